"""The suite runs where widely installed pytest plugins are: no test argument of ours takes a plugin's
fixture name.

A ``@pytest.mark.parametrize`` argument or a fixture of our own named like a plugin's fixture shadows
it; with the plugin installed its hooks still act on the name. ``pytest-benchmark`` (installed on the
GPU machine) ended the whole run with INTERNALERROR at the first test that parametrized
``benchmark``. The plugins are not dependencies of the suite, so the check reads the test files
(AST) for the names below instead of running them with each plugin.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PLUGIN_FIXTURES = {
    "benchmark": "pytest-benchmark", "benchmark_weave": "pytest-benchmark",
    "mocker": "pytest-mock", "class_mocker": "pytest-mock", "module_mocker": "pytest-mock",
    "session_mocker": "pytest-mock",
    "cov": "pytest-cov", "no_cover": "pytest-cov",
    "event_loop": "pytest-asyncio", "event_loop_policy": "pytest-asyncio",
    "httpserver": "pytest-httpserver", "httpx_mock": "pytest-httpx", "requests_mock": "requests-mock",
    "freezer": "pytest-freezer", "time_machine": "time-machine",
    "snapshot": "syrupy", "datadir": "pytest-datadir", "shared_datadir": "pytest-datadir",
    "faker": "Faker", "xprocess": "pytest-xprocess", "worker_id": "pytest-xdist",
    "testrun_uid": "pytest-xdist", "subtests": "pytest-subtests", "aiohttp_client": "pytest-aiohttp",
}
"""Fixture names that widely installed, general-purpose plugins define -> the plugin (framework plugins
such as pytest-django's ``client`` are left out: they come with their framework, not with a Python)."""


def _strings(node: ast.AST) -> list[str]:
    """The argument names of a parametrize call's first argument: "a, b", ["a", "b"] or ("a", "b")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [n.strip() for n in node.value.split(",") if n.strip()]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [n for element in node.elts for n in _strings(element)]
    return []


def _is_fixture(decorator: ast.AST) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "fixture" or \
        isinstance(target, ast.Name) and target.id == "fixture"


def argument_names(source: str) -> list[tuple[int, str, str]]:
    """(line, name, what) of each name a test module introduces: parametrize arguments (decorators and
    ``metafunc.parametrize`` calls) and fixtures it defines (``@pytest.fixture``, or its ``name=``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parametrize":
            names = _strings(node.args[0]) if node.args else []
            names += [n for kw in node.keywords if kw.arg == "argnames" for n in _strings(kw.value)]
            found += [(node.lineno, n, "parametrized argument") for n in names]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if not _is_fixture(decorator):
                    continue
                given = [kw.value.value for kw in getattr(decorator, "keywords", [])
                         if kw.arg == "name" and isinstance(kw.value, ast.Constant)]
                found.append((node.lineno, given[0] if given else node.name, "fixture"))
    return found


def collisions(source: str) -> list[str]:
    return [f"line {line}: {what} {name!r} is {PLUGIN_FIXTURES[name]}'s fixture"
            for line, name, what in sorted(argument_names(source)) if name in PLUGIN_FIXTURES]


def test_the_check_finds_each_form_of_collision():
    source = '''
import pytest

@pytest.mark.parametrize("benchmark", ["cirr"])
def test_a(benchmark): ...

@pytest.mark.parametrize("x, mocker", [(1, 2)])
def test_b(x, mocker): ...

@pytest.mark.parametrize(argnames=("event_loop",), argvalues=[1])
def test_c(event_loop): ...

@pytest.fixture
def snapshot(): ...

@pytest.fixture(name="faker")
def my_faker(): ...

def pytest_generate_tests(metafunc):
    metafunc.parametrize("cov", [1])

@pytest.mark.parametrize("bench_name", ["cirr"])
def test_fine(bench_name, tmp_path): ...
'''
    found = collisions(source)
    assert [f.split(":")[0] for f in found] == ["line 4", "line 7", "line 10", "line 14", "line 17", "line 20"]
    assert "'benchmark' is pytest-benchmark's fixture" in found[0]


def test_no_test_argument_or_fixture_of_ours_takes_a_plugin_fixture_name():
    problems = [f"{path.relative_to(TESTS.parent)} {problem}" for path in sorted(TESTS.rglob("*.py"))
                for problem in collisions(path.read_text(encoding="utf-8"))]
    assert not problems, "rename these (a plugin's hooks act on its fixture names):\n" + "\n".join(problems)
