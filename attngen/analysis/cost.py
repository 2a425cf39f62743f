"""FLOPs and HBM bytes of a program, read off its IR as sympy formulas.

Walking the IR, each matrix product costs 2*M*N*K FLOPs and each HBM load, store or scratch write
costs its elements times their size; a loop multiplies its body by its trip count. Where a loop's
bounds depend on an outer loop's variable (the causal diagonal), the outer loop becomes a symbolic
`Sum`, which sympy evaluates exactly once sizes are substituted. Only matrix products count as
FLOPs (the FlashAttention convention); head dims padded to a power of two are priced at their real
width, and tiles overhanging a sequence end at full size, so counts are upper bounds within one
tile per row.

`lower`'s program is the standard three-pass algorithm; the last pass's is the generated kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from .. import ir
from ..ir import sym
from ..ir import Assign, Call, Load, Loop, LoopKind, Op, Ref, Softmax, Space, Store

_DOTS = (Op.DOT, Op.DOT_T, Op.DOT_ACC)


@dataclass(frozen=True)
class Cost:
    flops: sympy.Expr
    bytes: sympy.Expr

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, factor) -> "Cost":
        return Cost(self.flops * factor, self.bytes * factor)


ZERO = Cost(sympy.Integer(0), sympy.Integer(0))


def _elements(shape) -> sympy.Expr:
    n = sympy.Integer(1)
    for d in shape:
        n *= d
    return n


def _expr_cost(e: ir.Expr) -> Cost:
    total = ZERO
    for node in ir.walk_expr(e):
        if isinstance(node, Load):
            total += Cost(sympy.Integer(0), _elements(ir.index_shape(node.index)) * node.buffer.dtype.bytes)
        elif isinstance(node, Ref) and node.buffer.space is Space.HBM:
            total += Cost(sympy.Integer(0), _elements(node.buffer.shape) * node.buffer.dtype.bytes)
        elif isinstance(node, Call) and node.op in _DOTS:
            inner = ir.shape_of(node.args[0])[1]
            out = ir.shape_of(node)
            total += Cost(2 * out[0] * out[1] * inner, sympy.Integer(0))
    return total


_EVALUATED_OPS = 40  # (the plain specs' counts have at most a dozen operations)


def _body_cost(body, defs: dict | None = None) -> Cost:
    """`defs`: scalars assigned from integer expressions so far (split bounds), inlined into loop
    bounds so that trip counts are formulas in the sizes."""
    total = ZERO
    defs = dict(defs or {})
    for st in body:
        if isinstance(st, Assign) and st.target.shape == () and isinstance(st.value, ir.Sym):
            defs[sympy.Symbol(st.target.name, integer=True, nonnegative=True)] = st.value.expr.subs(defs)
        if isinstance(st, Loop) and st.body and isinstance(st.body[0], ir.SequenceTile):
            st = _as_sequences(st)
        if isinstance(st, Loop):
            inner = _body_cost(st.body, defs)
            start, stop = sympy.sympify(st.start).subs(defs), sympy.sympify(st.stop).subs(defs)
            st = replace(st, start=start, stop=stop)
            count = sym.CeilDiv(st.stop - st.start, st.step)
            # A large count (a split kernel's window-narrowed bounds) is kept as Max(0, count) unevaluated:
            # sympy would compare every pair of its nested min/max terms, which took explain a minute on
            # decode_window_d128, to prove nothing; the value at a shape is the same.
            trips = sympy.Max(0, count, evaluate=sympy.count_ops(count) <= _EVALUATED_OPS)
            # (atoms, not free_symbols: an inner Sum's free_symbols re-evaluates its summand; its index is a Dummy)
            if st.var in inner.flops.atoms(sympy.Symbol) | inner.bytes.atoms(sympy.Symbol):
                i = sympy.Dummy("i", integer=True, nonnegative=True)
                at = {st.var: st.start + i * st.step}
                # unevaluated: re-evaluating the summand's min/max terms with the index in them compares every
                # pair of their (large) arguments, minutes for a split kernel's window-narrowed bounds
                with sympy.evaluate(False):
                    flops, moved = inner.flops.xreplace(at), inner.bytes.xreplace(at)
                total += Cost(sympy.Sum(flops, (i, 0, trips - 1)), sympy.Sum(moved, (i, 0, trips - 1)))
            else:
                total += inner.scaled(trips)
        elif isinstance(st, Assign):
            total += _expr_cost(st.value)
            if st.target.space is Space.HBM:
                total += Cost(sympy.Integer(0), _elements(st.target.shape) * st.target.dtype.bytes)
        elif isinstance(st, Store):
            total += _expr_cost(st.value)
            written = _elements(ir.index_shape(st.index)) * st.target.dtype.bytes
            total += Cost(sympy.Integer(0), written * (2 if st.accumulate else 1))
        elif isinstance(st, Softmax):
            total += _expr_cost(st.scores)
            total += Cost(sympy.Integer(0), _elements(ir.shape_of(st.scores)) * st.probs.dtype.bytes)
    return total


def _as_sequences(tiles: Loop) -> Loop:
    """A varlen grid over all sequences' tiles, priced as B sequences of N_Q queries and N_K keys each: a loop
    over the sequences around one over a sequence's tiles."""
    locate, *body = tiles.body
    count = sympy.sympify(locate.count).xreplace(_PER_SEQUENCE)
    per_sequence = Loop(locate.start, sympy.Integer(0), count, locate.block, tuple(body), LoopKind.GRID)
    return Loop(locate.seq, sympy.Integer(0), sym.B, sympy.Integer(1), (per_sequence,), LoopKind.GRID)


