"""The drop-in for flash-attn's `flash_attn_varlen_func`: packed sequences of different lengths in one call.

q (total_q, H, D) and k, v (total_k, H_KV, D) hold the batch's sequences one after another; int32
`cu_seqlens_q` / `cu_seqlens_k` (B + 1,) say where each starts. K and V may instead be a paged pool
(num_pages, page_size, H_KV, D) read through `block_table` (B, pages per sequence). Each combination of
dtype, head dim, GQA grouping, mask, variant and page size is one builtin spec (lang/builtin.py's `varlen_spec`,
registry key `varlen_key`) whose kernel the call runs; the kernel's autograd makes the call differentiable
(not paged).

The arguments' shapes and dtypes are checked at the first call of a signature (`signature_of`: every tensor's layout
and the other arguments), whose plan later calls take, from their second on replaying the launches (as
`attngen.attention` does; attngen/runtime/replay.py). Their values (cu_seqlens monotonic from 0 and within
the packed tensors, max_seqlen at least every sequence's length, seqused_k and block_table in range) need the
tensors on the host: they are checked when the tensors are on the CPU, and on a GPU only under
ATTNGEN_CHECK_KVCACHE=1 (a debug mode: it copies them back and synchronises), as attention_with_kvcache does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..env import check_kvcache, interpreting
from .. import policy
from ..errors import KernelInputError
from ..lang.builtin import NO_WINDOW, varlen_key
from ..runtime import autograd, tables
from ..runtime.arguments import INT32_MAX, check_scale, tensor_signature, value_head_dim
from ..runtime.plans import PLANS
from ..runtime.registry import resolve
from .sdpa import _DTYPES, _checked_float, checked_softcap, checked_window


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_k=None,
                           sinks=None, out=None):
    """Attention over packed variable-length sequences, with flash-attn's `flash_attn_varlen_func` semantics.

    q (total_q, H, D); k and v (total_k, H_KV, D), or with `block_table` (B, pages per sequence; int32) a paged
    pool (num_pages, page_size, H_KV, D) in which sequence b's keys are its pages in block_table[b]'s order.
    `cu_seqlens_q`, `cu_seqlens_k`: int32 (B + 1,), each starting at 0; sequence b's queries are
    q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]. `max_seqlen_q`, `max_seqlen_k`: at least every sequence's length.
    `seqused_k` (B,) int32: only the first seqused_k[b] keys of sequence b are attended. H a multiple of H_KV
    (GQA). `causal` and `window_size` (left, right; -1 unbounded) are aligned bottom-right per sequence
    (query i of a sequence of L queries and S keys sits at key position i + S - L); `softcap` > 0, `alibi_slopes`
    (H,) or (B, H) and `sinks` (H,) as `attngen.attention` takes them. `dropout_p` must be 0; `deterministic` is
    accepted for flash-attn's signature (attngen's backward is deterministic under
    `torch.use_deterministic_algorithms(True)`). `out`: a tensor like q (as wide as v) to write the output into.

    Returns out (total_q, H, D_V: v's head dim); with `return_attn_probs`, (out, softmax_lse, None) as flash-attn
    does, softmax_lse float32 (H, total_q) in natural log.
    """
    signature = None if out is not None else signature_of(
        "varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, block_table, seqused_k, sinks)
    plan = None if signature is None else PLANS.get(signature)
    if plan is not None and plan.lengths_ok(max_seqlen_q, max_seqlen_k):
        seqlens_k, shared = planned_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                            block_table)
        if autograd.needs_grad(q, k, v):  # (a signature holds whether the call is recorded: never paged, no
            # run-time tensors then)
            result = autograd.planned_varlen_forward(plan.training, plan.key, plan.scale, q, k, v, cu_seqlens_q,
                                                     cu_seqlens_k, seqlens_k, shared, bool(return_attn_probs))
        else:
            result = autograd.replayed_varlen_forward(plan.replays(max_seqlen_q, max_seqlen_k), plan.key,
                                                      plan.scale, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                                      block_table, (max_seqlen_q, max_seqlen_k), shared,
                                                      planned_tensors(alibi_slopes, sinks))
            result = result if return_attn_probs else result[0]
    else:
        checked = _checked_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size, softcap, alibi_slopes, block_table, seqused_k,
                                sinks)
        kernel = resolve(checked.key)
        result = kernel(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), seqused_k=seqused_k,
                        block_table=block_table, scale=checked.scale, return_lse=bool(return_attn_probs), out=out,
                        **checked.tensors)
        if signature is not None:  # (kept once the call has run: one a kernel refused keeps no plan)
            PLANS.keep(signature, PlannedVarlen(checked.key, checked.scale, kernel))
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result


class PlannedVarlen:
    """The plan of a varlen call signature (`signature_of`): the kernel's registry key, the softmax scale, and the
    replays of its launches (attngen/runtime/replay.py) for calls without autograd and with it. max_seqlen_q and
    max_seqlen_k are not in the signature (a training loop's change every batch): a kernel's launches read them only
    where a mixed kernel (paged: prefills and decodes in one launch) schedules its short sequences by them, so its
    inference replays are kept per pair (`replays`)."""

    __slots__ = ("key", "scale", "inference", "training", "by_lengths")
    KEPT = 16  # (max_seqlen_q, max_seqlen_k) pairs kept per signature of a mixed kernel, then the table starts over

    def __init__(self, key: str, scale: float, kernel):
        self.key, self.scale = key, scale
        self.inference, self.training = autograd.Replays(), autograd.Replays()
        # NOTE: the module's constant, as attngen/runtime/varlen.py's forward reads it (not kernel.program)
        self.by_lengths = {} if getattr(kernel.module, "NARROW_CONFIG", None) is not None else None

    @staticmethod
    def lengths_ok(max_seqlen_q, max_seqlen_k) -> bool:
        """What the checks ask of the max lengths beyond their type (the signature's): within int32."""
        return 0 <= max_seqlen_q <= INT32_MAX and 0 <= max_seqlen_k <= INT32_MAX

    def replays(self, max_seqlen_q: int, max_seqlen_k: int) -> autograd.Replays:
        """The inference replays of calls with these max lengths."""
        if self.by_lengths is None:
            return self.inference
        replays = self.by_lengths.get((max_seqlen_q, max_seqlen_k))
        if replays is None:
            if len(self.by_lengths) >= self.KEPT:
                self.by_lengths.clear()
            replays = self.by_lengths[max_seqlen_q, max_seqlen_k] = autograd.Replays()
        return replays


# PLANS holds signature_of(...) -> PlannedVarlen of calls that passed `_checked_plan` and ran: a training loop packs
# its batches to one layout again and again (the lengths change, the totals and the batch often do not), and a later
# call of a signature skips the checks, its second planned call on the Python of the kernel's module too (the
# launches of its first planned call replayed: attngen/runtime/replay.py). The host time of a small packed batch's
# backward was its wall time (benchmarks/NOTES.md [v58]).
def signature_of(path: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                 causal, window_size, softcap, alibi_slopes, block_table, seqused_k, sinks):
    """The key of `PLANS` for a varlen call on call path `path` ("varlen" here; the flash-attention slot's ops have
    their own): each tensor's `tensor_signature`, whether cu_seqlens_k is cu_seqlens_q (a replay then holds one
    address for both), whether the call is recorded for autograd, the other arguments' values but the max lengths'
    (their types only: `PlannedVarlen`), whether Triton interprets and the tuning tables' generation. The
    cu_seqlens' and seqused_k's values are not in it: the checks read them only where the tensors are on the CPU,
    which a planned call does again (`planned_offsets`). ALiBi slopes and sinks enter by their layouts (a planned
    call takes its own: `planned_tensors`), with grad mode (the checks refuse slopes that require grad in it). None
    where the call is not planned: slopes or sinks in a call recorded for autograd (the sinks' gradient is made by
    torch operations a replay would not repeat), ATTNGEN_CHECK_KVCACHE (values read back every call),
    torch.compile tracing, or an argument not of the plain type the checks expect."""
    if check_kvcache() or torch.compiler.is_compiling():
        return None
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes, sinks)
    if (any(type(t) is not torch.Tensor for t in tensors[:5])
            or any(t is not None and type(t) is not torch.Tensor for t in tensors[5:])):
        return None
    if (alibi_slopes is not None or sinks is not None) and autograd.needs_grad(
            q, k, v, *(t for t in tensors[7:] if t is not None)):
        return None
    if not (type(max_seqlen_q) is int and type(max_seqlen_k) is int and type(causal) is bool
            and type(dropout_p) in (float, int) and type(softcap) in (float, int)
            and (softmax_scale is None or type(softmax_scale) in (float, int))
            and type(window_size) in (tuple, list) and len(window_size) == 2
            and all(type(w) is int for w in window_size)):
        return None
    return (path, *(None if t is None else tensor_signature(t) for t in tensors),
            cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr(), autograd.needs_grad(q, k, v), torch.is_grad_enabled(),
            dropout_p, softmax_scale, causal, tuple(window_size), softcap, interpreting(), tables.generation(), policy.generation())


def planned_tensors(alibi_slopes, sinks) -> tuple:
    """A planned call's run-time tensors in the kernel's order (slopes, sinks), float32 as the checks made them
    (a copy, per call, of one given in another dtype or not contiguous; the signature holds their layouts)."""
    return tuple(t.float().contiguous() for t in (alibi_slopes, sinks) if t is not None)


def planned_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table):
    """What a planned call (its signature's checks passed) computes afresh: the sequences' value checks where the
    tensors are on the CPU (not part of the signature), the keys each sequence uses (seqused_k, else the
    differences of cu_seqlens_k), and whether cu_seqlens_k is cu_seqlens_q."""
    if q.device.type == "cpu":
        page_size = k.shape[1] if block_table is not None else None
        _check_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, q.shape[0],
                      None if block_table is not None else k.shape[0], page_size,
                      k.shape[0] if block_table is not None else 0)
    seqlens_k = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return seqlens_k, cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr()


