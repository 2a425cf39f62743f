"""Shared test setup.

Without a CUDA GPU, kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before
anything imports triton) at small shapes; tests marked `gpu` run the same checks at real shapes and
are skipped. Every test session gets its own attngen cache directory.
"""

from __future__ import annotations

import os
import tempfile

import torch

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("ATTNGEN_CACHE_DIR", tempfile.mkdtemp(prefix="attngen-test-cache-"))

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_GPU else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = os.path.join(ROOT, "specs")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def spec_text(name="t", head_dim=64, dtype="fp16", mask="none", **extra) -> str:
    """Spec text with the given keys (values written as in a .attn file)."""
    lines = [f"kernel {name} {{", f"    head_dim = {head_dim}", f"    dtype = {dtype}", f"    mask = {mask}"]
    lines += [f"    {k} = {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n}\n"


def shipped_specs() -> list[str]:
    return sorted(os.path.join(SPECS, f) for f in os.listdir(SPECS) if f.endswith(".attn"))


@pytest.fixture
def device():
    return DEVICE


def empty_plans(monkeypatch):
    """The one plan cache of the three call paths (attngen/runtime/plans.py `PLANS`), emptied until `monkeypatch`
    is undone: calls meanwhile are their signatures' first (checked afresh, nothing replayed), and the plans kept
    before are back afterwards (a GPU test compares a replayed call with the unplanned path of the same
    signature inside `monkeypatch.context()`)."""
    from attngen.runtime.plans import PLANS  # (after TRITON_INTERPRET is set above)

    table = {}
    # `get` is the table's own bound lookup (the hot path's): it moves with the table
    monkeypatch.setattr(PLANS, "_table", table)
    monkeypatch.setattr(PLANS, "get", table.get)
    return PLANS


def record_split_launches(monkeypatch, gluon: str, ready, caches: int) -> tuple[list, list]:
    """attngen.attention_with_kvcache's modules, loaded as usual but with their Gluon kernel's readiness check
    (`wsm_ready` or `wsd_ready`, per `gluon`) replaced by `ready` and every partial launch recording
    (kind, the split count) instead of running (`caches`: both launchers' cache arguments before o_part): for the
    tests of the split count a call takes where the Gluon kernel runs, which the interpreter has not (they also fake
    KVCachePart.gluon_runs_here). Returns (modules loaded, launches)."""
    from attngen.api import kvcache
    from attngen.runtime.parts import KVCachePart

    modules, counts = [], []
    real_load = kvcache.load

    def loaded(spec):  # the API's kernel, its launches recording the split count instead of running
        kernel = real_load(spec)
        kernel.part("kvcache")._configs.clear()  # (configs memoised by earlier tests without the fake)
        module = kernel.module
        modules.append(module)
        monkeypatch.setattr(module, f"{gluon}_ready", ready)
        monkeypatch.setattr(module, f"launch_attn_fwd_{gluon}",
                            lambda q, *a: counts.append((gluon, a[caches].shape[1])))
        monkeypatch.setattr(module, "launch_attn_fwd",
                            lambda q, *a, **kw: counts.append(("triton", a[caches].shape[1])))
        monkeypatch.setattr(module, "launch_attn_combine", lambda *args, **kwargs: None)
        return kernel

    monkeypatch.setattr(kvcache, "load", loaded)
    return modules, counts

