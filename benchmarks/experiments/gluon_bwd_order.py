"""Experiment: the order in which the one-kernel Gluon backward's programs visit their query blocks (ORDER).

    git apply benchmarks/experiments/gluon_bwd_order.patch    (the ORDER knob: template and sm_90 probe)
    python benchmarks/experiments/gluon_bwd_order.py OUT_DIR HEAD_DIM N [N ...] [--causal] [--no-checks]    (GPU)

Lost (NOTES.md v30): neither order beats the shipped one, with or without DQ_CLAIM; the patch is not applied.

ORDER 0 (shipped): every program of a (batch, K/V head), one per 128 keys, takes the (query head, query block)
pairs in ascending order, so without a mask they visit the same tile at the same time (in lockstep), and under a
causal mask program p starts at its diagonal, two blocks after program p - 1 (staggered).
ORDER 1 (rotated; without a mask only): program p of P takes its n steps in the order p * n / P, ..., n - 1, 0,
..., so a head's programs reach each tile n / P steps apart. Made for DQ_CLAIM (v29: causal d=128 only), which
without a mask lost 20-30% because the lockstep programs all wait for each tile's owner. Only where P < n;
deadlock-free then: an owner waits, between its claim and its announcement, only for its sibling warpgroup to pass
the previous step's wait for an announcement, so a cycle of waits steps one position back per program in the
cyclic order and needs n programs of one (batch, K/V head); with P >= n no rotation (the same order everywhere).
ORDER 2 (descending): each head's query blocks from the last down, the same order in every program, so under a
causal mask a head's programs visit their common tiles in lockstep (each stops at its own diagonal).

First run (H100, d=128, no mask; NOTES.md v30): ORDER 1 alone slowed the kernel 4-8% (366 -> 382 us at N=512,
620 -> 669 at 1024), and with DQ_CLAIM the claims still cost 11% of the kernel at 512: lost. Prediction for this
run: if lockstep itself is what made ORDER 0 faster (the programs' Q/dO loads and dQ reductions meeting the same
tiles in L2 at once), ORDER 2 without a mask is level with ORDER 0 (the same lockstep, the same index arithmetic
as ORDER 1) and under a causal mask gains 3-8% of the kernel from 2048 keys, where DQ_CLAIM is off (and at 512-1024
against ORDER 0 without claims); if it was ORDER 1's arithmetic, ORDER 2 loses a few % everywhere.

Variants without a mask: base (shipped), rot (ORDER 1), desc (ORDER 2), claimrot (ORDER 1 with DQ_CLAIM). Causal:
base (shipped: DQ_CLAIM at d=128 up to 1024 keys), base0 (ORDER 0, no claims), desc (ORDER 2, no claims). Cases:
bf16, batch 16384/N, hidden 2048. Times as in gluon_dq_claim.py (torch.profiler GPU us of the call's kernels and
of the Gluon kernel, best of 4 rounds; whole call by do_bench beside Flex and cuDNN). Float64 checks of ORDER 1 and
of ORDER 2, both with DQ_CLAIM, on small odd GQA cases, rotated (P < n) and not (P >= n), all three masks, every
torch.empty of the module poisoned, each case twice. Writes gluon_bwd_order_d<HEAD_DIM>[_causal].json; prints a
table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]

from common import (BACKWARD_CHECK_CASES, PoisonedTorch, backward_checks, backward_rows,  # noqa: E402
                    gluon_variant_module, print_backward_rows)

CASES = BACKWARD_CHECK_CASES + ((2, 4, 2, 333, 150), (1, 2, 2, 1000, 300), (2, 2, 2, 100, 1000), (2, 8, 2, 1100, None))
"""The shared cases (rotated without a mask: P < n) and more: fewer keys than queries, more programs than steps
(2, 2, 2, 100, 1000: not rotated), a longer one."""

VARIANTS = {"base": {}, "rot": {"order": 1}, "desc": {"order": 2}, "claimrot": {"dq_claim_keys": 1 << 30, "order": 1}}
CAUSAL_VARIANTS = {"base": {}, "base0": {"dq_claim_keys": 0}, "desc": {"dq_claim_keys": 0, "order": 2}}
CHECKED = {"claimrot": {"dq_claim_keys": 1 << 30, "order": 1}, "claimdesc": {"dq_claim_keys": 1 << 30, "order": 2}}


def main() -> int:
    import torch

    out_dir, d = ARGS[0], int(ARGS[1])
    causal = "--causal" in sys.argv
    os.makedirs(out_dir, exist_ok=True)

    checks = []
    for name, shape in ({} if "--no-checks" in sys.argv else CHECKED).items():
        def poisoned(spec, name=name, shape=shape):
            m = gluon_variant_module(spec, name, dict(shape, min_scores=0, min_keys=0), "bwd_order",
                                     attr="warp_specialized_bwd")
            m.torch = PoisonedTorch(torch)
            return m

        checks += backward_checks(poisoned, d, cases=CASES, reps=2, variant=name)
    result = {"device": torch.cuda.get_device_name(), "checks": checks, "rows": []}
    variants = CAUSAL_VARIANTS if causal else VARIANTS

    def make_mods(spec) -> dict:
        return {x: gluon_variant_module(spec, x, shape, "bwd_order", attr="warp_specialized_bwd")
                for x, shape in variants.items()}

    backward_rows(result, os.path.join(out_dir, f"gluon_bwd_order_d{d}{'_causal' if causal else ''}.json"), d,
                  [int(a) for a in ARGS[2:]], make_mods, "base", masks=(causal,))
    print(f"\n{result['device']} d={d}, {'causal' if causal else 'no mask'}: " + " / ".join(variants) + ". GPU us "
          "(prep + kernel + dQ pass) and the kernel's, best of 4 profiler rounds; whole call TFLOP/s, best of 3 do_bench "
          "rounds")
    print_backward_rows(result, list(variants), "poisoned empties, each case twice")
    return 0

if __name__ == "__main__":
    sys.exit(main())
