"""Context parallelism: forward and backward of one long causal sequence on 1, 2 or 4 GPUs.

    torchrun --nproc-per-node 1 benchmarks/context_parallel.py          # the one-GPU baselines first
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py
    python benchmarks/context_parallel.py --plot benchmarks/results/context_parallel_<gpu>.json   # (matplotlib)

B=1, H=32, d=128, bf16, causal, N from --lengths (default 128k, 256k, 512k; a length that runs out of memory is
recorded as such). Providers, each at the same shapes:
  attngen         attngen.distributed.context_parallel_attention (on one GPU: attngen.attention)
  attngen_fused   the same with policy.context_parallel.FUSED_MERGE on: each step's partial merges into the
                  accumulator in one kernel, in place (several GPUs only; its speed-up is over attngen's one-GPU row)
  torch_cudnn     torch's context_parallel with SDPA's cuDNN backend (on one GPU: SDPA cuDNN)
  torch_flash     torch's context_parallel with SDPA's flash backend, torch's own kernels
  torch_attngen   torch's context_parallel with SDPA's flash backend and attngen in the flash slot
  attngen_window  attngen's, with a sliding window of --window keys on contiguous shards (load_balance=False: each
                  rank receives only the window's rows of its neighbour, not whole shards around the ring)
  attngen_softcap attngen's, with logits capped at --softcap (head-tail shards)
  attngen_alibi   attngen's, with ALiBi (the geometric slopes 2^(-8 (h + 1) / H); head-tail shards, a block per chunk
                  pair, each block's kernel reading its chunks' distance)
  attngen_sinks   attngen's, with a learned sink logit per head (-2 .. 2 over the heads; head-tail shards)
  flex_window     FlexAttention (compiled) under torch's context_parallel (its FLEX plan: K and V all-gathered, the
                  block mask sharded with them), the same window, contiguous shards (on one GPU: FlexAttention)
  flex_softcap    the same with --softcap as a score_mod, head-tail shards
  flex_alibi      the same with ALiBi's slopes as a score_mod, head-tail shards
  attngen_document attngen's over documents packed into the sequence (cu_seqlens; lengths drawn uniformly from 1 to
                  twice --document, seed 0, the same on every rank), causal within each, head-tail shards (on one
                  GPU: attngen.flash_attn_varlen_func)
  attngen_document_balanced  the same with balance_documents=True: part of the heavy ranks' document pieces runs on
                  the light ones (several GPUs only; its speed-up is over attngen_document's one-GPU row)
  attngen_document_early  the same with policy.context_parallel.LOANS_EARLY on: an executor runs the loans after the
                  first of its own pieces, so that their returns travel under the rest (several GPUs only)
  attngen_document_fused  balanced documents with policy.context_parallel.FUSED_MERGE on (several GPUs only)
  flex_document   FlexAttention under torch's context_parallel with a document block mask, head-tail shards
                  (the flex rows run where torch's FlexAttention context parallelism exists, found by its names,
                  not the version; elsewhere they are error rows)
Each run writes its rows into benchmarks/results/context_parallel_<gpu>.json as they finish (replacing rows of the
same provider, GPU count and length) and recomputes every row's `speedup`: the one-GPU row's time over its own, for
forward and forward + backward. attngen's, attngen_window's and attngen_document's (balanced too) rows on several
GPUs add the time of their kernels alone (`compute_*_ms`, the rank's blocks on its own keys) and `exposed_share`, the
part of forward + backward beyond it (the document rows also each rank's `shares` of the kept scores); after timing,
one more call of every attngen row on several GPUs runs under attngen.distributed.timeline(): the row gets `steps`
(each rank's phases, [{rank, pass, step, phase, ms}]: its kernels, merges and waits per step, and its "call") and
`exposed_by_step` (each rank's waits per pass and step, [{rank, pass, step, wait_ms, share}], share of that rank's
forward + backward call: the exposed communication, step by step), and rank 0 prints them as a table; the window,
softcap and document rows add `vs_flex`, FlexAttention's forward + backward time at the same GPU count and length
over theirs (the issue's target: >= 1.3). With --rounds R the providers of a length are measured in turn R times and
each row is its round of median forward + backward time (`rounds` lists them all: over a long run the GPUs' times
drift by more than the providers differ, NOTES v57); every row has `alloc_retries`, the caching allocator's retries
during it. Times are medians over --reps of the slowest rank's (CUDA events, a barrier
before each); TFLOP/s of the whole sequence by the FlashAttention convention (causal halved, backward 2.5x; documents
count their own causal scores). A script, not a test: GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROVIDERS = ("attngen", "attngen_fused", "torch_cudnn", "torch_flash", "torch_attngen", "attngen_window",
             "flex_window", "attngen_softcap", "flex_softcap", "attngen_alibi", "flex_alibi", "attngen_sinks",
             "attngen_document", "attngen_document_balanced", "attngen_document_early", "attngen_document_fused",
             "flex_document")
# attngen's rows that FlexAttention under context_parallel is the peer of
FLEX_PEERS = {"attngen_window": "flex_window", "attngen_softcap": "flex_softcap", "attngen_alibi": "flex_alibi",
              "attngen_document": "flex_document",
              "attngen_document_balanced": "flex_document", "attngen_document_early": "flex_document",
              "attngen_document_fused": "flex_document"}
# providers whose one-GPU row is another's (the same computation on one GPU)
ONE_GPU_ROW = {"attngen_fused": "attngen", "attngen_document_balanced": "attngen_document",
               "attngen_document_early": "attngen_document", "attngen_document_fused": "attngen_document"}
# attngen's providers on several GPUs that get the kernels-alone time
KERNELS_ALONE = ("attngen", "attngen_fused", "attngen_window", "attngen_document", "attngen_document_balanced",
                 "attngen_document_early", "attngen_document_fused")
# providers that run another's computation with a policy.context_parallel switch on
SWITCHED = {"attngen_fused": "FUSED_MERGE", "attngen_document_early": "LOANS_EARLY",
            "attngen_document_fused": "FUSED_MERGE"}
# the phases (attngen.distributed.timeline) that wait on an exchange: the communication left exposed
WAITS = ("exchange wait", "grads wait", "return wait", "loan rows wait", "returns wait")


def document_offsets(n: int, mean: int) -> list[int]:
    """Offsets (cu_seqlens) of documents packed into n positions, lengths uniform in 1 .. 2 * mean (the last cut at
    n); seed 0, so every rank draws the same."""
    import random

    rng, offsets = random.Random(0), [0]
    while offsets[-1] < n:
        offsets.append(min(n, offsets[-1] + rng.randint(1, 2 * mean)))
    return offsets


def flops(n: int, heads: int, d: int, window: int | None, backward: bool, documents: list[int] | None = None) -> float:
    """FlashAttention's count of the whole sequence: 4 B H N^2 d, halved when causal; a window counts its keys,
    documents (offsets) the causal scores of each."""
    if documents is not None:
        pairs = sum((b - a) ** 2 / 2 for a, b in zip(documents, documents[1:]))
    elif window is None:
        pairs = n * n / 2
    else:  # query i sees min(i + 1, window) keys
        w = min(window, n)
        pairs = w * (w + 1) / 2 + (n - w) * w
    forward = 4 * heads * pairs * d
    return forward * 3.5 if backward else forward  # forward + backward: 1 + 2.5


def timed(fn, reps: int, world: int) -> float:
    """Median ms of fn() over reps (one warm-up call first), each the slowest rank's."""
    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ms = torch.tensor(start.elapsed_time(end), device="cuda")
        if world > 1:
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        times.append(ms.item())
    return statistics.median(times)


