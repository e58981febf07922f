"""``demind-quickstart`` / ``python pipelines/quickstart.py``: the whole De-MINDS pipeline on the toy world, on a CPU.

    demind-quickstart                                 # one seed, all methods
    demind-quickstart seeds=[0,1,2] ablations=true
    demind-quickstart --config my.yaml backbone.steps=600 workdir=runs/qs2 run.progress=false

Generates the toy intent shards and benchmarks, trains (or reuses) the toy CLIP,
caches frozen features, trains De-MINDS with the trainer's code, evaluates every method
with the evaluation harness, prints the table and writes <workdir>/results.json,
<workdir>/recall_at_k.png and <workdir>/search.json (for ``demind-serve --quickstart``).
Everything is cached: a rerun only does what is missing.
The work happens in :func:`toyworld.pipeline.run_quickstart`.
"""

from __future__ import annotations

import argparse

from demind.cli.common import run_command
from demind.config import ConfigError

# spellings that are gone -> what to write instead (one error line says it)
OLD_SPELLINGS = {"--quiet": "use run.progress=false", "progress": "use run.progress",
                 "world": "remove it: the toy world has one version (World v2.1)"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demind-quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML with QuickstartConfig keys (optional)")
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # gone: named in its error
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. seeds=[0,1,2] backbone.steps=600")
    return parser


def check_old_spellings(args: argparse.Namespace) -> None:
    """A ConfigError naming the new key for the first old spelling among the arguments."""
    used = ["--quiet"] if args.quiet else []
    used += [o.split("=", 1)[0] for o in args.overrides]
    for old in used:
        leaf = old.rsplit(".", 1)[-1]
        if old in OLD_SPELLINGS or (leaf == "world" and old != "run.world"):
            key = old if old in OLD_SPELLINGS else "world"
            raise ConfigError(f"{old} is no longer a quickstart setting; {OLD_SPELLINGS[key]}", key=old)


def quickstart_command(args: argparse.Namespace) -> int:
    """Run the quickstart; print the tables, the toy CLIP's recall and where the files are."""
    from pathlib import Path

    from demind.config import load_config
    from toyworld.clip_eval import format_backbone_report
    from toyworld.pipeline import QuickstartConfig, run_quickstart

    check_old_spellings(args)
    cfg = load_config(QuickstartConfig, args.config, args.overrides)
    summary = run_quickstart(cfg)
    print()
    print(f"toy world {summary['world_version']}")
    print(summary["table"])
    for table in ("per_type_table", "paired_table", "deo_table", "ablation_table"):
        if summary.get(table):
            print()
            print(summary[table])
    print()
    print(format_backbone_report(summary["backbone"]))
    for variant, by_seed in summary["gate"].items():
        print(f"tanh(gate) [{variant}]: " + ", ".join(f"seed {s} {g:.3f}" for s, g in by_seed.items()))
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["timings_s"].items()))
    print(f"results: {Path(cfg.workdir) / 'results.json'}" + (f"\nplot: {summary['plot']}" if summary["plot"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), quickstart_command, argv)
