"""Gradients: the generated kernels as torch custom ops with a registered backward.

`torch.ops.attngen.forward(key, q, k, v, scale, tensors) -> (out, lse)` and
`torch.ops.attngen.backward(key, do, q, k, v, out, lse, scale, tensors) -> [dq, dk, dv(, dsinks)]` run the
kernel named by `key`; `tensors` are a variant kernel's run-time tensors in `Variant.runtime_tensors` order
(declared tensors, ALiBi slopes, sinks; empty for the others). The forward op's autograd formula calls the
backward op, so `.backward()` works on q, k, v and the sinks (any subset requiring grad; the other run-time
tensors are constants) and `torch.compile` keeps both in one graph. `key` is either
a loaded kernel's registry key (`Kernel.key`), or `sdpa:<dtype>:<head_dim>:<causal|full>` for
`attngen.attention`, which loads its spec inside the op so that tracing never runs attngen's
loader. The log-sum-exp output carries no gradient.

`key` resolves to a kernel in attngen/runtime/registry.py. The ops live in attngen/runtime/ops.py,
imported the first time torch.compile traces a call: registering them took 0.1 s of a cached process's first result on the lent H200. Outside `torch.compile`,
`attention_forward` runs the same kernels through a plain `torch.autograd.Function` instead: a
custom op's first call imports torch._dynamo (seconds in a fresh process, more than the cached
kernels take to load), and eager calls gain nothing from it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .arguments import check_like, gradient_tensors, new_output, output_shape, tensor_signature
from .registry import gradients, resolve, setup_context, varlen_gradients, varlen_setup_context
from .replay import record, wanted


class _Eager(torch.autograd.Function):
    """The forward op and its autograd formula, for eager calls (see the module docstring)."""

    @staticmethod
    def forward(ctx, key, q, k, v, scale, *tensors):
        output = resolve(key).forward(q, k, v, scale, tensors=tensors)
        setup_context(ctx, (key, q, k, v, scale, tensors), output)
        ctx.mark_non_differentiable(output[1])
        return output

    @staticmethod
    def backward(ctx, d_out, d_lse):
        # (q, k, v, out and lse were checked by the forward and are guarded by autograd since: only
        # d_out is checked again)
        *grads, extra = gradients(ctx, d_out, lambda key, do, q, k, v, out, lse, scale, tensors:
                                  resolve(key).backward_saved(q, k, v, out, lse, do, scale, tensors))
        return (*grads, *extra)


class Replays:
    """The replays (attngen/runtime/replay.py) of one `attngen.attention` or `Kernel.__call__` signature's calls, of its
    inference calls or of its autograd calls: the forward's (None: none recorded yet, False: its launches cannot be
    replayed), and for autograd calls the backward's, one per output-gradient layout (autograd hands the
    backward whatever layout the loss made: `out.sum()` gives an expanded one) and deterministic-algorithms
    setting (None: seen once, recorded at the next)."""

    __slots__ = ("forward", "backward")
    KEPT = 16  # backward layouts kept per signature, then the table starts over

    def __init__(self):
        self.forward = None
        self.backward: dict = {}


class Plan(NamedTuple):
    """What the checks of `attngen.attention` or `Kernel.__call__` decide for one call signature: the key of the
    kernel that runs it, the softmax scale, whether the inputs are 3-D; and the replays of its launches
    (attngen/runtime/replay.py) for calls without autograd and with it (filled in by later calls)."""
    key: str
    scale: float
    squeeze: bool
    inference: Replays
    training: Replays

    @classmethod
    def new(cls, key: str, scale: float, squeeze: bool) -> "Plan":
        return cls(key, scale, squeeze, Replays(), Replays())


def replayed_forward(replays: Replays, key: str, scale: float, squeeze: bool, q, k, v, lse=None,
                     out=None, tensors: tuple = ()) -> torch.Tensor:
    """The output of the kernel named by `key` on inputs of a signature `attngen.attention` (or `Kernel.__call__`)
    checked at an earlier call (3-D where `squeeze`): `replays.forward`'s launches where it holds them, else the
    kernel's own path, recorded into `replays.forward` at the first call. `lse`: a float32 tensor of q's rows
    (with a leading 1 where `squeeze`) to write the log-sum-exp into, else it is scratch. `out`: the tensor to
    write the output into (`Kernel.__call__`'s out=, laid out as the signature's and checked for sharing
    memory with q, k and v), else one like q allocated here. `tensors`: the kernel's checked run-time tensors (a
    variant's slopes, sinks), inputs of the replay as q, k and v are (their layouts are the signature's)."""
    out = new_output(q, v) if out is None else out
    inputs = ((q, k, v, out) if lse is None else (q, k, v, out, lse)) + tuple(tensors)

    def run():
        q4, k4, v4, out4 = (t.unsqueeze(0) for t in (q, k, v, out)) if squeeze else (q, k, v, out)
        resolve(key).forward(q4, k4, v4, scale, out=out4, lse=lse, tensors=tensors)

    _forward_launches(replays, inputs, run)
    return out


def _forward_launches(replays: Replays, inputs: tuple, run) -> None:
    """A planned forward's launches on `inputs`: `replays.forward`'s where it holds them (and the replay does not
    decline), else `run()`, the kernel's own path, recorded into `replays.forward` at the first planned call."""
    replay = replays.forward
    if replay and replay(inputs):
        return
    if wanted(replay):
        replays.forward = record(run, inputs)[1] or False
    else:
        run()


