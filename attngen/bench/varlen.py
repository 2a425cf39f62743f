"""`attngen bench --suite varlen`: packed variable-length batches, and attngen in PyTorch's flash-attention slot.

bf16, d=128, H=16, in one process with the peers. Rows (`params["case"]`):
- `documents`: 8 documents of random lengths packed into 16,384 tokens, causal, forward and backward: attngen
  (`flash_attn_varlen_func`), FlexAttention with a document mask (compiled as the prefill suite measures it; its
  `create_block_mask` runs once, outside the timing), torch's `varlen_attn` (FA2 in torch 2.11) and cuDNN's dense
  causal over the whole 16k (SDPA; the reference: it computes every document's scores against the others').
- `long_and_short`: one 16k prompt beside 63 prompts of 256 tokens, causal forward, against the 16k prompt alone
  (`extra["ratio"]`: the batch's time over the prompt's).
- `mixed`: one serving step, 4 new prompts of 2,048 tokens and 60 decodes over paged caches of 1k..32k keys
  (pages of 64), in one varlen paged call, against the prefill call plus `attention_with_kvcache`'s decode call
  (`extra["ratio"]`: separate over one call).
- `slot`: SDPA under the flash backend with "attngen" activated against `attngen.attention`, on the prefill
  suite's shapes (batch 16384 / N, d=128), forward and backward.

TFLOP/s count the kept scores (FlashAttention's convention per sequence: 4 * d per kept score forward, x2.5
backward), causal aligned bottom-right per sequence. A peer that cannot run (absent from this torch, or failing)
gives a row with its error. `--check` runs every row's attngen path (and the slot's ops, called directly) at tiny
sizes against float64 instead of timing; on a CPU in Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from ..api.kvcache import attention_with_kvcache
from ..api.sdpa import attention
from ..api.varlen import flash_attn_varlen_func
from ..integrations import torch_flash
from ..testing.packed import cu_seqlens, document_lengths
from ..testing.reference import kvcache_attention, varlen_attention
from .common import Row, compiled_flex_attention, error_text
from .prefill import PREFILL_LENGTHS, _median_ms, run_suite

PROVIDERS = ("attngen", "flex", "varlen_attn", "sdpa_cudnn", "slot")
FULL = dict(tokens=16384, documents=8, heads=16, head_dim=128, short=256, shorts=63, prompts=4, prompt=2048,
            decodes=60, min_cache=1024, max_cache=32768, page_size=64)
TINY = dict(tokens=96, documents=3, heads=2, head_dim=32, short=8, shorts=5, prompts=2, prompt=16, decodes=3,
            min_cache=8, max_cache=40, page_size=16)
CHECK_REL = 2e-2  # a check: ||out - ref|| / ||ref|| under this (bf16 inputs and output)


def kept_scores(lengths_q, lengths_k, causal: bool) -> int:
    """Scores a batch keeps: every pair of each sequence, or under a causal mask aligned bottom-right the keys up
    to each query's position (query i of L over S keys sees min(S, S - L + i + 1) of them)."""
    kept = 0
    for n_q, n_k in zip(lengths_q, lengths_k):
        if not causal:
            kept += n_q * n_k
        elif n_q <= n_k:
            kept += n_q * (n_k - n_q) + n_q * (n_q + 1) // 2
        else:  # (the first n_q - n_k queries see no key)
            kept += n_k * (n_k + 1) // 2
    return kept


def _tflops(kept: int, heads: int, head_dim: int, ms: float, backward: bool) -> float:
    return 4 * head_dim * heads * kept * (2.5 if backward else 1.0) / ms / 1e9


def _timed(fn, inputs, direction) -> float:
    """fn's median time: forward without autograd, backward as torch.autograd.grad on a retained graph."""
    if direction == "forward":
        with torch.no_grad():
            fn()
            return _median_ms(fn)
    out = fn()
    do = torch.randn_like(out)
    torch.autograd.grad(out, inputs, do, retain_graph=True)
    return _median_ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True))


def _accuracy(out, ref) -> str | None:
    """A check's verdict: None when the output is within CHECK_REL of the float64 reference."""
    rel = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return None if rel < CHECK_REL else f"relative error {rel:.3g} against float64"


