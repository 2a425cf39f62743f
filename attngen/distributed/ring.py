"""The execution of context-parallel attention's plan (`schedule`): the point-to-point exchanges over the group
(`_Ring`, `_post`: batched isend/irecv; the ring's after each step's kernels, or beside them where
policy.context_parallel.overlap_exchanges says so), the kernels of a block or of a run of
document pieces (`_Kernels`), and the forward and backward loops of the ring, the halo exchange and the documents'
direct exchange, each step's partial (out, lse) merged in float32."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..api import sdpa, varlen
from ..api.sdpa import _DTYPES
from ..api.kvcache import merge_states
from ..api.merge import merge
from ..lang.builtin import NO_WINDOW, positional_alibi_spec
from ..policy import context_parallel
from ..runtime.arguments import check_attention_inputs, check_scale
from ..runtime.kernel import load
from ..runtime.registry import resolve
from .schedule import Block, Halo, Pieces, Visit
from .phases import at, phase

# (above every visit's tags, 2 * step + 0 or 1)
_LOAN_TAG = 1 << 12


class _Ring(NamedTuple):
    """This rank's place in the group: P2P peers as global ranks."""
    group: object
    rank: int
    world: int

    def peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)


_EXCHANGE_GROUPS: dict = {}


def exchange_group(group):
    """The group the ring's messages go through: `group`, or under policy.context_parallel.HIGH_PRIORITY_EXCHANGES
    and NCCL a group of the same ranks whose stream has high priority, made on the first call (collective among
    `group`'s ranks only, as every call is) and kept. Its rank numbering is `group`'s (ranks in order; a group that
    numbers its ranks otherwise is kept as it is)."""
    if not context_parallel.HIGH_PRIORITY_EXCHANGES or dist.get_backend(group) != "nccl":
        return group
    found = _EXCHANGE_GROUPS.get(group)
    if found is None:
        ranks = dist.get_process_group_ranks(group)
        found = group
        if ranks == sorted(ranks):
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            found = dist.new_group(ranks, pg_options=options, use_local_synchronization=True)
        _EXCHANGE_GROUPS[group] = found
    return found


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


def _wait(requests, name: str = "exchange wait") -> None:
    """Wait on `requests`, recorded as phase `name` (phases.py) when recording and there are any."""
    if not requests:
        return
    with phase(name):
        for request in requests:
            request.wait()


def alibi_side(block: Block) -> str | None:
    """Which side of the sequence's diagonal every pair an ALiBi block keeps lies on: "below" where each distance
    q - k + shift (its local positions, `Block.shift`) is >= 0, "above" where each is <= 0, None where they have both
    signs. Its kernel then takes the score without the abs (`positional_alibi_spec`'s `side`), linear on every block."""
    nq, nk = block.q_end - block.q_start, block.k_end - block.k_start
    left, right = block.window
    # the least and the most q - k among the pairs the block's mask keeps (causal: k <= q; a window's sides)
    least = 0 if block.causal else max(-right, -(nk - 1)) if right >= 0 else -(nk - 1)
    most = min(left, nq - 1) if left >= 0 else nq - 1
    if block.shift + least >= 0:
        return "below"
    if block.shift + most <= 0:
        return "above"
    return None


