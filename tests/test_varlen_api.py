"""attngen.flash_attn_varlen_func: its argument checks (every bad input raises a ValueError naming the argument
before anything runs), its builtin specs' registry keys, the float64 reference it is compared with, and its
numerics (forward, log-sum-exp layout and gradients) against that reference per sequence."""

import inspect

import pytest
import torch

import attngen
from attngen import KernelInputError
from attngen.lang.builtin import varlen_key
from attngen.lang.spec import Mask
from attngen.testing.reference import attention, varlen_attention
from conftest import DEVICE
from test_torch_flash import VARLEN


def cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def batch(lengths_q, lengths_k, heads=2, kv_heads=2, d=16, dtype=torch.float32, device="cpu"):
    """A packed batch; on the CPU by default (the value checks read the tensors there before any launch)."""
    q = torch.randn(sum(lengths_q), heads, d, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lengths_k), kv_heads, d, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, cu(lengths_q, device), cu(lengths_k, device)


def test_the_signature_is_flash_attns():
    names = list(inspect.signature(attngen.flash_attn_varlen_func).parameters)
    assert names[:15] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                          "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                          "return_attn_probs"]
    assert names[15] == "block_table" and {"seqused_k", "sinks"} <= set(names[16:])


def _bad(q, k, v, cu_q, cu_k, **changes):
    """flash_attn_varlen_func's arguments for the batch, with `changes`."""
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(cu_q.diff().max()),
                max_seqlen_k=int(cu_k.diff().max()))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, named", [
    (lambda b: dict(cu_seqlens_q=b["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
    (lambda b: dict(cu_seqlens_k=b["cu_seqlens_k"].float()), "cu_seqlens_k must be int32"),
    (lambda b: dict(cu_seqlens_q=b["cu_seqlens_q"][None]), "cu_seqlens_q must be 1-D"),
    (lambda b: dict(cu_seqlens_k=b["cu_seqlens_k"][:-1]), "cu_seqlens_k must have 4 entries"),
    (lambda b: dict(cu_seqlens_q=b["cu_seqlens_q"] + 1), "cu_seqlens_q must start at 0"),
    (lambda b: dict(cu_seqlens_k=torch.tensor([0, 9, 4, 30], dtype=torch.int32)), "cu_seqlens_k must not decrease"),
    (lambda b: dict(cu_seqlens_q=torch.tensor([0, 5, 10, 29], dtype=torch.int32), max_seqlen_q=19),
     "cu_seqlens_q ends at 29, past the 28"),
    (lambda b: dict(cu_seqlens_k=torch.tensor([0, 5, 10, 31], dtype=torch.int32), max_seqlen_k=21),
     "cu_seqlens_k ends at 31, past the 30"),
    (lambda b: dict(max_seqlen_q=10), "max_seqlen_q is 10, smaller than sequence 2's 17"),
    (lambda b: dict(max_seqlen_k=3), "max_seqlen_k is 3"),
    (lambda b: dict(max_seqlen_k=-1), "max_seqlen_k must be an int"),
    (lambda b: dict(seqused_k=torch.tensor([1, 2], dtype=torch.int32)), "seqused_k must have 3 entries"),
    (lambda b: dict(seqused_k=torch.tensor([1, 2, 3])), "seqused_k must be int32"),
    (lambda b: dict(seqused_k=torch.tensor([1, 20, 3], dtype=torch.int32)), r"seqused_k\[1\] is 20"),
    (lambda b: dict(dropout_p=0.1), "dropout_p must be 0.0"),
    (lambda b: dict(window_size=(2, 3), causal=True), "window_size"),
    (lambda b: dict(softcap=-1.0), "softcap"),
    (lambda b: dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape"),
    (lambda b: dict(sinks=torch.ones(5)), "sinks must have shape"),
    (lambda b: dict(q=b["q"][None]), "q must be"),
    (lambda b: dict(k=b["k"].half()), "share a dtype"),
    (lambda b: dict(q=torch.randn(28, 3, 16)), "multiple of the key/value heads"),
])
def test_bad_input_raises_a_value_error_naming_it(changes, named):
    q, k, v, cu_q, cu_k = batch([5, 6, 17], [9, 1, 20])
    args = _bad(q, k, v, cu_q, cu_k)
    args.update(changes(args))
    with pytest.raises(ValueError, match=named):
        attngen.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("changes, named", [
    (lambda b: dict(block_table=torch.zeros(2, 4, dtype=torch.int32)), "block_table has 2 rows"),
    (lambda b: dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "block_table must be int32"),
    (lambda b: dict(block_table=torch.full((3, 4), 7, dtype=torch.int32)), "outside the pool of 6 pages"),
    (lambda b: dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), "more than its block_table row's 1 pages"),
    (lambda b: dict(block_table=torch.zeros(3, 4, dtype=torch.int32), k=b["k"][:, 0]), "k must be"),
])
def test_bad_paged_input_raises_a_value_error_naming_it(changes, named):
    q, _, _, cu_q, cu_k = batch([5, 6, 17], [9, 1, 20])
    pool = torch.randn(6, 8, 2, 16)  # 6 pages of 8 keys
    args = _bad(q, pool, pool, cu_q, cu_k)
    args.update(changes(args))
    with pytest.raises(ValueError, match=named):
        attngen.flash_attn_varlen_func(**args)


def test_values_on_a_gpu_are_checked_only_in_debug_mode(monkeypatch):
    from attngen.api import varlen

    seen = []
    monkeypatch.setattr(varlen, "_check_values", lambda *a: seen.append(a))
    monkeypatch.setattr(varlen, "resolve", lambda key: pytest.fail("checked without its values: " + key))
    q, k, v, cu_q, cu_k = batch([5], [5])
    meta = [t.to("meta") for t in (q, k, v, cu_q, cu_k)]  # (a device the values cannot be read from)
    with pytest.raises(BaseException):
        attngen.flash_attn_varlen_func(*meta, 5, 5)
    assert seen == []
    monkeypatch.setenv("ATTNGEN_CHECK_KVCACHE", "1")
    with pytest.raises(BaseException):
        attngen.flash_attn_varlen_func(*meta, 5, 5)
    assert len(seen) == 1


@pytest.mark.parametrize("args, key", [
    (("bf16", 128, True), "varlen:bf16:128:causal"),
    (("fp16", 64, False, 16, (32, 8)), "varlen:fp16:64:full:paged=16:gqa=32,8"),
    (("bf16", 128, True, None, None, (255, 0), 30.0, False, True), "varlen:bf16:128:causal:window=255,0:softcap=30.0:sinks"),
    (("fp32", 32, False, None, None, (3, 2), 0.0, True), "varlen:fp32:32:full:window=3,2:alibi"),
])
def test_keys(args, key):
    assert varlen_key(*args) == key


@VARLEN
@pytest.mark.parametrize("key", ["varlen:bf16:128:causal", "varlen:fp16:64:full:paged=16:gqa=32,8",
                                 "varlen:bf16:128:causal:window=255,0:softcap=30.0:sinks"])
def test_keys_round_trip_to_their_specs(key):
    from attngen.lang.builtin import varlen_key_spec

    spec = varlen_key_spec(key)
    assert spec.backward == ("paged" not in key)
    assert spec.name.startswith("varlen_") and spec.varlen


@VARLEN
def test_a_call_loads_its_key_s_kernel_through_the_registry():
    from attngen.runtime import registry

    q, k, v, cu_q, cu_k = batch([3, 5], [4, 5], heads=4, kv_heads=2, device=DEVICE)
    attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, window_size=(2, 0))
    from attngen.lang.builtin import varlen_key_spec

    key = varlen_key("fp32", 16, True, None, (4, 2), (2, 0))
    assert key in registry._SDPA_SPECS  # (the call resolved it)
    assert registry.resolve(key).spec.hash == varlen_key_spec(key).hash


