"""The lazy package faces (:mod:`demind.lazy`) say the same thing three times: the ``if TYPE_CHECKING:``
imports static tools follow (go-to-definition from ``from demind.training import train``), the table
resolved at run time, and ``__all__``. These tests keep the three equal and point each name at the
module that defines it. (Why each face is lazy: a command's ``--help`` reads a torch-free module of
its package, see tests/test_help.py.)

Read from the source (no package is imported), so the checks cost no torch.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = sorted(path for path in (ROOT / "demind").rglob("__init__.py") if "lazy_exports(" in path.read_text())


def package_of(path: Path) -> str:
    return ".".join(path.parent.relative_to(ROOT).parts)


def lazy_table(tree: ast.Module) -> dict[str, set[str]]:
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "lazy_exports")
    return {module: set(names) for module, names in ast.literal_eval(call.args[1]).items()}


def type_checking_imports(tree: ast.Module) -> dict[str, set[str]]:
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    out: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 0, ast.unparse(node)
        assert all(alias.asname is None for alias in node.names), ast.unparse(node)
        out.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return out


def dunder_all(tree: ast.Module) -> list[str]:
    node = next(node for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(target, "id", "") == "__all__" for target in node.targets))
    return list(ast.literal_eval(node.value))


def defined_names(module: str) -> set[str]:
    """Names a module's own top-level code binds (def, class, assignment), not the ones it imports."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_the_lazy_faces_are_found():
    assert {package_of(path) for path in FACES} >= {"demind.training", "demind.eval", "demind.retrieval"}


@pytest.mark.parametrize("face", FACES, ids=package_of)
def test_type_checking_imports_equal_the_lazy_table_and_all(face):
    tree = ast.parse(face.read_text(encoding="utf-8"))
    table = lazy_table(tree)
    assert type_checking_imports(tree) == table, "the TYPE_CHECKING imports drifted from the lazy table"
    names = dunder_all(tree)
    assert len(names) == len(set(names)), f"__all__ repeats {sorted(n for n in names if names.count(n) > 1)}"
    assert set(names) == set().union(*table.values()), "__all__ drifted from the lazy table"


@pytest.mark.parametrize("face", FACES, ids=package_of)
def test_each_lazy_name_comes_from_the_module_that_defines_it(face):
    table = lazy_table(ast.parse(face.read_text(encoding="utf-8")))
    wrong = {(module, name) for module, names in table.items() for name in names if name not in defined_names(module)}
    assert not wrong, f"names the face takes from a module that only imports them (name its home): {sorted(wrong)}"