# A sequence's lengths (decoding, varlen) are priced at the batch's: every sequence full.
_PER_SEQUENCE = {sym.n_k: sym.N_K, sym.n_q: sym.N_Q}


def program_cost(program: ir.Program, kernels=None) -> Cost:
    """FLOPs and HBM bytes of the program's kernels (all, or those named), as formulas in the sizes."""
    total = ZERO
    for kernel in program.kernels:
        if kernels is None or kernel.name in kernels:
            total += _body_cost(kernel.body)
    real_width = {sym.HEAD_DIM_PADDED: sym.HEAD_DIM, sym.HEAD_DIM_V_PADDED: sym.HEAD_DIM_V,
                  sym.HEAD_DIM_ROPE_PADDED: sym.HEAD_DIM - sym.HEAD_DIM_V, **_PER_SEQUENCE}
    return Cost(_renamed(total.flops, real_width), _renamed(total.bytes, real_width))


def _renamed(expr: sympy.Expr, names: dict) -> sympy.Expr:
    """`expr` with symbols replaced by symbols. xreplace, not subs: subs re-simplifies every Sum it enters; and a
    Sum's summand unevaluated: rebuilding its min/max terms compares every pair of their arguments (minutes for a
    split kernel's window-narrowed bounds). Sum-free formulas keep their evaluated (printed) form."""
    if not expr.has(sympy.Sum):
        return expr.xreplace(names)
    with sympy.evaluate(False):
        return expr.xreplace(names)


def printed(expr: sympy.Expr) -> str:
    """A formula as `explain` prints it: `simplified`, and a Sum's terms in the order they were built (sorting
    them asks each term whether it is a number, which re-evaluates a split kernel's summand: minutes)."""
    if expr.has(sympy.Sum):
        return sympy.sstr(expr, order="none")
    return str(simplified(expr))


def simplified(expr: sympy.Expr) -> sympy.Expr:
    """A readable form: trip counts of exact divisions shown as plain quotients."""
    if expr.has(sympy.Sum):
        return expr
    plain = expr.replace(sym.CeilDiv, lambda a, b: a / b).replace(sym.FloorDiv, lambda a, b: a / b)
    plain = plain.replace(sympy.Max, lambda *args: args[-1] if args[0] == 0 else sympy.Max(*args))
    return sympy.factor(sympy.simplify(plain))


def evaluate(expr: sympy.Expr, sizes: dict) -> float:
    """The exact value of a cost formula for concrete sizes (symbol name -> int)."""
    # NOTE: not expr.free_symbols: a Sum's rebuilds its summand (xreplace of the bound index), minutes of min/max
    # simplification on a decoding kernel's formula; its indices are Dummies, the sizes plain symbols
    symbols = {s for s in expr.atoms(sympy.Symbol) if not isinstance(s, sympy.Dummy)}
    by_symbol = {s: sizes[str(s)] for s in symbols if str(s) in sizes}
    missing = {str(s) for s in symbols} - set(sizes)
    if missing:
        raise ValueError(f"cost formula needs {', '.join(sorted(missing))}")
    # sums term by term: their terms (integer divisions, min/max) have no closed form
    return float(sym.value(expr, by_symbol))


def fa_flops(mask_causal: bool, backward: bool = False, head_dim_v: bool = False) -> sympy.Expr:
    """The FlashAttention convention: 4 * B * H * N_Q * N_K * d forward, halved when causal;
    the backward counts 2.5 times the forward. With `head_dim_v` (a spec whose V has another head dim,
    HEAD_DIM_V), the convention generalised: a score costs 2 * (HEAD_DIM + HEAD_DIM_V) forward (Q K^T, P V)
    and 2 * (3 * HEAD_DIM + 2 * HEAD_DIM_V) backward (Q K^T, dS K, dS^T Q; dO V^T, P^T dO): 4 d and
    2.5 x 4 d where the two are equal."""
    if not head_dim_v:
        flops = 4 * sym.B * sym.H * sym.N_Q * sym.N_K * sym.HEAD_DIM
        flops = flops / 2 if mask_causal else flops
        return flops * sympy.Rational(5, 2) if backward else flops
    flops = sym.B * sym.H * sym.N_Q * sym.N_K * per_score(backward, sym.HEAD_DIM, sym.HEAD_DIM_V)
    return flops / 2 if mask_causal else flops


def per_score(backward: bool, head_dim, head_dim_v):
    """The FlashAttention-convention FLOPs of one kept score (`fa_flops` says which products they count)."""
    return 2 * (3 * head_dim + 2 * head_dim_v) if backward else 2 * (head_dim + head_dim_v)
