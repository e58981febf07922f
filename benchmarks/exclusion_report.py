"""The exclusion instrument's report (:mod:`benchmarks.exclusion_instrument`): held-out and
in-domain scores per seed, tables, paired tests at the combination unit, steps and loss curves.

A query's *held-out* value is the one of the fold whose held-out triple is the query's; its
*in-domain* value the mean over the folds that trained on its triple. Means are over queries;
paired tests (:func:`demind.eval.paired.paired_per_seed`) average a query's difference within its
(include, exclude) combination first and test across combinations, one test per seed.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from demind.eval.paired import paired_per_seed
from demind.io import atomic_path, write_json_atomic, write_text_atomic

log = logging.getLogger("exclusion_instrument")
METRICS = ("exclusion AUC", "inclusion AUC", "AP@1", "AP@5")
SPLITS = ("held-out", "in-domain")
# (a, b): the paired tests in the table; the first two decide the headline (the design note)
COMPARISONS = (("ExclMM (paper's form)", "CLIP + DEO"), ("ExclMM (paper's form)", "F_θ on CLIP (no stage 1)"),
               ("ExclMM (paper's form)", "stage 1 only"), ("ExclMM (paper's form)", "w/o L_t (L_c weight kept)"),
               ("ExclMM (paper's form)", "ExclMM (paper's form, τ 1)"),
               ("ExclMM (earlier variants)", "ExclMM (paper's form)"),
               ("F_θ on CLIP (no stage 1)", "CLIP + DEO"), ("CLIP + DEO", "CLIP text-only"))
TESTED = ("exclusion AUC", "inclusion AUC", "AP@5")


def assemble(by_run: dict, triples: list[int], folds: list[int], seed: int) -> dict[str, dict[str, list]]:
    """split -> metric -> per-query value or None (not in that split for the folds run), one seed.

    by_run: (fold, seed) -> metric -> Q values (a trained row's runs)."""
    out = {s: {m: [] for m in METRICS} for s in SPLITS}
    for q, triple in enumerate(triples):
        for m in METRICS:
            held = by_run.get((triple, seed)) if triple in folds else None
            out["held-out"][m].append(held[m][q] if held is not None else None)
            ins = [by_run[(f, seed)][m][q] for f in folds if f != triple and (f, seed) in by_run]
            out["in-domain"][m].append(statistics.fmean(ins) if ins else None)
    return out


def fixed_split(values: dict[str, list], triples: list[int], folds: list[int]) -> dict[str, dict[str, list]]:
    """An untrained row's per-query values on the queries each split holds (the same as a trained row's)."""
    return {"held-out": {m: [v if t in folds else None for v, t in zip(values[m], triples)] for m in METRICS},
            "in-domain": {m: [v if any(f != t for f in folds) else None for v, t in zip(values[m], triples)]
                          for m in METRICS}}


def mean_sd(values: list[float], digits: int) -> str:
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def seed_mean(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def paired_cell(a: dict, b: dict, combos: list, metric: str, split: str, seeds: list[int]) -> str:
    """Per seed: better/worse combinations and the sign-test p (Wilcoxon p in results.json)."""
    a_by, b_by, units = {}, {}, {}
    for s in seeds:
        if s not in a or s not in b:
            continue
        keep = [q for q, (x, y) in enumerate(zip(a[s][split][metric], b[s][split][metric]))
                if x is not None and y is not None]
        if keep:
            a_by[s] = [a[s][split][metric][q] for q in keep]
            b_by[s] = [b[s][split][metric][q] for q in keep]
            units[s] = [combos[q] for q in keep]
    if not a_by:
        return "—", {}
    tests = paired_per_seed(a_by, b_by, units, unit="combination")
    cell = "; ".join(f"{t.better}/{t.worse} of {t.n_units} (p {t.p_sign:.2g})" for _, t in sorted(tests.items()))
    return cell, {str(s): t.as_dict() for s, t in tests.items()}


def steps_summary(runs: dict) -> dict[str, dict]:
    """row -> phase -> (mean steps, min, max, how many stopped at the cap) over its runs' phases.json."""
    out: dict[str, dict] = {}
    for name, by_run in runs.items():
        phases: dict[str, list] = {}
        for run in by_run.values():
            path = Path(run) / "phases.json"
            if path.is_file():
                for phase, rec in json.loads(path.read_text())["phases"].items():
                    phases.setdefault(phase, []).append(rec)
        out[name] = {p: {"mean": statistics.fmean(r["steps"] for r in recs), "min": min(r["steps"] for r in recs),
                         "max": max(r["steps"] for r in recs), "runs": len(recs),
                         "at cap": sum(r["stopped"] == "cap" for r in recs)} for p, recs in phases.items()}
    return out


def plot_curves(work: Path, runs: dict) -> list[Path]:
    """``curves/<row>.png``: total loss per logged step of each phase, one line per (fold, seed)."""
    from demind.plots import file_pyplot

    plt = file_pyplot("loss curves")
    if plt is None:
        return []
    written = []
    for name, by_run in runs.items():
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
        for (fold, seed), run in sorted(by_run.items()):
            rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
            for ax, phase in zip(axes, ("sae", "space", "query")):
                pts = [(r["phase_step"], r["loss"]) for r in rows if r["phase"] == phase]
                if pts:
                    ax.plot(*zip(*pts), linewidth=0.8, label=f"fold {fold} seed {seed}")
        for ax, phase in zip(axes, ("sae", "space", "query")):
            ax.set_title(phase, fontsize=9)
            ax.set_xlabel("phase step")
            ax.set_yscale("log")  # the first window's loss is many times the last one's
        axes[0].set_ylabel("loss (mean of the logged window)")
        axes[2].legend(fontsize=6)
        fig.suptitle(name, fontsize=10)
        fig.tight_layout()
        out = work / "curves" / f"{''.join(c if c.isascii() and c.isalnum() else '_' for c in name)}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
        plt.close(fig)
        written.append(out)
    return written


def write_report(work: Path, *, fixed: dict, trained: dict, runs: dict, combos: list, triples: list[int],
                 folds: list[int], seeds: list[int], gate: dict, gate_min: float, missing: list[str],
                 n_images: int, data: dict) -> str:
    """Write ``table.md``, ``results.json`` and the curves; returns the markdown."""
    rows: dict[str, dict] = {n: {s: fixed_split(v, triples, folds) for s in seeds} for n, v in fixed.items()}
    for name, by_run in trained.items():
        rows[name] = {s: assemble(by_run, triples, folds, s) for s in seeds if any(k[1] == s for k in by_run)}
    held_combos = sorted({c for c, t in zip(combos, triples) if t in folds})
    lines = [f"Exclusion instrument, test split: {len(triples)} queries over {len(set(combos))} (include, exclude) "
             f"combinations, {n_images} images. Folds (held-out triples): {folds}, so {len(held_combos)} held-out "
             f"combinations; seeds {seeds}. Mean ± std over seeds of the per-seed means over queries (CLIP rows "
             "are deterministic).", "",
             "Gate, CLIP's inclusion AUC per label (>= 0.8 needed): " + ", ".join(
                 f"{k} {v:.3f}" for k, v in gate.items()) + f" -> {'passed' if min(gate.values()) >= gate_min else 'FAILED'}"]
    if missing:
        lines += ["", "Not run (left out of every table): " + "; ".join(missing)]
    summary: dict = {"folds": folds, "seeds": seeds, "gate": gate, "missing": missing, "means": {}, "paired": {}}
    for split in SPLITS:
        lines += ["", f"### {split}", "", "| method | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
        for name, by_seed in rows.items():
            means = {m: [x for x in (seed_mean(by_seed[s][split][m]) for s in by_seed) if x is not None] for m in METRICS}
            summary["means"].setdefault(split, {})[name] = means
            lines.append(f"| {name} | " + " | ".join(mean_sd(means[m], 3 if "AUC" in m else 1) for m in METRICS) + " |")
        lines += ["", f"Paired, {split}, per seed: combinations where a is above / below b (sign-test p).", "",
                  "| a vs b | " + " | ".join(TESTED) + " |", "|---" * (len(TESTED) + 1) + "|"]
        for a, b in COMPARISONS:
            if a in rows and b in rows:
                cells = []
                for m in TESTED:
                    cell, tests = paired_cell(rows[a], rows[b], combos, m, split, seeds)
                    cells.append(cell)
                    summary["paired"].setdefault(split, {}).setdefault(f"{a} vs {b}", {})[m] = tests
                lines.append(f"| {a} vs {b} | " + " | ".join(cells) + " |")
    steps = steps_summary(runs)
    summary["steps"] = steps
    lines += ["", "Steps per phase (plateau rule; mean, min-max over runs; runs stopped at the cap):", "",
              "| row | sae | space | query |", "|---|---|---|---|"]
    for name, phases in steps.items():
        cells = [f"{p['mean']:.0f} ({p['min']}-{p['max']}; {p['at cap']}/{p['runs']} at cap)" if (p := phases.get(ph))
                 else "—" for ph in ("sae", "space", "query")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    curves = plot_curves(work, runs)
    summary["curves"] = [str(p.relative_to(work)) for p in curves]
    summary["per_query"] = {n: {str(s): v for s, v in by_seed.items()} for n, by_seed in rows.items()}
    table = "\n".join(lines)
    write_text_atomic(work / "table.md", table + "\n")
    write_json_atomic(work / "results.json", summary, indent=1)
    return table
