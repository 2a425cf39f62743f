"""Host time of the paged decode's Gluon kernel against the Triton kernel (eager calls), part by part.

    [PROFILE=1] python benchmarks/experiments/wsd_host.py [OUT.json]

Paths compared, each through the user's call `attngen.attention_with_kvcache` on a paged cache
(16-token pages, 32/8 heads, d=128, bf16):
  triton       the Triton kernel (the Gluon kernel's readiness check patched to say no);
  gluon-remap  the Gluon kernel, every tensor map encoded afresh per launch (Triton's launcher);
  gluon        the Gluon kernel, FastJIT keeping each pool's tensor maps (attngen/launch.py `_tma_plan`);
and the contiguous cache for reference. For each, at batch 1 1k and 8k and batch 16 1k: a call's host
time (the GPU idle before it) and latency (to the end of its GPU work), and where the GPU work is not
trivial the eager `attngen bench --suite decode` row (do_bench with its L2 flush) and the CUDA-graph
row (the GPU's time alone).
Then the parts of one Gluon launch: the readiness check, two descriptors, FastJIT's key, one tensor map.
"""

import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton

import attngen
from attngen import launch
from attngen.bench_decode import bench_graph
from attngen.decode import kvcache_spec

ROUNDS = 5
PROFILE = os.environ.get("PROFILE", "0") == "1"  # also cProfile the paged and contiguous calls


def loop_us(fn, n=20000) -> float:
    """Mean us of a host-only function (no GPU work) over n calls."""
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def host_and_latency(call, n=300) -> tuple:
    """Medians (us) of one call's host time (from the call to its return, the GPU idle before it: no
    launch waits on a full queue) and of its latency (to the GPU's end of its work)."""
    host, latency = [], []
    for _ in range(20):
        call()
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        latency.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e6, statistics.median(latency) * 1e6


