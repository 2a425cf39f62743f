"""Autotuning a varlen spec's kernels (`layout = varlen`): the forward (paged or not) and the two backward kernels,
timed on packed batches of documents and looked up by a varlen call's packed bucket. In Triton's interpreter with
tiny spaces and shapes: the timings mean nothing (tests that need an order pass their own timer), the search, the
gate, the files and the lookup are the real ones.
"""

import json
import os

import pytest
import torch

import attngen
from attngen.policy import hopper
from attngen import cli, tuning
from attngen.cli import main
from attngen.runtime import tables as store
from attngen.runtime.keys import Device, Packed, bucket, problem_key
from attngen.testing.accuracy import compare, compare_grads, Case
from attngen.testing.packed import packed_inputs
from attngen.tuning import save, tune
from attngen.tuning.varlen import checked_sequences, packed_lengths
from conftest import DEVICE, HAS_GPU, SPECS, spec_text

# The tuner's default shapes and printed buckets are the interpreter's here (a GPU tunes 4096 and 16384 tokens, and
# its varlen forward is the Gluon kernel's part): these CLI checks hold in the interpreter.
INTERPRETER_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the interpreter's tune shapes and output")
from test_tune import fresh_tuning_state  # noqa: F401 - the autouse fixture: a fresh cache per test
from test_tune_kinds import order, spy

SHAPE = Packed(3, 2, 2, 96, 96)  # 3 documents of random lengths in 96 tokens
TINY = {"block_m": (32, 64), "block_n": (32,), "num_warps": (4,), "num_stages": (1,)}
TINY_ARGS = ["--values", "block_m=32,64", "block_n=32", "num_warps=4", "num_stages=1"]


def varlen_kernel(name, direction="forward+backward", **extra):
    return attngen.load(spec_text(name, 32, "fp16", "causal", layout="varlen", direction=direction, **extra))


def spec_file(tmp_path, name, **extra):
    path = tmp_path / f"{name}.attn"
    path.write_text(spec_text(name, 32, "fp16", "causal", layout="varlen", direction="forward+backward", **extra))
    return str(path)


def packed_call(kernel, lengths_q, lengths_k, generator=None, grad=False):
    """Inputs of a varlen call (K/V in pages for a paged spec) and the keyword arguments that describe them."""
    x = packed_inputs(kernel.spec, lengths_q, lengths_k, 2, 2, DEVICE, generator)
    if grad:
        for t in (x.q, x.k, x.v):
            t.requires_grad_()
    sizes = dict(cu_seqlens_q=x.cu_seqlens_q, cu_seqlens_k=x.cu_seqlens_k, max_seqlen_q=max(lengths_q),
                 max_seqlen_k=max(lengths_k), block_table=x.block_table)
    return x, sizes


def launched(kernel, monkeypatch, name):
    """The configs the generated module's `name` is called with from now on."""
    seen, real = [], getattr(kernel.module, name)
    monkeypatch.setattr(kernel.module, name, lambda *a, **kw: seen.append(kw.get("config")) or real(*a, **kw))
    return seen


# -- what is tuned, and the keys -----------------------------------------------------------------


def test_varlen_kernels_are_parts_of_their_own_beside_the_dense_ones():
    kernel = varlen_kernel("vl_parts")
    kinds = [(part.kind, part.label) for part in tuning.tunables(kernel)]
    assert kinds == [("forward", "vl_parts"), ("backward", "vl_parts backward attn_bwd_dq"),
                     ("backward", "vl_parts backward attn_bwd_dkdv")]
    dense = attngen.load(spec_text("vl_parts", 32, "fp16", "causal", direction="forward+backward"))
    varlen_keys = {problem_key(part.tuning_problem()) for part in tuning.tunables(kernel)}
    dense_keys = {problem_key(part.tuning_problem()) for part in tuning.tunables(dense)}
    assert len(varlen_keys) == 3 and not varlen_keys & dense_keys
    paged = varlen_kernel("vl_parts_paged", direction="forward", kv_layout="paged(page_size = 16)")
    assert [part.kind for part in tuning.tunables(paged)] == ["forward"]


