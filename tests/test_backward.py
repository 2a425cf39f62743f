"""The backward: gradients against float64 autograd, autograd plumbing, determinism, torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import attngen
from attngen import KernelInputError
from attngen.check import Case, compare_grads, validate
from conftest import DEVICE, spec_text


def rand(*shape, dtype=torch.float16, grad=False):
    t = torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)
    return t.requires_grad_(grad)


def train_spec(name, head_dim=32, dtype="fp16", mask="causal", **extra):
    return attngen.load(spec_text(name, head_dim, dtype, mask, direction="forward+backward", **extra))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
def test_gradients_at_odd_sizes(dtype, mask):
    kernel = train_spec(f"g_{dtype}_{mask[:6]}{len(mask)}", 32, dtype, mask, heads=4, kv_heads=2)
    for result in validate(kernel, [Case(2, 4, 2, 37, 53), Case(1, 4, 2, 53, 37), Case(1, 4, 2, 1, 20)], device=DEVICE):
        assert result.ok and len(result.grads) == 3, result


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_gradients_for_head_dims(head_dim):
    kernel = train_spec(f"g_d{head_dim}", head_dim, "fp16", "causal")
    for result in validate(kernel, [Case(1, 2, 2, 45, 70)], device=DEVICE):
        assert result.ok, result


def test_fixed_tiles_at_a_tma_head_dim_load_and_match_float64():
    """A 16-bit forward+backward spec at d=64 without a mask and with its tiles written out: Triton TMA
    descriptors (pass tma) and no Gluon kernel (the warp-specialize passes leave fixed tiles alone). Such
    a module once failed to import (the template joined two functions on one line when it had no Gluon
    prelude)."""
    kernel = train_spec("fixed_tiles64", 64, "fp16", "none", heads=4, block_m=16, block_n=32)
    assert not hasattr(kernel.module, "attn_fwd_ws") and hasattr(kernel.module, "tma_readable")
    for result in validate(kernel, [Case(1, 4, 4, 37, 53)], device=DEVICE):
        assert result.ok and len(result.grads) == 3, result


def test_autograd_through_kernel_call_any_subset():
    kernel = train_spec("autograd_subset", 32, "fp32", "causal(bottom_right)", heads=4, kv_heads=2)
    q, k, v = rand(1, 4, 20, 32, dtype=torch.float32), rand(1, 2, 30, 32, dtype=torch.float32), rand(1, 2, 30, 32, dtype=torch.float32)
    do = rand(1, 4, 20, 32, dtype=torch.float32)
    full = None
    for wants in [(True, True, True), (False, True, False), (True, False, False), (False, False, True)]:
        leaves = [t.detach().clone().requires_grad_(w) for t, w in zip((q, k, v), wants)]
        kernel(*leaves).backward(do)
        grads = [t.grad for t in leaves]
        assert [g is not None for g in grads] == list(wants)
        if full is None:
            full = grads
            expected = compare_grads(kernel.spec, q, k, v, do, grads)
            assert all(r.ok for r in expected), expected
        else:
            for g, f in zip(grads, full):
                if g is not None:
                    assert torch.equal(g, f)


def test_autograd_backward_refuses_tensors_changed_in_place():
    """Autograd's backward checks only the output gradient (`Kernel.backward_saved`): q, k, v, out and lse
    are what the checked forward took and returned, so a change made in place since must raise, not
    give gradients of other values."""
    kernel = train_spec("autograd_inplace", 32, "fp32", "causal")
    leaf, k, v = (rand(1, 2, 9, 32, dtype=torch.float32, grad=True) for _ in range(3))
    q = leaf * 1.0  # not a leaf: changing it in place is allowed, and autograd counts it
    out = kernel(q, k, v)
    q.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.randn_like(out))
    out = kernel(q, k, v)
    out.mul_(2.0)  # the saved output itself
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.randn_like(out))
    out = kernel(q, k, v)  # untouched: gradients flow
    out.backward(torch.randn_like(out))
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0


def test_backward_is_deterministic():
    kernel = train_spec("determinism", 32, "fp16", "none", heads=4, kv_heads=1)
    q, k, v, do = rand(2, 4, 33, 32), rand(2, 1, 47, 32), rand(2, 1, 47, 32), rand(2, 4, 33, 32)
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    first = kernel.backward(q, k, v, out, lse, do)
    second = kernel.backward(q, k, v, out, lse, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_non_contiguous_inputs_and_grad_output():
    kernel = train_spec("strided_bwd", 64, "fp16", "causal")
    q = rand(2, 41, 3, 64).transpose(1, 2)
    kv = rand(2, 2, 3, 57, 64)
    k, v = kv[0], kv[1]
    do = rand(2, 41, 3, 64).transpose(1, 2)
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    grads = kernel.backward(q, k, v, out, lse, do)
    assert all(r.ok for r in compare_grads(kernel.spec, q.contiguous(), k, v, do.contiguous(), grads))


@pytest.mark.parametrize("head_dim", [128, 64])
def test_tma_descriptor_loads_match_pointer_loads_and_float64(head_dim):
    """16-bit dK/dV without a mask reads Q and dO through TMA descriptors (passes/tma.py; the
    interpreter emulates them): two full query blocks and a tail whose rows past the end read as
    zeros, GQA, seq_q != seq_k; the same numbers with pointers; an input TMA cannot read (a row
    stride that is not a multiple of 16 bytes) falls back to pointers."""
    d = head_dim
    kernel = train_spec(f"tma_d{d}", d, "bf16", "none", heads=4, kv_heads=2)
    module, scale = kernel.module, kernel.spec.softmax_scale
    q, k, v, do = rand(1, 4, 140, d, dtype=torch.bfloat16), rand(1, 2, 75, d, dtype=torch.bfloat16), \
        rand(1, 2, 75, d, dtype=torch.bfloat16), rand(1, 4, 140, d, dtype=torch.bfloat16)
    config = {"attn_bwd_dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)}
    out, lse = kernel.forward(q, k, v, scale)
    assert module.tma_readable(q, do)
    grads = kernel.backward(q, k, v, out, lse, do, scale, config=config)
    assert all(r.ok for r in compare_grads(kernel.spec, q, k, v, do, grads))
    delta = torch.empty_like(lse)
    module.launch_attn_bwd_dq(q=q, k=k, v=v, o=out, do=do, lse=lse, delta=delta, dq=torch.empty_like(q),
                              sm_scale=scale, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    module.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv, sm_scale=scale,
                                use_tma=False, **config["attn_bwd_dkdv"])
    assert torch.equal(dk, grads[1]) and torch.equal(dv, grads[2])
    wide = rand(1, 4, 140, d + 1, dtype=torch.bfloat16)
    q_odd = wide[..., :d].copy_(q)  # rows of 2 * (d + 1) bytes
    assert not module.tma_readable(q_odd, do)
    odd = kernel.backward(q_odd, k, v, out, lse, do, scale, config=config)
    assert all(torch.equal(a, b) for a, b in zip(odd, grads))


def test_forward_only_kernel_refuses_to_record_gradients():
    kernel = attngen.load(spec_text("fwd_only", 32, "fp16"))
    q = rand(1, 1, 8, 32, grad=True)
    with pytest.raises(KernelInputError, match="forward-only"):
        kernel(q, rand(1, 1, 8, 32), rand(1, 1, 8, 32))
    with torch.no_grad():
        assert kernel(q, rand(1, 1, 8, 32), rand(1, 1, 8, 32)).shape == q.shape


def test_empty_sequences_have_zero_gradients():
    kernel = train_spec("empty_bwd", 32, "fp32", "none")
    q, k, v = rand(1, 2, 5, 32, dtype=torch.float32, grad=True), rand(1, 2, 0, 32, dtype=torch.float32, grad=True), \
        rand(1, 2, 0, 32, dtype=torch.float32, grad=True)
    kernel(q, k, v).sum().backward()
    assert (q.grad == 0).all() and k.grad.shape == k.shape


def test_attention_drop_in_backward_matches_sdpa():
    q, k, v = (rand(1, 4, n, 32, grad=True) for n in (25, 40, 40))
    k, v = rand(1, 2, 40, 32, grad=True), rand(1, 2, 40, 32, grad=True)
    out = attngen.attention(q, k, v, is_causal=True, enable_gqa=True)
    do = rand(*out.shape)
    out.backward(do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(do.double())
    for got, ref in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert (got.double() - ref).norm() / ref.norm() < 5e-3


def test_torch_compile_with_backward_keeps_one_graph():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def loss(q, k, v):
        return (attngen.attention(q, k, v, is_causal=True) ** 2).sum()

    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    q, k, v = (rand(1, 2, 16, 32, grad=True) for _ in range(3))
    compiled(q, k, v).backward()
    assert counter.frame_count == 1 and q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gpu_gradients_at_4096(dtype, head_dim, mask):
    kernel = train_spec(f"gpu_bwd_{dtype}_{head_dim}_{mask}", head_dim, dtype, mask)
    for result in validate(kernel, [Case(1, 4, 4, 4096, 4096), Case(1, 2, 2, 4093, 4099)], device="cuda"):
        assert result.ok, result
