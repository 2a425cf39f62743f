"""Decoding over a KV cache: the drop-in for flash-attn's `flash_attn_with_kvcache`, and LSE merging.

`attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, ...)` takes
flash-attn's argument names, layouts and semantics: q (batch, seqlen_q, heads, d); a contiguous
cache (batch, seqlen_max, kv_heads, d), or with a block table a page pool (num_pages, page_size,
kv_heads, d) and block_table (batch, max_pages) int32; cache_seqlens (batch,) int32 (or one int).
It writes the spec it needs (one per dtype, head dim, mask and page size, with split_kv = auto, and
flash-attn's window_size, softcap, alibi_slopes and sinks as the spec's variant),
loads it, and calls the generated module's `forward_kvcache` on (batch, heads, seq, d) views of the
same memory: no copies, and no value read back from the GPU, so a decoding step can be captured in
a CUDA graph. Every argument is checked first; a bad one is a ValueError (KernelInputError) or
TypeError naming it, before anything is launched: layouts, dtypes and devices, and what the
generated kernels' grids and 32-bit offsets can take (`_check_indexing`, `check_split_launch`). A
decoding step repeats its calls' layouts: a call whose signature (`_signature`: everything the checks read
but addresses and an int cache_seqlens' value) matches an earlier call's takes that call's outcome (its
plan in `attngen.runtime.plans.PLANS`, the one cache of the three call paths) and checks only that `out`
shares no memory with an input and that an int length fits. The signature's second call records its
launches, and later calls replay them on their own tensors (attngen/runtime/replay.py) instead of running
the generated module's `forward_kvcache` again.
There is no backward: inputs that require grad are refused while grad mode is on. Tensors may be on
any GPU; the launch then runs under `torch.cuda.device(q.device)`.

What is not checked on the way (it would need the values, i.e. a GPU->host copy): that
cache_seqlens[b] fits the cache and that block-table entries name pages inside the pool. Set
ATTNGEN_CHECK_KVCACHE=1 to check them on every call (a debug mode: it synchronises).

`merge_states(out_a, lse_a, out_b, lse_b)` merges two attention states over disjoint key sets (for
cascade or context-parallel attention) by their log-sum-exps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import env
from ..env import interpreting
from ..errors import KernelInputError
from ..lang.builtin import kvcache_spec
from ..lang.spec import FP8_DESCALES, MAX_HEAD_DIM, MAX_HEAD_DIM_LATENT, MAX_HEAD_DIM_V, DType
from .. import policy
from ..policy import context_parallel
from ..runtime import tables
from ..runtime.arguments import (INT32_MAX, MAX_SEQ, _runtime_device_ok, check_disjoint, check_out,
                                 check_packed_indexing, check_scale, check_span, check_split_launch, check_tensor,
                                 is_prefix_view, new_output, on_other_gpu, output_shape, tensor_signature,
                                 value_head_dim)
from ..runtime.kernel import load
from ..runtime.keys import Shape
from ..runtime.plans import PLANS
from ..runtime.replay import record, wanted
from .sdpa import _DTYPES, _checked_float, checked_softcap, checked_window


def _tensor(name: str, t, dims: int, layout: str) -> torch.Tensor:
    check_tensor(name, t, dims, layout)
    _runtime_device_ok(name, t)
    return t


def _check_int32(name: str, t: torch.Tensor, shape: tuple, device) -> None:
    if t.dtype != torch.int32:
        raise KernelInputError(f"{name} must be int32; got {t.dtype}")
    if tuple(t.shape) != shape:
        raise KernelInputError(f"{name} must have shape {shape}; got {tuple(t.shape)}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device} but q is on {device}")


def _check_values(cache_seqlens, block_table, capacity: int, num_pages: int, page_size: int) -> None:
    """Debug mode (ATTNGEN_CHECK_KVCACHE=1): the checks that need the tensors' values."""
    lens = cache_seqlens.cpu()
    if (lens < 0).any() or (lens > capacity).any():
        raise KernelInputError(f"cache_seqlens must lie in [0, {capacity}] (the cache's capacity); got {lens.tolist()}")
    if block_table is not None:
        table = block_table.cpu()
        for b, n in enumerate(lens.tolist()):
            used = table[b, : -(-n // page_size)]
            if ((used < 0) | (used >= num_pages)).any():
                raise KernelInputError(f"block_table[{b}] names pages outside the pool of {num_pages}: {used.tolist()}")


def _check_descale_values(k_descale, v_descale) -> None:
    """Debug mode (ATTNGEN_CHECK_KVCACHE=1): descales are positive and finite (k_descale scales the softmax scale,
    whose positivity the kernels' running max relies on)."""
    for name, t in zip(FP8_DESCALES, (k_descale, v_descale)):
        if t is not None and not bool(((t > 0) & torch.isfinite(t)).all()):
            raise KernelInputError(f"{name} must be positive and finite; got {t.cpu().tolist()}")


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, softmax_scale=None,
                           num_splits=0, return_softmax_lse=False, *, out=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, sinks=None, head_dim_v=None, k_descale=None, v_descale=None):
    """softmax(q k^T * scale) v over the first cache_seqlens[b] keys of each sequence's cache.

    q (B, S_q, H, D); k_cache, v_cache (B_cache >= B, S_max, H_KV, D), or with `block_table`
    (B, max_pages) int32 page pools (num_pages, page_size, H_KV, D) with page_size a power of two
    from 1 to 256; v_cache's D may differ from q's and k_cache's (D_V, a multiple of 16 up to 512). `causal` aligns the mask bottom-right (query i of S_q sees keys up to
    cache_seqlens[b] - S_q + i), so a chunk of new tokens whose K/V are already in the cache
    (chunked prefill) and single-token decoding (S_q = 1) both work. `num_splits=0` takes the
    Flash-Decoding split count tuned for this GPU and shape bucket (`attngen tune`), else picks it
    from the batch, the heads and the GPU's multiprocessors. `cache_seqlens` is a (B,) int32 tensor,
    or an int when every sequence holds that many keys: the launch then takes the bucket's config
    tuned for equal lengths where the table has one (with lengths that differ, a split count that
    evens them out is faster; with equal ones, often fewer splits).
    flash-attn's variants, positions aligned bottom-right as the causal mask's: `window_size` (left, right)
    keeps keys k with q - left <= k <= q + right, -1 leaving that side unbounded (causal makes right 0);
    `softcap` C > 0 maps each scaled score s to C tanh(s / C) (0: off); `alibi_slopes` (H,) or (B, H)
    float32 subtracts slope * |q - k|; `sinks` (H,) float32, one learned logit per head, joins each
    row's softmax denominator (and the lse) with no value. softcap and alibi_slopes together are refused.
    An FP8 cache (k_cache and v_cache in torch.float8_e4m3fn, q in bfloat16 or float16; FP8 queries are refused):
    `k_descale`, `v_descale` (FA3's names) are float32 tensors of shape (B, H_KV) (per sequence and K/V head),
    (H_KV,) (per head) or (1,) (per tensor), the true key being k_cache * k_descale (values likewise); None means
    1.0 (vLLM's default scale: a cache written without scaling). Descales must be positive and finite (checked
    with ATTNGEN_CHECK_KVCACHE=1: it reads them back). K and V are read as e4m3 and widened in
    registers; k_descale folds into the softmax scale and v_descale scales the accumulated output, which is in
    q's dtype. Descales with a 16-bit cache are refused.
    Calls with alibi_slopes or sinks skip the checks from their signature's second call on and replay their
    launches from its third, as other calls do, with the slopes' and sinks' addresses (or those of their float32
    copies, made per call where they are given in another dtype); calls over an FP8 cache with their descales'.
    MLA's absorbed decode (DeepSeek): one latent cache whose first D_V columns are the values, as
    `v_cache=None, head_dim_v=D_V` or v_cache a view `k_cache[..., :D_V]`; q and k_cache may then be up to 576
    wide (512 latent + 64 rotary), and the kernel reads each tile of the cache once for both products.
    Returns out (B, S_q, H, D_V), and (out, lse) with lse (B, H, S_q) float32 when
    `return_softmax_lse`. Sequences with no keys give zeros (and lse -inf).
    """
    if v_cache is None or head_dim_v is not None:
        v_cache = _latent_values(k_cache, v_cache, head_dim_v)
    key = _signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits, out,
                     window_size, softcap, alibi_slopes, sinks, k_descale, v_descale)
    plan = None if key is None else PLANS.get(key)
    planned = plan is not None
    if planned and out is not None:  # the layout is the key's; addresses are this call's
        check_disjoint(out, "out", {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if plan is None or on_other_gpu(q):
        plan = _checked_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits, out,
                             window_size, softcap, alibi_slopes, sinks, k_descale, v_descale)
        if plan is None:  # q is on another GPU: Triton launches on the current device, so make q's current
            with torch.cuda.device(q.device):
                return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal,
                                              softmax_scale, num_splits, return_softmax_lse, out=out,
                                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                              sinks=sinks, head_dim_v=head_dim_v, k_descale=k_descale,
                                              v_descale=v_descale)
        planned = False
        if key is not None:
            # A plan with run-time tensors keeps the checks' verdict on their layouts, not the tensors (a call
            # brings its own: `_call_tensors`, which a replay takes as inputs like the caches).
            PLANS.keep(key, plan._replace(tensors=()) if plan.tensors else plan)
    if plan.uniform:
        if planned:  # the signature holds that the lengths are an int, not which: a decoding loop's grows
            _check_uniform_length(cache_seqlens, plan.capacity)
        cache_seqlens = _equal_lengths(plan.batch, cache_seqlens, q.device)
    if env.check_kvcache():
        _check_values(cache_seqlens, block_table, plan.capacity, k_cache.shape[0], plan.page_size or 1)
        _check_descale_values(k_descale, v_descale)
    if out is None:
        out = new_output(q, v_cache)
    lse = torch.empty((plan.batch, plan.heads, plan.seqlen_q), device=q.device, dtype=torch.float32)
    if plan.part is None:  # q is empty
        return (out, lse) if return_softmax_lse else out
    descales = _descales(k_descale, v_descale, q.device) if k_cache.dtype in FP8_CACHE else {}
    # the run-time tensors the launch reads (float32 copies of slopes or sinks given in another dtype: made here, out
    # of a recording, so that a replay takes them as inputs as it takes the caches)
    tensors = dict(plan.tensors) if not planned else dict(_call_tensors(alibi_slopes, sinks), **descales)
    inputs = (q, k_cache, v_cache, cache_seqlens, block_table, out, lse, *descales.values(),
              tensors.get("alibi_slopes"), tensors.get("sinks"))
    if plan.replay and plan.replay(inputs):  # the launches of this signature's earlier call, on these tensors
        return (out, lse) if return_softmax_lse else out

    def run():
        # The kernels see (batch, heads, seq, d) views of flash-attn's (batch, seq, heads, d) tensors.
        if plan.page_size:
            k4, v4 = k_cache, v_cache
        elif k_cache.shape[0] == plan.batch:
            k4, v4 = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        else:
            k4, v4 = k_cache[:plan.batch].transpose(1, 2), v_cache[:plan.batch].transpose(1, 2)
        plan.part.launch(q.transpose(1, 2), k4, v4, cache_seqlens, block_table, plan.softmax_scale,
                         out.transpose(1, 2), lse, plan.config, plan.num_splits, tensors)


    if planned and wanted(plan.replay):
        # The signature's second call: its launches are recorded for the calls after it (attngen/runtime/replay.py; False where they cannot be)
        _, replay = record(run, inputs)
        PLANS.replace(key, plan._replace(replay=replay or False))
    else:
        run()
    return (out, lse) if return_softmax_lse else out