class _Kernels:
    """The kernel (and softmax scale) of each mask a call's blocks need, checked once per call. Inside `margin()`
    the kernels' persistent grids leave policy.context_parallel.SM_MARGIN multiprocessors to the exchanges' NCCL
    kernels (the modules' SM_MARGIN, given back on leaving).

    With ALiBi (`alibi`: the slopes, (B, H) float32) a block's scores depend on its global positions, so its kernel
    is a spec whose score reads them: `s - slopes[b, h] * abs(q - k + shift[b])`, `shift` the block's (`Block.shift`,
    `tensors`), its mask the block's in local positions (`lang.builtin.positional_alibi_spec`); without the abs where
    every pair the block keeps lies on one side of the diagonal (`alibi_side`)."""

    def __init__(self, q, k, v, scale, softcap, alibi=None):
        self.args, self.softcap, self.alibi, self.found = (q, k, v, scale), softcap, alibi, {}
        self.saved = None  # inside margin(): {module: its SM_MARGIN before}
        self.shifts = {}  # ALiBi: {shift: its (B,) int32 tensor}

    @contextlib.contextmanager
    def margin(self):
        self.saved = {}
        try:
            for found in self.found.values():  # ((kernel, scale) by mask; cu_seqlens tensors by offsets)
                if isinstance(found, tuple):
                    self._hold(found[0])
            yield
        finally:
            for module, before in self.saved.items():
                module.SM_MARGIN = before
            self.saved = None

    def _hold(self, kernel) -> None:
        module = getattr(kernel, "module", None)
        if self.saved is not None and module is not None and hasattr(module, "SM_MARGIN") \
                and module not in self.saved:
            self.saved[module] = module.SM_MARGIN
            module.SM_MARGIN = context_parallel.SM_MARGIN

    def __call__(self, block: Block | Pieces):
        if isinstance(block, Pieces):
            return self.varlen(block)
        mask = (block.causal, block.window)
        if self.alibi is not None:
            side = alibi_side(block)
            mask = ("alibi", side, *mask)
            if mask not in self.found:
                q, k, v, scale = self.args
                head_dim_v = v.shape[-1] if v.shape[-1] != q.shape[-1] else None
                kernel = load(positional_alibi_spec(_DTYPES[q.dtype], q.shape[-1], block.causal, block.window,
                                                    head_dim_v, side))
                check_attention_inputs(kernel.spec, q, k, v)
                self.found[mask] = kernel, check_scale(scale, kernel.spec)
                self._hold(kernel)
            return self.found[mask]
        if mask not in self.found:
            q, k, v, scale = self.args
            variant = None
            if block.window != NO_WINDOW or self.softcap:
                variant = sdpa._checked_variant(q, block.causal, block.window, self.softcap, None, None)
            plan = sdpa._checked_plan(q, k, v, None, 0.0, block.causal, scale, True, variant)
            self.found[mask] = resolve(plan.key), plan.scale
            self._hold(self.found[mask][0])
        return self.found[mask]

    def tensors(self, block: Block) -> tuple:
        """The run-time tensors of block's kernel: none, or with ALiBi the slopes and the block's shift."""
        if self.alibi is None:
            return ()
        shift = self.shifts.get(block.shift)
        if shift is None:
            shift = self.shifts[block.shift] = torch.full(self.alibi.shape[:1], block.shift, dtype=torch.int32,
                                                          device=self.alibi.device)
        return self.alibi, shift

    def varlen_tensors(self, i: int) -> tuple:
        """The run-time tensors of the varlen kernel's call on batch entry i: none, or with ALiBi its slopes (H,)."""
        return () if self.alibi is None else (self.alibi[i],)

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
            # (ALiBi: pieces on the diagonal, each query and key at the same positions, so the varlen kernel's own
            # ALiBi over a piece's local positions is the sequence's)
            slopes = None if self.alibi is None else self.alibi[0]
            plan = varlen._checked_plan(*(t[0, :, rows].transpose(0, 1) for t in (q, k, v)), cu, cu, longest,
                                        longest, 0.0, scale, pieces.causal, NO_WINDOW, self.softcap, slopes, None,
                                        None, None)
            self.found[mask] = resolve(plan.key), plan.scale
            self._hold(self.found[mask][0])
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
    parts = [kernel.varlen_forward(*(_packed(t, b, i) for t in (q, k, v)), cu, cu, cu.diff(), scale,
                                   kernels.varlen_tensors(i)) for i in range(q.shape[0])]
    return _batched([o.transpose(0, 1) for o, _ in parts]), _batched([lse for _, lse in parts])


def _pieces_grads(kernels, b: Pieces, q, k, v, out, lse, do):
    """(dq, dk, dv) of pieces b's rows, as `_block_grads` returns a block's."""
    kernel, scale, cu = kernels(b)
    grads = [kernel.varlen_backward(*(_packed(t, b, i) for t in (q, k, v, out)),
                                    lse[i, :, b.q_start:b.q_end].contiguous(), _packed(do, b, i), cu, cu, cu.diff(),
                                    scale, kernels.varlen_tensors(i))[:3] for i in range(q.shape[0])]
    return tuple(_batched([g[j].transpose(0, 1) for g in grads]) for j in range(3))


