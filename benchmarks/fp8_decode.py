"""FP8 KV-cache decode against bf16 decode (issue 52: >= 1.8x bf16's tokens/s from batch 16 and 8k keys, paged
within 5% of contiguous): batch 16 and 64 x 8k and 32k keys, 32/8 heads, d = 128 (or 64), one query a sequence, a
contiguous cache and the same tokens in shuffled 16-token pages, each call replayed in a CUDA graph
(attngen.bench.decode's timer).

    python benchmarks/fp8_decode.py            the FP8 cache on the kernel the policy picks as shipped
    python benchmarks/fp8_decode.py --gluon    with policy hopper.FP8_DECODE_GLUON switched on
    python benchmarks/fp8_decode.py --fp8-2wg  FP8 with one consumer warpgroup and with two (hopper.FP8_DECODE_2WG
                                               off, then on, for each call; K widened, the shared state), beside
                                               bf16, in one process
    python benchmarks/fp8_decode.py --splits 1 the FP8 calls at a fixed split count (0: the policy's rule)
    python benchmarks/fp8_decode.py --fp8-2wg --stages-2wg 4    DECODE_FP8_2WG's ring at 4 stages
    python benchmarks/fp8_decode.py --fp8-2wg --halves   also the two warpgroups as partitions (FP8_DECODE_HALVES)
    python benchmarks/fp8_decode.py --split-loader   also the shipped kernel with a loader warp for each of K and V
    python benchmarks/fp8_decode.py --head-dim 64 [--block-n 128]   d=64 (two warpgroups, halves), its key block
    python benchmarks/fp8_decode.py --block-n 128 --stages-2wg 4   d=128's form before 256-key blocks in 2 stages
    python benchmarks/fp8_decode.py --e4m3-products  also halves with Q as one e4m3 term and as two (FP8_DECODE_Q8
                                                     1 and 2: S^T on e4m3 products), and with P in e4m3 too
    python benchmarks/fp8_decode.py --fp8-2wg --stage-v 0       DECODE_FP8_2WG with V^T a register operand
    python benchmarks/fp8_decode.py --fp8-2wg --permute-k 0     DECODE_FP8_2WG with K's fragments read as they lie
    python benchmarks/fp8_decode.py --fp8-2wg --stage-k 1 --permute-k 0    with K widened in shared memory too

The switches are set on the policy object (an experiment's way: CONVENTIONS.md): FP8_DECODE_GLUON before anything
compiles, FP8_DECODE_2WG before each FP8 call is first made and captured (the kernel caches key on it, so each setting
gets its own module), and the kernels go to a fresh ATTNGEN_CACHE_DIR: a module the disk cache kept from a run with
other settings, under the API's spec name, would be reused otherwise. Prints one line a shape, layout and kernel
(bf16, then each FP8 kernel): its time, tokens/s (sequences decoded a second) and K/V bytes a second, its tokens/s
over bf16's, paged over its contiguous, its relative error against float64 (bf16: of the cache; FP8: of the dequantised
cache, and then of the unquantised one); last, how many FP8 modules have the Gluon kernel with one and with two
consumer warpgroups.
"""

import argparse
import os
import tempfile
from dataclasses import replace

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-fp8dec-")

import torch  # noqa: E402

from attngen.api.kvcache import attention_with_kvcache  # noqa: E402
from attngen.bench.decode import DTYPE, H, H_KV, bench_graph, paged_copy  # noqa: E402
from attngen.policy import hopper  # noqa: E402
from attngen.runtime.plans import PLANS  # noqa: E402

FP8 = torch.float8_e4m3fn


def gluon_fp8_modules() -> tuple[int, int]:
    """Generated modules in this run's cache whose Gluon decode ring is e4m3: with one consumer warpgroup, with two."""
    one = two = 0
    for root, _, files in os.walk(os.environ["ATTNGEN_CACHE_DIR"]):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    text = f.read()
                if "gl.allocate_shared_memory(gl.float8e4nv" in text:
                    two += "'CONSUMERS': 2" in text
                    one += "'CONSUMERS': 2" not in text
    return one, two


_PLANNED_WITH = {"switches": None}  # the setting the plans in PLANS were made with


def switched(call, settings: dict):
    """`call` made with the policy's switches set as `settings` says (hopper.FP8_DECODE_2WG, FP8_DECODE_HALVES,
    FP8_DECODE_SPLIT_LOADER; the module is chosen, and the graph captured, then)."""
    def run():
        saved = {name: getattr(hopper, name) for name in settings}
        for name, value in settings.items():
            setattr(hopper, name, value)
        # NOTE: a call's plan (the module it runs) is kept by its arguments' signature, which holds no switch: the
        # other setting's call of the same tensors would take its plan. Cleared only when the setting changes, so
        # that bench_graph's captured call reuses its first call's plan (planning checks values on the host)
        if _PLANNED_WITH["switches"] != settings:
            PLANS.clear()
            _PLANNED_WITH["switches"] = settings
        try:
            return call()
        finally:
            for name, value in saved.items():
                setattr(hopper, name, value)
    return run


