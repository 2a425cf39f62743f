"""Launch configurations: the tile sizes, warps and pipeline depth a kernel runs with.

A spec fixes some of these and leaves the rest `auto`. Until the autotuner has a measured answer
for the GPU at hand, `default_config` fills the `auto` ones from a heuristic by head dim and dtype
(close to what FlexAttention and the Triton tutorial use on Hopper), and small tiles in Triton's
interpreter, where big tiles only cost time. `search_space` is what the autotuner (attngen/tuning/)
tries for the `auto` ones; the run-time lookup of tuned configs lives there too.
"""

from __future__ import annotations

from ..analysis.resources import SPEC_FIELDS, nearest_fit
from ..lang.spec import DType, Spec
from .tma import reads_through_descriptors

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")

SEARCH_SPACE = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128), "num_warps": (4, 8),
                "num_stages": (1, 2, 3, 4)}
"""The values the autotuner tries for a tile key left `auto`: the tiles `check_spec_tiles` considers,
plus a fourth pipeline stage. The resource model prunes what cannot fit before anything compiles.
256-wide tiles are left out to keep the space small: the Hopper probe (benchmarks/NOTES.md) found
every best forward config at 64 and 128."""


DECODE_SPACE = {"BLOCK_N": (16, 32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4, 5, 7),
                "num_splits": (0, 1, 2, 4, 8, 16, 32, 64)}
"""The autotuner's values for a kernel over a KV cache (attngen/tuning/decoding.py): BLOCK_M follows
the call's rows; a paged kernel spends stages on its block-table load (5 and 7 buffer two and three
K/V tiles); `num_splits` (for `split_kv = auto`) 0 is the run-time heuristic of attngen/policy/splits.py."""


def heuristic(spec: Spec, interpreter: bool = False) -> dict[str, int]:
    """A reasonable config for a GPU (or the interpreter), before any tuning."""
    # NOTE: a paged varlen kernel tiles the queries of prefills beside decodes (no GQA packing): prefill tiles,
    # BLOCK_N kept within a page by its launcher. Not measured yet.
    if (spec.is_split or spec.kv_layout.paged) and not spec.varlen:
        return decode_heuristic(spec, interpreter)
    if interpreter:
        # The interpreter pays per block iteration, not per element: big tiles are fast there.
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    d = max(spec.head_dim_padded, spec.head_dim_v_padded)  # the wider of the two head dims sizes the tiles
    if spec.dtype is DType.FP32:
        bm, bn, warps = (64, 32, 4) if d <= 64 else (32, 32, 4)
    elif d <= 64:
        # H200 tuning (attngen/tuned/): (128, 64, 8 warps, 4 stages) wins at 4k and 16k non-causal.
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4}
    elif d <= 128:
        # H200 tuning: (128, 128, 8 warps, 3 stages) wins for every d=128 spec at 4k and 16k.
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    else:
        bm, bn, warps = 64, 32, 4
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": 2 if d > 128 else 3}


def default_config(spec: Spec, interpreter: bool = False, target=None) -> dict[str, int]:
    """The heuristic config with the spec's fixed values applied. Where the two together do not fit the
    GPU (`target`, an attngen.analysis.resources.Target; default: the one in use), the keys the spec leaves
    `auto` move to the nearest config that fits (`resources.nearest_fit`). The interpreter has no
    such limits."""
    config = heuristic(spec, interpreter)
    for key, field in SPEC_FIELDS.items():
        value = getattr(spec, field)
        if value is not None:
            config[key] = value
    return config if interpreter else nearest_fit(spec, config, target)


BWD_MAX_GROUP_SPLIT = 8
"""At most how many programs of the Triton dK/dV kernel share the query heads of one GQA group (1: never split;
pass group-split then adds no split kernel). Its grid has one program per (batch, K/V head, key tile), each walking
every query head of its group: at B=1 with 4 K/V heads and 2049 keys (issue 51, d=128 GQA 28/4 causal, 128-key
tiles) that is 68 programs on the H200's 132 multiprocessors. `splits.group_split`, the Gluon backward's rule, picks
the count per launch; the cap, hopper.BWD_MAX_GROUP_SPLIT's, bounds the float32 workspace (parts x the dK and dV
bytes x 2). Not measured yet."""

