"""ExclMM's config is checked when it is loaded, before any model loads or feature is built; the
plateau rule that stops a phase once its loss has stopped falling; L_t's weight kept apart."""

from __future__ import annotations

import json

import pytest
import torch

from demind.cli import train_exclmm as cli
from demind.config import ConfigError, load_config
from demind.exclmm.config import ExclMMConfig
from demind.exclmm.train import PHASES_NAME, Plateau, plateau_reached


def args(repo_root, train_dir, run_dir, *extra):
    return ["--config", str(repo_root / "configs/exclmm/smoke.yaml"),
            f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", f"data.train={train_dir}",
            f"run.output_dir={run_dir}", *extra]


@pytest.mark.parametrize("overrides, key", [
    (["run.log_every=0"], "run.log_every"),                      # was: ZeroDivisionError after encoding
    (["query.space=CLIP"], "query.space"),                       # was: refused only after the features
    (["space.top_t=1000", "sae.code_dim=48"], "space.top_t"),    # was: trained silently
    (["space.zc_mask=false", "space.image_mask=zc_or_top_t"], "space.image_mask"),  # was: trained silently
    (["sae.code_dim=0"], "sae.code_dim"),                        # was: a traceback
    (["sae.steps=-3"], "sae.steps"),
    (["data.encode_batch_size=0"], "data.encode_batch_size"),
    (["query.lambda_c=0", "query.lambda_t=0"], "query.lambda_c"),
    (["stop.tol=1.5"], "stop.tol"),
])
def test_bad_settings_are_one_line_before_any_work(repo_root, tmp_path, capsys, overrides, key):
    """Each refused when the config is loaded: one error line naming the key, and nothing built
    (the training split given does not even exist: the config is refused first)."""
    run = tmp_path / "run"
    assert cli.main(args(repo_root, tmp_path / "no-split", run, *overrides)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and repr(key) in err, err
    assert not (run / "features.safetensors").exists()


def test_every_key_has_a_declared_check_or_says_why_not():
    """Walk the dataclass fields: each key of ExclMM's own sections has a rule, is an output folder,
    is a bool, or is named free with a reason; each rule refuses a value that breaks it."""
    import dataclasses

    from demind.settings import Rule

    unchecked = []
    for section in ("data", "sae", "space", "query", "stop", "run"):
        cls = type(getattr(ExclMMConfig(), section))
        for f in dataclasses.fields(cls):
            meta, key = f.metadata, f"{section}.{f.name}"
            rule = meta.get("rule")
            if rule is not None and rule != Rule():
                continue
            if meta.get("output") or meta.get("free") or isinstance(f.default, bool):
                continue
            unchecked.append(key)
    assert unchecked == []


def test_cross_field_checks_name_the_fix():
    with pytest.raises(ConfigError, match=r"space.top_t.*exceeds sae.code_dim = 48.*lower space.top_t"):
        load_config(ExclMMConfig, None, ["space.top_t=49", "sae.code_dim=48"])
    load_config(ExclMMConfig, None, ["space.top_t=48", "sae.code_dim=48"])  # equal is fine
    with pytest.raises(ConfigError, match=r"space.image_mask.*space.zc_mask=false"):
        load_config(ExclMMConfig, None, ["space.zc_mask=false", "space.image_mask=zc_or_top_t"])
    load_config(ExclMMConfig, None, ["space.zc_mask=false", "space.image_mask=top_t"])


def test_without_l_t_keeps_l_c_weight_unless_asked():
    """Eq. 17 as lambda_c L_c + (1 - lambda_c) L_t: lambda_c = 1 doubles L_c's weight against the
    default 0.5; lambda_t = 0 drops L_t at L_c's own weight."""
    assert load_config(ExclMMConfig, None, []).query.weights() == (0.5, 0.5)
    assert load_config(ExclMMConfig, None, ["query.lambda_c=1.0"]).query.weights() == (1.0, 0.0)
    assert load_config(ExclMMConfig, None, ["query.lambda_t=0"]).query.weights() == (0.5, 0.0)


def test_plateau_rule_on_a_hand_made_curve():
    """Window means 10, 6, 4, 3.5, 3.49, ...: with tol 0.01 the phase stops at the window that
    gains less than 1 % of the best before it (3.49 > 3.5 - 0.035)."""
    assert not plateau_reached([10.0], 0.01)
    assert not plateau_reached([10.0, 6.0], 0.01)
    assert not plateau_reached([10.0, 6.0, 4.0, 3.5], 0.01)
    assert plateau_reached([10.0, 6.0, 4.0, 3.5, 3.49], 0.01)
    # a noisy window above an earlier one stops it too: the best earlier window is the reference
    assert plateau_reached([10.0, 6.0, 6.5], 0.01)
    assert not plateau_reached([10.0, 6.0, 6.5, 5.0], 0.01)  # ... but never after a real gain

    # step by step: window 2, a loss curve per step; stops at the end of the 4th window (step 8)
    curve = [10, 10, 6, 6, 4, 4, 3.99, 3.99, 3, 3]
    plateau = Plateau(window=2, tol=0.01)
    stops = [step for step, loss in enumerate(curve, 1) if plateau.add(loss)]
    assert stops[0] == 8 and plateau.means == [10.0, 6.0, 4.0, 3.99, 3.0]
    # restored half-way through a window, it stops at the same step
    first = Plateau(window=2, tol=0.01)
    for loss in curve[:5]:
        first.add(loss)
    resumed = Plateau.restore(json.loads(json.dumps(first.snapshot())), 2, 0.01)
    assert [s for s, loss in enumerate(curve[5:], 6) if resumed.add(loss)][0] == 8
    assert not any(Plateau(window=0, tol=0.5).add(x) for x in curve)  # window 0: never stops early


def test_phases_stop_on_the_plateau_and_say_so(repo_root, tmp_path):
    """With a tolerance no real gain meets, every phase stops after its second window; phases.json
    records the steps run and why, and the export's step count in metrics.jsonl follows them."""
    from toyworld.synthetic import write_synthetic_coco
    from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco

    root = tmp_path / "data"
    instances, captions, images = write_synthetic_coco(root / "coco", 24, split="train", seed=5, write_images=True)
    build_exclcoco(instances, captions, root / "train", images, ExclCocoConfig(caption_min_images=3), split="train")
    run = tmp_path / "run"
    assert cli.main(args(repo_root, root / "train", run, "stop.window=3", "stop.tol=0.9")) == 0
    phases = json.loads((run / PHASES_NAME).read_text())["phases"]
    assert {k: (v["steps"], v["stopped"]) for k, v in phases.items()} == {
        "sae": (6, "plateau"), "space": (6, "plateau"), "query": (6, "plateau")}
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["step"]) for r in logged][-1] == ("query", 18)
    assert (run / "stage1.safetensors").is_file()  # the "stage 1 only" model, written as stage 2 began
    # the plateau settings define the weights: another stop.window in the same folder is refused
    assert cli.main(args(repo_root, root / "train", run, "stop.window=4", "stop.tol=0.9")) == 2


def test_stage1_export_is_the_stage_1_only_model(repo_root, tmp_path):
    """The model written when stage 2 begins equals, weight for weight, a run with query.steps=0 (the
    "stage 1 only" ablation), so the benchmark reads that row from the full run instead of training it."""
    from safetensors.torch import load_file

    from toyworld.synthetic import write_synthetic_coco
    from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco

    root = tmp_path / "data"
    instances, captions, images = write_synthetic_coco(root / "coco", 24, split="train", seed=5, write_images=True)
    build_exclcoco(instances, captions, root / "train", images, ExclCocoConfig(caption_min_images=3), split="train")
    assert cli.main(args(repo_root, root / "train", tmp_path / "full")) == 0
    assert cli.main(args(repo_root, root / "train", tmp_path / "s1", "query.steps=0")) == 0
    stage1 = load_file(tmp_path / "full" / "stage1.safetensors")
    alone = load_file(tmp_path / "s1" / "exclmm.safetensors")
    full = load_file(tmp_path / "full" / "exclmm.safetensors")
    assert stage1.keys() == alone.keys() and all(torch.equal(stage1[k], alone[k]) for k in alone)
    assert not all(torch.equal(stage1[k], full[k]) for k in full)  # stage 2 moved F_theta
