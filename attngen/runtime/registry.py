"""The loaded kernels by the key the custom ops and attngen's autograd name them with.

A key is a loaded kernel's `Kernel.key` (`register` adds it when `load` loads the kernel), or
`sdpa:<dtype>:<head_dim>:<causal|full>[:<variant>...]` for `attngen.attention` (lang/builtin.py's `sdpa_key`) or
`varlen:...` for `attngen.flash_attn_varlen_func` (`varlen_key`), whose spec `resolve` loads on first use (inside the op while torch.compile runs the graph, so that tracing never
runs attngen's loader).
"""

from __future__ import annotations

from ..errors import AttnGenError
from ..lang.builtin import sdpa_key_spec, varlen_key_spec

_KERNELS: dict = {}
_SDPA_SPECS: dict = {}  # builtin key -> its spec
_BUILTIN_KEYS = {"sdpa": sdpa_key_spec, "varlen": varlen_key_spec}  # a builtin key's prefix -> its spec's reader


def _no_loader(spec):
    raise AttnGenError("attngen's loader is not set up: import attngen.runtime.kernel first")


# attngen/runtime/kernel.py's `load`, which that module sets here when it is imported: it imports this module
# (its kernels register here), so this one cannot import it.
_load = _no_loader


def set_loader(load) -> None:
    global _load
    _load = load


def register(kernel) -> str:
    """Make a loaded kernel reachable from the ops; returns its key."""
    _KERNELS[kernel.key] = kernel
    return kernel.key


def resolve(key: str):
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    builtin = _BUILTIN_KEYS.get(key.partition(":")[0])
    if builtin is not None:
        spec = _SDPA_SPECS.get(key)
        if spec is None:
            spec = _SDPA_SPECS[key] = builtin(key)
        return _load(spec)  # a spec object load() has seen: a dictionary lookup
    raise AttnGenError(f"no attngen kernel with key {key!r} is loaded in this process")


def setup_context(ctx, inputs, output):
    """Save what the forward's gradient needs (the forward op's and the eager autograd.Function's): inputs
    (key, q, k, v, scale, tensors), the tensors the kernel's run-time ones in `Kernel.tensor_names` order."""
    key, q, k, v, scale, tensors = inputs
    out, lse = output
    ctx.key, ctx.scale = key, scale
    ctx.save_for_backward(q, k, v, out, lse, *tensors)


def gradients(ctx, d_out, backward):
    """The forward's input gradients (key, q, k, v, scale, tensors), the last a list with one entry per run-time
    tensor, from `backward(key, d_out, q, k, v, out, lse, scale, tensors) -> (dq, dk, dv[, dsinks])`: the
    backward op (traceable) or the kernel's own method (eager). Of the run-time tensors only the sinks (the
    last, where the spec has them) get a gradient."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None, [None] * len(tensors)
    dq, dk, dv, *dsinks = backward(ctx.key, d_out, q, k, v, out, lse, ctx.scale, tuple(tensors))
    need = ctx.needs_input_grad
    extra = [None] * len(tensors)
    if dsinks and tensors[-1].requires_grad:
        extra[-1] = dsinks[0]
    return None, dq if need[1] else None, dk if need[2] else None, dv if need[3] else None, None, extra


def varlen_setup_context(ctx, inputs, output):
    """What a varlen forward's gradient needs: inputs (key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale,
    tensors), the tensors in `Kernel.tensor_names` order."""
    key, q, k, v, cu_q, cu_k, seqlens_k, scale, tensors = inputs
    ctx.key, ctx.scale = key, scale
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, seqlens_k, *tensors)


def varlen_gradients(ctx, d_out, backward) -> tuple:
    """The varlen forward's input gradients (key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors),
    the last a list with one entry per run-time tensor (as `gradients`), from `backward(key, q, k, v, out, lse, do,
    cu_q, cu_k, seqlens_k, scale, tensors) -> (dq, dk, dv[, dsinks])`."""
    q, k, v, out, lse, cu_q, cu_k, seqlens_k, *tensors = ctx.saved_tensors
    extra = [None] * len(tensors)
    if d_out is None:
        return (None,) * 8 + (extra,)
    dq, dk, dv, *dsinks = backward(ctx.key, q, k, v, out, lse, d_out, cu_q, cu_k, seqlens_k, ctx.scale, tuple(tensors))
    if dsinks and tensors[-1].requires_grad:
        extra[-1] = dsinks[0]
    need = ctx.needs_input_grad
    return (None, dq if need[1] else None, dk if need[2] else None, dv if need[3] else None) + (None,) * 4 + (extra,)
