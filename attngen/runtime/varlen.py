"""Calling a varlen kernel (`layout = varlen`): packed variable-length sequences.

`Kernel.__call__` of a varlen spec comes here (`call`): q (TOTAL_Q, H, D), k and v (TOTAL_K, H_KV, D) or page
pools (NUM_PAGES, PAGE_SIZE, H_KV, D), int32 cu_seqlens_q / cu_seqlens_k (B + 1,), optional seqused_k (B,) and
block_table (B, MAX_PAGES). Everything is checked on the host from shapes, dtypes and devices before any launch
(a `KernelInputError`, i.e. a ValueError, naming the argument; a missing or unknown keyword is a TypeError); the
values of cu_seqlens are not read here (that needs a copy from the GPU: the API's job). `forward` and `backward`
run the generated module's `forward_varlen` / `backward_varlen` (`Kernel.varlen_forward` / `varlen_backward`, which
attngen's autograd and custom ops call by kernel key), each launch with the config tuned for the call's `keys.Packed`
bucket (attngen/runtime/tables.py; the policy's default where nobody tuned one).
"""

from __future__ import annotations

import numbers

import torch

from ..errors import KernelInputError
from ..lang.spec import Spec
from ..policy import mixed
from ..policy.splits import multiprocessors
from . import autograd, tables, warmup
from .arguments import (INT32_MAX, _runtime_device_ok, check_head_dim, check_heads, check_like, check_out,
                        check_recording, check_runtime_tensors, new_output, output_shape, check_scale, check_span, check_tensor, on_other_gpu)
from .keys import Packed
from .parts import PARTS


def call(kernel, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
         block_table=None, scale=None, return_lse: bool = False, out=None, config: dict | None = None, **tensors):
    """The varlen form of `Kernel.__call__`: returns out (like q), or (out, lse) with `return_lse`, lse (H, TOTAL_Q)
    float32. Recorded for autograd when q, k, v or the sinks require grad (forward+backward specs, not paged).
    max_seqlen_q / max_seqlen_k are checked to be integers and otherwise only describe the call: the grid
    follows the tokens (cdiv(TOTAL_Q, BLOCK_M) + B tiles a head)."""
    spec = kernel.spec
    arguments(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table)
    batch = cu_seqlens_q.shape[0] - 1
    extra = check_runtime_tensors(spec, q, tensors, batch=batch) if tensors or kernel.tensor_names else ()
    sm_scale = check_scale(scale, spec)
    seqlens_k = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    grad = autograd.needs_grad(q, k, v, *extra)
    check_recording(spec, grad, torch.compiler.is_compiling(), out, config)
    if grad or torch.compiler.is_compiling():
        if block_table is not None:  # (grad is refused above: a paged spec has no backward)
            raise KernelInputError("torch.compile does not trace a paged varlen kernel yet: call it outside the "
                                   "compiled region")
        out, lse = autograd.varlen_forward(kernel.key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, sm_scale, extra)
    else:
        if out is not None:
            check_out(out, q, inputs={"q": q, "k": k, "v": v}, shape=output_shape(q, v))
        out, lse = forward(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, sm_scale, out=out,
                           config=config, tensors=extra, max_seqlens=(max_seqlen_q, max_seqlen_k))
    return (out, lse) if return_lse else out


