"""What a spec's mask leaves of the score matrix, for concrete sizes: each tile classified, and the kept scores.

The mask's predicates are the IR's (ir/variants.mask_preds, or the plain causal diagonal), taken at the
sizes' alignment. For a tile of query rows [q0, q1] and keys [k0, k1], a predicate that reads
`c * k + f(q) <= 0` (`Pred.band`, f monotone in q) is extreme at the tile's corners, so whether it holds
for every element (full) or for none (empty) follows from four values; a tile is empty when one predicate
holds nowhere on it, full when every predicate holds everywhere and no key lies past N_K (the kernel's
KEY_BOUND masks those), partial otherwise. Query rows past N_Q are never stored, so they do not count. An
EXPR predicate (a condition the analysis cannot bound) leaves every tile the bands keep alive partial: the
kernels evaluate it element by element there.

The kept-score count is exact: per query row, bands give the kept keys as one interval (closed form); an
EXPR predicate is evaluated numerically inside that interval, a chunk of rows at a time. FLOPs follow the
FlashAttention convention on kept scores: 4 * d per kept score forward, 2.5 times that backward.
"""

from __future__ import annotations

import enum
import functools
import operator
from dataclasses import dataclass

import sympy
import torch

from ..ir import sym
from ..ir import variants as irv
from ..ir.nodes import Pred, PredKind
from ..lang.spec import Mask, Spec
from . import cost


class Block(enum.Enum):
    EMPTY = "."
    FULL = "#"
    PARTIAL = "~"


# -- the predicates -----------------------------------------------------------------------------------


def predicates(spec: Spec, offset=None) -> tuple[Pred, ...]:
    """The spec's mask as the IR's predicates, with the query's alignment `offset` (default: symbolic,
    0 top-left or N_K - N_Q bottom-right)."""
    if offset is None:
        offset = sym.N_K - sym.N_Q if spec.bottom_right else sym.ZERO
    if spec.variant.mask is not None:
        return irv.mask_preds(spec.variant.mask, offset)
    if spec.mask is Mask.NONE:
        return ()
    return (Pred(PredKind.CAUSAL, sympy.sympify(offset)),)


def bounded(pred: Pred) -> bool:
    """Whether the block analysis bounds the predicate in closed form (else it is evaluated per block)."""
    return pred.band("key") is not None


def describe(pred: Pred) -> str:
    """The predicate as a condition on the element's query row q_idx and key k_idx."""
    if pred.kind is PredKind.EXPR:
        return str(pred.bound)
    c, f = pred.band("key")
    side = "k_idx <= " if c > 0 else "k_idx >= "
    return side + str(sympy.expand(-f if c > 0 else f))


def _offset(spec: Spec, n_q: int, n_k: int) -> int:
    return n_k - n_q if spec.bottom_right else 0


# -- numbers from sympy: the few functions predicates use, over numpy integer arrays ----------------------