def _packed(lengths, heads, head_dim, device, generator, grad=False):
    # (drawn by the host's generator, then moved: one generator serves every tensor of a run on any device)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, generator=generator).to(device, torch.bfloat16)
               .requires_grad_(grad) for _ in range(3))
    return q, k, v


def documents_rows(size: dict, device, check: bool, names, directions, generator) -> list[Row]:
    heads, d, total = size["heads"], size["head_dim"], size["tokens"]
    lengths = document_lengths(total, size["documents"], generator)
    q, k, v = _packed(lengths, heads, d, device, generator, grad=True)
    cu = cu_seqlens(lengths, device)
    # (the lengths, drawn afresh each run, go with the row but not into its key: a run replaces the last one's rows)
    params = dict(case="documents", tokens=total, documents=len(lengths), heads=heads, head_dim=d, causal=True)
    runs = {"attngen": (lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True),
                        (q, k, v))}
    kept = {"attngen": kept_scores(lengths, lengths, True)}
    if not check:
        runs.update(_document_peers(q, k, v, cu, lengths))
        kept.update(flex=kept["attngen"], varlen_attn=kept["attngen"], sdpa_cudnn=total * (total + 1) // 2)
    rows = []
    for name in (n for n in names if n in runs):
        fn, inputs = runs[name]
        for direction in directions:
            row = Row("varlen", direction, name, params, extra={"lengths": lengths})
            try:
                if check:
                    row.error = _accuracy(fn(), varlen_attention(q, k, v, cu, cu, causal=True)[0])
                else:
                    row.ms = _timed(fn, inputs, direction)
                    row.tflops = _tflops(kept[name], heads, d, row.ms, direction == "backward")
            except Exception as e:  # noqa: BLE001 - a provider that cannot run a case is a result
                row.error = error_text(e)
            rows.append(row)
    return rows


def _document_peers(q, k, v, cu, lengths) -> dict:
    """The documents row's peers: name -> (f() -> out, the inputs it differentiates); the dense ones read
    (1, H, total, D) copies of the packed tensors, made here (outside the timing)."""
    import inspect

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                  torch.tensor(lengths, device=q.device))
    mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None, total, total)
    flex = compiled_flex_attention()
    dense = tuple(t.detach().transpose(0, 1)[None].contiguous().requires_grad_() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*dense, is_causal=True)

    peers = {"flex": (lambda: flex(*dense, block_mask=mask), dense), "sdpa_cudnn": (cudnn, dense)}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return peers
    n = max(lengths)
    # (torch 2.11's varlen_attn takes is_causal, later ones a window of (-1, 0))
    causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
              else {"is_causal": True})
    peers["varlen_attn"] = (lambda: varlen_attn(q, k, v, cu, cu, n, n, **causal), (q, k, v))
    return peers


def long_and_short_rows(size: dict, device, check: bool, generator) -> list[Row]:
    heads, d, long = size["heads"], size["head_dim"], size["tokens"]
    lengths = [long] + [size["short"]] * size["shorts"]
    q, k, v = _packed(lengths, heads, d, device, generator)
    cu, alone = cu_seqlens(lengths, device), cu_seqlens([long], device)
    batch = lambda: flash_attn_varlen_func(q, k, v, cu, cu, long, long, causal=True)  # noqa: E731
    single = lambda: flash_attn_varlen_func(q[:long], k[:long], v[:long], alone, alone, long, long,  # noqa: E731
                                            causal=True)
    row = Row("varlen", "forward", "attngen", dict(case="long_and_short", long=long, short=size["short"],
                                                   shorts=size["shorts"], heads=heads, head_dim=d, causal=True))
    try:
        if check:
            row.error = _accuracy(batch(), varlen_attention(q, k, v, cu, cu, causal=True)[0])
        else:
            row.ms, alone_ms = _timed(batch, (), "forward"), _timed(single, (), "forward")
            row.tflops = _tflops(kept_scores(lengths, lengths, True), heads, d, row.ms, False)
            row.extra = dict(alone_ms=alone_ms, ratio=row.ms / alone_ms)
    except Exception as e:  # noqa: BLE001
        row.error = error_text(e)
    return [row]