def runner(provider: str, world: int, window: int, softcap: float, documents: list[int]):
    """(a context manager to run under, f(q, k, v) -> out) of one attngen or torch SDPA provider; q, k, v are this
    rank's shard (several GPUs) or the whole sequence (one)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.distributed import context_parallel_attention

    switch = switched_on(SWITCHED[provider]) if provider in SWITCHED else contextlib.nullcontext()
    if provider.startswith("attngen_document"):
        cu_seqlens = torch.tensor(documents, dtype=torch.int32, device="cuda")
        balance = provider != "attngen_document"
        if world > 1:
            return switch, lambda q, k, v: context_parallel_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens,
                                                                      balance_documents=balance)
        longest = max(b - a for a, b in zip(documents, documents[1:]))

        def varlen(q, k, v):  # (1, H, N, D) as (N, H, D) views: no copy
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
            out = attngen.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True)
            return out.transpose(0, 1)[None]

        return contextlib.nullcontext(), varlen
    if provider.startswith("attngen"):
        size = (window - 1, 0) if provider == "attngen_window" else (-1, -1)
        cap = softcap if provider == "attngen_softcap" else 0.0
        if world == 1:
            return contextlib.nullcontext(), lambda q, k, v: attngen.attention(
                q, k, v, is_causal=True, window_size=size, softcap=cap, **variant_tensors(provider, q.shape[1]))
        balance = provider != "attngen_window"
        return switch, lambda q, k, v: context_parallel_attention(
            q, k, v, causal=True, window_size=size, softcap=cap, load_balance=balance,
            **variant_tensors(provider, q.shape[1]))
    backend = SDPBackend.CUDNN_ATTENTION if provider == "torch_cudnn" else SDPBackend.FLASH_ATTENTION

    @contextlib.contextmanager
    def torch_sdpa():
        if provider == "torch_attngen":
            torch.nn.attention.activate_flash_attention_impl("attngen")
        try:
            with sdpa_kernel(backend):
                yield
        finally:
            if provider == "torch_attngen":
                torch.nn.attention.restore_flash_attention_impl()

    return torch_sdpa(), lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def alibi_slopes(heads: int):
    """ALiBi's geometric slopes, 2^(-8 (h + 1) / heads), float32 on the GPU."""
    import torch

    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda", dtype=torch.float32) / heads)


