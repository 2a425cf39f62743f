"""Plans and replays of packed calls (attngen/api/varlen.py `signature_of`, `PlannedVarlen`; attngen/runtime/autograd.py
`replayed_varlen_forward` / `replayed_varlen_backward`): a layout's later calls skip the checks but compute each call's
own sequences (the cu_seqlens' values and the max lengths are not in the signature), through flash_attn_varlen_func
and through the flash-attention slot's varlen ops; on the GPU they replay the launches of their first planned call,
and the replays follow every call's values too."""

from __future__ import annotations

import pytest
import torch

import attngen
from attngen import KernelInputError
from attngen.api import varlen as varlen_api
from attngen.testing.reference import varlen_attention
from conftest import DEVICE, empty_plans
from test_torch_flash import VARLEN, cpu_ops  # noqa: F401 - the fixture
from test_varlen_api import _check, cu

# One layout: 40 query and 52 key tokens in 3 sequences, split differently at each call (a zero-length one too).
SPLITS = [([7, 19, 14], [9, 21, 22]), ([20, 0, 20], [20, 12, 20]), ([1, 38, 1], [30, 11, 11]),
          ([13, 13, 14], [2, 40, 10])]


def _packed(lengths_q, lengths_k, heads=4, kv_heads=2, d=16, dtype=torch.float32, grad=False):
    """Fresh random packed q, k, v (NaN-free, new addresses each call) and the offsets."""
    q = torch.randn(sum(lengths_q), heads, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(sum(lengths_k), kv_heads, d, dtype=dtype, device=DEVICE) for _ in range(2))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, cu(lengths_q, DEVICE), cu(lengths_k, DEVICE)


def _count_checks(monkeypatch) -> list:
    checked = []
    real = varlen_api._checked_plan
    monkeypatch.setattr(varlen_api, "_checked_plan", lambda *a: checked.append(a[5:7]) or real(*a))
    return checked


def _spy_on_replays(monkeypatch) -> list:
    """What each replay's call returned (True: it launched), in call order."""
    from attngen.runtime import replay

    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    return replayed


def _against_float64(q, k, v, cu_q, cu_k, out, lse=None, grads=None, do=None, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = varlen_attention(*leaves, cu_q, cu_k, **kw)
    low, _ = varlen_attention(q.detach(), k.detach(), v.detach(), cu_q, cu_k, dtype=torch.float32, **kw)
    _check(out, ref, low)
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3
    if grads is not None:
        ref_grads = torch.autograd.grad(ref, leaves, do.double())
        fp32 = [t.detach().requires_grad_() for t in (q, k, v)]
        low_grads = torch.autograd.grad(varlen_attention(*fp32, cu_q, cu_k, dtype=torch.float32, **kw)[0], fp32, do)
        for got, want, base in zip(grads, ref_grads, low_grads):
            _check(got, want, base)


@VARLEN
@pytest.mark.parametrize("kw,splits", [(dict(causal=True), 4), (dict(window_size=(4, 3), softcap=3.0), 2)])
def test_a_planned_layout_computes_each_call_s_own_sequences(kw, splits, monkeypatch):
    """Splits of one layout, each with and without autograd (two signatures: whether the call is recorded), the max
    lengths changing with the split: two checked calls, every call against float64, gradients included."""
    empty_plans(monkeypatch)
    checked = _count_checks(monkeypatch)
    for lengths_q, lengths_k in SPLITS[:splits]:
        max_q, max_k = max(lengths_q), max(lengths_k)
        q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
        with torch.no_grad():
            out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        _against_float64(q, k, v, cu_q, cu_k, out, **kw)
        q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, grad=True)
        out, lse, _ = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **kw)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        _against_float64(q, k, v, cu_q, cu_k, out, lse, grads, do, **kw)
    assert len(checked) == 2
    plans = varlen_api.PLANS.plans("varlen")
    assert len(plans) == 2 and all(isinstance(p, varlen_api.PlannedVarlen) for p in plans)


