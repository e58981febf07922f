"""The quickstart's numbers: per-type recall, paired sign tests, the tables, results.json's sections and the plot.

Everything here reads evaluation outputs (rankings, caption files, the harness's results) and
formats them; nothing trains or evaluates a model (that is :mod:`toyworld.pipeline`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

from demind.io import atomic_path
from demind.plots import file_pyplot

logger = logging.getLogger(__name__)

# the headline metrics of each benchmark, the table's columns
HEADLINE = {"cirr": ("R@1", "R@5", "R@10"), "imagenet-r": ("average/R@10", "average/R@50"),
            "coco": ("R@1", "R@5", "R@10"), "exclusion": ("mAP@5", "mAP@10")}


def load_cirr_truth_and_rankings(cirr_root: Path, rankings: dict[str, str]
                                 ) -> tuple[list[dict[str, Any]], dict[str, dict[str, list[str]]]]:
    """(toy-CIRR caption entries, method -> query id -> top-50 names), each file read once."""
    captions = json.loads((cirr_root / "captions" / "cap.rc2.val.json").read_text())
    return captions, {method: json.loads(Path(path).read_text()) for method, path in rankings.items()}


def cirr_targets(captions: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Query id -> {its target image name}, from the toy-CIRR caption entries."""
    return {str(e["pairid"]): {e["target_hard"]} for e in captions}


def paired_recall(ranked_a: dict[str, list[str]], ranked_b: dict[str, list[str]], targets: dict[str, set[str]],
                  ks: tuple[int, ...], names: tuple[str, str]) -> dict[str, dict[str, float]]:
    """Two rankings of the same queries at each K: "R@k" -> {"only_<a>", "only_<b>", "p"}, the queries
    only one side hits and the exact sign-test p; ``names`` = (a, b)."""
    from demind.eval import paired_hits, sign_test_p

    out = {}
    for k in ks:
        only_a, only_b = paired_hits(ranked_a, ranked_b, targets, k)
        out[f"R@{k}"] = {f"only_{names[0]}": only_a, f"only_{names[1]}": only_b, "p": sign_test_p(only_a, only_b)}
    return out


def recall_by_type(captions: list[dict[str, Any]], ranked_by_method: dict[str, dict[str, list[str]]],
                   ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, dict[str, dict[str, float]]]:
    """method -> modification type -> {"R@k": percent, "n": count}, from the toy CIRR caption
    entries and each method's rankings (query id -> top-50 names)."""
    truth = {str(e["pairid"]): (e["target_hard"], e["toy_type"]) for e in captions}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for method, ranked in ranked_by_method.items():
        by_type: dict[str, list[float]] = {}
        for qid, names in ranked.items():
            target, kind = truth[str(qid)]
            # the rankings hold the top 50 only: a target outside them counts as a miss at every K
            rank = names.index(target) if target in names else math.inf
            by_type.setdefault(kind, []).append(rank)
            by_type.setdefault("all", []).append(rank)
        out[method] = {kind: {**{f"R@{k}": 100.0 * sum(r < k for r in ranks) / len(ranks) for k in ks},
                              "n": len(ranks)} for kind, ranks in sorted(by_type.items())}
    return out


def paired_vs_demind(captions: list[dict[str, Any]], ranked: dict[str, dict[str, list[str]]], ks: tuple[int, ...] = (5, 10)
            ) -> dict[str, dict[str, dict[str, float]]]:
    """De-MINDS against every other method on the same toy-CIRR queries:
    other method -> "R@k" -> {"only_demind", "only_other", "p"} (exact sign test)."""
    targets = cirr_targets(captions)
    return {other: paired_recall(ranked["demind"], ranked[other], targets, ks, ("demind", "other"))
            for other in ranked if other != "demind"}


# the query-time family's own comparisons (De-MINDS against each is in ``paired``): the hybrid against the
# description alone (what the trained query adds) and the one-call describer against the two-step one
FAMILY_PAIRS = (("demind+mllm", "osrcir"), ("osrcir", "cirevl"))


def family_paired(captions: list[dict[str, Any]], ranked: dict[str, dict[str, list[str]]], ks: tuple[int, ...] = (5, 10)
                  ) -> dict[str, dict[str, dict[str, float]]]:
    """"A vs B" -> "R@k" -> {"only_a", "only_b", "p"} for each pair of :data:`FAMILY_PAIRS` both ranked."""
    targets = cirr_targets(captions)
    return {f"{a} vs {b}": paired_recall(ranked[a], ranked[b], targets, ks, ("a", "b"))
            for a, b in FAMILY_PAIRS if a in ranked and b in ranked}


