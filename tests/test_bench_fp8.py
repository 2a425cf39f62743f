"""`attngen bench --suite fp8`: its arguments, the check of attngen's FP8 and bf16 forwards in the interpreter against
float64 (and that it fails on a wrong output), and the table."""

import torch

from attngen.bench import fp8
from attngen.bench.common import Row
from attngen.cli import build_parser, main


def test_arguments_parse_and_unknown_providers_are_a_usage_error(capsys):
    args = build_parser().parse_args(["bench", "--suite", "fp8", "--check", "--lengths", "4096,8192"])
    assert (args.suite, args.check, args.lengths) == ("fp8", True, "4096,8192")
    assert main(["bench", "--suite", "fp8", "--providers", "attngen_fp8,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_check_runs_the_attngen_rows_in_the_interpreter(capsys):
    assert main(["bench", "--suite", "fp8", "--check"]) == 0
    out = capsys.readouterr().out
    assert "attngen_fp8_vt" in out and "attngen_fp8_rot" in out and "err" not in out.split("d=128", 1)[1]
    # each cell: "ok (relative error against float64 of the unquantised inputs)"; rotation cuts it with outliers.
    # (Summed over the two outlier rows: at this size one draw's ratio spreads from 1.0 to 10; the sum's was >= 2.1
    # over 100 fresh pairs.)
    header, *lines = out.split("d=128\n", 1)[1].splitlines()
    errors = {"attngen_fp8_rot": 0.0, "attngen_fp8_vt": 0.0}
    for line in (line for line in lines if "outliers" in line):
        cells = dict(zip(header.split()[3:], line.split("ok")[1:]))
        for name in errors:
            errors[name] += float(cells[name].strip(" ()"))
    assert errors["attngen_fp8_rot"] * 1.5 < errors["attngen_fp8_vt"], out


def test_a_check_catches_a_wrong_output():
    gen = torch.Generator().manual_seed(0)
    q, k, v = fp8._inputs(1, 2, 37, 128, False, "cpu", gen)
    runs, given = fp8._runs(True, q, k, v)
    for name in ("attngen_fp8", "attngen_fp8_rot"):
        out = runs[name]()
        assert fp8._check(name, out, q, k, v, given, True) is None
        assert "relative error" in fp8._check(name, out * 1.1, q, k, v, given, True)
        assert "relative error" in fp8._check(name, out, q, k, v, given, False)  # another mask



def test_table_shows_the_speedup_and_the_errors():
    params = dict(batch=4, heads=16, seqlen=4096, head_dim=128, causal=True, inputs="normal")
    rows = [Row("fp8", "forward", "attngen_fp8", params, ms=1.0, tflops=600.0, extra=dict(err=0.1, rel=0.03)),
            Row("fp8", "forward", "attngen_bf16", params, ms=1.5, tflops=400.0, extra=dict(err=0.01, rel=0.004)),
            Row("fp8", "forward", "torch_fp8", params, error="RuntimeError: FA3 is not installed")]
    text = fp8.table(rows)
    assert "600.0 (3.0e-02)" in text and "1.50" in text and "torch_fp8: RuntimeError" in text
