"""The drop-in for `torch.nn.functional.scaled_dot_product_attention`.

`attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)` checks its arguments the way SDPA
does and runs the kernels of the spec it needs (one per dtype, head dim, mask and variant: sequence lengths,
batch and heads are run-time arguments of one compiled kernel) through
`attngen.runtime.autograd.attention_forward`: the custom op `torch.ops.attngen.forward` while torch.compile
traces (it keeps the call and its registered backward inside one graph), a plain autograd.Function
in eager mode. The spec is loaded on first use. A call whose signature (`_signature`) repeats an earlier
call's skips the checks that call passed (its plan in `attngen.runtime.plans.PLANS`, the one cache of the three
call paths), and from the signature's third call on replays the launches of its second
(attngen/runtime/replay.py) instead of running `Kernel.forward` again: without autograd here, with it in
`autograd._Planned`, whose backward replays too.

The keyword-only variant arguments `window_size`, `softcap`, `alibi_slopes` and `sinks` take flash-attn's
semantics, aligned top-left as `is_causal` is; each combination is one builtin spec (lang/builtin.py's
`sdpa_variant`, keyed by `sdpa_key`). Calls that pass run-time tensors (slopes, sinks) check them at every call;
without autograd they take their signature's plan and replay as other calls do, with their own tensors; recorded
for autograd they run checked (the sinks' gradient is made by torch operations a replay would not repeat).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..env import interpreting
from .. import policy
from ..errors import KernelInputError
from ..lang.builtin import NO_WINDOW, sdpa_key, sdpa_spec, sdpa_variant, v_keyword
from ..lang.variants import Variant
from . import fp8 as fp8_inputs
from ..runtime import autograd, tables
from ..runtime.arguments import check_attention_inputs, check_scale, tensor_signature, value_head_dim
from ..runtime.plans import PLANS

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8_e4m3"}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
              v_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention with the semantics of
    `torch.nn.functional.scaled_dot_product_attention`.

    query (B, H, L, E), key and value (B, H_KV, S, E); 3-D inputs (H, L, E) are taken as batch 1.
    `is_causal` aligns the mask top-left, as SDPA does (query i sees keys 0..i, also when L != S).
    `enable_gqa` lets H be a multiple of H_KV. `attn_mask` and `dropout_p` are not supported.

    Variants, as flash-attn's arguments but aligned top-left: `window_size` (left, right) keeps the keys
    i - left <= j <= i + right of query i, -1 leaving a side unbounded (with `is_causal`, right is 0 or -1:
    `(W - 1, 0)` is a sliding window of W keys, the query's own included); `softcap` > 0 caps each scaled score
    s at `softcap * tanh(s / softcap)`; `alibi_slopes` (H,) or (B, H) subtracts `slope * |i - j|`;
    `sinks` (H,) adds one learned logit per query head to each row's softmax denominator (gpt-oss), with its
    gradient when it requires grad. Slopes and sinks are taken in float32.

    FP8: query, key and value all float8_e4m3fn (4-D; attngen.quantize_fp8 makes them), with FA3's descales
    `q_descale`, `k_descale`, `v_descale` (float32, (1,) or (batch, kv_heads); None is 1): each stored value x
    stands for x * descale. The output is bfloat16. Forward only (inputs that require grad are refused). V is
    copied once per call into the layout the kernel's P V reads (keys contiguous; the Hopper kernel's V^T with its
    keys permuted within each 16), unless the Triton kernel runs and V's keys are contiguous already.
    """
    fp8 = fp8_inputs.is_fp8(query, key, value)
    if fp8 or q_descale is not None or k_descale is not None or v_descale is not None:
        return _fp8_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                              softcap, alibi_slopes, sinks, dict(q_descale=q_descale, k_descale=k_descale,
                                                                 v_descale=v_descale))
    if window_size is not NO_WINDOW or softcap or alibi_slopes is not None or sinks is not None:
        variant = _checked_variant(query, is_causal, window_size, softcap, alibi_slopes, sinks)
    else:
        variant = None
    planned = False
    if torch.compiler.is_compiling():  # traced: the shapes are checked (`_checked_plan`), no plans kept
        plan = _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant)
    else:
        signature = _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant)
        plan = None if signature is None else PLANS.get(signature)
        planned = plan is not None
        if plan is None:
            plan = _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant)
            if signature is not None:
                PLANS.keep(signature, plan)
    op_key, scale, squeeze = plan.key, plan.scale, plan.squeeze
    if planned:
        # from the signature's third call on, the launches of its second (attngen/runtime/replay.py); a variant's
        # run-time tensors (this call's, checked above) only without autograd: the signature says which
        if variant is not None and variant.tensors:
            return autograd.replayed_forward(plan.inference, op_key, scale, squeeze, query, key, value,
                                             tensors=variant.tensors)
        if not autograd.needs_grad(query, key, value):
            return autograd.replayed_forward(plan.inference, op_key, scale, squeeze, query, key, value)
        return autograd.planned_forward(plan.training, op_key, scale, squeeze, query, key, value)
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    if variant is not None and variant.tensors:
        out, _ = autograd.attention_forward(op_key, query, key, value, scale, tensors=variant.tensors)
    else:
        out, _ = autograd.attention_forward(op_key, query, key, value, scale)
    return out.squeeze(0) if squeeze else out


