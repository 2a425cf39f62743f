"""Symbolic integers for loop bounds and index expressions (sympy).

Every size a kernel sees at run time (B, H, N_Q, ...) and every tile size (BLOCK_M, ...) is a sympy
symbol, so bounds like `min(N_K, start_m + BLOCK_M + N_K - N_Q)` can be built, simplified, compared
and printed both as IR text and as Triton code. `FloorDiv` and `CeilDiv` are integer divisions that
sympy keeps as written (it would otherwise turn `floor(x / BLOCK_N)` into fractions); passes only
apply them to non-negative numerators, so C-style and Python-style division agree.
"""

from __future__ import annotations

import math
from fractions import Fraction

import sympy

sympify = sympy.sympify
ZERO = sympy.Integer(0)
ONE = sympy.Integer(1)


def size(name: str) -> sympy.Symbol:
    """A run-time or compile-time size: a positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)


def index(name: str) -> sympy.Symbol:
    """A loop or grid variable: a non-negative integer."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


def offset(name: str) -> sympy.Symbol:
    """An integer of either sign (e.g. the causal diagonal's offset)."""
    return sympy.Symbol(name, integer=True)


class FloorDiv(sympy.Function):
    """Integer division rounding down, printed as `a // b`."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        # (k * b) // b == k for a symbolic b
        if a.has(sympy.Min, sympy.Max, FloorDiv, CeilDiv):
            return None  # no polynomial quotient through min/max/division; cancel() there is slow
        q = sympy.cancel(a / b)
        if q.is_polynomial() and sympy.denom(sympy.together(q)) == 1 and q.is_integer:
            return q
        return None

    def _eval_is_nonnegative(self):
        a, b = self.args
        if a.is_nonnegative and b.is_positive:
            return True
        return None

    def _sympystr(self, printer):
        a, b = self.args
        return f"({printer.parenthesize(a, 60)} // {printer.parenthesize(b, 60)})"


class CeilDiv(sympy.Function):
    """Integer division rounding up, printed as `cdiv(a, b)`."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(-(-int(a) // int(b)))
        if a.has(sympy.Min, sympy.Max, FloorDiv, CeilDiv):
            return None  # no polynomial quotient through min/max/division; cancel() there is slow
        q = sympy.cancel(a / b)
        if q.is_polynomial() and sympy.denom(sympy.together(q)) == 1 and q.is_integer:
            return q
        return None

    def _eval_is_nonnegative(self):
        a, b = self.args
        if a.is_nonnegative and b.is_positive:
            return True
        return None

    def _sympystr(self, printer):
        a, b = self.args
        return f"cdiv({printer.doprint(a)}, {printer.doprint(b)})"


def align_down(x, base, step):
    """The largest `base + k*step` that is <= x (x >= base)."""
    return base + FloorDiv(x - base, step) * step


def align_up(x, base, step):
    """The smallest `base + k*step` that is >= x (x >= base)."""
    return base + CeilDiv(x - base, step) * step


def clamp(x, lo, hi):
    return sympy.Min(sympy.Max(x, lo), hi)


def evaluate(expr, values: dict) -> int:
    """Evaluate an integer expression for concrete sizes (FloorDiv/CeilDiv with Python semantics)."""
    return int(value(expr, values))


def value(expr, values: dict) -> Fraction:
    """The exact value of a rational expression (sums over loops included) for concrete values of its symbols
    (symbol -> number), computed in Python's exact arithmetic, each distinct subexpression once.

    NOTE: not `subs`: sympy rebuilds and re-simplifies every node it substitutes into (Min, Max, the divisions'
    eval, every Sum), minutes for a decoding kernel's cost formula, whose trip counts nest the split bounds."""
    # keyed by identity: a lookup by value compares equal subtrees node by node, as slow as evaluating them
    memo: dict = {}

    def walk(e):
        found = memo.get(id(e))
        if found is not None:
            return found
        if e.is_Symbol:
            if e not in values:
                raise ValueError(f"no value for {e}")
            result = Fraction(values[e])
        elif e.is_Rational:
            result = Fraction(int(e.p), int(e.q))
        elif e.is_Add:
            result = sum((walk(a) for a in e.args), Fraction(0))
        elif e.is_Mul:
            result = Fraction(1)
            for a in e.args:
                result *= walk(a)
        elif e.is_Pow and e.exp.is_Integer:
            result = walk(e.base) ** int(e.exp)
        elif isinstance(e, sympy.Sum):
            result = _sum_value(e, values, walk)
        elif isinstance(e, sympy.Piecewise):  # (a mixed step's narrow-or-wide bounds)
            result = next(walk(v) for v, cond in e.args if _holds(cond, walk))
        elif e.func in _EXACT:
            result = Fraction(_EXACT[e.func](*(walk(a) for a in e.args)))
        else:
            raise ValueError(f"no exact value for {e.func.__name__} in {expr}")
        memo[id(e)] = result
        return result

    return walk(sympy.sympify(expr))


_RELATIONS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
              ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _holds(cond, walk) -> bool:
    """Whether a Piecewise condition (comparisons joined by And / Or) holds, its operands valued by `walk`."""
    if cond is sympy.true or cond is sympy.false:
        return bool(cond)
    if isinstance(cond, sympy.And):
        return all(_holds(c, walk) for c in cond.args)
    if isinstance(cond, sympy.Or):
        return any(_holds(c, walk) for c in cond.args)
    if isinstance(cond, sympy.core.relational.Relational):
        return _RELATIONS[cond.rel_op](walk(cond.lhs), walk(cond.rhs))
    raise ValueError(f"no exact value for the condition {cond}")


