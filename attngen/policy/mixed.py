"""How a paged varlen call (a serving step) schedules its short sequences: narrow tiles, and how many key splits.

A decode (one query) in the wide kernel takes a 128-row tile of which one row is real and walks its whole cache in
one program; the mixed pass (attngen/passes/mixed.py) gives such sequences narrow tiles and splits their keys across
programs. The decision is taken on the host from values the call already holds (the batch, the heads, max_seqlen_q,
max_seqlen_k and the multiprocessor count), never from the lengths on the GPU, so a step stays capturable in a CUDA
graph and costs no synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MixedPolicy:
    """The thresholds of `schedule`.

    narrow_m: the narrow tile's rows, (query, head of the GQA group) pairs, at least: a sequence whose queries times
        the group fit takes one. 16 is the narrowest tile `tl.dot` takes (vLLM's unified Triton kernel packs its
        tiles of 16 rows the same way); it covers a decode, and without GQA a speculative step of up to 16 tokens; a
        group of more than 16 heads gets a tile of its size (a power of two).
    min_keys: below this longest cache (max_seqlen_k) the narrow kernels are not launched: a short sequence over
        fewer keys costs the wide tile less than two extra launches (a few microseconds each) would.
    split_keys: the longest sequence's keys are cut into slices of at most this many, so that its programs are no
        tail: a slice of 2,048 keys (1 MiB of K and V a head at d=128, bf16) is ~0.3 us of an H200's bandwidth
        spread over its SMs, far less than a step that holds such caches.
    min_waves: with few sequences, more splits, until the narrow programs fill this many waves of the SMs.
    max_splits: the most splits (the merge reads every split of a row).
    """

    narrow_m: int = 16
    min_keys: int = 256
    split_keys: int = 2048
    min_waves: int = 2
    max_splits: int = 64


@dataclass(frozen=True, slots=True)
class MixedSchedule:
    """What a paged varlen call launches: `narrow_m` > 0, the narrow kernels with tiles of that many (query, group
    head) rows, for the sequences whose rows fit (the wide kernel skips them); 0, the wide kernel alone.
    `num_splits`: key splits a narrow item."""

    narrow_m: int
    num_splits: int


DEFAULT = MixedPolicy()
"""The policy `schedule` applies unless given another (tests force the narrow path at small sizes with their own)."""

NARROW_LAUNCH = {"num_warps": 4, "num_stages": 2}
"""The narrow kernel's warps and pipeline stages: a 16-row tile is a quarter of a wide one's work per key block."""

OFF = MixedSchedule(0, 1)


def schedule(batch: int, heads: int, kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, sms: int, block_n: int,
             policy: MixedPolicy | None = None) -> MixedSchedule:
    """The schedule of a paged varlen call of `batch` sequences, `heads` query heads over `kv_heads` K/V heads,
    from host values only (`policy`: DEFAULT where None)."""
    policy = policy or DEFAULT
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k < policy.min_keys:
        return OFF
    narrow_m = max(policy.narrow_m, 1 << (heads // kv_heads - 1).bit_length())
    key_blocks = -(-max_seqlen_k // block_n)
    splits = -(-max_seqlen_k // policy.split_keys)
    # Few sequences: split further until the programs fill the SMs (a lone decode over 32k keys, 16 heads).
    splits = max(splits, -(-policy.min_waves * sms // (batch * kv_heads)))
    return MixedSchedule(narrow_m, max(1, min(splits, policy.max_splits, key_blocks)))
