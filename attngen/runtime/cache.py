"""The on-disk cache of generated kernel files.

A generated module lives at `<cache>/<name>-<key>/<name>.py`, where `key` hashes the canonical spec,
the attngen version, a fingerprint of the generator's own sources (passes, code generation,
templates) and the Triton version, so a second process imports the file instead of regenerating
it, and any change to the generator or Triton makes a new one. Beside it, `<name>.py.sha256` holds
the hash of its content: a truncated or edited file is detected, reported once as a warning and
rewritten. Files are written to a temporary name and renamed into place, so concurrent processes
never see half a file; they write identical bytes, so whichever rename lands last changes nothing.

The sidecar is written before the file it vouches for: a process that finds the file finds its
hash too, so a concurrent writer is never mistaken for damage.

The cache directory is `$ATTNGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/attngen`, else
`~/.cache/attngen`; if it cannot be written, a per-user temporary directory is used instead, with a
warning. That directory must belong to this user and be closed to others' writes (anyone who can
plant a file with its hash there chooses the code this process imports); if it is not, a fresh
private one is made.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from .. import env
from ..codegen import template_files
from ..errors import AttnGenError
from ..version import __version__


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
    for sub in ("", "lang", "ir", "analysis", "policy", "passes", "codegen"):
        folder = package.joinpath(sub) if sub else package
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.name.endswith((".py", ".lark")):
                digest.update(entry.name.encode())
                digest.update(entry.read_bytes())
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
    base = env.cache_dir()
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "attngen")
    path = Path(base) / kind
    if _usable(path):
        return path
    fallback = _private_fallback(kind)
    if str(path) not in _fallback_warned:
        _fallback_warned.add(str(path))
        warnings.warn(f"attngen: cache directory {path} is not writable; using {fallback}", CacheWarning, stacklevel=3)
    return fallback


def _private_fallback(kind: str) -> Path:
    """`<tmp>/attngen-<uid>/<kind>` if that is this user's own directory and nobody else can write
    it; else a fresh private temporary directory (shared with no other process)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    root = Path(tempfile.gettempdir()) / f"attngen-{uid if uid is not None else 'user'}"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(root)  # lstat: a symlink planted in /tmp is not a directory of ours
        if stat.S_ISDIR(info.st_mode) and (uid is None or info.st_uid == uid) and not info.st_mode & 0o022:
            if _usable(root / kind):
                return root / kind
    except OSError:
        pass
    try:
        return Path(tempfile.mkdtemp(prefix=f"attngen-{kind}-"))
    except OSError as e:
        raise AttnGenError(f"no writable directory for attngen's {kind} cache ({root}: {e.strerror}); "
                           "set ATTNGEN_CACHE_DIR to a writable directory") from None


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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
        text = path.read_text(encoding="utf-8")
        expected = _sidecar(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if digest(text) == expected else None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def store(path: Path, text: str) -> None:
    # Sidecar first: whoever sees the new file also sees its hash (see the module docstring).
    write_atomic(_sidecar(path), digest(text) + "\n")
    write_atomic(path, text)


def damage(path: Path) -> str | None:
    """Why an existing cached file failed verification, for the warning; None if there is no file."""
    if not path.exists():
        return None
    if not _sidecar(path).exists():
        return "its content hash file is missing"
    return "content hash mismatch"


def generated_path(name: str, canonical_spec: str) -> Path:
    key = cache_key(canonical_spec)
    return cache_dir("kernels") / f"{name}-{key}" / f"{name}.py"


def cached_source(name: str, canonical_spec: str, generate) -> tuple[Path, str]:
    """The generated file for a spec: read from the cache when intact, else `generate()`d and stored."""
    path = generated_path(name, canonical_spec)
    text = read_verified(path)
    if text is not None:
        return path, text
    problem = damage(path)
    if problem:
        warnings.warn(f"attngen: cached kernel {path} is damaged ({problem}); regenerating it",
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