def _latent_values(k_cache, v_cache, head_dim_v):
    """The values of an MLA call: `k_cache[..., :head_dim_v]` (a view: nothing is allocated or read back) for
    `v_cache=None`; a given v_cache, which must then be head_dim_v wide."""
    if head_dim_v is None:
        raise KernelInputError("v_cache is None: pass head_dim_v, the width of k_cache's first columns that hold the "
                               "values (MLA's latent cache: head_dim_v=512), or a v_cache")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise TypeError(f"head_dim_v must be an int, not {type(head_dim_v).__name__}")
    if v_cache is not None:
        if isinstance(v_cache, torch.Tensor) and v_cache.dim() and v_cache.shape[-1] != head_dim_v:
            raise KernelInputError(f"v_cache has head dim {v_cache.shape[-1]} but head_dim_v is {head_dim_v}")
        return v_cache
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, not {type(k_cache).__name__}")
    if not (k_cache.dim() == 4 and 16 <= head_dim_v < k_cache.shape[-1] and head_dim_v % 16 == 0
            and head_dim_v <= MAX_HEAD_DIM_V):
        raise KernelInputError(f"head_dim_v = {head_dim_v} must be a multiple of 16 from 16 to {MAX_HEAD_DIM_V} and "
                               f"less than k_cache's head dim ({k_cache.shape[-1] if k_cache.dim() else '?'}): the values "
                               "are k_cache's first head_dim_v columns")
    return k_cache[..., :head_dim_v]


