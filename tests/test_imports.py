"""The modules of src/syncbn_lab import one another without a cycle.

The imports are read from the source (ast), every ``import`` statement anywhere in a module,
function-level ones included: a lazy import only hides a cycle until the function runs.
Imports under ``if TYPE_CHECKING:`` never run (annotations only), but a cycle among them is a
knot a reader has to untie all the same: the second graph counts them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "syncbn_lab"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, modules: set[str], type_only: bool = False) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` counts a.b when b is
    a module, else a)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if type_only else _executed_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    # a module also imports each package above it (running their __init__)
    out = set()
    for target in found:
        parts = target.split(".")
        out |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return {m for m in out if m in modules and m != name and not name.startswith(m + ".")}


def _executed_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``type_only``: ``if TYPE_CHECKING:``
    imports counted too)."""
    paths = sorted((SRC / PACKAGE).rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules, type_only) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "syncbn_lab.errors" in graph["syncbn_lab.config"]
    assert "syncbn_lab.parallel.ddp" in graph["syncbn_lab.parallel.modes"]  # a lazy import
    assert "syncbn_lab.shape" not in graph["syncbn_lab.parallel.modes"]  # TYPE_CHECKING only
    assert "syncbn_lab.shape" in import_graph(type_only=True)["syncbn_lab.parallel.modes"]


def test_no_import_cycle_among_the_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_even_among_type_only_imports():
    cycle = find_cycle(import_graph(type_only=True))
    assert cycle is None, "import cycle (type-only imports counted): " + " -> ".join(cycle)


def test_the_run_shape_is_a_leaf():
    assert import_graph(type_only=True)["syncbn_lab.shape"] == set()
