"""attngen's modules import only downward: each belongs to a layer (`LAYERS`), imports from its own layer or
lower ones, no two modules import each other (directly or round a cycle, imports inside functions counted),
and an import inside a function is an exception listed in `ALLOWED_LOCAL` with its reason.

The checker reads the sources with `ast` (nothing is imported), so it sees every import a module can run.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attngen"

# Lowest first; a module's layer is that of the longest name here it starts with (docs: the package layout).
LAYERS = {
    "attngen.errors": 0, "attngen.env": 0, "attngen.version": 0,
    "attngen.lang": 1,
    "attngen.ir": 2,
    "attngen.analysis": 3,
    "attngen.policy": 4,
    "attngen.passes": 5,
    "attngen.codegen": 6,
    "attngen.runtime": 7,
    "attngen.api": 8,
    "attngen.distributed": 8,  # context parallelism: the API over torch.distributed
    "attngen.testing": 9,
    "attngen.integrations": 9,  # attngen inside other libraries (transformers): on the API, beside testing
    "attngen.tuning": 10,
    "attngen.bench": 11,
    "attngen.cli": 12, "attngen.__main__": 12,
    "attngen": 13,  # the public facade (attngen/__init__.py): it may import any layer, and none may import it
}

# (module, the attngen module it imports inside a function): why that import cannot be at the top.
ALLOWED_LOCAL = {
    ("attngen.runtime.autograd", "attngen.runtime.ops"):
        "registers torch's custom ops the first time torch.compile traces a call; an eager process never "
        "pays for registering them (0.1 s of a cached process's first call)",
    ("attngen.api.kvcache", "attngen.api.merge"):
        "merge_states runs attngen.api.merge's Triton kernel on GPUs under policy.context_parallel.FUSED_MERGE, and "
        "whether Triton interprets a kernel is fixed when it is defined: `import attngen` must not define it",
    ("attngen.__init__", "attngen.api.paged"):
        "PagedKVCache defines a Triton kernel, and whether Triton interprets it is fixed when it is defined: "
        "the CLI decides that after `import attngen`",
}


class Import(NamedTuple):
    module: str   # the importing module
    target: str   # the attngen module imported
    line: int
    local: bool   # inside a function


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(module: str, source: str, is_package: bool, modules: set[str]) -> list[Import]:
    """The modules of its own package that `source` (the text of `module`) imports, with their lines:
    `from X import name` counts as an import of X.name where that is a module, else of X."""
    tree = ast.parse(source)
    functions = [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local_lines = {node.lineno for fn in functions for node in ast.walk(fn)
                   if isinstance(node, (ast.Import, ast.ImportFrom))}
    here = module.split(".") if is_package else module.split(".")[:-1]
    root = here[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == root or target.startswith(root + "."):
                found.append(Import(module, target, node.lineno, node.lineno in local_lines))
    return found


def layer_of(module: str, layers: dict[str, int]) -> int:
    prefix = max((name for name in layers if module == name or module.startswith(name + ".")), key=len)
    return layers[prefix]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def problems(sources: dict[str, tuple[str, bool]], layers: dict[str, int], allowed: dict) -> list[str]:
    """Everything wrong with the imports of `sources` ({module: (text, is_package)}): upward imports, cycles,
    function-level imports not in `allowed`."""
    modules = set(sources)
    found, edges = [], {m: set() for m in modules}
    for module, (source, is_package) in sorted(sources.items()):
        for imp in imports_of(module, source, is_package, modules):
            if imp.target == module:
                continue
            # importing a.b.c runs the packages a.b and a.b.c too (not the ones the importer is inside)
            parts = imp.target.split(".")
            for i in range(2, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in modules and not module.startswith(name + ".") and name != module:
                    edges[module].add(name)
            if module != "attngen" and layer_of(imp.target, layers) > layer_of(module, layers):
                found.append(f"{module}:{imp.line} imports {imp.target}, a higher layer "
                             f"({layer_of(imp.target, layers)} > {layer_of(module, layers)})")
            key = (module if not is_package else f"{module}.__init__", imp.target)
            if imp.local and key not in allowed:
                found.append(f"{module}:{imp.line} imports {imp.target} inside a function (not in ALLOWED_LOCAL)")
    found += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return list(dict.fromkeys(found))  # (one line per import, not per name it imports)


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p, PACKAGE): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_attngen_imports_only_downward_without_cycles_or_unlisted_local_imports():
    assert problems(package_sources(), LAYERS, ALLOWED_LOCAL) == []


def test_every_module_has_a_layer_and_every_allowed_local_import_is_used():
    sources = package_sources()
    assert all(layer_of(m, LAYERS) is not None for m in sources)
    used = {(m if not pkg else f"{m}.__init__", imp.target)
            for m, (text, pkg) in sources.items() for imp in imports_of(m, text, pkg, set(sources)) if imp.local}
    assert set(ALLOWED_LOCAL) <= used, set(ALLOWED_LOCAL) - used


# -- the checker itself, on made-up packages -----------------------------------------------------------------

TOY_LAYERS = {"toy": 9, "toy.low": 0, "toy.high": 1}


def toy(**files) -> dict[str, tuple[str, bool]]:
    return {"toy": ("", True), **{f"toy.{name}": (text, False) for name, text in files.items()}}


def test_the_checker_finds_an_upward_import():
    found = problems(toy(low="from . import high\n", high=""), TOY_LAYERS, {})
    assert found == ["toy.low:1 imports toy.high, a higher layer (1 > 0)"]


def test_the_checker_finds_a_cycle_through_a_function_level_import():
    sources = toy(low="", high="from . import other\n", other="def f():\n    from . import high\n")
    layers = dict(TOY_LAYERS, **{"toy.other": 1})
    allowed = {("toy.other", "toy.high"): "a reason"}
    assert problems(sources, layers, allowed) == ["import cycle: toy.high <-> toy.other"]


def test_the_checker_finds_an_unlisted_function_level_import_and_resolves_relative_names():
    sources = {"toy": ("", True), "toy.pkg": ("", True), "toy.pkg.a": ("def f():\n    from ..low import x\n", False),
               "toy.low": ("x = 1\n", False)}
    layers = dict(TOY_LAYERS, **{"toy.pkg": 1})
    assert problems(sources, layers, {}) == ["toy.pkg.a:2 imports toy.low inside a function (not in ALLOWED_LOCAL)"]
    assert problems(sources, layers, {("toy.pkg.a", "toy.low"): "a reason"}) == []


@pytest.mark.parametrize("text, target", [("from .. import low\n", "toy.low"), ("from ..low import x\n", "toy.low"),
                                          ("import toy.low\n", "toy.low"), ("from . import b\n", "toy.pkg.b")])
def test_imports_resolve_to_modules(text, target):
    (imp,) = imports_of("toy.pkg.a", text, False, {"toy", "toy.low", "toy.pkg", "toy.pkg.a", "toy.pkg.b"})
    assert imp.target == target and not imp.local
