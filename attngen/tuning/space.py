"""The search space: candidates from the spec, pruning by the resource model, and the budget.

Only keys the spec leaves `auto` vary (`kernel.tuning_space()` gives a single value for the rest);
`restrict` narrows them further (`attngen tune --values block_n=32,64`). Before anything compiles,
`kernel.tuning_infeasible(config, target)` (the sympy resource model of attngen/analysis/resources.py:
shared memory against the device's per-block limit, a register estimate) prunes what cannot fit;
the reasons are grouped for the report. What survives is ordered by its distance from the
untuned default config, which comes first, and cut at the budget: the search looks around the
heuristic, and the tuned result is never slower than the default on the tuning shapes.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

from ..errors import AttnGenError


class TuneError(AttnGenError):
    """A tuning request that cannot be met (bad --values, nothing to search): a user error."""


def describe(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


@dataclass
class Pruned:
    """The candidates one kind of reason pruned, with one full reason as the example."""

    reason: str
    configs: list = field(default_factory=list)
    example: str = ""


def restrict(space: dict[str, tuple], values: dict[str, tuple[int, ...]] | None) -> dict[str, tuple]:
    """The space with the given keys narrowed (names match case-insensitively: block_n = BLOCK_N)."""
    space = dict(space)
    by_name = {k.lower(): k for k in space}
    for name, choice in (values or {}).items():
        key = by_name.get(name.lower())
        if key is None:
            raise TuneError(f"--values: no tile key '{name}'; this kernel's keys: "
                            f"{', '.join(k.lower() for k in space)}")
        if len(space[key]) == 1:
            raise TuneError(f"--values: {key.lower()} is fixed to {space[key][0]} by the spec; "
                            "write it as auto in the spec to search it")
        least = 0 if 0 in space[key] else 1
        if not choice or any(not isinstance(v, int) or v < least for v in choice):
            what = "whole numbers from 0" if least == 0 else "positive whole numbers"
            raise TuneError(f"--values: {key.lower()} takes {what}; got {choice}")
        space[key] = tuple(dict.fromkeys(choice))
    return space


def candidates(space: dict[str, tuple]) -> list[dict]:
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]


def _kind(reason: str) -> str:
    """The reason with its numbers and details taken out, to group alike reasons."""
    head = reason.split(" (", 1)[0]
    return re.sub(r"\b\d[\d,.]*\b", "N", head)


def prune(kernel, configs: list[dict], target) -> tuple[list[dict], list[Pruned]]:
    """The configs that fit, and the pruned ones grouped by reason (largest group first)."""
    fits, groups = [], {}
    for config in configs:
        reason = kernel.tuning_infeasible(config, target)
        if reason is None:
            fits.append(config)
            continue
        group = groups.setdefault(_kind(reason), Pruned(_kind(reason), example=f"{describe(config)}: {reason}"))
        group.configs.append(config)
    return fits, sorted(groups.values(), key=lambda g: -len(g.configs))


def _distance(config: dict, default: dict) -> float:
    return sum(abs(math.log2(config[k]) - math.log2(default[k])) for k in config
               if k in default and config[k] > 0 and default[k] > 0)


def within_budget(configs: list[dict], default: dict, budget: int | None) -> list[dict]:
    """The configs nearest the default first (the default itself leads), at most `budget` of them."""
    ordered = sorted(configs, key=lambda c: _distance(c, default))  # stable: ties keep space order
    return ordered if budget is None else ordered[:max(budget, 1)]
