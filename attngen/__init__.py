"""attngen: a compiler from `.attn` attention specs to Triton kernels.

    import attngen
    kernel = attngen.load("specs/fwd_causal_d64.attn")   # or spec text
    out = kernel(q, k, v)                                 # q, k, v: (batch, heads, seq, head_dim)
    out = attngen.attention(q, k, v, is_causal=True)      # drop-in for F.scaled_dot_product_attention
    out = attngen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)  # flash-attn's
"""

from .api import attention
from .decode import attention_with_kvcache, merge_states
from .errors import AttnGenError, KernelInputError, SpecError, UnsupportedError
from .runtime import Kernel, load
from .spec import Spec, parse
from .version import __version__
from .warmup import start as _start_warmup

__all__ = [
    "AttnGenError", "Kernel", "KernelInputError", "Spec", "SpecError", "UnsupportedError",
    "PagedKVCache", "__version__", "attention", "attention_with_kvcache", "load", "merge_states", "parse",
]


def __getattr__(name):
    # Imported on first use: attngen.kvcache defines a Triton kernel, and whether Triton interprets
    # it is fixed when it is defined (the CLI decides that after `import attngen`).
    if name == "PagedKVCache":
        from .kvcache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")


# Triton's start-up hash, on a thread from here on (attngen/warmup.py says why and how to turn it off).
_start_warmup()
