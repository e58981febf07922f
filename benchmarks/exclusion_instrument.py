"""ExclMM against CLIP, CLIP + DEO and its own ablations on the exclusion instrument.

    python -m benchmarks.exclusion_instrument --quickstart runs/quickstart --workdir runs/exclusion-instrument

The instrument (:mod:`toyworld.exclusion_instrument`): each query "A and B without C" has as many
hard negatives (A, B and C) as ground-truth images (A and B), so a method that ignores the
exclusion sits at exclusion AUC 0.5. The design, the decision rule and the results are in
docs/negation.md ("ExclMM on the exclusion instrument"); it was written before the first run.

* Backbone: the quickstart's toy CLIP (``--quickstart``: its run folder; the shipped weights are
  expanded there when missing, as the quickstart does), frozen.
* Methods: CLIP text-only; CLIP with the exclusion clause deleted from the query text; CLIP + DEO
  (rule decomposer, exact); and, trained on the instrument's train split (configs/exclmm/toy.yaml):
  F_theta on CLIP embeddings (no stage 1), stage 1 only (no stage-2 step), ExclMM in the paper's
  form (``PAPER_OVERRIDES``; the first two rows use it too) and ExclMM with the earlier variants
  (``EARLIER_OVERRIDES``, the defaults since this measurement). ``--diagnostics`` adds, post hoc,
  the paper's form with one part at a time swapped for its earlier variant. Seeds change
  every trained phase's initialisation and batches; the data is fixed.
* Metrics on the test split: the paper's eight, exclusion AUC and inclusion AUC
  (:func:`demind.eval.metrics.exclusion_aucs` and :func:`~demind.eval.metrics.mean_aucs`, as
  ``demind-eval --benchmark exclcoco`` reports them), mean ± std over seeds.
* Paired tests on the same queries, per seed (the largest p of the seeds is reported): exact sign
  test on per-query AP@5, Wilcoxon signed-rank test (scipy) on per-query exclusion and inclusion AUC.
* Gate: CLIP's inclusion AUC per label ("a photo of a <label>" against the test images showing
  the label) must be >= 0.8 for every label.

Writes ``<workdir>/table.md`` and ``<workdir>/results.json``; trained runs and features are
reused on a rerun. ``--instrument KEY=VALUE`` changes :class:`InstrumentConfig`, ``--set KEY=VALUE``
every ExclMM run's recipe (a smaller run for a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from demind.config import load_config
from demind.eval import load_exclcoco
from demind.eval import metrics as M
from demind.exclmm.config import EARLIER_OVERRIDES, PAPER_OVERRIDES
from demind.io import write_json_atomic, write_text_atomic
from demind.logs import setup_logging

log = logging.getLogger("exclusion_instrument")
ROOT = Path(__file__).resolve().parents[1]
TRAINED = {
    "F_θ on CLIP (no stage 1)": [*PAPER_OVERRIDES, "query.space=clip"],
    "stage 1 only": [*PAPER_OVERRIDES, "query.steps=0"],
    "ExclMM (paper's form)": PAPER_OVERRIDES,
    "ExclMM (earlier variants)": EARLIER_OVERRIDES,
}
# --diagnostics (added after the first run, not part of the design): the paper's form with one part
# swapped for its earlier variant, to see which part makes the difference
DIAGNOSTICS = {
    "paper, Eq. 12 dot": [*PAPER_OVERRIDES, "space.contrastive=dot"],
    "paper, image mask Top_t": [*PAPER_OVERRIDES, "space.image_mask=top_t"],
    "paper, Eq. 13 masked": [*PAPER_OVERRIDES, "space.reconstruct=masked"],
    "paper, Eq. 15 dot": [*PAPER_OVERRIDES, "query.contrastive=dot"],
    "paper, earlier triplet": [*PAPER_OVERRIDES, "query.triplet=gt-vs-positive"],
    "paper, w/o L_t": [*PAPER_OVERRIDES, "query.lambda_c=1.0"],
}
FIXED = ("CLIP text-only", "CLIP, clause deleted", "CLIP + DEO")
# (method, reference): the paired tests in the table; the first two decide the headline
COMPARISONS = (("ExclMM (paper's form)", "CLIP + DEO"), ("ExclMM (paper's form)", "F_θ on CLIP (no stage 1)"),
               ("ExclMM (paper's form)", "ExclMM (earlier variants)"), ("ExclMM (paper's form)", "stage 1 only"),
               ("ExclMM (earlier variants)", "CLIP + DEO"), ("F_θ on CLIP (no stage 1)", "CLIP + DEO"),
               ("CLIP + DEO", "CLIP text-only"), ("CLIP, clause deleted", "CLIP text-only"))
CUES = (" without ", " but not ", " with no ", " except for ")  # demind.exclcoco_builder.TEMPLATES' clauses
GATE = 0.8


def delete_exclusion_clause(text: str) -> str:
    """The query text up to its exclusion clause: "a photo of a dog without a cat" -> "a photo of a dog"."""
    for cue in CUES:
        if cue in text:
            return text.split(cue)[0]
    raise ValueError(f"no exclusion clause ({', '.join(c.strip() for c in CUES)}) in {text!r}")


def method_scores(method, texts: list[str], gallery: torch.Tensor) -> torch.Tensor:
    """(Q, N) scores of a retrieval method (demind.retrieval.methods) for text queries."""
    ref = torch.zeros(len(texts), gallery.shape[1])  # text methods read no reference image
    with torch.no_grad():
        q = method.embed(ref, texts, texts).float()
        return q @ method.map_gallery(gallery).float().T


def evaluate_scores(scores: torch.Tensor, truth: list[set[int]], hard: list[set[int]]) -> dict:
    """The eight metrics (means), and per query AP@5 and the two AUCs."""
    ranked = scores.topk(min(10, scores.shape[1]), dim=1).indices
    rel = M.relevance_matrix(ranked, truth)
    n_rel = torch.tensor([len(t) for t in truth])
    means = {k: 100 * v for k, v in M.exclusion_metrics(rel, n_rel).items()}
    aucs = M.exclusion_aucs(scores, truth, hard)  # demind-eval's ExclCOCO AUCs, averaged the same way
    per_query = {"AP@5": M.average_precision_at_k(rel, n_rel, 5).tolist(), **aucs}
    means.update(M.mean_aucs(aucs))
    return {"means": means, "per_query": per_query}


def label_gate(backbone, gallery: torch.Tensor, instances_path: Path, image_ids: list[str]) -> dict[str, float]:
    """CLIP's inclusion AUC per label: "a photo of a <label>" against the images showing it."""
    from demind.coco_files import INSTANCE_FIELDS, load_coco

    instances = load_coco(instances_path, INSTANCE_FIELDS)
    names = {c["id"]: c["name"] for c in instances["categories"]}
    row = {i: k for k, i in enumerate(image_ids)}
    shows: dict[str, set[int]] = {n: set() for n in names.values()}
    for a in instances["annotations"]:
        shows[names[a["category_id"]]].add(row[str(a["image_id"])])
    labels = sorted(shows)
    with torch.no_grad():
        text = F.normalize(backbone.encode_text([f"a photo of a {n}" for n in labels]).pooled.float(), dim=-1)
    scores = text @ gallery.T
    out = {}
    for k, n in enumerate(labels):
        pos = torch.zeros(gallery.shape[0], dtype=torch.bool)
        pos[sorted(shows[n])] = True
        out[n] = M.pairwise_auc(scores[k][pos], scores[k][~pos])
    return out


