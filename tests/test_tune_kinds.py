"""Autotuning the backward kernels and the kernels over a KV cache, and the chunked float64 gradient
reference the backward's validation gate uses. In Triton's interpreter, with tiny spaces and shapes:
the timings mean nothing (tests that need an order pass their own timer), the paths are the real ones.
"""

import json
import os

import pytest
import torch

import attngen
from attngen.testing import accuracy as check, reference
from attngen import tuning
from attngen.cli import main
from attngen.api.kvcache import _auto_splits
from attngen.lang.builtin import kvcache_spec
from conftest import shipped_specs
from attngen.lang.spec import Mask, load_file
from attngen.tuning import Shape, save, tune
from attngen.runtime import tables as store
from attngen.runtime.keys import Device, problem_key
from attngen.tuning.report import format_outcome
from conftest import DEVICE, SPECS, spec_text
from test_tune import TINY, fresh_tuning_state  # noqa: F401 - the autouse fixture: a fresh cache per test

SHAPE = Shape(1, 2, 2, 48, 80)  # seq_q != seq_k, neither a multiple of the tiles
DECODE = {"block_n": (32,), "num_warps": (4,), "num_stages": (1,)}


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).half()


def train_kernel(name, mask="causal"):
    return attngen.load(spec_text(name, 32, "fp16", mask, direction="forward+backward"))


def order(fast):
    """A timer under which the configs `fast(config)` says are fast win, whatever the interpreter says."""
    seen = []

    def timer(fn, rep_ms, cuda):
        fn()
        return 0.001 if fast(seen[-1]) else 1.0

    return seen, timer


def spy(kernel, seen):
    """Record the config of every tuning_run (tune() runs candidates through it)."""
    real = kernel.tuning_run

    def run(inputs, config, poison=False):
        seen.append(dict(config))
        return real(inputs, config, poison=poison)

    return run


# -- the chunked gradient reference --------------------------------------------------------------


@pytest.mark.parametrize("mask,n_q,n_k", [(Mask.CAUSAL_TOP_LEFT, 37, 53), (Mask.CAUSAL_BOTTOM_RIGHT, 53, 37),
                                          (Mask.NONE, 29, 41)])
def test_chunked_gradient_reference_equals_autograd_in_one_piece(mask, n_q, n_k):
    q, k, v, do = (torch.randn(2, 4, n, 16, dtype=torch.float64) for n in (n_q, n_k, n_k, n_q))
    k, v = k[:, :2], v[:, :2]  # GQA: two query heads per key/value head
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = reference.attention(*leaves, mask, 0.3)
    out.backward(do)
    chunked = reference.attention_grads(q, k, v, do, mask, 0.3, max_scores=2 * 4 * n_k * 5)  # 5 rows at a time
    for got, leaf in zip(chunked, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)


# -- the backward kernels ------------------------------------------------------------------------


def test_the_backward_kernels_are_two_problems_of_their_own():
    kernel = train_kernel("parts")
    kinds = [(part.kind, part.label) for part in tuning.tunables(kernel)]
    assert kinds == [("forward", "parts"), ("backward", "parts backward attn_bwd_dq"),
                     ("backward", "parts backward attn_bwd_dkdv")]
    keys = {problem_key(part.tuning_problem()) for part in tuning.tunables(kernel)}
    assert len(keys) == 3
    # The spec's tile keys describe the forward: fixing one changes the forward's problem only.
    fixed = attngen.load(spec_text("parts2", 32, "fp16", "causal", direction="forward+backward", block_m=64))
    assert problem_key(fixed.tuning_problem()) != problem_key(kernel.tuning_problem())
    assert problem_key(fixed.part("attn_bwd_dq").tuning_problem()) == problem_key(kernel.part("attn_bwd_dq").tuning_problem())
    assert tuning.tunables(attngen.load(spec_text("fwdonly", 32, "fp16", "causal")))[1:] == []


