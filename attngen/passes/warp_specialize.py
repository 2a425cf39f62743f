"""warp-specialize: on Hopper the prefill forward runs as a warp-specialised Gluon kernel.

Triton 3.6 keeps the forward near 500 TFLOP/s at d=128 on an H200 however its source is arranged
(benchmarks/NOTES.md v1-v8): its software pipeline fills shared memory with cp.async and needs a
CTA-wide barrier in every key step (Nsight Compute: `barrier` is the top stall), and its
`warp_specialize` loop option does not act on this loop on Hopper. The layout cuDNN and
FlashAttention 3 use (a producer warp that moves K and V by TMA, consumer warpgroups that only
compute, mbarriers between them) is expressible in Gluon, Triton's explicit-layout dialect
(`triton.experimental.gluon`, in Triton 3.6). Measured (NOTES.md v9, v12 and v22, `attngen bench`,
bf16, H200, N = 4096-16384): d=128 614-637 TFLOP/s without a mask and 569-616 causal, against 483-501
and 427-482 for the Triton kernel and 612-626 / 528-561 for cuDNN; d=64 474-513 and 415-477, against
423-441 and 380-421 (cuDNN 455-463 / 419-445). At N=512, d=128: 517 and 297 (cuDNN 505 / 334).

The pass records the decision and the kernel's fixed shape on the program (`Program.warp_specialized.forward`,
an `ir.GluonForward` from the tables in attngen/policy/hopper.py:
at d=128 tiles of 128 query rows in two consumer warpgroups of 64, at d=64 192 rows in three;
128-key blocks, 2 stages, the next block's scores issued before this block's softmax, the register
split between the partitions, a persistent grid of one program per multiprocessor) and the shape of calls
of at most SHORT_KEYS keys (FORWARD_SHORT: at d=64 two consumer warpgroups, causal d=128 64-key blocks).
The code generator then emits the Gluon kernel (templates/gluon_forward.py.j2), its scaling and masking
rendered from this program's IR (codegen/hooks.py), beside the portable Triton kernel, and the module's `forward` takes it where it can run and pays: a CUDA tensor on an
sm_90 GPU (wgmma is Hopper's), inputs TMA can read (16-byte aligned base and strides, unit last
stride), at least one query, MIN_KEYS keys and MIN_SCORES scores. Everything else, the interpreter included, runs the
Triton kernel, which the tuner keeps tuning.

FP8 programs (dtype = fp8_e4m3: e4m3 Q, K and V, bf16 output) get the Gluon forward too where `fp8_refusal` finds
nothing against it (hopper.FP8_GLUON on, head dim 64 or 128, no mask or a causal one, no variant, not varlen), at
`hopper.forward_fp8`'s shape: e4m3 descriptors and shared tiles, V read through its (B, H_KV, D, N_K) view (FP8
wgmma takes both operands K-major, and P V's K is the keys: V's keys contiguous), P quantised to e4m3 as the IR's
cast says and carried as the product's register operand, qk_scale and V's factor per tile from the IR's descales
(pass descale), the output stored through a bf16 buffer of its own.

Applies to forward specs (prefill, with or without a backward), with or without a causal mask, with
16-bit inputs, a head dim in hopper.HEAD_DIMS (64, 96, 128, 256; d=96 runs 128 columns wide, `hopper.TILE_DIM`,
and not varlen: its row-masked stores would write past the head), or a (head dim, head_dim_v) pair in
hopper.SPLIT_FORWARD (DeepSeek's 192 / 128: the forward, Q and K tiles 256 wide, V and the output 128), and the
tile keys left `auto` (a spec that fixes its tiles by hand gets exactly those, in the Triton kernel). A causal
program reads only the key blocks its rows see and masks the diagonal block; bottom-right alignment with fewer keys than queries (rows that see no
key) stays on the Triton kernel.

Packed variable-length programs (`layout = varlen`, not paged) get the Gluon forward over all sequences' tiles:
the tiles are the Triton varlen kernel's, cdiv(TOTAL_Q, BLOCK_M) + B a head, taken heads fastest by a persistent
grid; a tile finds its sequence by a binary search over CU_SEQLENS_Q, and reads Q, K and V through descriptors
over the packed tensors (keys of the next sequence that a block reaches are masked by the key bound and their V
rows zeroed in shared memory; a tile that ends past its sequence stores its output through registers,
row-masked). Every varlen
program takes the variant path of the template (key blocks and masks from the IR per sequence, rows that see
no key written as 0 with a log-sum-exp of -inf), with `hopper.forward_varlen`'s shape. Their backward (head dim 64
or 128, query loops one unmasked range) is the Gluon one too, with `hopper.backward_varlen`'s shape: a program per
key tile of the Triton varlen dK/dV kernel's grid, cdiv(TOTAL_K, BLOCK_N) + B a K/V head, found by a binary search
over CU_SEQLENS_K; it visits the query blocks the IR's loops give its sequence, masking rows past n_q with the IR's
query bound (they are the next sequence's: their dS is 0, so dQ's reductions add zeros there), zeroes its K and V
rows past n_k in shared memory (another sequence's keys or memory no one wrote; dQ = dS K reads them), and stores
a warpgroup's dK and dV through registers, row-masked, where its keys end past the sequence. The row passes
before and after are the dense kernel's over (1, H, TOTAL_Q) views. The paged varlen forward stays on the Triton
kernel.

Variant programs (issue 48: windows, prefixes, chunks, softcap, ALiBi, sinks; `variant_supported` says which) get the
Gluon forward too: each query tile visits exactly the key blocks causal-skip's loops give it, masking those
outside the unmasked range with the IR's predicates, its scores modified and its sink step taken as the IR says
(hooks.py); their tiles are taken in order, not in the causal pairs. Their backward is the Gluon one too where its query
loops after causal-skip are one unmasked range (`variant_backward_supported`): each key tile visits the query blocks
those loops give it, masking, modifying the scores and multiplying dS by the modifier's derivative as the IR says.

Specs with a backward (head dim 64, 96 or 128, `hopper.BWD_HEAD_DIMS`; at d=256, where a consumer's dK and dV alone
would take 256 registers a thread, and DeepSeek's (192, 128) on 256-wide tiles (or, with `hopper.SPLIT_TILES_192`, 192
columns in two pieces), the wide path `hopper.BWD_WIDE` while
`hopper.WIDE_BACKWARD` is on, plain masks only; `backward_refusal` says why not) also get the backward in Gluon (`Program.warp_specialized.backward`,
templates/gluon_backward.py.j2): one kernel for dQ, dK and dV. A loader warp streams Q, dO and the
rows' lse and delta by TMA; two consumer warpgroups of 64 keys each keep K and V in shared memory and
dK, dV in registers, and share their dS through shared memory to add dQ = dS K into a float32
accumulator by TMA reductions (DQ_ATOMIC, FlashAttention 3's scheme: five products, not the seven of
a separate dQ kernel that recomputes S and dP; at d=64 without a mask and from 1024 query rows each consumer
instead adds dQ over its own keys, DQ_LOCAL, and no consumer waits for the other's dS). A row pass before
(lse in log2 units, delta, zeroed accumulator) and after (dQ in its dtype) completes it. Measured (NOTES.md v11, H200, N = 1024-16384): d=128 430-530 TFLOP/s without a mask and
308-512 causal, 1.24-1.33x FlexAttention; d=64 343-414 and 263-428, 1.24-1.44x (the Gluon dK/dV
kernel with the Triton dQ kernel had reached 1.00-1.09x). `backward` takes it under the forward's
rules (sm_90, TMA-readable tensors, BWD_MIN_KEYS keys, BWD_MIN_SCORES scores), the Triton kernels
elsewhere; calls of at most BWD_SHORT_KEYS keys take BWD_SHORT's shape (causal d=64: one consumer
warpgroup of 64 keys, two programs a multiprocessor). Where its grid (batch x K/V heads x key tiles) leaves
multiprocessors idle, up to `max_group_split` programs share a GQA group's query heads (policy/splits.py group_split, at
launch), each storing its float32 dK and dV into a workspace that a pass after sums in order. The reductions land in any order, so under torch.use_deterministic_algorithms(True) dQ comes
from the Triton dQ kernel (and dK, dV from the Gluon kernel without DQ_ATOMIC where that wins: d=128).
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from .. import ir
from ..analysis.distance import any_distance, linear_distance
from ..ir import sym
from ..policy import hopper

NAME = "warp-specialize"


PLAIN_MASKS = ("none", "causal(top_left)", "causal(bottom_right)")


def applies(program: ir.Program) -> bool:
    if program.attr("dtype") == "fp8_e4m3":
        return fp8_refusal(program) is None
    return (not program.attr("kvcache", False) and program.attr("split_kv") is None
            and not (program.attr("varlen") and program.attr("page_size") is not None)
            and not program.attr("fixed_tiles", False) and program.attr("dtype") in ("fp16", "bf16")
            and (not is_variant(program) or variant_supported(program, _varlen_scalars(program)))
            and (not program.attr("varlen") or _one_unmasked_range(program.kernel("attn_fwd"), sym.start_n))
            and head_dims_supported(program))


def fp8_refusal(program: ir.Program) -> str | None:
    """Why an FP8 program (dtype = fp8_e4m3) keeps the Triton forward, or None where it takes the Gluon one: a plain
    prefill (no mask or a causal one, no variant, not varlen, not paged, auto tiles) at a head dim in
    hopper.FP8_HEAD_DIMS, with hopper.FP8_GLUON on. `attngen explain` prints it."""
    if program.attr("dtype") != "fp8_e4m3":
        return None
    if not hopper.FP8_GLUON:
        return "policy/hopper.py FP8_GLUON is off: the Triton kernel runs"
    d = program.attr("head_dim")
    if (d not in hopper.FP8_HEAD_DIMS or program.attr("head_dim_padded") != d
            or program.attr("head_dim_v") is not None):
        return f"head dim {d}: the FP8 Gluon forward takes {', '.join(map(str, hopper.FP8_HEAD_DIMS))}"
    if (program.attr("kvcache", False) or program.attr("varlen") or program.attr("page_size") is not None
            or program.attr("split_kv") is not None):
        return "the FP8 Gluon forward is a dense prefill's (not a KV cache's, varlen or paged)"
    if is_variant(program) or program.attr("fixed_tiles", False):
        return "the FP8 Gluon forward takes no mask or a causal one, no variant, and auto tiles"
    return None


def head_dims_supported(program: ir.Program) -> bool:
    """Whether the Gluon kernels take the program's head dims: one in hopper.HEAD_DIMS at its tiles' width, or a
    (head dim, head_dim_v) pair in hopper.SPLIT_FORWARD (the forward only). Not a varlen program's head dim that its
    tiles pad, nor its head_dim_v: the varlen kernels' row-masked stores are one tile wide, and would write over a
    packed row's next head."""
    d, dv, varlen = program.attr("head_dim"), program.attr("head_dim_v"), program.attr("varlen")
    if program.attr("head_dim_padded") != hopper.tile_dim(d):
        return False
    if dv is None:
        return d in hopper.HEAD_DIMS and not (varlen and hopper.tile_dim(d) != d)
    return (d, dv) in hopper.SPLIT_FORWARD and not varlen


