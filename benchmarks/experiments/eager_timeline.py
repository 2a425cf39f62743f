"""Where an eager decoding call's time goes under do_bench: host launches against GPU kernels.

    python benchmarks/experiments/eager_timeline.py [OUT_DIR]

`attngen bench --suite decode` times eager calls as do_bench does: per iteration a 256 MB L2 flush
(`cache.zero_()`), then the call, CUDA events around the call. This runs that loop under
torch.profiler for the contiguous and the paged (16-token pages, Gluon kernel on Hopper) call at
batch 1, 8k keys, and prints, per provider, the medians over iterations of: each launch's host time
from the iteration's start (the flush's launch), each kernel's GPU start and end from the flush's
end, and the event-measured time; OUT_DIR gets the chrome traces.
"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import attngen


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    gen = torch.Generator("cuda").manual_seed(0)
    batch, ctx = 1, 8192
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, ctx, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    kp = torch.randn(batch * ctx // 16, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    vp = torch.randn_like(kp)
    table = torch.randperm(kp.shape[0], device="cuda", generator=gen).view(batch, -1).int()
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
    providers = {"contiguous": lambda: attngen.attention_with_kvcache(q, k, v, lens),
                 "paged16": lambda: attngen.attention_with_kvcache(q, kp, vp, lens, table)}
    for name, fn in providers.items():
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(40)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for start, end in events:
                cache.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
        if out_dir:
            prof.export_chrome_trace(f"{out_dir}/eager_{name}.json")
        measured = statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
        report(name, prof, measured)


def report(name, prof, measured_us) -> None:
    launches = sorted((e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")),
                      key=lambda e: e.time_range.start)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith("Memcpy") and "Event" not in e.name), key=lambda e: e.time_range.start)
    # iterations start at each flush kernel (torch's fill / zero kernel)
    flush = [i for i, e in enumerate(kernels) if "elementwise" in e.name or "fill" in e.name.lower()]
    host_rows, gpu_rows = [], []
    flush_launch = [i for i, e in enumerate(launches) if e.name == "cudaLaunchKernel"]
    for it in range(len(flush) - 1):
        ks = kernels[flush[it] + 1:flush[it + 1]]
        zero = kernels[flush[it]]
        gpu_rows.append([(kk.time_range.start - zero.time_range.end, kk.time_range.end - zero.time_range.end,
                          kk.name[:30]) for kk in ks])
    # host: launches between consecutive flush launches (the flush goes through cudaLaunchKernel first)
    starts = [launches[i].time_range.start for i in flush_launch]
    for a, b in zip(starts, starts[1:]):
        host_rows.append([e.time_range.start - a for e in launches if a < e.time_range.start < b])
    print(f"--- {name}: event-measured {measured_us:.1f} us (median of 40)")
    n = min(len(r) for r in host_rows) if host_rows else 0
    print("  host: launches at", [round(statistics.median(r[i] for r in host_rows), 1) for i in range(n)],
          "us after the flush's launch; iteration", round(statistics.median(b - a for a, b in zip(starts, starts[1:])), 1))
    m = min(len(r) for r in gpu_rows) if gpu_rows else 0
    for i in range(m):
        print(f"  gpu kernel {gpu_rows[0][i][2]}: start {statistics.median(r[i][0] for r in gpu_rows):.1f}"
              f" end {statistics.median(r[i][1] for r in gpu_rows):.1f} us after the flush's end")


if __name__ == "__main__":
    main()
