"""Image towers from other packages: the ``demind.plugins`` entry points are loaded only when a
model config names a timm tower timm does not know, and a tower nobody provides is one clear error."""

from __future__ import annotations

import json
import sys
from importlib import metadata

import pytest
import timm

from demind import plugins
from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig

TOWER = "demind_test_plugin_tower"
MODULE = "demind_test_plugin_module"
PLUGIN_SOURCE = f'''
from timm.models import register_model
from toyworld.towers import ToyConvNet


@register_model
def {TOWER}(pretrained=False, **kwargs):
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    return ToyConvNet(width=4, **kwargs)
'''


def model_config(tmp_path, tower: str):
    path = tmp_path / f"{tower}.json"
    path.write_text(json.dumps({
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "timm_model_name": tower, "timm_model_pretrained": False,
                       "timm_pool": "max", "timm_proj": "linear"},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}))
    return path


@pytest.fixture()
def fake_plugin(tmp_path, monkeypatch):
    """A plugin package on sys.path, declared as installed metadata declares it (a dist-info folder)."""
    (tmp_path / f"{MODULE}.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "demind_test_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demind-test-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\ntest = {MODULE}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(MODULE, None)
    plugins._loaded.discard(MODULE)


def test_an_unknown_tower_loads_its_plugin_before_the_model_is_built(fake_plugin, tmp_path):
    assert not timm.is_model(TOWER) and MODULE not in sys.modules  # nothing imported it yet
    assert [e.value for e in plugins.plugin_entry_points() if e.name == "test"] == [MODULE]
    backbone = FrozenCLIP(BackboneConfig(name=str(model_config(tmp_path, TOWER)), pretrained=None))
    assert MODULE in sys.modules and timm.is_model(TOWER)
    assert backbone.embed_dim == 16


def test_a_known_tower_loads_no_plugin(fake_plugin, tmp_path, monkeypatch):
    def fail():
        raise AssertionError("plugins were loaded for a tower timm knows")

    monkeypatch.setattr(plugins, "load_plugins", fail)
    plugins.require_timm_model({"vision_cfg": {"timm_model_name": "resnet18"}}, "x.json")
    plugins.require_timm_model({"vision_cfg": {"layers": 1}}, "x.json")  # open_clip's own ViT


def test_a_tower_no_plugin_provides_is_one_error_naming_config_tower_and_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata, "entry_points", lambda group=None: [])
    config = model_config(tmp_path, "demind_no_such_tower")
    with pytest.raises(plugins.MissingTowerError) as error:
        FrozenCLIP(BackboneConfig(name=str(config), pretrained=None))
    message = str(error.value)
    assert str(config) in message and "demind_no_such_tower" in message and "install the package" in message


def test_importing_the_toy_towers_registers_them():
    import toyworld.towers  # noqa: F401

    assert timm.is_model("demind_toy_convnet")


def test_the_toy_package_declares_its_towers_as_a_plugin(repo_root):
    import tomllib

    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][plugins.ENTRY_POINT_GROUP] == {"toy": "toyworld.towers"}