def _forward_block(kernels, b: Block, q, k, v, out, lse) -> None:
    """Merge block b's partial (out, lse) into `out` (float32 in the ring, the inputs' dtype in the halo exchange)
    and `lse` of this rank's queries."""
    with phase("kernels"):
        if isinstance(b, Pieces):
            part, part_lse = _pieces_forward(kernels, b, q, k, v)
        else:
            kernel, scale = kernels(b)
            part, part_lse = kernel.forward(q[:, :, b.q_start:b.q_end], k[:, :, b.k_start:b.k_end],
                                            v[:, :, b.k_start:b.k_end], scale, tensors=kernels.tensors(b))
    with phase("merge"):
        _merge(out, lse, slice(b.q_start, b.q_end), part, part_lse)


def _merge(out, lse, rows: slice, part, part_lse) -> None:
    """Merge the partial (part, part_lse) of `rows` into `out` and `lse` (in one kernel, in place, under
    policy.context_parallel.FUSED_MERGE)."""
    if context_parallel.FUSED_MERGE:
        merge(out[:, :, rows], lse[:, :, rows], part, part_lse, out[:, :, rows], lse[:, :, rows])
        return
    merged, merged_lse = merge_states(out[:, :, rows].transpose(1, 2), lse[:, :, rows],
                                      part.transpose(1, 2), part_lse)
    out[:, :, rows] = merged.transpose(1, 2)
    lse[:, :, rows] = merged_lse


def _block_grads(kernels, b: Block, q, k, v, out, lse, do):
    """(dq, dk, dv) of block b's rows and keys, in their dtype (phase "kernels")."""
    with phase("kernels"):
        if isinstance(b, Pieces):
            return _pieces_grads(kernels, b, q, k, v, out, lse, do)
        kernel, scale = kernels(b)
        rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
        return kernel.backward_saved(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                     lse[:, :, rows].contiguous(), do[:, :, rows], scale, kernels.tensors(b))


def _backward_block(kernels, b: Block, q, k, v, out, lse, do, dq, dk, dv) -> None:
    """Add block b's gradients to the float32 dq (of q's rows) and dk, dv (of k and v's rows)."""
    g = _block_grads(kernels, b, q, k, v, out, lse, do)
    rows, keys = slice(b.q_start, b.q_end), slice(b.k_start, b.k_end)
    with phase("merge"):
        dq[:, :, rows] += g[0]
        dk[:, :, keys] += g[1]
        dv[:, :, keys] += g[2]


