"""Experiment: FlashAttention 3's warpgroup ping-pong in the Gluon forward (passes/warp_specialize.py).

    python benchmarks/experiments/gluon_pingpong.py OUT_DIR

In the adopted kernel the two consumer warpgroups run freely: both may issue their products at the
same moment and then both sit in the softmax while the tensor cores idle. With PINGPONG a pair of
mbarriers orders them (FA3's warp-scheduler barrier): a warpgroup waits for its turn, issues block
j's Q K^T and block j-1's P V, and hands the turn to the other, so one warpgroup's softmax runs
under the other's products. At d=64 a block's products take half as long as at d=128 for the same
softmax work, so the overlap matters most there. Variants are rendered from
templates/gluon_forward.py.j2 (the pass's attribute with PINGPONG set; also with 3 stages, which
gives the loader more room when the consumers are staggered). Prediction: d=64 +4-8% (to >= 1.15x
FlexAttention without a mask), d=128 +0-4%.
Cases: bf16, batch 16384/N, hidden 2048; outputs checked against the base's (poisoned with NaN first);
the Triton kernel, SDPA's cuDNN backend and compiled FlexAttention in the same process.
Writes gluon_pingpong.json; prints a table (TFLOP/s).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

# (TRIM, adopted later, lets warpgroups skip blocks, which PINGPONG's turns do not allow: off here)
VARIANTS = {"base": {}, "pp": {"PINGPONG": True, "TRIM": False}, "pp_s3": {"PINGPONG": True, "STAGES": 3, "TRIM": False}}
CASES = [(64, False, 4096), (64, False, 16384), (64, True, 4096), (64, True, 16384),
         (128, False, 4096), (128, False, 16384), (128, True, 4096), (128, True, 16384)]


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    bench_gluon_variants(VARIANTS, CASES, os.path.join(sys.argv[1], "gluon_pingpong.json"),
                         "Gluon forward, warpgroup ping-pong", flex=True)