@VARLEN
def test_one_offsets_tensor_for_queries_and_keys_is_its_own_signature(monkeypatch):
    """Self-attention's packing passes one cu_seqlens twice (a replay then holds one address for both); a call with
    the same layout but distinct offsets takes another plan, and each computes its own sequences."""
    empty_plans(monkeypatch)
    lengths = [9, 17, 14]
    for shared in (True, False, True, False):
        q, k, v, cu_q, _ = _packed(lengths, lengths)
        cu_k = cu_q if shared else cu([20, 6, 14], DEVICE)
        out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, causal=True)
        _against_float64(q, k, v, cu_q, cu_k, out, causal=True)
    signatures = [s for s in varlen_api.PLANS._table if s[0] == "varlen"]
    assert len(signatures) == 2 and {s[10] for s in signatures} == {True, False}  # (after the 9 tensors' layouts)


@VARLEN
def test_a_planned_call_on_the_cpu_checks_its_values_again(monkeypatch):
    """The values are not in the signature: on the CPU, where the checks read them, a planned call reads them
    again (bad offsets, a max length smaller than a sequence: ValueErrors naming them)."""
    if DEVICE != "cpu":
        pytest.skip("the values are read on the host only where the tensors are there")
    empty_plans(monkeypatch)
    q, k, v, cu_q, cu_k = _packed([5, 6], [5, 6])
    attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6)
    assert len(varlen_api.PLANS.plans("varlen")) == 1
    with pytest.raises(KernelInputError, match="cu_seqlens_q must not decrease"):
        attngen.flash_attn_varlen_func(q, k, v, torch.tensor([0, 8, 7], dtype=torch.int32), cu_k, 8, 6)
    with pytest.raises(KernelInputError, match="max_seqlen_k is 5"):
        attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 5)
    with pytest.raises(KernelInputError, match="max_seqlen_q"):
        attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, -1, 6)
    assert len(varlen_api.PLANS.plans("varlen")) == 1  # (the planned signature's, unchanged)


def test_what_is_not_planned(monkeypatch):
    """Run-time tensors (slopes, sinks) in a call recorded for autograd, the debug mode that reads values back, and
    arguments of other types than the checks expect have no signature; the max lengths' values are not part of one,
    the slopes' and sinks' layouts are."""
    q, k, v, cu_q, cu_k = _packed([3], [3])
    args = lambda **kw: dict(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3,
                                  dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                  alibi_slopes=None, block_table=None, seqused_k=None, sinks=None), **kw)
    sig = lambda **kw: varlen_api.signature_of("varlen", *args(**kw).values())
    assert sig() is not None and sig() == sig(max_seqlen_q=7, max_seqlen_k=9)
    assert sig() != sig(causal=True) and sig() != sig(window_size=(2, 0)) and sig() != sig(softmax_scale=0.5)
    assert sig(window_size=[2, 0]) == sig(window_size=(2, 0))
    slopes, sinks = torch.ones(4, device=DEVICE), torch.ones(4, device=DEVICE)
    assert None not in (sig(alibi_slopes=slopes), sig(sinks=sinks))
    assert len({sig(), sig(alibi_slopes=slopes), sig(sinks=sinks), sig(sinks=sinks.double())}) == 4
    assert sig(sinks=sinks.requires_grad_()) is None  # (the sinks' gradient: a recorded call)
    with torch.no_grad():
        assert sig(sinks=sinks) is not None
    q.requires_grad_()
    assert sig(alibi_slopes=slopes) is None and sig() is not None
    for changes in (dict(max_seqlen_q=3.0), dict(window_size=(2.0, 0)), dict(causal=1), dict(cu_seqlens_q=[0, 3]),
                    dict(alibi_slopes=[1.0] * 4)):
        assert sig(**changes) is None, changes
    monkeypatch.setenv("ATTNGEN_CHECK_KVCACHE", "1")
    assert sig() is None


