"""The recipe of pair mining (``demind-mine-pairs``): :class:`MinePairsConfig`. Torch-free, so
``--help`` and the config checks load no model code."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from demind.schema import BackboneConfig
from demind.search import RANKERS
from demind.settings import RunSection, device_setting, setting, threads_setting

SIGNALS = ("image", "caption", "second")
"""The neighbour signals: the frozen CLIP's image features, its text features of the captions, a
second visual encoder (MegaPairs: DINOv2)."""


@dataclass
class WindowConfig:
    """One neighbour signal: on or off, and the similarity window a kept pair's cosine lies in."""

    enabled: bool = setting(True, help="search neighbours by this signal")
    low: float = setting(0.8, ge=-1.0, le=1.0, help="keep a neighbour whose cosine similarity is above this "
                                                     "(MegaPairs: 0.8)")
    high: float = setting(0.96, ge=-1.0, le=1.0, help="... and below this (MegaPairs: 0.96; above: a "
                                                      "near-duplicate, dropped)")


@dataclass
class SecondEncoderConfig(WindowConfig):
    """A second visual encoder (MegaPairs: DINOv2), a timm model; its features are cached per shard."""

    enabled: bool = setting(False, help="search neighbours by a second visual encoder too")
    name: str = setting("vit_large_patch14_dinov2.lvd142m", free="a timm model name; timm refuses an unknown one",
                        help="timm model name (DINOv2 ViT-L/14: "
                                                                 "vit_large_patch14_dinov2.lvd142m)")
    pretrained: bool = setting(True, help="load timm's pretrained weights (from the Hugging Face cache)")
    checkpoint: str = setting("", free="a weights file, read with one error naming it", help="a local weights file instead (safetensors or a torch state dict)")
    overrides: str = setting("", free="keyword overrides timm checks when it builds the model", help="timm create_model keyword overrides, 'depth=1,embed_dim=32' (tiny "
                                      "random models for tests)")
    seed: int = setting(0, ge=0, help="the seed of a random initialisation (pretrained false: tests)")


@dataclass
class MiningConfig:
    neighbours: int = setting(50, ge=1, help="nearest neighbours searched per query and signal")
    targets: int = setting(3, ge=1, help="K: at most this many targets per query image")
    hard_negatives: int = setting(5, ge=0, help="H: at most this many hard negatives per query (MegaPairs: 5)")
    ranker: str = setting("exact", choices=RANKERS, help="nearest-neighbour search: exact or a FAISS index "
                                                         "(demind-search's rankers)")
    query_batch: int = setting(1024, ge=1, help="queries searched at once: the score buffer is "
                                                "corpus rows x min(query_batch, 64) x 4 bytes")


@dataclass
class PairFeaturesConfig:
    dir: str = setting("auto", free="auto or a folder, checked writable before any image is encoded", help="feature cache folder; auto = <input folder>/features/<backbone>, the "
                                    "training feature cache's place (intent shards share it with demind-train)")
    batch_size: int = setting(64, ge=1, help="images encoded at once")
    num_workers: int = setting(0, ge=0, help="image-decoding workers (0: in the main process)")


@dataclass
class MinePairsRunConfig(RunSection):
    """demind-mine-pairs's ``run`` section."""

    device: str = device_setting("cpu")
    threads: int = threads_setting()


@dataclass
class MinePairsConfig:
    """The mining recipe plus this job's input and output."""

    input: str | None = setting(None, free="a shard list, resolved (and refused naming it) before any model "
                                            "loads", help="the captioned corpus: a folder of .tar shards (img2dataset, "
                                           "demind-make-shards or intent shards) or a brace pattern (required)")
    output: str | None = setting(None, output="dir", help="folder of pair shards pairs-NNNNN.tar, one per input shard "
                                            "(required)")
    overwrite: bool = setting(False, help="mine finished shards again (and accept a changed recipe)")
    dry_run: bool = setting(False, help="print the plan and exit without loading a model")
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    image: WindowConfig = field(default_factory=WindowConfig)
    caption: WindowConfig = field(default_factory=WindowConfig)
    second: SecondEncoderConfig = field(default_factory=SecondEncoderConfig)
    mining: MiningConfig = field(default_factory=MiningConfig)
    features: PairFeaturesConfig = field(default_factory=PairFeaturesConfig)
    run: MinePairsRunConfig = field(default_factory=MinePairsRunConfig)

    def windows(self) -> dict[str, WindowConfig]:
        """signal -> its window, for the enabled signals, in :data:`SIGNALS` order."""
        return {name: getattr(self, name) for name in SIGNALS if getattr(self, name).enabled}

    def config_problems(self) -> list[tuple[str, str]]:
        problems = [(key, f"is required: give --{key} DIR") for key in ("input", "output") if getattr(self, key) is None]
        for name in SIGNALS:
            window = getattr(self, name)
            if window.low >= window.high:
                problems.append((f"{name}.low", f"must be below {name}.high ({window.high}): the window keeps nothing"))
        if not self.windows():
            problems.append(("image.enabled", "no signal is on: enable image, caption or second"))
        if self.mining.neighbours < self.mining.targets:
            problems.append(("mining.neighbours", f"must be at least mining.targets ({self.mining.targets})"))
        return problems

    def recipe(self) -> dict:
        """What the pairs depend on (not where this job reads and writes, nor how fast it runs)."""
        from demind.config import to_dict

        out = {f.name: to_dict(getattr(self, f.name)) for f in fields(self)
               if f.name in ("backbone", "mining", *SIGNALS)}
        out["mining"].pop("query_batch", None)
        for name in SIGNALS:
            if not out[name]["enabled"]:
                out[name] = {"enabled": False}
        return out
