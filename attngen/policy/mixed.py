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

    short_q: the narrow tile's rows, and the most queries a sequence may have to take one: 16 is the narrowest tile
        `tl.dot` takes (vLLM's unified Triton kernel tiles its queries by 16 rows too), and it covers a decode and a
        speculative-decoding step of a few tokens; 17 queries or more fill an eighth of a wide tile or more.
    min_keys: below this longest cache (max_seqlen_k) the narrow kernels are not launched: a short sequence over
        fewer keys costs the wide tile less than two extra launches (a few microseconds each) would.
    split_keys: the longest sequence's keys are cut into slices of at most this many, so that its programs are no
        tail: a slice of 2,048 keys (1 MiB of K and V a head at d=128, bf16) is ~0.3 us of an H200's bandwidth
        spread over its SMs, far less than a step that holds such caches.
    min_waves: with few sequences, more splits, until the narrow programs fill this many waves of the SMs.
    max_splits: the most splits (the merge reads every split of a row).
    """

    short_q: int = 16
    min_keys: int = 256
    split_keys: int = 2048
    min_waves: int = 2
    max_splits: int = 64


@dataclass(frozen=True, slots=True)
class MixedSchedule:
    """What a paged varlen call launches: `short_q` > 0, the narrow kernels for sequences of at most that many
    queries (and the wide kernel skips them); 0, the wide kernel alone. `num_splits`: key splits a narrow item."""

    short_q: int
    num_splits: int


DEFAULT = MixedPolicy()
"""The policy `schedule` applies unless given another (tests force the narrow path at small sizes with their own)."""

NARROW_LAUNCH = {"num_warps": 4, "num_stages": 2}
"""The narrow kernel's warps and pipeline stages: a 16-row tile is a quarter of a wide one's work per key block."""

OFF = MixedSchedule(0, 1)


def schedule(batch: int, heads: int, max_seqlen_q: int, max_seqlen_k: int, sms: int, block_n: int,
             policy: MixedPolicy | None = None) -> MixedSchedule:
    """The schedule of a paged varlen call of `batch` sequences and `heads` query heads, from host values only
    (`policy`: DEFAULT where None)."""
    policy = policy or DEFAULT
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_k < policy.min_keys:
        return OFF
    key_blocks = -(-max_seqlen_k // block_n)
    splits = -(-max_seqlen_k // policy.split_keys)
    # Few sequences: split further until the programs fill the SMs (a lone decode over 32k keys, 16 heads).
    splits = max(splits, -(-policy.min_waves * sms // (batch * heads)))
    return MixedSchedule(policy.short_q, max(1, min(splits, policy.max_splits, key_blocks)))
