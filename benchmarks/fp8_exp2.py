"""The FP8 forward's kernels side by side in one process (issue 52: 1.5x the bf16 forward at d=128, N >= 4096): the
Triton FP8 kernel, the Gluon FP8 kernel (policy hopper.FP8_GLUON), the Gluon one with part of each key block's
exponentials on the FMA pipe (hopper.FP8_EXP2_EMULATION, at FP8_EXP2_FMA's share and at a half), its shapes from
hopper.FP8_FORWARD_ALTERNATIVES, and the bf16 Gluon forward for the ratio. B x 16 heads x N = 16k tokens, d=128,
GQA off, no mask and causal, TFLOP/s by triton.testing.do_bench (median), each module launched directly through
its `forward` (the Triton kernel: the module generated with FP8_GLUON off).

    python benchmarks/fp8_exp2.py                       N = 4096 and 16384
    python benchmarks/fp8_exp2.py --lengths 4096,8192,16384 --settings gluon,gluon_exp2

Each setting sets the policy objects before its module is generated (an experiment's way: CONVENTIONS.md) under a
spec name of its own, in a fresh ATTNGEN_CACHE_DIR, and restores them after; a row says "not taken" where the
module's Gluon kernel refuses the inputs (`ws_ready`). Also prints each FP8 row's largest error against the Triton
FP8 kernel's output on the same inputs.
"""

import argparse
import os
import tempfile
from contextlib import contextmanager

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-fp8exp2-")

import torch  # noqa: E402
import triton  # noqa: E402

import attngen  # noqa: E402
from attngen.policy import hopper  # noqa: E402

D, H, TOKENS = 128, 16, 16384

SETTINGS = {  # name: (dtype, policy values set while its module is generated)
    "bf16": ("bf16", {}),
    "triton": ("fp8_e4m3", {"FP8_GLUON": False}),
    "gluon": ("fp8_e4m3", {"FP8_GLUON": True}),
    "gluon_exp2": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_EXP2_EMULATION": True}),
    "gluon_exp2_half": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_EXP2_EMULATION": True,
                                     "FP8_EXP2_FMA": {**hopper.FP8_EXP2_FMA, D: 0.5}}),
    **{f"gluon_{alt}{exp2}": ("fp8_e4m3", {"FP8_GLUON": True, "FP8_EXP2_EMULATION": bool(exp2),
                                           "FP8_FORWARD": {**hopper.FP8_FORWARD, D: shape}})
       for alt, shape in hopper.FP8_FORWARD_ALTERNATIVES.items() for exp2 in ("", "_exp2")},
}


@contextmanager
def policy(values: dict):
    """hopper's attributes set to `values` inside the block."""
    saved = {name: getattr(hopper, name) for name in values}
    try:
        for name, value in values.items():
            setattr(hopper, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(hopper, name, value)


def module_for(setting: str, causal: bool):
    """The generated module of a setting: its spec under a name of its own, generated under its policy values."""
    dtype, values = SETTINGS[setting]
    mask = "causal" if causal else "none"
    text = (f"kernel fp8exp2_{setting}_{mask} {{\n    direction = forward\n    mask = {mask}\n    head_dim = {D}\n"
            f"    dtype = {dtype}\n}}\n")
    with policy(values):
        return attngen.load(text).module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    settings = args.settings.split(",")
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; d={D}, {H} heads, B x N = {TOKENS} tokens; TFLOP/s (x bf16; max |out - "
          "triton fp8|)")
    for causal in (False, True):
        for n in (int(x) for x in args.lengths.split(",")):
            b = max(1, TOKENS // n)
            q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = (attngen.quantize_fp8(t, "head") for t in (q, k, v))
            v8 = v8.transpose(-1, -2).contiguous().transpose(-1, -2)  # keys contiguous: the Gluon kernel's V^T view
            fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
            flops = 4 * b * H * n * n * D / (2 if causal else 1)
            # (the "triton" setting's module is generated with FP8_GLUON off: it has the Triton kernel only)
            reference, _ = module_for("triton", causal).forward(q8, k8, v8, **fp8)
            cells, bf16_tflops = [], None
            for setting in settings:
                module = module_for(setting, causal)
                if setting == "bf16":
                    call = lambda: module.forward(q, k, v)  # noqa: E731
                elif setting == "triton":
                    call = lambda: module.forward(q8, k8, v8, **fp8)  # noqa: E731
                elif not module.ws_ready(q8, k8, v8, torch.empty_like(q)):
                    cells.append(f"{setting} not taken")
                    continue
                else:
                    call = lambda: module.forward(q8, k8, v8, **fp8)  # noqa: E731
                out, _ = call()
                ms = triton.testing.do_bench(call, warmup=50, rep=300)
                tflops = flops / ms / 1e9
                bf16_tflops = tflops if setting == "bf16" else bf16_tflops
                ratio = f" x{tflops / bf16_tflops:.2f}" if bf16_tflops and setting != "bf16" else ""
                err = "" if setting == "bf16" else f" {(out.float() - reference.float()).abs().max().item():.1e}"
                cells.append(f"{setting} {tflops:.0f}{ratio}{err}")
            print(f"N={n:>5} B={b:>2} {'causal' if causal else 'none  '}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
