"""Kernels over a KV cache (split-KV decoding, paged caches, chunked prefill), as the tuner sees them.

A spec with `split_kv` other than 1 or a paged `kv_layout` generates `forward_kvcache`, which
`attngen.attention_with_kvcache` calls through attngen/runtime/parts.py's `KVCachePart` (whose docstring says
how its launch config differs from the prefill forward's). Tuning it (`KVCacheTunable`):

  * the inputs are realistic: sequence lengths spread from the cache's capacity down to half of
    it, and for a paged cache a shuffled block table over a pool with spare pages. Each candidate
    is checked and timed again with every sequence at capacity (`tuning_variants`), and a bucket
    keeps the config whose worst ratio to the fastest on either is least: the two mixes can want
    different split counts (batch 16, 8k keys on an H200: two splits are fastest on spread lengths,
    and 4% behind the fastest at capacity; every config nearer the fastest at capacity is more than 4%
    behind on the spread lengths), and a table tuned on one mix alone can give more away on the other.
    The fastest config at capacity alone (after a runoff of its own) is kept beside it as the bucket's
    `uniform` config, which calls that pass `cache_seqlens` as an int (every sequence of one length,
    so no split has to even out long and short sequences) take.
  * a spec with the Gluon decode kernel searches `warp_specialized`: 1 runs the Gluon kernel (fixed tiles: one
    candidate per split count, `tuning_canonical`), 0 the Triton kernel.
  * an FP8 cache (`kv_dtype = fp8_e4m3`) is filled with e4m3 values and read with descale factors of 1.0, so
    that the float64 check sees the values the kernel reads; its GB/s count one byte an element.

Speeds are reported in GB/s of K/V read (`tuning_bytes`), as decoding is memory bound, and timed as
CUDA-graph replays (`tuning_graph`): at batch 1 a step takes tens of microseconds, less than the
Python that launches it, so eager timings would rank candidates by host noise.
"""

from __future__ import annotations

import torch

from ..runtime.keys import Shape
from ..testing.accuracy import Case, compare
from ..testing.reference import gather_cache
from .tunables import Tunable


