"""Experiment: the one-kernel Gluon backward as rendered from other versions of its template, against this one.

    python benchmarks/experiments/gluon_bwd_templates.py OUT_DIR HEAD_DIM N [N ...] --tpl=NAME=PATH [--tpl=...] [--causal]
    (GPU; each --tpl: a variant rendered from the gluon_backward.py.j2 at PATH, e.g. `git show
    <commit>:templates/gluon_backward.py.j2 > old.j2`; "new" is the checkout's template; --causal: causal rows only)

Cases: bf16, batch 16384/N, hidden 2048, without a mask and causal. Each variant's gradients against new's
(relative error); times of every attn_bwd* kernel of a call by torch.profiler ("gpu us": prep + kernel + dQ pass;
"kernel us": the Gluon kernel), 4 alternating rounds; the whole `module.backward` call by do_bench in alternating
rounds beside FlexAttention's backward (compiled) and SDPA cuDNN's. Float64 checks of new on small odd GQA cases
(all three masks; dQ, dK and dV poisoned with NaN first). Writes gluon_bwd_templates_d<HEAD_DIM>.json; prints a
table.

First use, NOTES v28: LATE_ROWS (a step's lse and delta read from shared memory where they are used, not before
the step's waits; predicted d=128 kernel -3 to -8%, d=64 level). Results (results/h100_gluon_bwd_templates_d128_v28.json,
h100_..._d64_v28.json, h200_..._d128_v28.json; old: fb6548e's template, late: LATE_ROWS 1, new: 2), kernel time
against old: H100 d=128 full late -3.0 to -4.4%, new -2.0 to -4.3%; causal late -3.7 to -7.1%, new -5.0 to -8.7%;
d=64 late +1-7%, new +1-12%; H200 d=128 new -4.1 to -5.3% full, -8.3 to -13.7% causal. Float64 checks 9 of 9 each run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
TEMPLATES = dict(a.split("=", 2)[1:] for a in sys.argv[1:] if a.startswith("--tpl="))

from common import backward_checks, backward_rows, gluon_variant_module, print_backward_rows, template_module  # noqa: E402


def main() -> int:
    import torch

    out_dir, d = ARGS[0], int(ARGS[1])
    os.makedirs(out_dir, exist_ok=True)
    checks = backward_checks(lambda spec: gluon_variant_module(spec, "new", {"min_scores": 0, "min_keys": 0},
                                                               "bwd_templates", attr="warp_specialized_bwd"), d)
    result = {"device": torch.cuda.get_device_name(), "templates": TEMPLATES, "checks": checks, "rows": []}

    def make_mods(spec) -> dict:
        mods = {"new": gluon_variant_module(spec, "new", {}, "bwd_templates", attr="warp_specialized_bwd")}
        mods.update({x: template_module(spec, x, p, {}, "bwd_templates") for x, p in TEMPLATES.items()})
        return mods

    backward_rows(result, os.path.join(out_dir, f"gluon_bwd_templates_d{d}.json"), d, [int(a) for a in ARGS[2:]],
                  make_mods, "new", masks=(True,) if "--causal" in sys.argv else (False, True))
    names = list(TEMPLATES) + ["new"]
    print(f"\n{result['device']} d={d}: the one-kernel Gluon backward from other templates ({', '.join(TEMPLATES)}) "
          "and this one (new). GPU us (prep + kernel + dQ pass), the kernel's, best of 4 profiler rounds; whole call "
          "TFLOP/s, best of 3 do_bench rounds")
    print_backward_rows(result, names, "new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
