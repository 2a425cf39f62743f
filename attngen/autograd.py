"""Gradients: the generated kernels as torch custom ops with a registered backward.

`torch.ops.attngen.forward(key, q, k, v, scale) -> (out, lse)` and
`torch.ops.attngen.backward(key, do, q, k, v, out, lse, scale) -> (dq, dk, dv)` run the kernel
named by `key`; the forward op's autograd formula calls the backward op, so `.backward()` works on
q, k and v (any subset requiring grad) and `torch.compile` keeps both in one graph. `key` is either
a loaded kernel's registry key (`Kernel.key`), or `sdpa:<dtype>:<head_dim>:<causal|full>` for
`attngen.attention`, which loads its spec inside the op so that tracing never runs attngen's
loader. The log-sum-exp output carries no gradient.

The ops live in attngen/ops.py, imported the first time torch.compile traces a call: registering
them took 0.1 s of a cached process's first result on the lent H200. Outside `torch.compile`,
`attention_forward` runs the same kernels through a plain `torch.autograd.Function` instead: a
custom op's first call imports torch._dynamo (seconds in a fresh process, more than the cached
kernels take to load), and eager calls gain nothing from it.
"""

from __future__ import annotations

import torch

from .errors import AttnGenError

_KERNELS: dict = {}
_SDPA_SPECS: dict = {}


def register(kernel) -> str:
    """Make a loaded kernel reachable from the ops; returns its key."""
    _KERNELS[kernel.key] = kernel
    return kernel.key


def resolve(key: str):
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    if key.startswith("sdpa:"):
        from .runtime import load

        spec = _SDPA_SPECS.get(key)
        if spec is None:
            from .api import sdpa_spec

            _, dtype, head_dim, mask = key.split(":")
            spec = _SDPA_SPECS[key] = sdpa_spec(dtype, int(head_dim), mask == "causal")
        return load(spec)  # a spec object load() has seen: a dictionary lookup
    raise AttnGenError(f"no attngen kernel with key {key!r} is loaded in this process")


def _setup_context(ctx, inputs, output):
    key, q, k, v, scale = inputs
    out, lse = output
    ctx.key, ctx.scale = key, scale
    ctx.save_for_backward(q, k, v, out, lse)


def _gradients(ctx, d_out, backward):
    """The forward's input gradients (key, q, k, v, scale) from `backward(key, d_out, q, k, v, out, lse,
    scale) -> (dq, dk, dv)`: the backward op (traceable) or the kernel's own method (eager)."""
    q, k, v, out, lse = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None
    dq, dk, dv = backward(ctx.key, d_out, q, k, v, out, lse, ctx.scale)
    need = ctx.needs_input_grad
    return None, dq if need[1] else None, dk if need[2] else None, dv if need[3] else None, None


class _Eager(torch.autograd.Function):
    """The forward op and its autograd formula, for eager calls (see the module docstring)."""

    @staticmethod
    def forward(ctx, key, q, k, v, scale):
        output = resolve(key).forward(q, k, v, scale)
        _setup_context(ctx, (key, q, k, v, scale), output)
        ctx.mark_non_differentiable(output[1])
        return output

    @staticmethod
    def backward(ctx, d_out, d_lse):
        # (q, k, v, out and lse were checked by the forward and are guarded by autograd since: only
        # d_out is checked again)
        return _gradients(ctx, d_out, lambda key, do, q, k, v, out, lse, scale:
                          resolve(key).backward_saved(q, k, v, out, lse, do, scale))


def attention_forward(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernel named by `key` on checked inputs, recorded for autograd when q, k or v
    require grad: through the custom op while torch.compile traces, else directly."""
    if torch.compiler.is_compiling():
        from . import ops  # noqa: F401 - registers the ops (torch.compile imports it, it does not trace it)

        return torch.ops.attngen.forward(key, q, k, v, scale)
    if needs_grad(q, k, v):
        return _Eager.apply(key, q, k, v, scale)
    return resolve(key).forward(q, k, v, scale)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
