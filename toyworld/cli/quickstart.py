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

from pathlib import Path

from demind.cli.common import config_parser, run_config_command
from toyworld.pipeline import QuickstartConfig


def build_parser():
    return config_parser(QuickstartConfig, "demind-quickstart", __doc__.split("\n\n")[0],
                         config_help="YAML with QuickstartConfig keys (optional)")


def quickstart_command(cfg: QuickstartConfig) -> int:
    """Run the quickstart; print the tables, the toy CLIP's recall and where the files are."""
    from toyworld.clip_eval import format_backbone_report
    from toyworld.pipeline import run_quickstart

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
    return run_config_command(QuickstartConfig, build_parser(), quickstart_command, argv,
                              log_packages=("toyworld",))