def _varlen_scalars(program: ir.Program) -> frozenset:
    """The per-sequence sizes a varlen program's score modifier may read (bottom-right positions: n_k - n_q)."""
    return frozenset({sym.n_q, sym.n_k}) if program.attr("varlen") else frozenset()


def is_variant(program: ir.Program) -> bool:
    """Whether the program's spec has a mask tree, a score modifier or sinks (issue 48's variants)."""
    return (program.attr("mask") not in PLAIN_MASKS or program.attr("score") is not None
            or program.attr("sinks", False))


def variant_supported(program: ir.Program, scalars: frozenset = frozenset()) -> bool:
    """Whether the Gluon forward (its hooks, codegen/hooks.py) can take a variant program's attn_fwd: masks of
    CAUSAL, KEY_BOUND and BAND predicates (windows, prefixes, chunks; EXPR predicates, the general form, stay on
    the Triton kernel: causal-skip cannot bound them), a score modifier over the score and the element
    positions whose tensor reads depend on the batch and query head alone (ALiBi's slopes: one value per tile;
    a declared tensor read at positions, as a bias[h, q - k], stays on the Triton kernel), and key loops that
    are one unmasked range between masked ones (the tile's key blocks the template visits). `scalars`: the
    values a Pointwise may read besides (decoding's split and the sizes its bottom-right positions read)."""
    kernel = program.kernel("attn_fwd")
    nodes = [n for st in ir.walk_stmts(kernel.body) for e in ir.stmt_exprs(st) for n in ir.walk_expr(e)]
    kinds = {p.kind for n in nodes if isinstance(n, ir.Masked) for p in n.preds}
    if not kinds <= {ir.PredKind.CAUSAL, ir.PredKind.KEY_BOUND, ir.PredKind.BAND}:
        return False
    for n in nodes:
        if not isinstance(n, ir.Pointwise):
            continue
        fn = sympy.sympify(n.fn)
        reads = fn.atoms(sympy.core.function.AppliedUndef)
        outside = fn.xreplace({r: sympy.Integer(1) for r in reads}).free_symbols
        if not outside <= {sym.S, sym.q_idx, sym.k_idx} | scalars:
            return False
        if any(not sympy.Tuple(*r.args).free_symbols <= {sym.b, sym.q_head} for r in reads):
            return False  # a read that varies within a tile (a bias over positions)
    return _one_unmasked_range(kernel, sym.start_n)