def mixed_rows(size: dict, device, check: bool, generator) -> list[Row]:
    """One serving step: new prompts (their keys their own, in the pool) and decodes (one query over a cache)."""
    heads, d, page = size["heads"], size["head_dim"], size["page_size"]
    prompts, decodes = [size["prompt"]] * size["prompts"], size["decodes"]
    caches = torch.randint(size["min_cache"], size["max_cache"] + 1, (decodes,), generator=generator).tolist()
    keys = prompts + caches
    pages = [-(-n // page) for n in keys]
    order = torch.randperm(sum(pages), generator=generator).to(torch.int32)
    table = torch.zeros(len(keys), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start : start + n]
        start += n
    table = table.to(device)
    pool_k, pool_v = (torch.randn(sum(pages), page, heads, d, dtype=torch.bfloat16, generator=generator).to(device)
                      for _ in range(2))
    lengths_q = prompts + [1] * decodes
    q = torch.randn(sum(lengths_q), heads, d, dtype=torch.bfloat16, generator=generator).to(device)
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(keys, device)
    used = torch.tensor(keys, dtype=torch.int32, device=device)
    n_p = len(prompts)
    split = sum(prompts)

    def one_call():
        return flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, max(lengths_q), max(keys), causal=True,
                                      block_table=table, seqused_k=used)

    def separate():
        flash_attn_varlen_func(q[:split], pool_k, pool_v, cu_q[: n_p + 1], cu_k[: n_p + 1], max(prompts), max(prompts),
                               causal=True, block_table=table[:n_p], seqused_k=used[:n_p])
        return attention_with_kvcache(q[split:, None], pool_k, pool_v, used[n_p:], table[n_p:], causal=True)

    # (the cache lengths, drawn afresh each run, go with the row but not into its key: a run replaces the last one's)
    params = dict(case="mixed", prompts=prompts, decodes=decodes, heads=heads, head_dim=d, page_size=page,
                  min_cache=size["min_cache"], max_cache=size["max_cache"], causal=True)
    row = Row("varlen", "forward", "attngen", params, extra={"caches": caches})
    try:
        if check:
            ref = varlen_attention(q, pool_k, pool_v, cu_q, cu_k, causal=True, seqused_k=used, block_table=table)[0]
            row.error = _accuracy(one_call(), ref)
            decode_ref = kvcache_attention(q[split:, None], pool_k, pool_v, used[n_p:], table[n_p:])[0]
            row.error = row.error or _accuracy(separate(), decode_ref)
        else:
            row.ms, separate_ms = _timed(one_call, (), "forward"), _timed(separate, (), "forward")
            row.tflops = _tflops(kept_scores(lengths_q, keys, True), heads, d, row.ms, False)
            row.extra.update(separate_ms=separate_ms, ratio=separate_ms / row.ms)
    except Exception as e:  # noqa: BLE001
        row.error = error_text(e)
    return [row]


def slot_rows(size: dict, device, check: bool, names, directions, generator) -> list[Row]:
    """SDPA's flash backend with "attngen" active against attngen.attention, on the prefill suite's shapes; a
    check calls the slot's op directly (the aten op is a CUDA op)."""
    import torch.nn.functional as F

    heads, d = size["heads"], size["head_dim"]
    lengths = PREFILL_LENGTHS if not check else (size["tokens"],)
    rows = []
    for causal in (False, True):
        for n in lengths:
            b = max(1, FULL["tokens"] // n) if not check else 2
            q, k, v = (torch.randn(b, heads, n, d, generator=generator).to(device, torch.bfloat16)
                       .requires_grad_() for _ in range(3))
            params = dict(case="slot", batch=b, heads=heads, seqlen=n, head_dim=d, causal=True if causal else False)
            runs = {"attngen": lambda: attention(q, k, v, is_causal=causal)}
            if check:
                runs["slot"] = lambda: torch_flash._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
            else:  # (timed inside sdpa_kernel's context, entered once: as a model sets the backend, not per call)
                runs["slot"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            runs = {name: fn for name, fn in runs.items() if name in names}
            medians = {}  # direction -> each side's median time
            for name in runs:
                for direction in directions:
                    row = Row("varlen", direction, name, params, extra={"lengths": lengths})
                    try:
                        if check:
                            ref = varlen_attention(*(t.detach()[0].transpose(0, 1) for t in (q, k, v)),
                                                   cu_seqlens([n], "cpu"), cu_seqlens([n], "cpu"), causal=causal)[0]
                            with torch.no_grad():
                                row.error = _accuracy(runs[name]()[0].transpose(0, 1), ref)
                        else:
                            if direction not in medians:
                                medians[direction] = _slot_medians(runs, (q, k, v), direction)
                            if isinstance(medians[direction][name], Exception):
                                raise medians[direction][name]
                            row.ms = medians[direction][name]
                            kept = kept_scores([n] * b, [n] * b, causal)
                            row.tflops = _tflops(kept, heads, d, row.ms, direction == "backward")
                    except Exception as e:  # noqa: BLE001
                        row.error = error_text(e)
                    rows.append(row)
            q = k = v = None  # (freed before the next length; rebound: the lambdas name them)
    return rows


SLOT_ROUNDS = 3  # timings of each side a row, the sides taking turns: the row is their median


def _slot_medians(runs: dict, inputs, direction) -> dict:
    """Each side's median time over SLOT_ROUNDS timings, the sides taking turns: single timings of the same kernel
    moved by up to 5% between calls of a run (H200), as much as the slot's target."""
    times, errors = {name: [] for name in runs}, {}
    for _ in range(SLOT_ROUNDS):
        for name, fn in runs.items():
            if name in errors:
                continue
            try:
                with _flash_backend() if name == "slot" else contextlib.nullcontext():
                    times[name].append(_timed(fn, inputs, direction))
            except Exception as e:  # noqa: BLE001 - a side that cannot run is its row's result
                errors[name] = e
    return {name: errors.get(name) or statistics.median_high(t) for name, t in times.items()}


def _flash_backend():
    """SDPA restricted to its flash backend (the slot), as a context."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def bench_varlen(names=PROVIDERS, directions=("forward", "backward"), check=False, progress=print) -> list[Row]:
    device = "cpu" if check and not torch.cuda.is_available() else "cuda"
    size = TINY if check else FULL
    generator = torch.Generator()
    generator.seed()  # fresh random data each run
    # (a check compares forward outputs: one direction is enough)
    rows = documents_rows(size, device, check, names, directions[:1] if check else directions, generator)
    progress("varlen documents done")
    if "attngen" in names:
        rows += long_and_short_rows(size, device, check, generator)
        progress("varlen long_and_short done")
        rows += mixed_rows(size, device, check, generator)
        progress("varlen mixed done")
    if "slot" in names:
        if check:
            rows += slot_rows(size, device, check, names, directions[:1], generator)
        else:
            from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

            activate_flash_attention_impl(torch_flash.NAME)
            try:
                rows += slot_rows(size, device, check, names, directions, generator)
            finally:
                restore_flash_attention_impl()
        progress("varlen slot done")
    return rows


def table(rows: list[Row]) -> str:
    """The rows as text: TFLOP/s (or the check's verdict) per provider and case, and the ratios."""
    lines = []
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.direction == direction]
        if not sel:
            continue
        lines.append(f"varlen {direction} TFLOP/s on kept scores (bf16)")
        for r in sel:
            shape = {k: v for k, v in r.params.items() if k in ("batch", "seqlen", "causal", "tokens")}
            cell = "err" if r.error else f"{r.tflops:.1f}" if r.tflops else "ok"
            ratio = f"  ratio {r.extra['ratio']:.2f}" if "ratio" in r.extra else ""
            lines.append(f"  {r.params['case']:>15} {r.provider:>12} {cell:>8}  {shape}{ratio}")
    errors = [f"  {r.params['case']} {r.direction} {r.provider}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def main(out_dir="benchmarks/results", names=None, directions=("forward", "backward"), check=False) -> int:
    """Run the suite (or its check) and print the table; writes `<out_dir>/varlen_<gpu>.json` when timed."""
    return run_suite("varlen_", lambda: bench_varlen(names or PROVIDERS, directions, check), table, out_dir, check)
