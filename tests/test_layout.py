"""The house's layout rules, read from the source with ast (nothing is imported or run):

* only the command-line package ``demind/cli/`` parses arguments or reads the environment;
* the library never imports ``demind.cli`` (only ``python -m`` shims do, under ``__main__``);
* no import cycle among ``demind`` modules, counting imports inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "demind"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def library_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of the module except those under an ``if __name__ == "__main__":`` block."""
    nodes = []
    for top in tree.body:
        if not is_main_guard(top):
            nodes.extend(ast.walk(top))
    return nodes


def imported_modules(nodes: list[ast.AST], this: str, is_package: bool) -> set[str]:
    """Absolute names of the modules ``nodes`` import (``from a import b`` counts a.b when that is a module)."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = this.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def demind_modules() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = demind_modules()


def import_graph() -> dict[str, set[str]]:
    """Module -> the demind modules it imports (a package's __init__ counts when its submodule is imported)."""
    graph = {}
    for name, (path, tree) in MODULES.items():
        imported = imported_modules(library_nodes(tree), name, path.name == "__init__.py")
        edges = set()
        for target in imported:
            parts = target.split(".")
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in MODULES and prefix != name and not name.startswith(prefix + "."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def in_cli(name: str) -> bool:
    return name == "demind.cli" or name.startswith("demind.cli.")


def test_only_the_command_line_package_parses_arguments_or_reads_the_environment():
    offences = []
    for name, (_, tree) in MODULES.items():
        if in_cli(name):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                offences.append(f"{name}:{node.lineno} imports argparse")
            elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
                offences.append(f"{name}:{node.lineno} imports from argparse")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in {("sys", "argv"), ("os", "environ"), ("os", "getenv")}:
                    offences.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("os", "sys"):
                bad = [a.name for a in node.names if a.name in ("environ", "getenv", "argv")]
                if bad:
                    offences.append(f"{name}:{node.lineno} imports {bad} from {node.module}")
    assert offences == [], "argument or environment reading outside demind/cli: " + "; ".join(offences)


def test_the_library_never_imports_the_command_line_package():
    graph = import_graph()
    offences = [f"{name} -> {target}" for name, targets in graph.items() if not in_cli(name)
                and not name.endswith(".__main__") for target in targets if in_cli(target)]
    assert offences == []


def test_no_import_cycle_among_demind_modules():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_on_hand_made_graphs(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "demind.search.manifest" in graph["demind.cli.serve"]  # imported inside a function
    assert "demind.training.config" in graph["demind.training.loop"]
    assert "demind.cli.common" in graph["demind.cli.train"]