_NEW = object()  # a layout `Replays.backward` has not seen


def _backward_layout(replays: Replays, do, out) -> tuple:
    """(the key of a backward's replays in `replays.backward`, what it holds there: `_NEW` for a layout not seen)."""
    # (whether torch insists on deterministic algorithms picks the backward's kernels: a replay is of one)
    layout = (tensor_signature(do), tensor_signature(out), torch.are_deterministic_algorithms_enabled())
    return layout, replays.backward.get(layout, _NEW)


def _backward_launches(replays: Replays, layout, replay, inputs: tuple, run) -> None:
    """A planned backward's launches on `inputs` for one layout (`_backward_layout`): its replay where held (and not
    declining), else `run()`, the kernel's own path, which a layout's first call runs as it is (its launches may
    compile, or take Triton's path to a binary FastJIT has not kept, and a recording of them would fail) and its
    second records."""
    layouts = replays.backward
    if replay is _NEW:
        if len(layouts) >= Replays.KEPT:
            layouts.clear()
        layouts[layout] = None
        run()
    elif replay and replay(inputs):
        return
    elif wanted(replay):
        layouts[layout] = record(run, inputs)[1] or False
    else:
        run()


def _planned_outputs(ctx, with_lse: bool, out, lse):
    """A planned autograd forward's outputs: `out`, or with `with_lse` (out, lse), lse not differentiable."""
    if not with_lse:
        return out
    ctx.mark_non_differentiable(lse)
    return out, lse


class _Planned(torch.autograd.Function):
    """`_Eager` for a call signature `attngen.attention` or `Kernel.__call__` planned: the same kernels, without the
    checks, the forward's launches replayed from the second planned call on (the first records them:
    `replayed_forward`), the backward's from a layout's third (the first runs as it is, the second records),
    and only `out` returned unless `with_lse` (the log-sum-exp is kept for the backward, so autograd makes no
    zero gradient for it). q, k and v are the caller's (3-D where `squeeze`)."""

    @staticmethod
    def forward(ctx, replays: Replays, key: str, scale: float, squeeze: bool, with_lse: bool, q, k, v):
        lse = torch.empty(((1,) if squeeze else ()) + q.shape[:-1], device=q.device, dtype=torch.float32)
        out = replayed_forward(replays, key, scale, squeeze, q, k, v, lse)
        ctx.replays, ctx.key, ctx.scale, ctx.squeeze = replays, key, scale, squeeze
        ctx.save_for_backward(q, k, v, out, lse)
        return _planned_outputs(ctx, with_lse, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _d_lse=None):
        q, k, v, out, lse = ctx.saved_tensors
        grads = replayed_backward(ctx.replays, ctx.key, ctx.scale, ctx.squeeze, q, k, v, out, lse, do)
        need = ctx.needs_input_grad
        return (None, None, None, None, None) + tuple(g if n else None for g, n in zip(grads, need[5:]))


