"""How many key/value splits a decoding launch uses when the caller leaves it to attngen.

The functions here are copied verbatim into generated modules of `split_kv = auto` specs (the
generated file needs only torch and triton), and are called from there at launch time. They look
only at tensor shapes and the device's multiprocessor count, never at tensor values, so choosing
reads nothing back from the GPU and a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 stands in for the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=4096)  # called per decoding step: a few dictionary lookups, not ~30 us of Python
def choose_num_splits(programs: int, key_blocks: int, sms: int, max_splits: int = 128) -> int:
    """Splits for a launch of `programs` (batch x heads x query blocks) over `key_blocks` key tiles.

    FlashAttention-2's rule: a launch that already fills 80% of the multiprocessors is not split.
    Otherwise, among split counts up to the number of key blocks, the multiprocessors and
    `max_splits`, take the smallest whose last wave is at least 85% as full as the best count's
    (waves = programs * splits / sms; a split count that gives no split fewer blocks than a smaller
    count does is skipped).
    """
    if programs <= 0 or key_blocks <= 1 or programs >= 0.8 * sms:
        return 1
    limit = max(1, min(max_splits, sms, key_blocks))

    def efficiency(splits: int) -> float:
        waves = programs * splits / sms
        return waves / math.ceil(waves)

    def eligible(splits: int) -> bool:
        return splits == 1 or math.ceil(key_blocks / splits) != math.ceil(key_blocks / (splits - 1))

    best = max(efficiency(s) for s in range(1, limit + 1) if eligible(s))
    return next(s for s in range(1, limit + 1) if eligible(s) and efficiency(s) >= 0.85 * best)
