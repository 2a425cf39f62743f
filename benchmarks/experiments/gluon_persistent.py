"""Experiment: a persistent grid for the Gluon forward (passes/warp_specialize.py, PERSISTENT).

    python benchmarks/experiments/gluon_persistent.py OUT_DIR [--long]

(--long: the causal rows at N = 8192 and 16384 only, with N = 8192 without a mask.)

The Gluon forward runs one program per tile of 128 (d=128) or 192 (d=64) query rows. Each program pays
a fixed cost around its key loop: barrier set-up, the Q load and the first K/V blocks' latency before
the first product, the output's store after the last. At N=512 a tile has 4 key blocks, and the
bench's short rows trail cuDNN's persistent kernel (d=128 407 against 510 TFLOP/s, H200; a fit of the
N=512-16384 rows puts the fixed cost near two key blocks' time). With PERSISTENT the grid holds one
program per SM; a program takes tiles p, p + P, ... and its loader warp moves the next tile's Q (into a
second Q buffer) and first K/V blocks while the consumers finish this tile and store its output.
Prediction: N=512 +15-30%, 1024 +5-10%, 4096 and up +0-2%; causal alike or better (its short tiles
weigh more); d=64 at short N (where the Triton kernel now runs) close to or above the Triton kernel.
Cases: bf16, batch 16384/N, hidden 2048, causal and not; each variant's output (poisoned with NaN
first) checked against the base's; the Triton kernel and SDPA's cuDNN backend in the same process.
Writes gluon_persistent.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

VARIANTS = {"base": {"PERSISTENT": False}, "persistent": {"PERSISTENT": True}}
CASES = [(d, causal, n) for d in (128, 64) for causal in (False, True) for n in (512, 1024, 2048, 4096, 16384)]
LONG = [(d, causal, n) for d in (128, 64) for causal, n in ((True, 8192), (True, 16384), (False, 8192))]


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    long = "--long" in sys.argv
    bench_gluon_variants(VARIANTS, LONG if long else CASES,
                         os.path.join(sys.argv[1], f"gluon_persistent{'_long' if long else ''}.json"),
                         "Gluon forward, one program per tile / a persistent grid")
