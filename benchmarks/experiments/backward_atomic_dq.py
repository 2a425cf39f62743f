"""Experiment: the backward in one pass over the keys, dQ accumulated with atomics (FA2/FA3's layout).

    python benchmarks/experiments/backward_atomic_dq.py OUT_DIR
    TRITON_INTERPRET=1 python benchmarks/experiments/backward_atomic_dq.py --interpret-check

attngen's backward runs two kernels: dQ (per block of queries: S, dP and dQ = dS K, three products)
and dK/dV (per block of keys: S^T, dP^T, dV and dK, four products). Seven products where the FA
convention counts five: S and dP are computed twice. FlashAttention 2 and 3 compute dQ inside the
dK/dV kernel (a fifth product, dS^T^T K) and add each program's partial dQ into an fp32 buffer with
atomics; a small kernel then scales and casts it. Prediction: the dK/dV kernel slows by the fifth
product plus the atomics' traffic, the dQ kernel's 3/7 of the work goes away: +10-20% at d=128 if
the atomics stay off the critical path.

Variants of the kernel `attngen.attention()` runs (its spec's `attn_bwd_dkdv`, textual rewrites;
delta = rowsum(dO * O) by a small kernel here, as the dQ kernel no longer runs):
  ptr       dQ partials added with `tl.atomic_add` (per-element red.global.add.f32)
  desc      dQ partials added through a TMA descriptor's `atomic_add` (cp.reduce.async.bulk: one
            bulk reduction per tile, FA3's way)
  desc_rot  desc, and the programs of one head start their query loop at different blocks (program
            n starts at block n), so that they do not all add into the same dQ tile at once
            (non-causal only)
Timed: the whole backward (zero the fp32 buffer, delta, dK/dV/dQ kernel, scale-and-cast) against
`Kernel.backward` with its tuned configs, bf16, batch 16384/N, hidden 2048; gradients checked
against the two-kernel backward. Writes backward_atomic_dq.json; prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backward_variants import IMPORT, patch  # noqa: E402
from common import build_variants, error_text, rel_err  # noqa: E402

import attngen  # noqa: E402
from attngen.api import sdpa_spec  # noqa: E402

def _bounds(t):
    s = t.index("def attn_bwd_dkdv(")
    ls = t.index("def launch_attn_bwd_dkdv(", s)
    le = t.index("\n\n\n", ls)
    return s, ls, le


def _atomic(desc: bool):
    def rewrite(t):
        if "TensorDescriptor" not in t.split("def ", 1)[0]:
            t = IMPORT + t
        s, ls, le = _bounds(t)
        kernel, launch = t[s:ls], t[ls:le]
        dtype = "tl.bfloat16" if "ds_t.to(tl.bfloat16)" in kernel else "tl.float16"
        kernel = patch(kernel, "    DV,\n", "    DV,\n    DQA,\n    DQA_DESC,\n")
        old = f"dk = tl.dot(ds_t.to({dtype}), q, dk)"
        assert old in kernel, "no dK product"
        if desc:
            add = "DQA_DESC.atomic_add([b, g + hkv*GROUP, start_m, 0], dq_part.reshape(1, 1, BLOCK_M, HEAD_DIM))"
        else:
            add = ("tl.atomic_add(DQA + ((b.to(tl.int64) * H + g + hkv*GROUP) * N_Q + offs_m[:, None]) * HEAD_DIM"
                   " + offs_d[None, :], dq_part, mask=offs_m[:, None] < N_Q, sem=\"relaxed\")")
        lines = []
        for line in kernel.split("\n"):
            lines.append(line)
            if line.strip() == old:
                indent = line[: len(line) - len(line.lstrip())]
                lines.append(indent + f"dq_part = tl.dot(tl.trans(ds_t.to({dtype})), k)")
                lines.append(indent + add)
        kernel = "\n".join(lines)
        launch = patch(launch, "delta, dk, dv, sm_scale, *,", "delta, dk, dv, dqa, sm_scale, *,")
        launch = patch(launch, "    grid = (", "    dqa_desc = TensorDescriptor(dqa, list(dqa.shape), list(dqa.stride()), "
                       "[1, 1, BLOCK_M, HEAD_DIM])\n    grid = (" if desc else "    dqa_desc = None\n    grid = (")
        launch = patch(launch, "q, k, v, do, lse, delta, dk, dv,\n", "q, k, v, do, lse, delta, dk, dv, dqa, dqa_desc,\n")
        return t[:s] + kernel + launch + t[le:]
    return rewrite


def rotate(t):
    s, ls, _ = _bounds(t)
    kernel = t[s:ls]
    old = ("for start_m in range(0, BLOCK_M*(N_Q // BLOCK_M), BLOCK_M):  # full blocks: no mask\n"
           "            start_m = tl.multiple_of(start_m, BLOCK_M)\n")
    new = ("for i_m in range(0, N_Q // BLOCK_M):  # full blocks: no mask, program n starts at block n\n"
           "            start_m = ((i_m + tl.program_id(0)) % (N_Q // BLOCK_M)) * BLOCK_M\n"
           "            start_m = tl.multiple_of(start_m, BLOCK_M)\n")
    return t[:s] + patch(kernel, old, new) + t[ls:]


@triton.jit
def _delta_kernel(O, DO, DELTA, ROWS, D: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    mask = rows[:, None] < ROWS
    o = tl.load(O + rows[:, None].to(tl.int64) * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None].to(tl.int64) * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < ROWS)


@triton.jit
def _cast_kernel(SRC, DST, SIZE, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(SRC + offs, mask=offs < SIZE, other=0.0)
    tl.store(DST + offs, (x * scale).to(DST.dtype.element_ty), mask=offs < SIZE)


def atomic_backward(module, q, k, v, out, lse, do, scale, config, dqa, delta):
    """dq, dk, dv through the one-pass kernel of `module` (contiguous inputs)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d = q.shape[-1]
    dqa.zero_()
    rows = q.numel() // d
    _delta_kernel[(triton.cdiv(rows, 64),)](out, do, delta, rows, D=d, BLOCK=64)
    module.launch_attn_bwd_dkdv(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dk=dk, dv=dv, dqa=dqa,
                                sm_scale=scale, **config)
    _cast_kernel[(triton.cdiv(dqa.numel(), 1024),)](dqa, dq, dqa.numel(), scale, BLOCK=1024)
    return dq, dk, dv


