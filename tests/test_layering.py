"""The package's import graph, read from the source with ``ast``: no circle between its packages, none between its
files (modules), and the configuration at the bottom (``dfpo_trl/__init__.py``'s docstring declares the layers).

A "package" here is a top-level subpackage of ``dfpo_trl`` (``objectives``, ``config``, ...) or a top-level module
(``trainer``, ``precision``, ...); ``dfpo_trl/__init__.py`` itself is left out (it names the public names of every
layer). Every ``import``/``from ... import`` counts, also one inside a function: a lazy import still ties the two
packages together, it only moves the moment it runs. The exception is an import under ``if TYPE_CHECKING:``, which
never runs and only names a type for the type checker.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dfpo_trl"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes: list[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes``, at any depth, except those under ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)  # the else branch runs
        else:
            yield from _imports(list(ast.iter_child_nodes(node)))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement reads (``from . import x`` reads ``pkg.x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def package_of(dotted: str, root: Path = PACKAGE) -> str | None:
    """The top-level subpackage or module of ``root`` (``dfpo_trl``) a dotted name lies in (None: outside, or the
    root itself)."""
    parts = dotted.split(".")
    if parts[0] != root.name or len(parts) < 2:
        return None
    name = parts[1]
    if (root / name).is_dir() or (root / f"{name}.py").is_file():
        return name
    return None  # ``from dfpo_trl import __version__``: a name of the root itself, no package


def package_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (lazy imports included, TYPE_CHECKING ones not)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        source = package_of(module, root)
        if source is None:
            continue
        edges = graph.setdefault(source, set())
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree.body):
            for target in _targets(node, module, path.name == "__init__.py"):
                other = package_of(target, root)
                if other is not None and other != source:
                    edges.add(other)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def simple_cycles(graph: dict[str, set[str]]) -> int:
    """How many elementary circles the package graph holds (each counted once, from its smallest package)."""
    count = 0
    nodes = sorted(graph)

    def walk(start: str, node: str, seen: set[str]) -> None:
        nonlocal count
        for other in graph.get(node, ()):
            if other == start:
                count += 1
            elif other > start and other not in seen:
                walk(start, other, seen | {other})

    for start in nodes:
        walk(start, start, {start})
    return count


def _module_of(dotted: str, modules: set[str]) -> str | None:
    """The module of ``modules`` a dotted import target names: itself, or the module a name is taken from
    (``pkg.mod.name`` -> ``pkg.mod``); None when it is outside them."""
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module (file) -> the other modules of ``root`` it imports, lazy imports included, TYPE_CHECKING ones not.
    A package's ``__init__`` counts as the module of the package's name, and ``dfpo_trl/__init__.py`` is left out, as
    in :func:`package_graph`; importing ``pkg.mod`` also runs ``pkg/__init__``, but that edge is the package's, not a
    file's, so only the named module counts."""
    paths = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(paths) - {root.name}
    graph: dict[str, set[str]] = {}
    for module in sorted(modules):
        path = paths[module]
        edges = graph.setdefault(module, set())
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree.body):
            targets = _targets(node, module, path.name == "__init__.py")
            named = targets[1:] if isinstance(node, ast.ImportFrom) else targets
            for target in named:
                other = _module_of(target, modules)
                if other is None and isinstance(node, ast.ImportFrom):
                    other = _module_of(targets[0], modules)  # ``from .mod import name``: the module ``mod``
                if other is not None and other != module:
                    edges.add(other)
    return graph


def test_the_checker_sees_a_circle_and_a_lazy_import(tmp_path: Path) -> None:
    """The checker itself: a lazy import makes a circle, one under TYPE_CHECKING does not."""
    root = tmp_path / "dfpo_trl"
    (root / "a").mkdir(parents=True)
    (root / "a" / "__init__.py").write_text("from ..b import x\n")
    (root / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import y\n"
        "def f():\n    from .a import z\n"
    )
    (root / "c.py").write_text("import dfpo_trl.a.inner\n")
    graph = package_graph(root)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert circles(graph) == [["a", "b"]]
    assert simple_cycles(graph) == 1


