"""Helpers for passes that rewrite the grid: find the nest of grid loops, rebuild it."""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..errors import InternalError
from ..ir import Loop, LoopKind


def grid_path(kernel: ir.KernelIR, pass_name: str) -> list[Loop]:
    """The kernel's grid loops, outermost first (each holds only the next)."""
    path, body = [], kernel.body
    while len(body) == 1 and isinstance(body[0], Loop) and body[0].kind is LoopKind.GRID:
        path.append(body[0])
        body = body[0].body
    if not path:
        raise InternalError(f"{pass_name}: kernel {kernel.name} has no grid")
    return path


def rebuild(path: list[Loop], body: tuple) -> tuple:
    """The grid nest `path` around a new innermost body."""
    for loop in reversed(path):
        body = (replace(loop, body=body),)
    return body


def map_indices(body: tuple, fn) -> tuple:
    """Rewrite the index of every load and store: `fn(buffer, index) -> (buffer, index)`."""

    def expr(e):
        if isinstance(e, ir.Load):
            buffer, index = fn(e.buffer, e.index)
            return replace(e, buffer=buffer, index=index)
        return e

    def stmt(st):
        if isinstance(st, ir.Store):
            target, index = fn(st.target, st.index)
            return replace(st, target=target, index=index)
        return st

    return ir.map_stmts(ir.map_exprs_in(body, expr), stmt)