BWD_SUM_ELEMENTS = 4096
"""Elements a program of the pass that sums the split's parts takes: 4096 / the tiles' head dim rows, as the Gluon
row passes' (hopper.BWD_ROW_ELEMENTS, measured there)."""


def backward_config(spec: Spec, interpreter: bool = False) -> dict[str, dict[str, int]]:
    """Launch configs of the two backward kernels, by kernel name.

    `attn_bwd_dq` tiles queries by BLOCK_M and loops over BLOCK_N keys, like the forward;
    `attn_bwd_dkdv` tiles keys by BLOCK_N and loops over BLOCK_M queries. It keeps two fp32
    accumulators (dK, dV) per key row, so it wants more warps and a smaller query step.
    """
    if interpreter:
        tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
        return {"attn_bwd_dq": dict(tile), "attn_bwd_dkdv": dict(tile)}
    d = max(spec.head_dim_padded, spec.head_dim_v_padded)  # the wider of the two head dims sizes the tiles
    if spec.dtype is DType.FP32:
        dq = dkdv = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    # From config sweeps on an H200 (bf16, N=4096; NOTES.md v1-v2):
    # the causal kernels do fewer blocks per program and prefer smaller tiles.
    elif d <= 64 and spec.mask.is_causal:
        dq = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        dkdv = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    elif d <= 64:
        dq = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
        # with the tma pass's descriptor loads 64 x 64 / 3 stages runs at 450 TFLOP/s, 434 at 32 x 64;
        # with pointers 32 x 64 is the better (403 against 356)
        if reads_through_descriptors(spec, "attn_bwd_dkdv"):
            dkdv = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        else:
            dkdv = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    elif d <= 128 and spec.mask.is_causal:
        dq = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        dkdv = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    elif d <= 128:
        # dK/dV on 64 x 64 tiles and 4 warps: 486 TFLOP/s against 454 for 64 x 128 on 8 warps (which
        # spills), 529 with the tma pass's descriptor loads (NOTES.md v5)
        dq = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        dkdv = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    else:
        dq = dkdv = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"attn_bwd_dq": dict(dq), "attn_bwd_dkdv": dict(dkdv)}


def decode_heuristic(spec: Spec, interpreter: bool = False) -> dict[str, int]:
    """Decoding over a KV cache: few query rows (a decode tile holds the GROUP heads of one key/value
    head), so small BLOCK_M; the cache streams through BLOCK_N keys at a time. Pages looked up once
    per tile bound BLOCK_N (the generated launcher enforces it).

    A paged kernel spends pipeline stages on its block-table load: compiled for sm_90 it buffers one
    K/V tile pair at num_stages 3-4, two at 5-6, three at 7. Measured on an H200 (bf16, 32/8 heads,
    d=128): contiguous BLOCK_N=128 with 3 stages, 16-token pages
    128 with 5, per-tile pages (>= 64 tokens) 64 with 7 bring paged to 0.96-0.98x of contiguous."""
    if interpreter:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if spec.v_from_k:
        # MLA (v = k[:512]): 16-128 query heads share the latent head, so BLOCK_M 64 reaches wgmma's rows; the
        # 64 x 512 fp32 accumulator over 8 warps is 128 registers a thread. benchmarks/mla_sweep.py on the H200
        # (batch 64 x 8k, 2026-11-28): 64-key tiles, 2 stages, 8 warps: 16 heads 3,518 GB/s (4 warps 3,674),
        # 128 heads 245 TFLOP/s, against 2,379 and 168 with 32-key tiles (NOTES.md, MLA decode).
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    d = max(spec.head_dim_padded, spec.head_dim_v_padded)  # the wider of the two head dims sizes the tiles
    if d > 128:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    page = spec.kv_layout.page_size if spec.kv_layout.paged else None
    if page is None:
        return {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    if page < 64:
        return {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 5}
    return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 7}


def search_space(spec: Spec) -> dict[str, tuple[int, ...]]:
    """The autotuner's candidates per key: `SEARCH_SPACE` where the spec says `auto`, else its value."""
    space = {}
    for key, field in SPEC_FIELDS.items():
        value = getattr(spec, field)
        space[key] = SEARCH_SPACE[key] if value is None else (value,)
    return space
