"""attngen in PyTorch's flash-attention slot (attngen/integrations/torch_flash.py): the registration's bookkeeping,
the op implementations on CPU tensors (through the dispatcher, registered for the CPU key) against float64, their
errors, and the schema comparison. The GPU tests activate the slot and run SDPA's flash backend and varlen_attn
against torch's own kernels and float64, counting the calls that reached attngen."""

import math

import pytest
import torch
import torch.nn.attention as attention_registry

import attngen
from attngen.errors import AttnGenError, KernelInputError
from attngen.integrations import torch_flash
from attngen.lang.spec import Mask, parse
from attngen.testing.reference import attention as reference, varlen_attention
from conftest import DEVICE

pytestmark = pytest.mark.skipif(not hasattr(attention_registry, "register_flash_attention_impl"),
                                reason="this torch has no flash-attention registry")


def has_varlen() -> bool:
    """Whether this branch's compiler generates varlen kernels (the `layout = varlen` spec entry)."""
    try:
        parse("kernel probe {\n layout = varlen\n head_dim = 16\n dtype = fp32\n}")
    except attngen.SpecError:
        return False
    return True


VARLEN = pytest.mark.skipif(not has_varlen(), reason="needs the varlen kernels (spec entry layout = varlen)")


@pytest.fixture
def cpu_ops():
    """attngen's implementations registered for the test device's key (the CPU's without a GPU, so that
    torch.ops.aten calls on CPU tensors reach them through the dispatcher); removed afterwards."""
    handle = torch_flash.activate("CUDA" if DEVICE == "cuda" else "CPU")
    try:
        yield
    finally:
        handle.remove()


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def test_import_registers_attngen_without_activating_it():
    assert "attngen" in attention_registry.list_flash_attention_impls()
    assert attention_registry.current_flash_attention_impl() != "attngen"


def test_a_torch_without_the_registry_is_skipped_silently(monkeypatch):
    monkeypatch.delattr(attention_registry, "register_flash_attention_impl")
    assert torch_flash.register() is False


def test_activate_and_restore_round_trip():
    name = "aten::_scaled_dot_product_flash_attention"
    before = torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    attention_registry.activate_flash_attention_impl("attngen")
    try:
        assert attention_registry.current_flash_attention_impl() == "attngen"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    finally:
        attention_registry.restore_flash_attention_impl()
    assert attention_registry.current_flash_attention_impl() is None
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") == before


@pytest.mark.parametrize("causal, n_k", [(False, 40), (True, 40), (False, 29)])
def test_sdpa_flash_op_forward_and_backward_against_float64(cpu_ops, causal, n_k):
    b, h, n, d = 2, 2, 40, 16
    q, do = rand(b, h, n, d), rand(b, h, n, d)
    k, v = rand(b, h, n_k, d), rand(b, h, n_k, d)
    before = dict(torch_flash.calls)
    out, lse, cum_q, cum_k, max_q, max_k, rng, philox, debug = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal)
    mask = Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, mask)
    assert out.shape == q.shape and out.stride() == q.stride()
    assert (out.double() - ref).abs().max() < 2e-3
    assert lse.shape == (b, h, n) and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max() < 2e-3
    assert (max_q, max_k) == (n, n_k) and rng.shape == (2,) and philox.shape == () and debug.numel() == 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng, philox)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        assert (got.double() - want).abs().max() < 5e-3
    assert torch_flash.calls["_scaled_dot_product_flash_attention"] == before.get("_scaled_dot_product_flash_attention", 0) + 1
    assert torch_flash.calls["_scaled_dot_product_flash_attention_backward"] == \
        before.get("_scaled_dot_product_flash_attention_backward", 0) + 1


def test_flash_attention_forward_dense_gqa_and_window_against_float64(cpu_ops):
    # (B, N, H, D) layout, 4 query heads over 2 key/value heads, a causal window of 8 keys
    b, n, d = 1, 48, 16
    q, k, v = rand(b, n, 4, d), rand(b, n, 2, d), rand(b, n, 2, d)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, n, n, 0.0, True, False,
                                                           window_size_left=7, window_size_right=0)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    ref, ref_lse = varlen_attention(q[0], k[0], v[0], cu, cu, causal=True, window_size=(7, 0))
    assert (out[0].double() - ref).abs().max() < 2e-3
    assert (lse[0].double() - ref_lse).abs().max() < 2e-3


@VARLEN
def test_flash_attention_forward_varlen_and_backward_against_float64(cpu_ops):
    lengths_q, lengths_k = [5, 0, 17, 9], [12, 3, 17, 30]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = rand(int(cu_q[-1]), 4, 16), rand(int(cu_k[-1]), 2, 16), rand(int(cu_k[-1]), 2, 16)
    do = rand(*q.shape)
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max(lengths_q),
                                                                       max(lengths_k), 0.0, True, False)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = varlen_attention(q64, k64, v64, cu_q, cu_k, causal=True)
    assert (out.double() - ref).abs().max() < 2e-3
    assert lse.shape == (4, q.shape[0]) and (lse.double() - ref_lse).abs().max() < 2e-3
    grads = torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lengths_q),
                                                     max(lengths_k), 0.0, True, rng, unused)
    for got, want in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        assert (got.double() - want).abs().max() < 5e-3


