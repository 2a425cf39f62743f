"""Kernels over a KV cache (split-KV decoding, paged caches, chunked prefill), as the tuner sees them.

A spec with `split_kv` other than 1 or a paged `kv_layout` generates `forward_kvcache`, which
`attngen.attention_with_kvcache` calls. Its launch config differs from the prefill forward's:

  * BLOCK_M is not searched: a tile holds the query rows of one key/value head (the group's heads
    x the new tokens, when the spec packs GQA), so it follows from the call's shape (`block_m`);
    the resource model prunes with the smallest tile, 16 rows, and a stored config that cannot
    fit a call's larger tile gives way to the heuristic for that call.
  * the split count is a key of its own, `num_splits`, when the spec says `split_kv = auto`:
    0 is the run-time heuristic (attngen/splits.py), other values fix the count. A fixed count
    is only right for the shapes it was measured at, so it is used for its own bucket only; a
    call served by the nearest bucket's entry takes the heuristic instead.
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
  * a spec with the Gluon decode kernel (pass warp-specialize-decode) has a key `warp_specialized`:
    1 runs the Gluon kernel (fixed tiles: one candidate per split count, `tuning_canonical`), 0 the
    Triton kernel. A bucket's entry thus says which kernel runs, and at which split count; on GPUs
    without the Gluon kernel 1 is the same as 0. An entry without the key was tuned before the spec
    had the Gluon kernel and runs the Triton kernel it was measured on. Calls in other buckets take the
    default (the Gluon kernel where it runs).

Speeds are reported in GB/s of K/V read (`tuning_bytes`), as decoding is memory bound, and timed as
CUDA-graph replays (`tuning_graph`): at batch 1 a step takes tens of microseconds, less than the
Python that launches it, so eager timings would rank candidates by host noise.
"""

from __future__ import annotations

import torch

from .. import configs, warmup
from . import store
from .key import Shape, problem_text


