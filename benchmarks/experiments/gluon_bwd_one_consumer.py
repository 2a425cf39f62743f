"""Experiment: the d=64 one-kernel Gluon backward with one consumer warpgroup of 64 keys a program, two programs a
multiprocessor (v38).

    python benchmarks/experiments/gluon_bwd_one_consumer.py OUT_DIR N [N ...] [--no-checks | --shipped | --bench-order]    (GPU)

v36 left the d=64 backward without a mask 2-5% under cuDNN, all of it in the main kernel, and found the gap
proportional to the number of programs (no wave steps): a fixed cost per program, its start (K, V, the first Q and
dO) and drain (dK, dV stored). The shipped kernel holds 128 keys in two consumer warpgroups plus a loader warp
padded to a warpgroup, 12 warps x 168 registers: the whole register file, one program a multiprocessor, so nothing
runs through a program's start and drain (v27's persistent grid, which overlapped them inside one program, lost).
cuDNN's kernel here is `..._bprop_wgmma_f16_knob_26_64x64x64_1x4x1`: 64-key programs of one warpgroup.
The variant c1 renders the same template with one consumer of 64 keys (BLOCK_N 64), maxnreg 128 (8 warps x 128 x 2
programs = the register file; the consumer 232, the loader 24): ptxas on the CPU gives 128 registers and no spills,
and 100 KB of shared memory at 3 stages (83 KB at 2), so two programs fit a multiprocessor and one's start and drain
run beside the other's steps. The price: each Q, dO, lse and delta block streamed feeds 64 keys, not 128 (twice the
L2 reads of them per product). c1s is c1 with the other stage count (3 causal, 2 without a mask).
Prediction: the Gluon kernel -2 to -6% at N = 1024-4096 without a mask, level at 16384; causal -0 to -4%.
Float64 checks (all masks, GQA, odd lengths, outputs poisoned) of c1 come first. Writes
gluon_bwd_one_consumer.json; prints a table.
Result (H200, results/h200_gluon_bwd_one_consumer_v38.json and _run2; kernel by profiler / whole call by do_bench,
c1s against base): causal -11% / +10% at N=512 (184 -> 202 TFLOP/s, cuDNN 171), -9% / +5% at 1024, -7% / +1% at
2048, -5% / -2% at 4096, -2% / -4% at 8192, +2% / -6% at 16384; without a mask -2% / +2% at 512, level at 1024, +4
to +10% slower kernel from 2048 (twice the Q and dO reads). Adopted as the causal d=64 backward's shape up to 2048
keys (BWD_SHORT_KEYS, BWD_SHORT_SHAPE in passes/warp_specialize.py). --shipped and --bench-order then measured the
shipped module (results/h200_gluon_bwd_one_consumer_shipped_v38.json, _bench_order_v38.json): see NOTES.md v38.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]

from common import (PoisonedTorch, backward_checks, backward_rows, gluon_variant_module,  # noqa: E402
                    print_backward_rows)

ONE = {"consumers": 1, "BLOCK_N": 64, "maxnreg": 128, "consumer_regs": 232}
NAMES = ["base", "c1", "c1s"]


def shapes(causal: bool) -> dict:
    """Each variant's changes to the shipped backward shape at d=64 (3 stages without a mask, 2 causal)."""
    return {"base": {}, "c1": ONE, "c1s": dict(ONE, STAGES=3 if causal else 2)}


