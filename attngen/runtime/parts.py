"""The launches of a loaded kernel beyond its forward, each with its own launch config.

A forward+backward spec's backward is two launches (attngen/passes/recompute.py), `attn_bwd_dq` and
`attn_bwd_dkdv` (`BackwardPart`); a split-KV or paged spec's `forward_kvcache` entry is another
(`KVCachePart`, which `attngen.attention_with_kvcache` launches through). Each part, like the `Kernel` for its
forward, gives the config lookup of attngen/runtime/tables.py what it reads: `tuning_problem()`,
`tuning_space()`, `tuning_default()`, `tuning_infeasible(config, target)`; the tuner (attngen/tuning/) adapts
them to its search.

`KVCachePart`'s config differs from the prefill forward's:

  * BLOCK_M is not searched: a tile holds the query rows of one key/value head (the group's heads
    x the new tokens, when the spec packs GQA), so it follows from the call's shape (`block_m`);
    the resource model prunes with the smallest tile, 16 rows, and a stored config that cannot
    fit a call's larger tile gives way to the heuristic for that call.
  * the split count is a key of its own, `num_splits`, when the spec says `split_kv = auto`:
    0 is the run-time heuristic (attngen/policy/splits.py), other values fix the count. A fixed count
    is only right for the shapes it was measured at, so it is used for its own bucket only; a
    call served by the nearest bucket's entry takes the heuristic instead.
  * a spec with the Gluon decode kernel (pass warp-specialize-decode) has a key `warp_specialized`:
    1 runs the Gluon kernel, 0 the Triton kernel. A bucket's entry thus says which kernel runs, and at which
    split count; on GPUs without the Gluon kernel 1 is the same as 0. An entry without the key was tuned
    before the spec had the Gluon kernel and runs the Triton kernel it was measured on. Calls in other
    buckets take the default (the Gluon kernel where it runs).
  * a bucket's entry may hold a `uniform` config, which calls that pass `cache_seqlens` as an int (every
    sequence of one length) take.

The spec's tile keys (block_m, ...) describe the forward kernel; the spec language has none for the
backward kernels, so all four keys are searched and the backward's problem text leaves the spec's tiles out.
"""

from __future__ import annotations

import torch

from ..analysis.resources import infeasible, infeasible_backward, nearest_fit
from ..env import interpreting
from ..policy import configs
from ..policy.tma import reads_through_descriptors
from . import tables, warmup
from .keys import Shape, problem_text

PARTS = ("attn_bwd_dq", "attn_bwd_dkdv")
_TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages")


class BackwardPart:
    """One of the two backward kernels of `kernel` (a loaded forward+backward `Kernel`)."""

    def __init__(self, kernel, name: str):
        if name not in PARTS:
            raise ValueError(f"no backward kernel '{name}'; the backward kernels are {', '.join(PARTS)}")
        self.kernel, self.name, self.spec = kernel, name, kernel.spec

    def __repr__(self) -> str:
        return f"<backward kernel {self.name} of {self.spec.name}>"

    @property
    def autotune(self):
        return self.kernel.autotune

    def tuning_problem(self) -> str:
        return problem_text(self.spec, f"backward {self.name}", ignore=("direction",) + _TILE_KEYS)

    def tuning_space(self) -> dict:
        return dict(configs.SEARCH_SPACE)

    def tuning_default(self) -> dict:
        return configs.backward_config(self.spec, interpreter=interpreting())[self.name]

    def tuning_infeasible(self, config: dict, target) -> str | None:
        return infeasible_backward(self.spec, self.name, config, target,
                                   tma=reads_through_descriptors(self.spec, self.name))


