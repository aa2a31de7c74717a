"""Sonar's floors: a module imports only its own package and the packages below it, and no two
modules import each other, not even through an import inside a function.

Every ``import`` statement of ``sonar/`` counts, at any depth (a lazy import hides a loop, it
does not remove it), except those under ``if TYPE_CHECKING:`` for the cycle check (they never
run). The floors, lowest first; packages on one floor import nothing of each other:

0. ``errors`` (the one exception hierarchy every floor raises from), ``lazy`` (names a package
   imports on first use) and the package ``sonar`` itself, whose ``__init__`` imports nothing
   (its ``__version__``; the public names load on first use, by its own ``__getattr__``).
1. ``units``, ``log``, ``paths``, ``procfs``, ``heap`` (the garbage collector around a process's start),
   ``sampling_params``, ``pooling_params``, ``parsers`` (tool-call and reasoning parsers of generated text):
   leaves.
2. ``core`` (pure cores) and ``actors`` (the runtime): nothing above them.
3. ``protocol`` (the engine's and the offload manager's messages, below every actor that sends
   them) and ``kernels``.
4. ``models``.
5. ``offload`` (the KV offload manager and its events publisher), ``structured`` (grammar
   backends, their compile cache, the token bitmask), ``lora`` (LoRA adapter files, names, the
   worker's slots), ``multimodal`` (image loading, preprocessing, per-prompt limits).
6. ``engine`` (the actor shells, the runner, the library client).
7. ``http`` (the OpenAI frontend).
8. ``cli``, ``bench``; 9. ``__main__``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sonar"

FLOORS: dict[str, int] = {
    "": 0,
    "errors": 0,
    "lazy": 0,
    "units": 1,
    "log": 1,
    "paths": 1,
    "procfs": 1,
    "heap": 1,
    "sampling_params": 1,
    "pooling_params": 1,
    "parsers": 1,
    "core": 2,
    "actors": 2,
    "protocol": 3,
    "kernels": 3,
    "models": 4,
    "offload": 5,
    "structured": 5,
    "lora": 5,
    "multimodal": 5,
    "engine": 6,
    "http": 7,
    "cli": 8,
    "bench": 8,
    "__main__": 9,
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (the package itself for a name it re-exports)
    where: str  # path:line
    runtime: bool  # False under `if TYPE_CHECKING:`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str:
    """The module `name` names: itself, or the closest package holding it (`from pkg import Name`)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    where = path.relative_to(ROOT)
    found: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in dict.fromkeys(names):
            if name == "sonar" or name.startswith("sonar."):
                target = _resolve(name)
                if target != module:
                    found.append(Import(module, target, f"{where}:{node.lineno}", runtime))
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(tree, True)
    return found


IMPORTS: list[Import] = [imp for module, path in sorted(MODULES.items()) for imp in _imports(module, path)]


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_floor() -> None:
    assert sorted({_component(m) for m in MODULES} - set(FLOORS)) == []


def test_no_import_reaches_a_higher_or_sibling_floor() -> None:
    wrong = []
    for imp in IMPORTS:
        source, target = _component(imp.source), _component(imp.target)
        if source not in FLOORS or target not in FLOORS:
            continue  # test_every_package_has_a_floor names it
        if source != target and target and FLOORS[target] >= FLOORS[source]:
            wrong.append(
                f"{imp.where}: {imp.source} (floor {FLOORS[source]}) imports {imp.target} (floor {FLOORS[target]})"
            )
    assert wrong == [], "imports against the floors:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        edges[module]
    for imp in IMPORTS:
        if imp.runtime:
            edges[imp.source].add(imp.target)
    report = []
    for component in _cycles(edges):
        members = set(component)
        lines = [
            f"  {imp.where}: {imp.source} -> {imp.target}"
            for imp in IMPORTS
            if imp.runtime and imp.source in members and imp.target in members
        ]
        report.append(" <-> ".join(component) + "\n" + "\n".join(lines))
    assert report == [], "import cycles:\n" + "\n".join(report)


def test_the_checks_see_lazy_imports_and_report_where() -> None:
    """The rules above would pass vacuously if the parser missed imports inside functions."""
    lazy = [imp for imp in IMPORTS if imp.source == "sonar.engine.config" and imp.target == "sonar.offload.config"]
    assert lazy and all(imp.where.startswith("sonar/engine/config.py:") for imp in lazy)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
