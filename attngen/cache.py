"""The on-disk cache of generated kernel files.

A generated module lives at `<cache>/<name>-<key>/<name>.py`, where `key` hashes the canonical spec,
the attngen version, a fingerprint of the generator's own sources (passes, code generation,
templates) and the Triton version, so a second process imports the file instead of regenerating
it, and any change to the generator or Triton makes a new one. Beside it, `<name>.py.sha256` holds
the hash of its content: a truncated or edited file is detected, reported once as a warning and
rewritten. Files are written to a temporary name and renamed into place, so concurrent processes
never see half a file; they write identical bytes, so whichever rename lands last changes nothing.

The cache directory is `$ATTNGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/attngen`, else
`~/.cache/attngen`; if it cannot be written, a per-user temporary directory is used instead, with a
warning.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .version import __version__


class CacheWarning(UserWarning):
    """Something was wrong with a cache on disk; attngen recovered from it."""


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - triton missing or broken: generation still works
        return "none"


@lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """A hash of everything that shapes generated code: attngen's sources and templates."""
    digest = hashlib.sha256(__version__.encode())
    package = resources.files("attngen")
    for sub in ("", "passes", "codegen"):
        folder = package.joinpath(sub) if sub else package
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.name.endswith((".py", ".lark")):
                digest.update(entry.name.encode())
                digest.update(entry.read_bytes())
    from .codegen import template_files

    for entry in sorted(template_files().iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".j2"):
            digest.update(entry.name.encode())
            digest.update(entry.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(canonical_spec: str) -> str:
    text = "\n".join([canonical_spec, __version__, generator_fingerprint(), triton_version()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _usable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
        return True
    except OSError:
        return False


_fallback_warned: set[str] = set()


def cache_dir(kind: str = "kernels") -> Path:
    """The directory for one kind of cached file ('kernels', 'tuning'), created if needed."""
    base = os.environ.get("ATTNGEN_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "attngen")
    path = Path(base) / kind
    if _usable(path):
        return path
    fallback = Path(tempfile.gettempdir()) / f"attngen-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / kind
    if str(path) not in _fallback_warned:
        _fallback_warned.add(str(path))
        warnings.warn(f"attngen: cache directory {path} is not writable; using {fallback}", CacheWarning, stacklevel=3)
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_verified(path: Path) -> str | None:
    """The file's text if it and its `.sha256` sidecar agree; None if either is missing or wrong."""
    try:
        text = path.read_text()
        expected = path.with_name(path.name + ".sha256").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if digest(text) == expected else None


def store(path: Path, text: str) -> None:
    write_atomic(path, text)
    write_atomic(path.with_name(path.name + ".sha256"), digest(text) + "\n")


def generated_path(name: str, canonical_spec: str) -> Path:
    key = cache_key(canonical_spec)
    return cache_dir("kernels") / f"{name}-{key}" / f"{name}.py"


def cached_source(name: str, canonical_spec: str, generate) -> tuple[Path, str]:
    """The generated file for a spec: read from the cache when intact, else `generate()`d and stored."""
    path = generated_path(name, canonical_spec)
    text = read_verified(path)
    if text is not None:
        return path, text
    if path.exists():
        warnings.warn(f"attngen: cached kernel {path} is damaged (content hash mismatch); regenerating it",
                      CacheWarning, stacklevel=3)
    text = generate()
    try:
        store(path, text)
    except OSError as e:
        # Unwritable after all (disk full, permissions changed): keep going from a private copy.
        fallback = Path(tempfile.mkdtemp(prefix="attngen-")) / path.name
        warnings.warn(f"attngen: cannot write {path} ({e.strerror}); using {fallback}", CacheWarning, stacklevel=3)
        store(fallback, text)
        path = fallback
    return path, text
