"""Autotuning: pruning, the validation gate, tune -> cache -> reuse, shipped tables, cache abuse.

Everything runs in Triton's interpreter with a tiny space and tiny shapes: the timings there mean
nothing, but the search, the gate, the files and the lookup are the real ones.
"""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile

import pytest
import torch

import attngen
from attngen.testing import accuracy as check, reference
from attngen import tuning
from attngen.lang.builtin import sdpa_spec
from attngen.runtime.cache import CacheWarning
from attngen.cli import main
from attngen.analysis.resources import SHARED_LIMIT, Target
from attngen.lang.spec import load_file, parse
from attngen.tuning import Shape, save, tune
from attngen.runtime import tables as store
from attngen.runtime.keys import Device, bucket, nearest_power_of_two, problem_key
from attngen.tuning.report import format_outcome
from attngen.tuning.space import candidates, prune, restrict, within_budget
from attngen.tuning.gate import check_attention
from attngen.tuning.tunables import ForwardTunable
from conftest import DEVICE, HAS_GPU, ROOT, SPECS, shipped_specs, spec_text

H100 = Target((9, 0), SHARED_LIMIT[(9, 0)], "H100")
SHIPPED_TABLES = store.shipped_files()  # the real ones: each test below sees none unless it says so
# Two candidates: BLOCK_M 32 or 64; everything else fixed.
TINY = {"block_m": (32, 64), "block_n": (64,), "num_warps": (4,), "num_stages": (1,)}
TINY_ARGS = ["--values", "block_m=32,64", "block_n=64", "num_warps=4", "num_stages=1"]
SHAPE = Shape(1, 2, 2, 64, 64)