def test_a_tuned_backward_kernel_serves_the_backward_and_gradients_stay_right(monkeypatch):
    kernel = train_kernel("bwdtune")
    dq_part = tuning.tunable(kernel.part("attn_bwd_dq"))
    launches = []
    for name in ("launch_attn_bwd_dq", "launch_attn_bwd_dkdv"):
        real = getattr(kernel.module, name)
        monkeypatch.setattr(kernel.module, name, lambda *a, _real=real, _name=name, **kw: launches.append(_name) or _real(*a, **kw))
    seen, timer = order(lambda config: config["BLOCK_M"] == 32)
    monkeypatch.setattr(dq_part, "tuning_run", spy(dq_part, seen))
    outcome = tune(dq_part, [SHAPE], values=TINY, timer=timer, runoff=0)  # on a GPU, no re-timing
    assert outcome.ok and outcome.best[0].trial.config["BLOCK_M"] == 32
    assert format_outcome(outcome).startswith("bwdtune backward attn_bwd_dq on ")
    # Validation ran the whole backward; timing (timer calls fn once) only the dQ kernel.
    assert launches == ["launch_attn_bwd_dq", "launch_attn_bwd_dkdv", "launch_attn_bwd_dq"] * 2
    save(outcome)

    q, k, v = (rand(1, 2, n, 32).requires_grad_() for n in (48, 80, 80))
    shape = Shape.of(q, k)
    used = kernel.backward_config(q, k)
    assert used["attn_bwd_dq"] == outcome.best[0].trial.config
    assert used["attn_bwd_dkdv"] == kernel.part("attn_bwd_dkdv").tuning_default()
    assert store.describe_config(dq_part, shape)[1] == "this process"
    do = rand(1, 2, 48, 32)
    kernel(q, k, v).backward(do)
    results = check.compare_grads(kernel.spec, q.detach(), k.detach(), v.detach(), do, (q.grad, k.grad, v.grad))
    assert all(r.ok for r in results), results


def test_a_backward_candidate_that_breaks_a_gradient_is_rejected(monkeypatch):
    kernel = train_kernel("bwdgate", "none")
    part = tuning.tunable(kernel.part("attn_bwd_dkdv"))
    wrong = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    real = part.tuning_run

    def run(inputs, config, poison=False):
        dq, dk, dv = real(inputs, config, poison=poison)
        if config == wrong:
            dv[:, :, 3] += 0.5  # one key row of dV is off
        return dq, dk, dv

    monkeypatch.setattr(part, "tuning_run", run)
    outcome = tune(part, [SHAPE], values=dict(TINY, block_n=(64,)))
    (rejected,) = [t for t in outcome.trials if t.status == "rejected"]
    assert rejected.config == wrong and "wrong result: dv rel" in rejected.reason
    assert outcome.ok and outcome.best[0].trial.config != wrong


# -- kernels over a KV cache ---------------------------------------------------------------------


def decode_kernel(page_size=None):
    return attngen.load(kvcache_spec("fp16", 32, True, page_size))


def test_the_split_count_is_searched_for_split_auto_specs_only():
    kernel = decode_kernel()
    (part,) = tuning.tunables(kernel)
    assert part.kind == "decode" and "BLOCK_M" not in part.tuning_space()
    assert part.tuning_space()["num_splits"][0] == 0 and part.tuning_default()["num_splits"] == 0
    fixed = attngen.load(spec_text("split4", 32, "fp16", "causal(bottom_right)", split_kv=4))
    assert "num_splits" not in fixed.part("kvcache").tuning_space()
    paged = decode_kernel(64)  # pages of 64 tokens are looked up once per tile: BLOCK_N <= 64
    reason = paged.part("kvcache").tuning_infeasible({"BLOCK_N": 128, "num_warps": 4, "num_stages": 1, "num_splits": 0}, None)
    assert "block_n=128 crosses a page" in reason


