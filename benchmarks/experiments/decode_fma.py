"""Experiment: a decode kernel on CUDA cores with K/V loaded straight into registers (Gluon).

    python benchmarks/experiments/decode_fma.py OUT_DIR         (GPU: float64 check, then times)
    python benchmarks/experiments/decode_fma.py --ptxas         (CPU: registers and spills per shape)

Every decode kernel so far (the shipped Triton one, the Gluon paged one, v13-v20's variants) streams K/V
through shared memory into tensor-core products: cp.async or TMA, a barrier per block, and (Triton) a
cross-warp max and sum and a layout conversion of P per block. At batch 16 (one program per SM) they
stall on fixed-latency dependencies and reach 0.97-0.99x cuDNN at best (NOTES v17, v18, v20); cuDNN's
kernel stalls on global loads into registers. A decoding step has 4 query rows per K/V head (GQA 4):
4 FLOP per byte of K/V, which CUDA cores can do at ~40% of their FMA rate while DRAM streams.

Here no shared memory is used in the loop. A block of BN = R x T keys is an [R, T, D] tile: each of the
T key slots is held by DL lanes (VEC = 8 bf16 each, one 16-byte load, D / (DL VEC) of them per row), and
each thread holds R keys of its slot in registers. Scores: FMAs over the thread's d, then a butterfly
over its DL lanes. Every key slot keeps its own running max, sum and [G, D / DL] accumulator, so the
softmax and P V are within the thread: no cross-thread step per block, only one merge at the end. The
next block's K and V are loaded into registers before the current one is used (a two-deep register
pipeline).
Prediction: batch 16 8k one split >= cuDNN if the loads stay in flight (bytes in flight per SM =
2 x BN x D x 2 x 2); batch 1 no better than the shipped kernel (ramp-bound).
Result (H200, results/h200_decode_fma_v23.json; float64 check passed, worst 7e-3): far below everywhere,
0.52-0.78x cuDNN against the shipped kernel's 0.95-1.01x: batch 16 8k best 2908 GB/s (R 4, DL 16, 8 warps,
one split) against shipped 3790 and cuDNN 4001; batch 64 8k 3319 against 4363; batch 1 32k 1824 against
2689. The shapes that keep more keys in flight (R 4) do best, and those spill or reach 255 registers
(ptxas: 168-255 registers, R 8 and DL 8 spill): with a pointer per 16-byte load, fp32 Q and a [G, D/DL]
accumulator per thread, registers cap the bytes in flight at ~16-32 KB per SM, short of what the
shared-memory pipelines hold. Not adopted.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import decode_case, error_text, split_decode, write_rows  # noqa: E402
from decode_warpsplit import reference  # noqa: E402  (float64 attention of one new token per sequence)


@gluon.jit
def fma_decode(Q, K, V, O_PART, LSE_PART, SEQLENS,
               stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_k_n, stride_v_b, stride_v_h, stride_v_n,
               stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s, stride_l_h, NUM_SPLITS, sm_scale,
               G: gl.constexpr, D: gl.constexpr, R: gl.constexpr, DL: gl.constexpr, NW: gl.constexpr):
    """one program per (split, K/V head, sequence); G query rows (the K/V head's group)"""
    VEC: gl.constexpr = 8
    TPW: gl.constexpr = 32 // DL
    T: gl.constexpr = TPW * NW
    BN: gl.constexpr = R * T
    L4: gl.constexpr = gl.BlockedLayout([G, R, 1, VEC], [1, 1, TPW, DL], [1, 1, NW, 1], [3, 2, 1, 0])
    KV: gl.constexpr = gl.SliceLayout(0, L4)                      # [R, T, D] tiles
    SC: gl.constexpr = gl.SliceLayout(3, L4)                      # [G, R, T] scores
    ST: gl.constexpr = gl.SliceLayout(1, SC)                      # [G, T] per key slot statistics
    AC: gl.constexpr = gl.SliceLayout(1, L4)                      # [G, T, D] accumulators
    QL: gl.constexpr = gl.SliceLayout(1, AC)                      # [G, D]
    pid = gl.program_id(2)
    split = pid % NUM_SPLITS
    b = pid // NUM_SPLITS
    h_kv = gl.program_id(1)
    n_k = gl.load(SEQLENS + b)
    qk_scale = sm_scale * 1.4426950408889634
    g_q = gl.arange(0, G, layout=gl.SliceLayout(1, QL))
    d_q = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    q_base = Q + b.to(gl.int64) * stride_q_b + (h_kv * G).to(gl.int64) * stride_q_h
    q = gl.load(q_base + g_q[:, None] * stride_q_h + d_q[None, :]).to(gl.float32) * qk_scale
    q4 = gl.expand_dims(gl.expand_dims(q, 1), 1)                   # [G, 1, 1, D]
    r_i = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, KV)))
    t_i = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, KV)))
    d_i = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, KV)))
    key3 = (r_i[:, None] * T + t_i[None, :])[:, :, None]          # [R, T, 1]: key of each element
    k_off = key3 * stride_k_n + d_i[None, None, :]
    v_off = key3 * stride_v_n + d_i[None, None, :]
    r_s = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(0, SC)))
    t_s = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(0, SC)))
    key_s = (r_s[:, None] * T + t_s[None, :])[None, :, :]          # [1, R, T]
    k_base = K + b.to(gl.int64) * stride_k_b + h_kv.to(gl.int64) * stride_k_h
    v_base = V + b.to(gl.int64) * stride_v_b + h_kv.to(gl.int64) * stride_v_h
    per_split = BN * gl.cdiv(gl.cdiv(n_k, NUM_SPLITS), BN)
    start = per_split * split
    stop = gl.minimum(n_k, start + per_split)
    m_i = gl.full([G, T], float("-inf"), gl.float32, layout=ST)
    l_i = gl.zeros([G, T], gl.float32, layout=ST)
    acc = gl.zeros([G, T, D], gl.float32, layout=AC)
    k_cur = gl.load(k_base + start.to(gl.int64) * stride_k_n + k_off, mask=start + key3 < stop, other=0.0)
    v_cur = gl.load(v_base + start.to(gl.int64) * stride_v_n + v_off, mask=start + key3 < stop, other=0.0)
    for n0 in range(start, stop, BN):
        n1 = n0 + BN
        k_nxt = gl.load(k_base + n1.to(gl.int64) * stride_k_n + k_off, mask=n1 + key3 < stop, other=0.0)
        v_nxt = gl.load(v_base + n1.to(gl.int64) * stride_v_n + v_off, mask=n1 + key3 < stop, other=0.0)
        s = gl.sum(q4 * gl.expand_dims(k_cur.to(gl.float32), 0), 3)           # [G, R, T], base-2 logits
        s = gl.where(n0 + key_s < stop, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        pv = gl.sum(gl.expand_dims(p, 3) * gl.expand_dims(v_cur.to(gl.float32), 0), 1)   # [G, T, D]
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(2, AC)), 2) + pv
        m_i = m_new
        k_cur = k_nxt
        v_cur = v_nxt
    # -- merge the key slots' states --
    m = gl.max(m_i, 1)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w = gl.exp2(m_i - gl.expand_dims(m_safe, 1))
    l_f = gl.sum(l_i * w, 1)
    o = gl.sum(acc * gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(2, AC)), 2), 1)   # [G, D]
    l_safe = gl.where(l_f == 0.0, 1.0, l_f)
    o = o / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o.type.layout)), 1)
    g_o = gl.arange(0, G, layout=gl.SliceLayout(1, o.type.layout))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o.type.layout))
    o_base = (O_PART + b.to(gl.int64) * stride_o_b + split.to(gl.int64) * stride_o_s
              + (h_kv * G).to(gl.int64) * stride_o_h)
    gl.store(o_base + g_o[:, None] * stride_o_h + d_o[None, :], o.to(O_PART.dtype.element_ty))
    l_base = (LSE_PART + b.to(gl.int64) * stride_l_b + split.to(gl.int64) * stride_l_s
              + (h_kv * G).to(gl.int64) * stride_l_h)
    g_l = gl.arange(0, G, layout=l_safe.type.layout)
    gl.store(l_base + g_l * stride_l_h, (m_safe + gl.log2(l_safe)) * 0.6931471805599453)


