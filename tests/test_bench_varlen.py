"""`attngen bench --suite varlen`: its arguments, the kept-score count its TFLOP/s use, the packed batches it builds,
and its rows' checks at tiny sizes against float64 in the interpreter."""

import pytest
import torch

from attngen.bench import varlen
from attngen.cli import build_parser, main
from test_torch_flash import VARLEN


def test_arguments_parse_and_unknown_providers_are_a_usage_error(capsys):
    args = build_parser().parse_args(["bench", "--suite", "varlen", "--check", "--providers", "attngen,slot"])
    assert (args.suite, args.check, args.providers) == ("varlen", True, "attngen,slot")
    assert main(["bench", "--suite", "varlen", "--providers", "attngen,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_kept_scores_count_each_sequence_bottom_right():
    assert varlen.kept_scores([4], [4], True) == 10
    assert varlen.kept_scores([2, 3], [5, 3], True) == (4 + 5) + 6
    assert varlen.kept_scores([5], [2], True) == 3  # the first three queries see no key
    assert varlen.kept_scores([2, 3], [5, 3], False) == 10 + 9
    brute = int(((torch.arange(7)[:, None] + 9 - 7) >= torch.arange(9)[None]).sum())  # query i at key position i + 2
    assert varlen.kept_scores([7], [9], True) == brute


def test_document_lengths_are_positive_and_fill_the_tokens():
    lengths = varlen.document_lengths(16384, 8, torch.Generator().manual_seed(0))
    assert len(lengths) == 8 and sum(lengths) == 16384 and min(lengths) > 0


def test_the_slot_rows_check_against_float64():
    rows = varlen.bench_varlen(names=("slot",), check=True, progress=lambda _: None)
    assert {r.params["causal"] for r in rows} == {False, True} and {r.provider for r in rows} == {"slot"}
    assert [r.error for r in rows] == [None, None]


@VARLEN
def test_every_row_checks_against_float64():
    rows = varlen.bench_varlen(check=True, progress=lambda _: None)
    assert {r.params["case"] for r in rows} == {"documents", "long_and_short", "mixed", "slot"}
    assert [r.error for r in rows if r.error] == []


def test_slot_rows_take_the_median_of_alternating_timings(monkeypatch):
    """The slot's timings: each side timed SLOT_ROUNDS times, the sides taking turns (attngen, slot, attngen, ...),
    each row its side's median; a side that raises is its row's error, the other side still timed."""
    from attngen.bench import varlen as bench_varlen

    order, values = [], iter([5.0, 9.0, 1.0, 8.0, 3.0, 7.0])

    def timed(fn, inputs, direction):
        order.append(fn())
        return next(values)

    monkeypatch.setattr(bench_varlen, "_timed", timed)
    medians = bench_varlen._slot_medians({"attngen": lambda: "a", "slot": lambda: "s"}, (), "forward")
    assert order == ["a", "s"] * bench_varlen.SLOT_ROUNDS and medians == {"attngen": 3.0, "slot": 8.0}

    def failing():
        raise RuntimeError("no flash kernel here")

    values = iter([2.0, 4.0, 3.0])
    medians = bench_varlen._slot_medians({"attngen": lambda: "a", "slot": failing}, (), "backward")
    assert medians["attngen"] == 3.0 and isinstance(medians["slot"], RuntimeError)
