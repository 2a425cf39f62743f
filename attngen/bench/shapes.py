"""`attngen bench --suite shapes`: the head shapes of issue 51 against cuDNN, FlexAttention and FA2, in one process.

bf16, forward and backward (`torch.autograd.grad`), rows (`params["shape"]`):
- `d96`: d=96, B=2 H=16 N=4096, no mask (Phi)
- `d256`: d=256, B=1 H=8 N=8192, causal (Gemma)
- `gqa_28_4`: d=128, 28 query heads over 4 key/value heads, B=1 N=2049, causal (Qwen)
- `d64_n3000`: d=64, B=3 H=12 N=3000, causal
- `d64_b16`: d=64, B=16 H=32 N=1024, causal
- `d192_128`: q.k over 192 dims and v over 128, B=1 H=128 N=4096, causal (DeepSeek-V3's prefill)
- `mla_h16`, `mla_h128`: DeepSeek's MLA decode, batch 64 x 8k tokens, 16 or 128 heads over one 576/512 latent cache
  in 64-token pages (bench/mla.py: direction "decode", GB/s of the cache read once and TFLOP/s, SDPA and
  FlexAttention as reference peers: FlashMLA is not on the image)

Providers: attngen (`attngen.attention`), SDPA's cuDNN backend, FlexAttention (compiled as the prefill suite
measures it; a causal block mask made once, outside the timing) and FA2 (SDPA's flash backend). A provider that
cannot run a row (FA2 with two head dims) gives a row with its error. Every timing is a `do_bench` median on
fresh random data. TFLOP/s count the kept scores by the FlashAttention convention generalised to two head dims
(`analysis.cost.per_score`: 2 * (d_qk + d_v) a score forward, 2 * (3 d_qk + 2 d_v) backward; a causal square
mask keeps N (N + 1) / 2). `--check` runs attngen on each row at a tiny size (in Triton's interpreter without a
GPU), with the row's head dims and group, and compares its output and its gradients with float64's instead of
timing. SDPA's backends that refuse GQA run on the K/V heads repeated (the copy timed too; `extra["gqa"]`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..analysis.cost import per_score
from ..api.sdpa import attention
from . import mla
from .common import Row, compiled_flex_attention, error_text
from .prefill import _median_ms, run_suite
from .varlen import _accuracy, _timed, kept_scores

PROVIDERS = ("attngen", "sdpa_cudnn", "flex", "sdpa_flash", "sdpa")  # sdpa: the MLA rows' (its own backend choice)


@dataclass(frozen=True)
class Shape:
    """One row's problem: batch, query heads, key/value heads, length, the two head dims, the mask."""

    name: str
    batch: int
    heads: int
    heads_kv: int
    seqlen: int
    head_dim: int
    head_dim_v: int
    causal: bool

    def params(self) -> dict:
        return dict(shape=self.name, batch=self.batch, heads=self.heads, heads_kv=self.heads_kv, seqlen=self.seqlen,
                    head_dim=self.head_dim, head_dim_v=self.head_dim_v, causal=self.causal, dtype="bf16")

    def flops(self, backward: bool) -> int:
        kept = kept_scores([self.seqlen], [self.seqlen], self.causal)
        return self.batch * self.heads * kept * per_score(backward, self.head_dim, self.head_dim_v)


SHAPES = (
    Shape("d96", 2, 16, 16, 4096, 96, 96, False),
    Shape("d256", 1, 8, 8, 8192, 256, 256, True),
    Shape("gqa_28_4", 1, 28, 4, 2049, 128, 128, True),
    Shape("d64_n3000", 3, 12, 12, 3000, 64, 64, True),
    Shape("d64_b16", 16, 32, 32, 1024, 64, 64, True),
    Shape("d192_128", 1, 128, 128, 4096, 192, 128, True),
)


def tiny(shape: Shape) -> Shape:
    """The row at a check's size: its head dims, mask and query heads per key/value head, an odd length."""
    group = shape.heads // shape.heads_kv
    return Shape(shape.name, 1, group * (1 if group > 1 else 2), 1 if group > 1 else 2, 37, shape.head_dim,
                 shape.head_dim_v, shape.causal)


def providers(shape: Shape, device) -> dict:
    """name -> f(q, k, v) -> out for the peers (GPU only); FA2 and cuDNN through SDPA's backend selection."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    gqa = shape.heads != shape.heads_kv
    flex = compiled_flex_attention()
    mask = (create_block_mask(lambda b, h, q, k: q >= k, None, None, shape.seqlen, shape.seqlen, device=device)
            if shape.causal else None)

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=q.shape[1] != k.shape[1])
        return run

    return {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=gqa)}


def _as_taken(fn, shape: Shape, q, k, v):
    """(fn, None), or where fn refuses GQA (SDPA's backends may), fn on the K/V heads repeated to the query heads
    and a note saying so: the copy is timed with it, the cost of running GQA through that backend."""
    if shape.heads == shape.heads_kv:
        return fn, None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (SDPA warns before it refuses enable_gqa: the refusal is the note)
            fn(q, k, v)
        return fn, None
    except Exception:  # noqa: BLE001 - a peer may refuse enable_gqa: repeat the heads
        group = shape.heads // shape.heads_kv
        return (lambda q, k, v: fn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))), "expanded heads"


def _tensors(shape: Shape, device, generator):
    # (drawn by the host's generator, then moved: one generator serves every tensor of a run on any device)
    def draw(heads, dim):
        return (torch.randn(shape.batch, heads, shape.seqlen, dim, generator=generator)
                .to(device, torch.bfloat16).requires_grad_())
    return draw(shape.heads, shape.head_dim), draw(shape.heads_kv, shape.head_dim), draw(shape.heads_kv, shape.head_dim_v)


def _reference(shape: Shape, q, k, v):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.heads != shape.heads_kv)


def _checked(fn, shape: Shape, q, k, v, direction) -> str | None:
    """A check's verdict: None when fn's output (forward) or its gradients for q, k and v under one random dO
    (backward) are within CHECK_REL of float64's."""
    wide = tuple(t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = _reference(shape, *wide)
    if direction == "forward":
        with torch.no_grad():
            return _accuracy(fn(q, k, v), ref.detach())
    do = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), do.to(q.device, q.dtype))
    for name, got, want in zip("qkv", grads, torch.autograd.grad(ref, wide, do)):
        error = _accuracy(got, want)
        if error:
            return f"d{name}: {error}"
    return None


