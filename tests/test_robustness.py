"""Failure behaviour on purpose: bad tensors are refused before any launch, edge-case numerics are
defined (fully masked rows, large logits, NaN and inf inputs), and the disk cache survives damage,
an unwritable directory and concurrent processes.

The bad-argument and numerics tests are tables over kernel *families*: each family says how to
build a valid call, and each case how to spoil one argument. A new entry point (decoding with a
paged cache, the backward pass) adds a family and its own cases, and reuses the assertions.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import attngen
import attngen.runtime.arguments
import attngen.api.kvcache
from attngen.runtime import cache
from attngen.testing import reference
from attngen.lang.builtin import sdpa_spec
from attngen.testing.accuracy import ATOL, FUDGE, Case, compare, compare_grads, validate
from attngen.lang.spec import MIN_SCALE, DType, Mask
from conftest import DEVICE, HAS_GPU, ROOT, empty_plans, spec_text


def rand(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)


# -- bad arguments ------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Make any Triton launch (compiled or interpreted) fail the test: a refused call must be
    refused before the GPU, or the interpreter, sees anything."""
    from triton.runtime import interpreter, jit

    from attngen.runtime.launch import FastJIT

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched for a call that should have been refused")

    monkeypatch.setattr(jit.JITFunction, "run", launched)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", launched)
    monkeypatch.setattr(FastJIT, "run", launched)  # the short path of repeat launches (attngen/runtime/launch.py)


@dataclass
class Family:
    """How to call one kind of kernel: `call(args)` with `args` a dict of valid arguments from
    `make()`; `names` maps the roles q, k, v, out to this entry point's argument names."""

    name: str
    make: Callable[[], dict]
    call: Callable[[dict], object]
    names: dict


@pytest.fixture(scope="module")
def checked_kernel():
    return attngen.load(spec_text("robust_checked", 32, "fp16", "causal", heads=4, kv_heads=2))


def _kernel_family(kernel) -> Family:
    def make():
        return dict(q=rand(2, 4, 8, 32), k=rand(2, 2, 8, 32), v=rand(2, 2, 8, 32))

    def call(a):
        a = dict(a)
        return kernel(a.pop("q"), a.pop("k"), a.pop("v"), **a)

    return Family("kernel", make, call, dict(q="q", k="k", v="v", out="out"))


def _sdpa_family() -> Family:
    def make():
        return dict(query=rand(2, 4, 8, 32), key=rand(2, 2, 8, 32), value=rand(2, 2, 8, 32), enable_gqa=True)

    return Family("sdpa", make, lambda a: attngen.attention(**a), dict(q="query", k="key", v="value"))


def _set(role, fn):
    """A case that replaces the argument playing `role` with fn(that argument, all arguments)."""
    def spoil(args, names):
        args[names[role]] = fn(args[names[role]], args)
    return spoil


def _heads(role, n):
    return _set(role, lambda t, a: t[:, :1].expand(t.shape[0], n, *t.shape[2:]).contiguous())


def _both(fn):
    """Apply fn to k and v alike."""
    def spoil(args, names):
        args[names["k"]], args[names["v"]] = fn(args[names["k"]]), fn(args[names["v"]])
    return spoil


def _kwarg(key, value):
    def spoil(args, names):
        args[key] = value(args, names) if callable(value) else value
    return spoil


def _aliased_out(role):
    def spoil(args, names):
        args["out"] = torch.empty_like(args[names["q"]])
        if role == "q":
            args["out"] = args[names["q"]]
        else:  # k/v a view into the output's memory
            args[names[role]] = args["out"][:, :2]
    return spoil


def _expanded(*shape):
    """A tensor of `shape` that is a stride-0 expansion of a tiny one (no memory needed)."""
    def make(t, a):
        small = t.reshape(-1)[:1].reshape(1, 1, 1, 1).expand(1, 1, 1, t.shape[-1]).contiguous()
        return small.expand(*shape)
    return make


def _on_meta_with_strides(strides):
    return lambda t, a: torch.empty_strided(t.shape, strides, dtype=t.dtype, device="meta")


# (case id, spoil, exception type, message pattern with {q} {k} {v} for the family's names)
COMMON_CASES = [
    ("q-rank3", _set("q", lambda t, a: t[0]), ValueError, r"{q}\b.* must"),
    ("q-rank5", _set("q", lambda t, a: t[None]), ValueError, r"{q} must"),
    ("q-list", _set("q", lambda t, a: t.tolist()), TypeError, r"{q} must be a torch.Tensor, not list"),
    ("k-none", _set("k", lambda t, a: None), TypeError, r"{k} must be a torch.Tensor, not NoneType"),
    ("v-numpy", _set("v", lambda t, a: t.cpu().numpy()), TypeError, r"{v} must be a torch.Tensor, not ndarray"),
    ("q-float64", _set("q", lambda t, a: t.double()), ValueError, r"dtype"),
    ("k-sparse", _set("k", lambda t, a: t.to_sparse()), ValueError, r"{k} is a torch.sparse_coo tensor"),
    ("heads-not-divisible", _heads("q", 3), ValueError, r"{q} has 3 heads, which is not a multiple of the 2 heads of {k} and {v}"),
    ("kv-zero-heads", _both(lambda t: t[:, :0]), ValueError, r"not a multiple of the 0 heads of {k} and {v}"),
    ("batch", _both(lambda t: t[:1]), ValueError, r"{q} has batch 2 but {k} and {v} have batch 1"),
    ("k-v-seq", _set("v", lambda t, a: t[:, :, :5]), ValueError, r"{k} and {v} must have the same shape"),
    ("on-meta", _set("q", lambda t, a: t.to("meta")), ValueError, r"{q} is on meta"),
    ("scale-bool", _kwarg("scale", True), TypeError, r"scale must be a Python number, not bool"),
    ("scale-tensor", _kwarg("scale", torch.tensor(0.5)), TypeError, r"scale must be a Python number, not Tensor"),
    ("scale-str", _kwarg("scale", "0.5"), TypeError, r"scale must be a Python number, not str"),
    ("scale-nan", _kwarg("scale", float("nan")), ValueError, r"scale must be finite"),
    ("scale-inf", _kwarg("scale", -float("inf")), ValueError, r"scale must be finite"),
    ("scale-overflows", _kwarg("scale", 1e39), ValueError, r"scale = 1e\+39 overflows float32"),
    ("scale-negative", _kwarg("scale", -0.5), ValueError, r"scale = -0.5 is not supported; .* at least 1e-30"),
    ("scale-zero", _kwarg("scale", 0), ValueError, r"scale = 0 is not supported"),
    ("scale-tiny", _kwarg("scale", 1e-300), ValueError, r"scale = 1e-300 is not supported"),
    ("int32-offsets", _set("q", _on_meta_with_strides((2**40, 2**36, 2**29, 1))), ValueError,
     r"{q} spans [\d,]+ elements within one \(batch, head\) slice.*32-bit"),
    ("seq-too-long", _set("q", _expanded(2, 4, 2**30 + 1, 32)), ValueError, r"{q} has sequence length 1,073,741,825"),
    ("batch-over-grid", lambda a, n: [a.update({n[r]: _expanded(70_000, *a[n[r]].shape[1:])(a[n[r]], a)})
                                      for r in ("q", "k", "v")], ValueError, r"{q} has batch 70000.*at most 65535"),
]

