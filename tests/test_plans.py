"""The one plan cache (attngen/runtime/plans.py): `attngen.attention`, `attention_with_kvcache` and
`Kernel.__call__` keep their plans in `PLANS`, each signature under its own call path, and the cache starts
over when it is full."""

from __future__ import annotations

import torch

import attngen
from attngen.lang.builtin import sdpa_spec
from attngen.runtime.plans import CAPACITY, PLANS
from conftest import DEVICE, empty_plans


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float16)


def test_the_three_call_paths_share_one_cache_without_taking_each_others_plans(monkeypatch):
    """The same tensors through `attngen.attention`, through the kernel it loads, and through a copy of that kernel
    loaded with its own autotune setting are three plans in the one cache (a copy's plans hold its own key);
    a KV-cache call is a fourth; repeating every call adds none."""
    kept = empty_plans(monkeypatch)
    assert kept is PLANS
    kernel = attngen.load(sdpa_spec("fp16", 32, False))
    untuned = attngen.load(sdpa_spec("fp16", 32, False), autotune=False)
    assert untuned is not kernel and untuned.key != kernel.key
    q, k, v = rand(1, 2, 20, 32), rand(1, 2, 24, 32), rand(1, 2, 24, 32)
    step, cache_k, cache_v = rand(1, 1, 2, 32), rand(1, 24, 2, 32), rand(1, 24, 2, 32)
    for _ in range(2):
        want = attngen.attention(q, k, v)
        assert torch.equal(kernel(q, k, v), want) and torch.equal(untuned(q, k, v), want)
        attngen.attention_with_kvcache(step, cache_k, cache_v, 24)
    assert len(PLANS) == 4
    by_path = {"sdpa": PLANS.plans("sdpa"), "kernel": PLANS.plans(kernel), "untuned": PLANS.plans(untuned),
               "kvcache": PLANS.plans("kvcache")}
    assert all(len(plans) == 1 for plans in by_path.values()), by_path
    assert by_path["kernel"][0].key == kernel.key and by_path["untuned"][0].key == untuned.key
    assert by_path["sdpa"][0].key == "sdpa:fp16:32:full" and by_path["kvcache"][0].capacity == 24


def test_the_cache_starts_over_when_full(monkeypatch):
    """`keep` adds until the cache holds CAPACITY signatures, then empties it before adding; `replace` changes a
    kept plan without emptying; a call with a new signature keeps its plan through the same `keep`."""
    empty_plans(monkeypatch)
    for i in range(CAPACITY - 1):
        PLANS.keep(("test", i), i)
    q = rand(1, 2, 9, 32)
    attngen.attention(q, q, q)  # the cache's last free place
    assert len(PLANS) == CAPACITY and PLANS.get(("test", 0)) == 0 and len(PLANS.plans("sdpa")) == 1
    PLANS.replace(("test", 0), "replaced")
    assert len(PLANS) == CAPACITY and PLANS.get(("test", 0)) == "replaced"
    attngen.attention(q, q, q)  # planned: nothing added
    assert len(PLANS) == CAPACITY
    attngen.attention(q, q, q, is_causal=True)  # a new signature: the full cache starts over
    assert len(PLANS) == 1 and PLANS.get(("test", 0)) is None and len(PLANS.plans("sdpa")) == 1
    PLANS.clear()
    assert len(PLANS) == 0 and PLANS.plans("sdpa") == []


def test_setting_a_policy_switch_makes_every_call_path_plan_afresh(monkeypatch):
    """A plan replays launches of the modules generated under the policy switches' values when it was made; setting a
    switch (an experiment's assignment, a test's monkeypatch) changes every call path's signature, so the next call of
    each is checked and launched afresh, by a module generated under the new values. Without the switch generation in
    the signatures the three calls after the assignment would find the plans kept before it."""
    from attngen.policy import hopper

    empty_plans(monkeypatch)
    kernel = attngen.load(sdpa_spec("fp16", 32, False))
    q = rand(1, 2, 20, 32)
    step, cache_k, cache_v = rand(1, 1, 2, 32), rand(1, 24, 2, 32), rand(1, 24, 2, 32)

    def calls():
        attngen.attention(q, q, q)
        kernel(q, q, q)
        attngen.attention_with_kvcache(step, cache_k, cache_v, 24)

    calls()
    assert len(PLANS) == 3
    calls()
    assert len(PLANS) == 3  # planned
    monkeypatch.setattr(hopper, "LINEAR_DISTANCE", not hopper.LINEAR_DISTANCE)
    calls()
    assert len(PLANS) == 6  # three new signatures
    monkeypatch.setattr(hopper, "MIN_SCORES", hopper.MIN_SCORES)  # (not a switch: nothing changes)
    calls()
    assert len(PLANS) == 6
