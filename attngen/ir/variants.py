"""What a spec's masks and score modifiers mean in the IR: predicates over positions, pointwise functions.

A mask tree (lang/variants.py) becomes a conjunction of `Pred`s over an element's query row `q_idx` and key
`k_idx` (sym.py); the mask's `q` is `q_idx + offset`, the alignment (0 top-left, N_K - N_Q bottom-right).
Where a conjunct bounds the key on one side by a monotone function of the query (causal, window, prefix,
chunked, and the comparisons and disjunctions of such bounds), it is a BAND predicate, with its
solution for the query beside it: the block analysis (passes/causal_skip.py, analysis/masks.py) derives
each query block's key-block range and each key block's query-block range from them in closed form.
Anything else is an EXPR predicate: evaluated per element on every block the bands leave alive.

A score modifier becomes a sympy function of the scaled score S, positions, head and batch, and reads of
run-time tensors (applied sympy functions named after their buffers); `sympy.diff` gives the backward's
derivative.

Nothing from a spec reaches generated code but through these sympy trees: numbers, the symbols of
sym.py and the buffers' validated names.
"""

from __future__ import annotations

import sympy

from ..errors import InternalError
from ..lang import variants as v
from . import sym
from .nodes import DT, Buffer, Pred, PredKind, Role, Space, Stat

_DTYPES = {"fp32": DT.F32, "fp16": DT.F16, "bf16": DT.BF16, "int32": DT.I32}
ALIBI = "ALIBI_SLOPES"
SINKS = "SINKS"


def tensor_name(name: str) -> str:
    """The buffer (kernel argument) name of a declared tensor: prefixed, so that no spec name can collide
    with a name the generated code uses."""
    return f"ARG_{name}"


def tensor_buffers(variant: v.Variant) -> tuple[Buffer, ...]:
    """The HBM inputs a variant adds to the forward kernel, in the order `Variant.runtime_tensors` names
    them: declared tensors, ALiBi's slopes (B, H) (a (H,) tensor is expanded by the launcher) and the
    sinks (H,)."""
    out = []
    for t in variant.tensors:
        dims = tuple(sym.B if d == "B" else sym.H if d == "H" else sympy.Integer(d) for d in t.dims)
        out.append(Buffer(tensor_name(t.name), dims, _DTYPES[t.dtype], Space.HBM, Role.INPUT))
    if isinstance(variant.score, v.Alibi):
        out.append(Buffer(ALIBI, (sym.B, sym.H), DT.F32, Space.HBM, Role.INPUT))
    if variant.sinks:
        out.append(Buffer(SINKS, (sym.H,), DT.F32, Space.HBM, Role.INPUT, Stat.SINK))
    return tuple(out)


# -- expressions ----------------------------------------------------------------------------------------


def element(e, offset, score=None, tensors: dict | None = None) -> sympy.Expr:
    """A spec expression as sympy over the element symbols: q -> q_idx + offset, k -> k_idx, h -> q_head,
    b -> b, s -> `score` (sym.S); tensor reads -> the applied function of their buffer."""
    rec = lambda x: element(x, offset, score, tensors)
    if isinstance(e, v.Const):
        return sympy.Integer(e.value) if isinstance(e.value, int) else sympy.Float(e.value)
    if isinstance(e, v.Var):
        found = {"q": sym.q_idx + offset, "k": sym.k_idx, "h": sym.q_head, "b": sym.b, "s": score}.get(e.name)
        if found is None:
            raise InternalError(f"the variable {e.name} has no meaning here")
        return found
    if isinstance(e, v.Neg):
        return -rec(e.arg)
    if isinstance(e, v.BinOp):
        a, b = rec(e.a), rec(e.b)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op == "/":
            return a / b
        if not (b.is_Integer and b > 0):
            raise InternalError(f"integer division by {b}: the spec checker admits positive constants only")
        return sym.FloorDivS(a, b) if e.op == "//" else sym.ModS(a, b)
    if isinstance(e, v.Func):
        args = [rec(a) for a in e.args]
        return {"abs": lambda x: sympy.Abs(x), "min": sympy.Min, "max": sympy.Max, "tanh": sympy.tanh,
                "exp": sympy.exp}[e.name](*args)
    if isinstance(e, v.Index):
        buf = (tensors or {}).get(e.tensor)
        if buf is None:
            raise InternalError(f"the tensor {e.tensor} is not declared")
        return sympy.Function(buf.name)(*(rec(a) for a in e.args))
    raise InternalError(f"no sympy form for {e!r}")


# -- masks ----------------------------------------------------------------------------------------------


def _conjuncts(m):
    if isinstance(m, v.And):
        return _conjuncts(m.a) + _conjuncts(m.b)
    return [m]


