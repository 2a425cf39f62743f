"""Checking tensors against a kernel's spec before any launch.

Every check raises `KernelInputError` (a ValueError) or TypeError naming the argument and what was
expected, so a bad call never reaches the GPU and never computes garbage.
"""

from __future__ import annotations

import math

import torch

from .errors import KernelInputError
from .spec import Spec


def _runtime_device_ok(name: str, t: torch.Tensor) -> None:
    from .runtime import interpreting

    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()):
        return
    if t.device.type == "cpu":
        raise KernelInputError(
            f"{name} is on the CPU; attngen kernels run on a CUDA GPU "
            "(set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter)"
        )
    raise KernelInputError(f"{name} is on {t.device}; attngen kernels run on CUDA GPUs")


def check_tensor(name: str, t, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dim() != dims:
        raise KernelInputError(f"{name} must have {dims} dimensions {what}; got shape {tuple(t.shape)}")
    return t


def check_attention_inputs(spec: Spec, q, k, v) -> None:
    """q (B, H, N_Q, D), k and v (B, H_KV, N_K, D), matching the spec's dtype, head dim and heads."""
    layout = "(batch, heads, seq, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, layout)
        if t.dtype != spec.dtype.torch:
            raise KernelInputError(f"{name} has dtype {t.dtype}; kernel '{spec.name}' takes {spec.dtype.torch}")
        if t.shape[-1] != spec.head_dim:
            raise KernelInputError(
                f"{name} has head_dim {t.shape[-1]}; kernel '{spec.name}' takes head_dim {spec.head_dim}"
            )
        _runtime_device_ok(name, t)
    if not (q.device == k.device == v.device):
        raise KernelInputError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise KernelInputError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise KernelInputError(f"q has batch {q.shape[0]} but k and v have batch {k.shape[0]}")
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(spec, heads, kv_heads, "q", "k")


def check_heads(spec: Spec, heads: int, kv_heads: int, q_name: str, k_name: str) -> None:
    if kv_heads == 0 or heads % kv_heads:
        raise KernelInputError(
            f"{q_name} has {heads} heads, which is not a multiple of the {kv_heads} heads of {k_name} and v"
        )
    if spec.heads is not None and heads != spec.heads:
        raise KernelInputError(f"{q_name} has {heads} heads; kernel '{spec.name}' takes heads = {spec.heads}")
    if spec.kv_heads is not None and kv_heads != spec.kv_heads:
        raise KernelInputError(f"{k_name} has {kv_heads} heads; kernel '{spec.name}' takes kv_heads = {spec.kv_heads}")
    if spec.group is not None and heads // kv_heads != spec.group:
        raise KernelInputError(
            f"{q_name} and {k_name} have {heads} and {kv_heads} heads (group {heads // kv_heads}); "
            f"kernel '{spec.name}' takes group = {spec.group}"
        )


def check_scale(scale, spec: Spec) -> float:
    if scale is None:
        return spec.softmax_scale
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python number, not {type(scale).__name__}")
    if not math.isfinite(scale):
        raise KernelInputError(f"scale must be finite; got {scale}")
    return float(scale)


def check_out(out, like: torch.Tensor, name: str = "out") -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(out).__name__}")
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise KernelInputError(
            f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