@pytest.mark.parametrize("page_size", [None, 16])
def test_a_tuned_split_count_serves_its_own_bucket_and_the_heuristic_the_rest(monkeypatch, page_size):
    kernel = decode_kernel(page_size)
    part = tuning.tunable(kernel.part("kvcache"))
    # The run-time heuristic's count for the other batch below (it depends on the GPU's SMs), and a
    # tuned count that differs from it.
    heuristic = _auto_splits(kernel.module, {"BLOCK_M": 16, "BLOCK_N": 32}, 8, 4, 2, 1, 96, torch.device(DEVICE))
    tuned = 3 if heuristic != 3 else 5
    seen, timer = order(lambda config: config["num_splits"] == tuned)
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    shape = Shape(2, 4, 2, 1, 96)
    outcome = tune(part, [shape], values=dict(DECODE, num_splits=(0, 1, tuned)), timer=timer)
    assert outcome.ok and outcome.best[0].trial.config["num_splits"] == tuned
    assert outcome.best[0].gbps is not None and "GB/s" in format_outcome(outcome)
    save(outcome)
    monkeypatch.undo()

    splits = []
    real = kernel.module.forward_kvcache
    monkeypatch.setattr(kernel.module, "forward_kvcache",
                        lambda *a: splits.append((a[8], dict(a[9]))) or real(*a))
    for batch, expected in ((2, tuned), (8, heuristic)):  # its own bucket; BH=32 takes the nearest bucket's tiles only
        q = rand(batch, 1, 4, 32)
        if page_size:
            k, v = rand(batch * 6 + 3, page_size, 2, 32), rand(batch * 6 + 3, page_size, 2, 32)
            table = torch.randperm(batch * 6 + 3, dtype=torch.int32, device=DEVICE)[: batch * 6].view(batch, 6)
        else:
            k, v, table = rand(batch, 96, 2, 32), rand(batch, 96, 2, 32), None
        lens = torch.randint(1, 97, (batch,), dtype=torch.int32, device=DEVICE)
        out = attngen.attention_with_kvcache(q, k, v, lens, table, causal=True)
        assert splits[-1][0] == expected and splits[-1][1]["BLOCK_N"] == 32 and splits[-1][1]["BLOCK_M"] == 16
        ref, _ = reference.kvcache_attention(q, k, v, lens, table, causal=True)
        assert (out.double() - ref).abs().max().item() < 5e-3


