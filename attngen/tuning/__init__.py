"""Autotuning: a correctness-gated search per GPU, a persistent cache, shipped tables, run-time lookup.

    attngen tune specs/fwd_causal_d64.attn --seqlens 1024 4096     # search, print, write the cache
    kernel = attngen.load(spec)          # calls use the tuned config for their shape bucket
    kernel = attngen.load(spec, autotune=True)   # ... and tune a bucket nobody tuned, on first use

The modules: `key` (device, problem identity, shape buckets), `space` (candidates, pruning by the
resource model, the budget), `search` (compile, validate, time), `store` (the JSON files and the
lookup), `report` (progress bar and table); and the kernel kinds beyond the forward: `backward`
(the dQ and dK/dV kernels of a forward+backward spec, one at a time) and `decoding` (the
`forward_kvcache` entry of a split-KV or paged spec, with its split count).

## The protocol a kernel object provides

The tuner knows nothing about attention: it drives any kernel object with these methods, so every
kind the generator emits (forward, backward, split-KV decode, paged) is tuned the same way. The
forward `Kernel` in attngen/runtime.py implements them, and `Kernel.tuning_kernels()` lists the
objects for each launch of a spec: itself, `backward.BackwardPart` x 2, or
`decoding.KVCacheKernel` (`Kernel.tuner(part)` gives one, the same object on every call).

    spec
        The kernel's spec (its name labels entries; its fixed tile keys are checked).
    kind, label
        "forward", "backward" or "decode" (`attngen tune --kind`), and the name reports use.
    tuning_problem() -> str
        What the kernel computes, as text: its entries are stored under the hash. Build it with
        `key.problem_text(spec, kind, ignore)`: the kind ("forward"; e.g. "backward" for the
        backward kernels of a forward+backward spec) and the spec's canonical keys, less those that
        do not change this kernel (the forward ignores `direction`).

    tuning_space() -> dict[str, tuple[int, ...]]
        Every launch-config key with the values to try: the keys the spec leaves `auto` get the
        candidates (attngen/configs.py SEARCH_SPACE), fixed keys a single value. A backward kernel
        has its own keys (e.g. BLOCK_M_DQ); a split-KV decode kernel adds its split count.
    tuning_default() -> dict
        The config used when nothing is tuned (the heuristic, with the spec's fixed values).
    tuning_infeasible(config, target) -> str | None
        Why `config` cannot run on `target` (attngen.resources.Target), from the resource model,
        with the numbers; None if it fits. Called before anything compiles.
    tuning_inputs(shape, device, generator) -> inputs
        Fresh random inputs for a `key.Shape` (and output buffers), on `device`, drawn from
        `generator`. Decode kernels add cache_seqlens and a block table of realistic lengths.
    tuning_run(inputs, config, *, poison=False) -> outputs
        Launch with `config`, writing into the buffers of `inputs`; with `poison`, fill the outputs
        with NaN first so unwritten elements show. Must not consult the tuned tables.
    tuning_check(inputs, outputs) -> attngen.check.Result
        Validation against the float64 reference (attngen/check.py) with bounded memory: at large
        shapes check a slice (some batch entries, heads, query rows), as `validate.check_attention`.
    tuning_flops(shape) -> float
        FLOPs of one call by the FlashAttention convention, for the TFLOP/s column.
    tuning_bytes(shape) -> float | None   (optional)
        Bytes one call must read, for a memory-bound kernel (decoding): reports show GB/s.
    tuning_graph: bool   (optional)
        True: time CUDA-graph replays of `tuning_run` (a kernel shorter than its Python launch).
    tuning_canonical(config) -> dict   (optional)
        The config as it runs: candidates with one canonical form are tried once (a decode kernel's
        Gluon candidates, whose tiles are fixed, differ by split count only).
    tuning_optional: tuple   (optional)
        Keys of the space a stored entry may lack (store.entry_problem): added to the space after
        entries were tuned, which the kernel's config lookup then fills with what those entries ran.

At run time, the kernel's launch path calls `launch_config(kernel, shape, device_index)` (or
`launch_choice`, which also says whether the entry was tuned for this very bucket); a kind whose
inputs are not (q, k) builds its `Shape` from its own tensors' sizes (a decode kernel: the KV
cache's capacity, not the device-side cache_seqlens), never from device data.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

from ..cache import CacheWarning
from ..runtime import interpreting
from . import store
from .key import Device, Shape, bucket, problem_key
from .search import Outcome, tune
from .space import TuneError

__all__ = ["Device", "Outcome", "Shape", "TuneError", "launch_choice", "launch_config", "save", "tune"]


def save(outcome: Outcome, path=None) -> str | None:
    """Record a search's best configs: in this process, and in the file at `path` (default: the
    user's cache for the device). Returns the path written, or None (with a warning) if it could
    not be written; the results then serve this process only."""
    records = outcome.records()
    if not records:
        return None
    store.remember(outcome.device, outcome.problem, outcome.spec.name, records)
    if path is None:
        path = store.user_path(outcome.device)
    try:
        store.save(path, outcome.device, outcome.problem, outcome.spec.name, records)
    except OSError as e:
        warnings.warn(f"attngen: cannot write tuning results to {path} ({e.strerror or e}); "
                      "they serve this process only", CacheWarning, stacklevel=2)
        return None
    return str(path)


def autotune_enabled(kernel) -> bool:
    """The kernel's own flag (`load(..., autotune=True)`), else the ATTNGEN_AUTOTUNE variable."""
    flag = getattr(kernel, "autotune", None)
    if flag is not None:
        return bool(flag)
    return os.environ.get("ATTNGEN_AUTOTUNE", "0").lower() not in ("", "0", "false", "no", "off")


