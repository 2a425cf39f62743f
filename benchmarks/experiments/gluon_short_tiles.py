"""Experiment: the persistent Gluon forward's tile shape for short sequences (passes/warp_specialize.py,
SHORT_KEYS; v22).

    python benchmarks/experiments/gluon_short_tiles.py OUT_DIR

With the persistent grid (NOTES.md v22) the short rows still trail cuDNN where a tile holds few key
blocks: causal d=128 at N=512 (245 TFLOP/s against 336) and 1024, and at d=64 the Triton kernel still runs
below 1024 keys without a mask and 4096 causal. Two shapes that fit short tiles better: 64-key blocks (a
causal tile's diagonal block wastes half as much, and a 4-block tile becomes 8 steps that the pipeline
can overlap) in 3 or 4 stages, and at d=64 two consumer warpgroups (128-row tiles: half again as many
tiles, so pairs and rounds fill the machine better). Prediction: causal d=128 at 512-1024 +10-20% with
64-key blocks; d=64 at 512-2048 two consumers above the Triton kernel; long rows unchanged or worse (v9).
Cases: bf16, batch 16384/N, hidden 2048; outputs (poisoned with NaN) checked against the base's; the
Triton kernel and SDPA's cuDNN backend in the same process. Writes gluon_short_tiles.json; prints a
table (TFLOP/s). Every variant keeps one shape at every length (short_keys 0).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

C2 = {"consumers": 2, "BLOCK_M": 128, "maxnreg": 168, "consumer_regs": 240}
VARIANTS = {"base": {"short_keys": 0}, "n64": {"BLOCK_N": 64, "STAGES": 3, "short_keys": 0},
            "n64s4": {"BLOCK_N": 64, "STAGES": 4, "short_keys": 0}, "c2": dict(C2, short_keys=0),
            "c2n64": dict(C2, BLOCK_N=64, STAGES=3, short_keys=0)}
CASES = ([(128, True, n) for n in (512, 1024, 2048, 4096)] + [(128, False, n) for n in (512, 1024)]
         + [(64, False, n) for n in (512, 1024, 2048)] + [(64, True, n) for n in (512, 1024, 2048, 4096)])


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    bench_gluon_variants(VARIANTS, CASES, os.path.join(sys.argv[1], "gluon_short_tiles.json"),
                         "Gluon forward (persistent), tile shapes for short sequences")
