"""``run.threads`` on every command that runs torch: listed by --help, applied before the command's
body (torch starts its thread pools at the first tensor op)."""

from __future__ import annotations

import importlib

import pytest
import torch

COMMANDS = {  # module: (its main's body, an argv that passes config checks)
    "demind.cli.train": ("train_command", []),
    "demind.cli.train_exclmm": ("train_exclmm_command", []),
    "demind.cli.features": ("features_command", []),
    "demind.cli.evaluate": ("evaluate_command", ["--benchmark", "cirr", "--data-root", "d", "--out", "o"]),
}


@pytest.mark.parametrize("module_name", sorted(COMMANDS))
def test_run_threads_is_set_before_the_body_runs(module_name, monkeypatch, capsys):
    module = importlib.import_module(module_name)
    body_name, argv = COMMANDS[module_name]
    seen = []
    monkeypatch.setattr(module, body_name, lambda cfg: (seen.append((torch.get_num_threads(), cfg.run.threads)), 0)[1])
    before = torch.get_num_threads()
    try:
        assert module.main([*argv, "run.threads=3"]) == 0, capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    assert seen == [(3, 3)]
    assert "run.threads" in module.build_parser().format_help()


def test_a_run_saved_before_run_threads_existed_resumes_without_a_changed_settings_line(tmp_path, caplog):
    """A key added since a checkpoint was written, left at its default, is not reported as changed;
    a setting that did change still is."""
    import logging

    from demind.config import to_dict
    from demind.training.config import TrainConfig
    from demind.training.resume import check_resumable

    cfg = TrainConfig()
    saved = to_dict(cfg)
    del saved["run"]["threads"]  # written before the key existed
    with caplog.at_level(logging.WARNING, logger="demind.training.resume"):
        check_resumable(saved, cfg, tmp_path)
    assert "changed settings" not in caplog.text
    saved["run"]["log_every"] = cfg.run.log_every + 1
    with caplog.at_level(logging.WARNING, logger="demind.training.resume"):
        check_resumable(saved, cfg, tmp_path)
    assert f"run.log_every ({cfg.run.log_every + 1} -> {cfg.run.log_every})" in caplog.text
    assert "run.threads" not in caplog.text


@pytest.mark.parametrize("key, value", [("optim.lr", 3e-4), ("loss.distil", False), ("noise.mode", "conesep"),
                                        ("data.shards", "shards/other"), ("run.seed", 7), ("model.num_heads", 4)])
def test_resuming_under_another_recipe_is_refused_naming_the_key(tmp_path, key, value):
    """A rerun into a run folder with another recipe or other inputs must not continue the old weights
    under the new recipe: one line names the changed key (free keys, such as run.log_every, may change)."""
    from demind.config import to_dict
    from demind.training.config import TrainConfig
    from demind.trainkit import ResumeError
    from demind.training.resume import check_resumable

    cfg = TrainConfig()
    saved = to_dict(cfg)
    section, name = key.split(".")
    if name not in saved[section]:
        pytest.skip(f"{key} is not a key of this config")
    saved[section][name] = value
    with pytest.raises(ResumeError, match=rf"cannot resume from .*{key} \(.* -> .*\) differ"):
        check_resumable(saved, cfg, tmp_path)


def test_growing_max_steps_resumes(tmp_path, caplog):
    import logging

    from demind.config import to_dict
    from demind.training.config import TrainConfig
    from demind.training.resume import check_resumable

    cfg = TrainConfig()
    saved = to_dict(cfg)
    saved["optim"]["max_steps"] = cfg.optim.max_steps - 100
    with caplog.at_level(logging.WARNING, logger="demind.training.resume"):
        check_resumable(saved, cfg, tmp_path)
    assert "optim.max_steps" in caplog.text


def test_train_refuses_missing_shards_and_another_recipe_before_the_backbone_loads(tmp_path, monkeypatch):
    """Missing shards and a resumed run under another recipe are refused before the backbone (minutes for
    ViT-L/14, a download offline) is built."""
    import yaml

    from demind.config import to_dict
    from demind.shard_format import ShardListError
    from demind.training import loop
    from demind.trainkit import ResumeError
    from demind.training.resume import STATE_NAME, checkpoint_root
    from demind.training.config import TrainConfig

    def no_backbone(*args, **kwargs):
        raise AssertionError("the backbone was built before the config was refused")

    monkeypatch.setattr(loop, "build_modules", no_backbone)
    cfg = TrainConfig()
    cfg.run.output_dir, cfg.run.device, cfg.run.trackers = str(tmp_path / "run"), "cpu", []
    cfg.data.shards = str(tmp_path / "no-shards" / "{00000..00003}.tar")
    with pytest.raises(ShardListError, match="data.shards"):
        loop.train(cfg)

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "00000.tar").write_bytes(b"")
    cfg.data.shards = str(shards)
    saved = checkpoint_root(tmp_path / "run") / "step_000010"
    saved.mkdir(parents=True)
    old = to_dict(cfg)
    old["optim"]["lr"] = cfg.optim.lr * 10
    (saved / "config.yaml").write_text(yaml.safe_dump(old), encoding="utf-8")
    (saved / STATE_NAME).write_text("{}", encoding="utf-8")
    with pytest.raises(ResumeError, match=r"optim.lr \("):
        loop.train(cfg)