def format_family_paired(runs: dict[str, dict[int, dict[str, dict[str, Any]]]], k: int = 10) -> str:
    """Per seed, the family's pairs on toy CIRR at R@k: discordant queries and p."""
    lines = []
    for seed, benches in sorted(runs.get("demind", {}).items()):
        paired = benches.get("cirr", {}).get("family_paired")
        if paired:
            lines.append(f"  seed {seed}: " + ", ".join(f"{pair} {v[f'R@{k}']['only_a']}:{v[f'R@{k}']['only_b']} "
                                                       f"(p {v[f'R@{k}']['p']:.2g})" for pair, v in paired.items()))
    if not lines:
        return ""
    return (f"MLLM family, toy CIRR R@{k}, same queries: queries only the first hits : only the second hits "
            "(exact sign-test p)\n" + "\n".join(lines))


def deo_paired(ranked: dict[str, dict[str, list[str]]], targets: dict[str, set[str]], ks: tuple[int, ...],
                ap: bool) -> dict[str, dict[str, dict[str, float]]]:
    """Every ``X+deo`` method against its base X on the same queries:
    "X+deo" -> "AP@k" (per-query AP, mAP benchmarks) or "R@k" (hit) -> {"only_deo", "only_base", "p"}.
    ``only_*``: queries where that side is strictly better (AP) or alone in hitting (recall)."""
    from demind.eval import paired_ap, paired_hits, sign_test_p
    from demind.retrieval import split_deo_name

    out: dict[str, dict[str, dict[str, float]]] = {}
    for method in ranked:
        base, mode = split_deo_name(method)
        if mode is None or base not in ranked:
            continue
        out[method] = {}
        for k in ks:
            better, worse = (paired_ap if ap else paired_hits)(ranked[method], ranked[base], targets, k)
            out[method][f"{'AP' if ap else 'R'}@{k}"] = {"only_deo": better, "only_base": worse,
                                                       "p": sign_test_p(better, worse)}
    return out


def deo_touched(captions: list[dict[str, Any]], ranked: dict[str, dict[str, list[str]]]) -> dict[str, Any]:
    """How many toy-CIRR captions the rule decomposer flags (DEO changes only those queries),
    and, per ``+deo`` method, how many UNflagged queries got a ranking different from the
    base method's (0 by construction: their embedding is the base query, bit for bit)."""
    from demind.retrieval import split_deo_name
    from demind.negation import RuleDecomposer

    decomposed = RuleDecomposer().decompose([e["caption"] for e in captions])
    flagged = {str(e["pairid"]) for e, d in zip(captions, decomposed) if d.has_negation}
    changed = {}
    for method in ranked:
        base, mode = split_deo_name(method)
        if mode is not None and base in ranked:
            changed[method] = sum(ranked[method][q] != ranked[base][q] for q in ranked[base] if q not in flagged)
    kinds: dict[str, int] = {}
    for e in captions:
        if str(e["pairid"]) in flagged:
            kinds[e.get("toy_type", "?")] = kinds.get(e.get("toy_type", "?"), 0) + 1
    return {"queries": len(captions), "touched": len(flagged), "touched_by_type": kinds,
            "untouched_ranking_changed": changed}


def format_deo(runs: dict[str, dict[int, dict[str, dict[str, Any]]]]) -> str:
    """Per seed, each ``+deo`` method against its base: exclusion AP@10 and toy-CIRR R@10 pairs."""
    lines = []
    for seed, benches in sorted(runs.get("demind", {}).items()):
        for bench, key in (("exclusion", "AP@10"), ("cirr", "R@10")):
            paired = benches.get(bench, {}).get("deo_paired")
            if not paired:
                continue
            cells = [f"{m} {v[key]['only_deo']}:{v[key]['only_base']} (p {v[key]['p']:.2g})" for m, v in paired.items()]
            lines.append(f"  seed {seed} {bench} {key}: " + ", ".join(cells))
        touched = benches.get("cirr", {}).get("deo_touched")
        if touched:
            lines.append(f"  seed {seed} toy CIRR: DEO touches {touched['touched']} of {touched['queries']} queries "
                         f"{touched['touched_by_type']}; untouched queries with a changed ranking: "
                         f"{touched['untouched_ranking_changed']}")
    if not lines:
        return ""
    return ("DEO vs its base method, same queries: queries where +deo is better : where the base is better "
            "(exclusion: per-query AP@10; toy CIRR: hit@10; exact sign-test p)\n" + "\n".join(lines))


