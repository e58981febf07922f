"""Retrieval of De-MINDS trained on noisy descriptions, per training mode (measurement b).

    python -m benchmarks.noise_retrieval --quickstart runs/quickstart --out runs/noise_retrieval
    python -m benchmarks.noise_retrieval --quickstart Q --out O --tiny     # minutes on a CPU

For every noise kind x rate x training mode x seed ("cell"): toy intent shards with that noise
(:mod:`toyworld.intent_data`; rate 0 is the clean shards, shared by every kind), their feature
cache, De-MINDS trained with ``training.noise.mode`` = the mode, and toy CIRR R@10 plus the
exclusion set's mAP@10 -- all with the quickstart's own pieces (``write_toy_shards``,
``build_features``, ``train_variant``, ``evaluate_run``) and the quickstart workdir's toy CLIP
and benchmarks (copied once; the source is only read).

Resumable: each finished cell is written to ``<out>/results.json`` atomically and skipped on a
rerun; a killed training resumes from its checkpoint. Prints mean ± std over seeds per (kind,
mode, rate), a paired sign test of each mode against mode none on the same toy-CIRR queries
(hit@10, per seed, over toy CIRR sets: :func:`demind.eval.paired_per_seed`), and writes
``<out>/noise_retrieval.png``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from benchmarks.noise_common import (MODES, TINY_TRAIN, NoiseBenchError, add_common_arguments,
                                     cell_config, copy_benchmarks, group_name, load_backbone, noisy_shards, parse_choices, parse_floats,
                                     source_config)

logger = logging.getLogger("noise_retrieval")

METRICS = (("cirr", "R@10"), ("exclusion", "mAP@10"))


def cell_key(kind: str, rate: float, mode: str, seed: int) -> str:
    return f"{group_name(kind, rate)}/{mode}/seed{seed}"


def run_cell(out: Path, cfg, backbone, log_scale: float, kind: str, rate: float, mode: str, seed: int,
             overrides: list[str], num_samples: int | None) -> dict[str, Any]:
    """Shards + cache (shared by the group), training and evaluation of one cell; its metrics."""
    from toyworld.pipeline import build_features, evaluate_run, train_variant

    shards = noisy_shards(out, cfg, kind, rate, num_samples)
    cell_cfg = cell_config(out, cfg, group_name(kind, rate), mode, overrides)
    build_features(cell_cfg, backbone, shards)
    export = train_variant(cell_cfg, backbone, "demind", seed, log_scale)
    results = evaluate_run(cell_cfg, backbone, export, "demind", seed, ("demind",))
    return {"kind": kind, "rate": rate, "mode": mode, "seed": seed, "export": str(export),
            "metrics": {f"{b}:{k}": results[b]["methods"]["demind"][k] for b, k in METRICS},
            "rankings": results["cirr"]["files"]["rankings"]["demind"]}


def paired_vs_none(cells: dict[str, Any], kind: str, rate: float, mode: str, seeds: list[int]) -> dict[str, Any] | None:
    """Mode vs none on the same toy-CIRR queries, hit@10, one test per seed (never counts summed over
    seeds): per-query differences averaged within each CIRR image set (its queries share their
    images: the set is the independent unit), exact sign test over sets
    (:func:`demind.eval.paired_per_seed`). Returns {seed: PairedTest as a dict}."""
    import json

    from demind.eval import paired_per_seed

    pairs = {s: (cells.get(cell_key(kind, rate, mode, s)), cells.get(cell_key(kind, rate, "none", s))) for s in seeds}
    if mode == "none" or not all(a and b for a, b in pairs.values()):
        return None
    hits_a, hits_b, units = {}, {}, {}
    for seed, (a, b) in pairs.items():
        ranked_a, ranked_b = (json.loads(Path(c["rankings"]).read_text()) for c in (a, b))
        root = Path(a["export"]).parents[3] / "benchmarks" / "cirr"
        captions = json.loads((root / "captions" / "cap.rc2.val.json").read_text())
        qids = [str(e["pairid"]) for e in captions if str(e["pairid"]) in ranked_a]
        entry = {str(e["pairid"]): e for e in captions}
        hits_a[seed] = [float(entry[q]["target_hard"] in ranked_a[q][:10]) for q in qids]
        hits_b[seed] = [float(entry[q]["target_hard"] in ranked_b.get(q, [])[:10]) for q in qids]
        units[seed] = [str(entry[q]["img_set"].get("id", sorted(entry[q]["img_set"]["members"]))) for q in qids]
    return {str(s): t.as_dict() for s, t in paired_per_seed(hits_a, hits_b, units, unit="set").items()}


def summarise(cells: dict[str, Any], kinds: list[str], rates: list[float], modes: list[str], seeds: list[int]
              ) -> dict[str, Any]:
    """(kind, mode, rate) -> metric -> (mean, std, n seeds), plus the paired test against none."""
    from toyworld.results import mean_std

    rows: dict[str, Any] = {}
    for kind in kinds:
        for mode in modes:
            for rate in rates:
                done = [cells[k] for s in seeds if (k := cell_key(kind, rate, mode, s)) in cells]
                if not done:
                    continue
                row = {m: (*mean_std([c["metrics"][m] for c in done]), len(done)) for m in (f"{b}:{k}" for b, k in METRICS)}
                row["paired_vs_none"] = paired_vs_none(cells, kind, rate, mode, seeds)
                rows[f"{kind}/{mode}/{rate:.2f}"] = row
    return rows


def format_table(rows: dict[str, Any], kinds: list[str], rates: list[float], modes: list[str]) -> str:
    lines = []
    for metric in (f"{b}:{k}" for b, k in METRICS):
        for kind in kinds:
            header = [f"{kind} noise, {metric}"] + [f"{rate:.0%}" for rate in rates]
            table = [header]
            for mode in modes:
                cells = []
                for rate in rates:
                    row = rows.get(f"{kind}/{mode}/{rate:.2f}")
                    if row is None:
                        cells.append("-")
                        continue
                    mean, std, n = row[metric]
                    text = f"{mean:.1f} ± {std:.1f}" + (f" (n={n})" if n < 2 else "")
                    paired = row["paired_vs_none"]
                    if metric.startswith("cirr") and paired:
                        text += " [" + "; ".join(f"s{k}: {t['better']}/{t['worse']} p {t['p_sign']:.2g}"
                                                 for k, t in sorted(paired.items())) + "]"
                    cells.append(text)
                table.append([mode, *cells])
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table] + [""]
    lines.append("mean ± std over seeds; [sN: a/b p] per seed, toy-CIRR sets where this mode's hit@10 (mean over "
                 "the set's queries) is above / below mode none's, exact sign test over sets")
    return "\n".join(lines)


def plot(rows: dict[str, Any], kinds: list[str], rates: list[float], modes: list[str], path: Path) -> Path | None:
    """Toy CIRR R@10 against the noise rate, one line per mode, one panel per noise kind."""
    from demind.plots import file_pyplot

    plt = file_pyplot("noise plot")
    if plt is None:
        return None
    from demind.io import atomic_path

    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for mode in modes:
            points = [(r * 100, rows[k]["cirr:R@10"]) for r in rates if (k := f"{kind}/{mode}/{r:.2f}") in rows]
            if points:
                ax.errorbar([p[0] for p in points], [p[1][0] for p in points], yerr=[p[1][1] for p in points],
                            marker="o", capsize=3, label=mode)
        ax.set_title(f"{kind} noise")
        ax.set_xlabel("noisy samples (%)")
        ax.set_ylabel("toy CIRR R@10 (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "64 samples, 3 steps, rates 0,0.5, seed 0: a smoke run")
    parser.add_argument("--rates", default="0,0.2,0.5,0.8", help="noise rates (or percentages)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"training modes, of {MODES}")
    parser.add_argument("--seeds", default="0,1,2")
    return parser


def main(argv: list[str] | None = None) -> int:
    from demind.io import write_json_atomic

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        kinds = parse_choices(args.kinds, "kinds", ("hard", "easy"))
        modes = parse_choices(args.modes, "modes", MODES)
        rates = parse_floats("0,0.5" if args.tiny and args.rates == "0,0.2,0.5,0.8" else args.rates, "rates")
        seeds = [int(s) for s in ("0" if args.tiny and args.seeds == "0,1,2" else args.seeds).split(",")]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = source_config(args.quickstart)
        cfg.run.progress = False
        backbone, log_scale = load_backbone(args.quickstart, cfg)
        copy_benchmarks(args.quickstart, out)
    except NoiseBenchError as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2
    overrides = [*(TINY_TRAIN if args.tiny else []), *args.train_override]
    num_samples = 64 if args.tiny and args.num_samples is None else args.num_samples
    results_path = out / "results.json"
    import json

    saved = json.loads(results_path.read_text()) if results_path.is_file() else {}
    cells: dict[str, Any] = saved.get("cells", {})
    for kind in kinds:
        for rate in rates:
            for mode in modes:
                for seed in seeds:
                    key = cell_key(kind, rate, mode, seed)
                    if key in cells:
                        continue  # finished (rate 0 is shared by every kind)
                    logger.info("cell %s", key)
                    cells[key] = run_cell(out, cfg, backbone, log_scale, kind, rate, mode, seed, overrides, num_samples)
                    write_json_atomic(results_path, {"cells": cells}, indent=2)
    rows = summarise(cells, kinds, rates, modes, seeds)
    table = format_table(rows, kinds, rates, modes)
    figure = plot(rows, kinds, rates, modes, out / "noise_retrieval.png")
    write_json_atomic(results_path, {"cells": cells, "rows": rows, "table": table, "plot": str(figure) if figure else None,
                                     "settings": {"kinds": kinds, "rates": rates, "modes": modes, "seeds": seeds,
                                                  "overrides": overrides, "num_samples": num_samples,
                                                  "quickstart": str(args.quickstart)}}, indent=2)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