KERNEL_CASES = [
    ("q-float32", _set("q", lambda t, a: t.float()), ValueError, r"q has dtype torch.float32; kernel 'robust_checked' takes torch.float16"),
    ("v-bf16", _set("v", lambda t, a: t.bfloat16()), ValueError, r"v has dtype torch.bfloat16"),
    ("k-head-dim", _set("k", lambda t, a: t[..., :16]), ValueError, r"k has head_dim 16; kernel 'robust_checked' takes head_dim 32"),
    ("heads-vs-spec", _heads("q", 6), ValueError, r"q has 6 heads; kernel 'robust_checked' takes heads = 4"),
    ("kv-heads-vs-spec", _both(lambda t: t[:, :1]), ValueError, r"k has 1 heads; kernel 'robust_checked' takes kv_heads = 2"),
    ("requires-grad", _set("q", lambda t, a: t.float().half().requires_grad_()), ValueError,
     r"requires grad, but kernel 'robust_checked' is forward-only"),
    ("out-list", _kwarg("out", []), TypeError, r"out must be a torch.Tensor, not list"),
    ("out-shape", _kwarg("out", lambda a, n: torch.empty(2, 4, 8, 16, dtype=torch.float16, device=DEVICE)),
     ValueError, r"out must be \(2, 4, 8, 32\) torch.float16"),
    ("out-dtype", _kwarg("out", lambda a, n: torch.empty(2, 4, 8, 32, device=DEVICE)), ValueError, r"out must be .* torch.float16"),
    ("out-expanded", _kwarg("out", lambda a, n: torch.empty(2, 4, 1, 32, dtype=torch.float16, device=DEVICE).expand(2, 4, 8, 32)),
     ValueError, r"out has strides \(128, 32, 0, 1\).*share"),
    ("out-is-q", _aliased_out("q"), ValueError, r"out shares memory with q"),
    ("out-holds-v", _aliased_out("v"), ValueError, r"out shares memory with v"),
]

SDPA_CASES = [
    ("dtypes-differ", _set("k", lambda t, a: t.float()), ValueError, r"query, key and value must share a dtype"),
    # (v may differ, as SDPA allows: a spec with head_dim_v; q and k may not)
    ("head-dims-differ", _set("k", lambda t, a: t[..., :16]), ValueError, r"query and key must share a head dim"),
    ("head-dim-40", lambda a, n: [a.update({n[r]: rand(*a[n[r]].shape[:-1], 40)}) for r in ("q", "k", "v")],
     ValueError, r"head dim 40 is not supported: it must be a multiple of 16"),
    ("gqa-off", _kwarg("enable_gqa", False), ValueError, r"query has 4 heads and key 2; pass enable_gqa=True"),
    ("attn-mask", _kwarg("attn_mask", torch.ones(1)), ValueError, r"attn_mask is not supported"),
    ("dropout", _kwarg("dropout_p", 0.1), ValueError, r"dropout_p must be 0.0"),
]


def _grads(make):
    """A case that passes grads=make(args) to the backward: where it writes dq, dk and dv."""
    def spoil(args, names):
        fresh = {n: torch.empty_like(args[n]) for n in ("q", "k", "v")}
        args["grads"] = make(args, fresh)
    return spoil


BACKWARD_CASES = [
    ("do-list", _set("do", lambda t, a: t.tolist()), TypeError, r"do must be a torch.Tensor, not list"),
    ("do-dtype", _set("do", lambda t, a: t.float()), ValueError, r"do must be \(2, 4, 8, 32\) torch.float16 .*torch.float32"),
    ("do-shape", _set("do", lambda t, a: t[:, :, :5]), ValueError, r"do must be \(2, 4, 8, 32\)"),
    ("out-shape", _set("out", lambda t, a: t[..., :16]), ValueError, r"out must be \(2, 4, 8, 32\)"),
    ("lse-dtype", _set("lse", lambda t, a: t.half()), ValueError, r"lse must be a float32 tensor of shape \(2, 4, 8\)"),
    ("lse-none", _set("lse", lambda t, a: None), ValueError, r"lse must be a float32 tensor"),
    ("dq-is-q", _grads(lambda a, g: (a["q"], g["k"], g["v"])), ValueError, r"dq shares memory with q"),
    ("dq-is-do", _grads(lambda a, g: (a["do"], g["k"], g["v"])), ValueError, r"dq shares memory with do"),
    ("dv-is-dk", _grads(lambda a, g: (g["q"], g["k"], g["k"])), ValueError, r"dv shares memory with dk"),
    ("dq-expanded", _grads(lambda a, g: (g["q"][:, :, :1].expand_as(g["q"]), g["k"], g["v"])), ValueError, r"dq has strides"),
    ("dk-dtype", _grads(lambda a, g: (g["q"], g["k"].float(), g["v"])), ValueError, r"dk must be .* torch.float16"),
    ("lse-on-meta", _set("lse", lambda t, a: t.to("meta")), ValueError, r"lse must be a dense tensor on \w+.*on meta"),
]


def assert_refused(family: Family, spoil, exc, pattern):
    args = family.make()
    spoil(args, family.names)
    with pytest.raises(exc, match=pattern.format(**family.names)) as info:
        family.call(args)
    assert isinstance(info.value, (ValueError, TypeError))


@pytest.mark.parametrize("case", COMMON_CASES + KERNEL_CASES, ids=lambda c: c[0])
def test_kernel_refuses_bad_arguments_before_launch(case, checked_kernel, no_launch):
    assert_refused(_kernel_family(checked_kernel), *case[1:])


@pytest.mark.parametrize("case", COMMON_CASES + SDPA_CASES, ids=lambda c: c[0])
def test_sdpa_refuses_bad_arguments_before_launch(case, no_launch):
    attngen.load(sdpa_spec("fp16", 32, False))  # generated outside the guard; calls must not launch
    assert_refused(_sdpa_family(), *case[1:])


@pytest.fixture(scope="module")
def train_kernel():
    return attngen.load(spec_text("robust_train", 32, "fp16", "causal", heads=4, kv_heads=2,
                                  direction="forward+backward"))


@pytest.fixture(scope="module")
def backward_family(train_kernel) -> Family:
    """Kernel.backward on the output of a real forward (run here, before any launch guard)."""
    q, k, v, do = rand(2, 4, 8, 32), rand(2, 2, 8, 32), rand(2, 2, 8, 32), rand(2, 4, 8, 32)
    out, lse = train_kernel.forward(q, k, v, train_kernel.spec.softmax_scale)
    valid = dict(q=q, k=k, v=v, out=out, lse=lse, do=do)

    def call(a):
        a = dict(a)
        tensors = [a.pop(n) for n in ("q", "k", "v", "out", "lse", "do")]
        return train_kernel.backward(*tensors, **a)

    return Family("backward", lambda: {n: t.clone() for n, t in valid.items()}, call, {n: n for n in valid})


@pytest.mark.parametrize("case", COMMON_CASES + BACKWARD_CASES, ids=lambda c: c[0])
def test_backward_refuses_bad_arguments_before_launch(case, backward_family, no_launch):
    assert_refused(backward_family, *case[1:])


