"""How context parallelism shares documents' work among the ranks (attngen.distributed.balance): whether it moves
part of a heavy rank's work to lighter ranks, and the cost model that decides what to move."""

from __future__ import annotations

from dataclasses import dataclass

# Documents packed into head-tail shards leave the ranks' work uneven (the 14 documents of mean 8,192 in 128k
# tokens: 0.851 / 1.149 of the mean on 2 ranks); True moves part of the heavy ranks' diagonal pieces to the light
# ranks for execution. Measured on two H200s (2026-11-28, benchmarks/context_parallel.py at 128k): forward +
# backward 649 TFLOP/s against 599 unbalanced (shares 0.994 / 1.006 against 0.851 / 1.149). On since.
BALANCE_DOCUMENTS = True

# Where an executor runs the loans (attngen.distributed.balance.loans_split): False, after all its blocks on its own
# keys, so that the returns (partial out; dQ, dK, dV) travel under the later steps only, short under documents (two
# H200s at 128k: 15.8% of the call exposed, against 10.3% unbalanced); True, after the first of those blocks that
# cover the lent rows' arrival, the owner posting its receives of the returns up front, so that the returns travel
# under the executor's remaining blocks. Measured on two H200s (2026-11-28, benchmarks/context_parallel.py at 128k,
# 14 documents, one run): 676 TFLOP/s against 702 with the loans last, the exposed share the same (16.3% / 16.4%):
# the timeline shows the returns' waits near zero either way, the exposed time being the merges. Off.
LOANS_EARLY = False

# How a partial state (out, lse) merges into another (attngen.distributed.ring._merge, and `attngen.merge_states` on
# GPUs): False, PyTorch's element-wise ops (about fifteen launches with float32 temporaries over the accumulator's
# strided rows, then two copies back: two H200s at 128k tokens of balanced documents, ~6 ms of a 20 ms forward);
# True, one Triton kernel (attngen.api.merge) that reads both states' rows and writes the merged rows in place, in
# one pass. Measured on two H200s (2026-11-28, benchmarks/context_parallel.py --lengths 131072, one process a
# provider set): balanced documents forward 580 -> 753 TFLOP/s, forward + backward 711 -> 742 (1.32x -> 1.38x
# FlexAttention's), the forward's merges ~6 ms -> ~0.8; plain causal 1,048 -> 1,054. On since.
FUSED_MERGE = True

# Multiprocessors the ring's persistent attention kernels (the Gluon forward's persistent grid) leave free for the
# NCCL send/receive kernels that run beside them (FlashAttention-3's sm_margin; the generated modules' SM_MARGIN,
# set for the call's kernels only). A persistent program that finds every multiprocessor taken waits for one, and
# an exchange's kernels hold theirs until its bytes have moved, which the ring overlaps with the step's kernels: on
# four H200s the ring's forward timed alone came out bimodal, its step kernels twice as long when NCCL took more
# time (NCCL_MAX_NCHANNELS=1: 56 -> 112 ms). 0: every multiprocessor, as outside context parallelism. Measured on
# four H200s (2026-11-28, benchmarks/cp_margin.py at 4e4f6e9, plain causal ring, H=32 d=128, torch's context_parallel
# over cuDNN in the same process):
# a margin lost at every length, forward and forward + backward alike (128k: forward 1967 TFLOP/s at 0, 1860 at 8,
# 2050 at 16, 1940 at 0 again; 256k 2037 / 1949 / 1882; 512k 2032 / 1938 / 1856): in a timed run the exchanges do
# not hold the persistent grid back, and the margin's programs are simply lost. 0.
SM_MARGIN = 0

# Whether the ring's messages go through a group of the caller's ranks whose NCCL stream has high priority
# (ProcessGroupNCCL's is_high_priority_stream; made once per group, by its ranks alone), so that a step's exchange
# kernel is dispatched ahead of the attention kernel's pending programs instead of after them. The hypothesis it tests
# (NOTES.md, context parallelism [v51]): the ring's forward is bimodal (two H200s at 512k: 2045 and 2588 ms for the same
# call), its slow mode the exchange run exposed after a step's kernels. Measured on two H200s (2026-11-28,
# benchmarks/cp_priority.py at 9ee44a8, 256k, plain causal H=32 d=128, with and without TORCH_NCCL_HIGH_PRIORITY=1): a
# tie (forward 1168-1174 TFLOP/s on against 1162-1189 off, forward + backward 1063-1072 against 1062-1066), no slow mode
# in either; 512k and four GPUs, where the slow mode showed, not yet. Off. (Gloo and other backends: the caller's group,
# always.)
HIGH_PRIORITY_EXCHANGES = False