def test_no_circle_between_packages() -> None:
    found = circles(package_graph())
    assert not found, f"package-level import circles ({simple_cycles(package_graph())} elementary): {found}"


def test_the_file_checker_sees_a_lazy_circle_inside_one_package(tmp_path: Path) -> None:
    """The file-level checker: two modules of one package importing each other (one lazily) are a circle that the
    package-level check cannot see; ``from . import mod`` names the module, a package's own ``__init__`` is not
    imported by its module's relative imports."""
    root = tmp_path / "dfpo_trl"
    (root / "cli").mkdir(parents=True)
    (root / "cli" / "__init__.py").write_text("")
    (root / "cli" / "fields.py").write_text("from .parser import make_parser\nfrom . import values\n")
    (root / "cli" / "parser.py").write_text("def f():\n    from .fields import build\n")
    (root / "cli" / "values.py").write_text("import json\n")
    graph = module_graph(root)
    assert graph == {
        "dfpo_trl.cli": set(),
        "dfpo_trl.cli.fields": {"dfpo_trl.cli.parser", "dfpo_trl.cli.values"},
        "dfpo_trl.cli.parser": {"dfpo_trl.cli.fields"},
        "dfpo_trl.cli.values": set(),
    }
    assert circles(graph) == [["dfpo_trl.cli.fields", "dfpo_trl.cli.parser"]]
    assert package_graph(root) == {"cli": set()}  # invisible at package level


def test_no_circle_between_files() -> None:
    """No two modules import each other, even through others or lazily (an import inside a function)."""
    graph = module_graph()
    found = circles(graph)
    assert not found, f"file-level import circles ({simple_cycles(graph)} elementary): {found}"


#: The bottom of the graph, lowest first: each imports only the ones before it. The transform registry sits below the
#: config because the config checks ``group_transform`` against it (and lists the built-ins in the field's help).
BOTTOM = ("precision", "transforms", "config")


def test_config_is_at_the_bottom() -> None:
    """The configuration imports no package above it: the math packages read its options and rules, never the
    reverse; below it only the transform registry and the compute dtype, which import nothing else."""
    graph = package_graph()
    for i, name in enumerate(BOTTOM):
        assert graph[name] <= set(BOTTOM[:i]), f"{name} imports {sorted(graph[name] - set(BOTTOM[:i]))}"


#: The program: the ``dfpo-train`` CLI with its tasks (``cli``) and ``python -m dfpo_trl`` (``__main__``). Everything
#: else in the package is the library.
PROGRAM = ("cli", "__main__")


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for other in graph.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_the_library_imports_nothing_from_the_program() -> None:
    """The library (trainer, config, objectives, transforms, groups, delta, metrics, trl_hooks, rewards, testing)
    imports nothing from ``dfpo_trl.cli`` or ``__main__``, even lazily or through another package; the program sits
    on top of it."""
    graph = package_graph()
    assert set(PROGRAM) <= set(graph), sorted(graph)
    for package in sorted(set(graph) - set(PROGRAM)):
        reached = _reaches(graph, package) & set(PROGRAM)
        assert not reached, f"library package {package!r} imports the program's {sorted(reached)}"


def test_the_library_check_sees_a_lazy_import_of_the_program(tmp_path: Path) -> None:
    root = tmp_path / "dfpo_trl"
    (root / "cli").mkdir(parents=True)
    (root / "cli" / "__init__.py").write_text("from ..metrics import m\n")
    (root / "metrics.py").write_text("def f():\n    from .helper import h\n")
    (root / "helper.py").write_text("def g():\n    from .cli import tasks\n")
    graph = package_graph(root)
    assert "cli" in _reaches(graph, "metrics")
