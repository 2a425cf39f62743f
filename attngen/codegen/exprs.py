"""Printing sympy integer expressions as Triton (device) or Python (host) code."""

from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter

from ..ir import sym


class _Printer(StrPrinter):
    """sympy's own printer, with min/max and the two integer divisions spelled for the target."""

    # Dispatch on `_print_<Class>` below, not on the `_sympystr` methods sym.py gives the IR text.
    printmethod = "_attngen_code"

    def __init__(self, device: bool, lib: str = "tl"):
        super().__init__({"order": "none"})
        self.device = device
        self.lib = lib  # the kernel language's module: tl (Triton) or gl (Gluon)

    def _nest(self, fn: str, args) -> str:
        args = sorted(args, key=sympy.default_sort_key)
        text = self._print(args[0])
        for a in args[1:]:
            text = f"{fn}({text}, {self._print(a)})"
        return text

    def _print_Min(self, expr):
        return self._nest(f"{self.lib}.minimum" if self.device else "min", expr.args)

    def _print_Max(self, expr):
        return self._nest(f"{self.lib}.maximum" if self.device else "max", expr.args)

    def _print_FloorDiv(self, expr):
        a, b = expr.args
        return f"({self.parenthesize(a, 60)} // {self.parenthesize(b, 60)})"

    def _print_CeilDiv(self, expr):
        a, b = expr.args
        fn = f"{self.lib}.cdiv" if self.device else "cdiv"  # the generated module's own: see the template
        return f"{fn}({self._print(a)}, {self._print(b)})"

    def _print_Float(self, expr):
        return repr(float(expr))

    # -- what masks and score modifiers add (ir/variants.py): device code over element tiles ---------------
    def _print_FloorDivS(self, expr):
        a, b = expr.args
        mod = self._print_ModS(expr)
        return f"(({self._print(a)} - {mod}) // {self.parenthesize(b, 60)})"

    def _print_ModS(self, expr):
        # Python's sign whatever the target's remainder does (C's truncates toward zero; the interpreter's
        # numpy floors): ((a % b) + b) % b is a's residue in [0, b) either way.
        a, b = expr.args
        bt = self.parenthesize(b, 60)
        return f"((({self._print(a)}) % {bt} + {bt}) % {bt})"

    def _print_Abs(self, expr):
        return f"{self.lib}.abs({self._print(expr.args[0])})"

    def _print_exp(self, expr):
        return f"{self.lib}.exp({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        # The generated module's own helper (templates/attention.py.j2): the multi-function unit's tanh on a GPU.
        fn = "_tanh" if self.lib == "tl" else "_gl_tanh"
        return f"{fn}({self._print(expr.args[0])})"

    def _print_Pow(self, expr):
        base, power = expr.args
        if power.is_Integer and 1 <= int(power) <= 4:
            b = self.parenthesize(base, 60)
            return "(" + " * ".join([b] * int(power)) + ")"
        if power == -1:
            return f"(1.0 / {self.parenthesize(base, 60)})"
        raise ValueError(f"no device spelling for the power {expr}")

    def _print_Relational(self, expr):
        op = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}[expr.rel_op]
        return f"({self._print(expr.lhs)} {op} {self._print(expr.rhs)})"

    def _print_And(self, expr):
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"(~{self._print(expr.args[0])})"

    def _print_Piecewise(self, expr):
        *pieces, (last, otherwise) = expr.args
        if otherwise is not sympy.true:
            raise ValueError(f"no device spelling for {expr}: its last piece must hold everywhere")
        text = self._print(last)
        for value, cond in reversed(pieces):
            text = f"{self.lib}.where({self._print(cond)}, {self._print(value)}, {text})"
        return text

    def _print_NegativeInfinity(self, expr):
        return 'float("-inf")'

    def _print_BooleanTrue(self, expr):
        return "True"

    def _print_BooleanFalse(self, expr):
        return "False"


_DEVICE = _Printer(device=True)
_HOST = _Printer(device=False)
_GLUON = _Printer(device=True, lib="gl")


def device(expr) -> str:
    """An integer expression as Triton code inside a kernel."""
    return _DEVICE.doprint(sympy.sympify(expr))


def gluon(expr) -> str:
    """An integer expression as Gluon code inside a kernel."""
    return _GLUON.doprint(sympy.sympify(expr))


def host(expr) -> str:
    """An integer expression as Python code in the launcher."""
    return _HOST.doprint(sympy.sympify(expr))


def parenthesized(text: str) -> str:
    """`text` wrapped in parentheses unless it already is one parenthesized group."""
    if text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and i < len(text) - 1:
                break
        else:
            return text
    return f"({text})"


def is_zero(expr) -> bool:
    return sympy.sympify(expr) == sym.ZERO
