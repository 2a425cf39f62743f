"""Experiment: the one-kernel Gluon backward on a persistent grid (PERSISTENT in the backward's shape).

    git apply benchmarks/experiments/gluon_bwd_persistent.patch   # (first copy templates/gluon_backward.py.j2
    python benchmarks/experiments/gluon_bwd_persistent.py OUT_DIR HEAD_DIM N [N ...] [--old=TEMPLATE]  # for --old)
    (GPU; --old: also a module rendered from an older gluon_backward.py.j2, here the shipped one, to check that
    the patched template's non-persistent form has not moved)

Until now each program of the backward took one tile (128 keys of one (batch, K/V head)) and exited: the
next program on that SM then initialised its barriers, loaded K and V and its first Q and dO blocks, and
its consumers waited for all of them before the first product; at the end each consumer stored dK and
dV through its K and V buffers and waited for the stores. At N=512 a tile is 8 query steps (causal 2-8),
so that start and drain are a large share: NOTES v25 measured the H100's d=128 N=512 rows at 1.02x
(causal) and 1.07x Flex, short of the 1.1x target. With PERSISTENT the grid has one program per SM (or per
unit of work); a program takes tiles in rounds (causal: the k-th key block of a head with the
(n_kb-1-k)-th, so that programs finish together); the loader loads a tile's first STAGES query steps
while the last tile drains and its K and V once the last tile's dK and dV have left the buffers (an
mbarrier, kv_free). Prediction: kernel -5 to -15% at N=512 (more causal), -2 to -5% at 1024, within 1%
from 4096 (ptxas: spills at d=128 184 -> 212 bytes without a mask, 244 -> 308 causal; d=64 none).

Variants: old (--old: the template before), np (this template, PERSISTENT off), p (on), pall (on, with a
program per unit of work: the persistent code without the scheduling). Cases: bf16,
batch 16384/N, hidden 2048. Kernel times by torch.profiler (10 back-to-back calls, 4 alternating rounds),
the whole `module.backward` call by do_bench in alternating rounds beside FlexAttention's backward
(compiled) and SDPA cuDNN's. Float64 checks of p on small odd GQA cases on a grid of 3 programs (every
program several tiles), all three masks. Writes gluon_bwd_persistent_d<HEAD_DIM>.json; prints a table.

Result (H100, NOTES v27; results/h100_gluon_bwd_persistent_d128_v27.json (np / p, four lengths; its old column
failed on a bug of the script's, since fixed), h100_gluon_bwd_persistent_d128_run2_v27.json,
h100_gluon_bwd_persistent_d64_v27.json and h100_gluon_bwd_persistent_d64_run2_v27.json (all four variants)).
Float64 checks of p on 3 programs: all 24 pass (6 a run).
Kernel us, old / np / p / pall:
  d=128 full 512 377 / 389 / 433 / 425, 16384 9471 / 9613 / 10181 / 9999; causal 512 320 / 326 / 393 / 387,
  16384 4787 / 4651 / 5986 / 5843 (first run, np / p: full 1024 +7%, 4096 +4.5%; causal 1024 and 4096 +22%).
  d=64 full 512 488 / 506 / 468 / 508, 4096 3100 / 3116 / 3121 / 3204; causal 512 349 / 357 / 353 / 366,
  4096 1634 / 1650 / 1683 / 1699 (h100_gluon_bwd_persistent_d64_run2_v27.json: 1024 and 2048, p within 1% of np,
  both 2-3% above old).
So at d=128 the persistent code itself (pall) costs 12-22% and the schedule adds nothing (p >= pall): the
consumers, already spilling at 240 registers, carry the tile loop's state across the step loop. At d=64 (no
spills) the schedule is worth -8% at N=512 without a mask (p against pall), but the restructured kernel's
one-tile path costs +2-4% against the shipped one (np, pall against old), leaving -4% (whole call 263 -> 271
TFLOP/s, Flex 235); level or worse elsewhere. Not adopted; the template change is kept as the patch.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OLD = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--old=")), None)

from common import (BACKWARD_CHECK_CASES, backward_checks, backward_rows, gluon_variant_module,  # noqa: E402
                    print_backward_checks, template_module)


def checked_module(spec):
    """The persistent variant (p) on a grid of 3 programs, every program several tiles."""
    m = gluon_variant_module(spec, "p", {"PERSISTENT": True, "min_scores": 0, "min_keys": 0}, "bwd_persistent",
                             attr="warp_specialized_bwd")
    m._ws_programs = lambda device: 3
    return m


def main() -> int:
    import torch

    out_dir, d = ARGS[0], int(ARGS[1])
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "old": OLD,
              "checks": backward_checks(checked_module, d, cases=BACKWARD_CHECK_CASES[:2]), "rows": []}

    def make_mods(spec) -> dict:
        mods = {x: gluon_variant_module(spec, x, {"PERSISTENT": x != "np"}, "bwd_persistent",
                                        attr="warp_specialized_bwd") for x in ("np", "p", "pall")}
        # pall: the persistent code with a program per unit of work (a tile; causal, a pair of tiles)
        mods["pall"]._ws_programs = lambda device: 1 << 30
        if OLD:
            mods["old"] = template_module(spec, "old", OLD, {}, "bwd_persistent")
        return mods

    backward_rows(result, os.path.join(out_dir, f"gluon_bwd_persistent_d{d}.json"), d, [int(a) for a in ARGS[2:]],
                  make_mods, "np")
    names = [x for x in ("old", "np", "p", "pall") if OLD or x != "old"]
    print(f"\n{result['device']} d={d}: one-kernel Gluon backward, persistent grid off (np) / on (p)"
          f"{' / the template before (old)' if OLD else ''}. Kernel: best of 4 profiler rounds (us); whole call "
          "TFLOP/s, best of 3 do_bench rounds")
    print(f"{'mask':>6} {'N':>6} " + " ".join(f"{x + ' us':>9}" for x in names) + f" {'p/np':>6}   "
          + " ".join(f"{x:>5}" for x in names + ["flex", "cudnn"]) + "  errs")
    for r in result["rows"]:
        ks = {x: min(r.get(f"{x} kernel us", [float("nan")])) for x in names}
        errs = " ".join(k_ for k_ in r if (k_.endswith("err") and r[k_] > 2e-2) or k_.endswith("error"))
        print(f"{'causal' if r['causal'] else 'full':>6} {r['n']:>6} " + " ".join(f"{ks[x]:9.1f}" for x in names)
              + f" {ks['p'] / ks['np']:6.3f}   " + " ".join(f"{r.get(x, float('nan')):5.0f}" for x in names + ["flex", "cudnn"])
              + f"  {errs}")
    print_backward_checks(result["checks"], "p, 3 programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
