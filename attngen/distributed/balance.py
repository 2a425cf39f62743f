"""Documents' work shared evenly among the ranks without moving the shards: part of a heavy rank's diagonal pieces
(a document piece against its own keys) runs on a lighter rank, which receives those rows from their owner and
returns the partial results (`Loan`). The plan is static, a pure function of the schedule: every rank computes the
same one from cu_seqlens.

Head-tail shards balance a whole-sequence causal mask, not documents: a document's causal work grows with the square
of its length, so a rank whose chunks hold the long documents does more (the 14 documents of mean 8,192 in 128k
tokens: 0.851 / 1.149 of the mean on 2 ranks, 0.758 / 0.945 / 1.233 / 1.064 on 4). `balanced_schedule` moves pieces,
largest that fits first, from the most loaded rank to the least loaded, and where none fits splits the largest by
query rows (rows m..L against keys 0..L: an unmasked block beside a causal one), costing each block its kept scores
plus a per-call constant (`policy.context_parallel.BalancePolicy`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..lang.builtin import NO_WINDOW
from ..policy.context_parallel import BalancePolicy
from .schedule import Block, Pieces, grouped_pieces, spans, packed_block


class Loan(NamedTuple):
    """Diagonal work of rank `owner` that rank `executor` runs: it receives the owner's query rows `rows` and key rows
    `keys` (ranges of the owner's shard, each packed one after another), runs `blocks` (positions local to the packed
    rows) and returns the partial out and lse of those queries (forward), their dQ and the keys' dK, dV
    (backward)."""
    owner: int
    executor: int
    rows: tuple[tuple[int, int], ...]
    keys: tuple[tuple[int, int], ...]
    blocks: list


def kept_scores(b: Block) -> int:
    """The (query, key) pairs block b's mask keeps (top-left, in its local positions)."""
    nq, nk = b.q_end - b.q_start, b.k_end - b.k_start
    if b.window != NO_WINDOW:
        left, right = b.window
        right = 0 if b.causal else right
        i = torch.arange(nq)
        first = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
        last = (i + right).clamp(max=nk - 1) if right >= 0 else torch.full_like(i, nk - 1)
        return int((last - first + 1).clamp(min=0).sum())
    if not b.causal:
        return nq * nk
    seen = min(nq, nk)  # rows 0..seen-1 see i + 1 keys, later rows every key
    return seen * (seen + 1) // 2 + (nq - seen) * nk


def rank_loads(schedule, policy: BalancePolicy) -> list[int]:
    """Each rank's cost over every ring step of a `ring_schedule`: kept scores plus `block_cost` a block."""
    return [sum(kept_scores(b) + policy.block_cost for step in steps for b in step) for steps in schedule]


def _diagonal(b: Block) -> bool:
    return (b.q_start, b.q_end) == (b.k_start, b.k_end)


def _movable(b: Block) -> bool:
    """Whether `split_piece` can cut b: unwindowed, and where causal on the diagonal (a piece against its own keys;
    an unmasked block is a document's piece against an earlier piece of it)."""
    return b.window == NO_WINDOW and (not b.causal or _diagonal(b))


def split_piece(b: Block, target: float, min_rows: int, positional: bool = False):
    """(what stays home, the blocks that move) of block b (unmasked, or a causal piece on the diagonal) cut by query
    rows so that the moved rows keep at most `target` scores, as many as that allows: rows m..L against all its keys
    (causal: keys 0..m in full and m..L causally); None where fewer than `min_rows` rows would move. `positional`:
    each part with its shift (`Block.shift`: b's, less its first key's offset in b, plus its first row's)."""
    length, keys, q0, k0 = b.q_end - b.q_start, b.k_end - b.k_start, b.q_start, b.k_start
    if b.causal:  # rows m..L keep (L(L+1) - m(m+1)) / 2 scores: the least m with m(m+1) >= L(L+1) - 2 target
        least = length * (length + 1) - 2 * target
        m = max(0, math.ceil((math.sqrt(1 + 4 * least) - 1) / 2)) if least > 0 else 0
        while m > 0 and m * (m - 1) >= least:  # (the square root's rounding)
            m -= 1
        while m * (m + 1) < least:
            m += 1
    else:  # rows m..L keep (L - m) keys
        m = length - math.floor(target / keys)
    m = max(m, 1)
    if length - m < min_rows:
        return None
    part = lambda r0, r1, c0, c1, causal: Block(r0, r1, c0, c1, causal, NO_WINDOW,  # noqa: E731
                                                b.shift + (r0 - q0) - (c0 - k0) if positional else 0)
    if b.causal:
        home = part(q0, q0 + m, k0, k0 + m, True)
        moved = [part(q0 + m, b.q_end, k0, k0 + m, False), part(q0 + m, b.q_end, k0 + m, b.k_end, True)]
    else:
        home = part(q0, q0 + m, k0, b.k_end, False)
        moved = [part(q0 + m, b.q_end, k0, b.k_end, False)]
    return home, moved


