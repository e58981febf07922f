r"""``demind-generate`` / ``python data_gen/run.py``: turn image-caption shards into intent shards
(T_rew, T_int) with a multimodal LLM.

    demind-generate --input /data/cc3m --output /data/intent-cc3m --shard 0-99 \
        --config configs/data_gen/llava-1.6-7b.yaml [engine.tensor_parallel_size=2 ...]

Rerunning the same command skips finished shards and redoes interrupted ones.
Schema of the input and output shards: shards/README.md.
"""

from __future__ import annotations

import argparse

from demind.cli.common import run_command
from demind.config import to_dict
from demind.gen.config import GenConfig


def config_keys_help() -> str:
    """Every config key with its default, for --help (meanings: demind/gen/config.py)."""
    lines = ["config keys (KEY=VALUE overrides or YAML; meanings in demind/gen/config.py), with defaults:"]
    for section, values in to_dict(GenConfig()).items():
        lines += [f"  {section}.{key} = {value}" for key, value in values.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="demind-generate",
        description=__doc__,
        epilog=config_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", required=True,
                        help="folder of input .tar shards (img2dataset layout: KEY.jpg, KEY.txt, KEY.json) "
                             "or a brace pattern such as '/data/cc3m/{00000..00331}.tar'")
    parser.add_argument("--output", required=True,
                        help="folder for the intent shards: one NNNNN.tar and NNNNN_stats.json per input shard")
    parser.add_argument("--shard", default=None,
                        help="input shard ids to process, inclusive ranges and lists: '0-99', '0-9,20-29', '7' "
                             "(default: every shard in --input). Give each process or node a disjoint range.")
    parser.add_argument("--config", default=None,
                        help="YAML config, e.g. configs/data_gen/llava-1.6-7b.yaml (default: built-in defaults)")
    parser.add_argument("--overwrite", action="store_true",
                        help="redo selected shards even if their stats file says they are done")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit without loading a model")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. engine.name=transformers engine.model=/path "
                             "sampling.temperature=0.2 prompts.mode=single")
    return parser


def generate_command(args: argparse.Namespace) -> int:
    """0 when every selected shard is done, 1 if an input shard failed."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from demind.config import load_config
    from demind.gen.config import validate_config
    from demind.gen.engines import build_engine
    from demind.gen.job import format_job_summary, run_plan
    from demind.gen.prompts import load_prompts
    from demind.gen.plan import format_plan, make_plan
    from demind.io import check_output_dir

    cfg = load_config(GenConfig, args.config, args.overrides)
    validate_config(cfg)
    plan = make_plan(args.input, args.output, args.shard, args.overwrite)
    print(format_plan(plan), flush=True)
    if args.dry_run or not plan.todo:
        print("nothing to do" if not plan.todo else "dry run: stopping before loading the model")
        return 0
    if args.no_progress:  # also the weight-loading bars of transformers / huggingface_hub
        from demind.gen.engines import disable_loading_progress

        disable_loading_progress()
    check_output_dir(args.output)  # before the model loads: a read-only or full disk fails in seconds
    prompts = load_prompts(cfg.prompts.version)
    engine = build_engine(cfg.engine, cfg.sampling)
    print(f"engine {engine.name}: {engine.model_id}; prompts {prompts.version} ({prompts.sha}), mode {cfg.prompts.mode}",
          flush=True)
    with logging_redirect_tqdm():  # log lines print above the progress bars instead of through them
        summary = run_plan(plan, cfg, engine, prompts, show_progress=not args.no_progress)
    print(format_job_summary(summary))
    return 1 if summary.failed else 0


def main(argv: list[str] | None = None) -> int:
    """Returns 0 when every selected shard is done, 1 if an input shard failed, 2 on bad usage or input."""
    # intermixed: overrides may come before or after the flags
    return run_command(build_parser(), generate_command, argv, intermixed=True)