def _sum_value(e, values: dict, walk) -> Fraction:
    """A Sum's terms one by one: its summand's values depend on the index, so each term is a fresh walk."""
    (i, lo, hi), *outer = e.limits
    if outer:
        raise ValueError(f"a Sum over several indices: {e}")
    total = Fraction(0)
    for k in range(int(walk(lo)), int(walk(hi)) + 1):
        total += value(e.function, {**values, i: k})
    return total


# -- the names every pass and the code generator agree on -----------------------------------------
# Run-time sizes (kernel arguments).
B = size("B")                 # batch
H = size("H")                 # query heads
H_KV = size("H_KV")           # key/value heads
GROUP = size("GROUP")         # query heads per key/value head (H // H_KV)
N_Q = size("N_Q")             # query sequence length
N_K = size("N_K")             # key/value sequence length
# Compile-time sizes (tl.constexpr).
HEAD_DIM = size("HEAD_DIM")
HEAD_DIM_PADDED = size("HEAD_DIM_PADDED")
HEAD_DIM_V = size("HEAD_DIM_V")                # V's and O's head dim, where a spec sets another (head_dim_v)
HEAD_DIM_V_PADDED = size("HEAD_DIM_V_PADDED")
# K's columns after V's prefix where `v = k[:N]` (MLA: the rotary part), rounded up to a power of two
HEAD_DIM_ROPE_PADDED = size("HEAD_DIM_ROPE_PADDED")
BLOCK_M = size("BLOCK_M")
BLOCK_N = size("BLOCK_N")
# Grid and loop variables.
b = index("b")
h = index("h")
start_m = index("start_m")
start_n = index("start_n")
# The softmax scale, a run-time float.
sm_scale = sympy.Symbol("sm_scale", positive=True)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Decoding over a KV cache (passes kv-lengths, pack-gqa, split-kv, paged).
NUM_SPLITS = size("NUM_SPLITS")   # key/value splits per sequence (Flash-Decoding), a run-time value
NUM_PAGES = size("NUM_PAGES")     # pages in a paged cache's pool
PAGE_SIZE = size("PAGE_SIZE")     # tokens per page
MAX_PAGES = size("MAX_PAGES")     # block-table entries per sequence
h_kv = index("h_kv")              # the key/value head a packed program serves
split = index("split")            # which slice of the keys a partial program reduces
BLOCK_S = size("BLOCK_S")         # splits the combine kernel merges per step (a compile-time size)
m = index("m")                    # one query row (the combine kernel's grid)
n_k = index("n_k")                # this sequence's key count (loaded from SEQLENS)
keys_per_split = index("keys_per_split")
split_start = index("split_start")
split_stop = index("split_stop")
# Packed variable-length batches (pass varlen): sequences end to end, found through CU_SEQLENS_Q / _K.
TOTAL_Q = size("TOTAL_Q")         # query rows of all sequences together
TOTAL_K = size("TOTAL_K")         # key rows of all sequences together
tile = index("tile")              # a program's tile among all sequences' tiles
q_start = index("q_start")        # this sequence's first query row
k_start = index("k_start")        # this sequence's first key row
n_q = index("n_q")                # this sequence's query count
# Mixed prefill+decode steps (pass mixed): short sequences as narrow work items beside the wide tiles.
SHORT_Q = size("SHORT_Q")         # a sequence of at most this many queries is a narrow work item (0: none is)
n_q_all = index("n_q_all")        # a sequence's query count, before the narrow kernel drops the long ones
n_k_all = index("n_k_all")        # its key count, likewise


# Masks and score modifiers (ir/variants.py): the element a predicate or pointwise function is evaluated at.
q_idx = index("q_idx")            # the element's query row position (a mask's q is q_idx plus the alignment)
k_idx = index("k_idx")            # the element's key position
q_head = index("q_head")          # the element's query head (h, or per row under GQA packing)
S = sympy.Symbol("s", real=True)  # a pointwise function's argument: the score tile's value
BIG = sympy.Integer(1 << 30)      # past every position: a bound that holds (or fails) for every query


class FloorDivS(sympy.Function):
    """floor(a / b) for a positive constant b and an `a` of either sign (a user's expression, or an
    aligned position that may be negative): printed so that C's and Python's integer division agree."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if a.is_nonnegative:
            return FloorDiv(a, b)
        return None

    def _sympystr(self, printer):
        a, b = self.args
        return f"floor({printer.doprint(a)} / {printer.doprint(b)})"


class ModS(sympy.Function):
    """a mod b for a positive constant b, with Python's sign (the result is in [0, b))."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        return None

    def _eval_is_nonnegative(self):
        return True

    def _sympystr(self, printer):
        a, b = self.args
        return f"({printer.doprint(a)} mod {printer.doprint(b)})"


# The integer functions `value` evaluates, on exact numbers (Python's `//` and `%` round down, as these do).
_EXACT = {
    sympy.Max: max,
    sympy.Min: min,
    sympy.floor: math.floor,
    sympy.ceiling: math.ceil,
    sympy.Abs: abs,
    sympy.Mod: lambda a, b: a % b,
    FloorDiv: lambda a, b: a // b,
    CeilDiv: lambda a, b: -(-a // b),
    FloorDivS: lambda a, b: a // b,
    ModS: lambda a, b: a % b,
}


def distribute(expr):
    """Push additions into min/max (`min(a, b) + c` -> `min(a + c, b + c)`), so that nested
    bounds flatten into one readable min or max."""
    expr = sympy.sympify(expr)
    if not expr.args:
        return expr
    expr = expr.func(*(distribute(a) for a in expr.args))
    if isinstance(expr, sympy.Add):
        for term in expr.args:
            if isinstance(term, (sympy.Min, sympy.Max)):
                rest = expr - term
                return distribute(term.func(*(a + rest for a in term.args)))
    return expr
