"""`attngen bench`: attngen against the kernels a user would otherwise pick, in one process.

Prefill (forward and backward), bf16, the FlashAttention benchmark shapes: batch = 16384 / N, hidden
2048 (32 heads at d=64, 16 at d=128), N from 512 to 16384, causal and not. Providers: attngen, torch
SDPA with its flash, cuDNN and memory-efficient backends, FlexAttention (compiled, with the dynamo
recompile limit raised so it never falls back to eager), and naive PyTorch attention where its
N x N matrices fit. Decode (see attngen/bench/decode.py): GB/s of K/V read.

Every timing is a `triton.testing.do_bench` median on fresh random data (never zeros); the forward
is timed alone, the backward as `torch.autograd.grad` on a retained graph. TFLOP/s follow the
FlashAttention convention: 4*B*H*N^2*d forward, halved when causal, times 2.5 for the backward.
Rows go to `<out>/<gpu>.json` (one per case and provider); timings are never assertions.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict

from ..analysis.cost import evaluate, fa_flops
from ..api.sdpa import attention
from ..version import __version__
from .common import Row, compiled_flex_attention, error_text
from .decode import bench_decode

PREFILL_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
PREFILL_PROVIDERS = ("attngen", "flex", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive")
NAIVE_LIMIT_BYTES = 24 << 30  # naive attention keeps ~4 N x N tensors for its backward


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _median_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _naive(q, k, v, causal):
    import torch

    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def prefill_providers(causal: bool) -> dict:
    """name -> f(q, k, v) -> out, each differentiable."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    flex = compiled_flex_attention()
    masks = {}

    def run_flex(q, k, v):
        n = q.shape[2]
        if causal and n not in masks:
            masks[n] = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n)
        return flex(q, k, v, block_mask=masks.get(n))

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {
        "attngen": lambda q, k, v: attention(q, k, v, is_causal=causal),
        "flex": run_flex,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "naive": lambda q, k, v: _naive(q, k, v, causal),
    }


def bench_prefill(lengths=PREFILL_LENGTHS, head_dims=(64, 128), providers=PREFILL_PROVIDERS,
                  directions=("forward", "backward"), progress=print) -> list[Row]:
    import torch

    rows = []
    for d in head_dims:
        for causal in (False, True):
            impls = prefill_providers(causal)
            for n in lengths:
                b, h = max(1, 16384 // n), 2048 // d
                params = dict(batch=b, heads=h, seqlen=n, head_dim=d, causal=causal, dtype="bf16")
                gen = torch.Generator(device="cuda").manual_seed(1000 * d + n + causal)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                           for _ in range(3))
                for name in providers:
                    if name == "naive" and 4 * b * h * n * n * 2 > NAIVE_LIMIT_BYTES:
                        continue
                    fn = impls[name]
                    for direction in directions:
                        row = Row("prefill", direction, name, params)
                        try:
                            if direction == "forward":
                                with torch.no_grad():
                                    fn(q, k, v)
                                    row.ms = _median_ms(lambda: fn(q, k, v))
                            else:
                                out = fn(q, k, v)
                                do = torch.randn_like(out)
                                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                                row.ms = _median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                                del out, do
                            row.tflops = evaluate(fa_flops(causal, direction == "backward"),
                                                          dict(B=b, H=h, N_Q=n, N_K=n, HEAD_DIM=d)) / row.ms / 1e9
                        except Exception as e:  # noqa: BLE001 - a provider that cannot run a case is a result
                            row.error = error_text(e)
                            torch.cuda.empty_cache()
                        rows.append(row)
                progress(f"prefill d={d} causal={causal} N={n} done")
                q = k = v = None  # (freed before the next length; rebound, not deleted: the timed lambdas name them)
                torch.cuda.empty_cache()
    return rows


