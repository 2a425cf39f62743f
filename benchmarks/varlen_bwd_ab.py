"""The Gluon varlen backward with each of its experimental switches off and on, in one process (issues 49 and 50):
  docs16k  the varlen bench's 8 documents packed in 16,384 tokens, H=16 (issue 49: target 1.5x FlexAttention's
           backward, ~486 TFLOP/s)
  cp128k   131,072 tokens of 14 documents of mean 8,192 (benchmarks/context_parallel.py `document_offsets`), H=32:
           the one-GPU document row of issue 50 (FlexAttention's backward ~373 TFLOP/s there)
both causal per document, d=128, bf16. Settings (policy/hopper.py values set while the setting's module is
generated; every one with VARLEN_BACKWARD on and the default tile order):
  main     main's switches (VARLEN_BWD_LEAN on, VARLEN_BWD_PERSISTENT and VARLEN_BWD_MASK_S off)
  mask_s   main with VARLEN_BWD_MASK_S: a masked block's S^T masked before exp2 as the dense kernel does, the rows'
           delta read unmasked from rows padded by 3 (ptxas: 156 bytes of spills a thread -> 48 at causal d=128)
  base     main without VARLEN_BWD_LEAN (its first A/B's control)
Each module's `backward_varlen` is timed by triton.testing.do_bench (median; TFLOP/s on kept scores, as `attngen
bench --suite varlen` counts them), and a torch.profiler pass gives the main kernel's (attn_bwd_dkdv_ws) share of
it; "max diff" is the largest gradient difference against the base setting's.

    python benchmarks/varlen_bwd_ab.py                         both cases, every setting
    python benchmarks/varlen_bwd_ab.py --cases docs16k --settings main,mask_s

Each setting's module is generated under a spec name of its own in a fresh ATTNGEN_CACHE_DIR, so no setting reuses
another's kernels (CONVENTIONS.md: an experiment's way).
"""

import argparse
import os
import tempfile
from collections import defaultdict
from unittest import mock

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-vbwd-ab-")

import torch  # noqa: E402
import triton.testing  # noqa: E402

import attngen  # noqa: E402
from attngen.bench.varlen import kept_scores  # noqa: E402
from attngen.policy import hopper  # noqa: E402
from context_parallel import document_offsets  # noqa: E402  (benchmarks/, this script's folder)

D = 128
_CP = document_offsets(131072, 8192)
CASES = {  # name: (document lengths, heads)
    "docs16k": ((607, 3417, 6339, 936, 3589, 452, 197, 847), 16),  # the H200 bench run's (NOTES.md, varlen)
    "cp128k": (tuple(b - a for a, b in zip(_CP, _CP[1:])), 32),
}

SETTINGS = {  # name: policy values set while its module is generated
    name: {"VARLEN_BACKWARD": True, "VARLEN_BWD_SCHEDULE": True, "VARLEN_BWD_LEAN": lean,
           "VARLEN_BWD_PERSISTENT": False, "VARLEN_BWD_MASK_S": mask_s}
    for name, lean, mask_s in (("main", True, False), ("mask_s", True, True), ("base", False, False))
}

MAIN = "attn_bwd_dkdv_ws"
"""The main kernel's name in the profiler's events."""


def module_for(setting: str, heads: int):
    """The generated module of a setting: a varlen causal spec under a name of its own, generated under its values."""
    text = (f"kernel vbwd_ab_{setting}_{heads} {{\n    direction = forward+backward\n    layout = varlen\n"
            f"    mask = causal\n    head_dim = {D}\n    dtype = bf16\n    heads = {heads}\n"
            f"    kv_heads = {heads}\n}}\n")
    with mock.patch.multiple(hopper, **SETTINGS[setting]):  # (restored after)
        return attngen.load(text).module


def main_kernel_us(fn, calls=10) -> float:
    """Microseconds a call of fn spends in the main kernel (torch.profiler's CUDA times)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = defaultdict(float)
    for event in prof.key_averages():
        if MAIN in event.key:
            us[MAIN] += event.device_time_total / calls
    return us[MAIN]


def run_case(case: str, settings: list[str]) -> None:
    lengths, heads = CASES[case]
    gen = torch.Generator("cuda").manual_seed(0)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    cu = torch.tensor([0, *lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    used = cu[1:] - cu[:-1]
    kept = kept_scores(lengths, lengths, True)
    print(f"\n{case}: {len(lengths)} sequences ({total} tokens), H={heads}, d={D}, causal, bf16")
    print(f"{'setting':>15} {'ms':>7} {'TFLOP/s':>8} {'main us':>9} {'main TFLOP/s':>13} | max diff")
    reference = None
    for setting in settings:
        module = module_for(setting, heads)
        out, lse = module.forward_varlen(q, k, v, cu, cu, used)

        def backward():
            return module.backward_varlen(q, k, v, out, lse, do, cu, cu, used)

        grads = backward()
        ms = triton.testing.do_bench(backward, warmup=25, rep=300)
        main_us = main_kernel_us(backward)
        if reference is None:
            reference, diff = grads, ""
        else:
            diff = f"{max((g - r).abs().max().item() for g, r in zip(grads, reference)):.3g}"
        flop = 4 * D * heads * kept * 2.5
        print(f"{setting:>15} {ms:7.3f} {flop / ms / 1e9:8.1f} {main_us:9.1f} {flop / main_us / 1e6:13.1f} | {diff}")
        del grads, out, lse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for case in args.cases.split(","):
        run_case(case, args.settings.split(","))


if __name__ == "__main__":
    main()
