"""Experiment: the one-kernel Gluon backward zeroes its own float32 dQ accumulator (ZERO_DQ).

    git worktree add /tmp/zero_dq fb6548e && cd /tmp/zero_dq    # the tree the patch was made against
    git apply <this tree>/benchmarks/experiments/gluon_zero_dq.patch
    cp <this tree>/benchmarks/experiments/{gluon_zero_dq.py,common.py} benchmarks/experiments/
    python benchmarks/experiments/gluon_zero_dq.py OUT_DIR HEAD_DIM N [N ...] [--inloop=TEMPLATE]
    (GPU; --inloop: also a module rendered from another gluon_backward.py.j2, here the patched template with the
    `_ws_bwd_dq_zeroed` call moved from before the step loop to `if t == 0:` after the loop's `tma.store_wait(0)`,
    plus a call after the loop for a zeroing program without query blocks: the wait at a warpgroup's first
    reduction instead of before its first step)

The backward is three launches: the prep pass (lse and delta rows, and zeros over the float32 dQ accumulator),
the Gluon kernel (dK, dV, and dQ added into the accumulator by TMA reductions), the dQ pass (accumulator -> dQ
in the inputs' dtype). At N=512 the two passes are ~160 us of the H100's ~540 us of GPU work (NOTES v25), and
the prep pass's zeros are half of its bytes: 4 bytes per element of dQ written to DRAM, which the kernel's
first reduction into each line reads back. With ZERO_DQ the first program of each (batch, K/V head) to start
(a ticket per consumer warpgroup, from int32 counters the prep pass zeroes) stores zeros over its columns of the
group's rows by TMA from shared memory while its K and V load; full-line stores allocate in L2 without a DRAM
read, and the reductions of the (batch, K/V head)'s other programs, which run at the same time, find the lines
there. The zeroing warpgroup waits for its stores to complete and announces them (+2^16 on its counter,
release); the others wait for that (acquire) before their first step. One program zeroes all of a head's rows,
which does not scale to long sequences: the launch takes it up to `zero_dq_rows` rows per K/V head.

Prediction (H100, d=128, N=512): prep pass 93 -> ~50 us, the kernel -0 to -15 us (no DRAM read behind the first
reductions, a wait of ~1-2 us at the start of 3 programs in 4): the whole call +6-10%, which would lift the
1.07x / 1.02x Flex rows past 1.1x; N=1024 +3-5%; from 4096 level or worse (the one zeroing program's serial
stores).

Variants: base (zero_dq_rows 0: the shipped path), pre (on: the wait before the first step), and with --inloop
the other template (on). Cases: bf16, batch 16384/N, hidden 2048. Times: every attn_bwd* kernel of a call by
torch.profiler ("gpu us": prep + kernel + dQ pass; "kernel us": the Gluon kernel), 4 alternating rounds; the
whole `module.backward` call by do_bench in alternating rounds beside FlexAttention's backward (compiled) and SDPA
cuDNN's. Float64 checks of the ZERO_DQ variants on small odd GQA cases, all three masks, with every torch.empty
of the generated module poisoned (NaN, int32 -1), so that an accumulator row left unzeroed or a counter not
reset shows; each case runs twice (the counters of the second call start from the prep pass again). Writes
gluon_zero_dq_d<HEAD_DIM>.json; prints a table.

Result (H100, d=128, NOTES v28, results/h100_gluon_zero_dq_d128_v28.json): lost everywhere. GPU us of the three
kernels (base / pre / inloop): full 512 538 / 581 / 692, 1024 808 / 923 / 1107, 4096 2499 / 2704 / 3442; causal 512
479 / 487 / 597, 1024 598 / 696 / 891, 4096 1508 / 1874 / 2511. The prep pass saves 30 us; one SM storing a head's
zeros while its other programs wait costs the kernel more (pre); inloop's extra 136 bytes of spills cost +29% even
where its waits are hidden. Float64 checks: 36 of 36 pass.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
INLOOP = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--inloop=")), None)

from common import (PoisonedTorch, backward_checks, backward_rows, gluon_variant_module, print_backward_rows,  # noqa: E402
                    template_module)


def main() -> int:
    import torch

    out_dir, d = ARGS[0], int(ARGS[1])
    os.makedirs(out_dir, exist_ok=True)
    makers = {"pre": lambda spec, shape: gluon_variant_module(spec, "pre", shape, "zero_dq", attr="warp_specialized_bwd")}
    if INLOOP:
        makers["inloop"] = lambda spec, shape: template_module(spec, "inloop", INLOOP, shape, "zero_dq")

    def poisoned(make):  # the variant on every check shape, its module's torch.empty poisoned
        def module(spec):
            m = make(spec, {"zero_dq_rows": 1 << 30, "min_scores": 0, "min_keys": 0})
            m.torch = PoisonedTorch(torch)
            return m
        return module

    checks = [row for name, make in makers.items() for row in backward_checks(poisoned(make), d, reps=2, variant=name)]
    result = {"device": torch.cuda.get_device_name(), "inloop": INLOOP, "checks": checks, "rows": []}

    def make_mods(spec) -> dict:
        mods = {"base": gluon_variant_module(spec, "base", {"zero_dq_rows": 0}, "zero_dq", attr="warp_specialized_bwd")}
        mods.update({x: make(spec, {"zero_dq_rows": 1 << 30}) for x, make in makers.items()})
        return mods

    backward_rows(result, os.path.join(out_dir, f"gluon_zero_dq_d{d}.json"), d, [int(a) for a in ARGS[2:]], make_mods,
                  "base")
    names = ["base"] + list(makers)
    print(f"\n{result['device']} d={d}: the backward's dQ accumulator zeroed by the prep pass (base) / by the kernel "
          "(pre: waited for before the first step; inloop: at the first reduction). GPU us (prep + kernel + dQ pass) and "
          "the kernel's, best of 4 profiler rounds; whole call TFLOP/s, best of 3 do_bench rounds")
    print_backward_rows(result, names, "poisoned empties, each case twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
