"""The backward: gradients against float64 autograd, autograd plumbing, determinism, torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import attngen
from attngen import KernelInputError
from attngen.testing.accuracy import Case, compare_grads, validate
from conftest import DEVICE, empty_plans, spec_text


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
def test_tma_descriptor_loads_match_pointer_loads_and_float64(head_dim, monkeypatch):
    """16-bit dK/dV without a mask reads Q and dO through TMA descriptors (passes/tma.py; the
    interpreter emulates them): two full query blocks and a tail whose rows past the end read as
    zeros, GQA, seq_q != seq_k; the same numbers with pointers; an input TMA cannot read (a row
    stride that is not a multiple of 16 bytes) falls back to pointers. (The group split is held off:
    its float32 parts summed after round differently from the unsplit kernel launched here.)"""
    d = head_dim
    kernel = train_spec(f"tma_d{d}", d, "bf16", "none", heads=4, kv_heads=2)
    module, scale = kernel.module, kernel.spec.softmax_scale
    monkeypatch.setitem(module.TRITON_BWD_SHAPE, "max_group_split", 1)
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


def _training_step(q, k, v, do, causal, compiled=None):
    """attngen.attention's output and (dq, dk, dv) through autograd, eagerly or through `compiled`."""
    out = (compiled or attngen.attention)(q, k, v, is_causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _check_step(results, q, k, v, do, causal, scale=None):
    """A training step's output and gradients against float64 (the gradients by attngen's validation
    rule); 3-D inputs are taken as batch 1."""
    from attngen.api.sdpa import _DTYPES
    from attngen.lang.builtin import sdpa_spec
    from attngen.testing.reference import attention as reference

    if q.dim() == 3:
        q, k, v, do, *results = (t.unsqueeze(0) for t in (q, k, v, do, *results))
    spec = sdpa_spec(_DTYPES[q.dtype], q.shape[-1], causal)
    scale = spec.softmax_scale if scale is None else scale
    ref, _ = reference(q.detach(), k.detach(), v.detach(), spec.mask, scale)
    out = results[0]
    assert not torch.isnan(out).any()
    assert (out.double() - ref).norm() / ref.norm() < 1e-2
    for grad in compare_grads(spec, q.detach(), k.detach(), v.detach(), do, results[1:], scale):
        assert grad.ok, grad


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal, n", [(64, False, 2048), (128, True, 2048), (128, False, 333)])
def test_gpu_training_step_captured_in_a_cuda_graph(head_dim, causal, n):
    """attngen.attention's forward and backward read nothing back from the GPU, so a training step (the
    forward, then autograd's backward) can be captured in a CUDA graph after warm-up calls on a side stream
    (torch's recipe for whole-network capture) and replayed on new data written in place into the same
    tensors. N=2048 with 16 heads runs the Gluon forward and backward on Hopper; 333 the Triton kernels."""
    gen = torch.Generator("cuda").manual_seed(head_dim + n)

    def fresh(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    q, k, v = (fresh(1, 16, n, head_dim).requires_grad_() for _ in range(3))
    do = fresh(1, 16, n, head_dim)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # checks, then a plan: the capture sees the steady state
            _training_step(q, k, v, do, causal)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _training_step(q, k, v, do, causal)
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, do):
                t.copy_(fresh(*t.shape))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_step(captured, q, k, v, do, causal)
        assert torch.equal(captured[0], attngen.attention(q.detach(), k.detach(), v.detach(), is_causal=causal))


@pytest.mark.gpu
def test_gpu_inference_calls_captured_in_a_cuda_graph_after_their_replay_is_recorded():
    """Without autograd a signature's third call replays the launches recorded from its second
    (attngen/runtime/replay.py): capturing such a call captures the replay, which must follow new data too."""
    gen = torch.Generator("cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 16, 1024, 64, device="cuda", generator=gen).bfloat16() for _ in range(3))
    for _ in range(3):
        attngen.attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.attention(q, k, v, is_causal=True)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        assert (out.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead_trains_in_cuda_graphs():
    """torch.compile(mode="reduce-overhead") runs a block around attngen.attention, forward and backward,
    in CUDA graphs (inductor skips graphs with ops it cannot capture, and counts those skips), and its
    output and gradients follow new data, against float64."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def block(q, k, v, is_causal):
        return attngen.attention(q * 1.0, k, v, is_causal=is_causal)

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator("cuda").manual_seed(8)
    for step in range(4):
        q, k, v, do = (torch.randn(2, 16, 512, 128, device="cuda", generator=gen).bfloat16() for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        results = _training_step(q, k, v, do, True, compiled)
        if step >= 2:  # cudagraph trees record on the second run and replay from the third
            _check_step(results, q, k, v, do, True)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def backward_with(out, layout: str):
    """Run out's backward with an output gradient laid out `layout` (contiguous; expanded: from out.sum();
    transposed: the last two dimensions swapped in memory) of fresh float32 values; returns that gradient."""
    if layout == "expanded":
        out.sum().backward()
        return torch.ones((), device=out.device).expand(out.shape)
    do = rand(*out.shape, dtype=torch.float32)
    if layout == "transposed":
        do = do.transpose(-1, -2).contiguous().transpose(-1, -2)
    out.backward(do)
    return do


@pytest.mark.parametrize("three_d", [False, True])
def test_planned_training_calls_match_float64_for_each_output_gradient_layout(three_d, monkeypatch):
    """A repeated attngen.attention signature with autograd takes the planned path (autograd._Planned: no
    checks, the launches of its second call replayed where FastJIT runs; here, interpreted, the kernels
    run each time): every call, on fresh inputs, has float64's gradients, for output gradients laid out
    contiguously, expanded (from out.sum()) and transposed, for any subset of q, k, v requiring grad, and
    3-D inputs too."""
    from attngen.testing.reference import attention_grads
    from attngen.lang.spec import Mask

    kept = empty_plans(monkeypatch)
    lead = () if three_d else (1,)
    every, k_only, q_v = (True, True, True), (False, True, False), (True, False, True)
    calls = [(every, "contiguous"), (every, "expanded"), (every, "transposed"), (k_only, "contiguous"),
             (k_only, "expanded"), (q_v, "transposed"), (q_v, "contiguous"), (every, "expanded")]
    for call, (want, layout) in enumerate(calls):
        q = rand(*lead, 4, 19, 32, dtype=torch.float32)
        k, v = (rand(*lead, 2, 27, 32, dtype=torch.float32) for _ in range(2))
        leaves = [t.clone().requires_grad_(w) for t, w in zip((q, k, v), want)]
        out = attngen.attention(*leaves, is_causal=True, enable_gqa=True)
        do = backward_with(out, layout)
        ref_out = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True, enable_gqa=True)
        assert (out.double() - ref_out).norm() / ref_out.norm() < 1e-5
        refs = attention_grads(*(t.unsqueeze(0) if three_d else t for t in (q, k, v, do)),
                               Mask.CAUSAL_TOP_LEFT, 32 ** -0.5)
        for leaf, w, ref in zip(leaves, want, refs):
            if not w:
                assert leaf.grad is None
                continue
            ref = ref.squeeze(0) if three_d else ref
            assert leaf.grad.shape == leaf.shape and (leaf.grad.double() - ref).norm() / ref.norm() < 1e-5, call
    # one plan per requires_grad pattern (each called twice or more), each of whose planned calls ran _Planned
    # (its forward recorded, or refused as interpreted: not None; each output-gradient layout it saw noted)
    plans = kept.plans("sdpa")
    assert len(plans) == 3 and all(p.training.forward is not None and p.training.backward for p in plans)


@pytest.mark.parametrize("return_lse", [False, True])
def test_planned_kernel_calls_match_float64_with_and_without_autograd(return_lse, monkeypatch):
    """`Kernel.__call__` (a user's own spec) plans its checked calls per signature as `attngen.attention` does
    (in `PLANS`: a repeated signature skips the checks and replays the launches of its second call where
    FastJIT runs; here, interpreted, the kernels run each time): repeated inference calls (into a new tensor, or
    into a NaN-poisoned `out=`) and autograd calls (output gradients contiguous, expanded and transposed, any
    subset of q, k, v requiring grad), each on fresh inputs, have float64's outputs, log-sum-exps (not
    differentiable) and gradients."""
    from attngen.testing.reference import attention as reference
    from attngen.testing.reference import attention_grads
    from attngen.lang.spec import Mask

    kernel = train_spec("planned_call", 32, "fp32", "causal(bottom_right)", heads=4, kv_heads=2)
    kept = empty_plans(monkeypatch)
    none, every, k_only, q_v = (False,) * 3, (True,) * 3, (False, True, False), (True, False, True)
    calls = [(none, None)] * 3 + [(none, "out=")] * 3 + [
        (every, "contiguous"), (every, "expanded"), (every, "transposed"), (k_only, "contiguous"), (k_only, "expanded"),
        (q_v, "transposed"), (q_v, "contiguous"), (every, "expanded")]
    for call, (want, layout) in enumerate(calls):
        q = rand(1, 4, 19, 32, dtype=torch.float32)
        k, v = (rand(1, 2, 27, 32, dtype=torch.float32) for _ in range(2))
        leaves = [t.clone().requires_grad_(w) for t, w in zip((q, k, v), want)]
        given = torch.full_like(q, float("nan")) if layout == "out=" else None
        got = kernel(*leaves, scale=0.2, return_lse=return_lse, out=given)
        out, lse = got if return_lse else (got, None)
        assert given is None or out is given
        ref_out, ref_lse = reference(q, k, v, Mask.CAUSAL_BOTTOM_RIGHT, 0.2)
        assert out.requires_grad == any(want) and (out.double() - ref_out).norm() / ref_out.norm() < 1e-5, call
        if return_lse:
            assert lse.shape == (1, 4, 19) and not lse.requires_grad
            assert (lse.double() - ref_lse).abs().max().item() < 1e-5, call
        if not any(want):
            continue
        do = backward_with(out, layout)
        refs = attention_grads(q, k, v, do, Mask.CAUSAL_BOTTOM_RIGHT, 0.2)
        for leaf, w, ref in zip(leaves, want, refs):
            if not w:
                assert leaf.grad is None
                continue
            assert leaf.grad.shape == leaf.shape and (leaf.grad.double() - ref).norm() / ref.norm() < 1e-5, call
    # one plan per requires_grad pattern and for out=; the inference ones ran replayed_forward, the others
    # _Planned (its forward recorded, or refused as interpreted: not None; each output-gradient layout noted)
    plans = kept.plans(kernel)
    assert len(plans) == 5 and all(p.inference.forward is not None for p in plans[:2])
    assert all(p.training.forward is not None and p.training.backward for p in plans[2:])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d128 gqa n_q != n_k", "d64 long"])
def test_gpu_replayed_kernel_calls_compute_what_the_kernel_computes(case, monkeypatch):
    """On the GPU, a user's spec called repeatedly (`Kernel.__call__`, with the log-sum-exp) replays from a
    signature's third call: four inference calls, four training calls, then four inference calls into a
    NaN-poisoned `out=`, each on fresh inputs at new addresses, match float64 (output, log-sum-exp, gradients),
    and the output, log-sum-exp, dK and dV are bit for bit the unplanned path's (dQ adds its parts in any
    order on the Gluon backward: held to float64 only). "d64 long" takes the Gluon forward and backward on
    sm_90."""
    from attngen.runtime import replay
    from attngen.testing.accuracy import compare

    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    if "gqa" in case:
        kernel = train_spec("replayed_gqa", 128, "bf16", "causal(bottom_right)", heads=8, kv_heads=2)
        shapes = ((2, 8, 100, 128), (2, 2, 300, 128))
    else:
        kernel = train_spec("replayed_long", 64, "bf16", "causal(bottom_right)", heads=16)
        shapes = ((2, 16, 2048, 64), (2, 16, 2048, 64))
    empty_plans(monkeypatch)
    size = Case(shapes[0][0], shapes[0][1], shapes[1][1], shapes[0][2], shapes[1][2])
    gen = torch.Generator("cuda").manual_seed(len(case))
    for i in range(12):
        training = 4 <= i < 8
        q, k, v, do = (torch.randn(*shapes[j], device="cuda", generator=gen).to(torch.bfloat16) for j in (0, 1, 1, 0))
        q, k, v = (t.requires_grad_(training) for t in (q, k, v))

        def call():
            given = torch.full_like(q, float("nan")) if i >= 8 else None
            out, lse = kernel(q, k, v, scale=0.1, return_lse=True, out=given)
            assert given is None or out is given
            return (out, lse, *torch.autograd.grad(out, (q, k, v), do)) if training else (out, lse)

        got = call()
        assert compare(kernel.spec, size, got[0], got[1], q.detach(), k.detach(), v.detach(), 0.1).ok, i
        if training:
            for grad in compare_grads(kernel.spec, q.detach(), k.detach(), v.detach(), do, got[2:], 0.1):
                assert grad.ok, (i, grad)
        with monkeypatch.context() as m:  # the unplanned path: a fresh plan table, the signature's first call
            empty_plans(m)
            want = call()
        assert all(torch.equal(a, b) for a, b in zip(got[:2] + got[3:], want[:2] + want[3:])), i
    # inference calls 3 and 4; training: the forward at calls 7 and 8, the backward at 8 (6 ran it as it is,
    # 7 recorded it); out=: calls 11 and 12
    assert replayed == [True] * 7


def test_planned_kernel_calls_still_refuse_gradients_of_a_forward_only_spec(monkeypatch):
    """Grad mode is not in a plan's signature: a forward-only kernel planned under torch.no_grad() on tensors
    that require grad still refuses them when grad mode is on."""
    kernel = attngen.load(spec_text("planned_forward_only", 32, "fp32", "causal", heads=2))
    kept = empty_plans(monkeypatch)
    q, k, v = (rand(1, 2, 9, 32, dtype=torch.float32, grad=True) for _ in range(3))
    with torch.no_grad():
        for _ in range(2):
            kernel(q, k, v)
    assert len(kept.plans(kernel)) == 1
    with pytest.raises(KernelInputError, match="requires grad, but kernel 'planned_forward_only' is forward-only"):
        kernel(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d64 causal 3-D", "d128 gqa n_q != n_k", "d64 long", "d128 long causal"])
def test_gpu_replayed_training_calls_compute_what_the_kernels_compute(case, monkeypatch):
    """On the GPU, a training call whose signature repeats replays, from its third call on, the forward's and
    the backward's launches of its second (autograd._Planned): each call, on fresh inputs at new addresses,
    matches float64, and its output, dK and dV are bit for bit those of the unplanned path (dQ adds its
    parts in any order on the Gluon backward: it is held to float64 only). The long cases take the Gluon
    forward and backward on sm_90."""
    from attngen.runtime import replay

    empty_plans(monkeypatch)
    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    causal, scale, dtype = "causal" in case, None, torch.bfloat16
    if "3-D" in case:
        shapes, kw, dtype = ((16, 130, 64), (16, 77, 64)), {}, torch.float16
    elif "gqa" in case:
        shapes, kw, scale = ((2, 8, 100, 128), (2, 2, 300, 128)), {"enable_gqa": True, "scale": 0.1}, 0.1
    else:
        n, d = 2048, int(case[1:4].strip())
        shapes, kw = ((2, 2048 // d, n, d), (2, 2048 // d, n, d)), {}
    gen = torch.Generator("cuda").manual_seed(len(case))
    for i in range(10):  # calls 5-7: a transposed output gradient (heads and rows swapped); 8-10: an expanded one
        q, k, v, do = (torch.randn(*shapes[j], device="cuda", generator=gen).to(dtype) for j in (0, 1, 1, 0))
        if 4 <= i < 7:
            do = do.transpose(-3, -2).contiguous().transpose(-3, -2)
        elif i >= 7:  # (a loss of out.sum(): TMA cannot read it, so the Triton kernels run, on pointers)
            do = torch.ones((), device="cuda", dtype=dtype).expand(do.shape)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attngen.attention(q, k, v, is_causal=causal, **kw)
        got = (out, *torch.autograd.grad(out, (q, k, v), do))
        _check_step(got, q, k, v, do, causal, scale)
        with monkeypatch.context() as m:  # the unplanned path: a fresh plan table, the signature's first call
            empty_plans(m)
            out = attngen.attention(q, k, v, is_causal=causal, **kw)
            want = (out, *torch.autograd.grad(out, (q, k, v), do))
        assert all(torch.equal(a, b) for a, b in zip(got[::2], want[::2])), i  # out and dk
        assert torch.equal(got[3], want[3]), i  # dv
    # the forward from call 3 on; the backward from a layout's third planned call on (the first runs as it is,
    # the second records): calls 4, 7 and 10
    assert replayed == [True] * 11


def test_planned_backward_records_once_per_output_gradient_layout_and_determinism(monkeypatch):
    """The planned path records a signature's forward once and its backward once per (layout of the output
    gradient, deterministic-algorithms setting), at its second planned call (the first may compile, or
    launch binaries FastJIT has not kept): the generated backward picks its kernels by that setting
    (the Gluon dQ adds in any order), so a replay recorded under one must not run under the other. (A stand-in
    replay that declines, so the kernels run and the gradients can be checked.)"""
    from attngen.runtime import autograd

    empty_plans(monkeypatch)
    recorded = []

    def declines(inputs):
        return False

    def record(fn, inputs):
        recorded.append(len(inputs))  # 5: the forward's (q, k, v, out, lse); 9: the backward's
        return fn(), declines

    monkeypatch.setattr(autograd, "record", record)
    deterministic = torch.are_deterministic_algorithms_enabled()
    for call, (strict, expanded) in enumerate([(False, False)] * 3 + [(True, False)] * 2 + [(False, True)] * 2
                                              + [(True, True)] * 2):
        q, k, v = (rand(1, 2, 21, 32, dtype=torch.float32, grad=True) for _ in range(3))
        do = torch.ones((), device=DEVICE).expand(q.shape) if expanded else rand(*q.shape, dtype=torch.float32)
        torch.use_deterministic_algorithms(strict)
        try:
            attngen.attention(q, k, v, is_causal=True).backward(do)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do.double())
        for got, ref in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
            assert (got.double() - ref).norm() / ref.norm() < 1e-5, call
    # call 2 records the forward, 3 the backward; 5 the strict backward; 7 and 9 the expanded ones
    assert recorded == [5, 9, 9, 9, 9]