def paired(a: dict, b: dict) -> dict:
    """Sign test on per-query AP@5, Wilcoxon on per-query exclusion and inclusion AUC (a vs b)."""
    try:
        from scipy.stats import wilcoxon
    except ImportError as e:  # scipy is in the robust extra
        raise SystemExit("error: the Wilcoxon test needs scipy: pip install -e .[robust] (or pip install scipy)") from e

    ap_a, ap_b = a["per_query"]["AP@5"], b["per_query"]["AP@5"]
    better = sum(x > y for x, y in zip(ap_a, ap_b))
    worse = sum(x < y for x, y in zip(ap_a, ap_b))
    out = {"AP@5 better/worse": [better, worse], "AP@5 sign p": M.sign_test_p(better, worse)}
    for name in ("exclusion AUC", "inclusion AUC"):
        diff = [x - y for x, y in zip(a["per_query"][name], b["per_query"][name])]
        out[f"{name} diff"] = statistics.mean(diff)
        out[f"{name} Wilcoxon p"] = 1.0 if all(d == 0 for d in diff) else float(wilcoxon(diff).pvalue)
    return out


def gallery_features(backbone, files: dict, cache_dir: Path) -> torch.Tensor:
    """(N, D) normalised CLIP features of the test images, through the evaluation image cache."""
    from demind.retrieval import ImageFeatureCache, ImageRef, encode_image_refs

    cache = ImageFeatureCache.for_backbone(cache_dir, backbone, "exclusion-instrument", "test")
    raw, _ = encode_image_refs(backbone, [ImageRef(i, p) for i, p in files.items()], cache, "gallery", 256,
                               progress=False, desc="instrument test images")
    return F.normalize(torch.stack([raw[i] for i in files]).float(), dim=-1)


