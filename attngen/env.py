"""The environment variables attngen reads, in one place.

Each is read on every call (not once at import), so a test or a user can set it at any time.

    TRITON_INTERPRET=1         kernels run in Triton's CPU interpreter (`interpreting`)
    ATTNGEN_AUTOTUNE=1         calls tune shape buckets nobody tuned, once, on first use (`autotune`)
    ATTNGEN_CACHE_DIR=path     where generated kernels and tuning results are kept (`cache_dir`)
    ATTNGEN_FAST_LAUNCH=0      launches take Triton's own path, not attngen's cached one (`fast_launch`)
    ATTNGEN_WARMUP=0|1         Triton's start-up hash on a background thread at import (`warmup`)
    ATTNGEN_CHECK_KVCACHE=1    attention_with_kvcache checks cache_seqlens and block_table values, flash_attn_varlen_func
                               its sequence tensors' values on a GPU (`check_kvcache`)
"""

from __future__ import annotations

import os

_OFF = ("", "0", "false", "no", "off")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune() -> bool:
    """ATTNGEN_AUTOTUNE: whether a kernel loaded without its own autotune setting tunes untuned buckets."""
    return os.environ.get("ATTNGEN_AUTOTUNE", "0").lower() not in _OFF


def cache_dir() -> str | None:
    """ATTNGEN_CACHE_DIR, or None when unset or empty."""
    return os.environ.get("ATTNGEN_CACHE_DIR") or None


def fast_launch() -> bool:
    """ATTNGEN_FAST_LAUNCH (default on): whether launches take attngen's cached path (runtime/launch.py)."""
    return os.environ.get("ATTNGEN_FAST_LAUNCH", "1") not in ("0", "false", "no", "off")


def warmup() -> bool | None:
    """ATTNGEN_WARMUP: True for "1", False for "0", None when unset (decided by the machine)."""
    setting = os.environ.get("ATTNGEN_WARMUP", "")
    return setting == "1" if setting in ("0", "1") else None


def check_kvcache() -> bool:
    """ATTNGEN_CHECK_KVCACHE=1: attention_with_kvcache reads cache_seqlens and block_table back to check them."""
    return os.environ.get("ATTNGEN_CHECK_KVCACHE", "0") not in ("", "0")
