"""Masks and score modifiers as the spec writes them: a small typed tree, checked, with a canonical text.

The spec's `mask`, `score`, `sinks` and `tensor` entries parse into these nodes (spec.py); what they mean
as predicates over positions and as IR expressions is the passes' business (passes/variants.py), and the
float64 reference evaluates the same tree independently (testing/reference.py).

Positions: `q` and `k` are a score's query and key positions, aligned as the causal mask is (top-left for
prefill kernels, bottom-right for kernels over a KV cache: the last query sits at the last key); `h` and
`b` its query head and batch index; `s` (score expressions only) the scaled score `q . k * scale`.

    mask  := causal | causal(top_left) | causal(bottom_right) | window(W) | window(L, R) | prefix(P)
           | chunked(C) | mask & mask | mask | mask | (mask) | COMPARISON | mask and mask | mask or mask
           | not mask
    score := softcap(C) | alibi | EXPR over s, q, k, h, b, numbers and declared tensors
    EXPR  := numbers, q k h b s, + - * / // %, unary -, abs(x) min(x, y) max(x, y) tanh(x) exp(x),
             NAME[EXPR, ...] (a declared tensor)

Every node is frozen and hashable; `text()` prints the canonical form (the spec's identity), and
`pos` (line, column) is where it was written, kept out of equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

POSITION_VARS = ("q", "k", "h", "b")
SCORE_VAR = "s"
FUNCTIONS = {"abs": 1, "min": 2, "max": 2, "tanh": 1, "exp": 1}
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
ARITH = ("+", "-", "*", "/", "//", "%")
TENSOR_DTYPES = ("fp32", "fp16", "bf16", "int32")
ALIBI_TENSOR = "alibi_slopes"
SINKS_TENSOR = "sinks"


def _pos():
    return field(default=(0, 0), compare=False, repr=False)


# -- expressions (integers over positions; floats in score expressions) ---------------------------


@dataclass(frozen=True, slots=True)
class Const:
    value: int | float
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return repr(self.value) if isinstance(self.value, float) else str(self.value)


@dataclass(frozen=True, slots=True)
class Var:
    name: str  # one of POSITION_VARS, or SCORE_VAR
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class Neg:
    arg: "Expr"
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"-{_wrap(self.arg, 3)}"


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # one of ARITH
    a: "Expr"
    b: "Expr"
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        prec = _PREC[self.op]
        # The parser groups to the left, so a right operand of the same precedence keeps its parentheses
        # (a + (b + c) is another tree, and another sum in floating point).
        return f"{_wrap(self.a, prec)} {self.op} {_wrap(self.b, prec + 1)}"


@dataclass(frozen=True, slots=True)
class Func:
    name: str  # one of FUNCTIONS
    args: tuple["Expr", ...]
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"{self.name}(" + ", ".join(a.text() for a in self.args) + ")"


@dataclass(frozen=True, slots=True)
class Index:
    """`tensor[i, j, ...]`: a read of a run-time tensor the spec declares, at integer indices."""

    tensor: str
    args: tuple["Expr", ...]
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"{self.tensor}[" + ", ".join(a.text() for a in self.args) + "]"


Expr = Union[Const, Var, Neg, BinOp, Func, Index]
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2}


def _wrap(e, prec: int) -> str:
    inner = _PREC.get(e.op, 9) if isinstance(e, BinOp) else 9
    return f"({e.text()})" if inner < prec else e.text()


# -- masks ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Causal:
    """k <= q. `align` None: the kernel's alignment (top-left prefill, bottom-right over a KV cache)."""

    align: str | None = None  # "top_left" | "bottom_right" | None
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"causal({self.align})" if self.align else "causal"


@dataclass(frozen=True, slots=True)
class Window:
    """q - left <= k <= q + right. `window(W)` is left = W - 1, right = 0 (the last W keys up to the
    query, itself included) and keeps `size` = W to print as written."""

    left: int
    right: int
    size: int | None = None
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"window({self.size})" if self.size is not None else f"window({self.left}, {self.right})"


