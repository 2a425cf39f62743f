"""attngen as PyTorch's flash-attention implementation (torch.nn.attention's provider slot, as FA3 and FA4 use it).

    import attngen, torch
    torch.nn.attention.activate_flash_attention_impl("attngen")   # SDPA's flash backend and varlen_attn run attngen
    torch.nn.attention.restore_flash_attention_impl()              # torch's own kernels again

`import attngen` registers "attngen" (`register`; nothing is compiled or activated: torch asks providers to leave
that to the user). Activating it (`activate`) overrides, for CUDA tensors, the aten ops torch's FA4 provider
overrides, each with the schema of the installed torch (`OPS`; an op this torch lacks is skipped, one whose schema
takes arguments this module does not know makes activation fail with a message naming them):
`_flash_attention_forward` (and its no-dropout in-place form), `_flash_attention_backward`,
`_scaled_dot_product_flash_attention` and its backward. Dense calls (no cum_seq_q; (B, N, H, D) for the
`_flash_attention_*` ops, (B, H, N, D) for the SDPA ones) run `attngen.attention`'s kernels where queries and
keys have one length or nothing is masked, else the varlen kernels, which align causal masks and windows
bottom-right as flash-attn does; varlen calls (cum_seq_q/cum_seq_k, seqused_k, block_table) run
`flash_attn_varlen_func`'s. The outputs are the schemas' own: the log-sum-exp (B, H, N) dense or (H, total_q)
varlen in float32, rng state and philox tensors left unset (as torch's own kernel leaves them without dropout),
an empty debug mask. dropout_p > 0, return_debug_mask and
anything else attngen cannot do raise an error naming the argument. `calls` counts the ops that reached attngen.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..api import sdpa
from ..api import varlen as varlen_api
from ..errors import AttnGenError, KernelInputError
from ..lang.builtin import NO_WINDOW
from ..runtime import autograd
from ..runtime.plans import PLANS
from ..runtime.registry import resolve

NAME = "attngen"

calls: dict[str, int] = {}  # op name -> how many calls reached attngen since the process started


def register() -> bool:
    """Register "attngen" with torch.nn.attention's flash-attention registry (not activated); False where the
    installed torch has no such registry."""
    try:
        from torch.nn.attention import register_flash_attention_impl
    except ImportError:
        return False
    register_flash_attention_impl(NAME, register_fn=activate)
    return True


@dataclass
class Handle:
    """The overrides of one activation; `remove()` gives the ops back to torch's kernels."""
    library: object

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def activate(dispatch_key: str = "CUDA") -> Handle:
    """Override the ops of `OPS` the installed torch has for `dispatch_key` (torch.nn.attention's register_fn;
    the tests pass "CPU" to run them through the dispatcher on CPU tensors). Raises AttnGenError, before
    overriding any, where an op's schema does not match what attngen implements."""
    found = [(name, getattr(torch.ops.aten, name).default._schema, fn) for name, fn in OPS.items()
             if hasattr(torch.ops.aten, name)]
    for name, schema, fn in found:
        error = schema_mismatch(schema, fn)
        if error:
            raise AttnGenError(f"attngen cannot take over aten::{name} on torch {torch.__version__}: {error}. "
                               f"This torch's schema is {schema}")
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for name, _, fn in found:
        library.impl(name, fn, dispatch_key)
    return Handle(library)


def schema_mismatch(schema, fn) -> str | None:
    """Why `fn` cannot implement the op `schema` (a torch FunctionSchema), or None: every argument of the schema
    must be a parameter of `fn`, positional ones in the schema's order, keyword-only ones keyword-only; `fn`'s
    parameters the schema lacks must have defaults; the number of returns must be `fn`'s `RETURNS`."""
    params = inspect.signature(fn).parameters
    positional = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    schema_positional = [a.name for a in schema.arguments if not a.kwarg_only]
    schema_keyword = {a.name for a in schema.arguments if a.kwarg_only}
    if schema_positional != positional[:len(schema_positional)]:
        return f"its positional arguments are ({', '.join(schema_positional)}), attngen's ({', '.join(positional)})"
    unknown = sorted(schema_keyword - keyword)
    if unknown:
        return f"attngen does not know its argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
    missing = [p.name for p in params.values() if p.name not in schema_positional and p.name not in schema_keyword
               and p.default is inspect.Parameter.empty]
    if missing:
        return f"it lacks the argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    if len(schema.returns) != fn.RETURNS:
        return f"it returns {len(schema.returns)} values, attngen's {fn.RETURNS}"
    return None


def _count(name: str) -> None:
    calls[name] = calls.get(name, 0) + 1