def test_forward_only_kernels_refuse_gradients(checked_kernel, train_kernel, no_launch):
    q, k, v = rand(1, 4, 8, 32), rand(1, 2, 8, 32), rand(1, 2, 8, 32)
    with pytest.raises(ValueError, match="kernel 'robust_checked' is forward-only"):
        checked_kernel.backward(q, k, v, q, torch.zeros(1, 4, 8), q)
    with pytest.raises(ValueError, match="out= and config= are not supported when recording for autograd"):
        train_kernel(q.requires_grad_(), k, v, out=torch.empty_like(q))


def _decode_family() -> Family:
    """attention_with_kvcache on a page pool: q (B, S_q, H, D), pages (num_pages, page_size, H_KV, D)."""
    pool = dict(k_cache=rand(6, 16, 2, 32), v_cache=rand(6, 16, 2, 32))

    def make():
        return dict(q=rand(2, 1, 4, 32), **{n: t.clone() for n, t in pool.items()},
                    cache_seqlens=torch.tensor([20, 5], dtype=torch.int32, device=DEVICE),
                    block_table=torch.tensor([[4, 1], [0, 5]], dtype=torch.int32, device=DEVICE))

    return Family("decode", make, lambda a: attngen.attention_with_kvcache(**a),
                  dict(q="q", k="k_cache", v="v_cache", out="out"))


def _out_view_of(role):
    """out= a view of the memory of the argument playing `role`."""
    def spoil(args, names):
        src = args[names[role]]
        args["out"] = src if src.shape == args[names["q"]].shape else src.reshape(-1)[: args[names["q"]].numel()].view_as(args[names["q"]])
    return spoil


# attention_with_kvcache checks its own layouts (tests/test_decode.py lists those errors); these are
# the cases the shared checks add, and each must be refused before any launch.
DECODE_CASES = [
    ("scale-bool", _kwarg("softmax_scale", True), TypeError, r"softmax_scale must be a Python number, not bool"),
    ("scale-negative", _kwarg("softmax_scale", -1.0), ValueError, r"softmax_scale = -1 is not supported"),
    ("scale-zero", _kwarg("softmax_scale", 0.0), ValueError, r"softmax_scale = 0 is not supported"),
    ("scale-nan", _kwarg("softmax_scale", float("nan")), ValueError, r"softmax_scale must be finite"),
    ("out-is-q", _out_view_of("q"), ValueError, r"out shares memory with q"),
    ("out-in-pool", _out_view_of("v"), ValueError, r"out shares memory with v_cache"),
    ("out-expanded", _kwarg("out", lambda a, n: torch.empty(2, 1, 1, 32, dtype=torch.float16, device=DEVICE).expand(2, 1, 4, 32)),
     ValueError, r"out has strides"),
    ("table-int64", _set("block_table", lambda t, a: t.long()), ValueError, r"block_table must be int32"),
    ("table-on-meta", _set("block_table", lambda t, a: t.to("meta")), ValueError, r"block_table is on meta"),
    ("seqlens-bool", _set("cache_seqlens", lambda t, a: True), TypeError, r"cache_seqlens must be an int32 tensor or an int, not bool"),
    ("seqlens-negative", _set("cache_seqlens", lambda t, a: -1), ValueError, r"cache_seqlens = -1 does not fit"),
    ("q-list", _set("q", lambda t, a: t.tolist()), TypeError, r"q must be a torch.Tensor, not list"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c[0])
def test_decode_refuses_bad_arguments_before_launch(case, no_launch):
    attngen.load(attngen.lang.builtin.kvcache_spec("fp16", 32, True, 16))  # generated outside the guard
    family = _decode_family()
    family.names.update(block_table="block_table", cache_seqlens="cache_seqlens")
    assert_refused(family, *case[1:])


@pytest.mark.parametrize("case", [("sdpa",) + c for c in COMMON_CASES + SDPA_CASES]
                         + [("decode",) + c for c in DECODE_CASES]
                         + [("kernel",) + c for c in COMMON_CASES + KERNEL_CASES], ids=lambda c: f"{c[0]}-{c[1]}")
def test_bad_arguments_are_refused_after_valid_calls_were_planned(case, checked_kernel, monkeypatch):
    """`attngen.attention`, `attention_with_kvcache` and `Kernel.__call__` keep the outcome of a valid call's
    checks per signature (in `attngen.runtime.plans.PLANS`): a call that differs from a planned one in anything
    the checks read is checked afresh and refused, and an out= that aliases an input is refused on a planned
    signature too."""
    from triton.runtime import interpreter, jit

    from attngen.runtime.launch import FastJIT

    which, _, spoil, exc, pattern = case
    if which == "sdpa":
        attngen.load(sdpa_spec("fp16", 32, False))
        family = _sdpa_family()
    elif which == "kernel":
        family = _kernel_family(checked_kernel)
    else:
        attngen.load(attngen.lang.builtin.kvcache_spec("fp16", 32, True, 16))
        family = _decode_family()
        family.names.update(block_table="block_table", cache_seqlens="cache_seqlens")
    kept = empty_plans(monkeypatch)
    launches = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction, FastJIT):
        monkeypatch.setattr(cls, "run", lambda *a, **k: launches.append(1))
    valid = family.make()
    family.call(valid)
    if which != "sdpa":
        family.call(dict(valid, out=torch.empty_like(valid[family.names["q"]])))
    planned = kept.plans({"sdpa": "sdpa", "decode": "kvcache", "kernel": checked_kernel}[which])
    assert launches and len(planned) == len(kept) == (1 if which == "sdpa" else 2)
    if which == "kernel":  # as on a GPU, where a planned signature's replay has been recorded by now (interpreted,
        # none is): a stand-in that launches nothing, which a refused call must not reach
        for plan in planned:
            plan.inference.forward = lambda inputs: launches.append("replay") or True
    launches.clear()
    assert_refused(family, spoil, exc, pattern)
    assert not launches, "a kernel was launched for a call that should have been refused"


@pytest.mark.parametrize("problem,pattern", [
    (lambda a: a["block_table"].__setitem__((0, 1), 6), r"block_table\[0\] names pages outside the pool of 6"),
    (lambda a: a["block_table"].__setitem__((1, 0), -1), r"block_table\[1\] names pages outside the pool"),
    (lambda a: a.__setitem__("cache_seqlens", a["cache_seqlens"] + 13), r"cache_seqlens must lie in \[0, 32\]"),
])
def test_decode_debug_mode_checks_values_before_launch(problem, pattern, no_launch, monkeypatch):
    """Page indices and lengths are the caller's contract (checking them costs a device sync per
    call); ATTNGEN_CHECK_KVCACHE=1 checks them."""
    attngen.load(attngen.lang.builtin.kvcache_spec("fp16", 32, True, 16))
    args = _decode_family().make()
    problem(args)
    monkeypatch.setenv("ATTNGEN_CHECK_KVCACHE", "1")
    with pytest.raises(ValueError, match=pattern):
        attngen.attention_with_kvcache(**args)


@pytest.mark.parametrize("family", ["kernel", "sdpa"])
def test_cpu_tensors_outside_the_interpreter_are_refused(family, checked_kernel, no_launch, monkeypatch):
    fam = _kernel_family(checked_kernel) if family == "kernel" else _sdpa_family()
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in fam.make().items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=f"{fam.names['q']} is on the CPU.*TRITON_INTERPRET=1"):
        fam.call(args)


