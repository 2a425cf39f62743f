"""FP8 (e4m3) inputs for `attngen.attention`: quantising a tensor (or q, k and v together, q and k optionally rotated
by a Hadamard matrix first), and checking the descales a call passes.

The convention is FA3's: an e4m3 tensor `x8` with its float32 `descale` stands for `x8 * descale`, the descale
(1,) for the whole tensor or (batch, kv_heads) per head (q's per K/V head: the query heads of a GQA group share
one, as the kernel applies q_descale * k_descale once per (batch, K/V head)).
"""

from __future__ import annotations

import torch

from ..errors import KernelInputError
from ..lang.spec import FP8_MIN_REDUCTION
from ..runtime.arguments import unit_descale
from .hadamard import hadamard

FP8 = torch.float8_e4m3fn
# e4m3's largest finite value: amax / E4M3_MAX is the descale that uses e4m3's whole range without saturating.
E4M3_MAX = 448.0
# The smallest amax a descale is taken from: an all-zero tensor gets a descale of this / 448, not 0.
_TINY = 1e-12


def quantize_fp8(x: torch.Tensor, per: str = "tensor", kv_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale): `x` (batch, heads, seq, head_dim) in float8_e4m3fn and its float32 descale, so that
    `x8.float() * descale` is `x` to e4m3's precision (a relative 2^-4 per element; values below 2^-6 * descale
    are subnormal, steps of 2^-9 * descale).

    per="tensor": one descale (1,) from the tensor's largest magnitude. per="head": one per (batch, head) from
    that head's largest magnitude, (batch, heads); for q under GQA pass `kv_heads` (k's heads): the heads of a
    group share one, (batch, kv_heads), as the kernel takes q_descale. The largest magnitude maps to 448."""
    return _quantized(_checked("x", x), per, kv_heads)


def quantize_fp8_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per: str = "tensor",
                     rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(q8, k8, v8, descales) for `attention(q8, k8, v8, **descales)`: each of q, k, v quantised as `quantize_fp8`
    does (`per` "tensor" or "head"; q's per-head descales per K/V head under GQA), descales the dict of
    q_descale, k_descale and v_descale.

    rotate=True multiplies q and k by the same orthonormal Hadamard matrix along head_dim first (`hadamard`, in
    float32): the scores q k^T are unchanged, but a score's large terms, once concentrated in a few outlier
    channels, are spread over all of them, where their independent e4m3 roundings (each 2^-4 of itself) partly
    cancel. Both or neither: a rotation of one alone would change the scores."""
    q, k, v = _checked("q", q), _checked("k", k), _checked("v", v)
    if q.shape[-1] != k.shape[-1]:
        raise KernelInputError(f"q and k must have the same head_dim; got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise KernelInputError(f"k's {k.shape[1]} heads do not divide q's {q.shape[1]}")
    if rotate:
        q, k = hadamard(q), hadamard(k)
    (q8, qd), (k8, kd), (v8, vd) = (_quantized(q, per, k.shape[1]), _quantized(k, per, None),
                                    _quantized(v, per, None))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _checked(name: str, x) -> torch.Tensor:
    """`x` if it is a tensor quantize_fp8 takes; a TypeError or KernelInputError naming it if not."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(x).__name__}")
    if x.dim() != 4:
        raise KernelInputError(f"{name} must be (batch, heads, seq, head_dim); got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8:
        raise KernelInputError(f"{name} must be a float16, bfloat16 or float32 tensor; got {x.dtype}")
    return x


def _quantized(x: torch.Tensor, per: str, kv_heads: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 of a checked `x`."""
    if per not in ("tensor", "head"):
        raise KernelInputError(f"per must be 'tensor' or 'head'; got {per!r}")
    batch, heads = x.shape[:2]
    groups = heads if kv_heads is None else kv_heads
    if per == "head" and (groups < 1 or heads % groups):
        raise KernelInputError(f"kv_heads = {kv_heads} does not divide x's {heads} heads")
    wide = x.float()
    if per == "tensor":
        amax = wide.abs().amax().reshape(1)
        descale = amax.clamp(min=_TINY) / E4M3_MAX
        scaled = wide / descale
    else:
        amax = wide.abs().reshape(batch, groups, -1).amax(dim=2)
        descale = amax.clamp(min=_TINY) / E4M3_MAX
        scaled = wide / descale.repeat_interleave(heads // groups, dim=1)[:, :, None, None]
    # NOTE: clamped first: torch's float8_e4m3fn conversion makes NaN of what rounds past 448.
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8), descale


def is_fp8(*tensors) -> bool:
    """Whether any of these is a float8_e4m3fn tensor."""
    return any(isinstance(t, torch.Tensor) and t.dtype == FP8 for t in tensors)


def checked_descales(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     descales: dict) -> tuple[torch.Tensor, ...]:
    """The descales of an FP8 call, checked before anything runs (a TypeError or ValueError naming the argument):
    query, key and value all float8_e4m3fn (4-D), none requiring grad (the FP8 forward has no backward), each
    descale None (1) or a float32 tensor (1,) or (batch, kv_heads) on the inputs' device."""
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if not all(t.dtype == FP8 for t in (query, key, value)):
        raise KernelInputError("query, key and value must all be float8_e4m3fn or all 16/32-bit; got "
                               f"{query.dtype}, {key.dtype}, {value.dtype} (quantise them all: attngen.quantize_fp8)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise KernelInputError("FP8 attention is forward-only: its backward stays 16-bit; run it under "
                               "torch.no_grad() or pass detached tensors, and train with bf16 inputs")
    if query.dim() != 4 or key.dim() != 4:
        raise KernelInputError(f"FP8 query, key and value must be (batch, heads, seq, head_dim); got shape "
                               f"{tuple(query.shape)}")
    if query.shape[-1] < FP8_MIN_REDUCTION:
        raise KernelInputError(f"FP8 attention needs head dim >= {FP8_MIN_REDUCTION} (FP8 tensor-core products reduce "
                               f"over at least {FP8_MIN_REDUCTION}); query has {query.shape[-1]}")
    shapes = ((1,), (key.shape[0], key.shape[1]))
    out = []
    for name in ("q_descale", "k_descale", "v_descale"):
        t = descales[name]
        if t is None:
            out.append(unit_descale(query.device))
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype != torch.float32:
            raise KernelInputError(f"{name} must be float32; got {t.dtype}")
        if tuple(t.shape) not in shapes:
            raise KernelInputError(f"{name} must have shape (1,) or (batch, kv_heads) = {shapes[1]}; "
                                   f"got {tuple(t.shape)}")
        if t.device != query.device:
            raise KernelInputError(f"{name} is on {t.device} and query on {query.device}")
        out.append(t)
    return tuple(out)
