"""Experiment: how fast can the generated decode kernel go on this GPU, by launch config alone?

    python benchmarks/experiments/decode_sweep.py OUT_DIR [--quick]

The tuner tries the 10 configs nearest the heuristic; this sweeps the whole space that fits the
shared memory (BLOCK_N x warps x stages) x split counts, at the decode grid's shapes where attngen
trails cuDNN (32 query / 8 kv heads, d = 128, bf16, one query token, full caches), each timed as
CUDA-graph replays (do_bench median, L2 flushed between replays), cuDNN measured in the same run.
Every config's output is checked against the default's. Writes decode_sweep.json, prints the best
configs per shape last. Results decide the heuristics and the tuning space (benchmarks/NOTES.md).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import attngen  # noqa: E402
from attngen.bench_decode import H, H_KV, D, DTYPE, bench_graph, gbps, sdpa  # noqa: E402
from common import quick_graph  # noqa: E402


SHAPES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768))
SMEM = 227 * 1024


def configs(quick: bool):
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4, 6)):
        if stages * 2 * block_n * D * 2 > SMEM - 8192:
            continue
        if quick and warps != 4:
            continue
        yield {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def splits_for(batch: int, sms: int):
    if batch == 1:
        return sorted({4, 8, 12, 16, 24, 32, 48, 64, sms // H_KV, 2 * sms // H_KV, 4 * sms // H_KV})
    return (1, 2, 3, 4, 6, 8)


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    quick = "--quick" in sys.argv
    os.makedirs(out_dir, exist_ok=True)
    spec = attngen.parse(open(os.path.join(ROOT, "specs", "decode_d128.attn")).read(), "decode_d128.attn")
    module = attngen.load(spec).module
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator("cuda").manual_seed(0)
    started = time.time()
    rows = []
    for batch, ctx in SHAPES:
        q = torch.randn(batch, H, 1, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2)
        v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen).transpose(1, 2)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        ref, _ = module.forward_kvcache(q, k, v, lens)
        cudnn_ms, _ = sdpa("CUDNN_ATTENTION", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        default_ms = bench_graph(lambda: module.forward_kvcache(q, k, v, lens))
        row = {"batch": batch, "context": ctx, "cudnn_ms": cudnn_ms, "default_ms": default_ms, "runs": []}
        for config in configs(quick):
            for splits in splits_for(batch, sms):
                out = torch.full_like(q, float("nan"))
                try:
                    module.forward_kvcache(q, k, v, lens, out=out, num_splits=splits, config=config)
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = quick_graph(lambda: module.forward_kvcache(q, k, v, lens, out=out, num_splits=splits,
                                                                     config=config)) if err < 2e-2 else None
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses
                    err, ms = f"{type(e).__name__}: {str(e)[:80]}", None
                row["runs"].append({"config": config, "splits": splits, "ms": ms, "err": err})
        best = sorted((r for r in row["runs"] if r["ms"]), key=lambda r: r["ms"])[:5]
        row["best"] = best
        rows.append(row)
        print(f"B={batch} ctx={ctx}: cudnn {gbps(batch, ctx, cudnn_ms):.0f} default {gbps(batch, ctx, default_ms):.0f} "
              f"best {gbps(batch, ctx, best[0]['ms']):.0f} GB/s ({time.time() - started:.0f} s)", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, f, indent=1)
    print(f"\nGB/s of K/V read ({torch.cuda.get_device_name()}), graph replays; best 5 configs (BN,warps,stages,splits)")
    for r in rows:
        b, c = r["batch"], r["context"]
        tops = "  ".join(f"{gbps(b, c, x['ms']):.0f}:{x['config']['BLOCK_N']},{x['config']['num_warps']},"
                         f"{x['config']['num_stages']},{x['splits']}" for x in r["best"])
        print(f"B={b:>2} ctx={c:>5} cudnn {gbps(b, c, r['cudnn_ms']):5.0f} default {gbps(b, c, r['default_ms']):5.0f} | {tops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