# -- limits of the decode kernels' grids and 32-bit offsets --------------------------------------------
# Huge shapes cost no memory: stride-0 (expanded) views, or fake tensors (torch's FakeTensorMode: shapes
# and strides without storage) for huge strides. Each case must be refused before any launch.


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _strided(shape, strides, dtype=torch.float16):
    """A tensor with these strides and no storage to speak of (call inside _fake_mode())."""
    return torch.empty_strided(shape, strides, dtype=dtype, device=DEVICE)


def _wide(*shape, dtype=torch.float16):
    """A (possibly huge) expanded view of one element."""
    return torch.zeros((1,) * len(shape), dtype=dtype, device=DEVICE).expand(*shape)


def _decode_args(q, k=None, table=None, **kw):
    k = _wide(6, 16, 2, 32) if k is None else k
    if table is None:
        table = _wide(q.shape[0], 2, dtype=torch.int32)
    lens = _wide(q.shape[0], dtype=torch.int32) if "cache_seqlens" not in kw else kw.pop("cache_seqlens")
    return dict(q=q, k_cache=k, v_cache=k, cache_seqlens=lens, block_table=table, **kw)


# (case id, make the arguments (called inside a fake mode when `fake`), fake, message pattern)
DECODE_LIMIT_CASES = [
    ("batch-x-splits", lambda: _decode_args(_wide(2048, 1, 4, 32), num_splits=64), False,
     r"q has batch 2048 and num_splits = 64: .* 131,072 programs .* at most 65535.* smaller num_splits"),
    ("batch-over-grid", lambda: _decode_args(_wide(70_000, 1, 4, 32)), False, r"q has batch 70000; at most 65535"),
    ("kv-heads-over-grid", lambda: _decode_args(_wide(2, 1, 70_000, 32), k=_wide(6, 16, 70_000, 32)), False,
     r"k_cache has 70000 heads; at most 65535"),
    ("heads-over-merge-grid", lambda: _decode_args(_wide(2, 1, 131_072, 32), num_splits=2), False,
     r"q has 131072 heads; with num_splits = 2 the merge kernel .* at most 65535"),
    ("merge-offsets", lambda: _decode_args(_wide(1, 2**18, 4, 32), num_splits=128), False,
     r"q with num_splits = 128: the merge kernel reads 128 x 4 heads x 262,144 queries .* over 2\*\*31"),
    ("rows", lambda: _decode_args(_wide(1, 2**29, 8, 32)), False,
     r"q has 536,870,912 queries x 4 query heads per K/V head = 2,147,483,648 rows"),
    ("paged-capacity", lambda: _decode_args(_wide(2, 1, 4, 32), table=_wide(2, 2**26 + 1, dtype=torch.int32)), False,
     r"block_table holds 67,108,865 pages of 16 tokens per sequence, 1,073,741,840 key positions; the limit"),
    ("contiguous-capacity", lambda: _decode_args(_wide(2, 1, 4, 32), k=_wide(2, 2**30 + 1, 2, 32), table=False), False,
     r"k_cache holds sequences of up to 1,073,741,825 tokens"),
    # q (batch, seqlen_q, heads, d) with 2**30 between heads: a group of 2 heads spans under 2**31, 4 over.
    ("q-group-offsets", lambda: _decode_args(_strided((1, 1, 4, 32), (2**32, 2**32, 2**30, 1)),
                                             k=_strided((6, 16, 1, 32), (512, 32, 32, 1))), True,
     r"q spans 3,221,225,504 elements within one group of 4 query heads sharing a K/V head .*32-bit"),
    ("pages-slot-offsets", lambda: _decode_args(_strided((2, 1, 4, 32), (128, 128, 32, 1)),
                                                k=_strided((6, 16, 2, 32), (2**40, 2**28, 32, 1))), True,
     r"k_cache spans [\d,]+ elements within one \(page, K/V head\).*32-bit.*k_cache.contiguous\(\)"),
    ("contiguous-cache-offsets", lambda: _decode_args(_strided((2, 1, 4, 32), (128, 128, 32, 1)),
                                                      k=_strided((2, 64, 2, 32), (2**40, 2**26, 32, 1)), table=False),
     True, r"k_cache spans [\d,]+ elements within one \(sequence, K/V head\)"),
    ("block-table-offsets", lambda: _decode_args(_strided((2, 1, 4, 32), (128, 128, 32, 1)),
                                                 table=_strided((2, 3), (1, 2**30), torch.int32)), True,
     r"block_table spans 2,147,483,649 elements within one sequence's row"),
]


@pytest.mark.parametrize("case", DECODE_LIMIT_CASES, ids=lambda c: c[0])
def test_decode_refuses_launches_past_grid_and_offset_limits(case, no_launch):
    """attention_with_kvcache checks what its kernels' grids (partial kernel: row blocks x K/V heads x
    batch*splits; merge kernel: query blocks x heads x batch) and 32-bit offsets can take."""
    _, make, fake, pattern = case
    for page_size in (16, None):
        attngen.load(attngen.lang.builtin.kvcache_spec("fp16", 32, True, page_size))  # generated outside the guard
    with _fake_mode() if fake else contextlib.nullcontext():
        args = make()
        if args["block_table"] is False:
            args["block_table"] = None
        with pytest.raises(attngen.KernelInputError, match=pattern):
            attngen.attention_with_kvcache(**args)


def test_decode_checks_the_span_of_out(no_launch, monkeypatch):
    """out is written like q is read: one group of query heads at 32-bit offsets. (Fake tensors have
    no data pointers to tell apart, so the test says they do not overlap.)"""
    attngen.load(attngen.lang.builtin.kvcache_spec("fp16", 32, True, 16))
    monkeypatch.setattr(attngen.runtime.arguments, "shares_memory", lambda a, b: False)
    with _fake_mode():
        q = _strided((1, 2, 4, 32), (256, 128, 32, 1))
        out = _strided((1, 2, 4, 32), (2**33, 2**31, 32, 1))
        with pytest.raises(attngen.KernelInputError, match=r"out spans [\d,]+ elements within one group of 2 query heads"
                                                            r".*pass a denser out"):
            attngen.attention_with_kvcache(**_decode_args(q, out=out))


def test_decode_limits_are_not_stricter_than_the_kernels(monkeypatch):
    """Page index x page stride is 64-bit in the kernel, so a pool of any size passes; and the
    split count the checks see is the one that is launched (auto included)."""
    from attngen.lang.builtin import kvcache_spec

    module = attngen.load(kvcache_spec("fp16", 32, True, 16)).module
    launched = []
    monkeypatch.setattr(module, "forward_kvcache", lambda *a: launched.append(a[8]))
    with _fake_mode():
        q = _strided((2, 1, 4, 32), (128, 128, 32, 1))
        pool = _strided((6, 16, 2, 32), (2**40, 64, 32, 1))  # pages 2**40 elements apart
        attngen.attention_with_kvcache(**_decode_args(q, k=pool, num_splits=3))
        attngen.attention_with_kvcache(**_decode_args(q, k=pool, num_splits=0))
    assert launched[0] == 3 and 1 <= launched[1] <= 128


