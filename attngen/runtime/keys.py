"""What a tuned entry is keyed by: the device, the problem, and the shape bucket.

  * `Device`: the GPU's name and compute capability and Triton's major.minor version (each device
    has its own file). Triton's patch number is left out on purpose: patch releases fix bugs and
    do not move the best tiles, and a key with it would orphan every shipped table at each patch
    upgrade; a stale config is still safe, since every entry is re-checked against the resource
    model when it is read. The interpreter is a device of its own, so CPU runs never touch a GPU's
    entries.
  * the problem: what the kernel computes, as text (`kernel.tuning_problem()`, built with
    `problem_text`: the kernel's kind and the spec's canonical text without its name and without
    keys that do not change that kernel), hashed. Two specs that differ only in name share
    entries, and so do the `sdpa_*` specs `attngen.attention()` writes: the forward kernel is the
    same code for `direction = forward` and `forward+backward`, so specs/fwd_causal_d64.attn and
    `attention(..., is_causal=True)` on fp16 d=64 are one forward problem. Fixed tile keys stay
    in the text: a spec that fixes block_m = 64 searches a smaller space than one that leaves it
    `auto`, and must not be handed the other's answer.
  * `Shape` -> `bucket`: the sizes of one call, rounded to the nearest power of two (in log scale):
    batch x heads (the kernel's grid is blocks x heads x batch, so only the product matters), N_Q
    and N_K. Sizes come from tensor shapes: no host synchronisation.
  * `Packed` -> `bucket`: the sizes of one varlen call (packed sequences), likewise rounded: the query heads,
    the packed query tokens (the grid is cdiv(TOTAL_Q, BLOCK_M) + B tiles x heads) and the mean query and key
    length of a sequence (what one tile's loop runs over), e.g. 'H=32 TOTAL_Q=16384 N_Q=2048 N_K=2048'. The
    lengths themselves are on the GPU; the means come from shapes: tokens / sequences (cu_seqlens has B + 1
    entries), for a paged kernel the keys its block table can address per sequence (the decode kernels' cache
    capacity).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from .cache import triton_version
from ..lang.spec import Spec
from ..env import interpreting


@dataclass(frozen=True)
class Device:
    """The device a tuned entry was measured on: GPU name, compute capability, Triton major.minor."""

    name: str
    capability: tuple[int, int] | None  # None: Triton's CPU interpreter
    triton: str

    @property
    def interpreter(self) -> bool:
        return self.capability is None

    @property
    def slug(self) -> str:
        """The file name (without .json) of this device's tuned entries."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"
        arch = "" if self.capability is None else f"_sm{self.capability[0]}{self.capability[1]}"
        return f"{name}{arch}_triton-{self.triton}"

    def __str__(self) -> str:
        arch = "" if self.capability is None else f" (sm_{self.capability[0]}{self.capability[1]})"
        return f"{self.name}{arch}, Triton {self.triton}"

    def header(self) -> dict:
        return {"gpu": self.name, "capability": list(self.capability) if self.capability else None,
                "triton": self.triton}

    @staticmethod
    def from_header(data: dict) -> "Device":
        cap = data.get("capability")
        return Device(str(data.get("gpu")), tuple(cap) if cap else None, str(data.get("triton")))

    @staticmethod
    def current(index: int | None = None) -> "Device":
        """The device kernels run on now: CUDA device `index` (default: current), or the interpreter."""
        if interpreting():
            return _current(True, None)
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return _current(False, index)


@lru_cache(maxsize=None)
def _current(interpreting: bool, index: int | None) -> Device:
    triton = ".".join(triton_version().split(".")[:2])
    if interpreting:
        return Device("Triton interpreter", None, triton)
    import torch

    props = torch.cuda.get_device_properties(index)
    return Device(props.name, (props.major, props.minor), triton)


def problem_text(spec: Spec, kind: str, ignore: tuple[str, ...] = ()) -> str:
    """The kernel kind and the spec's canonical text without its name and the `ignore`d keys:
    'kind = forward; mask = none; head_dim = 64; ...'."""
    lines = [line.strip() for line in spec.canonical().splitlines()[1:-1]]
    return "; ".join([f"kind = {kind}"] + [line for line in lines if line.split(" = ")[0] not in ignore])


@lru_cache(maxsize=256)
def problem_key(problem: str) -> str:
    return hashlib.sha256(problem.encode()).hexdigest()[:16]


