"""The specs attngen writes itself: `attention()`'s (`sdpa_spec`) and `attention_with_kvcache()`'s
(`kvcache_spec`), one per dtype, head dim, mask (and page size): sequence lengths, batch and heads are run-time
arguments of one compiled kernel."""

from __future__ import annotations

from functools import lru_cache

from .spec import Spec, parse


@lru_cache(maxsize=None)
def sdpa_spec(dtype: str, head_dim: int, causal: bool) -> Spec:
    """The spec `attention()` uses for one dtype / head dim / mask (with its backward)."""
    mask = "causal(top_left)" if causal else "none"
    name = f"sdpa_{dtype}_d{head_dim}_{'causal' if causal else 'full'}"
    text = (f"# written by attngen.attention()\nkernel {name} {{\n    direction = forward+backward\n"
            f"    mask = {mask}\n    head_dim = {head_dim}\n    dtype = {dtype}\n}}\n")
    return parse(text, f"<attention {name}>")


@lru_cache(maxsize=None)
def kvcache_spec(dtype: str, head_dim: int, causal: bool, page_size: int | None) -> Spec:
    """The spec `attention_with_kvcache()` uses for one dtype / head dim / mask / page size."""
    mask = "causal(bottom_right)" if causal else "none"
    layout = f"paged(page_size = {page_size})" if page_size else "contiguous"
    name = (f"kvcache_{dtype}_d{head_dim}_{'causal' if causal else 'full'}_"
            f"{f'paged{page_size}' if page_size else 'contiguous'}")
    text = (f"# written by attngen.attention_with_kvcache()\nkernel {name} {{\n    mask = {mask}\n"
            f"    head_dim = {head_dim}\n    dtype = {dtype}\n    split_kv = auto\n    kv_layout = {layout}\n}}\n")
    return parse(text, f"<attention_with_kvcache {name}>")