def test_packed_and_split_specs_check_their_own_grids(no_launch):
    """Kernel.__call__ on a packed-GQA spec checks the q span of a head group (which a
    (batch, head) kernel never addresses in 32 bits), and a fixed split_kv its batch x splits."""
    packed = attngen.load(spec_text("robust_packed", 32, "fp16", "none", heads=4, kv_heads=1, pack_gqa="true"))
    split = attngen.load(spec_text("robust_split", 32, "fp16", "none", split_kv=4))
    with _fake_mode():
        q = _strided((1, 4, 2, 32), (2**33, 2**30, 32, 1))
        k = _strided((1, 1, 8, 32), (256, 256, 32, 1))
        with pytest.raises(attngen.KernelInputError, match=r"q spans [\d,]+ elements within one group of 4 query heads"):
            packed(q, k, k)
    with pytest.raises(attngen.KernelInputError, match=r"q has batch 20000 and split_kv = 4: .* 80,000 programs"):
        split(_wide(20_000, 1, 1, 32), _wide(20_000, 1, 8, 32), _wide(20_000, 1, 8, 32))


def test_backward_takes_heads_x_queries_past_32_bits(train_kernel, no_launch):
    """The dK/dV kernel loops over the query heads of a K/V head inside one program; that head's
    offset is computed in 64 bits (like every grid coordinate), so a (batch, heads, seq, d) q whose
    heads together span past 2**31 elements is launched, as long as each (batch, head) slice fits."""
    assert "tl.cast(g + hkv*GROUP, tl.int64) * stride_q_h" in train_kernel.source
    with _fake_mode():
        q = torch.empty(1, 4, 2**24 + 1, 32, dtype=torch.float16, device=DEVICE)
        k = torch.empty(1, 2, 2**24 + 1, 32, dtype=torch.float16, device=DEVICE)
        with pytest.raises(AssertionError, match="a kernel was launched"):
            train_kernel.backward(q, k, k, q, torch.empty(1, 4, 2**24 + 1, device=DEVICE), q)


# -- several GPUs ---------------------------------------------------------------------------------------


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """Without GPUs: fake tensors on cuda:0 and cuda:1, a current device that torch.cuda.device(...)
    switches, and a log of the current device at each launch (`launch()` records it)."""
    state = {"current": 0, "switches": 0}

    @contextlib.contextmanager
    def device(d):
        index = torch.device(d).index
        state["switches"] += 1
        saved, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = saved

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    launches = []
    state["launches"] = launches
    state["launch"] = lambda *a, **kw: launches.append(state["current"])
    with _fake_mode():
        yield state


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2,
                    reason="fake tensors on cuda:1 need no GPU (all fake) or two real ones")
@pytest.mark.parametrize("gpu", [1, 0])
def test_tensors_on_another_gpu_launch_on_that_gpu(gpu, checked_kernel, train_kernel, two_fake_gpus, monkeypatch):
    """A CUDA tensor need not be on the current device (a drop-in for SDPA must work on cuda:1): every
    launch path switches to the tensors' device, and only when it is not the current one."""
    from attngen.lang.builtin import kvcache_spec

    state = two_fake_gpus
    dev = f"cuda:{gpu}"
    decode = attngen.load(kvcache_spec("fp16", 32, True, 16)).module
    for module, name in ((checked_kernel.module, "forward"), (train_kernel.module, "backward"),
                         (decode, "forward_kvcache")):
        monkeypatch.setattr(module, name, state["launch"])
    q, k = torch.empty(2, 4, 8, 32, dtype=torch.float16, device=dev), torch.empty(2, 2, 8, 32, dtype=torch.float16, device=dev)
    checked_kernel(q, k, k)
    lse = torch.empty(2, 4, 8, device=dev)
    train_kernel.backward(q, k, k, q, lse, q)
    pool = torch.empty(6, 16, 2, 32, dtype=torch.float16, device=dev)
    table = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    attngen.attention_with_kvcache(q.transpose(1, 2), pool, pool, torch.zeros(2, dtype=torch.int32, device=dev), table,
                                   num_splits=2)
    cache = attngen.PagedKVCache(4, 16, 2, 32, torch.float16, dev)
    monkeypatch.setattr(attngen.api.paged, "_append_kv", {(1,): state["launch"]})
    cache.append(cache.new_sequence(), torch.empty(3, 2, 32, dtype=torch.float16, device=dev),
                 torch.empty(3, 2, 32, dtype=torch.float16, device=dev))
    assert state["launches"] == [gpu] * 4
    assert state["current"] == 0 and state["switches"] == (4 if gpu else 0)  # restored; no switch on cuda:0
    # Still one device per call.
    with pytest.raises(attngen.KernelInputError, match=r"q, k and v must be on one device; got cuda:1, cuda:0"):
        checked_kernel(q.to("cuda:1"), k.to("cuda:0"), k.to("cuda:1"))
    with pytest.raises(attngen.KernelInputError, match=r"k_cache is on cuda:0 but q is on cuda:1"):
        attngen.attention_with_kvcache(q.transpose(1, 2).to("cuda:1"), pool.to("cuda:0"), pool.to("cuda:1"), 0,
                                       table.to("cuda:1"))
    assert len(state["launches"]) == 4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_attention_and_decoding_on_cuda1_while_cuda0_is_current():
    torch.cuda.set_device(0)
    gen = torch.Generator("cuda:1").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 300, 64, generator=gen, device="cuda:1", dtype=torch.float16) for _ in range(3))
    q.requires_grad_()
    out = attngen.attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.device == q.device and (out.float() - ref).abs().max().item() < 2e-2
    out.sum().backward()
    assert q.grad.device == q.device and torch.isfinite(q.grad).all()
    with torch.no_grad():
        dec = attngen.attention_with_kvcache(q[:, :, -1:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 300)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:].float(), k.float(), v.float())
    assert (dec.transpose(1, 2).float() - ref).abs().max().item() < 2e-2
    cache = attngen.PagedKVCache(8, 64, 8, 64, torch.float16, "cuda:1")
    s = cache.new_sequence()
    cache.append(s, k[0].transpose(0, 1), v[0].transpose(0, 1))
    stored = reference.gather_cache(cache.k_pages.cpu(), 300, cache.block_table([s], device="cpu")[0])
    assert torch.equal(stored, k[0].transpose(0, 1).cpu())
    assert torch.cuda.current_device() == 0


def test_valid_call_does_launch(checked_kernel, monkeypatch):
    """The guard above is real: the unspoilt arguments do reach a launch."""
    from triton.runtime import interpreter, jit

    from attngen.runtime.launch import FastJIT

    def launched(*args, **kwargs):
        raise RuntimeError("launched")

    monkeypatch.setattr(jit.JITFunction, "run", launched)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", launched)
    monkeypatch.setattr(FastJIT, "run", launched)
    fam = _kernel_family(checked_kernel)
    with pytest.raises(RuntimeError, match="launched"):
        fam.call(fam.make())


def test_empty_dimensions_return_without_launch(checked_kernel, no_launch):
    out, lse = checked_kernel(rand(0, 4, 8, 32), rand(0, 2, 8, 32), rand(0, 2, 8, 32), return_lse=True)
    assert out.shape == (0, 4, 8, 32) and lse.shape == (0, 4, 8)
    out = checked_kernel(rand(2, 4, 0, 32), rand(2, 2, 8, 32), rand(2, 2, 8, 32))
    assert out.shape == (2, 4, 0, 32)


