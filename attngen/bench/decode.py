"""Decoding speed on the GPU: attngen's KV-cache kernels against torch SDPA, one process.

    attngen bench --suite decode            (rows into benchmarks/results/<gpu>.json)
    python -m attngen.bench.decode OUT_DIR  (decode_bench.json with the CUDA-graph check)

One new token per sequence (seqlen_q = 1) against a full cache: batch 1, 16, 64 x context 1k, 8k,
32k; 32 query heads, 8 kv heads, d = 128, bf16. Measured on the same fresh random data (never
zeros), triton.testing.do_bench medians:
  attngen contiguous     attention_with_kvcache on a (B, ctx, 8, 128) cache, splits chosen (auto),
                         cache_seqlens = ctx as an int: every sequence full, the problem SDPA's
                         backends are given (they take no lengths); the launch takes the tuned
                         bucket's config for equal lengths
  attngen contig 1 split the same with num_splits=1 (what split-KV buys)
  attngen paged 16 / 64  the same tokens in a pool of 16- or 64-token pages, pages shuffled
  ... [graph]            the same call captured in a CUDA graph and replayed (no Python launch cost)
  attngen ... lens [graph]
                         contiguous and paged 16 with cache_seqlens as a (B,) tensor (lengths the
                         call cannot know are equal: the bucket's config for mixed lengths)
  sdpa flash / cudnn / efficient
                         torch SDPA with the FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION
                         backend on the contiguous cache viewed (B, 8, ctx, 128), enable_gqa=True (or,
                         where a backend refuses GQA, the K/V heads repeated to 32: noted as
                         "expanded"), timed as CUDA-graph replays
  flex                   FlexAttention, compiled (static shapes, dynamo's recompile limit raised so
                         it never falls back to eager), enable_gqa=True, no mask: a full cache
  naive                  softmax(q k^T) v in PyTorch, the 4 query heads of a K/V head as one matmul
  attngen fp8 contiguous / paged 16 (and [graph], [layers])
                         the same calls on an FP8 (e4m3) cache of the same tokens (per-head k_descale,
                         v_descale), bf16 queries and output (issue 52): checked against attngen on the
                         dequantised bf16 cache; the note gives the speed-up over the bf16 row of the
                         same name (tokens per second, batch / time), and paged's ratio to contiguous
  (every peer's output is checked against attngen contiguous before it is timed)
  ... [layers]           one decoding step of a model: L layers' attention back to back in one CUDA
                         graph, each layer on its own cache (L = 256 MB / one layer's K/V, 1 to 16,
                         so the caches do not fit in L2 together), time / L. A replay of one call
                         alone also counts the graph's launch latency (about 10 us on an H200,
                         common to every provider), which a model pays once per step, not per layer
Bandwidth = K/V bytes of the cache, 2 * B * ctx * H_kv * d * 2 (1 for an FP8 cache), over the time. Every attngen
variant is checked against the contiguous one. Then one decode step (B=16, 8k, paged 16) is
captured in a CUDA graph, replayed on new query data, and compared with an eager call.
Writes OUT_DIR/decode_bench.json and prints a table last.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from ..api.kvcache import attention_with_kvcache
from .common import Row, compiled_flex_attention

H, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 8192, 32768)


def bench(fn) -> float:
    # NOTE: triton is imported where it is used, not at the top: the CLI imports this module before it decides
    # whether Triton interprets kernels (no GPU), and Triton fixes that when it is first imported
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float:
    """The same call captured in a CUDA graph and replayed: the GPU time without Python's launch cost
    (at batch 1 and 1k keys a decode step takes microseconds, less than the Python around it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def layer_count(batch: int, ctx: int) -> int:
    """Layers of the [layers] measurement: enough caches for 256 MB of K/V, 1 to 16."""
    per_layer = 2 * batch * ctx * H_KV * D * DTYPE.itemsize
    return max(1, min(16, -(-(256 << 20) // per_layer)))


def bench_layers(calls) -> float:
    """Per-call time of `calls` (one per layer, each on its own data) replayed as one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return bench(graph.replay) / len(calls)


def gbps(batch: int, ctx: int, ms: float, itemsize: int = DTYPE.itemsize) -> float:
    return 2 * batch * ctx * H_KV * D * itemsize / (ms * 1e-3) / 1e9


def paged_copy(cache: torch.Tensor, page: int, perm: torch.Tensor) -> torch.Tensor:
    """The contiguous cache (B, ctx, H_KV, D) in a pool of pages placed at `perm`."""
    pages = cache.reshape(-1, page, *cache.shape[2:])
    pool = torch.empty_like(pages)
    pool[perm] = pages
    return pool


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = getattr(SDPBackend, backend)

    def make(q4, k4, v4, expand):
        if expand:
            k4, v4 = k4.repeat_interleave(H // H_KV, dim=1), v4.repeat_interleave(H // H_KV, dim=1)

        def fn():
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=not expand)
        return fn
    return make


def _flex_call(q4, k4, v4, expand):
    if expand:
        return None  # FlexAttention takes GQA as it is
    flex = compiled_flex_attention()
    return lambda: flex(q4, k4, v4, enable_gqa=True)


def _naive_call(q4, k4, v4, expand):
    if expand:
        return None  # takes GQA as it is
    b, h, n_q, d = q4.shape
    qg = q4.reshape(b, H_KV, (h // H_KV) * n_q, d)  # the query heads of one K/V head are adjacent
    scale = 1.0 / d ** 0.5

    def fn():
        p = torch.softmax((qg @ k4.transpose(-1, -2)).float() * scale, dim=-1).to(q4.dtype)
        return (p @ v4).view(b, h, n_q, d)
    return fn


def sdpa(backend, q, k, v, caches=None):
    """One SDPA backend timed as `peer` times it ."""
    return peer(_sdpa(backend), q, k, v, None, caches)


# name -> make(q4, k4, v4, expand) -> fn(): a peer's decode call on (B, heads, seq, d) views, with
# the K/V heads repeated to H if `expand` (None: this peer takes GQA as it is)
PEERS = {
    "sdpa flash": _sdpa("FLASH_ATTENTION"),
    "sdpa cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex": _flex_call,
    "naive": _naive_call,
}


def peer(make, q, k, v, want=None, caches=None):
    """Time one peer as CUDA-graph replays: one call on (k, v), or with `caches` (a list of (k, v),
    one per layer) the per-layer time of all of them in one graph. GQA as the peer takes it, or,
    where it refuses, with the K/V heads repeated ("expanded"). Its output on (k, v) must match
    `want` (attngen's, (B, 1, H, D)) if given. Returns (ms, note), ms None where it cannot run or
    disagrees."""
    q4 = q.transpose(1, 2)
    error = None
    for expand in (False, True):
        fns = None
        try:
            fns = [make(q4, kl.transpose(1, 2), vl.transpose(1, 2), expand) for kl, vl in (caches or [(k, v)])]
            if fns[0] is None:
                break
            with warnings.catch_warnings():  # SDPA warns before it refuses enable_gqa: the refusal is the note
                warnings.simplefilter("ignore")
                out = fns[0]()  # raises where the peer refuses these inputs
            err = 0.0 if want is None else (out.transpose(1, 2).float() - want.float()).abs().max().item()
            if not err <= 2e-2:
                return None, f"error: disagrees with attngen (max |diff| {err:.1e})"
            ms = bench_layers(fns) if caches else bench_graph(fns[0])
            return ms, ("expanded heads" if expand else "gqa") + ", CUDA graph"
        except Exception as e:  # noqa: BLE001 - a peer may refuse enable_gqa: repeat the heads
            error = e
        finally:
            del fns
            torch.cuda.empty_cache()
    return None, f"error: {type(error).__name__}: {_reason(error)}"


def _reason(error: Exception) -> str:
    """An exception's first line, and the innermost error named in the rest (Inductor's errors carry
    the real reason, e.g. a Triton CompilationError, many lines down)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return ""
    inner = [line for line in lines[1:] if re.search(r"[A-Za-z]+Error\b", line)]
    return lines[0][:100] + (f" ... {inner[-1][:200]}" if inner else "")


def one_shape(batch: int, ctx: int, gen: torch.Generator) -> dict:
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(batch, ctx, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    row = {"batch": batch, "context": ctx, "ms": {}, "GB/s": {}, "notes": {}}

    def record(name, ms, note=None, itemsize=DTYPE.itemsize):
        row["ms"][name] = ms
        row["GB/s"][name] = None if ms is None else gbps(batch, ctx, ms, itemsize)
        if note:
            row["notes"][name] = note

    ref = attention_with_kvcache(q, k, v, seqlens)
    full = ctx  # every sequence holds ctx keys: cache_seqlens as an int says so
    err = (attention_with_kvcache(q, k, v, full).float() - ref.float()).abs().max().item()
    if err > 2e-2:
        raise SystemExit(f"int cache_seqlens disagrees with the tensor at B={batch} ctx={ctx}: {err}")
    record("attngen contiguous", bench(lambda: attention_with_kvcache(q, k, v, full)))
    record("attngen contig 1 split", bench(lambda: attention_with_kvcache(q, k, v, full, num_splits=1)))
    record("attngen contiguous [graph]", bench_graph(lambda: attention_with_kvcache(q, k, v, full)))
    record("attngen contiguous lens [graph]", bench_graph(lambda: attention_with_kvcache(q, k, v, seqlens)))
    for page in (16, 64):
        n_pages = batch * ctx // page
        perm = torch.randperm(n_pages, device="cuda", generator=gen)
        kp, vp = paged_copy(k, page, perm), paged_copy(v, page, perm)
        table = perm.view(batch, ctx // page).to(torch.int32)
        out = attention_with_kvcache(q, kp, vp, full, table)
        err = max((o.float() - ref.float()).abs().max().item()
                  for o in (out, attention_with_kvcache(q, kp, vp, seqlens, table)))
        record(f"attngen paged {page}", bench(lambda: attention_with_kvcache(q, kp, vp, full, table)),
               f"max |diff| vs contiguous {err:.1e}")
        if page == 16:
            record("attngen paged 16 [graph]", bench_graph(lambda: attention_with_kvcache(q, kp, vp, full, table)))
            record("attngen paged 16 lens [graph]",
                   bench_graph(lambda: attention_with_kvcache(q, kp, vp, seqlens, table)))
        if err > 2e-2:
            raise SystemExit(f"paged {page} disagrees with contiguous at B={batch} ctx={ctx}: {err}")
        kp = vp = None  # (freed; rebound, not deleted: the timed lambdas name them)
    fp8_rows(q, k, v, full, gen, record, row["ms"])
    for name, make in PEERS.items():
        ms, note = peer(make, q, k, v, ref)
        record(name, ms, note)
    layers = layer_count(batch, ctx)
    caches = [(k, v)] + [(torch.randn(k.shape, device="cuda", dtype=DTYPE, generator=gen),
                          torch.randn(v.shape, device="cuda", dtype=DTYPE, generator=gen)) for _ in range(layers - 1)]
    note = f"{layers} layers in one CUDA graph"
    record("attngen contiguous [layers]", bench_layers([
        (lambda kl=kl, vl=vl: attention_with_kvcache(q, kl, vl, full)) for kl, vl in caches]), note)
    perm = torch.randperm(batch * ctx // 16, device="cuda", generator=gen)
    table = perm.view(batch, ctx // 16).to(torch.int32)
    pools = [(paged_copy(kl, 16, perm), paged_copy(vl, 16, perm)) for kl, vl in caches]
    record("attngen paged 16 [layers]", bench_layers([
        (lambda kp=kp, vp=vp: attention_with_kvcache(q, kp, vp, full, table)) for kp, vp in pools]), note)
    del pools
    for name, make in PEERS.items():
        ms, why = peer(make, q, k, v, ref, caches)
        record(f"{name} [layers]", ms, f"{note}; {why}")
    q = k = v = caches = None
    torch.cuda.empty_cache()
    return row


FP8 = torch.float8_e4m3fn


def fp8_rows(q, k, v, full: int, gen: torch.Generator, record, times: dict) -> None:
    """The FP8-cache rows (issue 52): the bf16 cache quantised per K/V head (k / k_descale in e4m3, scales from
    each head's absolute maximum as a calibration would set them), contiguous and in shuffled 16-token pages, timed
    eagerly, as a CUDA-graph replay and as layers; each checked against attngen on the dequantised cache, and
    noted with its speed-up over the bf16 row of the same name in `times` (tokens per second = batch / time)."""
    batch, ctx = k.shape[0], k.shape[1]
    k_descale, v_descale = (t.abs().amax(dim=(0, 1, 3)).float() / 448.0 for t in (k, v))
    k8 = (k.float() / k_descale[:, None]).to(FP8)
    v8 = (v.float() / v_descale[:, None]).to(FP8)
    want = attention_with_kvcache(q, (k8.float() * k_descale[:, None]).to(DTYPE),
                                  (v8.float() * v_descale[:, None]).to(DTYPE), full)
    scales = dict(k_descale=k_descale, v_descale=v_descale)
    perm = torch.randperm(batch * ctx // 16, device=k.device, generator=gen)
    table = perm.view(batch, ctx // 16).to(torch.int32)
    kp, vp = paged_copy(k8, 16, perm), paged_copy(v8, 16, perm)
    calls = {"contiguous": lambda: attention_with_kvcache(q, k8, v8, full, **scales),
             "paged 16": lambda: attention_with_kvcache(q, kp, vp, full, table, **scales)}
    for layout, call in calls.items():
        err = (call().float() - want.float()).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"fp8 {layout} disagrees with the dequantised cache at B={batch} ctx={ctx}: {err}")
        for suffix, timer in (("", bench), (" [graph]", bench_graph)):
            bf16 = f"attngen {layout}{suffix}"
            ms = timer(call)
            note = f"x{times[bf16] / ms:.2f} bf16's tokens/s" if times.get(bf16) else ""
            if layout == "paged 16" and times.get(f"attngen fp8 contiguous{suffix}"):
                note += f"; x{times[f'attngen fp8 contiguous{suffix}'] / ms:.2f} of fp8 contiguous"
            record(f"attngen fp8 {layout}{suffix}", ms, note, itemsize=FP8.itemsize)


def graph_check(gen: torch.Generator) -> dict:
    batch, ctx, page = 16, 8192, 16
    k = torch.randn(batch * ctx // page, page, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    table = torch.randperm(k.shape[0], device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    seqlens = torch.randint(1, ctx + 1, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    q = torch.randn(batch, 1, H, D, device="cuda", dtype=DTYPE, generator=gen)
    step = lambda: attention_with_kvcache(q, k, v, seqlens, table)  # noqa: E731
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn(q.shape, device="cuda", dtype=DTYPE, generator=gen))
    graph.replay()
    eager = step()
    equal = torch.equal(out, eager)
    return {"batch": batch, "context": ctx, "page": page, "replay equals eager": equal,
            "eager ms": bench(step), "replay ms": bench(graph.replay)}


def bench_decode(progress=print) -> list:
    """The decode grid as `attngen.bench.common.Row`s (suite "decode", GB/s of K/V read)."""
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            shape = one_shape(batch, ctx, gen)
            params = dict(batch=batch, context=ctx, heads=H, kv_heads=H_KV, head_dim=D, dtype="bf16", seqlen_q=1)
            for name, ms in shape["ms"].items():
                provider = name.replace(" ", "_").replace("[", "").replace("]", "")
                rows.append(Row("decode", "forward", provider, params, ms=ms, gbps=shape["GB/s"][name],
                                error=None if ms is not None else shape["notes"].get(name, "error"),
                                extra={"note": shape["notes"][name]} if name in shape["notes"] else {}))
            progress(f"decode B={batch} ctx={ctx} done")
    graph = graph_check(gen)
    rows.append(Row("decode", "forward", "cuda_graph_check", dict(batch=graph["batch"], context=graph["context"],
                    page=graph["page"]), ms=graph["replay ms"], extra={k: v for k, v in graph.items()}))
    if not graph["replay equals eager"]:
        raise SystemExit("a CUDA-graph replay of a decode step differs from the eager call")
    return rows


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    started = time.time()
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(one_shape(batch, ctx, gen))
            print(f"B={batch} ctx={ctx}: " + ", ".join(f"{n} {g:.0f}" for n, g in rows[-1]["GB/s"].items() if g),
                  flush=True)
    graph = graph_check(gen)
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "heads": H, "kv_heads": H_KV, "head_dim": D, "dtype": "bf16", "seqlen_q": 1, "rows": rows,
              "cuda_graph": graph, "seconds": time.time() - started}
    with open(os.path.join(out_dir, "decode_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    names = list(rows[0]["GB/s"])
    print(f"\nK/V read bandwidth, GB/s ({result['device']}, 32/8 heads, d=128, bf16, one query token)")
    print(f"{'B':>3} {'ctx':>6} " + " ".join(f"{n.replace('attngen ', ''):>14}" for n in names))
    for r in rows:
        cells = [f"{r['GB/s'][n]:14.0f}" if r["GB/s"][n] else f"{'-':>14}" for n in names]
        print(f"{r['batch']:>3} {r['context']:>6} " + " ".join(cells))
    notes = {f"{r['batch']}x{r['context']} {n}": t for r in rows for n, t in r["notes"].items() if "paged" not in n}
    if notes:
        print("notes:", notes)
    print(f"CUDA graph (B=16, 8k, paged 16): replay equals eager: {graph['replay equals eager']}; "
          f"eager {graph['eager ms'] * 1e3:.0f} us, replay {graph['replay ms'] * 1e3:.0f} us")
    return 0 if graph["replay equals eager"] else 1


if __name__ == "__main__":
    sys.exit(main())