def ablation_paired(cirr_root: Path, runs: dict[str, dict[int, dict[str, dict[str, Any]]]],
                    ks: tuple[int, ...] = (5, 10)) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Every Table 5 variant against the full model of the same seed on the same toy-CIRR queries
    (the benchmark at ``cirr_root``): variant -> seed -> "R@k" -> {"only_full", "only_variant", "p"}
    (exact sign test). Empty without ablations."""
    full = runs.get("demind", {})
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for seed in sorted(full):
        files = {variant: by_seed[seed]["cirr"]["files"]["rankings"]["demind"] for variant, by_seed in runs.items()
                 if seed in by_seed and "cirr" in by_seed[seed]}
        if "demind" not in files or len(files) < 2:
            continue
        # each ranking read once: the full model's serves every variant of its seed
        captions, ranked = load_cirr_truth_and_rankings(cirr_root, files)
        targets = cirr_targets(captions)
        for variant in files.keys() - {"demind"}:
            out.setdefault(variant, {})[seed] = paired_recall(ranked["demind"], ranked[variant], targets, ks,
                                                              ("full", "variant"))
    return {variant: out[variant] for variant in runs if variant in out}  # in the order of runs (the variants')


def format_ablation_paired(paired: dict[str, dict[int, dict[str, dict[str, float]]]], k: int = 10) -> str:
    """Per variant, the full model against it on toy CIRR at R@k, seed by seed."""
    if not paired:
        return ""
    lines = [f"Table 5 variants vs the full De-MINDS of the same seed, toy CIRR R@{k}, same queries: queries only "
             "the full model hits : only the variant hits (exact sign-test p)"]
    for variant, by_seed in paired.items():
        cells = [f"seed {seed} {v[f'R@{k}']['only_full']}:{v[f'R@{k}']['only_variant']} (p {v[f'R@{k}']['p']:.2g})"
                 for seed, v in sorted(by_seed.items())]
        lines.append(f"  {variant}: " + ", ".join(cells))
    return "\n".join(lines)


def format_paired(runs: dict[str, dict[int, dict[str, dict[str, Any]]]], k: int = 10) -> str:
    """Per seed, De-MINDS vs each method on toy CIRR at R@k: discordant queries and p."""
    by_seed = runs.get("demind", {})
    lines = []
    for seed, benches in sorted(by_seed.items()):
        paired = benches.get("cirr", {}).get("paired")
        if not paired:
            continue
        cells = [f"{other} {v[f'R@{k}']['only_demind']}:{v[f'R@{k}']['only_other']} (p {v[f'R@{k}']['p']:.2g})"
                 for other, v in paired.items()]
        lines.append(f"  seed {seed}: " + ", ".join(cells))
    if not lines:
        return ""
    return (f"De-MINDS vs each method, toy CIRR R@{k}, same queries: queries only De-MINDS hits : only the "
            "other hits (exact sign-test p)\n" + "\n".join(lines))


def mean_std(values: list[float]) -> tuple[float, float]:
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: dict[str, dict[int, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """variant -> seed -> benchmark -> results  ==>  rows of mean ± std per (variant, method)."""
    rows: dict[str, dict[str, Any]] = {}
    for variant, by_seed in runs.items():
        seeds = sorted(by_seed)
        # every benchmark's methods, in order: the toy MLLM family runs on toy CIRR only
        methods = list(dict.fromkeys(m for results in by_seed[seeds[0]].values() for m in results["methods"]))
        for method in methods:
            label = method if variant == "demind" else f"{method} [{variant}]"
            row: dict[str, Any] = {"variant": variant, "method": method, "seeds": seeds, "metrics": {}}
            for bench, keys in HEADLINE.items():
                if bench not in by_seed[seeds[0]] or method not in by_seed[seeds[0]][bench]["methods"]:
                    continue  # the oracle only where the benchmark has target descriptions
                for key in keys:
                    values = [by_seed[s][bench]["methods"][method][key] for s in seeds]
                    row["metrics"][f"{bench}:{key}"] = mean_std(values)
            if method in by_seed[seeds[0]].get("cirr", {}).get("per_type", {}):
                types = by_seed[seeds[0]]["cirr"]["per_type"][method]
                row["per_type"] = {kind: {k: mean_std([by_seed[s]["cirr"]["per_type"][method][kind][k] for s in seeds])
                                          for k in ("R@1", "R@5", "R@10")} | {"n": types[kind]["n"]}
                                   for kind in types}
            rows[label] = row
    return rows


def format_quickstart_table(rows: dict[str, Any]) -> str:
    """Paper-style text table: one row per method (and ablation), mean ± std over seeds."""
    present = {c for r in rows.values() for c in r["metrics"]}
    columns = [f"{b}:{k}" for b, keys in HEADLINE.items() for k in keys if f"{b}:{k}" in present]
    header = ["method"] + [c.replace("average/", "") for c in columns]
    lines = [header]
    for label, row in rows.items():
        cells = [label]
        for c in columns:
            if c not in row["metrics"]:
                cells.append("-")  # not measured (the oracle without target descriptions)
                continue
            m, s = row["metrics"][c]
            cells.append(f"{m:.1f} ± {s:.1f}" if len(row["seeds"]) > 1 else f"{m:.1f}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [" | ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def format_per_type(rows: dict[str, Any]) -> str:
    """Toy CIRR R@10 per modification type, for the main variant's methods."""
    main = {k: r for k, r in rows.items() if r["variant"] == "demind" and "per_type" in r}
    if not main:
        return ""
    kinds = sorted({k for r in main.values() for k in r["per_type"]})
    lines = ["toy CIRR R@10 by modification type (n queries): " +
             ", ".join(f"{k} ({next(iter(main.values()))['per_type'][k]['n']})" for k in kinds)]
    for label, r in main.items():
        lines.append(f"  {label:<13} " + "  ".join(f"{k}={r['per_type'][k]['R@10'][0]:.1f}" for k in kinds))
    return "\n".join(lines)