def _ring_forward(ring, steps, kernels, q, k, v):
    """(out float32, lse) of this rank's queries over every rank's keys. The next step's keys travel beside this
    step's kernels where policy.context_parallel.overlap_exchanges says so, else after them, alone."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(q.shape[:3], -math.inf, device=q.device, dtype=torch.float32)
    kv = (k, v)
    overlap = context_parallel.overlap_exchanges(False, k.shape[2])
    for step, blocks in enumerate(steps):
        at(step)
        following = step + 1 < len(steps)
        if following and overlap:
            received, requests = _exchange(ring, kv, 1, -1, 0)
        for b in blocks:
            _forward_block(kernels, b, q, *kv, out, lse)
        if following:
            at(step + 1)  # (the wait for the next step's keys)
            if not overlap:
                received, requests = _exchange(ring, kv, 1, -1, 0)
            _wait(requests)
            kv = tuple(received)
    return out, lse


def _ring_backward(ring, steps, kernels, q, k, v, out, lse, do):
    """(dq, dk, dv) float32: dq of this rank's queries, dk and dv of its keys, gathered from every rank. Where
    policy.context_parallel.overlap_exchanges says so (short shards) the next step's keys travel beside this
    step's kernels and the dK, dV summed so far beside the next step's; else both after this step's kernels,
    alone."""
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = (k, v)
    incoming = None  # (buffers, requests): the dk, dv the previous rank has summed for the keys this rank holds next
    last = len(steps) - 1
    overlap = context_parallel.overlap_exchanges(True, k.shape[2])
    for step, blocks in enumerate(steps):
        at(step)
        if step < last and overlap:
            received, requests = _exchange(ring, kv, 1, -1, 0)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        for b in blocks:
            _backward_block(kernels, b, q, *kv, out, lse, do, dq, dk, dv)
        if incoming is not None:
            _wait(incoming[1], "grads wait")  # (none left when not overlapped: waited before the kernels)
            with phase("merge"):
                dk += incoming[0][0]
                dv += incoming[0][1]
        if step < last:
            # these keys go to the next rank: their gradient follows them there
            incoming = _exchange(ring, (dk, dv), 1, -1, 2)
            if not overlap:
                received, requests = _exchange(ring, kv, 1, -1, 0)
            at(step + 1)  # (the wait for the next step's keys)
            _wait(requests)
            if not overlap:
                _wait(incoming[1], "grads wait")
                incoming = incoming[0], []
            kv = tuple(received)
    if last == 0:
        return dq, dk, dv
    # the keys held now are those of rank - last: their gradient goes home, ours comes from rank + last. These are
    # whole sums that the caller only rounds to the inputs' dtype, so they travel rounded already: the same bits at
    # half the bytes of float32 (this message is not overlapped with any work)
    home = (dk.to(k.dtype), dv.to(v.dtype))
    (dk, dv), requests = _exchange(ring, home, -last, last, 4)
    _wait(requests, "return wait")
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
    at(0)
    kernel, scale = kernels(halo.own)
    with phase("kernels"):
        out, lse = kernel.forward(q, k, v, scale, tensors=kernels.tensors(halo.own))
    at(1)  # (the neighbours' rows)
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
    at(1)  # (the neighbours' rows)
    for rows, blocks, offset, tag in ((before, halo.before, -1, 0), (after, halo.after, 1, 2)):
        if rows is None:
            continue
        grads = [torch.zeros_like(t) for t in rows]
        for b in blocks:
            g = _block_grads(kernels, b, q, *rows, out, lse, do)
            dq_parts.append((slice(b.q_start, b.q_end), g[0]))
            with phase("merge"):
                grads[0][:, :, b.k_start:b.k_end] += g[1]
                grads[1][:, :, b.k_start:b.k_end] += g[2]
        sends += [(offset, g, tag + i) for i, g in enumerate(grads)]
    receives = [(1, t[:, :, n - halo.to_next:], i) for i, t in enumerate((k, v)) if halo.to_next]
    receives += [(-1, t[:, :, :halo.to_prev], 2 + i) for i, t in enumerate((k, v)) if halo.to_prev]
    buffers, requests = _post(ring, sends, receives)
    at(0)
    dq, dk, dv = _block_grads(kernels, halo.own, q, k, v, out, lse, do)
    with phase("merge"):
        for rows, part in dq_parts:
            dq[:, :, rows] += part
    at(1)  # (the neighbours' rows' dK, dV)
    _wait(requests, "grads wait")
    with phase("merge"):
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


def _visits_forward(ring, visits, loans, split, kernels, q, k, v):
    """(out float32, lse, the K/V rows each visit received, the q, k, v rows of each loan this rank runs): each
    visit's exchange is posted before the previous visit's kernels run, the loans' rows before the first; a loan
    runs after its executor's blocks on its own keys (`split`: (those before, those after) the loans, as
    `balance.loans_split` cuts them; None: all before), and its partial goes back to its owner while the rest run.

    NOTE: NCCL matches a pair's messages by the order they are posted, so every rank posts the loans' rows first,
    then the exchange of step 1 (where it has one), the loans' partials, and the steps after 1: a rank with loans
    whose first step after 0 is a later one posts it only after the partials. With `split` the owner posts its
    receives of the partials up front (at that place in the order): its NCCL stream then takes them while it runs
    its own blocks, instead of only once those are done."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(q.shape[:3], -math.inf, device=q.device, dtype=torch.float32)
    received = []
    lent = _post_loans(ring, loans, True,
                       lambda _, loan: (_rows(q, loan.rows), *(_rows(t, loan.keys) for t in (k, v))),
                       lambda loan: (q[:, :, :_length(loan.rows)], *(t[:, :, :_length(loan.keys)] for t in (k, v))),
                       0)
    early = len(visits) > 1 and (not loans or visits[1].step == 1)
    posted = _post_visit(ring, visits[1], k, v) if early else None
    partial_like = lambda loan: (q[:, :, :_length(loan.rows)], lse[:, :, :_length(loan.rows)])  # noqa: E731
    owed = None if split is None else _post_loans(ring, loans, False, None, partial_like, 3, sends=False)
    for i, visit in enumerate(visits):
        at(visit.step)
        kv = (k, v)
        if i:
            buffers, requests, _ = posted or _post_visit(ring, visit, k, v)
            _wait(requests)
            kv = tuple(buffers) if visit.receive else (k[:, :, :0], v[:, :, :0])
            received.append(kv)
            posted = _post_visit(ring, visits[i + 1], k, v) if i + 1 < len(visits) else None
        blocks = visit.blocks
        if i == 0:
            first, blocks = split or (blocks, [])
            for b in first:
                _forward_block(kernels, b, q, *kv, out, lse)
            hosted, returns = _loans_forward(ring, loans, kernels, q, lse, lent, partial_like, owed)
            at(0)
        for b in blocks:
            _forward_block(kernels, b, q, *kv, out, lse)
    at(0)
    back, requests, _ = returns
    _wait(requests, "returns wait")
    with phase("returns merge") if loans else contextlib.nullcontext():
        for loan, part in zip(loans, back):
            if part is not None:
                for rows, offset in _offsets(loan.rows):
                    _merge(out, lse, rows, part[0][:, :, offset:offset + rows.stop - rows.start],
                           part[1][:, :, offset:offset + rows.stop - rows.start])
    return out, lse, received, hosted


