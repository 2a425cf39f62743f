"""Experiment: a cached process's time to its first result, and Triton's start-up hash in it.

    python benchmarks/experiments/first_call.py OUT_DIR [SPEC ...]

The v7 profile (benchmarks/compile_time.py --profile) of a cached process's `load` + first call on
the lent H200: 1.0-1.1 s, of which 0.33-0.35 s is `triton.runtime.cache.triton_key()` (a sha256 of
Triton's sources and its 415 MB libtriton.so, once per process, at the first launch), 0.1 s
registering the torch custom ops (now imported only under torch.compile) and 0.26 s compiling .py
files that the machine's torch environment ships without .pyc (sympy.tensor, sympy.combinatorics,
triton.experimental.gluon: imported on first use, after `import attngen`).
Prediction: computing the hash on a thread from `load` hides only part of it (the main thread's
Python work in `load` holds the GIL; the hash needs it between 1 MB chunks); from `import attngen`
it overlaps CUDA's initialisation too and hides most of it.

Variants, each a fresh process on the same warm caches, 3 repetitions, medians:
  off      ATTNGEN_WARMUP=0: Triton computes the hash at the first launch
  load     the hash on a thread from `attngen.load` (attngen/warmup.py)
  import   the same thread started right after `import attngen`
  pyc      `load`, with PYTHONPYCACHEPREFIX set so that modules without .pyc compile once, as on a
           normal install
Recorded: import_s (`import torch, attngen`), cuda_s (torch.cuda.init and one randn), first_s
(`attngen.load` + the first result, synchronised: compile_time.py's "first result"), total_s (from
the child's start to the first result).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECS = ["specs/fwd_d128.attn", "specs/decode_d128.attn", "specs/train_causal_d64.attn"]

CHILD = r"""
import time
t0 = time.perf_counter()
import json, sys, torch, attngen
t_import = time.perf_counter() - t0
if sys.argv[2] == "import":
    from attngen import warmup
    warmup.start()
torch.cuda.init()
torch.randn(1, device="cuda")
t_cuda = time.perf_counter() - t0 - t_import
t1 = time.perf_counter()
kernel = attngen.load(sys.argv[1])
s = kernel.spec
mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=s.dtype.torch)
if s.is_split or s.kv_layout.paged:
    q, k, v = mk(2, 1, 32, s.head_dim), mk(2, 1024, 8, s.head_dim), mk(2, 1024, 8, s.head_dim)
    table = None
    if s.kv_layout.paged:
        page = s.kv_layout.page_size
        k, v = k.reshape(-1, page, 8, s.head_dim), v.reshape(-1, page, 8, s.head_dim)
        table = torch.arange(k.shape[0], dtype=torch.int32, device="cuda").reshape(2, -1)
    lens = torch.full((2,), 1024, dtype=torch.int32, device="cuda")
    out = attngen.attention_with_kvcache(q, k, v, lens, block_table=table)
elif s.backward:
    q, k, v = (mk(2, 16, 1024, s.head_dim).requires_grad_() for _ in range(3))
    kernel(q, k, v).backward(torch.randn_like(q))
else:
    q, k, v = (mk(2, 16, 1024, s.head_dim) for _ in range(3))
    kernel(q, k, v)
torch.cuda.synchronize()
t_first = time.perf_counter() - t1
print(json.dumps({"import_s": t_import, "cuda_s": t_cuda, "first_s": t_first,
                  "total_s": time.perf_counter() - t0}))
"""


def child(spec: str, variant: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, spec, variant], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    if done.returncode:
        raise SystemExit(f"{spec} {variant}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    specs = sys.argv[2:] or SPECS
    rows = []
    for spec in specs:
        with tempfile.TemporaryDirectory() as tmp:
            base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNGEN_WARMUP")}
            base.update(ATTNGEN_CACHE_DIR=f"{tmp}/attngen", TRITON_CACHE_DIR=f"{tmp}/triton")
            child(spec, "load", base)  # cold: generate and compile
            envs = {"off": dict(base, ATTNGEN_WARMUP="0"), "load": base, "import": base,
                    "pyc": dict(base, PYTHONPYCACHEPREFIX=f"{tmp}/pyc")}
            child(spec, "load", envs["pyc"])  # fills the pyc prefix
            runs = {name: [] for name in envs}
            for _ in range(3):  # interleaved, so that drift on the machine hits every variant alike
                for name, env in envs.items():
                    runs[name].append(child(spec, "import" if name == "import" else "load", env))
        for name, samples in runs.items():
            row = {"spec": spec, "variant": name, "samples": samples}
            row.update({key: statistics.median(s[key] for s in samples) for key in samples[0]})
            rows.append(row)
            print(f"{Path(spec).stem:20s} {name:7s} import {row['import_s']:.2f} s  cuda {row['cuda_s']:.2f} s  "
                  f"load+first {row['first_s']:.3f} s  total {row['total_s']:.2f} s", flush=True)
    (out_dir / "first_call.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