def variant_tensors(provider: str, heads: int) -> dict:
    """The run-time tensors of a variant provider's calls: ALiBi's slopes, or one sink logit per head (-2 .. 2)."""
    import torch

    if provider == "attngen_alibi":
        return {"alibi_slopes": alibi_slopes(heads)}
    if provider == "attngen_sinks":
        return {"sinks": torch.linspace(-2.0, 2.0, heads, device="cuda")}
    return {}


@contextlib.contextmanager
def switched_on(name: str):
    """policy.context_parallel's switch `name` on inside the block (the calls read it as they run)."""
    from attngen.policy import context_parallel

    before = getattr(context_parallel, name)
    setattr(context_parallel, name, True)
    try:
        yield
    finally:
        setattr(context_parallel, name, before)


def flex_context_parallel():
    """torch's FlexAttention context parallelism: the module torch.distributed.tensor.experimental._attention, with
    its FLEX plan, shard function and head-tail balancer; a RuntimeError naming what this torch lacks."""
    import torch
    from torch.distributed.tensor.experimental import _attention as cp

    missing = [name for name in ("_ContextParallel", "_context_parallel_shard", "_HeadTailLoadBalancer")
               if not hasattr(cp, name)]
    if not missing and not hasattr(getattr(cp._ContextParallel, "AttentionType", None), "FLEX"):
        missing = ["_ContextParallel.AttentionType.FLEX"]
    if missing:
        raise RuntimeError(f"torch {torch.__version__} has no FlexAttention context parallelism: "
                           f"{', '.join(missing)} missing from torch.distributed.tensor.experimental._attention")
    return cp