def test_specs_with_the_gluon_decode_tune_which_kernel_runs(monkeypatch):
    """A paged spec with the Gluon decode kernel searches `warp_specialized`. Where the Gluon kernel does not
    run (here), 1 is the Triton kernel and collapses into 0. Where it runs, its candidates are one per split
    count (fixed tiles; the Triton keys at the default's), and a bucket won by it stores 1, which reaches
    forward_kvcache for that bucket only (elsewhere the default: the Gluon kernel where it runs)."""
    kernel = attngen.load(kvcache_spec("fp16", 64, True, 16))  # head dims 64 and 128 have the Gluon kernel
    part = tuning.tunable(kernel.part("kvcache"))
    assert part.tuning_space()["warp_specialized"] == (0, 1)
    assert part.tuning_default()["warp_specialized"] == int(part.part.gluon_runs_here())
    assert "warp_specialized" not in decode_kernel().part("kvcache").tuning_space()  # head dim 32: no Gluon kernel
    values = dict(DECODE, block_n=(16, 32), num_splits=(0, 2))
    shape = Shape(2, 4, 2, 1, 64)
    if not part.part.gluon_runs_here():
        outcome = tune(part, [shape], values=values, budget=10)
        assert sorted((t.config["BLOCK_N"], t.config["num_splits"], t.config["warp_specialized"])
                      for t in outcome.trials) == [(16, 0, 0), (16, 2, 0), (32, 0, 0), (32, 2, 0)]
        assert "run as another candidate does: 4 of 8" in format_outcome(outcome)

    monkeypatch.setattr(part.part, "gluon_runs_here", lambda: True)  # as on an sm_90 GPU
    default = part.tuning_default()
    assert default["warp_specialized"] == 1
    seen, timer = order(lambda config: config["warp_specialized"] and config["num_splits"] == 2)
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    asked, real = [], kernel.module.forward_kvcache
    monkeypatch.setattr(kernel.module, "forward_kvcache", lambda *a: asked.append(a[9]["warp_specialized"]) or real(*a))
    outcome = tune(part, [shape], values=values, timer=timer, budget=10)
    gluon = [t.config for t in outcome.trials if t.config["warp_specialized"]]
    assert len(outcome.trials) == 4 + 2 and sorted(c["num_splits"] for c in gluon) == [0, 2]
    assert "run as another candidate does: 2 of 8" in format_outcome(outcome)
    assert "pruned before compiling: 0 of 8" in format_outcome(outcome)
    assert all(c[k] == default[k] for c in gluon for k in ("BLOCK_N", "num_warps", "num_stages"))
    assert set(asked) == {False, True}  # each candidate asks for its kernel (here the Triton one runs both)
    winner = outcome.best[0].trial.config
    assert winner["warp_specialized"] == 1 and winner["num_splits"] == 2
    save(outcome)
    monkeypatch.undo()

    configs = []
    real = kernel.module.forward_kvcache
    monkeypatch.setattr(kernel.module, "forward_kvcache", lambda *a: configs.append(dict(a[9])) or real(*a))
    for batch in (2, 8):  # the tuned bucket; another, served by the nearest bucket's tiles only
        q = rand(batch, 1, 4, 64)
        k, v = rand(batch * 4 + 3, 16, 2, 64), rand(batch * 4 + 3, 16, 2, 64)
        table = torch.randperm(batch * 4 + 3, dtype=torch.int32, device=DEVICE)[: batch * 4].view(batch, 4)
        lens = torch.randint(1, 65, (batch,), dtype=torch.int32, device=DEVICE)
        out = attngen.attention_with_kvcache(q, k, v, lens, table, causal=True)
        ref, _ = reference.kvcache_attention(q, k, v, lens, table, causal=True)
        assert (out.double() - ref).abs().max().item() < 5e-3
    assert configs[0]["warp_specialized"] == 1 and "warp_specialized" not in configs[1]


def test_a_contiguous_cache_entry_from_before_its_gluon_kernel_runs_the_triton_kernel(monkeypatch):
    """Contiguous caches gained the Gluon decode kernel after tables were tuned for them: a stored entry
    without `warp_specialized` was measured on the Triton kernel and asks for it (0); an entry with the key
    keeps it; a call served by another bucket's entry takes the default (no key: the Gluon kernel where it
    runs)."""
    from attngen.runtime.tables import entry_problem

    part = attngen.load(kvcache_spec("fp16", 64, True, None)).part("kvcache")
    assert part.has_gluon() and part.tuning_space()["warp_specialized"] == (0, 1)
    old = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "num_splits": 2}  # an entry from before the key
    for config, problem in ((old, None), (dict(old, warp_specialized=1), None),
                            ({k: v for k, v in old.items() if k != "BLOCK_N"}, "must set exactly"),
                            (dict(old, colour=1), "must set exactly")):
        found = entry_problem(part, "BH=8 N_Q=1 N_K=64", {"config": config})
        assert (found is None) if problem is None else problem in found, (config, found)
    for stored, exact, expected in (({}, True, 0), ({"warp_specialized": 1}, True, 1), ({}, False, None),
                                    ({"warp_specialized": 0}, False, None)):
        entry = dict(stored, BLOCK_N=32, num_warps=4, num_stages=2, num_splits=2)
        monkeypatch.setattr(store, "launch_choice", lambda *a, entry=entry, exact=exact: (dict(entry), exact))
        part._configs.clear()
        config = part.config(Shape(2, 4, 2, 1, 64), None)
        assert config.get("warp_specialized") == expected, (stored, exact, config)
        assert config["num_splits"] == (2 if exact else 0) and config["BLOCK_N"] == 32


