"""FP8 KV-cache decode against bf16 decode (issue 52: >= 1.8x bf16's tokens/s from batch 16 and 8k keys, paged
within 5% of contiguous): batch 16 and 64 x 8k and 32k keys, 32/8 heads, d = 128, one query a sequence, a
contiguous cache and the same tokens in shuffled 16-token pages, each call replayed in a CUDA graph
(attngen.bench.decode's timer).

    python benchmarks/fp8_decode.py            the FP8 cache on the kernel the policy picks as shipped
    python benchmarks/fp8_decode.py --gluon    with policy hopper.FP8_DECODE_GLUON switched on

The switch is set on the policy object before anything compiles (an experiment's way: CONVENTIONS.md), and the
kernels go to a fresh ATTNGEN_CACHE_DIR: a module the disk cache kept from a run with the switch off, under the
API's spec name, would be reused otherwise. Prints one line a shape and layout: bf16's and FP8's time, FP8's K/V
bytes a second, FP8's tokens/s over bf16's, paged over contiguous, and whether the FP8 module has the Gluon kernel.
"""

import argparse
import os
import tempfile

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-fp8dec-")

import torch  # noqa: E402

from attngen.api.kvcache import attention_with_kvcache  # noqa: E402
from attngen.bench.decode import D, DTYPE, H, H_KV, bench_graph, paged_copy  # noqa: E402
from attngen.policy import hopper  # noqa: E402

FP8 = torch.float8_e4m3fn


def gluon_fp8_modules() -> int:
    """Generated modules in this run's cache whose Gluon decode ring is e4m3."""
    found = 0
    for root, _, files in os.walk(os.environ["ATTNGEN_CACHE_DIR"]):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    found += "gl.allocate_shared_memory(gl.float8e4nv" in f.read()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gluon", action="store_true", help="switch hopper.FP8_DECODE_GLUON on")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--contexts", default="8192,32768")
    args = parser.parse_args()
    hopper.FP8_DECODE_GLUON = args.gluon or hopper.FP8_DECODE_GLUON
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; hopper.FP8_DECODE_GLUON = {hopper.FP8_DECODE_GLUON}")
    print(f"{'B':>3} {'ctx':>6} {'layout':<10} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8 GB/s':>9} {'x bf16':>7} "
          f"{'paged/contig':>12} {'err':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
            k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
            v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
            # per-head scales from each head's absolute maximum, as a calibration would set them (bench.decode's)
            k_descale, v_descale = (t.abs().amax(dim=(0, 1, 3)).float() / 448.0 for t in (k, v))
            k8, v8 = (k.float() / k_descale[:, None]).to(FP8), (v.float() / v_descale[:, None]).to(FP8)
            k_deq, v_deq = ((t.float() * s[:, None]).to(DTYPE) for t, s in ((k8, k_descale), (v8, v_descale)))
            perm = torch.randperm(batch * ctx // 16, device="cuda", generator=gen)
            table = perm.view(batch, ctx // 16).to(torch.int32)
            scales = dict(k_descale=k_descale, v_descale=v_descale)
            want = attention_with_kvcache(q, k_deq, v_deq, ctx)
            del k_deq, v_deq
            calls = {"contiguous": (lambda: attention_with_kvcache(q, k, v, ctx),
                                    lambda: attention_with_kvcache(q, k8, v8, ctx, **scales))}
            kp, vp, k8p, v8p = (paged_copy(t, 16, perm) for t in (k, v, k8, v8))
            calls["paged 16"] = (lambda: attention_with_kvcache(q, kp, vp, ctx, table),
                                 lambda: attention_with_kvcache(q, k8p, v8p, ctx, table, **scales))
            fp8_contiguous = None
            for layout, (bf16_call, fp8_call) in calls.items():
                err = (fp8_call().float() - want.float()).abs().max().item()
                bf16_ms, fp8_ms = bench_graph(bf16_call), bench_graph(fp8_call)
                fp8_contiguous = fp8_contiguous or fp8_ms
                gbps = 2 * batch * ctx * H_KV * D * FP8.itemsize / fp8_ms / 1e6
                print(f"{batch:>3} {ctx:>6} {layout:<10} {bf16_ms:>8.4f} {fp8_ms:>8.4f} {gbps:>9.0f} "
                      f"{bf16_ms / fp8_ms:>7.2f} {fp8_contiguous / fp8_ms:>12.3f} {err:>8.1e}", flush=True)
            del q, k, v, k8, v8, kp, vp, k8p, v8p, calls
            torch.cuda.empty_cache()
    print(f"Gluon FP8 decode modules compiled: {gluon_fp8_modules()}")


if __name__ == "__main__":
    main()