def shipped_ab(out_dir: str, lengths) -> int:
    """--shipped (after the change): the causal d=64 spec's backward as shipped, three ways in alternating do_bench
    rounds (best of 4): `module.backward` with the short shape taken (short_keys as shipped: "short") and not
    (short_keys 0: "main"), and the bench's own call ("bench": `attngen.attention` then torch.autograd.grad, whose
    launches replay); SDPA cuDNN's backward beside. Gradients of short and bench against main's."""
    import json

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops

    kernel = attngen.load(sdpa_spec("bf16", 64, True))
    shape, shipped = kernel.module.WS_BWD_SHAPE, kernel.module.WS_BWD_SHAPE["short_keys"]
    rows = []
    for n in lengths:
        b, h, scale = 16384 // n, 32, 64 ** -0.5
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (torch.randn(b, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = kernel.module.forward(q, k, v, scale)
        bench_out = attngen.attention(qg, kg, vg, is_causal=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        fns = {"short": lambda: kernel.module.backward(q, k, v, out, lse, do, scale),
               "main": lambda: kernel.module.backward(q, k, v, out, lse, do, scale),
               "bench": lambda: torch.autograd.grad(bench_out, (qg, kg, vg), do, retain_graph=True),
               "cudnn": lambda: torch.autograd.grad(ref, (qg, kg, vg), do, retain_graph=True)}
        grads, ms = {}, {}
        for rnd in range(4):
            for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                shape["short_keys"] = 0 if name == "main" else shipped
                grads.setdefault(name, fns[name]())
                ms.setdefault(name, []).append(triton.testing.do_bench(fns[name], warmup=25, rep=100,
                                                                       return_mode="median"))
        shape["short_keys"] = shipped
        flops = fa_flops(b, h, n, n, 64, True, backward=True)
        row = {"n": n, **{x: flops / min(t) / 1e9 for x, t in ms.items()},
               "rounds": {x: [flops / t_ / 1e9 for t_ in t] for x, t in ms.items()}}
        for x in ("short", "bench"):
            row[f"{x} vs main err"] = max(((a.float() - r.float()).norm() / r.float().norm()).item()
                                          for a, r in zip(grads[x], grads["main"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "gluon_bwd_one_consumer_shipped.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} causal d=64 backward, TFLOP/s (best of 4 alternating do_bench rounds): "
          f"module.backward with the short shape up to {shipped} keys (short) / never (main); attngen.attention + "
          "autograd as the bench calls it (bench)")
    print(f"{'N':>6} {'short':>7} {'main':>7} {'bench':>7} {'cudnn':>7}  errs (short, bench vs main)")
    for r in rows:
        print(f"{r['n']:>6} {r['short']:7.1f} {r['main']:7.1f} {r['bench']:7.1f} {r['cudnn']:7.1f}  "
              f"{r['short vs main err']:.1e} {r['bench vs main err']:.1e}")
    return 0


def bench_order(out_dir: str, lengths) -> int:
    """--bench-order: `attngen.bench.bench_prefill` itself (backward, d=64, attngen and SDPA cuDNN) three times in
    one fresh process: first use, again warm, and warm with the causal module's short shape off (short_keys 0,
    attngen.attention's plans cleared so that no replay recorded with the short shape serves it)."""
    import json

    import attngen
    from attngen import api
    from attngen.api import sdpa_spec
    from attngen.bench import bench_prefill

    shape = attngen.load(sdpa_spec("bf16", 64, True)).module.WS_BWD_SHAPE
    shipped, result = shape["short_keys"], {}
    for name in ("first", "warm", "main shape"):
        if name == "main shape":
            api._PLANS.clear()
            shape["short_keys"] = 0
        rows = bench_prefill(lengths, (64,), ("attngen", "sdpa_cudnn"), ("backward",), progress=lambda _: None)
        result[name] = [dict(r.params, provider=r.provider, tflops=r.tflops) for r in rows]
        print(name, [(r.params["causal"], r.params["seqlen"], r.provider, round(r.tflops or 0, 1)) for r in rows],
              flush=True)
    shape["short_keys"] = shipped
    with open(os.path.join(out_dir, "gluon_bwd_one_consumer_bench_order.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


def main() -> int:
    import torch

    out_dir = ARGS[0]
    os.makedirs(out_dir, exist_ok=True)
    if "--shipped" in sys.argv:
        return shipped_ab(out_dir, [int(a) for a in ARGS[1:]])
    if "--bench-order" in sys.argv:
        return bench_order(out_dir, [int(a) for a in ARGS[1:]])

    def poisoned(spec):
        m = gluon_variant_module(spec, "c1", dict(ONE, min_scores=0, min_keys=0), "bwd_c1", attr="warp_specialized_bwd")
        m.torch = PoisonedTorch(torch)
        return m

    checks = [] if "--no-checks" in sys.argv else backward_checks(poisoned, 64, variant="c1")
    result = {"device": torch.cuda.get_device_name(), "checks": checks, "rows": []}

    def make_mods(spec) -> dict:
        return {x: gluon_variant_module(spec, x, shape, "bwd_c1", attr="warp_specialized_bwd")
                for x, shape in shapes(spec.mask.name != "NONE").items()}

    backward_rows(result, os.path.join(out_dir, "gluon_bwd_one_consumer.json"), 64, [int(a) for a in ARGS[1:]],
                  make_mods, "base")
    print(f"\n{result['device']} d=64: the one-kernel backward, two consumers of 64 keys (base) / one, two programs a "
          "multiprocessor (c1) / one, other stage count (c1s). GPU us (prep + kernel + dQ pass) and the kernel's, "
          "best of 4 profiler rounds; whole call TFLOP/s, best of 3 do_bench rounds")
    print_backward_rows(result, NAMES, "c1, poisoned empties")
    return 0


if __name__ == "__main__":
    sys.exit(main())
