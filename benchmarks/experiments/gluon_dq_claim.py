"""Experiment: the one-kernel Gluon backward claims its dQ tiles (DQ_CLAIM) instead of the prep pass zeroing
the float32 dQ accumulator.

    python benchmarks/experiments/gluon_dq_claim.py OUT_DIR HEAD_DIM N [N ...] [--causal] [--no-checks]    (GPU;
    --causal: the causal rows only; --no-checks: no float64 checks)

The backward is three launches: the prep pass (lse and delta rows, zeros over the float32 dQ accumulator), the
Gluon kernel (dK, dV, and dQ added into the accumulator by TMA reductions), the dQ pass. At N=512 the prep pass
is ~90 us of the H100's ~480 us of causal d=128 GPU work, half of its bytes the accumulator's zeros, which the
kernel's first reduction into each line then reads back from DRAM. ZERO_DQ (v28) moved the zeroing into the
kernel and lost: one program zeroed a head while the others waited.

DQ_CLAIM removes the zeros instead. Each consumer warpgroup claims each step's dQ tile (its columns of a block
of 64 query rows) at the step's start: a compare-and-swap 0 -> its id on a word per tile (acquire; lane 0 of
each warp, so every warp of the warpgroup sees either 0 or its own id when it won), whose answer it reads at the
step's end. The winner stores its part by TMA (full lines: allocated in L2 without a DRAM read); in its next
step, after the S^T wait, it waits for that store to be written and sets the word's announced bit (release).
The others add their part by TMA reduction once the bit is set (seen in the swap's answer, or waited for).
No deadlock: an owner's announcement waits on no other program, and everything between its claim and its store
waits only on claims made earlier. The prep pass zeroes the claim words (8 bytes per 64 rows) and only the
accumulator rows no program visits (bottom-right causal with N_Q > N_K).

Prediction (H100, d=128, causal, N=512): prep pass 90 -> ~60 us; kernel -0 to -10 us (no zero lines read back;
the claims' latency hidden behind a step, waits rare under a causal mask, where a tile's first visitor is the
program on its diagonal at its first or second step and the others come two steps later or more): the whole call
+6-8%, 1.05x -> ~1.12x Flex. Without a mask every program of a head reaches a tile at once and waits a step for
its owner: a large loss (measured to confirm, not to ship).

Variants: base (DQ_CLAIM off: the prep pass zeroes) and claim (on), at the checkout's template. Cases: bf16, batch
16384/N, hidden 2048, without a mask and causal. Times: every attn_bwd* kernel of a call by torch.profiler ("gpu
us": prep + kernel + dQ pass; "kernel us": the Gluon kernel), 4 alternating rounds; the whole `module.backward`
call by do_bench beside FlexAttention's backward (compiled) and SDPA cuDNN's. Float64 checks of claim on small
odd GQA cases, all three masks, N_Q > N_K among them, with every torch.empty of the module poisoned (NaN, int32
-1), each case twice. Writes gluon_dq_claim_d<HEAD_DIM>.json; prints a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]

from common import (BACKWARD_CHECK_CASES, PoisonedTorch, backward_checks, backward_rows,  # noqa: E402
                    gluon_variant_module, print_backward_rows)

CASES = BACKWARD_CHECK_CASES + ((2, 4, 2, 333, 150), (1, 2, 2, 1000, 300), (2, 8, 2, 1100, None))
"""The shared cases and three more: more queries than keys (bottom-right: rows that see no key), and a longer one."""


def main() -> int:
    import torch

    out_dir, d = ARGS[0], int(ARGS[1])
    os.makedirs(out_dir, exist_ok=True)

    def poisoned(spec):
        m = gluon_variant_module(spec, "claim", {"dq_claim_keys": 1 << 30, "min_scores": 0, "min_keys": 0}, "dq_claim",
                                 attr="warp_specialized_bwd")
        m.torch = PoisonedTorch(torch)
        return m

    checks = [] if "--no-checks" in sys.argv else backward_checks(poisoned, d, cases=CASES, reps=2, variant="claim")
    result = {"device": torch.cuda.get_device_name(), "checks": checks, "rows": []}

    def make_mods(spec) -> dict:
        return {x: gluon_variant_module(spec, x, {"dq_claim_keys": (1 << 30) * (x == "claim")}, "dq_claim", attr="warp_specialized_bwd")
                for x in ("base", "claim")}

    backward_rows(result, os.path.join(out_dir, f"gluon_dq_claim_d{d}.json"), d, [int(a) for a in ARGS[2:]], make_mods,
                  "base", masks=(True,) if "--causal" in sys.argv else (False, True))
    print(f"\n{result['device']} d={d}: the backward's dQ accumulator zeroed by the prep pass (base) / its tiles claimed "
          "(claim). GPU us (prep + kernel + dQ pass) and the kernel's, best of 4 profiler rounds; whole call TFLOP/s, "
          "best of 3 do_bench rounds")
    print_backward_rows(result, ["base", "claim"], "poisoned empties, each case twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
