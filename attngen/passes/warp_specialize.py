"""warp-specialize: on Hopper the prefill forward runs as a warp-specialised Gluon kernel.

Triton 3.6 keeps the forward near 500 TFLOP/s at d=128 on an H200 however its source is arranged
(benchmarks/NOTES.md v1-v8): its software pipeline fills shared memory with cp.async and needs a
CTA-wide barrier in every key step (Nsight Compute: `barrier` is the top stall), and its
`warp_specialize` loop option does not act on this loop on Hopper. The layout cuDNN and
FlashAttention 3 use (a producer warp that moves K and V by TMA, consumer warpgroups that only
compute, mbarriers between them) is expressible in Gluon, Triton's explicit-layout dialect
(`triton.experimental.gluon`, in Triton 3.6). Measured (NOTES.md v9, `attngen bench`, bf16, H200,
N = 4096-16384): d=128 607-649 TFLOP/s without a mask and 519-605 causal, against 483-501 and
427-482 for the Triton kernel and 599-612 / 519-567 for cuDNN; d=64 440-458 and 387-449, against
423-441 and 380-421.

The rewrite records the decision and the kernel's fixed shape on the program (`warp_specialized`:
128 query rows per program in two consumer warpgroups of 64, 128-key blocks, 2 stages, the next
block's scores issued before this block's softmax, the register split between the partitions).
The code generator then emits the Gluon kernel (templates/gluon_forward.py.j2) beside the portable
Triton kernel, and the module's `forward` takes it where it can run and pays: a CUDA tensor on an
sm_90 GPU (wgmma is Hopper's), inputs TMA can read (16-byte aligned base and strides, unit last
stride), at least one query, MIN_KEYS keys and MIN_SCORES scores. Everything else, the interpreter included, runs the
Triton kernel, which the tuner keeps tuning.

Applies to forward specs (prefill, with or without a backward), with or without a causal mask, with
16-bit inputs, a head dim of 64 or 128 and the tile keys left `auto` (a spec that fixes its tiles by
hand gets exactly those, in the Triton kernel). A causal program reads only the key blocks its rows see
and masks the diagonal block; bottom-right alignment with fewer keys than queries (rows that see no
key) stays on the Triton kernel.

Specs with a backward at head dim 128 also get the backward's dK/dV kernel in Gluon
(`warp_specialized_bwd`, templates/gluon_backward.py.j2): a loader warp streams Q and dO by TMA, two
consumer warpgroups of 64 keys each keep K and V in shared memory and dK, dV in registers. Measured
(NOTES.md v10, experiments/gluon_backward.py, H200, N = 4096-16384): dK/dV alone 558-570 TFLOP/s
without a mask and 512-575 causal, against 516-533 and 447-518 for the Triton kernel; the whole backward
1.03-1.06x FlexAttention without a mask and 1.06-1.08x causal (was 0.97-1.00x). The dQ kernel stays in
Triton. `backward` takes the Gluon dK/dV kernel under the forward's rules (sm_90, TMA-readable tensors,
BWD_MIN_KEYS keys, BWD_MIN_SCORES scores), the Triton one elsewhere.
"""

from __future__ import annotations

from .. import ir

NAME = "warp-specialize"

HEAD_DIMS = (64, 128)
SHAPE = (("BLOCK_M", 128), ("BLOCK_N", 128), ("STAGES", 2), ("OVERLAP", True), ("PINGPONG", False), ("consumers", 2),
         ("consumer_regs", 240), ("loader_regs", 24), ("maxnreg", 168))
"""The Gluon kernel's fixed launch shape. 12 warps (two consumer warpgroups, one loader warp padded
to a warpgroup) x 168 registers fill the 64K register file; the loader gives back all but 24, so each
consumer thread gets 240. Measured against 256-row programs, 256-key blocks, 3 stages and 64-key
blocks with 4 stages (NOTES.md v9, experiments/gluon_shapes.py): this one is the best or within 1%
at d=64 and d=128."""

