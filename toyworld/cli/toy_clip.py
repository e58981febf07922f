"""``demind-toy-clip``: train the toy CLIP recipe from scratch and write the weights the package ships.

    demind-toy-clip                         # the default recipe -> toyworld/weights/<stem>-<key>.safetensors
    demind-toy-clip workdir=runs/toy-clip backbone.seed=1 out=runs/shipped

The quickstart uses these weights instead of training (``toyworld/shipped.py`` says how they are
packed and checked bit for bit); this command is how they are made, and made again after the recipe,
the toy world or torch changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from demind.cli.common import config_parser, run_config_command
from demind.settings import setting
from toyworld.clip_config import ToyBackboneConfig
from toyworld.pipeline import ToyRunConfig

# what the training log holds (toyworld.clip_train.train_toy_clip): shipped beside the weights
TRAINING_LOG_KEYS = ("train_seconds", "final_loss", "pretrain_final_loss")


@dataclass
class ToyClipConfig:
    """``demind-toy-clip``: train the toy CLIP recipe from scratch and write its shipped weights."""

    workdir: str = setting("runs/toy-clip", output="dir", help="where it is trained and cached (WORKDIR/backbone); a rerun reuses it")
    out: str | None = setting(None, output="dir", help="folder of the shipped weights (default: the package's toyworld/weights)")
    backbone: ToyBackboneConfig = field(default_factory=ToyBackboneConfig)
    run: ToyRunConfig = field(default_factory=ToyRunConfig)


def toy_clip_command(cfg: ToyClipConfig) -> int:
    """Train (never from shipped weights), then pack the result as :mod:`toyworld.shipped` ships it."""
    from safetensors.torch import load_file

    from demind.io import check_output_dir
    from toyworld.clip_config import model_config_path
    from toyworld.clip_cache import ensure_toy_backbone
    from toyworld.shipped import SHIPPED_DIR, initial_state, pack, shipped_path

    recipe = dataclasses.replace(cfg.backbone, shipped=False)
    model_config_path(recipe.model_config)  # a missing model config is named before anything runs
    check_output_dir(Path(cfg.workdir) / "backbone")
    check_output_dir(Path(cfg.out) if cfg.out else SHIPPED_DIR)
    weights, report = ensure_toy_backbone(recipe, Path(cfg.workdir) / "backbone", cfg.run.progress)
    log = {k: report[k] for k in TRAINING_LOG_KEYS if k in report}
    out = shipped_path(weights.stem, Path(cfg.out) if cfg.out else SHIPPED_DIR)
    out.parent.mkdir(parents=True, exist_ok=True)
    pack(load_file(str(weights)), initial_state(recipe), log, out)
    print(f"trained weights: {weights}\nshipped weights: {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


def build_parser():
    return config_parser(ToyClipConfig, "demind-toy-clip", ToyClipConfig.__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    """``demind-toy-clip`` on ``argv``; returns the exit status (2: bad input)."""
    return run_config_command(ToyClipConfig, build_parser(), toy_clip_command, argv,
                              log_packages=("toyworld",))