@pytest.fixture(autouse=True)
def fresh_tuning_state(tmp_path, monkeypatch):
    """Each test gets its own cache directory, no shipped tables, and no memory of earlier tunings."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNGEN_AUTOTUNE", raising=False)
    monkeypatch.setattr(store, "shipped_files", lambda: [])
    store.forget()
    store._ATTEMPTED.clear()
    yield
    store.forget()
    store._ATTEMPTED.clear()


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).half()


def kernel_for(name, mask="causal", **extra):
    return attngen.load(spec_text(name, 32, "fp16", mask, **extra))


def spec_file(tmp_path, name, mask="causal"):
    path = tmp_path / f"{name}.attn"
    path.write_text(spec_text(name, 32, "fp16", mask))
    return str(path)


def tile(config):
    return config["BLOCK_M"], config["BLOCK_N"], config["num_stages"]


# -- keys ----------------------------------------------------------------------------------------


def test_buckets_round_sizes_to_the_nearest_power_of_two():
    assert [nearest_power_of_two(n) for n in (1, 3, 1000, 1400, 1500, 3000)] == [1, 4, 1024, 1024, 2048, 4096]
    assert bucket(Shape(2, 8, 2, 1000, 3000)) == "BH=16 N_Q=1024 N_K=4096"


def key_of(spec):
    return problem_key(attngen.load(spec).tuning_problem())


def test_problem_identity_ignores_the_name_but_not_fixed_tiles():
    a, b = spec_text("a", 32, "fp16", "causal"), spec_text("b", 32, "fp16", "causal")
    assert key_of(a) == key_of(b) != key_of(spec_text("c", 32, "fp16", "causal", block_m=64))
    assert key_of(a) != key_of(spec_text("d", 32, "fp16", "none"))
    # attention(is_causal=True) on fp16 d=64 (a forward+backward spec) has the forward problem of
    # specs/fwd_causal_d64.attn
    assert key_of(sdpa_spec("fp16", 64, True)) == key_of(load_file(os.path.join(SPECS, "fwd_causal_d64.attn")))


# -- pruning and the budget ----------------------------------------------------------------------


def test_pruning_matches_hand_computed_shared_memory():
    kernel = attngen.load(spec_text("prune", 128, "bf16", "none"))
    space = restrict(kernel.tuning_space(), {"block_m": (64, 128), "block_n": (64, 128), "num_warps": (4,),
                                             "num_stages": (3, 4)})
    fits, groups = prune(kernel, candidates(space), H100)
    # wgmma path (16-bit, block_m >= 64): 2 bytes x 128 x (block_m + 2 x num_stages x block_n) <= 232,448
    #   (64, 64, 3) 114,688   (64, 64, 4) 147,456   (64, 128, 3) 212,992   (64, 128, 4) 278,528 x
    #   (128, 64, 3) 131,072  (128, 64, 4) 163,840  (128, 128, 3) 229,376  (128, 128, 4) 294,912 x
    # registers: (128 x 128 + 128 x block_n) / 128 threads: 256 > 255 for block_n = 128 -> (128, 128, 3) x
    assert {tile(c) for c in fits} == {(64, 64, 3), (64, 64, 4), (64, 128, 3), (128, 64, 3), (128, 64, 4)}
    smem, regs = groups
    assert "shared memory" in smem.reason and {tile(c) for c in smem.configs} == {(64, 128, 4), (128, 128, 4)}
    assert "278,528 bytes" in smem.example and "232,448" in smem.example
    assert "registers" in regs.reason and [tile(c) for c in regs.configs] == [(128, 128, 3)]
    assert "256" in regs.example


def test_tune_reports_pruning_before_compiling_anything(tmp_path, capsys, monkeypatch):
    path = tmp_path / "big.attn"
    path.write_text(spec_text("big", 128, "bf16", "none"))
    ran = []
    real = ForwardTunable.tuning_run
    monkeypatch.setattr(ForwardTunable, "tuning_run",
                        lambda self, i, c, poison=False: ran.append(tile(c)) or real(self, i, c, poison=poison))
    assert main(["tune", str(path), "--seqlens", "64", "--max-configs", "1", "--values", "block_m=64,128",
                 "block_n=64,128", "num_warps=4", "num_stages=3,4"]) == 0
    out = capsys.readouterr().out
    assert "pruned before compiling: 3 of 8" in out and "tried 1 of 5 that fit" in out
    assert "2  needs N bytes of shared memory but sm_90 allows N per block" in out
    assert set(ran) <= {(64, 64, 3), (64, 64, 4), (64, 128, 3), (128, 64, 3), (128, 64, 4)}


def test_budget_keeps_the_default_first_then_its_neighbours():
    default = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    configs = candidates({"BLOCK_M": (16, 64, 128), "BLOCK_N": (64,), "num_warps": (4, 8), "num_stages": (2,)})
    picked = within_budget(configs, default, 3)
    assert picked[0] == default and len(picked) == 3
    assert all(c["BLOCK_M"] != 16 for c in picked)  # two halvings away; 128 and 8 warps are one step


# -- the validation gate -------------------------------------------------------------------------


def test_the_best_few_are_timed_again_alternating_and_the_runoff_decides(monkeypatch):
    """A candidate whose first timing was low by luck (the order of measurement, NOTES v20) loses the
    runoff: the best `runoff` are timed again in alternating rounds and the median of its rounds
    decides, among the finalists only."""
    kernel = kernel_for("runoff")
    target = tuning.tunable(kernel)
    real, seen, timed = type(target).tuning_run, [], []
    first = {16: 1.0, 32: 2.0, 64: 3.0}   # block_m -> the first timing: 16 looks fastest
    later = {16: 5.0, 32: 2.0, 64: 3.0}   # and is the slowest when timed again

    def run(inputs, config, poison=False):
        seen.append(config["BLOCK_M"])
        return real(target, inputs, config, poison=poison)

    def timer(fn, rep_ms, cuda):
        fn()
        m = seen[-1]
        timed.append(m)
        return (first if timed.count(m) == 1 else later)[m]

    monkeypatch.setattr(target, "tuning_run", run)
    values = dict(TINY, block_m=(16, 32, 64))
    alone = tune(kernel, [SHAPE], values=values, timer=timer, runoff=0)
    assert alone.best[0].trial.config["BLOCK_M"] == 16 and len(timed) == 3
    timed.clear()
    outcome = tune(kernel, [SHAPE], values=values, timer=timer, runoff=2)
    assert timed[3:] == [16, 32, 32, 16, 16, 32]  # the two best, three rounds, alternating
    assert outcome.best[0].trial.config["BLOCK_M"] == 32 and outcome.best[0].ms == 2.0
    assert {t.config["BLOCK_M"]: t.ms[outcome.best[0].bucket] for t in outcome.trials} == {16: 5.0, 32: 2.0, 64: 3.0}


def test_a_wrong_candidate_is_rejected_reported_and_never_chosen(monkeypatch):
    kernel = kernel_for("gate")
    wrong = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    target = tuning.tunable(kernel)
    real, seen = type(target).tuning_run, []

    def run(inputs, config, poison=False):
        seen.append(config)
        out, lse = real(target, inputs, config, poison=poison)
        if config == wrong:
            out[:, :, -1] += 1.0  # the last query row is off
        return out, lse

    def timer(fn, rep_ms, cuda):  # the wrong candidate would be the fastest, were it ever timed
        fn()
        return 0.001 if seen[-1] == wrong else 1.0

    monkeypatch.setattr(target, "tuning_run", run)
    outcome = tune(kernel, [SHAPE], values=TINY, timer=timer)
    (rejected,) = [t for t in outcome.trials if t.status == "rejected"]
    assert rejected.config == wrong and rejected.reason.startswith("wrong result")
    assert outcome.ok and outcome.best[0].trial.config != wrong
    assert "rejected BLOCK_M=32 BLOCK_N=64 num_warps=4 num_stages=1: wrong result" in format_outcome(outcome)
    save(outcome)
    stored = json.loads(store.user_path(outcome.device).read_text())["problems"][key_of(kernel.spec)]
    assert all(e["config"] != wrong for e in stored["buckets"].values())


def test_tune_exits_1_and_writes_nothing_when_no_candidate_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check, "REL_TOL", {k: -1.0 for k in check.REL_TOL})  # nothing can pass
    assert main(["tune", spec_file(tmp_path, "nopass"), "--seqlens", "64", *TINY_ARGS]) == 1
    out = capsys.readouterr().out
    assert "2 rejected by validation" in out and "no candidate passed validation" in out
    assert not store.user_path(Device.current()).exists()


def test_a_candidate_that_fails_to_compile_is_skipped_with_its_reason():
    kernel = kernel_for("nocompile")
    outcome = tune(kernel, [SHAPE], values=dict(TINY, block_m=(48, 64)))  # tl.arange needs a power of two
    failed = [t for t in outcome.trials if t.status == "failed"]
    assert [t.config["BLOCK_M"] for t in failed] == [48] and "power of 2" in failed[0].reason
    assert outcome.ok and outcome.best[0].trial.config["BLOCK_M"] == 64


# -- tune -> cache -> reuse ----------------------------------------------------------------------

REUSE = """
import json, sys, torch, attngen
from attngen import tuning
from attngen.env import interpreting
from attngen.runtime import tables as store

