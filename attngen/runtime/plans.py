"""Plans of checked calls, by call signature: the one cache `attngen.attention`, `attngen.attention_with_kvcache`
and `Kernel.__call__` keep.

A plan is what the argument checks of one call decided (the kernel to run, its config, the scale, ...) and
the replays of its launches (attngen/runtime/replay.py); a signature holds everything those checks read
(each tensor's `arguments.tensor_signature`, the other arguments, whether Triton interprets, the tuning
tables' generation), so a later call with the same signature skips the checks and would pass them. Each caller
keeps its own table (a dict: signature -> plan) and adds to it with `keep`.
"""

from __future__ import annotations

KEPT = 256  # signatures a table holds; then it starts over (a process that keeps making new layouts)


def keep(table: dict, signature, plan) -> None:
    """Add `plan` under `signature`, emptying `table` first when it is full."""
    if len(table) >= KEPT:
        table.clear()
    table[signature] = plan
