"""attngen as a Hugging Face transformers attention implementation.

    from attngen.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attngen")

`register()` adds `attention_forward` to `transformers.AttentionInterface` and `build_mask` to its
`AttentionMaskInterface` under one name. The mask function builds no mask: like flash attention's, it returns None,
and the attention function takes the pattern from its arguments (the module's `is_causal`, `sliding_window`),
so no dense (B, 1, N, N) mask is ever made. Patterns it cannot express that way raise a ValueError when the
model builds its masks: padding (a 2-D `attention_mask` with zeros), packed sequences, custom mask functions,
static-cache decoding; and Llama 4's chunked attention. Attention dropout is not supported (a ValueError when
a module in training mode asks for it).

The semantics are eager attention's (transformers' `eager_attention_forward` of each model): `sliding_window`
W keeps the last W keys up to the query, itself included (`k > q - W`; bidirectional: `|q - k| <= W`),
`softcap` caps the scaled scores before the mask (Gemma 2), `s_aux` holds gpt-oss's per-head sink logits,
query heads may be a multiple of key/value heads. A call whose queries and keys have one length (a forward
over a whole sequence, training, prefill) runs `attngen.attention` (with autograd); one with fewer queries
than keys (decoding with a cache) runs `attngen.attention_with_kvcache`, aligned bottom-right.
"""

from __future__ import annotations

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface

from ..api.kvcache import attention_with_kvcache
from ..api.sdpa import attention

NAME = "attngen"


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` run attngen's kernels in every transformers model."""
    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=None, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
               allow_is_bidirectional_skip: bool | None = None, config=None, **kwargs) -> None:
    """The mask function registered beside `attention_forward` (transformers' mask interface): None, the pattern
    being the module's; raises a ValueError where the model asks for a mask the pattern does not give."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[-1] != kv_length or not bool(attention_mask.all()):
            raise ValueError("attn_implementation='attngen' does not support padding: the attention_mask has zeros "
                             "(or is shorter than the keys). Run unpadded sequences (batch equal lengths, or one at "
                             "a time), or use attn_implementation='eager' or 'sdpa' for padded batches")
    # transformers clears the skip flags exactly where the mask is not the plain causal, sliding or bidirectional
    # pattern: packed sequences (position_ids restarting), or_mask/and_mask functions, blockwise overlays, and
    # decoding with a static (compileable) cache
    skip = allow_is_causal_skip if allow_is_bidirectional_skip is None else allow_is_bidirectional_skip
    if not skip:
        raise ValueError("attn_implementation='attngen' only runs the plain causal, sliding-window and bidirectional "
                         "patterns; this model asks for another mask (packed sequences, a custom mask function, or "
                         "decoding with a static cache)")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("attn_implementation='attngen' does not run chunked attention (attention_chunk_size) yet")
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query (B, H, N_Q, D), key and value (B, H_KV, N_K, D) -> (the output
    (B, N_Q, H, D), None: no attention weights)."""
    if attention_mask is not None:
        raise ValueError("attn_implementation='attngen' takes no attention_mask; register the mask function with "
                         "attngen.integrations.transformers.register() (a custom 4-D mask is not supported)")
    if dropout:
        raise ValueError(f"attn_implementation='attngen' has no attention dropout; got dropout={dropout} "
                         "(set the config's attention_dropout to 0, or call model.eval())")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q_length, kv_length = query.shape[2], key.shape[2]
    variant = {}
    if sliding_window is not None and kv_length > sliding_window:  # (a shorter sequence fits in the window)
        variant["window_size"] = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    if softcap:
        variant["softcap"] = float(softcap)
    if s_aux is not None:
        variant["sinks"] = s_aux
    if q_length == kv_length:
        out = attention(query, key, value, is_causal=causal, scale=scaling,
                        enable_gqa=query.shape[1] != key.shape[1], **variant)
        return out.transpose(1, 2).contiguous(), None
    # fewer queries than keys: the new tokens are the cache's last, as attention_with_kvcache aligns them
    out = attention_with_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), kv_length,
                                 causal=causal, softmax_scale=scaling, **variant)
    return out, None
