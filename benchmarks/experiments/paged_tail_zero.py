"""Experiment: what zeroing the last block's V rows past the sequence costs the paged Gluon decode kernel.

    python benchmarks/experiments/paged_tail_zero.py OUT_DIR   (GPU, sm_90)

The Gluon paged decode kernel copies whole pages by TMA, so a sequence's last block holds slots past
its length (a last page's unwritten slots; page 0, read for table entries past the sequence's pages).
Their scores were masked, but a NaN or Inf there still reached the output through 0 x NaN in P V:
tests/test_robustness.py's garbage test failed on an H100 (NOTES v19). The fix zeroes those V rows in
shared memory before P V, in the last block of each sequence only. This times the generated module of
specs/decode_paged16_d128.attn as shipped ("zeroed") against the same module with the fix taken out
("unzeroed"), at the tuned table's config per shape, CUDA-graph replays (the tuner's timing), in
alternating order, twice, on full caches (the bench's: whole blocks, the branch never taken) and on the
tuner's lengths spread from the capacity to half of it (the branch taken once per sequence). Outputs of
both are poisoned first and compared with each other. Prediction: within 1% everywhere (one 16 KB
shared-memory read and write per sequence, against 0.25-64 MB of K/V streamed).
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIX_START = "        if (j + 1) * BLOCK_N > n_k:  # the sequence's last block: zero its V rows past n_k\n"
FIX_END = "            fence_async_shared()\n"
SHAPES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 1024), (64, 8192))


def unzeroed(text: str) -> str:
    """The module with the fix's `if` block taken out."""
    assert text.count(FIX_START) == 1, "the fix is not in the generated module"
    start = text.index(FIX_START)
    end = text.index(FIX_END, start) + len(FIX_END)
    return text[:start] + text[end:]


def main() -> int:
    import attngen
    from attngen.tuning import Shape
    from common import alternate_modules, build_variants, module_outputs, write_rows

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    paged = attngen.load(os.path.join(ROOT, "specs/decode_paged16_d128.attn")).tuner("kvcache")
    with open(paged.kernel.path) as f:
        source = f.read()
    variants = build_variants(source, {"zeroed": [], "unzeroed": [unzeroed]}, "paged_tail_zero")
    shipped = paged.kernel.module
    rows = []
    try:
        for batch, ctx in SHAPES:
            shape = Shape(batch, 32, 8, 1, ctx)
            x = paged.tuning_inputs(shape, "cuda", torch.Generator("cuda").manual_seed(batch * ctx))
            config = dict(paged._config(shape, 0))
            config.setdefault("warp_specialized", 1)
            config.pop("BLOCK_M", None)
            for mix, full in (("full", True), ("spread", False)):
                lens = torch.full_like(x["lens"], ctx) if full else x["lens"]
                xl = dict(x, lens=lens)
                row = {"batch": batch, "context": ctx, "mix": mix, "config": config}
                outs = module_outputs(paged, variants, xl, config)
                row["max diff"] = (outs["zeroed"].float() - outs["unzeroed"].float()).abs().max().item()
                alternate_modules(paged, variants, xl, config, 2 * int(lens.sum()) * 8 * 128 * 2, row)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x
            torch.cuda.empty_cache()
    finally:
        paged.kernel.module = shipped
        write_rows(out_dir, "paged_tail_zero.json", rows)
    print(f"\n{torch.cuda.get_device_name()}: paged 16 decode, GB/s [graph], best of two: zeroed / unzeroed")
    for r in rows:
        z, u = max(r["zeroed"]), max(r["unzeroed"])
        print(f"  B={r['batch']:2d} {r['context']:5d} {r['mix']:6s} {z:6.0f} / {u:6.0f}  {z / u:5.3f}x  "
              f"splits {r['config'].get('num_splits')}  diff {r['max diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
