"""The package's import floors: a module imports only modules of its own floor or lower ones, at module level, and
the imports between spmd's modules form no cycle. Read from the source with `ast`, so nothing is imported.

Only explicit imports count: importing `spmd.x` also runs `spmd/__init__.py`, which imports everything (floor 6).
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spmd"

FLOORS = {  # a module's floor is that of its longest matching entry; `spmd` alone is the package's __init__
    0: ["spmd.errors", "spmd.mesh", "spmd.layout", "spmd.clients", "spmd.hlo_sharding", "spmd.jax_sharding",
        "spmd.torch_placements"],  # values
    1: ["spmd.collectives", "spmd.explain", "spmd.ops", "spmd.tracing"],  # collectives, spmd's own ops
    2: ["spmd.dtensor", "spmd.random", "spmd.shards"],  # the DTensor
    3: ["spmd.engine"],  # the rule engine
    4: ["spmd.api", "spmd.creation", "spmd.scope", "spmd.variable", "spmd.function_mode", "spmd.whole_step",
        "spmd.forbidden", "spmd.visualize", "spmd.local_functions", "spmd.custom_ops"],
    5: ["spmd.nn", "spmd.tp_plans", "spmd.chunked_losses", "spmd.experts", "spmd.sharded_batch", "spmd.buckets",
        "spmd.fsdp", "spmd.data", "spmd.checkpoint", "spmd.runtime", "spmd.xla", "spmd.interop"],
    6: ["spmd.cli", "spmd.demo", "spmd.controller", "spmd"],
}
_FLOOR_OF = {prefix: floor for floor, prefixes in FLOORS.items() for prefix in prefixes}

# (importing module, imported module) -> why the import has to be inside a function; keep this empty if possible
ALLOWED_INSIDE: dict[tuple[str, str], str] = {}

Import = collections.namedtuple("Import", "module target where nested")  # nested: inside a function or class


def floor(module: str) -> int | None:
    if module == "spmd":
        return _FLOOR_OF["spmd"]
    prefixes = [p for p in _FLOOR_OF if p != "spmd" and (module == p or module.startswith(p + "."))]
    return _FLOOR_OF[max(prefixes, key=len)] if prefixes else None


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The spmd modules an import statement imports (`from spmd.x import y` is `spmd.x.y` when y is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "spmd" or a.name.startswith("spmd.")]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    if not (base == "spmd" or base.startswith("spmd.")):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names]


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: pathlib.Path):
        self.module, self.path, self.scopes, self.found = module, path, [], []

    def _scope(self, node):
        self.scopes.append(node.name if hasattr(node, "name") else "<lambda>")
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _scope

    def visit_Import(self, node):
        where = f"{self.path.relative_to(ROOT)}:{node.lineno}"
        nested = ".".join(self.scopes) or None
        for target in _targets(node, self.module, self.path.name == "__init__.py"):
            if target != self.module:
                self.found.append(Import(self.module, target, where, nested))

    visit_ImportFrom = visit_Import


@functools.lru_cache(maxsize=None)
def imports() -> tuple[Import, ...]:
    found = []
    for module, path in modules().items():
        collector = _Collector(module, path)
        collector.visit(ast.parse(path.read_text(), str(path)))
        found += collector.found
    return tuple(found)


def _path(graph: dict, start: str, goal: str) -> list[str] | None:
    """The shortest import path from `start` to `goal`, or None."""
    previous, queue = {start: None}, collections.deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = previous[node]
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def test_the_package_is_found():
    assert {"spmd", "spmd.dtensor", "spmd.engine.dispatch", "spmd.clients", "spmd.shards"} <= set(modules())
    assert any(i.target == "spmd.engine.rules" for i in imports())  # `from spmd.engine.rules import register`


def test_every_module_has_a_floor():
    missing = [m for m in modules() if floor(m) is None]
    assert not missing, f"modules without a floor (add them to FLOORS in {pathlib.Path(__file__).name}): {missing}"


def test_no_spmd_import_inside_a_function_or_class():
    nested = [i for i in imports() if i.nested and (i.module, i.target) not in ALLOWED_INSIDE]
    assert not nested, "imports of spmd modules belong at module level (an import inside a function hides a " \
        "dependency, often one that goes up a floor or closes a loop):\n" + "\n".join(
            f"  {i.where}: {i.module} imports {i.target} inside {i.nested}" for i in nested)


def test_the_allowlist_is_current():
    used = {(i.module, i.target) for i in imports() if i.nested}
    assert not set(ALLOWED_INSIDE) - used, f"stale ALLOWED_INSIDE entries: {sorted(set(ALLOWED_INSIDE) - used)}"


def test_imports_go_to_the_same_or_a_lower_floor():
    upward = [i for i in imports() if None not in (floor(i.module), floor(i.target)) and
              floor(i.target) > floor(i.module)]
    assert not upward, "imports that go up a floor:\n" + "\n".join(
        f"  {i.where}: {i.module} (floor {floor(i.module)}) imports {i.target} (floor {floor(i.target)})"
        for i in upward)


def test_no_import_cycle():
    graph = collections.defaultdict(set)
    for i in imports():
        graph[i.module].add(i.target)
    cycles, seen = [], set()
    for a in sorted(graph):
        for b in sorted(graph[a]):
            path = _path(graph, b, a)
            if path and frozenset(path) not in seen:
                seen.add(frozenset(path))
                cycles.append(" -> ".join([a] + path))
    assert not cycles, "import cycles between spmd's modules:\n" + "\n".join(f"  {c}" for c in cycles)


@pytest.mark.parametrize("module, expected", [("spmd", 6), ("spmd.engine.rules.view", 3), ("spmd.collectives", 1),
                                              ("spmd.demo.train", 6), ("spmd.clients", 0), ("spmd.other", None)])
def test_floor_of(module, expected):
    assert floor(module) == expected
