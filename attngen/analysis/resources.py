"""The resource model: will a tile configuration fit on the GPU, before Triton is asked?

Shared memory is a sympy formula in BLOCK_M, BLOCK_N, the padded head dim, the pipeline depth and
the element size, fitted to what Triton 3.6 allocates for the generated forward kernel on sm_90
(checked against the compiler: tests/test_resources.py):

  * The query tile lives in shared memory:  ELEM * BLOCK_M * D.
  * Each pipeline stage buffers one K tile (D wide) and one V tile (D_V wide: V's head dim, `head_dim_v`,
    padded; D unless a spec sets another): with Hopper's warpgroup MMA (wgmma: 16-bit
    inputs, BLOCK_M >= 64 on sm_90+) there are `num_stages` of them; with the older MMA path
    `num_stages - 1` (the cp.async pipeline keeps one in registers); with one stage, one tile.
  * Without wgmma, P goes through shared memory to change layout: ELEM * BLOCK_M * BLOCK_N, plus
    up to 128 bytes of alignment.
  * A paged kernel's K/V loads wait on a block-table load, which takes pipeline stages of its own:
    it buffers one K/V pair at num_stages 3-4, two at 5-6, three at 7 (sm_90 compiles of the
    generated decode kernels), i.e. it behaves as `1 + max(1, (num_stages - 1) // 2)` stages, plus
    up to 1 KB for the page indices.

The backward kernels (attngen/passes/recompute.py) follow the same pattern with the roles swapped
(fitted to sm_90 compiles of the generated `attn_bwd_dq` and `attn_bwd_dkdv`, every block size
16-128 and 1-4 stages: tests/test_resources.py). Each keeps two tiles of R rows resident and
streams two tiles of S rows per pipeline stage, one D and one D_V wide:

  * `attn_bwd_dq`: Q and dO resident (R = BLOCK_M), K and V streamed (S = BLOCK_N);
  * `attn_bwd_dkdv`: K and V resident (R = BLOCK_N), Q and dO streamed (S = BLOCK_M), with the
    BLOCK_M fp32 values of the log-sum-exp and delta beside them.

  The wgmma path (16-bit inputs, R >= 64) buffers `num_stages` streamed pairs; the older MMA path
  `num_stages - 1` (at least one), plus the P tile through shared memory. A single-stage MMA
  dK/dV kernel stages its operands differently (no derivation: the largest of the three terms
  below matches every compile); a single-stage MMA dQ kernel needs up to 40% less than the model
  says (an upper bound there, as nothing near the limit runs one stage on that path).

Registers are estimated from the fp32 values each thread keeps live across the key loop (the
accumulator, D_V wide, and the score tile); a configuration needing more than the 255 a thread can have would
spill heavily, and is pruned.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir import sym
from ..lang.spec import FP8_MIN_REDUCTION

STAGES = sym.size("NUM_STAGES")
WARPS = sym.size("NUM_WARPS")
ELEM = sym.size("ELEM_BYTES")
WGMMA = sympy.Symbol("WGMMA")  # 1 on the warpgroup-MMA path, else 0

DV = sym.HEAD_DIM_V_PADDED  # V's padded head dim; HEAD_DIM_PADDED's value where a spec sets no other
_T = sympy.Piecewise((1, sympy.Lt(STAGES, 2)), (2 * STAGES, sympy.Eq(WGMMA, 1)), (2 * STAGES - 2, True))
SHARED_BYTES = (ELEM * (sym.HEAD_DIM_PADDED * sym.BLOCK_M + sym.BLOCK_N * _T * (sym.HEAD_DIM_PADDED + DV) / 2)
                + sympy.Piecewise((0, sympy.Eq(WGMMA, 1)), (ELEM * sym.BLOCK_M * sym.BLOCK_N + 128, True)))
"""Shared memory of the forward kernel, in bytes."""

REGISTERS = (sym.BLOCK_M * DV + sym.BLOCK_M * sym.BLOCK_N) / (32 * WARPS)
"""Lower bound on 32-bit registers per thread: the fp32 accumulator and score tile."""

MAX_REGISTERS = 255

ROWS_RESIDENT, ROWS_STREAMED, STAT_BYTES = sym.size("R"), sym.size("S"), sympy.Symbol("STAT_BYTES")
_PAIRS = sympy.Piecewise((STAGES, sympy.Eq(WGMMA, 1)), (sympy.Max(1, STAGES - 1), True))
_MMA_P = sympy.Piecewise(  # the MMA path's P tile in shared memory (see the module docstring)
    (sympy.Max(ELEM * sym.BLOCK_M * sym.BLOCK_N, sym.BLOCK_M * sym.HEAD_DIM_PADDED, 16 * ELEM * sym.HEAD_DIM_PADDED),
     sympy.And(sympy.Gt(STAT_BYTES, 0), sympy.Lt(STAGES, 2))),
    (ELEM * sym.BLOCK_M * sym.BLOCK_N + 128, True))
TMA = sympy.Symbol("TMA")  # 1 when the streamed tiles come through TMA descriptors, else 0
SHARED_BYTES_BACKWARD = (ELEM * ROWS_RESIDENT * (sym.HEAD_DIM_PADDED + DV)
                         + _PAIRS * (ELEM * ROWS_STREAMED * (sym.HEAD_DIM_PADDED + DV) + STAT_BYTES * ROWS_STREAMED)
                         + sympy.Piecewise((0, sympy.Eq(WGMMA, 1)), (_MMA_P, True))
                         + TMA * (1024 + 8 * STAGES))
"""Shared memory of a backward kernel, in bytes (R, S: resident and streamed rows; STAT_BYTES: the
bytes of row statistics streamed per row, 8 for dK/dV and 0 for dQ). Tiles that TMA writes are
aligned to 1 KB and each stage has an 8-byte barrier: sm_90 compiles of the dK/dV kernel with
descriptor loads take 8-1024 bytes more than without."""

REGISTERS_BACKWARD = {"attn_bwd_dq": (sym.BLOCK_M * sym.HEAD_DIM_PADDED + sym.BLOCK_M * sym.BLOCK_N) / (32 * WARPS),
                      "attn_bwd_dkdv": (sym.BLOCK_N * (sym.HEAD_DIM_PADDED + DV) + sym.BLOCK_M * sym.BLOCK_N) / (32 * WARPS)}
"""Lower bounds on 32-bit registers per thread: the fp32 accumulators (dQ; dK and dV) and one score tile."""

_LAMBDIFIED: dict = {}


def _value(expr: sympy.Expr, values: dict):
    """`expr` at `values` (symbol -> number). The formulas stay sympy (explain and the tests read
    them); each is evaluated through a lambdified copy, since `subs` takes milliseconds and tuned-table
    lookups evaluate them on a process's first call."""
    compiled = _LAMBDIFIED.get(expr)
    if compiled is None:
        symbols = sorted(expr.free_symbols, key=str)
        compiled = _LAMBDIFIED[expr] = (symbols, sympy.lambdify(symbols, expr, modules="math"))
    symbols, fn = compiled
    return fn(*(values[s] for s in symbols))