# Whether the ring's exchanges (the next step's keys and values; in the backward the dK, dV summed so far) run beside
# the step's kernels (True: posted before them, FlashAttention's ring) or after them, alone, the next step's kernels
# waiting for their bytes (False). Beside, the exchange's NCCL kernels share the multiprocessors with the attention
# kernels for the whole step and slow them more than the transfer costs alone: over NVLink the 512k shards' K and V
# (4.3 GB a step on two GPUs) move in ~10 ms, a step's kernels take ~1 s. Measured on two H200s (2026-11-29,
# cp_overlap.py at da7e66b, plain causal H=32 d=128 head-tail, torch's context_parallel over cuDNN in the same
# process, two alternating rounds): forward / forward + backward ms, beside -> alone: 256k 478-479 -> 470-472 /
# 1844-1852 -> 1818 (cuDNN 502-511 / 1863-1880); 512k 1994-2265 -> 1975-1982 / 7833-8099 -> 7463-7480 (cuDNN 2186-2191
# / 7434-7492). Beside, the 512k forward was bimodal (NOTES [v51], [v57]); alone it is not. The halo exchange and the
# documents' visits move only the rows a window or a document reaches and keep their exchanges beside the kernels.
# False. The backward's own rule: OVERLAP_BACKWARD_KEYS.
OVERLAP_EXCHANGES = False

# The backward's exchanges (the next step's keys and values, the dK, dV summed so far) also run beside its kernels
# where a rank's shard holds at most this many keys (`overlap_exchanges`). A step's bytes grow with the shard, its
# kernels' work with its square, so on short shards the transfer alone costs more than it slows the kernels beside
# it; the forward's persistent grid loses a whole wave to the multiprocessors NCCL's kernels hold (four H200s, 128k:
# forward 64 -> 72 ms beside), the backward's one-program-a-tile grid only those multiprocessors. Measured on four
# H200s (2026-11-29, cp_ov.py in benchmarks/NOTES.md [v62], plain causal H=32 d=128 head-tail, two alternating rounds,
# the backward as forward + backward less forward): 128k (32k keys a rank) 185 -> 179 ms beside, 256k (64k) 695 ->
# 682; two H200s at 128k (64k keys a rank; cp_ov.py with only this setting toggled, three rounds): forward + backward
# 471-477 ms alone, 474-475 beside, a tie; on two H200s the longer shards lost beside (256k, 128k keys a rank: 1348 ->
# 1366-1373 ms; 512k: 5488 -> 5834; NOTES [v60]). 0: alone at every length.
OVERLAP_BACKWARD_KEYS = 65536


def overlap_exchanges(backward: bool, keys: int) -> bool:
    """Whether a ring pass over shards of `keys` keys a rank posts each step's exchange before the step's kernels
    (beside them) rather than after them (alone): OVERLAP_EXCHANGES for both passes, and for the backward
    OVERLAP_BACKWARD_KEYS."""
    return OVERLAP_EXCHANGES or (backward and keys <= OVERLAP_BACKWARD_KEYS)


@dataclass(frozen=True, slots=True)
class BalancePolicy:
    """The cost model and stopping rule of the document balance.

    block_cost: what a kernel call costs beyond its kept scores, in kept (query, key) pairs: a launch, its merge
        and a tile's ragged edge; at d=128, 32 heads and ~400 TFLOP/s forward + backward a pair costs ~0.14 ns, so
        131,072 pairs are ~20 us.
    tolerance: moves stop once no rank is further from the mean than this share of it.
    min_rows: a split piece moves at least this many query rows (fewer cost more in launches than they balance).
    arrival_scores: under LOANS_EARLY, the kept pairs an executor runs on its own keys before it starts the loans,
        for each query or key row they bring: at d=128 in bf16 a head's q row is 256 bytes, ~1.7 ns at 150 GB/s,
        the time of ~1,800 pairs of a head at ~550 TFLOP/s forward (a K and V row twice that); about twice that.
    """
    block_cost: int = 128 * 1024
    tolerance: float = 0.01
    min_rows: int = 64
    arrival_scores: int = 4096


BALANCE = BalancePolicy()
