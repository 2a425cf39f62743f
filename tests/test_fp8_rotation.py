"""The Hadamard rotation of q and k before FP8 quantisation (attngen/api/hadamard.py, `attngen.quantize_fp8_qkv`): the
transform against an explicit Sylvester matrix, the scores it keeps, and the FP8 kernel's error with outlier
channels, rotated and not, against float64 of the unquantised inputs (Triton's interpreter on a CPU)."""

import math

import pytest
import torch

import attngen
from attngen.api.hadamard import hadamard, hadamard_block
from attngen.errors import KernelInputError
from attngen.lang.spec import Mask
from attngen.testing import reference
from conftest import DEVICE

E4M3_REL, BF16_REL = 2.0 ** -4, 2.0 ** -9


def sylvester(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix (entries +-1) in float64, built by its recursion."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("d", [64, 128, 96, 80])
def test_the_transform_is_sylvesters_orthonormal_matrix(d):
    block = hadamard_block(d)
    assert block == {64: 64, 128: 128, 96: 32, 80: 16}[d]
    expected = torch.block_diag(*[sylvester(block) / math.sqrt(block)] * (d // block))
    h = hadamard(torch.eye(d))  # the rows of I H are H's
    assert h.dtype == torch.float32
    assert torch.allclose(h.double(), expected, rtol=0, atol=1e-7)
    assert torch.allclose(h @ h.T, torch.eye(d), rtol=0, atol=2e-7)
    x = torch.randn(3, 2, 5, d, dtype=torch.bfloat16)
    assert torch.allclose(hadamard(x).double(), x.double() @ expected, rtol=0, atol=1e-5)


def test_rotation_keeps_the_scores_and_spreads_an_outlier():
    q, k = torch.randn(2, 3, 7, 128, dtype=torch.float64), torch.randn(2, 3, 9, 128, dtype=torch.float64)
    rq, rk = hadamard(q), hadamard(k)
    assert rq.dtype == torch.float64
    assert torch.allclose(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=0, atol=1e-12)
    spike = torch.zeros(1, 128)
    spike[0, 5] = 20.0
    assert torch.allclose(hadamard(spike).abs(), torch.full((1, 128), 20.0 / math.sqrt(128)))


def test_quantize_qkv_is_quantize_fp8_of_each_unless_rotated():
    q, k, v = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 11, 64), torch.randn(2, 2, 11, 64)
    q8, k8, v8, descales = attngen.quantize_fp8_qkv(q, k, v, per="head")
    for x8, d, (e8, ed) in ((q8, descales["q_descale"], attngen.quantize_fp8(q, "head", 2)),
                            (k8, descales["k_descale"], attngen.quantize_fp8(k, "head")),
                            (v8, descales["v_descale"], attngen.quantize_fp8(v, "head"))):
        assert torch.equal(x8.float(), e8.float()) and torch.equal(d, ed)
    q[..., :3] *= 20
    k[..., :3] *= 20
    r8, rk8, rv8, rotated = attngen.quantize_fp8_qkv(q, k, v, per="tensor", rotate=True)
    assert torch.equal(rv8.float(), attngen.quantize_fp8(v)[0].float())  # v is not rotated
    for x8, d, x in ((r8, rotated["q_descale"], q), (rk8, rotated["k_descale"], k)):
        back = x8.float() * d
        assert (back - hadamard(x)).abs().max() <= E4M3_REL * hadamard(x).abs().max()
        # the outlier channels' energy is spread: the largest magnitude, hence the descale, falls
        assert d.item() < attngen.quantize_fp8(x)[1].item() / 2


def test_bad_inputs_name_the_argument():
    q, k, v = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    with pytest.raises(KernelInputError, match="q and k must have the same head_dim; got 64 and 128"):
        attngen.quantize_fp8_qkv(q, torch.randn(1, 2, 8, 128), v, rotate=True)
    with pytest.raises(KernelInputError, match="q must be a float16, bfloat16 or float32 tensor; got torch.int64"):
        attngen.quantize_fp8_qkv(q.long(), k, v, rotate=True)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, not list"):
        attngen.quantize_fp8_qkv(q, [1.0], v)
    with pytest.raises(KernelInputError, match="v must be \\(batch, heads, seq, head_dim\\)"):
        attngen.quantize_fp8_qkv(q, k, v[0])
    with pytest.raises(KernelInputError, match="k's 3 heads do not divide q's 4"):
        attngen.quantize_fp8_qkv(q, torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64))
    with pytest.raises(KernelInputError, match="per must be"):
        attngen.quantize_fp8_qkv(q, k, v, per="row")
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        hadamard(torch.ones(2, 64, dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True])
def test_rotation_cuts_the_fp8_error_with_outlier_channels(causal):
    """Three q and k channels 20x the rest: unrotated, a score's rounding error is 2^-4 of a few terms ~400x the
    others, and the softmax moves (about 0.2 relative error at this size, 0.4 at N=4096); rotated, the error is 1.8-5x lower
    (measured over 250 fresh draws at this size, causal and not; 4x at N=4096 in a float64 emulation). Held to 1.5x, and the
    rotated kernel to e4m3's norm bound against float64 of the inputs it was given."""
    gen = torch.Generator(device=DEVICE)
    gen.seed()
    q, k, v = (torch.randn(2, h, n, 64, generator=gen, device=DEVICE) for h, n in ((4, 64), (2, 130), (2, 130)))
    q[..., :3] *= 20
    k[..., :3] *= 20
    mask = Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE
    exact, _ = reference.attention(q, k, v, mask)
    rel = lambda out, ref: ((out.double() - ref).norm() / ref.norm()).item()
    errors = {}
    for rotate in (False, True):
        q8, k8, v8, descales = attngen.quantize_fp8_qkv(q, k, v, per="head", rotate=rotate)
        out = attngen.attention(q8, k8, v8, is_causal=causal, enable_gqa=True, **descales)
        errors[rotate] = rel(out, exact)
    assert errors[True] * 1.5 < errors[False], errors
    dequantised = [x.double() * d.double().repeat_interleave(x.shape[1] // d.shape[1], 1)[:, :, None, None]
                   for x, d in ((q8, descales["q_descale"]), (k8, descales["k_descale"]), (v8, descales["v_descale"]))]
    given, _ = reference.attention(*dequantised, mask)
    assert rel(out, given) <= E4M3_REL + 2 * BF16_REL


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_rotation_at_real_sizes(causal):
    """d=128, N=4096, GQA 16/4, outlier channels: the rotated FP8 kernel's error against float64 of the unquantised
    inputs at least 2x below the unrotated one's (a float64 emulation of the kernel's rounding gives 0.10 against
    0.40 here), printed beside bf16's."""
    gen = torch.Generator(device="cuda")
    gen.seed()
    q, k, v = (torch.randn(1, h, 4096, 128, generator=gen, device="cuda") for h in (16, 4, 4))
    q[..., :3] *= 20
    k[..., :3] *= 20
    exact, _ = reference.attention(q, k, v, Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE)
    rel = lambda out: ((out.double() - exact).norm() / exact.norm()).item()
    errors = {}
    for rotate in (False, True):
        q8, k8, v8, descales = attngen.quantize_fp8_qkv(q, k, v, per="head", rotate=rotate)
        errors[rotate] = rel(attngen.attention(q8, k8, v8, is_causal=causal, enable_gqa=True, **descales))
    bf16 = rel(attngen.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=causal, enable_gqa=True))
    print(f"causal={causal}: fp8 {errors[False]:.3e}, rotated {errors[True]:.3e}, bf16 {bf16:.3e}")
    assert errors[True] * 2 < errors[False], errors