# Opt-in shared memory per block by compute capability (CUDA programming guide, table of limits).
SHARED_LIMIT = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 7): 166912, (8, 6): 101376,
                (8, 9): 101376, (12, 0): 101376, (7, 5): 65536}
DEFAULT_TARGET = (9, 0)


@dataclass(frozen=True)
class Target:
    """The GPU a configuration must fit: compute capability and shared memory per block."""

    capability: tuple[int, int]
    shared_limit: int
    name: str = ""

    @staticmethod
    def current() -> "Target":
        """The CUDA device in use, or an sm_90 (H100/H200) when there is none."""
        try:
            import torch

            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                cap = (props.major, props.minor)
                limit = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_LIMIT.get(cap, 101376)
                return Target(cap, int(limit), props.name)
        except Exception:  # noqa: BLE001 - no usable CUDA: fall back to the default target
            pass
        return Target.default()

    @staticmethod
    def default() -> "Target":
        """An sm_90 (H100/H200): what the heuristics are written for, and what generated source assumes."""
        return Target(DEFAULT_TARGET, SHARED_LIMIT[DEFAULT_TARGET], "sm_90 (default target)")


def uses_wgmma(elem_bytes: int, block_m: int, target: Target) -> bool:
    return target.capability >= (9, 0) and elem_bytes == 2 and block_m >= 64


