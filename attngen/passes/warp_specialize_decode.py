"""warp-specialize-decode: on Hopper a KV cache is decoded by a warp-specialised Gluon kernel.

The Triton split-KV kernel over a paged cache (pass paged) looks its pages up in the block table row by
row, in the same threads that then load K and V, and Triton's software pipeline spends stages on the
table load: at batch 1 its programs execute 63% more instructions than the contiguous kernel's and
hold 226 registers against 128 (Nsight Compute, benchmarks/NOTES.md v8), and decoding over 16-token
pages ran at 0.86-0.94x of the contiguous cache (v4-v12). Moving that work into a loader warp that only
reads the table and issues TMA copies removes it from the consumer's path: the table is read 32
entries at a time, a chunk ahead, and each page's rows arrive by their own TMA copy into a ring of
shared buffers (templates/gluon_decode.py.j2). Measured (NOTES.md v13,
H200, 32/8 heads, d=128, 16-token pages): batch 1 at 8k 1475 GB/s against 1353 for the Triton kernel
in a CUDA graph (1977 against 1731 per layer), 0.97x of the contiguous cache (was 0.89x); from batch
16 0-7% faster, except batch 16 at 8k with the tuned 4 splits (-1%). Its consumer now runs both
products swapped (the keys as wgmma's M, the group's query rows as its N), which read another 1-7%
faster than the group's rows padded to M = 64 (v32).
On a contiguous cache the padded kernel was within 3% of the Triton kernel either way (v13), so
contiguous caches kept the Triton kernel; the swapped one reads 2-8% faster than it at batch 1 and
batch 16 1k and level elsewhere (v32), so contiguous caches (flash-attn's (batch, seq, kv heads, d)
layout, one TMA copy a block) take it too, and the tuner picks between the two kernels per bucket.

The pass records the decision and the kernel's fixed shape on the program
(`Program.warp_specialized.decode`, an `ir.GluonDecode` from attngen/policy/hopper.py); the code generator then emits the Gluon kernel beside the Triton one,
and `forward_kvcache` takes it where it can run: sm_90, at most ROWS query rows per K/V head (GROUP x
N_Q: decoding and short chunks), caches TMA can read (`wsd_ready`). The split count and the
merge are the Triton path's; the tuned BLOCK_N, warps and stages serve the Triton kernel only.

Applies to decoding specs with a contiguous cache or a paged cache of pages of at least 16 tokens (a
TMA copy of fewer rows would cut through the shared tiles' swizzle pattern), split-KV, GQA packing, no
mask or a causal one aligned bottom-right, 16-bit inputs, a head dim of 64 or 128 and the tile keys
left `auto`; an FP8 cache (`kv_dtype = fp8_e4m3`) too, without a variant, while policy hopper.FP8_DECODE_GLUON is
on (its ring holds the e4m3 bytes, `hopper.DECODE_FP8`, and its consumer widens each tile in registers;
`fp8_refusal` says why one keeps the Triton kernel); and to the variants (issue 48) the Gluon forward takes (`warp_specialize.variant_supported`: windows,
chunks, prefixes, softcap, ALiBi, sinks): each split visits the key blocks of the IR's partial kernel over the
group's rows (split-kv's slice narrowed to the window, causal-skip's loops), masks those outside the unmasked
loop with the IR's predicates, modifies its scores as the IR does (ALiBi's slope per packed row's query head)
and takes the sink's step in split 0 (hooks.py). EXPR masks and reads at positions keep the Triton kernel.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import sym
from ..policy import hopper
from . import warp_specialize

NAME = "warp-specialize-decode"


# what the kernel's Pointwise may read besides the scores and positions: the split (the sink's split-0 step) and the
# sizes a bottom-right position reads (ALiBi's distance k - q + n_k - N_Q), which the consumer holds
DECODE_SCALARS = frozenset({sym.split, sym.n_k, sym.N_Q})


def applies(program: ir.Program) -> bool:
    page = program.attr("page_size")
    return (program.attr("kvcache", False) and program.attr("split_kv") is not None
            and (page is None or page >= hopper.DECODE_MIN_PAGE) and bool(program.attr("pack_gqa"))
            and (plain(program) or (warp_specialize.is_variant(program)
                                    and warp_specialize.variant_supported(program, DECODE_SCALARS)))
            and not program.attr("fixed_tiles", False) and program.attr("dtype") in ("fp16", "bf16")
            and fp8_refusal(program) is None
            and program.attr("head_dim") == program.attr("head_dim_padded") in hopper.DECODE_HEAD_DIMS
            and program.attr("head_dim_v") is None)  # the Gluon template takes one head dim for K and V


def fp8_refusal(program: ir.Program) -> str | None:
    """Why an FP8 cache keeps the Triton kernel (None for a 16-bit one, and for an FP8 one the Gluon kernel takes):
    `attngen explain` prints it."""
    kv_dtype = program.attr("kv_dtype")
    if kv_dtype is None:
        return None
    if not hopper.FP8_DECODE_GLUON:
        return (f"kv_dtype = {kv_dtype}: the Gluon kernel's e4m3 ring is switched off (policy hopper.FP8_DECODE_GLUON); "
                "the Triton kernel reads the e4m3 tiles and widens them in registers")
    if not plain(program):
        return (f"kv_dtype = {kv_dtype} with a variant: the Gluon kernel's e4m3 ring takes no mask but a causal one "
                "and no score modifier or sink")
    return None


def plain(program: ir.Program) -> bool:
    """Whether the program decodes without a variant: no mask, or a causal one aligned bottom-right."""
    return (program.attr("mask") in ("none", "causal(bottom_right)") and program.attr("score") is None
            and not program.attr("sinks", False))


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    shape = hopper.decode(program.attr("kv_dtype"), program.attr("head_dim"))
    if shape.halves and not plain(program):  # (a variant's hooks take the shared state)
        shape = replace(shape, halves=False)
    return replace(program, warp_specialized=replace(program.warp_specialized, decode=shape))
