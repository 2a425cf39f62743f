"""Plans of checked calls, by call signature: `PLANS`, the one cache that `attngen.attention`,
`attngen.attention_with_kvcache` and `Kernel.__call__` share.

A plan is what the argument checks of one call decided (the kernel to run, its config, the scale, ...) and
the replays of its launches (attngen/runtime/replay.py); a signature holds everything those checks read
(each tensor's `arguments.tensor_signature`, the other arguments, whether Triton interprets, the tuning
tables' generation), so a later call with the same signature skips the checks and would pass them.

A signature's first element names its call path, so the paths cannot take each other's plans: "sdpa"
(attngen/api/sdpa.py), "kvcache" (attngen/api/kvcache.py), "torch_flash" (the aten ops of
attngen/integrations/torch_flash.py, whose forward's replays also write the log-sum-exp), and for `Kernel.__call__` the `Kernel` object
itself (attngen/runtime/kernel.py): a kernel loaded with its own autotune setting is a copy of the plain one
with the same spec, and its plans hold its own key and replays of its own configs.
"""

from __future__ import annotations

# NOTE: 256 signatures per call path, as each path's own table held before they shared this one: the bound on
# memory stays what it was, and a process whose three paths together see at most 768 layouts never starts over.
CAPACITY = 3 * 256


class PlanCache:
    """Plans by call signature, at most `capacity` of them: `keep` empties the cache when it is full (a process
    that keeps making new layouts starts over rather than paying for an eviction order on every call).

    `get(signature)` is the dict's own lookup, bound once: the hot path pays for a dict lookup and nothing
    more (a wrapping method would add a Python frame to every call).
    """

    __slots__ = ("capacity", "_table", "get")

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._table: dict = {}
        self.get = self._table.get

    def keep(self, signature: tuple, plan) -> None:
        """Add `plan` under `signature`, emptying the cache first when it is full."""
        if len(self._table) >= self.capacity:
            self._table.clear()
        self._table[signature] = plan

    def replace(self, signature: tuple, plan) -> None:
        """Put `plan` in place of the one kept under `signature` (a plan that has since recorded its replay),
        without `keep`'s emptying: replacing adds no signature."""
        self._table[signature] = plan

    def clear(self) -> None:
        self._table.clear()

    def __len__(self) -> int:
        return len(self._table)

    def plans(self, path) -> list:
        """The plans kept for one call path ("sdpa", "kvcache" or a `Kernel`), oldest first."""
        return [plan for signature, plan in self._table.items() if signature[0] == path]


PLANS = PlanCache()
