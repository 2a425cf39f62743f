"""The tuner's view of a loaded kernel: one `Tunable` (attngen/tuning/tunables.py) per launch part (a varlen
spec's: attngen/tuning/varlen.py)."""

from __future__ import annotations

import weakref

from ..runtime.parts import PARTS, BackwardPart, KVCachePart
from .backward import BackwardTunable
from .decoding import KVCacheTunable
from .tunables import ForwardTunable, Tunable
from .varlen import VarlenBackwardTunable, VarlenForwardTunable

_TUNABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tunable(part) -> Tunable:
    """The tuner's view of one launch part (a `Kernel` for its forward, or one of its `Kernel.part(name)`): the
    same object on every call, so that a caller may replace its methods and see the tuner use them."""
    found = _TUNABLES.get(part)
    if found is None:
        if isinstance(part, KVCachePart):
            adapter = KVCacheTunable
        elif isinstance(part, BackwardPart):
            adapter = VarlenBackwardTunable if part.spec.varlen else BackwardTunable
        else:
            adapter = VarlenForwardTunable if part.spec.varlen else ForwardTunable
        found = _TUNABLES.setdefault(part, adapter(part))
    return found


def tunables(kernel) -> list[Tunable]:
    """Everything of a loaded kernel the autotuner can tune, each with its `kind`: the forward (or, for a spec
    over a KV cache, its `forward_kvcache` entry; for a varlen spec, paged or not, `forward_varlen`), and a
    forward+backward spec's two backward kernels."""
    if kernel.kvcache:
        return [tunable(kernel.part("kvcache"))]
    return [tunable(kernel)] + ([tunable(kernel.part(name)) for name in PARTS] if kernel.spec.backward else [])
