"""Kernels against the float64 reference: fresh random inputs, odd sizes, outputs poisoned first.

In the interpreter (no GPU) at small shapes; with a GPU, the `gpu` tests run N=4096.
"""

import pytest
import torch

import attngen
from attngen.testing.accuracy import Case, compare, validate
from conftest import DEVICE, shipped_specs, spec_text


def run(kernel, q, k, v, **kw):
    out = torch.full_like(q, float("nan"))
    out, lse = kernel(q, k, v, out=out, return_lse=True, **kw)
    return out, lse


def rand(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
def test_masks_and_dtypes_at_odd_sizes(dtype, mask):
    kernel = attngen.load(spec_text(f"k_{dtype}_{mask[:6]}{len(mask)}", 32, dtype, mask))
    cases = [Case(2, 3, 3, 37, 53), Case(1, 2, 2, 53, 37), Case(1, 1, 1, 1, 19), Case(1, 2, 2, 19, 1)]
    for result in validate(kernel, cases, device=DEVICE):
        assert result.ok, result


@pytest.mark.parametrize("head_dim", [16, 48, 80, 96, 192])
def test_head_dims_including_non_powers_of_two(head_dim):
    kernel = attngen.load(spec_text(f"k_d{head_dim}", head_dim, "fp16", "causal"))
    for result in validate(kernel, [Case(1, 2, 2, 45, 70)], device=DEVICE):
        assert result.ok, result


def test_gqa_matches_repeated_heads():
    kernel = attngen.load(spec_text("gqa", 64, "fp16", "causal(bottom_right)", heads=8, kv_heads=2))
    for result in validate(kernel, [Case(2, 8, 2, 33, 90)], device=DEVICE):
        assert result.ok, result


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=32), dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=128, BLOCK_N=64)])
def test_block_sizes_do_not_change_the_result(config):
    kernel = attngen.load(spec_text("blocks", 64, "fp16", "causal"))
    q, k, v = rand(1, 2, 70, 64), rand(1, 2, 70, 64), rand(1, 2, 70, 64)
    out, lse = run(kernel, q, k, v, config=config)
    result = compare(kernel.spec, Case(1, 2, 2, 70, 70), out, lse, q, k, v)
    assert result.ok, result


def test_non_contiguous_inputs():
    kernel = attngen.load(spec_text("strided", 64, "fp16", "causal"))
    # (B, N, H, D) storage viewed as (B, H, N, D); k and v sliced from one fused buffer.
    q = rand(2, 41, 3, 64).transpose(1, 2)
    kv = rand(2, 2, 3, 57, 64)
    k, v = kv[0], kv[1]
    k = k[:, :, :, :]
    assert not q.is_contiguous()
    out, lse = run(kernel, q, k, v)
    result = compare(kernel.spec, Case(2, 3, 3, 41, 57), out, lse, q.contiguous(), k, v)
    assert result.ok, result
    # A head-dim stride other than 1.
    q2 = rand(1, 2, 20, 128)[..., ::2]
    out2, lse2 = run(kernel, q2, rand(1, 2, 30, 64), rand(1, 2, 30, 64))
    assert torch.isfinite(out2).all()


def test_custom_scale_and_spec_scale():
    spec_scaled = attngen.load(spec_text("scaled", 32, "fp32", "none", scale=0.3))
    q, k, v = rand(1, 1, 9, 32, dtype=torch.float32), rand(1, 1, 11, 32, dtype=torch.float32), rand(1, 1, 11, 32, dtype=torch.float32)
    out, lse = run(spec_scaled, q, k, v)
    assert compare(spec_scaled.spec, Case(1, 1, 1, 9, 11), out, lse, q, k, v, scale=0.3).ok
    out, lse = run(spec_scaled, q, k, v, scale=1.7)
    assert compare(spec_scaled.spec, Case(1, 1, 1, 9, 11), out, lse, q, k, v, scale=1.7).ok