def balanced_schedule(schedule, policy: BalancePolicy, positional: bool = False):
    """(the schedule with the moved blocks gone from their owners' step 0, the `Loan`s that run them elsewhere) of a
    `ring_schedule` under documents: while the most loaded rank is further from the mean than `policy.tolerance`,
    it gives the least loaded one its largest block on its own keys that fits the gap, or, where none fits, the
    part of its largest that does (`split_piece`). Every rank's share then lies within about the tolerance of the
    mean, where the blocks on its own keys allow (another rank's keys would have to come from a third)."""
    world = len(schedule)
    loads = rank_loads(schedule, policy)
    mean = sum(loads) / world
    home = [list(steps[0]) for steps in schedule]
    moved: dict[tuple[int, int], list[Block]] = {}
    cost = lambda b: kept_scores(b) + policy.block_cost  # noqa: E731
    # (a move either empties a block from home or, cut to the gap, brings a rank to the mean)
    for _ in range(sum(map(len, home)) + 2 * world * world):
        heavy = max(range(world), key=loads.__getitem__)
        light = min(range(world), key=loads.__getitem__)
        gap = min(loads[heavy] - mean, mean - loads[light])
        if gap <= policy.tolerance * mean:
            break
        move = _move(home[heavy], gap, cost, policy, positional)
        if move is None:
            break
        given, parts = move
        loads[heavy] -= given
        loads[light] += sum(cost(b) for b in parts)
        moved.setdefault((heavy, light), []).extend(parts)
    balanced = [[sorted(home[rank]), *steps[1:]] for rank, steps in enumerate(schedule)]
    return balanced, tuple(loan(owner, executor, blocks) for (owner, executor), blocks in sorted(moved.items()))


def _move(home: list[Block], gap: float, cost, policy: BalancePolicy, positional: bool = False):
    """(the cost leaving, the blocks that move) of the move out of `home` (a rank's blocks on its own keys, updated)
    that fills at most `gap`, None where none can: the largest block that fits, else the part of the largest that
    does; pieces on the diagonal first, then unmasked blocks (which move all their queries for a few keys)."""
    for tier in (True, False):
        movable = sorted((b for b in home if _movable(b) and _diagonal(b) == tier), key=kept_scores, reverse=True)
        whole = next((b for b in movable if cost(b) <= gap), None)
        if whole is not None:
            home.remove(whole)
            return cost(whole), [whole]
        split = split_piece(movable[0], gap - 2 * policy.block_cost, policy.min_rows, positional) if movable else None
        if split is not None:
            stays, parts = split
            home[home.index(movable[0])] = stays
            return kept_scores(movable[0]) - kept_scores(stays), parts
    return None


def loan(owner: int, executor: int, blocks: list[Block]) -> Loan:
    """The Loan of `blocks` (positions in the owner's shard): the query and key rows they reach, and the blocks on
    those rows packed, each run of diagonal ones a varlen call."""
    rows = spans((b.q_start, b.q_end) for b in blocks)
    keys = spans((b.k_start, b.k_end) for b in blocks)
    return Loan(owner, executor, rows, keys, grouped_pieces([packed_block(b, rows, keys) for b in blocks]))


def shares(schedule, loans=(), policy: BalancePolicy | None = None) -> list[float]:
    """Each rank's kept scores (plus `policy.block_cost` a block where given) over the mean: its own blocks and
    those it runs for others."""
    block_cost = policy.block_cost if policy else 0
    work = [sum(kept_scores(b) + block_cost for step in steps for b in step) for steps in schedule]
    for lent in loans:
        work[lent.executor] += sum(_blocks_work(b, block_cost) for b in lent.blocks)
    mean = sum(work) / len(work)
    return [w / mean for w in work]


def loans_split(blocks, loans, rank: int, policy: BalancePolicy):
    """(the blocks rank `rank` runs on its own keys before the `loans` it executes, those it runs after) of its
    blocks on its own keys (`blocks`, in their order) under LOANS_EARLY: the fewest whose kept scores reach
    `policy.arrival_scores` for each query and key row those loans bring (so that the rows have arrived when they
    start), a run of pieces cut between two of them where the target falls inside it, and something always left
    after (the returns travel under it); all before where it executes none (an owner's wait on its sent rows stays
    after its work)."""
    executed = [lent for lent in loans if lent.executor == rank]
    if not executed or not blocks:
        return list(blocks), []
    need = policy.arrival_scores * sum(b - a for lent in executed for a, b in (*lent.rows, *lent.keys))
    done = 0
    for i, b in enumerate(blocks):
        if done >= need and i:
            return list(blocks[:i]), list(blocks[i:])
        if isinstance(b, Pieces) and (done + _blocks_work(b, 0) > need or i == len(blocks) - 1):
            cut = _cut_pieces(b, need - done)
            if cut is not None:
                return [*blocks[:i], cut[0]], [cut[1], *blocks[i + 1:]]
        done += _blocks_work(b, 0)
    return list(blocks[:-1]), [blocks[-1]]


def _cut_pieces(b: Pieces, target: float):
    """(the first pieces of b, the rest) as two Pieces, the first the fewest whose kept scores reach `target`, at
    most all but the last; None where b holds one piece."""
    cuts = len(b.offsets) - 1
    if cuts < 2:
        return None
    j, done = 1, 0
    while j < cuts - 1:
        length = b.offsets[j] - b.offsets[j - 1]
        done += length * (length + 1) // 2 if b.causal else length * length
        if done >= target:
            break
        j += 1
    at = b.offsets[j]
    return (Pieces(b.q_start, b.q_start + at, b.k_start, b.k_start + at, b.causal, b.offsets[:j + 1]),
            Pieces(b.q_start + at, b.q_end, b.k_start + at, b.k_end, b.causal, tuple(x - at for x in b.offsets[j:])))


def _blocks_work(b, block_cost: int) -> int:
    """Kept scores of a block or of each piece of a `Pieces` (plus block_cost each)."""
    if isinstance(b, Block):
        return kept_scores(b) + block_cost
    return sum(kept_scores(Block(b.q_start + x, b.q_start + y, b.k_start + x, b.k_start + y, b.causal, NO_WINDOW))
               + block_cost for x, y in zip(b.offsets, b.offsets[1:]))