_TUNING = threading.Lock()
_ATTEMPTED: set = set()


def launch_config(kernel, shape: Shape, device_index: int | None = None) -> dict:
    """The config for one call: tuned for this device and shape bucket if anyone tuned it, else
    the nearest tuned bucket, else the default. No tuning happens here unless autotuning is on and
    this bucket has no entry of its own; then it is tuned once per process, on random inputs of
    the call's shape, and saved to the user's cache."""
    return launch_choice(kernel, shape, device_index)[0]


def launch_choice(kernel, shape: Shape, device_index: int | None = None, uniform: bool = False) -> tuple[dict, bool]:
    """`launch_config`, and whether the config was tuned for this very bucket (not the nearest one
    or the default): keys that only suit the shapes they were measured at need to know. `uniform`:
    the call's sequences all have one length, and the bucket's entry may hold a config for that."""
    # NOTE: this runs on every call; the memo makes it a handful of dictionary operations. (The
    # kernel objects are per mode, interpreted or compiled: runtime.load keys them by it.)
    memo_key = (store.generation(), device_index, kernel, shape.batch * shape.heads, shape.n_q, shape.n_k)
    found = _MEMO.get(memo_key)
    if found is None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        found = _MEMO[memo_key] = _launch_config(kernel, shape, device_index)
    return dict(found.uniform if uniform and found.uniform else found.config), found.exact


_MEMO: dict = {}


def _launch_config(kernel, shape: Shape, device_index: int | None) -> dict:
    device = Device.current(device_index)
    key = (problem_key(kernel.tuning_problem()), bucket(shape))
    found = store.tables(device).find(kernel, *key)
    if found.exact or not autotune_enabled(kernel) or all(len(v) == 1 for v in kernel.tuning_space().values()):
        return found
    if not interpreting() and torch.cuda.is_current_stream_capturing():
        return found  # tuning would break the CUDA graph being captured
    with _TUNING:
        if (device, key) not in _ATTEMPTED:
            _ATTEMPTED.add((device, key))
            with torch.cuda.device(device_index) if device_index is not None else contextlib.nullcontext():
                outcome = tune(kernel, [shape])
            if outcome.ok:
                save(outcome)
            else:
                warnings.warn(f"attngen: autotuning {kernel.spec.name} at {shape} found no config that passed "
                              f"validation; using {found.source}", CacheWarning, stacklevel=3)
    return store.tables(device).find(kernel, *key)


def describe_config(kernel, shape: Shape, device_index: int | None = None) -> tuple[dict, str]:
    """(config, where it came from) for a call of this shape, without autotuning."""
    problem = problem_key(kernel.tuning_problem())
    found = store.tables(Device.current(device_index)).find(kernel, problem, bucket(shape))
    return dict(found.config), found.source
