"""No import cycles: not between files of the package, not between its sub-packages.

Every `import` / `from ... import` in a file counts, module-level or inside a function (a
function-local import that dodges a cycle at import time is still a layering knot), except
imports under `if TYPE_CHECKING:`. A sub-package is a folder; an import between a package and
its own sub-packages is no cross-package edge.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tensorrt_llm

ROOT = Path(tensorrt_llm.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["tensorrt_llm", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_ids(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _imported(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "tensorrt_llm"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "tensorrt_llm":
        return []
    # `from pkg import name` imports the module pkg.name when there is one.
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over the package's own modules."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_ids(tree)
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(module, path, node, modules):
                if target in modules and target != module:
                    graph[module].setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {w for ws in graph.values() for w in ws}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(cycle: list[str], edges: dict[str, dict[str, str]]) -> str:
    members = set(cycle)
    lines = [" <-> ".join(cycle)]
    for a in cycle:
        for b, where in sorted(edges.get(a, {}).items()):
            if b in members:
                lines.append(f"    {a} -> {b} ({where})")
    return "\n".join(lines)


def test_no_import_cycle_between_files() -> None:
    graph = import_graph()
    cycles = _cycles({m: set(ts) for m, ts in graph.items()})
    edges = {m: {t: f"line {n}" for t, n in ts.items()} for m, ts in graph.items()}
    assert not cycles, "\n".join(_describe(c, edges) for c in cycles)


def _package(module: str) -> str:
    path = _modules()[module]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_import_cycle_between_packages() -> None:
    graph = import_graph()
    packages: dict[str, set[str]] = defaultdict(set)
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = _package(module), _package(target)
            related = a == b or a.startswith(b + ".") or b.startswith(a + ".")
            if not related:
                packages[a].add(b)
                edges[a].setdefault(b, f"{module} -> {target} line {line}")
    cycles = _cycles(packages)
    assert not cycles, "\n".join(_describe(c, edges) for c in cycles)


def test_the_checker_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
