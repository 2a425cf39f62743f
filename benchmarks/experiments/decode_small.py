"""Experiment: every decode candidate at one small shape, contiguous and paged, both length mixes.

    python benchmarks/experiments/decode_small.py OUT_DIR [BATCH CONTEXT]   (GPU; default 1 1024)

The re-tuned H200 tables (NOTES v15) moved the contiguous batch-1 1k row from 334 to 358 GB/s (BLOCK_N
64 instead of 128), and paged 16 stayed at 332: 0.93x of contiguous against the 0.95x target. This
times each candidate of both specs' tuning spaces (the tuner's own inputs and launch path, CUDA-graph
replays) on the spread lengths and at capacity, to see whether any paged config reaches 0.95x of the
best contiguous one, and how far apart the two layouts' best configs are.
Prediction: no; the paged kernel's first K copy waits on a block-table load (~0.8 us of ~12 us).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    import attngen
    from attngen.resources import Target
    from attngen.tuning import Shape
    from attngen.tuning import space as space_
    from attngen.tuning.search import bench, graphed

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = args[0] if args else "."
    batch, ctx = (int(args[1]), int(args[2])) if len(args) >= 3 else (1, 1024)
    os.makedirs(out_dir, exist_ok=True)
    shape = Shape(batch, 32, 8, 1, ctx)
    rows = []
    for spec in ("specs/decode_d128.attn", "specs/decode_paged16_d128.attn"):
        part = attngen.load(os.path.join(ROOT, spec)).tuner("kvcache")
        space = space_.restrict(part.tuning_space(), {"block_n": (64, 128), "num_warps": (4,),
                                                      "num_stages": (3, 4, 5, 6)})
        candidates = space_.candidates(space)
        canonical = getattr(part, "tuning_canonical", None)
        if canonical:
            candidates = list({tuple(sorted(c.items())): c for c in map(canonical, candidates)}.values())
        candidates, _ = space_.prune(part, candidates, Target.current())
        gen = torch.Generator("cuda").manual_seed(0)
        spread = part.tuning_inputs(shape, "cuda", gen)
        mixes = [("spread", spread)] + list(part.tuning_variants(spread))
        for config in candidates:
            row = {"spec": os.path.basename(spec), "config": config}
            for name, x in mixes:
                part.tuning_run(x, config)
                torch.cuda.synchronize()
                ms = bench(graphed(lambda x=x, config=config: part.tuning_run(x, config)), 25, True)
                tokens = int(x["lens"].sum())
                row[name] = 2 * tokens * 8 * 128 * 2 / (ms * 1e-3) / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, f"decode_small_b{batch}_{ctx}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nbest five per spec, GB/s at capacity (spread), batch {batch} context {ctx}:")
    for spec in ("decode_d128.attn", "decode_paged16_d128.attn"):
        mine = sorted((r for r in rows if r["spec"] == spec), key=lambda r: -r["at capacity"])[:5]
        for r in mine:
            print(f"  {spec:28s} {r['at capacity']:6.0f} ({r['spread']:6.0f})  {space_.describe(r['config'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