@pytest.mark.parametrize("call, named", [
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.1), "dropout_p"),
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, True), "return_debug_mask"),
    (lambda q: torch.ops.aten._flash_attention_forward(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None,
                                                       None, 8, 8, 0.5, False, False), "dropout_p"),
])
def test_unsupported_arguments_are_named(cpu_ops, call, named):
    with pytest.raises(KernelInputError, match=named):
        call(rand(1, 2, 8, 16))


def test_alibi_slopes_are_taken_without_gradients_only(cpu_ops):
    q, k, v = (rand(1, 12, 2, 16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 12, 12, 0.0, True, False,
                                                           alibi_slopes=slopes)
    cu = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    ref, _ = varlen_attention(q[0], k[0], v[0], cu, cu, causal=True, alibi_slopes=slopes)
    assert (out[0].double() - ref).abs().max() < 2e-3
    with pytest.raises(KernelInputError, match="alibi_slopes"):
        torch.ops.aten._flash_attention_forward(q.requires_grad_(), k, v, None, None, 12, 12, 0.0, True, False,
                                                alibi_slopes=slopes)


def test_schema_mismatch_names_the_argument():
    schema = torch.ops.aten._flash_attention_backward.default._schema
    assert torch_flash.schema_mismatch(schema, torch_flash._flash_attention_backward) is None
    grown = torch._C.parse_schema(str(schema).replace("SymInt? window_size_right=None)",
                                                       "SymInt? window_size_right=None, float? temperature=None)"))
    assert "temperature" in torch_flash.schema_mismatch(grown, torch_flash._flash_attention_backward)
    fewer_returns = torch._C.parse_schema(str(schema).replace("-> (Tensor, Tensor, Tensor)", "-> (Tensor, Tensor)"))
    assert "returns 2 values" in torch_flash.schema_mismatch(fewer_returns, torch_flash._flash_attention_backward)


def test_activation_fails_clearly_and_overrides_nothing_on_a_schema_it_does_not_know(monkeypatch):
    def backward(grad_out, query):  # an implementation of some other schema
        pass

    backward.RETURNS = 3
    monkeypatch.setitem(torch_flash.OPS, "_flash_attention_backward", backward)
    name = "aten::_scaled_dot_product_flash_attention"
    before = torch._C._dispatch_dump(name)
    with pytest.raises(AttnGenError, match="aten::_flash_attention_backward.*positional arguments"):
        torch_flash.activate("CUDA")
    assert torch._C._dispatch_dump(name) == before


# -- GPU: the slot active, torch's own entry points ---------------------------------------------------------------

def _close(got, want, ref, fudge=3.0, floor=1e-3):
    """attngen's error against float64 within `fudge` times torch's kernel's, plus a floor."""
    err = (got.double() - ref).abs().max().item()
    base = (want.double() - ref).abs().max().item()
    assert err <= fudge * base + floor, (err, base)


@pytest.fixture
def active():
    attention_registry.activate_flash_attention_impl("attngen")
    try:
        yield torch_flash.calls
    finally:
        attention_registry.restore_flash_attention_impl()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_sdpa_flash_backend_runs_attngen(causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = 2, 16, 1024, 128
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        their_grads = torch.autograd.grad(theirs, (q, k, v), do)
        attention_registry.activate_flash_attention_impl("attngen")
        try:
            before = dict(torch_flash.calls)
            ours = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            our_grads = torch.autograd.grad(ours, (q, k, v), do)
            torch.cuda.synchronize()
        finally:
            attention_registry.restore_flash_attention_impl()
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        assert torch_flash.calls.get(op, 0) == before.get(op, 0) + 1, op
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference(q64, k64, v64, Mask.CAUSAL_TOP_LEFT if causal else Mask.NONE)
    _close(ours, theirs, ref)
    for got, want, r in zip(our_grads, their_grads, torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        _close(got, want, r)


def _packed_batch(lengths_q, lengths_k, heads=16, kv_heads=16, d=128):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu_q[-1]), heads, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    return q, k, v, cu_q, cu_k


def _varlen_attn():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    return varlen.varlen_attn


@pytest.mark.gpu
@VARLEN
@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (255, 0)])
def test_gpu_varlen_attn_runs_attngen(window_size):
    import inspect

    varlen_attn = _varlen_attn()
    lengths = [1000, 37, 0, 2048, 511]
    q, k, v, cu_q, cu_k = _packed_batch(lengths, lengths)
    do = torch.randn_like(q)
    params = inspect.signature(varlen_attn).parameters
    if window_size == (-1, -1):
        kw = {}
    elif "window_size" in params:
        kw = {"window_size": window_size}
    elif window_size == (-1, 0) and "is_causal" in params:  # (an older torch's varlen_attn)
        kw = {"is_causal": True}
    else:
        pytest.skip(f"this torch's varlen_attn takes no window_size {window_size}")
    theirs = varlen_attn(q, k, v, cu_q, cu_k, max(lengths), max(lengths), **kw)
    their_grads = torch.autograd.grad(theirs, (q, k, v), do)
    attention_registry.activate_flash_attention_impl("attngen")
    try:
        before = dict(torch_flash.calls)
        ours = varlen_attn(q, k, v, cu_q, cu_k, max(lengths), max(lengths), **kw)
        our_grads = torch.autograd.grad(ours, (q, k, v), do)
        torch.cuda.synchronize()
    finally:
        attention_registry.restore_flash_attention_impl()
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        assert torch_flash.calls.get(op, 0) == before.get(op, 0) + 1, op
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = varlen_attention(q64, k64, v64, cu_q, cu_k, causal=window_size[1] == 0,
                              window_size=window_size)
    _close(ours, theirs, ref)
    for got, want, r in zip(our_grads, their_grads, torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        _close(got, want, r)


@pytest.mark.gpu
@VARLEN
def test_gpu_varlen_attn_paged_with_seqused_k_runs_attngen():
    import inspect

    varlen_attn = _varlen_attn()
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        pytest.skip("this torch's varlen_attn takes no block_table")
    page_size, heads, d = 16, 16, 128
    lengths_q, used = [64, 1, 1, 200], [100, 1000, 33, 200]
    pages = [-(-n // page_size) for n in used]
    pool = sum(pages) + 5
    order = torch.randperm(pool, device=DEVICE)[: sum(pages)].to(torch.int32)
    table = torch.zeros(len(used), max(pages), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start : start + n]
        start += n
    k, v = (torch.randn(pool, page_size, heads, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(used).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu_q[-1]), heads, d, device=DEVICE, dtype=torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(used))
    theirs = varlen_attn(*args, window_size=(-1, 0), seqused_k=seqused, block_table=table)
    attention_registry.activate_flash_attention_impl("attngen")
    try:
        before = torch_flash.calls.get("_flash_attention_forward", 0)
        ours = varlen_attn(*args, window_size=(-1, 0), seqused_k=seqused, block_table=table)
        torch.cuda.synchronize()
    finally:
        attention_registry.restore_flash_attention_impl()
    assert torch_flash.calls["_flash_attention_forward"] == before + 1
    ref, _ = varlen_attention(q, k, v, cu_q, cu_k, causal=True, seqused_k=seqused, block_table=table)
    _close(ours, theirs, ref)


def test_scale_default_is_one_over_sqrt_head_dim(cpu_ops):
    q, k, v = (rand(1, 1, 8, 16) for _ in range(3))
    out, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=1 / math.sqrt(16))
    default, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    doubled, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=2 / math.sqrt(16))
    assert torch.equal(out, default) and not torch.allclose(out, doubled)


def test_repeated_layouts_replay_the_planned_forward_on_fresh_inputs(cpu_ops):
    # (the second call of a layout records its launches, the third replays them: each on new values)
    from attngen.runtime.plans import PLANS

    for _ in range(3):
        q, k, v = (rand(1, 2, 24, 16) for _ in range(3))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        ref, ref_lse = reference(q.double(), k.double(), v.double(), Mask.CAUSAL_TOP_LEFT)
        assert (out.double() - ref).abs().max() < 2e-3 and (lse.double() - ref_lse).abs().max() < 2e-3
    assert PLANS.plans("torch_flash")


@VARLEN
def test_dense_calls_with_fewer_queries_than_keys_align_causal_bottom_right(cpu_ops):
    # (B, N, H, D) with 9 queries over 20 keys: flash-attn's causal (bottom-right) runs on the varlen kernels
    b, n_q, n_k = 2, 9, 20
    q, k, v, do = rand(b, n_q, 2, 16), rand(b, n_k, 2, 16), rand(b, n_k, 2, 16), rand(b, n_q, 2, 16)
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, n_q, n_k, 0.0, True,
                                                                       False)
    grads = torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, None, None, n_q, n_k, 0.0, True, rng,
                                                     unused)
    assert lse.shape == (b, 2, n_q)
    for i in range(b):
        q64, k64, v64 = (t[i].double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = reference(*(t.transpose(0, 1)[None] for t in (q64, k64, v64)), Mask.CAUSAL_BOTTOM_RIGHT)
        assert (out[i].double() - ref[0].transpose(0, 1)).abs().max() < 2e-3
        assert (lse[i].double() - ref_lse[0]).abs().max() < 2e-3
        want = torch.autograd.grad(ref[0].transpose(0, 1), (q64, k64, v64), do[i].double())
        for got, w in zip(grads, want):
            assert (got[i].double() - w).abs().max() < 5e-3
