"""The loaded kernels by the key the custom ops and attngen's autograd name them with.

A key is a loaded kernel's `Kernel.key` (`register` adds it when `load` loads the kernel), or
`sdpa:<dtype>:<head_dim>:<causal|full>[:<variant>...]` for `attngen.attention` (lang/builtin.py's `sdpa_key`),
whose spec `resolve` loads on first use (inside the op while torch.compile runs the graph, so that tracing never
runs attngen's loader).
"""

from __future__ import annotations

from ..errors import AttnGenError
from ..lang.builtin import sdpa_key_spec

_KERNELS: dict = {}
_SDPA_SPECS: dict = {}


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
    if key.startswith("sdpa:"):
        spec = _SDPA_SPECS.get(key)
        if spec is None:
            spec = _SDPA_SPECS[key] = sdpa_key_spec(key)
        return _load(spec)  # a spec object load() has seen: a dictionary lookup
    raise AttnGenError(f"no attngen kernel with key {key!r} is loaded in this process")


def setup_context(ctx, inputs, output):
    """Save what the forward's gradient needs (the forward op's and the eager autograd.Function's)."""
    key, q, k, v, scale = inputs
    out, lse = output
    ctx.key, ctx.scale = key, scale
    ctx.save_for_backward(q, k, v, out, lse)


def gradients(ctx, d_out, backward):
    """The forward's input gradients (key, q, k, v, scale) from `backward(key, d_out, q, k, v, out, lse,
    scale) -> (dq, dk, dv)`: the backward op (traceable) or the kernel's own method (eager)."""
    q, k, v, out, lse = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None
    dq, dk, dv = backward(ctx.key, d_out, q, k, v, out, lse, ctx.scale)
    need = ctx.needs_input_grad
    return None, dq if need[1] else None, dk if need[2] else None, dv if need[3] else None, None
