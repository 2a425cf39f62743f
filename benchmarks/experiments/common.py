"""Helpers the experiment scripts share: variant modules built from generated source, and a short
CUDA-graph timing for sweeps of hundreds of candidates."""

from __future__ import annotations

import importlib.util
import os


def load(path: str, name: str):
    """Import the Python file at `path` as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_variants(source: str, variants: dict, tag: str) -> dict:
    """{name: module} for each variant: its rewrite steps applied in order to `source`, written
    under /tmp/<tag>/ and imported."""
    os.makedirs(f"/tmp/{tag}", exist_ok=True)
    modules = {}
    for name, steps in variants.items():
        text = source
        for step in steps:
            text = step(text)
        path = f"/tmp/{tag}/{tag}_{name}.py"
        with open(path, "w") as f:
            f.write(text)
        modules[name] = load(path, f"{tag}_{name}")
    return modules


def quick_graph(fn) -> float:
    """fn captured in a CUDA graph; median ms of its replays (do_bench, 25 ms: a sweep measurement)."""
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")


def error_text(e: Exception, width: int = 160) -> str:
    """A failed variant's row entry: the exception's type and the last line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[-1][:width] if msg else ''}"


def rel_err(got, want) -> float:
    """Relative Frobenius error of `got` against `want`, in float32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()