MIN_KEYS = {(64, False): 2048, (64, True): 4096, (128, False): 1, (128, True): 1}
"""Fewest keys for which the Gluon kernel runs, by (head dim, causal). At d=64 and short sequences
the Triton kernel is faster (H200, NOTES.md v9: 1024 keys 401 TFLOP/s against 366; 2048 keys about
even without a mask, 354 against 331 causal): each program's fixed cost (barrier set-up, the
loader's first loads, the epilogue) weighs more against the half-size products of d=64. At d=128
the Gluon kernel wins from 512 keys on (421 against 318 without a mask, 253 against 190 causal)."""


MIN_SCORES = 1 << 25
"""Fewest scores (B * H * N_Q * N_K) for which the Gluon kernel runs. Its launch costs about 50 us more
host time than the Triton kernel's (four TMA descriptors built per call, and Triton's own launcher:
FastJIT passes descriptors to it; results/h200_host_overhead_v9.json: 79 against 26 us for B=1 H=16
N=128 d=128, 9.6 us of GPU work either way). Below 2^25 scores (about 30 us of GPU work at d=128) a call
is host-bound and the Triton kernel finishes first."""


BWD_HEAD_DIMS = (128,)
BWD_SHAPE = (("BLOCK_M", 64), ("BLOCK_N", 128), ("STAGES", 2), ("AHEAD", False), ("consumers", 2),
             ("consumer_regs", 240), ("loader_regs", 24), ("maxnreg", 168))
"""The Gluon dK/dV kernel's fixed launch shape: 128 keys per program in two consumer warpgroups of 64
(each holds its dK and dV [64, D] accumulators in registers), blocks of 64 queries, 2 stages of Q and
dO, each step's four products waited for before the next step's (AHEAD: the next step's S^T issued
first; ptxas then serialises the wgmma queue, C7514). Head dim 128 only: at d=64 the Triton kernel
(TMA loads, 64-key tiles) stays ahead, 433-448 TFLOP/s against 324-415 (NOTES.md v10,
experiments/gluon_backward.py). PREFETCH (loading the next step's lse and delta during this step) is
set for causal masks: it wins there (+15-20%) and loses 5% without a mask, by ptxas's spills."""

BWD_MIN_KEYS = {False: 1024, True: 1}
"""Fewest keys for which the Gluon dK/dV kernel runs, by causal. Without a mask the Triton kernel is
faster at 512 keys (H200, `attngen bench`, whole backward: 261 TFLOP/s against 283) and slower from 1024
(352 against 340); causal, the Gluon kernel wins from 512 (195 against 165)."""

BWD_MIN_SCORES = 1 << 25
"""Fewest scores (B * H * N_Q * N_K) for which the Gluon dK/dV kernel runs: below, the host time of its
six descriptors is not hidden (see MIN_SCORES)."""


def applies(program: ir.Program) -> bool:
    return (not program.attr("kvcache", False) and program.attr("split_kv") is None
            and not program.attr("fixed_tiles", False) and program.attr("dtype") in ("fp16", "bf16")
            and program.attr("head_dim") == program.attr("head_dim_padded") in HEAD_DIMS)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    min_keys = MIN_KEYS[(program.attr("head_dim"), program.attr("mask") != "none")]
    program = program.with_attrs(warp_specialized=SHAPE + (("min_keys", min_keys), ("min_scores", MIN_SCORES)))
    if program.attr("head_dim") in BWD_HEAD_DIMS and any(k.name == "attn_bwd_dkdv" for k in program.kernels):
        prefetch = program.attr("mask") != "none"
        program = program.with_attrs(
            warp_specialized_bwd=BWD_SHAPE + (("PREFETCH", prefetch), ("min_keys", BWD_MIN_KEYS[prefetch]),
                                              ("min_scores", BWD_MIN_SCORES)))
    return program