def _loans_forward(ring, loans, kernels, q, lse, lent, partial_like, owed):
    """(the rows of each loan this rank runs, the posted return of the partials (received, requests, sends)): the
    loans this rank runs, on the rows `lent` (`_post_loans`) brings, their partial (out, lse) posted back to their
    owners; the partials this rank owns are received into buffers like `partial_like(loan)`, or were posted already
    (`owed`, not None).

    NOTE: a partial out travels in q's dtype, as a kernel returns it (only a query row that two of the loan's
    blocks reach, a piece cut by rows, is rounded once more), half the bytes of float32."""
    at(0, "loan ")
    hosted, requests, _ = lent
    _wait(requests, "rows wait")
    partials = {}
    for i, (loan, rows) in enumerate(zip(loans, hosted)):
        if rows is not None:
            part = torch.zeros(rows[0].shape, device=q.device, dtype=torch.float32)
            part_lse = torch.full(rows[0].shape[:3], -math.inf, device=q.device, dtype=torch.float32)
            for b in loan.blocks:
                _forward_block(kernels, b, *rows, part, part_lse)
            partials[i] = (part.to(q.dtype), part_lse)
    returns = _post_loans(ring, loans, False, lambda i, _: partials[i], partial_like, 3, receives=owed is None)
    return hosted, returns if owed is None else _joined(owed, returns)


def _joined(owed, sent):
    """The return of loans posted in two parts, the receives (`owed`) then the sends (`sent`), as one."""
    return owed[0], owed[1] + sent[1], owed[2] + sent[2]


