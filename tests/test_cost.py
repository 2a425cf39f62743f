"""The cost formulas `attngen explain` prints: sympy's Min and Max, built while the formulas are, skip the
comparisons no size can decide (cost._undecided_min_max_kept) and still build the very expressions sympy builds."""

import contextlib
import os
import re

import pytest
import sympy
from sympy.functions.elementary.miscellaneous import MinMaxBase

from attngen.analysis import cost
from attngen.ir import sym
from attngen.lang.spec import load_file
from attngen.passes import PASS_NAMES, compile_program
from conftest import SPECS

n_k, start = sym.index("n_k"), sym.index("start_m")
WINDOW = sym.N_K - sym.N_Q + start - 4094  # a window-narrowed bound: either sign
LIVE = sympy.Max(0, WINDOW)                # (built here: the cases below build only their outermost node)
WIDEST = sympy.Max(WINDOW, n_k)


def built(make):
    """make()'s expression built plainly and under the fast constructor, and whether a pair was left undecided."""
    plain = make()
    undecided = []
    real = cost._both_signs
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cost, "_both_signs", lambda d: undecided.append(real(d)) or undecided[-1])
        with cost._undecided_min_max_kept():
            fast = make()
    return plain, fast, any(undecided)


@pytest.mark.parametrize("make, skipped", [
    (lambda: sympy.Max(0, WINDOW), True),                                 # either sign: kept as is
    (lambda: sympy.Max(0, sym.CeilDiv(LIVE, sym.BLOCK_N)), False),        # never negative: left to sympy
    (lambda: sympy.Max(0, sym.N_K), False),                               # provably N_K
    (lambda: sympy.Min(n_k, sym.N_K + 1, WINDOW), True),
    (lambda: sympy.Max(sym.N_K, WIDEST), True),                           # flattened first
    (lambda: sympy.Min(n_k, WIDEST), False),                              # collapsed to n_k
    (lambda: sympy.Max(WINDOW, WINDOW + 1), False),                       # provably the second
    (lambda: sympy.Max(sympy.oo, n_k), False),                            # sympy's zero
])
def test_min_and_max_are_what_sympy_builds(make, skipped):
    plain, fast, undecided = built(make)
    assert sympy.srepr(fast) == sympy.srepr(plain)
    assert undecided == skipped


def test_sympy_s_own_constructor_is_back_after_the_formulas_even_on_an_error():
    defined = MinMaxBase.__dict__["__new__"]
    with pytest.raises(ZeroDivisionError):
        with cost._undecided_min_max_kept():
            assert MinMaxBase.__dict__["__new__"] is not defined
            1 / 0
    assert MinMaxBase.__dict__["__new__"] is defined
    assert sympy.Max(0, WINDOW).args == (0, WINDOW)


def _canonical(expr) -> str:
    return re.sub(r"dummy_index=\d+", "", sympy.srepr(expr))  # (each cost walk names its sums' indices afresh)


@pytest.mark.parametrize("name", ["mistral_window_d128", "varlen_softcap_window_d128", "train_gqa_d128"])
def test_cost_formulas_are_sympy_s_own(name, monkeypatch):
    stages = {}
    compile_program(load_file(os.path.join(SPECS, f"{name}.attn")), trace=lambda n, p: stages.__setitem__(n, p))
    for program in (stages[PASS_NAMES[0]], stages[PASS_NAMES[-1]]):
        fast = cost.program_cost(program)
        with monkeypatch.context() as m:
            m.setattr(cost, "_undecided_min_max_kept", contextlib.nullcontext)
            plain = cost.program_cost(program)
        assert _canonical(fast.flops) == _canonical(plain.flops) and _canonical(fast.bytes) == _canonical(plain.bytes)