class KVCachePart:
    """The `forward_kvcache` entry of `kernel` (a loaded `Kernel` whose spec is split or paged)."""

    tuning_optional = ("warp_specialized",)  # absent from entries tuned before the spec had the Gluon kernel

    def __init__(self, kernel):
        self.kernel, self.spec = kernel, kernel.spec
        self._fits: dict = {}
        self._configs: dict = {}

    def __repr__(self) -> str:
        return f"<kvcache kernel of {self.spec.name}>"

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
        memo_key = (tables.generation(), device_index, shape, uniform)
        found = self._configs.get(memo_key)
        if found is None:
            if len(self._configs) > 4096:
                self._configs.clear()
            found = self._configs[memo_key] = self._config(shape, device_index, uniform)
        return dict(found)

    def _config(self, shape: Shape, device_index: int | None, uniform: bool = False) -> dict:
        found, exact = tables.launch_choice(self, shape, device_index, uniform)
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
        config = dict(self.tuning_default(), BLOCK_M=block_m)
        for keep in (("BLOCK_M",), ()):
            fitted = nearest_fit(self.spec, config, keep=keep)
            if self._fit(fitted):
                return fitted
        return config

    def _fit(self, config: dict) -> bool:
        key = tuple(sorted(config.items()))
        fits = self._fits.get(key)
        if fits is None:
            fits = self._fits[key] = infeasible(self.spec, config) is None
        return fits

    def launch(self, q4, k4, v4, cache_seqlens, block_table, scale: float, out4, lse, config: dict,
               num_splits: int = 0, tensors: dict | None = None):
        """forward_kvcache on (batch, heads, seq, d) views; `num_splits` (if not 0) overrides the config's;
        `tensors`: the spec's run-time tensors by keyword (alibi_slopes, sinks)."""
        config = dict(config)
        splits = config.pop("num_splits", 0)
        warmup.wait()
        return self.kernel.module.forward_kvcache(q4, k4, v4, cache_seqlens, block_table, scale, out4, lse,
                                                  num_splits or splits, config, **(tensors or {}))

    # -- what the config lookup reads (attngen/runtime/tables.py) ---------------------------------
    def tuning_problem(self) -> str:
        return problem_text(self.spec, "kvcache", ignore=("direction",))

    def has_gluon(self) -> bool:
        """Whether the spec has a Gluon decode kernel (pass warp-specialize-decode, or warp-specialize-mla): read from
        the generated module's shapes (WSD_SHAPE, WSM_SHAPE), not the program, which a module from the disk cache
        would rebuild (sympy in the passes: a cached process's first decode call took 1.2 s on the H200, 3 s of it
        under cProfile in compile_program, for the tuned-table lookup's question; benchmarks/NOTES.md v57)."""
        module = self.kernel.module
        return hasattr(module, "WSD_SHAPE") or hasattr(module, "WSM_SHAPE")

    def rounds_q(self) -> int:
        """The e4m3 terms its Gluon decode kernel takes q's rows as (an FP8 cache's `q_e4m3`, the module's
        WSD_SHAPE["Q_E4M3"]) where it runs; 0: q as given."""
        shape = getattr(self.kernel.module, "WSD_SHAPE", None)
        return shape.get("Q_E4M3", 0) if shape is not None and self.gluon_runs_here() else 0

    def gluon_runs_here(self) -> bool:
        """Whether this process can run it: compiled mode on an sm_90 GPU."""
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
        config = configs.default_config(self.spec, interpreter=interpreting())
        del config["BLOCK_M"]
        if self.spec.split_kv is None:
            config["num_splits"] = 0
        if self.has_gluon():  # untuned calls take the Gluon kernel where it runs
            config["warp_specialized"] = int(self.gluon_runs_here())
        return config

    def tuning_infeasible(self, config: dict, target) -> str | None:
        # from the generated module, not the program: rebuilding the program (sympy in the passes)
        # for a tuned-table lookup took seconds of a cached process's first call
        page_tile = getattr(self.kernel.module, "MAX_BLOCK_N", None)
        if page_tile is not None and config["BLOCK_N"] > page_tile:
            return (f"block_n={config['BLOCK_N']} crosses a page: pages of {page_tile} tokens are looked up "
                    "once per key tile, so block_n must not exceed the page size")
        tiles = {k: v for k, v in config.items() if k not in ("num_splits", "warp_specialized")}
        return infeasible(self.spec, dict(tiles, BLOCK_M=self.spec.block_m or 16), target)
