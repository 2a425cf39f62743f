"""exp2 on the FMA pipe (codegen/exp2_fma.py), the FP8 Gluon forward's emulated exponential, against float64.

Over the softmax's range (x <= 0, past the float32 normals' end at -126, -inf for a masked key): a pure-torch
reference of the same formula (float32 steps, each FMA rounded once as the GPU's is) and the emitted helper itself,
in Triton's spelling run by the interpreter (the Gluon kernel takes the same text in Gluon's: `helper("gl")`;
Triton 3.6's interpreter does not run Gluon kernels).
"""

import importlib.util

import pytest
import torch
import triton

from attngen.codegen import exp2_fma

BOUND = 7.5e-5  # the polynomial's minimax relative error on [-0.5, 0.5], 2^-13.7


def reference(x: torch.Tensor) -> torch.Tensor:
    """exp2_fma's formula in torch on a float32 tensor: the rounding add, the polynomial by FMAs (float64 products
    rounded once to float32), round(x) added into the exponent bits, 0 below SMALLEST."""
    def fma(a, b, c):
        return (a.double() * b + c).float()

    c0, c1, c2, c3 = exp2_fma.COEFFS
    x = torch.clamp_min(x.float(), exp2_fma.LOWEST)
    t = x + exp2_fma.ROUNDER
    f = x - (t - exp2_fma.ROUNDER)
    p = fma(fma(fma(f, c3, c2), f, c1), f, c0)
    bits = p.view(torch.int32) + (t.view(torch.int32) << 23)
    return torch.where(x < exp2_fma.SMALLEST, 0.0, bits.view(torch.float32))


def _inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.cat([
        torch.linspace(-140.0, 0.0, 60001),                      # across the whole range, past the normals' end
        -torch.rand(20000, generator=gen) * 4,                   # where P is large
        torch.arange(-130, 1).float() + 0.5,                     # ties of the rounding
        torch.arange(-130, 1).float(),                            # integers: f = 0
        torch.tensor([-125.5, -125.50001, -125.49999, -126.0, -126.5, -127.0, -127.5, -1e4, -3e38, -1e-30, -0.0,
                      -float("inf")]),
    ]).float()


def _accuracy(y: torch.Tensor, x: torch.Tensor) -> None:
    exact = torch.exp2(x.double())
    assert not torch.isnan(y).any()
    normal = x >= exp2_fma.SMALLEST
    rel = ((y.double() - exact).abs() / exact)[normal]
    assert rel.max().item() <= BOUND, rel.max().item()
    assert (y[~normal] == 0).all()  # underflow is exactly 0, -inf included (a masked key's P)
    assert (x[~normal] < -125.5).all() and (x < -126).sum() > 0  # (the cases reach past the normals)
    assert (y[~normal].double() - exact[~normal]).abs().max().item() < 2.0 ** -125.5


def test_the_polynomial_is_minimax_within_its_bound():
    """The stated bound is the coefficients' own (they are float32 values, as the kernel takes them)."""
    f = torch.linspace(-0.5, 0.5, 200001, dtype=torch.float64)
    c0, c1, c2, c3 = exp2_fma.COEFFS
    rel = ((((c3 * f + c2) * f + c1) * f + c0) / torch.exp2(f) - 1).abs()
    assert 7.0e-5 < rel.max().item() <= BOUND
    assert all(float(torch.tensor(c, dtype=torch.float32)) == c for c in exp2_fma.COEFFS)  # as the kernel takes them


def test_the_reference_formula_against_float64():
    x = _inputs()
    _accuracy(reference(x), x)


@pytest.fixture
def emitted(tmp_path):
    """The emitted helper (Triton's spelling), with a kernel applying it to a vector."""
    path = tmp_path / "exp2_fma_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n" + exp2_fma.helper("tl") + '''


@triton.jit
def apply(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, _exp2_fma(tl.load(X + i, mask=i < N)), mask=i < N)
''')
    spec = importlib.util.spec_from_file_location("exp2_fma_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_emitted_helper_is_the_formula(emitted):
    x = _inputs()
    y = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    emitted.apply[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    _accuracy(y, x)
    # the interpreter rounds an FMA twice, the reference once: a few units in the last place apart at most
    torch.testing.assert_close(y, reference(x), rtol=2.0 ** -21, atol=0)


def test_the_gluon_and_triton_spellings_are_one_text():
    gl, tl = exp2_fma.helper("gl"), exp2_fma.helper("tl")
    assert gl.replace("gl.", "tl.") == tl and "gl.fma(" in gl and "tl." not in gl
