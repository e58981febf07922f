r"""``demind-generate`` / ``python data_gen/run.py``: turn image-caption shards into intent shards
(T_rew, T_int) with a multimodal LLM.

    demind-generate --input /data/cc3m --output /data/intent-cc3m --shard 0-99 \
        --config configs/data_gen/llava-1.6-7b.yaml [engine.tensor_parallel_size=2 ...]

On a Ray cluster (one engine per worker, shards pulled by whichever worker is free):

    demind-generate --input ... --output ... --shard 0-99 --config ... --distributor ray --workers 8 \
        [--ray-address HOST:6379]   # or RAY_ADDRESS; neither: a local Ray cluster

Rerunning the same command skips finished shards and redoes interrupted ones.
Schema of the input and output shards: shards/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from demind.cli.common import DISTRIBUTOR_FLAGS, Flag, config_parser, run_config_command
from demind.settings import DistributorOptions, setting
from demind.gen.config import GenConfig


@dataclass
class GenerateConfig(GenConfig, DistributorOptions):
    """The generation recipe (engine, sampling, prompts, quality, io, run) plus this job's shards."""

    input: str | None = setting(None, refuses=None,
                                help="folder of input .tar shards (img2dataset layout: KEY.jpg, KEY.txt, KEY.json) or "
                                     "a brace pattern such as '/data/cc3m/{00000..00331}.tar' (required)")
    output: str | None = setting(None, output="dir",
                                 help="folder for the intent shards: one NNNNN.tar and NNNNN_stats.json per input "
                                      "shard (required)")
    shard: str | None = setting(None, refuses="5-2",
                                help="input shard ids, inclusive ranges and lists: '0-99', '0-9,20-29', '7' (default: "
                                     "every shard of input); give each process a disjoint range")
    overwrite: bool = setting(False, help="redo selected shards even if their stats file says they are done")
    dry_run: bool = setting(False, help="print the plan and exit without loading a model")

    def config_problems(self) -> list[tuple[str, str]]:
        from demind.gen.plan import ShardSpecError, parse_shard_range

        problems = [(key, f"is required: give --{key} DIR") for key in ("input", "output") if getattr(self, key) is None]
        if self.shard is not None:
            try:
                parse_shard_range(self.shard)  # ranges, not ids: a huge range is two numbers
            except ShardSpecError as e:
                problems.append(("shard", str(e)))
        return problems + self.distributor_problems()

    def recipe(self) -> GenConfig:
        """The generation recipe alone: what each shard's stats record (not where this job read and wrote)."""
        return GenConfig(**{f.name: getattr(self, f.name) for f in fields(GenConfig)})


FLAGS = {"--input": Flag("input"), "--output": Flag("output"), "--shard": Flag("shard"),
         "--overwrite": Flag("overwrite"), "--dry-run": Flag("dry_run"), **DISTRIBUTOR_FLAGS}


def build_parser():
    return config_parser(GenerateConfig, "demind-generate", __doc__, FLAGS,
                         config_help="YAML config, e.g. configs/data_gen/llava-1.6-7b.yaml "
                                     "(default: the values listed below)")


def generate_command(job: GenerateConfig) -> int:
    """0 when every selected shard is done, 1 if an input shard failed."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from demind.engines import build_engine
    from demind.engines.model_ref import check_engine_model
    from demind.gen.job import format_job_summary, run_plan
    from demind.gen.prompts import check_intent_prompt_fits, load_prompts
    from demind.gen.plan import format_plan, make_plan

    cfg = job.recipe()
    plan = make_plan(job.input, job.output, job.shard, job.overwrite)
    print(format_plan(plan), flush=True)
    if job.dry_run or not plan.todo:
        print("nothing to do" if not plan.todo else "dry run: stopping before loading the model")
        return 0
    if not cfg.run.progress:  # also the weight-loading bars of transformers / huggingface_hub
        from demind.engines import disable_loading_progress

        disable_loading_progress()
    check_engine_model(cfg.engine.model)  # here too for Ray, whose workers load the model
    prompts = load_prompts(cfg.prompts.version)
    # the longest request against engine.max_model_len: one line now, not vLLM's error after its engine started
    check_intent_prompt_fits(cfg, prompts)
    if job.distributor == "ray":
        summary = generate_on_ray(job, plan, cfg)
        print(format_job_summary(summary))
        return 1 if summary.failed else 0
    engine = build_engine(cfg.engine, cfg.sampling, device=cfg.run.device, seed=cfg.run.seed)
    print(f"engine {engine.name}: {engine.model_id}; prompts {prompts.version} ({prompts.sha}), mode {cfg.prompts.mode}",
          flush=True)
    with logging_redirect_tqdm():  # log lines print above the progress bars instead of through them
        summary = run_plan(plan, cfg, engine, prompts, show_progress=cfg.run.progress)
    print(format_job_summary(summary))
    return 1 if summary.failed else 0


def generate_on_ray(job: GenerateConfig, plan, cfg: GenConfig):
    """The plan's shards on Ray workers (the engines load there, not in this process)."""
    import os

    from tqdm.contrib.logging import logging_redirect_tqdm

    from demind.gen.job import IntentShardJob
    from demind.gen.ray_job import RayOptions, run_plan_on_ray

    options = RayOptions(workers=job.workers, address=job.ray_address or os.environ.get("RAY_ADDRESS") or None,
                         shard_attempts=job.shard_attempts)
    print(f"prompts {cfg.prompts.version}, mode {cfg.prompts.mode}; engine {cfg.engine.name}: {cfg.engine.model} "
          f"on Ray ({options.address or 'local cluster'})", flush=True)
    with logging_redirect_tqdm():
        return run_plan_on_ray(plan, cfg, options, IntentShardJob.load, show_progress=cfg.run.progress)


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when every selected shard is done, 1 if an input shard failed, 2 on bad usage or input."""
    return run_config_command(GenerateConfig, build_parser(), generate_command, argv)
