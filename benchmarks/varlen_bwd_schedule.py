"""The Gluon varlen backward's tile orders side by side in one process (issue 49: the bench's 8 documents packed in
16,384 tokens, causal per document, d=128, H=16, bf16; target 1.5x FlexAttention's backward, ~486 TFLOP/s): the
Triton varlen backward (hopper.VARLEN_BACKWARD off), the Gluon one in the packed order (VARLEN_BWD_SCHEDULE off) and
with it on at 1, 2, 4 and 16 K/V heads at a time (VARLEN_BWD_ORDER_HEADS; "lpt4" the default). Each module's
`backward_varlen` is timed by triton.testing.do_bench (median; TFLOP/s on kept scores, as `attngen bench --suite
varlen` counts them), and a torch.profiler pass splits its time by GPU kernel: the row pass before
(attn_bwd_prep_ws), the rows' shifted copies (a torch copy kernel), the order (attn_bwd_order_ws), the main kernel
(attn_bwd_dkdv_ws) and the dQ pass (attn_bwd_dq_ws). Also prints each setting's largest gradient difference against
the packed order's.

    python benchmarks/varlen_bwd_schedule.py                      the bench's documents (NOTES.md, varlen)
    python benchmarks/varlen_bwd_schedule.py --seed 1             8 other random documents
    python benchmarks/varlen_bwd_schedule.py --lengths 16384      one sequence (the dense kernel's shape: the
                                                                  varlen kernel's cost a step, apart from its order)

Each setting sets the policy objects before its module is generated, under a spec name of its own, in a fresh
ATTNGEN_CACHE_DIR (CONVENTIONS.md: an experiment's way).
"""

import argparse
import os
import tempfile
from collections import defaultdict
from unittest import mock

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-vbwd-")

import torch  # noqa: E402
import triton.testing  # noqa: E402

import attngen  # noqa: E402
from attngen.bench.varlen import kept_scores  # noqa: E402
from attngen.policy import hopper  # noqa: E402
from attngen.testing.packed import document_lengths  # noqa: E402

D, H = 128, 16
DOCUMENTS = (607, 3417, 6339, 936, 3589, 452, 197, 847)  # the H200 bench run's (NOTES.md, varlen)

SETTINGS = {  # name: policy values set while its module is generated
    "triton": {"VARLEN_BACKWARD": False},
    "packed": {"VARLEN_BACKWARD": True, "VARLEN_BWD_SCHEDULE": False},
    **{f"lpt{g}": {"VARLEN_BACKWARD": True, "VARLEN_BWD_SCHEDULE": True, "VARLEN_BWD_ORDER_HEADS": g}
       for g in (1, 2, 4, 16)},
}

KERNELS = {"prep": "attn_bwd_prep_ws", "order": "attn_bwd_order_ws", "main": "attn_bwd_dkdv_ws",
           "dq": "attn_bwd_dq_ws", "copy": "copy"}
"""A column of the split: the GPU kernels whose name holds the text (the shifted copies: torch's copy kernel)."""


def module_for(setting: str):
    """The generated module of a setting: a varlen causal spec under a name of its own, generated under its values."""
    text = (f"kernel vbwd_{setting} {{\n    direction = forward+backward\n    layout = varlen\n    mask = causal\n"
            f"    head_dim = {D}\n    dtype = bf16\n    heads = {H}\n    kv_heads = {H}\n}}\n")
    with mock.patch.multiple(hopper, **SETTINGS[setting]):  # (restored after)
        return attngen.load(text).module


def split_us(fn, calls=10) -> dict:
    """Microseconds a call of fn spends in each KERNELS column (torch.profiler's CUDA times)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = defaultdict(float)
    for event in prof.key_averages():
        for column, name in KERNELS.items():
            if name in event.key:
                us[column] += event.device_time_total / calls  # (microseconds)
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, DOCUMENTS)))
    parser.add_argument("--seed", type=int, default=None, help="8 random documents in 16,384 tokens instead")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    if args.seed is not None:
        lengths = document_lengths(16384, 8, torch.Generator().manual_seed(args.seed))
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
    gen = torch.Generator("cuda").manual_seed(0)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    cu = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    used = cu[1:] - cu[:-1]
    kept = kept_scores(lengths, lengths, True)
    print(f"{torch.cuda.get_device_name()}; {len(lengths)} sequences {lengths}, H={H}, d={D}, causal, bf16")
    print(f"{'setting':>9} {'ms':>7} {'TFLOP/s':>8} | " + " ".join(f"{c + ' us':>9}" for c in KERNELS) + " | max diff")
    reference = None
    for setting in args.settings.split(","):
        module = module_for(setting)
        out, lse = module.forward_varlen(q, k, v, cu, cu, used)

        def backward():
            return module.backward_varlen(q, k, v, out, lse, do, cu, cu, used)

        grads = backward()
        ms = triton.testing.do_bench(backward, warmup=50, rep=500)
        us = split_us(backward)
        diff = "" if reference is None else f"{max((g - r).abs().max().item() for g, r in zip(grads, reference)):.3g}"
        if setting == "packed":
            reference = grads
        tflops = 4 * D * H * kept * 2.5 / ms / 1e9
        print(f"{setting:>9} {ms:7.3f} {tflops:8.1f} | " + " ".join(f"{us.get(c, 0.0):9.1f}" for c in KERNELS)
              + f" | {diff}")


if __name__ == "__main__":
    main()
