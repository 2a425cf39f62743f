"""Experiment: the decode merge loading only as many splits as the call has.

    python benchmarks/experiments/combine_width.py OUT_DIR   (GPU)

The split-KV merge (`attn_combine`, one program per (sequence, head, query row)) loads BLOCK_S splits'
log-sum-exps and [BLOCK_S, D] float32 outputs per step, BLOCK_S = COMBINE_BLOCK_S = 32 at d=128 (v4:
one split at a time cost 7% of a batch-1 step at 16 splits). Batch 16 runs 2-4 splits, so each
program works on a 32 x 128 tile of which 2-4 rows are real (the rest masked, but still in registers
and in the reductions). `decode_adaptive.py` (NOTES v20) had a copy of the decode kernel whose merge
used BLOCK_S = next power of two of the split count, and at batch 16 8k with the tuned 2 splits it ran
+1.2-1.4% over the shipped call. This times the generated modules of specs/decode_d128.attn and
specs/decode_paged16_d128.attn as shipped ("32") against the same modules launching the merge with
BLOCK_S = min(32, next_power_of_2(num_splits)) ("fitted"), at the tuned table's config per shape,
CUDA-graph replays, alternating, twice, on full caches and the tuner's spread lengths; and the merge
kernel alone on the same partials. Outputs of both are compared. Prediction: the merge 1-2 us faster at
2-4 splits (batch 16: +1% of the call), unchanged at 16 splits (batch 1).
Result (NOTES.md v20): the merge 7.7 -> 6.1 us at 2 splits, batch 16 8k +1.1-1.5% (contiguous and paged),
batch 1 within noise; adopted (templates/attention.py.j2).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHIPPED = "BLOCK_S=COMBINE_BLOCK_S,"
FITTED = "BLOCK_S=min(COMBINE_BLOCK_S, triton.next_power_of_2(num_splits)),"
SHAPES = ((1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 1024), (64, 8192))


def fitted(text: str) -> str:
    assert text.count(SHIPPED) == 1, "the merge launch is not as expected"
    return text.replace(SHIPPED, FITTED)


def main() -> int:
    import triton

    import attngen
    from attngen.tuning import Shape
    from attngen.tuning.search import bench, graphed
    from common import alternate_modules, build_variants, module_outputs, write_rows

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for spec in ("decode_d128", "decode_paged16_d128"):
        part = attngen.load(os.path.join(ROOT, f"specs/{spec}.attn")).tuner("kvcache")
        with open(part.kernel.path) as f:
            source = f.read()
        variants = build_variants(source, {"32": [], "fitted": [fitted]}, f"combine_width_{spec}")
        shipped = part.kernel.module
        try:
            for batch, ctx in SHAPES:
                shape = Shape(batch, 32, 8, 1, ctx)
                x = part.tuning_inputs(shape, "cuda", torch.Generator("cuda").manual_seed(batch * ctx))
                config = dict(part._config(shape, 0))
                config.pop("BLOCK_M", None)
                splits = config.get("num_splits") or part.kernel.module.choose_num_splits(
                    batch * 8, -(-ctx // config.get("BLOCK_N", 64)), part.kernel.module.multiprocessors(x["q"].device))
                config["num_splits"] = splits
                for mix in ("full", "spread"):
                    lens = torch.full_like(x["lens"], ctx) if mix == "full" else x["lens"]
                    xl = dict(x, lens=lens)
                    row = {"spec": spec, "batch": batch, "context": ctx, "mix": mix, "config": config}
                    outs = module_outputs(part, variants, xl, config)
                    row["max diff"] = (outs["32"].float() - outs["fitted"].float()).abs().max().item()
                    alternate_modules(part, variants, xl, config, 2 * int(lens.sum()) * 8 * 128 * 2, row)
                    if splits > 1 and mix == "full":  # the merge alone, on partials of this shape
                        h = 32
                        o_part = torch.randn(batch, splits, h, 1, 128, device="cuda")
                        lse_part = torch.randn(batch, splits, h, 1, device="cuda")
                        out = torch.empty(batch, h, 1, 128, device="cuda", dtype=torch.bfloat16)
                        lse = torch.empty(batch, h, 1, device="cuda")
                        for name, width in (("32", 32), ("fitted", min(32, triton.next_power_of_2(splits)))):
                            mod = variants[name]
                            us = 1e3 * bench(graphed(lambda mod=mod, width=width: mod.launch_attn_combine(
                                o_part, lse_part, out, lse, BLOCK_S=width, num_warps=4, num_stages=1)), 50, True)
                            row[f"merge us {name}"] = us
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del x
                torch.cuda.empty_cache()
        finally:
            part.kernel.module = shipped
    write_rows(out_dir, "combine_width.json", rows)
    print(f"\n{torch.cuda.get_device_name()}: decode GB/s [graph], best of two: BLOCK_S 32 / fitted; merge alone us")
    for r in rows:
        a, b = max(r["32"]), max(r["fitted"])
        merge = (f"  merge {r['merge us 32']:.2f} / {r['merge us fitted']:.2f} us" if "merge us 32" in r else "")
        print(f"  {r['spec']:20s} B={r['batch']:2d} {r['context']:5d} {r['mix']:6s} splits {r['config']['num_splits']:2d} "
              f"{a:6.0f} / {b:6.0f}  {b / a:5.3f}x  diff {r['max diff']:.1e}{merge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