@dataclass(frozen=True, slots=True)
class Prefix:
    """k < length: the first `length` keys, visible to every query (prefix-LM, with `causal | prefix(P)`)."""

    length: int
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"prefix({self.length})"


@dataclass(frozen=True, slots=True)
class Chunked:
    """q // size == k // size (Llama 4's chunked local attention)."""

    size: int
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"chunked({self.size})"


@dataclass(frozen=True, slots=True)
class Compare:
    """A general condition `a OP b` over integer expressions of q, k, h, b."""

    op: str  # one of COMPARISONS
    a: Expr
    b: Expr
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"{self.a.text()} {self.op} {self.b.text()}"


@dataclass(frozen=True, slots=True)
class And:
    a: "MaskExpr"
    b: "MaskExpr"
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"{_mwrap(self.a, 2)} & {_mwrap(self.b, 3)}"  # grouped to the left, as parsed


@dataclass(frozen=True, slots=True)
class Or:
    a: "MaskExpr"
    b: "MaskExpr"
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"{_mwrap(self.a, 1)} | {_mwrap(self.b, 2)}"


@dataclass(frozen=True, slots=True)
class Not:
    arg: "MaskExpr"
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"not {_mwrap(self.arg, 5)}"  # `not (q < k)`, `not (not m)`: parenthesized for the reader


MaskExpr = Union[Causal, Window, Prefix, Chunked, Compare, And, Or, Not]


def _mwrap(m, prec: int) -> str:
    inner = {Or: 1, And: 2, Not: 3, Compare: 4}.get(type(m), 9)
    return f"({m.text()})" if inner < prec else m.text()


def mask_nodes(m: MaskExpr):
    """Every node of a mask tree, parents first."""
    yield m
    if isinstance(m, (And, Or)):
        yield from mask_nodes(m.a)
        yield from mask_nodes(m.b)
    elif isinstance(m, Not):
        yield from mask_nodes(m.arg)


def expr_nodes(e):
    """Every node of an expression tree (or of a mask's comparisons), parents first."""
    yield e
    if isinstance(e, Neg):
        yield from expr_nodes(e.arg)
    elif isinstance(e, BinOp):
        yield from expr_nodes(e.a)
        yield from expr_nodes(e.b)
    elif isinstance(e, (Func, Index)):
        for a in e.args:
            yield from expr_nodes(a)
    elif isinstance(e, Compare):
        yield from expr_nodes(e.a)
        yield from expr_nodes(e.b)


def alignment(m: MaskExpr | None) -> str | None:
    """The alignment a mask's causal nodes name ("top_left", "bottom_right"), or None if they name none."""
    if m is None:
        return None
    aligns = {n.align for n in mask_nodes(m) if isinstance(n, Causal) and n.align}
    return aligns.pop() if len(aligns) == 1 else None


# -- score modifiers ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Softcap:
    """s -> cap * tanh(s / cap) (Gemma 2), applied before any bias."""

    cap: float
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"softcap({_num(self.cap)})"


@dataclass(frozen=True, slots=True)
class Alibi:
    """s -> s - alibi_slopes[h] * |q - k|; slopes a run-time float32 tensor (heads,) or (batch, heads)."""

    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return "alibi"


@dataclass(frozen=True, slots=True)
class ScoreExpr:
    """A general score: an expression over s, q, k, h, b, numbers and declared tensors."""

    expr: Expr
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return self.expr.text()