def replayed_backward(replays: Replays, key: str, scale: float, squeeze: bool, q, k, v, out, lse, do) -> tuple:
    """(dq, dk, dv) of the kernel named by `key` for the output gradient `do`, where q, k, v and `scale` are a
    signature's checked at an earlier call (3-D where `squeeze`) and `out` and `lse` what its forward returned:
    `replays.backward`'s launches for this layout of `do` and `out` where it holds them, else the kernel's own
    path, which a layout's second call records (its first runs as it is: its launches may compile, or take
    Triton's path to a binary FastJIT has not kept, and a recording of them would fail). `do` is checked once
    per layout: the rest of the layout is the signature's."""
    layout, replay = _backward_layout(replays, do, out)
    if replay is _NEW:
        check_like(do, q, "do", output_shape(q, v))
    grads = gradient_tensors(q, k, v)
    inputs = (q, k, v, out, lse, do) + grads

    def run():
        q4, k4, v4, out4, do4, dq4, dk4, dv4 = ((t.unsqueeze(0) for t in inputs if t is not lse) if squeeze
                                                else (t for t in inputs if t is not lse))
        resolve(key)._backward(q4, k4, v4, out4, lse, do4, scale, None, (dq4, dk4, dv4))

    _backward_launches(replays, layout, replay, inputs, run)
    return grads


def planned_forward(replays: Replays, key: str, scale: float, squeeze: bool, q, k, v, with_lse: bool = False):
    """The output of the kernel named by `key` on inputs of a signature `attngen.attention` or `Kernel.__call__`
    planned (checked at an earlier call), recorded for autograd (q, k or v requires grad) with the
    signature's autograd replays (`_Planned`); with `with_lse`, (out, lse), lse not differentiable. Eager calls
    only: torch.compile traces the custom op."""
    return _Planned.apply(replays, key, scale, squeeze, with_lse, q, k, v)


