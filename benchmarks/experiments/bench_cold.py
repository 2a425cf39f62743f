"""Experiment: why a cold process's bench reads its first causal backward case low (NOTES.md v38).

    python benchmarks/experiments/bench_cold.py OUT_DIR [ROUNDS]      (GPU)

v38: with empty Triton and attngen caches, `attngen bench --suite prefill --direction backward --head-dims 64
--lengths 512,1024` read causal N=512 at 121-141 TFLOP/s where a warm process reads ~200; N=1024 read normally.
Hypothesis: something the first timed calls of a freshly compiled spec do (a compile, a first-use step) falls
inside do_bench's 5-call estimate, so the estimate is seconds long and do_bench takes n_warmup = n_repeat = 1:
the "median" is one call, made right after seconds of an idle GPU (clocks down).
Prediction: the low case shows an estimate of >= 100 ms and n_repeat 1; the same case timed again in the same
process reads ~200.

Each round is a fresh process with empty TRITON_CACHE_DIR and ATTNGEN_CACHE_DIR that runs the bench's own
`bench_prefill` (d=64, N 512 and 1024, attngen and SDPA cuDNN, backward) with triton.testing.do_bench replaced
by a copy of it that records its parts (the first call's wall time, the estimate, n_warmup, n_repeat, the timed
samples), then runs the same cases again in that process. Writes OUT_DIR/bench_cold.json and prints a table.
Result (H100, results/h100_bench_cold_v39.json, two cold processes): not reproduced. Every case's estimate was
0.7-1.3 ms (one call's time) and do_bench took 80-145 repeats; causal N=512 read 162.6-162.8 TFLOP/s cold and
163.4-163.7 again in the same process (cuDNN 149-150), and the cold bench CLI run of that session read 162.9. The
hypothesis is wrong on the H100; the H200's low first reading (v38) remains unexplained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child() -> None:
    """One cold process: the instrumented bench twice; one JSON line on stdout."""
    sys.path.insert(0, ROOT)
    import torch
    import triton
    import triton.testing

    from attngen import bench

    log = []

    def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        # triton.testing.do_bench (3.6) with its parts recorded; same calls, same order
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(5):
            triton.runtime.driver.active.clear_cache(cache)
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_wall_s = time.perf_counter() - t0
        estimate_ms = start.elapsed_time(end) / 5
        n_warmup = max(1, int(warmup / estimate_ms))
        n_repeat = max(1, int(rep / estimate_ms))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        for _ in range(n_warmup):
            fn()
        for s, e in zip(starts, ends):
            triton.runtime.driver.active.clear_cache(cache)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        log.append(dict(first_s=first_s, estimate_ms=estimate_ms, estimate_wall_s=estimate_wall_s,
                        n_warmup=n_warmup, n_repeat=n_repeat, median_ms=times[len(times) // 2], samples=times[:8]))
        return times[len(times) // 2]

    triton.testing.do_bench = do_bench
    out = {}
    for rep in ("cold", "again"):
        log.clear()
        rows = bench.bench_prefill((512, 1024), (64,), ("attngen", "sdpa_cudnn"), ("backward",), progress=lambda s: None)
        parts = iter(log)  # one do_bench per row that ran; a failed row made none
        out[rep] = [dict(provider=r.provider, causal=r.params["causal"], n=r.params["seqlen"], tflops=r.tflops,
                         error=r.error, **({} if r.error else next(parts))) for r in rows]
    print("JSON " + json.dumps(out))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
        return 0
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as tc, tempfile.TemporaryDirectory() as ac:
            env = dict(os.environ, TRITON_CACHE_DIR=tc, ATTNGEN_CACHE_DIR=ac, PYTHONUNBUFFERED="1")
            proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("JSON ")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            return 1
        results.append(json.loads(line[5:]))
    with open(os.path.join(out_dir, "bench_cold.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'round':>5} {'pass':>6} {'provider':>11} {'causal':>6} {'N':>5} {'TFLOP/s':>8} {'first s':>8} "
          f"{'est. ms':>9} {'est. wall s':>11} {'warm':>5} {'reps':>5}")
    for i, res in enumerate(results):
        for rep, rows in res.items():
            for x in rows:
                if x["error"]:
                    print(f"{i:>5} {rep:>6} {x['provider']:>11} {x['causal']!s:>6} {x['n']:>5} {x['error']}")
                    continue
                print(f"{i:>5} {rep:>6} {x['provider']:>11} {x['causal']!s:>6} {x['n']:>5} {x['tflops'] or 0:8.1f} "
                      f"{x['first_s']:8.3f} {x['estimate_ms']:9.3f} {x['estimate_wall_s']:11.3f} {x['n_warmup']:>5} "
                      f"{x['n_repeat']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