def test_the_reference_is_attention_per_sequence_bottom_right():
    q, k, v, cu_q, cu_k = batch([3, 0, 7], [5, 4, 7], heads=4, kv_heads=2)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        kb, vb = (t[keys].repeat_interleave(2, 1).transpose(0, 1)[None] for t in (k, v))
        want, want_lse = attention(q[rows].transpose(0, 1)[None], kb, vb, Mask.CAUSAL_BOTTOM_RIGHT)
        torch.testing.assert_close(out[rows], want[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, rows], want_lse[0])


# -- numerics against float64, per sequence ----------------------------------------------------------------------

def _check(got, ref, low, fudge=4.0, floor=2e-4):
    """err(got) <= fudge * err(float32 torch of the same inputs) + floor, both against float64."""
    err = (got.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    assert err <= fudge * base + floor, (err, base)


CASES = {
    "equal": dict(lengths_q=[7, 19, 33], lengths_k=[7, 19, 33]),
    "unequal": dict(lengths_q=[3, 40, 1, 16], lengths_k=[30, 40, 9, 17]),
    "empty": dict(lengths_q=[6, 0, 12], lengths_k=[6, 5, 0]),
    "gqa": dict(lengths_q=[17, 9], lengths_k=[21, 9], heads=4, kv_heads=2),
}


@VARLEN
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", [dict(), dict(causal=True), dict(causal=True, window_size=(5, 0)),
                                     dict(window_size=(4, 3)), dict(softcap=2.0, causal=True),
                                     dict(alibi=True, causal=True), dict(sinks=True)])
