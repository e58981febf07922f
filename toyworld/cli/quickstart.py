"""``demind-quickstart`` / ``python pipelines/quickstart.py``: the whole De-MINDS pipeline on the toy world, on a CPU.

    demind-quickstart                                 # one seed, all methods
    demind-quickstart seeds=[0,1,2] ablations=true
    demind-quickstart run.seed=1 'train_overrides=[optim.max_steps=500,optim.lr=1e-4]'
    demind-quickstart --config my.yaml backbone.steps=600 workdir=runs/qs2 run.progress=false
    demind-quickstart mllm.p_ignore=0.4 mllm.p_drop=0.2 mllm.p_garble=0.1   # a noisier toy MLLM

Generates the toy intent shards and benchmarks, trains (or reuses) the toy CLIP,
caches frozen features, trains De-MINDS with the trainer's code, evaluates every method
with the evaluation harness (and the query-time MLLM family on the toy CIRR through the toy MLLM), prints the table and writes <workdir>/results.json,
<workdir>/recall_at_k.png and <workdir>/search.json (for ``demind-serve --quickstart``).
Everything is cached: a rerun only does what is missing (``reevaluate=true`` evaluates again).
At the end it prints the checkpoint, the result files and the search commands to try.
The work happens in :func:`toyworld.pipeline.run_quickstart`.
"""

from __future__ import annotations

import shlex
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
    if summary.get("toy_mllm"):
        print(toy_mllm_line(summary["toy_mllm"]))
    for table in ("per_type_table", "paired_table", "family_table", "deo_table", "ablation_table"):
        if summary.get(table):
            print()
            print(summary[table])
    print()
    print(format_backbone_report(summary["backbone"]))
    for variant, by_seed in summary["gate"].items():
        print(f"tanh(gate) [{variant}]: " + ", ".join(f"seed {s} {g:.3f}" for s, g in by_seed.items()))
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["timings_s"].items()))
    print()
    print(next_steps(cfg, summary))
    return 0


def toy_mllm_line(toy: dict) -> str:
    """The toy MLLM's noise model under the table: what the family's rows were described by."""
    noise = ", ".join(f"{k} {v:g}" for k, v in toy["noise"].items())
    answers = ", ".join(f"{k} {v}" for k, v in toy["outcomes"].items())
    return (f"{', '.join(toy['methods'])}: toy CIRR only, descriptions from the toy MLLM (toyworld/describer.py) "
            f"with {noise} (mllm.*); its answers: {answers}")


def next_steps(cfg: QuickstartConfig, summary: dict) -> str:
    """The files a user opens next and the search commands to try on the trained model."""
    workdir = Path(cfg.workdir)
    rows = [("checkpoint", summary.get("checkpoint")), ("results", str(workdir / "results.json")),
            ("recall plot", summary.get("plot")), ("training curves", summary.get("training_plot"))]
    lines = ["files:"] + [f"  {name + ':':<17}{path}" for name, path in rows if path]
    checkpoint, example = summary.get("checkpoint"), summary.get("search_example")
    if checkpoint:
        index = workdir / "search-index"
        lines += ["try search:",
                  f"  demind-serve --quickstart {workdir}      # the search page on http://127.0.0.1:8000/",
                  f"  demind-index --images {workdir / 'benchmarks' / 'cirr' / 'dev'} --index {index} "
                  f"--checkpoint {checkpoint}"]
        if example:
            lines.append(f"  demind-search --index {index} --checkpoint {checkpoint} --image {example['image']} "
                         f"--text {shlex.quote(example['text'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(QuickstartConfig, build_parser(), quickstart_command, argv,
                              log_packages=("toyworld",))