def bench_shapes(names=PROVIDERS, directions=("forward", "backward"), check=False, progress=print,
                 only=None) -> list[Row]:
    """One Row per (shape, direction, provider): timed on a GPU, or with `check` attngen's output (forward) or
    gradients (backward) compared with float64 (`error` says why a check failed). `only`: the names of the shapes
    to run (default all)."""
    device = "cpu" if check and not torch.cuda.is_available() else "cuda"
    generator = torch.Generator()
    generator.seed()  # fresh random data each run
    rows = []
    for full in SHAPES:
        if only is not None and full.name not in only:
            continue
        shape = tiny(full) if check else full
        q, k, v = _tensors(shape, device, generator)
        gqa = shape.heads != shape.heads_kv
        runs = {"attngen": lambda q, k, v: attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)}
        if not check:
            try:
                runs.update(providers(shape, device))
            except Exception as e:  # noqa: BLE001 - peers that cannot be set up are a result
                rows += [Row("shapes", d, p, shape.params(), error=error_text(e)) for p in names if p != "attngen"
                         for d in directions]
        for name in (n for n in names if n in runs):
            fn, note = (runs[name], None) if check or name == "attngen" else _as_taken(runs[name], shape, q, k, v)
            for direction in directions:
                row = Row("shapes", direction, name, shape.params(), extra={"gqa": note} if note else {})
                try:
                    if check:
                        row.error = _checked(fn, shape, q, k, v, direction)
                    else:
                        row.ms = _timed(lambda: fn(q, k, v), (q, k, v), direction)
                        row.tflops = shape.flops(direction == "backward") / row.ms / 1e9
                except Exception as e:  # noqa: BLE001 - a provider that cannot run a shape is a result
                    row.error = error_text(e)
                    if device == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
        progress(f"shapes {full.name} done")
        q = k = v = None  # (freed before the next shape; rebound: the timed lambdas name them)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[Row]) -> str:
    """The rows as text: TFLOP/s (or the check's verdict) per provider, one line per shape, and attngen's ratio
    to cuDNN where both ran."""
    lines = []
    names = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    for direction in ("forward", "backward"):
        sel = [r for r in rows if r.direction == direction]
        if not sel:
            continue
        lines.append(f"shapes {direction} TFLOP/s on kept scores (bf16)")
        lines.append(f"{'shape':>10} {'B':>3} {'H':>4} {'H_KV':>4} {'N':>5} {'d':>7} {'mask':>6} "
                     + " ".join(f"{p:>10}" for p in names) + f" {'/cudnn':>7}")
        for shape in dict.fromkeys(r.params["shape"] for r in sel):
            found = {r.provider: r for r in sel if r.params["shape"] == shape}
            cells = []
            for p in names:
                r = found.get(p)
                cell = "-" if r is None else "err" if r.error else f"{r.tflops:.1f}" if r.tflops else "ok"
                cells.append(f"{cell:>10}")
            ours, cudnn = found.get("attngen"), found.get("sdpa_cudnn")
            ratio = (f"{ours.tflops / cudnn.tflops:7.2f}" if ours and cudnn and ours.tflops and cudnn.tflops
                     else f"{'':>7}")
            p = next(iter(found.values())).params
            dims = f"{p['head_dim']}/{p['head_dim_v']}" if p["head_dim"] != p["head_dim_v"] else str(p["head_dim"])
            lines.append(f"{shape:>10} {p['batch']:>3} {p['heads']:>4} {p['heads_kv']:>4} {p['seqlen']:>5} {dims:>7} "
                         f"{'causal' if p['causal'] else 'none':>6} " + " ".join(cells) + f" {ratio}")
    notes = [f"  {r.params['shape']} {r.direction} {r.provider}: {r.extra['gqa']}" for r in rows if "gqa" in r.extra]
    errors = [f"  {r.params['shape']} {r.direction} {r.provider}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + (["notes:"] + notes if notes else []) + (["errors:"] + errors if errors else []))


def main(out_dir="benchmarks/results", names=None, directions=("forward", "backward"), check=False) -> int:
    """Run the suite (or its check) and print the table; writes `<out_dir>/shapes_<gpu>.json` when timed. The MLA
    decode rows (bench/mla.py) run after the others, whatever the directions asked for."""
    names = names or PROVIDERS

    def rows():
        return bench_shapes(names, directions, check) + mla.bench_mla(names, check)

    def tables(rows):
        return "\n".join(filter(None, (table([r for r in rows if r.direction != "decode"]), mla.table(rows))))

    return run_suite("shapes_", rows, tables, out_dir, check)