def test_forward_and_gradients_against_float64(case, variant):
    shape = dict(CASES[case])
    lengths_q, lengths_k = shape.pop("lengths_q"), shape.pop("lengths_k")
    q, k, v, cu_q, cu_k = batch(lengths_q, lengths_k, device=DEVICE, **shape)
    heads = q.shape[1]
    kw = {n: variant[n] for n in ("causal", "window_size", "softcap") if n in variant}
    if variant.get("alibi"):
        kw["alibi_slopes"] = torch.rand(heads, device=DEVICE)
    if variant.get("sinks"):
        kw["sinks"] = torch.randn(heads, device=DEVICE, requires_grad=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, none = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    return_attn_probs=True, **kw)
    assert none is None and lse.shape == (heads, q.shape[0]) and lse.dtype == torch.float32
    do = torch.randn_like(out)
    ref, ref_lse = varlen_attention(*(t.detach().double().requires_grad_() for t in (q, k, v)), cu_q, cu_k, **kw)
    low, _ = varlen_attention(q, k, v, cu_q, cu_k, dtype=torch.float32, **kw)
    _check(out, ref, low)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    grads = torch.autograd.grad(out, inputs, do)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    kw64 = dict(kw, sinks=leaves[3]) if "sinks" in kw else kw
    ref, _ = varlen_attention(*leaves[:3], cu_q, cu_k, **kw64)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    low_grads = torch.autograd.grad(varlen_attention(q, k, v, cu_q, cu_k, dtype=torch.float32, **kw)[0], inputs, do)
    for got, want, base in zip(grads, ref_grads, low_grads):
        _check(got, want, base)


@VARLEN
def test_paged_keys_with_shuffled_pages_and_seqused_k():
    page_size, lengths_q, used = 8, [5, 1, 12], [13, 30, 12]
    pages = [-(-n // page_size) for n in used]
    order = torch.randperm(sum(pages) + 3)[: sum(pages)].to(torch.int32)
    table = torch.zeros(3, max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start : start + n]
        start += n
    table = table.to(DEVICE)
    pool_k, pool_v = (torch.randn(sum(pages) + 3, page_size, 2, 16, device=DEVICE) for _ in range(2))
    q = torch.randn(sum(lengths_q), 2, 16, device=DEVICE)
    cu_q, cu_k = cu(lengths_q, DEVICE), cu([16, 32, 16], DEVICE)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out = attngen.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 12, 32, causal=True, block_table=table,
                                         seqused_k=seqused)
    ref, _ = varlen_attention(q, pool_k, pool_v, cu_q, cu_k, causal=True, seqused_k=seqused, block_table=table)
    low, _ = varlen_attention(q, pool_k, pool_v, cu_q, cu_k, causal=True, seqused_k=seqused, block_table=table,
                              dtype=torch.float32)
    _check(out, ref, low)
