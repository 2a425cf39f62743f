"""Experiment: each consumer of the one-kernel Gluon backward makes dQ over its own keys (DQ_LOCAL).

    python benchmarks/experiments/gluon_dq_local.py OUT_DIR [HEAD_DIM [N ...]] [--key=NAME]
    (GPU; N: lengths other than CASES'; --key: A/B another boolean key of the backward's shape, off (l0) / on
    (l1), instead of DQ_LOCAL: `--key=P16` with gluon_bwd_p16.patch applied, NOTES v25)

(DQ_LOCAL: a constexpr of the kernel since v25, which the launch sets from `dq_local_rows` query rows on,
BWD_DQ_LOCAL_ROWS in passes/warp_specialize.py; both variants here are rendered from the template with that
threshold at 1 (l1) and 0 (l0).)

In the shipped kernel (NOTES v11) each consumer warpgroup writes its dS^T to shared memory and arrives on
an mbarrier; each then waits for the other's, and computes its HEAD_DIM / 2 columns of the step's
dQ = dS K over all 128 keys of the program. That wait ties the two warpgroups together at every step:
their softmax phases (exp2, dS, stores) fall at the same time and the tensor cores idle through them.
With DQ_LOCAL a warpgroup computes every column of dQ over its own 64 keys (dS^T from its own buffer, its
own K) and adds that partial sum into the float32 accumulator by its own TMA reduction: no wait on the
other warpgroup, the same products, twice the reduction traffic (each warpgroup reduces [64, HEAD_DIM]
float32 a step instead of [64, HEAD_DIM / 2]) and, at d=128, a [64, 128] float32 dQ accumulator in
registers instead of [64, 64] (ptxas on the CPU: spills 184 -> 240 bytes without a mask, 232 -> 260
causal; shared memory 198 -> 214 KB; d=64: no spills either way).
Prediction: d=64 +2-5% (its steps are short, so the wait is a larger share), d=128 within +-2%.
Cases: bf16, batch 16384/N, hidden 2048; l0 = shipped algorithm, l1 = DQ_LOCAL, whole `module.backward`
(row passes included); kernel times by torch.profiler (10 back-to-back calls, 4 alternating rounds) and
do_bench of the whole call beside SDPA cuDNN's backward (torch.autograd.grad) in alternating rounds;
gradients of l1 against l0's, and on small odd GQA cases (both causal alignments, N_Q != N_K) against float64.
Writes gluon_<key>.json (gluon_dq_local_rows.json for DQ_LOCAL); prints a table.
Result (H200; results/h200_gluon_dq_local_v24.json, all cases, and h200_gluon_dq_local_d64_v24.json, d=64 again
on the same machine): float64 checks pass (dQ, dK, dV 0.0023-0.0025 for every mask). d=64 without a mask:
the kernel 5-10% faster (1024 878 -> 830 us, 4096 3224 -> 2913, 16384 12591 -> 11936), the whole call
343 -> 343-349, 407-411 -> 418-423, 426-433 -> 437-445 TFLOP/s (cuDNN 358-373, 422-432, 444-454). d=64
causal: the kernel 0.5-3% faster but the whole call 0-3% slower in both runs (the profiler's calls run
back to back; do_bench flushes the cache before each). d=128: 23-30% slower (kernel and call). Adopted
for d=64 without a mask only (BWD_DQ_LOCAL).
v25 (`gluon_dq_local.py OUT 64 512 1024`): at N=512 without a mask the kernel 5.4% slower on the H100 (491 ->
518 us; call 262 -> 250 TFLOP/s, Flex 235) and level on the H200 (496 -> 497); at 1024 2% / 5.3% faster. So it
runs from 1024 query rows on (BWD_DQ_LOCAL_ROWS).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
KEY = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--key=")), "dq_local_rows")
ON, OFF = (1, 0) if KEY == "dq_local_rows" else (True, False)

from common import (BACKWARD_CHECK_CASES, backward_checks, backward_variants_row, gluon_variant_module,  # noqa: E402
                    print_backward_checks)

CASES = [(64, c, n) for c in (False, True) for n in (1024, 4096, 16384)] + \
        [(128, c, n) for c in (False, True) for n in (4096, 16384)]


def float64_checks() -> list:
    """KEY on, at each head dim asked for, on the first of the common check cases, all three masks."""
    def make(spec):
        return gluon_variant_module(spec, "l1", {KEY: ON, "min_scores": 0, "min_keys": 0}, "dq_local",
                                    attr="warp_specialized_bwd")
    return [row for d in (64, 128) if len(ARGS) < 2 or d == int(ARGS[1])
            for row in backward_checks(make, d, cases=BACKWARD_CHECK_CASES[:1])]


def main() -> int:
    import torch

    import attngen
    from attngen.api import sdpa_spec

    out_dir = ARGS[0]
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "key": KEY, "checks": float64_checks(), "rows": []}
    lengths = [int(a) for a in ARGS[2:]]
    cases = [(int(ARGS[1]), c, n) for c in (False, True) for n in lengths] if lengths else CASES
    for d, causal, n in [c for c in cases if len(ARGS) < 2 or c[0] == int(ARGS[1])]:
        spec = attngen.load(sdpa_spec("bf16", d, causal)).spec
        mods = {x: gluon_variant_module(spec, x, {KEY: ON if x == "l1" else OFF}, "dq_local", attr="warp_specialized_bwd")
                for x in ("l0", "l1")}
        row = backward_variants_row(mods, "l0", d, causal, n)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if "rounds" not in k}), flush=True)
        with open(os.path.join(out_dir, f"gluon_{KEY.lower()}.json"), "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n{result['device']}: one-kernel Gluon backward, {KEY} off (l0) / on (l1). Kernel: the Gluon kernel "
          "alone, best of 4 profiler rounds (us); whole call TFLOP/s, best of 3 do_bench rounds")
    print(f"{'d':>4} {'mask':>6} {'N':>6} {'l0 us':>9} {'l1 us':>9} {'l1/l0':>6}   {'l0':>5} {'l1':>5} {'cudnn':>5}  errs")
    for r in result["rows"]:
        k0, k1 = (min(r.get(f"{x} kernel us", [float("nan")])) for x in ("l0", "l1"))
        errs = " ".join(k for k in r if (k.endswith("err") and r[k] > 2e-2) or k.endswith("error"))
        print(f"{r['head_dim']:>4} {'causal' if r['causal'] else 'full':>6} {r['n']:>6} {k0:9.1f} {k1:9.1f} {k1 / k0:6.3f}   "
              + " ".join(f"{r.get(x, float('nan')):5.0f}" for x in ("l0", "l1", "cudnn")) + f"  {errs}")
    print_backward_checks(result["checks"], f"{KEY} on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
