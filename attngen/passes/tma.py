"""tma: the dK/dV kernel reads its streamed Q and dO tiles through TMA tensor descriptors.

The dK/dV kernel keeps two [BLOCK_N, D] fp32 accumulators, which leave its threads no registers
to spare (sm_90 compiles: 255 registers and spills at every BLOCK_N = 128 config). Its inner loops
stream a Q and a dO tile per step. Through a tensor descriptor (Hopper's Tensor Memory
Accelerator) each tile is one bulk asynchronous copy into shared memory: no per-element
addresses (no [BLOCK_M, D] pointer tensors held in registers), no load instructions issued by the
warps that run the products. Measured on an H200 (benchmarks/NOTES.md v5, v6):
- d=128, mask-free loop only: 486 -> 529 TFLOP/s (64 x 64 tiles, 4 warps, 2 stages);
- every query loop, the sequence-end loop too (v6):
  d=128 the same (spills 344 -> 112 bytes in the sm_90 compile), d=64 403 -> 434 at its old best
  config and 450 at 64 x 64 / 4 warps / 3 stages (the pointer form's best there: 421);
- causal specs lost: d=128 391-448 against 448 (64 x 128 / 8 warps / 3 stages), d=64 389-395
  against 413, in every loop arrangement tried, so causal specs keep pointers.

The rewrite marks the Q and dO loads of the dK/dV kernel's query loops as descriptor loads when
the tile is a plain (batch, head, rows, dims) block whose only bound is the tensor's own end along
the rows: a descriptor reads zeros past the end of the tensor, which is what the masked load
fills in. The generated kernel keeps the pointer form beside it, chosen by a constexpr: the
launcher builds 4-D descriptors of (B, H, N, D) with blocks [1, 1, BLOCK_M, D] when the GPU has
TMA (sm_90+; the interpreter emulates it) and the tensors meet its rules (16-byte aligned base
and strides, unit last stride), and uses pointers otherwise.

Applies to forward+backward specs without a mask, with 16-bit inputs and a head dim of at least 64
that needs no padding.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..ir import Load, Span
from ..policy import tma
from ..policy.tma import KERNEL

NAME = "tma"

STREAMED = ("Q", "DO")


def applies(program: ir.Program) -> bool:
    # NOTE: a packed varlen tensor's tiles start at any row: no descriptors for them (yet).
    return not program.attr("varlen") and tma.applies(bool(program.attr("backward", False)), program.attr("mask") != "none",
                       2 if program.attr("dtype") in ("fp16", "bf16") else 4,
                       program.attr("head_dim", 0), program.attr("head_dim_padded", 0),
                       program.attr("head_dim_v"), program.attr("head_dim_v_padded"))


def _descriptor_tile(load: Load) -> bool:
    """A plain (batch, head, rows, dims) tile that a descriptor reads as the load would: its spans
    are in bounds or bounded by the tensor's own extent (read as 0, what a descriptor returns past
    the end), and nothing but whole rows and columns."""
    plain = not any(isinstance(it, (ir.Paged, ir.Packed)) for it in load.index)
    if not plain or len(load.index) != 4 or load.fill != 0.0:
        return False
    spans = [(dim, it) for dim, it in enumerate(load.index) if isinstance(it, Span)]
    return len(spans) == 2 and all(s.limit is None or s.limit == load.buffer.shape[dim] for dim, s in spans)


def run(program: ir.Program) -> ir.Program:
    if not applies(program):
        return program
    kernel = program.kernel(KERNEL)

    def mark(e):
        if isinstance(e, Load) and e.buffer.name in STREAMED and _descriptor_tile(e):
            return replace(e, descriptor=True)
        return e

    return program.replace_kernel(replace(kernel, body=ir.map_exprs_in(kernel.body, mark)))
