"""Validation of attention outputs against float64 with bounded memory, for the tuner's gate.

The float64 reference materialises the (query x key) scores of every head it checks, several times
over; at tuning shapes (N = 16k, 32 heads) that is hundreds of GB. `check_attention` compares a
slice instead, with at most `MAX_SCORES` scores: the first batch entries, the first K/V heads with
all their query heads, and, when one head is still too big, the last query rows. The last rows see
the most keys; taking them is exact because the last R rows of a causal problem are the
bottom-right-aligned causal problem of R rows over the same keys (for top-left alignment with
N_Q <= N_K, over the first N_Q keys, the only ones those rows can see). When no exact row slice
exists (top-left with N_Q > N_K) all rows are checked.
"""

from __future__ import annotations

from ..testing.accuracy import Case, Result, compare
from ..lang.spec import Mask, Spec

MAX_SCORES = 1 << 25  # float64 scores per reference: 256 MB, a few copies at the peak


def check_attention(spec: Spec, q, k, v, out, lse, max_scores: int = MAX_SCORES, tensors: dict | None = None) -> Result:
    """`check.compare` on a slice of (q, k, v, out, lse) small enough to hold in float64; `tensors`: an FP8 spec's
    descales ((1,) or (batch, kv_heads): sliced with the batch entries and K/V heads)."""
    batch, heads, n_q, _ = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    mask, keys = spec.mask, n_k
    rows = n_q
    if group * n_q * n_k > max_scores:
        if mask is Mask.CAUSAL_TOP_LEFT and n_q <= n_k:
            mask, keys = Mask.CAUSAL_BOTTOM_RIGHT, n_q
        if mask is not Mask.CAUSAL_TOP_LEFT:
            rows = max(1, min(n_q, max_scores // (group * keys)))
    per_kv_head = group * rows * keys
    kv = max(1, min(kv_heads, max_scores // per_kv_head))
    b = max(1, min(batch, max_scores // (per_kv_head * kv)))
    r0 = n_q - rows
    sliced = (slice(0, b), slice(0, kv * group), slice(r0, n_q))
    tensors = {name: t if t.dim() == 1 else t[:b, :kv] for name, t in (tensors or {}).items()}
    return compare(spec.replace(mask=mask), Case(b, kv * group, kv, rows, keys), out[sliced], lse[sliced],
                   q[sliced], k[:b, :kv, :keys], v[:b, :kv, :keys], tensors=tensors)
