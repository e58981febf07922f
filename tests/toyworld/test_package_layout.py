"""The toy world is a package beside demind that depends on it, never the reverse: demind never
imports toyworld, toyworld has no import cycle, only its command module parses arguments, and no
module is over 450 lines (read from the source with ast; nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules(package: str) -> dict[str, ast.Module]:
    root = REPO / package
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def imports(name: str, tree: ast.Module, is_package: bool) -> set[str]:
    """Absolute names of everything ``tree`` imports, inside functions too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_demind_never_imports_the_toy_world():
    offences = [f"{name} -> {target}" for name, tree in modules("demind").items()
                for target in imports(name, tree, False) if target == "toyworld" or target.startswith("toyworld.")]
    assert offences == []


def test_no_import_cycle_inside_the_toy_world():
    mods = modules("toyworld")
    graph = {name: {t for t in imports(name, tree, name == "toyworld") if t in mods and t != name}
             for name, tree in mods.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [node])):
                return cycle
        state[node] = 2
        return None

    cycles = [c for name in sorted(graph) if name not in state and (c := visit(name, []))]
    assert cycles == []


def test_only_the_command_module_parses_arguments():
    # toyworld.lab: the research probes, scripts run with python -m (tests/test_layout.py: nothing imports them)
    offences = [name for name, tree in modules("toyworld").items()
                if not name.startswith(("toyworld.cli", "toyworld.lab"))
                and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "argparse" in imports(name, n, False)
                        for n in ast.walk(tree))]
    assert offences == []


def test_no_toy_module_is_over_450_lines():
    long = {p.name: n for p in (REPO / "toyworld").rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}
