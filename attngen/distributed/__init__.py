"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed group.

    shard = attngen.distributed.shard_sequence(x, world, rank)              # this rank's part of (B, H, N, D)
    out = attngen.distributed.context_parallel_attention(q, k, v, causal=True)   # q, k, v: shards
    full = attngen.distributed.unshard_sequence([out_0, out_1, ...])        # the sequence again

Ring attention: each rank keeps its query shard while the key/value shards travel around the ring (batched
isend/irecv between steps, after each step's kernels, or beside them on short shards: policy overlap_exchanges);
each step's partial (out, lse) is merged in float32 with `merge_states`. Under `load_balance` the sequence is cut
into 2W chunks and rank r holds chunks r and 2W-1-r (head-tail), so that a causal mask gives every rank the same
work; either way every (query chunk, key chunk) pair a step meets is full, masked (causal or a window, in the
chunks' local positions) or empty, and empty ones are skipped, as are whole ring steps no rank needs (a sliding
window). The backward recomputes each step from the global out and lse (`Kernel.backward_saved`), accumulates dQ
locally and sends dK/dV around the ring behind their keys, back to the ranks that own them.

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

Documents leave head-tail shards uneven (a document's causal work grows with the square of its length), so under
`balance_documents` a heavy rank lends part of its diagonal pieces to lighter ranks: the executor receives those
query rows and their keys from the owner, runs them, and returns the partial (out, lse), merged by the owner in
float32 like every other partial, and in the backward dQ, dK and dV (`Loan`). The shards stay as the caller made them.
Under policy.context_parallel.LOANS_EARLY the executor runs the loans after the first of its own pieces
(`balance.loans_split`), so that what they return travels under the rest of its work.

`timeline()` records where a call's time goes on this rank, step by step (phases.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import sdpa
from ..errors import KernelInputError
from ..lang.builtin import NO_WINDOW
from ..policy import context_parallel
from .balance import Loan, balanced_schedule, kept_scores, loans_split, shares
from .ring import (_halo_backward, _halo_forward, _Kernels, _Ring, _ring_backward, _ring_forward, _visits_backward,
                   _visits_forward, exchange_group)
from .schedule import (Block, Halo, Pieces, Visit, chunks_of, document_pieces, document_visits, grouped_pieces,
                       halo_schedule, key_ranges, merged_blocks, pair_block, pair_blocks, ring_schedule,
                       shard_sequence, unshard_sequence)

from .phases import Timeline, recorded_pass, timeline

__all__ = ["Timeline", "context_parallel_attention", "shard_sequence", "timeline", "unshard_sequence"]


class _ContextParallel(torch.autograd.Function):
    """The ring (`steps` a list of ring steps), the halo exchange (`steps` a Halo) or documents' direct exchange
    (`steps` a list of `Visit`s) as one differentiable call."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring, steps, kernels, loans=(), split=None):
        ctx.halo_rows = ctx.received = None
        with recorded_pass("forward", q.device), kernels.margin():
            if isinstance(steps, Halo):
                out, lse, *ctx.halo_rows = _halo_forward(ring, steps, kernels, q, k, v)
            elif isinstance(steps[0], Visit):
                out, lse, ctx.received, ctx.hosted = _visits_forward(ring, steps, loans, split, kernels, q, k, v)
            else:
                out, lse = _ring_forward(ring, steps, kernels, q, k, v)
            if sinks is not None:
                out, lse = _with_sinks(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.steps, ctx.kernels, ctx.loans, ctx.split = ring, steps, kernels, loans, split
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        # (with sinks, out and lse are the sinks' already: each block's recomputed P and delta = rowsum(dO * out)
        # are then those of the softmax with the sink logit, and dQ, dK, dV need nothing more)
        with recorded_pass("backward", q.device), ctx.kernels.margin():
            if ctx.halo_rows is not None:
                dq, dk, dv = _halo_backward(ctx.ring, ctx.steps, ctx.kernels, q, k, v, *ctx.halo_rows, out, lse,
                                            do.contiguous())
            elif ctx.received is not None:
                dq, dk, dv = _visits_backward(ctx.ring, ctx.steps, ctx.loans, ctx.split, ctx.kernels, q, k, v,
                                              ctx.received, ctx.hosted, out, lse, do.contiguous())
            else:
                dq, dk, dv = _ring_backward(ctx.ring, ctx.steps, ctx.kernels, q, k, v, out, lse, do.contiguous())
            dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        dsinks = _sinks_grad(out, lse, do, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def _with_sinks(out, lse, sinks):
    """(out float32, lse) of the merged state of every key with each head's sink logit joined to its rows' softmax
    denominator: lse' = log(e^lse + e^sink), the keys' output weighted by their share e^(lse - lse'), the sink
    adding no value. Rows that saw no key keep out 0 and get lse' = sink."""
    total = torch.logaddexp(lse, sinks[None, :, None])
    return out.float() * torch.exp(lse - total)[..., None], total


def _sinks_grad(out, lse, do, sinks):
    """d loss / d sinks from this rank's rows (float32, (H,)): a row's sink has probability e^(sink - lse'), and
    its gradient is minus that times delta = rowsum(dO * out), summed over the batch and the rows."""
    delta = (do.float() * out.float()).sum(-1)
    return -(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                               causal: bool = False, scale: float | None = None, load_balance: bool = True,
                               window_size: tuple[int, int] = NO_WINDOW, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                               cu_seqlens: torch.Tensor | None = None,
                               return_lse: bool = False, balance_documents: bool | None = None):
    """Attention of a sequence sharded across the ranks of `group` (None: the default group), each rank passing its
    shard: q (B, H, N_local, D), k and v (B, H_KV, N_local, D), H a multiple of H_KV, the layout `shard_sequence`
    makes with the same `load_balance` (head-tail chunks; False: contiguous parts). Returns this rank's output shard
    (B, H, N_local, D), and its log-sum-exp (B, H, N_local) float32 when `return_lse`. Differentiable in q, k, v.

    `causal`, `scale`, `window_size`, `softcap`, `alibi_slopes` and `sinks` as `attngen.attention`'s, over the
    positions of the whole sequence. With `alibi_slopes` ((H,) or (B, H), the same on every rank) each block of a
    query chunk against a key chunk runs a kernel whose score reads its global positions
    (`lang.builtin.positional_alibi_spec`), so no blocks are joined across chunks (with `cu_seqlens`, a document's
    pieces against their own keys still run as one varlen call: their positions are the sequence's). `sinks` (H,),
    the same on every rank, joins each row's softmax denominator once (after the partial states of every key are
    merged); its gradient, when it requires grad, is this rank's rows' share, to be summed over the group as every
    weight's is under context parallelism (the data-parallel reduction over the context-parallel ranks does it).
    `cu_seqlens`: documents packed into the sequence (training's packed batches), int32 (documents + 1,) offsets
    over the whole sequence (0 first, world * N_local last), the same on every rank; each query then sees only its
    own document's keys (causal within it under `causal`, exactly across shard boundaries); each rank runs only the
    (query, key) pieces of a document that both shards hold, and receives from each other rank only the key rows its
    documents reach there, not whole shards around the ring. Ring steps no rank needs are not run. Pass
    `load_balance=False` (and shards made with it) for a sliding window no wider than a shard: every query sees at
    most the window's keys, so contiguous shards are balanced already, and each rank then exchanges only the rows
    the window reaches into its neighbours' shards instead of whole shards around the ring (head-tail chunks put a
    chunk's neighbour on the far side of the ring, and every ring step moves a whole shard); with `cu_seqlens` a
    window cuts the documents' rows exchanged instead. `balance_documents` (None: policy.context_parallel's
    BALANCE_DOCUMENTS): with `cu_seqlens`, part of the documents' work of the ranks that hold more of it runs on the
    others (`balance.balanced_schedule`), the shards staying as they are. Every rank must pass shards of one shape
    and the same arguments; a ValueError names the argument that differs or does not fit (a group of one rank, an
    odd shard under `load_balance`). Collective: every rank of `group` must call it, and its backward, together.
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
    softcap = sdpa.checked_softcap(softcap, alibi_slopes)
    if alibi_slopes is not None:  # (float32 (B, H): the kernels' slopes tensor)
        alibi_slopes = sdpa._checked_float("alibi_slopes", alibi_slopes, q, ((q.shape[1],), tuple(q.shape[:2])))
        alibi_slopes = alibi_slopes.detach().expand(q.shape[:2]).contiguous()
    if sinks is not None:  # (float32, a differentiable cast: the sinks' own dtype gets their gradient)
        sinks = sdpa._checked_float("sinks", sinks, q, ((q.shape[1],),))
    documents = None if cu_seqlens is None else checked_documents(cu_seqlens, world * q.shape[2])
    balance = bool(context_parallel.BALANCE_DOCUMENTS if balance_documents is None else balance_documents)
    _check_same_on_every_rank(group, world, q, k, causal, scale, load_balance, window, softcap, documents,
                              balance, sinks, alibi_slopes)
    positional = alibi_slopes is not None
    halos = None if documents else halo_schedule(world, q.shape[2], bool(causal), window, load_balance, positional)
    schedule = None if halos else ring_schedule(world, q.shape[2], bool(causal), window, load_balance, documents,
                                                positional)
    loans = ()
    if documents and balance:
        schedule, loans = balanced_schedule(schedule, context_parallel.BALANCE, positional)
        loans = tuple(loan for loan in loans if rank in (loan.owner, loan.executor))
    steps = halos[rank] if halos else document_visits(schedule, rank) if documents else schedule[rank]
    split = None  # (LOANS_EARLY: the blocks on its own keys a rank runs before the loans, and after)
    if loans and context_parallel.LOANS_EARLY:
        split = loans_split(steps[0].blocks, loans, rank, context_parallel.BALANCE)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ring = _Ring(exchange_group(group), rank, world)
    out, lse = _ContextParallel.apply(q, k, v, sinks, ring, steps, _Kernels(q, k, v, scale, softcap, alibi_slopes),
                                      loans, split)
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


def _check_same_on_every_rank(group, world, q, k, causal, scale, load_balance, window, softcap, documents,
                              balance, sinks=None, alibi_slopes=None) -> None:
    """Raise, naming it, where an argument differs across the ranks (one all-gather of a few numbers)."""
    names = ("batch", "q heads", "k heads", "shard length", "head dim", "dtype", "causal", "scale", "load_balance",
             "window_size left", "window_size right", "softcap", "cu_seqlens documents", "cu_seqlens offsets",
             "balance_documents", "sinks given", "sinks values", "alibi_slopes given", "alibi_slopes values")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # NOTE: the offsets travel as one weighted sum modulo a prime (below 2^53: exact in float64), so that the
    # all-gather stays a few numbers however many documents there are
    offsets = [-1, -1] if documents is None else [len(documents),
                                                   sum(i * x for i, x in enumerate(documents, 1)) % 1_000_000_007]
    mine = torch.tensor([*q.shape[:2], k.shape[1], q.shape[2], q.shape[3],
                         dtypes.index(q.dtype) if q.dtype in dtypes else -1, bool(causal),
                         -1.0 if scale is None else float(scale), bool(load_balance), *window, softcap, *offsets,
                         balance, sinks is not None, 0.0, alibi_slopes is not None, 0.0],
                        dtype=torch.float64, device=q.device)
    for i, t in ((-3, sinks), (-1, alibi_slopes)):  # (their values as one weighted sum, on the device: no copy)
        if t is not None:
            mine[i] = (t.double().flatten() * torch.arange(1, t.numel() + 1, dtype=torch.float64,
                                                           device=t.device)).sum()
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
