"""Experiment: three consumer warpgroups in the Gluon forward (passes/warp_specialize.py).

    python benchmarks/experiments/gluon_consumers.py OUT_DIR

At d=64 the Gluon forward led FlexAttention by 1.09-1.12x without a mask (NOTES.md v9): per key block a
consumer warpgroup does half the products of d=128 for the same softmax work, so more of its time is
its own dependency chain (wgmma wait -> softmax -> next wgmma). A third consumer warpgroup (192 query
rows a program, 16 warps at 128 registers: consumers 160-168, the loader 24) gives the warp
schedulers a third chain to switch to. Variants are rendered from templates/gluon_forward.py.j2 with
another launch shape (the `consumers` key of the pass's attribute), not edited by hand. Prediction:
+3-8% at d=64; at d=128 a 160-register consumer spills and loses.
Cases: bf16, batch 16384/N, hidden 2048; each variant's output checked against the adopted shape's
(poisoned with NaN first); the Triton kernel and SDPA's cuDNN backend in the same process.
Writes gluon_consumers.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

THREE = {"consumers": 3, "BLOCK_M": 192, "maxnreg": 128, "consumer_regs": 160}
VARIANTS = {"base": {}, "c3": THREE, "c3n64": dict(THREE, BLOCK_N=64, STAGES=3)}
CASES = [(64, False, 2048), (64, False, 4096), (64, False, 16384), (64, True, 4096), (64, True, 16384),
         (128, False, 4096), (128, True, 16384)]


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    bench_gluon_variants(VARIANTS, CASES, os.path.join(sys.argv[1], "gluon_consumers.json"),
                         "Gluon forward, consumer warpgroups")
