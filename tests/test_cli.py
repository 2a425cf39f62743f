"""The command line: compile, check, explain, and exit codes on errors."""

import os
import subprocess
import sys

import pytest
import torch

from attngen.cli import main
from conftest import ROOT, SPECS


def test_compile_writes_named_files(tmp_path, capsys):
    spec = os.path.join(SPECS, "fwd_causal_d64.attn")
    assert main(["compile", spec, "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "fwd_causal_d64.py")]
    assert "@triton.jit" in (tmp_path / "fwd_causal_d64.py").read_text()


def test_compile_error_exit_code_and_location(tmp_path, capsys):
    bad = tmp_path / "bad.attn"
    bad.write_text("kernel k {\n    head_dim = 100\n    dtype = fp16\n}\n")
    assert main(["compile", str(bad), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:2:16: error: head_dim = 100 is not a multiple of 16")
    assert "Traceback" not in err and not (tmp_path / "k.py").exists()


def test_duplicate_kernel_names_across_files(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / f"{name}.attn").write_text("kernel same { head_dim = 64 dtype = fp16 }")
    assert main(["compile", str(tmp_path / "a.attn"), str(tmp_path / "b.attn"), "-o", str(tmp_path)]) == 2
    assert "also defined in" in capsys.readouterr().err


def test_check_passes_and_reports_each_case(capsys):
    assert main(["check", os.path.join(SPECS, "fwd_causal_d80.attn"), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "6/6 cases within tolerance" in out and "N_Q=1 N_K=1" in out and out.count("ok  ") == 6


def test_check_fails_with_exit_1_on_a_wrong_kernel(monkeypatch, capsys):
    import attngen.testing.accuracy as check

    monkeypatch.setattr(check, "REL_TOL", {k: -1.0 for k in check.REL_TOL})  # nothing can pass
    assert main(["check", os.path.join(SPECS, "fwd_d64.attn")]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_explain_prints_every_pass_and_the_costs(capsys):
    assert main(["explain", os.path.join(SPECS, "fwd_causal_d64.attn"), "--shape", "B=2,H=8,N=1024"]) == 0
    out = capsys.readouterr().out
    for name in ("lower", "tiling", "online-softmax", "exp2", "causal-skip"):
        assert f"=== after {name} ===" in out
    assert "standard three-pass algorithm" in out and "FlashAttention convention" in out
    assert "shared memory" in out


@pytest.mark.parametrize("name", ["decode_d128", "prefill_paged64_d128", "train_gqa_d128"])
def test_explain_evaluates_the_costs_of_every_kernel_kind(name, capsys):
    """Decoding (split partials and their combine), paged and backward specs: every size symbol the
    final kernels use gets a value, so the cost table prints."""
    assert main(["explain", os.path.join(SPECS, f"{name}.attn")]) == 0
    out = capsys.readouterr().out
    assert "forward  generated" in out and "GFLOP" in out


def test_explain_single_pass_and_bad_shape(capsys):
    spec = os.path.join(SPECS, "fwd_d64.attn")
    assert main(["explain", spec, "--pass", "tiling"]) == 0
    out = capsys.readouterr().out
    assert "=== after tiling ===" in out and "=== after lower ===" not in out
    assert main(["explain", spec, "--shape", "Q=3"]) == 2
    assert main(["explain", spec, "--pass", "nope"]) == 2


def test_module_entry_point_and_usage_errors():
    run = lambda *a: subprocess.run([sys.executable, "-m", "attngen", *a], capture_output=True, text=True, cwd=ROOT)
    assert run("--version").stdout.startswith("attngen ")
    usage = run("frobnicate")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    missing = run("compile", "nope.attn")
    assert missing.returncode == 2 and missing.stderr.startswith("nope.attn:1:1: error: cannot read spec")


def test_the_cli_decides_the_interpreter_before_anything_imports_triton():
    """Triton fixes whether it interprets kernels when it is first imported, and `attngen` decides that after its
    own imports (no GPU: the interpreter), so importing the CLI must not import triton."""
    code = "import sys, attngen.cli; print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without a CUDA GPU")
def test_quickstart_check_runs_in_the_interpreter_without_being_told():
    """The README's first command on a machine without a GPU: `attngen check` with TRITON_INTERPRET unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "attngen", "check", os.path.join(SPECS, "fwd_causal_d64.attn")],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "running kernels in Triton's interpreter" in done.stderr and "6/6 cases within tolerance" in done.stdout
