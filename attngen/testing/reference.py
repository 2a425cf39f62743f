"""The float64 reference every kernel is validated against.

Plain PyTorch on upcast inputs: scores, mask, softmax, weighted sum; no tiling, no tricks. Rows with
no visible key give 0 and a log-sum-exp of -inf, which is the convention the kernels follow.
"""

from __future__ import annotations

import math

import torch

from ..lang import variants as v
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
              first_row: int = 0, total_rows: int | None = None, fp8_probs: bool = False):
    """Reference attention for q (B, H, N_Q, D), k and v (B, H_KV, N_K, D); returns (out, lse).

    Computed in `dtype` (float64 by default; a lower precision gives the error a same-precision
    PyTorch computation makes, which the tolerances are measured against). `first_row` and
    `total_rows` place q's rows inside a longer query sequence, for the causal mask. `fp8_probs`: the
    weights quantised to e4m3 as an FP8 kernel quantises P (`weights`).
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
    out = weights(scores, lse, fp8_probs) @ vd
    return out, lse


def weights(scores: torch.Tensor, lse: torch.Tensor, fp8_probs: bool = False) -> torch.Tensor:
    """softmax(scores) along the last axis, from its log-sum-exp `lse`; rows with no visible key (lse -inf) get
    zero weights (exp(-inf - -inf) would be NaN). With `fp8_probs`, as an FP8 kernel weighs the values:
    p = exp(s - rowmax) rounded to e4m3 (in [0, 1]: no scaling), over the unrounded sum of p."""
    if not fp8_probs:
        return torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    total = p.sum(dim=-1, keepdim=True)
    return p.to(torch.float8_e4m3fn).to(p.dtype) / torch.where(total == 0, torch.ones_like(total), total)


def e4m3_rows(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """x's rows (the last axis) as the FP8 decode kernel's `q_e4m3` multiplies them, in float64: each row scaled by
    the least power of two f with max |x| / f <= 448 (e4m3's largest), rounded to nearest e4m3 (`terms` 2: plus the
    rounding's remainder rounded to e4m3) and scaled back by f (the scaling exact, as in the kernel, which takes f from
    the bits of the row's maximum)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa x 2^exponent, mantissa in [0.5, 1)
    # 448 = 0.875 x 2^9: amax / 2^(exponent - 9) = 2 mantissa x 2^8 <= 448 while mantissa <= 0.875
    f_exp = (exponent - 9 + (mantissa > 0.875).to(exponent.dtype)).clamp(min=-126)
    factor = torch.ldexp(torch.ones_like(amax), f_exp)
    scaled = xf / factor
    hi = scaled.to(torch.float8_e4m3fn).float()
    total = hi.double()
    if terms == 2:
        total = total + (scaled - hi).to(torch.float8_e4m3fn).double()
    return total * factor.double()


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
                      dtype=torch.float64, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """Reference for `attention_with_kvcache` (flash-attn layouts): each sequence's keys gathered
    into a contiguous tensor, then `attention` with a bottom-right causal mask, or, with flash-attn's
    window_size / softcap / alibi_slopes / sinks, `variant_attention` of the variant they mean
    (`kvcache_variant`), bottom-right aligned per sequence. Returns out (B, S_q, H, D) and lse
    (B, H, S_q), in `dtype`."""
    batch, seqlen_q, heads, d = q.shape
    variant = kvcache_variant(causal, window_size, softcap, alibi_slopes is not None, sinks is not None)
    outs, lses = [], []
    for b in range(batch):
        n = int(cache_seqlens[b])
        row = None if block_table is None else block_table[b]
        k = gather_cache(k_cache[b] if row is None else k_cache, n, row)
        v_ = gather_cache(v_cache[b] if row is None else v_cache, n, row)
        out, lse = _bottom_right(q[b], k, v_, b, variant, causal, scale, alibi_slopes, sinks, dtype)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _bottom_right(q, k, v_, b: int, variant, causal: bool, scale, alibi_slopes, sinks, dtype):
    """Sequence `b`'s attention, q (S_q, H, D) and k, v (S_k, H_KV, D), aligned bottom-right: out (S_q, H, D),
    lse (H, S_q)."""
    q, k, v_ = (t.transpose(0, 1)[None] for t in (q, k, v_))
    if variant:
        tensors = {"sinks": sinks} if sinks is not None else {}
        if alibi_slopes is not None:
            tensors["alibi_slopes"] = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b : b + 1]
        out, lse = variant_attention(q, k, v_, variant, True, scale, tensors, dtype)
    else:
        mask = Mask.CAUSAL_BOTTOM_RIGHT if causal else Mask.NONE
        out, lse = attention(q, k, v_, mask, scale, dtype)
    return out[0].transpose(0, 1), lse[0]


