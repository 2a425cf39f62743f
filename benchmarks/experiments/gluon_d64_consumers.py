"""Experiment: the d=64 Gluon forward with two consumer warpgroups (128-row tiles) instead of three (192), on the
persistent grid with BALANCE, at every bench length (v30).

    python benchmarks/experiments/gluon_d64_consumers.py OUT_DIR [--stages]    (GPU)

d=64 takes three consumer warpgroups (FlashAttention 3's shape, v12: +7% at 4096-16384 before the persistent
grid). The rows still furthest below cuDNN are d=64 causal at N=512-2048 (0.79-0.90x), which run the Triton
kernel: the three-consumer Gluon kernel lost there (H100, v26: 213 / 305 TFLOP/s at 1024 / 2048 against the
Triton kernel's 281 / 345). v22 measured two consumers on the persistent grid (H200, before BALANCE): causal 2048
374 against the Triton kernel's 349 and the three-consumer 293 (cuDNN 391), 4096 419 against 414; without a
mask 512 379 against 318 (Triton 345). If two consumers stay within ~1-2% of three at 8192-16384 (where v12's
+7% was measured on one program per tile), the causal d=64 spec could take them at every length and run the
Gluon kernel from 2048 keys, a shape-table change rather than a second kernel in the module.

Prediction (H100): causal two consumers +15-25% over three at 1024-2048 and above the Triton kernel at 2048
(+5-8%), level at 4096, -2 to -5% at 8192-16384; without a mask, two consumers ahead at 512-1024, behind from 4096.

Variants: base (shipped shape: three consumers), c2 (two consumers of 64 rows, 240 registers, maxnreg 168, as at
d=128); the Triton kernel at its tuned config and SDPA's cuDNN in the same process. bf16, batch 16384/N, hidden
2048; each variant's output (poisoned with NaN first) checked against the base's. Writes gluon_d64_consumers.json;
prints a table (TFLOP/s).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

C2 = {"consumers": 2, "BLOCK_M": 128, "maxnreg": 168, "consumer_regs": 240}
VARIANTS = {"base": {}, "c2": C2}
CASES = ([(64, True, n) for n in (1024, 2048, 4096, 8192, 16384)]
         + [(64, False, n) for n in (512, 1024, 4096, 16384)])
STAGE_VARIANTS = {"c2": dict(C2, short_keys=0), "c2s3": dict(C2, STAGES=3, short_keys=0),
                  "c2s4": dict(C2, STAGES=4, short_keys=0)}
"""--stages (after the change: two consumers are the shipped short shape): its K/V ring in 2 (shipped), 3 or 4 stages,
at every length (short_keys 0: one shape). Prediction: a deeper ring hides more of each tile's start at 1024-2048,
+2-4%, and might take causal 1024 past the Triton kernel; level from 4096."""
STAGE_CASES = [(64, True, n) for n in (1024, 2048, 4096)] + [(64, False, n) for n in (512, 1024)]


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    if "--stages" in sys.argv:
        bench_gluon_variants(STAGE_VARIANTS, STAGE_CASES, os.path.join(sys.argv[1], "gluon_d64_consumers_stages.json"),
                             "Gluon forward (persistent), d=64, two consumer warpgroups: 2 / 3 / 4 stages")
    else:
        bench_gluon_variants(VARIANTS, CASES, os.path.join(sys.argv[1], "gluon_d64_consumers.json"),
                             "Gluon forward (persistent), d=64: three consumer warpgroups (base) / two (c2)")
