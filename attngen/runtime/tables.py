"""Tuned entries on disk: one human-readable JSON file per device, and the lookup over them.

A file (the user's `<cache>/tuning/<device slug>.json`, or a table shipped in `attngen/tuned/`):

    {
      "format": "attngen-tuning/1",
      "gpu": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "triton": "3.6",
      "problems": {
        "<problem key>": {
          "problem": "kind = forward; mask = causal(top_left); head_dim = 64; dtype = fp16; ...",
          "specs": ["fwd_causal_d64"],
          "buckets": {
            "BH=64 N_Q=4096 N_K=4096": {
              "config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "num_warps": 8},
              "ms": 0.52, "tflops": 402.1, "rel_err": 0.0011, "default_ms": 0.58,
              "shape": {"B": 4, "H": 16, "H_KV": 16, "N_Q": 4096, "N_K": 4096},
              "tried": 16, "pruned": 40, "failed": 0, "rejected": 0,
              "timing": "do_bench median", "attngen": "0.1.0", "tuned": "2026-11-20"}}}}
    }

A decode entry may also hold `"uniform": {"config": {...}, "ms": ...}`: the fastest config when every
sequence holds the same number of keys (timed at capacity), where that is another than the bucket's best
(which must also do well on spread lengths). Calls that say their lengths are equal (`cache_seqlens` an
int) take it, from their own bucket's entry only.

Writers hold an exclusive `fcntl.flock` on a lock file beside it, read what is there, merge their
entries in (a new entry replaces the one for its bucket) and write atomically (`cache.write_atomic`),
so two processes tuning at once both land and a reader never sees half a file. A file that does not
parse, or is not a tuning file, is treated as empty with a `CacheWarning`, and the next writer
replaces it. A write that fails (unwritable directory, full disk) is a warning: the results still
serve the process that measured them.

Lookup, per device: the entries this process tuned itself > the user's cache file > the tables
shipped in the package, merged per bucket in that order. A call's bucket is served by its own
entry if there is one, else by the nearest tuned bucket of the same problem (`key.bucket_distance`),
else by the kernel's default (the heuristic of attngen/policy/configs.py). Every entry is checked before
use: its config must name the kernel's tile keys, agree with the spec's fixed values and fit the
resource model; a bad one is skipped with a warning. Answers are memoised per (problem, bucket),
so a call costs a few dictionary lookups.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .. import env
from ..env import interpreting
from .cache import CacheWarning, cache_dir, write_atomic
from .keys import Device, Packed, Shape, bucket, bucket_distance, bucket_sizes, problem_key
from ..analysis.resources import Target

FORMAT = "attngen-tuning/1"


def user_path(device: Device) -> Path:
    return cache_dir("tuning") / f"{device.slug}.json"


def shipped_files() -> list:
    """The tables shipped in the package (attngen/tuned/*.json)."""
    folder = resources.files("attngen").joinpath("tuned")
    try:
        return sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def read(path) -> dict | None:
    """A tuning file's content; None when missing. Unreadable or malformed: a warning, then None."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warnings.warn(f"attngen: cannot read tuning file {path} ({e}); ignoring it", CacheWarning, stacklevel=2)
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        warnings.warn(f"attngen: tuning file {path} is damaged ({e}); ignoring it, the next tuning rewrites it",
                      CacheWarning, stacklevel=2)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("problems"), dict):
        warnings.warn(f"attngen: {path} is not an attngen tuning file (format {FORMAT}); ignoring it",
                      CacheWarning, stacklevel=2)
        return None
    return data


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on `.<name>.lock` beside `path` (no locking where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: atomic writes still keep the file whole
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge(data: dict, problem_text: str, spec_name: str, records: list[tuple[str, dict]]) -> None:
    """Put `records` ((bucket, entry) pairs measured for a problem, on a spec so named) into a file's content."""
    problem = data["problems"].setdefault(problem_key(problem_text), {})
    problem["problem"] = problem_text
    problem["specs"] = sorted(set(problem.get("specs") or []) | {spec_name})
    buckets = problem.setdefault("buckets", {})
    if not isinstance(buckets, dict):
        problem["buckets"] = buckets = {}
    for bucket, entry in records:
        buckets[bucket] = entry


def save(path: Path, device: Device, problem_text: str, spec_name: str, records: list[tuple[str, dict]]) -> None:
    """Merge records into the file at `path` under its lock. Raises OSError if it cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        data = read(path)
        if data is not None and Device.from_header(data) != device:
            warnings.warn(f"attngen: {path} holds entries for {Device.from_header(data)}, not {device}; "
                          "replacing it", CacheWarning, stacklevel=2)
            data = None
        if data is None:
            data = {"format": FORMAT, **device.header(), "problems": {}}
        merge(data, problem_text, spec_name, records)
        write_atomic(path, dumps(data))


def dumps(data: dict) -> str:
    """JSON laid out for reading and diffing: one line per problem field and per bucket entry."""
    def line(value) -> str:
        return json.dumps(value)  # entries keep their order: config first

    head = [f" {line(k)}: {line(v)}," for k, v in data.items() if k != "problems"]
    problems = []
    for key, problem in sorted(data["problems"].items()):
        fields = [f"   {line(k)}: {line(v)}" for k, v in sorted(problem.items()) if k != "buckets"]
        buckets = sorted((problem.get("buckets") or {}).items())
        fields.append('   "buckets": {' + ",".join(f"\n    {line(b)}: {line(e)}" for b, e in buckets)
                      + ("\n   }" if buckets else "}"))
        problems.append(f"  {line(key)}: {{\n" + ",\n".join(fields) + "\n  }")
    return "{\n" + "\n".join(head) + '\n "problems": {\n' + ",\n".join(problems) + "\n }\n}\n"


# -- lookup --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    config: dict
    source: str   # "user cache <path>", "shipped table <file>", "this process", "default", ...
    exact: bool   # an entry for this very bucket (False: the nearest tuned bucket, or the default)
    uniform: dict | None = None  # this very bucket's config for calls whose sequences all have one length


class Tables:
    """The tuned entries one device can use, in order of precedence, with a memo of answers."""

    def __init__(self, device: Device, layers: list[tuple[str, dict]]):
        self.device = device
        self.layers = layers            # (source, file content), highest precedence first
        self._memo: dict[tuple[str, str], Found] = {}
        self._warned: set = set()

    @staticmethod
    def load(device: Device, session: dict) -> "Tables":
        layers = [("this process", {"problems": session})]
        user = user_path(device)
        data = read(user)
        if data is not None and Device.from_header(data) != device:
            warnings.warn(f"attngen: {user} holds entries for {Device.from_header(data)}, not {device}; "
                          "ignoring it", CacheWarning, stacklevel=2)
        elif data is not None:
            layers.append((f"user cache {user}", data))
        for table in shipped_files():
            data = read(table)
            if data is not None and Device.from_header(data) == device:
                layers.append((f"shipped table attngen/tuned/{table.name}", data))
        return Tables(device, layers)

    def find(self, kernel, problem: str, bucket: str) -> Found:
        found = self._memo.get((problem, bucket))
        if found is None:
            found = self._memo[(problem, bucket)] = self._find(kernel, problem, bucket)
        return found

    def _find(self, kernel, problem: str, bucket: str) -> Found:
        candidates: dict[str, tuple[str, dict]] = {}
        for source, data in self.layers:
            stored = data["problems"].get(problem)
            buckets = stored.get("buckets") if isinstance(stored, dict) else None
            for name, entry in (buckets.items() if isinstance(buckets, dict) else ()):
                if name not in candidates and self._usable(kernel, source, name, entry):
                    candidates[name] = (source, entry)
        if bucket in candidates:
            source, entry = candidates[bucket]
            return Found(dict(entry["config"]), source, True, self._uniform(kernel, source, bucket, entry))
        wanted = bucket_sizes(bucket)
        near = sorted((bucket_distance(bucket_sizes(name), wanted), name) for name in candidates)
        if near:
            source, entry = candidates[near[0][1]]
            return Found(dict(entry["config"]), f"{source} (nearest tuned bucket {near[0][1]})", False)
        return Found(kernel.tuning_default(), "default", False)

    def _uniform(self, kernel, source: str, bucket: str, entry: dict) -> dict | None:
        """The entry's config for calls of equal lengths, if it has a usable one (else a warning, once)."""
        uniform = entry.get("uniform")
        if uniform is None:
            return None
        uniform = uniform if isinstance(uniform, dict) else {}
        if self._usable(kernel, source, f"{bucket} (uniform)", uniform, bucket):
            return dict(uniform["config"])
        return None

    def _usable(self, kernel, source: str, bucket: str, entry, shape_bucket: str | None = None) -> bool:
        problem = entry_problem(kernel, shape_bucket or bucket, entry)
        if problem is None:
            return True
        if (source, bucket) not in self._warned:
            self._warned.add((source, bucket))
            warnings.warn(f"attngen: ignoring the tuned entry for {kernel.spec.name} at '{bucket}' in {source}: "
                          f"{problem}", CacheWarning, stacklevel=5)
        return False


def entry_problem(kernel, bucket: str, entry, target=None) -> str | None:
    """Why a stored entry cannot serve this kernel on `target` (default: the device in use), or None."""
    if bucket_sizes(bucket) is None:
        return "not a shape bucket"
    config = entry.get("config") if isinstance(entry, dict) else None
    space = kernel.tuning_space()
    optional = set(getattr(kernel, "tuning_optional", ()))  # keys an entry from before they existed lacks
    if not isinstance(config, dict) or not set(space) - optional <= set(config) <= set(space):
        required = [k for k in space if k not in optional]
        return (f"its config must set exactly {', '.join(required)}"
                + "".join(f" (and may set {k})" for k in space if k in optional))
    if any(type(v) is not int or v < (0 if 0 in space[k] else 1) for k, v in config.items()):
        return "its config values must be positive whole numbers (0 only where the key allows it)"
    fixed = {k: v[0] for k, v in space.items() if len(v) == 1 and config.get(k, v[0]) != v[0]}
    if fixed:
        return f"the spec fixes {', '.join(f'{k}={v}' for k, v in fixed.items())}"
    return kernel.tuning_infeasible(config, target or Target.current())


_LOCK = threading.RLock()
_TABLES: dict[Device, Tables] = {}
_SESSION: dict[Device, dict] = {}  # what this process tuned: {device: {problem: {"buckets": {...}}}}


def tables(device: Device) -> Tables:
    found = _TABLES.get(device)
    if found is None:
        with _LOCK:
            found = _TABLES.get(device)
            if found is None:
                found = _TABLES[device] = Tables.load(device, _SESSION.setdefault(device, {}))
    return found


_GENERATION = [0]  # bumped whenever what lookups see may have changed; memos key on it


def generation() -> int:
    return _GENERATION[0]


def remember(device: Device, problem_text: str, spec_name: str, records: list[tuple[str, dict]]) -> None:
    """Make records serve this process (whether or not they reach a file) and drop stale answers."""
    with _LOCK:
        merge({"problems": _SESSION.setdefault(device, {})}, problem_text, spec_name, records)
        _TABLES.pop(device, None)
        _GENERATION[0] += 1


def forget() -> None:
    """Drop everything read or tuned in this process (tests; a fresh look at the files)."""
    with _LOCK:
        _TABLES.clear()
        _SESSION.clear()
        _GENERATION[0] += 1


# -- the config of one call ----------------------------------------------------------------------
#
# A launch part (a `Kernel` for its forward, `parts.BackwardPart`, `parts.KVCachePart`) provides what the
# lookup needs: `spec`, `autotune`, `tuning_problem()` (its entries' problem text), `tuning_space()` (the keys
# an entry must set, with their candidates), `tuning_default()`, `tuning_infeasible(config, target)` and,
# optionally, `tuning_optional` (keys an entry may lack).

def _no_autotuner(part, shape) -> bool:
    raise RuntimeError("attngen: autotuning needs attngen.tuning, which `import attngen` sets up")


# How a bucket is tuned on first use, `(part, shape) -> whether a config passed`: attngen.tuning's, a layer
# above this one, set by `import attngen` (`set_autotuner`).
_autotuner = _no_autotuner


def set_autotuner(tune_bucket) -> None:
    """Make `tune_bucket(part, shape) -> bool` tune the buckets that calls with autotuning on find untuned."""
    global _autotuner
    _autotuner = tune_bucket


def autotune_enabled(kernel) -> bool:
    """The kernel's own flag (`load(..., autotune=True)`), else the ATTNGEN_AUTOTUNE variable."""
    flag = getattr(kernel, "autotune", None)
    if flag is not None:
        return bool(flag)
    return env.autotune()


_TUNING = threading.Lock()
_ATTEMPTED: set = set()


def launch_config(kernel, shape: "Shape | Packed", device_index: int | None = None) -> dict:
    """The config for one call: tuned for this device and shape bucket if anyone tuned it, else
    the nearest tuned bucket, else the default. No tuning happens here unless autotuning is on and
    this bucket has no entry of its own; then it is tuned once per process, on random inputs of
    the call's shape, and saved to the user's cache."""
    return launch_choice(kernel, shape, device_index)[0]


def launch_choice(kernel, shape: "Shape | Packed", device_index: int | None = None, uniform: bool = False) -> tuple[dict, bool]:
    """`launch_config`, and whether the config was tuned for this very bucket (not the nearest one
    or the default): keys that only suit the shapes they were measured at need to know. `uniform`:
    the call's sequences all have one length, and the bucket's entry may hold a config for that."""
    # NOTE: this runs on every call; the memo makes it a handful of dictionary operations. (The
    # kernel objects are per mode, interpreted or compiled: runtime.load keys them by it.)
    if type(shape) is Shape:
        memo_key = (generation(), device_index, kernel, shape.batch * shape.heads, shape.n_q, shape.n_k)
    else:  # a varlen call's `Packed`, by its bucket: a serving step's token count is new at nearly every call
        memo_key = (generation(), device_index, kernel, bucket(shape))
    found = _MEMO.get(memo_key)
    if found is None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        found = _MEMO[memo_key] = _launch_config(kernel, shape, device_index)
    return dict(found.uniform if uniform and found.uniform else found.config), found.exact


_MEMO: dict = {}


def _launch_config(kernel, shape: Shape, device_index: int | None) -> dict:
    device = Device.current(device_index)
    key = (problem_key(kernel.tuning_problem()), bucket(shape))
    found = tables(device).find(kernel, *key)
    if found.exact or not autotune_enabled(kernel) or all(len(v) == 1 for v in kernel.tuning_space().values()):
        return found
    if not interpreting() and torch.cuda.is_current_stream_capturing():
        return found  # tuning would break the CUDA graph being captured
    with _TUNING:
        if (device, key) not in _ATTEMPTED:
            _ATTEMPTED.add((device, key))
            with torch.cuda.device(device_index) if device_index is not None else contextlib.nullcontext():
                ok = _autotuner(kernel, shape)
            if not ok:
                warnings.warn(f"attngen: autotuning {kernel.spec.name} at {shape} found no config that passed "
                              f"validation; using {found.source}", CacheWarning, stacklevel=3)
    return tables(device).find(kernel, *key)


def describe_config(kernel, shape: Shape, device_index: int | None = None) -> tuple[dict, str]:
    """(config, where it came from) for a call of this shape, without autotuning."""
    problem = problem_key(kernel.tuning_problem())
    found = tables(Device.current(device_index)).find(kernel, problem, bucket(shape))
    return dict(found.config), found.source
