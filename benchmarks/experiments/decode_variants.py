"""Experiment: which rewrites of the generated decode kernel pay on Hopper?

    python benchmarks/experiments/decode_variants.py OUT_DIR

decode_sweep.py found that launch configs alone leave batch-1 decoding at 0.92-0.96x cuDNN: more
splits make it slower, so the cost is not (only) in the split kernel. Candidates, each a textual
rewrite of the committed generated/decode_d128.py:
  vcomb  the combine kernel loads a chunk of BLOCK_S splits at once ([BLOCK_S] log-sum-exps,
         [BLOCK_S, D] outputs) and merges chunks online, one program per (batch, head, query row);
         the generated one loops over the splits one load at a time, twice
  tma    K and V through device-side tensor descriptors (shape [n_k, D]: rows past the sequence
         read as zeros), one bulk copy per tile instead of 16-byte copies per thread
Shapes: the decode grid's (32 query / 8 kv heads, d = 128, bf16, one query token, full caches),
CUDA-graph replays, cuDNN measured in the same run. Writes decode_variants.json; a table last.
Measured (NOTES v4) on the generated module of that time; the split-kv pass has since adopted vcomb,
so on today's generated module `base` and `vcomb` are the same algorithm.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from attngen.bench_decode import H, H_KV, D, DTYPE, gbps, sdpa  # noqa: E402
from common import build_variants, quick_graph  # noqa: E402

SHAPES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 8192))

VCOMB = '''
@triton.jit(do_not_specialize=["B", "NUM_SPLITS", "N_Q", "stride_lse_part_b", "stride_lse_part_split", "stride_lse_part_h", "stride_lse_b", "stride_lse_h"])
def attn_combine(
    O_PART, LSE_PART, O, LSE,
    stride_o_part_b, stride_o_part_split, stride_o_part_h, stride_o_part_n, stride_o_part_d,
    stride_lse_part_b, stride_lse_part_split, stride_lse_part_h, stride_lse_part_n,
    stride_o_b, stride_o_h, stride_o_n, stride_o_d,
    stride_lse_b, stride_lse_h, stride_lse_n,
    B, H, NUM_SPLITS, N_Q,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(2)
    h = tl.program_id(1)
    m = tl.program_id(0)
    lse_part_base = LSE_PART + b.to(tl.int64) * stride_lse_part_b + h.to(tl.int64) * stride_lse_part_h + m.to(tl.int64) * stride_lse_part_n
    o_part_base = O_PART + b.to(tl.int64) * stride_o_part_b + h.to(tl.int64) * stride_o_part_h + m.to(tl.int64) * stride_o_part_n
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse_s = tl.load(lse_part_base + offs_s.to(tl.int64) * stride_lse_part_split, mask=offs_s < NUM_SPLITS, other=float("-inf"))
        o_s = tl.load(o_part_base + offs_s.to(tl.int64)[:, None] * stride_o_part_split + offs_d[None, :] * stride_o_part_d, mask=offs_s[:, None] < NUM_SPLITS, other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse_s - m_use)
        alpha = tl.exp(m_run - m_use)
        l_run = l_run * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        m_run = m_new
    l_safe = tl.where(l_run == 0.0, 1.0, l_run)
    o_base = O + b.to(tl.int64) * stride_o_b + h.to(tl.int64) * stride_o_h + m.to(tl.int64) * stride_o_n
    tl.store(o_base + offs_d * stride_o_d, (acc / l_safe).to(tl.bfloat16))
    tl.store(LSE + b.to(tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + m.to(tl.int64) * stride_lse_n, m_run + tl.log(l_safe))


def launch_attn_combine(o_part, lse_part, o, lse, *, BLOCK_M, num_warps, num_stages):
    B, NUM_SPLITS, H, N_Q = o_part.shape[:4]
    grid = (N_Q, H, B)
    attn_combine[grid](
        o_part, lse_part, o, lse, *o_part.stride(), *lse_part.stride(), *o.stride(), *lse.stride(),
        B, H, NUM_SPLITS, N_Q, HEAD_DIM=HEAD_DIM, HEAD_DIM_PADDED=HEAD_DIM_PADDED,
        BLOCK_S=min(32, triton.next_power_of_2(NUM_SPLITS)), num_warps=4, num_stages=1)
'''


def vcomb(t):
    start = t.index('@triton.jit(do_not_specialize=["B", "NUM_SPLITS"')
    end = t.index("\n\n\n\n", t.index("def launch_attn_combine"))
    return t[:start] + VCOMB.strip() + t[end:]


def tma(t):
    t = t.replace("    qk_scale = sm_scale * 1.4426950408889634\n",
                  "    qk_scale = sm_scale * 1.4426950408889634\n"
                  "    k_desc = tl.make_tensor_descriptor(k_base, shape=[n_k, HEAD_DIM], strides=[stride_k_n, 1], block_shape=[BLOCK_N, HEAD_DIM])\n"
                  "    v_desc = tl.make_tensor_descriptor(v_base, shape=[n_k, HEAD_DIM], strides=[stride_v_n, 1], block_shape=[BLOCK_N, HEAD_DIM])\n", 1)
    lines = []
    for line in t.split("\n"):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped.startswith("k = tl.load(k_base"):
            line = f"{indent}k = k_desc.load([start_n, 0])"
        elif stripped.startswith("v = tl.load(v_base"):
            line = f"{indent}v = v_desc.load([start_n, 0])"
        lines.append(line)
    t = "\n".join(lines)
    assert t.count("k_desc.load") == 2 and t.count("v_desc.load") == 2
    return t


VARIANTS = {"base": [], "vcomb": [vcomb], "tma": [tma], "tma_vcomb": [tma, vcomb]}


def candidates(batch):
    splits = (8, 12, 16, 24, 32, 48) if batch == 1 else (1, 2, 3, 4) if batch == 16 else (1, 2)
    for (bn, stages), s in itertools.product(((64, 3), (64, 4), (128, 3), (128, 2), (32, 4)), splits):
        yield {"BLOCK_M": 16, "BLOCK_N": bn, "num_warps": 4, "num_stages": stages}, s


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    source = open(os.path.join(ROOT, "generated", "decode_d128.py")).read()
    modules = build_variants(source, VARIANTS, "dv")
    gen = torch.Generator("cuda").manual_seed(0)
    started = time.time()
    rows = []
    for batch, ctx in SHAPES:
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2)
        v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2)
        # uneven lengths for the check (the last tile partial), full lengths for timing
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        odd = torch.randint(ctx // 2, ctx, (batch,), device="cuda", dtype=torch.int32, generator=gen)
        ref_full, _ = modules["base"].forward_kvcache(q, k, v, lens)
        ref_odd, ref_lse = modules["base"].forward_kvcache(q, k, v, odd, num_splits=7)
        cudnn_ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        row = {"batch": batch, "context": ctx, "cudnn": gbps(batch, ctx, cudnn_ms), "best": {}, "runs": []}
        for name, module in modules.items():
            for config, splits in candidates(batch):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((batch, H, 1), float("nan"), device="cuda")
                run = {"variant": name, "config": config, "splits": splits}
                try:
                    module.forward_kvcache(q, k, v, odd, out=out, lse=lse, num_splits=splits, config=config)
                    err = max((out.float() - ref_odd.float()).abs().max().item(), (lse - ref_lse).abs().max().item())
                    module.forward_kvcache(q, k, v, lens, out=out, num_splits=splits, config=config)
                    err = max(err, (out.float() - ref_full.float()).abs().max().item())
                    run["err"] = err
                    if err < 2e-2:
                        run["gbps"] = gbps(batch, ctx, quick_graph(
                            lambda: module.forward_kvcache(q, k, v, lens, out=out, num_splits=splits, config=config)))
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                    run["err"] = f"{type(e).__name__}: {str(e).strip()[-160:]}"
                row["runs"].append(run)
            done = [r for r in row["runs"] if r["variant"] == name and "gbps" in r]
            if done:
                top = max(done, key=lambda r: r["gbps"])
                row["best"][name] = (round(top["gbps"]), top["config"]["BLOCK_N"], top["config"]["num_stages"], top["splits"])
        rows.append(row)
        print(f"B={batch} ctx={ctx} cudnn {row['cudnn']:.0f}: {row['best']} ({time.time() - started:.0f} s)", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    errors = {(r["variant"], str(r["err"])[:100]) for row in rows for r in row["runs"] if isinstance(r.get("err"), str)
              or (r.get("err") or 0) >= 2e-2}
    print(f"\nGB/s of K/V read ({torch.cuda.get_device_name()}), best (GB/s, BLOCK_N, stages, splits) per variant")
    print(f"{'B':>3} {'ctx':>6} {'cudnn':>6} " + " ".join(f"{n:>22}" for n in VARIANTS))
    for r in rows:
        cells = [str(r["best"].get(n, "-")) for n in VARIANTS]
        print(f"{r['batch']:>3} {r['context']:>6} {r['cudnn']:6.0f} " + " ".join(f"{c:>22}" for c in cells))
    for e in sorted(errors)[:8]:
        print("error/mismatch:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