def attention_forward(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, tensors: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernel named by `key` on checked inputs, recorded for autograd when q, k, v or a
    tensor of `tensors` (the sinks) require grad: through the custom op while torch.compile traces, else
    directly. `tensors`: the kernel's run-time tensors, checked (`arguments.check_runtime_tensors`), in
    `Variant.runtime_tensors` order."""
    if torch.compiler.is_compiling():
        from . import ops  # noqa: F401 - registers the ops (torch.compile imports it, it does not trace it)

        return torch.ops.attngen.forward(key, q, k, v, scale, list(tensors))
    if needs_grad(q, k, v, *tensors):
        return _Eager.apply(key, q, k, v, scale, *tensors)
    return resolve(key).forward(q, k, v, scale, tensors=tuple(tensors))


class _VarlenEager(torch.autograd.Function):
    """`_Eager` for a varlen kernel (packed sequences): the sequences' int32 offsets and key counts ride along."""

    @staticmethod
    def forward(ctx, key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, *tensors):
        out, lse = resolve(key).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors)
        varlen_setup_context(ctx, (key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors), (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        *grads, extra = varlen_gradients(ctx, d_out, lambda key, *args: resolve(key).varlen_backward(*args))
        return (*grads, *extra)


def varlen_forward(key: str, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale: float,
                   tensors: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_forward` for a varlen kernel: (out, lse (H, TOTAL_Q)) of checked packed inputs, recorded for
    autograd when q, k, v or the sinks require grad, through the custom op `attngen::varlen_forward` while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        from . import ops  # noqa: F401 - registers the ops (torch.compile imports it, it does not trace it)

        return torch.ops.attngen.varlen_forward(key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale,
                                                list(tensors))
    if needs_grad(q, k, v, *tensors):
        return _VarlenEager.apply(key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, *tensors)
    return resolve(key).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tuple(tensors))


# -- planned varlen calls (attngen/api/varlen.py's plans; the slot's varlen ops) ----------------------------------
# The inputs a replay ties addresses to: q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table (and
# for the backward do, dq, dk, dv). A replay needs each address to be one input's: where cu_seqlens_k is
# cu_seqlens_q (self-attention's packing passes one tensor twice) the planned call passes `shared_offsets` and the
# replay holds it once; the plan's signature says whether they were one, so a replay never serves a call where
# they differ.

def replayed_varlen_forward(replays: Replays, key: str, scale: float, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                            block_table=None, max_seqlens: tuple[int, int] | None = None,
                            shared_offsets: bool = False, tensors: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse (H, TOTAL_Q)) of the varlen kernel named by `key` on packed inputs of a signature checked at an
    earlier call (`flash_attn_varlen_func`'s plans): `replays.forward`'s launches where it holds them, else the
    kernel's own path (`Kernel.varlen_forward`), recorded at the signature's first planned call. `seqlens_k`: the
    keys each sequence uses (B,) int32; `max_seqlens` as `attngen.runtime.varlen.forward` takes them (part of the
    signature: a mixed call's schedule reads them); `tensors`: the kernel's run-time tensors (ALiBi's slopes, the
    sinks: float32, in the kernel's order), inputs of the replay as the caller's tensors are. No autograd."""
    out = new_output(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
    inputs = (q, k, v, out, lse, cu_seqlens_q, None if shared_offsets else cu_seqlens_k, seqlens_k, block_table,
              *tensors)

    def run():
        resolve(key).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors,
                                    block_table=block_table, max_seqlens=max_seqlens, out=out, lse=lse)

    _forward_launches(replays, inputs, run)
    return out, lse


def replayed_varlen_backward(replays: Replays, key: str, scale: float, q, k, v, out, lse, do, cu_seqlens_q,
                             cu_seqlens_k, seqlens_k, shared_offsets: bool = False) -> tuple:
    """(dq, dk, dv) of the varlen kernel named by `key` for the output gradient `do`, q, k, v and the offsets a
    signature's checked at an earlier call and `out`, `lse` what its forward returned: as `replayed_backward`,
    per layout of `do` and `out` and deterministic-algorithms setting (the first call of a layout checks `do` and
    runs as it is, the second records, later ones replay)."""
    layout, replay = _backward_layout(replays, do, out)
    if replay is _NEW:
        check_like(do, q, "do", output_shape(q, v))
    grads = gradient_tensors(q, k, v)
    inputs = (q, k, v, out, lse, do, cu_seqlens_q, None if shared_offsets else cu_seqlens_k, seqlens_k) + grads

    def run():
        resolve(key).varlen_backward(q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale,
                                     grads=grads)

    _backward_launches(replays, layout, replay, inputs, run)
    return grads


class _VarlenPlanned(torch.autograd.Function):
    """`_Planned` for a varlen signature `flash_attn_varlen_func` planned: the forward's launches replayed from the
    second planned call on, the backward's from a layout's third; only `out` returned unless `with_lse`."""

    @staticmethod
    def forward(ctx, replays: Replays, key: str, scale: float, shared_offsets: bool, with_lse: bool, q, k, v,
                cu_seqlens_q, cu_seqlens_k, seqlens_k):
        out, lse = replayed_varlen_forward(replays, key, scale, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                           shared_offsets=shared_offsets)
        ctx.replays, ctx.key, ctx.scale, ctx.shared_offsets = replays, key, scale, shared_offsets
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqlens_k)
        return _planned_outputs(ctx, with_lse, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _d_lse=None):
        q, k, v, out, lse, cu_q, cu_k, seqlens_k = ctx.saved_tensors
        grads = replayed_varlen_backward(ctx.replays, ctx.key, ctx.scale, q, k, v, out, lse, do, cu_q, cu_k,
                                         seqlens_k, ctx.shared_offsets)
        need = ctx.needs_input_grad[5:8]
        return (None,) * 5 + tuple(g if n else None for g, n in zip(grads, need)) + (None,) * 3


def planned_varlen_forward(replays: Replays, key: str, scale: float, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                           shared_offsets: bool = False, with_lse: bool = False):
    """The output of the varlen kernel named by `key` on packed inputs of a planned signature, recorded for autograd
    with the signature's training replays (`_VarlenPlanned`); with `with_lse`, (out, lse), lse not differentiable.
    Eager calls only: torch.compile traces the custom op."""
    return _VarlenPlanned.apply(replays, key, scale, shared_offsets, with_lse, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                seqlens_k)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