def train_variant(work: Path, name: str, seed: int, backbone, train_root: Path, settings: list[str],
                  own: list[str]) -> Path:
    """Train (or reuse) one ExclMM run; the frozen features are computed once and copied."""
    from demind.exclmm.train import train_exclmm
    from demind.exclmm.features import FEATURES_NAME
    from demind.exclmm.config import ExclMMConfig

    run = work / "train" / f"{''.join(c if c.isalnum() else '_' for c in name)}-seed{seed}"
    shared = work / "train" / FEATURES_NAME
    run.mkdir(parents=True, exist_ok=True)
    if shared.is_file() and not (run / FEATURES_NAME).is_file():
        shutil.copy(shared, run / FEATURES_NAME)
        shutil.copy(shared.with_suffix(".json"), run / shared.with_suffix(".json").name)
    cfg = load_config(ExclMMConfig, ROOT / "configs/exclmm/toy.yaml", [
        f"backbone.name={backbone.cfg.name}", f"backbone.pretrained={backbone.cfg.pretrained}",
        f"data.train={train_root}", f"data.cache_dir={work / 'feature_cache'}", f"run.output_dir={run}",
        f"run.seed={seed}", "run.progress=false", *settings, *own])  # the method's own settings win
    export = train_exclmm(cfg, backbone)
    if not shared.is_file():
        shutil.copy(run / FEATURES_NAME, shared)
        shutil.copy((run / FEATURES_NAME).with_suffix(".json"), shared.with_suffix(".json"))
    return export


def quickstart_config(folder: Path):
    """The QuickstartConfig of a finished quickstart run folder (its results.json), so its toy CLIP is
    reused as trained; without one, the default recipe (the shipped weights, expanded into it)."""
    from toyworld.pipeline import QuickstartConfig

    if (folder / "results.json").is_file():
        from benchmarks.noise_common import source_config

        return dataclasses.replace(source_config(folder), workdir=str(folder))
    log.info("%s has no results.json: the default toy CLIP (shipped weights) is set up there", folder)
    return QuickstartConfig(workdir=str(folder))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quickstart", default="runs/quickstart", help="the quickstart's run folder (its toy CLIP)")
    p.add_argument("--workdir", default="runs/exclusion-instrument")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--instrument", nargs="*", default=[], metavar="KEY=VALUE", help="InstrumentConfig overrides")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="settings",
                   help="ExclMMConfig overrides for every trained run (before the method's own)")
    p.add_argument("--trained", nargs="*", default=list(TRAINED), choices=list(TRAINED), metavar="METHOD",
                   help=f"trained rows to run (default all: {', '.join(TRAINED)}); the paired tests need "
                        "the rows they compare")
    p.add_argument("--diagnostics", action="store_true",
                   help="also the paper's form with one part swapped for its earlier variant (post hoc)")
    args = p.parse_args(argv)
    setup_logging(packages=("toyworld", log.name))
    torch.set_num_threads(1)
    from demind.exclmm import load_exclmm
    from demind.retrieval.methods import ExclMMQuery, build_methods
    from toyworld.exclusion_instrument import InstrumentConfig, write_instrument
    from toyworld.pipeline import prepare_backbone

    work = Path(args.workdir)
    root = write_instrument(work / "instrument", load_config(InstrumentConfig, None, args.instrument), progress=False)
    backbone, _, _ = prepare_backbone(quickstart_config(Path(args.quickstart)))
    data, files = load_exclcoco(root / "test")
    image_ids = list(files)
    row = {i: k for k, i in enumerate(image_ids)}
    truth = [{row[i] for i in q["ground_truth"]} for q in data["queries"]]
    hard = [{row[i] for i in q["hard_negatives"]} for q in data["queries"]]
    texts = [q["query"] for q in data["queries"]]
    gallery = gallery_features(backbone, files, work / "feature_cache")
    gate = label_gate(backbone, gallery, Path(data["source"]["instances"]), image_ids)

    text_only, deo = build_methods(["text-only", "text-only+deo"], backbone, None)
    fixed = {"CLIP text-only": evaluate_scores(method_scores(text_only, texts, gallery), truth, hard),
             "CLIP, clause deleted": evaluate_scores(
                 method_scores(text_only, [delete_exclusion_clause(t) for t in texts], gallery), truth, hard),
             "CLIP + DEO": evaluate_scores(method_scores(deo, texts, gallery), truth, hard)}
    runs: dict[str, list[dict]] = {name: [fixed[name]] * len(args.seeds) for name in FIXED}
    seconds: dict[str, list[float]] = {}
    trained = {**{n: TRAINED[n] for n in args.trained}, **(DIAGNOSTICS if args.diagnostics else {})}
    for name, own in trained.items():
        runs[name] = []
        for seed in args.seeds:
            started = time.perf_counter()
            export = train_variant(work, name, seed, backbone, root / "train", args.settings, own)
            seconds.setdefault(name, []).append(time.perf_counter() - started)
            method = ExclMMQuery(backbone, load_exclmm(export, backbone.identity))
            runs[name].append(evaluate_scores(method_scores(method, texts, gallery), truth, hard))
            log.info("%s seed %d: %s", name, seed, {k: round(v, 3) for k, v in runs[name][-1]["means"].items()})
    comparisons = tuple((a, b) for a, b in COMPARISONS if a in runs and b in runs) + tuple(
        (d, "ExclMM (paper's form)") for d in DIAGNOSTICS if d in runs and "ExclMM (paper's form)" in runs)
    tests = {f"{a} vs {b}": [paired(x, y) for x, y in zip(runs[a], runs[b])] for a, b in comparisons}
    table = format_report(runs, tests, gate, len(texts), len(image_ids), args.seeds, data)
    print(table)
    write_text_atomic(work / "table.md", table + "\n")
    summary = {"gate": gate, "seeds": args.seeds, "queries": len(texts), "images": len(image_ids),
               "means": {n: [r["means"] for r in rs] for n, rs in runs.items()}, "paired": tests,
               "train_seconds": seconds, "per_query": {n: [r["per_query"] for r in rs] for n, rs in runs.items()}}
    write_json_atomic(work / "results.json", summary, indent=1)
    return 0