def _unsupported(op: str, dropout_p=0.0, return_debug_mask=False) -> None:
    if dropout_p != 0.0:
        raise KernelInputError(f"attngen's aten::{op} has no dropout: dropout_p must be 0.0, got {dropout_p}")
    if return_debug_mask:
        raise KernelInputError(f"attngen's aten::{op} cannot return a debug mask: return_debug_mask must be False")


def _alibi_without_grad(op: str, alibi_slopes, *inputs) -> None:
    # NOTE: aten::_flash_attention_backward takes no alibi_slopes: a backward of this call would drop them
    if alibi_slopes is not None and any(t.requires_grad for t in inputs):
        raise KernelInputError(f"attngen's aten::{op} takes alibi_slopes only for inputs that do not require grad "
                               "(aten::_flash_attention_backward has no alibi_slopes)")


def _window(is_causal: bool, left, right) -> tuple[int, int]:
    """aten's window_size_left/right (None or -1: unbounded) as flash-attn's (left, right), right 0 when causal."""
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    if is_causal:
        return (left, 0) if left >= 0 else NO_WINDOW
    return left, right


def _dense_ok(q_len: int, k_len: int, is_causal: bool, window, alibi_slopes) -> bool:
    """Whether a dense call runs attngen.attention's kernels: they align masks top-left, flash-attn bottom-right,
    which agree when queries and keys have one length or nothing depends on positions."""
    return q_len == k_len or not (is_causal or window != NO_WINDOW or alibi_slopes is not None)


def _dense_plan(q, k, v, is_causal: bool, window, scale, alibi_slopes):
    """The `autograd.Plan` of a dense call on attention()'s kernels (q, k, v (B, H, N, D)), and its run-time
    tensors: `attention()`'s checks, kept in `PLANS` under "torch_flash" and attention()'s signature, so that a
    repeated layout skips them and replays its forward's launches as attention() does."""
    variant = None
    if window != NO_WINDOW or alibi_slopes is not None:
        variant = sdpa._checked_variant(q, is_causal, window, 0.0, alibi_slopes, None)
    signature = sdpa._signature(q, k, v, None, 0.0, is_causal, scale, True, variant)
    tensors = variant.tensors if variant is not None else ()  # (this call's: checked above, planned or not)
    if signature is not None:
        signature = ("torch_flash",) + signature[1:]
        plan = PLANS.get(signature)
        if plan is not None:
            return plan, tensors
    plan = sdpa._checked_plan(q, k, v, None, 0.0, is_causal, scale, True, variant)
    if signature is not None:
        PLANS.keep(signature, plan)
    return plan, tensors


def _dense_forward(q, k, v, o, is_causal: bool, scale, window, alibi_slopes) -> torch.Tensor:
    """The log-sum-exp (B, H, N) of attention()'s kernels on (B, H, N, D) views, the output written into `o`."""
    plan, tensors = _dense_plan(q, k, v, is_causal, window, scale, alibi_slopes)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if tensors or o.stride() != q.stride():  # (a replay holds q, k and v's layouts, and out laid out as q)
        resolve(plan.key).forward(q, k, v, plan.scale, out=o, lse=lse, tensors=tensors)
    else:
        autograd.replayed_forward(plan.inference, plan.key, plan.scale, False, q, k, v, lse, o)
    return lse


def _dense_backward(op, q, k, v, o, logsumexp, do, is_causal: bool, scale, window):
    """(dq, dk, dv) of attention()'s kernels on (B, H, N, D) views."""
    plan, _ = _dense_plan(q, k, v, is_causal, window, scale, None)
    if o.shape != q.shape or logsumexp.shape != q.shape[:3] or logsumexp.dtype != torch.float32:
        raise KernelInputError(f"attngen's aten::{op}: out {tuple(o.shape)} and logsumexp "
                               f"{tuple(logsumexp.shape)} are not what its forward returned for a query of "
                               f"(batch, heads, seq, dim) {tuple(q.shape)}")
    # (q, k, v, out and the log-sum-exp are what the forward took and returned, saved by torch's autograd: only the
    # output gradient is checked, and the launches replayed, as attention()'s backward does; without the replays a
    # short backward waited on the host: 0.64x attention()'s throughput at N=1024 on the H100)
    return autograd.replayed_backward(plan.training, plan.key, plan.scale, False, q, k, v, o,
                                      logsumexp.contiguous(), do)


