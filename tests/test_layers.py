"""The package's layers, read from its source with `ast` (nothing imported): no import runs in a circle, and the
library never imports the command line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "cdc"
LIBRARY = ("source", "mapping", "sink", "bridge", "consume", "reconcile", "ops")


def _module_name(path: Path, root: Path) -> str:
    parts = ["cdc", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The line numbers of imports under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines.update(n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno"))
    return lines


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at its top or inside a function (both run)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        skip = _type_checking_only(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            if node.lineno not in skip:
                targets.update(n for n in names if n in paths and n != module)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others():
    assert cycles(import_graph()) == []


def test_the_library_never_imports_the_command_line():
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                    if m.split(".")[1] in LIBRARY and (t == "cdc.cli" or t.startswith("cdc.cli.")))
    assert upward == []


def test_the_check_finds_a_cycle_and_an_upward_import(tmp_path):
    root = tmp_path / "cdc"
    for name, text in {"__init__.py": "", "cli/__init__.py": "", "cli/main.py": "",
                       "bridge/__init__.py": "", "bridge/a.py": "from . import b\n",
                       "bridge/b.py": "def f():\n    from .a import x\n    from ..cli.main import y\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert cycles(graph) == [["cdc.bridge.a", "cdc.bridge.b"]]
    assert "cdc.cli.main" in graph["cdc.bridge.b"]


def test_a_session_knows_the_bridge_running_it_only_through_session_host():
    """Not even for annotations: what a session needs of its bridge is named by `SessionHost` (cdc/bridge/session.py)."""
    tree = ast.parse((ROOT / "bridge" / "session.py").read_text())
    named = {part for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for part in [*(node.module or "").split("."), *(alias.name for alias in node.names)]}
    assert "loop" not in named and "Bridge" not in named
