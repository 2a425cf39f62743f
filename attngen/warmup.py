"""Triton's one-time start-up hash, computed in the background from `import attngen`.

The first kernel a process launches (even one in Triton's disk cache) makes Triton compute
`triton.runtime.cache.triton_key()`: a sha256 of Triton's own sources and its ~400 MB libtriton.so,
kept for the process. It was a third to a half of a cached process's time from `attngen.load` to
its first result (0.33-0.35 s on the lent H200, benchmarks/NOTES.md v7). hashlib and file reads
release the GIL, so `start()` (called at the end of `import attngen`) runs it on a thread while the
process goes on: CUDA's initialisation, the model's own setup, `load()`. `wait()`, called before
each launch, joins it, so that Triton finds the key cached instead of computing it a second time.

Started from `load()` instead, it hid little (benchmarks/experiments/first_call.py): `load` is
Python work that holds the GIL, and the hash needs the GIL between Triton's 1 MB chunks. The thread
is not a daemon: a process that exits within the hash's time waits for it (a daemon thread inside
buffered I/O at interpreter shutdown can abort the process).

On by default where kernels compile: a CUDA or ROCm build of torch, outside Triton's interpreter.
`ATTNGEN_WARMUP=0` turns it off, `ATTNGEN_WARMUP=1` on (on any build: the tests use it). Nothing
happens when Triton has no lru-cached `triton_key` (another version).
"""

from __future__ import annotations

import os
import threading

_THREAD: threading.Thread | None = None
_STARTED = False
_LOCK = threading.Lock()


def start() -> None:
    """Begin computing Triton's start-up hash in the background (once per process)."""
    global _THREAD, _STARTED
    if _STARTED:
        return
    with _LOCK:
        if _STARTED:
            return
        _STARTED = True
        if not _wanted():
            return
        try:
            # NOTE: imported here, on the calling thread: two threads importing triton at once can
            # see each other's half-initialised modules.
            from triton.runtime import cache as triton_cache
        except Exception:  # noqa: BLE001 - no usable triton: loading reports that itself
            return
        key = getattr(triton_cache, "triton_key", None)
        if key is None or getattr(key, "cache_info", None) is None or key.cache_info().currsize:
            return  # not the lru-cached function this module knows, or already computed
        _THREAD = threading.Thread(target=_compute, args=(key,), name="attngen-triton-key")
        _THREAD.start()


def _wanted() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    setting = os.environ.get("ATTNGEN_WARMUP", "")
    if setting in ("0", "1"):
        return setting == "1"
    import torch

    return bool(torch.version.cuda or torch.version.hip)


def _compute(key) -> None:
    try:
        key()
    except Exception:  # noqa: BLE001 - Triton raises it again, with its own message, when it needs the key
        pass


def wait() -> None:
    """Block until the background hash (if any) is done; then Triton finds it cached."""
    thread = _THREAD
    if thread is not None and thread.is_alive():
        thread.join()