def _fp8_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, softcap,
                   alibi_slopes, sinks, descales: dict) -> torch.Tensor:
    """`attention` on FP8 inputs: every check before the launch, the descales after the variant's tensors (the
    kernel's run-time tensors in `Spec.runtime_tensors` order), no plans or replays (they hold q, k and v only)."""
    if not fp8_inputs.is_fp8(query, key, value):
        given = next(name for name, t in descales.items() if t is not None)
        raise KernelInputError(f"{given} is for float8_e4m3fn inputs; query, key and value are {query.dtype}")
    extra = fp8_inputs.checked_descales(query, key, value, descales)
    variant = None
    if window_size is not NO_WINDOW or softcap or alibi_slopes is not None or sinks is not None:
        variant = _checked_variant(query, is_causal, window_size, softcap, alibi_slopes, sinks)
    plan = _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant)
    tensors = (variant.tensors if variant is not None else ()) + extra
    out, _ = autograd.attention_forward(plan.key, query, key, value, plan.scale, tensors=tensors)
    return out


class _Variant(NamedTuple):
    """`attention()`'s variant arguments, checked: the arguments `sdpa_key` takes (the window normalised:
    right 0 under `is_causal`), and the run-time tensors in the order the kernel takes them (slopes, then
    sinks; float32)."""
    window: tuple[int, int]
    softcap: float
    alibi: bool
    sinks: bool
    tensors: tuple[torch.Tensor, ...]

    def options(self) -> dict:
        """The keyword arguments of `sdpa_key` and `sdpa_variant`."""
        return dict(window=self.window, softcap=self.softcap, alibi=self.alibi, sinks=self.sinks)


def _checked_variant(query, is_causal, window_size, softcap, alibi_slopes, sinks) -> _Variant:
    """The variant arguments' checks (a bad one raises a ValueError naming it, before anything runs)."""
    window = checked_window(is_causal, window_size, "is_causal")
    softcap = checked_softcap(softcap, alibi_slopes)
    if not isinstance(query, torch.Tensor) or query.dim() not in (3, 4):  # (_checked_plan says why)
        return _Variant(window, float(softcap), alibi_slopes is not None, sinks is not None, ())
    heads = query.shape[-3]
    batch = query.shape[0] if query.dim() == 4 else 1
    tensors = []
    if alibi_slopes is not None:
        # ((1, H) slopes of 3-D inputs are the one sequence's: the kernel reads (B, H) with B = 1)
        tensors.append(_checked_float("alibi_slopes", alibi_slopes, query, ((heads,), (batch, heads))))
    if sinks is not None:
        tensors.append(_checked_float("sinks", sinks, query, ((heads,),)))
    return _Variant(window, float(softcap), alibi_slopes is not None, sinks is not None, tuple(tensors))


def checked_window(causal, window_size, causal_name: str) -> tuple[int, int]:
    """flash-attn's `window_size` (left, right), checked; right 0 under `causal` (named `causal_name` in the error),
    NO_WINDOW when causal leaves it unbounded."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(type(w) is int and w >= -1 for w in window_size)):
        raise KernelInputError(f"window_size must be two ints (left, right), each -1 (unbounded) or >= 0; "
                               f"got {window_size!r}")
    left, right = window_size
    if not causal:
        return left, right
    if right > 0:
        raise KernelInputError(f"window_size {tuple(window_size)!r} looks right of the query, which "
                               f"{causal_name}=True hides: its right side must be 0 or -1")
    return (left, 0) if left >= 0 else NO_WINDOW


def checked_softcap(softcap, alibi_slopes) -> float:
    """flash-attn's `softcap`, checked (0: none; it cannot be combined with ALiBi)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise KernelInputError(f"softcap must be a finite number >= 0 (0: no soft-capping); got {softcap!r}")
    if softcap and alibi_slopes is not None:
        raise KernelInputError("softcap and alibi_slopes cannot be combined; write a spec with a score expression")
    return float(softcap)