ACCURACY_SEQUENCES = 4  # the sequences each call's output is checked on against float64


def float64_attention(q, k, v):
    """Float64 attention of q (B, 1, H, D) over every key of k, v (B, N, H_KV, D) (their first ACCURACY_SEQUENCES
    sequences): (B, 1, H, D)."""
    q, k, v = (t[:ACCURACY_SEQUENCES].double() for t in (q, k, v))
    b, _, h, d = q.shape
    qg = q.view(b, k.shape[2], h // k.shape[2], d)  # (B, H_KV, group, D)
    s = torch.einsum("bkgd,bnkd->bkgn", qg, k) * d ** -0.5
    return torch.einsum("bkgn,bnkd->bkgd", torch.softmax(s, dim=-1), v).reshape(b, 1, h, d)


def relative(out, ref) -> float:
    """||out - ref|| / ||ref|| over the checked sequences."""
    return ((out[:ACCURACY_SEQUENCES].double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gluon", action="store_true", help="switch hopper.FP8_DECODE_GLUON on")
    parser.add_argument("--fp8-2wg", action="store_true",
                        help="time FP8 with hopper.FP8_DECODE_2WG off and on (one and two consumer warpgroups)")
    parser.add_argument("--halves", action="store_true",
                        help="also two consumer warpgroups as partitions of their own (hopper.FP8_DECODE_HALVES)")
    parser.add_argument("--split-loader", action="store_true",
                        help="also halves with K's and V's copies from a loader warp each (FP8_DECODE_SPLIT_LOADER)")
    parser.add_argument("--e4m3-products", action="store_true",
                        help="also halves with Q as one and as two e4m3 terms (FP8_DECODE_Q8 1, 2), and with P in e4m3 "
                             "too (FP8_DECODE_P8)")
    parser.add_argument("--stages-2wg", type=int, default=None,
                        help="hopper.DECODE_FP8_2WG's stages (and the head dim's FP8_DECODE_2WG_STAGES)")
    parser.add_argument("--stage-k", type=int, choices=(0, 1), default=None, help="hopper.DECODE_FP8_2WG's stage_k")
    parser.add_argument("--stage-v", type=int, choices=(0, 1), default=None, help="hopper.DECODE_FP8_2WG's stage_v")
    parser.add_argument("--permute-k", type=int, choices=(0, 1), default=None,
                        help="hopper.DECODE_FP8_2WG's permute_k")
    parser.add_argument("--splits", type=int, default=0, help="the FP8 calls' num_splits (0: the split rule's)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--block-n", type=int, default=None,
                        help="the two-warpgroup kernel's key block at this head dim (hopper.FP8_DECODE_2WG_BLOCK_N)")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--contexts", default="8192,32768")
    args = parser.parse_args()
    hopper.FP8_DECODE_GLUON = args.gluon or hopper.FP8_DECODE_GLUON
    if args.block_n:
        hopper.FP8_DECODE_2WG_BLOCK_N = {**hopper.FP8_DECODE_2WG_BLOCK_N, args.head_dim: args.block_n}
    if args.stages_2wg:  # (a head dim with stages of its own in FP8_DECODE_2WG_STAGES takes them there)
        hopper.DECODE_FP8_2WG = replace(hopper.DECODE_FP8_2WG, stages=args.stages_2wg)
        hopper.FP8_DECODE_2WG_STAGES = {**hopper.FP8_DECODE_2WG_STAGES, args.head_dim: args.stages_2wg}
    for name in ("stage_k", "stage_v", "permute_k"):
        if getattr(args, name) is not None:
            hopper.DECODE_FP8_2WG = replace(hopper.DECODE_FP8_2WG, **{name: bool(getattr(args, name))})
    # the FP8 kernels timed: (name, the switches' settings), each beside bf16
    def kind(two_wg, halves=False, split_loader=False, q8=0, p8=False):
        return {"FP8_DECODE_2WG": two_wg, "FP8_DECODE_HALVES": halves, "FP8_DECODE_SPLIT_LOADER": split_loader,
                "FP8_DECODE_Q8": q8, "FP8_DECODE_P8": p8}
    shipped = kind(hopper.FP8_DECODE_2WG, hopper.FP8_DECODE_HALVES, hopper.FP8_DECODE_SPLIT_LOADER,
                   hopper.FP8_DECODE_Q8, hopper.FP8_DECODE_P8)
    fp8_kinds = [("fp8 1wg", kind(False)), ("fp8 2wg", kind(True))] if args.fp8_2wg else [("fp8", shipped)]
    fp8_kinds += [("fp8 half", kind(True, True))] if args.halves else []
    fp8_kinds += [("fp8 sl", {**shipped, "FP8_DECODE_SPLIT_LOADER": True})] if args.split_loader else []
    fp8_kinds += [("fp8 q8", kind(True, True, False, q8=1))] if args.e4m3_products else []
    fp8_kinds += [("fp8 q8x2", kind(True, True, False, q8=2))] if args.e4m3_products else []
    fp8_kinds += [("fp8 p8", kind(True, True, False, q8=1, p8=True))] if args.e4m3_products else []
    gen = torch.Generator("cuda").manual_seed(0)
    kinds = "; ".join(f"{name}: " + ", ".join(f"{k} = {v}" for k, v in settings.items())
                      for name, settings in fp8_kinds)
    print(f"{torch.cuda.get_device_name()}; hopper.FP8_DECODE_GLUON = {hopper.FP8_DECODE_GLUON}; {kinds}; "
          f"DECODE_FP8_2WG = {hopper.DECODE_FP8_2WG}")
    print(f"{'B':>3} {'ctx':>6} {'layout':<10} {'kernel':<8} {'ms':>8} {'tokens/s':>9} {'GB/s':>6} {'x bf16':>7} "
          f"{'paged/contig':>12} {'rel64':>8} {'vs bf16 kv':>10}")
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            q = torch.randn(batch, 1, H, args.head_dim, device="cuda", dtype=DTYPE, generator=gen)
            k = torch.randn(batch, ctx, H_KV, args.head_dim, device="cuda", dtype=DTYPE, generator=gen)
            v = torch.randn(batch, ctx, H_KV, args.head_dim, device="cuda", dtype=DTYPE, generator=gen)
            # per-head scales from each head's absolute maximum, as a calibration would set them (bench.decode's)
            k_descale, v_descale = (t.abs().amax(dim=(0, 1, 3)).float() / 448.0 for t in (k, v))
            k8, v8 = (k.float() / k_descale[:, None]).to(FP8), (v.float() / v_descale[:, None]).to(FP8)
            k_deq, v_deq = ((t.float() * s[:, None]).to(DTYPE) for t, s in ((k8, k_descale), (v8, v_descale)))
            perm = torch.randperm(batch * ctx // 16, device="cuda", generator=gen)
            table = perm.view(batch, ctx // 16).to(torch.int32)
            scales = dict(k_descale=k_descale, v_descale=v_descale)
            # float64 of the cache's values (bf16's rows) and of the dequantised ones (the FP8 rows': their own error;
            # "vs bf16 kv", against the unquantised cache's, adds the cache's rounding)
            ref_bf16, ref_fp8 = float64_attention(q, k, v), float64_attention(q, k_deq, v_deq)
            del k_deq, v_deq
            calls = {"contiguous": (lambda: attention_with_kvcache(q, k, v, ctx),
                                    lambda: attention_with_kvcache(q, k8, v8, ctx, **scales, num_splits=args.splits))}
            kp, vp, k8p, v8p = (paged_copy(t, 16, perm) for t in (k, v, k8, v8))
            calls["paged 16"] = (lambda: attention_with_kvcache(q, kp, vp, ctx, table),
                                 lambda: attention_with_kvcache(q, k8p, v8p, ctx, table, **scales,
                                                                num_splits=args.splits))
            contiguous = {}  # each kernel's contiguous time
            for layout, (bf16_call, fp8_call) in calls.items():
                bf16_ms = bench_graph(bf16_call)
                rows = [("bf16", bf16_ms, DTYPE.itemsize, (relative(bf16_call(), ref_bf16), None))]
                for name, settings in fp8_kinds:
                    call = switched(fp8_call, settings)
                    out = call()
                    rows.append((name, bench_graph(call), FP8.itemsize,
                                 (relative(out, ref_fp8), relative(out, ref_bf16))))
                for name, ms, itemsize, (err, total) in rows:
                    contiguous.setdefault(name, ms)
                    gbps = 2 * batch * ctx * H_KV * args.head_dim * itemsize / ms / 1e6
                    print(f"{batch:>3} {ctx:>6} {layout:<10} {name:<8} {ms:>8.4f} {batch / ms * 1e3:>9.0f} "
                          f"{gbps:>6.0f} {bf16_ms / ms:>7.2f} {contiguous[name] / ms:>12.3f} "
                          f"{err:>8.1e} {'' if total is None else f'{total:.1e}':>10}", flush=True)
            del q, k, v, k8, v8, kp, vp, k8p, v8p, calls, ref_bf16, ref_fp8
            torch.cuda.empty_cache()
    one, two = gluon_fp8_modules()
    print(f"Gluon FP8 decode modules compiled: {one} with one consumer warpgroup, {two} with two")


if __name__ == "__main__":
    main()