def test_a_varlen_call_is_bucketed_by_tokens_and_mean_lengths_from_shapes_alone():
    q, k = torch.empty(5000, 32, 128), torch.empty(9000, 8, 128)
    cu = torch.zeros(9, dtype=torch.int32)  # 8 sequences: their offsets are not read
    shape = Packed.of(q, k, cu)
    assert shape == Packed(8, 32, 8, 5000, 9000)
    assert bucket(shape) == "H=32 TOTAL_Q=4096 N_Q=512 N_K=1024"
    pool, table = torch.empty(300, 64, 8, 128), torch.zeros(8, 40, dtype=torch.int32)
    # paged: the keys a block table row addresses (40 pages of 64), not the pool's size
    assert bucket(Packed.of(q, pool, cu, table)) == "H=32 TOTAL_Q=4096 N_Q=512 N_K=2048"


def test_a_shape_packs_the_same_documents_every_time():
    spec = varlen_kernel("vl_lengths").spec
    lengths_q, lengths_k = packed_lengths(spec, Packed(8, 2, 2, 16384, 16384))
    assert len(lengths_q) == 8 and sum(lengths_q) == 16384 and min(lengths_q) > 0 and len(set(lengths_q)) > 1
    assert lengths_k == lengths_q and packed_lengths(spec, Packed(8, 2, 2, 16384, 16384)) == (lengths_q, lengths_k)
    lengths_q, lengths_k = packed_lengths(spec, Packed(3, 2, 2, 90, 180))
    assert sum(lengths_k) == 180 and all(n_k >= 2 * n_q - 1 for n_q, n_k in zip(lengths_q, lengths_k))
    paged = varlen_kernel("vl_lengths_paged", direction="forward", kv_layout="paged(page_size = 16)").spec
    lengths_q, lengths_k = packed_lengths(paged, Packed(3, 2, 2, 48, 192))
    assert sum(lengths_q) == 48 and lengths_k[0] == 64 and all(n_k >= n_q for n_q, n_k in zip(lengths_q, lengths_k))
    assert checked_sequences([5, 9, 2, 7]) == [0, 1, 3]


# -- tune -> table -> a varlen call ----------------------------------------------------------------


def test_a_tuned_varlen_forward_serves_varlen_calls_of_its_bucket_from_the_written_file(monkeypatch):
    kernel = varlen_kernel("vl_fwd")
    part = tuning.tunable(kernel)
    seen, timer = order(lambda config: config["BLOCK_M"] == 32)  # the interpreter's default is 64
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    outcome = tune(kernel, [SHAPE], values=TINY, timer=timer)
    assert outcome.ok and outcome.best[0].trial.config["BLOCK_M"] == 32
    assert outcome.best[0].bucket == "H=2 TOTAL_Q=128 N_Q=32 N_K=32" and outcome.best[0].tflops > 0
    path = save(outcome)
    store.forget()  # what this process tuned is gone: the lookup reads the file

    configs = launched(kernel, monkeypatch, "forward_varlen")
    lengths = [40, 7, 49]  # 96 tokens in 3 sequences: the tuned bucket
    x, sizes = packed_call(kernel, lengths, lengths)
    with torch.no_grad():
        out, lse = kernel(x.q, x.k, x.v, return_lse=True, **sizes)
    assert configs[-1] == outcome.best[0].trial.config
    assert store.describe_config(kernel, Packed.of(x.q, x.k, x.cu_seqlens_q)) == (configs[-1], f"user cache {path}")
    for b in range(3):
        result = compare(kernel.spec, Case(1, 2, 2, lengths[b], lengths[b]), x.rows(out, b),
                         lse[:, int(x.cu_seqlens_q[b]):int(x.cu_seqlens_q[b + 1])][None], x.rows(x.q, b),
                         x.rows(x.k, b, keys=True), x.rows(x.v, b, keys=True))
        assert result.ok, result
    # a bucket nobody tuned: the nearest tuned one, by the same lookup
    x, sizes = packed_call(kernel, [300, 200], [300, 200])
    with torch.no_grad():
        kernel(x.q, x.k, x.v, **sizes)
    assert configs[-1] == outcome.best[0].trial.config