def test_accepted_unusual_arguments_compute_the_right_thing(checked_kernel):
    """What is not refused must be right: numpy and int scales, the smallest scale,
    stride-0 (expanded) inputs, and an output with free strides that overlaps nothing."""
    q = rand(1, 4, 1, 32).expand(1, 4, 24, 32)                      # every query row the same
    k, v = rand(1, 2, 1, 32).expand(1, 2, 40, 32), rand(1, 2, 40, 32)
    out = torch.full((1, 24, 4, 32), float("nan"), dtype=torch.float16, device=DEVICE).transpose(1, 2)
    for scale in (np.float32(0.3), 2, MIN_SCALE):
        out.fill_(float("nan"))
        got, lse = checked_kernel(q, k, v, scale=scale, out=out, return_lse=True)
        assert got.data_ptr() == out.data_ptr()
        result = compare(checked_kernel.spec, Case(1, 4, 2, 24, 40), got, lse, q, k, v, scale=float(scale))
        assert result.ok, (scale, result)


# -- numerics at the edges ------------------------------------------------------------------------------

# Small in the interpreter; the same tests at real sizes on a GPU.
SIZES = [pytest.param(dict(b=1, h=2, n=40, d=32), id="small"),
         pytest.param(dict(b=2, h=8, n=1500, d=128), id="gpu", marks=pytest.mark.gpu)]


def run(kernel, q, k, v, **kw):
    out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element shows
    return kernel(q, k, v, out=out, return_lse=True, **kw)


_MASK_TAGS = {"none": "full", "causal": "tl", "causal(top_left)": "tl", "causal(bottom_right)": "br"}


