"""The command-line wrapper: a known error is one ``error:`` line and exit status 2; ``--debug``
or ``DEMIND_DEBUG=1`` adds its traceback; a bug keeps its traceback; every command module has
``main(argv) -> int`` and the scripts and ``python -m`` entry points only call it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from demind.cli import common
from demind.cli import train as train_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("train", "features", "evaluate", "generate", "make_shards", "make_tiny_model", "index", "search",
            "serve", "publish", "cc3m_list")
# the command modules outside demind/cli (the toy world's quickstart lives in its own package)
COMMAND_MODULES = {**{c: f"demind.cli.{c}" for c in COMMANDS}, "quickstart": "toyworld.cli.quickstart", "toy_clip": "toyworld.cli.toy_clip"}
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


def test_a_bug_is_not_a_known_error_and_keeps_its_traceback(monkeypatch):
    from demind.cli import negation_report

    def buggy(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(negation_report, "rule_accuracy", buggy)
    with pytest.raises(RuntimeError, match="a bug"):
        negation_report.main([])


def test_a_valueerror_from_a_bug_inside_a_command_keeps_its_traceback(monkeypatch):
    """A bug that raises a builtin ValueError (``x, y = [1, 2, 3]``) is not a user error."""
    from demind.cli import negation_report

    def buggy(*args, **kwargs):
        x, y = [1, 2, 3]

    monkeypatch.setattr(negation_report, "rule_accuracy", buggy)
    with pytest.raises(ValueError, match="too many values to unpack"):
        negation_report.main([])


def test_a_bug_in_a_console_script_prints_its_traceback_and_exits_1():
    code = ("import sys\nfrom demind.cli import negation_report\n"
            "def buggy(*a, **k):\n    x, y = [1, 2, 3]\n"
            "negation_report.rule_accuracy = buggy\nsys.exit(negation_report.main([]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("Traceback") and "ValueError: too many values to unpack" in done.stderr
    assert "error:" not in done.stderr


def test_a_user_error_that_is_also_a_valueerror_is_one_line(tmp_path, capsys):
    """The readers' InputError keeps ValueError as a base for library callers; the CLI still shows one line."""
    from demind.cli import negation_report
    from demind.errors import InputError

    assert issubclass(InputError, ValueError)
    bad = tmp_path / "labels.jsonl"
    bad.write_text('{"query": "a cat"}\n')
    assert negation_report.main(["--phrasings", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"{bad}:1" in err[0]


def test_an_oserror_without_a_file_name_is_a_bug(monkeypatch):
    from demind.cli import negation_report

    def buggy(*args, **kwargs):
        raise OSError("a bug in a socket call")

    monkeypatch.setattr(negation_report, "rule_accuracy", buggy)
    with pytest.raises(OSError, match="a bug"):
        negation_report.main([])


def test_a_missing_file_named_by_the_os_is_one_line(tmp_path, capsys, monkeypatch):
    from demind.cli import negation_report

    def reads_a_missing_file(*args, **kwargs):
        open(tmp_path / "absent.json").close()

    monkeypatch.setattr(negation_report, "rule_accuracy", reads_a_missing_file)
    assert negation_report.main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "absent.json" in err[0]


def test_the_body_gets_parsed_arguments_and_its_status_is_returned(monkeypatch):
    from demind.cli import negation_report

    monkeypatch.setattr(negation_report, "report_command", lambda cfg: cfg.examples + 1)
    assert negation_report.main(["--examples", "4"]) == 5


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
                            "demind-make-shards", "demind-make-tiny-model", "demind-quickstart", "demind-toy-clip", "demind-index", "demind-search",
                            "demind-serve", "demind-build-exclcoco",
                            "demind-train-exclmm", "demind-negation-report", "demind-publish",
                            "demind-cc3m-list", "demind-train-triplets", "demind-mine-pairs",
                            "demind-generate-triplets"}


def test_the_command_line_package_lists_every_console_script():
    """demind/cli/__init__.py's list of commands (``* :mod:`MODULE` -- ``SCRIPT``...``) is pyproject's."""
    import re

    import demind.cli

    listed = dict(re.findall(r"^\* :mod:`([\w.]+)` -- ``(demind-[\w-]+)``", demind.cli.__doc__, re.MULTILINE))
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {script: module for module, script in listed.items()} == {
        name: target.partition(":")[0] for name, target in scripts.items()}


# --------------------------------------------------------------------------- the config front end


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_every_console_script_help_exits_0_and_lists_its_config_keys(name, capsys):
    """Whatever pyproject.toml lists: --help exits 0 and shows --config and every key of the command's config."""
    from demind.config import config_keys

    module_name, _, func = console_scripts()[name].partition(":")
    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as info:
        getattr(module, func)(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--config" in out
    config_class = module.build_parser().get_default("config_class")
    keys = [key for key, _, _ in config_keys(config_class)]
    assert keys and [key for key in keys if f"\n  {key} = " not in out] == []


@pytest.mark.parametrize("command, argv, new_key", [
    ("train", ["run.cpu=true"], "run.device"),
    ("generate", ["--input", "x", "--output", "y", "engine.device=cpu"], "run.device"),
    ("generate", ["--input", "x", "--output", "y", "sampling.seed=1"], "run.seed"),
    ("generate", ["--input", "x", "--output", "y", "--no-progress"], "run.progress"),
    ("evaluate", ["--benchmark", "cirr", "--data-root", "x", "--out", "y", "--quiet"], "run.progress"),
    ("evaluate", ["--benchmark", "cirr", "--data-root", "x", "--out", "y", "--device", "cpu"], "run.device"),
    ("features", ["--device=cpu"], "run.device"),
    ("search", ["--index", "x", "device=cpu"], "run.device"),
    ("index", ["--images", "x", "--index", "y", "precision=fp16"], "backbone.precision"),
])
def test_an_old_spelling_is_one_error_line_naming_the_new_key(command, argv, new_key, capsys):
    module = importlib.import_module(f"demind.cli.{command}")
    assert module.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and new_key in lines[0]


def test_an_old_key_in_a_config_file_names_the_new_key(tmp_path, capsys):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("run:\n  cpu: true\n")
    assert train_cli.main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "run.cpu" in err and "run.device" in err and str(recipe) in err


def test_flags_are_overrides_and_later_overrides_win():
    from demind.cli import evaluate

    args = evaluate.build_parser().parse_intermixed_args(
        ["--benchmark", "coco", "--data-root", "d", "--out", "o", "--fashioniq-text", "captions",
         "coco.prompt=prose", "--batch-size", "8", "batch_size=16", "run.device=cpu"])
    cfg = common.load_command_config(evaluate.EvalConfig, args)
    assert (cfg.benchmark, cfg.data_root, cfg.out) == ("coco", "d", "o")
    assert (cfg.fashioniq.text, cfg.coco.prompt, cfg.batch_size, cfg.run.device) == ("captions", "prose", 16, "cpu")


def test_a_flag_value_is_taken_as_written():
    """A flag's text is not read as YAML: '# blue' is not a comment, 'no' is not false."""
    from demind.cli import search

    args = search.build_parser().parse_intermixed_args(["--index", "i", "--text", "red # blue", "--negative", "no",
                                                         "-k", "5", "--keep-reference"])
    cfg = common.load_command_config(search.SearchConfig, args)
    assert (cfg.text, cfg.negative, cfg.k, cfg.keep_reference) == ("red # blue", "no", 5, True)


def test_a_missing_required_setting_names_its_flag_and_key(capsys):
    from demind.cli import evaluate

    assert evaluate.main(["--benchmark", "cirr", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert "data_root" in err and "--data-root" in err


@pytest.mark.parametrize("device, ok", [("auto", True), ("cpu", True), ("cuda", True), ("cuda:1", True),
                                        ("gpu", False), ("cuda:", False), ("cpu:0", False)])
def test_run_device_spelling(device, ok):
    from demind.cli.search import SearchConfig
    from demind.config import ConfigError, load_config

    overrides = ["index=i", f"run.device={device}"]
    if ok:
        assert load_config(SearchConfig, None, overrides).run.device == device
    else:
        with pytest.raises(ConfigError, match="run.device.*auto, cpu, cuda or cuda:N"):
            load_config(SearchConfig, None, overrides)


def test_a_flag_with_an_optional_value_leaves_an_override_alone():
    from demind.cli import serve

    args = serve.build_parser().parse_intermixed_args(["--quickstart", "run.device=cpu"])
    cfg = common.load_command_config(serve.ServeConfig, args)
    assert (cfg.quickstart, cfg.run.device) == ("runs/quickstart", "cpu")
