"""`attngen bench --suite shapes`: its arguments and provider selection, the FLOPs its TFLOP/s count, each shape's
check at a tiny size in the interpreter against float64, and the table, JSON and plot it writes."""

import importlib.util
import json
import os

import pytest
import torch

from attngen.analysis.cost import per_score
from attngen.bench import shapes
from attngen.bench.common import Row
from attngen.bench.prefill import write
from attngen.cli import build_parser, main
from conftest import ROOT

BY_NAME = {s.name: s for s in shapes.SHAPES}


def test_arguments_parse_and_unknown_providers_are_a_usage_error(capsys):
    args = build_parser().parse_args(["bench", "--suite", "shapes", "--check", "--providers", "attngen,sdpa_flash"])
    assert (args.suite, args.check, args.providers) == ("shapes", True, "attngen,sdpa_flash")
    assert main(["bench", "--suite", "shapes", "--providers", "attngen,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_the_suite_holds_the_issue_s_shapes():
    rows = {(s.head_dim, s.head_dim_v, s.batch, s.heads, s.heads_kv, s.seqlen, s.causal) for s in shapes.SHAPES}
    assert rows == {(96, 96, 2, 16, 16, 4096, False), (256, 256, 1, 8, 8, 8192, True),
                    (128, 128, 1, 28, 4, 2049, True), (64, 64, 3, 12, 12, 3000, True),
                    (64, 64, 16, 32, 32, 1024, True), (192, 128, 1, 128, 128, 4096, True)}


def test_flops_follow_the_flashattention_convention_with_two_head_dims():
    d96, deepseek = BY_NAME["d96"], BY_NAME["d192_128"]
    assert d96.flops(False) == 4 * 2 * 16 * 4096 * 4096 * 96  # 4 d a score, every score kept
    assert d96.flops(True) == 2.5 * d96.flops(False)
    kept = 4096 * 4097 // 2
    assert deepseek.flops(False) == 128 * kept * 2 * (192 + 128)
    assert deepseek.flops(True) == 128 * kept * per_score(True, 192, 128) == 128 * kept * 2 * (3 * 192 + 2 * 128)


def test_tiny_shapes_keep_the_head_dims_mask_and_group():
    small = shapes.tiny(BY_NAME["gqa_28_4"])
    assert (small.heads // small.heads_kv, small.head_dim, small.causal) == (7, 128, True)
    small = shapes.tiny(BY_NAME["d192_128"])
    assert (small.head_dim, small.head_dim_v, small.seqlen % 2) == (192, 128, 1)


@pytest.mark.parametrize("name", ["gqa_28_4", "d192_128"])
def test_check_runs_attngen_on_a_shape_in_the_interpreter(name):
    rows = shapes.bench_shapes(check=True, only=(name,), progress=lambda _: None)
    assert [(r.provider, r.direction) for r in rows] == [("attngen", "forward"), ("attngen", "backward")]
    assert [r.error for r in rows] == [None, None]


def test_a_check_catches_another_mask_and_a_wrong_gradient():
    shape = shapes.tiny(BY_NAME["d64_b16"])
    q, k, v = shapes._tensors(shape, "cpu", torch.Generator().manual_seed(0))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    full = lambda q, k, v: sdpa(q, k, v)  # noqa: E731
    assert "relative error" in shapes._checked(full, shape, q, k, v, "forward")
    causal = lambda q, k, v: sdpa(q, k, v, is_causal=True)  # noqa: E731
    assert shapes._checked(causal, shape, q, k, v, "forward") is None
    assert shapes._checked(causal, shape, q, k, v, "backward") is None
    twice_dq = lambda q, k, v: causal(q.detach() + 2 * (q - q.detach()), k, v)  # noqa: E731 - dq doubled, out the same
    assert shapes._checked(twice_dq, shape, q, k, v, "forward") is None
    assert shapes._checked(twice_dq, shape, q, k, v, "backward").startswith("dq: relative error")


def test_providers_are_selected_by_name_and_one_that_cannot_run_a_shape_is_a_row_with_its_error(monkeypatch):
    def fa2(q, k, v):
        raise RuntimeError("No available kernel.\nmore")

    # (the timed path without a GPU: tensors on the CPU, a fixed time, the peers replaced)
    draw = shapes._tensors
    monkeypatch.setattr(shapes, "_tensors", lambda shape, device, generator: draw(shape, "cpu", generator))
    monkeypatch.setattr(shapes, "providers", lambda shape, device: {"sdpa_cudnn": lambda q, k, v: q, "sdpa_flash": fa2})
    monkeypatch.setattr(shapes, "_timed", lambda fn, inputs, direction: (fn(), 2.0)[1])
    monkeypatch.setattr(shapes, "SHAPES", (shapes.tiny(BY_NAME["d192_128"]),))
    rows = shapes.bench_shapes(names=("sdpa_cudnn", "sdpa_flash"), progress=lambda _: None)
    assert [(r.provider, r.direction) for r in rows] == [("sdpa_cudnn", "forward"), ("sdpa_cudnn", "backward"),
                                                         ("sdpa_flash", "forward"), ("sdpa_flash", "backward")]
    assert rows[0].tflops == shapes.SHAPES[0].flops(False) / 2.0 / 1e9 and rows[0].error is None
    assert rows[2].error == "RuntimeError: No available kernel." and rows[2].tflops is None


def test_a_peer_that_refuses_gqa_runs_on_repeated_heads():
    shape = shapes.tiny(BY_NAME["gqa_28_4"])
    q, k, v = shapes._tensors(shape, "cpu", torch.Generator().manual_seed(0))

    def no_gqa(q, k, v):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("No available kernel.")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fn, note = shapes._as_taken(no_gqa, shape, q, k, v)
    assert note == "expanded heads" and shapes._checked(fn, shape, q, k, v, "backward") is None
    gqa = lambda q, k, v: shapes._reference(shape, q, k, v)  # noqa: E731
    assert shapes._as_taken(gqa, shape, q, k, v) == (gqa, None)


def test_rows_go_to_shapes_json_a_table_and_a_plot(tmp_path):
    rows = [Row("shapes", d, p, s.params(), ms=1.0, tflops=t) for s in shapes.SHAPES[:2] for d in ("forward", "backward")
            for p, t in (("attngen", 500.0), ("sdpa_cudnn", 400.0))]
    rows.append(Row("shapes", "forward", "sdpa_flash", BY_NAME["d192_128"].params(), error="RuntimeError: no kernel"))
    rows.append(Row("shapes", "forward", "sdpa_cudnn", BY_NAME["gqa_28_4"].params(), ms=1.0, tflops=300.0,
                    extra=dict(gqa="expanded heads")))
    text = shapes.table(rows)
    assert "d256" in text and "500.0" in text and "1.25" in text  # attngen over cuDNN
    assert "d192_128 forward sdpa_flash: RuntimeError: no kernel" in text and "192/128" in text
    assert "notes:\n  gqa_28_4 forward sdpa_cudnn: expanded heads" in text
    path = write(rows, str(tmp_path), dict(device="NVIDIA H100 80GB HBM3"), stem="shapes_")
    assert os.path.basename(path) == "shapes_nvidia_h100_80gb_hbm3.json"
    assert len(json.load(open(path))["rows"]) == 10
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    plot.main(path, str(tmp_path))
    assert (tmp_path / "shapes_nvidia_h100_80gb_hbm3.png").exists()
