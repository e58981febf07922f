"""Config: YAML + dotted overrides, unknown keys are errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from demind.schema import BackboneConfig, ModelConfig
from demind.config import ConfigError, load_config, save_config, to_dict
from demind.settings import setting


@dataclass
class Optim:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.98)


@dataclass
class Root:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: Optim = field(default_factory=Optim)
    steps: int = 10
    tags: list[str] = field(default_factory=list)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3.0e-5\nmodel:\n  num_queries: 2\nbackbone:\n  pretrained: null\n")
    cfg = load_config(Root, path, ["optim.lr=1e-4", "steps=7", "tags=[a,b]", "model.fusion=add"])
    assert cfg.optim.lr == 1e-4 and cfg.steps == 7 and cfg.tags == ["a", "b"]
    assert cfg.model.num_queries == 2 and cfg.model.fusion == "add" and cfg.model.num_blocks == 6
    assert cfg.backbone.pretrained is None and cfg.optim.betas == (0.9, 0.98)


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = load_config(Root, None, ["optim.betas=[0.8, 0.9]", "steps=3"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(Root, tmp_path / "resolved.yaml") == cfg
    assert to_dict(cfg)["optim"]["betas"] == [0.8, 0.9]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=1"], r"optim\.lrr.*did you mean 'lr'"),
        (["model.num_query=2"], r"model\.num_query.*'num_queries'"),
        (["stepz=2"], r"stepz.*'steps'"),
        (["steps.x=2"], "not a section"),
        (["steps=many"], "must be an integer"),
        (["no_equals_sign"], "section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Root, None, overrides)


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"optim\.learning_rate.*bad\.yaml"):
        load_config(Root, path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(Root, tmp_path / "missing.yaml")


def test_types_are_checked_without_silent_coercion(tmp_path):
    cfg = load_config(Root, None, ["optim.lr=1e-5", "steps=1e3", "optim.betas=[1, 0.5]"])
    assert cfg.optim.lr == 1e-5 and cfg.steps == 1000 and cfg.optim.betas == (1.0, 0.5)  # int for float is fine
    for bad in ("steps=1.5", "steps=true", "steps=null", "optim.lr=nan", "optim.betas=[0.9]"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.") + r".*\(command line"):
            load_config(Root, None, [bad])


def test_a_string_field_takes_the_override_text_as_written():
    cfg = load_config(Root, None, ["model.template=a photo of * , {text}: no", "backbone.pretrained=no"])
    assert cfg.model.template == "a photo of * , {text}: no" and cfg.backbone.pretrained == "no"
    assert load_config(Root, None, ["backbone.pretrained=null"]).backbone.pretrained is None


def test_rule_errors_name_key_value_origin_and_range(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backbone:\n  text_buckets: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(Root, path, ["model.num_blocks=0"])
    message = str(info.value)
    assert "'backbone.text_buckets' = 0 must be >= 1 (in " + str(path) + ")" in message
    assert "'model.num_blocks' = 0 must be >= 1 (command line)" in message


# ---------------------------------------------------------------- a section that checks itself; outputs


@dataclass
class SelfChecked:
    steps: int = setting(1, ge=1)

    def __post_init__(self) -> None:
        from demind.config import validate

        validate(self)  # built in code too: the section checks itself (toyworld's configs do)


@dataclass
class WithSelfChecked:
    inner: SelfChecked = field(default_factory=SelfChecked)


def test_a_section_checking_itself_names_the_dotted_key_and_where_it_came_from():
    with pytest.raises(ConfigError) as caught:
        load_config(WithSelfChecked, None, ["inner.steps=0"])
    assert caught.value.key == "inner.steps"
    assert "'inner.steps' = 0" in str(caught.value) and "command line" in str(caught.value)  # before: 'steps', default


@dataclass
class Writes:
    out: str | None = setting(None, output="dir")
    report: str = setting("report.json", output="file")
    keep: bool = False

    def output_problems(self) -> list[tuple[str, str]]:
        return [("out", "holds an earlier run; pass keep=true")] if not self.keep and self.out else []


def test_the_command_check_probes_declared_outputs_then_asks_each_section(tmp_path, monkeypatch):
    from demind.config_checks import check_command_config, declared_outputs

    monkeypatch.chdir(tmp_path)
    cfg = load_config(Writes)
    assert declared_outputs(cfg) == [("report", "report.json", "file")]  # None: nothing written
    check_command_config(cfg)
    (tmp_path / "a-file").write_text("x")
    for key, value in (("out", "a-file/sub"), ("report", "a-file/r.json"), ("report", "."), ("out", "/proc/demind-x")):
        with pytest.raises(ConfigError) as caught:
            check_command_config(load_config(Writes, None, [f"{key}={value}", "keep=true"]))
        assert caught.value.key == key and f"'{key}'" in str(caught.value) and "Errno" not in str(caught.value)
    with pytest.raises(ConfigError, match="config key 'out': holds an earlier run; pass keep=true"):
        check_command_config(load_config(Writes, None, ["out=runs/x"]))
    with pytest.raises(ValueError, match="output"):
        setting(None, output="folder")
