"""Every key of every console script is checked when the command checks its config, or named free.

The one place a command's whole config is checked is :func:`demind.config.load_config` (types,
declared rules, each section's ``config_problems()``) followed by
:func:`demind.config_checks.check_command_config` (declared outputs writable, ``output_problems()``),
both run by :func:`demind.cli.common.run_config_command` before the command's body. This test
walks each script's config class (``build_parser()``'s ``config_class``) and, for each leaf key:

* a declared rule (range, choices, pattern): a value it breaks is refused, naming the key;
* ``setting(output=...)``: a folder under a regular file is refused, naming the key;
* ``setting(input=...)``: a path that does not exist is refused, naming the key;
* ``setting(refuses=VALUE)``: that value is refused by the section's cross-field check, naming the key;
* a bool: its type is its whole check;
* ``setting(free="why")``: named free, with the reason.

Anything else is an unchecked key, unless it is in :data:`PENDING` (keys of modules whose owners
have not yet declared their check); a pending key that has become covered must leave the list.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from demind.config import ConfigError, _field_types, _strip_optional, load_config
from demind.settings import Rule

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]

# Keys not yet covered by a declared check nor named free, by script. Each belongs to a module outside
# the config-check mechanism's own files (the file that declares the key is named): declare its rule,
# output=, refuses= or free= there, then remove the key here.
PENDING: dict[str, set[str]] = {}


def config_class(script: str) -> type:
    module = importlib.import_module(SCRIPTS[script].split(":")[0])
    return module.build_parser().get_default("config_class")


def leaves(cls: type, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, type without Optional, field) of every leaf of ``cls``."""
    rows = []
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _strip_optional(types_[f.name])
        if dataclasses.is_dataclass(tp):
            rows += leaves(tp, prefix + f.name + ".")
        else:
            rows.append((prefix + f.name, tp, f))
    return rows


def coverage(tp: Any, f: dataclasses.Field) -> str:
    """How a key is checked: rule, output, refuses, type (a bool), free, or '' (not at all)."""
    rule = f.metadata.get("rule")
    if rule is not None and rule != Rule():
        return "rule"
    if f.metadata.get("output"):
        return "output"
    if f.metadata.get("input"):
        return "input"
    if "refuses" in f.metadata:
        return "refuses"
    if tp is bool:
        return "type"
    if f.metadata.get("free"):
        return "free"
    return ""


