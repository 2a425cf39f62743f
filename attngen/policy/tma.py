"""Which kernels read through TMA tensor descriptors: the one place that decides it.

The dK/dV kernel of a forward+backward spec without a mask, with 16-bit inputs and an unpadded head dim of
at least 64, reads its streamed Q and dO tiles through descriptors (attngen/passes/tma.py says why and what
was measured). The pass marks those loads, the resource model counts the descriptors' shared memory when told
(`analysis.resources`), and the default configs pick their tiles by it (`policy.configs`).
"""

from __future__ import annotations

KERNEL = "attn_bwd_dkdv"
MIN_HEAD_DIM = 64


def applies(backward: bool, causal: bool, elem_bytes: int, head_dim: int, head_dim_padded: int) -> bool:
    """Whether a spec with these properties has the dK/dV kernel read through descriptors."""
    # an unpadded head dim: a padded one's loads are masked along D, and never in bounds
    return backward and not causal and elem_bytes == 2 and head_dim == head_dim_padded >= MIN_HEAD_DIM


def reads_through_descriptors(spec, kernel_name: str) -> bool:
    """Whether the generated `kernel_name` of `spec` has descriptor loads (a varlen kernel's never has: the
    pass leaves packed tensors, whose tiles start at any row, to pointers)."""
    return kernel_name == KERNEL and not spec.varlen and applies(spec.backward, spec.mask.is_causal, spec.dtype.bytes, spec.head_dim,
                                             spec.head_dim_padded)
