"""The command-line wrapper: a known error is one ``error:`` line and exit status 2; ``--debug``
or ``DEMIND_DEBUG=1`` adds its traceback; a bug keeps its traceback; every command module has
``main(argv) -> int`` and the scripts and ``python -m`` entry points only call it."""

from __future__ import annotations

import argparse
import ast
import importlib
import tomllib
from pathlib import Path

import pytest

from demind.cli import common
from demind.cli import train as train_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("train", "features", "evaluate", "generate", "make_shards", "make_tiny_model", "index", "search",
            "serve")
# the command modules outside demind/cli (the toy world's quickstart lives in its own package)
COMMAND_MODULES = {**{c: f"demind.cli.{c}" for c in COMMANDS}, "quickstart": "toyworld.cli"}
SHIMS = {"train.py": "train", "data_gen/run.py": "generate", "data_gen/make_shards.py": "make_shards",
         "data_gen/make_tiny_model.py": "make_tiny_model", "pipelines/quickstart.py": "quickstart",
         "demind/eval/__main__.py": "evaluate"}


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv(common.DEBUG_ENV, raising=False)


def test_a_known_error_is_one_line_and_exit_status_2(capsys):
    assert train_cli.main(["optim.lrr=1"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "optim.lrr" in lines[0]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_then_the_same_line(capsys, monkeypatch, how):
    argv = ["optim.lrr=1"]
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv(common.DEBUG_ENV, "1")
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ConfigError" in err
    assert err.splitlines()[-1].startswith("error: ") and "optim.lrr" in err.splitlines()[-1]


def test_a_bug_is_not_a_known_error_and_keeps_its_traceback():
    def body(args):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        common.run_command(argparse.ArgumentParser(), body, [])


def test_the_body_gets_parsed_arguments_and_its_status_is_returned():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int)
    assert common.run_command(parser, lambda args: args.n + 1, ["--n", "4"]) == 5


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_every_command_has_a_main_and_help(command, capsys):
    module = importlib.import_module(COMMAND_MODULES[command])
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0 and "--debug" in capsys.readouterr().out


@pytest.mark.parametrize("path, command", sorted(SHIMS.items()))
def test_scripts_only_call_the_command(path, command):
    tree = ast.parse((REPO_ROOT / path).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert {(getattr(n, "module", None), tuple(a.name for a in n.names)) for n in imports} == {
        (None, ("sys",)), (COMMAND_MODULES[command], ("main",))}
    assert "argv" not in (REPO_ROOT / path).read_text()


def test_console_scripts_point_at_the_command_mains():
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        assert name.startswith("demind-") and func == "main"
        assert callable(getattr(importlib.import_module(module), func))
    assert set(scripts) == {"demind-train", "demind-features", "demind-eval", "demind-generate",
                            "demind-make-shards", "demind-quickstart", "demind-index", "demind-search",
                            "demind-serve", "demind-build-exclcoco",
                            "demind-train-exclmm", "demind-negation-report"}