def flex_runner(provider: str, world: int, mesh, full, window: int, softcap: float, documents: list[int]):
    """(this rank's q, k, v, f(q, k, v) -> out) of a FlexAttention provider: on several GPUs under torch's
    context_parallel FLEX plan (a module whose pre-hook all-gathers K and V), the block mask sharded with q, k, v
    (head-tail for the causal softcap, ALiBi and documents, contiguous for the window, as attngen's rows)."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask

    from attngen.bench.common import compiled_flex_attention

    flex = compiled_flex_attention()
    n = full[0].shape[2]
    if provider == "flex_window":
        mask_mod, score_mod = (lambda b, h, i, j: (i >= j) & (i - j < window)), None
    elif provider == "flex_document":
        # each position's document (global positions: torch's sharding maps a shard's rows back to them)
        ends = torch.tensor(documents[1:], dtype=torch.int32, device="cuda")
        doc = torch.bucketize(torch.arange(n, device="cuda", dtype=torch.int32), ends, right=True)
        mask_mod, score_mod = (lambda b, h, i, j: (i >= j) & (doc[i] == doc[j])), None
    elif provider == "flex_alibi":
        slopes = alibi_slopes(full[0].shape[1])
        mask_mod = lambda b, h, i, j: i >= j  # noqa: E731
        score_mod = lambda score, b, h, i, j: score - slopes[h] * (i - j).abs()  # noqa: E731
    else:
        mask_mod = lambda b, h, i, j: i >= j  # noqa: E731
        score_mod = lambda score, b, h, i, j: softcap * torch.tanh(score / softcap)  # noqa: E731
    # (_compile: built blockwise; the eager form materialises the n x n mask, out of memory at 128k on an H200)
    mask = create_block_mask(mask_mod, 1, 1, n, n, device="cuda", _compile=True)
    if world == 1:
        return (*full, lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=mask))
    cp = flex_context_parallel()

    class Flex(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return flex(*args, **kwargs)

    plan = cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX)
    module = parallelize_module(Flex(), mesh, plan)
    balancer = None if provider == "flex_window" else cp._HeadTailLoadBalancer(n, world, torch.device("cuda"))
    *shards, shard_mask = cp._context_parallel_shard(mesh, [*full, mask], [2] * 4, load_balancer=balancer)
    return (*shards, lambda q, k, v: module(q, k, v, score_mod=score_mod, block_mask=shard_mask))


def measure(provider: str, world: int, rank: int, mesh, n: int, heads: int, d: int, window: int, softcap: float,
            document: int, reps: int) -> dict:
    """One row: forward and forward + backward times of `provider` at length n on `world` GPUs (documents of mean
    length `document` for the document rows)."""
    import torch
    from torch.distributed.tensor.experimental import context_parallel

    from attngen.distributed import shard_sequence

    torch.manual_seed(0)
    full = [torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    cp = None
    context = contextlib.nullcontext()
    documents = document_offsets(n, document) if "document" in provider else None
    if provider.startswith("flex"):
        *shards, fn = flex_runner(provider, world, mesh, full, window, softcap, documents)
    else:
        context, fn = runner(provider, world, window, softcap, documents)
        if provider.startswith("torch") and world > 1:
            shards = full  # torch's context_parallel shards these in place, head-tail
            cp = context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2])
        elif world > 1:
            balance = provider != "attngen_window"
            shards = [shard_sequence(t, world, rank, load_balance=balance).contiguous() for t in full]
        else:
            shards = full
    del full
    with context, (cp if cp is not None else contextlib.nullcontext()):
        q, k, v = (t.detach().requires_grad_() for t in shards)
        do = torch.randn_like(q)
        forward_ms = timed(lambda: fn(q, k, v), reps, world)
        both_ms = timed(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), reps, world)
        extra = {}
        if provider.startswith("attngen") and world > 1:
            extra = step_timeline(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), world, rank)
    size = window if provider.endswith("window") else None
    if provider in KERNELS_ALONE and world > 1:
        extra.update(exposed_communication(q, k, v, do, world, rank, reps, provider, window, documents))
        extra["exposed_share"] = 1 - extra["compute_forward_backward_ms"] / both_ms
    if documents is not None:
        extra["documents"] = len(documents) - 1
    return {**extra, "provider": provider, "gpus": world, "n": n, "heads": heads, "head_dim": d, "window": size,
            "softcap": softcap if provider.endswith("softcap") else None,
            "forward_ms": forward_ms, "forward_backward_ms": both_ms,
            "forward_tflops": flops(n, heads, d, size, False, documents) / forward_ms / 1e9,
            "forward_backward_tflops": flops(n, heads, d, size, True, documents) / both_ms / 1e9}


def exposed_communication(q, k, v, do, world: int, rank: int, reps: int, provider: str, window: int,
                          documents: list[int] | None) -> dict:
    """The time of the kernels alone of this rank's schedule (the causal ring's blocks, with documents one per
    document piece but a varlen call for each run of pieces against their own keys, balanced: the rank's own blocks
    and those it runs for others, or the window's blocks on its own keys and its neighbour's rows, all run on its
    own keys: no exchange, no merge), forward and forward + backward; what the call takes beyond it is exposed
    communication (and merging); with documents, each rank's `shares` of the kept scores over the mean."""
    import torch

    import attngen
    from attngen.distributed import Pieces, balanced_schedule, grouped_pieces, halo_schedule, ring_schedule, shares
    from attngen.lang.builtin import NO_WINDOW
    from attngen.policy import context_parallel

    extra = {}
    if provider == "attngen_window":
        halo = halo_schedule(world, q.shape[2], True, (window - 1, 0), False)[rank]
        blocks = [halo.own, *halo.before, *halo.after]
    else:
        schedule = ring_schedule(world, q.shape[2], True, NO_WINDOW, True, documents and tuple(documents))
        loans = ()
        if provider.startswith("attngen_document_"):
            schedule, loans = balanced_schedule(schedule, context_parallel.BALANCE)
        blocks = [b for step in schedule[rank] for b in (grouped_pieces(step) if documents else step)]
        blocks += [b for loan in loans if loan.executor == rank for b in loan.blocks]
        if documents:
            extra["shares"] = shares(schedule, loans)

    def kernels():
        for b in blocks:
            rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
            if isinstance(b, Pieces):  # (B = 1: packed (rows, heads, dim) views of the shard's rows)
                cu = torch.tensor(b.offsets, dtype=torch.int32, device=q.device)
                longest = max(y - x for x, y in zip(b.offsets, b.offsets[1:]))
                out = attngen.flash_attn_varlen_func(*(t[0, :, rows].transpose(0, 1) for t in (q, k, v)), cu, cu,
                                                     longest, longest, causal=b.causal)
                yield out, (q, k, v), do[0, :, rows].transpose(0, 1)
                continue
            out = attngen.attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], is_causal=b.causal,
                                    window_size=b.window)
            yield out, (q, k, v), do[:, :, rows]

    def forward():
        for _ in kernels():
            pass

    def both():
        for out, inputs, grad in kernels():
            torch.autograd.grad(out, inputs, grad)

    return {**extra, "compute_forward_ms": timed(forward, reps, world),
            "compute_forward_backward_ms": timed(both, reps, world)}