def sequence_lengths(batch: int, capacity: int) -> list[int]:
    """The tuning inputs' lengths: from `capacity` (the first sequence) down to about half of it."""
    return [capacity - (b * capacity) // (2 * batch) for b in range(batch)]


class KVCacheTunable(Tunable):
    """The `forward_kvcache` entry of a loaded split or paged `Kernel` (`part`: its `KVCachePart`)."""

    kind = "decode"
    tuning_graph = True  # timed as CUDA-graph replays: a decoding step is shorter than its Python
    tuning_uniform = "at capacity"  # its fastest config is kept too, for calls of equal lengths

    def tuning_canonical(self, config: dict) -> dict:
        """The config as it runs: with warp_specialized = 1 the Gluon kernel runs, whose tiles are fixed,
        so the Triton keys take the default's (what the Triton kernel runs where the Gluon one does not:
        more query rows per K/V head, pools TMA cannot read) and candidates differ by split count only;
        where the Gluon kernel does not run, warp_specialized = 1 is the Triton kernel, as 0."""
        if not config.get("warp_specialized"):
            return config
        if not self.part.gluon_runs_here():
            return dict(config, warp_specialized=0)
        default = self.tuning_default()
        return dict(config, **{key: default[key] for key in ("BLOCK_N", "num_warps", "num_stages")})

    def tuning_inputs(self, shape: Shape, device, generator) -> dict:
        spec = self.spec
        d, d_v, dtype = spec.head_dim, spec.head_dim_v, spec.dtype.torch

        def randn(*size, dtype=dtype):
            return torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(dtype)

        kv = self._kv_dtype()

        batch, capacity = shape.batch, shape.n_k
        lens = torch.tensor(sequence_lengths(batch, capacity), dtype=torch.int32, device=device)
        q = randn(batch, shape.n_q, shape.heads, d)
        table = None
        if spec.kv_layout.paged:
            page = spec.kv_layout.page_size
            per_seq = max(1, -(-capacity // page))
            pool = batch * per_seq + per_seq  # spare pages: the pool is not exactly the table
            order = torch.randperm(pool, generator=generator, device=device)[: batch * per_seq]
            table = order.to(torch.int32).view(batch, per_seq)
            k, v = randn(pool, page, shape.kv_heads, d, dtype=kv.torch), randn(pool, page, shape.kv_heads, d_v, dtype=kv.torch)
        else:
            k = randn(batch, capacity, shape.kv_heads, d, dtype=kv.torch)
            v = randn(batch, capacity, shape.kv_heads, d_v, dtype=kv.torch)
        if spec.v_from_k:  # MLA: the values are the cache's first columns (a view), read with the keys
            v = k[..., :d_v]
        # an FP8 cache's descale factors: 1.0, one per tensor
        tensors = {name: torch.ones(1, device=device) for name in spec.descales}
        return {"q": q, "k": k, "v": v, "lens": lens, "table": table, "shape": shape, "tensors": tensors,
                "out": q.new_empty((batch, shape.n_q, shape.heads, d_v)), "lse": torch.empty((batch, shape.heads, shape.n_q), device=device,
                                                                dtype=torch.float32)}

    def tuning_variants(self, inputs: dict) -> list[tuple[str, dict]]:
        """Further inputs each candidate is checked and timed on: the same caches, every sequence at
        capacity (the report's "at capacity" column; speeds in GB/s stay those of the spread lengths)."""
        full = torch.full_like(inputs["lens"], inputs["shape"].n_k)
        return [("at capacity", dict(inputs, lens=full))]

    def tuning_run(self, inputs: dict, config: dict, *, poison: bool = False):
        x = inputs
        if poison:
            x["out"].fill_(float("nan"))
            x["lse"].fill_(float("nan"))
        paged = x["table"] is not None
        k4, v4 = (x["k"], x["v"]) if paged else (x["k"].transpose(1, 2), x["v"].transpose(1, 2))
        config = dict(config, BLOCK_M=self.part.block_m(x["shape"]))
        if self.part.has_gluon():  # the Gluon kernel only where the candidate asks for it
            config["warp_specialized"] = bool(config.get("warp_specialized", 0))
        return self.part.launch(x["q"].transpose(1, 2), k4, v4, x["lens"], x["table"], self.spec.softmax_scale,
                                x["out"].transpose(1, 2), x["lse"], config, tensors=x["tensors"])

    def tuning_check(self, inputs: dict, outputs, sequences: int = 2):
        """The first `sequences` sequences against float64 (each gathered from its pages): the worst."""
        x, results = inputs, []
        out, lse = outputs  # out as the kernel saw it: (batch, heads, seq, d)
        for b in range(min(sequences, x["q"].shape[0])):
            n = int(x["lens"][b])
            row = None if x["table"] is None else x["table"][b]
            k, v = ((gather_cache(c[b] if row is None else c, n, row).transpose(0, 1)[None]) for c in (x["k"], x["v"]))
            q = x["q"][b : b + 1].transpose(1, 2)
            case = Case(1, q.shape[1], k.shape[1], q.shape[2], n)
            # (the Gluon kernel of an FP8 cache rounds q's rows to e4m3: a Triton candidate's bound is then the looser)
            results.append(compare(self.spec, case, out[b : b + 1], lse[b : b + 1], q, k, v,
                                   q_e4m3=self.part.rounds_q()))
        return next((r for r in results if not r.ok), max(results, key=lambda r: r.rel))

    def tuning_flops(self, shape: Shape) -> float:
        keys = sum(sequence_lengths(shape.batch, shape.n_k))
        return 2.0 * shape.heads * shape.n_q * keys * (self.spec.head_dim + self.spec.head_dim_v)

    def tuning_bytes(self, shape: Shape) -> float | None:
        """K and V bytes read by one call on the tuning inputs, when that bounds its speed (one query
        tile per key/value head: decoding); None for chunked prefill, which reports TFLOP/s. MLA's one new token
        reports both at any head count: 16 heads are bound by the cache's read, 128 by the products."""
        if self.part.rows(shape) > 16 and not (self.spec.v_from_k and shape.n_q == 1):
            return None
        keys = sum(sequence_lengths(shape.batch, shape.n_k))
        width = self.spec.head_dim + (0 if self.spec.v_from_k else self.spec.head_dim_v)  # MLA: one read of the cache
        return shape.kv_heads * keys * width * self._kv_dtype().bytes

    def _kv_dtype(self):
        """The cache's dtype (the spec's `kv_dtype`, else its `dtype`)."""
        return self.spec.kv_dtype or self.spec.dtype