def _visits_backward(ring, visits, loans, split, kernels, q, k, v, received, hosted, out, lse, do):
    """(dq, dk, dv) float32: the received rows' dK/dV go straight back to their ranks as each visit finishes, and
    the rows this rank sent come back with theirs; a loan's out, lse and dO rows go to its executor first, it runs
    between the executor's blocks on its own keys as `split` cuts them (None: after all), and its dQ, dK and dV (in
    q, k and v's dtype, as the partial out) go back before any visit's (so in one order on every rank), the owner's
    receives posted up front with `split` (as the forward's)."""
    lent = _post_loans(ring, loans, True, lambda _, loan: tuple(_rows(t, loan.rows) for t in (out, lse, do)),
                       lambda loan: tuple(t[:, :, :_length(loan.rows)] for t in (out, lse, do)), 0)

    def grads_like(loan):
        return q[:, :, :_length(loan.rows)], *(t[:, :, :_length(loan.keys)] for t in (k, v))

    owed = None if split is None else _post_loans(ring, loans, False, None, grads_like, 3, sends=False)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    first, later = split or (visits[0].blocks, [])
    at(0)
    for b in first:
        _backward_block(kernels, b, q, k, v, out, lse, do, dq, dk, dv)
    at(0, "loan ")
    saved, requests, _ = lent
    _wait(requests, "rows wait")
    grads = {}
    for i, (loan, inputs, rest) in enumerate(zip(loans, hosted, saved)):
        if inputs is not None:
            grads[i] = tuple(torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in inputs)
            for b in loan.blocks:
                _backward_block(kernels, b, *inputs, *rest, *grads[i])
    returning = _post_loans(ring, loans, False, lambda i, _: tuple(g.to(t.dtype) for g, t in zip(grads[i], (q, k, v))),
                            grads_like, 3, receives=owed is None)
    back, returns, returned = returning if owed is None else _joined(owed, returning)
    at(0)
    for b in later:
        _backward_block(kernels, b, q, k, v, out, lse, do, dq, dk, dv)
    pending = []
    for visit, rows in zip(visits[1:], received):
        at(visit.step)
        grads_i = [torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in rows]
        for b in visit.blocks:
            _backward_block(kernels, b, q, *rows, out, lse, do, dq, *grads_i)
        tag = 2 * visit.step
        sends = [(-visit.step, g, tag + i) for i, g in enumerate(grads_i) if visit.receive]
        receives = [(visit.step, t[:, :, :_length(visit.send)], tag + i) for i, t in enumerate((dk, dv))
                    if visit.send]
        pending.append((visit.step, visit.send, *_post(ring, sends, receives), grads_i))
    for step, ranges, buffers, requests, _ in pending:
        at(step)
        _wait(requests, "grads wait")
        if ranges:
            with phase("merge"):
                _add_rows(dk, ranges, buffers[0])
                _add_rows(dv, ranges, buffers[1])
    at(0)
    _wait(returns, "returns wait")
    with phase("returns merge") if loans else contextlib.nullcontext():
        for loan, part in zip(loans, back):
            if part is not None:
                _add_rows(dq, loan.rows, part[0])
                _add_rows(dk, loan.keys, part[1])
                _add_rows(dv, loan.keys, part[2])
    return dq, dk, dv


def _offsets(ranges):
    """(slice of the rows, where they start once packed) of each range of `ranges`."""
    offset = 0
    for a, b in ranges:
        yield slice(a, b), offset
        offset += b - a


def _add_rows(t, ranges, packed) -> None:
    """Add to t's rows in `ranges` the rows of `packed`, which holds them one after another."""
    for rows, offset in _offsets(ranges):
        t[:, :, rows] += packed[:, :, offset:offset + rows.stop - rows.start]


def _post_loans(ring, loans, from_owner: bool, tensors, like, tag: int, sends: bool = True, receives: bool = True):
    """Post the messages of `loans` (those this rank owns or runs) one way, from each owner to its executor
    (`from_owner`) or back: the sending side sends `tensors(i, loan)`, the other receives tensors like `like(loan)`
    (only the sends, or only the receives, where the other is False). Returns (the received tensors of each loan,
    None where this rank sends or does not receive now; the requests; the sends, kept alive until the requests are
    waited on).

    NOTE: a loan's messages are posted before every visit's (its rows) or after (what comes back), on every rank
    alike, so that the ranks post them in one order (NCCL matches a pair's messages by their order)."""
    if not loans:
        return [], [], []
    outgoing, incoming, counts = [], [], []
    for i, loan in enumerate(loans):
        sending = (loan.owner == ring.rank) == from_owner
        offset = (loan.executor if loan.owner == ring.rank else loan.owner) - ring.rank
        if sending and sends:
            outgoing += [(offset, t.contiguous(), _LOAN_TAG + tag + j) for j, t in enumerate(tensors(i, loan))]
        elif not sending and receives:
            incoming += [(offset, t, _LOAN_TAG + tag + j) for j, t in enumerate(like(loan))]
            counts.append(len(like(loan)))
            continue
        counts.append(0)
    buffers, requests = _post(ring, outgoing, incoming)
    received = []
    for count in counts:
        received.append(tuple(buffers[:count]) if count else None)
        buffers = buffers[count:]
    return received, requests, outgoing