def variant_backward_supported(program: ir.Program) -> bool:
    """Whether the Gluon backward (its hooks) can take a variant program's attn_bwd_dkdv, given that the forward
    takes its attn_fwd (`variant_supported`: the same predicates and score modifier): its query loops after
    causal-skip are one unmasked range between masked ones (the key tile's query blocks the template visits)."""
    return _one_unmasked_range(program.kernel("attn_bwd_dkdv"), sym.start_m)


def grows_like_causal(kernel: ir.KernelIR) -> bool:
    """Whether a query tile's key blocks start at a key that does not move with the tile (start_m) and end at
    one that does: its work grows with the row block as the causal mask's does (a prefix-LM, or a score
    modifier under a causal mask), so pairing the longest tile with the shortest evens the programs' work.
    A window or a chunk moves both ends: its tiles are about equal."""
    loops = [st for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Loop) and st.kind is ir.LoopKind.SERIAL
             and st.var == sym.start_n]
    if not loops:
        return False
    starts = sympy.Min(*(sympy.sympify(lp.start) for lp in loops))
    stops = sympy.Max(*(sympy.sympify(lp.stop) for lp in loops))
    return sym.start_m not in starts.free_symbols and sym.start_m in stops.free_symbols


def _one_unmasked_range(kernel: ir.KernelIR, var) -> bool:
    loops = [st for st in ir.walk_stmts(kernel.body) if isinstance(st, ir.Loop) and st.kind is ir.LoopKind.SERIAL
             and st.var == var]
    unmasked = [lp for lp in loops if not any(isinstance(n, ir.Masked) for st in ir.walk_stmts(lp.body)
                                              for e in ir.stmt_exprs(st) for n in ir.walk_expr(e))]
    return len(unmasked) == 1


