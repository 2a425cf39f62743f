"""The orthonormal Walsh-Hadamard transform along a tensor's last axis: the rotation of q and k that spreads an outlier
channel's energy over many channels before FP8 quantisation (QuaRot, SpinQuant; FA3's "incoherent processing"), so
that a score's rounding errors come from many comparable terms, which partly cancel, instead of a few large ones.

For the last axis of size d = 2^m * r (r odd) the matrix is block-diagonal: r copies of H_b / sqrt(b), b = 2^m the
largest power of two dividing d, H_b Sylvester's Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]).
d = 64 or 128 is one block; d = 96 three blocks of 32, d = 80 five of 16 (an outlier is then spread over its block
only). Orthonormal either way, so (q H)(k H)^T = q k^T.
"""

from __future__ import annotations

import torch


def hadamard_block(d: int) -> int:
    """The size of the Hadamard blocks for a last axis of `d`: the largest power of two dividing it."""
    if d < 1:
        raise ValueError(f"head_dim must be positive; got {d}")
    return d & -d


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H, H the d x d orthonormal (block-diagonal) Hadamard matrix of the module docstring, d = x.shape[-1]:
    log2(b) butterfly stages on (..., d / b, b) views, then a scale of b^-1/2; no d x d matrix. Computed and
    returned in float32 (float64 for a float64 `x`): 16-bit sums of 128 channels would round away what the
    quantisation after it keeps."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, not {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor; got {x.dtype}")
    d = x.shape[-1]
    block = hadamard_block(d)
    wide = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    out = wide.reshape(*x.shape[:-1], d // block, block)
    lead = out.shape[:-1]
    h = 1
    while h < block:
        # pairs (i, i + h) inside each run of 2h: (a, b) -> (a + b, a - b), Sylvester's order
        pairs = out.reshape(*lead, block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        out = torch.stack((a + b, a - b), dim=-2).reshape(*lead, block)
        h *= 2
    return (out * block ** -0.5).reshape(x.shape)
