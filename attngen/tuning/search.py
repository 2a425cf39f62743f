"""The search: every candidate that fits is compiled, validated, then timed, per shape bucket.

For each candidate in budget order and each tuning shape, on the same fresh random inputs for every
candidate (`kernel.tuning_inputs`):
  1. run it with its outputs poisoned (NaN) first; the first run compiles it. An exception (a
     compile error, Triton's OutOfResources, a launch failure) skips the candidate with its reason;
  2. validate the outputs against the float64 reference (`kernel.tuning_check`). A candidate that
     computes a wrong result at any shape is rejected and reported, and never chosen;
  3. time it: `triton.testing.do_bench(..., return_mode="median")` on CUDA (of a CUDA-graph replay
     for kernels that ask for it with `tuning_graph = True`: decoding); in Triton's
     interpreter, which has no CUDA events, a wall-clock median (meaningless as a speed, and the
     report says so; the path, the gate and the cache are the real ones).
The best config per bucket is the passing candidate with the lowest median. A kernel may also name
further inputs per bucket (`kernel.tuning_variants(inputs)`: decoding times every candidate on a batch
of spread lengths and again with every sequence at capacity); each candidate is then validated and timed
on each, and the best is the one whose worst ratio to the fastest candidate on any of them is least
(a config tuned on one length mix alone can cost 4-5% on the other), ties to the lower first median.
  4. runoff (on a GPU): candidates timed one after another drift by 1-2% with the order they ran in
     (benchmarks/NOTES.md v20), as much as the gaps between the best few. The best RUNOFF of a bucket
     are timed again, RUNOFF_ROUNDS times on each input, in alternating order (forward, backward, ...);
     each finalist's time is the median of its rounds, and the best is chosen again by the same rule.
A kernel may also name one of its further inputs `tuning_uniform` (decoding: "at capacity", every
sequence of the same length): the fastest config on that input alone, after a runoff of its own best
RUNOFF, is kept beside the bucket's best as the config for calls known to have that form (decoding:
`cache_seqlens` given as an int), where it differs from the best and is at least UNIFORM_GAIN times as
fast there.
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..analysis.resources import Target
from ..env import interpreting
from ..runtime.keys import Device, Shape, bucket
from ..testing.accuracy import Result, format_result
from ..version import __version__
from . import space as space_
from .adapt import tunable
from .tunables import Tunable

DEFAULT_BUDGET = 16
INTERPRETER_BUDGET = 4
DEFAULT_REP_MS = 25
RUNOFF = 4         # finalists re-timed per bucket on a GPU (0: none; the interpreter's timings mean nothing)
RUNOFF_ROUNDS = 3  # alternating rounds of the runoff
UNIFORM_GAIN = 1.02  # a bucket keeps a config for equal lengths only if it is this much faster there


@dataclass
class Trial:
    """One candidate config: 'ok', 'failed' (did not compile or launch) or 'rejected' (wrong result)."""

    config: dict
    status: str = "ok"
    reason: str = ""
    ms: dict = field(default_factory=dict)    # bucket -> median milliseconds (on the bucket's first inputs)
    rel: dict = field(default_factory=dict)   # bucket -> relative error against float64 (worst of its inputs)
    also: dict = field(default_factory=dict)  # bucket -> {name: median ms} on the kernel's further inputs


@dataclass
class Best:
    shape: Shape
    bucket: str
    trial: Trial
    tflops: float
    default_ms: float | None  # the untuned default's median on the same inputs, if it was tried
    gbps: float | None = None  # for kernels that report bytes read (decoding): GB/s
    also: dict = field(default_factory=dict)  # further inputs' name -> (this config's ms, the fastest's ms)
    uniform: tuple | None = None  # (trial, its ms, the input's name): fastest on the kernel's `tuning_uniform` input

    @property
    def uniform_kept(self) -> bool:
        """Whether the config for the uniform input is another than the bucket's best, and at least
        UNIFORM_GAIN times as fast there (closer is within the runoff's noise)."""
        if self.uniform is None or self.uniform[0].config == self.trial.config:
            return False
        trial, ms, name = self.uniform
        return name in self.also and self.also[name][0] >= UNIFORM_GAIN * ms

    @property
    def ms(self) -> float:
        return self.trial.ms[self.bucket]


@dataclass
class Outcome:
    label: str            # what was tuned: the spec's name, with the kernel's part if it has several
    spec: object
    problem: str          # the kernel's tuning_problem()
    device: Device
    space: dict
    pruned: list          # space.Pruned groups
    feasible: int         # candidates the resource model let through
    trials: list          # Trial, in the order tried
    best: list            # Best, one per tuned bucket
    missing: list         # Shapes no candidate passed at
    timing: str
    seconds: float
    merged: int = 0       # candidates that run as another one (`tuning_canonical`), tried once

    @property
    def ok(self) -> bool:
        return not self.missing

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)

    def records(self) -> list[tuple[str, dict]]:
        """(bucket, entry) pairs for the tuning file."""
        today = datetime.date.today().isoformat()
        out = []
        for b in self.best:
            out.append((b.bucket, {
                "config": dict(b.trial.config), "ms": round(b.ms, 5), "tflops": round(b.tflops, 2),
                **({} if b.gbps is None else {"gbps": round(b.gbps, 1)}),
                "rel_err": float(f"{b.trial.rel[b.bucket]:.3g}"),
                **({"also": {name: {"ms": round(ms, 5), "best_ms": round(fastest, 5)}
                             for name, (ms, fastest) in b.also.items()}} if b.also else {}),
                **({"uniform": {"config": dict(b.uniform[0].config), "ms": round(b.uniform[1], 5)}}
                   if b.uniform_kept else {}),
                "default_ms": None if b.default_ms is None else round(b.default_ms, 5),
                "shape": b.shape.as_dict(), "tried": len(self.trials),
                "pruned": sum(len(g.configs) for g in self.pruned), "failed": self.count("failed"),
                "rejected": self.count("rejected"), "timing": self.timing.split(":")[0],
                "attngen": __version__, "tuned": today,
            }))
            if self.count("ok") < len(self.trials):
                out[-1][1]["skipped"] = [f"{t.status} {space_.describe(t.config)}: {t.reason}"
                                         for t in self.trials if t.status != "ok"]
        return out


