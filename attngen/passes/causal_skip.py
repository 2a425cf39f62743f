"""causal-skip: visit only the blocks a mask leaves alive, and mask only where it cuts.

A loop over key blocks (or, in the backward, over query blocks) whose score tile is masked is split
into up to three loops, in order:

    [live_lo, full_lo)   leading blocks the mask cuts through      (masked)
    [full_lo, full_hi)   blocks the mask keeps entirely            (no mask, no bounds checks)
    [full_hi, live_hi)   trailing blocks the mask cuts through     (masked)

Blocks outside [live_lo, live_hi) are wholly masked and never visited: for a causal mask that is
everything above the diagonal. Every predicate is a linear inequality in (query, key) positions
(`Pred.holds_for`), so for a loop over one axis with the other axis's tile fixed, the first/last
block that is entirely kept or entirely dropped is a closed-form expression in the sizes; sympy
builds and simplifies it, and a range that is empty for every size is dropped. Predicates that do
not depend on the loop's axis stay in every region.
"""

from __future__ import annotations

import random
from dataclasses import replace

import sympy

from .. import ir
from ..ir import sym
from ..errors import InternalError
from ..ir import Assign, Call, Load, Loop, LoopKind, Masked, Op, PredKind, Ref, Span

NAME = "causal-skip"
_SIMPLIFY_OPS = 40


def _masks_in(loop: Loop) -> list[Masked]:
    found = []
    for st in ir.walk_stmts(loop.body):
        for x in ir.stmt_exprs(st):
            found.extend(e for e in ir.walk_expr(x) if isinstance(e, Masked))
    return found


def _ends(span: Span, group=sym.ONE):
    """The first and last real position of a span (those below its limit: the rows a tile has past the
    sequence end are never stored, so what they see does not matter). With GQA packing, `group` rows share
    a position (row // group)."""
    first, last = span.start, span.start + span.size - 1
    if span.limit is not None:
        last = sympy.Min(last, span.limit - 1)
    if group != 1:
        first, last = sym.FloorDiv(first, group), sym.FloorDiv(last, group)
    return first, last


def regions(loop: Loop, mask: Masked):
    """The three ranges (and the predicates each keeps) for a loop over one axis of `mask`.

    Each predicate reads `c * x + f(y) <= 0` for x the loop's position and y the other axis's (`Pred.band`),
    f antitone where c > 0 and monotone where c < 0, so over the other tile f is extreme at its ends, and
    the blocks where the predicate holds for every element (full) or for none (dead) are a prefix or a
    suffix of the loop, found in closed form. A predicate that does not depend on x, or that cannot be
    solved for it, stays in every region."""
    if mask.key.start == loop.var:
        axis, other = "key", mask.query
    elif mask.query.start == loop.var:
        axis, other = "query", mask.key
    else:
        return None
    tile = mask.key if axis == "key" else mask.query
    if axis == "query" and mask.query_group != 1:
        raise InternalError("causal-skip: a loop over packed query rows")
    group = mask.query_group if axis == "key" else sym.ONE
    if sympy.simplify(tile.size - loop.step) != 0:
        raise InternalError(f"causal-skip: tile of {tile.size} positions in a loop of step {loop.step}")
    y = sym.q_idx if axis == "key" else sym.k_idx
    first, last = _ends(other, group)
    lo, hi, step = loop.start, loop.stop, loop.step
    live_starts, live_ends, full_starts, full_ends, kept = [], [], [], [], []
    for pred in mask.preds:
        band = pred.band(axis)
        if band is None or band[0] == 0:
            kept.append(pred)
            continue
        c, f = band
        at_first, at_last = f.subs(y, first), f.subs(y, last)
        if c > 0:  # x <= -f(y): kept for low positions: full prefix, dead suffix
            f_min, f_max = at_last, at_first
            full_ends.append(lo + sym.FloorDiv(sympy.Max(0, -f_max - lo + 1), step) * step)
            live_ends.append(-f_min + 1)
        else:      # x >= f(y): kept for high positions: dead prefix, full suffix
            f_min, f_max = at_first, at_last
            full_starts.append(lo + sym.CeilDiv(sympy.Max(0, f_max - lo), step) * step)
            live_starts.append(lo + sym.CeilDiv(sympy.Max(0, f_min - lo - step + 1), step) * step)
    live_lo = sympy.Max(lo, *live_starts)
    live_hi = sympy.Min(hi, *live_ends) if hi not in live_ends else sympy.Min(*live_ends)
    full_lo = sympy.Max(live_lo, *full_starts)
    # When a predicate bounds the loop's own end, its full end already lies below `hi`.
    ends = full_ends if hi in live_ends else [hi, *full_ends]
    full_hi = sympy.Max(full_lo, sympy.Min(*ends))
    return (
        (live_lo, sympy.Min(full_lo, live_hi), True),
        (full_lo, full_hi, False),
        (full_hi, live_hi, True),
    ), kept, axis


