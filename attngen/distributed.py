"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed group.

    shard = attngen.distributed.shard_sequence(x, world, rank)              # this rank's part of (B, H, N, D)
    out = attngen.distributed.context_parallel_attention(q, k, v, causal=True)   # q, k, v: shards
    full = attngen.distributed.unshard_sequence([out_0, out_1, ...])        # the sequence again

Ring attention: each rank keeps its query shard while the key/value shards travel around the ring (batched
isend/irecv, the next step's exchange posted before this step's kernels run); each step's partial (out, lse) is
merged in float32 with `merge_states`. Under `load_balance` the sequence is cut into 2W chunks and rank r holds
chunks r and 2W-1-r (head-tail), so that a causal mask gives every rank the same work; either way every
(query chunk, key chunk) pair a step meets is full, masked (causal or a window, in the chunks' local positions) or
empty, and empty ones are skipped, as are whole ring steps no rank needs (a sliding window). The backward
recomputes each step from the global out and lse (`Kernel.backward_saved`), accumulates dQ locally and sends
dK/dV around the ring behind their keys, back to the ranks that own them.

A sliding window no wider than a shard over contiguous shards (`load_balance=False`) needs no ring: each rank
receives only the key/value rows its window reaches beyond its shard (the previous rank's last `left`, the next
rank's first `right`) while it runs its own block, and the backward sends those rows' dK/dV back (`Halo`).

Documents packed into one sequence (`cu_seqlens`) cut each (query chunk, key chunk) pair further, into the pieces
of each document both chunks hold (`document_pieces`): a query piece meets its document's keys in an earlier chunk
in full, its own piece causally, a later one not at all, all in global positions, so each step runs only the pieces
that share a document (every document within one shard: no exchange at all). A chunk's pieces against their own
keys, one block each, run as one varlen call (`Pieces`): only a chunk's first document can reach back into another
chunk, so they are nearly all of the blocks, and a step with another rank's keys needs only the rows of the
document or two that cross a boundary. So the keys do not travel the ring: each step's rows come straight from the
rank that owns them, and their dK/dV go straight back (`Visit`), the next step's exchange posted before this
step's kernels run.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from .api import sdpa, varlen
from .api.kvcache import merge_states
from .errors import KernelInputError
from .lang.builtin import NO_WINDOW
from .runtime.registry import resolve

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence"]


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
    shard it holds, with `causal` and `window` (flash-attn's (left, right), top-left in these local positions)."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    window: tuple[int, int]


def chunks_of(rank: int, world: int, n: int, load_balance: bool) -> tuple[tuple[int, int, int], ...]:
    """(global start, local start, length) of each contiguous chunk of rank `rank`'s shard of length n."""
    if not load_balance:
        return ((rank * n, 0, n),)
    half = n // 2
    return ((rank * half, 0, half), ((2 * world - 1 - rank) * half, half, half))


def pair_block(q_chunk, k_chunk, lo: float, hi: float) -> Block | None:
    """The block of one (query chunk, key chunk) pair where query position p sees keys p + lo .. p + hi (lo may be
    -inf, hi +inf), None where it sees none. A partly visible pair is cut to the rows and keys that see something,
    so that its band holds its own diagonal and the kernel's top-left window covers it."""
    (q_pos, q_local, nq), (k_pos, k_local, nk) = q_chunk, k_chunk
    d = k_pos - q_pos  # key j and query i of the pair are d + j - i apart
    if nk - 1 + d < lo or d - (nq - 1) > hi:
        return None
    if d - (nq - 1) >= lo and nk - 1 + d <= hi:
        return Block(q_local, q_local + nq, k_local, k_local + nk, False, NO_WINDOW)
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
    if lo == -math.inf and hi == 0:
        return Block(q0, q0 + nq, k0, k0 + nk, True, NO_WINDOW)
    window = (-1 if lo == -math.inf else int(-lo), -1 if hi == math.inf else int(hi))
    return Block(q0, q0 + nq, k0, k0 + nk, False, window)


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


def pair_blocks(q_chunk, k_chunk, lo: float, hi: float, documents: tuple[int, ...] | None) -> list[Block]:
    """The blocks of one (query chunk, key chunk) pair: `pair_block`'s, or with `documents` one per document both
    chunks hold a piece of (its queries see only its keys, positions still global)."""
    if documents is None:
        pairs = [(q_chunk, k_chunk)]
    else:
        keys = document_pieces(k_chunk, documents)
        pairs = [(piece, keys[d]) for d, piece in document_pieces(q_chunk, documents).items() if d in keys]
    blocks = [pair_block(qp, kp, lo, hi) for qp, kp in pairs]
    return [b for b in blocks if b is not None]


def ring_schedule(world: int, n: int, causal: bool, window: tuple[int, int], load_balance: bool,
                  documents: tuple[int, ...] | None = None):
    """Every rank's blocks per ring step (schedule[rank][step], step s holding the keys of rank rank - s), cut
    after the last step any rank needs. `documents`: the offsets of the documents packed into the sequence (global
    positions, the last world * n), each query seeing only its own document's keys; None: one sequence."""
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
            steps.append(merged_blocks([b for qc in mine for kc in theirs for b in pair_blocks(qc, kc, lo, hi,
                                                                                               documents)]))
        if causal and window == NO_WINDOW and documents is None:
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
        diagonal = b is not None and (b.q_start, b.q_end) == (b.k_start, b.k_end) and b.window == NO_WINDOW
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


def key_ranges(blocks) -> tuple[tuple[int, int], ...]:
    """The key rows `blocks` reach, as sorted disjoint (start, end) ranges."""
    ranges = []
    for start, end in sorted((b.k_start, b.k_end) for b in blocks):
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((start, end))
    return tuple(ranges)


def _packed_keys(b: Block, ranges) -> Block:
    """Block b with its keys local to the rows of `ranges` packed one after another."""
    offset = 0
    for start, end in ranges:
        if start <= b.k_start < end:
            return b._replace(k_start=b.k_start - start + offset, k_end=b.k_end - start + offset)
        offset += end - start
    raise AssertionError(f"{b} reaches no rows of {ranges}")


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
            packed = [_packed_keys(b, receive) for b in blocks] if step else blocks
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


def halo_schedule(world: int, n: int, causal: bool, window: tuple[int, int], load_balance: bool):
    """Every rank's Halo where contiguous shards (not `load_balance`) meet a window no wider than a shard on either
    side (left and right in 0..n, right 0 when causal); None where the window needs the ring."""
    left, right = window
    right = 0 if causal else right
    if load_balance or not (0 <= left <= n and 0 <= right <= n):
        return None
    halos = []
    for rank in range(world):
        mine = (rank * n, 0, n)
        left_in = left if rank > 0 else 0
        right_in = right if rank < world - 1 else 0
        before = [pair_block(mine, (rank * n - left_in, 0, left_in), -left, right)] if left_in else []
        after = [pair_block(mine, ((rank + 1) * n, 0, right_in), -left, right)] if right_in else []
        halos.append(Halo(left_in, right_in, left if rank < world - 1 else 0, right if rank > 0 else 0,
                          pair_block(mine, mine, -left, right), [b for b in before if b], [b for b in after if b]))
    return halos


class _Ring(NamedTuple):
    """This rank's place in the group: P2P peers as global ranks."""
    group: object
    rank: int
    world: int

    def peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)


def _post(ring: _Ring, sends, receives):
    """Post a send of each (group rank offset, tensor, tag) of `sends` and a receive of a tensor like the tensor of
    each (offset, tensor, tag) of `receives`; returns (the receive buffers, the requests). Every message of a call
    goes through here (the tests count the bytes sent by wrapping it). The tensors sent must be contiguous and
    kept alive by the caller until the requests are waited on (an asynchronous send reads them until then)."""
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for _, t, _ in receives]
    ops = [dist.P2POp(dist.isend, t, ring.peer(o), ring.group, tag) for o, t, tag in sends]
    ops += [dist.P2POp(dist.irecv, b, ring.peer(o), ring.group, tag) for (o, _, tag), b in zip(receives, buffers)]
    return buffers, (dist.batch_isend_irecv(ops) if ops else [])


def _exchange(ring: _Ring, tensors, send_to: int, recv_from: int, tag: int):
    """Post the sends of `tensors` to group rank offset `send_to` and the receives of tensors like them from
    `recv_from`; returns (the receive buffers, the requests)."""
    return _post(ring, [(send_to, t, tag + i) for i, t in enumerate(tensors)],
                 [(recv_from, t, tag + i) for i, t in enumerate(tensors)])


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _Kernels:
    """The kernel (and softmax scale) of each mask a call's blocks need, checked once per call."""

    def __init__(self, q, k, v, scale, softcap):
        self.args, self.softcap, self.found = (q, k, v, scale), softcap, {}

    def __call__(self, block: Block | Pieces):
        if isinstance(block, Pieces):
            return self.varlen(block)
        mask = (block.causal, block.window)
        if mask not in self.found:
            q, k, v, scale = self.args
            variant = None
            if block.window != NO_WINDOW or self.softcap:
                variant = sdpa._checked_variant(q, block.causal, block.window, self.softcap, None, None)
            plan = sdpa._checked_plan(q, k, v, None, 0.0, block.causal, scale, True, variant)
            self.found[mask] = resolve(plan.key), plan.scale
        return self.found[mask]

    def varlen(self, pieces: Pieces):
        """(the varlen kernel, its scale, cu_seqlens of the pieces on q's device)."""
        cu = self.found.get(("cu_seqlens", pieces.offsets))
        if cu is None:
            cu = self.found[("cu_seqlens", pieces.offsets)] = torch.tensor(pieces.offsets, dtype=torch.int32,
                                                                            device=self.args[0].device)
        mask = ("varlen", pieces.causal)
        if mask not in self.found:
            q, k, v, scale = self.args
            rows = slice(pieces.q_start, pieces.q_end)
            longest = max(b - a for a, b in zip(pieces.offsets, pieces.offsets[1:]))
            plan = varlen._checked_plan(*(t[0, :, rows].transpose(0, 1) for t in (q, k, v)), cu, cu, longest,
                                        longest, 0.0, scale, pieces.causal, NO_WINDOW, self.softcap, None, None,
                                        None, None)
            self.found[mask] = resolve(plan.key), plan.scale
        return (*self.found[mask], cu)


def _packed(t, b: Block | Pieces, i: int):
    """Batch entry i of t's rows of pieces b as varlen's packed (rows, heads, dim) view (no copy)."""
    return t[i, :, b.q_start:b.q_end].transpose(0, 1)


def _batched(parts):
    """(B, ...) of B per-entry tensors (a view where B is 1)."""
    return parts[0][None] if len(parts) == 1 else torch.stack(parts)


def _pieces_forward(kernels, b: Pieces, q, k, v):
    """(out, lse) of pieces b as a block's kernel returns them: one varlen call a batch entry."""
    kernel, scale, cu = kernels(b)
    parts = [kernel.varlen_forward(*(_packed(t, b, i) for t in (q, k, v)), cu, cu, cu.diff(), scale)
             for i in range(q.shape[0])]
    return _batched([o.transpose(0, 1) for o, _ in parts]), _batched([lse for _, lse in parts])


def _pieces_grads(kernels, b: Pieces, q, k, v, out, lse, do):
    """(dq, dk, dv) of pieces b's rows, as `_block_grads` returns a block's."""
    kernel, scale, cu = kernels(b)
    grads = [kernel.varlen_backward(*(_packed(t, b, i) for t in (q, k, v, out)),
                                    lse[i, :, b.q_start:b.q_end].contiguous(), _packed(do, b, i), cu, cu, cu.diff(),
                                    scale)[:3] for i in range(q.shape[0])]
    return tuple(_batched([g[j].transpose(0, 1) for g in grads]) for j in range(3))


def _forward_block(kernels, b: Block, q, k, v, out, lse) -> None:
    """Merge block b's partial (out, lse) into `out` (float32 in the ring, the inputs' dtype in the halo exchange)
    and `lse` of this rank's queries."""
    if isinstance(b, Pieces):
        part, part_lse = _pieces_forward(kernels, b, q, k, v)
    else:
        kernel, scale = kernels(b)
        part, part_lse = kernel.forward(q[:, :, b.q_start:b.q_end], k[:, :, b.k_start:b.k_end],
                                        v[:, :, b.k_start:b.k_end], scale)
    rows = slice(b.q_start, b.q_end)
    merged, merged_lse = merge_states(out[:, :, rows].transpose(1, 2), lse[:, :, rows],
                                      part.transpose(1, 2), part_lse)
    out[:, :, rows] = merged.transpose(1, 2)
    lse[:, :, rows] = merged_lse


def _block_grads(kernels, b: Block, q, k, v, out, lse, do):
    """(dq, dk, dv) of block b's rows and keys, in their dtype."""
    if isinstance(b, Pieces):
        return _pieces_grads(kernels, b, q, k, v, out, lse, do)
    kernel, scale = kernels(b)
    rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
    return kernel.backward_saved(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                 lse[:, :, rows].contiguous(), do[:, :, rows], scale)


def _backward_block(kernels, b: Block, q, k, v, out, lse, do, dq, dk, dv) -> None:
    """Add block b's gradients to the float32 dq (of q's rows) and dk, dv (of k and v's rows)."""
    g = _block_grads(kernels, b, q, k, v, out, lse, do)
    rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
    dq[:, :, rows] += g[0]
    dk[:, :, keys] += g[1]
    dv[:, :, keys] += g[2]


def _ring_forward(ring, steps, kernels, q, k, v):
    """(out float32, lse) of this rank's queries over every rank's keys."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(q.shape[:3], -math.inf, device=q.device, dtype=torch.float32)
    kv = (k, v)
    for step, blocks in enumerate(steps):
        if step + 1 < len(steps):
            following, requests = _exchange(ring, kv, 1, -1, 0)
        for b in blocks:
            _forward_block(kernels, b, q, *kv, out, lse)
        if step + 1 < len(steps):
            _wait(requests)
            kv = tuple(following)
    return out, lse


def _ring_backward(ring, steps, kernels, q, k, v, out, lse, do):
    """(dq, dk, dv) float32: dq of this rank's queries, dk and dv of its keys, gathered from every rank."""
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = (k, v)
    incoming = None  # (buffers, requests): the dk, dv the previous rank has summed for the keys this rank holds next
    last = len(steps) - 1
    for step, blocks in enumerate(steps):
        if step < last:
            following, requests = _exchange(ring, kv, 1, -1, 0)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        for b in blocks:
            _backward_block(kernels, b, q, *kv, out, lse, do, dq, dk, dv)
        if incoming is not None:
            _wait(incoming[1])
            dk += incoming[0][0]
            dv += incoming[0][1]
        if step < last:
            # these keys go to the next rank: their gradient follows them there
            incoming = _exchange(ring, (dk, dv), 1, -1, 2)
            _wait(requests)
            kv = tuple(following)
    if last == 0:
        return dq, dk, dv
    # the keys held now are those of rank - last: their gradient goes home, ours comes from rank + last
    (dk, dv), requests = _exchange(ring, (dk, dv), -last, last, 4)
    _wait(requests)
    return dq, dk, dv


def _halo_forward(ring, halo: Halo, kernels, q, k, v):
    """(out, lse, the received (k, v) rows before the shard or None, those after or None): the exchange is posted
    before the shard's own block runs.

    NOTE: out stays in q's dtype: the own block covers every row and writes it, and only the rows a neighbour's
    keys reach merge (in float32, rounded once, as the ring's float32 accumulator would be), which spares the full
    float32 copy of the shard the ring needs."""
    n = k.shape[2]
    sends = [(1, t[:, :, n - halo.to_next:].contiguous(), i) for i, t in enumerate((k, v)) if halo.to_next]
    sends += [(-1, t[:, :, :halo.to_prev].contiguous(), 2 + i) for i, t in enumerate((k, v)) if halo.to_prev]
    receives = [(-1, t[:, :, :halo.left], i) for i, t in enumerate((k, v)) if halo.left]
    receives += [(1, t[:, :, :halo.right], 2 + i) for i, t in enumerate((k, v)) if halo.right]
    buffers, requests = _post(ring, sends, receives)
    kernel, scale = kernels(halo.own)
    out, lse = kernel.forward(q, k, v, scale)
    _wait(requests)
    before = tuple(buffers[:2]) if halo.left else None
    after = tuple(buffers[-2:]) if halo.right else None
    for rows, blocks in ((before, halo.before), (after, halo.after)):
        for b in blocks:
            _forward_block(kernels, b, q, *rows, out, lse)
    return out, lse, before, after


def _halo_backward(ring, halo: Halo, kernels, q, k, v, before, after, out, lse, do):
    """(dq, dk, dv) in q, k and v's dtype: the received rows' dK/dV go back to their ranks while the shard's own
    block runs (each is one kernel's output, so its dtype loses nothing on the way)."""
    n = k.shape[2]
    sends, dq_parts = [], []
    for rows, blocks, offset, tag in ((before, halo.before, -1, 0), (after, halo.after, 1, 2)):
        if rows is None:
            continue
        grads = [torch.zeros_like(t) for t in rows]
        for b in blocks:
            g = _block_grads(kernels, b, q, *rows, out, lse, do)
            dq_parts.append((slice(b.q_start, b.q_end), g[0]))
            grads[0][:, :, b.k_start:b.k_end] += g[1]
            grads[1][:, :, b.k_start:b.k_end] += g[2]
        sends += [(offset, g, tag + i) for i, g in enumerate(grads)]
    receives = [(1, t[:, :, n - halo.to_next:], i) for i, t in enumerate((k, v)) if halo.to_next]
    receives += [(-1, t[:, :, :halo.to_prev], 2 + i) for i, t in enumerate((k, v)) if halo.to_prev]
    buffers, requests = _post(ring, sends, receives)
    dq, dk, dv = _block_grads(kernels, halo.own, q, k, v, out, lse, do)
    for rows, part in dq_parts:
        dq[:, :, rows] += part
    _wait(requests)
    if halo.to_next:
        dk[:, :, n - halo.to_next:] += buffers[0]
        dv[:, :, n - halo.to_next:] += buffers[1]
    if halo.to_prev:
        dk[:, :, :halo.to_prev] += buffers[-2]
        dv[:, :, :halo.to_prev] += buffers[-1]
    return dq, dk, dv


def _rows(t, ranges):
    """t's rows (dim 2) in `ranges`, one after another in one contiguous tensor."""
    return torch.cat([t[:, :, a:b] for a, b in ranges], 2) if len(ranges) > 1 else t[:, :, ranges[0][0]:ranges[0][1]]


def _length(ranges) -> int:
    return sum(b - a for a, b in ranges)


def _post_visit(ring, visit: Visit, k, v):
    """Post visit's exchange of K and V rows (receive buffers, requests, the sends kept alive until waited on),
    tagged by its step (the ranks' lists of visits differ, the steps they meet at do not)."""
    tag = 2 * visit.step
    sends = [(visit.step, _rows(t, visit.send).contiguous(), tag + i) for i, t in enumerate((k, v)) if visit.send]
    receives = [(-visit.step, t[:, :, :_length(visit.receive)], tag + i) for i, t in enumerate((k, v))
                if visit.receive]
    return (*_post(ring, sends, receives), sends)


def _visits_forward(ring, visits, kernels, q, k, v):
    """(out float32, lse, the K/V rows each visit received): each visit's exchange is posted before the previous
    visit's kernels run."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(q.shape[:3], -math.inf, device=q.device, dtype=torch.float32)
    received = []
    posted = _post_visit(ring, visits[1], k, v) if len(visits) > 1 else None
    for i, visit in enumerate(visits):
        kv = (k, v)
        if i:
            buffers, requests, _ = posted
            _wait(requests)
            kv = tuple(buffers) if visit.receive else (k[:, :, :0], v[:, :, :0])
            received.append(kv)
            posted = _post_visit(ring, visits[i + 1], k, v) if i + 1 < len(visits) else None
        for b in visit.blocks:
            _forward_block(kernels, b, q, *kv, out, lse)
    return out, lse, received


def _visits_backward(ring, visits, kernels, q, k, v, received, out, lse, do):
    """(dq, dk, dv) float32: the received rows' dK/dV go straight back to their ranks as each visit finishes, and
    the rows this rank sent come back with theirs."""
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    for b in visits[0].blocks:
        _backward_block(kernels, b, q, k, v, out, lse, do, dq, dk, dv)
    pending = []
    for visit, rows in zip(visits[1:], received):
        grads = [torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in rows]
        for b in visit.blocks:
            _backward_block(kernels, b, q, *rows, out, lse, do, dq, *grads)
        tag = 2 * visit.step
        sends = [(-visit.step, g, tag + i) for i, g in enumerate(grads) if visit.receive]
        receives = [(visit.step, t[:, :, :_length(visit.send)], tag + i) for i, t in enumerate((dk, dv))
                    if visit.send]
        pending.append((visit.send, *_post(ring, sends, receives), grads))
    for ranges, buffers, requests, _ in pending:
        _wait(requests)
        offset = 0
        for a, b in ranges:
            dk[:, :, a:b] += buffers[0][:, :, offset:offset + b - a]
            dv[:, :, a:b] += buffers[1][:, :, offset:offset + b - a]
            offset += b - a
    return dq, dk, dv


class _ContextParallel(torch.autograd.Function):
    """The ring (`steps` a list of ring steps), the halo exchange (`steps` a Halo) or documents' direct exchange
    (`steps` a list of `Visit`s) as one differentiable call."""

    @staticmethod
    def forward(ctx, q, k, v, ring, steps, kernels):
        ctx.halo_rows = ctx.received = None
        if isinstance(steps, Halo):
            out, lse, *ctx.halo_rows = _halo_forward(ring, steps, kernels, q, k, v)
        elif isinstance(steps[0], Visit):
            out, lse, ctx.received = _visits_forward(ring, steps, kernels, q, k, v)
        else:
            out, lse = _ring_forward(ring, steps, kernels, q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.steps, ctx.kernels = ring, steps, kernels
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.halo_rows is not None:
            dq, dk, dv = _halo_backward(ctx.ring, ctx.steps, ctx.kernels, q, k, v, *ctx.halo_rows, out, lse,
                                        do.contiguous())
        elif ctx.received is not None:
            dq, dk, dv = _visits_backward(ctx.ring, ctx.steps, ctx.kernels, q, k, v, ctx.received, out, lse,
                                          do.contiguous())
        else:
            dq, dk, dv = _ring_backward(ctx.ring, ctx.steps, ctx.kernels, q, k, v, out, lse, do.contiguous())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                               causal: bool = False, scale: float | None = None, load_balance: bool = True,
                               window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                               cu_seqlens: torch.Tensor | None = None, return_lse: bool = False):
    """Attention of a sequence sharded across the ranks of `group` (None: the default group), each rank passing its
    shard: q (B, H, N_local, D), k and v (B, H_KV, N_local, D), H a multiple of H_KV, the layout `shard_sequence`
    makes with the same `load_balance` (head-tail chunks; False: contiguous parts). Returns this rank's output shard
    (B, H, N_local, D), and its log-sum-exp (B, H, N_local) float32 when `return_lse`. Differentiable in q, k, v.

    `causal`, `scale`, `window_size` and `softcap` as `attngen.attention`'s, over the positions of the whole
    sequence. `cu_seqlens`: documents packed into the sequence (training's packed batches), int32 (documents + 1,)
    offsets over the whole sequence (0 first, world * N_local last), the same on every rank; each query then sees
    only its own document's keys (causal within it under `causal`, exactly across shard boundaries); each rank runs
    only the (query, key) pieces of a document that both shards hold, and receives from each other rank only the key
    rows its documents reach there, not whole shards around the ring. Ring steps no rank needs are not run. Pass
    `load_balance=False` (and shards made with it) for a sliding window no wider than a shard: every query sees at
    most the window's keys, so contiguous shards are balanced already, and each rank then exchanges only the rows
    the window reaches into its neighbours' shards instead of whole shards around the ring (head-tail chunks put a
    chunk's neighbour on the far side of the ring, and every ring step moves a whole shard); with `cu_seqlens` a
    window cuts the documents' rows exchanged instead. Every rank must pass shards of one shape and the same
    arguments; a ValueError names the argument that differs or does not fit (a group of one rank, an odd shard under
    `load_balance`). Collective: every rank of `group` must call it, and its backward, together.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise KernelInputError("context_parallel_attention needs torch.distributed initialised "
                               "(torch.distributed.init_process_group)")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        raise KernelInputError(f"group has {world} rank; context parallelism needs at least 2 "
                               "(attngen.attention runs one rank's whole sequence)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise KernelInputError(f"{name} must be a 4-D tensor (batch, heads, seq, head_dim), this rank's shard")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise KernelInputError(f"q, k and v must hold one shard of the sequence: their lengths are {q.shape[2]}, "
                               f"{k.shape[2]} and {v.shape[2]}")
    if load_balance and q.shape[2] % 2:
        raise KernelInputError(f"load_balance=True cuts each shard in two chunks: its length {q.shape[2]} must be "
                               "even (or pass load_balance=False with shards from shard_sequence(load_balance=False))")
    window = sdpa.checked_window(causal, window_size, "causal")
    softcap = sdpa.checked_softcap(softcap, None)
    documents = None if cu_seqlens is None else checked_documents(cu_seqlens, world * q.shape[2])
    _check_same_on_every_rank(group, world, q, k, causal, scale, load_balance, window, softcap, documents)
    halos = None if documents else halo_schedule(world, q.shape[2], bool(causal), window, load_balance)
    schedule = None if halos else ring_schedule(world, q.shape[2], bool(causal), window, load_balance, documents)
    steps = halos[rank] if halos else document_visits(schedule, rank) if documents else schedule[rank]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = _ContextParallel.apply(q, k, v, _Ring(group, rank, world), steps, _Kernels(q, k, v, scale, softcap))
    return (out, lse) if return_lse else out


def checked_documents(cu_seqlens, total: int) -> tuple[int, ...]:
    """The document offsets `cu_seqlens` holds, checked against a packed sequence of `total` positions (a
    ValueError, naming cu_seqlens, where they do not fit)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise KernelInputError(f"cu_seqlens must be a torch.Tensor (int32 document offsets), not "
                               f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise KernelInputError(f"cu_seqlens must be int32; got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise KernelInputError(f"cu_seqlens must be 1-D (documents + 1,) with at least one document; got shape "
                               f"{tuple(cu_seqlens.shape)}")
    offsets = tuple(cu_seqlens.tolist())  # (one copy to the host: the schedule is planned there)
    if offsets[0] != 0:
        raise KernelInputError(f"cu_seqlens must start at 0; starts at {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise KernelInputError(f"cu_seqlens must be non-decreasing (document offsets); got {list(offsets)}")
    if offsets[-1] != total:
        raise KernelInputError(f"cu_seqlens must end at the global sequence length {total} (every rank's shard "
                               f"together); ends at {offsets[-1]}")
    return offsets


def _check_same_on_every_rank(group, world, q, k, causal, scale, load_balance, window, softcap, documents) -> None:
    """Raise, naming it, where an argument differs across the ranks (one all-gather of a few numbers)."""
    names = ("batch", "q heads", "k heads", "shard length", "head dim", "dtype", "causal", "scale", "load_balance",
             "window_size left", "window_size right", "softcap", "cu_seqlens documents", "cu_seqlens offsets")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # NOTE: the offsets travel as one weighted sum modulo a prime (below 2^53: exact in float64), so that the
    # all-gather stays a few numbers however many documents there are
    offsets = [-1, -1] if documents is None else [len(documents),
                                                   sum(i * x for i, x in enumerate(documents, 1)) % 1_000_000_007]
    mine = torch.tensor([*q.shape[:2], k.shape[1], q.shape[2], q.shape[3],
                         dtypes.index(q.dtype) if q.dtype in dtypes else -1, bool(causal),
                         -1.0 if scale is None else float(scale), bool(load_balance), *window, softcap, *offsets],
                        dtype=torch.float64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()  # (one copy to the host, not one a value)
    for i, name in enumerate(names):
        values = table[:, i].tolist()
        if len(set(values)) > 1:
            argument = {"shard length": "q", "q heads": "q", "batch": "q", "head dim": "q", "dtype": "q",
                        "k heads": "k"}.get(
                name, name.split()[0])
            raise KernelInputError(f"{argument}: the ranks disagree on the {name} ({values}); every rank must pass "
                                   "shards of one shape and the same arguments")
