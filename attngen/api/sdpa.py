"""The drop-in for `torch.nn.functional.scaled_dot_product_attention`.

`attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)` checks its arguments the way SDPA
does and runs the kernels of the spec it needs (one per dtype, head dim and mask: sequence lengths,
batch and heads are run-time arguments of one compiled kernel) through
`attngen.runtime.autograd.attention_forward`: the custom op `torch.ops.attngen.forward` while torch.compile
traces (it keeps the call and its registered backward inside one graph), a plain autograd.Function
in eager mode. The spec is loaded on first use. A call whose signature (`_signature`) repeats an earlier
call's skips the checks that call passed (its plan in `attngen.runtime.plans.PLANS`, the one cache of the three
call paths), and from the signature's third call on replays the launches of its second
(attngen/runtime/replay.py) instead of running `Kernel.forward` again: without autograd here, with it in
`autograd._Planned`, whose backward replays too.
"""

from __future__ import annotations

import math

import torch

from ..env import interpreting
from ..errors import KernelInputError
from ..lang.builtin import sdpa_spec
from ..runtime import autograd, tables
from ..runtime.arguments import check_attention_inputs, check_scale, tensor_signature
from ..runtime.plans import PLANS

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with the semantics of
    `torch.nn.functional.scaled_dot_product_attention`.

    query (B, H, L, E), key and value (B, H_KV, S, E); 3-D inputs (H, L, E) are taken as batch 1.
    `is_causal` aligns the mask top-left, as SDPA does (query i sees keys 0..i, also when L != S).
    `enable_gqa` lets H be a multiple of H_KV. `attn_mask` and `dropout_p` are not supported.
    """
    planned = False
    if torch.compiler.is_compiling():  # traced: the shapes are checked (`_checked_plan`), no plans kept
        plan = _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        signature = _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        plan = None if signature is None else PLANS.get(signature)
        planned = plan is not None
        if plan is None:
            plan = _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            if signature is not None:
                PLANS.keep(signature, plan)
    op_key, scale, squeeze = plan.key, plan.scale, plan.squeeze
    if planned:
        # from the signature's third call on, the launches of its second (attngen/runtime/replay.py)
        if not autograd.needs_grad(query, key, value):
            return autograd.replayed_forward(plan.inference, op_key, scale, squeeze, query, key, value)
        return autograd.planned_forward(plan.training, op_key, scale, squeeze, query, key, value)
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    out, _ = autograd.attention_forward(op_key, query, key, value, scale)
    return out.squeeze(0) if squeeze else out


# PLANS holds _signature(...) -> autograd.Plan of calls that passed `_checked_plan`: a training loop or a
# decoder's prefill repeats its layouts, and the second call of one skips the checks (as attngen/api/kvcache.py's
# plans do, benchmarks/NOTES.md v33), the third the module's Python too (v35; with autograd, v36). The
# signature holds everything the checks read, so a call that would fail them never hits.
def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The key of `PLANS`: "sdpa" (this call path), each tensor's `tensor_signature`, the other arguments'
    values, whether Triton interprets and the tuning tables' generation (a replay keeps the config it was
    recorded with); None where an argument is not of the plain type the checks expect (checked afresh)."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
            and attn_mask is None and type(is_causal) is bool and type(enable_gqa) is bool
            and type(dropout_p) in (float, int) and (scale is None or type(scale) in (float, int))):
        return None
    return ("sdpa", tensor_signature(query), tensor_signature(key), tensor_signature(value), dropout_p, is_causal,
            scale, enable_gqa, interpreting(), tables.generation())


def _checked_plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple:
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
            raise KernelInputError(f"{name} has dtype {t.dtype}; supported are float16, bfloat16 and float32")
    if not (query.dim() == key.dim() == value.dim()):
        raise KernelInputError("query, key and value must have the same number of dimensions")
    if not (query.dtype == key.dtype == value.dtype):
        raise KernelInputError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    head_dim = query.shape[-1]
    if value.shape[-1] != head_dim or key.shape[-1] != head_dim:
        raise KernelInputError(f"query, key and value must share a head dim; got {head_dim}, "
                               f"{key.shape[-1]} and {value.shape[-1]}")
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise KernelInputError(f"head dim {head_dim} is not supported: it must be a multiple of 16 from 16 to 256")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise KernelInputError(f"query has {query.shape[1]} heads and key {key.shape[1]}; "
                               "pass enable_gqa=True for grouped-query attention")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale)
    # The op checks again when it runs; checking here names SDPA's arguments and fails before it is
    # dispatched. While torch.compile traces, the spec cannot be parsed (the loader does not trace),
    # so only the shapes are checked here.
    if not torch.compiler.is_compiling():
        check_attention_inputs(sdpa_spec(_DTYPES[query.dtype], head_dim, bool(is_causal)), query, key, value,
                               names=("query", "key", "value"))
    elif query.shape[0] != key.shape[0] or key.shape != value.shape or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise KernelInputError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                               "must share batch, key and value must have one shape, and the query heads must "
                               "be a multiple of the key/value heads")
    return autograd.Plan.new(f"sdpa:{_DTYPES[query.dtype]}:{head_dim}:{'causal' if is_causal else 'full'}",
                             float(scale), squeeze)
