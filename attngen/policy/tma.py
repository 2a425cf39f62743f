"""Which kernels read through TMA tensor descriptors: the one place that decides it.

The dK/dV kernel of a forward+backward spec without a mask, with 16-bit inputs and an unpadded head dim of
at least 64, reads its streamed Q and dO tiles through descriptors (attngen/passes/tma.py says why and what
was measured). The pass marks those loads, the resource model counts the descriptors' shared memory when told
(`analysis.resources`), and the default configs pick their tiles by it (`policy.configs`).
"""

from __future__ import annotations

KERNEL = "attn_bwd_dkdv"
MIN_HEAD_DIM = 64


def applies(backward: bool, causal: bool, elem_bytes: int, head_dim: int, head_dim_padded: int,
            head_dim_v: int | None = None, head_dim_v_padded: int | None = None) -> bool:
    """Whether a spec with these properties has the dK/dV kernel read through descriptors (Q's tiles are
    head_dim wide, dO's head_dim_v: head_dim unless given)."""
    # unpadded head dims: a padded one's loads are masked along D, and never in bounds
    dv, dv_padded = (head_dim, head_dim_padded) if head_dim_v is None else (head_dim_v, head_dim_v_padded)
    return (backward and not causal and elem_bytes == 2 and head_dim == head_dim_padded >= MIN_HEAD_DIM
            and dv == dv_padded >= MIN_HEAD_DIM)


def reads_through_descriptors(spec, kernel_name: str) -> bool:
    """Whether the generated `kernel_name` of `spec` has descriptor loads (a varlen kernel's never has: the
    pass leaves packed tensors, whose tiles start at any row, to pointers)."""
    return kernel_name == KERNEL and not spec.varlen and applies(spec.backward, spec.mask.is_causal, spec.dtype.bytes, spec.head_dim,
                                             spec.head_dim_padded, spec.head_dim_v, spec.head_dim_v_padded)