def bench(fn, rep_ms: int, cuda: bool) -> float:
    """Median milliseconds of `fn()`: do_bench on CUDA, else wall clock (at most 10 runs)."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median"))
    times, deadline = [], time.perf_counter() + rep_ms / 1000
    while not times or (len(times) < 10 and time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def graphed(fn):
    """fn captured in a CUDA graph: its replay. For kernels whose GPU time is shorter than the Python
    that launches them (a decoding step: tens of microseconds), timing the eager call would measure
    the host, and rank candidates by noise; serving engines replay decode steps as graphs anyway."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _error(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}".rstrip(": ")


def _unique_buckets(shapes: list[Shape]) -> list[tuple[str, Shape]]:
    seen: dict[str, Shape] = {}
    for shape in shapes:
        seen.setdefault(bucket(shape), shape)
    return list(seen.items())


def tune(kernel, shapes: list[Shape], *, values: dict | None = None, budget: int | None = None,
         rep_ms: int = DEFAULT_REP_MS, seed: int = 0, target=None, progress=None, timer=bench,
         runoff: int | None = None) -> Outcome:
    """Search the kernel's tile space at these shapes on the device at hand; nothing is saved.

    `values` narrows keys the spec leaves auto; `budget` caps the candidates tried (default: 16 on
    a GPU, 4 in the interpreter); `progress(done, total, text)` is told before each step; `timer`
    (fn, rep_ms, cuda) -> ms is `bench` unless a test replaces it; `runoff` finalists per bucket are
    timed again, alternating (default RUNOFF on a GPU, none in the interpreter). Shapes that fall in
    one bucket are tuned once, at the first of them. `kernel`: a loaded `Kernel`'s launch part (the `Kernel`
    itself for its forward, or `Kernel.part(name)`), or its `Tunable`.
    """
    kernel = kernel if isinstance(kernel, Tunable) else tunable(kernel)
    started = time.perf_counter()
    cuda = not interpreting() and torch.cuda.is_available()
    device = Device.current()
    target = target or Target.current()
    if budget is None:
        budget = DEFAULT_BUDGET if cuda else INTERPRETER_BUDGET
    if runoff is None:
        runoff = RUNOFF if cuda else 0
    space = space_.restrict(kernel.tuning_space(), values)
    candidates = space_.candidates(space)
    canonical = getattr(kernel, "tuning_canonical", None)
    total = len(candidates)
    if canonical is not None:  # candidates that run alike are tried once
        candidates = list({tuple(sorted(c.items())): c for c in map(canonical, candidates)}.values())
    feasible, pruned = space_.prune(kernel, candidates, target)
    default = kernel.tuning_default()
    tried = space_.within_budget(feasible, default, budget)
    buckets = _unique_buckets(shapes)

    generator = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(seed)
    variants = getattr(kernel, "tuning_variants", lambda x: [])
    runs = {}  # bucket -> its (name, inputs) pairs: the kernel's inputs, named "", then its variants
    for b, s in buckets:
        x = kernel.tuning_inputs(s, "cuda" if cuda else "cpu", generator)
        runs[b] = [("", x)] + list(variants(x))
    trials, steps = [], len(tried) * len(buckets)
    for i, config in enumerate(tried):
        trial = Trial(dict(config))
        trials.append(trial)
        for j, (b, shape) in enumerate(buckets):
            if progress:
                progress(i * len(buckets) + j, steps, f"{space_.describe(config)} at {shape}")
            _measure(kernel, trial, b, runs[b], rep_ms, cuda, timer)
            if trial.status != "ok":
                break
    passed = [t for t in trials if t.status == "ok"]
    # the candidates each bucket's best is chosen from: its finalists, all timed again alike, where
    # there was a runoff (a finalist's first time may have been low by luck), else every passing one
    pools, finals = {b: passed for b, _ in buckets}, 0
    for b, shape in buckets:
        finalists = ranked(passed, b)[:runoff]
        if len(finalists) > 1:
            if progress:
                progress(steps, steps, f"runoff of the best {len(finalists)} at {shape}")
            _runoff(kernel, finalists, b, runs[b], rep_ms, cuda, timer)
            finals = max(finals, len(finalists))
            pools[b] = [t for t in finalists if t.status == "ok"] or [t for t in passed if t.status == "ok"]
    if progress:
        progress(steps, steps, "done")

    best, missing = [], []
    passed = [t for t in passed if t.status == "ok"]
    default_trial = next((t for t in passed if t.config == default), None)
    for b, shape in buckets:
        pool = [t for t in pools[b] if t.status == "ok"]
        if not pool:
            missing.append(shape)
            continue
        winner, fastest = choose(pool, b)
        seconds = max(winner.ms[b] * 1e-3, 1e-12)
        moved = getattr(kernel, "tuning_bytes", lambda shape: None)(shape)  # bytes, for memory-bound kernels
        gbps = None if moved is None else moved / seconds / 1e9
        best.append(Best(shape, b, winner, kernel.tuning_flops(shape) / seconds / 1e12,
                         default_trial.ms[b] if default_trial else None, gbps,
                         {name: (winner.also[b][name], ms) for name, ms in fastest.items()},
                         _uniform(kernel, passed, b, runs[b], runoff, rep_ms, cuda, timer)))
    timing = (f"triton.testing.do_bench median ({rep_ms} ms per measurement"
              + (f"; the best {finals} of each bucket re-timed, median of {RUNOFF_ROUNDS} alternating rounds)"
                 if finals else ")")
              if cuda else
              "wall-clock median in Triton's CPU interpreter: the path, the validation gate and the cache "
              "are real, the speeds are meaningless")
    return Outcome(getattr(kernel, "label", kernel.spec.name), kernel.spec, kernel.tuning_problem(), device, space,
                   pruned, len(feasible), trials, best, missing, timing, time.perf_counter() - started,
                   total - len(candidates))


