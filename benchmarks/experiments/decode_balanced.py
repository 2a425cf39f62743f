"""Experiment: decoding with a balanced split of the keys (stream-K over the K/V heads' blocks).

    python benchmarks/experiments/decode_balanced.py OUT_DIR        (GPU: timings + checks)
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_balanced.py --check   (CPU: checks only)
    ncu ... python benchmarks/experiments/decode_balanced.py --profile              (see profile())

The shipped decode kernel splits each (sequence, K/V head) into NUM_SPLITS equal slices, one program
each, NUM_SPLITS picked per shape bucket by the tuner or a wave-count heuristic. Two costs follow:
  - a grid of programs that is not a whole number of waves of the multiprocessors (batch 16 x 8 K/V
    heads = 128 programs for 132 SMs at one split; 256 programs, two waves, at two splits), and
  - on uneven lengths a slice count tuned for one length spread (NOTES v4: batch 16 picks 2 splits
    on the tuner's spread inputs; one split is 5% faster on full caches).
Here the grid is G programs (G = SMs x programs per SM). All the K/V blocks of the call, sequence by
sequence and head by head (T = H_KV x sum_b ceil(n_k(b) / BLOCK_N)), are cut into G ranges of equal
length; program i streams blocks [i T / G, (i + 1) T / G), a range that may cover the end of one
(sequence, head) and the start of the next, and writes one partial (output, log-sum-exp) per
(sequence, head) piece it touched at slot i + s (s = b H_KV + h: unique, since ranges are in order).
A combine program per (sequence, query head) finds the programs that covered its blocks from the
same arithmetic and merges their pieces by log-sum-exp. Every call is split, every SM busy, every
program the same number of blocks whatever the lengths; nothing is read back to the host.

Prediction: +3% at batch 1 (132 programs instead of 128) and at batch 16 on full caches against one
split (0.99x cuDNN -> ~1.02x); on the auto split the table picks for batch 16 (2 splits) +5-7%;
batch 64 +0-3%. Costs: each piece boundary drains the pipeline once (~1 us), and every call pays
the combine (~3-4 us at batch 1, as now).
Result (NOTES.md v12): lost everywhere but spread lengths at batch 16; ncu: programs whose range
crosses a (sequence, head) boundary pay a second pipeline ramp, and the merge costs 1-4 us more.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


@triton.jit
def balanced_fwd(Q, K, V, OP, LP, SEQLENS,
                 stride_q_b, stride_q_h, stride_q_d,
                 stride_k_b, stride_k_h, stride_k_n, stride_k_d,
                 stride_v_b, stride_v_h, stride_v_n, stride_v_d,
                 B, H_KV, G, sm_scale,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 B_POW2: tl.constexpr, WIDE: tl.constexpr):
    """program i: blocks [i T / G, (i + 1) T / G) of all (sequence, K/V head) block lists laid end to end"""
    pid = tl.program_id(0)
    offs_b = tl.arange(0, B_POW2)
    lens = tl.load(SEQLENS + offs_b, mask=offs_b < B, other=0)
    nblk = (lens + BLOCK_N - 1) // BLOCK_N
    ends = tl.cumsum(nblk, 0) * H_KV  # where sequence b's blocks end, all heads counted
    T = tl.sum(nblk, 0) * H_KV
    if WIDE:  # i * T can pass 2^31
        lo = ((pid.to(tl.int64) * T) // G).to(tl.int32)
        hi = (((pid + 1).to(tl.int64) * T) // G).to(tl.int32)
    else:
        lo = (pid * T) // G
        hi = ((pid + 1) * T) // G
    qk_scale = sm_scale * 1.4426950408889634
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    x = lo
    while x < hi:
        b = tl.sum((ends <= x).to(tl.int32), 0)
        pick = offs_b == b
        nb = tl.sum(tl.where(pick, nblk, 0), 0)
        n_k = tl.sum(tl.where(pick, lens, 0), 0)
        seq_start = tl.sum(tl.where(pick, ends, 0), 0) - nb * H_KV
        h = (x - seq_start) // nb
        seg_start = seq_start + h * nb
        j0 = x - seg_start
        j1 = tl.minimum(hi - seg_start, nb)
        q = tl.load(Q + b.to(tl.int64) * stride_q_b + (h * GROUP + offs_m)[:, None] * stride_q_h
                    + offs_d[None, :] * stride_q_d, mask=offs_m[:, None] < GROUP, other=0.0)
        k_base = K + b.to(tl.int64) * stride_k_b + h.to(tl.int64) * stride_k_h
        v_base = V + b.to(tl.int64) * stride_v_b + h.to(tl.int64) * stride_v_h
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        full = tl.minimum(j1, n_k // BLOCK_N)
        for j in range(j0, tl.maximum(j0, full)):  # whole blocks: no mask
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_k_n + offs_d[None, :] * stride_k_d)
            s = tl.dot(q, tl.trans(k))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_v_n + offs_d[None, :] * stride_v_d)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        if full < j1:  # the sequence's last, partial block
            offs_n = full * BLOCK_N + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_k_n + offs_d[None, :] * stride_k_d,
                        mask=offs_n[:, None] < n_k, other=0.0)
            s = tl.where((offs_n < n_k)[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_v_n + offs_d[None, :] * stride_v_d,
                        mask=offs_n[:, None] < n_k, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        piece = (pid + b * H_KV + h).to(tl.int64)
        tl.store(OP + piece * GROUP * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
                 mask=offs_m[:, None] < GROUP)
        tl.store(LP + piece * GROUP + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=offs_m < GROUP)
        x = seg_start + j1


@triton.jit
def balanced_combine(OP, LP, O, LSE, SEQLENS, stride_o_b, stride_o_h, stride_o_d, stride_lse_b, stride_lse_h,
                     B, H_KV, G, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     B_POW2: tl.constexpr, BLOCK_P: tl.constexpr, WIDE: tl.constexpr):
    """one program per (query head, sequence): merge the pieces of the programs that covered its blocks"""
    hq = tl.program_id(0)
    b = tl.program_id(1)
    h = hq // GROUP
    g = hq % GROUP
    offs_b = tl.arange(0, B_POW2)
    lens = tl.load(SEQLENS + offs_b, mask=offs_b < B, other=0)
    nblk = (lens + BLOCK_N - 1) // BLOCK_N
    ends = tl.cumsum(nblk, 0) * H_KV
    T = tl.sum(nblk, 0) * H_KV
    pick = offs_b == b
    nb = tl.sum(tl.where(pick, nblk, 0), 0)
    s0 = tl.sum(tl.where(pick, ends, 0), 0) - nb * H_KV + h * nb  # this (sequence, head)'s first block
    # program c covers [c T / G, (c + 1) T / G): the one holding block x is ((x + 1) G - 1) // T
    if WIDE:
        c0 = (((s0 + 1).to(tl.int64) * G - 1) // T).to(tl.int32)
        c1 = (((s0 + nb).to(tl.int64) * G - 1) // T).to(tl.int32)
    else:
        c0 = ((s0 + 1) * G - 1) // T
        c1 = ((s0 + nb) * G - 1) // T
    c1 = tl.where(nb == 0, c0 - 1, c1)
    slot = b * H_KV + h
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    l_run = tl.full([], 0.0, dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for c in range(c0, c1 + 1, BLOCK_P):
        offs_c = c + tl.arange(0, BLOCK_P)
        if WIDE:
            start = (offs_c.to(tl.int64) * T) // G
            stop = ((offs_c + 1).to(tl.int64) * T) // G
        else:
            start = (offs_c * T) // G
            stop = ((offs_c + 1) * T) // G
        keep = (offs_c <= c1) & (stop > start)  # programs with an empty range wrote nothing
        piece = (offs_c + slot).to(tl.int64)
        lse_c = tl.load(LP + piece * GROUP + g, mask=keep, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lse_c, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_use)
        w = tl.exp(lse_c - m_use)
        l_run = l_run * alpha + tl.sum(w, 0)
        o_c = tl.load(OP + piece[:, None] * GROUP * HEAD_DIM + g * HEAD_DIM + offs_d[None, :], mask=keep[:, None],
                      other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o_c, 0)
        m_run = m_new
    l_safe = tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(O + b.to(tl.int64) * stride_o_b + hq * stride_o_h + offs_d * stride_o_d, (acc / l_safe).to(O.dtype.element_ty))
    tl.store(LSE + b.to(tl.int64) * stride_lse_b + hq * stride_lse_h, m_run + tl.log(l_safe))


def balanced(q, k, v, seqlens, out=None, lse=None, *, G, BLOCK_N=64, num_warps=4, num_stages=4, sm_scale=None,
             wide=True, block_p=16):
    """q (B, H, 1, D), k/v (B, H_KV, N, D) any strides; returns (out, lse) like forward_kvcache."""
    B, H, _, D = q.shape
    H_KV = k.shape[1]
    group = H // H_KV
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((B, H, 1), device=q.device, dtype=torch.float32) if lse is None else lse
    o_part = torch.empty((G + B * H_KV, group, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((G + B * H_KV, group), device=q.device, dtype=torch.float32)
    b_pow2 = max(2, triton.next_power_of_2(B))
    balanced_fwd[(G,)](q, k, v, o_part, lse_part, seqlens, q.stride(0), q.stride(1), q.stride(3), *k.stride(),
                       *v.stride(), B, H_KV, G, sm_scale, GROUP=group, BLOCK_M=16, BLOCK_N=BLOCK_N, HEAD_DIM=D,
                       B_POW2=b_pow2, WIDE=wide, num_warps=num_warps, num_stages=num_stages)
    balanced_combine[(H, B)](o_part, lse_part, out, lse, seqlens, out.stride(0), out.stride(1), out.stride(3),
                             lse.stride(0), lse.stride(1), B, H_KV, G, GROUP=group, BLOCK_N=BLOCK_N, HEAD_DIM=D,
                             B_POW2=b_pow2, BLOCK_P=block_p, WIDE=wide, num_warps=4, num_stages=1)
    return out, lse


def reference(q, k, v, seqlens):
    """float64 attention of each sequence's one query row over its first seqlens[b] keys."""
    B, H, _, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, H, 1), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(seqlens[b])
        if n == 0:
            continue
        kk = k[b, :, :n].double().cpu().repeat_interleave(group, 0)
        vv = v[b, :, :n].double().cpu().repeat_interleave(group, 0)
        s = q[b].double().cpu() @ kk.transpose(-1, -2) * D ** -0.5
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.softmax(s, -1) @ vv
    return out, lse