def interpret_check():
    """CPU, Triton's interpreter: the ptr variant against the two-kernel backward at odd sizes."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for d, causal in ((64, True), (64, False)):
        kern = attngen.load(sdpa_spec("bf16", d, causal))
        mods = build_variants(kern.source, {"ptr": [_atomic(False)]}, f"adqcheck{d}{int(causal)}")
        gen = torch.Generator().manual_seed(0)
        b, h, hkv, nq, nk = 1, 4, 2, 77, 77
        q = torch.randn(b, h, nq, d, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(b, hkv, nk, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        do = torch.randn(b, h, nq, d, generator=gen).to(torch.bfloat16)
        scale = d ** -0.5
        out, lse = kern.forward(q, k, v, scale)
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
        ref = kern.backward(q, k, v, out, lse, do, scale)
        got = atomic_backward(mods["ptr"], q, k, v, out, lse, do, scale, cfg,
                              torch.empty(q.shape, dtype=torch.float32), torch.empty_like(lse))
        errs = [rel_err(g, r) for g, r in zip(got, ref)]
        print(f"d={d} causal={causal}: rel err dq/dk/dv {errs}")
        assert max(errs) < 1e-2, errs


CONFIGS = {128: [(64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 3)],
           64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3), (128, 64, 8, 2)]}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d in (128, 64):
        for causal in (False, True):
            kern = attngen.load(sdpa_spec("bf16", d, causal))
            variants = {"ptr": [_atomic(False)], "desc": [_atomic(True)]}
            if not causal:
                variants["desc_rot"] = [_atomic(True), rotate]
            mods = build_variants(kern.source, variants, f"adq{d}{int(causal)}")
            for n in (4096, 16384):
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                               for _ in range(4))
                scale = d ** -0.5
                out, lse = kern.forward(q, k, v, scale)
                ref = kern.backward(q, k, v, out, lse, do, scale)
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                case = dict(head_dim=d, causal=causal, seqlen=n)
                ms = triton.testing.do_bench(lambda: kern.backward(q, k, v, out, lse, do, scale),
                                             warmup=25, rep=100, return_mode="median")
                rows.append(dict(case, variant="two_kernels", config=None, ms=ms, tflops=flops / ms / 1e9))
                dqa = torch.empty(q.shape, device="cuda", dtype=torch.float32)
                delta = torch.empty_like(lse)
                # the sweep at 4096; at 16384 each variant's best config from 4096
                for vname, module in mods.items():
                    if n == 4096:
                        configs = CONFIGS[d]
                    else:
                        done = [r for r in rows if r["variant"] == vname and r["seqlen"] == 4096 and "tflops" in r
                                and r["head_dim"] == d and r["causal"] == causal]
                        configs = [max(done, key=lambda r: r["tflops"])["config"]] if done else []
                    for cfg in configs:
                        config = dict(BLOCK_M=cfg[0], BLOCK_N=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                        row = dict(case, variant=vname, config=tuple(cfg))
                        run = lambda: atomic_backward(module, q, k, v, out, lse, do, scale, config, dqa, delta)
                        try:
                            got = run()
                            torch.cuda.synchronize()
                            row.update(err_dq=rel_err(got[0], ref[0]), err_dk=rel_err(got[1], ref[1]), err_dv=rel_err(got[2], ref[2]))
                            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                            row.update(ms=ms, tflops=flops / ms / 1e9)
                        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
                            row["error"] = error_text(e)
                        rows.append(row)
                print(f"d={d} causal={causal} N={n} done", flush=True)
                del q, k, v, do, out, lse, ref, dqa
                torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "backward_atomic_dq.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}: backward, bf16, TFLOP/s (FA convention), best config per variant")
    print(f"{'d':>4} {'causal':>6} {'N':>6} {'variant':>12} {'config':>18} {'TFLOP/s':>8} {'max err':>8}")
    keys = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in rows}, key=lambda x: (-x[0], x[1], x[2]))
    for key in keys:
        sel = [r for r in rows if (r["head_dim"], r["causal"], r["seqlen"]) == key and "tflops" in r]
        for vname in ["two_kernels", "ptr", "desc", "desc_rot"]:
            vs = [r for r in sel if r["variant"] == vname]
            if vs:
                r = max(vs, key=lambda r: r["tflops"])
                err = max(r.get("err_dq", 0), r.get("err_dk", 0), r.get("err_dv", 0))
                print(f"{key[0]:>4} {str(key[1]):>6} {key[2]:>6} {vname:>12} {str(r['config']):>18} "
                      f"{r['tflops']:8.1f} {err:8.1e}")
    for r in rows:
        if "error" in r:
            print(f"  d={r['head_dim']} causal={r['causal']} {r['variant']} {r['config']}: {r['error']}")


if __name__ == "__main__":
    if "--interpret-check" in sys.argv:
        interpret_check()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