def _empty(start, stop) -> bool:
    if start == stop:
        return True
    if isinstance(stop, sympy.Min) and start in stop.args:  # min(start, ...) <= start
        return True
    diff = stop - start
    # NOTE: simplify is what proves a range empty, but it costs seconds on the bounds of a window or chunk
    # under split-KV and GQA packing (~15 s a range); past _SIMPLIFY_OPS operations (a plain spec's are at
    # most ~30) the range is kept, which is always correct: a loop that turns out empty runs no iteration.
    if sympy.count_ops(diff) > _SIMPLIFY_OPS:
        return bool(diff.is_nonpositive)
    if _positive_somewhere(diff):
        return False
    return bool(sympy.simplify(diff).is_nonpositive)


# Values probed for each symbol of a range's length; its assumptions pick those it may take.
_PROBE_VALUES = (0, 1, 2, 3, 5, 16, 37, 64, 128, 1000, 4096, -1, -7, -300)


def _positive_somewhere(diff) -> bool:
    """Whether the range's length `diff` is positive at some values its symbols' assumptions allow (positive,
    nonnegative, or any integer): then simplify cannot prove the range empty, and it need not try (seconds a
    range on a window's bounds; nearly every range a pass asks about is live). Python's rounding-down division is
    a model of all sympy knows of FloorDiv and CeilDiv, so the answer never differs from simplify's."""
    symbols = sorted(diff.free_symbols, key=str)
    for seed in range(8):
        rng = random.Random(seed)
        values = {s: rng.choice([x for x in _PROBE_VALUES if _allowed(s, x)]) for s in symbols}
        try:
            if sym.value(diff, values) > 0:
                return True
        except (ValueError, ZeroDivisionError):
            return False
    return False


def _allowed(symbol, x: int) -> bool:
    return not ((symbol.is_positive and x <= 0) or (symbol.is_nonnegative and x < 0)
                or (symbol.is_negative and x >= 0) or (symbol.is_nonpositive and x > 0))


def _unmask(body, loop: Loop, mask: Masked, kept, axis: str):
    """The loop body for blocks the mask keeps entirely."""
    proven = {p.bound for p in mask.preds if p not in kept and p.kind in (PredKind.KEY_BOUND, PredKind.QUERY_BOUND)}

    def span(sp: Span) -> Span:
        if sp.start == loop.var and sp.limit in proven:
            return replace(sp, limit=None)
        return sp

    def expr(e):
        # Rebuilt bottom-up, the mask's operands may already differ: match it by what it keeps.
        if isinstance(e, Masked) and (e.preds, e.query, e.key) == (mask.preds, mask.query, mask.key):
            return replace(e, preds=tuple(kept), query=span(e.query), key=span(e.key)) if kept else e.value
        if isinstance(e, Load):
            return replace(e, index=tuple(span(i) if isinstance(i, Span) else i for i in e.index))
        return e

    body = ir.map_exprs_in(body, expr)
    # With every score finite, no row max is -inf: the guard against exp(-inf - -inf) goes.
    aliases = {}
    out = []
    for st in body:
        if isinstance(st, Assign) and isinstance(st.value, Call) and st.value.op is Op.FINITE_OR_ZERO and not kept:
            (arg,) = st.value.args
            aliases[Ref(st.target)] = arg
            continue
        out.append(st)
    if aliases:
        out = list(ir.map_exprs_in(tuple(out), lambda e: aliases.get(e, e)))
    return tuple(out)


def _describe(mask: Masked, axis: str, masked: bool, kept=()) -> str:
    if not masked:
        if any(p.kind is PredKind.EXPR for p in kept):
            return "blocks no bound excludes: mask evaluated per element"
        return "full blocks: no mask"
    if any(p.kind in (PredKind.BAND, PredKind.EXPR) for p in mask.preds):
        return "blocks a mask bound cuts: masked"
    causal = any(p.kind is PredKind.CAUSAL for p in mask.preds)
    return ("diagonal blocks: masked" if causal else "sequence end: masked") if axis else "masked"


def _split(stmt):
    if not (isinstance(stmt, Loop) and stmt.kind is LoopKind.SERIAL):
        return stmt
    masks = set(_masks_in(stmt))
    if not masks:
        return stmt
    if len(masks) != 1:
        # A loop around an already split one (dK/dV's loop over the query heads of a group) sees the masked
        # and the unmasked remains of an EXPR predicate: not a loop over a mask's axis, nothing to split.
        if not any(stmt.var in (m.query.start, m.key.start) for m in masks):
            return stmt
        raise InternalError(f"causal-skip: loop over {stmt.var} computes {len(masks)} different masks")
    (mask,) = masks
    found = regions(stmt, mask)
    if found is None:
        return stmt
    ranges, kept, axis = found
    loops = []
    for start, stop, masked in ranges:
        start, stop = sym.distribute(start), sym.distribute(stop)
        if _empty(start, stop):
            continue
        body = stmt.body if masked else _unmask(stmt.body, stmt, mask, kept, axis)
        loops.append(replace(stmt, start=start, stop=stop, body=body, note=_describe(mask, axis, masked, kept), aligned=True))
    return tuple(loops)


def run(program: ir.Program) -> ir.Program:
    return replace(program, kernels=tuple(replace(k, body=ir.map_stmts(k.body, _split)) for k in program.kernels))
