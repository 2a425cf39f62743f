"""Experiment: how much of a decode measurement is the L2 flush's dirty lines being written back.

    python benchmarks/experiments/decode_flush.py OUT_DIR      (GPU)

triton.testing.do_bench clears the L2 before every timed call by zeroing a 256 MB buffer, so each call
starts with the L2 (50 MB on an H100/H200) full of dirty lines. A decode kernel's K/V reads evict them,
and the write-backs share HBM with the reads inside the timed interval: up to ~50 MB more traffic, ~11 us
at 4.5 TB/s, against a batch-1 call of 15-45 us. If so, the bench's decode ratios to cuDNN carry a fixed
cost common to every provider.

Each case (contiguous cache, 32 query / 8 K/V heads, d=128, bf16, every sequence full) times attngen's
shipped call (int cache_seqlens), SDPA's cuDNN and flash backends, and torch.sum over K and V (a read of the
same bytes by a reduction), each captured in a CUDA graph, as medians of 200 replays with each of:
  dirty   the L2 cleared by writing 256 MB (do_bench's flush), then the timed replay
  clean   the L2 cleared by reading 256 MB (a reduction: the L2 holds clean lines), then the timed replay
  do_bench triton.testing.do_bench on the replay (should equal dirty)
Prediction: clean is 8-12 us faster than dirty for every provider, so batch-1 ratios between providers
grow when measured clean (cuDNN's 49 us at 32k -> ~38 us).
Writes OUT_DIR/decode_flush.json and prints a table (us; GB/s of K/V).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CASES = ((1, 1024), (1, 8192), (1, 32768), (16, 1024), (16, 8192), (16, 32768), (64, 8192))


def timed(fn, flush, reps: int = 200) -> float:
    """Median us of fn captured in a CUDA graph, `flush()` before each timed replay (not timed)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        flush()
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return 1e3 * times[len(times) // 2]


def main() -> int:
    import attngen
    from attngen.bench_decode import DTYPE, H, H_KV, D, PEERS, gbps

    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    acc = torch.empty((), dtype=torch.int64, device="cuda")
    flushes = {
        "dirty": lambda: buf.zero_(),
        "clean": lambda: torch.sum(buf, 0, dtype=torch.int64, out=acc),
    }
    buf.random_(-100, 100)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, ctx in CASES:
        q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
        k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
        ref = attngen.attention_with_kvcache(q, k, v, ctx)
        q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        s_k, s_v = (torch.empty((), device="cuda", dtype=torch.float32) for _ in range(2))
        fns = {
            "attngen": lambda: attngen.attention_with_kvcache(q, k, v, ctx),
            "cudnn": PEERS["sdpa cudnn"](q4, k4, v4, False),
            "flash": PEERS["sdpa flash"](q4, k4, v4, False),
            "sum": lambda: (torch.sum(k.view(-1), 0, dtype=torch.float32, out=s_k),
                            torch.sum(v.view(-1), 0, dtype=torch.float32, out=s_v)),
        }
        for name in ("cudnn", "flash"):
            err = (fns[name]().transpose(1, 2).float() - ref.float()).abs().max().item()
            if not err <= 2e-2:
                raise SystemExit(f"{name} disagrees with attngen at B={batch} ctx={ctx}: {err}")
        row = dict(batch=batch, context=ctx, us={})
        for rnd in range(2):  # two rounds, the second in reverse order: timings drift by 1-2%
            for name in (list(fns) if rnd == 0 else list(fns)[::-1]):
                for mode, flush in flushes.items():
                    row["us"].setdefault(f"{name} {mode}", []).append(timed(fns[name], flush))
                fn = fns[name]
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                row["us"].setdefault(f"{name} do_bench", []).append(
                    1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))
        row["us"] = {key: min(ts) for key, ts in row["us"].items()}
        row["gbps"] = {key: gbps(batch, ctx, us * 1e-3) for key, us in row["us"].items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, "decode_flush.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    names = ("attngen", "cudnn", "flash", "sum")
    print(f"\n{'B':>3} {'ctx':>6} " + " ".join(f"{n + ' ' + m:>15}" for n in names for m in ("dirty", "clean"))
          + "  ratio dirty  ratio clean")
    for r in rows:
        u = r["us"]
        print(f"{r['batch']:>3} {r['context']:>6} " + " ".join(f"{u[f'{n} {m}']:15.1f}" for n in names
                                                              for m in ("dirty", "clean"))
              + f"  {u['cudnn dirty'] / u['attngen dirty']:11.3f}  {u['cudnn clean'] / u['attngen clean']:11.3f}")
    print("(us, CUDA-graph replays, medians; ratio = cuDNN time / attngen time; do_bench column in the json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
