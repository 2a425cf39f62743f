"""Compile time: the first call of a new spec, a cached second process, one binary for all lengths.

    python benchmarks/compile_time.py [-o benchmarks/results/compile_<gpu>.json] [SPEC ...]

For each spec, in fresh, empty attngen and Triton caches:
  1. a cold process: `attngen.load` (parse, passes, render, write the cache) and the first call
     (Triton compiles; the result is synchronised), then calls at other lengths (seq 77, 1000, 4096,
     seq_q != seq_k), counting the binaries Triton holds per kernel: one each means no length
     triggered a recompile;
  2. a second process on the same caches: load + first result, and how long `import attngen` took
     (Python and torch start-up, which no cache removes) and CUDA's initialisation; `from_start_s`
     adds the three (attngen/runtime/warmup.py's thread, started by the import, overlaps the latter two).
A forward+backward spec's first call includes its backward (both compile); a split or paged spec
runs its own `forward_kvcache`. Also recorded: the distinct launch configs the calls used (tuned
per shape bucket): a binary per config, never per length, is what "one kernel for all lengths"
means once tuned tables pick configs by bucket. GPU only. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECS = ["specs/fwd_d128.attn", "specs/fwd_causal_d64.attn", "specs/train_causal_d64.attn",
                 "specs/decode_d128.attn", "specs/decode_paged16_d128.attn"]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, attngen
from attngen import tuning
from attngen.testing.accuracy import Case, runtime_tensors
t_import = time.perf_counter() - t0

def inputs(kernel, n_q, n_k, batch=2):
    s = kernel.spec
    h = s.heads or 16
    hk = s.kv_heads or h // (s.group or 1)
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=s.dtype.torch)
    return mk(batch, h, n_q, s.head_dim), mk(batch, hk, n_k, s.head_dim), mk(batch, hk, n_k, s.head_dim)

def call(kernel, n_q, n_k):
    q, k, v = inputs(kernel, n_q, n_k)
    # a variant spec's run-time tensors (ALiBi slopes, sinks, declared tensors), random, of this call's shape
    tensors = runtime_tensors(kernel.spec, Case(q.shape[0], q.shape[1], k.shape[1], n_q, n_k), "cuda")
    if kernel.spec.is_split or kernel.spec.kv_layout.paged:  # this spec's own forward_kvcache
        lens = torch.full((q.shape[0],), n_k, dtype=torch.int32, device="cuda")
        table = None
        if kernel.spec.kv_layout.paged:
            k, table = kernel.module.as_pages(k)
            v, _ = kernel.module.as_pages(v)
        tuner = kernel.part("kvcache")
        config = tuner.config(tuning.Shape(q.shape[0], q.shape[1], k.shape[1] if table is None else k.shape[2],
                                           n_q, n_k))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        tuner.launch(q, k, v, lens, table, kernel.spec.softmax_scale, out, lse, config)
    elif kernel.spec.backward:
        q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
        out = kernel(q, k, v, **tensors)
        out.backward(torch.randn_like(out))
    else:
        out = kernel(q, k, v, **tensors)
    torch.cuda.synchronize()
    return out

def binaries(kernel):
    # compiled binaries Triton holds, per @triton.jit kernel of the module
    counts = {}
    for name in dir(kernel.module):
        caches = getattr(getattr(kernel.module, name), "device_caches", None)
        if caches:
            counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts

torch.cuda.init()
torch.randn(1, device="cuda")  # CUDA's random generator starts here, not inside the timed call
t_cuda = time.perf_counter() - t0 - t_import
profile_to = sys.argv[2] if len(sys.argv) > 2 else ""
if profile_to:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
t1 = time.perf_counter()
kernel = attngen.load(sys.argv[1])
t_load = time.perf_counter() - t1
decoding = kernel.spec.is_split or kernel.spec.kv_layout.paged
call(kernel, 1 if decoding else 1024, 1024)
t_first = time.perf_counter() - t1
if profile_to:
    profiler.disable()
    profiler.dump_stats(profile_to)
lengths = [(1, 77), (1, 4096), (1, 1000)] if decoding else [(77, 77), (1000, 1000), (4096, 4096), (300, 2000)]
for n_q, n_k in lengths:
    call(kernel, n_q, n_k)

def config_of(n_q, n_k):  # the forward (or kvcache) launch config a call of these lengths uses
    q, k, _ = inputs(kernel, n_q, n_k)
    config = kernel.part("kvcache").config(tuning.Shape.of(q, k)) if decoding else kernel.config(q, k)
    return str(sorted(config.items()))

configs = {config_of(n_q, n_k) for n_q, n_k in [(1 if decoding else 1024, 1024)] + lengths}
print(json.dumps({"import_s": t_import, "cuda_s": t_cuda, "load_s": t_load, "first_result_s": t_first,
                  "from_start_s": t_import + t_cuda + t_first,
                  "binaries_after_all_lengths": binaries(kernel), "forward_configs_used": len(configs),
                  "lengths": [[1024, 1024]] + lengths}))
"""


def run(spec: str, env: dict, profile_to: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, spec, profile_to], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{spec}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=DEFAULT_SPECS)
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="cProfile the cached process's load and first call; write DIR/<spec>.prof and print "
                             "the functions that took the most of it")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    for spec in args.specs:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, ATTNGEN_CACHE_DIR=f"{tmp}/attngen", TRITON_CACHE_DIR=f"{tmp}/triton")
            env.pop("TRITON_INTERPRET", None)
            profile_to = os.path.join(args.profile, Path(spec).stem + ".prof") if args.profile else ""
            if profile_to:
                os.makedirs(args.profile, exist_ok=True)
            cold, warm = run(spec, env), run(spec, env, profile_to)
        rows.append({"spec": spec, "gpu": gpu, "cold": cold, "warm": warm})
        print(f"{Path(spec).stem:24s} cold: load {cold['load_s']:.2f} s, first result {cold['first_result_s']:.2f} s | "
              f"cached process: first result {warm['first_result_s']:.3f} s (+ import {warm['import_s']:.2f} s, "
              f"CUDA init {warm['cuda_s']:.2f} s) | "
              f"binaries per kernel after {len(cold['lengths'])} lengths: {cold['binaries_after_all_lengths']} "
              f"({cold['forward_configs_used']} distinct forward configs)", flush=True)
        if profile_to:
            import pstats

            print(f"  where the cached process's load + first call went ({profile_to}):")
            stats = pstats.Stats(profile_to)
            stats.sort_stats("cumulative").print_stats(r"(attngen|triton|torch)/.*\.py", 25)
    output = args.output or ROOT / "benchmarks" / "results" / f"compile_{gpu.lower().replace(' ', '_')}.json"
    Path(output).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
