"""What `attngen tune` prints: a progress bar on stderr, then the pruning report and a table."""

from __future__ import annotations

import sys

from .space import describe


class Progress:
    """A plain-text progress bar: redrawn in place on a terminal, one line per step elsewhere."""

    def __init__(self, label: str, stream=None, width: int = 24):
        self.label, self.stream, self.width = label, stream or sys.stderr, width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int, text: str) -> None:
        filled = self.width * done // max(total, 1)
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {text}"
        if self.tty:
            end = "\n" if done >= total else ""
            self.stream.write("\r\033[K" + line[:160] + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_outcome(outcome) -> str:
    lines = []
    total = 1
    for values in outcome.space.values():
        total *= len(values)
    varying = {k: v for k, v in outcome.space.items() if len(v) > 1}
    lines.append(f"{outcome.label} on {outcome.device}")
    if varying:
        sizes = " x ".join(f"{len(v)} {k.lower()}" for k, v in varying.items())
        lines.append(f"  search space: {sizes} = {total} candidates "
                     f"(fixed: {describe({k: v[0] for k, v in outcome.space.items() if len(v) == 1}) or 'none'})")
    else:
        lines.append(f"  nothing to search: the spec fixes every tile key ({describe({k: v[0] for k, v in outcome.space.items()})})")
    if outcome.merged:
        lines.append(f"  run as another candidate does: {outcome.merged} of {total} (e.g. the Gluon decode kernel's "
                     "fixed tiles), each tried once")
    n_pruned = total - outcome.merged - outcome.feasible
    lines.append(f"  pruned before compiling: {n_pruned} of {total} by the resource model")
    for group in outcome.pruned:
        lines.append(f"    {len(group.configs):4d}  {group.reason}")
        lines.append(f"          e.g. {group.example}")
    tried = len(outcome.trials)
    lines.append(f"  tried {tried} of {outcome.feasible} that fit ({outcome.feasible - tried} left out by the budget, "
                 f"nearest the default first): {outcome.count('ok')} passed, {outcome.count('failed')} failed to "
                 f"compile or launch, {outcome.count('rejected')} rejected by validation")
    for trial in outcome.trials:
        if trial.status != "ok":
            lines.append(f"    {trial.status} {describe(trial.config)}: {trial.reason}")
    bandwidth = any(b.gbps is not None for b in outcome.best)
    also = list(dict.fromkeys(name for b in outcome.best for name in b.also))
    if also:
        lines.append(f"  each candidate also timed {' and '.join(also)}: the best config is the one whose worst "
                     "ratio to the fastest candidate on any of the inputs is least")
    # a decode bucket reports GB/s of the cache read, and TFLOP/s beside it: a spec tuned at decoding shapes and
    # at longer query blocks (chunked prefill, which reports no bytes) has rows of both kinds
    rates = ["GB/s", "TFLOP/s"] if bandwidth else ["TFLOP/s"]
    rows = [["shape", "best config", "median ms", *rates, "rel err", "vs default"]
            + [f"{name}: ms (of fastest)" for name in also]]
    for b in outcome.best:
        speedup = f"{b.default_ms / b.ms:.2f}x" if b.default_ms and b.ms > 0 else "-"
        rate = [f"{b.tflops:.1f}"] if not bandwidth else ["-" if b.gbps is None else f"{b.gbps:.0f}", f"{b.tflops:.1f}"]
        rows.append([f"{b.shape} ({b.bucket})", describe(b.trial.config), f"{b.ms:.4f}", *rate,
                     f"{b.trial.rel[b.bucket]:.1e}", speedup]
                    + [f"{b.also[n][0]:.4f} ({b.also[n][1] / b.also[n][0]:.2f})" if n in b.also else "-" for n in also])
    for shape in outcome.missing:
        rows.append([str(shape), "no candidate passed", "-", *["-"] * len(rates), "-", "-"] + ["-"] * len(also))
    lines += _table(rows)
    for b in outcome.best:
        if b.uniform_kept:  # kept beside the best config, for calls known to have that input's form
            trial, ms, name = b.uniform
            lines.append(f"  {b.bucket}, kept for calls whose sequences all have one length: {describe(trial.config)}, "
                         f"{ms:.4f} ms {name} ({b.also[name][0] / ms:.2f}x the best config's speed)")
    lines.append(f"  timings: {outcome.timing}; {outcome.seconds:.1f} s in all")
    return "\n".join(lines)
