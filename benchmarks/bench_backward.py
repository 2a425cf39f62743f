"""Training memory on the GPU: attngen against naive PyTorch attention.

    python benchmarks/bench_backward.py OUT_DIR

Peak extra memory of forward + backward at N = 4k, 8k, 16k (B=1, H=16, d=128, bf16, causal):
attngen saves only O and the log-sum-exp, so it grows linearly in N; naive attention keeps N x N
matrices. Backward speed against the peers is `attngen bench --direction backward`.
Writes backward_memory.json to OUT_DIR; prints a table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import attngen
from attngen.bench.prefill import _naive


def memory():
    rows = []
    for n in (4096, 8192, 16384):
        for name, fn in (("attngen", lambda q, k, v: attngen.attention(q, k, v, is_causal=True)),
                         ("naive", lambda q, k, v: _naive(q, k, v, True))):
            torch.cuda.empty_cache()
            q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                fn(q, k, v).backward(do)
                torch.cuda.synchronize()
                rows.append(dict(n=n, provider=name, peak_extra_bytes=torch.cuda.max_memory_allocated() - base))
            except torch.OutOfMemoryError:
                rows.append(dict(n=n, provider=name, error="out of memory"))
            del q, k, v, do
    return rows


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = memory()
    with open(os.path.join(out_dir, "backward_memory.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"{torch.cuda.get_device_name()}: peak extra memory of forward+backward (B=1, H=16, d=128, bf16, causal)")
    for r in rows:
        print(f"  N={r['n']:>6} {r['provider']:>8}: " + (f"{r['peak_extra_bytes'] / 2**30:8.3f} GiB" if "error" not in r else r["error"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
