r"""``demind-generate-triplets``: turn pair shards (demind-mine-pairs) into triplet shards, MegaPairs-style:
an MLLM describes how the two images of each pair relate (both images in one prompt), an LLM writes
retrieval instructions from that description (at least three per pair, in a validated structure).

    demind-generate-triplets --pairs shards/mine-pairs --output shards/mine-triplets \
        --config configs/data_gen/triplets-tiny-cpu.yaml [engine.name=vllm writer.model=... ...]

On a Ray cluster (one describer + writer per worker, shards pulled by whichever worker is free):

    demind-generate-triplets --pairs ... --output ... --config ... --distributor ray --workers 8

The images are read by key from the corpus the pairs were mined from (the pairs manifest names it;
--corpus where it lies now if it moved). Rerunning the same command skips finished shards and redoes
interrupted ones; a rerun with another recipe into the same --output is refused unless --overwrite.
Schema of the pair and triplet shards: shards/README.md; the job: docs/generation.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from demind.cli.common import DISTRIBUTOR_FLAGS, Flag, config_parser, run_config_command
from demind.gen.triplet_config import TripletGenConfig
from demind.settings import DistributorOptions, setting


@dataclass
class GenerateTripletsConfig(TripletGenConfig, DistributorOptions):
    """The triplet recipe (engine, writer, sampling, prompts, instructions, io, run) plus this job's shards."""

    pairs: str | None = setting(None, refuses=None, help="folder of pair shards written by demind-mine-pairs "
                                                         "(pairs-NNNNN.tar and pairs_manifest.json) (required)")
    output: str | None = setting(None, output="dir", help="folder for the triplet shards: triplets-NNNNN.tar and "
                                                          "its _stats.json per pair shard (required)")
    corpus: str | None = setting(None, free="checked against the pairs manifest's digest when opened",
                                 help="where the corpus the pairs were mined from lies now, if it moved (default: "
                                      "where the pairs manifest says); another corpus is refused")
    shard: str | None = setting(None, refuses="5-2", help="pair shard ids: '0-99', '0-9,20-29', '7' (default: all)")
    overwrite: bool = setting(False, help="redo selected shards even when done, and replace the folder's recipe")
    dry_run: bool = setting(False, help="print the plan and exit without loading a model")

    def config_problems(self) -> list[tuple[str, str]]:
        from demind.gen.plan import ShardSpecError, parse_shard_range

        problems = [(key, f"is required: give --{key} DIR") for key in ("pairs", "output") if getattr(self, key) is None]
        if self.shard is not None:
            try:
                parse_shard_range(self.shard)
            except ShardSpecError as e:
                problems.append(("shard", str(e)))
        return problems + self.distributor_problems()

    def recipe(self) -> TripletGenConfig:
        """The recipe alone: what each shard's stats and the folder's manifest record."""
        return TripletGenConfig(**{f.name: getattr(self, f.name) for f in fields(TripletGenConfig)})


FLAGS = {"--pairs": Flag("pairs"), "--output": Flag("output"), "--corpus": Flag("corpus"), "--shard": Flag("shard"),
         "--overwrite": Flag("overwrite"), "--dry-run": Flag("dry_run"), **DISTRIBUTOR_FLAGS}


def build_parser():
    return config_parser(GenerateTripletsConfig, "demind-generate-triplets", __doc__, FLAGS,
                         config_help="YAML config, e.g. configs/data_gen/triplets-tiny-cpu.yaml")


def triplets_command(job: GenerateTripletsConfig) -> int:
    """0 when every selected shard is done, 1 if a pair shard failed."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from demind.gen.plan import format_plan, make_plan
    from demind.gen.relation import load_triplet_prompts
    from demind.gen.runner import run_plan
    from demind.gen.triplet_job import (
        OUTPUT_PREFIX, TripletJobSpec, TripletShardJob, check_before_loading, check_manifest, format_triplet_summary,
        manifest_record)
    from demind.pairs import open_corpus, read_pairs_manifest

    cfg = job.recipe()
    pairs_manifest = read_pairs_manifest(job.pairs)
    corpus = open_corpus(pairs_manifest, corpus=job.corpus, setting="--corpus")  # another corpus: refused
    prompts = load_triplet_prompts(cfg.prompts.version)
    plan = make_plan(job.pairs, job.output, job.shard, job.overwrite, output_prefix=OUTPUT_PREFIX)
    print(format_plan(plan).replace("data_gen plan", "triplet plan", 1), flush=True)
    writer = cfg.writer_engine()
    print(f"describer {cfg.engine.name}: {cfg.engine.model}; writer: {writer.model if writer else 'the describer'}; "
          f"prompts {prompts.version}; {cfg.instructions.count} instructions a pair, mode {cfg.instructions.mode}; "
          f"corpus {pairs_manifest['corpus'].get('spec')}", flush=True)
    if job.dry_run or not plan.todo:
        print("nothing to do" if not plan.todo else "dry run: stopping before loading the model")
        return 0
    if not cfg.run.progress:
        from demind.engines import disable_loading_progress

        disable_loading_progress()
    check_before_loading(cfg, prompts)  # the models' folders, the prompts' token budgets
    check_manifest(job.output, manifest_record(cfg, pairs_manifest, job.pairs, prompts.sha), job.overwrite)
    spec = TripletJobSpec(cfg, corpus)
    if job.distributor == "ray":
        import os

        from demind.gen.ray_job import RayOptions, run_plan_on_ray

        options = RayOptions(workers=job.workers, address=job.ray_address or os.environ.get("RAY_ADDRESS") or None,
                             shard_attempts=job.shard_attempts, name_prefix="demind-generate-triplets")
        with logging_redirect_tqdm():
            summary = run_plan_on_ray(plan, spec, options, TripletShardJob.load, show_progress=cfg.run.progress,
                                      unit="pair", rate_key="pairs_per_s")
    else:
        triplet_job = TripletShardJob.load(spec)
        with logging_redirect_tqdm():
            summary = run_plan(plan, triplet_job, show_progress=cfg.run.progress)
    print(format_triplet_summary(summary))
    return 1 if summary.failed else 0


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when every selected shard is done, 1 if a pair shard failed, 2 on bad usage or input."""
    return run_config_command(GenerateTripletsConfig, build_parser(), triplets_command, argv)