def load(name, d, dtype="fp16", mask="causal"):
    return attngen.load(spec_text(f"edge_{name}_d{d}_{dtype}_{_MASK_TAGS[mask]}", d, dtype, mask))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_fully_masked_rows_are_zero_with_lse_minus_inf(size, dtype):
    """Bottom-right causal with more queries than keys: the first n_q - n_k queries see no key."""
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("masked", d, dtype, "causal(bottom_right)")
    dt = DType(dtype).torch
    n_k = n // 3 + 1
    q, k, v = rand(b, h, n, d, dtype=dt), rand(b, h, n_k, d, dtype=dt), rand(b, h, n_k, d, dtype=dt)
    out, lse = run(kernel, q, k, v)
    dead = n - n_k
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[:, :, :dead] == 0).all() and torch.isneginf(lse[:, :, :dead]).all()
    assert torch.isfinite(lse[:, :, dead:]).all()
    result = compare(kernel.spec, Case(b, h, h, n, n_k), out, lse, q, k, v)
    assert result.ok, result


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mask", ["none", "causal(top_left)", "causal(bottom_right)"])
def test_no_keys_at_all(size, mask):
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("nokeys", d, "fp16", mask)
    out, lse = run(kernel, rand(b, h, n, d), rand(b, h, 0, d), rand(b, h, 0, d))
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("logit", [1e3, 1e4])
def test_fp16_large_logits_stay_finite_and_accurate(size, logit):
    """Inputs scaled so the largest |score| is about `logit`: the scores live in fp32 inside the
    kernel, so nothing overflows, and the error stays within what an fp32 computation makes."""
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("large", d, "fp16", "causal")
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE) for _ in range(3))
    grow = math.sqrt(logit / ((q @ k.transpose(-1, -2)).abs().max().item() * d ** -0.5))
    q, k, v = (q * grow).half(), (k * grow).half(), v.half()
    out, lse = run(kernel, q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max().item() > logit / 4  # the scores really are large
    ref, ref_lse = reference.attention(q, k, v, Mask.CAUSAL_TOP_LEFT)
    low, low_lse = reference.attention(q, k, v, Mask.CAUSAL_TOP_LEFT, dtype=torch.float32)
    err, low_err = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert err <= FUDGE * low_err + ATOL[DType.FP16], (err, low_err)
    lse_err, low_lse_err = (lse.double() - ref_lse).abs().max().item(), (low_lse.double() - ref_lse).abs().max().item()
    assert lse_err <= FUDGE * low_lse_err + ATOL[DType.FP16], (lse_err, low_lse_err)


def test_validation_measures_huge_scores_against_fp32():
    """With scale 1e4 the scores pass fp16's range: the same-precision baseline of `validate` would
    overflow, leaving a NaN (always failing) or inf (never failing) tolerance."""
    kernel = attngen.load(spec_text("edge_huge_scale", 16, "fp16", "causal", scale="1e4"))
    for result in validate(kernel, [Case(1, 2, 2, 13, 29)], seed=0):
        assert math.isfinite(result.tol) and math.isfinite(result.lse_tol) and result.ok, result


def _rows_with_nonfinite(out):
    """(b, h, row) indices of rows with any non-finite element."""
    return {tuple(i) for i in (~torch.isfinite(out)).any(-1).nonzero().tolist()}


def assert_finite_rows_correct(out, lse, ref, ref_lse):
    finite = torch.isfinite(out).all(-1)
    assert torch.equal(finite, torch.isfinite(lse) | torch.isneginf(lse)), "out and lse disagree on bad rows"
    err = (out.double() - ref)[finite].abs().max().item() if finite.any() else 0.0
    assert err < 1e-2, err
    lse_err = (lse.double() - ref_lse)[finite & torch.isfinite(ref_lse)].abs().max().item() if finite.any() else 0.0
    assert lse_err < 1e-2, lse_err


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_query_row_poisons_that_row_only(size, bad):
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("qnan", d, "fp16", "causal")
    q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    row = n // 2 + 1
    q[0, 1, row, 3] = bad
    out, lse = run(kernel, q, k, v)
    assert _rows_with_nonfinite(out) == {(0, 1, row)}
    assert not torch.isfinite(lse[0, 1, row])
    ref, ref_lse = reference.attention(q, k, v, Mask.CAUSAL_TOP_LEFT)
    assert_finite_rows_correct(out, lse, ref, ref_lse)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mask", ["causal(top_left)", "causal(bottom_right)"])
def test_nan_in_a_key_reaches_exactly_the_rows_that_see_it(size, mask):
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("knan", d, "fp16", mask)
    n_q, n_k = n, n + 7
    q, k, v = rand(b, h, n_q, d), rand(b, h, n_k, d), rand(b, h, n_k, d)
    j = n_k // 2
    k[:, :, j, 5] = float("nan")
    out, lse = run(kernel, q, k, v)
    keep = reference.causal_keep(n_q, n_k, Mask(mask), q.device)
    sees = {(bi, hi, i) for bi in range(b) for hi in range(h) for i in range(n_q) if keep[i, j]}
    assert sees and len(sees) < b * h * n_q  # some rows see key j, some do not
    assert _rows_with_nonfinite(out) == sees
    ref, ref_lse = reference.attention(q, k, v, Mask(mask))
    assert_finite_rows_correct(out, lse, ref, ref_lse)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_value_poisons_rows_that_see_it_and_never_corrupts_silently(size, bad):
    """A non-finite V[j] makes every row that sees key j non-finite. Rows that do not see it but
    share its tiles may turn NaN as well (0 * inf in the P V product, as in FlashAttention; PyTorch's
    math SDPA turns every row NaN); rows whose query tile ends before key j's tile never do, and no
    row is ever finite but wrong. Where the module has the Gluon forward (Hopper, at this size), both
    kernels: the Triton one at 16 x 16 tiles, the Gluon one at its fixed shape."""
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = load("vnan", d, "fp16", "causal")
    q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    j = n // 2 + 3
    clean_v = v.clone()
    v[:, :, j, 7] = bad
    # Rows that stay finite are right: compare with the same inputs where V[j] is finite (it has
    # weight 0 in every such row).
    clean_v[:, :, j] = 0
    ref, ref_lse = reference.attention(q, k, clean_v, Mask.CAUSAL_TOP_LEFT)
    runs = [(dict(BLOCK_M=16, BLOCK_N=16, num_warps=4), 16, 16)]  # (config, query rows, keys) of a tile
    gluon = kernel.program.warp_specialized.forward
    if gluon is not None:
        runs = [(dict(runs[0][0], warp_specialized=False), 16, 16), ({}, gluon.main.block_m, gluon.main.block_n)]
    for config, block_m, block_n in runs:
        out, lse = run(kernel, q, k, v, config=config)
        bad_rows = _rows_with_nonfinite(out)
        sees = {(bi, hi, i) for bi in range(b) for hi in range(h) for i in range(j, n)}
        assert sees <= bad_rows
        assert all(i // block_m * block_m + block_m > j // block_n * block_n for _, _, i in bad_rows), config
        finite = torch.isfinite(out).all(-1)
        assert (out.double() - ref)[finite].abs().max().item() < 1e-2


def _train(name, d, mask="causal"):
    return attngen.load(spec_text(f"edge_train_{name}_d{d}_{_MASK_TAGS[mask]}", d, "fp16", mask,
                                  direction="forward+backward"))


@pytest.mark.parametrize("size", SIZES)
def test_backward_of_fully_masked_rows_is_zero(size):
    b, h, n, d = size["b"], size["h"], size["n"], size["d"]
    kernel = _train("masked", d, "causal(bottom_right)")
    n_k = n // 3 + 1
    q, k, v, do = rand(b, h, n, d), rand(b, h, n_k, d), rand(b, h, n_k, d), rand(b, h, n, d)
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale)
    poisoned = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv = kernel.backward(q, k, v, out, lse, do, grads=poisoned)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert (dq[:, :, : n - n_k] == 0).all()
    results = compare_grads(kernel.spec, q, k, v, do, (dq, dk, dv))
    assert all(r.ok for r in results), results
    dq, dk, dv = kernel.backward(q, k[:, :, :0], v[:, :, :0], torch.zeros_like(q), torch.full_like(lse, -math.inf), do)
    assert (dq == 0).all() and dk.shape == (b, h, 0, d)


@pytest.mark.parametrize("size", [pytest.param(dict(b=1, h=2, n=80, d=32, block=16), id="small"),
                                  pytest.param(dict(b=2, h=8, n=1500, d=128, block=64), id="gpu", marks=pytest.mark.gpu)])
def test_backward_nan_query_row(size):
    """A NaN in query row i: dq is NaN in row i only; dK and dV are NaN for every key row i sees,
    may be NaN for other keys of the tiles row i's tile visits, are finite beyond them, and are
    right wherever finite."""
    b, h, n, d, block = size["b"], size["h"], size["n"], size["d"], size["block"]
    kernel = _train("qnan", d)
    q, k, v, do = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    i = block + 4
    clean_q = q.clone()
    q[0, 1, i, 2] = float("nan")
    tiles = {name: dict(BLOCK_M=block, BLOCK_N=block, num_warps=4) for name in ("attn_bwd_dq", "attn_bwd_dkdv")}
    out, lse = kernel.forward(q, k, v, kernel.spec.softmax_scale, config=dict(BLOCK_M=block, BLOCK_N=block, num_warps=4))
    dq, dk, dv = kernel.backward(q, k, v, out, lse, do, config=tiles)
    assert _rows_with_nonfinite(dq) == {(0, 1, i)}
    seen = {(0, 1, j) for j in range(i + 1)}
    for g in (dk, dv):
        bad = _rows_with_nonfinite(g)
        assert seen <= bad and all(hi == 1 and j < (i // block + 1) * block for _, hi, j in bad), bad
    # Finite entries are right: row i's query does not reach them, so zeroing it changes nothing there.
    clean_q[0, 1, i] = 0
    clean_out, clean_lse = kernel.forward(clean_q, k, v, kernel.spec.softmax_scale)
    leaves = [t.double().requires_grad_() for t in (clean_q, k, v)]
    ref, _ = reference.attention(*leaves, Mask.CAUSAL_TOP_LEFT, kernel.spec.softmax_scale)
    ref.backward(do.double())
    for got, want in zip((dq, dk, dv), (t.grad for t in leaves)):
        finite = torch.isfinite(got).all(-1)
        assert (got.double() - want)[finite].abs().max().item() < 2e-2


DECODE_SIZES = [pytest.param(dict(lengths=[0, 37, 16, 1], page=16, h=4, h_kv=2, d=32, s_q=2), id="small"),
                # on Hopper, paged: the Gluon kernel, pages as large as its blocks (64 keys), then smaller
                # (a last block's entries past the sequence's pages read page 0); then 68 query rows per
                # K/V head, more than the Gluon kernel takes: the Triton kernel
                pytest.param(dict(lengths=[0, 4093, 1024, 1], page=64, h=32, h_kv=8, d=128, s_q=3), id="gpu",
                             marks=pytest.mark.gpu),
                pytest.param(dict(lengths=[0, 4093, 1000, 1], page=16, h=32, h_kv=8, d=128, s_q=1), id="gpu-page16",
                             marks=pytest.mark.gpu),
                pytest.param(dict(lengths=[0, 4093, 1000, 17], page=16, h=8, h_kv=2, d=64, s_q=17), id="gpu-68-rows",
                             marks=pytest.mark.gpu)]


@pytest.mark.parametrize("size", DECODE_SIZES)
@pytest.mark.parametrize("paged", [True, False])
def test_cache_garbage_beyond_the_lengths_never_leaks(size, paged):
    """Every cache slot no sequence owns is NaN: pages outside the block table (page 0 among them),
    slots past cache_seqlens in a last page, a contiguous cache past each length. The output is
    exactly right anyway; a zero-length sequence gives 0 and lse -inf; nothing is NaN."""
    lengths, page, h, h_kv, d, s_q = (size[k] for k in ("lengths", "page", "h", "h_kv", "d", "s_q"))
    batch = len(lengths)
    per_seq = max(-(-n // page) for n in lengths)
    q = rand(batch, s_q, h, d)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if paged:
        pool = torch.full((batch * per_seq + 3, page, h_kv, d), float("nan"), dtype=torch.float16, device=DEVICE)
        k_cache, v_cache = pool, pool.clone()
        order = 1 + torch.randperm(pool.shape[0] - 1, device=DEVICE)[: batch * per_seq].view(batch, per_seq)
        table = order.to(torch.int32)
        for b, n in enumerate(lengths):
            for i in range(n):
                for pool_ in (k_cache, v_cache):
                    pool_[order[b, i // page], i % page] = rand(h_kv, d)
    else:
        k_cache = torch.full((batch, per_seq * page, h_kv, d), float("nan"), dtype=torch.float16, device=DEVICE)
        v_cache = k_cache.clone()
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = rand(n, h_kv, d), rand(n, h_kv, d)
        table = None
    out = torch.full_like(q, float("nan"))
    out, lse = attngen.attention_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, return_softmax_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    ref, ref_lse = reference.kvcache_attention(q, k_cache, v_cache, seqlens.cpu(), None if table is None else table.cpu())
    assert (out[1:].double() - ref[1:]).abs().max().item() < 1e-2
    # Rows with no visible key (more queries than keys, bottom-right) have lse -inf in both.
    got, want = lse[1:].double(), ref_lse[1:].to(lse.device)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert (got[finite] - want[finite]).abs().max().item() < 1e-2


# -- the disk cache -------------------------------------------------------------------------------------


def _fresh_spec_text(tag):
    return spec_text(f"cache_{tag}_{uuid.uuid4().hex[:8]}", 32, "fp16", "causal")


def _generate(text):
    from attngen.codegen import render
    from attngen.passes import compile_program
    from attngen.lang.spec import parse

    spec = parse(text)
    return spec, render(spec, compile_program(spec))


DAMAGE = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2]),
    "bit-flipped": lambda path: path.write_bytes(_flip(path.read_bytes(), 777)),
    "emptied": lambda path: path.write_bytes(b""),
    "not-utf8": lambda path: path.write_bytes(path.read_bytes() + b"\xff\xfe"),
    "sidecar-missing": lambda path: path.with_name(path.name + ".sha256").unlink(),
    "sidecar-garbage": lambda path: path.with_name(path.name + ".sha256").write_text("0" * 64),
    "sidecar-truncated": lambda path: path.with_name(path.name + ".sha256").write_text("ab"),
}


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1:]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_cache_entries_are_detected_and_rebuilt(damage, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec, source = _generate(_fresh_spec_text(damage.replace("-", "_")))
    canonical = spec.canonical()
    path, _ = cache.cached_source(spec.name, canonical, lambda: source)
    DAMAGE[damage](path)
    with pytest.warns(cache.CacheWarning, match="damaged") as record:
        again, text = cache.cached_source(spec.name, canonical, lambda: source)
    assert again == path and text == source
    assert ("missing" in str(record[0].message)) == (damage == "sidecar-missing")
    assert path.read_text() == source and cache.read_verified(path) == source
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # repaired: the next reader is silent
        assert cache.cached_source(spec.name, canonical, lambda: "unused")[1] == source


def test_unwritable_cache_directory_falls_back_to_a_private_one(tmp_path, monkeypatch):
    """A cache directory below a regular file cannot be created, even by root (chmod would not
    stop root): attngen warns once and uses its own temporary directory."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache._fallback_warned.clear()
    with pytest.warns(cache.CacheWarning, match="not writable"):
        kernels = cache.cache_dir("kernels")
    assert kernels.is_dir() and str(kernels).startswith(str(tmp_path / "tmp"))
    assert (kernels.parent.stat().st_mode & 0o777) == 0o700
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per directory
        assert cache.cache_dir("kernels") == kernels
    spec, source = _generate(_fresh_spec_text("fallback"))
    path, text = cache.cached_source(spec.name, spec.canonical(), lambda: source)
    assert path.is_relative_to(kernels) and cache.read_verified(path) == source


@pytest.mark.parametrize("planted", ["open-to-others", "symlink"])
def test_fallback_refuses_a_directory_others_could_have_planted(planted, tmp_path, monkeypatch):
    """Whoever can write `<tmp>/attngen-<uid>` chooses the code attngen imports from it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(cache.tempfile, "gettempdir", lambda: str(tmp))
    shared = tmp / f"attngen-{os.getuid()}"
    if planted == "symlink":
        (tmp_path / "elsewhere").mkdir()
        shared.symlink_to(tmp_path / "elsewhere")
    else:
        shared.mkdir()
        shared.chmod(0o777)
    chosen = cache._private_fallback("kernels")
    assert not chosen.is_relative_to(shared) and not chosen.is_relative_to(tmp_path / "elsewhere")
    assert (chosen.stat().st_mode & 0o077) == 0


def test_unwritable_entry_falls_back_with_a_warning(tmp_path, monkeypatch):
    """The directory is fine but the entry cannot be written (here a file sits where the entry's
    folder goes): the module is kept in a private temporary folder instead."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec, source = _generate(_fresh_spec_text("entry"))
    path = cache.generated_path(spec.name, spec.canonical())
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    path.parent.write_text("in the way")
    with pytest.warns(cache.CacheWarning, match="cannot write"):
        fallback, text = cache.cached_source(spec.name, spec.canonical(), lambda: source)
    assert fallback != path and text == source and cache.read_verified(fallback) == source


LOADER = """
import os, sys, time
import attngen, torch
from attngen.env import interpreting
ready, count = sys.argv[2], int(sys.argv[3])
if count > 1:  # a barrier: every process has imported torch before any of them loads the spec
    open(os.path.join(ready, str(os.getpid())), "w").close()
    deadline = time.time() + 60
    while len(os.listdir(ready)) < count and time.time() < deadline:
        time.sleep(0.005)
kernel = attngen.load(sys.argv[1])
q = torch.randn(1, 2, 5, 32, device="cpu" if interpreting() else "cuda").half()
out = kernel(q, q, q)
assert torch.isfinite(out).all()
print(kernel.path, kernel.source.count(chr(10)))
"""


def _loaders(cache_dir, text, count=1):
    ready = cache_dir.parent / f"ready-{uuid.uuid4().hex[:8]}"
    ready.mkdir()
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="0" if HAS_GPU else "1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    procs = [subprocess.Popen([sys.executable, "-c", LOADER, text, str(ready), str(count)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for _ in range(count)]
    outputs = [p.communicate(timeout=180) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outputs)]


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Four processes that loaded one never-seen spec into one empty cache at the same moment."""
    cache_dir = tmp_path_factory.mktemp("raced") / "cache"
    cache_dir.mkdir()
    text = _fresh_spec_text("race")
    return cache_dir, text, _loaders(cache_dir, text, count=4)


def test_concurrent_processes_share_one_consistent_file(raced):
    """All succeed, none mistakes another's write for damage, and one file with its hash remains."""
    cache_dir, text, results = raced
    for r in results:
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr and "CacheWarning" not in r.stderr, r.stderr
    assert len({r.stdout for r in results}) == 1
    entries = sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)  # Python's own bytecode cache
    name = attngen.parse(text).name
    assert [e.name for e in entries] == [f"{name}.py", f"{name}.py.sha256"], entries
    assert cache.read_verified(cache_dir / entries[0]) == _generate(text)[1]


def test_damaged_file_is_rebuilt_by_the_next_process(raced):
    """End to end: a process finds a bit-flipped module from earlier ones, warns, rebuilds it, and
    runs the rebuilt kernel."""
    cache_dir, text, results = raced
    path = cache.Path(results[0].stdout.split()[0])
    path.write_bytes(_flip(path.read_bytes(), 500))
    (again,) = _loaders(cache_dir, text)
    assert again.returncode == 0, again.stderr
    assert "damaged (content hash mismatch)" in again.stderr and "Traceback" not in again.stderr
    assert again.stdout == results[0].stdout and cache.read_verified(path) is not None
