"""De-MINDS training recipes on the toy CIRR, each against mapping-only of the same checkpoint and Image+Text.

    python -m toyworld.lab.recipes --recipes default gate-lr query-scale both --seeds 0 1 2
    python -m toyworld.lab.recipes --recipes gate-lr --seeds 0 1 2 --ablations

Each recipe is the quickstart (``toyworld.pipeline.run_quickstart``, toy CIRR only) with its training
overrides in one shared workdir, so the shards, benchmark, toy CLIP and features are made once and
each recipe's runs are kept apart (their run folders carry a hash of the overrides). Prints, per
recipe, R@10 mean ± std over seeds of De-MINDS, mapping-only and Image+Text, tanh(gate), and per seed
the paired sign tests of De-MINDS vs mapping-only (same checkpoint) and vs Image+Text on the same
queries (``toyworld.results.paired_vs_demind``); ``--ablations`` adds the Table 5 variants, each
paired against the full model of its seed. Writes ``<workdir>/recipes.json``. ``--set KEY=VALUE ...``
changes the quickstart's settings (``QuickstartConfig``, e.g. ``backbone.steps=2``; a smaller world
for a smoke run); ``train_overrides`` is the recipe's and is added to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from demind.config import load_config
from demind.io import write_json_atomic
from toyworld.pipeline import QuickstartConfig, run_quickstart

RECIPES: dict[str, list[str]] = {
    "default": [],
    # 20x the toy recipe's lr (5e-4) on alpha alone: the schedule's cap on tanh(alpha) goes from 0.100 to 0.965
    "gate-lr": ["optim.gate_lr=1e-2"],
    "query-scale": ["model.query_scale=token_norm"],
    "both": ["optim.gate_lr=1e-2", "model.query_scale=token_norm"],
}


def recipe_summary(summary: dict) -> dict:
    """R@10 rows, tanh(gate) and the paired tests of one recipe's quickstart summary."""
    rows = {label: row["metrics"]["cirr:R@10"] for label, row in summary["rows"].items()
            if label in ("demind", "mapping-only", "image+text", "text-only", "image-only") or "[" in label}
    paired = {seed: {other: p["R@10"] for other, p in by_other.items() if other in ("mapping-only", "image+text")}
              for seed, by_other in summary["paired"].items()}
    return {"R@10": rows, "gate": summary["gate"], "paired_R@10": paired,
            "ablation_paired": summary.get("ablation_paired", {}), "timings_s": summary["timings_s"]}


def format_recipe(name: str, result: dict) -> str:
    lines = [f"[{name}]"]
    for label, (mean, std) in result["R@10"].items():
        lines.append(f"  {label:<28} R@10 {mean:5.1f} ± {std:.1f}")
    lines.append("  tanh(gate): " + ", ".join(f"{v} {', '.join(f'{g:.3f}' for g in by.values())}"
                                            for v, by in result["gate"].items()))
    for seed, by_other in result["paired_R@10"].items():
        cells = [f"vs {o} {p['only_demind']}:{p['only_other']} (p {p['p']:.2g})" for o, p in by_other.items()]
        lines.append(f"  seed {seed}: " + ", ".join(cells))
    for variant, by_seed in result["ablation_paired"].items():
        cells = [f"seed {s} {p['R@10']['only_full']}:{p['R@10']['only_variant']} (p {p['R@10']['p']:.2g})"
                 for s, p in by_seed.items()]
        lines.append(f"  full vs {variant}: " + ", ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--ablations", action="store_true", help="also the Table 5 variants of each recipe")
    parser.add_argument("--workdir", default="runs/recipes")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="settings",
                        help="QuickstartConfig overrides, e.g. backbone.steps=2 (train_overrides: added to the recipe's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out_path = Path(args.workdir) / "recipes.json"
    for name in args.recipes:
        base = load_config(QuickstartConfig, None, args.settings)
        cfg = dataclasses.replace(base, workdir=args.workdir, train_overrides=[*base.train_overrides, *RECIPES[name]],
                                  seeds=args.seeds, ablations=args.ablations, benchmarks=["cirr"],
                                  run=dataclasses.replace(base.run, progress=False))
        key = name + (" +ablations" if args.ablations else "")
        result = recipe_summary(run_quickstart(cfg)) | {"seeds": args.seeds, "overrides": RECIPES[name]}
        # read just before writing: another invocation may have added its recipes meanwhile
        results = json.loads(out_path.read_text()) if out_path.is_file() else {}
        results[key] = result
        write_json_atomic(out_path, results, indent=1)
        print(format_recipe(key, result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