def test_decode_candidates_are_also_timed_at_capacity_and_the_least_worst_wins(monkeypatch):
    """Each decode candidate runs on the spread lengths and again with every sequence at capacity, is
    checked on both, and the bucket keeps the config whose worst ratio to the fastest on either is least:
    not the fastest on the spread lengths when it is far behind at capacity. A candidate wrong only at
    capacity is rejected."""
    part = tuning.tunable(decode_kernel().part("kvcache"))
    shape = Shape(2, 4, 2, 1, 96)
    real = part.tuning_run
    runs = []
    at_capacity = {}  # lens tensor -> whether it is the at-capacity input; read outside graph capture

    def run(inputs, config, poison=False):
        lens = inputs["lens"]
        if lens.data_ptr() not in at_capacity:  # each input's first run is eager (the validation run)
            at_capacity[lens.data_ptr()] = bool((lens == shape.n_k).all())
        full = at_capacity[lens.data_ptr()]
        runs.append((config["num_splits"], full))
        out, lse = real(inputs, config, poison=poison)
        if full and config["num_splits"] == 3:
            out[1] *= 1.01  # wrong at capacity only
        return out, lse

    # (spread, at capacity) medians: 1 split is fastest on spread lengths but 30% behind at capacity
    times = {0: (1.2, 1.2), 1: (1.0, 1.3), 2: (1.05, 1.0), 3: (0.5, 0.5)}

    def timer(fn, rep_ms, cuda):
        fn()
        splits, full = runs[-1]
        return times[splits][full]

    monkeypatch.setattr(part, "tuning_run", run)
    outcome = tune(part, [shape], values=dict(DECODE, num_splits=(0, 1, 2, 3)), timer=timer)
    assert {(s, f) for s, f in runs} == {(s, f) for s in (0, 1, 2, 3) for f in (False, True)}
    (rejected,) = [t for t in outcome.trials if t.status == "rejected"]
    assert rejected.config["num_splits"] == 3
    (best,) = outcome.best
    assert best.trial.config["num_splits"] == 2 and best.ms == 1.05
    assert best.also == {"at capacity": (1.0, 1.0)}
    report = format_outcome(outcome)
    assert "also timed at capacity" in report and "1.0000 (1.00)" in report
    ((_, entry),) = outcome.records()
    assert entry["also"] == {"at capacity": {"ms": 1.0, "best_ms": 1.0}} and entry["ms"] == 1.05
    save(outcome)  # a stored entry with the extra timings serves calls
    assert part.part.config(shape, 0)["num_splits"] == 2