def step_timeline(call, world: int, rank: int) -> dict:
    """{"steps", "exposed_by_step"} of one call (forward and backward) recorded under attngen.distributed.timeline()
    on every rank, gathered (see the module's docstring); rank 0 prints them as a table."""
    import torch
    import torch.distributed as dist

    from attngen.distributed import timeline

    dist.barrier()
    torch.cuda.synchronize()
    with timeline() as recorded:
        call()
    torch.cuda.synchronize()
    every = [None] * world
    dist.all_gather_object(every, recorded.rows())
    steps = [{"rank": r, **row} for r, rows in enumerate(every) for row in rows]
    exposed = []
    for r, rows in enumerate(every):
        whole = sum(row["ms"] for row in rows if row["phase"] == "call")
        waits: dict[tuple, float] = {}
        for row in rows:
            if row["phase"] in WAITS:
                waits[row["pass"], row["step"]] = waits.get((row["pass"], row["step"]), 0.0) + row["ms"]
        exposed += [{"rank": r, "pass": p, "step": s, "wait_ms": ms, "share": ms / whole}
                    for (p, s), ms in sorted(waits.items(), key=lambda x: (x[0][0] != "forward", x[0][1]))]
    if rank == 0:
        print(step_table(steps), flush=True)
    return {"steps": steps, "exposed_by_step": exposed}


def step_table(steps: list[dict]) -> str:
    """Each rank's recorded call, a line per pass and step: ms of its kernels, merges and waits (the loans' own
    columns), and the pass's call."""
    columns = {"kernels": ("kernels", "loan kernels"), "merges": ("merge", "loan merge", "returns merge"),
               "waits": WAITS}
    lines = ["rank pass     step   kernels    merges     waits      call"]
    keys = sorted({(r["rank"], r["pass"], r["step"]) for r in steps},
                  key=lambda x: (x[0], x[1] != "forward", x[2] is None, x[2] or 0))
    for rank, pass_, step in keys:
        mine = [r for r in steps if (r["rank"], r["pass"], r["step"]) == (rank, pass_, step)]
        if step is None:
            lines.append(f"{rank:4} {pass_:8} call {'':30}{sum(r['ms'] for r in mine):10.3f}")
            continue
        sums = [sum(r["ms"] for r in mine if r["phase"] in names) for names in columns.values()]
        lines.append(f"{rank:4} {pass_:8} {step:4}" + "".join(f"{x:10.3f}" for x in sums))
    return "\n".join(lines)