def test_autotune_tunes_a_varlen_call_s_untuned_bucket_once_on_first_use(monkeypatch):
    kernel = attngen.load(varlen_kernel("vl_auto", direction="forward").spec, autotune=True)
    calls = []
    monkeypatch.setattr(tuning, "tune", lambda k, shapes, **kw: calls.append(shapes) or tune(k, shapes, values=TINY))
    x, sizes = packed_call(kernel, [40, 7, 49], [40, 7, 49])
    kernel(x.q, x.k, x.v, **sizes)
    x, sizes = packed_call(kernel, [30, 30, 40], [30, 30, 40])  # the same bucket
    kernel(x.q, x.k, x.v, **sizes)
    assert calls == [[Packed(3, 2, 2, 96, 96)]]
    assert "H=2 TOTAL_Q=128 N_Q=32 N_K=32" in store.user_path(Device.current()).read_text()
    assert packed_lengths(kernel.spec, Packed(4, 2, 2, 2, 8)) == ([1, 1, 0, 0], [4, 4, 0, 0])  # more sequences than queries


def test_a_tuned_varlen_backward_kernel_serves_the_backward_and_gradients_stay_right(monkeypatch):
    kernel = varlen_kernel("vl_bwd")
    part = tuning.tunable(kernel.part("attn_bwd_dkdv"))
    seen, timer = order(lambda config: config["BLOCK_M"] == 32)
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    outcome = tune(part, [SHAPE], values=TINY, timer=timer)
    assert outcome.ok and outcome.best[0].trial.config["BLOCK_M"] == 32
    save(outcome)

    configs = launched(kernel, monkeypatch, "backward_varlen")
    lengths = [40, 7, 49]
    x, sizes = packed_call(kernel, lengths, lengths, grad=True)
    out = kernel(x.q, x.k, x.v, **sizes)
    do = torch.randn_like(out)
    out.backward(do)
    assert configs[-1]["attn_bwd_dkdv"] == outcome.best[0].trial.config
    assert configs[-1]["attn_bwd_dq"] == kernel.part("attn_bwd_dq").tuning_default()
    for b in range(3):
        rows = [x.rows(t.detach(), b, keys=name != "q") for name, t in (("q", x.q), ("k", x.k), ("v", x.v))]
        grads = [x.rows(t.grad, b, keys=name != "q") for name, t in (("q", x.q), ("k", x.k), ("v", x.v))]
        results = compare_grads(kernel.spec, *rows, x.rows(do, b), grads)
        assert all(r.ok for r in results), results


def test_a_varlen_backward_candidate_is_validated_on_the_triton_kernels_not_the_gluon_one(monkeypatch):
    """A spec with the Gluon varlen backward (d=64, 16-bit): the tuner's validation runs asks backward_varlen for the
    Triton dK/dV kernel it tunes (on a Hopper GPU the Gluon kernel would run instead)."""
    monkeypatch.setattr(hopper, "VARLEN_BACKWARD", True)  # (off by default; this spec name is this test's own)
    kernel = attngen.load(spec_text("vl_bwd_gluon", 64, "fp16", "causal", layout="varlen",
                                    direction="forward+backward"))
    assert kernel.program.warp_specialized.backward is not None
    configs = launched(kernel, monkeypatch, "backward_varlen")
    for name in ("attn_bwd_dkdv", "attn_bwd_dq"):
        part = tuning.tunable(kernel.part(name))
        inputs = part.tuning_inputs(Packed(2, 2, 2, 32, 32), DEVICE, torch.Generator(device=DEVICE).manual_seed(0))
        part.tuning_run(inputs, part.tuning_default(), poison=True)
        assert configs[-1]["attn_bwd_dkdv"]["warp_specialized"] is False


