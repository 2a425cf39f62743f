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