def test_the_fastest_decode_config_at_capacity_serves_calls_of_equal_lengths(monkeypatch):
    """Where the fastest config with every sequence at capacity is another than the bucket's least-worst
    best, the entry keeps it as `uniform` (after a runoff of its own that leaves the best's times alone),
    the report says so, and calls that give cache_seqlens as an int take it; lengths given as a tensor
    keep the best. Both are right against float64."""
    kernel = decode_kernel()
    part = tuning.tunable(kernel.part("kvcache"))
    shape = Shape(2, 4, 2, 1, 96)
    real = part.tuning_run
    runs, at_capacity = [], {}

    def run(inputs, config, poison=False):
        lens = inputs["lens"]
        if lens.data_ptr() not in at_capacity:
            at_capacity[lens.data_ptr()] = bool((lens == shape.n_k).all())
        runs.append((config["num_splits"], at_capacity[lens.data_ptr()]))
        return real(inputs, config, poison=poison)

    # (spread, at capacity): 2 splits are the least worst (1.05, 1.11); 1 split is fastest at capacity
    times = {0: (1.0, 1.3), 1: (1.2, 0.9), 2: (1.05, 1.0)}
    timed = []

    def timer(fn, rep_ms, cuda):
        fn()
        timed.append(runs[-1])
        return times[runs[-1][0]][runs[-1][1]]

    monkeypatch.setattr(part, "tuning_run", run)
    outcome = tune(part, [shape], values=dict(DECODE, num_splits=(0, 1, 2)), timer=timer, runoff=2)
    (best,) = outcome.best
    assert best.trial.config["num_splits"] == 2 and best.ms == 1.05 and best.also == {"at capacity": (1.0, 0.9)}
    trial, ms, name = best.uniform
    assert trial.config["num_splits"] == 1 and ms == 0.9 and name == "at capacity" and trial is not best.trial
    assert timed.count((1, True)) == 1 + 3 + 3  # timed, then in the runoff of the best and in its own
    report = format_outcome(outcome)
    assert "kept for calls whose sequences all have one length: BLOCK_N=32 num_warps=4 num_stages=1 num_splits=1, " \
        "0.9000 ms at capacity (1.11x the best config's speed)" in report
    ((_, entry),) = outcome.records()
    assert entry["config"]["num_splits"] == 2 and entry["uniform"] == {"config": trial.config, "ms": 0.9}
    save(outcome)
    monkeypatch.undo()
    assert part.part.config(shape, 0)["num_splits"] == 2 and part.part.config(shape, 0, uniform=True)["num_splits"] == 1

    splits = []
    real_launch = kernel.module.forward_kvcache
    monkeypatch.setattr(kernel.module, "forward_kvcache", lambda *a: splits.append((a[8], a[3])) or real_launch(*a))
    q, k, v = rand(2, 1, 4, 32), rand(2, 96, 2, 32), rand(2, 96, 2, 32)
    for lens, expected in ((torch.tensor([96, 40], dtype=torch.int32, device=DEVICE), 2), (77, 1), (77, 1)):
        out = attngen.attention_with_kvcache(q, k, v, lens, causal=True)
        assert splits[-1][0] == expected
        full = lens if torch.is_tensor(lens) else torch.full((2,), lens, dtype=torch.int32, device=DEVICE)
        ref, _ = reference.kvcache_attention(q, k, v, full, None, causal=True)
        assert (out.double() - ref).abs().max().item() < 5e-3
    assert splits[-1][1] is splits[-2][1]  # an int's lengths tensor is made once (no fill kernel per call)


@pytest.mark.parametrize("at_capacity", [0.8, 0.99])
def test_a_config_at_capacity_within_the_noise_is_not_kept_and_a_bad_uniform_config_is_ignored(monkeypatch,
                                                                                              at_capacity):
    """The fastest config at capacity is kept for equal lengths only where it differs from the bucket's best
    and is UNIFORM_GAIN (2%) faster there; a stored one that cannot run is ignored with a warning."""
    part = tuning.tunable(decode_kernel().part("kvcache"))
    shape = Shape(2, 4, 2, 1, 96)
    seen, runs = [], []
    monkeypatch.setattr(part, "tuning_run", spy(part, seen))
    # 0 splits: the best (1.0 on both inputs); 1 split: far behind on spread lengths, ahead at capacity (the
    # capacity input is each candidate's second run: its lengths are all the bucket's capacity)
    times = {0: (1.0, 1.0), 1: (1.5, at_capacity)}

    def timer(fn, rep_ms, cuda):
        fn()
        runs.append(seen[-1]["num_splits"])
        return times[runs[-1]][len([r for r in runs if r == runs[-1]]) % 2 == 0]

    outcome = tune(part, [shape], values=dict(DECODE, num_splits=(0, 1)), timer=timer)
    (best,) = outcome.best
    assert best.trial.config["num_splits"] == 0 and best.uniform[0].config["num_splits"] == 1
    ((bucket, entry),) = outcome.records()
    kept = at_capacity == 0.8
    assert ("uniform" in entry) == kept and ("all have one length" in format_outcome(outcome)) == kept

    problem = part.tuning_problem()
    one = dict(entry["config"], num_splits=1, BLOCK_N=16)
    bad = dict(entry, uniform={"config": dict(one, BLOCK_N=0)})
    store.remember(Device.current(), problem, part.spec.name, [(bucket, bad)])
    with pytest.warns(store.CacheWarning, match=r"\(uniform\)' in this process: its config values must be positive"):
        assert part.part.config(shape, 0, uniform=True)["num_splits"] == 0  # the entry's own config serves
    store.remember(Device.current(), problem, part.spec.name, [(bucket, dict(entry, uniform={"config": one}))])
    assert part.part.config(shape, 0, uniform=True) == dict(one, BLOCK_M=16) and part.part.config(shape, 0)["num_splits"] == 0
    other = Shape(8, 4, 2, 1, 96)  # another bucket: served by the nearest bucket's tiles, never its uniform config
    assert part.part.config(other, 0, uniform=True) == dict(entry["config"], BLOCK_M=16)


