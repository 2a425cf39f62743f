"""The float64 reference every kernel is validated against.

Plain PyTorch on upcast inputs: scores, mask, softmax, weighted sum; no tiling, no tricks. Rows with
no visible key give 0 and a log-sum-exp of -inf, which is the convention the kernels follow.
"""

from __future__ import annotations

import math

import torch

from .spec import Mask


def causal_keep(n_q: int, n_k: int, mask: Mask, device=None) -> torch.Tensor | None:
    """Boolean (n_q, n_k) of the (query, key) pairs a mask keeps; None for no mask."""
    if mask is Mask.NONE:
        return None
    offset = 0 if mask is Mask.CAUSAL_TOP_LEFT else n_k - n_q
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + offset


def attention(q, k, v, mask: Mask = Mask.NONE, scale: float | None = None, dtype=torch.float64):
    """Reference attention for q (B, H, N_Q, D), k and v (B, H_KV, N_K, D); returns (out, lse).

    Computed in `dtype` (float64 by default; a lower precision gives the error a same-precision
    PyTorch computation makes, which the tolerances are measured against).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    heads, kv_heads = q.shape[1], k.shape[1]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    if heads != kv_heads:
        kd = kd.repeat_interleave(heads // kv_heads, dim=1)
        vd = vd.repeat_interleave(heads // kv_heads, dim=1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    keep = causal_keep(q.shape[2], k.shape[2], mask, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN: rows with no visible key get zero weights instead.
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = probs @ vd
    return out, lse
