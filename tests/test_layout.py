"""The house's layout rules, read from the source with ast (nothing is imported or run).

Packages checked: ``demind/`` (the library) and ``toyworld/`` (the toy world beside it), where
that folder exists.  Imports count wherever they are written: at the top, inside functions and
under ``if __name__ == "__main__":``.

* Only the command-line package ``demind/cli/`` and ``toyworld/cli/`` import ``argparse``
  and read ``sys.argv`` or the environment; and the toy world's research probes
  ``toyworld/lab/`` (``python -m toyworld.lab.NAME`` scripts), which nothing imports.
* Nothing imports ``demind.cli`` except the command line itself and ``__main__.py`` modules:
  those are ``python -m`` entry points that only call a command's ``main`` and that nothing
  imports, so they cannot close a circle.
  A library module does not import it even under a ``__main__`` guard (``demind.features``
  once did, and ``demind.cli.features`` imported it back).
* No module of the command line imports a command module (one that a console script of
  pyproject.toml's ``[project.scripts]`` points to): what several commands share lives in a module
  of its own (``demind.cli.common``, ``demind.cli.model_options``), not in one of the commands.
* ``demind`` never imports ``toyworld``: the toy world depends on the library, not the reverse
  (open_clip learns of its tower through the ``demind.plugins`` entry points).
* No import circle among the modules.
* No import runs back up.  Each module belongs to a *component*: ``demind.X`` for a top-level
  module or subpackage of ``demind`` (``demind.eval.harness`` is in ``demind.eval``), and
  ``toyworld`` for the whole toy package; ``__main__`` modules are left out (entry points).  An
  import from component A to component B runs back up when B, through any chain of imports,
  already imports A: the components form a layered graph without circles, so each can be read,
  tested and replaced with only what lies below it.  Within a package, a module does not import
  names from its own package's ``__init__`` (which imports the module back); it imports the
  submodule that defines them.
* A package's public names are its ``__init__`` face: outside the command line, no module imports
  another package's modules (``demind.eval.harness`` from ``demind.search``); it imports the face
  (``from demind.eval import evaluate``). ``demind/cli/`` wires the commands and may reach inside.
* Image decoding (``Image.open``) lives in one module, :mod:`demind.imaging`.
* A module over ``MAX_LINES`` lines is a prompt to look for a second concept in it, not a number
  to split at: move that concept to a module named for it (where a reader would look for it by
  name); never move code only to get under the line.
* A function of ``demind/`` is at most ``MAX_FUNCTION_LINES`` lines, from its ``def`` line to its
  last line, docstring included (decorators not counted): a longer one is split by step, as
  :func:`demind.training.loop.train` reads (setup, build, resume, steps, export as a short list of calls).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "demind"
TOYWORLD = REPO_ROOT / "toyworld"
MAX_LINES = 450
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    """Every .py file of demind/ and, where it exists, toyworld/."""
    return sorted(p for root in (PACKAGE, TOYWORLD) if root.is_dir() for p in root.rglob("*.py"))


def from_module(node: ast.ImportFrom, this: str, is_package: bool) -> str:
    """The absolute module of ``from <module> import ...`` written in module ``this`` (relative levels resolved)."""
    base = node.module or ""
    if node.level:
        anchor = this.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imported_modules(tree: ast.Module, this: str, is_package: bool) -> set[str]:
    """Absolute names of the modules ``tree`` imports anywhere (``from a import b`` counts a.b if a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_module(node, this, is_package)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


MODULES = {module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in package_files()}


def is_entry_point(name: str) -> bool:
    return name.endswith(".__main__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the checked modules it imports (a package's __init__ counts when its submodule is imported)."""
    graph = {}
    for name, (path, tree) in MODULES.items():
        edges = set()
        for target in imported_modules(tree, name, path.name == "__init__.py"):
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


def component(name: str) -> str:
    """``demind.eval.harness`` -> ``demind.eval``; ``demind.model`` -> itself; any toyworld module -> ``toyworld``."""
    parts = name.split(".")
    return "toyworld" if parts[0] == "toyworld" else ".".join(parts[:2])


def component_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """Component -> component it imports -> the module edges ("a -> b") behind that import."""
    components: dict[str, dict[str, set[str]]] = {}
    for name, targets in graph.items():
        if is_entry_point(name):
            continue
        outgoing = components.setdefault(component(name), {})
        for target in targets:
            if component(target) != component(name) and target != "demind":  # demind/__init__ holds no code
                outgoing.setdefault(component(target), set()).add(f"{name} -> {target}")
    return components


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The module imports that close a circle between components (see the module docstring)."""
    components = component_graph(graph)
    edges = {a: set(targets) for a, targets in components.items()}
    return sorted(edge for a, targets in components.items() for b, behind in targets.items()
                  if a in reachable(edges, b) for edge in behind)


def in_cli(name: str) -> bool:
    return name == "demind.cli" or name.startswith("demind.cli.") or name == "toyworld.cli" or name.startswith("toyworld.cli.")


def in_lab(name: str) -> bool:
    """The toy world's research probes: scripts that parse their own arguments, imported by nothing."""
    return name == "toyworld.lab" or name.startswith("toyworld.lab.")


def test_only_the_command_line_parses_arguments_or_reads_the_environment():
    offences = []
    for name, (_, tree) in MODULES.items():
        if in_cli(name) or in_lab(name):
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
    assert offences == [], "argument or environment reading outside the command line: " + "; ".join(offences)


def test_only_entry_points_import_the_command_line_package():
    graph = import_graph()
    offences = [f"{name} -> {target}" for name, targets in graph.items()
                if not in_cli(name) and not is_entry_point(name) for target in targets if in_cli(target)]
    assert offences == []


def command_modules() -> set[str]:
    """The modules the console scripts of pyproject.toml's ``[project.scripts]`` point to."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    return {target.partition(":")[0] for target in scripts.values()}


def command_imports(graph: dict[str, set[str]], commands: set[str]) -> list[str]:
    """The imports of a command module by another module of the command line ("a -> b")."""
    return sorted(f"{name} -> {target}" for name, targets in graph.items() if in_cli(name)
                  for target in targets if target in commands and target != name)


def test_no_command_module_imports_another_command():
    commands = command_modules()
    assert {"demind.cli.search", "demind.cli.evaluate", "toyworld.cli.quickstart"} <= commands
    offences = command_imports(import_graph(), commands)
    assert offences == [], "move what the commands share into a module of its own: " + "; ".join(offences)


def test_command_imports_on_a_hand_made_graph():
    graph = {"demind.cli.serve": {"demind.cli.search", "demind.cli.common"}, "demind.cli.search": {"demind.cli.common"},
             "demind.cli.common": set(), "demind.eval.__main__": {"demind.cli.evaluate"}}
    # a command importing the shared helpers, or an entry point importing a command, is no offence
    assert command_imports(graph, {"demind.cli.serve", "demind.cli.search", "demind.cli.evaluate"}) == [
        "demind.cli.serve -> demind.cli.search"]


def test_entry_points_only_call_a_command_main():
    # what lets the import rules leave __main__ modules out: they hold no library code
    for name, (path, tree) in MODULES.items():
        if is_entry_point(name):
            imports = {(getattr(n, "module", None), tuple(a.name for a in n.names))
                       for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
            assert {module for module, _ in imports} - {None} and all(
                (module, names) == (None, ("sys",)) or (in_cli(module or "") and names == ("main",))
                for module, names in imports), f"{path} should only import sys and a command's main"


def test_nothing_imports_the_toy_worlds_research_probes():
    # what lets them parse arguments: like the command line, they sit on top of everything
    graph = import_graph()
    offences = [f"{name} -> {target}" for name, targets in graph.items() if not in_lab(name)
                for target in targets if in_lab(target)]
    assert offences == []


def test_the_library_never_imports_the_toy_world():
    offences = [f"{name} imports {target}" for name, (path, tree) in MODULES.items() if name.startswith("demind")
                for target in imported_modules(tree, name, path.name == "__init__.py")
                if target == "toyworld" or target.startswith("toyworld.")]
    assert offences == []


def test_no_import_cycle_among_modules():
    assert find_cycle(import_graph()) is None


def test_no_import_runs_back_up():
    assert upward_imports(import_graph()) == []


def test_no_module_imports_names_from_its_own_package_init():
    offences = []
    for name, (path, tree) in MODULES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = from_module(node, name, path.name == "__init__.py")
            if base in MODULES and base != "demind" and name.startswith(base + "."):
                names = [a.name for a in node.names if f"{base}.{a.name}" not in MODULES]
                if names:
                    offences.append(f"{name}:{node.lineno} imports {names} from {base}")
    assert offences == []


def package_of(name: str) -> str | None:
    """The top-level package of ``demind`` a module belongs to (``demind.eval.harness`` -> ``demind.eval``),
    or None for a top-level module of ``demind`` and for modules outside it."""
    parts = name.split(".")
    if parts[0] != "demind" or len(parts) < 2:
        return None
    package = ".".join(parts[:2])
    return package if MODULES.get(package, (Path(),))[0].name == "__init__.py" else None


def private_imports(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Imports of another package's modules (not its face) from outside the command line."""
    offences = []
    for name, targets in graph.items():
        if in_cli(name) or is_entry_point(name):
            continue
        for target in targets:
            package = ".".join(target.split(".")[:2])
            if package in packages and target != package and not (name == package or name.startswith(package + ".")):
                offences.append(f"{name} -> {target}")
    return sorted(offences)


def test_packages_are_imported_through_their_face():
    packages = {p for p in map(package_of, MODULES) if p is not None}
    assert {"demind.eval", "demind.retrieval", "demind.search"} <= packages
    offences = private_imports(import_graph(), packages)
    assert offences == [], "import the package's face (its __init__) instead: " + "; ".join(offences)


def test_private_imports_on_a_hand_made_graph():
    graph = {"demind.search.index": {"demind.eval.structures", "demind.retrieval", "demind.search.run_manifest"},
             "demind.cli.evaluate": {"demind.eval.harness"}, "demind.eval.__main__": {"demind.cli.evaluate"}}
    assert private_imports(graph, {"demind.eval", "demind.retrieval", "demind.search", "demind.cli"}) == [
        "demind.search.index -> demind.eval.structures"]


def test_image_decoding_lives_in_one_module():
    decoders = set()
    for name, (_, tree) in MODULES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "open" and isinstance(node.value, ast.Name)
                    and node.value.id == "Image"):
                decoders.add(name)
            elif isinstance(node, ast.ImportFrom) and node.module == "PIL.Image" and any(
                    a.name == "open" for a in node.names):
                decoders.add(name)
    assert decoders == {"demind.imaging"}


def test_no_module_is_longer_than_the_limit():
    long = {}
    for path in package_files():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[str(path.relative_to(REPO_ROOT))] = lines
    assert long == {}, (f"over {MAX_LINES} lines, a smell, not a target: look in each for a second concept and "
                        f"move it to a module named for it (never a split by length): {long}")


def long_functions(trees: dict[str, ast.Module], limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``path:line name`` -> length, for every function (methods and nested ones too) longer than ``limit``
    lines, counted from its ``def`` line to its last line."""
    found = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found[f"{path}:{node.lineno} {node.name}"] = length
    return found


def test_no_function_is_longer_than_the_limit():
    library = {str(path.relative_to(REPO_ROOT)): tree for name, (path, tree) in MODULES.items()
               if name.split(".")[0] == "demind"}
    assert library, "no module of demind/ found"
    long = long_functions(library)
    assert long == {}, (f"over {MAX_FUNCTION_LINES} lines (def line to last line, docstring included): split each "
                        f"by step, as demind/training/loop.py:train reads (setup, build, resume, steps, export): {long}")


def test_the_function_length_count_on_a_hand_made_source():
    def function(name: str, lines: int, indent: str = "") -> str:
        """A function of exactly ``lines`` lines: def line, docstring, then one statement a line."""
        return (f"{indent}def {name}():\n{indent}    \"\"\"Doc.\"\"\"\n"
                + "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 2)))

    source = ("import functools\n\n\n@functools.cache\n" + function("long", 61) + "\n\n" + function("fits", 60)
              + "\n\nclass Holder:\n" + function("method", 61, "    ") + "\n" + function("short_method", 60, "    ")
              + "\n\nasync def outer():\n" + function("inner", 61, "    "))
    tree = ast.parse(source)
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert (lengths["long"], lengths["fits"], lengths["method"], lengths["short_method"]) == (61, 60, 61, 60)
    found = {key.split()[1]: length for key, length in long_functions({"hand.py": tree}).items()}
    # the decorator line is not counted; a method, a nested function and the async function holding it are
    assert found == {"long": 61, "method": 61, "inner": 61, "outer": 62}


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_on_hand_made_graphs(graph, cycle):
    assert find_cycle(graph) == cycle


def test_upward_imports_on_a_hand_made_graph():
    graph = {"demind.eval.methods": {"demind.model", "demind.exclmm"}, "demind.exclmm": {"demind.exclmm.train"},
             "demind.exclmm.train": {"demind.eval.structures"}, "demind.eval.structures": set(),
             "demind.model": set(), "demind.eval.__main__": {"demind.cli.evaluate"},
             "demind.cli.evaluate": {"demind.eval.methods"}}
    # eval -> exclmm -> eval is a circle of components (the modules alone have none); the
    # entry point's import of the command line is not
    assert upward_imports(graph) == ["demind.eval.methods -> demind.exclmm",
                                     "demind.exclmm.train -> demind.eval.structures"]
    assert find_cycle(graph) is None


def test_the_import_graph_sees_lazy_relative_and_main_guarded_imports(tmp_path):
    graph = import_graph()
    assert "demind.fidelity" in graph["demind.features.build"]  # imported inside a function only
    assert "demind.search.run_manifest" in graph["demind.cli.serve"]  # imported inside a function
    assert "demind.training.config" in graph["demind.training.loop"]
    assert "demind.cli.common" in graph["demind.cli.train"]
    guarded = ast.parse('if __name__ == "__main__":\n    from demind.cli.features import main\n')
    assert "demind.cli.features" in imported_modules(guarded, "demind.features", True)