def shared_bytes(head_dim_padded: int, elem_bytes: int, block_m: int, block_n: int, num_stages: int,
                 target: Target, paged: bool = False, head_dim_v_padded: int | None = None) -> int:
    """`head_dim_v_padded`: V's padded head dim, head_dim_padded unless given (0: no V tile, `tile_widths`)."""
    stages = 1 + max(1, (num_stages - 1) // 2) if paged else num_stages
    dv = head_dim_padded if head_dim_v_padded is None else head_dim_v_padded
    values = {sym.HEAD_DIM_PADDED: head_dim_padded, DV: dv, ELEM: elem_bytes, sym.BLOCK_M: block_m,
              sym.BLOCK_N: block_n, STAGES: stages, WGMMA: int(uses_wgmma(elem_bytes, block_m, target))}
    return int(_value(SHARED_BYTES, values)) + (1024 if paged else 0)


def registers(head_dim_v_padded: int, block_m: int, block_n: int, num_warps: int) -> float:
    """The forward's estimate: its accumulator is as wide as V's padded head dim."""
    return float(_value(REGISTERS, {DV: head_dim_v_padded, sym.BLOCK_M: block_m, sym.BLOCK_N: block_n,
                                    WARPS: num_warps}))


def shared_bytes_mla(head_dim: int, elem_bytes: int, rows: int, block_n: int, stages: int,
                     seesaw: bool = False) -> int:
    """The Gluon MLA decode kernel's shared memory (templates/gluon_mla_decode.py.j2): Q's rows x head_dim, `stages`
    latent tiles of block_n x head_dim, the [rows, block_n] P tile, two float32 rows of the warpgroups' exchange
    (`seesaw`: four, the row maxima and the sums apart) and the mbarriers (ready and empty a stage, three more;
    `seesaw` four). An sm_90 compile of (576, 512) at 64 x 64, 2 stages takes 288 bytes more (alignment;
    tests/test_gluon_mla.py)."""
    tiles = (rows + stages * block_n) * head_dim * elem_bytes + rows * block_n * elem_bytes
    return tiles + (4 if seesaw else 2) * rows * 4 + (2 * stages + (4 if seesaw else 3)) * 8


def tile_widths(spec) -> tuple[int, int]:
    """The padded widths the shared-memory formulas take for a spec's Q and K tiles and its V tiles. Where V is
    K's prefix (`v = k[:N]`, passes/latent_kv.py) Q and K are read as V's columns plus the rest, each padded on
    its own (576 for MLA's 512 + 64, where one tile would pad to 1024), and a stage holds that one K tile and
    no V tile: V's width is 0. (sm_90 compiles of the 576/512 kernel match this within 1 KB: one 32 x 576 tile
    a stage, not two; tests/test_mla.py.)"""
    if not spec.v_from_k:
        return spec.head_dim_padded, spec.head_dim_v_padded
    rest = spec.head_dim - spec.head_dim_v
    return spec.head_dim_v_padded + (1 << (rest - 1).bit_length()), 0


def infeasible(spec, config: dict, target: Target | None = None) -> str | None:
    """Why `config` cannot run `spec` on `target` (with the numbers), or None if it fits."""
    target = target or Target.current()
    (dp, dvp), acc, elem = tile_widths(spec), spec.head_dim_v_padded, spec.dtype.bytes
    bm, bn, stages, warps = config["BLOCK_M"], config["BLOCK_N"], config["num_stages"], config["num_warps"]
    if spec.dtype.fp8 and bn < FP8_MIN_REDUCTION:
        return (f"block_n={bn} is the reduction of P V, and FP8 tensor-core products reduce over at least "
                f"{FP8_MIN_REDUCTION}")
    smem = shared_bytes(dp, elem, bm, bn, stages, target, paged=spec.kv_layout.paged, head_dim_v_padded=dvp)
    dims = f"head_dim {dp}" + ("" if dvp in (dp, 0) else f" and head_dim_v {dvp}")
    if smem > target.shared_limit:
        path = "wgmma" if uses_wgmma(elem, bm, target) else "mma"
        return (f"needs {smem:,} bytes of shared memory but sm_{target.capability[0]}{target.capability[1]} "
                f"allows {target.shared_limit:,} per block (block_m={bm}, block_n={bn}, {dims} padded, "
                f"{elem}-byte elements, num_stages={stages}, {path} path)")
    regs = registers(acc, bm, bn, warps)
    if regs > MAX_REGISTERS:
        return (f"keeps at least {regs:.0f} fp32 registers per thread live (block_m={bm} x head_dim{'_v' if acc != dp else ''} {acc} "
                f"accumulator + block_m x block_n={bn} scores over {32 * warps} threads); a thread has "
                f"{MAX_REGISTERS}")
    return None


_CHOICES = {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
SPEC_FIELDS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps", "num_stages": "num_stages"}
"""Each tile key of a launch config, and the spec field that can fix it."""


def nearest_fit(spec, config: dict, target: Target | None = None, keep: tuple = ()) -> dict:
    """`config` if it fits `spec` on `target`; else the config that fits with the spec's fixed tile values
    (and the keys in `keep`) kept and the fewest other keys changed, by the least (in powers of two),
    from `check_spec_tiles`'s choices (a spec that passed that check has one, with nothing else kept);
    else `config` unchanged. A heuristic config with the spec's fixed values put in can be too big where
    each alone is not (block_n = 256 at head dim 176: four 256-row K/V tiles of 512 bytes)."""
    from itertools import product
    from math import log2

    target = target or Target.current()
    if infeasible(spec, config, target) is None:
        return config
    free = [k for k, f in SPEC_FIELDS.items() if getattr(spec, f) is None and k not in keep]

    def distance(values) -> tuple:
        changed = [(new, config[k]) for k, new in zip(free, values) if new != config[k]]
        return len(changed), sum(abs(log2(new / old)) for new, old in changed)

    for values in sorted(product(*(_CHOICES[k] for k in free)), key=distance):
        candidate = dict(config, **dict(zip(free, values)))
        if infeasible(spec, candidate, target) is None:
            return candidate
    return config


def check_spec_tiles(spec, target: Target | None = None) -> None:
    """Raise a SpecError at the spec's tile keys if no choice of its `auto` values can fit."""
    from itertools import product

    fixed = {k: getattr(spec, f) for k, f in SPEC_FIELDS.items() if getattr(spec, f) is not None}
    if not fixed:
        return
    target = target or Target.current()
    free = [k for k in _CHOICES if k not in fixed]
    problems = []
    for values in product(*(_CHOICES[k] for k in free)):
        config = dict(fixed, **dict(zip(free, values)))
        problem = infeasible(spec, config, target)
        if problem is None:
            return
        problems.append(problem)
    key = next(f for k, f in SPEC_FIELDS.items() if k in fixed)
    # Report the least demanding completion: its numbers show how far off the spec is.
    raise spec.error(key, f"these tiles cannot fit: the smallest choice {min(problems, key=len)}")


BACKWARD_KERNELS = ("attn_bwd_dq", "attn_bwd_dkdv")


def shared_bytes_backward(kernel_name: str, head_dim_padded: int, elem_bytes: int, block_m: int, block_n: int,
                          num_stages: int, target: Target, tma: bool = False, head_dim_v_padded: int | None = None) -> int:
    """`tma`: the kernel reads its streamed tiles through TMA descriptors (policy/tma.py); `head_dim_v_padded`: V's
    padded head dim, head_dim_padded unless given."""
    resident, streamed, stats = (block_m, block_n, 0) if kernel_name == "attn_bwd_dq" else (block_n, block_m, 8)
    values = {sym.HEAD_DIM_PADDED: head_dim_padded, DV: head_dim_v_padded or head_dim_padded, ELEM: elem_bytes, sym.BLOCK_M: block_m, sym.BLOCK_N: block_n,
              STAGES: num_stages, ROWS_RESIDENT: resident, ROWS_STREAMED: streamed, STAT_BYTES: stats,
              WGMMA: int(uses_wgmma(elem_bytes, resident, target)), TMA: int(tma and target.capability >= (9, 0))}
    return int(_value(SHARED_BYTES_BACKWARD, values))


def infeasible_backward(spec, kernel_name: str, config: dict, target: Target | None = None, *,
                        tma: bool) -> str | None:
    """Why `config` cannot run the backward kernel `kernel_name` of `spec` on `target`, or None. `tma`: the
    kernel reads through TMA descriptors (`policy.tma.reads_through_descriptors`)."""
    if kernel_name not in BACKWARD_KERNELS:
        raise ValueError(f"no backward kernel '{kernel_name}'; the backward kernels are {', '.join(BACKWARD_KERNELS)}")
    target = target or Target.current()
    dp, dvp, elem = spec.head_dim_padded, spec.head_dim_v_padded, spec.dtype.bytes
    bm, bn, stages, warps = config["BLOCK_M"], config["BLOCK_N"], config["num_stages"], config["num_warps"]
    smem = shared_bytes_backward(kernel_name, dp, elem, bm, bn, stages, target, tma=tma, head_dim_v_padded=dvp)
    dims = f"head_dim {dp}" + ("" if dvp in (dp, 0) else f" and head_dim_v {dvp}")
    if smem > target.shared_limit:
        return (f"{kernel_name} needs {smem:,} bytes of shared memory but sm_{target.capability[0]}"
                f"{target.capability[1]} allows {target.shared_limit:,} per block (block_m={bm}, block_n={bn}, "
                f"{dims} padded, {elem}-byte elements, num_stages={stages})")
    regs = float(_value(REGISTERS_BACKWARD[kernel_name], {sym.HEAD_DIM_PADDED: dp, DV: dvp, sym.BLOCK_M: bm,
                                                           sym.BLOCK_N: bn, WARPS: warps}))
    if regs > MAX_REGISTERS:
        held = "dQ" if kernel_name == "attn_bwd_dq" else "dK and dV"
        return (f"{kernel_name} keeps at least {regs:.0f} fp32 registers per thread live (the {held} "
                f"accumulator{'s' if held != 'dQ' else ''} and a block_m={bm} x block_n={bn} score tile over "
                f"{32 * warps} threads); a thread has {MAX_REGISTERS}")
    return None


def wide_backward_shared_bytes(shape, tile_dim: int, head_dim_v: int, elem_bytes: int = 2, pieces: tuple = ()) -> int:
    """Shared memory of the Gluon backward's wide path (`ir.GluonBackward.wide`, templates/gluon_backward.py.j2) at
    `shape` (an `ir.GluonShape`), with Q and K tiles `tile_dim` wide and V and dO `head_dim_v` wide, in bytes: what
    Triton 3.6 allocates less its alignment padding (at most 512 bytes in sm_90 compiles,
    tests/test_gluon_wide_backward.py). K and V stay resident, P^T and dS^T are two [block_n, block_m] tiles, double
    buffered, and each stage has its lse and delta rows; with one stage, Q and dO beside the consumers' float32 dQ
    tiles ([block_m, tile_dim / consumers] each); with more, each stage is those dQ tiles, which hold the stage's Q
    and dO until its dQ is made (`hopper.BWD_WIDE_STAGED`). With `pieces` (`ir.GluonBackward.pieces`) Q and K are
    sum(pieces) wide (not `tile_dim`), each consumer's dQ tile its piece's width, and every stage has its own Q and
    dO beside them (`hopper.BWD_WIDE_SPLIT`)."""
    m, n, stages = shape.block_m, shape.block_n, shape.stages
    tile_dim = sum(pieces) or tile_dim
    dq_tiles = m * tile_dim * 4 if pieces else shape.consumers * m * (tile_dim // shape.consumers) * 4
    resident = elem_bytes * n * (tile_dim + head_dim_v) + 4 * elem_bytes * n * m
    ring = stages > 1 and not pieces  # (the stages are the dQ tiles)
    streamed = stages * dq_tiles if ring else stages * elem_bytes * m * (tile_dim + head_dim_v) + dq_tiles
    rows = stages * 2 * m * 4
    barriers = 8 * (1 + 2 * stages + (5 if ring else 3))  # K/V's, a stage's ready and empty, the exchange's
    return resident + streamed + rows + barriers
