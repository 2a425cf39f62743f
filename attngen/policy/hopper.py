"""The Hopper Gluon kernels' shapes and thresholds, by head dim and causal mask, with the measurements that chose them.

The passes warp-specialize and warp-specialize-decode read these tables and set the program's typed
`ir.WarpSpecialized` value (forward, backward, decode) from them; the verifier checks its invariants and
`attngen explain` prints it. An experiment changes a setting here, never the generated source, and runs
each setting in a process of its own with its own ATTNGEN_CACHE_DIR: the kernel cache is keyed by the
generator's source files, not by values set in a running process; but for the switches (`SWITCHES`), which may
be set in a running process: kernel caches key on their values, and setting one bumps `switch_generation()`, which
every call plan's signature holds (a plan replays launches of the modules generated under the values it saw).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, replace

from .. import ir
from .splits import group_split  # noqa: F401 (the backward's split rule, shared with the Triton backward)

HEAD_DIMS = (64, 96, 128, 256)

TILE_DIM = {96: 128, 192: 256}
"""Head dims the Gluon kernels run at a wider tile, and that width: their register tiles and TMA blocks have
power-of-two shapes (Triton 3.6's Gluon checks both), so d=96 runs 128 columns wide, TMA reading zeros past the
tensors' 96 columns and clipping the stores there (its bytes are d=96's, its products d=128's), and takes d=128's
shapes and thresholds, which are those of the same registers and shared memory. FA3's 96-column tiles would split each
product into a 64- and a 32-column one over column slices of the swizzled tiles, and each TMA copy in two; not
tried. Not measured. d=192 (DeepSeek's q.k, SPLIT_FORWARD) runs 256 columns wide."""


def tile_dim(head_dim: int) -> int:
    """The width of the Gluon kernels' Q and K tiles for a head dim in HEAD_DIMS or SPLIT_FORWARD (TILE_DIM)."""
    return TILE_DIM.get(head_dim, head_dim)


SPLIT_FORWARD = {(192, 128): ir.GluonShape(block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240,
                                           maxnreg=168)}
"""The Gluon forward's shape by (head dim, head_dim_v) for specs whose V and output are narrower than Q and K
(DeepSeek's prefill: q.k over 192, v over 128; its backward takes BWD_WIDE where WIDE_BACKWARD is on, else the
Triton kernels). Q and K tiles 256 columns wide (TILE_DIM), V, the accumulator and the output 128, which leaves through
the first half of its warpgroup's Q buffer. 64-key blocks: 2 stages of K (32 KB a stage) and V (16 KB) beside two
Q buffers of 64 KB fill 224 KB, so the persistent grid fits (128-key blocks would not, even with one Q buffer); a
consumer's [64, 128] accumulator and [64, 64] scores are d=128's registers at half its keys. Thresholds: d=256's.
Not measured."""


@dataclass(frozen=True, slots=True)
class ForwardFlags:
    """The Gluon forward's switches and loader registers, the same at every head dim and mask."""

    loader_regs: int
    overlap: bool
    pingpong: bool
    early_p: bool
    trim: bool
    persistent: bool


FORWARD_FLAGS = ForwardFlags(loader_regs=24, overlap=True, pingpong=False, early_p=True, trim=True, persistent=True)
"""The loader gives back all but 24 registers (see FORWARD_MAIN). EARLY_P: the softmax's P is converted to the
P V product's 16-bit operand as soon as it is made, so the loop carries half the registers of it (+1-3% at both
head dims, NOTES.md v12).
TRIM: a consumer takes only the key blocks its own rows need and releases the rest unread: under a
causal mask it stops at its own last block (the program's blocks reach its last row's keys), and in a
sequence's last row block it may have no row at all (NOTES.md v12).
PERSISTENT: one program per multiprocessor, each taking tiles in rounds (under a causal mask a (batch,
head)'s row blocks in pairs, the k-th longest with the k-th shortest, so that the programs' work is even);
its loader moves the next tile's Q into a second buffer and its first K/V blocks while the consumers
finish a tile, so a tile's start-up and output store no longer stand between tiles. Against one program
per tile (H200, NOTES.md v22): d=128 +35% at N=512 and +6-18% at 1024-2048 without a mask, +10-16% causal
at 512-4096, within 1% at 16384; d=64 +13-17% at 512-1024, +1-3% from 4096."""

FORWARD_MAIN = {
    64: ir.GluonShape(block_m=192, block_n=128, stages=2, consumers=3, consumer_regs=160, maxnreg=128),
    128: ir.GluonShape(block_m=128, block_n=128, stages=2, consumers=2, consumer_regs=240, maxnreg=168),
    256: ir.GluonShape(block_m=128, block_n=64, stages=2, consumers=2, consumer_regs=240, maxnreg=168),
}
"""The Gluon kernel's launch shape by head dim. d=128: 12 warps (two consumer warpgroups, one loader warp
padded to a warpgroup) x 168 registers fill the 64K register file; the loader gives back all but 24,
so each consumer thread gets 240. Measured against 256-row programs, 256-key blocks, 3 stages and
64-key blocks with 4 stages (NOTES.md v9): this one is the best or within 1%.
d=64 takes FlashAttention 3's shape: 192 query rows in three
consumer warpgroups (16 warps x 128 registers; consumers 160, the loader 24), each K/V block feeding
half again as many rows. With P carried in 16 bits its consumers spill 248 bytes (1.7 KB before) and it
wins: 465 TFLOP/s against 435 at N=4096 and 515 against 455 at 16384 without a mask, 479 against 447
causal at 16384 (H200, NOTES.md v12; it had lost at 172-181 while P was carried in float32, v9). At
d=128 a 160-register consumer cannot hold the [64, 128] accumulator beside S (420-425).
d=256 takes FlashAttention 3's tile (128 rows in two consumer warpgroups) with 64-key blocks: a consumer's [64, 256]
float32 accumulator is 128 of its 240 registers, so S must stay [64, 64] (32 more; FA3 takes 80 keys, which a
power-of-two register tile cannot); 2 stages of K and V (128 KB) beside one Q buffer (64 KB) fill shared memory,
so the grid is one program per tile (PERSISTENT's second Q buffer would need 64 KB more). Not measured yet.
SHORT_KEYS, FORWARD_SHORT: the shape of calls of at most SHORT_KEYS keys."""

MIN_KEYS = {(64, False): 512, (64, True): 2048, (128, False): 1, (128, True): 1, (256, False): 1, (256, True): 1}
"""Fewest keys for which the Gluon kernel runs, by (head dim, causal). At d=64 and short sequences
the Triton kernel is faster (H200, NOTES.md v22, persistent grid: 512 keys 318 TFLOP/s against 346
without a mask, 1024 413 against 393; causal 2048 294 against 351, 4096 414 against 381): a tile's
half-size products of d=64 leave more of its time to fixed costs. Since BALANCE (NOTES.md v26, H100) the
Gluon kernel wins without a mask from 512 keys (363-368 against 340-344; 256 keys 220 against 257), and
causal still lost at 1024 and 2048 (213 against 281, 305 against 345); with two consumer warpgroups up to 4096 keys
(FORWARD_SHORT, NOTES.md v30, H100) it wins from 2048 (377 against 343) and ties at 1024 (283 against 281). At d=128
the Gluon kernel wins from 512 keys on (517 against 314 without a mask, 245 against 188 causal). d=256: as d=128
(its products are twice as long, so fixed costs weigh less); not measured."""


SHORT_KEYS = {(64, False): 512, (64, True): 4096, (128, False): 0, (128, True): 1024, (256, False): 0, (256, True): 0}
"""Most keys for which the Gluon kernel takes FORWARD_SHORT's shape instead of its own, by (head dim, causal); 0:
never. The same kernel at other constexprs: a second binary, compiled on the first call that takes it."""

FORWARD_SHORT = {(64, False): FORWARD_MAIN[128], (64, True): FORWARD_MAIN[128], (128, False): FORWARD_MAIN[128],
                 (128, True): replace(FORWARD_MAIN[128], block_n=64, stages=3), (256, False): FORWARD_MAIN[256],
                 (256, True): FORWARD_MAIN[256]}
"""The shape of calls of at most SHORT_KEYS keys, by (head dim, causal): `GluonForward.short` (each
consumer warpgroup keeps its 64 rows, so the Q and output descriptors are the same; the verifier checks it). Causal d=128 (H200, NOTES.md v22): 64-key blocks in 3 stages 297 TFLOP/s against 243 at N=512 (a
4-block tile becomes 8 steps, and the diagonal block wastes half as much), 417 against 394 at 1024, 477 against
509 at 2048; without a mask and at d=64 they lose at every length measured. d=64 (H100, NOTES.md v30): two consumer warpgroups (128-row tiles, as at d=128) instead of
three, causal 283 / 377 / 421 TFLOP/s against 213 / 302 / 417 at N = 1024 / 2048 / 4096 (the Triton kernel 281 /
343 / 373) but 441 / 466 against 460 / 476 at 8192 / 16384; without a mask 374 against 361 at 512, level at 1024,
455 against 493 at 4096."""


BALANCE = {(64, False): True, (64, True): True, (128, False): True, (128, True): False, (256, False): False,
           (256, True): False}
"""Whether a persistent grid deals each round's tiles (causal: pairs of them) so that the short ones are spread
over the programs, by (head dim, causal); the kernel does so only when a sequence's last row block leaves a
warpgroup idle or, causal, a middle row block has no pair (_ws_balanced_slot in templates/gluon_forward.py.j2).
Taken in place order, P = 132 programs against 22 row blocks a head (d=64, N=4096) gave 6 programs every short
tile and the rest none. Measured (H100, kernel time, NOTES.md v26):
d=64 without a mask -6% at N=1024, -4% at 2048, -6.5 to -7.5% at 4096, within noise at 8192-16384; causal 0 to
-2.3% at 4096, within noise from 8192; d=128 without a mask -1% at 4000 and 4096; causal d=128 +0.6-1.4% (it has no short pair at the bench's
lengths, and the dealing's arithmetic costs its registers more): off. d=256: no persistent grid (PERSISTENT_FITS)."""


PERSISTENT_FITS = {64: True, 128: True, 256: False}
"""By head dim: whether a persistent grid's second Q buffer fits in shared memory beside the K/V ring (227 KB): at
d=256 one tile's Q is 64 KB and the ring 128 KB, so the forward there takes one program per tile whatever
FORWARD_FLAGS.persistent says."""


MIN_SCORES = 1 << 25
"""Fewest scores (B * H * N_Q * N_K) for which the Gluon kernel runs. Its launch costs about 50 us more
host time than the Triton kernel's (four TMA descriptors built per call, and Triton's own launcher:
FastJIT passes descriptors to it: 79 against 26 us for B=1 H=16
N=128 d=128, 9.6 us of GPU work either way). Below 2^25 scores (about 30 us of GPU work at d=128) a call
is host-bound and the Triton kernel finishes first."""


BWD_HEAD_DIMS = (64, 96, 128)
"""Head dims whose backward gives each consumer warpgroup its own keys. d=256 is not here: a consumer warpgroup's dK
and dV [64, 256] float32 accumulators are 256 registers a thread alone. ptxas (sm_90a) on the d=128 kernel at d=256:
two consumers of 64 keys spill 4524 bytes (and need 296 KB of shared memory at one stage), one consumer of 64 keys
at 255 registers spills 5720 (214 KB); d=128 spills 68. d=256 takes BWD_WIDE instead."""

WIDE_BACKWARD = True
"""Whether a d=256 program's backward takes the Gluon kernel's wide path (BWD_WIDE); it covers d=256 and DeepSeek's
(192, 128) (SPLIT_FORWARD: Q and K tiles 256 wide, V, dO and dV 128). Its GPU tests pass (H200, 2026-11-28,
tests/test_gluon_wide_backward.py); `attngen bench --suite shapes` backward: d=256 B=1 H=8 N=8192 causal 258
TFLOP/s (Triton 204; cuDNN 417), 192/128 B=1 H=128 N=4096 causal 282 (Triton 199; cuDNN 425). Off: the Triton
kernels, and `attngen explain` says why.""" 

BWD_WIDE = ir.GluonShape(block_m=64, block_n=64, stages=1, consumers=2, consumer_regs=240, maxnreg=168)
"""The Gluon backward's shape at d=256 (`GluonBackward.wide`), FlashAttention 3's split for hdim 256: both consumer
warpgroups on the program's 64 keys, each holding half of dK's and dV's columns ([64, 128] float32: 64 registers
each) and computing S^T and dP^T for half of the step's 64 query rows ([64 keys, 32 queries], over all 256
columns); they exchange P^T and dS^T through shared memory (each writes its 32 columns of a [64, 64] tile, double
buffered, an mbarrier a step), then each adds P^T dO and dS^T Q into its columns of dV and dK and makes its 128
columns of the step's dQ = dS K ([64, 128] float32), added into the accumulator by a TMA reduction. Shared memory
(sm_90a, 227 KB): K and V 64 KB, P^T and dS^T 32 KB, the two dQ tiles 64 KB, so Q and dO get one stage (64 KB):
the loader refills it once both consumers' dK and dV products are done, while they make dQ. The alternatives, by
ptxas -v (benchmarks/NOTES.md "Head shapes"): two consumers of 64 keys each (the d=128 kernel) spill 4.5 KB, one
consumer of 64 keys spills 5.7 KB; a consumer's S^T needs 64 keys (wgmma's M), so one consumer of 32 keys cannot be
written with this kernel's products. No GQA split (max_group_split 1), no DQ_LOCAL or DQ_CLAIM, and no dK/dV-only
kernel: under deterministic algorithms the Triton kernels run. DeepSeek's (192, 128) takes it too, Q and K 256
columns wide (TILE_DIM), V, dO and a consumer's 64 columns of dV 128 (the same shared memory less 48 KB), or with
SPLIT_TILES_192 192 columns in two pieces (BWD_WIDE_SPLIT). Two stages: BWD_WIDE_STAGED, behind WIDE_BACKWARD_STAGES."""


WIDE_BACKWARD_STAGES = True
"""Whether the wide path takes BWD_WIDE_STAGED (two Q/dO stages) instead of BWD_WIDE (one), for the head-dim pairs of
BWD_WIDE_STAGED_PAIRS. ptxas (sm_90a, 168 registers): spill stores / loads in bytes d=256 120 / 112 without a mask and
128 / 120 causal, against BWD_WIDE's 312 / 304 and 336 / 328; (192, 128) none, against 24 / 16 and 32 / 24. Its GPU
tests pass (H200, 2026-11-28, tests/test_gluon_wide_backward.py); `benchmarks/wide_backward.py` at 5ae37a6 (H200, TFLOP/s of the
backward, cuDNN in the same process): d=256 B=1 H=8 N=8192 causal 367 against one stage's 258 (cuDNN 414: 0.89x),
without a mask 363 against 266 (cuDNN 368: 0.99x); (192, 128) B=1 H=128 N=4096 lost: causal 263 against 281,
without a mask 277 against 309."""

BWD_WIDE_STAGED_PAIRS = frozenset({(256, 256)})
"""The (q.k, v) head dims whose wide backward takes BWD_WIDE_STAGED while WIDE_BACKWARD_STAGES is on: d=256, which it
speeds up 1.36-1.42x; not DeepSeek's (192, 128), which it slows 6-10% (WIDE_BACKWARD_STAGES): there the dQ tiles that
hold a stage are half filled by dO, and one stage's refill already hid behind the shorter dV products."""

BWD_WIDE_STAGED = replace(BWD_WIDE, stages=2)
"""The wide path with two stages of Q and dO, so that the loader fetches the next step's while the consumers work on
this one's (BWD_WIDE's one stage waits for the refill at every step). Beside two stages, separate dQ tiles do not fit
(d=256: K and V 64 KB, two stages 128 KB, P^T and dS^T 32 KB, the dQ tiles 64 KB: 288 KB), so each stage is the two
consumers' float32 [64, 128] dQ tiles (64 KB): Q lives in the first and dO in the second (at (192, 128) dO fills
half of its tile) until both consumers' products over them are done (an mbarrier a step), then consumer c's dQ
takes tile c, and the stage is released in the next step once its TMA reduction has read it. Shared memory
(`analysis.resources.wide_backward_shared_bytes`): d=256 224 KB, (192, 128) 208 KB; a third stage fits neither."""


SPLIT_TILES_192 = True
"""Whether DeepSeek's (192, 128) Gluon kernels take their Q and K tiles as the column pieces TILE_PIECES gives (192 =
128 + 64: two TMA boxes and shared buffers, S as two wgmma over K = 128 and K = 64) instead of 256 columns of which 64
are zeros. The wide backward (BWD_WIDE_SPLIT): S^T, dK and dQ a quarter less work, and two stages of Q and dO in
separate buffers; consumer 0 holds dK's and dQ's first 128 columns, consumer 1 their last 64 and all of dV's 128 (each
256 columns of products a step). The plain forward (SPLIT_FORWARD's shape; not a variant's): S a quarter less work,
Q's and K's buffers 49 KB less shared memory (ptxas, sm_90a: 180,664 B against 229,736, no spills either way). Its GPU
tests pass (H200, 2026-11-28); `benchmarks/wide_backward.py` at 5ae37a6 (H200, B=1 H=128 N=4096, TFLOP/s forward / backward,
cuDNN in the same process): causal 574 / 345 against 256 columns' 497 / 282 (cuDNN 543 / 428: 1.06x / 0.81x), without
a mask 591 / 376 against 536 / 313 (cuDNN 605 / 314: 0.98x / 1.20x)."""

TILE_PIECES = {192: (128, 64)}
"""Head dims whose Q and K tiles the wide backward takes as column pieces of power-of-two widths (SPLIT_TILES_192):
Gluon 3.6's register tiles and TMA boxes take power-of-two shapes only, so a 192-column tile is two."""


def tile_pieces(head_dim: int) -> tuple[int, ...]:
    """The column pieces of a head dim's Q and K tiles in the wide backward: TILE_PIECES's where SPLIT_TILES_192 is on,
    else () (one tile of `tile_dim`'s width)."""
    return TILE_PIECES.get(head_dim, ()) if SPLIT_TILES_192 else ()


BWD_WIDE_SPLIT = replace(BWD_WIDE, stages=2)
"""The wide path with its Q and K tiles in pieces (SPLIT_TILES_192, (192, 128)): two stages of Q and dO in their own
buffers, beside separate dQ tiles (K 24 KB, V 16 KB, two stages of Q 48 KB and dO 32 KB, P^T and dS^T 32 KB, the dQ
tiles 32 + 16 KB: 201 KB; `analysis.resources.wide_backward_shared_bytes`). Not measured: the one-stage form is
BWD_WIDE_SPLIT with stages=1, the first alternative to try."""


WIDE_BWD_PAIRED = False
"""Whether the wide backward's causal programs take two key tiles each (`GluonBackward.paired`) where its Q and K tiles
are in pieces (SPLIT_TILES_192: ptxas, sm_90a, no spills either way; the 256-column one-stage form, which the
template also pairs, spills 220 / 228 B against 32 / 24): program p key tile p and then tile T - 1 - p of its head's
T (the longest with the shortest: 65 steps of 64 query rows each at N=4096, as a program without a mask takes 64),
its loader asking for the second tile's first Q and dO blocks while the consumers finish the first, and loading the
second's K and V once the first's dK and dV have left their buffers. Why: at (192, 128) B=1 H=128 N=4096 the causal
backward ran 345 TFLOP/s against 376 without a mask (H200, SPLIT_TILES_192), where its 8,192 programs average 32.5
steps against 64, so what a program pays once (its launch, K and V loaded and the ring filled before the first step,
dK and dV stored after the last) weighs twice as much; read as that alone, the gap is about 5 steps a program
(benchmarks/NOTES.md "Head shapes"). The launch order is not the gap: a list-scheduling simulation of the per-tile
grid (132 programs at a time, a tile's time its steps plus a fixed cost c) is within 1.5% of the work's own makespan
at c = 0 to 2 steps, with and without the mask. Pairs halve the launches and hide the second tile's ring fill behind
the first's last steps; the second tile's K and V load stays exposed (shared memory holds one K/V tile: 205,888 of
232,448 B). Measured (H200, 2026-11-28, `python benchmarks/wide_backward.py` at f1790be, one process, its GPU tests passing):
192/128 causal backward 361 TFLOP/s paired against 359 per tile (cuDNN 432), no mask 385 / 385 (cuDNN 313), d=256
causal 370 / 373: a tie, so off. The fixed cost a program pays is not what holds the causal rate back."""

WIDE_BWD_PAIR_TAIL_WAVES = 2
"""Under WIDE_BWD_PAIRED, how many waves of programs (multiprocessors' worth) of single key tiles end a launch: the last
cdiv(waves x multiprocessors, T) (batch, head)s are not paired (`ws_bwd_paired_heads` in the generated launcher). Pairs
are all as long (T + 1 steps), so a launch of pairs alone ends in a part-filled wave: 4,096 pairs at (192, 128) B=1
H=128 N=4096 are 31.03 waves of 132, and the list-scheduling simulation (`python benchmarks/wide_backward.py
--simulate` at f1790be, a program's time its steps plus a fixed cost c, plus `second` for a pair's second K/V load) puts all pairs
at 0.969 of the no-mask rate where the per-tile grid makes 0.985 (c = 0), and 0.943 against 0.922 at c = 5, second = 2;
with the last 5 heads single (2 waves) 0.985 and 0.957: never below the per-tile grid there. At other shapes the best
count differs (H=16, N=4096: all pairs 1.09x the per-tile grid's rate at c = 0, 2 waves 1.01x): a value to measure
(0: every head paired)."""


@dataclass(frozen=True, slots=True)
class BackwardFlags:
    """The Gluon backward's switches and loader registers, the same at every head dim and mask."""

    loader_regs: int
    ahead: bool
    dq_atomic: bool
    rows_smem: bool


BWD_FLAGS = BackwardFlags(loader_regs=24, ahead=False, dq_atomic=True, rows_smem=True)
"""Each step's products waited for before the next step's (AHEAD: the next step's S^T issued first; ptxas then
serialises the wgmma queue, C7514). DQ_ATOMIC: dQ made here (off: dK and dV only, beside the Triton dQ kernel).
ROWS_SMEM: lse and delta come by TMA with Q and dO (DQ_ATOMIC only; the row pass lays them out): +12-20% over
loading them through pointers in the consumers (NOTES.md v11)."""

_BWD_TWO_STAGES = ir.GluonShape(block_m=64, block_n=128, stages=2, consumers=2, consumer_regs=240, maxnreg=168)
BWD_MAIN = {(64, False): replace(_BWD_TWO_STAGES, stages=3), (64, True): _BWD_TWO_STAGES,
            (128, False): _BWD_TWO_STAGES, (128, True): _BWD_TWO_STAGES}
"""The Gluon backward's launch shape, by (head dim, causal): 128 keys per program in two consumer warpgroups of
64 (each holds its dK and dV [64, D] accumulators in registers and makes D/2 columns of the step's dQ), blocks of
64 queries, the loader at 24 registers. Stages of Q and dO (and the rows): d=128 fills shared memory at 2
(198 KB); at d=64 a third stage wins without a mask (+7-15%) and not causal (-1 to +4%)."""

BWD_DQ_LOCAL_ROWS = {(64, False): 1024, (64, True): 0, (128, False): 0, (128, True): 0}
"""By (head dim, causal): from how many query rows on each consumer makes dQ over its own keys (DQ_LOCAL:
every column, a partial sum it adds by its own TMA reduction) instead of its share of the columns over all the
program's keys, which needs the other consumer's dS^T first (an mbarrier at every step); 0: never. A constexpr
of the kernel: a spec that runs both gets a second binary, compiled on the first call that takes it.
Measured (NOTES.md v24-v25; the Gluon kernel alone by torch.profiler / the whole
call by do_bench, cache flushed): d=64 without a mask kernel -5 to -10% from N=1024 (H200; H100 -2% at 1024),
whole call +1.7-2.9% at 4096-16384 (N=4096: 411 -> 423 TFLOP/s), but at N=512 the kernel +5.4% slower on the
H100 (491 -> 518 us) and level on the H200 (496 -> 497); d=64 causal kernel 0 to -3% but the whole call -0-3%; d=128
+23-30% slower (a [64, 128] float32 dQ accumulator beside dK and dV: more spills, twice the reduction bytes)."""

BWD_LATE_ROWS = {(64, False): 0, (64, True): 0, (128, False): 1, (128, True): 2}
"""By (head dim, causal): which of a step's rows the consumers read from shared memory where they use them
rather than before the step's waits for its S^T and dP^T products (LATE_ROWS; ROWS_SMEM only). 0: lse and
delta both before; 1: delta after the dP^T wait; 2: lse after the S^T wait too. Read early, each [BLOCK_M]
row costs a consumer 16 registers across those waits, at the point where it also holds dK, dV, P^T and
dP^T: ptxas spilled 184 bytes at d=128 without a mask and 232 causal; with 1, 68 and 76; with 2, 4 and 16.
Measured (H100, NOTES.md v28, the Gluon kernel by torch.profiler): d=128
without a mask 1: -3.0 to -4.4% at N = 512-16384 (2: -2.0 to -4.3%), causal 2: -5.0 to -8.7% (1: -3.7 to
-7.1%); H200 with 2: -4.1 to -5.3% without a mask, -8.3 to -13.7% causal; d=64 (no spills either way) +1-7%
with 1 and +1-12% with 2."""

BWD_DQ_CLAIM_KEYS = {(64, False): 0, (64, True): 0, (128, False): 0, (128, True): 1024}
"""By (head dim, causal): up to how many keys the one-kernel backward claims its dQ tiles (DQ_CLAIM) instead of
the prep pass zeroing the float32 dQ accumulator; 0: never. Each consumer warpgroup claims each step's tile (its
columns of a block of BLOCK_M query rows) after the step's S^T wait (a compare-and-swap on a word per tile, which
the prep pass zeroes instead); the first to claim stores its part at the step's end and sets the word's announced
bit once that store is written, in its next step; the others add theirs by TMA reduction once the bit is set. The
prep pass writes 4 bytes per dQ element less and no reduction reads zeros back from DRAM; each step pays for its
claim. Measured (H100, NOTES.md v29; all three kernels / the Gluon kernel):
d=128 causal -12% / -7% at N=512, -5% / +3% at 768, -2.5% / +5% at 1024, level / +5% at 2048, +2-3% / +5.5% at
4096 (the prep pass saves the same bytes at every length, the claims cost per step); d=64 causal +8-22% / +23-26%
(shorter steps hide less of the claim); without a mask every program of a head reaches each tile at once and
waits for its owner (d=128 +20-30%). A constexpr of the kernel, so a spec that runs both gets two binaries."""

BWD_SPLIT = {64: False, 128: True}
"""By head dim: whether the kernel without DQ_ATOMIC (dK, dV only) beats the Triton dK/dV kernel, for
when dQ must come from the Triton kernel (deterministic algorithms). At d=128 it does (558-570 TFLOP/s
on its four products against 516-533); at d=64 it does not (324-415 against 433-448, NOTES.md v10)."""

BWD_MIN_KEYS = {False: 1, True: 1}
"""Fewest keys for which the Gluon backward runs, by causal. Before DQ_ATOMIC the Triton kernels won
without a mask at 512 keys; the one-kernel form wins from 512 at both head dims (H200, d=128: 342
TFLOP/s against 289 without a mask, 213 against 166 causal; d=64: 281 against 254, 185 against 186;
NOTES.md v11), so only BWD_MIN_SCORES limits it."""

BWD_SHORT_KEYS = {(64, False): 0, (64, True): 2048, (128, False): 0, (128, True): 0}
"""Most keys for which the Gluon backward takes BWD_SHORT's shape instead of its own, by (head dim, causal);
0: never. The same kernel at other constexprs: a second binary, compiled on the first call that takes it."""

BWD_SHORT = {(64, False): BWD_MAIN[(64, False)],
             (64, True): ir.GluonShape(block_m=64, block_n=64, stages=3, consumers=1, consumer_regs=232, maxnreg=128),
             (128, False): BWD_MAIN[(128, False)], (128, True): BWD_MAIN[(128, True)]}
"""The backward's shape of calls of at most BWD_SHORT_KEYS keys, by (head dim, causal):
`GluonBackward.short` (each consumer keeps its 64 keys, so the K/V descriptors are the same; the verifier checks it). Causal d=64: one consumer warpgroup of 64 keys a program at 128 registers
(8 warps: the loader padded to a warpgroup; ptxas: 128 registers, no spills; 100 KB of shared memory at 3 stages),
so that two programs share a multiprocessor and one's start (K, V, the first Q and dO) and drain (dK, dV stored)
run beside the other's steps; the main shape fills the register file with one program (12 warps x 168). Each Q and
dO block streamed then feeds 64 keys instead of 128. Measured (H200, NOTES.md v38; the Gluon kernel by torch.profiler / the whole call by do_bench):
causal N=512 -11% / +10% (184 -> 202 TFLOP/s, cuDNN 171), 1024 -9% / +5%, 2048 -7% / +1%, 4096 -5% / -2%, 8192
-2% / -4%, 16384 +2% / -6%; without a mask -2% / +2% at 512 and -1% to +15% / -3 to -8% from 1024: not taken."""

BWD_MAX_GROUP_SPLIT = 8
"""At most how many programs share the query heads of one GQA group in the Gluon backward (1: never split). The
dK/dV grid has one program per (batch, K/V head, key tile), each walking every query head of its group: at B=1 with
4 K/V heads and 2049 keys that is 68 programs on the H200's 132 multiprocessors, the backward at 0.49 of cuDNN
(issue 51, d=128 GQA 28/4 causal). `group_split` (policy/splits.py, the Triton backward's rule too) picks the count
per launch from the grid and the multiprocessors; each part's program adds its heads' dK and dV in float32 and a
pass after sums the parts in order. Only the one-kernel backward (DQ_ATOMIC) is split: the dK/dV-only kernel of deterministic algorithms spills
more with the float32 stores from registers (d=128 without a mask: 104 -> 272 bytes, ptxas; with dQ: 68 -> 0).
Not measured yet: the cap only bounds the float32 workspace (parts x the dK and dV bytes x 2)."""


BWD_ROW_ELEMENTS = 4096
"""Elements per program of the two row passes around the one-kernel backward (lse, delta and the zeroed dQ
accumulator before; dQ after): ROW_BLOCK = 4096 / d rows, 4 warps. At d=128 the prep pass took 86 us
in blocks of BLOCK_M = 64 rows and takes 73 in blocks of 32 (3.1 -> 3.7 TB/s, H200, B x H x N = 262144);
d=64 and the dQ pass were already there (NOTES.md v17)."""

BWD_MIN_SCORES = 1 << 25
"""Fewest scores (B * H * N_Q * N_K) for which the Gluon dK/dV kernel runs: below, the host time of its
six descriptors is not hidden (see MIN_SCORES)."""


DECODE_HEAD_DIMS = (64, 128)
DECODE_MIN_PAGE = 16
"""Fewest tokens a page of a paged cache holds for the Gluon decode kernel: a TMA copy of fewer rows would cut
through the shared tiles' swizzle pattern."""

DECODE = ir.GluonDecode(block_n=64, stages=3, rows=64, loader_regs=40)
"""The Gluon decode kernel's launch shape: blocks of 64 keys, 3 stages of K and V, at most 64 query rows
per K/V head (wgmma's N of the swapped products, padded to a power of two from 8; more rows go to the
Triton kernel), a loader warp of 40 registers: 98 KB of shared memory for the ring at d=128 and a few
KB for Q and P^T, one program per multiprocessor (ptxas gives the 8 warps 255 registers). 3 stages
were faster than 4 and 6 at every batch and context measured, by 0-5% (NOTES.md v13, v32)."""


def forward(head_dim: int, causal: bool, head_dim_v: int | None = None) -> ir.GluonForward:
    """The Gluon forward's shapes and thresholds for a head dim in HEAD_DIMS (those of its tiles' width), or with
    head_dim_v for a pair in SPLIT_FORWARD (its Q and K tiles in `tile_pieces` where SPLIT_TILES_192 is on)."""
    split = None if head_dim_v is None else SPLIT_FORWARD[(head_dim, head_dim_v)]
    pieces = () if split is None else tile_pieces(head_dim)
    head_dim = tile_dim(head_dim)
    key, f = (head_dim, causal), FORWARD_FLAGS
    main, short = (FORWARD_MAIN[head_dim], FORWARD_SHORT[key]) if split is None else (split, split)
    fits = PERSISTENT_FITS[head_dim] if split is None else True
    return ir.GluonForward(main=main, short=short, loader_regs=f.loader_regs,
                           overlap=f.overlap, pingpong=f.pingpong, early_p=f.early_p, trim=f.trim,
                           persistent=f.persistent and fits, balance=BALANCE[key], pair=causal,
                           min_keys=MIN_KEYS[key],
                           short_keys=SHORT_KEYS[key], min_scores=MIN_SCORES, pieces=pieces)


LINEAR_DISTANCE = True
"""Whether the Gluon kernels of a variant program whose score modifier adds c * |q - k + shift| with one sign on every
block the mask keeps (analysis/distance.py: the context-parallel ring's ALiBi blocks off the diagonal, written without
the |.|; the causal ALiBi; a linear relative bias) take it as a term per key folded into the scale's FMA and a term per
row folded into the running max (the forward) or the loaded log-sum-exp (the backward): one floating-point instruction
a score against three. Measured (H200, 2026-11-29, lin_ab.py on branch exp-distance: B=1 H=16 N=16384 d=128, rounds
alternating in one process): a context-parallel block of keys wholly before its queries forward 437-460 -> 566-601
TFLOP/s, backward 404-412 -> 556-571 (the plain unmasked kernel's 606-626 and 511-549); two H200s, the ring's ALiBi at
128k tokens 837 -> 1054 forward + backward (NOTES.md v61). Masked programs: LINEAR_DISTANCE_MASKED."""

LINEAR_DISTANCE_MASKED = True
"""Whether LINEAR_DISTANCE takes masked programs too (the built-in causal ALiBi, whose kept distances are all >= 0).
Measured as LINEAR_DISTANCE (causal, N=16384): forward 482-504 -> 532-540 TFLOP/s, backward 526-531 -> 470-535 (a tie).
(A first A/B had it losing 2-3%: its calls through attention() replayed plans made before the switch was set, so
both settings ran the same kernel; plans now key on the switches, `switch_generation`.)"""

LINEAR_DISTANCE_BY_BLOCK = True
"""Whether the Gluon forward of an unmasked variant program whose distance bias has both signs (ALiBi without a causal
mask, as bidirectional encoders use it; a context-parallel block straddling the diagonal) tests each key block's
corners and takes the split form on the blocks wholly on one side of the diagonal (c * |d| = sign(c) * |rc - kd| on
the others, from the same terms). ptxas spills 168 bytes a consumer thread at d=128 (16 without); measured (as
LINEAR_DISTANCE, no mask, N=16384): 450-456 -> 507-525 TFLOP/s. The backward: LINEAR_DISTANCE_BY_BLOCK_BACKWARD."""

LINEAR_DISTANCE_BY_BLOCK_BACKWARD = True
"""LINEAR_DISTANCE_BY_BLOCK for the Gluon dK/dV kernel: each step (a query block against the key tile) tests its
corners. ptxas for sm_90a at d=128 without a mask: 332 bytes of spills a consumer thread against the |.| form's 328,
168 registers. GPU-tested (2026-11-29, H200: `pytest -m gpu tests/test_gluon_distance.py`, its steps below, across and
above the diagonal against float64). Measured on one H200 (benchmarks/experiments/lin_ab.py on branch exp-distance,
SWITCH=LINEAR_DISTANCE_BY_BLOCK_BACKWARD BCASES=alibi_full_abs,plain_full, three alternating rounds; B=1 H=16 N=16384
d=128, ALiBi without a mask): backward 411-413 -> 510-544 TFLOP/s (1.32x); the plain unmasked backward, which it does
not touch, 545-558 / 536-550. On since."""

VARIANT_RAW_MAX = True
"""Whether the Gluon forward of a variant program without a score modifier (windows, prefixes, chunks, sinks) takes
each block's running max over the raw scores and scales it once a row, the scale then in exp2's FMA, as the plain
kernel does (the IR's max for such a program), instead of scaling every score before its max and exponential.
Measured (as LINEAR_DISTANCE): causal window 4096 495-509 -> 506-526 TFLOP/s; 8 packed documents (varlen, causal)
453-490 -> 471-508. Varlen programs take it too since tests/test_gluon_varlen.py's GPU tests passed with it
(2026-11-29, H200, 215 passed)."""


def forward_variant(head_dim: int, masked: bool, pair: bool, head_dim_v: int | None = None,
                    distance: bool = False, any_distance: bool = False) -> ir.GluonForward:
    """The Gluon forward's shapes and thresholds for a variant program (issue 48): a masked variant takes the
    causal column of the tables (a window, prefix or chunk skips blocks as the causal mask does and masks a
    few), an unmasked one (softcap, sinks) the column without a mask. BALANCE is off: its dealing plans around
    a sequence's short last row block, and a variant's tiles differ by their key blocks instead. `pair`: the
    tiles' work grows with the row block as the causal mask's does (a prefix-LM, ALiBi or softcap under a
    causal mask), so they are taken as the causal mask's are, longest first and in pairs; taken in order,
    the last round of a persistent grid held the longest tiles (prefix-LM 2048 443 TFLOP/s on the H100 against
    the plain causal kernel's 676, NOTES.md v44)."""
    # (the tiles in pieces, SPLIT_TILES_192, are the plain forward's only: not tested with a variant's hooks)
    # `distance`: the program's score modifier is a distance bias (LINEAR_DISTANCE takes it linearly).
    return replace(forward(head_dim, masked, head_dim_v), balance=False, pair=pair, pieces=(),
                   distance=distance and LINEAR_DISTANCE and (LINEAR_DISTANCE_MASKED or not masked),
                   distance_by_block=any_distance and not distance and LINEAR_DISTANCE_BY_BLOCK and not masked,
                   raw_max=VARIANT_RAW_MAX)


def forward_varlen(head_dim: int, causal: bool, distance: bool = False) -> ir.GluonForward:
    """The Gluon forward's shapes and thresholds for a packed variable-length program: the variant column of the
    tables (its tiles visit the key blocks the IR's loops give each sequence), always at the main shape (the
    lengths are on the GPU, so a launch cannot pick the short shape by them), the persistent grid without BALANCE
    (its dealing plans around one sequence length). min_keys and min_scores are compared with the average keys a
    sequence and the scores of sequences that long (`ws_ready`): guesses, not measured. The shape: 8 documents in
    16k tokens, causal, 493 TFLOP/s on the H200 and 462 on the H100 (NOTES.md v44)."""
    variant = forward_variant(head_dim, causal, pair=False, distance=distance)  # (tiles dealt by _ws_sequence_tile)
    return replace(variant, short=variant.main, short_keys=0)


FP8_GLUON = True
"""Whether FP8 specs (dtype = fp8_e4m3) get the Gluon forward (`forward_fp8`); while off, warp-specialize leaves FP8
specs on the Triton kernel and `attngen explain` says why (`fp8_refusal`). On since it beat the Triton FP8 kernel with
FP8_PERMUTE_P and FP8_EARLY_P off (H200, 2026-11-28, benchmarks/fp8_permute.py at 9ee44a8, d=128, 16 heads, 32k tokens,
TFLOP/s with the launcher's copy of V: 804 / 812 / 819 without a mask at N = 4096 / 8192 / 16384 against the Triton
kernel's 719 / 746 / 754 on V already keys-contiguous, causal 692 / 738 / 763 against 599 / 674 / 720; the bf16 Gluon
forward 629-633 and 568-611). Before those two it ran no faster than the Triton kernel (684 / 727 without a mask at N =
4096 / 16384 against 718 / 764, causal 609 / 688 against 581 / 696)."""

FP8_HEAD_DIMS = (128,)
"""The head dims FP8 specs take the Gluon forward at (FP8_FORWARD has shapes for 64 and 128). d=64 stays on the Triton
kernel: there the Gluon one (FP8_PERMUTE_P, FP8_EARLY_P off) ran 475 / 499 TFLOP/s without a mask at N = 4096 / 16384
against the Triton kernel's 493 / 508, causal 422 / 469 against 415 / 476 (H200, 2026-11-28, benchmarks/fp8_permute.py
at 9ee44a8 --head-dim 64, 16 heads, 32k tokens; FP8 at d=64 is no faster than bf16 there: 514-527 and 428-482)."""

FP8_FORWARD = {
    64: ir.GluonShape(block_m=192, block_n=64, stages=3, consumers=3, consumer_regs=160, maxnreg=128),
    128: ir.GluonShape(block_m=128, block_n=128, stages=3, consumers=2, consumer_regs=240, maxnreg=168),
}
"""The FP8 Gluon forward's launch shape by head dim, at every length. d=128: the 16-bit kernel's tiles (FORWARD_MAIN),
as FlashAttention 3's FP8 kernel takes 128 rows in two consumer warpgroups; its K and V blocks are half the bytes (16 KB
each a stage), so a third stage fits (164,312 bytes of shared memory; ptxas, sm_90a: 168 registers, 8-20 bytes spilled,
as at 2 stages). 3 stages since they beat 2 with FP8_PERMUTE_P (H200, 2026-11-28, benchmarks/fp8_permute.py at 9ee44a8
--alternatives, 16 heads, 32k tokens, TFLOP/s at N = 4096 / 8192 / 16384: 796 / 832 / 834 without a mask against 800 /
830 / 822, causal 693 / 770 / 790 against 685 / 751 / 758; before FP8_PERMUTE_P they tied). Its Q buffers are allocated
as the bf16 output tiles a Q tile fills half of (64 KB for the persistent grid's two). d=64 (not taken: FP8_HEAD_DIMS):
FA3's 192 rows in three consumer warpgroups, but 64-key blocks in 3 stages: with 128-key blocks a consumer's 160
registers spill 608-760 bytes (the bf16 kernel 356), with 64 none (90,588 bytes of shared memory). Not measured on a
GPU: d=64 at two consumers of 128-key blocks (no spills either), and FA3's 176- and 160-key blocks (not powers of
two)."""


FP8_FORWARD_ALTERNATIVES = {
    "stages2": ir.GluonShape(block_m=128, block_n=128, stages=2, consumers=2, consumer_regs=240, maxnreg=168),
}
"""Shapes to A/B against FP8_FORWARD[128] on a GPU (a run sets FP8_FORWARD[128] to one in a process and kernel cache
of its own: the cache keys on SWITCHES, not on the tables). "stages2": the shape before 3 stages (131,480 bytes of
shared memory; 0-4% slower, see FP8_FORWARD). Measured and dropped (H200, 2026-11-28, fp8_permute.py --alternatives:
benchmarks/ at 9ee44a8 for consumers3, benchmarks/experiments/ at f8a468a for the flags; 16 heads, 32k tokens, TFLOP/s
at N = 4096 / 16384 against FP8_FORWARD[128]'s, NOTES.md v53): three consumer
warpgroups of 64 rows over 64-key blocks in 3 stages 770 / 807 against 812 / 839 without a mask, 672 / 768 against 702
/ 785 causal; one program a tile instead of the persistent grid (FORWARD_FLAGS.persistent off) 765 / 823 and 661 /
805, and with the consumers taking turns (pingpong, TRIM off) 768 / 812 and 670 / 794: a tie with one program a tile,
below the persistent grid but at causal N = 16384. Wider blocks: FA3's FP8 kernel takes 176 keys at d=128, which a
register tile of power-of-two shape cannot (192 neither); 256-key blocks (197,016 bytes) spill 1,572-1,740 bytes a
consumer thread at 240 registers (its [64, 256] float32 scores are 128 registers beside the accumulator's 64) and
ptxas serialises their wgmma: not worth a GPU run."""


FP8_EXP2_EMULATION = False
"""Whether the FP8 Gluon forward computes part of each key block's exponentials on the FMA pipe
(`GluonForward.exp2_fma`, FP8_EXP2_FMA's share of its columns; codegen/exp2_fma.py). At d=128 a score costs 512 FLOPs
of the two products: the H200's dense e4m3 rate (~1,979 TFLOP/s) makes ~3.9e12 scores/s, and its exp2 units
(MUFU.EX2: 132 SMs x 16 a clock x ~1.83 GHz) ~3.9e12/s too, so with every exponential on them the softmax takes as
long as the products and the kernel cannot pass about half the e4m3 peak. An emulated exp2 is ~10 FP32/integer
instructions (Cody-Waite: 2^x = 2^round(x) * 2^f, 2^f by a degree-3 polynomial, round(x) added into the exponent
bits), on pipes 8x as wide as MUFU's. Compiled for sm_90a (ptxas, CPU; tests/test_gluon_fp8.py): at a quarter, MUFU.EX2
260 -> 196 in the d=128 kernel's SASS (64 -> 48 a block and consumer thread, the rows' rescaling kept), d=64 198 ->
150; the same registers and spills (8 bytes causal d=128, none at d=64), no shuffles added (the tile is split by
its columns' register bits), the wgmma not serialised. Off: it lost on the H200 (2026-11-28, benchmarks/fp8_exp2.py at
5ae37a6, d=128, 16 heads, 16k tokens, TFLOP/s): without a mask 619 / 636 at N = 4096 / 16384 against the Gluon FP8
kernel's 686 / 710 (a half: 517 / 537), causal 523 / 594 against 622 / 694; the extra FMA-pipe instructions cost more
issue slots than the MUFU time they free, at this tile."""

FP8_EXP2_FMA = {64: 0.25, 128: 0.25}
"""The share of each key block's columns whose exp2 runs on the FMA pipe where FP8_EXP2_EMULATION is on, by head dim:
1/2^k (the tile is halved k times by its columns, and the last part emulated). Why a quarter, per multiprocessor and
clock at d=128: the e4m3 products make 16 scores (~1,979 TFLOP/s / 512 FLOPs / 132 SMs / 1.83 GHz), MUFU 16
exponentials, and the 4 schedulers issue 128 thread-instructions, of which a score takes ~4.5 besides the emulation
(the scale's FFMA, the max, the sum, half an e4m3 pack, its MUFU issue). Emulating a share s costs ~9 more a score:
MUFU's time (1 - s) / 16 meets the issue's (4.5 + 9 s) / 128 near s = 0.2, both then ~0.05 clocks a score, under
the products' 0.0625. A half (the other setting to try: ptxas gives it the same registers and spills) would be
issue-bound at ~0.07. Not measured."""


FP8_PERMUTE_P = True
"""Whether the FP8 Gluon forward takes P's e4m3 operand for P V straight from the scores' registers (`GluonForward.
permute_p`). wgmma's accumulator gives a thread columns {2t, 2t+1, 2t+8, 2t+9} + 16c of its rows (t = lane % 4), and its
8-bit A operand wants {4t .. 4t+3} + 16c: Triton moves P between the two by warp shuffles and byte permutes at every key
block (ptxas, sm_90a, d=128 without a mask: 99 shfl.sync, 512 prmt in the kernel). P V sums over the keys, so a fixed
permutation of the keys in both P and V changes nothing: P's operand column 16g + 8a + 4b + 2c + l is taken from the
scores' column 16g + 8c + 4a + 2b + l (a relabelling of each thread's registers: no data moves, the compiler checks it),
and the launcher writes V^T with its keys in that order (one copy of V, the one the keys- contiguous layout FP8's P V
needs took before; padded to 16 keys). With it: 35 shfl.sync (the rows' max and sum), 192 prmt (packing 4 bytes a
register), spills 20 -> 8 bytes; on the H200 the Gluon FP8 kernel issued ~45% more instructions than the bf16 one at the
same speed (ncu, NOTES.md FP8 prefill [v52]); with it and FP8_EARLY_P off as many, 660 us against 820 (B=4 H=16 N=4096
d=128). P's e4m3 values are packed four a register by one inline-asm conversion (two cvt.rn.satfinite.e4m3x2.f32 and a
mov, the IR's cast), which only pays where P is converted beside its product (FP8_EARLY_P off): carried around the loop
as e4m3, Triton keeps each byte in a register of its own and packs them again at the product (ptxas: 447-512 PRMT in the
kernel against 64)."""

FP8_EARLY_P = False
"""Whether the FP8 Gluon forward converts P to its e4m3 operand as soon as the softmax makes it (`GluonForward.early_p`,
the 16-bit kernels' FORWARD_FLAGS.early_p) or beside the P V product that takes it. With FP8_PERMUTE_P, beside it:
the inline-asm packing then folds into the operand (ptxas, sm_90a, d=128 without a mask: PRMT 447 -> 64, LOP3 647 ->
395 in the kernel) at 48 more registers of float32 P carried around the loop (spills 8 -> 20 bytes, as without
FP8_PERMUTE_P). Measured (H200, 2026-11-28, benchmarks/fp8_permute.py at 9ee44a8, d=128, 16 heads, 32k tokens, TFLOP/s,
N = 4096 / 8192 / 16384): early 704 / 717 / 723 without a mask and 636 / 681 / 713 causal, beside the product 804 /
812 / 819 and 692 / 738 / 763 (unpermuted 697 / 694 / 705 and 633 / 661 / 677)."""


def forward_fp8(head_dim: int, causal: bool) -> ir.GluonForward:
    """The Gluon forward's shapes and thresholds for an FP8 program (head dim in FP8_HEAD_DIMS, no variant): the
    16-bit kernel's flags and thresholds (guesses: not measured), one shape (FP8_FORWARD) at every length, with
    FP8_EXP2_EMULATION the share FP8_EXP2_FMA of the exponentials on the FMA pipe, FP8_PERMUTE_P's P operand made where
    FP8_EARLY_P says."""
    shape = FP8_FORWARD[head_dim]
    exp2_fma = FP8_EXP2_FMA[head_dim] if FP8_EXP2_EMULATION else 0.0
    return replace(forward(head_dim, causal), main=shape, short=shape, short_keys=0, exp2_fma=exp2_fma,
                   permute_p=FP8_PERMUTE_P, early_p=FP8_EARLY_P)


def backward(head_dim: int, causal: bool, head_dim_v: int | None = None) -> ir.GluonBackward:
    """The Gluon backward's shapes and thresholds for a head dim in BWD_HEAD_DIMS (those of its tiles' width), or
    one whose tiles are 256 wide (BWD_WIDE: d=256, and d=192 of a (192, 128) pair in SPLIT_FORWARD, V, dO and dV
    then 128 wide, its Q and K tiles in `tile_pieces` where SPLIT_TILES_192 is on; `head_dim_v` the pair's v, None:
    head_dim)."""
    pair = (head_dim, head_dim if head_dim_v is None else head_dim_v)
    pieces = tile_pieces(head_dim)
    head_dim = tile_dim(head_dim)
    if head_dim == 256:
        wide = BWD_WIDE_STAGED if WIDE_BACKWARD_STAGES and pair in BWD_WIDE_STAGED_PAIRS else BWD_WIDE
        wide = BWD_WIDE_SPLIT if pieces else wide
        paired = WIDE_BWD_PAIRED and causal and bool(pieces)
        return ir.GluonBackward(main=wide, short=wide, loader_regs=BWD_FLAGS.loader_regs, ahead=False,
                                dq_atomic=True, rows_smem=True, prefetch=False, late_rows=0, split=False,
                                dq_local_rows=0, dq_claim_keys=0, row_block=BWD_ROW_ELEMENTS // head_dim,
                                min_keys=BWD_MIN_KEYS[causal], short_keys=0, min_scores=BWD_MIN_SCORES, wide=True,
                                pieces=pieces, paired=paired,
                                pair_tail_waves=WIDE_BWD_PAIR_TAIL_WAVES if paired else 0)
    key, f = (head_dim, causal), BWD_FLAGS
    # PREFETCH (the kernel without ROWS_SMEM loads the next step's lse and delta during this step):
    # causal only; it wins there (+15-20%) and loses 5% without a mask, by ptxas's spills (NOTES v10).
    return ir.GluonBackward(main=BWD_MAIN[key], short=BWD_SHORT[key], loader_regs=f.loader_regs, ahead=f.ahead,
                            dq_atomic=f.dq_atomic, rows_smem=f.rows_smem, prefetch=causal,
                            late_rows=BWD_LATE_ROWS[key], split=BWD_SPLIT[head_dim],
                            dq_local_rows=BWD_DQ_LOCAL_ROWS[key], dq_claim_keys=BWD_DQ_CLAIM_KEYS[key],
                            row_block=BWD_ROW_ELEMENTS // head_dim, min_keys=BWD_MIN_KEYS[causal],
                            short_keys=BWD_SHORT_KEYS[key], min_scores=BWD_MIN_SCORES,
                            max_group_split=BWD_MAX_GROUP_SPLIT)


def backward_variant(head_dim: int, masked: bool, distance: bool = False, any_distance: bool = False) -> ir.GluonBackward:
    """The Gluon backward's shapes and thresholds for a variant program (issue 48): a masked variant takes the
    causal column (a window, prefix or chunk skips query blocks as the causal mask does and masks a few), an
    unmasked one the column without a mask. DQ_CLAIM is off: its accumulator is zeroed only in the query blocks
    no key tile reaches under a causal mask, and a variant's mask leaves other blocks unreached."""
    return replace(backward(head_dim, masked), dq_claim_keys=0, paired=False, pair_tail_waves=0,
                   distance=distance and LINEAR_DISTANCE and (LINEAR_DISTANCE_MASKED or not masked),
                   distance_by_block=any_distance and not distance and LINEAR_DISTANCE_BY_BLOCK_BACKWARD and not masked)


VARLEN_BACKWARD = True
"""Whether a varlen program's backward takes the Gluon kernel (`backward_varlen`; not with sinks, see
`warp_specialize.varlen_backward_refusal`). Measured on the H200 (2026-11-28, the bench's 8 documents in 16k tokens,
causal d=128): 343 TFLOP/s against the Triton varlen backward's 311 (Flex 324, varlen_attn 253), with lse and delta
by TMA from shifted copies (VARLEN_ROWS_SMEM; by pointer 250) (benchmarks/NOTES.md, varlen)."""

SWITCHES = ("VARLEN_BACKWARD", "VARLEN_ROWS_SMEM", "FP8_GLUON", "WIDE_BACKWARD", "FP8_DECODE_GLUON", "MLA_GLUON",
            "WIDE_BACKWARD_STAGES", "FP8_EXP2_EMULATION", "FP8_DECODE_2WG", "FP8_DECODE_HALVES", "MLA_OVERLAP",
            "MLA_SEESAW", "MLA_DEFER_PV", "SPLIT_TILES_192", "VARLEN_BWD_SCHEDULE", "VARLEN_BWD_LEAN",
            "VARLEN_BWD_PERSISTENT", "VARLEN_BWD_MASK_S", "WIDE_BWD_PAIRED", "FP8_PERMUTE_P", "FP8_EARLY_P",
            "FP8_DECODE_SPLIT_LOADER", "FP8_DECODE_Q8", "FP8_DECODE_P8", "FP8_DECODE_ONE_WAVE", "LINEAR_DISTANCE",
            "LINEAR_DISTANCE_MASKED", "LINEAR_DISTANCE_BY_BLOCK", "VARIANT_RAW_MAX",
            "LINEAR_DISTANCE_BY_BLOCK_BACKWARD")
"""The switches above that decide which kernels a module is generated with: kernel caches key on their values
(`attngen.policy.switches`), so a test or experiment that turns one at run time gets a module generated with it."""


VARLEN_ROWS_SMEM = True
"""Whether the Gluon varlen backward reads lse and delta by TMA with Q and dO (ROWS_SMEM, as the dense kernel does,
BWD_FLAGS) rather than by pointer. A sequence's rows start at any row and a TMA box's innermost coordinate must be
16-byte aligned (an unaligned one was an illegal instruction on the H200), so the launch copies the row pass's rows
four times, copy s shifted s rows down, and the loader reads a sequence's from copy q_start % 4 at a row that is a
multiple of 4 (the consumers then read them as the dense kernel does; Triton 3.6's shared-memory slices cannot start
a [BLOCK_M] row at an unaligned column: "the split offset may not touch the tile"). ptxas (sm_90a, causal d=128): by
pointer 676 bytes of spills a thread, by TMA 268 (tests/test_gluon_varlen.py VARLEN_BWD_SPILLS); the copies cost one
copy kernel of 4 x H x 2 x TOTAL_Q float32s a call. Off: the pointer path, the fallback should the GPU disagree. Not
measured on a GPU yet."""


VARLEN_BWD_SCHEDULE = True
"""Whether the Gluon varlen backward's programs take their key tiles in an order made per call (`attn_bwd_order_ws`,
one program: each tile's query blocks from the IR's loops, then a sort), the tiles with the most query blocks first
(longest processing time first), VARLEN_BWD_ORDER_HEADS K/V heads at a time, heads fastest; off: the packed order (a
K/V head's tiles in turn, each sequence's from its first key, heads slowest). Why (the bench's 8 documents in 16k
tokens, causal d=128, H=16, one program per multiprocessor at a time): a key tile's work is the query blocks after
it in its own document, 1 to 50 steps (16.5 on average, against 64.5 in one 16k sequence), and in the packed order
each head's longest tile starts a quarter of the way through that head's 136 programs, ~16.5 steps of work a
multiprocessor: the last head's longest tiles end alone. A list-scheduling simulation (132 multiprocessors, a tile's
time its query blocks + 0.5; benchmarks/NOTES.md, varlen) puts the makespan at 298 steps in the packed order, 298
with the order taken one head at a time, 286 two, 273 four to sixteen: the work's own 272 a multiprocessor (1.09x).
With it the order also gives each slot's sequence (no search in the prologue) and the row pass writes the four
shifted copies of the rows that VARLEN_ROWS_SMEM's loader reads (one copy launch of 4 x H x 2 x TOTAL_Q float32s
less a call). Its GPU tests pass (H200, 2026-11-28); `benchmarks/varlen_bwd_schedule.py` at 5ae37a6: 1.916 ms (358 TFLOP/s)
against the packed order's 1.985 (345), the main kernel 1,737 us against 1,806, the order kernel 3 us (the simulation's
1.09x is not reached: 1.04x)."""

VARLEN_BWD_ORDER_HEADS = 4
"""How many K/V heads' tiles VARLEN_BWD_SCHEDULE's order takes together (the launch takes the largest divisor of H_KV
up to it): a group's programs read its heads' Q, dO and dQ accumulator, 16 MB a head at 16k tokens and d=128, so
fewer heads keep more of them in L2, and four are the fewest whose work (4 x 16.5 steps a multiprocessor at the
bench's documents) covers the longest tile's 50 (the simulation above). 1: each head's tiles sorted, heads slowest (the
packed order's tail: the control). Measured (H200, `benchmarks/varlen_bwd_schedule.py` at 5ae37a6, the bench's documents): 4 heads
358 TFLOP/s, 2 351, 16 343, 1 338, against the packed order's 345 (VARLEN_BWD_SCHEDULE)."""

VARLEN_BWD_ORDER_TILES = 1 << 14
"""The most key tiles a K/V head (cdiv(TOTAL_K, BLOCK_N) + B) that `attn_bwd_order_ws` sorts in its one program (2M
keys at BLOCK_N = 128; at most 2^15, the bits it packs a tile's number in); more take the packed order."""

VARLEN_BWD_LEAN = True
"""Whether the Gluon varlen backward zeroes a warpgroup's K and V rows past its sequence by one load and store of its
whole tile (`_ws_bwd_zero_tail`, GluonBackward.zero_whole) instead of the forward's 16 rows at a time
(`_ws_zero_rows`). The zeroing runs once, before the loop, yet its four unrolled chunks raised ptxas's spills in the
loop (sm_90a, causal d=128, the ordered kernel): 268 bytes a thread with the chunks, 144 without any zeroing, 156 with
the whole tile at once (the dense variant kernel 96, the plain dense causal one 16). Of the other varlen-only code:
the query bound in keep() and the bottom-right offset, the masked delta and the dQ rows' q_start moved the count by
-4 to +4 each, and the row-masked epilogue lowers it (without it 336). Measured (H200, 2026-11-28, `python
benchmarks/varlen_bwd_ab.py` at 6caf2da, do_bench medians, one process): the bench's 8 documents in 16k tokens, H=16, 360 -> 413
TFLOP/s (main kernel 400 -> 457); 128k tokens of 14 documents, H=32, 371 -> 438 (main 395 -> 451). On since."""

VARLEN_BWD_PERSISTENT = False
"""Whether the ordered Gluon varlen backward (VARLEN_BWD_SCHEDULE) runs a persistent grid (GluonBackward.persistent):
a program a multiprocessor, each taking one of the order's work items (a K/V head's slot, in the ordered grid's
numbering) a round, the programs in order in even rounds and in reverse in odd ones (`_ws_bwd_item`), its
partitions counting the ring's steps and the tiles on across them; a
consumer's dK and dV leave through its dQ buffer (as large), so that once every consumer's products over a tile are
done the loader loads the next tile's K and V and first Q and dO blocks while they leave. Why: at the bench's
documents a key tile has 1 to 50 query-block steps, 16.5 on average (64.5 at one 16k sequence), so a program's fixed
costs (launch, K/V load, pipeline fill, dK/dV stores) weigh ~4x more than in the dense kernel. The work items are
dealt out by rounds, not taken as multiprocessors free up as a launch's programs are, so the longest-first order's
balance may suffer (the reversed odd rounds pair a round's longest item with the next round's shortest). Compiles for sm_90 (tests/test_gluon_varlen.py); ptxas (sm_90a, causal d=128) spills more than
the launch-per-tile kernel: 340 bytes a thread (268 without it), 352 with VARLEN_BWD_LEAN (156), all in the consumers.
Measured (H200, 2026-11-28, `python benchmarks/varlen_bwd_ab.py` at 6caf2da): it lost. The bench's 8 documents 361 TFLOP/s
against the launch-per-tile kernel's 360 (with VARLEN_BWD_LEAN 362 against 413), 128k tokens of 14 documents 292
against 371 (4 heads a group 313); its GPU tests pass. Again with VARLEN_BWD_MASK_S on (2026-11-29, varlen_bwd_ab.py
at 7169439, two rounds): 8 documents 390-423 TFLOP/s against 466-477 (4 heads a group 399-403, 16: 417-425), 128k 340-350
against 497-501 (4 heads 383-387). Off."""

VARLEN_BWD_MASK_S = True
"""Whether the Gluon varlen backward masks a masked block's S^T to -inf before the exponential, as the dense kernel
does (where no score modifier sits between them: softcap's would not keep -inf), instead of P^T to 0 after it, and
reads the rows' delta past a sequence unmasked (GluonBackward.mask_scores): the rows' buffer gets 3 rows more than
the sequences' and its descriptor ends 3 rows early, so that every copy's rows a tile reads are ones the row pass
wrote (a row past the sequences: lse +inf, delta 0) or TMA's zeros past the end, and 0 times a finite delta is 0.
ptxas (sm_90a, causal d=128, the ordered kernel with VARLEN_BWD_LEAN): 156 bytes of spills a thread -> 48, the
consumers' loops 747 and 745 SASS instructions -> 609 and 558 with 5 and 2 spill loads in them (17 and 16 before,
and 4 and 6 spill stores; the plain dense causal kernel: 16 bytes, loops of ~607 and ~563 instructions, 3 and 1
spill loads). Either half alone moved little (the mask on S^T 124 bytes, the delta unmasked 144): the P^T mask
after the exponential and the delta mask each kept values live across the loop's waits. The row pass reads out and
lse only up to the sequences' end (cu_seqlens_q[B]): rows of packed tensors past it, which the forward never wrote,
get lse +inf and delta 0 too (without that bound a NaN delta there reached dQ's rows past the sequences).
Measured (H200, 2026-11-28, `python benchmarks/varlen_bwd_ab.py --settings main,mask_s` at f1790be's script): the
bench's 8 documents in 16k tokens 411 -> 456 TFLOP/s, 128k tokens of 14 documents (H=32) 441 -> 491; its GPU tests
pass (188, every setting of tests/test_gluon_varlen.py's backward). On."""

VARLEN_BWD_PERSISTENT_ORDER_HEADS = 64
"""How many K/V heads' tiles the order takes together under VARLEN_BWD_PERSISTENT (VARLEN_BWD_ORDER_HEADS' role): all of
them up to 64. A persistent grid deals the items by rounds, and each group of heads starts again from its longest
tiles, so small groups pile the longest items on the same programs: a list-scheduling simulation (132 programs, the
bench's 8 documents, H=16, a tile's time its 64-row query blocks + 0.5) puts the makespan at 632 with 4 heads a group,
558 with 8 and 538 with all 16, against 533 for a launch's programs taken as multiprocessors free up (4 heads: 534);
at 128k tokens of 14 documents (H=32) every grouping is within 1% of the work's own. The price: all heads' Q, dO and dQ
rows in flight at once (16 heads a group measured 343 TFLOP/s against 4 heads' 358 launched per tile)."""


def backward_varlen(head_dim: int, causal: bool, distance: bool = False) -> ir.GluonBackward:
    """The Gluon backward's shapes and thresholds for a packed variable-length program: the variant column (its key
    tiles visit the query blocks the IR's loops give each sequence, DQ_CLAIM off: a claimed dQ tile is stored, not
    added, and its rows past a sequence are the next one's), always at the main shape (the lengths are on the GPU,
    so a launch cannot pick the short shape by them), its groups not split (its grid is over the packed key tiles),
    lse and delta by TMA unless VARLEN_ROWS_SMEM is off, its key tiles in VARLEN_BWD_SCHEDULE's order, the rows past
    a sequence zeroed a whole tile at once with VARLEN_BWD_LEAN, on a persistent grid with VARLEN_BWD_PERSISTENT,
    its masked blocks masked on S^T and the rows' delta read unmasked with VARLEN_BWD_MASK_S.
    min_keys and min_scores are compared with the average keys a
    sequence and the scores of sequences that long (`ws_bwd_ready`), and DQ_LOCAL's rows with the average query
    rows a sequence. Not measured: the dense kernel's settings until the varlen bench runs it."""
    variant = backward_variant(head_dim, causal, distance)
    return replace(variant, short=variant.main, short_keys=0, max_group_split=1,
                   rows_smem=variant.rows_smem and VARLEN_ROWS_SMEM,
                   order_heads=((VARLEN_BWD_PERSISTENT_ORDER_HEADS if VARLEN_BWD_PERSISTENT else VARLEN_BWD_ORDER_HEADS)
                                if VARLEN_BWD_SCHEDULE else 0),
                   order_tiles=VARLEN_BWD_ORDER_TILES if VARLEN_BWD_SCHEDULE else 0, zero_whole=VARLEN_BWD_LEAN,
                   persistent=VARLEN_BWD_SCHEDULE and VARLEN_BWD_PERSISTENT, mask_scores=VARLEN_BWD_MASK_S)


FP8_DECODE_GLUON = True
"""Whether a decoding spec with an FP8 cache (`kv_dtype = fp8_e4m3`) takes the Gluon decode kernel (its e4m3 ring,
`DECODE_FP8`). Its GPU tests pass (H200, 2026-11-28, tests/test_fp8kv_gluon.py); `benchmarks/fp8_decode.py`
(32/8 heads, d=128, CUDA graphs): 1.06-1.12x bf16's time at batch 16 and 64 x 8k and 32k keys, contiguous and
paged 16 alike (paged 0.97x of contiguous; the Triton kernel's paged FP8 0.85-0.92x). Both read ~2.1-2.4 TB/s of
e4m3 against bf16's ~4: the widening in the consumer, not the bytes, bounds them (NOTES.md, decode)."""

DECODE_FP8 = ir.GluonDecode(block_n=128, stages=3, rows=32, loader_regs=40)
"""The Gluon decode kernel's shape over an e4m3 cache: an e4m3 block of 128 keys is as many bytes as a 16-bit block
of 64, so a stage holds twice the keys in the same 96 KB ring at d=128 and a program waits on half the barriers
per byte. The consumer widens each K and V tile to 16 bits in registers (wgmma's A operand from registers,
64 registers a tile at d=128), so it takes at most 32 query rows per K/V head: at 64 (wgmma's N = 64) ptxas spills
836 bytes at d=128 and 80 at d=64 (none at 32; the 16-bit kernel spills 68 at 64), and more rows go to the Triton
kernel. DECODE's stages and loader registers, not measured on this ring yet."""


FP8_DECODE_2WG = True
"""Whether the Gluon decode kernel over an FP8 cache takes two consumer warpgroups (`DECODE_FP8_2WG`; at the head dims
of FP8_DECODE_2WG_HEAD_DIMS) instead of one (`DECODE_FP8`). Its GPU tests pass (H200, 2026-11-28,
tests/test_fp8kv_gluon.py); `benchmarks/fp8_decode.py --fp8-2wg` (H200, 32/8 heads, batch 16 and 64 x 8k and 32k keys):
tokens/s 1.17-1.22x bf16's at 3 stages, 1.23-1.29x at DECODE_FP8_2WG's 4, against one warpgroup's 1.04-1.11x; 2.4-2.9
TB/s of e4m3 read (bf16: 3.9-4.6 TB/s of its bytes), paged 16 within 3.2% of contiguous; 1.35-1.42x with stage_v off
(DECODE_FP8_2WG's A/Bs). The issue's 1.8x is not reached: the consumers are still the bound."""

DECODE_FP8_2WG = replace(DECODE_FP8, stages=4, consumers=2, widen_by_sign=True, stage_v=False, permute_k=True)
"""The Gluon decode kernel's shape over an e4m3 cache with two consumer warpgroups: one warpgroup, which widens both
tiles, runs both products and the softmax of each block, was the bound (2.1-2.4 TB/s of e4m3 where the 16-bit kernel
reads ~4), so both take every block, each widening and multiplying half of it: 64 of its 128 keys of S^T = K Q^T (the
column max meets through shared memory) and 64 of the head dim's 128 rows of O^T += V^T P^T (over all the block's keys,
P^T shared), which halves each thread's registers for the tiles and needs no merge at the end. widen_by_sign: e4m3
widened by a sign-extending byte permute, a shift and a mask a pair (4 PTX instructions for 2 values where the masks
took 6). stage_v (off: it lost): V's block read 16 bytes a thread, widened and stored into a 16-bit tile (32 KB) that
wgmma reads transposed, where V^T as a register operand is read a byte an element (ld.shared.b8) and packed by three
byte permutes each 4 values: 48 shared loads a thread a block instead of 116, but the store, the barrier and wgmma's
read of the 16-bit tile cost more than the loads saved. A ring of 4 stages of 128 keys (128 KB at d=128): 1.23-1.29x
bf16's tokens/s with stage_v against 3 stages' 1.17-1.22x; d=64 takes this shape only as halves (O^T's 64 rows are one
warpgroup's wgmma: FP8_DECODE_2WG_HEAD_DIMS). permute_k: K stays wgmma's register operand but is read 16 bytes a load (a
2-byte load and byte permutes to pack each 4 values before), the head dim permuted in K and Q alike (S^T sums over it;
the template says how). stage_k (off; excludes permute_k) stages K as V instead: 32 KB more shared memory and wgmma's 32
KB read of it a block.
The A/Bs (H200, 2026-11-28, `benchmarks/fp8_decode.py --fp8-2wg [...]`, 32/8 heads, batch 16 and 64 x 8k and 32k,
contiguous and paged 16, FP8 tokens/s over bf16's in one process): this shape 1.35-1.42x (paged 0.96-0.97x of
contiguous); with stage_v 1.24-1.29x; stage_v off and 3 stages 1.36-1.43x (a tie); stage_v and permute_k both off
1.19-1.25x; with stage_v, permute_k off 1.11-1.13x; stage_k with stage_v 1.08-1.10x."""


FP8_DECODE_2WG_HEAD_DIMS = (64, 128)
"""The head dims at which FP8_DECODE_2WG takes two consumer warpgroups: d=128 in either form; d=64 with halves only (the
shared state's split of O^T's rows needs 128; halves give each warpgroup all of them, over its half of the keys).
ptxas (sm_90a, d=64, q as two e4m3 terms, halves): no spills at 8 and 32 rows. Measured at d=64: FP8_DECODE_Q8_HEAD_DIMS
and FP8_DECODE_2WG_BLOCK_N."""

FP8_DECODE_2WG_BLOCK_N = {64: 256, 128: 256}
"""Key blocks of the two-warpgroup FP8 decode kernel by head dim where not DECODE_FP8_2WG's 128 (their stages:
FP8_DECODE_2WG_STAGES; d=128's measurement there), for the halves (FP8_DECODE_HALVES) reading K from the ring as it
lies (q in e4m3: K widened in permute_k's register layout takes 128-key blocks). At d=64 a block of 256 keys is the
bytes of d=128's 128 (each warpgroup's half two m64 tiles of S^T), so a program waits on half the barriers per byte.
ptxas (sm_90a, halves, q in e4m3): no spills at 8 and 32 rows, 143-177 KB of shared memory at 4 stages (d=128 at 256
keys: 271 KB at 3 stages, spills). Measured (H200, 2026-11-29, `python benchmarks/fp8_decode.py --head-dim 64
[--block-n 128] [--stages-2wg 3]`, 32/8 heads, FP8 tokens/s over bf16's, contiguous / paged 16):

| batch x keys | 128-key blocks | 256 | 256, 3 stages |
|---|---|---|---|
| 16 x 8k | 1.59 / 1.55 | 1.65 / 1.69 | 1.69 / 1.72 |
| 16 x 32k | 1.50 / 1.51 | 1.92 / 1.87 | 1.92 / 1.87 |
| 64 x 8k | 1.43 / 1.42 | 1.64 / 1.70 | 1.70 / 1.67 |
| 64 x 32k | 1.47 / 1.47 | 1.81 / 1.76 | 1.78 / 1.74 |

Paged 16 at 0.94-0.99x of contiguous at 256 (0.94 at 32k keys: the loader's 32 page copies a block); e4m3 read at up
to 3.7 TB/s (bf16's d=64 kernel reads 3.9-4.1)."""

FP8_DECODE_2WG_STAGES = {128: 2}
"""The ring's stages of the two-warpgroup FP8 decode kernel by head dim where not DECODE_FP8_2WG's 4. d=128 at 256-key
blocks (FP8_DECODE_2WG_BLOCK_N) holds two of them: 3 would need 271 KB of shared memory; at 2, ptxas (sm_90a, halves,
q in e4m3) spills nothing at up to 16 rows (8: 150 KB of shared memory), 20 bytes at 32 (205 KB). Measured (H200,
2026-11-29, `python benchmarks/fp8_decode.py --block-n 256 --stages-2wg 2` against `python benchmarks/fp8_decode.py`
as then shipped (128-key blocks, 4 stages), each twice, alternating, 32/8 heads, FP8 tokens/s over bf16's, contiguous
/ paged 16):

| batch x keys | 128 keys, 4 stages | 256 keys, 2 stages |
|---|---|---|
| 16 x 8k | 1.73-1.74 / 1.72 | 1.73-1.74 / 1.75 |
| 16 x 32k | 1.92-1.93 / 1.86-1.87 | 1.98 / 1.93 |
| 64 x 8k | 1.81-1.82 / 1.77 | 1.85 / 1.80-1.81 |
| 64 x 32k | 1.74-1.77 / 1.76-1.77 | 1.86-1.87 / 1.84-1.87 |

Paged 0.97-1.00x of contiguous. Shipped, `python benchmarks/fp8_decode.py` twice more: 1.73 / 1.75, 1.99 / 1.92-1.93,
1.84-1.85 / 1.80, 1.95-1.96 / 1.91-1.92, e4m3 read at up to 4.5 TB/s (16 x 8k: 1.84 with L2 cleared by a read instead
of do_bench's zeroing, NOTES.md v56)."""


def decode(kv_dtype: str | None = None, head_dim: int = 128) -> ir.GluonDecode:
    """The Gluon decode kernel's shape for a head dim in DECODE_HEAD_DIMS over a cache of `kv_dtype` (None: the
    queries' 16-bit dtype)."""
    if kv_dtype is None:
        return DECODE
    # (the shared state splits O^T's rows between the warpgroups; halves give each all of them)
    rows_split = head_dim % (64 * DECODE_FP8_2WG.consumers) == 0
    if FP8_DECODE_2WG and head_dim in FP8_DECODE_2WG_HEAD_DIMS and (rows_split or FP8_DECODE_HALVES):
        shape = replace(DECODE_FP8_2WG, halves=True) if FP8_DECODE_HALVES else DECODE_FP8_2WG
        shape = replace(shape, split_loader=True) if FP8_DECODE_SPLIT_LOADER else shape
    else:
        shape = DECODE_FP8
    shape = replace(shape, one_wave=FP8_DECODE_ONE_WAVE)
    if head_dim in FP8_DECODE_Q8_HEAD_DIMS and FP8_DECODE_P8:
        shape = replace(shape, q_e4m3=max(1, FP8_DECODE_Q8), p_e4m3=True, permute_k=False)
    elif head_dim in FP8_DECODE_Q8_HEAD_DIMS and FP8_DECODE_Q8:
        shape = replace(shape, q_e4m3=FP8_DECODE_Q8, permute_k=False)
    if shape.halves and not shape.permute_k:  # (K widened in permute_k's layout takes 128-key blocks)
        shape = replace(shape, block_n=FP8_DECODE_2WG_BLOCK_N.get(head_dim, shape.block_n),
                        stages=FP8_DECODE_2WG_STAGES.get(head_dim, shape.stages))
    return shape


FP8_DECODE_HALVES = True
"""Whether the two consumer warpgroups of the FP8 decode kernel (DECODE_FP8_2WG) are partitions of their own, each over
half of every block's keys with a softmax state of its own (its column max and sums, O^T over the whole head dim),
merged at the end (`GluonDecode.halves`; variants keep the shared state), instead of one 8-warp partition that
splits the M of both products. The two-warpgroup kernel's profile (ncu, H200, NOTES.md FP8 prefill [v52]) puts the
barriers between its warpgroups first among its stalls (2.7 cycles an instruction): each block's column max and P^T
meet across all 8 warps. With halves the only barriers a block are a warpgroup's own; each thread holds O^T's whole
head dim (twice the accumulator: NQ / 4 registers, where the split held NQ / 8) and reads V^T over its half of the
keys. ptxas (sm_90a, d=128): no spills up to 32 rows (DECODE_FP8_2WG.rows), 147,664 bytes of shared memory at 8.
Measured (H200, 2026-11-28, `python benchmarks/fp8_decode.py --fp8-2wg --halves`, 32/8 heads, CUDA graphs, FP8
tokens/s over bf16's; its GPU tests pass): contiguous 1.48-1.64x against the shared state's 1.40-1.45x, paged 16
1.45-1.55x against 1.37-1.39x; e4m3 read at up to 3.7 TB/s. Paged runs 0.93-0.96x of contiguous (the shared
state's 0.96-0.97x): the faster consumers leave the loader's sixteen 16-token copies a block more exposed."""

FP8_DECODE_SPLIT_LOADER = False
"""Whether the two-warpgroup FP8 decode kernel (DECODE_FP8_2WG) issues K's copies and V's from a loader warp each
(`GluonDecode.split_loader`) instead of one warp issuing both: over a paged cache of 16-token pages a 128-key
block is sixteen TMA copies (eight of K, eight of V), each behind a page lookup, from the one warp. Measured (H200,
2026-11-29, `python benchmarks/fp8_decode.py --split-loader --e4m3-products`, 32/8 heads, batch 16 and 64 x 8k and
32k): paged 16 0.94-0.96x of contiguous with it against 0.89-0.95x without in the same run, at the same tokens/s
within 2%, 0.92x with a ring of 6 stages, and 0.97-0.98x against 0.98-0.99x with q and P in e4m3: the copies' issue
is not what paged pays. Off."""

FP8_DECODE_Q8 = 2
"""How many e4m3 terms the Gluon decode kernel over an FP8 cache takes each query row as (`GluonDecode.q_e4m3`; 0: q
as given, K widened to 16 bits in registers): q / f for a power of two f a row (exact) rounded to e4m3, and with 2 the
rounding's remainder rounded too, so that S^T = K Q^T is one or two e4m3 wgmma reading K's block straight from the
ring, with no widening of K. Two terms hold a bf16 q's 8 significant bits (`attngen.testing.reference.e4m3_rows`: the
checks hold the kernel to a computation that takes q so, `accuracy.compare`'s q_e4m3); one term (FlashAttention 3's
FP8 convention) rounds each element by up to 2^-4, an error every key's score shares, which does not average out.
Measured (H200, 2026-11-29, `python benchmarks/fp8_decode.py --e4m3-products`, 32/8 heads, d=128, CUDA graphs, FP8
tokens/s over bf16's and the relative error against float64 of the dequantised cache, bf16's 2.3e-3, one process):

| batch x keys | widened K (0) [an earlier run] | one term | two terms | two terms: paged 16 / contiguous |
|---|---|---|---|---|
| 16 x 8k | 1.50 / 1.45 | 1.61 / 1.59 | 1.58 / 1.58 | 0.974 |
| 16 x 32k | 1.63 / 1.51 | 1.87 / 1.78 | 1.84 / 1.75 | 0.965 |
| 64 x 8k | 1.60 / 1.51 | 1.85 / 1.80 | 1.82 / 1.77 | 0.969 |
| 64 x 32k | 1.61 / 1.46 | 1.86 / 1.72 | 1.79 / 1.77 | 0.975 |
| relative error | (K's rounding only) | 2.7e-2 | 3.4-3.6e-3 | |

(contiguous / paged 16 in each cell.) Against float64 of the unquantised cache, the cache's own rounding dominates:
3.8-3.9e-2 with two terms, 4.7-4.8e-2 with one. Two terms: e4m3 read at up to 4.05 TB/s (bf16: up to 4.5)."""

FP8_DECODE_Q8_HEAD_DIMS = (64, 128)
"""The head dims FP8_DECODE_Q8 applies at: d=128 and d=64, whose kernels (two warpgroups, and one) ran on the H200 with
it (tests/test_fp8kv_gluon.py, marked gpu). d=64 (H200, 2026-11-29, `python benchmarks/fp8_decode.py --head-dim 64`,
32/8 heads, FP8 tokens/s over bf16's at batch 16 and 64 x 8k and 32k): one warpgroup 0.90-0.93x with K widened,
1.17-1.24x with q in e4m3; two warpgroups (FP8_DECODE_2WG_HEAD_DIMS) 1.42-1.58x at 128-key blocks, 1.64-1.92x at
256 (FP8_DECODE_2WG_BLOCK_N)."""


FP8_DECODE_ONE_WAVE = True
"""Whether a call of the Gluon decode kernel over an FP8 cache takes the one-wave split count (`GluonDecode.one_wave`,
policy/splits.py choose_wave_splits: as many splits as keep programs x splits within the multiprocessors, one split
from 132 programs) instead of the memory-bound rule (choose_num_splits, fitted to the 16-bit kernels' tuned entries):
each program holds a multiprocessor (147-197 KB of shared memory, 384 threads at 168 registers) with a ring of 4 x
32 KB in flight, so more splits only add a wave's tail, partial outputs and the merge. Measured (H200, 2026-11-29,
`python benchmarks/fp8_decode.py --batches B --contexts N --splits S`, 32/8 heads, q as two e4m3 terms, FP8 tokens/s
over bf16's, contiguous / paged 16):

| batch x keys | the memory-bound rule (splits) | one wave (splits) |
|---|---|---|
| 1 x 8k | 1.13 / 1.08 (8) | 1.20 / 1.17 (16) |
| 4 x 32k | 1.58 / 1.56 (8) | 1.65 / 1.64 (4) |
| 16 x 8k | 1.59 / 1.56 (2) | 1.72 / 1.71 (1) |
| 16 x 32k | 1.81 / 1.73 (4) | 1.88 / 1.83 (1) |
| 64 x 32k | 1.89 / 1.83 (2) | 1.88 / 1.86 (1) |

(64 x 8k takes one split either way: 1.82 / 1.77.) Paged 16 at 0.97-0.99x of contiguous with one wave."""


FP8_DECODE_P8 = False
"""FP8_DECODE_Q8 and P^T rounded to e4m3 as well (`GluonDecode.p_e4m3`, times 2^8 to keep small weights normal), so
that P V is an e4m3 product too and V^T's bytes go to wgmma without widening: both products as FlashAttention 3's FP8
kernels take them (q as one term). Measured with FP8_DECODE_Q8's runs: 1.50-1.69x bf16 against one term of q alone's
1.59-1.87x, and a relative error of 3.6-3.8e-2 (V^T's bytes are still gathered a byte a key for the register operand;
the widening was not the cost): off."""


MLA_GLUON = True
"""Whether an MLA decoding spec (`v = k[:N]`, (576, 512), paged by a multiple of MLA_DECODE's blocks) has the Gluon
MLA decode kernel (`MLA_DECODE`, pass warp-specialize-mla); off: the Triton split-KV kernel only, and `attngen explain`
says why (`warp_specialize_mla.refusal`). Its GPU tests pass (H200, 2026-11-28, tests/test_gluon_mla.py);
`benchmarks/mla_sweep.py --gluon` (H200, batch 64 x 8k keys in pages of 64, CUDA-graph replays): 128 heads 398
TFLOP/s at 2 splits, 361-372 at the split rule's and at 4, against the Triton kernel's 245 (1.5-1.6x); 16 heads
3,493 GB/s at 2 splits, 3,331 at the rule's, against the Triton kernel's 3,526: calls with fewer packed rows than
MLA_DECODE.min_rows keep the Triton kernel."""

MLA_DECODE = ir.GluonMlaDecode(block_n=64, stages=2, rows=64, consumers=2, consumer_regs=240, loader_regs=24,
                               maxnreg=168, min_rows=64)
"""The Gluon MLA decode kernel's shape, FlashMLA's: a program takes 64 packed query rows (heads x N_Q; 16 heads' rows
padded to wgmma's M = 64, 128 heads in two programs) of one latent head and one split's keys. Q (64 x 576: 72 KB)
stays in shared memory; each stage of the ring holds a whole latent tile of 64 keys x 576 (72 KB: three TMA copies,
two 256-column boxes and the 64-column rotary one, TMA's boxes being at most 256 wide), of which V is the first 512
columns (no second load). Two stages, Q and the [64, 64] P tile fill 224 KB of the 227. The Triton kernel computes
S = Q K^T in both warpgroups' halves of its rows (a 64 x 576 tile cannot be shared between two consumers there);
here each consumer warpgroup computes S for half the block's keys over all 576 columns ([64, 32]: the scores are
computed once), the two exchange their row maxima through shared memory, each writes its keys' half of P into the
shared P tile, and each then adds P V into its 256 of the 512 value columns ([64, 256] float32: 128 of its 240
registers). min_rows 64: a call's rows fill the tile; 16 heads' padded rows ran 1-6% slower than the Triton kernel's
16-row tiles (MLA_GLUON)."""

MLA_OVERLAP = False
"""Whether the Gluon MLA decode kernel overlaps its products with its softmax (`MLA_DECODE_OVERLAP`, `mla_decode`):
each consumer issues the next block's S = Q K^T before this block's row maxima, softmax and P V, so the tensor cores
work through the three mbarrier exchanges of a block (off: every wgmma is waited for as it is issued). Off until it
is timed against the serial schedule on the H200 (`benchmarks/mla_sweep.py --gluon --overlap`): it lost, 128 heads
308 TFLOP/s at 2 splits against the serial 64 x 2's 415 (H200, 2026-11-28, batch 64 x 8k): the 32-key blocks' m64n16
score products read Q from shared memory twice as often a key, and that cost more than the overlap gained."""

MLA_DECODE_OVERLAP = replace(MLA_DECODE, block_n=32, stages=4, overlap=True)
"""The overlapped schedule's shape: blocks of 32 keys in a ring of 4 (the same 144 KB as MLA_DECODE's 2 x 64). The
next block's tile must be in the ring when this block's softmax starts. In 2 stages of 64 that tile is the one the
loader was only allowed to copy when the previous block's was released, just before: its copy's latency would stand
in every block (a third stage of 64 needs 303,688 bytes of shared memory). In 4 stages of 32 its copy was asked for
three blocks earlier. sm_90 compile: 226,160 bytes of shared memory, no spills (2 x 64: 124 bytes); the cost is the
scores' wgmma at N = 16 (each warpgroup half of 32 keys), which read Q from shared memory twice as often a key."""


MLA_SEESAW = False
"""Whether the Gluon MLA decode kernel takes FlashMLA's seesaw schedule (`MLA_DECODE_SEESAW`, `mla_decode`). The serial
schedule's profile (ncu, H200, 2026-11-28, 128 heads, batch 64 x 8k keys, 1 split: 313 us) shows the two consumers in
lockstep: tensor pipe 52% active, shared-memory pipe 52%, issue 24%, DRAM 41% of its peak (the latent cache read once:
the second program of a sequence's rows reads it from L2), the top stall the barrier (5.5 warps an issue). The seesaw
takes the blocks in pairs: consumer 0 computes the first block's whole S (m64n64 over 576 columns: Q read once every 64
keys), its softmax and P, consumer 1 the second's from consumer 0's new row maxima, issued once consumer 0's scores
are done (so that they run beside its softmax); each adds both blocks' P V into its 256 value columns, its own block's
P from registers and the other's from the shared P tile. Off: it lost (H200, 2026-11-28, `python
benchmarks/mla_sweep.py --gluon --seesaw --heads 128 --splits 0 1 --shapes 32x4`, batch 64 x 8k keys, CUDA-graph
replays; its GPU tests pass): 64 x 2 414-416 TFLOP/s against the serial schedule's 452-470 in the same runs (the same
with consumer 1's scores ordered after consumer 0's or not), 32 x 4 426-434 (the serial schedule at 32 x 4: 321). A
pair holds both stages of the ring for most of its time: the copy of the next pair's first tile starts once both
warpgroups' P V over it are done, its second once the pair ends, where the serial schedule releases a block's stage a
whole block before its reuse. But that is not what it loses to: with every sequence's table on the same 128 pages
(the tiles L2-resident; .scratch experiment, same process) serial 478, seesaw 460, the deferred P V 474 against 446,
416, 425 on distinct pages: the copies cost every schedule 7-12%. Under Nsight Compute the seesaw issues 20% fewer
instructions than the serial schedule, its tensor pipe 46% busy (52%), its top stalls long scoreboard (7.2 warps an
issue against 1.7) and barrier (6.0 against 5.5): consumer 1, the worker partition, reloads its score products' wgmma
descriptors from local memory (ptxas, sm_90a: 384 bytes spilled there, 230,744 bytes of shared memory; the roles
swapped between the partitions, 372: the worker partition spills either role, though it is given 240 registers as
the default one is). In 32-key blocks and 4 stages (44 bytes spilled) a block's P V is half as long and the sync
points a key twice as many. Next: the seesaw with both consumers in one 8-warp partition (its roles chosen by the
warpgroup's index at run time), so neither is a worker partition."""

MLA_DECODE_SEESAW = replace(MLA_DECODE, seesaw=True)
"""The seesaw schedule's shape: MLA_DECODE's tiles (64 rows, 64-key blocks, a ring of 2 whole latent tiles: a pair's
two blocks)."""


MLA_DEFER_PV = False
"""Whether the serial schedule waits for block j's P V only after block j + 1's S is issued (`GluonMlaDecode.defer_pv`),
so that the tensor cores take the scores right behind the product instead of after the wait, the stage's release,
the next ready wait and the issue. Off: it lost (H200, 2026-11-28, `python benchmarks/mla_sweep.py --gluon --defer-pv
--heads 128 [--batch B]`; its GPU tests pass): batch 64 x 8k 414-420 TFLOP/s against 443-445, batch 32 382 against
409, batch 128 425 against 440. Block j's stage now goes back after block j + 1's ready wait and S issue, and that
delay reaches the loader's next copy into it: with the tiles L2-resident it ties the serial schedule (474 against 478,
MLA_SEESAW), so the issue gap it closes was not worth anything. ptxas: 36 bytes spilled (serial 56)."""


def mla_decode() -> ir.GluonMlaDecode:
    """The Gluon MLA decode kernel's shape under the switches: MLA_DECODE (its P V wait deferred where MLA_DEFER_PV is
    on); the seesaw schedule where MLA_SEESAW is on, else overlapped where MLA_OVERLAP is on."""
    if MLA_SEESAW or MLA_OVERLAP:
        return MLA_DECODE_SEESAW if MLA_SEESAW else MLA_DECODE_OVERLAP
    return replace(MLA_DECODE, defer_pv=True) if MLA_DEFER_PV else MLA_DECODE


_SWITCH_SETS = [0]


def switch_generation() -> int:
    """How many times one of SWITCHES has been set in this process (a monkeypatch, an experiment's assignment)."""
    return _SWITCH_SETS[0]


class _Policy(types.ModuleType):
    """This module's type: an assignment to one of its SWITCHES counts in `switch_generation()`."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in SWITCHES:
            _SWITCH_SETS[0] += 1


sys.modules[__name__].__class__ = _Policy
