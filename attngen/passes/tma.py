"""tma: the dK/dV kernel reads its streamed Q and dO tiles through TMA tensor descriptors.

The dK/dV kernel keeps two [BLOCK_N, D] fp32 accumulators, which leave its threads no registers
to spare (sm_90 compiles: 255 registers and spills at every BLOCK_N = 128 config). Its inner loop
streams a Q and a dO tile per step. Through a tensor descriptor (Hopper's Tensor Memory
Accelerator) each tile is one bulk asynchronous copy into shared memory: no per-element
addresses, no load instructions issued by the warps that run the products. On an H200 this took
the kernel from 486 to 529 TFLOP/s at d=128 (64 x 64 tiles, 4 warps, 2 stages), and from 454 to
471 at its old 64 x 128 / 8 warps config; at d=64 it lost 5% (388 against 408 at its best config),
and the whole causal d=128 backward lost 4-8% in `attngen bench` (its dK/dV kernel at 64 x 128 / 8
warps / 3 stages), so the pass applies to unmasked specs from a head dim of 128
(benchmarks/experiments/backward_variants.py, benchmarks/NOTES.md v5).

The rewrite marks the Q and dO loads of the mask-free query loop (every span in bounds: the block
lies inside the tensor) as descriptor loads. The generated kernel keeps the pointer form beside
it, chosen by a constexpr: the launcher builds 4-D descriptors of (B, H, N, D) with blocks
[1, 1, BLOCK_M, D] when the GPU has TMA (sm_90+; the interpreter emulates it) and the tensors
meet its rules (16-byte aligned base and strides, unit last stride), and uses pointers otherwise.

Applies to forward+backward specs without a mask, with 16-bit inputs and a head dim of at least 128
that needs no padding.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import Load, Span

NAME = "tma"

KERNEL = "attn_bwd_dkdv"
STREAMED = ("Q", "DO")
MIN_HEAD_DIM = 128


def _rule(backward: bool, causal: bool, elem_bytes: int, head_dim: int, head_dim_padded: int) -> bool:
    # an unpadded head dim: a padded one's loads are masked along D, and never in bounds
    return backward and not causal and elem_bytes == 2 and head_dim == head_dim_padded >= MIN_HEAD_DIM


def applies(program: ir.Program) -> bool:
    return _rule(bool(program.attr("backward", False)), program.attr("mask") != "none",
                 2 if program.attr("dtype") in ("fp16", "bf16") else 4,
                 program.attr("head_dim", 0), program.attr("head_dim_padded", 0))


def reads_through_descriptors(spec, kernel_name: str) -> bool:
    """Whether the generated `kernel_name` of `spec` has descriptor loads (for the resource model)."""
    return kernel_name == KERNEL and _rule(spec.backward, spec.mask.is_causal, spec.dtype.bytes, spec.head_dim,
                                           spec.head_dim_padded)


def _in_bounds_tile(load: Load) -> bool:
    """A plain (batch, head, rows, dims) tile whose spans all lie inside the tensor."""
    spans = [it for it in load.index if isinstance(it, Span)]
    plain = not any(isinstance(it, (ir.Paged, ir.Packed)) for it in load.index)
    return plain and len(load.index) == 4 and len(spans) == 2 and all(s.limit is None for s in spans)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel(KERNEL)

    def mark(e):
        if isinstance(e, Load) and e.buffer.name in STREAMED and _in_bounds_tile(e):
            return replace(e, descriptor=True)
        return e

    return program.replace_kernel(replace(kernel, body=ir.map_exprs_in(kernel.body, mark)))
