"""The float64 reference every kernel is validated against.

Plain PyTorch on upcast inputs: scores, mask, softmax, weighted sum; no tiling, no tricks. Rows with
no visible key give 0 and a log-sum-exp of -inf, which is the convention the kernels follow.
"""

from __future__ import annotations

import math

import torch

from ..lang.spec import Mask


def causal_keep(n_q: int, n_k: int, mask: Mask, device=None, first_row: int = 0,
                total_rows: int | None = None) -> torch.Tensor | None:
    """Boolean (n_q, n_k) of the (query, key) pairs a mask keeps; None for no mask. The rows may be
    rows first_row .. first_row + n_q - 1 of a problem of `total_rows` query rows (default n_q)."""
    if mask is Mask.NONE:
        return None
    total_rows = n_q if total_rows is None else total_rows
    offset = first_row + (0 if mask is Mask.CAUSAL_TOP_LEFT else n_k - total_rows)
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + offset


def attention(q, k, v, mask: Mask = Mask.NONE, scale: float | None = None, dtype=torch.float64,
              first_row: int = 0, total_rows: int | None = None):
    """Reference attention for q (B, H, N_Q, D), k and v (B, H_KV, N_K, D); returns (out, lse).

    Computed in `dtype` (float64 by default; a lower precision gives the error a same-precision
    PyTorch computation makes, which the tolerances are measured against). `first_row` and
    `total_rows` place q's rows inside a longer query sequence, for the causal mask.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    heads, kv_heads = q.shape[1], k.shape[1]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    if heads != kv_heads:
        kd = kd.repeat_interleave(heads // kv_heads, dim=1)
        vd = vd.repeat_interleave(heads // kv_heads, dim=1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    keep = causal_keep(q.shape[2], k.shape[2], mask, q.device, first_row, total_rows)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN: rows with no visible key get zero weights instead.
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = probs @ vd
    return out, lse


def attention_grads(q, k, v, do, mask: Mask = Mask.NONE, scale: float | None = None, dtype=torch.float64,
                    max_scores: int = 1 << 26):
    """(dq, dk, dv) of sum(attention(q, k, v) * do), in `dtype`, by autograd through `attention`.

    Query rows are taken in chunks so that about `max_scores` scores are alive at once: each chunk's
    dq is its own, and dk, dv accumulate over the chunks (exact: rows are independent given k and v).
    That bounds the memory of the float64 reference at training shapes (N = 16k).
    """
    n_q, n_k = q.shape[2], k.shape[2]
    kd, vd = (t.detach().to(dtype).requires_grad_() for t in (k, v))
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    rows = max(1, min(n_q, max_scores // max(1, q.shape[0] * q.shape[1] * n_k)))
    for r0 in range(0, n_q, rows):
        qc = q[:, :, r0:r0 + rows].detach().to(dtype).requires_grad_()
        out, _ = attention(qc, kd, vd, mask, scale, dtype, first_row=r0, total_rows=n_q)
        out.backward(do[:, :, r0:r0 + rows].to(dtype))
        dq[:, :, r0:r0 + rows] = qc.grad
    zeros = torch.zeros_like
    return dq, zeros(kd) if kd.grad is None else kd.grad, zeros(vd) if vd.grad is None else vd.grad


def gather_cache(cache, seqlen: int, table_row=None) -> torch.Tensor:
    """One sequence's first `seqlen` tokens, (seqlen, H_KV, D): from its row of a contiguous cache
    (batch, seq, H_KV, D), or, with its block-table row, from a page pool (pages, page_size, H_KV, D)."""
    if table_row is None:
        return cache[:seqlen]
    page_size = cache.shape[1]
    pages = table_row[: -(-seqlen // page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:seqlen]


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, scale=None,
                      dtype=torch.float64):
    """Reference for `attention_with_kvcache` (flash-attn layouts): each sequence's keys gathered
    into a contiguous tensor, then `attention` with a bottom-right causal mask. Returns out
    (B, S_q, H, D) and lse (B, H, S_q), in `dtype`."""
    batch, seqlen_q, heads, d = q.shape
    outs, lses = [], []
    for b in range(batch):
        n = int(cache_seqlens[b])
        row = None if block_table is None else block_table[b]
        k = gather_cache(k_cache[b] if row is None else k_cache, n, row).transpose(0, 1)[None]
        v = gather_cache(v_cache[b] if row is None else v_cache, n, row).transpose(0, 1)[None]
        mask = Mask.CAUSAL_BOTTOM_RIGHT if causal else Mask.NONE
        out, lse = attention(q[b : b + 1].transpose(1, 2), k, v, mask, scale, dtype)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)
