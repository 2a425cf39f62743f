"""Packed variable-length batches, as the checks (`accuracy`), the tuner (attngen/tuning/varlen.py) and the bench
(attngen/bench/varlen.py) draw them: sequences end to end in (tokens, heads, head_dim) tensors with int32
cu_seqlens, and for a paged spec the keys and values copied into a pool of pages in shuffled order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lang.spec import Spec


def document_lengths(total: int, count: int, generator: torch.Generator) -> list[int]:
    """`count` random positive lengths summing to `total` (cut points drawn uniformly)."""
    cuts = sorted(torch.randperm(total - 1, generator=generator)[: count - 1].add(1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def cu_seqlens(lengths, device) -> torch.Tensor:
    """The int32 offsets (B + 1,) of sequences of these lengths packed end to end."""
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


@dataclass
class Batch:
    """Packed inputs of a varlen kernel. `q` (TOTAL_Q, H, D), `k` and `v` (TOTAL_K, H_KV, D) hold the sequences
    end to end; `keys` and `values` are what the kernel reads: `k` and `v`, or for a paged spec pools (PAGES,
    PAGE_SIZE, H_KV, D) that `block_table` (B, MAX_PAGES) int32 maps each sequence's keys into."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    lengths_q: list
    lengths_k: list
    keys: torch.Tensor
    values: torch.Tensor
    block_table: torch.Tensor | None = None

    @property
    def seqlens_k(self) -> torch.Tensor:
        """The keys each sequence uses, (B,) int32."""
        return self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]

    def rows(self, t: torch.Tensor, b: int, keys: bool = False) -> torch.Tensor:
        """Sequence b's rows of a packed (tokens, heads, ...) tensor, as (1, heads, n, ...): the layout of the
        dense kernels and of the reference."""
        cu = self.cu_seqlens_k if keys else self.cu_seqlens_q
        return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]


def packed_inputs(spec: Spec, lengths_q, lengths_k, heads: int, kv_heads: int, device, generator=None) -> Batch:
    """Standard normal q, k, v in the spec's dtype for sequences of these lengths (zero allowed), packed; for a
    paged spec, K/V also copied into a pool with a spare page, each sequence on pages in shuffled order."""
    d, d_v, dtype = spec.head_dim, spec.head_dim_v, spec.dtype.torch

    def randn(*size):
        return torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q, k, v = randn(sum(lengths_q), heads, d), randn(sum(lengths_k), kv_heads, d), randn(sum(lengths_k), kv_heads, d_v)
    batch = Batch(q, k, v, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device), list(lengths_q),
                  list(lengths_k), k, v)
    if spec.kv_layout.paged:
        page = spec.kv_layout.page_size
        pages = [-(-n // page) for n in lengths_k]
        # (the generator's device: a CUDA generator draws CUDA permutations)
        order = torch.randperm(sum(pages) + 1, generator=generator, device=device)[: sum(pages)].to(torch.int32)
        table = torch.zeros((len(pages), max(pages, default=0)), dtype=torch.int32, device=device)
        keys, values = (t.new_zeros((sum(pages) + 1, page, kv_heads, t.shape[-1])) for t in (k, v))
        first = 0
        for b, n in enumerate(lengths_k):
            table[b, :pages[b]] = order[first:first + pages[b]]
            start = int(batch.cu_seqlens_k[b])
            for pool, t in ((keys, k), (values, v)):
                for j in range(pages[b]):
                    rows = t[start + j * page:min(start + n, start + (j + 1) * page)]
                    pool[int(table[b, j]), :rows.shape[0]] = rows
            first += pages[b]
        batch.keys, batch.values, batch.block_table = keys, values, table
    return batch