class _Plan(NamedTuple):
    """What the checks and choices of `attention_with_kvcache` decide for one call signature: the launch
    part (`runtime.parts.KVCachePart`; None where q is empty: nothing to launch), its config and split count, the softmax scale, whether
    cache_seqlens is an int, and the sizes the launch reads."""
    part: object
    config: dict
    num_splits: int
    softmax_scale: float
    uniform: bool
    batch: int
    heads: int
    seqlen_q: int
    capacity: int
    page_size: int | None
    replay: object = None  # a Replay of the launches (attngen/runtime/replay.py), False where they cannot be replayed
    tensors: tuple = ()  # the run-time tensors (alibi_slopes, sinks; an FP8 cache's k_descale, v_descale) in float32,
                         # as (keyword, tensor) pairs, of the call that made the plan (PLANS keeps it without them,
                         # and without a replay)


# PLANS holds _signature(...) -> _Plan of calls that passed the checks. A decoding step repeats its layouts, so
# from its second call on it skips ~60 lines of checks and the kernel's and config's lookups (benchmarks/NOTES.md
# v33), and from its third the generated module's Python too (the plan's replay, v34); the signature holds
# everything the checks read, so a call that would fail them never hits.
def _call_tensors(alibi_slopes, sinks) -> dict:
    """A planned call's run-time tensors, in float32 (the layouts the plan's signature holds were checked)."""
    found = {}
    if alibi_slopes is not None:
        found["alibi_slopes"] = alibi_slopes.float().contiguous()
    if sinks is not None:
        found["sinks"] = sinks.float().contiguous()
    return found