def with_speedups(rows: list[dict]) -> list[dict]:
    """rows with `speedup` (forward + backward) and `forward_speedup` over the one-GPU row of their provider and
    length (None where there is none), and attngen's window and softcap rows with `vs_flex` where their
    FlexAttention row at the same GPU count and length exists."""
    base = {(r["provider"], r["n"]): r for r in rows if r["gpus"] == 1 and "forward_ms" in r}
    for r in rows:
        one = base.get((ONE_GPU_ROW.get(r["provider"], r["provider"]), r["n"]))
        ok = one is not None and "forward_ms" in r
        r["speedup"] = one["forward_backward_ms"] / r["forward_backward_ms"] if ok else None
        r["forward_speedup"] = one["forward_ms"] / r["forward_ms"] if ok else None
    timed_rows = {(r["provider"], r["gpus"], r["n"]): r for r in rows if "forward_ms" in r}
    for r in rows:
        flex = timed_rows.get((FLEX_PEERS.get(r["provider"]), r["gpus"], r["n"]))
        if flex is not None and "forward_ms" in r:
            r["vs_flex"] = flex["forward_backward_ms"] / r["forward_backward_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--softcap", type=float, default=30.0)
    parser.add_argument("--document", type=int, default=8192, help="the documents' mean length")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the providers of a length in turn this many times; each row is the round of "
                             "median forward + backward time (its `rounds`: every round's), so that a drift over "
                             "the run falls on every provider alike")
    parser.add_argument("-o", "--output", default=None)
    parser.add_argument("--plot", metavar="JSON", help="draw the plot of a results file and exit")
    args = parser.parse_args()
    if args.plot:
        return plot(Path(args.plot))

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from attngen.bench.prefill import gpu_slug

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = None
    if world > 1:
        dist.init_process_group("nccl")
        mesh = init_device_mesh("cuda", (world,))
    path = Path(args.output or ROOT / "benchmarks" / "results" /
                f"context_parallel_{gpu_slug(torch.cuda.get_device_name())}.json")
    for n in args.lengths:
        rounds = {}  # provider: its rows so far at this length
        for r in range(args.rounds):
            for provider in args.providers:
                if world == 1 and provider in ONE_GPU_ROW:
                    continue
                retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
                try:
                    row = measure(provider, world, rank, mesh, n, args.heads, 128, args.window, args.softcap,
                                  args.document, args.reps)
                except torch.OutOfMemoryError:
                    row = {"provider": provider, "gpus": world, "n": n, "error": "out of memory"}
                except Exception as e:  # a provider this torch cannot run is a row, not the end of the run
                    row = {"provider": provider, "gpus": world, "n": n, "error": f"{type(e).__name__}: {e}"[:300]}
                # (the caching allocator's retries: each frees cached blocks and synchronises the device)
                row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
                torch.cuda.empty_cache()
                rounds.setdefault(provider, []).append(row)
                row = median_round(rounds[provider])
                if rank == 0:
                    print(json.dumps({**row, "round": r}), flush=True)
                    # (after every row: a run stopped by its time limit keeps the rows it finished)
                    save(path, [row])
    if world > 1:
        dist.destroy_process_group()


def median_round(rows: list[dict]) -> dict:
    """Of one provider's rows at one length, one a round: the round of median forward + backward time (the upper one
    of an even count), with `rounds`, every round's (forward, forward + backward) ms, where there are several; an
    error row where no round ran."""
    timed_rows = [r for r in rows if "forward_backward_ms" in r]
    if not timed_rows:
        return rows[-1]
    ranked = sorted(timed_rows, key=lambda r: r["forward_backward_ms"])
    row = dict(ranked[len(ranked) // 2])
    if len(rows) > 1:
        row["rounds"] = [[r.get("forward_ms"), r.get("forward_backward_ms")] for r in rows]
    return row


def save(path: Path, rows: list[dict]) -> None:
    """Write `rows` into the results file at `path`, replacing its rows of the same provider, GPU count and length."""
    import torch

    old = json.loads(path.read_text())["rows"] if path.exists() else []
    fresh = {(r["provider"], r["gpus"], r["n"]) for r in rows}
    merged = [r for r in old if (r["provider"], r["gpus"], r["n"]) not in fresh] + rows
    merged.sort(key=lambda r: (r["provider"], r["n"], r["gpus"]))
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "rows": with_speedups(merged)}, indent=1) + "\n")


def plot(path: Path) -> None:
    """TFLOP/s (forward + backward) against GPU count, a panel per length; written beside the JSON as .png."""
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(path.read_text())["rows"] if "forward_ms" in r]
    lengths = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        drawn = 0
        for provider in PROVIDERS:
            mine = sorted((r["gpus"], r["forward_backward_tflops"]) for r in rows
                          if r["n"] == n and r["provider"] == provider)
            if mine:  # (past the colour cycle's ten, another line style and marker)
                ax.plot(*zip(*mine), marker="os^"[drawn // 10 % 3], linestyle=("-", "--", ":")[drawn // 10 % 3],
                        label=provider)
                drawn += 1
        ax.set_title(f"N={n // 1024}k, B=1 H=32 d=128 bf16 (causal; variants by name)", fontsize="medium")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_xticks(sorted({r["gpus"] for r in rows}))
        ax.legend(fontsize="x-small", loc="upper left", ncols=2 if drawn > 8 else 1)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