@VARLEN
def test_planned_calls_take_their_own_slopes_and_sinks(monkeypatch):
    """Inference calls with ALiBi slopes (given in bfloat16: a float32 copy per call) or sinks plan like the others:
    one checked call per signature, each call computing with its own tensors against float64."""
    empty_plans(monkeypatch)
    checked = _count_checks(monkeypatch)
    for lengths_q, lengths_k in SPLITS:
        q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
        for kw in (dict(alibi_slopes=torch.rand(3, 4, device=DEVICE).to(torch.bfloat16), causal=True),
                   dict(sinks=torch.randn(4, device=DEVICE) * 2)):
            out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw)
            ref_kw = {name: t.float() if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
            _against_float64(q, k, v, cu_q, cu_k, out, **ref_kw)
    assert len(checked) == 2


def test_a_mixed_kernel_keeps_inference_replays_per_max_lengths():
    """Only a mixed kernel's launches read the max lengths (its schedule of the short sequences): its inference
    replays are kept per pair, bounded; any other kernel's are one."""
    mixed = varlen_api.PlannedVarlen("k", 1.0, type("K", (), {"module": type("M", (), {"NARROW_CONFIG": {}})}))
    plain = varlen_api.PlannedVarlen("k", 1.0, type("K", (), {"module": object()}))
    assert plain.replays(5, 7) is plain.inference is plain.replays(9, 9)
    first = mixed.replays(5, 7)
    assert first is mixed.replays(5, 7) and first is not mixed.replays(5, 8) and first is not mixed.inference
    for n in range(varlen_api.PlannedVarlen.KEPT):
        mixed.replays(100, n)
    assert len(mixed.by_lengths) <= varlen_api.PlannedVarlen.KEPT and mixed.replays(5, 7) is not first
    assert varlen_api.PlannedVarlen.lengths_ok(0, 2**31 - 1) and not varlen_api.PlannedVarlen.lengths_ok(-1, 3)


@VARLEN
def test_the_slot_s_varlen_ops_plan_their_layouts(cpu_ops, monkeypatch):  # noqa: F811
    """aten::_flash_attention_forward / _backward with cum_seq_q (torch's varlen_attn calls them): a repeated
    layout takes its plan, each call's own sequences against float64."""
    empty_plans(monkeypatch)
    checked = _count_checks(monkeypatch)
    for lengths_q, lengths_k in SPLITS[:3]:
        q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads=2, kv_heads=2)
        max_q, max_k = max(lengths_q), max(lengths_k)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
        do = torch.randn_like(out)
        grads = torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                         torch.empty(2, dtype=torch.uint64),
                                                         torch.empty((), dtype=torch.uint64))
        _against_float64(q, k, v, cu_q, cu_k, out, lse, grads, do, causal=True)
    assert len(checked) == 1  # (the forward's and the backward's signatures are one here: nothing requires grad)
    assert len(varlen_api.PLANS.plans("torch_flash_varlen")) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["documents bf16 causal", "gqa window fp16"])
def test_gpu_replayed_varlen_calls_follow_each_call_s_values(case, monkeypatch):
    """On the GPU, a packed layout's inference calls replay from their third call on (the first is checked, the
    second records), training calls' backward from the fourth (a layout's first backward runs as it is, the second
    records); every call, its sequences split differently, matches float64 and is bit for bit the kernel's own
    path (replays off). The documents take the Gluon kernels on sm_90."""
    from attngen.runtime import autograd

    empty_plans(monkeypatch)
    replayed = _spy_on_replays(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    if "documents" in case:
        dtype, heads, kv_heads, d, total, kw = torch.bfloat16, 16, 16, 128, 8192, dict(causal=True)
    else:
        dtype, heads, kv_heads, d, total, kw = torch.float16, 8, 2, 64, 3001, dict(window_size=(300, 0), causal=True)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for i in range(5):
        cuts = sorted(torch.randperm(total - 1, generator=gen)[:5].add(1).tolist())
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        q, k, v, cu_q, _ = _packed(lengths, lengths, heads, kv_heads, d, dtype, grad=True)
        n = max(lengths)
        with torch.no_grad():
            got = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_q, n, n, **kw)
        out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_q, n, n, **kw)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        assert torch.equal(got, out), i
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = varlen_attention(*leaves, cu_q, cu_q, **kw)
        assert (out.double() - ref).abs().max().item() < tolerance, i
        for g, want in zip(grads, torch.autograd.grad(ref, leaves, do.double())):
            assert (g.double() - want).abs().max().item() < 4 * tolerance * max(1.0, want.abs().max().item()), i
        with monkeypatch.context() as m:  # the kernel's own path: a fresh plan, no replay recorded
            empty_plans(m)
            m.setattr(autograd, "record", lambda fn, inputs: (fn(), None))
            for _ in range(3):
                want = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_q, n, n, **kw)
                want_grads = torch.autograd.grad(want, (q, k, v), do)
        # (dK and dV are each written by one program; dQ is added up in float32 by atomics in any order)
        assert torch.equal(out, want) and torch.equal(grads[1], want_grads[1]) and torch.equal(grads[2], want_grads[2])
        assert (grads[0] - want_grads[0]).abs().max().item() <= 1e-2 * want_grads[0].abs().max().item(), i
    # inference: calls 3-5 replay; training forwards: calls 3-5; backward: calls 4 and 5
    assert replayed.count(True) == 3 + 3 + 2 and False not in replayed, replayed


