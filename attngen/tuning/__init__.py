"""Autotuning: a correctness-gated search per GPU, a persistent cache, shipped tables, run-time lookup.

    attngen tune specs/fwd_causal_d64.attn --seqlens 1024 4096     # search, print, write the cache
    kernel = attngen.load(spec)          # calls use the tuned config for their shape bucket
    kernel = attngen.load(spec, autotune=True)   # ... and tune a bucket nobody tuned, on first use

The modules: `space` (candidates, pruning by the resource model, the budget), `search` (compile,
validate, time), `gate` (the accuracy check of a forward candidate), `report` (progress bar and table),
and what the tuner drives: `tunables` (the protocol's base and the forward kernel), `backward` (the dQ and
dK/dV kernels of a forward+backward spec, one at a time), `decoding` (the `forward_kvcache` entry of a
split-KV or paged spec, with its split count), `varlen` (a varlen spec's forward and backward kernels, on
packed batches), `adapt` (which of them a launch part gets). The tables the
results go to and the run-time lookup over them are the runtime's (attngen/runtime/tables.py, keys.py).

## The protocol a kernel object provides

The tuner knows nothing about attention: it drives any kernel object with these methods, so every
kind the generator emits (forward, backward, split-KV decode, paged) is tuned the same way. A loaded
`Kernel` and its parts (`Kernel.part(name)`, attngen/runtime/parts.py) provide the config lookup's
methods (`tuning_problem`, `tuning_space`, `tuning_default`, `tuning_infeasible`, `tuning_optional`); the
`Tunable` of each (`tunable(part)`, the same object on every call; `tunables(kernel)` lists a kernel's)
adds the rest.

    spec
        The kernel's spec (its name labels entries; its fixed tile keys are checked).
    kind, label
        "forward", "backward" or "decode" (`attngen tune --kind`), and the name reports use.
    tuning_problem() -> str
        What the kernel computes, as text: its entries are stored under the hash. Build it with
        `keys.problem_text(spec, kind, ignore)` (attngen/runtime/keys.py): the kind ("forward"; e.g.
        "backward" for the backward kernels of a forward+backward spec) and the spec's canonical keys,
        less those that do not change this kernel (the forward ignores `direction`).

    tuning_space() -> dict[str, tuple[int, ...]]
        Every launch-config key with the values to try: the keys the spec leaves `auto` get the
        candidates (attngen/policy/configs.py SEARCH_SPACE), fixed keys a single value. A backward kernel
        has its own keys (e.g. BLOCK_M_DQ); a split-KV decode kernel adds its split count.
    tuning_default() -> dict
        The config used when nothing is tuned (the heuristic, with the spec's fixed values).
    tuning_infeasible(config, target) -> str | None
        Why `config` cannot run on `target` (attngen.analysis.resources.Target), from the resource model,
        with the numbers; None if it fits. Called before anything compiles.
    tuning_inputs(shape, device, generator) -> inputs
        Fresh random inputs for a `keys.Shape` (and output buffers), on `device`, drawn from
        `generator`. Decode kernels add cache_seqlens and a block table of realistic lengths; a varlen
        kernel's shape is a `keys.Packed`, its inputs a packed batch of documents of random lengths.
    tuning_run(inputs, config, *, poison=False) -> outputs
        Launch with `config`, writing into the buffers of `inputs`; with `poison`, fill the outputs
        with NaN first so unwritten elements show. Must not consult the tuned tables.
    tuning_check(inputs, outputs) -> attngen.testing.accuracy.Result
        Validation against the float64 reference (attngen/testing/accuracy.py) with bounded memory: at large
        shapes check a slice (some batch entries, heads, query rows), as `gate.check_attention`.
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
        Keys of the space a stored entry may lack (tables.entry_problem): added to the space after
        entries were tuned, which the kernel's config lookup then fills with what those entries ran.

At run time, the kernel's launch path calls `tables.launch_config(part, shape, device_index)` (or
`launch_choice`, which also says whether the entry was tuned for this very bucket); a kind whose
inputs are not (q, k) builds its `Shape` from its own tensors' sizes (a decode kernel: the KV
cache's capacity, not the device-side cache_seqlens; a varlen kernel: `Packed.of`, the packed tokens and
cu_seqlens' length, not the lengths in it), never from device data.
"""

from __future__ import annotations

import warnings

from ..runtime import tables as store
from ..runtime.cache import CacheWarning
from ..runtime.keys import Device, Packed, Shape
from .adapt import tunable, tunables
from .search import Outcome, tune
from .space import TuneError

__all__ = ["Device", "Outcome", "Packed", "Shape", "TuneError", "save", "tunable", "tunables", "tune", "tune_bucket"]


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


def tune_bucket(part, shape: "Shape | Packed") -> bool:
    """Tune one launch part (a `Kernel`, or one of `runtime.parts`) at one shape and save what passed: what a
    call with autotuning on does for a bucket nobody tuned (`runtime.tables.set_autotuner`). Returns whether
    a config passed validation."""
    outcome = tune(part, [shape])
    if outcome.ok:
        save(outcome)
    return outcome.ok