def metrics_table(runs: dict[str, dict[int, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """results.json ``metrics``: benchmark -> method -> metric -> {"mean", "std", "per_seed"}
    (percent). Ablation variants appear as ``"demind [variant]"``, as in the table's rows."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, by_seed in runs.items():
        for seed, benches in sorted(by_seed.items()):
            for bench, results in benches.items():
                for method, metrics in results["methods"].items():
                    label = method if variant == "demind" else f"{method} [{variant}]"
                    for key, value in metrics.items():
                        if isinstance(value, (int, float)):
                            cell = out.setdefault(bench, {}).setdefault(label, {}).setdefault(key, {"per_seed": {}})
                            cell["per_seed"][seed] = value
    for by_method in out.values():
        for by_metric in by_method.values():
            for cell in by_metric.values():
                cell["mean"], cell["std"] = mean_std(list(cell["per_seed"].values()))
    return out


def per_type_metrics(runs: dict[str, dict[int, dict[str, dict[str, Any]]]]
                     ) -> dict[str, dict[str, dict[str, Any]]]:
    """results.json ``per_type``: toy-CIRR recall by modification type (``colour`` ... ``style``,
    ``implicit`` in World v2, ``multi``, ``all``): method -> type -> ``{"n": queries, "R@k":
    {"mean", "std", "per_seed"}}`` (percent), methods labelled as in :func:`metrics_table`."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, by_seed in runs.items():
        for seed, benches in sorted(by_seed.items()):
            for method, by_type in benches.get("cirr", {}).get("per_type", {}).items():
                label = method if variant == "demind" else f"{method} [{variant}]"
                for kind, values in by_type.items():
                    cell = out.setdefault(label, {}).setdefault(kind, {"n": values["n"]})
                    for key, value in values.items():
                        if key != "n":
                            cell.setdefault(key, {"per_seed": {}})["per_seed"][seed] = value
    for by_type in out.values():
        for cell in by_type.values():
            for key, value in cell.items():
                if key != "n":
                    value["mean"], value["std"] = mean_std(list(value["per_seed"].values()))
    return out


def plot_recall(rows: dict[str, Any], path: Path) -> Path | None:
    """Toy CIRR recall@K (K = 1, 5, 10) per method, mean over seeds, as a PNG."""
    plt = file_pyplot("recall plot")
    if plt is None:
        return None
    ks = (1, 5, 10)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, row in rows.items():
        if row["variant"] != "demind" or "cirr:R@1" not in row["metrics"]:
            continue
        means = [row["metrics"][f"cirr:R@{k}"][0] for k in ks]
        stds = [row["metrics"][f"cirr:R@{k}"][1] for k in ks]
        ax.errorbar(ks, means, yerr=stds, marker="o", capsize=3, label=label)
    ax.set_xlabel("K")
    ax.set_ylabel("Recall@K (%)")
    ax.set_title("toy CIRR")
    ax.set_xticks(ks)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")  # the tmp name has no .png for matplotlib to go by
    plt.close(fig)
    return path
