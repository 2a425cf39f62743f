"""The custom ops `torch.ops.attngen.forward` and `torch.ops.attngen.backward` (attngen/runtime/autograd.py
says what they take), and their varlen forms `attngen.varlen_forward` / `attngen.varlen_backward` (packed
sequences: the int32 cu_seqlens_q, cu_seqlens_k and per-sequence key counts after v); `tensors` is a
`Tensor[]`: a variant kernel's run-time tensors. Imported by `autograd.attention_forward` while torch.compile traces, so that an
eager process never pays for registering them.
"""

from __future__ import annotations

import torch

from .arguments import check_attention_inputs, new_output
from .registry import gradients, resolve, setup_context, varlen_gradients, varlen_setup_context


@torch.library.custom_op("attngen::forward", mutates_args=())
def forward_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = resolve(key)
    check_attention_inputs(kernel.spec, q, k, v)
    return kernel.forward(q, k, v, scale, tensors=tuple(tensors))


@forward_op.register_fake
def _forward_fake(key, q, k, v, scale, tensors):
    return new_output(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("attngen::backward", mutates_args=())
def backward_op(key: str, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, scale: float, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(resolve(key).backward_saved(q, k, v, out, lse, do, scale, tuple(tensors)))


@backward_op.register_fake
def _backward_fake(key, do, q, k, v, out, lse, scale, tensors):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    # (a spec with sinks has them last: their gradient comes last too)
    if tensors and resolve(key).spec.variant.sinks:
        grads.append(torch.empty_like(tensors[-1]))
    return grads


def _backward(ctx, d_out, d_lse):
    return gradients(ctx, d_out, lambda key, do, q, k, v, out, lse, scale, tensors:
                     torch.ops.attngen.backward(key, do, q, k, v, out, lse, scale, list(tensors)))


forward_op.register_autograd(_backward, setup_context=setup_context)


@torch.library.custom_op("attngen::varlen_forward", mutates_args=())
def varlen_forward_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, seqlens_k: torch.Tensor, scale: float,
                      tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return resolve(key).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tuple(tensors))


@varlen_forward_op.register_fake
def _varlen_forward_fake(key, q, k, v, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors):
    return new_output(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("attngen::varlen_backward", mutates_args=())
def varlen_backward_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, do: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                       seqlens_k: torch.Tensor, scale: float, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(resolve(key).varlen_backward(q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale,
                                             tuple(tensors)))


@varlen_backward_op.register_fake
def _varlen_backward_fake(key, q, k, v, out, lse, do, cu_seqlens_q, cu_seqlens_k, seqlens_k, scale, tensors):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    if tensors and resolve(key).spec.variant.sinks:
        grads.append(torch.empty_like(tensors[-1]))
    return grads


def _varlen_backward(ctx, d_out, d_lse):
    return varlen_gradients(ctx, d_out, lambda key, *args: torch.ops.attngen.varlen_backward(
        key, *args[:-1], list(args[-1])))


varlen_forward_op.register_autograd(_varlen_backward, setup_context=varlen_setup_context)
