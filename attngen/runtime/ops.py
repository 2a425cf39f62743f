"""The custom ops `torch.ops.attngen.forward` and `torch.ops.attngen.backward` (attngen/runtime/autograd.py
says what they take). Imported by `autograd.attention_forward` while torch.compile traces, so that an
eager process never pays for registering them.
"""

from __future__ import annotations

import torch

from .arguments import check_attention_inputs
from .registry import gradients, resolve, setup_context


@torch.library.custom_op("attngen::forward", mutates_args=())
def forward_op(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = resolve(key)
    check_attention_inputs(kernel.spec, q, k, v)
    return kernel.forward(q, k, v, scale)


@forward_op.register_fake
def _forward_fake(key, q, k, v, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("attngen::backward", mutates_args=())
def backward_op(key: str, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return resolve(key).backward(q, k, v, out, lse, do, scale)


@backward_op.register_fake
def _backward_fake(key, do, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward(ctx, d_out, d_lse):
    return gradients(ctx, d_out, torch.ops.attngen.backward)


forward_op.register_autograd(_backward, setup_context=setup_context)
