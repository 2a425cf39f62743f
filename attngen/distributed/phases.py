"""Where a context-parallel call's time goes, step by step: an opt-in recorder of its phases on this rank.

    with attngen.distributed.timeline() as recorded:
        out = context_parallel_attention(q, k, v, causal=True)
        out.backward(do)
    torch.cuda.synchronize()                      # (CUDA events: read once the work is done)
    recorded.rows()     # [{"pass": "forward", "step": 0, "phase": "kernels", "ms": 1.2}, ...]

Each phase is an interval on this rank: CUDA events on the current stream where the call runs on a GPU (a wait
then measures how long the stream stalls for an exchange, the communication left exposed), host times on the CPU
(gloo's waits block the host). The loops of ring.py name the step they are in (`at`) and wrap each phase
(`phase`); intervals of one (pass, step, phase) add up into one row. Each pass also records its whole call (phase
"call", step None). Off (no `timeline()` open), `phase` returns one shared no-op context: no event, no
synchronisation, nothing allocated.
"""

from __future__ import annotations

import contextlib
import time

import torch

_OFF = contextlib.nullcontext()

# the Timeline recording now; None when off
_current = None


class Timeline:
    """The intervals recorded on this rank: (pass, step, phase, start, end), start and end CUDA events or host
    seconds."""

    def __init__(self):
        self.intervals = []
        self.where = ("forward", None, "")  # (pass, step, prefix of the phases' names) the next phases belong to
        self.cuda = False

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def interval(self, name: str):
        where, start = self.where, self.mark()
        try:
            yield
        finally:
            self.intervals.append((*where[:2], where[2] + name, start, self.mark()))

    def rows(self) -> list[dict]:
        """One row a (pass, step, phase) in the order first recorded: {"pass", "step", "phase", "ms"}, ms the sum of
        its intervals. On a GPU, call after synchronising (the events must have completed)."""
        totals: dict[tuple, float] = {}
        for pass_, step, name, start, end in self.intervals:
            ms = start.elapsed_time(end) if self.cuda else 1e3 * (end - start)
            totals[(pass_, step, name)] = totals.get((pass_, step, name), 0.0) + ms
        return [{"pass": p, "step": s, "phase": name, "ms": ms} for (p, s, name), ms in totals.items()]


@contextlib.contextmanager
def timeline():
    """Record the phases of the context-parallel calls (forward and backward) made inside the block on this rank;
    yields the `Timeline`."""
    global _current
    if _current is not None:
        raise RuntimeError("attngen.distributed.timeline() is already recording")
    _current = Timeline()
    try:
        yield _current
    finally:
        _current = None


@contextlib.contextmanager
def recorded_pass(pass_: str, device: torch.device):
    """The whole of one pass ("forward" or "backward") of a call, recorded as phase "call" when recording."""
    recorder = _current
    if recorder is None:
        yield
        return
    recorder.cuda = device.type == "cuda"
    recorder.where = (pass_, None, "")
    with recorder.interval("call"):
        yield


def at(step: int, prefix: str = "") -> None:
    """The phases recorded next belong to `step` of the current pass, their names after `prefix` (a loan's
    phases: "loan ")."""
    if _current is not None:
        _current.where = (_current.where[0], step, prefix)


def phase(name: str):
    """A context recording `name` at the current step (the shared no-op context when not recording)."""
    return _OFF if _current is None else _current.interval(name)