def write(rows: list[Row], out_dir: str, meta: dict, stem: str = "") -> str:
    """Merge the rows into `<out_dir>/<stem><gpu>.json` (a row replaces an earlier one of the same case)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}{gpu_slug(meta['device'])}.json")
    old = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("rows", [])
        except (OSError, ValueError):
            old = []
    fresh = [asdict(r) for r in rows]
    seen = {(r["suite"], r["direction"], r["provider"], json.dumps(r["params"], sort_keys=True)) for r in fresh}
    kept = [r for r in old if (r["suite"], r["direction"], r["provider"], json.dumps(r["params"], sort_keys=True)) not in seen]
    with open(path, "w") as f:
        json.dump(dict(meta, rows=kept + fresh), f, indent=1)
    return path


def run_suite(stem: str, rows_of, table, out_dir: str, check: bool) -> int:
    """A suite's run (variants, varlen, shapes): refused without a GPU unless `check`; the rows `rows_of()` makes,
    printed by `table`; then the check's exit status (1 on any row's error), or the timed rows written to
    `<out_dir>/<stem><gpu>.json`."""
    import torch

    if not check and not torch.cuda.is_available():
        print("attngen bench: no CUDA GPU here; benchmarks need one (--check runs the rows in the interpreter)")
        return 2
    rows = rows_of()
    print(table(rows))
    if check:
        return 1 if any(r.error for r in rows) else 0
    print(f"wrote {write(rows, out_dir, meta(), stem=stem)}")
    return 0


def meta() -> dict:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, attngen=__version__,
                date=time.strftime("%Y-%m-%d"))


def table(rows: list[Row]) -> str:
    """The prefill rows as text: TFLOP/s per provider, one line per case."""
    lines = []
    providers = [p for p in PREFILL_PROVIDERS if any(r.provider == p for r in rows)]
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.suite == "prefill" and r.direction == direction]
        if not sel:
            continue
        lines.append(f"prefill {direction} TFLOP/s (bf16)")
        lines.append(f"{'d':>4} {'causal':>6} {'N':>6} " + " ".join(f"{p:>14}" for p in providers))
        cases = sorted({(r.params["head_dim"], r.params["causal"], r.params["seqlen"]) for r in sel})
        for d, causal, n in cases:
            cells = []
            for p in providers:
                r = next((r for r in sel if r.provider == p and (r.params["head_dim"], r.params["causal"], r.params["seqlen"]) == (d, causal, n)), None)
                cells.append(f"{r.tflops:14.1f}" if r and r.tflops else f"{'-' if r is None else 'err':>14}")
            lines.append(f"{d:>4} {causal!s:>6} {n:>6} " + " ".join(cells))
    return "\n".join(lines)


def main(suites=("prefill",), out_dir="benchmarks/results", lengths=None, head_dims=(64, 128), providers=None,
         directions=("forward", "backward")) -> int:
    import torch

    if not torch.cuda.is_available():
        print("attngen bench: no CUDA GPU here; benchmarks need one")
        return 2
    rows: list[Row] = []
    if "prefill" in suites:
        rows += bench_prefill(lengths or PREFILL_LENGTHS, head_dims, providers or PREFILL_PROVIDERS, directions)
    if "decode" in suites:
        rows += bench_decode()
    path = write(rows, out_dir, meta())
    print(table(rows))
    decode = [r for r in rows if r.suite == "decode" and r.gbps]
    if decode:
        print("decode GB/s of K/V read (bf16, 32/8 heads, d=128, one query token)")
        names = sorted({r.provider for r in decode})
        print(f"{'B':>3} {'ctx':>6} " + " ".join(f"{n[:16]:>16}" for n in names))
        for b, ctx in sorted({(r.params["batch"], r.params["context"]) for r in decode}):
            cells = [next((f"{r.gbps:16.0f}" for r in decode if r.provider == n and (r.params["batch"], r.params["context"]) == (b, ctx)), f"{'-':>16}") for n in names]
            print(f"{b:>3} {ctx:>6} " + " ".join(cells))
    print(f"wrote {path}")
    return 0
