"""Split counts for the paged decode's Gluon kernel: what the tuned table gives it, and what it would pick.

    python benchmarks/experiments/wsd_splits.py [OUT.json]

The tuner measures a paged spec's split count with the Triton kernel (`KVCacheKernel.tuning_run`
turns the Gluon kernel off), and on Hopper the Gluon kernel then runs at that count. This times the
Gluon kernel (CUDA-graph replays, GB/s of K/V read) at each split count of the tuner's space on
the bench's decode grid (16-token pages, 32/8 heads, d=128, bf16), on the tuner's inputs (lengths
spread from the capacity down to half of it) and on full caches (the bench's), next to the table's
count and the Triton kernel at its tuned config.
"""

import json
import sys

import torch

import attngen
from attngen.bench_decode import bench_graph
from attngen.decode import kvcache_spec
from attngen.tuning.decoding import sequence_lengths
from attngen.tuning.key import Shape

SPLITS = (1, 2, 3, 4, 6, 8, 16, 32)


def main() -> None:
    kernel = attngen.load(kvcache_spec("bf16", 128, True, 16))
    module, tuner = kernel.module, kernel.tuner("kvcache")
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for batch in (1, 16, 64):
        for ctx in (1024, 8192, 32768):
            per_seq = ctx // 16
            k = torch.randn(batch * per_seq + per_seq, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn_like(k)
            table = torch.randperm(k.shape[0], device="cuda", generator=gen)[:batch * per_seq].view(batch, -1).int()
            q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            config = tuner.config(Shape(batch, 32, 8, 1, ctx), 0)
            table_splits = config.pop("num_splits", 0)
            for lengths in ("spread", "full"):
                lens_list = sequence_lengths(batch, ctx) if lengths == "spread" else [ctx] * batch
                lens = torch.tensor(lens_list, device="cuda", dtype=torch.int32)
                nbytes = 2 * sum(lens_list) * 8 * 128 * 2
                row = {"batch": batch, "context": ctx, "lengths": lengths, "table splits": table_splits, "GB/s": {}}
                for s in SPLITS:
                    ms = bench_graph(lambda: module.forward_kvcache(q, k, v, lens, table, num_splits=s))
                    row["GB/s"][str(s)] = nbytes / ms / 1e6
                ms = bench_graph(lambda: module.forward_kvcache(q, k, v, lens, table, num_splits=table_splits,
                                                                config=dict(config, warp_specialized=False)))
                row["triton at its table config"] = nbytes / ms / 1e6
                ms = bench_graph(lambda: module.forward_kvcache(q, k, v, lens, table, num_splits=table_splits))
                row["gluon at the table splits"] = nbytes / ms / 1e6
                best = max(row["GB/s"], key=row["GB/s"].get)
                row["best"] = best
                rows.append(row)
                print(f"B={batch:3d} ctx={ctx:6d} {lengths:6s} table {table_splits:2d}: gluon "
                      f"{row['gluon at the table splits']:6.0f}, triton {row['triton at its table config']:6.0f}; best "
                      f"{best:>2s} {row['GB/s'][best]:6.0f} | " + " ".join(f"{s}:{g:.0f}" for s, g in row["GB/s"].items()),
                      flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