class VarlenPlan(NamedTuple):
    """What `flash_attn_varlen_func`'s checks decide: the kernel's registry key, the softmax scale, and the
    run-time tensors by the keyword the kernel takes them with (float32)."""
    key: str
    scale: float
    tensors: dict


def _checked_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, block_table, seqused_k, sinks) -> VarlenPlan:
    """The checks (a bad argument raises, naming it, before anything runs)."""
    if dropout_p != 0.0:
        raise KernelInputError(f"dropout_p must be 0.0 (attngen has no dropout); got {dropout_p}")
    paged = block_table is not None
    for name, t, dims in (("q", q, 3), ("k", k, 4 if paged else 3), ("v", v, 4 if paged else 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() != dims:
            layout = ("(num_pages, page_size, kv_heads, head_dim) with block_table" if dims == 4 else
                      "(total_tokens, heads, head_dim)")
            raise KernelInputError(f"{name} must be {layout}; got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise KernelInputError(f"{name} has dtype {t.dtype}; supported are float16, bfloat16 and float32")
        if t.device != q.device:
            raise KernelInputError(f"{name} is on {t.device} and q on {q.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelInputError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise KernelInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape but for the head dim")
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise KernelInputError(f"q and k must share a head dim; got {head_dim} and {k.shape[-1]}")
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise KernelInputError(f"head dim {head_dim} is not supported: it must be a multiple of 16 from 16 to 256")
    head_dim_v = value_head_dim(v, head_dim, "v")  # (the output takes it)
    if kv_heads == 0 or heads % kv_heads:
        raise KernelInputError(f"q has {heads} heads and k {kv_heads}: the query heads must be a multiple of the "
                               "key/value heads")
    batch = _check_batch(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table)
    if check_kvcache() or q.device.type == "cpu":
        page_size = k.shape[1] if paged else None
        _check_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, q.shape[0],
                      None if paged else k.shape[0], page_size, k.shape[0] if paged else 0)
    window, softcap = checked_window(causal, window_size, "causal"), checked_softcap(softcap, alibi_slopes)
    tensors = {}
    if alibi_slopes is not None:
        tensors["alibi_slopes"] = _checked_float("alibi_slopes", alibi_slopes, q, ((heads,), (batch, heads)))
    if sinks is not None:
        tensors["sinks"] = _checked_float("sinks", sinks, q, ((heads,),))
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else check_scale(softmax_scale, name="softmax_scale")
    key = varlen_key(_DTYPES[q.dtype], head_dim, bool(causal), k.shape[1] if paged else None,
                     (heads, kv_heads) if heads != kv_heads else None, window, softcap, alibi_slopes is not None,
                     sinks is not None, head_dim_v)
    return VarlenPlan(key, float(scale), tensors)


def _int32_vector(name: str, t, length: int | None, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != torch.int32:
        raise KernelInputError(f"{name} must be int32; got {t.dtype}")
    if t.dim() != 1:
        raise KernelInputError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise KernelInputError(f"{name} must have {length} entries (one per sequence of cu_seqlens_q); "
                               f"got {t.shape[0]}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device} and q on {device}")


def _check_batch(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table) -> int:
    """The checks of the sequence tensors' types and shapes (no values read); returns the batch size."""
    _int32_vector("cu_seqlens_q", cu_seqlens_q, None, q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise KernelInputError("cu_seqlens_q must have batch + 1 entries, starting at 0; got none")
    batch = cu_seqlens_q.shape[0] - 1
    _int32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q.device)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise KernelInputError(f"{name} must be an int >= 0; got {n!r}")
    if seqused_k is not None:
        _int32_vector("seqused_k", seqused_k, batch, q.device)
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, not {type(block_table).__name__}")
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            raise KernelInputError(f"block_table must be int32 (batch, pages per sequence); got {block_table.dtype} "
                                   f"{tuple(block_table.shape)}")
        if block_table.shape[0] != batch:
            raise KernelInputError(f"block_table has {block_table.shape[0]} rows and cu_seqlens_q {batch + 1} "
                                   f"entries: it must have one row per sequence ({batch})")
        if block_table.device != q.device:
            raise KernelInputError(f"block_table is on {block_table.device} and q on {q.device}")
    return batch


def _check_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table, total_q: int,
                  total_k: int | None, page_size: int | None, num_pages: int) -> None:
    """The checks that read the sequence tensors' values (on the host; `total_k` None when K/V are paged)."""
    lengths = {}
    for name, cu, total, longest, longest_name in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")):
        cu = cu.cpu().long()
        if cu[0].item() != 0:
            raise KernelInputError(f"{name} must start at 0; got {cu[0].item()}")
        diffs = cu.diff()
        if (diffs < 0).any():
            b = int((diffs < 0).nonzero()[0, 0])
            raise KernelInputError(f"{name} must not decrease; entry {b + 1} is {cu[b + 1].item()} after {cu[b].item()}")
        if total is not None and cu[-1].item() > total:
            raise KernelInputError(f"{name} ends at {cu[-1].item()}, past the {total} tokens of the packed "
                                   f"{'q' if name == 'cu_seqlens_q' else 'k and v'}")
        if diffs.numel() and diffs.max().item() > longest:
            raise KernelInputError(f"{longest_name} is {longest}, smaller than sequence "
                                   f"{int(diffs.argmax())}'s {diffs.max().item()} tokens in {name}")
        lengths[name] = diffs
    keys = lengths["cu_seqlens_k"]
    if seqused_k is not None:
        used = seqused_k.cpu().long()
        bad = (used < 0) | (used > keys) if total_k is not None else used < 0
        if bad.any():
            b = int(bad.nonzero()[0, 0])
            raise KernelInputError(f"seqused_k[{b}] is {used[b].item()}; it must be from 0 to the sequence's "
                                   f"{keys[b].item()} keys in cu_seqlens_k")
        if used.numel() and used.max().item() > max_seqlen_k:
            raise KernelInputError(f"max_seqlen_k is {max_seqlen_k}, smaller than seqused_k's {used.max().item()}")
        keys = used
    if block_table is not None:
        capacity = block_table.shape[1] * page_size
        if keys.numel() and keys.max().item() > capacity:
            b = int(keys.argmax())
            raise KernelInputError(f"sequence {b} has {keys[b].item()} keys, more than its block_table row's "
                                   f"{block_table.shape[1]} pages of {page_size} hold")
        table = block_table.cpu().long()
        needed = torch.arange(block_table.shape[1]) * page_size < keys[:, None]
        if ((table < 0) | (table >= num_pages))[needed].any():
            raise KernelInputError(f"block_table names a page outside the pool of {num_pages} pages")