def test_a_decode_candidate_with_a_wrong_result_is_rejected(monkeypatch):
    part = tuning.tunable(decode_kernel(16).part("kvcache"))
    real = part.tuning_run

    def run(inputs, config, poison=False):
        out, lse = real(inputs, config, poison=poison)
        if config["num_splits"] == 2:
            out[1] *= 1.01  # the second sequence is off: the check looks past the first
        return out, lse

    monkeypatch.setattr(part, "tuning_run", run)
    outcome = tune(part, [Shape(2, 4, 2, 1, 64)], values=dict(DECODE, num_splits=(0, 2)))
    (rejected,) = [t for t in outcome.trials if t.status == "rejected"]
    assert rejected.config["num_splits"] == 2 and outcome.best[0].trial.config["num_splits"] == 0


def test_a_stored_split_count_must_be_one_the_kernel_takes():
    part = decode_kernel().part("kvcache")
    good = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "num_splits": 0}
    assert store.entry_problem(part, "BH=8 N_Q=1 N_K=64", {"config": good}) is None
    assert "positive whole numbers" in store.entry_problem(part, "BH=8 N_Q=1 N_K=64", {"config": dict(good, BLOCK_N=0)})
    assert "positive whole numbers" in store.entry_problem(part, "BH=8 N_Q=1 N_K=64", {"config": dict(good, num_splits=-1)})


# -- the command line ----------------------------------------------------------------------------


def test_tune_kind_picks_the_kernels_and_refuses_one_the_spec_lacks(tmp_path, capsys):
    path = tmp_path / "both.attn"
    path.write_text(spec_text("both", 32, "fp16", "causal", direction="forward+backward"))
    assert main(["tune", str(path), "--kind", "backward", "--seqlens", "40:72", "--values", "block_m=32,64",
                 "block_n=32", "num_warps=4", "num_stages=1"]) == 0
    out = capsys.readouterr().out
    assert "both backward attn_bwd_dq on" in out and "both backward attn_bwd_dkdv on" in out
    assert "both on" not in out  # the forward was not asked for
    data = json.loads(store.user_path(Device.current()).read_text())
    assert sorted(p["problem"].split(";")[0] for p in data["problems"].values()) == [
        "kind = backward attn_bwd_dkdv", "kind = backward attn_bwd_dq"]

    assert main(["tune", str(path), "--kind", "decode"]) == 2
    assert "kernel 'both' has only backward, forward" in capsys.readouterr().err


def test_the_shipped_decode_specs_are_the_problems_attention_with_kvcache_solves():
    """So the tables tuned for specs/decode_*.attn serve attngen.attention_with_kvcache()."""
    for name, page_size in (("decode_d128", None), ("decode_paged16_d128", 16)):
        spec = load_file(os.path.join(SPECS, f"{name}.attn"))
        assert (attngen.load(spec).part("kvcache").tuning_problem()
                == attngen.load(kvcache_spec("bf16", 128, True, page_size)).part("kvcache").tuning_problem())