def tuned_again(*args, **kwargs):
    raise SystemExit("tuned again")

tuning.tune = tuning.search.tune = tuned_again
kernel = attngen.load(sys.argv[1], autotune=True)
device = "cpu" if interpreting() else "cuda"
q, k = torch.randn(1, 2, 100, 32, device=device).half(), torch.randn(1, 2, 200, 32, device=device).half()
out = kernel(q, k, k)
ref, _ = attngen.testing.reference.attention(q, k, k, kernel.spec.mask)
print(json.dumps([store.describe_config(kernel, tuning.Shape.of(q, k)), (out.double() - ref).abs().max().item()]))
"""


def test_tune_then_a_second_process_uses_the_cache_without_tuning(tmp_path, capsys):
    path = spec_file(tmp_path, "reuse")
    assert main(["tune", path, "--seqlens", "64", "100:200", "--batch", "1", "--heads", "2", *TINY_ARGS]) == 0
    captured = capsys.readouterr()
    assert "] 4/4 done" in captured.err  # the progress bar, on stderr
    timing = "triton.testing.do_bench median" if HAS_GPU else "wall-clock median in Triton's CPU interpreter"
    assert "best config" in captured.out and timing in captured.out
    assert "wrote 2 entries to" in captured.out
    data = json.loads(store.user_path(Device.current()).read_text())
    buckets = data["problems"][key_of(load_file(path))]["buckets"]
    assert set(buckets) == {"BH=2 N_Q=64 N_K=64", "BH=2 N_Q=128 N_K=256"}
    assert all(e["rel_err"] < check.REL_TOL[check.DType.FP16] for e in buckets.values())

    done = subprocess.run([sys.executable, "-c", REUSE, path], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, TRITON_INTERPRET="0" if HAS_GPU else "1"))
    assert done.returncode == 0, done.stderr
    (config, source), err = json.loads(done.stdout.splitlines()[-1])
    assert config == buckets["BH=2 N_Q=128 N_K=256"]["config"] and source.startswith("user cache")
    assert err < 1e-2


def test_autotune_tunes_an_untuned_bucket_once_on_first_use(monkeypatch):
    text = spec_text("autotuned", 32, "fp16", "none")
    plain, kernel = attngen.load(text), attngen.load(text, autotune=True)
    assert kernel is not plain and kernel.module is plain.module and plain.autotune is None
    assert attngen.load(text, autotune=True) is kernel
    calls = []
    monkeypatch.setattr(tuning, "tune", lambda k, shapes, **kw: calls.append(shapes) or tune(k, shapes, values=TINY))
    q = rand(1, 2, 40, 32)
    plain(q, q, q)
    assert calls == []  # no tuning in the call path unless asked
    out = kernel(q, q, q)
    kernel(q, q, q)
    kernel(rand(1, 2, 45, 32), rand(1, 2, 45, 32), rand(1, 2, 45, 32))  # the same bucket
    assert calls == [[Shape(1, 2, 2, 40, 40)]]
    assert (out.double() - reference.attention(q, q, q)[0]).abs().max().item() < 5e-3
    config, source = store.describe_config(kernel, Shape.of(q, q))
    assert config["BLOCK_M"] in (32, 64) and source == "this process"
    assert "BH=2 N_Q=32 N_K=32" in store.user_path(Device.current()).read_text()


# -- shipped tables ------------------------------------------------------------------------------


def test_user_cache_overrides_the_shipped_table_bucket_by_bucket(tmp_path, monkeypatch):
    kernel = kernel_for("shipped", "none")
    device = Device.current()
    a, b, c = ({"BLOCK_M": m, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1} for m in (16, 32, 128))
    shipped, other_gpu = tmp_path / f"{device.slug}.json", tmp_path / "other.json"
    problem = kernel.tuning_problem(), kernel.spec.name
    store.save(shipped, device, *problem, [("BH=2 N_Q=64 N_K=64", {"config": a}),
                                              ("BH=2 N_Q=1024 N_K=1024", {"config": a})])
    store.save(other_gpu, Device("Other GPU", (8, 0), device.triton), *problem, [("BH=2 N_Q=16 N_K=16", {"config": b})])
    store.save(store.user_path(device), device, *problem, [("BH=2 N_Q=64 N_K=64", {"config": b}),
                                                              ("BH=2 N_Q=16 N_K=16", {"config": c})])
    monkeypatch.setattr(store, "shipped_files", lambda: [other_gpu, shipped])
    store.forget()

    def lookup(n):
        return store.describe_config(kernel, Shape(1, 2, 2, n, n))

    assert lookup(64) == (b, f"user cache {store.user_path(device)}")
    assert lookup(1024) == (a, f"shipped table attngen/tuned/{shipped.name}")
    assert lookup(16) == (c, f"user cache {store.user_path(device)}")
    config, source = lookup(3000)
    assert config == a and source.endswith("(nearest tuned bucket BH=2 N_Q=1024 N_K=1024)")


UNTUNED_HEAD_DIM_SPECS = {"gemma_d256_train", "phi_d96_train"}
"""Issue 51's head-dim specs, shipped before a GPU run tuned them (attngen/tuned/README.md): drop a name once its
kernels are in every table."""


def test_shipped_tables_are_real_gpu_tables_of_the_shipped_specs():
    """Tables in attngen/tuned/ parse without a warning, name a GPU, hold every kernel of every plain spec
    in specs/ and nothing but kernels of specs/ (forward, backward, decode; a changed spec leaves a stale
    problem: re-tune, or drop it), and only entries that fit their kernel on that GPU. The variant specs
    (issue 48), the varlen specs (issue 49), the specs whose V has another head dim (head_dim_v, issue 51) and the
    FP8 specs (issue 52: dtype or kv_dtype fp8_e4m3) are not tuned on a GPU yet: their kernels run the policy's
    tiles (attngen/tuned/README.md)."""
    specs = list(map(load_file, shipped_specs()))
    parts = {problem_key(part.tuning_problem()): part for spec in specs for part in tuning.tunables(attngen.load(spec))}
    required = {key for key, part in parts.items()
                if not part.spec.variant and not part.spec.varlen and not part.spec.splits_head_dims
                and not part.spec.dtype.fp8 and not part.spec.fp8_cache
                and part.spec.name not in UNTUNED_HEAD_DIM_SPECS}
    for table in SHIPPED_TABLES:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            data = store.read(table)
        device = Device.from_header(data)
        assert not device.interpreter and table.name == f"{device.slug}.json", table.name
        stale = set(data["problems"]) - set(parts)
        assert not stale, f"{table.name}: problems of no spec in specs/: {stale}; re-tune (attngen/tuned/README.md)"
        missing = sorted(f"{parts[key].spec.name}: {parts[key].label}" for key in required if key not in data["problems"])
        assert not missing, f"{table.name}: kernels of shipped specs with no tuned entry: {missing}"
        target = Target(device.capability, SHARED_LIMIT[device.capability], device.name)
        for key, problem in data["problems"].items():
            for name, entry in problem["buckets"].items():
                assert store.entry_problem(parts[key], name, entry, target) is None, (table.name, parts[key].label, name)


def test_wheel_ships_the_tuned_tables_and_the_tuning_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("attngen", "templates"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "attngen" / "tuned").mkdir(exist_ok=True)
    (src / "attngen" / "tuned" / "some-gpu_sm90_triton-3.6.json").write_text("{}\n")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = os.listdir(tmp_path / "dist")
    names = zipfile.ZipFile(tmp_path / "dist" / wheel).namelist()
    assert "attngen/tuned/some-gpu_sm90_triton-3.6.json" in names and "attngen/runtime/tables.py" in names


# -- abuse ---------------------------------------------------------------------------------------


def tuned_file(kernel):
    outcome = tune(kernel, [SHAPE], values=TINY)
    return outcome, save(outcome)


def test_a_truncated_file_warns_falls_back_and_is_rewritten():
    kernel = kernel_for("truncated")
    outcome, path = tuned_file(kernel)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    store.forget()
    q = rand(*SHAPE[:2], 64, 32)
    with pytest.warns(CacheWarning, match="damaged"):
        out = kernel(q, q, q)
    assert torch.isfinite(out).all() and kernel.config(q, q) == kernel.tuning_default()
    with pytest.warns(CacheWarning, match="damaged"):
        save(outcome)
    assert json.loads(open(path).read())["problems"]  # whole again


ENTRY = '{"format": "attngen-tuning/1", HEADER, "problems": {"PROBLEM": {"buckets": {BUCKET: {"config": CONFIG}}}}}'


@pytest.mark.parametrize("content,warning", [
    ("\x00\xff not json", "damaged"),
    ("[]", "not an attngen tuning file"),
    ('{"format": "attngen-tuning/1", HEADER, "problems": {"PROBLEM": 5}}', None),
    ('{"format": "attngen-tuning/1", "gpu": "Some GPU", "capability": [8, 0], "triton": "3.6", "problems": {}}',
     "holds entries for Some GPU"),
    (ENTRY.replace("CONFIG", '{"BLOCK_M": 64}'), "must set exactly"),
    (ENTRY.replace("CONFIG", '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 1, "num_stages": 1}'),
     "640 fp32 registers"),
    (ENTRY.replace("CONFIG", '{"BLOCK_M": "64", "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}'), "whole numbers"),
    (ENTRY.replace("BUCKET", '"not a bucket"'), "not a shape bucket"),
], ids=["binary", "list", "problem", "other-gpu", "keys", "infeasible", "string", "bucket"])
def test_corrupt_files_give_a_working_kernel_and_at_most_a_warning(content, warning):
    kernel = kernel_for("corrupt")
    device = Device.current()
    header = json.dumps(device.header())[1:-1]
    config = '{"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}'
    content = (content.replace("HEADER", header).replace("PROBLEM", key_of(kernel.spec))
               .replace("BUCKET", json.dumps(bucket(SHAPE))).replace("CONFIG", config))
    store.user_path(device).write_text(content)
    q = rand(*SHAPE[:2], 64, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = kernel(q, q, q)
    ours = [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)]  # not the interpreter's
    assert all(issubclass(w.category, (CacheWarning, DeprecationWarning)) for w in caught)
    assert len(ours) == (warning is not None) and (warning is None or warning in ours[0]), ours
    assert kernel.config(q, q) == kernel.tuning_default()
    assert (out.double() - reference.attention(q, q, q, kernel.spec.mask)[0]).abs().max().item() < 5e-3


def test_a_fixed_spec_key_is_never_overridden_by_a_stored_entry():
    kernel = kernel_for("fixedkey", block_n=32)
    device = Device.current()
    store.save(store.user_path(device), device, kernel.tuning_problem(), kernel.spec.name,
               [(bucket(SHAPE), {"config": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}})])
    with pytest.warns(CacheWarning, match="fixes BLOCK_N=32"):
        config, source = store.describe_config(kernel, SHAPE)
    assert config["BLOCK_N"] == 32 and source == "default"


def test_an_unwritable_cache_directory_falls_back_with_a_warning(tmp_path, monkeypatch):
    from attngen.runtime import cache

    kernel = kernel_for("unwritable")
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    cache._fallback_warned.clear()
    outcome = tune(kernel, [SHAPE], values=TINY)
    with pytest.warns(CacheWarning, match="not writable"):
        written = save(outcome)
    assert written and written.startswith(str(tmp_path / "tmp")) and json.loads(open(written).read())


def test_a_failed_write_is_a_warning_and_the_result_still_serves_this_process(tmp_path):
    kernel = kernel_for("nowrite")
    outcome = tune(kernel, [SHAPE], values=TINY)
    (tmp_path / "blocker").write_text("")
    with pytest.warns(CacheWarning, match="cannot write"):
        assert save(outcome, tmp_path / "blocker" / "table.json") is None
    assert store.describe_config(kernel, SHAPE) == (outcome.best[0].trial.config, "this process")


def _hammer(path, head_dim, rounds):
    device = Device("Test GPU", (9, 0), "3.6")
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    for i in range(rounds):
        entry = {"config": config, "ms": 1.0}
        store.save(path, device, f"kind = test; head_dim = {head_dim}", f"p{head_dim}", [(f"BH={2 ** i} N_Q=1 N_K=1", entry)])


def test_processes_writing_at_once_all_land(tmp_path):
    path, rounds = tmp_path / "shared.json", 25
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_hammer, args=(path, d, rounds)) for d in (16, 32, 48, 64)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * 4
    problems = json.loads(path.read_text())["problems"]
    assert len(problems) == 4 and all(len(p["buckets"]) == rounds for p in problems.values())


# -- validation with bounded memory ---------------------------------------------------------------


@pytest.mark.parametrize("mask,n_q,n_k", [
    ("causal(top_left)", 96, 96), ("causal(top_left)", 40, 96), ("causal(bottom_right)", 40, 96),
    ("none", 96, 40), ("causal(top_left)", 96, 40),
])
def test_validation_slices_are_exact_and_still_catch_errors(mask, n_q, n_k):
    spec = parse(spec_text("slice", 16, "fp32", mask, heads=4, kv_heads=2))
    q, k, v = torch.randn(3, 4, n_q, 16), torch.randn(3, 2, n_k, 16), torch.randn(3, 2, n_k, 16)
    out, lse = reference.attention(q, k, v, spec.mask, spec.softmax_scale)
    out, lse = out.float(), lse.float()
    limit = 2 * 8 * n_k  # 8 rows of one K/V head's group
    result = check_attention(spec, q, k, v, out, lse, max_scores=limit)
    assert result.ok, check.format_result(result)
    exact_slice_exists = not (mask == "causal(top_left)" and n_q > n_k)
    assert (result.case.n_q < n_q) == exact_slice_exists and result.case.batch == 1
    out[0, 0, -1] += 1.0
    assert not check_attention(spec, q, k, v, out, lse, max_scores=limit).ok


# -- command-line errors -------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--seqlens", "abc"], "--seqlens takes positive whole numbers"),
    (["--values", "block_q=16"], "no tile key 'block_q'"),
    (["--values", "block_m"], "--values takes KEY=V1,V2"),
    (["--max-configs", "0"], "positive whole numbers"),
    (["--heads", "3", "--values", "block_m=64"], "--heads 3:8 does not fit kernel 'fwd_gqa_d128' (heads = 32, kv_heads = 8, group = 4)"),
    (["--heads", "32:4"], "--heads 32:4 does not fit"),
    (["--heads", "32:x"], "--heads takes positive whole numbers"),
    pytest.param(["--write-table", "tables"], "run it on that GPU",
                 marks=pytest.mark.skipif(HAS_GPU, reason="on a GPU, --write-table is the real thing")),
])
def test_tune_argument_errors_exit_2_without_a_traceback(args, message, capsys):
    spec = os.path.join(SPECS, "fwd_gqa_d128.attn")
    assert main(["tune", spec, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_values_for_a_key_the_spec_fixes_is_an_error(capsys):
    assert main(["tune", os.path.join(SPECS, "fwd_d128.attn"), "--values", "block_m=64"]) == 2
    assert "block_m is fixed to 128 by the spec" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_on_the_gpu_times_with_do_bench():
    kernel = attngen.load(os.path.join(SPECS, "fwd_d64.attn"))
    outcome = tune(kernel, [Shape(2, 16, 16, 1024, 1024)], budget=3, rep_ms=5)
    assert outcome.ok and "do_bench" in outcome.timing and outcome.best[0].tflops > 0
