"""Experiment: P carried in the Gluon forward as the P V product's bf16 operand (EARLY_P), and three
consumer warpgroups with it.

    python benchmarks/experiments/gluon_early_p.py OUT_DIR

Three consumer warpgroups (192 query rows, FlashAttention 3's d=64 shape) lost at d=64 (NOTES.md
v11... v9: 172-181 TFLOP/s) because each 160-register consumer spilled 1.7 KB: the softmax's P was
carried across the loop in float32 (64 registers a thread at 128-key blocks) and converted to bf16
only at the P V product. EARLY_P converts it right after the softmax, so the loop carries 32
registers of P; an sm_90 compile (ptxas -v) takes the three-consumer kernel's spills from 1684 to 248
bytes, and the two-consumer kernel is unchanged (168 registers, no spill). Prediction: d=64 with
three consumers +3-8% over the two-consumer kernel (FA3's reason for 192 rows: each K/V block feeds
half again as many rows); no change for two consumers; d=128 keeps two consumers.
Second run, after adopting both: CAUSAL_TRIM (now the causal half of TRIM). With 192-row programs and 128-key blocks a causal
program's first warpgroups reach past their own diagonal (rows 0-63 of a program at 0 see block 0
only; the program reads blocks 0 and 1). Trimmed, a consumer stops at its own last block and releases
the rest unread, in order (wait for each buffer's ready barrier, arrive on its empty one). Predicted
+2-4% causal at d=64 (about 1.5 of each program's 3 x n_blocks warpgroup-blocks at N=4096), nothing
without a mask or at d=128 (blocks and 64-row warpgroups meet at the same 128-key boundaries there).
Third run: TRIM, which also lets a warpgroup whose rows all lie past N_Q (the last row block of a
sequence: 4096 = 21.3 x 192 rows) release every block unread instead of computing on TMA's zero rows.
Predicted +1-2% at d=64 without a mask at 4096 (one program in 22 a third full), less at 8192-16384,
nothing at d=128 (128-row programs divide these lengths).
Variants, from the adopted shape (`adopted`: three consumers at d=64, EARLY_P, TRIM):
  notrim   the same without TRIM
  v11      two consumers, P in float32, no trim (the shape before)
  early    two consumers, EARLY_P
  c3early  three consumers, EARLY_P, no trim (the first run's winner; as notrim at d=64)
Cases: bf16, batch 16384/N, hidden 2048, against the adopted shape's output (poisoned first), the
Triton kernel, cuDNN and FlexAttention in the same process. Writes gluon_early_p_rows.json (the third run).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_gluon_variants  # noqa: E402

TWO = {"consumers": 2, "BLOCK_M": 128, "maxnreg": 168, "consumer_regs": 240}
THREE = {"consumers": 3, "BLOCK_M": 192, "maxnreg": 128, "consumer_regs": 160}
VARIANTS = {"adopted": {}, "notrim": {"TRIM": False}}
CASES = [(64, False, 4096), (64, False, 8192), (64, False, 16384), (64, True, 4096), (128, False, 4096)]
# The second run (results/h200_gluon_early_p_trim_v12.json, when the trim was causal only) compared
# adopted, v11 = dict(TWO, EARLY_P=False), early = dict(TWO, EARLY_P=True) and c3early = dict(THREE,
# EARLY_P=True), the three without the trim, on d=64 full 4096/16384, causal 4096/8192/16384 and d=128
# full 4096, causal 4096/16384.
# The first run (before adoption; results/h200_gluon_early_p_v12.json) compared base (two consumers, P
# in float32), early, c3early and c3n64early (three consumers, 64-key blocks, 3 stages) on d=64 full
# 2048/4096/16384, causal 4096/16384 and d=128 full 4096, causal 16384.


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    bench_gluon_variants(VARIANTS, CASES, os.path.join(sys.argv[1], "gluon_early_p_rows.json"),
                         "Gluon forward: TRIM (rows past N_Q, causal diagonal)", flex=True)