def test_kvcache_config_is_memoised_and_follows_new_tuning_records():
    """The per-call config lookup of the KV-cache kernels is memoised (a decoding step should cost
    dictionary lookups), and a tuning result recorded afterwards still takes effect at once."""
    from attngen.runtime.keys import bucket

    kernel = attngen.load(kvcache_spec("fp16", 32, True, None))
    tuner = kernel.part("kvcache")
    shape = Shape(1, 4, 2, 1, 256)
    first = tuner.config(shape)
    assert tuner.config(shape) == first and len(tuner._configs) >= 1
    first["BLOCK_N"] = -1  # callers get a copy: mutating it leaves the memo alone
    assert tuner.config(shape)["BLOCK_N"] != -1
    wanted = dict(tuner.tuning_default(), BLOCK_N=32 if tuner.config(shape)["BLOCK_N"] != 32 else 64, num_splits=3)
    store.remember(Device.current(None), tuner.tuning_problem(), kernel.spec.name,
                   [(bucket(shape), {"config": wanted})])
    now = tuner.config(shape)
    assert now["BLOCK_N"] == wanted["BLOCK_N"] and now["num_splits"] == 3


@pytest.mark.parametrize("path", [p for p in shipped_specs() if os.path.basename(p).startswith(("decode", "mla"))])
def test_a_decode_parts_gluon_answers_come_from_its_module_not_its_program(path):
    """KVCachePart's has_gluon and rounds_q agree with the program's warp-specialised kernels, and answer (with the
    tuning space and default the first call's table lookup asks for) without rebuilding the program that a module
    from the disk cache does not carry (1.2 s of a cached process's first decode call on the H200, NOTES v57)."""
    kernel = attngen.load(path)
    ws = kernel.program.warp_specialized
    kernel._program = None  # (as loaded from the disk cache)
    part = kernel.part("kvcache")
    assert part.has_gluon() == (ws.decode is not None or ws.mla is not None)
    shape = getattr(kernel.module, "WSD_SHAPE", None)
    assert (shape or {}).get("Q_E4M3", 0) == (ws.decode.q_e4m3 if ws.decode is not None else 0)
    assert part.rounds_q() == 0  # (no sm_90 GPU runs it here)
    part.tuning_space(), part.tuning_default()
    assert kernel._program is None


def test_a_cached_kernels_calls_leave_its_program_unbuilt():
    """Training through `attention`, a varlen training call and a paged decode call on kernels whose program is not
    held (a module from the disk cache has none), with the tables forgotten so that every config lookup runs again:
    none rebuilds the program (compile_program's sympy took seconds of a first call, NOTES v33 and v57)."""
    from attngen.runtime import tables
    from attngen.runtime.registry import resolve
    from attngen.lang.builtin import sdpa_key, varlen_key

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    attngen.attention(q, k, v, is_causal=True).sum().backward()
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    qv, kv, vv = (t[0].detach().transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
    attngen.flash_attn_varlen_func(qv, kv, vv, cu, cu, 19, 19, causal=True).sum().backward()
    cache = torch.randn(4, 16, 2, 16)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    qd = torch.randn(2, 1, 2, 16)
    attngen.attention_with_kvcache(qd, cache, cache, lens, block_table=table)
    kernels = [resolve(sdpa_key("fp32", 16, True)), resolve(varlen_key("fp32", 16, True)),
               attngen.load(kvcache_spec("fp32", 16, True, 16))]
    for kernel in kernels:
        kernel._program = None
    tables.forget()
    try:
        attngen.attention(q, k, v, is_causal=True).sum().backward()
        attngen.flash_attn_varlen_func(qv, kv, vv, cu, cu, 19, 19, causal=True).sum().backward()
        attngen.attention_with_kvcache(qd, cache, cache, lens, block_table=table)
        assert [kernel._program for kernel in kernels] == [None] * 3
    finally:
        tables.forget()