def backward_refusal(program: ir.Program) -> str | None:
    """Why a program whose forward takes the Gluon kernel keeps the Triton backward, given that it has one; None
    where the Gluon backward may take it (a variant's or a varlen program's further conditions are the pass's).
    `attngen explain` prints it."""
    d, dv = program.attr("head_dim"), program.attr("head_dim_v")
    if dv is not None and (d, dv) not in hopper.SPLIT_FORWARD:
        return "head_dim_v differs from head_dim: the Gluon backward takes one head dim for Q, K and V"
    if hopper.tile_dim(d) != 256:
        return None if d in hopper.BWD_HEAD_DIMS else f"head dim {d}: not in policy/hopper.py BWD_HEAD_DIMS"
    if not hopper.WIDE_BACKWARD:
        return (f"head dim {d}: the Gluon backward's wide path (both consumer warpgroups on 64 keys, each half of "
                "dK's and dV's columns) is switched off (policy/hopper.py WIDE_BACKWARD)")
    if is_variant(program) or program.attr("varlen"):
        return f"head dim {d}: the Gluon backward's wide path takes the plain masks (none, causal) only"
    return None


def varlen_backward_refusal(program: ir.Program) -> str | None:
    """Why a varlen program's backward keeps the Triton kernels (None: the Gluon kernel takes it); explain prints it."""
    if not hopper.VARLEN_BACKWARD:
        return "policy/hopper.py VARLEN_BACKWARD is off"
    if not variant_backward_supported(program):
        return "a variant the Gluon backward does not take"
    return None


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    d, causal = program.attr("head_dim"), program.attr("mask") != "none"
    dv = program.attr("head_dim_v")  # (the backward templates take one head dim)
    has_backward = backward_refusal(program) is None and any(k.name == "attn_bwd_dkdv" for k in program.kernels)
    # a score modifier adding c * |q - k + shift|: with one sign on every block the mask keeps (causal ALiBi), or not
    distance = linear_distance(program.kernel("attn_fwd")) is not None
    both_signs = not distance and any_distance(program.kernel("attn_fwd")) is not None
    if program.attr("varlen"):
        backward = None
        if has_backward and varlen_backward_refusal(program) is None:
            backward = hopper.backward_varlen(d, causal, distance)
        return replace(program, warp_specialized=replace(program.warp_specialized, backward=backward,
                                                         forward=hopper.forward_varlen(d, causal, distance)))
    if is_variant(program):
        # A variant's tiles each visit the key blocks its mask leaves (its key tiles in the backward the query
        # blocks it leaves); they are taken as the causal mask's, in pairs, where their work grows like it.
        backward = None
        if has_backward and variant_backward_supported(program):
            backward = hopper.backward_variant(d, causal, distance, both_signs)
        forward = hopper.forward_variant(d, causal, pair=grows_like_causal(program.kernel("attn_fwd")), head_dim_v=dv,
                                         distance=distance, any_distance=both_signs)
        return replace(program, warp_specialized=replace(program.warp_specialized, backward=backward, forward=forward))
    if program.attr("dtype") == "fp8_e4m3":  # (forward only: the spec refuses a backward)
        return replace(program, warp_specialized=replace(program.warp_specialized, forward=hopper.forward_fp8(d, causal)))
    backward = hopper.backward(d, causal, dv) if has_backward else None
    decision = replace(program.warp_specialized, forward=hopper.forward(d, causal, dv), backward=backward)
    return replace(program, warp_specialized=decision)