def _packed(q, k, v):
    """A dense (B, N, H, D) call as varlen: (B * N, H, D) tensors and uniform cu_seqlens."""
    (b, n_q), n_k = q.shape[:2], k.shape[1]
    steps = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    flat = [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
    return (*flat, steps * n_q, steps * n_k)


def _forward(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window, seqused_k,
             alibi_slopes, block_table, out):
    """(out, lse) of a `_flash_attention_forward` call: dense (B, N, H, D) or varlen (total, H, D)."""
    if cum_seq_q is None:
        if seqused_k is not None or block_table is not None:
            raise KernelInputError(f"attngen's aten::{op} takes seqused_k and block_table with cum_seq_q only")
        out = torch.empty_like(query) if out is None else out
        if _dense_ok(query.shape[1], key.shape[1], is_causal, window, alibi_slopes):
            q, k, v, o = (t.transpose(1, 2) for t in (query, key, value, out))
            return out, _dense_forward(q, k, v, o, is_causal, scale, window, alibi_slopes)
        q, k, v, cu_q, cu_k = _packed(query, key, value)
        flat, lse = _varlen(q, k, v, cu_q, cu_k, query.shape[1], key.shape[1], is_causal, scale, window, None,
                            alibi_slopes, None)
        out.copy_(flat.view_as(out))
        return out, lse.view(query.shape[2], query.shape[0], query.shape[1]).transpose(0, 1).contiguous()
    if cum_seq_k is None:
        raise KernelInputError(f"attngen's aten::{op} needs cum_seq_k with cum_seq_q")
    return _varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window, seqused_k,
                   alibi_slopes, block_table, out)


def _varlen_planned(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, seqused_k, alibi_slopes,
                    block_table):
    """(signature, plan) of a varlen call in `PLANS` under "torch_flash_varlen" and flash_attn_varlen_func's
    signature (`varlen_api.signature_of`); plan None where none is kept yet or the call is not planned (signature
    None)."""
    signature = varlen_api.signature_of("torch_flash_varlen", q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale,
                                        is_causal, window, 0.0, alibi_slopes, block_table, seqused_k, None)
    plan = None if signature is None else PLANS.get(signature)
    return signature, (plan if plan is not None and plan.lengths_ok(max_q, max_k) else None)


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, seqused_k, alibi_slopes, block_table,
            out=None):
    """(out, lse (H, total_q)) of flash_attn_varlen_func's kernels, without autograd: a repeated layout skips the
    checks and replays the launches as flash_attn_varlen_func does (not with `out` given)."""
    max_q, max_k = int(max_q), int(max_k)
    signature, plan = (None, None) if out is not None else _varlen_planned(
        q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, seqused_k, alibi_slopes, block_table)
    if plan is not None:
        seqlens_k, shared = varlen_api.planned_offsets(q, k, cu_q, cu_k, max_q, max_k, seqused_k, block_table)
        return autograd.replayed_varlen_forward(plan.replays(max_q, max_k), plan.key, plan.scale, q, k, v, cu_q,
                                                cu_k, seqlens_k, block_table, (max_q, max_k), shared,
                                                varlen_api.planned_tensors(alibi_slopes, None))
    checked = varlen_api._checked_plan(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, is_causal, window, 0.0,
                                       alibi_slopes, block_table, seqused_k, None)
    kernel = resolve(checked.key)
    result = kernel(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                    seqused_k=seqused_k, block_table=block_table, scale=checked.scale, return_lse=True, out=out,
                    **checked.tensors)
    if signature is not None:
        PLANS.keep(signature, varlen_api.PlannedVarlen(checked.key, checked.scale, kernel))
    return result


def _backward(op, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
              window):
    """(dq, dk, dv) of a `_flash_attention_backward` call, laid out as query, key and value."""
    if cum_seq_q is None:
        if _dense_ok(query.shape[1], key.shape[1], is_causal, window, None):
            q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
            return tuple(g.transpose(1, 2) for g in _dense_backward(op, q, k, v, o, logsumexp, do, is_causal, scale,
                                                                    window))
        q, k, v, cu_q, cu_k = _packed(query, key, value)
        lse = logsumexp.transpose(0, 1).reshape(query.shape[2], -1)  # (B, H, N) as (H, B * N)
        grads = _varlen_grads(q, k, v, out.reshape(q.shape), lse, grad_out.reshape(q.shape), cu_q, cu_k,
                              query.shape[1], key.shape[1], is_causal, scale, window)
        return tuple(g.view_as(t) for g, t in zip(grads, (query, key, value)))
    if cum_seq_k is None:
        raise KernelInputError(f"attngen's aten::{op} needs cum_seq_k with cum_seq_q")
    return _varlen_grads(query, key, value, out, logsumexp, grad_out, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                         scale, window)


