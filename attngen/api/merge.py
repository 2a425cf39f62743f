"""The merge of two attention states in one pass: a small Triton kernel (`_merge_states`) and its launch
(`merge`).

A state is (out, lse) of the same queries over a set of keys: out (B, H, rows, D) normalised, lse (B, H, rows)
natural-log. With m = max(lse_a, lse_b) (0 where both are -inf),

    out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)),
    lse = m + log(e^(lse_a - m) + e^(lse_b - m)),

`merge_states`' formula, so that an empty state (lse -inf) has weight 0 and two empty states give 0 and -inf. Each
program reads BLOCK_M rows of both states at their own strides and dtypes, computes in float32 and writes the rows
of the result, which may be state a itself: under policy.context_parallel.FUSED_MERGE context parallelism merges
each step's partial into its float32 accumulator's rows this way, in place, reading and writing each element once
(PyTorch's element-wise ops need float32 temporaries and a copy back).

NOTE: the kernel is written by hand rather than taken from the IR's merge of split-KV partials
(`passes.split_kv.merge_splits`): that one is a loop over the splits of one buffer, emitted into a spec's own
module; this one merges two buffers of any layouts and dtypes, for no spec, with the closed form above.
Not imported by `import attngen`: whether Triton interprets a kernel is fixed when it is defined (the CLI decides
that after the import).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..env import interpreting
from ..runtime.arguments import on_other_gpu


# (a step's rows vary, and the batch and head strides of a contiguous lse are multiples of them: specialised, a row
# count not a multiple of 16 would compile another binary)
@triton.jit(do_not_specialize=["rows", "stride_lse_a_b", "stride_lse_a_h", "stride_lse_b_b", "stride_lse_b_h",
                               "stride_lse_o_b", "stride_lse_o_h"])
def _merge_states(A, LSE_A, B, LSE_B, O, LSE_O, rows, width,
                  stride_a_b, stride_a_h, stride_a_n, stride_a_d, stride_lse_a_b, stride_lse_a_h, stride_lse_a_n,
                  stride_b_b, stride_b_h, stride_b_n, stride_b_d, stride_lse_b_b, stride_lse_b_h, stride_lse_b_n,
                  stride_o_b, stride_o_h, stride_o_n, stride_o_d, stride_lse_o_b, stride_lse_o_h, stride_lse_o_n,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """O, LSE_O = the merge of states (A, LSE_A) and (B, LSE_B), one program per BLOCK_M rows of one (batch,
    head); O and LSE_O may be A and LSE_A (each element is read before the same program writes it)."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    live = offs_m < rows
    tile = live[:, None] & (offs_d[None, :] < width)
    lse_a = tl.load(LSE_A + b * stride_lse_a_b + h * stride_lse_a_h + offs_m * stride_lse_a_n, mask=live,
                    other=float("-inf")).to(tl.float32)
    lse_b = tl.load(LSE_B + b * stride_lse_b_b + h * stride_lse_b_h + offs_m * stride_lse_b_n, mask=live,
                    other=float("-inf")).to(tl.float32)
    # -- the weights: an empty state (-inf) weighs 0, and two empty ones leave m at 0, not NaN --
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    a = tl.load(A + b * stride_a_b + h * stride_a_h + offs_m[:, None] * stride_a_n + offs_d[None, :] * stride_a_d,
                mask=tile, other=0.0).to(tl.float32)
    x = tl.load(B + b * stride_b_b + h * stride_b_h + offs_m[:, None] * stride_b_n + offs_d[None, :] * stride_b_d,
                mask=tile, other=0.0).to(tl.float32)
    out = (w_a[:, None] * a + w_b[:, None] * x) / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(O + b * stride_o_b + h * stride_o_h + offs_m[:, None] * stride_o_n + offs_d[None, :] * stride_o_d,
             out.to(O.dtype.element_ty), mask=tile)
    tl.store(LSE_O + b * stride_lse_o_b + h * stride_lse_o_h + offs_m * stride_lse_o_n, m + tl.log(total), mask=live)


def merge(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor) -> None:
    """Write the merge of states (a, lse_a) and (b, lse_b) into (out, lse): a, b, out (B, H, rows, D), lse_a,
    lse_b, lse (B, H, rows), any strides, on one device; a, b and out in any float dtype, lse float32. out and lse
    may be a and lse_a (a merge in place). Nothing is checked: the callers' tensors are theirs."""
    batch, heads, rows, width = a.shape
    if not a.numel():
        return
    block_d = triton.next_power_of_2(width)
    # The interpreter pays per program, not per element: one program a (batch, head) there.
    block_m = min(1024, triton.next_power_of_2(rows)) if interpreting() else max(1, 4096 // block_d)
    with torch.cuda.device(a.device) if on_other_gpu(a) else contextlib.nullcontext():
        _merge_states[(triton.cdiv(rows, block_m), heads, batch)](
            a, lse_a, b, lse_b, out, lse, rows, width, *a.stride(), *lse_a.stride(), *b.stride(), *lse_b.stride(),
            *out.stride(), *lse.stride(), BLOCK_M=block_m, BLOCK_D=block_d)
