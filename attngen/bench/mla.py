"""MLA decode rows of `attngen bench --suite shapes`: DeepSeek's absorbed latent attention at batch 64, 8k tokens.

One new token per sequence, 16 or 128 query heads over one latent head, q.k over 576 (512 latent + 64 rotary),
the values the cache's first 512 columns, bf16, the cache in 64-token pages shuffled over the pool
(`params["shape"]`: `mla_h16`, `mla_h128`; direction "decode"). Providers:
- attngen: `attention_with_kvcache(q, pool, None, 8192, table, head_dim_v=512)`, replayed from a CUDA graph;
- sdpa: torch SDPA (its own backend choice) on the contiguous latent cache, the heads as query rows of one
  head (q (B, 1, H, 576) against k (B, 1, N, 576) and v = k[..., :512]: the same scores, no copy of the
  cache). A reference peer, not FlashMLA (which this image does not have);
- flex: FlexAttention, compiled, on the same tensors (it may refuse the 576/512 head dims: a row with its error).
GB/s counts the latent cache read once (B * N * 576 * 2 bytes), issue 51's target being 80% of the measured HBM
read bandwidth; TFLOP/s counts 2 * (576 + 512) a score (B * H * N scores), its target 500 at 128 heads.
`--check` runs attngen at a tiny size (in Triton's interpreter without a GPU) against float64 instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.cost import per_score
from ..api.kvcache import attention_with_kvcache
from .common import Row, compiled_flex_attention, error_text
from .decode import bench_graph
from .varlen import _accuracy

PROVIDERS = ("attngen", "sdpa", "flex")
D, D_V, PAGE = 576, 512, 64


@dataclass(frozen=True)
class Decode:
    """One MLA decode row: batch, query heads (over one latent head), cached tokens per sequence."""

    name: str
    batch: int
    heads: int
    seqlen: int

    def params(self) -> dict:
        return dict(shape=self.name, batch=self.batch, heads=self.heads, heads_kv=1, seqlen=self.seqlen,
                    head_dim=D, head_dim_v=D_V, page_size=PAGE, dtype="bf16")

    def flops(self) -> int:
        return self.batch * self.heads * self.seqlen * per_score(False, D, D_V)

    def bytes(self) -> int:
        """The latent cache, read once."""
        return self.batch * self.seqlen * D * 2


ROWS = (Decode("mla_h16", 64, 16, 8192), Decode("mla_h128", 64, 128, 8192))
TINY = Decode("mla_tiny", 2, 16, 2 * PAGE + 5)  # a check's size: the real head dims, an odd length over 3 pages


def _tensors(row: Decode, device, generator):
    """q (B, 1, H, D); the latent cache as (B, N, 1, D), and in pages shuffled over a pool with its block table."""
    # (drawn by the host's generator, then moved: one generator serves every tensor of a run on any device)
    q = torch.randn(row.batch, 1, row.heads, D, generator=generator).to(device, torch.bfloat16)
    pages = -(-row.seqlen // PAGE)
    cache = torch.randn(row.batch, pages * PAGE, 1, D, generator=generator).to(device, torch.bfloat16)
    perm = torch.randperm(row.batch * pages, generator=generator).to(device)
    pool = torch.empty_like(cache.view(-1, PAGE, 1, D))
    pool[perm] = cache.view(-1, PAGE, 1, D)
    return q, cache[:, :row.seqlen], pool, perm.view(row.batch, pages).int()


def _peers(row: Decode, q, cache) -> dict:
    """name -> f() for the peers, on the contiguous cache: the heads as query rows of its one head."""
    import torch.nn.functional as F

    q1, k1 = q.transpose(1, 2), cache.transpose(1, 2)  # (B, 1, H, D), (B, 1, N, D)
    v1 = k1[..., :D_V]
    flex = compiled_flex_attention()
    return {"sdpa": lambda: F.scaled_dot_product_attention(q1, k1, v1).transpose(1, 2),
            "flex": lambda: flex(q1, k1, v1).transpose(1, 2)}


def bench_mla(names=PROVIDERS, check=False, progress=print) -> list[Row]:
    """One Row per (row, provider): timed as a CUDA-graph replay on a GPU, or with `check` attngen's output compared
    with float64's at `TINY` (`error` says why it failed)."""
    device = "cpu" if check and not torch.cuda.is_available() else "cuda"
    generator = torch.Generator()
    generator.seed()  # fresh random data each run
    rows = []
    for row in (TINY,) if check else ROWS:
        q, cache, pool, table = _tensors(row, device, generator)
        runs = {"attngen": lambda: attention_with_kvcache(q, pool, None, row.seqlen, table, head_dim_v=D_V)}
        if not check:
            runs.update(_peers(row, q, cache))
        for name in (n for n in names if n in runs):
            result = Row("shapes", "decode", name, row.params(),
                         extra={} if name == "attngen" else {"peer": "reference peer, not FlashMLA"})
            try:
                with torch.no_grad():
                    if check:
                        wide = cache.double()
                        ref = torch.nn.functional.scaled_dot_product_attention(
                            q.double().transpose(1, 2), wide.transpose(1, 2), wide[..., :D_V].transpose(1, 2))
                        result.error = _accuracy(runs[name](), ref.transpose(1, 2))
                    else:
                        result.ms = bench_graph(runs[name])
                        result.tflops = row.flops() / result.ms / 1e9
                        result.gbps = row.bytes() / result.ms / 1e6
            except Exception as e:  # noqa: BLE001 - a provider that cannot run a row is a result
                result.error = error_text(e)
            rows.append(result)
        progress(f"shapes {row.name} done")
        q = cache = pool = table = None  # (freed before the next row; rebound: the timed lambdas name them)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[Row]) -> str:
    """The decode rows as text: GB/s of the latent cache read once and TFLOP/s per provider, one line per row."""
    sel = [r for r in rows if r.direction == "decode"]
    if not sel:
        return ""
    names = [p for p in PROVIDERS if any(r.provider == p for r in sel)]
    lines = ["shapes MLA decode (576/512, one latent head, pages of 64): GB/s of the cache read once | TFLOP/s "
             "(sdpa and flex: reference peers, not FlashMLA)",
             f"{'shape':>10} {'B':>3} {'H':>4} {'N':>5} " + " ".join(f"{p:>16}" for p in names)]
    for shape in dict.fromkeys(r.params["shape"] for r in sel):
        found = {r.provider: r for r in sel if r.params["shape"] == shape}
        cells = []
        for p in names:
            r = found.get(p)
            cell = ("-" if r is None else "err" if r.error else f"{r.gbps:.0f} | {r.tflops:.1f}" if r.ms else "ok")
            cells.append(f"{cell:>16}")
        p = next(iter(found.values())).params
        lines.append(f"{shape:>10} {p['batch']:>3} {p['heads']:>4} {p['seqlen']:>5} " + " ".join(cells))
    errors = [f"  {r.params['shape']} decode {r.provider}: {r.error}" for r in sel if r.error]
    return "\n".join(lines + (["errors:"] + errors if errors else []))