def check(device, cases, G_values, dtype=torch.bfloat16) -> float:
    """Largest error against float64 over `cases` ((B, H, H_KV, N, lengths or None)); outputs poisoned."""
    gen = torch.Generator(device).manual_seed(1)
    worst = 0.0
    for B, H, H_KV, N, lengths in cases:
        q = torch.randn(B, H, 1, 128, device=device, dtype=dtype, generator=gen)
        k = torch.randn(B, N, H_KV, 128, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        v = torch.randn(B, N, H_KV, 128, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        if lengths is None:
            lengths = torch.randint(0, N + 1, (B,), generator=torch.Generator().manual_seed(B + N)).tolist()
        seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
        want, want_lse = reference(q, k, v, seqlens)
        for G in G_values:
            for block_n, wide, block_p in ((32, True, 16), (64, False, 32)):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((B, H, 1), float("nan"), device=device)
                balanced(q, k, v, seqlens, out, lse, G=G, BLOCK_N=block_n, num_stages=2, wide=wide, block_p=block_p)
                err = (out.double().cpu() - want).abs().max().item()
                finite = want_lse.isfinite()
                lse_err = (lse.double().cpu()[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
                lse_ok = bool((lse.cpu()[~finite] == float("-inf")).all())
                if not (err < 2e-2 and lse_err < 1e-3 and lse_ok):
                    raise AssertionError(f"B={B} N={N} lengths={lengths} G={G} BLOCK_N={block_n}: "
                                         f"out err {err:.3g}, lse err {lse_err:.3g}, empty rows -inf {lse_ok}")
                worst = max(worst, err)
    return worst


CPU_CASES = ((1, 8, 2, 300, [300]), (3, 4, 1, 130, [0, 1, 130]), (5, 8, 2, 97, None))


def profile() -> int:
    """One call each of the shipped decode and balanced variants inside NVTX ranges, for ncu:
        ncu --nvtx --nvtx-include "profile/" --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
            python benchmarks/experiments/decode_balanced.py --profile"""
    import attngen
    from attngen.bench_decode import H, H_KV, D, DTYPE

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator("cuda").manual_seed(0)
    for batch, ctx in ((1, 8192), (1, 32768), (16, 8192)):
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
        k, v = (torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2) for _ in range(2))
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        calls = {"shipped": lambda: attngen.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                   cache_seqlens=lens),
                 "bal64x4": lambda: balanced(q, k, v, lens, G=sms, BLOCK_N=64, num_stages=4),
                 "bal64x4_i32": lambda: balanced(q, k, v, lens, G=sms, BLOCK_N=64, num_stages=4, wide=False, block_p=32),
                 "bal64x4_i32_128": lambda: balanced(q, k, v, lens, G=128, BLOCK_N=64, num_stages=4, wide=False,
                                                     block_p=32)}
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        for name, fn in calls.items():
            torch.cuda.nvtx.range_push(f"profile/{batch}x{ctx}/{name}")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(f"profiled batch {batch} context {ctx}: " + ", ".join(calls), flush=True)
    return 0


def main() -> int:
    if "--profile" in sys.argv:
        return profile()
    if "--check" in sys.argv:
        # float16: Triton 3.6's interpreter multiplies bf16 bit patterns (attngen/interpreter_fixes.py)
        worst = check("cpu", CPU_CASES, (1, 3, 7, 40), torch.float16)
        print(f"balanced decode matches float64 (worst {worst:.2e})")
        return 0
    from attngen.bench_decode import H, H_KV, D, DTYPE, bench_graph, bench_layers, gbps, layer_count, sdpa
    import attngen

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    worst = check("cuda", ((1, 32, 8, 4097, [4097]), (16, 32, 8, 1000, None), (7, 32, 8, 333, [0, 1, 64, 65, 333, 200, 3])),
                  (sms, 2 * sms, 5))
    print(f"float64 check passed (worst {worst:.2e})", flush=True)
    variants = {
        "bal64x4": dict(G=sms, BLOCK_N=64, num_stages=4),
        "bal64x3_2": dict(G=2 * sms, BLOCK_N=64, num_stages=3),
        "bal128x3": dict(G=sms, BLOCK_N=128, num_stages=3),
        "bal64x6": dict(G=sms, BLOCK_N=64, num_stages=6),
    }
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for batch, ctx in ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 8192)):
        for spread in (False, True):
            layers = max(2, layer_count(batch, ctx))
            caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2),
                       torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2))
                      for _ in range(layers)]
            q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
            if spread:  # the tuner's inputs: lengths from the capacity down to half of it
                lens = torch.linspace(ctx, ctx // 2, batch, device="cuda").round().int()
                lens = lens[torch.randperm(batch, device="cuda", generator=gen)]
            else:
                lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            tokens = int(lens.sum())
            scale = tokens / (batch * ctx)  # GB/s of the keys the call reads
            row = {"batch": batch, "context": ctx, "spread": spread, "layers": layers}
            k, v = caches[0]
            want = attngen.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  cache_seqlens=lens)
            calls = {"shipped": lambda kl, vl: attngen.attention_with_kvcache(
                q.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), cache_seqlens=lens)}
            for name, kw in variants.items():
                calls[name] = lambda kl, vl, kw=kw: balanced(q, kl, vl, lens, **kw)
            for name, call in calls.items():
                try:
                    got = call(k, v)
                    got = got if name == "shipped" else got[0].transpose(1, 2)
                    row[f"{name} err"] = (got.float() - want.float()).abs().max().item()
                    row[name] = gbps(batch, ctx, bench_graph(lambda: call(k, v))) * scale
                    row[f"{name} [layers]"] = gbps(batch, ctx, bench_layers(
                        [lambda kl=kl, vl=vl: call(kl, vl) for kl, vl in caches])) * scale
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
                    row[name] = row[f"{name} [layers]"] = float("nan")
                    row[f"{name} err"] = f"{type(e).__name__}: {str(e)[:200]}"
            if not spread:
                ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                row["cudnn"] = gbps(batch, ctx, ms)
                ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             [(kl.transpose(1, 2), vl.transpose(1, 2)) for kl, vl in caches])
                row["cudnn [layers]"] = gbps(batch, ctx, ms)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            caches = q = k = v = calls = None  # free the caches before the next shape
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_balanced.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "variants": variants, "rows": rows}, f, indent=1)
    names = ["shipped"] + list(variants)
    print(f"\nGB/s of the keys read ({torch.cuda.get_device_name()}), CUDA-graph replay / [layers]")
    print(f"{'B':>3} {'ctx':>6} {'spread':>6} " + " ".join(f"{n:>17}" for n in names + ["cudnn"]))
    for r in rows:
        cells = [f"{r[n]:7.0f} / {r[n + ' [layers]']:7.0f}" for n in names]
        cells.append(f"{r['cudnn']:7.0f} / {r['cudnn [layers]']:7.0f}" if "cudnn" in r else " " * 17)
        print(f"{r['batch']:>3} {r['context']:>6} {str(r['spread']):>6} " + " ".join(f"{c:>17}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
