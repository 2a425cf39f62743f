"""How many programs share work that one would do alone: a decoding launch's key/value splits (when the caller
leaves them to attngen), and a backward launch's parts of a GQA group's query heads.

The functions here are copied verbatim into generated modules (of `split_kv = auto` specs; of specs with a
backward) that call them at launch time (the generated file needs only torch and triton). They look
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
    """Splits for a decoding launch of `programs` (batch x K/V heads x query blocks) over `key_blocks` key tiles.

    A decoding step reads the KV cache once and is bound by memory, not by the multiprocessors: FlashAttention-2's
    rule (no split once the programs fill 80% of the SMs) left an FP8 cache, which has no tuned entries, at one
    split from batch 16 (128 programs of 32/8 heads), where the tuned 16-bit kernels take 2 and 4. What a split
    buys is a shorter serial chain of key tiles per program (more loads in flight on each SM); what it costs grows
    with programs x splits (each split's prologue, partial output and the merge's read of it). Minimising
    key_blocks / s + s x programs / (16 x sms) gives s = sqrt(key_blocks x sms / (16 x programs)), rounded to a
    power of two. The constant 16 is fitted to the H200's tuned entries (attngen/tuned/nvidia-h200_sm90_triton-3.6
    .json, decode_d128 and decode_paged16_d128, 32/8 heads, BLOCK_N = 128, 132 SMs), which this reproduces:

        keys        1k   8k   32k
        batch 1      4    8    16    (tuned: 8, 8, 16; 11 us at 1k either way)
        batch 16     1    2     4    (tuned: 1, 2, 4)
        batch 64     1    1     2    (tuned: 1, 1, 2)

    The count is at most the key blocks, the SMs and `max_splits`, and is lowered while a split would get no
    block (ceil(key_blocks / s) equal to the count below's).
    """
    if programs <= 0 or key_blocks <= 1:
        return 1
    limit = max(1, min(max_splits, sms, key_blocks))
    best = math.sqrt(key_blocks * sms / (16 * programs))
    splits = min(limit, 1 << max(0, round(math.log2(best)))) if best >= 1 else 1
    while splits > 1 and math.ceil(key_blocks / splits) == math.ceil(key_blocks / (splits - 1)):
        splits -= 1
    return splits



@functools.lru_cache(maxsize=4096)
def choose_wave_splits(programs: int, key_blocks: int, sms: int, max_splits: int = 128) -> int:
    """Splits for a launch of `programs` whose programs hold a multiprocessor each and gain nothing from more loads
    in flight: the Gluon MLA decode kernel (128 query heads over one latent head, ~230 KB of shared memory a program,
    bound by the tensor cores) and the FP8 cache's Gluon decode kernel (a ring of 4 x 32 KB a program: FP8 tokens/s
    over bf16's on the H200 at 32/8 heads, one wave against choose_num_splits' count, 1.20 (16) against 1.13 (8) at
    batch 1 x 8k, 1.72 (1) against 1.59 (2) at 16 x 8k, 1.88 (1) against 1.81 (4) at 16 x 32k: policy/hopper.py
    FP8_DECODE_ONE_WAVE).

    Such a launch gains nothing from more loads in flight, which is what `choose_num_splits` buys; it gains from
    filling the multiprocessors once, and every split beyond that adds a wave's tail, a partial output and the
    merge's read of it. So the count is the most splits that keep programs x splits within one wave:
    floor(sms / programs), at least 1 (more programs than SMs: no split). Measured on the H200 (132 SMs; 128 heads,
    64 rows a program, `python benchmarks/mla_sweep.py --gluon --heads 128 --batch B --splits ...`), TFLOP/s:

        batch x keys   programs   best (splits)     choose_num_splits' count
        128 x 8k         256       449 (1)          410 (2)
         64 x 8k         128       457 (1)          369 (4)
         32 x 8k          64       410 (2)          367 (4)
          8 x 8k          16       266 (8)          266 (8)
          2 x 32k          4       254 (32)         254 (32)

    The count is at most the key blocks and `max_splits`, and is lowered while a split would get no block."""
    if programs <= 0 or key_blocks <= 1:
        return 1
    splits = max(1, min(max_splits, key_blocks, sms // programs))
    while splits > 1 and math.ceil(key_blocks / splits) == math.ceil(key_blocks / (splits - 1)):
        splits -= 1
    return splits


def group_split(programs: int, group: int, sms: int, max_split: int) -> int:
    """How many programs share a GQA group's `group` query heads in a backward launch whose dK/dV grid holds
    `programs` (batch x K/V heads x key tiles) on `sms` multiprocessors, one program each: 1 (no split) where the
    grid fills them or `max_split` is 1; else the count up to the group and `max_split` whose waves x heads a
    program (ceil(programs x parts / sms) x ceil(group / parts)) are fewest, the smallest of equals (a part's
    heads: group x p // parts to group x (p + 1) // parts). The Gluon backward's (hopper.BWD_MAX_GROUP_SPLIT) and
    the Triton one's (configs.BWD_MAX_GROUP_SPLIT) rule. Copied into the generated modules, which call it at
    launch time; explain calls it at 132 multiprocessors."""
    if group <= 1 or max_split <= 1 or programs >= sms:
        return 1
    best, best_cost = 1, group
    for parts in range(2, min(group, max_split) + 1):
        cost = -(-programs * parts // sms) * -(-group // parts)
        if cost < best_cost:
            best, best_cost = parts, cost
    return best