@pytest.mark.gpu
@VARLEN
def test_gpu_replayed_paged_and_slot_calls_follow_each_call_s_values(monkeypatch):
    """The paged kernel (a mixed one: its schedule reads the max lengths, so its replays are kept per pair) with
    seqused_k, shuffled pages and each call's own sinks, and torch's varlen_attn through the slot, forward and backward: each call's
    sequences split differently at one layout, each against float64, the later ones replayed."""
    import inspect

    from torch.nn.attention import varlen as torch_varlen

    from test_torch_flash import attention_registry

    empty_plans(monkeypatch)
    replayed = _spy_on_replays(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    page_size, heads, d, pages = 16, 16, 128, 63  # (pages a sequence: 1,000 keys at most)
    pool = 4 * pages + 9
    for i in range(4):  # the paged kernel: the same layout and max lengths, other lengths and pages each call
        used = [1000, 1, 300, 333 - i]
        lengths_q = [64 - i, 1, 1, 7 + i]
        order = torch.randperm(pool, generator=gen)[:4 * pages].to(torch.int32).view(4, pages).to(DEVICE)
        k, v = (torch.randn(pool, page_size, heads, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(sum(lengths_q), heads, d, device=DEVICE, dtype=torch.bfloat16)
        cu_q, cu_k, seqused = cu(lengths_q, DEVICE), cu(used, DEVICE), torch.tensor(used, dtype=torch.int32,
                                                                                      device=DEVICE)
        sinks = torch.randn(heads, device=DEVICE) + 1.0  # (gpt-oss's serving step: sinks, paged)
        out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 1000, causal=True, block_table=order,
                                             seqused_k=seqused, sinks=sinks)
        ref, _ = varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True, seqused_k=seqused,
                                  block_table=order, sinks=sinks.double())
        assert (out.double() - ref).abs().max().item() < 2e-2, i
    assert replayed.count(True) == 2 and False not in replayed, replayed  # calls 3 and 4
    if "window_size" not in inspect.signature(torch_varlen.varlen_attn).parameters:
        pytest.skip("this torch's varlen_attn takes no window_size")
    replayed.clear()
    attention_registry.activate_flash_attention_impl("attngen")
    try:
        for i in range(4):
            cuts = sorted(torch.randperm(4095, generator=gen)[:3].add(1).tolist())
            lengths = [b - a for a, b in zip([0] + cuts, cuts + [4096])]
            q, k, v, cu_q, _ = _packed(lengths, lengths, 16, 16, 128, torch.bfloat16, grad=True)
            out = torch_varlen.varlen_attn(q, k, v, cu_q, cu_q, max(lengths), max(lengths), window_size=(-1, 0))
            do = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), do)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref, _ = varlen_attention(*leaves, cu_q, cu_q, causal=True)
            assert (out.double() - ref).abs().max().item() < 2e-2, i
            for g, want in zip(grads, torch.autograd.grad(ref, leaves, do.double())):
                assert (g.double() - want).abs().max().item() < 8e-2 * max(1.0, want.abs().max().item()), i
    finally:
        attention_registry.restore_flash_attention_impl()
    # forwards and backwards (their own signature: nothing is recorded for autograd there) alike: calls 3 and 4 (the
    # first is checked, the second records)
    assert replayed.count(True) == 4 and False not in replayed, replayed
