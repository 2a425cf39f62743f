"""attngen: a compiler from `.attn` attention specs to Triton kernels.

    import attngen
    kernel = attngen.load("specs/fwd_causal_d64.attn")   # or spec text
    out = kernel(q, k, v)                                 # q, k, v: (batch, heads, seq, head_dim)
    out = attngen.attention(q, k, v, is_causal=True)      # drop-in for F.scaled_dot_product_attention
    q8, q_descale = attngen.quantize_fp8(q)               # FP8: attention(q8, k8, v8, q_descale=..., k_descale=...,
                                                          #      v_descale=...) -> bf16, forward only
    q8, k8, v8, descales = attngen.quantize_fp8_qkv(q, k, v, per="head", rotate=True)  # q, k Hadamard-rotated
    out = attngen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)  # flash-attn's
    out = attngen.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # flash-attn's
    torch.nn.attention.activate_flash_attention_impl("attngen")  # SDPA's flash backend and varlen_attn run attngen
"""

from .api.fp8 import quantize_fp8, quantize_fp8_qkv
from .api.kvcache import attention_with_kvcache, merge_states
from .api.sdpa import attention
from .api.varlen import flash_attn_varlen_func
from .errors import AttnGenError, KernelInputError, SpecError, UnsupportedError
from .integrations import torch_flash as _torch_flash
from .lang.spec import Spec, parse
from .runtime import tables as _tables
from .runtime.kernel import Kernel, load
from .runtime.warmup import start as _start_warmup
from .tuning import tune_bucket as _tune_bucket
from .version import __version__

__all__ = [
    "AttnGenError", "Kernel", "KernelInputError", "Spec", "SpecError", "UnsupportedError",
    "PagedKVCache", "__version__", "attention", "attention_with_kvcache", "flash_attn_varlen_func", "load",
    "merge_states", "parse", "quantize_fp8", "quantize_fp8_qkv",
]


def __getattr__(name):
    # Imported on first use: attngen.api.paged defines a Triton kernel, and whether Triton interprets
    # it is fixed when it is defined (the CLI decides that after `import attngen`).
    if name == "PagedKVCache":
        from .api.paged import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")


# "attngen" in torch.nn.attention's flash-attention registry, not activated (torch leaves that to the user);
# nothing is compiled until it is.
_torch_flash.register()

# Calls with autotuning on tune the buckets nobody tuned through the tuner, a layer above the runtime.
_tables.set_autotuner(_tune_bucket)

# Triton's start-up hash, on a thread from here on (attngen/runtime/warmup.py says why and how to turn it off).
_start_warmup()
