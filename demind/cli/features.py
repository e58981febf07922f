"""``demind-features`` / ``python -m demind.features --config configs/train/paper.yaml [dotted overrides]``.

Uses the train config's ``backbone`` and ``data`` sections, so the cache lands where the
trainer looks for it (``data.features=auto``) unless ``cache.out`` (``--out``) says otherwise.  The work
happens in :func:`demind.features.build_feature_cache`. Afterwards it prints the GFQ
fidelity summary of T_int and T_rew (histogram counts, share below omega; see
:mod:`demind.fidelity`) and writes it as a plot, ``<cache>/fidelity.png`` unless ``cache.plot`` (``--plot``) says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import resolve_device, setting
from demind.training.config import TrainConfig


@dataclass
class CacheOutput:
    """Where the cache and its fidelity plot go."""

    out: str | None = setting(None, output="dir", help="cache folder (default: data.features, or <shard folder>/features/<backbone> "
                                         "when it is auto or off)")
    plot: str | None = setting(None, output="file", help="fidelity histogram PNG (default: <cache folder>/fidelity.png; "
                                          "none: no plot)")


@dataclass
class FeaturesConfig(TrainConfig):
    """A train recipe (its backbone, data and run sections are used) plus where the cache goes."""

    cache: CacheOutput = field(default_factory=CacheOutput)
    UNUSED_OUTPUTS: ClassVar[tuple[str, ...]] = ("run.output_dir",)  # no run folder: the cache is the output

    def config_problems(self) -> list[tuple[str, str]]:
        from demind.features import features_off  # the cache module imports torch; --help must not

        problems = super().config_problems()
        if (str(self.data.shards).startswith("hf-hub:") and self.cache.out is None
                and (features_off(self.data.features) or self.data.features == "auto")):
            # the default folder lies beside the shards, here inside the Hugging Face cache
            problems.append(("cache.out", f"is required with data.shards={self.data.shards}: give --out DIR and "
                                          "train with data.features=DIR"))
        return problems


FLAGS = {"--out": Flag("cache.out"), "--plot": Flag("cache.plot")}


def build_parser():
    return config_parser(FeaturesConfig, "demind-features", __doc__.split("\n\n")[0], FLAGS,
                         config_help="train config YAML (its backbone, data and run sections are used)")


def features_command(cfg: FeaturesConfig) -> int:
    """Build the cache of every shard not yet cached; print the summary (aligned, then as JSON)."""
    import torch

    from demind.backbone import build_backbone
    from demind.shard_format import resolve_shards
    from demind.embedding_cache import cache_slug
    from demind.features import build_feature_cache, cache_dir_for

    shards = resolve_shards(cfg.data.shards)
    # Seeded like the trainer, so a randomly initialised backbone (pretrained: null,
    # smoke runs) gets the same weights here and there.
    torch.manual_seed(cfg.run.seed)
    backbone = build_backbone(cfg.backbone)
    out = cfg.cache.out or cache_dir_for(cfg.data.features, shards, cache_slug(backbone))
    summary = build_feature_cache(shards, out, backbone, batch_size=cfg.data.cache_batch_size,
                                  num_workers=cfg.data.num_workers, missing_text=cfg.data.missing_text,
                                  dtype=cfg.data.cache_dtype, device=resolve_device(cfg.run.device),
                                  progress=cfg.run.progress)
    summary["fidelity"] = report_fidelity(out, shards, backbone, cfg.cache.plot)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(summary))
    return 0


def report_fidelity(out, shards: list[str], backbone, plot: str | None) -> dict:
    """GFQ fidelity summary of the whole cache (printed per text kind), and its plot."""
    from pathlib import Path

    from demind.embedding_cache import cache_identity
    from demind.features import ShardFeatureCache
    from demind.fidelity import fidelity_summary, plot_fidelity
    from demind.schema import GFQ_THRESHOLD

    fidelities = ShardFeatureCache(out, cache_identity(backbone)).fidelities(shards)
    summary = fidelity_summary(fidelities, GFQ_THRESHOLD)
    for kind in fidelities:
        row = summary[kind]
        print(f"GFQ fidelity T_{kind}: {row['below_omega']}/{row['samples']} ({row['share_below_omega']:.1%}) "
              f"below omega {GFQ_THRESHOLD}; mean {row['mean']}; histogram over [0, 1] {row['histogram']}")
    if (plot or "").lower() != "none":
        written = plot_fidelity(fidelities, plot or Path(out) / "fidelity.png", GFQ_THRESHOLD)
        summary["plot"] = str(written) if written else None
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(FeaturesConfig, build_parser(), features_command, argv)
