"""A paged KV cache (PagedAttention's memory manager) for `attention_with_kvcache`.

`PagedKVCache` owns one pool of pages on a device, K and V each (num_pages, page_size, kv_heads,
head_dim), in the layout `attention_with_kvcache` takes with a block table. Sequences get pages on
demand as they grow, so memory holds tokens, not reservations: the waste is the unfilled part of
each sequence's last page (under one page), where a contiguous cache reserves the maximum length for
every sequence.

    cache = PagedKVCache(num_pages=4096, page_size=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    s = cache.new_sequence()
    cache.append([s], k, v)                      # k, v: (sequences, tokens, kv_heads, head_dim)
    t = cache.fork(s)                            # t shares s's pages; the last one is copied on write
    out = attngen.attention_with_kvcache(q, cache.k_pages, cache.v_pages, cache.seqlens([s, t]),
                                         cache.block_table([s, t]))
    cache.free(s)

MLA's latent cache is one pool whose first head_dim_v columns are the values: `PagedKVCache(..., kv_heads=1,
head_dim=576, head_dim_v=512)` holds only `k_pages`, `v_pages` is the view `k_pages[..., :512]`, `append`
takes k alone, and `attention_with_kvcache(q, cache.k_pages, None, ..., head_dim_v=512)` (or with
`cache.v_pages`) reads each page once.

Bookkeeping (which pages a sequence owns, reference counts, the free list) lives on the host, as
in vLLM's block manager; token data never does: `append` writes every token of a call with one
launch of a small Triton kernel (`_append_kv`), given the destination slot of each token.

An FP8 pool (`dtype=torch.float8_e4m3fn`) halves the bytes a decoding step reads. Its scales are fixed at
construction, as vLLM's `kv_cache_dtype="fp8"` fixes them when it loads a model: `k_scale` and `v_scale`
(a float, or a float32 tensor of one per K/V head, or (1,)), 1.0 unless given (vLLM's default; a
calibrated model brings its own). `append` takes 16- or 32-bit k and v and stores k / k_scale rounded to
e4m3, saturated to +-448 (e4m3's largest finite value, so an outlier clips instead of becoming NaN), v
likewise; FP8 k and v are taken as already scaled. Scales computed from the first append were not chosen:
later tokens outside that range would all clip, and the result would depend on what came first.
Attention reads the scales as its descale factors:

    cache = PagedKVCache(4096, 16, 8, 128, dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.02)
    out = attngen.attention_with_kvcache(q, cache.k_pages, cache.v_pages, lens, table,
                                         k_descale=cache.k_scale, v_descale=cache.v_scale)
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..env import interpreting
from ..errors import AttnGenError, KernelInputError
from ..runtime import interpreter_fixes
from ..runtime.arguments import on_other_gpu


class OutOfPages(AttnGenError, RuntimeError):
    """The pool has too few free pages for an append (nothing was changed)."""


# e4m3's largest finite value: quantised values saturate there
FP8_MAX = 448.0


@triton.jit
def _append_kv(K_SRC, V_SRC, K_POOL, V_POOL, SLOTS, K_SCALE, V_SCALE, n_tokens, width, stride_k_t, stride_v_t,
               BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_V: tl.constexpr,
               QUANTIZE: tl.constexpr):
    """Copy token rows (width = kv_heads * head_dim elements) into their slots of the page pools (K's alone
    where the values are K's columns: HAS_V false); with QUANTIZE, as x / scale of the row's K/V head (K_SCALE,
    V_SCALE: one float32 each) saturated to +-FP8_MAX, in the pools' FP8 dtype."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = offs_t < n_tokens
    slot = tl.load(SLOTS + offs_t, mask=live, other=0)  # page * page_size + slot in page, int64
    for start_w in range(0, width, BLOCK_W):
        offs_w = start_w + tl.arange(0, BLOCK_W)
        keep = live[:, None] & (offs_w[None, :] < width)
        row = offs_t[:, None].to(tl.int64)
        k = tl.load(K_SRC + row * stride_k_t + offs_w[None, :], mask=keep)
        if QUANTIZE:
            head = offs_w // HEAD_DIM
            k_scale = tl.load(K_SCALE + head, mask=offs_w < width, other=1.0)
            k = tl.clamp(k.to(tl.float32) / k_scale[None, :], -448.0, 448.0)  # (FP8_MAX)
        tl.store(K_POOL + slot[:, None] * width + offs_w[None, :], k, mask=keep)
        if HAS_V:
            v = tl.load(V_SRC + row * stride_v_t + offs_w[None, :], mask=keep)
            if QUANTIZE:
                v_scale = tl.load(V_SCALE + head, mask=offs_w < width, other=1.0)
                v = tl.clamp(v.to(tl.float32) / v_scale[None, :], -448.0, 448.0)
            tl.store(V_POOL + slot[:, None] * width + offs_w[None, :], v, mask=keep)


def _scales(name: str, t, kv_heads: int, device) -> torch.Tensor:
    """An FP8 pool's scale as (kv_heads,) float32 on its device: from a float (every head), None (1.0), or a
    float32 tensor of shape (kv_heads,) or (1,)."""
    if t is None:
        t = 1.0
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        value = float(t)
        if not (value > 0 and value < float("inf")):
            raise KernelInputError(f"{name} must be a positive finite number; got {t!r}")
        return torch.full((kv_heads,), value, dtype=torch.float32, device=device)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float or a torch.Tensor, not {type(t).__name__}")
    if t.dtype != torch.float32 or tuple(t.shape) not in ((kv_heads,), (1,)):
        raise KernelInputError(f"{name} must be a float32 tensor of shape ({kv_heads},) or (1,); got "
                               f"{tuple(t.shape)} {t.dtype}")
    if not bool(((t > 0) & torch.isfinite(t)).all()):  # (host side: checked once, at construction)
        raise KernelInputError(f"{name} must be positive and finite")
    return t.detach().to(device).expand(kv_heads).contiguous()


class PagedKVCache:
    """A pool of KV pages shared by many sequences, allocated on demand (see the module doc)."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device="cuda", head_dim_v: int | None = None, *, k_scale=None,
                 v_scale=None):
        """`head_dim_v`: where set, one latent pool (MLA) whose first head_dim_v columns are the values; else a K
        and a V pool of head_dim each. `k_scale`, `v_scale`: an FP8 pool's fixed scales (see the module doc)."""
        for name, value in (("num_pages", num_pages), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KernelInputError(f"{name} must be a positive int; got {value!r}")
        if head_dim_v is not None and (isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int)
                                       or not 1 <= head_dim_v < head_dim):
            raise KernelInputError(f"head_dim_v must be an int from 1 to head_dim - 1 = {head_dim - 1} (the values are "
                                   f"the latent pool's first head_dim_v columns); got {head_dim_v!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 256 \
                or page_size & (page_size - 1):
            raise KernelInputError(f"page_size must be a power of two from 1 to 256; got {page_size!r}")
        self.page_size = page_size
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.latent = head_dim_v is not None
        self.v_pages = self.k_pages[..., :head_dim_v] if self.latent else torch.zeros(shape, dtype=dtype, device=device)
        # An FP8 pool's descale factors, one per K/V head (the true value is the stored one times it); None otherwise.
        self.k_scale = self.v_scale = None
        if dtype == torch.float8_e4m3fn:
            if self.latent:
                # NOTE: the FP8 decode kernels read V as a pool of its own (kv_dtype with v = k[:N] is refused).
                raise KernelInputError("an FP8 latent pool (dtype=torch.float8_e4m3fn with head_dim_v) is not "
                                       "supported; use a 16-bit latent pool")
            self.k_scale, self.v_scale = (_scales(name, t, kv_heads, self.k_pages.device)
                                          for name, t in (("k_scale", k_scale), ("v_scale", v_scale)))
        elif k_scale is not None or v_scale is not None:
            raise KernelInputError(f"k_scale and v_scale are for an FP8 pool (dtype=torch.float8_e4m3fn), not {dtype}")
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * num_pages        # sequences holding each page
        self._filled = [0] * num_pages      # slots of each page holding a token
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    # -- sequences -----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def new_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._pages[seq], self._lengths[seq] = [], 0
        return seq

    def length(self, seq: int) -> int:
        return self._lengths[self._known(seq)]

    def pages(self, seq: int) -> list[int]:
        """The pages of a sequence, in order (a copy)."""
        return list(self._pages[self._known(seq)])

    def fork(self, seq: int) -> int:
        """A new sequence with the same tokens, sharing every page of `seq` (reference counted).
        Full pages stay shared; the partly filled last page is copied when either sequence first
        appends to it (copy on write)."""
        child = self.new_sequence()
        self._pages[child] = list(self._pages[self._known(seq)])
        self._lengths[child] = self._lengths[seq]
        for page in self._pages[child]:
            self._refs[page] += 1
        return child

    def free(self, seq: int) -> None:
        """Forget a finished sequence; pages no other sequence holds go back to the pool."""
        for page in self._pages.pop(self._known(seq)):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._filled[page] = 0
                self._free.append(page)
        del self._lengths[seq]

    def _known(self, seq) -> int:
        if seq not in self._pages:
            raise KernelInputError(f"no sequence {seq!r} in this cache")
        return seq

    # -- writing -------------------------------------------------------------------------------
    def append(self, seq_ids: Sequence[int] | int, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Append T new tokens to each sequence: k, v (len(seq_ids), T, kv_heads, head_dim), or
        (T, kv_heads, head_dim) for one sequence id; a latent cache takes k alone (its values are k's first
        head_dim_v columns). Pages are allocated as needed; nothing changes if the pool runs out (OutOfPages)."""
        if self.latent and v is not None:
            raise KernelInputError("v: this latent cache's values are k's first head_dim_v columns; append k alone")
        if not self.latent and v is None:
            raise KernelInputError("v is None: this cache has a V pool; append k and v")
        v = k if self.latent else v  # (checked as k; not copied)
        if isinstance(seq_ids, int):
            seq_ids, k, v = [seq_ids], k.unsqueeze(0), v.unsqueeze(0)
        seq_ids = [self._known(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise KernelInputError("append: a sequence id appears twice")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        expected = (len(seq_ids), k.shape[1] if k.dim() == 4 else -1) + tuple(self.k_pages.shape[2:])
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise KernelInputError(f"{name} must be (sequences, tokens, kv_heads, head_dim) = {expected}")
            if t.layout is not torch.strided:
                raise KernelInputError(f"{name} is a {t.layout} tensor; append takes dense (strided) tensors")
            if t.device != self.k_pages.device or (t.dtype != self.k_pages.dtype and not self._quantizes(t)):
                what = f"{self.k_pages.dtype} (or float16, bfloat16, float32, quantised)" if self.k_scale is not None \
                    else self.k_pages.dtype
                raise KernelInputError(f"{name} must be {what} on {self.k_pages.device}; got {t.dtype} on {t.device}")
        if k.dtype != v.dtype:
            raise KernelInputError(f"k and v must have one dtype; got {k.dtype} and {v.dtype}")
        tokens = k.shape[1]
        if tokens == 0 or not seq_ids:
            return
        self._reserve(seq_ids, tokens)
        slots = []
        for seq in seq_ids:
            start = self._lengths[seq]
            slots.append(self._claim(seq, start, start + tokens))
        slots = torch.cat(slots).to(self.k_pages.device, non_blocking=True)
        width = self.k_pages.shape[2] * self.k_pages.shape[3]
        # The kernel reads each token's row (kv_heads x head_dim) at unit stride: a view with a
        # strided head dim (k[..., ::2]) is copied first.
        k_rows, v_rows = (t.reshape(-1, width) for t in (k, v))
        k_rows, v_rows = (t if t.stride(1) == 1 else t.contiguous() for t in (k_rows, v_rows))
        n = k_rows.shape[0]
        # The interpreter pays per program, not per element: one program per call there.
        block_t = min(1024 if interpreting() else 64, triton.next_power_of_2(n))
        # Triton launches on the current device: the pool's, for this launch.
        quantize = self._quantizes(k)
        if quantize and interpreting():
            interpreter_fixes.apply()  # the interpreter's own FP8 rounding is not the GPU's
        scales = (self.k_scale, self.v_scale) if quantize else (slots, slots)  # (unread unless quantising)
        with torch.cuda.device(self.k_pages.device) if on_other_gpu(self.k_pages) else contextlib.nullcontext():
            _append_kv[(triton.cdiv(n, block_t),)](
                k_rows, v_rows, self.k_pages, self.v_pages, slots, *scales, n, width, k_rows.stride(0),
                v_rows.stride(0), BLOCK_T=block_t, BLOCK_W=min(256, triton.next_power_of_2(width)),
                HEAD_DIM=self.k_pages.shape[3], HAS_V=not self.latent, QUANTIZE=quantize)

    def _quantizes(self, t: torch.Tensor) -> bool:
        """Whether `append` quantises `t` into this pool: a 16- or 32-bit tensor into an FP8 one."""
        return self.k_scale is not None and t.dtype in (torch.float16, torch.bfloat16, torch.float32)

    def _pages_needed(self, seq: int, tokens: int) -> int:
        length, held = self._lengths[seq], len(self._pages[seq])
        new = -(-(length + tokens) // self.page_size) - held
        shared_tail = length % self.page_size and self._refs[self._pages[seq][-1]] > 1
        return new + (1 if shared_tail else 0)

    def _reserve(self, seq_ids, tokens: int) -> None:
        needed = sum(self._pages_needed(s, tokens) for s in seq_ids)
        if needed > len(self._free):
            raise OutOfPages(f"append needs {needed} pages; {len(self._free)} of {self.num_pages} are free")

    def _claim(self, seq: int, start: int, stop: int) -> torch.Tensor:
        """Give `seq` the pages for positions [start, stop); return each position's flat slot."""
        pages, size = self._pages[seq], self.page_size
        if start % size and self._refs[pages[-1]] > 1:
            # Copy on write: the partly filled last page is shared with a fork.
            old, new = pages[-1], self._free.pop()
            self.k_pages[new].copy_(self.k_pages[old])
            if not self.latent:  # (a latent cache's values are in its K pages)
                self.v_pages[new].copy_(self.v_pages[old])
            self._refs[old] -= 1
            self._refs[new], self._filled[new] = 1, start % size
            pages[-1] = new
        while len(pages) * size < stop:
            page = self._free.pop()
            self._refs[page] = 1
            pages.append(page)
        for j in range(start // size, (stop - 1) // size + 1):
            self._filled[pages[j]] = max(self._filled[pages[j]], min(size, stop - j * size))
        self._lengths[seq] = stop
        positions = torch.arange(start, stop)
        return torch.tensor(pages, dtype=torch.int64)[positions // size] * size + positions % size

    # -- reading -------------------------------------------------------------------------------

    def block_table(self, seq_ids: Sequence[int], device=None) -> torch.Tensor:
        """(len(seq_ids), max pages) int32 block table for `attention_with_kvcache` (unused entries 0)."""
        rows = [self._pages[self._known(s)] for s in seq_ids]
        table = torch.zeros((len(rows), max([1] + [len(r) for r in rows])), dtype=torch.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table.to(device or self.k_pages.device)

    def seqlens(self, seq_ids: Sequence[int], device=None) -> torch.Tensor:
        """(len(seq_ids),) int32 token counts for `attention_with_kvcache`."""
        lengths = [self._lengths[self._known(s)] for s in seq_ids]
        return torch.tensor(lengths, dtype=torch.int32).to(device or self.k_pages.device)

    def utilization(self) -> float:
        """Bytes holding tokens / bytes allocated, over the pages in use (a page shared by forks
        counts once); 1.0 when nothing is allocated."""
        allocated = self.num_pages - len(self._free)
        if not allocated:
            return 1.0
        return sum(self._filled) / (allocated * self.page_size)