# The dtypes of an FP8 cache, by the spec's name for them (lang/spec.py's DType vocabulary).
FP8_CACHE = {DType.FP8_E4M3.torch: DType.FP8_E4M3.value}
_UNIT_DESCALE: dict = {}  # device -> two (1,) float32 tensors of 1.0 (K's, V's), never written


def _descales(k_descale, v_descale, device) -> dict:
    """The descale factors a launch over an FP8 cache takes (as checked by `_check_descales`), 1.0 where None: (1,)
    tensors made once per device, so that a decoding step launches no fill kernel of its own, and two of them,
    one for K and one for V, so that a replay (attngen/runtime/replay.py) tells their addresses apart."""
    if k_descale is None or v_descale is None:
        units = _UNIT_DESCALE.get(device)
        if units is None:
            units = tuple(torch.ones(1, dtype=torch.float32, device=device) for _ in range(2))
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                _UNIT_DESCALE[device] = units
        k_descale = units[0] if k_descale is None else k_descale
        v_descale = units[1] if v_descale is None else v_descale
    return dict(zip(FP8_DESCALES, (k_descale, v_descale)))


def _check_descales(q, k_cache, k_descale, v_descale) -> None:
    """An FP8 cache's descale factors: float32 tensors of shape (B, H_KV), (H_KV,) or (1,) on q's device, or None
    (1.0); with a 16-bit cache, none. A bad one is a TypeError (not a tensor) or ValueError naming it."""
    fp8 = k_cache.dtype in FP8_CACHE
    batch, kv_heads = q.shape[0], k_cache.shape[2]
    shapes = ((batch, kv_heads), (kv_heads,), (1,))
    for name, t in zip(FP8_DESCALES, (k_descale, v_descale)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if not fp8:
            raise KernelInputError(f"{name} is for an FP8 cache (torch.float8_e4m3fn); k_cache has dtype {k_cache.dtype}")
        if t.dtype != torch.float32:
            raise KernelInputError(f"{name} must be float32; got {t.dtype}")
        if tuple(t.shape) not in shapes:
            raise KernelInputError(f"{name} must have shape {shapes[0]} (per sequence and K/V head), {shapes[1]} (per "
                                   f"K/V head) or (1,) (per tensor); got {tuple(t.shape)}")
        if t.device != q.device:
            raise KernelInputError(f"{name} is on {t.device} but q is on {q.device}")
        if torch.is_grad_enabled() and t.requires_grad:
            raise KernelInputError(f"{name} requires grad, but attention_with_kvcache has no backward: call it under "
                                   "torch.no_grad() or pass a detached tensor")


def _signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits, out, window_size,
               softcap, alibi_slopes=None, sinks=None, k_descale=None, v_descale=None):
    """The key of `PLANS`: "kvcache" (this call path), every tensor's shape, strides, dtype, device, layout
    and requires_grad, grad mode, the other arguments' values, the tuning tables' generation and whether
    Triton interprets (all that the checks read but whether `out` shares memory with the inputs, and an int
    cache_seqlens' value, both checked per call); None where an argument is not of the plain type the checks
    expect (those calls are checked afresh)."""
    if not (type(q) is torch.Tensor and type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor
            and type(causal) is bool and type(num_splits) is int
            and (softmax_scale is None or type(softmax_scale) in (float, int))
            and type(window_size) is tuple and len(window_size) == 2 and all(type(w) is int for w in window_size)
            and type(softcap) in (float, int)):
        return None
    if type(cache_seqlens) is int:
        lens = int  # its value is checked per call (`_check_uniform_length`): nothing else of the plan reads it
    elif type(cache_seqlens) is torch.Tensor:
        lens = tensor_signature(cache_seqlens)
    else:
        return None
    if block_table is None:
        table = None
    elif type(block_table) is torch.Tensor:
        table = tensor_signature(block_table)
    else:
        return None
    if out is not None and type(out) is not torch.Tensor:
        return None
    extra = ()
    for t in (alibi_slopes, sinks, k_descale, v_descale):  # their layouts, as the checks read them
        if t is not None and type(t) is not torch.Tensor:
            return None
        extra += (None if t is None else tensor_signature(t),)
    # Whether v_cache is k_cache's prefix (MLA: the latent kernel) is a fact of their addresses, not only their
    # layouts (which the signature holds): whether they start at one address completes it.
    latent = v_cache.data_ptr() == k_cache.data_ptr()
    return ("kvcache", *extra, tensor_signature(q), tensor_signature(k_cache), tensor_signature(v_cache), latent, lens, table,
            None if out is None else tensor_signature(out), causal, softmax_scale, num_splits, window_size, softcap,
            torch.is_grad_enabled(), tables.generation(), policy.generation(), interpreting())