def sequence_lengths(batch: int, capacity: int) -> list[int]:
    """The tuning inputs' lengths: from `capacity` (the first sequence) down to about half of it."""
    return [capacity - (b * capacity) // (2 * batch) for b in range(batch)]


class KVCacheKernel:
    """The `forward_kvcache` entry of `kernel` (a loaded `Kernel` whose spec is split or paged)."""

    kind = "decode"
    tuning_graph = True  # timed as CUDA-graph replays: a decoding step is shorter than its Python
    tuning_uniform = "at capacity"  # its fastest config is kept too, for calls of equal lengths
    tuning_optional = ("warp_specialized",)  # absent from entries tuned before the spec had the Gluon kernel

    def __init__(self, kernel):
        self.kernel, self.spec = kernel, kernel.spec
        self._fits: dict = {}
        self._configs: dict = {}

    def __repr__(self) -> str:
        return f"<kvcache kernel of {self.spec.name}>"

    @property
    def label(self) -> str:
        return self.spec.name

    @property
    def autotune(self):
        return self.kernel.autotune

    # -- the launch config of one call -------------------------------------------------------------
    def rows(self, shape: Shape) -> int:
        """Query rows one program covers: the group's heads x the new tokens when GQA is packed."""
        return shape.n_q * (shape.heads // max(shape.kv_heads, 1) if self.spec.packs_gqa else 1)

    def block_m(self, shape: Shape) -> int:
        if self.spec.block_m is not None:
            return self.spec.block_m
        return min(64, max(16, 1 << max(0, self.rows(shape) - 1).bit_length()))  # tl.dot needs 16

    def config(self, shape: Shape, device_index: int | None = None, uniform: bool = False) -> dict:
        """Tuned (or heuristic) config for a call of this shape, with BLOCK_M set for its rows, and
        `num_splits` (when the spec searches it) 0 unless this very bucket was tuned. `uniform`: every
        sequence of the call holds the same number of keys (the bucket's config for that, if it has one)."""
        # NOTE: runs on every decoding step: memoised per shape (and tuning-table generation; this
        # object belongs to one loaded kernel, which is interpreted or compiled, not both).
        memo_key = (store.generation(), device_index, shape, uniform)
        found = self._configs.get(memo_key)
        if found is None:
            if len(self._configs) > 4096:
                self._configs.clear()
            found = self._configs[memo_key] = self._config(shape, device_index, uniform)
        return dict(found)

    def _config(self, shape: Shape, device_index: int | None, uniform: bool = False) -> dict:
        from . import launch_choice

        found, exact = launch_choice(self, shape, device_index, uniform)
        config = dict(found, BLOCK_M=self.block_m(shape))
        if not exact and "num_splits" in config:
            config["num_splits"] = 0
        if not exact:  # which kernel won is the tuned bucket's finding too: elsewhere the default's
            config.pop("warp_specialized", None)
        elif self.has_gluon() and "warp_specialized" not in config:
            # an entry tuned before the spec had the Gluon kernel (contiguous caches gained it in v32) was
            # measured on the Triton kernel, so that is what it runs
            config["warp_specialized"] = 0
        if not self._fit(config):
            config = self._fitted(config["BLOCK_M"])
        return config

    def _fitted(self, block_m: int) -> dict:
        """The default config at the call's BLOCK_M, or where that does not fit (a spec's fixed block_n
        or num_stages with 64 rows), the nearest config that does: BLOCK_M kept if any fits with it."""
        from ..resources import nearest_fit

        config = dict(self.tuning_default(), BLOCK_M=block_m)
        for keep in (("BLOCK_M",), ()):
            fitted = nearest_fit(self.spec, config, keep=keep)
            if self._fit(fitted):
                return fitted
        return config

    def _fit(self, config: dict) -> bool:
        from ..resources import infeasible

        key = tuple(sorted(config.items()))
        fits = self._fits.get(key)
        if fits is None:
            fits = self._fits[key] = infeasible(self.spec, config) is None
        return fits

    def launch(self, q4, k4, v4, cache_seqlens, block_table, scale: float, out4, lse, config: dict,
               num_splits: int = 0):
        """forward_kvcache on (batch, heads, seq, d) views; `num_splits` (if not 0) overrides the config's."""
        config = dict(config)
        splits = config.pop("num_splits", 0)
        warmup.wait()
        return self.kernel.module.forward_kvcache(q4, k4, v4, cache_seqlens, block_table, scale, out4, lse,
                                                  num_splits or splits, config)

    # -- the tuner's protocol (attngen/tuning/__init__.py) -----------------------------------------
    def tuning_problem(self) -> str:
        return problem_text(self.spec, "kvcache", ignore=("direction",))

    def has_gluon(self) -> bool:
        """Whether the spec has the Gluon decode kernel (pass warp-specialize-decode)."""
        return self.kernel.program.warp_specialized.decode is not None

    def gluon_runs_here(self) -> bool:
        """Whether this process can run it: compiled mode on an sm_90 GPU."""
        from ..runtime import interpreting

        return (self.has_gluon() and not interpreting() and torch.cuda.is_available()
                and torch.cuda.get_device_capability() == (9, 0))

    def tuning_space(self) -> dict:
        space = {key: configs.DECODE_SPACE[key] if getattr(self.spec, field) is None else (getattr(self.spec, field),)
                 for key, field in (("BLOCK_N", "block_n"), ("num_warps", "num_warps"), ("num_stages", "num_stages"))}
        if self.spec.split_kv is None:
            space["num_splits"] = configs.DECODE_SPACE["num_splits"]
        if self.has_gluon():
            space["warp_specialized"] = (0, 1)
        return space

    def tuning_default(self) -> dict:
        from ..runtime import interpreting

        config = configs.default_config(self.spec, interpreter=interpreting())
        del config["BLOCK_M"]
        if self.spec.split_kv is None:
            config["num_splits"] = 0
        if self.has_gluon():  # untuned calls take the Gluon kernel where it runs
            config["warp_specialized"] = int(self.gluon_runs_here())
        return config

    def tuning_canonical(self, config: dict) -> dict:
        """The config as it runs: with warp_specialized = 1 the Gluon kernel runs, whose tiles are fixed,
        so the Triton keys take the default's (what the Triton kernel runs where the Gluon one does not:
        more query rows per K/V head, pools TMA cannot read) and candidates differ by split count only;
        where the Gluon kernel does not run, warp_specialized = 1 is the Triton kernel, as 0."""
        if not config.get("warp_specialized"):
            return config
        if not self.gluon_runs_here():
            return dict(config, warp_specialized=0)
        default = self.tuning_default()
        return dict(config, **{key: default[key] for key in ("BLOCK_N", "num_warps", "num_stages")})

    def tuning_infeasible(self, config: dict, target) -> str | None:
        from ..resources import infeasible

        # from the generated module, not the program: rebuilding the program (sympy in the passes)
        # for a tuned-table lookup took seconds of a cached process's first call
        page_tile = getattr(self.kernel.module, "MAX_BLOCK_N", None)
        if page_tile is not None and config["BLOCK_N"] > page_tile:
            return (f"block_n={config['BLOCK_N']} crosses a page: pages of {page_tile} tokens are looked up "
                    "once per key tile, so block_n must not exceed the page size")
        tiles = {k: v for k, v in config.items() if k not in ("num_splits", "warp_specialized")}
        return infeasible(self.spec, dict(tiles, BLOCK_M=self.spec.block_m or 16), target)

    def tuning_inputs(self, shape: Shape, device, generator) -> dict:
        spec = self.spec
        d, dtype = spec.head_dim, spec.dtype.torch

        def randn(*size):
            return torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(dtype)

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
            k, v = randn(pool, page, shape.kv_heads, d), randn(pool, page, shape.kv_heads, d)
        else:
            k, v = randn(batch, capacity, shape.kv_heads, d), randn(batch, capacity, shape.kv_heads, d)
        return {"q": q, "k": k, "v": v, "lens": lens, "table": table, "shape": shape,
                "out": torch.empty_like(q), "lse": torch.empty((batch, shape.heads, shape.n_q), device=device,
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
        config = dict(config, BLOCK_M=self.block_m(x["shape"]))
        if self.has_gluon():  # the Gluon kernel only where the candidate asks for it
            config["warp_specialized"] = bool(config.get("warp_specialized", 0))
        return self.launch(x["q"].transpose(1, 2), k4, v4, x["lens"], x["table"], self.spec.softmax_scale,
                           x["out"].transpose(1, 2), x["lse"], config)

    def tuning_check(self, inputs: dict, outputs, sequences: int = 2):
        """The first `sequences` sequences against float64 (each gathered from its pages): the worst."""
        from ..check import Case, compare
        from ..reference import gather_cache

        x, results = inputs, []
        out, lse = outputs  # out as the kernel saw it: (batch, heads, seq, d)
        for b in range(min(sequences, x["q"].shape[0])):
            n = int(x["lens"][b])
            row = None if x["table"] is None else x["table"][b]
            k, v = ((gather_cache(c[b] if row is None else c, n, row).transpose(0, 1)[None]) for c in (x["k"], x["v"]))
            q = x["q"][b : b + 1].transpose(1, 2)
            case = Case(1, q.shape[1], k.shape[1], q.shape[2], n)
            results.append(compare(self.spec, case, out[b : b + 1], lse[b : b + 1], q, k, v))
        return next((r for r in results if not r.ok), max(results, key=lambda r: r.rel))

    def tuning_flops(self, shape: Shape) -> float:
        keys = sum(sequence_lengths(shape.batch, shape.n_k))
        return 4.0 * shape.heads * shape.n_q * keys * self.spec.head_dim

    def tuning_bytes(self, shape: Shape) -> float | None:
        """K and V bytes read by one call on the tuning inputs, when that bounds its speed (one query
        tile per key/value head: decoding); None for chunked prefill, which reports TFLOP/s."""
        if self.rows(shape) > 16:
            return None
        keys = sum(sequence_lengths(shape.batch, shape.n_k))
        return 2.0 * shape.kv_heads * keys * self.spec.head_dim * self.spec.dtype.bytes