def breaking_value(tp: Any, rule: Rule) -> Any:
    """A value of the field's type that ``rule`` refuses."""
    item = typing.get_args(tp)[0] if typing.get_origin(tp) in (list, tuple) else tp
    if rule.choices is not None:
        numbers = [c for c in rule.choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
        value: Any = max(numbers) + 1 if item in (int, float) and numbers else "no-such-choice"
    elif rule.pattern is not None:
        value = "!! not a valid value !!"
    elif rule.ge is not None:
        value = rule.ge - 1
    elif rule.gt is not None:
        value = rule.gt
    elif rule.le is not None:
        value = rule.le + 1
    else:
        value = rule.lt
    if item is int and isinstance(value, float):
        value = math.floor(value) if rule.ge is not None or rule.gt is not None else math.ceil(value)
    assert not rule.allows(value), (rule, value)
    return [value] if item is not tp else value


def set_dotted(cfg: Any, key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for name in sections:
        cfg = getattr(cfg, name)
    setattr(cfg, last, value)


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    return {script: config_class(script) for script in SCRIPTS}


def test_every_console_script_has_a_config_class(classes):
    assert len(classes) == len(SCRIPTS) >= 15
    assert all(dataclasses.is_dataclass(cls) for cls in classes.values())


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_key_is_checked_or_named_free(classes, script):
    rows = leaves(classes[script])
    unchecked = {key for key, tp, f in rows if not coverage(tp, f)}
    pending = PENDING.get(script, set())
    assert unchecked - pending == set(), (
        f"{script}: keys with no check: declare a rule, output=, refuses= or free= (demind.settings.setting)")
    assert pending - unchecked == set(), f"{script}: covered or gone now: remove them from PENDING"
    for key, tp, f in rows:
        if coverage(tp, f) == "free":
            assert isinstance(f.metadata["free"], str) and len(f.metadata["free"]) > 8, f"{script}: {key}: say why"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_declared_rule_refuses_a_value_that_breaks_it(classes, script):
    cls = classes[script]
    for key, tp, f in leaves(cls):
        if coverage(tp, f) != "rule":
            continue
        bad = breaking_value(tp, f.metadata["rule"])
        with pytest.raises(ConfigError) as caught:
            load_config(cls, None, [(key, bad)])
        assert repr(key) in str(caught.value), f"{script}: {key}={bad!r}: {caught.value}"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_cross_field_check_refuses_its_example(classes, script, tmp_path, monkeypatch):
    """Refused when the config loads (``config_problems``) or, for a file the key names, when the command
    checks it (``input_problems``), before any model loads."""
    from demind.config import config_problems
    from demind.config_checks import raise_section_problems

    monkeypatch.chdir(tmp_path)
    cls = classes[script]
    for key, tp, f in leaves(cls):
        if coverage(tp, f) != "refuses":
            continue
        cfg = cls()  # defaults: a required key left unset is its own problem, not this one
        set_dotted(cfg, key, f.metadata["refuses"])
        said = [message for _, message in config_problems(cfg)]
        try:
            raise_section_problems(cfg, "input_problems")
        except ConfigError as e:
            said.append(str(e))
        assert any(repr(key) in message for message in said), f"{script}: {key}={f.metadata['refuses']!r}: {said}"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_declared_output_is_refused_where_nothing_can_be_written(classes, script, tmp_path, monkeypatch):
    from demind.config_checks import check_command_config

    monkeypatch.chdir(tmp_path)  # the other outputs' defaults (relative folders) are probed here
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    cls = classes[script]
    for key, tp, f in leaves(cls):
        if coverage(tp, f) != "output" or key in getattr(cls, "UNUSED_OUTPUTS", ()):
            continue
        cfg = cls()
        set_dotted(cfg, key, str(a_file / "out"))
        with pytest.raises(ConfigError) as caught:
            check_command_config(cfg)
        assert repr(key) in str(caught.value) and str(a_file) in str(caught.value), f"{script}: {key}: {caught.value}"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_declared_input_is_refused_where_it_does_not_exist(classes, script, tmp_path, monkeypatch):
    from demind.config_checks import check_inputs

    monkeypatch.chdir(tmp_path)
    cls = classes[script]
    for key, tp, f in leaves(cls):
        if coverage(tp, f) != "input":
            continue
        cfg = cls()
        missing = str(tmp_path / "no-such" / "input")
        set_dotted(cfg, key, [missing] if typing.get_origin(tp) is list else missing)
        with pytest.raises(ConfigError) as caught:
            check_inputs(cfg)
        assert repr(key) in str(caught.value) and missing in str(caught.value), f"{script}: {key}: {caught.value}"


# ---------------------------------------------------------------- outputs, as the commands see them


def test_an_output_folder_that_cannot_be_created_is_one_line_naming_its_key(tmp_path, capsys):
    from demind.cli import make_tiny_model

    assert make_tiny_model.main(["--output", "/proc/demind-no-such/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config key 'output'") and "/proc/demind-no-such" in err[0]
    assert "Errno" not in err[0]


def test_make_tiny_model_refuses_a_folder_holding_another_model(tmp_path, capsys):
    from demind.cli import make_tiny_model

    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llava_next", "hidden_size": 4096}')
    (other / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert make_tiny_model.main(["--output", str(other)]) == 2  # before: config.json overwritten, a mix, exit 0
    err = capsys.readouterr().err
    assert "config key 'output'" in err and "--overwrite" in err and "already holds 2 file(s)" in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    assert make_tiny_model.main(["--output", str(notes), "--overwrite"]) == 2  # not a model: never replaced
    assert "does not hold a LLaVA-NeXT model" in capsys.readouterr().err
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


@pytest.mark.slow
def test_make_tiny_model_overwrite_replaces_an_earlier_tiny_model_whole(tmp_path, tiny_llava, capsys):
    import shutil

    from demind.cli import make_tiny_model

    out = tmp_path / "tiny"
    shutil.copytree(tiny_llava, out)
    earlier = (out / "model.safetensors").read_bytes()
    assert make_tiny_model.main(["--output", str(out), "--overwrite", "run.seed=1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_llava.iterdir())
    assert (out / "model.safetensors").read_bytes() != earlier
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no build folder left beside it

    (out / "notes.txt").write_text("mine")  # a file no tiny model has: --overwrite changes nothing
    weights = (out / "model.safetensors").read_bytes()
    assert make_tiny_model.main(["--output", str(out), "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


# ---------------------------------------------------------------- ranges that expand


PLAN_UNDER_A_MEMORY_LIMIT = """
import re, resource, sys
import webdataset.shardlists  # what resolve_shards imports (torch with it), before the limit
from demind.gen.plan import format_plan, make_plan
mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))  # 1 GiB more: the old plan built every id
plan = make_plan(sys.argv[1], sys.argv[2], "0-99999999999", overwrite=False)
print(format_plan(plan))
"""


def test_a_huge_shard_range_is_planned_without_building_every_id(tmp_path):
    import subprocess
    import sys

    inputs = tmp_path / "in"
    inputs.mkdir()
    for shard_id in (0, 1, 5):
        (inputs / f"{shard_id:05d}.tar").write_bytes(b"")  # the plan reads names only
    done = subprocess.run([sys.executable, "-c", PLAN_UNDER_A_MEMORY_LIMIT, str(inputs), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # before: MemoryError (the OOM killer without a limit)
    assert "shards selected :      3  (0-1,5)" in done.stdout
    assert "not in input    : 99999999997  (2-4,6-99999999999)" in done.stdout


def test_a_brace_pattern_naming_too_many_shards_is_refused_before_expanding(tmp_path):
    from demind.shard_format import ShardListError, pattern_size, resolve_shards

    assert pattern_size("a/{00000..00331}.tar::b/{0,1}.tar") == 334
    assert pattern_size("{a,b}/{0..9..2}.tar") == 10
    with pytest.raises(ShardListError, match=r"--input=.* names 100,000,000,000 shards"):
        resolve_shards(str(tmp_path / "{0..99999999999}.tar"), setting="--input")


@pytest.mark.parametrize("shard", ["9-2", "1..3", "x"])
def test_a_bad_shard_value_is_refused_when_the_config_is_loaded(tmp_path, shard, capsys):
    from demind.cli import generate

    assert generate.main(["--input", str(tmp_path), "--output", str(tmp_path / "out"), "--shard", shard,
                          "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'shard'" in err[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written