def test_a_tuned_paged_varlen_forward_serves_paged_calls(monkeypatch):
    kernel = varlen_kernel("vl_paged", direction="forward", kv_layout="paged(page_size = 16)")
    part = tuning.tunable(kernel)
    seen, timer = order(lambda config: config["BLOCK_M"] == 32)
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    shape = Packed(3, 2, 2, 48, 192)
    outcome = tune(kernel, [shape], values=TINY, timer=timer)
    assert outcome.ok and outcome.best[0].trial.config["BLOCK_M"] == 32
    save(outcome)
    configs = launched(kernel, monkeypatch, "forward_varlen")
    x, sizes = packed_call(kernel, [10, 30, 8], [64, 50, 40])  # 4 pages of 16 per block-table row: 64 keys
    assert bucket(Packed.of(x.q, x.keys, x.cu_seqlens_q, x.block_table)) == outcome.best[0].bucket
    kernel(x.q, x.keys, x.values, **sizes)
    assert configs[-1] == outcome.best[0].trial.config


def test_a_varlen_candidate_wrong_in_one_sequence_is_rejected(monkeypatch):
    kernel = varlen_kernel("vl_gate")
    part = tuning.tunable(kernel)
    wrong = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    real = part.tuning_run

    def run(inputs, config, poison=False):
        out, lse = real(inputs, config, poison=poison)
        if config == wrong:
            out[-1] += 1.0  # the last query row of the last sequence is off
        return out, lse

    monkeypatch.setattr(part, "tuning_run", run)
    outcome = tune(kernel, [SHAPE], values=TINY)
    (rejected,) = [t for t in outcome.trials if t.status == "rejected"]
    assert rejected.config == wrong and rejected.reason.startswith("wrong result")
    assert outcome.ok and outcome.best[0].trial.config != wrong


# -- the command line ------------------------------------------------------------------------------


@INTERPRETER_ONLY
def test_attngen_tune_on_a_varlen_spec_writes_every_kernel_under_packed_buckets(tmp_path, capsys):
    path = spec_file(tmp_path, "vl_cli")
    assert main(["tune", path, "--seqlens", "96", "64:80", *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    assert "vl_cli backward attn_bwd_dq on" in out and "vl_cli backward attn_bwd_dkdv on" in out
    assert "B=3 H=2 TOTAL_Q=64 TOTAL_K=80 (H=2 TOTAL_Q=64 N_Q=16 N_K=32)" in out
    data = json.loads(store.user_path(Device.current()).read_text())
    assert len(data["problems"]) == 3
    for problem in data["problems"].values():
        assert "layout = varlen" in problem["problem"]
        assert set(problem["buckets"]) == {"H=2 TOTAL_Q=128 N_Q=32 N_K=32", "H=2 TOTAL_Q=64 N_Q=16 N_K=32"}
        entry = problem["buckets"]["H=2 TOTAL_Q=128 N_Q=32 N_K=32"]
        assert entry["shape"] == {"B": 3, "H": 2, "H_KV": 2, "TOTAL_Q": 96, "TOTAL_K": 96}


@INTERPRETER_ONLY
def test_the_shipped_varlen_specs_tune_in_the_interpreter_by_default_shapes(capsys):
    path = os.path.join(SPECS, "varlen_paged_d128.attn")
    assert main(["tune", path, "--max-configs", "1", "--values", "block_m=64", "block_n=64",
                 "num_warps=4", "num_stages=1"]) == 0
    assert "B=3 H=32/8 TOTAL_Q=48 TOTAL_K=192" in capsys.readouterr().out


def test_a_kernel_with_nothing_to_tune_is_an_error_naming_the_spec(tmp_path, monkeypatch, capsys):
    path = spec_file(tmp_path, "vl_none")
    monkeypatch.setattr(cli, "tunables", lambda kernel: [])
    assert main(["tune", path]) == 2
    err = capsys.readouterr().err
    assert "kernel 'vl_none'" in err and path in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--seqlens", "4", "--batch", "5"], "--batch 5 sequences do not fit 4 tokens"),
    (["--seqlens", "x"], "--seqlens takes positive whole numbers"),
])
def test_varlen_tune_argument_errors_exit_2(tmp_path, args, message, capsys):
    assert main(["tune", spec_file(tmp_path, "vl_args"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_paged_varlen_spec_needs_as_many_keys_as_queries(capsys):
    assert main(["tune", os.path.join(SPECS, "varlen_paged_d128.attn"), "--seqlens", "64:32"]) == 2
    assert "give at least as many keys as queries" in capsys.readouterr().err
