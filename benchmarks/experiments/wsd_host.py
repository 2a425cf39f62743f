"""Host time and registers of the paged decode's Gluon kernel against the Triton kernel (eager calls).

    python benchmarks/experiments/wsd_host.py

One small paged decoding step (batch 1, 1k keys: the GPU work is a few microseconds, so an eager call
measures the host's launch path) through `forward_kvcache` with the Gluon kernel and with
config={"warp_specialized": False}; and the Gluon kernel's registers per thread (occupancy).
"""

import time

import torch

import attngen
from attngen.decode import kvcache_spec


def main() -> None:
    module = attngen.load(kvcache_spec("bf16", 128, True, 16)).module
    gen = torch.Generator("cuda").manual_seed(0)
    for batch, ctx in ((1, 1024), (1, 8192)):
        k = torch.randn(batch * ctx // 16, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        table = torch.randperm(k.shape[0], device="cuda", generator=gen).view(batch, -1).int()
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        for name, config in (("gluon", None), ("triton", {"warp_specialized": False})):
            for splits in (1, 16):
                call = lambda: module.forward_kvcache(q, k, v, lens, table, num_splits=splits, config=config)  # noqa: E731
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
                n = 2000
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                host = (time.perf_counter() - t0) / n * 1e6
                torch.cuda.synchronize()
                print(f"B={batch} ctx={ctx} {name:6s} splits={splits:2d}: {host:6.1f} us per eager call (host loop)")
    for key, compiled in module.attn_fwd_wsd.device_caches[0][0].items():
        print("attn_fwd_wsd registers", compiled.n_regs, "spills", compiled.n_spills, "shared", compiled.metadata.shared)
        break


if __name__ == "__main__":
    main()
