"""Decisions and tables that rewrite no IR: launch configs (`configs`), split counts (`splits`), which kernels
read through TMA descriptors (`tma`), the Hopper Gluon kernels' shapes and thresholds (`hopper`), and how context
parallelism evens out documents' work among ranks (`context_parallel`)."""

from . import hopper


def switches() -> tuple:
    """The values of the policy's run-time switches (`hopper.SWITCHES`), which shape generated code beyond the spec
    and the generator's sources: part of every kernel cache key, read on each load (a few attribute reads)."""
    return tuple(getattr(hopper, name) for name in hopper.SWITCHES)


def generation() -> int:
    """Changes whenever a run-time switch is set (`hopper.switch_generation`): part of every call plan's signature,
    whose replays hold launches of modules generated under the switches' values when it was made."""
    return hopper.switch_generation()
