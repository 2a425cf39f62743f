"""attngen.attention's variant arguments (window_size, softcap, alibi_slopes, sinks): their checks, their keys,
and their numerics against a float64 reference that builds the mask and scores from flash-attn's definitions
(aligned top-left), independently of attngen's spec tree."""

import inspect
import math

import pytest
import torch

import attngen
from attngen import KernelInputError
from attngen.lang.builtin import sdpa_key, sdpa_key_spec, sdpa_spec, sdpa_variant
from attngen.runtime import autograd
from conftest import DEVICE, empty_plans

# The variant kernels are forward+backward specs and take run-time tensors through the autograd path's
# `tensors=`: both come with the backward of variants (issue 48's backward part).
VARIANT_BACKWARD = pytest.mark.skipif("tensors" not in inspect.signature(autograd.attention_forward).parameters,
                                      reason="needs the backward of variants (autograd.attention_forward(tensors=))")


def reference(q, k, v, is_causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, scale=None):
    """flash-attn's definitions in float64 (query i at position i, key j at j), GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1 if alibi_slopes.dim() == 2 else 1, q.shape[1], 1, 1)
        s = s - slopes * (i - j).abs()
    keep = torch.ones_like(s, dtype=torch.bool)
    left, right = window_size
    if is_causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num()  # (rows a window leaves empty give 0)
    return p[..., :k.shape[2]] @ v


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32)


@pytest.mark.parametrize("window,causal,key,normalised", [
    ((4, 0), True, "sdpa:fp32:32:causal:window=4,0", (4, 0)),
    ((4, -1), True, "sdpa:fp32:32:causal:window=4,0", (4, 0)),  # causal: the right side is 0 either way
    ((-1, -1), True, "sdpa:fp32:32:causal", (-1, -1)),
    ((3, 2), False, "sdpa:fp32:32:full:window=3,2", (3, 2)),
    ((3, -1), False, "sdpa:fp32:32:full:window=3,-1", (3, -1)),
])
def test_each_variant_has_one_key_that_reads_back_to_its_spec(window, causal, key, normalised, monkeypatch):
    empty_plans(monkeypatch)
    seen = []
    monkeypatch.setattr(autograd, "attention_forward", lambda k, *a, **kw: seen.append(k) or (a[0], None))
    q = rand(1, 2, 8, 32)
    attngen.attention(q, q, q, is_causal=causal, window_size=window)
    assert seen == [key]
    assert sdpa_key_spec(key) is sdpa_spec("fp32", 32, causal, sdpa_variant(causal, normalised))
    spec = sdpa_key_spec(sdpa_key("bf16", 64, True, (7, 0), 30.0, False, True))
    assert "mask = causal & window(8)" in spec.canonical() and "score = softcap(30)" in spec.canonical()
    assert "sinks = true" in spec.canonical() and spec.backward


def test_plain_calls_keep_the_plain_key_and_spec():
    assert sdpa_key("fp16", 64, True) == "sdpa:fp16:64:causal"
    assert sdpa_key_spec("sdpa:fp16:64:full") == sdpa_spec("fp16", 64, False)
    assert not sdpa_spec("fp16", 64, True).variant


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(3,)), "window_size"),
    (dict(window_size=(2.0, 0)), "window_size"),
    (dict(window_size=(3, 2), is_causal=True), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.int32)), "sinks"),
    (dict(alibi_slopes=torch.zeros(2, 3)), "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(4), softcap=5.0), "alibi_slopes"),
    # (attngen gives no gradient for the slopes: one that asks for it would silently be missing)
    (dict(alibi_slopes=torch.zeros(4, requires_grad=True)), "alibi_slopes requires grad"),
])
def test_bad_variant_arguments_raise_naming_them_before_any_launch(kwargs, match, monkeypatch):
    monkeypatch.setattr(autograd, "attention_forward", lambda *a, **kw: pytest.fail("launched"))
    q = rand(1, 4, 8, 32)
    with pytest.raises(ValueError, match=match):
        attngen.attention(q, q, q, **kwargs)
    assert issubclass(KernelInputError, ValueError)


def test_slopes_that_require_grad_run_as_constants_outside_grad_mode_or_detached():
    """ALiBi's slopes are constants: under torch.no_grad(), or detached, slopes that require grad are taken; the
    varlen entry point refuses them in grad mode as `attention` does."""
    q = rand(1, 4, 8, 32)
    slopes = torch.rand(4, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        want = attngen.attention(q, q, q, is_causal=True, alibi_slopes=slopes)
    assert torch.equal(attngen.attention(q, q, q, is_causal=True, alibi_slopes=slopes.detach()), want)
    packed = q[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        attngen.flash_attn_varlen_func(packed, packed, packed, cu, cu, 8, 8, causal=True, alibi_slopes=slopes)


CASES = {
    "causal_window": dict(is_causal=True, window_size=(5, 0)),
    "window_LR": dict(window_size=(4, 3)),
    "window_left_only": dict(window_size=(6, -1)),
    "window_right_only": dict(window_size=(-1, 2)),
    "softcap": dict(is_causal=True, softcap=2.0),
    "softcap_window": dict(is_causal=True, window_size=(7, 0), softcap=3.0),
}


@VARIANT_BACKWARD
@pytest.mark.parametrize("case", list(CASES))
def test_variant_forward_and_backward_match_the_reference(case):
    kwargs = CASES[case]
    torch.manual_seed(0)
    q, k, v = rand(2, 4, 21, 32), rand(2, 2, 21, 32), rand(2, 2, 21, 32)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attngen.attention(q, k, v, enable_gqa=True, **kwargs)
    ref = reference(q, k, v, **kwargs)
    assert (out.double() - ref).abs().max().item() < 1e-4
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max().item() < 1e-4
    again = attngen.attention(q.detach(), k.detach(), v.detach(), enable_gqa=True, **kwargs)  # planned
    assert torch.equal(again, out.detach())


@VARIANT_BACKWARD
def test_sinks_and_alibi_match_the_reference_with_the_sinks_gradient():
    torch.manual_seed(1)
    q, k, v = rand(2, 4, 19, 32), rand(2, 2, 19, 32), rand(2, 2, 19, 32)
    sinks = rand(4).requires_grad_(True)
    slopes = torch.rand(2, 4, device=DEVICE)
    q.requires_grad_(True)
    out = attngen.attention(q, k, v, is_causal=True, enable_gqa=True, window_size=(6, 0), sinks=sinks)
    ref = reference(q, k, v, is_causal=True, window_size=(6, 0), sinks=sinks)
    assert (out.double() - ref).abs().max().item() < 1e-4
    (dq, ds), (rq, rs) = (torch.autograd.grad(o, (q, sinks), torch.ones_like(o)) for o in (out, ref))
    assert (dq.double() - rq).abs().max().item() < 1e-4 and (ds.double() - rs).abs().max().item() < 1e-4
    with torch.no_grad():
        out = attngen.attention(q, k, v, is_causal=True, enable_gqa=True, alibi_slopes=slopes)
        ref = reference(q, k, v, is_causal=True, alibi_slopes=slopes)
    assert (out.double() - ref).abs().max().item() < 1e-4


@VARIANT_BACKWARD
def test_inference_calls_with_slopes_or_sinks_are_planned_with_their_own_tensors(monkeypatch):
    """Without autograd, a repeated layout with ALiBi slopes (3-D inputs, (B, H) slopes in bfloat16: a float32
    copy per call) or sinks takes its plan, every call with its own tensors against float64; with autograd (sinks
    that require grad) each call is checked and runs as it is."""
    from attngen.api import sdpa

    plans = empty_plans(monkeypatch)
    checked = []
    real = sdpa._checked_plan
    monkeypatch.setattr(sdpa, "_checked_plan", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    for i in range(3):
        q, k, v = rand(4, 13, 32), rand(2, 17, 32), rand(2, 17, 32)
        slopes = torch.rand(1, 4, device=DEVICE).to(torch.bfloat16)
        sinks = torch.randn(4, device=DEVICE) * 2
        with torch.no_grad():
            out = attngen.attention(q, k, v, is_causal=True, enable_gqa=True, alibi_slopes=slopes)
            ref = reference(q[None], k[None], v[None], is_causal=True, alibi_slopes=slopes.float())[0]
            assert (out.double() - ref).abs().max().item() < 1e-4, i
            out = attngen.attention(q, k, v, enable_gqa=True, window_size=(5, 2), sinks=sinks)
            ref = reference(q[None], k[None], v[None], window_size=(5, 2), sinks=sinks)[0]
            assert (out.double() - ref).abs().max().item() < 1e-4, i
        sinks.requires_grad_(True)
        out = attngen.attention(q, k, v, enable_gqa=True, sinks=sinks)
        (ds,), (rs,) = (torch.autograd.grad(o, (sinks,), torch.ones_like(o))
                        for o in (out, reference(q[None], k[None], v[None], sinks=sinks)[0]))
        assert (ds.double() - rs).abs().max().item() < 1e-4, i
    assert len(checked) == 2 + 3 and len(plans.plans("sdpa")) == 2


@pytest.mark.gpu
@VARIANT_BACKWARD
def test_gpu_replayed_calls_with_sinks_and_slopes_read_their_own(monkeypatch):
    """On the GPU, inference calls with sinks (gpt-oss, d=64, a window) or ALiBi slopes replay from a signature's
    third call on, each call's own tensors at new addresses: every call matches float64 and is bit for bit the
    module's own path (replays off)."""
    from attngen.runtime import replay

    empty_plans(monkeypatch)
    replayed = []
    real_call = replay.Replay.__call__
    monkeypatch.setattr(replay.Replay, "__call__", lambda self, inputs: replayed.append(real_call(self, inputs))
                        or replayed[-1])
    for i in range(4):
        q = torch.randn(2, 16, 700, 64, device=DEVICE, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 4, 700, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        calls = [dict(is_causal=True, window_size=(127, 0), sinks=torch.randn(16, device=DEVICE) + 1.0),
                 dict(is_causal=True, alibi_slopes=torch.rand(2, 16, device=DEVICE))]
        for kw in calls:
            with torch.no_grad():
                got = attngen.attention(q, k, v, enable_gqa=True, **kw)
                with monkeypatch.context() as m:  # the module's own path: a fresh plan, no replay recorded
                    empty_plans(m)
                    m.setattr(autograd, "record", lambda fn, inputs: (fn(), None))
                    for _ in range(3):
                        want = attngen.attention(q, k, v, enable_gqa=True, **kw)
            assert torch.equal(got, want), (i, list(kw))
            assert (got.double() - reference(q, k, v, **kw)).abs().max().item() < 2e-2, (i, list(kw))
    assert replayed == [True] * 4  # calls 3 and 4 of each
