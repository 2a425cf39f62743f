"""The FP8 kernels under Nsight Compute (issue 52): what holds the Gluon FP8 forward at ~1.1x the bf16 forward, and
the FP8 KV-cache decode at ~1.4x bf16's tokens/s (issue: 1.5x and 1.8x). Each case compiles and warms its kernels
outside the NVTX range "profile", then runs each once inside it.

    ncu --nvtx --nvtx-include "profile/" --clock-control none --set detailed --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --csv --page raw python benchmarks/fp8_profile.py

Cases: forward d=128, B=4 H=16 N=4096, no mask: the bf16 Gluon kernel, the Gluon FP8 kernel (hopper.FP8_GLUON on
while its module is generated) and the Triton FP8 one; decode, 32/8 heads d=128, batch 64 x 8k keys, contiguous:
bf16 and the FP8 cache (the shipped two-warpgroup Gluon kernel). Without ncu it prints each call's time (do_bench).
"""

import os
import tempfile

os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-fp8prof-")

import torch  # noqa: E402
import triton  # noqa: E402

import attngen  # noqa: E402
from attngen.api.kvcache import attention_with_kvcache  # noqa: E402
from attngen.policy import hopper  # noqa: E402

D, H, N, B = 128, 16, 4096, 4


def module(dtype: str, gluon: bool):
    saved, hopper.FP8_GLUON = hopper.FP8_GLUON, gluon
    try:
        text = (f"kernel fp8prof_{dtype}_{int(gluon)} {{\n    direction = forward\n    mask = none\n"
                f"    head_dim = {D}\n    dtype = {dtype}\n}}\n")
        return attngen.load(text).module
    finally:
        hopper.FP8_GLUON = saved


def main() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (attngen.quantize_fp8(t, "head") for t in (q, k, v))
    v8 = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    bf16, g8, t8 = module("bf16", False), module("fp8_e4m3", True), module("fp8_e4m3", False)
    assert g8.ws_ready(q8, k8, v8, torch.empty_like(q)), "the Gluon FP8 kernel refuses the inputs"
    calls = {"fwd_bf16": lambda: bf16.forward(q, k, v), "fwd_fp8_gluon": lambda: g8.forward(q8, k8, v8, **fp8),
             "fwd_fp8_triton": lambda: t8.forward(q8, k8, v8, **fp8)}
    flops = {name: 4 * B * H * N * N * D for name in calls}
    bd, ctx, hq, hkv = 64, 8192, 32, 8
    qd_ = torch.randn(bd, 1, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc, vc = (torch.randn(bd, ctx, hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    ks, vs = (t.abs().amax(dim=(0, 1, 3)).float() / 448.0 for t in (kc, vc))
    kc8, vc8 = (kc.float() / ks[:, None]).to(torch.float8_e4m3fn), (vc.float() / vs[:, None]).to(torch.float8_e4m3fn)
    calls["dec_bf16"] = lambda: attention_with_kvcache(qd_, kc, vc, ctx)
    calls["dec_fp8"] = lambda: attention_with_kvcache(qd_, kc8, vc8, ctx, k_descale=ks, v_descale=vs)
    for name, call in calls.items():
        call()
        ms = triton.testing.do_bench(call, warmup=25, rep=100)
        rate = f"{flops[name] / ms / 1e9:.0f} TFLOP/s" if name in flops else f"{bd / ms * 1e3:.0f} tokens/s"
        print(f"{name}: {ms:.4f} ms, {rate}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
