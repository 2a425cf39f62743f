"""Experiment: the backward at short sequences, where the H100 bench row fell behind FlexAttention.

    python benchmarks/experiments/backward_short.py OUT_DIR             (GPU)
    python benchmarks/experiments/backward_short.py OUT_DIR --profile   (GPU: where one call's time goes)

`attngen bench --suite prefill` on an H100 (NOTES v16) gave the d=128 causal backward at N=512 125
TFLOP/s against FlexAttention's 171 (0.73x), where the H200 gives 212 against 179; every other
backward row on the H100 is 1.06-1.47x Flex. Either the row is an outlier of that run or the Gluon
one-kernel backward (DQ_ATOMIC, chosen from 512 keys by BWD_MIN_KEYS on H200 timings) loses there on
an H100. This times, at N = 512 and 1024 (env LENGTHS, HEAD_DIMS, ROUNDS; batch 16384 / N, hidden 2048, bf16, both masks, d = 64 and
128), in alternating order, three rounds:
  attngen        attngen.attention's backward as the bench times it (autograd.grad, retained graph)
  attngen triton the same with the Gluon backward turned off (its readiness check made false): the
                 Triton dQ and dK/dV kernels at the tuned configs
  attngen split  torch.use_deterministic_algorithms(True): the Triton dQ kernel, then the Gluon dK/dV
                 kernel without DQ_ATOMIC (d=128; the Triton kernels at d=64)
  flex           compiled FlexAttention, as in the bench
and checks the two attngen gradients against each other. Prediction: the N=512 causal d=128 row was
an outlier (a re-run gives >= 1.1x Flex); if not, the Triton kernels win there on the H100 and
BWD_MIN_KEYS needs a per-GPU threshold.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

HEAD_DIMS = tuple(int(x) for x in os.environ.get("HEAD_DIMS", "128,64").split(","))
LENGTHS = tuple(int(x) for x in os.environ.get("LENGTHS", "512,1024").split(","))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def profile(out_dir: str) -> int:
    """--profile: where the time of one attngen backward goes at N=512, d=128 (both masks): the kernels'
    own times (torch.profiler, 20 calls), the wall time per call of 20 back-to-back calls (host and
    GPU together), the host time per call (no synchronisation), and a CUDA-graph replay of the
    module's backward (GPU time with no host in between)."""
    import time

    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops
    from attngen.tuning.search import graphed

    rows = []
    for causal in (True, False):
        n, d = int(os.environ.get("N", "512")), 128
        b, h = 16384 // n, 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(n + causal)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = attngen.attention(q, k, v, is_causal=causal)
        flops = fa_flops(b, h, n, n, d, causal, True)
        for _ in range(5):
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            torch.cuda.synchronize()
        kernels = {e.key: e.device_time_total / 20 for e in prof.key_averages() if e.device_time_total > 0}
        walls, hosts = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            hosts.append((time.perf_counter() - t0) / 20 * 1e6)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 20 * 1e6)
        module = attngen.load(sdpa_spec("bf16", d, causal)).module
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        o = torch.empty_like(q)
        module.forward(q.detach(), k.detach(), v.detach(), out=o, lse=lse)
        grads = [torch.empty_like(t) for t in (q, k, v)]

        def call():
            module.backward(q.detach(), k.detach(), v.detach(), o, lse, do, dq=grads[0], dk=grads[1], dv=grads[2])

        graph_us = [triton.testing.do_bench(graphed(call), warmup=25, rep=100, return_mode="median") * 1e3
                    for _ in range(5)]
        eager_us = [triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(5)]
        row = {"causal": causal, "seqlen": n, "kernels us": kernels, "wall us per call": walls,
               "host us per call": hosts, "graph us": graph_us, "module eager us": eager_us,
               "graph TFLOP/s": [flops / t / 1e6 for t in graph_us]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "backward_short_profile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, d=128: us per backward (5 rounds each)")
    for r in rows:
        print(f"  {'causal' if r['causal'] else 'full  '} N={r['seqlen']}: kernels {sum(r['kernels us'].values()):.0f} "
              f"({', '.join(f'{k[:24]} {t:.0f}' for k, t in r['kernels us'].items())})")
        for key in ("wall us per call", "host us per call", "graph us", "module eager us"):
            print(f"    {key:18s} {[round(x) for x in r[key]]}")
    return 0


def main() -> int:
    if "--profile" in sys.argv:
        return profile(next((a for a in sys.argv[1:] if not a.startswith("--")), "."))
    import attngen
    from attngen.api import sdpa_spec
    from attngen.bench import fa_flops, prefill_providers

    torch.utils.deterministic.fill_uninitialized_memory = False  # "attngen split": no NaN fills of torch.empty
    out_dir = next((a for a in sys.argv[1:] if not a.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d in HEAD_DIMS:
        for causal in (True, False):
            module = attngen.load(sdpa_spec("bf16", d, causal)).module
            ready = module.ws_bwd_ready
            flex = prefill_providers(causal)["flex"]

            def run_attngen(q, k, v, causal=causal):
                return attngen.attention(q, k, v, is_causal=causal)

            for n in LENGTHS:
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(7 * n + d + causal)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                           for _ in range(3))
                do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h}
                providers = {"attngen": run_attngen, "attngen triton": run_attngen, "attngen split": run_attngen,
                             "flex": flex}
                flops = fa_flops(b, h, n, n, d, causal, True)
                outs = {name: fn(q, k, v) for name, fn in providers.items()}

                def step(name, outs=outs, inputs=(q, k, v), do=do):
                    if name == "attngen triton":  # read by the module's backward at each call
                        module.ws_bwd_ready = lambda *a: False
                    torch.use_deterministic_algorithms(name == "attngen split")
                    try:
                        return torch.autograd.grad(outs[name], inputs, do, retain_graph=True)
                    finally:
                        module.ws_bwd_ready = ready
                        torch.use_deterministic_algorithms(False)

                grads = {name: step(name) for name in providers}
                for rep in range(ROUNDS):
                    for name in providers if rep % 2 == 0 else reversed(providers):
                        ms = triton.testing.do_bench(lambda name=name: step(name), warmup=25, rep=100,
                                                     return_mode="median")
                        row.setdefault(name, []).append(flops / ms / 1e9)
                for other in ("attngen", "attngen split"):
                    row[f"max rel diff, {other} vs triton"] = max(
                        ((a.float() - t.float()).norm() / t.float().norm()).item()
                        for a, t in zip(grads[other], grads["attngen triton"]))
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, do, grads, outs
                torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "backward_short.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: backward TFLOP/s, median of {ROUNDS} rounds "
          "(attngen / triton / split / flex; ratios to flex), attngen's rounds")
    for r in rows:
        a, t, sp, f = (sorted(r[k])[ROUNDS // 2] for k in ("attngen", "attngen triton", "attngen split", "flex"))
        print(f"  d={r['head_dim']:3d} {'causal' if r['causal'] else 'full  '} N={r['seqlen']:5d}  {a:5.0f} / {t:5.0f} / "
              f"{sp:5.0f} / {f:5.0f}   {a / f:4.2f}x / {t / f:4.2f}x / {sp / f:4.2f}x  {[round(x) for x in r['attngen']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