def test_empty_key_sequence_gives_zeros_and_minus_inf():
    kernel = attngen.load(spec_text("nokeys", 32, "fp16"))
    q = rand(1, 2, 5, 32)
    out, lse = run(kernel, q, rand(1, 2, 0, 32), rand(1, 2, 0, 32))
    assert (out == 0).all() and torch.isneginf(lse).all()
    out, lse = kernel(rand(1, 2, 0, 32), rand(1, 2, 4, 32), rand(1, 2, 4, 32), return_lse=True)
    assert out.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0)


def test_checker_catches_a_wrong_kernel():
    """The tolerance rule must fail an output that is off by a dropped key block or a tiny shift."""
    kernel = attngen.load(spec_text("mut", 64, "bf16", "none"))
    q, k, v = rand(1, 2, 40, 64, dtype=torch.bfloat16), rand(1, 2, 80, 64, dtype=torch.bfloat16), rand(1, 2, 80, 64, dtype=torch.bfloat16)
    out, lse = run(kernel, q, k, v)
    case = Case(1, 2, 2, 40, 80)
    assert compare(kernel.spec, case, out, lse, q, k, v).ok
    dropped, dropped_lse = kernel(q, k[:, :, :64], v[:, :, :64], return_lse=True)  # one 16-key block short
    assert not compare(kernel.spec, case, dropped, dropped_lse, q, k, v).ok
    assert not compare(kernel.spec, case, out * 1.02, lse, q, k, v).ok
    unwritten = out.clone()
    unwritten[0, 1, 7] = float("nan")
    assert not compare(kernel.spec, case, unwritten, lse, q, k, v).ok


@pytest.mark.parametrize("path", shipped_specs())
def test_shipped_specs_validate(path):
    kernel = attngen.load(path)
    heads = kernel.spec.heads or 2
    kv = kernel.spec.kv_heads or heads
    for result in validate(kernel, [Case(1, heads, kv, 65, 130)], device=DEVICE):
        assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gpu_real_sizes(dtype, head_dim, mask):
    kernel = attngen.load(spec_text(f"gpu_{dtype}_{head_dim}_{mask}", head_dim, dtype, mask))
    for result in validate(kernel, [Case(2, 8, 8, 4096, 4096), Case(1, 4, 4, 4093, 4099)], device="cuda"):
        assert result.ok, result


def test_the_backward_formula_floor_is_flash_attentions_change_exactly():
    """accuracy._delta_floor: the float64 gradients of FlashAttention's backward formula with delta = dO . O taken from
    the output rounded to bf16 (written out by hand here, sinks as one more logit per row) are the float64
    reference's plus the floor; on ordinary rows the floor is far below the gradient tolerance (it loosens nothing),
    and beside a sink with a single key it is what a kernel of that design cannot avoid."""
    from attngen.lang.spec import parse
    from attngen.testing import accuracy

    spec = parse(spec_text("floor_sinks", 64, "bf16", "none", sinks="true"))
    g = torch.Generator().manual_seed(5)
    for n_q, n_k in ((37, 23), (1, 1)):
        q, k, v, do = (torch.randn(2, 3, n, 64, generator=g).bfloat16() for n in (n_q, n_k, n_k, n_q))
        sinks = torch.randn(3, generator=g) * 2
        scale = spec.softmax_scale
        refs = accuracy._variant_grads(spec, q, k, v, do, scale, {"sinks": sinks}, torch.float64)
        floor = accuracy._delta_floor(spec, q, k, v, do, scale, {"sinks": sinks})
        q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
        s = torch.cat([q64 @ k64.transpose(-1, -2) * scale, sinks.double()[None, :, None, None].expand(2, 3, n_q, 1)], -1)
        p = torch.softmax(s, -1)
        pk = p[..., :-1]
        out = pk @ v64
        delta = (do64 * out.bfloat16().double()).sum(-1, keepdim=True)
        ds = pk * (do64 @ v64.transpose(-1, -2) - delta)
        by_hand = (ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, pk.transpose(-1, -2) @ do64)
        for ref, fl, want in zip(refs, floor, by_hand):
            assert torch.allclose(ref + fl, want, atol=1e-10, rtol=1e-9)
        dq_floor = (floor[0].norm() / refs[0].norm()).item()
        if n_q > 1:
            assert dq_floor * accuracy.FUDGE < accuracy.GRAD_REL_TOL[spec.dtype] / 4