def _bounds(m, offset):
    """The mask node as ("upper", U) / ("lower", L) bounds on k_idx (k <= U(q_idx), k >= L(q_idx), U and
    L monotone in q_idx), all of which must hold; None if it is not such a conjunction."""
    q = sym.q_idx + offset
    if isinstance(m, v.Causal):
        return [("upper", q)]
    if isinstance(m, v.Window):
        return [("lower", q - m.left), ("upper", q + m.right)]
    if isinstance(m, v.Prefix):
        return [("upper", sympy.Integer(m.length - 1))]
    if isinstance(m, v.Chunked):
        start = m.size * sym.FloorDivS(q, m.size)
        return [("lower", start), ("upper", start + m.size - 1)]
    if isinstance(m, v.And):
        a, b = _bounds(m.a, offset), _bounds(m.b, offset)
        return None if a is None or b is None else a + b
    if isinstance(m, v.Or):
        # k <= U1 or k <= U2 is k <= max(U1, U2); k >= L1 or k >= L2 is k >= min(L1, L2). Other unions
        # leave a gap between their pieces: not one band.
        a, b = _bounds(m.a, offset), _bounds(m.b, offset)
        if a is None or b is None or len(a) != 1 or len(b) != 1 or a[0][0] != b[0][0]:
            return None
        side = a[0][0]
        return [(side, (sympy.Max if side == "upper" else sympy.Min)(a[0][1], b[0][1]))]
    if isinstance(m, v.Compare):
        return _compare_bounds(m, offset)
    return None


def _compare_bounds(m: v.Compare, offset):
    """A comparison linear in k (coefficient +-1) whose other side is monotone in q: one or two bounds."""
    rel = element(m.a, offset) - element(m.b, offset)  # a OP b  <=>  rel OP 0
    if rel.has(sym.q_head, sym.b) or sym.k_idx not in rel.free_symbols:
        return None
    c = rel.coeff(sym.k_idx)
    rest = sympy.expand(rel - c * sym.k_idx)
    if c not in (1, -1) or sym.k_idx in rest.free_symbols:
        return None
    # rel = c*k + rest: for c = 1, k OP -rest; for c = -1, k OP' rest (the comparison flipped).
    op = m.op if c == 1 else {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}[m.op]
    edge = -rest if c == 1 else rest
    if not _monotone(edge):
        return None
    if op == "<":
        return [("upper", edge - 1)]
    if op == "<=":
        return [("upper", edge)]
    if op == ">":
        return [("lower", edge + 1)]
    if op == ">=":
        return [("lower", edge)]
    if op == "==":
        return [("lower", edge), ("upper", edge)]
    return None


def _monotone(e) -> bool:
    """Whether an integer expression is nondecreasing in q_idx (built of +, positive multiples, floor
    division by positive constants, min and max)."""
    e = sympy.sympify(e)
    if sym.q_idx not in e.free_symbols:
        return True
    if e == sym.q_idx:
        return True
    if isinstance(e, sympy.Add):
        return all(_monotone(a) for a in e.args)
    if isinstance(e, sympy.Mul):
        consts = [a for a in e.args if sym.q_idx not in a.free_symbols]
        rest = [a for a in e.args if sym.q_idx in a.free_symbols]
        return len(rest) == 1 and sympy.Mul(*consts).is_nonnegative is True and _monotone(rest[0])
    if isinstance(e, (sympy.Min, sympy.Max)):
        return all(_monotone(a) for a in e.args)
    if isinstance(e, (sym.FloorDiv, sym.FloorDivS)):
        return e.args[1].is_positive is True and _monotone(e.args[0])
    return False