def paired(module, shapes, n=400) -> dict:
    """Host time of the module's `forward_kvcache` (what the user's call runs after its checks) per path,
    the paths taken in turn within each sample so that the host's drift falls on all of them alike:
    medians over samples of each path's time and of its difference from the Triton kernel's."""
    fast = module.attn_fwd_wsd
    remap = launch.FastJIT(fast.fn)
    variants = {}
    for batch, ctx in ((1, 1024), (16, 1024)):
        q, k, v, lens, table, _ = shapes[(batch, ctx)]
        q4 = q.transpose(1, 2)
        variants[f"B{batch} 1k triton"] = (fast, lambda q4=q4, k=k, v=v, lens=lens, table=table: module.forward_kvcache(
            q4, k, v, lens, table, config={"warp_specialized": False}))
        for name, kernel in (("gluon-remap", remap), ("gluon", fast)):
            variants[f"B{batch} 1k {name}"] = (kernel, lambda q4=q4, k=k, v=v, lens=lens, table=table: module.forward_kvcache(
                q4, k, v, lens, table))
    for kernel, call in variants.values():
        module.attn_fwd_wsd = kernel
        call()
    remap._cache = {key: (compiled, tail, None) for key, (compiled, tail, _) in remap._cache.items()}  # no kept maps
    times = {name: [] for name in variants}
    for _ in range(n):
        for name, (kernel, call) in variants.items():
            module.attn_fwd_wsd = kernel
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    module.attn_fwd_wsd = fast
    out = {f"{name} us": statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        base = times[name.rsplit(" ", 1)[0] + " triton"]
        if t is not base:
            out[f"{name} - triton us"] = statistics.median([a - b for a, b in zip(t, base)])
    return out


def setup(batch: int, ctx: int, gen):
    k = torch.randn(batch * ctx // 16, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    table = torch.randperm(k.shape[0], device="cuda", generator=gen).view(batch, -1).int()
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    kc = torch.randn(batch, ctx, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, lens, table, kc


def main() -> None:
    module = attngen.load(kvcache_spec("bf16", 128, True, 16)).module
    ready, plan = module.wsd_ready, launch._tma_plan
    gen = torch.Generator("cuda").manual_seed(0)

    def use(path):
        module.wsd_ready = (lambda *a: False) if path == "triton" else ready
        launch._tma_plan = (lambda *a: None) if path == "gluon-remap" else plan
        module.attn_fwd_wsd._cache.clear()  # plans are made when a binary is first cached

    rows = {}
    shapes = {(1, 1024): setup(1, 1024, gen), (1, 8192): setup(1, 8192, gen), (16, 1024): setup(16, 1024, gen)}
    paths = ("triton", "gluon-remap", "gluon", "contiguous")

    def calls(path, batch, ctx, splits=0):
        q, k, v, lens, table, kc = shapes[(batch, ctx)]
        if path == "contiguous":
            return lambda: attngen.attention_with_kvcache(q, kc, kc, lens, num_splits=splits)
        return lambda: attngen.attention_with_kvcache(q, k, v, lens, table, num_splits=splits)

    # Rounds over the paths in turn (the lent machines' hosts drift by 10-20% within a run): medians.
    samples = {path: {} for path in paths}
    for _ in range(ROUNDS):
        for path in paths:
            use("gluon" if path == "contiguous" else path)
            got = samples[path]
            for batch, ctx in shapes:
                host, latency = host_and_latency(calls(path, batch, ctx))
                got.setdefault(f"host us B{batch} {ctx // 1024}k", []).append(host)
                got.setdefault(f"latency us B{batch} {ctx // 1024}k", []).append(latency)
                if ctx > 1024 or batch > 1:
                    ms = triton.testing.do_bench(calls(path, batch, ctx), warmup=25, rep=100, return_mode="median")
                    got.setdefault(f"eager GB/s B{batch} {ctx // 1024}k", []).append(
                        2 * batch * ctx * 8 * 128 * 2 / ms / 1e6)
                    ms = bench_graph(calls(path, batch, ctx))
                    got.setdefault(f"graph GB/s B{batch} {ctx // 1024}k", []).append(
                        2 * batch * ctx * 8 * 128 * 2 / ms / 1e6)
    for path in paths:
        rows[path] = {key: statistics.median(val) for key, val in samples[path].items()}
        print(path, {key: round(val, 1) for key, val in rows[path].items()}, flush=True)
    rows["paired"] = paired(module, shapes)
    print("paired", {key: round(val, 1) for key, val in rows["paired"].items()}, flush=True)
    if PROFILE:
        for path in ("gluon", "contiguous"):
            use("gluon")
            call = calls(path, 1, 1024)
            host_and_latency(call, 100)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                call()
            prof.disable()
            torch.cuda.synchronize()
            print(f"--- cProfile, {path}, 2000 calls (B1 1k)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    use("gluon")

    # The parts of one Gluon launch (batch 1, 1k keys, 16 splits' partial buffers).
    q, k, v, lens, table, _ = shapes[(1, 1024)]
    q4 = q.transpose(1, 2)
    o_part = torch.empty(1, 16, 32, 1, 128, device="cuda", dtype=torch.float32)
    lse_part = torch.empty(1, 16, 32, 1, device="cuda", dtype=torch.float32)
    out = torch.empty_like(q4)
    parts = rows["gluon parts"] = {}
    parts["wsd_ready"] = loop_us(lambda: module.wsd_ready(q4, k, v, out))
    desc = module.GluonTensorDescriptor
    box, layout = module._WSD_BOX, module._WSD_LAYOUT
    parts["two descriptors, constructor"] = loop_us(
        lambda: [desc(t, [t.shape[0] * 16, 1024], [t.stride(1), 1], box, layout) for t in (k, v)])
    parts["two descriptors, _wsd_descriptor"] = loop_us(lambda: [module._wsd_descriptor(t) for t in (k, v)])
    d = module._wsd_descriptor(k)
    attngen.attention_with_kvcache(q, k, v, lens, table)  # a binary in FastJIT's cache again
    parts["one descriptor key"] = loop_us(lambda: hash(launch._desc_key(d)))
    from triton.backends.nvidia.driver import make_tensordesc_arg

    compiled = next(iter(module.attn_fwd_wsd._cache.values()))[0]
    meta = compiled.metadata.tensordesc_meta[0]
    parts["one tensor map (make_tensordesc_arg)"] = loop_us(lambda: make_tensordesc_arg(d, meta))
    for path in ("gluon-remap", "gluon"):
        use(path)
        parts[f"launch_attn_fwd_wsd, {path}"] = host_and_latency(
            lambda: module.launch_attn_fwd_wsd(q4, k, v, o_part, lse_part, lens, table, 128 ** -0.5))[0]
    use("triton")
    config = dict(module.DEFAULT_CONFIG)
    config["BLOCK_N"] = min(config["BLOCK_N"], getattr(module, "MAX_BLOCK_N", config["BLOCK_N"]))
    parts["launch_attn_fwd (Triton kernel)"] = host_and_latency(
        lambda: module.launch_attn_fwd(q4, k, v, o_part, lse_part, lens, table, 128 ** -0.5, **config))[0]
    use("gluon")
    print("gluon parts", {key: round(val, 2) for key, val in parts.items()})
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
