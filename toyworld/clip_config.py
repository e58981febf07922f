"""The toy CLIP's recipe (:class:`ToyBackboneConfig`) and the scene tags its image tower pre-trains on.

Torch-free, so ``--help`` of the toy commands and their config checks load no model code;
re-exported by :mod:`toyworld.clip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from demind.config import validate
from demind.settings import setting
from demind.errors import MissingInputError

from .world import BACKGROUNDS, COLOURS, EDIT_KINDS, POSITIONS, SHAPES, SIZES, STYLES, THEME_BACKGROUNDS

# the toy CLIP's open_clip model config, relative to the repository root (resolved from there when
# the current folder is elsewhere: model_config_path)
TOY_CLIP_CONFIG = "toyworld/model_configs/toy-clip-cnn-text2.json"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


# the scene's ground-truth tags the image tower's pre-training predicts -> their values (the tag
# head's classes): object attributes (a scene sets the bit of every value its objects hold) and
# scene attributes (one bit)
OBJECT_TAGS = {"shape": SHAPES, "colour": COLOURS, "size": SIZES, "position": POSITIONS}
SCENE_TAGS = {"background": BACKGROUNDS + THEME_BACKGROUNDS, "style": STYLES}
TAG_VALUES = {**OBJECT_TAGS, **SCENE_TAGS}


@dataclass
class ToyBackboneConfig:
    """Training recipe of the toy CLIP (defaults sized for the CPU quickstart)."""

    # The full-resolution convnet (toyworld/towers.py) with a 2-layer text tower, pre-trained on the
    # scene's tags, then locked: chosen on the pair probes among ten measured candidates (lab notes)
    # an architecture JSON, from the current folder or beside the package (model_config_path)
    model_config: str = setting(TOY_CLIP_CONFIG, refuses="toyworld/model_configs/no-such-config.json")
    seed: int = setting(0, ge=0)
    # 1,000 steps: 400 left the toy CLIP at held-out R@1 5 % (full descriptions), 1,000 gave 42 %.
    steps: int = setting(1000, ge=1)
    batch_size: int = setting(128, ge=2)  # contrastive: at least one negative
    lr: float = setting(1e-3, gt=0)
    weight_decay: float = setting(0.1, ge=0)
    warmup_steps: int = setting(100, ge=0)
    num_train_images: int = setting(8000, ge=1)   # rendered once; each step draws fresh texts for them
    # Hard-negative groups: this share of every batch is made of groups, each one scene photographed
    # 1 + len(group_edits) times with the same nuisances, every other member edited in one attribute,
    # each captioned with its full description (the only text that tells the members apart).
    # 0 = random batches only.
    group_share: float = setting(0.5, ge=0, le=1)
    group_edits: tuple[str, ...] = setting(("shape", "size", "position"), choices=EDIT_KINDS)
    num_group_scenes: int = setting(2000, ge=1)  # groups rendered once, like the random pool
    # Image-tower pre-training: before the contrastive `steps`, `pretrain_steps` steps train the image
    # tower alone, with a linear tag head (discarded), to predict the scene's ground-truth tags:
    # `pretrain_first_tags` only for the first `pretrain_first_steps` steps (shape first: asked for
    # every tag from the start, the easy ones starve it), then `pretrain_tags`. Batches of random web
    # images, constant lr. 0 = none. The contrastive stage then keeps the image tower as it is (LiT,
    # Zhai et al. 2022: the training images are embedded once) and trains the text tower and the scale.
    pretrain_steps: int = setting(1000, ge=0)
    pretrain_tags: tuple[str, ...] = setting(("shape", "colour", "size", "background", "style"),
                                             choices=tuple(TAG_VALUES))
    pretrain_first_tags: tuple[str, ...] = setting(("shape",), choices=tuple(TAG_VALUES))
    pretrain_first_steps: int = setting(500, ge=0)
    num_eval_scenes: int = setting(1000, ge=1)
    # pair probes (toyworld/probes.py): evaluation only, so not part of the cache key
    num_pair_probe_scenes: int = setting(600, ge=1)
    fused_adamw: bool = True       # same update, one kernel (optimizer step 33 -> 7.6 ms: benchmarks/bench_toy.py)
    log_every: int = setting(50, ge=1)
    # The modality gap (toyworld.clip.add_modality_gap): text embeddings get one more dimension, held
    # at this constant, that images never use, so a caption's cosines to all images crowd into a
    # narrow band as real CLIP's do. Applied to the trained weights, so not part of the cache key.
    # 0: the toy CLIP as trained. 50: calibrated on the toy CIRR's baselines (lab notes).
    modality_gap: float = setting(50.0, ge=0)
    # use the weights shipped in toyworld/weights/ when this recipe has them (toyworld/shipped.py: the
    # default recipe's trained weights, checked bit for bit); false trains from scratch. Not in the key.
    shipped: bool = True

    def config_problems(self) -> list[tuple[str, str]]:
        """The rules that involve several fields (each field's own rule is declared with setting())."""
        problems = []
        if not set(self.pretrain_first_tags) <= set(self.pretrain_tags):
            problems.append(("pretrain_first_tags", f"= {list(self.pretrain_first_tags)} must be among pretrain_tags "
                                                    f"= {list(self.pretrain_tags)} (they share one tag head)"))
        if self.pretrain_steps and self.pretrain_first_steps > self.pretrain_steps:
            problems.append(("pretrain_first_steps", f"= {self.pretrain_first_steps} is more than pretrain_steps "
                                                     f"= {self.pretrain_steps}"))
        if self.pretrain_steps and not self.pretrain_tags:
            problems.append(("pretrain_tags", "is empty, but pretrain_steps > 0 needs at least one tag"))
        try:
            model_config_path(self.model_config)
        except MissingInputError as e:
            problems.append(("model_config", f"= {self.model_config!r}: {e}"))
        return problems

    def __post_init__(self) -> None:
        validate(self)  # built in code by the quickstart and the benchmarks: the rules a loaded config meets


def model_config_path(model_config: str | Path) -> Path:
    """The absolute path of a model-config JSON: as given (from the current folder), else the
    shipped one of that repository-relative name (``toyworld/model_configs/...``), so the toy
    commands and the checkpoints that record the path work from any folder."""
    path = Path(model_config)
    for candidate in (path, PACKAGE_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise MissingInputError(f"toy model config {path} does not exist (expected an open_clip model JSON)")