def _varlen_grads(q, k, v, out, lse, do, cu_q, cu_k, max_q, max_k, is_causal, scale, window):
    """(dq, dk, dv) of flash_attn_varlen_func's kernels for the output gradient `do`, from the output and the
    log-sum-exp (H, total_q) its forward returned (every key of each sequence: the backward takes no seqused_k)."""
    max_q, max_k = int(max_q), int(max_k)
    signature, plan = _varlen_planned(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, None, None, None)
    if plan is None:
        checked = varlen_api._checked_plan(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, is_causal, window, 0.0,
                                           None, None, None, None)
        plan = varlen_api.PlannedVarlen(checked.key, checked.scale, resolve(checked.key))
        if signature is not None:
            PLANS.keep(signature, plan)
    if out.shape != q.shape or lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32:
        raise KernelInputError(f"out {tuple(out.shape)} and logsumexp {tuple(lse.shape)} are not what the varlen "
                               f"forward returned for query {tuple(q.shape)}")
    seqlens_k, shared = varlen_api.planned_offsets(q, k, cu_q, cu_k, max_q, max_k, None, None)
    # (the backward's replays are the plan's training ones: kept per layout of the output gradient and the output,
    # as attention()'s; the first call of a layout checks do)
    return autograd.replayed_varlen_backward(plan.training, plan.key, plan.scale, q, k, v, out, lse.contiguous(), do,
                                             cu_q, cu_k, seqlens_k, shared)


# -- the ops, with the installed torch's schemas (torch 2.13's parameters; `schema_mismatch` compares) -------------

def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                             seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    # (num_splits is a hint attngen's kernels decide for themselves)
    out, lse = _forward_op("_flash_attention_forward", None, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                           dropout_p, is_causal, return_debug_mask, scale, window_size_left, window_size_right,
                           seqused_k, alibi_slopes, block_table)
    return out, lse, *_auxiliary(query)


_flash_attention_forward.RETURNS = 5


def _forward_op(op, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table):
    """The forward ops' common body: counted, refused arguments raised, then `_forward` into `out` (or a new
    tensor when None)."""
    _count(op)
    _unsupported(op, dropout_p, return_debug_mask)
    _alibi_without_grad(op, alibi_slopes, query, key, value)
    window = _window(is_causal, window_size_left, window_size_right)
    return _forward(op, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window,
                    seqused_k, alibi_slopes, block_table, out)


def _auxiliary(query):
    """The rng state, philox offset and debug mask of a call without dropout: unset, as torch's own flash kernel
    leaves them without dropout (its backward ignores them then, and so does attngen's). torch's FA4 provider fills
    them with zeros: two fill launches a call, host time that a short call cannot hide."""
    return (torch.empty((2,), dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                                is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                                                window_size_right=None, seqused_k=None, alibi_slopes=None,
                                                block_table=None, num_splits=None):
    result, lse = _forward_op("_flash_attention_forward_no_dropout_inplace", out, query, key, value, cum_seq_q,
                              cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale,
                              window_size_left, window_size_right, seqused_k, alibi_slopes, block_table)
    if result is not out:  # (a kernel that could not write into `out` returned its own)
        out.copy_(result)
    return lse


_flash_attention_forward_no_dropout_inplace.RETURNS = 1


def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                              dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                              window_size_right=None):
    op = "_flash_attention_backward"
    _count(op)
    _unsupported(op, dropout_p)
    window = _window(is_causal, window_size_left, window_size_right)
    return _backward(op, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                     scale, window)


_flash_attention_backward.RETURNS = 3


def _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                        *, scale=None):
    op = "_scaled_dot_product_flash_attention"
    _count(op)
    _unsupported(op, dropout_p, return_debug_mask)
    out = torch.empty_like(query)  # (B, H, N, D), laid out as query
    window = _window(is_causal, None, None)
    if _dense_ok(query.shape[2], key.shape[2], is_causal, window, None):  # (no round trip through (B, N, H, D) views)
        lse = _dense_forward(query, key, value, out, is_causal, scale, window, None)
    else:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        _, lse = _forward(op, q, k, v, None, None, None, None, is_causal, scale, window, None, None, None,
                          out.transpose(1, 2))
    return (out, lse, None, None, query.shape[2], key.shape[2], *_auxiliary(query))


_scaled_dot_product_flash_attention.RETURNS = 9


def _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                                                 scale=None):
    op = "_scaled_dot_product_flash_attention_backward"
    _count(op)
    _unsupported(op, dropout_p)
    window = _window(is_causal, None, None)
    if _dense_ok(query.shape[2], key.shape[2], is_causal, window, None):
        return _dense_backward(op, query, key, value, out, logsumexp, grad_out, is_causal, scale, window)
    q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
    grads = _backward(op, do, q, k, v, o, logsumexp, None, None, max_q, max_k, is_causal, scale, window)
    return tuple(g.transpose(1, 2) for g in grads)


_scaled_dot_product_flash_attention_backward.RETURNS = 3

# The aten ops attngen takes over: name -> implementation.
OPS = {fn.__name__: fn for fn in (
    _flash_attention_forward, _flash_attention_forward_no_dropout_inplace, _flash_attention_backward,
    _scaled_dot_product_flash_attention, _scaled_dot_product_flash_attention_backward)}
