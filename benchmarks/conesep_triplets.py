"""ConeSep in its own protocol on the toy world: supervised training on noisy toy triplets, every noise
mode x rate x kind x seed, scored on the toy CIRR test (design: docs/lab-notes/2026-11-conesep-authors-forms.md;
the first design, before the authors' forms: docs/lab-notes/conesep-triplets.md).

    python -m benchmarks.conesep_triplets --workdir runs/conesep-authors

The toy data and backbone come from :func:`toyworld.triplets.write_toy_triplets` (the shipped toy CLIP
weights; no quickstart needed). At 0 % noise only ``--clean-modes`` train (default ``none``: the gate's
reference).

Writes toy triplets and the toy CIRR test once (:mod:`toyworld.triplets`), trains each run with
``demind-train-triplets``'s library (:func:`demind.triplets.train.train_triplets`), loads its checkpoint
as ``demind-eval`` does and scores it with ``demind-eval``'s own code (:func:`demind.eval.harness.score_group`).
Columns: mean ± std over seeds; AUROC of the mode's own noise detector against the injected noise
(``none``, ``rcl``: the per-triplet loss); kept: share of the last epoch's triplets in the contrastive loss;
Δloss: the training loss's relative fall over the last two epochs (largest over seeds; the plateau
evidence). Paired tests (:func:`demind.eval.paired_per_seed`): per query Avg_q = (hit@5 + hit_subset@1) / 2,
averaged within each toy CIRR set (its two queries share their images: the set is the independent
unit), exact sign test over sets, one test per seed, never counts summed over seeds.
Each run's results are kept (``runs/<kind>-<rate>/<mode>/seed<N>/eval.json``): a killed run resumes,
a rerun only aggregates. Outputs in the workdir: ``conesep_triplets.md`` (BENCHMARKS.md-ready),
``conesep_triplets.json``, ``conesep_triplets.png`` (Avg vs noise rate per mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from toyworld.results import mean_std

log = logging.getLogger("benchmarks.conesep_triplets")

MODES = ("none", "small-loss", "gfq", "rcl", "conesep", "conesep-nobtu", "conesep-nonbl", "conesep-nogfq")
GRID_MODES = ("none", "small-loss", "rcl", "conesep", "conesep-nobtu", "conesep-nonbl", "conesep-nogfq")
RATES = (0.0, 0.5, 0.8)
KINDS = ("easy", "hard", "tme")
GRID_KINDS = ("tme", "hard")
COMPARISONS = (("conesep", "small-loss"), ("conesep", "rcl"))  # the paper's claim; the new modules' worth
ABLATIONS = ("conesep-nobtu", "conesep-nonbl", "conesep-nogfq")


def mode_seeds(args, mode: str) -> list[int]:
    """The seeds a mode runs on: ``--ablation-seeds`` for the ablation rows when given (the budget rule of
    the design note), else ``--seeds``."""
    return args.ablation_seeds if mode in ABLATIONS and args.ablation_seeds else args.seeds


METRICS = ("R@1", "R@5", "R@10", "Rsubset@1", "Avg")


def conditions(rates, kinds) -> list[tuple[str, float]]:
    """(kind, rate) pairs to train; 0 % once (it is the same data for every kind), labelled easy."""
    out = [("easy", 0.0)] if 0.0 in rates else []
    return out + [(k, r) for k in kinds for r in rates if r > 0]


def run_dir(workdir: Path, kind: str, rate: float, mode: str, seed: int) -> Path:
    return workdir / "runs" / f"{kind}-{round(rate * 100)}" / mode / f"seed{seed}"


# --------------------------------------------------------------------------- test set


class TestSet:
    """The toy CIRR test read and encoded once: the group, its gallery matrix, image and text features."""

    def __init__(self, root: Path, backbone, cache_dir: Path) -> None:
        from demind.eval.harness import encode_benchmark_images, gallery_matrix, read_benchmark
        from demind.retrieval import ImageFeatureCache

        import torch.nn.functional as F

        self.data = read_benchmark("cirr", root, "val")
        self.group = self.data.groups[0]
        cache = ImageFeatureCache.for_backbone(cache_dir, backbone, "cirr", "val")
        self.features, _ = encode_benchmark_images(backbone, self.data, cache, 256, 0, False)
        self.gallery = gallery_matrix(self.group, self.features, backbone.device)
        texts = sorted({q.text for q in self.group.queries})
        pooled = F.normalize(backbone.encode_text(texts).pooled.float(), dim=-1)
        self.text_rows = dict(zip(texts, pooled))
        self.targets = {q.qid: q.targets[0] for q in self.group.queries}
        # the independent unit: a toy CIRR set (its two queries share the set's images)
        self.units = {q.qid: "|".join(sorted({*q.subset, q.reference.name})) for q in self.group.queries}


def score(model, backbone, test: TestSet) -> dict:
    """R@K, Rsubset@1, Avg and per-query hits of ``model`` on ``test`` (demind-eval's scoring)."""
    import torch

    from demind.retrieval import CombinerQuery

    class KnownTexts(CombinerQuery):  # the test's texts encoded once for all runs
        def _text_embeddings(self, texts):
            return torch.stack([test.text_rows[t] for t in texts])

    return score_method(KnownTexts(backbone, model), test)


def score_method(method, test: TestSet) -> dict:
    """R@K, Rsubset@1, Avg and per-query hits of any retrieval method on ``test`` (demind-eval's scoring):
    the record :func:`paired_tests` and the generated-triplets benchmark read."""
    from demind.eval.harness import score_group

    outcome = score_group(method, test.group, test.gallery, test.features, True, 512, False)
    m = {k: 100 * v for k, v in outcome.metrics.items()}
    m["Avg"] = (m["R@5"] + m["Rsubset@1"]) / 2
    hit5 = "".join("1" if test.targets[q] in r[:5] else "0" for q, r in outcome.rankings.items())
    sub1 = "".join("1" if outcome.subset_rankings[q][0] == test.targets[q] else "0" for q in outcome.rankings)
    return {"metrics": {k: round(v, 3) for k, v in m.items()}, "qids": list(outcome.rankings),
            "units": [test.units[q] for q in outcome.rankings], "hit5": hit5, "subset1": sub1}


# --------------------------------------------------------------------------- runs


def run_all(args) -> None:
    import torch

    from demind.backbone import build_backbone
    from demind.checkpoint import load_checkpoint
    from demind.config import load_config
    from demind.io import write_json_atomic
    from demind.triplets.config import TripletTrainConfig
    from demind.triplets.train import load_training_data, train_triplets
    from toyworld.triplets import write_toy_triplets

    torch.set_num_threads(args.threads)
    data_dir = args.workdir / "data"
    write_toy_triplets(data_dir, args.train_sets, args.test_sets, progress=False)
    base = load_config(TripletTrainConfig, data_dir / "train.yaml",
                       [f"optim.epochs={args.epochs}", "run.device=cpu", "run.progress=false", *args.set])
    backbone = build_backbone(base.backbone)
    test = TestSet(data_dir / "cirr", backbone, Path(base.data.cache_dir))
    todo = [(k, r) for k, r in conditions(args.rates, args.kinds)]
    total = sum(len(mode_seeds(args, m)) for _, r in todo for m in (args.clean_modes if r == 0 else args.modes))
    done = 0
    started = time.perf_counter()
    loaded: dict[tuple[str, float], object] = {}  # every mode's inputs (negated texts, pixel-noise pool), per cell
    # seed-major: each seed's whole grid before the next seed's, so a grid cut short still covers every cell
    for seed in sorted({s for _, r in todo for m in (args.clean_modes if r == 0 else args.modes)
                        for s in mode_seeds(args, m)}):
        for kind, rate in todo:
            cfg = replace(base, noise=replace(base.noise, rate=rate, kind=kind))
            for mode in (args.clean_modes if rate == 0 else args.modes):
                if seed not in mode_seeds(args, mode):
                    continue
                out = run_dir(args.workdir, kind, rate, mode, seed)
                done += 1
                if (out / "eval.json").is_file():
                    continue
                if (kind, rate) not in loaded:
                    loaded[kind, rate] = load_training_data(replace(cfg, robust=replace(cfg.robust, mode="conesep")),
                                                            backbone)
                data = loaded[kind, rate]
                run_cfg = replace(cfg, robust=replace(cfg.robust, mode=mode),
                                  run=replace(cfg.run, seed=seed, output_dir=str(out)))
                t0 = time.perf_counter()
                path = train_triplets(run_cfg, backbone, data)
                result = score(load_checkpoint(path, backbone), backbone, test)
                result["train_seconds"] = round(time.perf_counter() - t0, 2)
                curve = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                result["epochs"] = len(curve)
                result["loss_curve"] = [c["loss"] for c in curve]
                detection = json.loads((out / "detection.json").read_text())
                result["auroc"] = detection["auroc"]
                write_json_atomic(out / "eval.json", result)
                log.info("[%d/%d] %s %d%% %s seed %d: Avg %.2f (R@5 %.2f, Rsub@1 %.2f), AUROC %s, %.1fs "
                         "(%.0fs so far)", done, total, kind, round(rate * 100), mode, seed,
                         result["metrics"]["Avg"], result["metrics"]["R@5"], result["metrics"]["Rsubset@1"],
                         f"{result['auroc']:.3f}" if result["auroc"] is not None else "-",
                         result["train_seconds"], time.perf_counter() - started)


# --------------------------------------------------------------------------- aggregation


def load_result(workdir: Path, kind: str, rate: float, mode: str, seed: int) -> dict | None:
    kind = "easy" if rate == 0 else kind  # 0 % is trained once
    path = run_dir(workdir, kind, rate, mode, seed) / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else None


def last_kept(workdir: Path, kind: str, rate: float, mode: str, seed: int) -> float:
    """Share (%) of the last epoch's triplets the mode kept in the contrastive loss."""
    kind = "easy" if rate == 0 else kind
    lines = (run_dir(workdir, kind, rate, mode, seed) / "metrics.jsonl").read_text().splitlines()
    return 100 * json.loads(lines[-1])["kept"]


def per_query_avg(result: dict) -> list[float]:
    """Avg_q = (hit@5 + hit_subset@1) / 2 per query."""
    return [(int(a) + int(b)) / 2 for a, b in zip(result["hit5"], result["subset1"])]


def plateau(result: dict) -> float | None:
    """The training loss's relative fall over the last two epochs, (L[-3] - L[-1]) / |L[-1]|."""
    curve = result.get("loss_curve") or []
    return (curve[-3] - curve[-1]) / abs(curve[-1]) if len(curve) >= 3 and curve[-1] else None


def paired_tests(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Per seed, A vs B over toy CIRR sets (:func:`demind.eval.paired_per_seed`); seed -> PairedTest dict."""
    from demind.eval import paired_per_seed

    seeds = sorted(set(a) & set(b))
    for s in seeds:
        if a[s]["qids"] != b[s]["qids"]:
            raise ValueError("the two runs scored different queries")
    if not seeds:
        return {}
    tests = paired_per_seed({s: per_query_avg(a[s]) for s in seeds}, {s: per_query_avg(b[s]) for s in seeds},
                            {s: a[s]["units"] for s in seeds}, unit="set")
    return {s: t.as_dict() for s, t in tests.items()}


def cell_results(args, kind: str, rate: float, mode: str) -> dict[int, dict]:
    results = {s: load_result(args.workdir, kind, rate, mode, s) for s in mode_seeds(args, mode)}
    return {s: r for s, r in results.items() if r is not None}


def aggregate(args) -> dict:
    rows = []
    for kind, rate in conditions(args.rates, args.kinds):
        for mode in (args.clean_modes if rate == 0 else args.modes):
            results = cell_results(args, kind, rate, mode)
            if not results:
                continue
            row = {"kind": kind, "rate": rate, "mode": mode, "seeds": sorted(results)}
            for metric in METRICS:
                row[metric] = mean_std([r["metrics"][metric] for r in results.values()])
            row["kept"] = mean_std([last_kept(args.workdir, kind, rate, mode, s) for s in results])
            aurocs = [r["auroc"] for r in results.values() if r["auroc"] is not None]
            row["AUROC"] = mean_std(aurocs) if aurocs else None
            row["epochs"] = sorted({r.get("epochs") for r in results.values()}, key=str)
            falls = [f for r in results.values() if (f := plateau(r)) is not None]
            row["loss_fall_last2"] = max(falls, key=abs) if falls else None
            if mode != "none":
                row["vs_none"] = paired_tests(results, cell_results(args, kind, rate, "none"))
            for a, b in COMPARISONS:
                if mode == a:
                    row[f"vs_{b}"] = paired_tests(results, cell_results(args, kind, rate, b))
            rows.append(row)
    return {"rows": rows, "gate": gate(rows), "claim": claim(rows), "settings": {
        "train_sets": args.train_sets, "test_sets": args.test_sets, "epochs": args.epochs, "seeds": args.seeds,
        "ablation_seeds": args.ablation_seeds,
        "overrides": args.set}}


def find(rows, kind, rate, mode):
    return next((r for r in rows if r["kind"] == kind and r["rate"] == rate and r["mode"] == mode), None)


def gate(rows) -> dict | None:
    """`none` must lose >= 5 Avg points from 0 % to the strongest noise of the first kind, each std below a
    third of the loss."""
    clean = find(rows, "easy", 0.0, "none")
    noisy = [r for r in rows if r["mode"] == "none" and r["rate"] > 0]
    if clean is None or not noisy:
        return None
    worst = max(noisy, key=lambda r: (r["rate"], -r["Avg"][0]))
    drop = clean["Avg"][0] - worst["Avg"][0]
    spread = max(clean["Avg"][1], worst["Avg"][1])
    return {"avg_0": clean["Avg"], "noisy": f"{worst['kind']} {round(worst['rate'] * 100)} %",
            "avg_noisy": worst["Avg"], "drop": drop, "max_std": spread, "passed": drop >= 5 and spread < drop / 3}


def verdict(row: dict, other: dict | None, key: str) -> dict:
    """A comparison of ``row`` (conesep) against ``other``, decided as the design fixed it: the mean Avg
    is higher and at least two of the three per-seed sign tests over sets favour it at p < 0.05, none
    significantly against it."""
    tests = row.get(key) or {}
    favour = sum(t["p_sign"] < 0.05 and t["better"] > t["worse"] for t in tests.values())
    against = sum(t["p_sign"] < 0.05 and t["better"] < t["worse"] for t in tests.values())
    higher = other is not None and row["Avg"][0] > other["Avg"][0]
    return {"other": other["Avg"][0] if other else None, "tests": tests, "favour": favour, "against": against,
            "holds": bool(higher and favour >= 2 and against == 0)}


def claim(rows) -> list[dict]:
    """Per noisy cell: conesep vs small-loss (the paper's claim) and vs rcl (what GFQ, NBL, BTU add)."""
    out = []
    for row in rows:
        if row["mode"] != "conesep" or row["rate"] == 0:
            continue
        entry = {"kind": row["kind"], "rate": row["rate"], "conesep": row["Avg"][0]}
        for _, b in COMPARISONS:
            entry[b] = verdict(row, find(rows, row["kind"], row["rate"], b), f"vs_{b}")
        out.append(entry)
    return out


# --------------------------------------------------------------------------- reports


def fmt(ms) -> str:
    return "-" if ms is None else f"{ms[0]:.1f} ± {ms[1]:.1f}"


def seed_tests(tests: dict) -> str:
    """``s0: 120/80, p 0.006; s1: ...`` (sets better/worse, exact sign test), one clause per seed."""
    return "; ".join(f"s{seed}: {t['better']}/{t['worse']}, p {t['p_sign']:.2g}" for seed, t in sorted(tests.items()))


def markdown(summary: dict, command: str) -> str:
    lines = [f"`{command}`", ""]
    g = summary["gate"]
    if g is not None:
        lines += [f"**Gate** (`none`, 0 % -> {g['noisy']}): Avg {fmt(g['avg_0'])} -> {fmt(g['avg_noisy'])}, "
                  f"drop {g['drop']:.1f} points, largest seed std {g['max_std']:.1f}: "
                  f"**{'passed' if g['passed'] else 'FAILED'}** (needs >= 5 and std < drop / 3).", ""]
    lines += ["| noise | mode | R@1 | R@5 | R@10 | Rsub@1 | Avg | AUROC | kept % | epochs | Δloss last 2 ep |"
              " vs none per seed (sets better/worse, p) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        noise = "0 %" if row["rate"] == 0 else f"{row['kind']} {round(row['rate'] * 100)} %"
        auroc = "-" if row["AUROC"] is None else f"{row['AUROC'][0]:.3f}"
        fall = "-" if row.get("loss_fall_last2") is None else f"{100 * row['loss_fall_last2']:.1f} %"
        epochs = "/".join(str(e) for e in row.get("epochs", []))
        lines.append(f"| {noise} | {row['mode']} | {fmt(row['R@1'])} | {fmt(row['R@5'])} | {fmt(row['R@10'])} | "
                     f"{fmt(row['Rsubset@1'])} | {fmt(row['Avg'])} | {auroc} | {row['kept'][0]:.0f} | {epochs} | "
                     f"{fall} | {seed_tests(row.get('vs_none', {}))} |")
    lines += ["", "ConeSep against small-loss (the paper's claim) and against RCL alone (what GFQ, NBL and BTU add "
                  "to its robust loss); holds = higher mean Avg and at least two of three per-seed sign tests over "
                  "sets in its favour at p < 0.05, none against:", "",
              "| noise | conesep Avg | small-loss Avg | vs small-loss per seed | | rcl Avg | vs rcl per seed | |",
              "|---|---|---|---|---|---|---|---|"]
    num = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731 - a mode left out of the run
    for c in summary["claim"]:
        sl, rc = c["small-loss"], c["rcl"]
        lines.append(f"| {c['kind']} {round(c['rate'] * 100)} % | {num(c['conesep'])} | {num(sl['other'])} | "
                     f"{seed_tests(sl['tests'])} | **{'holds' if sl['holds'] else 'does not hold'}** | "
                     f"{num(rc['other'])} | {seed_tests(rc['tests'])} | "
                     f"**{'holds' if rc['holds'] else 'does not hold'}** |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    from demind.plots import file_pyplot

    plt = file_pyplot("ConeSep plot")
    if plt is None:
        return None
    # a panel per noise kind that has noisy rows; the 0 % reference (kind "easy") is drawn in each
    kinds = sorted({r["kind"] for r in summary["rows"] if r["rate"] > 0}, key=KINDS.index) or ["easy"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        for mode in MODES:
            rows = sorted([r for r in summary["rows"] if r["mode"] == mode and (r["kind"] == kind or r["rate"] == 0)],
                          key=lambda r: r["rate"])
            if rows:
                ax.errorbar([100 * r["rate"] for r in rows], [r["Avg"][0] for r in rows],
                            yerr=[r["Avg"][1] for r in rows], marker="o", capsize=3, label=mode)
        ax.set_title(f"{kind} noise")
        ax.set_xlabel("noisy triplets (%)")
        ax.set_ylabel("Avg(R@5, Rsubset@1) (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conesep_triplets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--train-sets", type=int, default=2500)
    parser.add_argument("--test-sets", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ablation-seeds", type=int, nargs="+", default=None,
                        help="seeds of the ablation rows (default: --seeds)")
    parser.add_argument("--modes", nargs="+", default=list(GRID_MODES), choices=MODES)
    parser.add_argument("--clean-modes", nargs="+", default=["none"], choices=MODES,
                        help="modes trained at 0 %% noise (the gate's reference)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--kinds", nargs="+", default=list(GRID_KINDS), choices=KINDS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--set", action="append", default=[], help="a training override (key=value), every run")
    parser.add_argument("--report-only", action="store_true", help="train nothing: the table of the runs already "
                                                                   "finished in the workdir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("demind", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not args.report_only:
        run_all(args)
    summary = aggregate(args)
    command = "python -m benchmarks.conesep_triplets " + " ".join(argv if argv is not None else sys.argv[1:])
    from demind.io import write_json_atomic, write_text_atomic

    write_json_atomic(args.workdir / "conesep_triplets.json", summary, indent=1)
    text = markdown(summary, command.strip())
    write_text_atomic(args.workdir / "conesep_triplets.md", text)
    plot(summary, args.workdir / "conesep_triplets.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
