"""ConeSep in its own protocol on the toy world: supervised training on noisy toy triplets, every noise
mode x rate x kind x seed, scored on the toy CIRR test (design: docs/lab-notes/conesep-triplets.md).

    python -m benchmarks.conesep_triplets --workdir runs/conesep-triplets

Writes toy triplets and the toy CIRR test once (:mod:`toyworld.triplets`), trains each run with
``demind-train-triplets``'s library (:func:`demind.triplets.train.train_triplets`), loads its checkpoint
as ``demind-eval`` does and scores it with ``demind-eval``'s own code (:func:`demind.eval.harness.score_group`).
Columns: mean ± std over seeds; AUROC of the mode's own noise detector against the injected noise
(``none``: the per-triplet loss); kept: share of the last epoch's triplets in the contrastive loss.
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

MODES = ("none", "small-loss", "gfq", "conesep", "conesep-nobtu")
RATES = (0.0, 0.2, 0.5, 0.8)
KINDS = ("easy", "hard")
METRICS = ("R@1", "R@5", "R@10", "Rsubset@1", "Avg")


def conditions(rates, kinds) -> list[tuple[str, float]]:
    """(kind, rate) pairs to train; 0 % once (it is the same data for both kinds), labelled easy."""
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


def score(model, backbone, test: TestSet) -> dict:
    """R@K, Rsubset@1, Avg and per-query hits of ``model`` on ``test`` (demind-eval's scoring)."""
    import torch

    from demind.eval.harness import score_group
    from demind.retrieval import CombinerQuery

    class KnownTexts(CombinerQuery):  # the test's texts encoded once for all runs
        def _text_embeddings(self, texts):
            return torch.stack([test.text_rows[t] for t in texts])

    outcome = score_group(KnownTexts(backbone, model), test.group, test.gallery, test.features, True, 512, False)
    m = {k: 100 * v for k, v in outcome.metrics.items()}
    m["Avg"] = (m["R@5"] + m["Rsubset@1"]) / 2
    hit5 = "".join("1" if test.targets[q] in r[:5] else "0" for q, r in outcome.rankings.items())
    sub1 = "".join("1" if outcome.subset_rankings[q][0] == test.targets[q] else "0" for q in outcome.rankings)
    return {"metrics": {k: round(v, 3) for k, v in m.items()}, "qids": list(outcome.rankings),
            "hit5": hit5, "subset1": sub1}


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
    total, done = len(todo) * len(args.modes) * len(args.seeds), 0
    started = time.perf_counter()
    for kind, rate in todo:
        cfg = replace(base, noise=replace(base.noise, rate=rate, kind=kind))
        data = None
        for mode in args.modes:
            for seed in args.seeds:
                out = run_dir(args.workdir, kind, rate, mode, seed)
                done += 1
                if (out / "eval.json").is_file():
                    continue
                data = data if data is not None else load_training_data(cfg, backbone)
                run_cfg = replace(cfg, robust=replace(cfg.robust, mode=mode),
                                  run=replace(cfg.run, seed=seed, output_dir=str(out)))
                t0 = time.perf_counter()
                path = train_triplets(run_cfg, backbone, data)
                result = score(load_checkpoint(path, backbone), backbone, test)
                result["train_seconds"] = round(time.perf_counter() - t0, 2)
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


def paired(a: dict, b: dict) -> tuple[int, int]:
    """Queries where A's Avg_q is above / below B's (same queries, same order)."""
    if a["qids"] != b["qids"]:
        raise ValueError("the two runs scored different queries")
    qa, qb = per_query_avg(a), per_query_avg(b)
    return sum(x > y for x, y in zip(qa, qb)), sum(x < y for x, y in zip(qa, qb))


def aggregate(args) -> dict:
    from demind.eval.metrics import sign_test_p

    rows = []
    for kind in args.kinds:
        for rate in args.rates:
            if rate == 0 and kind != args.kinds[0]:
                continue  # one 0 % row: the same runs for every kind
            for mode in args.modes:
                results = {s: load_result(args.workdir, kind, rate, mode, s) for s in args.seeds}
                results = {s: r for s, r in results.items() if r is not None}
                if not results:
                    continue
                row = {"kind": kind, "rate": rate, "mode": mode, "seeds": sorted(results)}
                for metric in METRICS:
                    row[metric] = mean_std([r["metrics"][metric] for r in results.values()])
                row["kept"] = mean_std([last_kept(args.workdir, kind, rate, mode, s) for s in results])
                aurocs = [r["auroc"] for r in results.values() if r["auroc"] is not None]
                row["AUROC"] = mean_std(aurocs) if aurocs else None
                if mode != "none":
                    tests = []
                    for s, r in results.items():
                        base = load_result(args.workdir, kind, rate, "none", s)
                        if base is not None:
                            better, worse = paired(r, base)
                            tests.append({"seed": s, "better": better, "worse": worse,
                                          "p": sign_test_p(better, worse)})
                    row["vs_none"] = tests
                    if tests:
                        better, worse = sum(t["better"] for t in tests), sum(t["worse"] for t in tests)
                        row["vs_none_summed"] = {"better": better, "worse": worse, "p": sign_test_p(better, worse)}
                if mode == "conesep":  # the claim's second baseline, paired the same way (seeds summed)
                    counts = [paired(r, base) for s, r in results.items()
                              if (base := load_result(args.workdir, kind, rate, "small-loss", s)) is not None]
                    if counts:
                        better, worse = sum(c[0] for c in counts), sum(c[1] for c in counts)
                        row["vs_small_loss_summed"] = {"better": better, "worse": worse,
                                                       "p": sign_test_p(better, worse)}
                rows.append(row)
    return {"rows": rows, "gate": gate(rows), "claim": claim(rows), "settings": {
        "train_sets": args.train_sets, "test_sets": args.test_sets, "epochs": args.epochs, "seeds": args.seeds,
        "overrides": args.set}}


def find(rows, kind, rate, mode):
    return next((r for r in rows if r["kind"] == kind and r["rate"] == rate and r["mode"] == mode), None)


def gate(rows) -> dict | None:
    """`none` must lose >= 5 Avg points from 0 % to 80 % easy noise, each seed std below a third of the loss."""
    clean, noisy = find(rows, "easy", 0.0, "none"), find(rows, "easy", 0.8, "none")
    if clean is None or noisy is None:
        return None
    drop = clean["Avg"][0] - noisy["Avg"][0]
    spread = max(clean["Avg"][1], noisy["Avg"][1])
    return {"avg_0": clean["Avg"], "avg_80_easy": noisy["Avg"], "drop": drop, "max_std": spread,
            "passed": drop >= 5 and spread < drop / 3}


def claim(rows) -> list[dict]:
    """Per kind at 50 and 80 %: conesep's mean Avg vs none's and small-loss's, and its paired test vs none."""
    out = []
    for row in rows:
        if row["mode"] != "conesep" or row["rate"] not in (0.5, 0.8):
            continue
        none = find(rows, row["kind"], row["rate"], "none")
        small = find(rows, row["kind"], row["rate"], "small-loss")
        out.append({"kind": row["kind"], "rate": row["rate"], "conesep": row["Avg"][0],
                    "none": none["Avg"][0] if none else None, "small_loss": small["Avg"][0] if small else None,
                    "vs_none": row.get("vs_none_summed"), "vs_small_loss": row.get("vs_small_loss_summed"),
                    "holds": bool(none and small and row["Avg"][0] > none["Avg"][0] and row["Avg"][0] > small["Avg"][0]
                                  and row.get("vs_none_summed", {}).get("p", 1) < 0.05
                                  and row["vs_none_summed"]["better"] > row["vs_none_summed"]["worse"])})
    return out


# --------------------------------------------------------------------------- reports


def fmt(ms) -> str:
    return "-" if ms is None else f"{ms[0]:.1f} ± {ms[1]:.1f}"


def markdown(summary: dict, command: str) -> str:
    lines = [f"`{command}`", ""]
    g = summary["gate"]
    if g is not None:
        lines += [f"**Gate** (`none`, 0 % -> 80 % easy): Avg {fmt(g['avg_0'])} -> {fmt(g['avg_80_easy'])}, "
                  f"drop {g['drop']:.1f} points, largest seed std {g['max_std']:.1f}: "
                  f"**{'passed' if g['passed'] else 'FAILED'}** (needs >= 5 and std < drop / 3).", ""]
    lines += ["| noise | mode | R@1 | R@5 | R@10 | Rsub@1 | Avg | AUROC | kept % | vs none per seed (better/worse, p) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        noise = "0 %" if row["rate"] == 0 else f"{row['kind']} {round(row['rate'] * 100)} %"
        tests = "; ".join(f"s{t['seed']}: {t['better']}/{t['worse']}, p {t['p']:.2g}" for t in row.get("vs_none", []))
        auroc = "-" if row["AUROC"] is None else f"{row['AUROC'][0]:.3f}"
        lines.append(f"| {noise} | {row['mode']} | {fmt(row['R@1'])} | {fmt(row['R@5'])} | {fmt(row['R@10'])} | "
                     f"{fmt(row['Rsubset@1'])} | {fmt(row['Avg'])} | {auroc} | {row['kept'][0]:.0f} | {tests} |")
    lines += ["", "ConeSep's claim (mean Avg above none and small-loss, and the paired test vs none favours it; "
                  "queries better/worse, three seeds' counts summed: the same queries thrice, not independent):", ""]
    for c in summary["claim"]:
        t = c["vs_none"] or {}
        num = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731 - a mode left out of the run
        u = c.get("vs_small_loss") or {}
        lines.append(f"- {c['kind']} {round(c['rate'] * 100)} %: conesep {num(c['conesep'])}, none {num(c['none'])}, "
                     f"small-loss {num(c['small_loss'])}; vs none {t.get('better')}/{t.get('worse')} "
                     f"(p {t.get('p', 1):.2g}), vs small-loss {u.get('better')}/{u.get('worse')} "
                     f"(p {u.get('p', 1):.2g}): **{'holds' if c['holds'] else 'does not hold'}**")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return None
    kinds = sorted({r["kind"] for r in summary["rows"]}, key=KINDS.index)
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
    axes[0][0].legend()
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
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--set", action="append", default=[], help="a training override (key=value), every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("demind", "accelerate"):
        logging.getLogger(name).setLevel(logging.WARNING)
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
