"""Experiment: the kernels that trail their targets, run for Nsight Compute (hardware counters).

    ncu --nvtx --nvtx-include "profile/" --clock-control none --set detailed \
        --section WarpStateStats --section SchedulerStats \
        python benchmarks/experiments/ncu_cases.py CASE [CASE ...]

Each case compiles and warms its kernels outside the NVTX range "profile", then runs each provider
once inside it, so ncu reads only the timed kernels (every launch of the call: split + combine for
decode). Cases (bf16, fresh random data):
  decode1_32k / decode1_8k   batch 1, 32 query / 8 kv heads, d=128, full contiguous cache:
                             attngen.attention_with_kvcache and SDPA's cuDNN backend
  decode64_8k                the same at batch 64 (attngen streams at ~4.5 TB/s there: the reference
                             for what the batch-1 kernel misses)
  decode16_8k                the same at batch 16, where attngen trails cuDNN by 3-6% (NOTES v15);
                             attngen also with one split (faster on full caches, slower on spread ones)
  paged1_8k / paged16_8k     attngen's contiguous and 16-token paged decode on the same tokens
                             (paged at batch 1 trails by a constant ~2.7 us per call)
  paged1_1k                  the same at batch 1, 1k keys, the one shape where paged misses 0.95x of
                             contiguous (NOTES v15-v16)
  fwd128                     prefill forward d=128, B=4, H=16, N=4096, non-causal: attngen,
                             FlexAttention (compiled) and cuDNN
  bwd128                     the backward of the same (attngen's dQ and dK/dV kernels, Flex's, cuDNN's),
                             each run once: profile with -k regex:"attn_bwd|backward|bprop" instead of
                             the NVTX range (autograd launches them from its own thread)
Question it answers (benchmarks/NOTES.md v8): what holds each kernel (DRAM throughput, issue slots,
stall reasons, occupancy), where timing variants could only guess. Prints nothing of its own but
the case names; the counters are ncu's output.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import attngen  # noqa: E402

H, H_KV, D = 32, 8, 128


def decode_case(batch: int, ctx: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator("cuda").manual_seed(batch * ctx)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    calls = {"attngen": lambda: attngen.attention_with_kvcache(q, k, v, seqlens), "cudnn": cudnn}
    if batch == 16:
        calls["attngen_1split"] = lambda: attngen.attention_with_kvcache(q, k, v, seqlens, num_splits=1)
    return calls


def paged_case(batch: int, ctx: int):
    """attngen's contiguous and 16-token paged decode on the same tokens (pages in random order)."""
    from attngen.bench_decode import paged_copy

    gen = torch.Generator("cuda").manual_seed(batch * ctx + 1)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    perm = torch.randperm(batch * ctx // 16, device="cuda", generator=gen)
    kp, vp = paged_copy(k, 16, perm), paged_copy(v, 16, perm)
    table = perm.view(batch, ctx // 16).to(torch.int32)
    return {"contiguous": lambda: attngen.attention_with_kvcache(q, k, v, seqlens),
            "paged16": lambda: attngen.attention_with_kvcache(q, kp, vp, seqlens, table)}


def prefill_case(backward: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 64
    gen = torch.Generator("cuda").manual_seed(4096)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_(backward) for _ in range(3))
    do = torch.randn_like(q)
    flex = torch.compile(flex_attention, dynamic=False)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    fns = {"attngen": lambda q, k, v: attngen.attention(q, k, v), "flex": flex, "cudnn": cudnn}
    if not backward:
        return {name: (lambda fn=fn: fn(q, k, v)) for name, fn in fns.items()}
    outs = {name: fn(q, k, v) for name, fn in fns.items()}  # forward outside the range
    return {name: (lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            for name, out in outs.items()}


CASES = {
    "decode1_32k": lambda: decode_case(1, 32768),
    "decode1_8k": lambda: decode_case(1, 8192),
    "decode64_8k": lambda: decode_case(64, 8192),
    "decode16_8k": lambda: decode_case(16, 8192),
    "paged1_8k": lambda: paged_case(1, 8192),
    "paged1_1k": lambda: paged_case(1, 1024),
    "paged16_8k": lambda: paged_case(16, 8192),
    "fwd128": lambda: prefill_case(False),
    "bwd128": lambda: prefill_case(True),
}


def main() -> int:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        calls = CASES[name]()
        if name.startswith("bwd"):
            # autograd runs the backward kernels on its own thread, which the NVTX range of this one
            # does not cover: ncu selects them by name instead (-k regex:"attn_bwd|backward|bprop"),
            # and each runs once, so the first launch of each is the one profiled
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            print(f"case {name}: {', '.join(calls)}", flush=True)
            continue
        for fn in calls.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for provider, fn in calls.items():
            torch.cuda.nvtx.range_push("profile")
            torch.cuda.nvtx.range_push(f"{name}.{provider}")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_pop()
        print(f"case {name}: {', '.join(calls)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