def _invert(side: str, edge):
    """The bound solved for the query: k <= U(q) as q >= g(k) ("upper"), k >= L(q) as q <= g(k) ("lower");
    g over k_idx, monotone. None where the form is not one this knows."""
    k = sym.k_idx
    edge = sympy.sympify(edge)
    if isinstance(edge, (sympy.Max, sympy.Min)):
        parts = [_invert(side, a) for a in edge.args]
        if any(p is None for p in parts):
            return None
        # k <= max(U1, U2) <=> q >= min(g1, g2); k >= min(L1, L2) <=> q <= max(g1, g2); and the duals.
        flip = sympy.Min if isinstance(edge, sympy.Max) else sympy.Max
        return flip(*parts)
    if sym.q_idx not in edge.free_symbols:
        if side == "upper":  # k <= c: every query when it holds, none when not
            return sym.BIG * sympy.Min(1, sympy.Max(k - edge, 0))
        return -1 + (sym.BIG + 1) * sympy.Min(1, sympy.Max(k - edge + 1, 0))
    rest = sympy.expand(edge - sym.q_idx)
    if sym.q_idx not in rest.free_symbols:  # U = q + c: q >= k - c; L = q + c: q <= k - c
        return k - rest
    # C * floor((q + a) / C) + r, 0 <= r < C (a chunk's bounds)
    for term in sympy.Add.make_args(sympy.expand(edge)):
        coef, fl = term.as_coeff_Mul()
        if isinstance(fl, (sym.FloorDiv, sym.FloorDivS)) and fl.args[1] == coef and coef.is_Integer:
            r = sympy.expand(edge - term)
            inner = sympy.expand(fl.args[0] - sym.q_idx)
            if sym.q_idx in r.free_symbols or sym.q_idx in inner.free_symbols or not (r.is_Integer and 0 <= r < coef):
                return None
            if side == "upper":  # floor((q+a)/C) >= ceil((k-r)/C)  <=>  q >= C*ceil((k-r)/C) - a
                return -coef * sym.FloorDivS(r - k, coef) - inner
            # floor((q+a)/C) <= floor((k-r)/C)  <=>  q <= C*floor((k-r)/C) + C - 1 - a
            return coef * sym.FloorDivS(k - r, coef) + coef - 1 - inner
    return None


def mask_preds(m, offset) -> tuple[Pred, ...]:
    """The mask tree's predicates: CAUSAL for a plain diagonal (the kernels' existing fast paths know it),
    BAND for other monotone bounds, EXPR for the rest."""
    preds: list[Pred] = []

    def add(p):
        if p not in preds:
            preds.append(p)

    for c in _conjuncts(m):
        bounds = _bounds(c, offset)
        if bounds is None:
            add(Pred(PredKind.EXPR, mask_condition(c, offset)))
            continue
        for side, edge in bounds:
            edge = sympy.sympify(edge)
            if side == "upper" and sympy.expand(edge - sym.q_idx - offset) == 0:
                add(Pred(PredKind.CAUSAL, sympy.sympify(offset)))
                continue
            key_form = sym.k_idx - edge if side == "upper" else edge - sym.k_idx
            g = _invert(side, edge)
            alt = None if g is None else (g - sym.q_idx if side == "upper" else sym.q_idx - g)
            add(Pred(PredKind.BAND, key_form, alt))
    return tuple(preds)


def mask_condition(m, offset) -> sympy.Basic:
    """The mask tree as one sympy boolean over the element symbols (EXPR predicates; the reference checks)."""
    q = sym.q_idx + offset
    k = sym.k_idx
    if isinstance(m, v.Causal):
        return sympy.Le(k, q)
    if isinstance(m, v.Window):
        return sympy.And(sympy.Ge(k, q - m.left), sympy.Le(k, q + m.right))
    if isinstance(m, v.Prefix):
        return sympy.Lt(k, m.length)
    if isinstance(m, v.Chunked):
        return sympy.Eq(sym.FloorDivS(q, m.size), sym.FloorDivS(k, m.size))
    if isinstance(m, v.And):
        return sympy.And(mask_condition(m.a, offset), mask_condition(m.b, offset))
    if isinstance(m, v.Or):
        return sympy.Or(mask_condition(m.a, offset), mask_condition(m.b, offset))
    if isinstance(m, v.Not):
        return sympy.Not(mask_condition(m.arg, offset))
    if isinstance(m, v.Compare):
        a, b = element(m.a, offset), element(m.b, offset)
        return {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge, "==": sympy.Eq,
                "!=": sympy.Ne}[m.op](a, b)
    raise InternalError(f"no condition for the mask node {m!r}")


# -- score modifiers ------------------------------------------------------------------------------------


def score_fn(variant: v.Variant, offset, buffers: tuple[Buffer, ...]) -> sympy.Expr | None:
    """The score modifier as a function of sym.S (the scaled score); None for none."""
    score = variant.score
    if score is None:
        return None
    s = sym.S
    if isinstance(score, v.Softcap):
        cap = sympy.Float(score.cap)
        return cap * sympy.tanh(s / cap)
    if isinstance(score, v.Alibi):
        slope = sympy.Function(ALIBI)(sym.b, sym.q_head)
        return s - slope * sympy.Abs(sym.q_idx + offset - sym.k_idx)
    by_name = {t.name: b for t, b in zip(variant.tensors, buffers)}
    return element(score.expr, offset, s, by_name)


def reads(fn) -> tuple[str, ...]:
    """The buffers a pointwise function reads, by name."""
    return tuple(sorted({f.func.__name__ for f in sympy.sympify(fn).atoms(sympy.core.function.AppliedUndef)}))