def run(module, q, k, v, lens, out, lse, splits, R, DL, warps):
    """q (B, H, 1, D), k/v (B, H_KV, S, D) views; out (B, H, 1, D), lse (B, H, 1)."""
    return split_decode(fma_decode, module, q, k, v, lens, out, lse, splits, min(32, 1 << (splits - 1).bit_length()),
                        G=q.shape[1] // k.shape[1], D=q.shape[3], R=R, DL=DL, NW=warps, num_warps=warps)


SHAPES = [(2, 16, 4), (2, 16, 8), (4, 16, 4), (4, 16, 8), (1, 16, 8)]


def ptxas_report() -> int:
    from common import sm90_ptxas
    for R, DL, w in SHAPES:
        const = dict(G=4, D=128, R=R, DL=DL, NW=w)
        ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "SEQLENS": "*i32"}
        try:
            print(f"R {R} DL {DL} warps {w}: {sm90_ptxas(fma_decode, [64, 128], const, ptrs, num_warps=w)}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"R {R} DL {DL} warps {w}: {error_text(e)}")
    return 0


def check_gpu(module) -> float:
    """float64 check: odd lengths, an empty sequence, 1-3 splits, every shape; the worst error."""
    torch.manual_seed(0)
    B, H, H_KV, S, D = 3, 8, 2, 300, 128
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(B, S, H_KV, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    v = torch.randn(B, S, H_KV, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    lens = torch.tensor([300, 0, 77], dtype=torch.int32, device="cuda")
    want = reference(q, k, v, lens)
    worst = 0.0
    for splits in (1, 2, 3):
        for R, DL, w in SHAPES:
            out = torch.full((B, H, 1, D), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((B, H, 1), float("nan"), dtype=torch.float32, device="cuda")
            try:
                run(module, q, k, v, lens, out, lse, splits, R, DL, w)
                err = (out.double() - want).abs().max().item()
            except Exception as e:  # noqa: BLE001
                print(f"check splits {splits} R {R} DL {DL} warps {w}: {error_text(e)}")
                continue
            worst = max(worst, err if err == err else float("inf"))
            if not err < 2e-2:
                print(f"check splits {splits} R {R} DL {DL} warps {w}: max |err| {err:.2e}")
    print(f"float64 check: worst max |err| {worst:.2e}", flush=True)
    return worst


def main() -> int:
    if "--ptxas" in sys.argv:
        return ptxas_report()
    import attngen
    from attngen.bench_decode import H, D, bench_graph, sdpa
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    module = attngen.load(os.path.join(ROOT, "specs/decode_d128.attn")).module
    worst = check_gpu(module)
    shapes = [(16, 8192), (16, 32768), (16, 1024), (64, 8192), (64, 1024), (1, 8192), (1, 32768)]
    rows = []
    for batch, ctx in shapes:
        q, k, v, lens, nbytes = decode_case(batch, ctx)
        gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        want = attngen.attention_with_kvcache(q, k, v, lens)
        qv, kv, vv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = torch.empty(batch, H, 1, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, H, 1, device="cuda", dtype=torch.float32)
        split_set = (1, 2) if batch >= 16 else (8, 16)
        cands = []
        for splits in split_set:
            for R, DL, w in SHAPES:
                cfg = dict(splits=splits, R=R, DL=DL, warps=w)
                row = {"batch": batch, "context": ctx, **cfg}
                try:
                    out.fill_(float("nan"))
                    run(module, qv, kv, vv, lens, out, lse, **cfg)
                    torch.cuda.synchronize()
                    err = (out.transpose(1, 2).float() - want.float()).abs().max().item()
                    row["max diff"] = err
                    if not err < 2e-2:
                        row["error"] = "wrong result"
                    else:
                        row["GB/s"] = gbps(bench_graph(lambda c=cfg: run(module, qv, kv, vv, lens, out, lse, **c)))
                        cands.append(cfg)
                except Exception as e:  # noqa: BLE001 - out of resources: recorded, skipped
                    row["error"] = error_text(e)
                rows.append(row)
                print(json.dumps(row), flush=True)
        # the best four again, alternating with the shipped call and cuDNN, best of three rounds
        best = sorted((r for r in rows if (r["batch"], r["context"]) == (batch, ctx) and "GB/s" in r),
                      key=lambda r: -r["GB/s"])[:4]
        final = {"shipped": [], "cudnn": [], **{i: [] for i in range(len(best))}}
        for _ in range(3):
            final["shipped"].append(gbps(bench_graph(lambda: attngen.attention_with_kvcache(q, k, v, lens))))
            final["cudnn"].append(gbps(sdpa("CUDNN_ATTENTION", q, k, v)[0]))
            for i, r in enumerate(best):
                cfg = {key: r[key] for key in ("splits", "R", "DL", "warps")}
                final[i].append(gbps(bench_graph(lambda c=cfg: run(module, qv, kv, vv, lens, out, lse, **c))))
        summary = {"batch": batch, "context": ctx, "final": True, "shipped": max(final["shipped"]),
                   "cudnn": max(final["cudnn"]),
                   "best": [{**{key: r[key] for key in ("splits", "R", "DL", "warps")}, "GB/s": max(final[i])}
                            for i, r in enumerate(best)]}
        rows.append(summary)
        print(json.dumps(summary), flush=True)

        torch.cuda.empty_cache()
    write_rows(out_dir, "decode_fma.json", rows)
    print(f"\n{torch.cuda.get_device_name()}: CUDA-core decode, full caches, GB/s (best of three alternating rounds);"
          f" float64 check worst {worst:.1e}")
    for s in (r for r in rows if r.get("final")):
        print(f"  B={s['batch']} {s['context']}: shipped {s['shipped']:.0f} ({s['shipped'] / s['cudnn']:.3f}) cuDNN {s['cudnn']:.0f}")
        for r in s["best"]:
            print(f"     {r['GB/s']:6.0f} {r['GB/s'] / s['cudnn']:.3f}  splits {r['splits']} R {r['R']} DL {r['DL']} warps {r['warps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