def _uniform(kernel, passed: list, b: str, runs: list, runoff: int, rep_ms: int, cuda: bool, timer):
    """(trial, ms, name) fastest on the kernel's `tuning_uniform` input (so named) at bucket b, after a
    runoff of the best `runoff` there (on copies: the bucket's best and its recorded times stay as
    chosen); None if the kernel names no such input."""
    name = getattr(kernel, "tuning_uniform", None)
    pool = [t for t in passed if name in t.also.get(b, {})] if name else []
    if not pool:
        return None
    top = copy.deepcopy(sorted(pool, key=lambda t: t.also[b][name])[: max(runoff, 1)])
    if len(top) > 1:
        _runoff(kernel, top, b, runs, rep_ms, cuda, timer)
    top = [t for t in top if t.status == "ok"]
    if not top:
        return None
    fastest = min(top, key=lambda t: t.also[b][name])
    return fastest, fastest.also[b][name], name


def ranked(passed: list, b: str) -> list:
    """The passing trials at bucket b, best first (the rule of `choose`)."""
    if not passed:
        return []
    names = list(passed[0].also.get(b, {}))
    if not names:
        return sorted(passed, key=lambda t: t.ms[b])
    first = min(t.ms[b] for t in passed)
    fastest = {name: min(t.also[b][name] for t in passed) for name in names}

    def worst(t: Trial) -> float:
        return max([t.ms[b] / first] + [t.also[b][name] / fastest[name] for name in names])

    return sorted(passed, key=lambda t: (worst(t), t.ms[b]))


