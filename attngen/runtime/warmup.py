"""Triton's one-time start-up hash, computed in the background from `import attngen`.

The first kernel a process launches (even one in Triton's disk cache) makes Triton compute
`triton.runtime.cache.triton_key()`: a sha256 of Triton's own sources and its ~400 MB libtriton.so,
kept for the process. It was a third to a half of a cached process's time from `attngen.load` to
its first result (0.33-0.35 s on the lent H200, benchmarks/NOTES.md v7). hashlib and file reads
release the GIL, so `start()` (called at the end of `import attngen`) runs it on a thread while the
process goes on: CUDA's initialisation, the model's own setup, `load()`. `wait()`, called before
each launch, joins it, so that Triton finds the key cached instead of computing it a second time.

Started from `load()` instead, it hid little (NOTES.md v7): `load` is
Python work that holds the GIL, and the hash needs the GIL between Triton's 1 MB chunks. The thread
is not a daemon: a process that exits within the hash's time waits for it (a daemon thread inside
buffered I/O at interpreter shutdown can abort the process).

On by default where kernels will compile: a CUDA or ROCm build of torch, a GPU driver's device node
(/dev/nvidiactl, /dev/kfd), and Triton's interpreter not selected. Starting it imports Triton, and
Triton fixes interpreted or compiled mode for its own library when it is imported, so it must not
start where the CLI will switch to the interpreter after `import attngen` (a machine without a GPU);
the device node says so without initialising CUDA (which would break CUDA in forked children).
`ATTNGEN_WARMUP=0` turns it off, `ATTNGEN_WARMUP=1` on regardless (then select the interpreter,
if at all, before importing attngen). Nothing happens when Triton has no lru-cached `triton_key`
(another version).
"""

from __future__ import annotations

import os
import threading
from .. import env

DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's (ROCm) drivers
_THREAD: threading.Thread | None = None


def start() -> None:
    """Begin computing Triton's start-up hash in the background. Called once, by `import attngen`."""
    global _THREAD
    if _THREAD is not None or not wanted():
        return
    try:
        # NOTE: imported here, on the importing thread: two threads importing triton at once can
        # see each other's half-initialised modules.
        from triton.runtime import cache as triton_cache
    except Exception:  # noqa: BLE001 - no usable triton: loading reports that itself
        return
    key = getattr(triton_cache, "triton_key", None)
    if key is None or getattr(key, "cache_info", None) is None or key.cache_info().currsize:
        return  # not the lru-cached function this module knows, or already computed
    _THREAD = threading.Thread(target=_compute, args=(key,), name="attngen-triton-key")
    _THREAD.start()


def wanted() -> bool:
    """Whether `start` runs here (see the module docstring)."""
    if env.interpreting():
        return False
    setting = env.warmup()
    if setting is not None:
        return setting
    import torch

    return bool(torch.version.cuda or torch.version.hip) and any(os.path.exists(p) for p in DEVICE_NODES)


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
