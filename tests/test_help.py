"""``--help`` of every console script helps and is fast: no torch, each flag says what it does.

Each script's ``--help`` runs in a fresh interpreter (``python -X importtime`` style: the modules it
loaded are read back from ``sys.modules``); a command that imported torch to print text took 4-13 s
on a loaded 2-core machine. Each flag's help line carries its config key's description, the key
and its default, not ``= key``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
HEAVY = ("torch", "open_clip", "transformers", "timm", "torchvision")

PROBE = """
import contextlib, io, json, sys, time
start = time.process_time()
module, function = sys.argv[1].split(":")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        getattr(__import__(module, fromlist=[function]), function)(["--help"])
    except SystemExit as e:
        code = e.code
    else:
        code = "returned"
print(json.dumps({"code": code, "cpu_s": time.process_time() - start, "text": out.getvalue(),
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    """script name -> what its ``--help`` did in a fresh interpreter (one process per script)."""
    out = {}
    for name, target in SCRIPTS.items():
        done = subprocess.run([sys.executable, "-c", PROBE, target], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_every_console_script_is_probed():
    assert len(SCRIPTS) >= 15 and "demind-eval" in SCRIPTS and "demind-quickstart" in SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_imports_no_torch_and_is_fast(helps, name):
    result = helps[name]
    assert result["code"] in (0, None), f"{name} --help exited with {result['code']}"
    assert "usage:" in result["text"]
    assert result["heavy"] == [], f"{name} --help imported {result['heavy']} to print text"
    # 4.1 s of CPU when it imported torch; parsing the config classes takes a few hundredths
    assert result["cpu_s"] < 1.0, f"{name} --help took {result['cpu_s']:.2f} s of CPU"


def _parser(target: str):
    module = importlib.import_module(target.split(":")[0])
    return module.build_parser() if hasattr(module, "build_parser") else None


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_flag_says_what_it_does_with_its_key(name):
    parser = _parser(SCRIPTS[name])
    if parser is None:
        pytest.skip(f"{name} builds its parser inside main()")
    flagged = [a for a in parser._actions if a.dest.startswith("flag:")]
    for action in flagged:
        key = action.dest.split(":", 1)[1]
        text = action.help or ""
        assert f"[{key}, default " in text, f"{name} {action.option_strings}: {text!r}"
        description = text.split(f"[{key},")[0].strip()
        assert len(description) >= 8, f"{name} {action.option_strings[0]} has no description: {text!r}"
    others = [a for a in parser._actions if not a.dest.startswith("flag:") and a.option_strings]
    for action in others:
        assert action.help and not action.help.startswith("="), f"{name} {action.option_strings}"


def test_help_lists_every_config_key_with_its_text():
    from demind.cli.common import config_keys_help
    from demind.config import config_keys
    from demind.training.config import TrainConfig

    text = config_keys_help(TrainConfig, columns=100)
    assert all(len(line) <= 100 for line in text.splitlines())
    for key, _, help_text in config_keys(TrainConfig):
        assert f"  {key} = " in text
        if help_text:
            assert help_text.split()[0] in text


def test_torch_free_homes_agree_with_the_modules_that_use_them():
    """The names --help reads without torch are the ones the model code uses (no second list)."""
    from demind import backbone, retrieval
    from demind.retrieval import methods
    from demind.schema import PRECISION_NAMES

    assert tuple(backbone.PRECISIONS) == PRECISION_NAMES
    assert methods.METHODS is retrieval.METHODS and set(methods.METHOD_LABELS) == set(retrieval.METHODS)
