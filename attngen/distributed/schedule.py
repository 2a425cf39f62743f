"""The plan of context-parallel attention, before any tensor moves: how a sequence is sharded across ranks (head-tail
chunks or contiguous), which (query chunk, key chunk) blocks each ring step computes and with what mask (`Block`,
`ring_schedule`), documents cut into pieces (`document_pieces`, `Pieces`, `Visit`), and a window's halo (`Halo`).
Pure functions of sizes and offsets: the tests check them without any process group."""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch

from ..errors import KernelInputError
from ..lang.builtin import NO_WINDOW


def shard_sequence(x: torch.Tensor, world: int, rank: int, *, load_balance: bool = True, dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of `x` along `dim` (the sequence of (B, H, N, D)) among `world` ranks: chunks rank and
    2*world-1-rank of 2*world equal chunks under `load_balance`, else the rank-th of `world` equal parts."""
    parts = 2 * world if load_balance else world
    if x.shape[dim] % parts:
        raise KernelInputError(f"a sequence of {x.shape[dim]} cannot be cut into {parts} equal chunks for {world} "
                               f"ranks with load_balance={load_balance}")
    chunks = x.chunk(parts, dim)
    if not load_balance:
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim)


def unshard_sequence(shards, *, load_balance: bool = True, dim: int = 2) -> torch.Tensor:
    """The sequence whose `shard_sequence` pieces are `shards` (rank order)."""
    if not load_balance:
        return torch.cat(list(shards), dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


class Block(NamedTuple):
    """One kernel call of a ring step: queries q_start:q_end of the rank's shard against keys k_start:k_end of the
    shard it holds, with `causal` and `window` (flash-attn's (left, right), top-left in these local positions).
    `shift`: the global position of its first query less that of its first key, where a score depends on positions
    (ALiBi: a plan made `positional`, whose blocks each lie within one chunk of queries and one of keys); 0
    otherwise."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    window: tuple[int, int]
    shift: int = 0


def chunks_of(rank: int, world: int, n: int, load_balance: bool) -> tuple[tuple[int, int, int], ...]:
    """(global start, local start, length) of each contiguous chunk of rank `rank`'s shard of length n."""
    if not load_balance:
        return ((rank * n, 0, n),)
    half = n // 2
    return ((rank * half, 0, half), ((2 * world - 1 - rank) * half, half, half))


def pair_block(q_chunk, k_chunk, lo: float, hi: float, positional: bool = False) -> Block | None:
    """The block of one (query chunk, key chunk) pair where query position p sees keys p + lo .. p + hi (lo may be
    -inf, hi +inf), None where it sees none. A partly visible pair is cut to the rows and keys that see something,
    so that its band holds its own diagonal and the kernel's top-left window covers it. `positional`: with its
    `shift` (else 0)."""
    (q_pos, q_local, nq), (k_pos, k_local, nk) = q_chunk, k_chunk
    d = k_pos - q_pos  # key j and query i of the pair are d + j - i apart
    if nk - 1 + d < lo or d - (nq - 1) > hi:
        return None
    if d - (nq - 1) >= lo and nk - 1 + d <= hi:
        return Block(q_local, q_local + nq, k_local, k_local + nk, False, NO_WINDOW, -d if positional else 0)
    lo, hi = lo - d, hi - d  # in the pair's local positions: i sees j with lo <= j - i <= hi
    skip_k = int(max(0, lo))  # keys every row is past
    skip_q = int(max(0, -hi))  # rows before every key
    lo, hi = lo - skip_k + skip_q, hi - skip_k + skip_q
    nq, nk = nq - skip_q, nk - skip_k
    if lo > -math.inf:
        nq = min(nq, int(nk - lo))  # rows whose first key lies beyond the chunk see nothing
    if hi < math.inf:
        nk = min(nk, int(nq + hi))  # keys past the last row's reach
    q0, k0 = q_local + skip_q, k_local + skip_k
    shift = skip_q - skip_k - d if positional else 0
    if lo == -math.inf and hi == 0:
        return Block(q0, q0 + nq, k0, k0 + nk, True, NO_WINDOW, shift)
    window = (-1 if lo == -math.inf else int(-lo), -1 if hi == math.inf else int(hi))
    return Block(q0, q0 + nq, k0, k0 + nk, False, window, shift)


def merged_blocks(blocks: list[Block]) -> list[Block]:
    """`blocks` with unmasked neighbours joined into one call (the same rows over adjacent keys, or the same keys
    over adjacent rows)."""
    masked = [b for b in blocks if b.causal or b.window != NO_WINDOW]
    full = sorted(b for b in blocks if not b.causal and b.window == NO_WINDOW)
    joined = True
    while joined:  # a pass joins disjoint pairs; the next joins what they made
        # NOTE: neighbours are looked up by the edge they would share, so that a document mask's many blocks cost
        # linear time a pass
        by_rows = {(b.q_start, b.q_end, b.k_start): i for i, b in enumerate(full)}
        by_keys = {(b.k_start, b.k_end, b.q_start): i for i, b in enumerate(full)}
        used, out = set(), []
        for i, a in enumerate(full):
            if i in used:
                continue
            j = by_rows.get((a.q_start, a.q_end, a.k_end))
            if j is not None and j not in used:
                new = Block(a.q_start, a.q_end, a.k_start, full[j].k_end, False, NO_WINDOW)
            else:
                j = by_keys.get((a.k_start, a.k_end, a.q_end))
                new = Block(a.q_start, full[j].q_end, a.k_start, a.k_end, False, NO_WINDOW) if j is not None \
                    and j not in used else a
            used.update((i, j) if new is not a else (i,))
            out.append(new)
        joined = len(out) < len(full)
        full = sorted(out)
    return sorted(masked + full)


def document_pieces(chunk, documents: tuple[int, ...]) -> dict[int, tuple[int, int, int]]:
    """The piece (global start, local start, length) of each document that chunk (global start, local start,
    length) holds, by document index; `documents` the offsets of the packed sequence (cu_seqlens)."""
    start, local, length = chunk
    pieces = {}
    first = bisect.bisect_right(documents, start) - 1  # the document holding the chunk's first position
    for d in range(max(first, 0), len(documents) - 1):
        lo, hi = max(documents[d], start), min(documents[d + 1], start + length)
        if lo >= start + length:
            break
        if lo < hi:
            pieces[d] = (lo, local + lo - start, hi - lo)
    return pieces


def pair_blocks(q_chunk, k_chunk, lo: float, hi: float, documents: tuple[int, ...] | None,
                positional: bool = False) -> list[Block]:
    """The blocks of one (query chunk, key chunk) pair: `pair_block`'s, or with `documents` one per document both
    chunks hold a piece of (its queries see only its keys, positions still global)."""
    if documents is None:
        pairs = [(q_chunk, k_chunk)]
    else:
        keys = document_pieces(k_chunk, documents)
        pairs = [(piece, keys[d]) for d, piece in document_pieces(q_chunk, documents).items() if d in keys]
    blocks = [pair_block(qp, kp, lo, hi, positional) for qp, kp in pairs]
    return [b for b in blocks if b is not None]


def ring_schedule(world: int, n: int, causal: bool, window: tuple[int, int], load_balance: bool,
                  documents: tuple[int, ...] | None = None, positional: bool = False):
    """Every rank's blocks per ring step (schedule[rank][step], step s holding the keys of rank rank - s), cut
    after the last step any rank needs. `documents`: the offsets of the documents packed into the sequence (global
    positions, the last world * n), each query seeing only its own document's keys; None: one sequence.
    `positional`: for scores that depend on positions (ALiBi), a block per (query chunk, key chunk) pair with its
    `shift`, none joined (joined chunks of a head-tail shard are not adjacent in the sequence)."""
    left, right = window
    lo = -math.inf if left < 0 else -left
    hi = math.inf if right < 0 else right
    if causal:
        hi = min(hi, 0)
    schedule = []
    for rank in range(world):
        mine = chunks_of(rank, world, n, load_balance)
        steps = []
        for step in range(world):
            theirs = chunks_of((rank - step) % world, world, n, load_balance)
            blocks = [b for qc in mine for kc in theirs for b in pair_blocks(qc, kc, lo, hi, documents, positional)]
            steps.append(sorted(blocks) if positional else merged_blocks(blocks))
        if causal and window == NO_WINDOW and documents is None and not positional:
            # NOTE: a shard's chunks are in sequence order, so its own keys are causal in local positions: one
            # call instead of two diagonal chunks and the full pair between them
            steps[0] = [Block(0, n, 0, n, True, NO_WINDOW)]
        schedule.append(steps)
    needed = 1 + max(s for steps in schedule for s, blocks in enumerate(steps) if blocks)
    return [steps[:needed] for steps in schedule]


class Pieces(NamedTuple):
    """Documents' pieces each against its own keys (a step's diagonal: rows q_start:q_end, the same keys), run as one
    varlen call whose sequences are the pieces (`offsets` their bounds from q_start), `causal` within each."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    offsets: tuple[int, ...]


def grouped_pieces(blocks: list[Block]) -> list[Block | Pieces]:
    """`blocks` with each run of two or more adjacent unwindowed diagonal blocks (rows and keys the same positions,
    one ending where the next starts, both causal or both not) joined into one `Pieces`."""
    out, run = [], []
    for b in sorted(blocks) + [None]:
        # (shift 0: a positional plan's block whose local diagonal is the sequence's, its queries at its keys')
        diagonal = (b is not None and (b.q_start, b.q_end) == (b.k_start, b.k_end) and b.window == NO_WINDOW
                    and b.shift == 0)
        if run and not (diagonal and b.q_start == run[-1].q_end and b.causal == run[0].causal):
            if len(run) == 1:
                out += run
            else:
                offsets = tuple(x.q_start - run[0].q_start for x in run) + (run[-1].q_end - run[0].q_start,)
                out.append(Pieces(run[0].q_start, run[-1].q_end, run[0].q_start, run[-1].q_end, run[0].causal,
                                  offsets))
            run = []
        if diagonal:
            run.append(b)
        elif b is not None:
            out.append(b)
    return sorted(out)


class Visit(NamedTuple):
    """Ring step `step` of one rank under documents, as a direct exchange: it receives the key rows of rank
    rank - step in the ranges `receive` (none at step 0: its own), one after another in one buffer, runs `blocks` on
    them (keys local to that buffer), and sends its own key rows in the ranges `send` to rank rank + step."""
    step: int
    blocks: list
    receive: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, int], ...]


def spans(ranges) -> tuple[tuple[int, int], ...]:
    """(start, end) `ranges` as sorted disjoint ranges, overlapping or touching ones joined."""
    out = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


def key_ranges(blocks) -> tuple[tuple[int, int], ...]:
    """The key rows `blocks` reach, as sorted disjoint (start, end) ranges."""
    return spans((b.k_start, b.k_end) for b in blocks)


def _packed_position(start: int, end: int, ranges) -> int:
    """Where rows start..end (within one of `ranges`) begin once the rows of `ranges` are packed one after another."""
    offset = 0
    for a, b in ranges:
        if a <= start < b:
            return start - a + offset
        offset += b - a
    raise AssertionError(f"rows {start}..{end} lie in none of {ranges}")


def packed_block(b: Block, rows, keys) -> Block:
    """Block b with its queries local to the rows of `rows` packed one after another and its keys to those of
    `keys` (either None: left as they are)."""
    if rows is not None:
        start = _packed_position(b.q_start, b.q_end, rows)
        b = b._replace(q_start=start, q_end=start + b.q_end - b.q_start)
    if keys is not None:
        start = _packed_position(b.k_start, b.k_end, keys)
        b = b._replace(k_start=start, k_end=start + b.k_end - b.k_start)
    return b


def document_visits(schedule, rank: int) -> list[Visit]:
    """Rank `rank`'s `Visit`s of a `ring_schedule` under documents: each step's keys come straight from the rank that
    owns them, only the rows its blocks reach (a document or two crossing a chunk boundary, where a ring would move
    the whole shard), and steps no block of this rank needs, sent or received, are left out."""
    world = len(schedule)
    visits = []
    for step, blocks in enumerate(schedule[rank]):
        receive = key_ranges(blocks) if step else ()
        send = key_ranges(schedule[(rank + step) % world][step]) if step else ()
        if step == 0 or receive or send:
            packed = [packed_block(b, None, receive) for b in blocks] if step else blocks
            visits.append(Visit(step, grouped_pieces(packed), receive, send))
    return visits


class Halo(NamedTuple):
    """One rank's exchange under a window its neighbours' rows cover (contiguous shards): it receives the last `left`
    key rows of the previous rank and the first `right` of the next, sends its last `to_next` rows to the next rank
    and its first `to_prev` to the previous, and runs `own` on its keys (every row: a query sees its own position),
    `before` and `after` on the received rows (positions local to each)."""
    left: int
    right: int
    to_next: int
    to_prev: int
    own: Block
    before: list[Block]
    after: list[Block]


def halo_schedule(world: int, n: int, causal: bool, window: tuple[int, int], load_balance: bool,
                  positional: bool = False):
    """Every rank's Halo where contiguous shards (not `load_balance`) meet a window no wider than a shard on either
    side (left and right in 0..n, right 0 when causal); None where the window needs the ring. `positional`: the
    blocks with their `shift`."""
    left, right = window
    right = 0 if causal else right
    if load_balance or not (0 <= left <= n and 0 <= right <= n):
        return None
    halos = []
    for rank in range(world):
        mine = (rank * n, 0, n)
        left_in = left if rank > 0 else 0
        right_in = right if rank < world - 1 else 0
        before = [pair_block(mine, (rank * n - left_in, 0, left_in), -left, right, positional)] if left_in else []
        after = [pair_block(mine, ((rank + 1) * n, 0, right_in), -left, right, positional)] if right_in else []
        halos.append(Halo(left_in, right_in, left if rank < world - 1 else 0, right if rank > 0 else 0,
                          pair_block(mine, mine, -left, right, positional), [b for b in before if b],
                          [b for b in after if b]))
    return halos