class Shape(NamedTuple):
    """The sizes of one attention call: batch, query heads, key/value heads, query and key lengths.
    (A named tuple rather than a dataclass: one is built per call, and this is cheaper.)"""

    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int

    @staticmethod
    def of(q, k) -> "Shape":
        """From q (B, H, N_Q, D) and k (B, H_KV, N_K, D): tensor shapes only, no synchronisation."""
        return Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])

    def as_dict(self) -> dict:
        return {"B": self.batch, "H": self.heads, "H_KV": self.kv_heads, "N_Q": self.n_q, "N_K": self.n_k}

    def __str__(self) -> str:
        heads = f"{self.heads}" if self.heads == self.kv_heads else f"{self.heads}/{self.kv_heads}"
        return f"B={self.batch} H={heads} N_Q={self.n_q} N_K={self.n_k}"


class Packed(NamedTuple):
    """The sizes of one varlen call: sequences, query heads, key/value heads, and the packed query and key tokens
    (for a paged kernel: sequences x the keys its block table addresses per sequence)."""

    batch: int
    heads: int
    kv_heads: int
    total_q: int
    total_k: int

    @staticmethod
    def of(q, k, cu_seqlens_q, block_table=None) -> "Packed":
        """From q (TOTAL_Q, H, D), k (TOTAL_K, H_KV, D) or a page pool (PAGES, PAGE_SIZE, H_KV, D) with its
        block_table (B, MAX_PAGES), and cu_seqlens_q (B + 1,): tensor shapes only, no synchronisation."""
        batch = cu_seqlens_q.shape[0] - 1
        total_k = k.shape[0] if block_table is None else batch * block_table.shape[1] * k.shape[1]
        return Packed(batch, q.shape[1], k.shape[-2], q.shape[0], total_k)

    @property
    def n_q(self) -> int:
        """Query tokens per sequence, on average."""
        return self.total_q // max(self.batch, 1)

    @property
    def n_k(self) -> int:
        """Keys per sequence, on average."""
        return self.total_k // max(self.batch, 1)

    def as_dict(self) -> dict:
        return {"B": self.batch, "H": self.heads, "H_KV": self.kv_heads, "TOTAL_Q": self.total_q,
                "TOTAL_K": self.total_k}

    def __str__(self) -> str:
        heads = f"{self.heads}" if self.heads == self.kv_heads else f"{self.heads}/{self.kv_heads}"
        return f"B={self.batch} H={heads} TOTAL_Q={self.total_q} TOTAL_K={self.total_k}"


def nearest_power_of_two(n: int) -> int:
    """2^round(log2 n): 1000 -> 1024, 1400 -> 1024, 1500 -> 2048 (n < 1 counts as 1)."""
    n = max(int(n), 1)
    lower = 1 << (n.bit_length() - 1)
    return lower if n * n < 2 * lower * lower else 2 * lower


def bucket(shape: "Shape | Packed") -> str:
    """The shape bucket an entry is stored under, e.g. 'BH=64 N_Q=1024 N_K=1024', or for a varlen call
    'H=32 TOTAL_Q=16384 N_Q=2048 N_K=2048'."""
    if type(shape) is Packed:
        return (f"H={nearest_power_of_two(shape.heads)} TOTAL_Q={nearest_power_of_two(shape.total_q)} "
                f"N_Q={nearest_power_of_two(shape.n_q)} N_K={nearest_power_of_two(shape.n_k)}")
    return (f"BH={nearest_power_of_two(shape.batch * shape.heads)} N_Q={nearest_power_of_two(shape.n_q)} "
            f"N_K={nearest_power_of_two(shape.n_k)}")


def bucket_sizes(text: str) -> dict[str, int] | None:
    """'BH=64 N_Q=1024 N_K=1024' -> {'BH': 64, ...}; None if the text is not a bucket."""
    sizes = {}
    for part in text.split():
        key, sep, value = part.partition("=")
        if not sep or not value.isdigit() or int(value) < 1:
            return None
        sizes[key] = int(value)
    return sizes or None


def bucket_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """How far apart two buckets are: the sum of |log2 ratio| over their sizes (missing: far)."""
    keys = set(a) | set(b)
    return sum(abs(a[k].bit_length() - b[k].bit_length()) if k in a and k in b else 64 for k in keys)
