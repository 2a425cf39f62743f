"""`attngen bench --suite variants`: its arguments on a CPU, each row's check in the interpreter against the
float64 reference, the counted FLOPs, and the JSON and plot it writes."""

import importlib.util
import json
import os

import pytest
import torch

from attngen.analysis import masks
from attngen.bench import variants
from attngen.bench.common import Row
from attngen.bench.prefill import write
from attngen.cli import build_parser, main
from conftest import ROOT

TINY_CASES = [case.name for case in variants.cases(variants.TINY["seqlen"])]
# (the Kernel call takes the run-time tensors with the runtime of branch bwd)


def test_arguments_parse_on_a_cpu():
    args = build_parser().parse_args(["bench", "--suite", "variants", "--check", "--lengths", "4096",
                                      "--head-dims", "64", "--batch", "2", "--heads", "8", "--direction", "forward"])
    assert (args.suite, args.check, args.batch, args.heads, args.direction) == ("variants", True, 2, 8, "forward")


def test_unknown_provider_is_a_usage_error(capsys):
    assert main(["bench", "--suite", "variants", "--providers", "attngen,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_the_suite_s_rows_at_full_size():
    names = [case.name for case in variants.cases(16384)]
    assert names == ["causal", "window_4096", "softcap_30", "alibi", "prefix_2048", "chunked_8192",
                     "sinks_window_128"]
    # TFLOP/s count kept scores: a window of 4096 keeps 4096 keys a row past the first 4096 rows.
    window = variants.cases(16384)[1].spec(128, False)
    sizes = dict(B=1, H=16, N_Q=16384, N_K=16384, HEAD_DIM=128)
    kept = 4096 * 4097 // 2 + (16384 - 4096) * 4096
    assert masks.fa_flops(window, sizes) == 4 * 128 * 16 * kept


@pytest.mark.parametrize("name", TINY_CASES)
def test_check_runs_each_row_in_the_interpreter(name):
    rows = variants.bench_variants(directions=("forward",), check=True, only=(name,), progress=lambda _: None)
    assert {r.provider for r in rows} == {"attngen", "flex"}
    assert all(r.error is None and r.extra["checked"] for r in rows), [r.error for r in rows]


def test_a_check_catches_a_provider_computing_another_mask():
    case = variants.cases(96)[1]  # a window of 24
    spec = case.spec(32, False)
    q, k, v = (torch.randn(1, 2, 96, 32, dtype=torch.bfloat16) for _ in range(3))
    causal = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    assert "relative error" in variants._check(case, spec, causal, q, k, v, {})


def test_rows_go_to_variants_json_and_a_plot(tmp_path):
    params = dict(variants.SHAPE, variant="window_4096", dtype="bf16", window=4096)
    rows = [Row("variants", d, p, params, ms=1.0, tflops=t) for d in ("forward", "backward")
            for p, t in (("attngen", 500.0), ("flex", 390.0))]
    path = write(rows, str(tmp_path), dict(device="NVIDIA H200"), stem="variants_")
    assert os.path.basename(path) == "variants_nvidia_h200.json"
    assert len(json.load(open(path))["rows"]) == 4
    assert "window_4096" in variants.table(rows) and "500.0" in variants.table(rows)
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    plot.main(path, str(tmp_path))
    assert (tmp_path / "variants_nvidia_h200.png").exists()