def _checked_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, softmax_scale, num_splits, out,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None, v_descale=None):
    """Every check of `attention_with_kvcache`'s arguments (a bad one raises before anything is launched),
    then the kernel, config and split count of the call, as a _Plan; None where q is on a GPU other than
    the current one (the caller then calls again under torch.cuda.device(q.device))."""
    q = _tensor("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    if on_other_gpu(q):
        return None
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, kv_heads, head_dim)" if paged else "(batch, seqlen_max, kv_heads, head_dim)"
    k_cache = _tensor("k_cache", k_cache, 4, cache_layout)
    v_cache = _tensor("v_cache", v_cache, 4, cache_layout)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        # No backward: a result silently detached from the autograd graph would train on nothing.
        needs = [n for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) if t.requires_grad]
        raise KernelInputError(
            f"{' and '.join(needs)} {'requires' if len(needs) == 1 else 'require'} grad, but attention_with_kvcache "
            "has no backward (decoding is inference only): call it under torch.no_grad() or "
            "torch.inference_mode(), or pass detached tensors; for gradients use attngen.attention")
    if q.dtype in FP8_CACHE:
        raise KernelInputError(f"q has dtype {q.dtype}: FP8 queries are not supported by attention_with_kvcache; an "
                               "FP8 cache takes bfloat16 or float16 q (the output is in q's dtype)")
    if q.dtype not in _DTYPES:
        raise KernelInputError(f"q has dtype {q.dtype}; supported are float16, bfloat16 and float32")
    batch, seqlen_q, heads, head_dim = q.shape
    fp8 = k_cache.dtype in FP8_CACHE
    if fp8 and q.dtype == torch.float32:
        raise KernelInputError(f"k_cache has dtype {k_cache.dtype}: an FP8 cache takes bfloat16 or float16 q, not float32")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != (k_cache.dtype if fp8 else q.dtype):
            raise KernelInputError(f"{name} has dtype {t.dtype} but {'k_cache' if fp8 else 'q'} has "
                                   f"{k_cache.dtype if fp8 else q.dtype}")
        if t.device != q.device:
            raise KernelInputError(f"{name} is on {t.device} but q is on {q.device}")
    if k_cache.shape[-1] != head_dim:
        raise KernelInputError(f"k_cache has head_dim {k_cache.shape[-1]} but q has {head_dim}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise KernelInputError(f"k_cache and v_cache must have the same shape but for the head dim; got "
                               f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    # MLA: the values are k_cache's first columns, read with the keys (the spec's v = k[:N]).
    latent = is_prefix_view(v_cache, k_cache) and v_cache.shape[-1] < head_dim
    if latent and fp8:
        raise KernelInputError("v_cache is k_cache's first columns (MLA's latent cache) in FP8: an FP8 latent cache "
                               "is not supported; pass a bfloat16 or float16 one")
    widest = MAX_HEAD_DIM_LATENT if latent else MAX_HEAD_DIM
    if head_dim % 16 or not 16 <= head_dim <= widest:
        raise KernelInputError(f"head dim {head_dim} is not supported: it must be a multiple of 16 from 16 to {widest}"
                               + ("" if latent else f" ({MAX_HEAD_DIM_LATENT} where v_cache is k_cache[..., :D_V], MLA)"))
    head_dim_v = value_head_dim(v_cache, head_dim, "v_cache")  # (the output takes it)
    out_shape = output_shape(q, v_cache)
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise KernelInputError(f"q has {heads} heads, which is not a multiple of the {kv_heads} heads of k_cache")
    page_size = None
    if paged:
        block_table = _tensor("block_table", block_table, 2, "(batch, max_pages_per_sequence)")
        page_size = k_cache.shape[1]
        if page_size < 1 or page_size > 256 or page_size & (page_size - 1):
            raise KernelInputError(f"k_cache has pages of {page_size} tokens; page sizes are powers of two from 1 to 256")
        _check_int32("block_table", block_table, (batch, block_table.shape[1]), q.device)
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] < batch:
            raise KernelInputError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}")
        capacity = k_cache.shape[1]
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int32 tensor or an int, not {type(cache_seqlens).__name__}")
    uniform = isinstance(cache_seqlens, int)  # every sequence holds the same number of keys
    if uniform:
        _check_uniform_length(cache_seqlens, capacity)
    else:
        _check_int32("cache_seqlens", cache_seqlens, (batch,), q.device)
    softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else check_scale(softmax_scale, name="softmax_scale")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= 128:
        raise KernelInputError(f"num_splits must be an int from 0 (choose) to 128; got {num_splits!r}")
    window_size, softcap, tensors = _check_variant(q, window_size, softcap, alibi_slopes, sinks)
    _check_descales(q, k_cache, k_descale, v_descale)
    if fp8:
        tensors.update(_descales(k_descale, v_descale, q.device))
    _check_indexing(q.transpose(1, 2), q, k_cache, v_cache, block_table, capacity, page_size)
    if out is not None:
        check_out(out, q, inputs={"q": q, "k_cache": k_cache, "v_cache": v_cache}, shape=out_shape)
        if out.stride() != q.stride():
            check_packed_indexing("out", out.transpose(1, 2), heads // kv_heads, out,
                                  "pass a denser out (e.g. torch.empty_like(q)) or fewer queries per call")
    else:
        fresh = new_output(q, v_cache)  # what the call allocates: q's layout if dense, else laid out afresh
        if fresh.stride() != q.stride():  # q is expanded
            check_packed_indexing("out", fresh.transpose(1, 2), heads // kv_heads, fresh)

    kernel = load(kvcache_spec(_DTYPES[q.dtype], head_dim, bool(causal), page_size, window_size, softcap,
                               alibi_slopes is not None, sinks is not None, head_dim_v, latent,
                               FP8_CACHE.get(k_cache.dtype)))
    part, config = None, {}
    if q.numel():
        part = kernel.part("kvcache")
        config = part.config(Shape(batch, heads, kv_heads, seqlen_q, capacity), q.device.index, uniform)
        # Resolve the split count here (tuned for this shape bucket, else as the module would:
        # attngen/policy/splits.py) so that the launch it implies is checked before it happens.
        tuned_splits = config.pop("num_splits", 0)
        num_splits = num_splits or tuned_splits or _auto_splits(kernel.module, config, batch, heads, kv_heads,
                                                                seqlen_q, capacity, q.device,
                                                                _one_wave(kernel.module, config, q, k_cache, out,
                                                                          v_cache, page_size is not None))
        check_split_launch(batch, heads, kv_heads, seqlen_q, v_cache.shape[-1], num_splits, "q", "k_cache")
    return _Plan(part, config, num_splits, float(softmax_scale), uniform, batch, heads, seqlen_q, capacity, page_size,
                 tensors=tuple(tensors.items()))


def _check_variant(q, window_size, softcap, alibi_slopes, sinks):
    """flash-attn's variant arguments checked (a bad one is a ValueError naming it, a non-tensor slopes or sinks a
    TypeError); returns window_size as a tuple of ints, softcap as a float, and the run-time tensors by keyword in
    float32 (as `attention()` takes them)."""
    # (the window as given: `causal` aligns it bottom-right later, as flash-attn's decode does)
    window_size, softcap = checked_window(False, window_size, "causal"), checked_softcap(softcap, alibi_slopes)
    batch, _, heads, _ = q.shape
    tensors = {}
    for name, t, shapes in (("alibi_slopes", alibi_slopes, ((heads,), (batch, heads))), ("sinks", sinks, ((heads,),))):
        if t is None:
            continue
        if isinstance(t, torch.Tensor) and torch.is_grad_enabled() and t.requires_grad:
            raise KernelInputError(f"{name} requires grad, but attention_with_kvcache has no backward: call it under "
                                   "torch.no_grad() or pass a detached tensor")
        tensors[name] = _checked_float(name, t, q, shapes)
    return window_size, softcap, tensors


_EQUAL_LENGTHS: dict = {}  # (device, batch, keys) -> the (batch,) int32 tensor of keys
_EQUAL_LENGTHS_KEPT = 1024


def _check_uniform_length(keys: int, capacity: int) -> None:
    if not 0 <= keys <= capacity:
        raise KernelInputError(f"cache_seqlens = {keys} does not fit a cache of {capacity} tokens")


def _equal_lengths(batch: int, keys: int, device) -> torch.Tensor:
    """cache_seqlens for an int: a (batch,) int32 tensor of `keys`, made once per (device, batch, keys) and
    kept for the process, so that repeated calls launch no fill kernel of their own (at batch 1 and 8k keys
    the fill cost a CUDA-graph replay 7%). A kept tensor is never freed or written, so a graph captured
    around a call may read it. Made afresh per call while a graph is being captured (it would live in the
    graph's memory pool) and after _EQUAL_LENGTHS_KEPT distinct ones (an int that grows every step)."""
    key = (device, batch, keys)
    found = _EQUAL_LENGTHS.get(key)
    if found is not None:
        return found
    made = torch.full((batch,), keys, dtype=torch.int32, device=device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and len(_EQUAL_LENGTHS) < _EQUAL_LENGTHS_KEPT:
        _EQUAL_LENGTHS[key] = made
    return made


def _auto_splits(module, config: dict, batch: int, heads: int, kv_heads: int, seqlen_q: int, capacity: int,
                 device, one_wave: bool = False) -> int:
    """The split count the generated module's `forward_kvcache(num_splits=0)` picks: `one_wave` (where its Gluon
    MLA kernel runs: `_one_wave`) the rule of a kernel bound by the tensor cores, else the memory-bound decode
    rule (attngen/policy/splits.py)."""
    config = dict(module.DEFAULT_CONFIG, **config)
    programs = batch * kv_heads * -(-seqlen_q * (heads // kv_heads) // config["BLOCK_M"])
    rule = module.choose_wave_splits if one_wave else module.choose_num_splits
    return rule(programs, -(-capacity // config["BLOCK_N"]), module.multiprocessors(device))


def _one_wave(module, config: dict, q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None,
              v_cache: torch.Tensor | None = None, paged: bool = True) -> bool:
    """Whether the module's Gluon MLA kernel, or its Gluon decode kernel where that takes the one-wave rule (an FP8
    cache's: WSD_SHAPE["ONE_WAVE"]), runs this call (q, out and a contiguous cache in flash-attn's (batch, seq,
    heads, dim) layout, seen by the module as `run` hands them over; out None: one laid out as q), so that its split
    count follows the one-wave rule as the module's own."""
    if not hasattr(module, "choose_wave_splits") or not config.get("warp_specialized", True):
        return False
    out4 = (q if out is None else out).transpose(1, 2)
    if hasattr(module, "wsm_ready"):
        return bool(module.wsm_ready(q.transpose(1, 2), k_cache, out4))
    if not paged:  # (the module's (batch, K/V heads, seq, dim) view of the sequences' caches)
        k_cache, v_cache = k_cache[:q.shape[0]].transpose(1, 2), v_cache[:q.shape[0]].transpose(1, 2)
    return bool(module.WSD_SHAPE.get("ONE_WAVE") and module.wsd_ready(q.transpose(1, 2), k_cache, v_cache, out4))


def _check_indexing(q4, q, k_cache, v_cache, block_table, capacity: int, page_size: int | None) -> None:
    """What the decode kernels address with 32-bit integers (read off generated/decode_d128.py and
    generated/decode_paged16_d128.py); batch, K/V head, split and page index are 64-bit.

    - q (and out): one program reads the GROUP query heads of one K/V head, all seqlen_q queries,
      at 32-bit offsets from the group's first head (rows numbered GROUP * seqlen_q in 32 bits);
    - key positions (offs_n, start_n, ...) are 32-bit: the capacity (a contiguous cache's seqlen_max,
      or max_pages x page_size) is at most MAX_SEQ;
    - contiguous cache: position x stride and head dim x stride within one (sequence, K/V head);
    - page pool: slot-in-page x stride and head dim x stride within one (page, K/V head) (page index
      x page stride is 64-bit, so the pool itself may be any size);
    - block table: page number x stride within one sequence's row.
    """
    # NOTE: this runs on every decoding step: the common layouts (a dense q and block table, K and V
    # caches of one layout) take the cheap paths, and only a suspect tensor gets the full check.
    if not (q.is_contiguous() and q.numel() <= INT32_MAX + 1):  # else every part of q spans less
        check_packed_indexing("q", q4, q.shape[2] // k_cache.shape[2], q)
    if capacity > MAX_SEQ:
        what = (f"block_table holds {block_table.shape[1]:,} pages of {page_size} tokens per sequence"
                if page_size else f"k_cache holds sequences of up to {capacity:,} tokens")
        raise KernelInputError(f"{what}, {capacity:,} key positions; the limit is {MAX_SEQ:,} (32-bit positions)")
    shape, strides = k_cache.shape, k_cache.stride()
    if (shape[1] - 1) * strides[1] + (shape[3] - 1) * strides[3] > INT32_MAX or v_cache.stride() != strides:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if page_size:
                check_span(name, t, (t.shape[1], t.shape[3]), (t.stride(1), t.stride(3)), "one (page, K/V head)",
                           f"make its pages denser (e.g. {name}.contiguous())")
            else:
                check_span(name, t, (t.shape[1], t.shape[3]), (t.stride(1), t.stride(3)), "one (sequence, K/V head)",
                           f"make its sequence dimension denser (e.g. {name}.contiguous()) or split it")
    if block_table is not None and not block_table.is_contiguous():  # a contiguous row spans max_pages < 2**30
        check_span("block_table", block_table, block_table.shape[1:], block_table.stride()[1:], "one sequence's row",
                   "pass a denser block table (e.g. block_table.contiguous())")


def merge_states(out_a, lse_a, out_b, lse_b):
    """Merge two attention states of the same queries over disjoint key sets; returns (out, lse).

    Layouts as `attention_with_kvcache(..., return_softmax_lse=True)` returns them: out (B, S_q, H,
    D), lse (B, H, S_q) float32 natural-log. With m = max(lse_a, lse_b):
    out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)),
    lse = m + log(e^(lse_a - m) + e^(lse_b - m)). An empty state (lse -inf) has weight 0; two
    empty states give 0 and -inf. On GPUs under policy.context_parallel.FUSED_MERGE, one kernel computes it
    (attngen.api.merge).
    """
    for name, t, dims in (("out_a", out_a, 4), ("lse_a", lse_a, 3), ("out_b", out_b, 4), ("lse_b", lse_b, 3)):
        check_tensor(name, t, dims, "(batch, seqlen_q, heads, head_dim)" if dims == 4 else "(batch, heads, seqlen_q)")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise KernelInputError("the two states must have the same shapes")
    b, s, h, _ = out_a.shape
    if tuple(lse_a.shape) != (b, h, s):
        raise KernelInputError(f"lse must be (batch, heads, seqlen_q) = {(b, h, s)}; got {tuple(lse_a.shape)}")
    if context_parallel.FUSED_MERGE and _fusable(out_a, lse_a, out_b, lse_b):
        from .merge import merge  # (defines a Triton kernel: see ALLOWED_LOCAL in tests/test_layers.py)

        out, lse = torch.empty_like(out_a, memory_format=torch.contiguous_format), lse_a.new_empty((b, h, s))
        merge(out_a.transpose(1, 2), lse_a, out_b.transpose(1, 2), lse_b, out.transpose(1, 2), lse)
        return out, lse
    la, lb = lse_a.float().transpose(1, 2), lse_b.float().transpose(1, 2)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / torch.where(total == 0, 1.0, total)[..., None]
    return out.to(out_a.dtype), (m + torch.log(total)).transpose(1, 2).contiguous()


def _fusable(out_a, lse_a, out_b, lse_b) -> bool:
    """Whether attngen.api.merge's kernel takes these states: on one GPU, outputs in 16- or 32-bit floats,
    log-sum-exps in float32 (else PyTorch's ops merge them, and report a device that differs)."""
    tensors = (out_a, lse_a, out_b, lse_b)
    return (out_a.is_cuda and all(t.device == out_a.device for t in tensors)
            and all(t.dtype in (torch.float16, torch.bfloat16, torch.float32) for t in (out_a, out_b))
            and lse_a.dtype == lse_b.dtype == torch.float32)