def varlen_attention(q, k, v_, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, dtype=torch.float64,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, seqused_k=None,
                     block_table=None):
    """Reference for `flash_attn_varlen_func` (flash-attn's semantics): each sequence on its own, its keys the
    first seqused_k[b] (else all) of its slice of k and v (total_k, H_KV, D), or with `block_table` of its pages
    in the pool (num_pages, page_size, H_KV, D), aligned bottom-right as `kvcache_attention` aligns them.
    Returns out (total_q, H, D) and lse (H, total_q), in `dtype`; differentiable."""
    variant = kvcache_variant(causal, window_size, softcap, alibi_slopes is not None, sinks is not None)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        n = cu_k[b + 1] - cu_k[b] if seqused_k is None else int(seqused_k[b])
        if block_table is None:
            k_b, v_b = k[cu_k[b] : cu_k[b] + n], v_[cu_k[b] : cu_k[b] + n]
        else:
            k_b, v_b = gather_cache(k, n, block_table[b]), gather_cache(v_, n, block_table[b])
        out, lse = _bottom_right(q[cu_q[b] : cu_q[b + 1]], k_b, v_b, b, variant, causal, scale, alibi_slopes, sinks,
                                 dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def kvcache_variant(causal: bool, window_size=(-1, -1), softcap=0.0, alibi=False, sinks=False) -> v.Variant:
    """flash-attn's arguments as a variant tree, written from flash-attn's rule (key k visible to query q when
    q - left <= k <= q + right, a side of -1 unbounded, right 0 when causal) as plain comparisons; empty for
    a call without window, softcap, alibi or sinks."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and (right < 0 or causal) and not (softcap or alibi or sinks):
        return v.Variant()
    mask = None
    bounds = []
    if left >= 0:
        bounds.append(v.Compare(">=", v.Var("k"), v.BinOp("-", v.Var("q"), v.Const(left))))
    if right >= 0:
        bounds.append(v.Compare("<=", v.Var("k"), v.BinOp("+", v.Var("q"), v.Const(right))))
    for bound in bounds:
        mask = bound if mask is None else v.And(mask, bound)
    score = v.Softcap(float(softcap)) if softcap else v.Alibi() if alibi else None
    return v.Variant(mask, score, bool(sinks))


# -- variants: masks and score modifiers built as full matrices from the spec's own tree -----------------


def _value(e, env: dict, tensors: dict):
    """A spec expression (lang/variants.py) over the broadcast index tensors in `env`, in torch."""
    if isinstance(e, v.Const):
        return e.value
    if isinstance(e, v.Var):
        return env[e.name]
    if isinstance(e, v.Neg):
        return -_value(e.arg, env, tensors)
    if isinstance(e, v.BinOp):
        a, b = _value(e.a, env, tensors), _value(e.b, env, tensors)
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                "//": lambda: a // b, "%": lambda: a % b}[e.op]()
    if isinstance(e, v.Func):
        args = [_value(a, env, tensors) for a in e.args]
        device = next((x.device for x in args if isinstance(x, torch.Tensor)), None)
        args = [x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64, device=device) for x in args]
        return {"abs": torch.abs, "min": torch.minimum, "max": torch.maximum, "tanh": torch.tanh,
                "exp": torch.exp}[e.name](*args)
    if isinstance(e, v.Index):
        t = tensors[e.tensor]
        idx = [_value(a, env, tensors) for a in e.args]
        idx = [torch.as_tensor(i, device=t.device) for i in idx]
        shape = torch.broadcast_shapes(*(i.shape for i in idx))
        idx = [i.expand(shape).long() for i in idx]
        inside = torch.ones(shape, dtype=torch.bool, device=t.device)
        for i, n in zip(idx, t.shape):
            inside &= (i >= 0) & (i < n)
        safe = [torch.where(inside, i, torch.zeros_like(i)) for i in idx]
        return torch.where(inside, t.to(torch.float64)[tuple(safe)], torch.zeros((), dtype=torch.float64, device=t.device))
    raise TypeError(f"no value for {e!r}")


def _holds(m, env: dict):
    """A mask tree as a boolean tensor over the broadcast (b, h, q, k) index tensors in `env`."""
    q, k = env["q"], env["k"]
    if isinstance(m, v.Causal):
        return k <= q
    if isinstance(m, v.Window):
        return (k >= q - m.left) & (k <= q + m.right)
    if isinstance(m, v.Prefix):
        return k < m.length
    if isinstance(m, v.Chunked):
        return torch.div(q, m.size, rounding_mode="floor") == torch.div(k, m.size, rounding_mode="floor")
    if isinstance(m, v.And):
        return _holds(m.a, env) & _holds(m.b, env)
    if isinstance(m, v.Or):
        return _holds(m.a, env) | _holds(m.b, env)
    if isinstance(m, v.Not):
        return ~_holds(m.arg, env)
    if isinstance(m, v.Compare):
        a, b = _value(m.a, env, {}), _value(m.b, env, {})
        return {"<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b,
                "==": lambda: a == b, "!=": lambda: a != b}[m.op]()
    raise TypeError(f"no condition for {m!r}")


def variant_attention(q, k, v_, variant, bottom_right: bool = False, scale: float | None = None,
                      tensors: dict | None = None, dtype=torch.float64, fp8_probs: bool = False):
    """Reference attention of a variant (lang/variants.py `Variant`) for q (B, H, N_Q, D), k and v (B, H_KV, N_K, D):
    the full (B, H, N_Q, N_K) score matrix, the score modifier applied element by element, the mask built
    from the tree, the sinks (tensors["sinks"], (H,)) as one more logit per row. `tensors` holds the run-time
    tensors by keyword (declared tensors, "alibi_slopes" (H,) or (B, H), "sinks"). Returns (out, lse), the
    lse including the sink; differentiable. `fp8_probs`: as `attention`'s."""
    tensors = dict(tensors or {})
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v_))
    if heads != k.shape[1]:
        kd = kd.repeat_interleave(heads // k.shape[1], dim=1)
        vd = vd.repeat_interleave(heads // k.shape[1], dim=1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    offset = n_k - n_q if bottom_right else 0
    at = dict(device=q.device)
    env = {"b": torch.arange(batch, **at)[:, None, None, None], "h": torch.arange(heads, **at)[None, :, None, None],
           "q": torch.arange(n_q, **at)[None, None, :, None] + offset, "k": torch.arange(n_k, **at)[None, None, None, :]}
    score = variant.score
    if isinstance(score, v.Softcap):
        scores = score.cap * torch.tanh(scores / score.cap)
    elif isinstance(score, v.Alibi):
        slopes = tensors["alibi_slopes"].to(dtype)
        slopes = slopes.expand(batch, heads) if slopes.dim() == 1 else slopes
        scores = scores - slopes[:, :, None, None] * (env["q"] - env["k"]).abs().to(dtype)
    elif isinstance(score, v.ScoreExpr):
        scores = _value(score.expr, dict(env, s=scores), tensors).to(dtype) * torch.ones_like(scores)
    if variant.mask is not None:
        keep = _holds(variant.mask, env).expand(scores.shape)
        scores = scores.masked_fill(~keep, float("-inf"))
    if variant.sinks:
        sink = tensors["sinks"].to(dtype)[None, :, None, None].expand(batch, heads, n_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = weights(scores, lse, fp8_probs)
    if variant.sinks:
        probs = probs[..., :-1]
    return probs @ vd, lse