def mean_sd(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


def format_report(runs: dict, tests: dict, gate: dict, n_queries: int, n_images: int, seeds: list[int],
                  data: dict) -> str:
    """Markdown: the gate, the metrics table, the paired tests."""
    gt = statistics.mean(len(q["ground_truth"]) for q in data["queries"])
    hn = statistics.mean(len(q["hard_negatives"]) for q in data["queries"])
    lines = [f"Exclusion instrument, test split: {n_queries} queries, {n_images} images, {gt:.1f} ground-truth "
             f"images and {hn:.1f} hard negatives per query; seeds {seeds}; mean ± std over seeds "
             "(CLIP rows are deterministic).", "",
             "Gate, CLIP's inclusion AUC per label (>= 0.8 needed): " + ", ".join(
                 f"{k} {v:.3f}" for k, v in gate.items()) + f" -> {'passed' if min(gate.values()) >= GATE else 'FAILED'}",
             ""]
    names = ["exclusion AUC", "inclusion AUC", *M.EXCLUSION_METRICS]
    lines += ["| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for method, rs in runs.items():
        cells = [mean_sd([r["means"][n] for r in rs], digits=3 if "AUC" in n else 1) for n in names]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Paired tests per seed (a vs b): AP@5 better/worse queries and sign-test p; mean per-query "
                  "difference and Wilcoxon p of exclusion and inclusion AUC; p = the largest over seeds.", "",
              "| a vs b | AP@5 better/worse | p | Δ excl. AUC | p | Δ incl. AUC | p |", "|---" * 7 + "|"]
    for name, per_seed in tests.items():
        bw = ", ".join(f"{t['AP@5 better/worse'][0]}/{t['AP@5 better/worse'][1]}" for t in per_seed)
        cells = [bw, f"{max(t['AP@5 sign p'] for t in per_seed):.1e}"]
        for m in ("exclusion AUC", "inclusion AUC"):
            cells += [f"{statistics.mean(t[f'{m} diff'] for t in per_seed):+.3f}",
                      f"{max(t[f'{m} Wilcoxon p'] for t in per_seed):.1e}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