def _max(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


def _min(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


# (`//` and `%` floor on tensors as on Python integers: the IR's FloorDivS and ModS semantics)
_FUNCS = {
    "FloorDiv": operator.floordiv, "FloorDivS": operator.floordiv, "ModS": operator.mod,
    "CeilDiv": lambda a, b: -((-a) // b),
}


# n-ary nodes, folded left to right (a relational has two arguments)
_FOLDS = {sympy.Add: operator.add, sympy.Mul: operator.mul, sympy.Max: _max, sympy.Min: _min,
          sympy.Lt: operator.lt, sympy.Le: operator.le, sympy.Gt: operator.gt, sympy.Ge: operator.ge,
          sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.And: operator.and_, sympy.Or: operator.or_}


def numeric(e, env: dict):
    """The value of an integer (or boolean) sympy expression over `env` (symbol -> int64 tensor or int),
    broadcast. Raises TypeError on a node it does not know."""
    rec = lambda x: numeric(x, env)
    if e in env:
        return env[e]
    if e is sympy.true:
        return True
    if e is sympy.false:
        return False
    if e.is_Integer:
        return int(e)
    if e.is_Number:
        return float(e)
    name = type(e).__name__
    if name in _FUNCS:
        return _FUNCS[name](*(rec(a) for a in e.args))
    args = [rec(a) for a in e.args]
    if isinstance(e, sympy.Pow) and e.args[1].is_Integer and int(e.args[1]) >= 0:
        return args[0] ** int(e.args[1])
    if isinstance(e, sympy.Abs):
        return abs(args[0])
    for kind, op in _FOLDS.items():
        if isinstance(e, kind):
            return functools.reduce(op, args)
    if isinstance(e, sympy.Not):
        return ~torch.as_tensor(args[0], dtype=torch.bool)
    raise TypeError(f"no numeric value for {e!r}")


def _bands(preds, axis_values):
    """Each bounded predicate as (c, f values over `axis_values` of the query), c = +-1 or 0."""
    out = []
    for p in preds:
        band = p.band("key")
        if band is not None:
            c, f = band
            out.append((c, torch.as_tensor(numeric(f, {sym.q_idx: axis_values})).expand(axis_values.shape)))
    return out


# -- the block map -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockMap:
    """Each (query block, key block) tile of an N_Q x N_K score matrix as empty, full or partial."""

    n_q: int
    n_k: int
    block_m: int
    block_n: int
    cells: tuple[str, ...]  # one string per query block, a Block value's character per key block
    evaluated: bool         # whether an EXPR predicate makes live tiles partial (evaluated per block)

    def count(self, kind: Block) -> int:
        return sum(row.count(kind.value) for row in self.cells)

    def text(self, cap: int = 32) -> list[str]:
        """The map as lines of '.', '#', '~', one per query block, at most `cap` x `cap` (a coarser grid
        merges tiles: a merged cell is '.' or '#' only when all its tiles are)."""
        rows, cols = len(self.cells), len(self.cells[0]) if self.cells else 0
        sr, sc = -(-rows // cap), -(-cols // cap)
        lines = []
        for i in range(0, rows, sr):
            line = []
            for j in range(0, cols, sc):
                kinds = {ch for row in self.cells[i:i + sr] for ch in row[j:j + sc]}
                line.append(kinds.pop() if len(kinds) == 1 else Block.PARTIAL.value)
            lines.append("".join(line))
        return lines


def classify(spec: Spec, n_q: int, n_k: int, block_m: int, block_n: int) -> BlockMap:
    """The block map of the spec's mask at these sizes and tiles, by interval reasoning over each tile's
    corners (see the module docstring)."""
    preds = predicates(spec, _offset(spec, n_q, n_k))
    rows, cols = -(-n_q // block_m), -(-n_k // block_n)
    q0 = torch.arange(rows, dtype=torch.int64) * block_m
    q1 = torch.clamp(q0 + block_m - 1, max=n_q - 1)
    k0 = torch.arange(cols, dtype=torch.int64) * block_n
    k1 = k0 + block_n - 1
    alive = torch.ones((rows, cols), dtype=torch.bool)
    full = (k1 < n_k).expand(rows, cols).clone()  # KEY_BOUND: keys past N_K are masked
    for c, f in _bands(preds, torch.stack([q0, q1])):
        f_lo, f_hi = torch.minimum(f[0], f[1])[:, None], torch.maximum(f[0], f[1])[:, None]
        k_lo, k_hi = (k0, k1) if c >= 0 else (k1, k0)  # the keys giving c*k its least and greatest value
        alive &= c * k_lo[None, :] + f_lo <= 0
        full &= c * k_hi[None, :] + f_hi <= 0
    evaluated = any(not bounded(p) for p in preds)
    if evaluated:
        full[:] = False
    code = torch.where(alive, torch.where(full, 1, 2), 0).tolist()
    chars = (Block.EMPTY.value, Block.FULL.value, Block.PARTIAL.value)
    cells = tuple("".join(chars[x] for x in row) for row in code)
    return BlockMap(n_q, n_k, block_m, block_n, cells, evaluated)


# -- kept scores ---------------------------------------------------------------------------------------


def _key_intervals(preds, rows: torch.Tensor, n_k: int):
    """Per query row, the keys [lo, hi] every bounded predicate keeps (closed form), within [0, n_k)."""
    lo = torch.zeros(rows.shape, dtype=torch.int64)
    hi = torch.full(rows.shape, n_k - 1, dtype=torch.int64)
    for c, f in _bands(preds, rows):
        if c > 0:    # k <= -f(q)
            hi = torch.minimum(hi, -f)
        elif c < 0:  # k >= f(q)
            lo = torch.maximum(lo, f)
        else:        # holds for no key of rows where f(q) > 0
            hi = torch.where(f > 0, -1, hi)
    return lo, hi


def kept_scores(spec: Spec, n_q: int, n_k: int, batch: int = 1, heads: int = 1, chunk: int = 1 << 22) -> int:
    """The number of (query, key) scores the mask keeps over `batch` x `heads` problems of N_Q x N_K.
    Exact: bands in closed form per row; an EXPR predicate evaluated on each row's band, about `chunk`
    elements at a time (per batch and head only when it reads them)."""
    if n_q <= 0 or n_k <= 0:
        return 0
    preds = predicates(spec, _offset(spec, n_q, n_k))
    rows = torch.arange(n_q, dtype=torch.int64)
    lo, hi = _key_intervals(preds, rows, n_k)
    width = torch.clamp(hi - lo + 1, min=0)
    exprs = [p.bound for p in preds if not bounded(p)]
    if not exprs:
        return int(width.sum()) * batch * heads
    per_head = any(e.has(sym.q_head, sym.b) for e in exprs)
    problems = [(b, h) for b in range(batch) for h in range(heads)] if per_head else [(0, 0)]
    total = 0
    widest = max(1, int(width.max()))
    # A chunk of rows spans its bands' union: at most `step` + `widest` keys when the band moves by a key a row.
    step = max(1, min(chunk // widest, widest))
    for b, h in problems:
        for r0 in range(0, n_q, step):
            r1 = min(n_q, r0 + step)
            if not width[r0:r1].any():
                continue
            k_lo, k_hi = int(lo[r0:r1].min()), int(hi[r0:r1].max())
            k = torch.arange(k_lo, k_hi + 1, dtype=torch.int64)[None, :]
            env = {sym.q_idx: rows[r0:r1, None], sym.k_idx: k, sym.q_head: h, sym.b: b}
            keep = torch.ones((1, k.shape[1]), dtype=torch.bool)
            for e in exprs:
                keep = keep & torch.as_tensor(numeric(e, env), dtype=torch.bool)
            # Each row counts the kept keys of its band [lo, hi] as a difference of running sums (a row of
            # `keep` serves every query row when the condition does not read q).
            sums = torch.nn.functional.pad(keep.to(torch.int32).cumsum(dim=1), (1, 0))
            which = torch.arange(r1 - r0)[:, None] if keep.shape[0] > 1 else torch.zeros((r1 - r0, 1), dtype=torch.int64)
            ends = torch.stack([lo[r0:r1] - k_lo, hi[r0:r1] - k_lo + 1], dim=1).clamp(0, k.shape[1])
            counts = sums[which, ends]
            total += int(torch.where(width[r0:r1] > 0, counts[:, 1] - counts[:, 0], 0).sum())
    return total if per_head else total * batch * heads


def fa_flops(spec: Spec, sizes: dict, backward: bool = False) -> float:
    """The FlashAttention-convention FLOPs of one call at `sizes` (B, H, N_Q, N_K, HEAD_DIM; HEAD_DIM_V, else the
    spec's head_dim_v): 4 * d per kept score forward, x2.5 backward (cost.fa_flops' generalisation where V has
    another head dim). A plain mask keeps cost.fa_flops' formula (causal counted as half), so the numbers printed
    for plain specs stay what they were."""
    if spec.splits_head_dims:
        sizes = {"HEAD_DIM_V": spec.head_dim_v, **sizes}
    if spec.variant.mask is None:
        return cost.evaluate(cost.fa_flops(spec.mask.is_causal, backward, spec.splits_head_dims), sizes)
    kept = kept_scores(spec, sizes["N_Q"], sizes["N_K"], sizes["B"], sizes["H"])
    if spec.splits_head_dims:
        return float(cost.per_score(backward, sizes["HEAD_DIM"], sizes["HEAD_DIM_V"]) * kept)
    flops = 4 * sizes["HEAD_DIM"] * kept
    return flops * 2.5 if backward else float(flops)