def _checked_float(name, t, query, shapes) -> torch.Tensor:
    """A run-time tensor of the variant in float32 (a differentiable cast, so that sinks get their gradient); any
    other than the sinks that requires grad while grad mode is on is refused, as `Kernel.__call__` refuses it
    (attngen computes no gradient for ALiBi's slopes: it would silently be missing)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if name != "sinks" and t.requires_grad and torch.is_grad_enabled():
        raise KernelInputError(f"{name} requires grad, but attngen computes gradients for q, k, v and sinks only: "
                               f"pass {name}.detach() to use it as a constant")
    if tuple(t.shape) not in shapes:
        raise KernelInputError(f"{name} must have shape " + " or ".join(str(s) for s in shapes)
                               + f" for query {tuple(query.shape)}; got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise KernelInputError(f"{name} must be a floating-point tensor; got {t.dtype}")
    if t.device != query.device:
        raise KernelInputError(f"{name} is on {t.device} and query on {query.device}")
    return t.float().contiguous()


# PLANS holds _signature(...) -> autograd.Plan of calls that passed `_checked_plan`: a training loop or a
# decoder's prefill repeats its layouts, and the second call of one skips the checks (as attngen/api/kvcache.py's
# plans do, benchmarks/NOTES.md v33), the third the module's Python too (v35; with autograd, v36). The
# signature holds everything the checks read, so a call that would fail them never hits.
def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant=None):
    """The key of `PLANS`: "sdpa" (this call path), each tensor's `tensor_signature`, the other arguments'
    values (a checked `variant`'s window and softcap after them), whether Triton interprets and the tuning
    tables' generation (a replay keeps the config it was recorded with); with ALiBi slopes or sinks, their
    layouts and grad mode too (a planned call brings its own tensors, checked by `_checked_variant`). None where an
    argument is not of the plain type the checks expect, or the variant has run-time tensors and the call is
    recorded for autograd (the sinks' gradient is made by torch operations a replay would not repeat)."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and attn_mask is None and type(is_causal) is bool and type(enable_gqa) is bool
            and type(dropout_p) in (float, int) and (scale is None or type(scale) in (float, int))):
        return None
    if variant is None:
        return ("sdpa", tensor_signature(query), tensor_signature(key), tensor_signature(value), dropout_p,
                is_causal, scale, enable_gqa, interpreting(), tables.generation(), policy.generation())
    if variant.alibi or variant.sinks:
        if autograd.needs_grad(query, key, value, *variant.tensors):
            return None
        return ("sdpa", tensor_signature(query), tensor_signature(key), tensor_signature(value), dropout_p, is_causal,
                scale, enable_gqa, interpreting(), tables.generation(), policy.generation(), variant.window, variant.softcap,
                tuple(tensor_signature(t) for t in variant.tensors), variant.alibi, torch.is_grad_enabled())
    return ("sdpa", tensor_signature(query), tensor_signature(key), tensor_signature(value), dropout_p, is_causal,
            scale, enable_gqa, interpreting(), tables.generation(), policy.generation(), variant.window, variant.softcap)


def _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant=None) -> tuple:
    """`attention`'s checks (a bad argument raises, naming it, before anything runs): an `autograd.Plan` (the key
    of the kernel that runs the call, the softmax scale, whether the inputs are 3-D)."""
    if attn_mask is not None:
        raise KernelInputError("attn_mask is not supported; use is_causal, or write a spec with the mask you need")
    if dropout_p != 0.0:
        raise KernelInputError(f"dropout_p must be 0.0; got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dim() not in (3, 4):
            raise KernelInputError(f"{name} must be (batch, heads, seq, head_dim) or (heads, seq, head_dim); "
                                   f"got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise KernelInputError(f"{name} has dtype {t.dtype}; supported are float16, bfloat16, float32 and "
                                   "float8_e4m3fn")
    if not (query.dim() == key.dim() == value.dim()):
        raise KernelInputError("query, key and value must have the same number of dimensions")
    if not (query.dtype == key.dtype == value.dtype):
        raise KernelInputError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim:
        raise KernelInputError(f"query and key must share a head dim; got {head_dim} and {key.shape[-1]}")
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise KernelInputError(f"head dim {head_dim} is not supported: it must be a multiple of 16 from 16 to 256")
    # value may have another head dim, as SDPA allows (the output takes it): `head_dim_v` of the spec
    head_dim_v = value_head_dim(value, head_dim)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise KernelInputError(f"query has {query.shape[1]} heads and key {key.shape[1]}; "
                               "pass enable_gqa=True for grouped-query attention")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale)
    # The op checks again when it runs; checking here names SDPA's arguments and fails before it is
    # dispatched. While torch.compile traces, the spec cannot be parsed (the loader does not trace),
    # so only the shapes are checked here.
    dtype = _DTYPES[query.dtype]
    if variant is None and head_dim_v is None:
        op_key, spec_variant = f"sdpa:{dtype}:{head_dim}:{'causal' if is_causal else 'full'}", Variant()
    else:
        options = variant.options() if variant is not None else {}
        op_key = sdpa_key(dtype, head_dim, bool(is_causal), **options, head_dim_v=head_dim_v)
        spec_variant = sdpa_variant(bool(is_causal), **options) if options else Variant()
    if not torch.compiler.is_compiling():
        check_attention_inputs(sdpa_spec(dtype, head_dim, bool(is_causal), spec_variant, **v_keyword(head_dim_v)),
                               query, key, value, names=("query", "key", "value"))
    elif (query.shape[0] != key.shape[0] or key.shape[:-1] != value.shape[:-1] or key.shape[1] == 0
          or query.shape[1] % key.shape[1]):
        raise KernelInputError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                               "must share batch, key and value must have one shape, and the query heads must "
                               "be a multiple of the key/value heads")
    return autograd.Plan.new(op_key, float(scale), squeeze)
