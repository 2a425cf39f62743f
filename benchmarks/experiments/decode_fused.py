"""Experiment: merge the splits inside the split kernel (the last split of a tile merges), one launch.

    python benchmarks/experiments/decode_fused.py OUT_DIR

Variants of the committed generated/decode_d128.py (whose combine already merges 32 splits per
load, NOTES v4):
  base     split kernel + combine kernel, as generated
  nocomb   the split kernel alone (wrong results; it measures what the combine launch costs)
  fused    each program stores its partial, then takes a ticket from a per-tile counter (atomic,
           acquire-release); the program that draws the last ticket resets the counter and merges
           the tile's rows over all splits (32 splits per load), writing O and LSE: no second launch
Timed both as one call per CUDA-graph replay and as 8-16 layers per graph ([layers], attngen
bench's decode measurement), cuDNN in the same run. Every variant (but nocomb) is checked against
base on uneven lengths first, then on repeated graph replays (a counter left non-zero shows there).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attngen.bench_decode import H, H_KV, D, DTYPE, bench_graph, bench_layers, gbps, layer_count, sdpa  # noqa: E402
from common import build_variants  # noqa: E402

SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192))

FUSED_EPILOGUE = '''
    # -- fused merge: the program that finishes last among this tile's splits merges them --
    if NUM_SPLITS > 1:
        tl.debug_barrier()
        ticket_ptr = COUNTER + (b * H_KV + h_kv) * tl.num_programs(0) + tl.program_id(0)
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:
            tl.atomic_xchg(ticket_ptr, 0)
            tl.debug_barrier()
            for r in range(start_m, tl.minimum(start_m + BLOCK_M, GROUP * N_Q)):
                hh = h_kv * GROUP + r % GROUP
                nn = r // GROUP
                row_lse = LSE_PART + b.to(tl.int64) * stride_lse_part_b + tl.cast(hh, tl.int64) * stride_lse_part_h + tl.cast(nn, tl.int64) * stride_lse_part_n
                row_o = O_PART + b.to(tl.int64) * stride_o_part_b + tl.cast(hh, tl.int64) * stride_o_part_h + tl.cast(nn, tl.int64) * stride_o_part_n
                m_run = tl.full([], float("-inf"), dtype=tl.float32)
                l_run = tl.full([], 0.0, dtype=tl.float32)
                acc_o = tl.zeros([HEAD_DIM], dtype=tl.float32)
                for s0 in range(0, NUM_SPLITS, BLOCK_S):
                    offs_s = s0 + tl.arange(0, BLOCK_S)
                    lse_s = tl.load(row_lse + offs_s * stride_lse_part_split, mask=offs_s < NUM_SPLITS, other=float("-inf"), cache_modifier=".cg")
                    o_s = tl.load(row_o + offs_s[:, None] * stride_o_part_split + offs_d[None, :] * stride_o_part_d, mask=offs_s[:, None] < NUM_SPLITS, other=0.0, cache_modifier=".cg")
                    m_new2 = tl.maximum(m_run, tl.max(lse_s, 0))
                    m_use2 = tl.where(m_new2 == float("-inf"), 0.0, m_new2)
                    alpha2 = tl.exp(m_run - m_use2)
                    w = tl.exp(lse_s - m_use2)
                    l_run = l_run * alpha2 + tl.sum(w, 0)
                    acc_o = acc_o * alpha2 + tl.sum(w[:, None] * o_s, 0)
                    m_run = m_new2
                l_fin = tl.where(l_run == 0.0, 1.0, l_run)
                out_row = O + b.to(tl.int64) * stride_o_b + tl.cast(hh, tl.int64) * stride_o_h + tl.cast(nn, tl.int64) * stride_o_n
                tl.store(out_row + offs_d * stride_o_d, (acc_o / l_fin).to(tl.bfloat16))
                tl.store(LSE + b.to(tl.int64) * stride_lse_b + tl.cast(hh, tl.int64) * stride_lse_h + tl.cast(nn, tl.int64) * stride_lse_n, m_run + tl.log(l_fin))
'''


def fused(t):
    t = t.replace("    SEQLENS,\n    stride_q_b,", "    SEQLENS,\n    O,\n    LSE,\n    COUNTER,\n    stride_q_b,", 1)
    t = t.replace("    stride_seqlens_b,\n    B,", "    stride_seqlens_b,\n    stride_o_b,\n    stride_o_h,\n    stride_o_n,\n    stride_o_d,\n"
                  "    stride_lse_b,\n    stride_lse_h,\n    stride_lse_n,\n    B,", 1)
    t = t.replace("    BLOCK_N: tl.constexpr,\n):\n    \"\"\"one program per (batch, split,",
                  "    BLOCK_N: tl.constexpr,\n    BLOCK_S: tl.constexpr,\n):\n    \"\"\"one program per (batch, split,", 1)
    marker = "* 0.6931471805599453, mask=(offs_m < GROUP*N_Q))\n"
    i = t.index(marker, t.index("def attn_fwd")) + len(marker)
    t = t[:i] + FUSED_EPILOGUE + t[i:]
    # launcher: pass out, lse and the counter; no combine launch
    t = t.replace("def launch_attn_fwd(q, k, v, o_part, lse_part, seqlens, sm_scale, *, BLOCK_M, BLOCK_N, num_warps, num_stages):",
                  "def launch_attn_fwd(q, k, v, o_part, lse_part, seqlens, sm_scale, *, BLOCK_M, BLOCK_N, num_warps, num_stages, out=None, lse=None):", 1)
    t = t.replace("        q, k, v, o_part, lse_part, seqlens,\n        *q.stride(),",
                  "        q, k, v, o_part, lse_part, seqlens, out, lse, counter(out.device, grid),\n        *q.stride(),", 1)
    t = t.replace("        *seqlens.stride(),\n        B, H, H_KV, GROUP, N_Q, NUM_SPLITS,",
                  "        *seqlens.stride(),\n        *out.stride(),\n        *lse.stride(),\n        B, H, H_KV, GROUP, N_Q, NUM_SPLITS,", 1)
    t = t.replace("        BLOCK_N=BLOCK_N,\n        num_warps=num_warps,", "        BLOCK_N=BLOCK_N,\n        BLOCK_S=COMBINE_BLOCK_S,\n        num_warps=num_warps,", 1)
    t = t.replace("""        launch_attn_fwd(q, k_cache, v_cache, out.unsqueeze(1), lse.unsqueeze(1), cache_seqlens, sm_scale,
                        **config)""", """        launch_attn_fwd(q, k_cache, v_cache, out.unsqueeze(1), lse.unsqueeze(1), cache_seqlens, sm_scale,
                        **config, out=out, lse=lse)""", 1)
    t = t.replace("""    launch_attn_fwd(q, k_cache, v_cache, o_part, lse_part, cache_seqlens, sm_scale, **config)
    launch_attn_combine(o_part, lse_part, out, lse, BLOCK_S=COMBINE_BLOCK_S, num_warps=4, num_stages=1)""",
                  """    launch_attn_fwd(q, k_cache, v_cache, o_part, lse_part, cache_seqlens, sm_scale, **config, out=out, lse=lse)""", 1)
    assert t.count("out=out, lse=lse") == 2 and "BLOCK_S=COMBINE_BLOCK_S,\n        num_warps" in t
    return t + '''

_COUNTERS = {}


def counter(device, grid):
    """Per-tile tickets, zero between launches (the last program of a tile resets its own)."""
    n = grid[0] * grid[1] * grid[2]
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf
'''


def nocomb(t):
    old = "    launch_attn_combine(o_part, lse_part, out, lse, BLOCK_S=COMBINE_BLOCK_S, num_warps=4, num_stages=1)"
    assert old in t
    return t.replace(old, "    pass")


VARIANTS = {"base": [], "nocomb": [nocomb], "fused": [fused]}


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    source = open(os.path.join(ROOT, "generated", "decode_d128.py")).read()
    modules = build_variants(source, VARIANTS, "df")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for batch, ctx in SHAPES:
        layers = max(2, layer_count(batch, ctx))
        caches = [(torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2),
                   torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2))
                  for _ in range(layers)]
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
        k, v = caches[0]
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        odd = torch.randint(1, ctx, (batch,), device="cuda", dtype=torch.int32, generator=gen)
        row = {"batch": batch, "context": ctx, "layers": layers}
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
        splits = 16 if batch == 1 else 2
        for name, module in modules.items():
            call = lambda kl, vl, out=None, lse=None, m=module, n=lens: m.forward_kvcache(  # noqa: E731
                q, kl, vl, n, out=out, lse=lse, num_splits=splits, config=config)
            if name != "nocomb":
                errs = []
                for s in (splits, 3, 37):
                    want, want_lse = modules["base"].forward_kvcache(q, k, v, odd, num_splits=s, config=config)
                    got = torch.full_like(q, float("nan"))
                    got_lse = torch.full((batch, H, 1), float("nan"), device="cuda")
                    module.forward_kvcache(q, k, v, odd, out=got, lse=got_lse, num_splits=s, config=config)
                    errs.append(max((got.float() - want.float()).abs().max().item(), (got_lse - want_lse).abs().max().item()))
                # repeated graph replays on new queries: the counter must come back to zero each time
                out = torch.empty_like(q)
                graph = torch.cuda.CUDAGraph()
                call(k, v, out)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    call(k, v, out)
                for _ in range(20):
                    q.copy_(torch.randn(q.shape, device="cuda", dtype=DTYPE, generator=gen))
                    graph.replay()
                    want, _ = modules["base"].forward_kvcache(q, k, v, lens, num_splits=splits, config=config)
                    errs.append((out.float() - want.float()).abs().max().item())
                row[f"{name} max err"] = max(errs)
            row[name] = gbps(batch, ctx, bench_graph(lambda: call(k, v)))
            row[f"{name} [layers]"] = gbps(batch, ctx, bench_layers([lambda kl=kl, vl=vl: call(kl, vl) for kl, vl in caches]))
        ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        row["cudnn"] = gbps(batch, ctx, ms)
        ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     [(kl.transpose(1, 2), vl.transpose(1, 2)) for kl, vl in caches])
        row["cudnn [layers]"] = gbps(batch, ctx, ms)
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del caches, q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_fused.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = ["base", "nocomb", "fused", "cudnn", "base [layers]", "nocomb [layers]", "fused [layers]", "cudnn [layers]"]
    print(f"\nGB/s ({torch.cuda.get_device_name()}), BLOCK_N=64 4 stages, 16 splits at batch 1, 2 at 16")
    print(f"{'B':>3} {'ctx':>6} " + " ".join(f"{c:>15}" for c in cols) + "  fused err")
    for r in rows:
        print(f"{r['batch']:>3} {r['context']:>6} " + " ".join(f"{r[c]:15.0f}" for c in cols) + f"  {r['fused max err']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