def choose(passed: list, b: str) -> tuple[Trial, dict]:
    """The best of the passing trials at bucket b, and the fastest median on each further input there:
    with further inputs, the trial whose worst ratio to the fastest on any input is least (ties: the
    lower median on the first inputs); else the lowest median."""
    names = list(passed[0].also.get(b, {}))
    fastest = {name: min(t.also[b][name] for t in passed) for name in names}
    return ranked(passed, b)[0], fastest


def _runoff(kernel, finalists: list, b: str, runs: list, rep_ms: int, cuda: bool, timer) -> None:
    """Time the finalists again on each input, RUNOFF_ROUNDS rounds in alternating order, and give each
    the median of its rounds (one-after-another timings drift with their order: NOTES v20)."""
    times = {(id(t), name): [] for t in finalists for name, _ in runs}
    for round_ in range(RUNOFF_ROUNDS):
        for trial in (finalists if round_ % 2 == 0 else finalists[::-1]):
            for name, inputs in runs:
                if trial.status != "ok":
                    continue
                fn = lambda trial=trial, inputs=inputs: kernel.tuning_run(inputs, trial.config)  # noqa: E731
                try:
                    if cuda and getattr(kernel, "tuning_graph", False):
                        fn = graphed(fn)
                    times[(id(trial), name)].append(timer(fn, rep_ms, cuda))
                except Exception as e:  # noqa: BLE001 - it ran before; if it fails now it is out
                    trial.status, trial.reason = "failed", "in the runoff: " + _error(e)
    for trial in (t for t in finalists if t.status == "ok"):
        for name, _ in runs:
            ms = statistics.median(times[(id(trial), name)])
            if name:
                trial.also[b][name] = ms
            else:
                trial.ms[b] = ms


def _measure(kernel, trial: Trial, b: str, runs: list, rep_ms: int, cuda: bool, timer) -> None:
    """Run (compiling on first use), validate, then time one candidate at one bucket, on each of its
    inputs (`runs`: (name, inputs) pairs, the first named "")."""
    for name, inputs in runs:
        _measure_one(kernel, trial, b, name, inputs, rep_ms, cuda, timer)
        if trial.status != "ok":
            return


def _measure_one(kernel, trial: Trial, b: str, name: str, inputs, rep_ms: int, cuda: bool, timer) -> None:
    config = trial.config
    try:
        outputs = kernel.tuning_run(inputs, config, poison=True)
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure to compile or launch skips the candidate
        trial.status, trial.reason = "failed", _error(e)
        return
    result = kernel.tuning_check(inputs, outputs)
    trial.rel[b] = max(trial.rel.get(b, 0.0), result.rel)
    if not result.ok:
        trial.status = "rejected"
        shown = format_result(result) if isinstance(result, Result) else str(result)
        trial.reason = "wrong result: " + shown.removeprefix("FAIL").strip()
        return
    try:
        fn = lambda: kernel.tuning_run(inputs, config)  # noqa: E731
        if cuda and getattr(kernel, "tuning_graph", False):
            fn = graphed(fn)
        ms = timer(fn, rep_ms, cuda)
        if name:
            trial.also.setdefault(b, {})[name] = ms
        else:
            trial.ms[b] = ms
    except Exception as e:  # noqa: BLE001
        trial.status, trial.reason = "failed", _error(e)