ScoreMod = Union[Softcap, Alibi, ScoreExpr]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# -- run-time tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorDecl:
    """`tensor NAME[D0, D1, ...]: DTYPE`: a run-time tensor the kernel takes as a keyword argument.
    A dimension is an integer, or "B" / "H" (the call's batch and query heads)."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str  # one of TENSOR_DTYPES
    pos: tuple[int, int] = _pos()

    def text(self) -> str:
        return f"tensor {self.name}[" + ", ".join(str(d) for d in self.dims) + f"]: {self.dtype}"


@dataclass(frozen=True, slots=True)
class Variant:
    """What a spec says beyond the plain masks: the mask tree (None: the plain `mask` enum says it all),
    the score modifier, whether the softmax has learned sinks, and the declared tensors."""

    mask: MaskExpr | None = None
    score: ScoreMod | None = None
    sinks: bool = False
    tensors: tuple[TensorDecl, ...] = ()

    def __bool__(self) -> bool:
        return self.mask is not None or self.score is not None or self.sinks or bool(self.tensors)

    def runtime_tensors(self) -> tuple[str, ...]:
        """The keyword tensors a kernel of this variant takes, in order."""
        names = [t.name for t in self.tensors]
        if isinstance(self.score, Alibi):
            names.append(ALIBI_TENSOR)
        if self.sinks:
            names.append(SINKS_TENSOR)
        return tuple(names)

    def tensor(self, name: str) -> TensorDecl | None:
        return next((t for t in self.tensors if t.name == name), None)


# -- evaluation on sample positions ---------------------------------------------------------------------


def keeps_any(m: MaskExpr) -> bool:
    """Whether a mask (one that reads no tensor) keeps any (query, key) pair at sample positions: q and k
    in 0..63, near every constant the mask names and near sums of two of them; h and b in 0..1. Used to
    refuse a mask that keeps nothing (`causal & not causal`, `window(8) & not window(16)`)."""
    import numpy as np  # here, not at the top: parsing a plain spec needs no numpy

    consts = sorted({c for c in _mask_constants(m) if 0 < c < 2**31})[:24]
    points = set(range(64))
    for i, c in enumerate(consts):
        points.update(c + d for d in range(-2, 3))
        points.update(c + e + d for e in consts[i:] for d in range(-1, 2))
    pos = np.array(sorted(p for p in points if 0 <= p < 2**31)[:600], dtype=np.int64)
    env = {"q": pos.reshape(-1, 1, 1, 1), "k": pos.reshape(1, -1, 1, 1),
           "h": np.arange(2).reshape(1, 1, -1, 1), "b": np.arange(2).reshape(1, 1, 1, -1)}
    with np.errstate(all="ignore"):
        return bool(np.any(_eval_mask(m, env, np)))


def _mask_constants(m: MaskExpr):
    for n in mask_nodes(m):
        if isinstance(n, Window):
            yield from (n.left, n.right, n.left + 1)
        elif isinstance(n, (Prefix,)):
            yield n.length
        elif isinstance(n, Chunked):
            yield n.size
        elif isinstance(n, Compare):
            yield from (abs(c.value) for c in expr_nodes(n) if isinstance(c, Const))


def _eval_mask(m: MaskExpr, env, np):
    q, k = env["q"], env["k"]
    if isinstance(m, Causal):
        return k <= q  # the sample grid is square: top-left and bottom-right agree
    if isinstance(m, Window):
        return (q - m.left <= k) & (k <= q + m.right)
    if isinstance(m, Prefix):
        return k < m.length
    if isinstance(m, Chunked):
        return q // m.size == k // m.size
    if isinstance(m, And):
        return _eval_mask(m.a, env, np) & _eval_mask(m.b, env, np)
    if isinstance(m, Or):
        return _eval_mask(m.a, env, np) | _eval_mask(m.b, env, np)
    if isinstance(m, Not):
        return ~_eval_mask(m.arg, env, np)
    ops = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
           "==": np.equal, "!=": np.not_equal}
    return ops[m.op](_eval_expr(m.a, env, np), _eval_expr(m.b, env, np))


def _eval_expr(e: Expr, env, np):
    """A whole-number expression over int64 arrays: // and % floor as Python's do (x // 0 is 0 here)."""
    if isinstance(e, Const):
        return np.int64(e.value)
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Neg):
        return -_eval_expr(e.arg, env, np)
    if isinstance(e, Func):
        args = [_eval_expr(a, env, np) for a in e.args]
        return {"abs": np.abs, "min": np.minimum, "max": np.maximum}[e.name](*args)
    a, b = _eval_expr(e.a, env, np), _eval_expr(e.b, env, np)
    return {"+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide, "%": np.mod}[e.op](a, b)