def arguments(spec: Spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
              block_table=None) -> None:
    """Every tensor's shape, dtype and device against the spec and each other (not the cu_seqlens' values)."""
    paged = spec.kv_layout.paged
    for name, t in (("q", q), ("k", k), ("v", v)):
        dims, layout = (4, "(pages, page_size, kv_heads, head_dim)") if paged and name != "q" else \
            (3, "(total_tokens, heads, head_dim)")
        check_tensor(name, t, dims, layout)
        if t.dtype != spec.dtype.torch:
            raise KernelInputError(f"{name} has dtype {t.dtype}; kernel '{spec.name}' takes {spec.dtype.torch}")
        check_head_dim(spec, name, t, value=name == "v")
        _runtime_device_ok(name, t)
        # Rows inside a sequence (a page) and the head dim are addressed with 32-bit offsets (the sequence's first
        # row, the page and the head in 64 bits): a sequence can be as long as the tensor.
        pages = paged and name != "q"
        rows, s_rows = (t.shape[1], t.stride(1)) if pages else (t.shape[0], t.stride(0))
        check_span(name, t, (rows, t.shape[-1]), (s_rows, t.stride(-1)),
                   "one page of one head" if pages else "one sequence's rows of one head",
                   "make the token dimension denser or split the batch")
    if not (q.device == k.device == v.device):
        raise KernelInputError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise KernelInputError(f"k and v must have the same shape but for the head dim; got {tuple(k.shape)} and "
                               f"{tuple(v.shape)}")
    if paged and k.shape[1] != spec.kv_layout.page_size:
        raise KernelInputError(f"k and v have pages of {k.shape[1]} tokens; kernel '{spec.name}' takes page_size = "
                               f"{spec.kv_layout.page_size}")
    check_heads(spec, q.shape[1], k.shape[-2], "q", "k")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _int32(name, t, 1, q.device)
        if t.shape[0] < 1:
            raise KernelInputError(f"{name} must hold batch + 1 offsets, the first 0; it is empty")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise KernelInputError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has {batch + 1}: "
                               "both hold batch + 1 offsets")
    if seqused_k is not None:
        _int32("seqused_k", seqused_k, 1, q.device)
        if seqused_k.shape[0] != batch:
            raise KernelInputError(f"seqused_k must have shape ({batch},), one length per sequence; "
                                   f"got {tuple(seqused_k.shape)}")
    if paged:
        if block_table is None:
            raise TypeError(f"kernel '{spec.name}' keeps K/V in pages: it needs block_table=")
        _int32("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise KernelInputError(f"block_table must have one row per sequence ({batch}); got shape "
                                   f"{tuple(block_table.shape)}")
    elif block_table is not None:
        raise KernelInputError(f"block_table is for a paged kernel; kernel '{spec.name}' has kv_layout = contiguous")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be a Python int, not {type(n).__name__}")
        if not 0 <= n <= INT32_MAX:
            raise KernelInputError(f"{name} = {n} is out of range; expected 0 to {INT32_MAX}")


def _int32(name: str, t, dims: int, device) -> None:
    check_tensor(name, t, dims, "of int32")
    if t.dtype != torch.int32:
        raise KernelInputError(f"{name} must be int32; got {t.dtype}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}; q is on {device}")


def forward(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, scale: float, out=None,
            config: dict | None = None, tensors: tuple = (), max_seqlens: tuple[int, int] | None = None, lse=None):
    """(out, lse) of checked inputs; no autograd. `seqlens_k`: the keys each sequence uses (B,) int32.
    `max_seqlens` (max_seqlen_q, max_seqlen_k): where given, a mixed spec's call (paged) schedules its short
    sequences by the policy (attngen/policy/mixed.py); without them the wide kernel runs alone. `out` and `lse`
    (H, TOTAL_Q) float32: tensors to write into, else allocated here."""
    if on_other_gpu(q):
        with torch.cuda.device(q.device):
            return forward(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, scale, out, config,
                           tensors, max_seqlens, lse)
    out = new_output(q, v) if out is None else out
    if lse is None:
        lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
    shape = Packed.of(q, k, cu_seqlens_q, block_table)
    launch = dict(tables.launch_config(kernel, shape, q.device.index), **(config or {}))
    steps = {}
    # NOTE: the module's constants, not kernel.program: a module loaded from the disk cache would rebuild its
    # program (~0.5 s) at its first call. NARROW_CONFIG is in the modules the mixed pass gave narrow kernels.
    if max_seqlens is not None and getattr(kernel.module, "NARROW_CONFIG", None) is not None:
        plan = mixed.schedule(seqlens_k.shape[0], q.shape[1], k.shape[-2], *max_seqlens, multiprocessors(q.device),
                              min(launch["BLOCK_N"], getattr(kernel.module, "MAX_BLOCK_N", launch["BLOCK_N"])))
        steps = dict(narrow_m=plan.narrow_m, num_splits=plan.num_splits, max_seqlen_q=max_seqlens[0])
    warmup.wait()
    kernel.module.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, scale, out=out, lse=lse,
                                 config=launch, **kernel._keywords(tensors), **steps)
    return out, lse


def backward(kernel, q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale: float, tensors: tuple = (),
             grads: tuple | None = None):
    """(dq, dk, dv), and the sinks' gradient in their dtype last where the spec has sinks; `do` is checked.
    `grads`: (dq, dk, dv) laid out as q, k and v to write into (every row is written), else allocated here."""
    check_like(do, q, "do", output_shape(q, v))
    if on_other_gpu(q):
        with torch.cuda.device(q.device):
            return backward(kernel, q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors,
                            grads)
    shape = Packed.of(q, k, cu_seqlens_q)
    launch = {name: tables.launch_config(kernel.part(name), shape, q.device.index) for name in PARTS}
    warmup.wait()
    given = {} if grads is None else dict(zip(("dq", "dk", "dv"), grads))
    grads = kernel.module.backward_varlen(q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale,
                                          config=launch, **given, **kernel._keywords(tensors))
    sinks = dict(zip(kernel.tensor_names, tensors)).get("sinks")
    return grads if sinks is None else grads[:3] + (grads[3].to(sinks.dtype),)
