"""Score modifiers that add a multiple of the query-key distance: where they are linear, and how to spell them so.

ALiBi (`s - slope * |q - k|`), the context-parallel blocks' ALiBi (`... |q - k + shift[b]|`) and a plain linear
relative bias (`s + c * (q - k)`) are all

    f(S) = alpha * S + coef * |q_idx - k_idx + shift| + rest        (or without the |.|)

with alpha a number and coef, shift, rest free of the positions (numbers, sizes, reads over the batch and head).
On a block of scores whose distances d = q - k + shift all have one sign sigma, the |.| is sigma * d and the
modifier splits into a term per key and a term per query row:

    f(S) = alpha * S - sigma * coef * (k - k0)  +  sigma * coef * (q - k0 + shift) + rest

k0 being the block's first key. The first part costs one FMA a score (the key term is a vector over the block's
columns, the same for every block: computed once per tile); the second is one value a row, which the online
softmax folds into its running max (and the backward into the loaded log-sum-exp) instead of adding it to every
score. Against the |.| form (a difference of positions, its absolute value times the slope, and the scale's
multiply, each per score) that saves two floating-point instructions a score. Positions are taken relative to
k0, so every value rounded is a small one or one rounding of the whole distance (as the |.| form rounds it).

The kernels take the split form only where it holds on every block at every size (`linear_everywhere`): a
modifier without the |.| (the context-parallel ring writes its blocks' ALiBi so where it knows their side of the
diagonal), or a mask that keeps only k <= q + b (a CAUSAL predicate) with shift - b >= 0 (the built-in causal ALiBi:
every distance it keeps is >= 0). A test of each block's corners at run time, with the |.| form for the blocks
straddling d = 0, made the Gluon forward's step three copies (and two) of itself, and its registers spilled (700
bytes a thread at d=128 without a mask, against 16): the others keep the |.| form everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .. import ir
from ..ir import sym
from ..ir.nodes import PredKind


@dataclass(frozen=True)
class DistanceBias:
    """f(S) = alpha * S + coef * |q_idx - k_idx + shift| + rest (`absolute`), or alpha * S + coef * (q_idx - k_idx +
    shift) + rest (not `absolute`: the distance's sign is + on every block)."""

    alpha: sympy.Expr
    coef: sympy.Expr
    shift: sympy.Expr
    rest: sympy.Expr
    absolute: bool

    def at(self, s, q, k):
        """f at a score and positions (sympy or numbers): the form this decomposition stands for."""
        d = q - k + self.shift
        return self.alpha * s + self.coef * (sympy.Abs(d) if self.absolute else d) + self.rest

    def linear_everywhere(self, preds) -> bool:
        """Whether the split form holds on every block at every size under the mask predicates `preds` (the IR's):
        no |.|, or a CAUSAL predicate k <= q + b with shift - b >= 0 (every distance the mask keeps is >= 0)."""
        if not self.absolute:
            return True
        bounds = {sympy.sympify(p.bound) for p in preds if p.kind is PredKind.CAUSAL}
        return len(bounds) == 1 and sympy.simplify(self.shift - bounds.pop()).is_nonnegative is True


def _free_of_positions(e) -> bool:
    return not sympy.sympify(e).has(sym.q_idx, sym.k_idx, sym.S)


def distance_bias(fn) -> DistanceBias | None:
    """The decomposition of a score modifier `fn` (sympy over sym.S, the positions, sizes and reads), or None where
    it is not of that form (a softcap, a tensor indexed by position, two distances, a floor, ...)."""
    fn = sympy.sympify(fn)
    s, q, k = sym.S, sym.q_idx, sym.k_idx
    if not fn.has(q) and not fn.has(k):
        return None
    alpha = sympy.diff(fn, s)
    if not _free_of_positions(alpha) or not alpha.is_number or not alpha.is_positive:
        return None  # a negative alpha would turn the running max over raw scores around
    rest = sympy.expand(fn - alpha * s)
    if rest.has(s):
        return None
    absolutes = [a for a in rest.atoms(sympy.Abs) if a.has(q) or a.has(k)]
    if len(absolutes) > 1:
        return None
    if absolutes:
        x = sympy.Dummy("x")
        over = rest.xreplace({absolutes[0]: x})
        coef = sympy.diff(over, x)
        remainder = sympy.expand(over - coef * x)
        if not (_free_of_positions(coef) and not coef.has(x) and _free_of_positions(remainder)):
            return None
        d = sympy.expand(absolutes[0].args[0])
        cq, ck = sympy.diff(d, q), sympy.diff(d, k)
        if (cq, ck) == (-1, 1):
            d, cq, ck = -d, 1, -1
        if (cq, ck) != (1, -1):
            return None
        shift = sympy.expand(d - q + k)
        if not _free_of_positions(shift):
            return None
        return DistanceBias(alpha, coef, shift, remainder, True)
    cq, ck = sympy.diff(rest, q), sympy.diff(rest, k)
    if not (_free_of_positions(cq) and _free_of_positions(ck)) or sympy.expand(cq + ck) != 0 or cq == 0:
        return None
    remainder = sympy.expand(rest - cq * (q - k))
    if not _free_of_positions(remainder):
        return None
    # the remainder as a shift of the distance (c * (q - k + shift): one rounding of the whole distance's product)
    shift = sympy.simplify(remainder / cq)
    shift = shift.xreplace({f: sympy.Integer(int(f)) for f in shift.atoms(sympy.Float) if float(f).is_integer()})
    return DistanceBias(alpha, cq, shift, sympy.Integer(0), False)


def any_distance(kernel) -> DistanceBias | None:
    """The IR kernel's score modifier as a distance bias, linear on every block or not; None otherwise."""
    return _kernel_distance(kernel, everywhere=False)


def linear_distance(kernel) -> DistanceBias | None:
    """The IR kernel's score modifier as a distance bias that is linear on every block (`linear_everywhere` under the
    kernel's mask), or None."""
    return _kernel_distance(kernel, everywhere=True)


def _kernel_distance(kernel, everywhere: bool) -> DistanceBias | None:
    fns, preds = set(), []
    for st in ir.walk_stmts(kernel.body):
        for e in ir.stmt_exprs(st):
            for n in ir.walk_expr(e):
                if isinstance(n, ir.Pointwise):
                    fns.add(sympy.sympify(n.fn))
                if isinstance(n, ir.Masked):
                    preds += [p for p in n.preds if p not in preds]
    bias = distance_bias(fns.pop()) if len(fns) == 1 else None
    return bias if bias is not None and (not everywhere or bias.linear_everywhere(preds)) else None
