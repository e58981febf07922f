"""Build ExclCOCO from COCO-format annotations (the format is documented in :mod:`demind.exclcoco_builder`).

    python -m demind.cli.build_exclcoco --annotations data/coco/annotations --split val2017 \\
        --images data/coco/val2017 --out data/exclcoco/val2017

Reads ``instances_{split}.json`` and ``captions_{split}.json``; writes ``OUT/exclcoco.json`` and
prints the counts. ``--query-source llm --llm-config configs/data_gen/llava-1.6-7b.yaml`` (keys ``query_source``, ``llm_config``) writes
the query texts with the data_gen engine named there (vLLM or transformers) and the few-shot
prompt ``demind/gen/exclusion_prompts/<prompt_version>.txt``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting
from demind.exclcoco_builder import ExclCocoConfig


@dataclass
class BuildExclCocoConfig(ExclCocoConfig):
    """The builder's recipe (:class:`demind.exclcoco_builder.ExclCocoConfig`) plus its inputs and output."""

    annotations: str | None = setting(None, input="dir", help="folder with instances_{split}.json and captions_{split}.json "
                                                 "(required)")
    split: str = setting("val2017", free="a COCO split name: its two annotation files are checked in --annotations "
                                         "with the config", help="COCO split name in the annotation file names, e.g. val2017 or train2017")
    images: str | None = setting(None, input="dir", help="folder of the split's images, file_name is relative to it (required)")
    out: str | None = setting(None, output="dir", help="output folder for exclcoco.json (required)")
    llm_config: str | None = setting(None, input="file", help="data_gen YAML (engine, sampling, run sections) for "
                                                "query_source=llm")

    def config_problems(self) -> list[tuple[str, str]]:
        problems = [(key, f"is required: give --{key} DIR") for key in ("annotations", "images", "out")
                    if getattr(self, key) is None]
        if self.query_source == "llm" and not self.llm_config:
            problems.append(("llm_config", "is required by query_source=llm: give --llm-config, a data_gen YAML "
                                           "such as configs/data_gen/tiny-cpu.yaml"))
        if self.annotations is not None and Path(self.annotations).is_dir():
            missing = [name for name in (f"instances_{self.split}.json", f"captions_{self.split}.json")
                       if not (Path(self.annotations) / name).is_file()]
            if missing:
                problems.append(("split", f"= {self.split!r}: {self.annotations} lacks {', '.join(missing)}"))
        problems += prompt_problems(self.prompt_version)
        return problems

    def recipe(self) -> ExclCocoConfig:
        return ExclCocoConfig(**{f.name: getattr(self, f.name) for f in fields(ExclCocoConfig)})


FLAGS = {f"--{key.replace('_', '-')}": Flag(key) for key in (
    "annotations", "split", "images", "out", "caption_min_images", "max_per_caption", "max_ground_truth",
    "max_queries", "seed", "query_source", "llm_config", "prompt_version")}


def prompt_problems(version: str) -> list[tuple[str, str]]:
    """The LLM's few-shot prompt file of ``version`` exists and has its slots (checked with the config)."""
    from demind.errors import DemindError
    from demind.gen.exclusion import load_exclusion_prompt

    try:
        load_exclusion_prompt(version)
    except DemindError as e:
        return [("prompt_version", f"= {version!r}: {e}")]
    return []


def build_parser():
    return config_parser(BuildExclCocoConfig, "demind-build-exclcoco", __doc__.split("\n")[0], FLAGS)


def build_exclcoco_command(job: BuildExclCocoConfig) -> int:
    """Build the benchmark, print the counts and the output path."""
    from demind.exclcoco_builder import build_exclcoco
    from demind.gen.exclusion import llm_query_writer

    ann = Path(job.annotations)
    cfg = job.recipe()
    llm = build_llm(job.llm_config, cfg, llm_query_writer) if cfg.query_source == "llm" else None
    path, counts = build_exclcoco(ann / f"instances_{job.split}.json", ann / f"captions_{job.split}.json",
                                  job.out, job.images, cfg, llm=llm, split=job.split)
    print(counts.summary())
    print(f"exclcoco: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(BuildExclCocoConfig, build_parser(), build_exclcoco_command, argv)


def build_llm(llm_config: str, cfg: ExclCocoConfig, llm_query_writer):
    """The data_gen engine of ``llm_config`` wrapped as the builder's ``llm``."""
    from demind.config import load_config
    from demind.gen.config import GenConfig
    from demind.engines import build_engine

    gen = load_config(GenConfig, llm_config)
    engine = build_engine(gen.engine, gen.sampling, device=gen.run.device, seed=gen.run.seed)
    return llm_query_writer(engine, cfg.prompt_version, gen.run.seed, cfg.llm_max_tokens,
                            gen.io.image_max_side, gen.quality.repeat_ngram, gen.quality.max_ngram_repeats)


if __name__ == "__main__":
    sys.exit(main())
