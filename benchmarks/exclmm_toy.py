"""ExclMM vs CLIP text-only on the toy ExclCOCO, with the paper's cheap Table 2 ablations.

    python -m benchmarks.exclmm_toy --backbone-dir runs/quickstart/backbone --workdir runs/exclmm --seeds 0 1 2

Design (written before measuring):
* Data: the toy ExclCOCO (toyworld/benchmarks.py, defaults: 3,000 train / 1,000 test images,
  labels = the 8 shapes); ExclMM trains on the train split only, everything is scored on test.
* Backbone: the quickstart's toy CLIP (read only), frozen.
* Methods: CLIP text-only (the exclusion query text through the text tower; deterministic, so
  its std over seeds is 0), ExclMM (configs/exclmm/toy.yaml) and its variants: without L_t
  (lambda_c = 1), without L_c (lambda_c = 0), without the z_c mask (Top_t only), CLIP embeddings
  without stage 1 (F_theta on CLIP text embeddings), and stage 1 alone (no stage-2 steps: F_theta
  is the identity). "w/o L_t" drops L_t at L_c's own weight (``query.lambda_t=0``); the earlier
  lambda_c = 1, which also doubled L_c's weight, is the row "w/o L_t (L_c weight doubled)". Text-only+DEO (demind.negation: rule decomposer, exact DEO; training-free and
  deterministic) is added as a row next to CLIP text-only.
* Seeds 0, 1, 2 change initialisation and batch order of every phase; the data is fixed.
* Metrics: the eight of the paper's Table 1 (demind/eval/metrics.py), mean ± std over seeds.
  Paired test vs CLIP on the same queries, per seed (:mod:`demind.eval.paired`): sign test on
  AP@5 over (include, exclude) label combinations, a query's difference averaged within its
  combination first (the queries of one combination share their ground truth; counted one by one
  they overstate significance).
* Not changed since it was measured: every phase runs its fixed steps at the recipe's
  temperatures (``--set stop.window=200 ...`` for the plateau rule; see the exclusion instrument,
  which supersedes this table).
Writes ``<workdir>/table.md`` and ``<workdir>/results.json``; ``<workdir>/recipe.json`` records
what the workdir was made from, and a rerun with other settings is refused. ``--bench KEY=VALUE`` changes the toy
ExclCOCO (``ToyBenchmarkConfig``, e.g. ``exclcoco_test_images=40``) and ``--set KEY=VALUE`` the
ExclMM recipe of every run (``configs/exclmm/toy.yaml``): a smaller run for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig
from benchmarks.exclusion_instrument import copy_atomic
from demind.cli.common import add_debug_option, report_error
from demind.config import ConfigError, load_config
from demind.config_checks import check_output_key
from demind.errors import DemindError, MissingInputError
from demind.eval.paired import paired_by_unit
from demind.io import write_json_atomic, write_text_atomic
from demind.eval import evaluate, load_exclcoco
from demind.eval import metrics as M
from demind.exclmm import load_exclmm
from demind.exclmm.config import PAPER_OVERRIDES, ExclMMConfig
from demind.exclmm.train import train_exclmm
from demind.exclmm.features import FEATURES_NAME
from demind.logs import setup_logging
from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmarks
from toyworld.clip_config import TOY_CLIP_CONFIG, ToyBackboneConfig
from toyworld.clip_cache import with_modality_gap

log = logging.getLogger("exclmm_toy")
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "ExclMM": [],
    "ExclMM (paper's form)": PAPER_OVERRIDES,  # Eq. 12/15 normalised, z_c OR Top_t image mask, Eq. 16 as written
    "w/o L_t": ["query.lambda_t=0"],
    "w/o L_t (L_c weight doubled)": ["query.lambda_c=1.0"],
    "w/o L_c": ["query.lambda_c=0.0"],
    "w/o z_c mask": ["space.zc_mask=false"],
    "CLIP emb. w/o stage 1": ["query.space=clip"],
    "stage 1 only": ["query.steps=0"],
}


def toy_clip_report(folder: Path) -> dict:
    """The newest finished toy CLIP's report in ``folder`` (a report names its ``weights``; the
    modality gap's ``*-model.json`` configs beside them are not reports)."""
    reports = [p for p in sorted(folder.glob("toy-clip-*.json"), key=lambda p: p.stat().st_mtime)  # newest last
               if not p.name.endswith("-model.json")]
    if not reports:
        raise MissingInputError(f"--backbone-dir {folder}: no trained toy CLIP there (a toy-clip-*.json report marks "
                                "a finished one); give the quickstart's backbone folder")
    return json.loads(reports[-1].read_text())


def load_toy_backbone(folder: Path, gap: float) -> FrozenCLIP:
    """The toy CLIP as the quickstart loads it: its trained weights, extended by the modality gap."""
    report = toy_clip_report(folder)
    model_config = report.get("config", {}).get("model_config", TOY_CLIP_CONFIG)  # as it was trained
    weights, config = with_modality_gap(ToyBackboneConfig(model_config=model_config, modality_gap=gap),
                                        Path(report["weights"]))
    return FrozenCLIP(BackboneConfig(name=str(config), pretrained=str(weights)))


def combinations(data: dict) -> dict[str, tuple]:
    """Query id -> its (include, exclude) label combination: the unit of the paired tests."""
    return {str(q["id"]): (tuple(sorted(q["include"])), q["exclude"]) for q in data["queries"]}


def sign_vs(ap: dict[str, float], reference: dict[str, float], combos: dict[str, tuple]) -> tuple[int, int, float]:
    """(combinations better, worse, sign-test p) of ``ap`` against ``reference`` (one seed)."""
    qids = sorted(reference)
    t = paired_by_unit([ap[q] for q in qids], [reference[q] for q in qids], [combos[q] for q in qids], "combination")
    return t.better, t.worse, t.p_sign


def per_query_ap(results: dict, method: str, truth: dict[str, list[str]], k: int = 5) -> dict[str, float]:
    ranked = json.loads(Path(results["files"]["rankings"][method]).read_text())
    out = {}
    for qid, names in ranked.items():
        rel = torch.tensor([[n in truth[qid] for n in names[:k]]])
        out[qid] = M.map_at_k(rel, torch.tensor([len(truth[qid])]), [k])[k]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backbone-dir", required=True)
    p.add_argument("--workdir", default="runs/exclmm")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--gap", type=float, default=ToyBackboneConfig().modality_gap,
                   help="the toy CLIP's modality gap (the quickstart's backbone.modality_gap)")
    p.add_argument("--bench", nargs="*", default=[], metavar="KEY=VALUE", help="ToyBenchmarkConfig overrides")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="settings",
                   help="ExclMMConfig overrides for every run (after the variant's)")
    p.add_argument("--batch-size", type=int, default=256, help="evaluation batch size")
    add_debug_option(p)
    args = p.parse_args(argv)
    setup_logging()
    try:
        return run(args)
    except (DemindError, OSError) as e:
        return report_error(e, args)


def run(args: argparse.Namespace) -> int:
    """Check every setting, then build, train and evaluate."""
    from benchmarks.exclusion_instrument import check_recipe

    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"--variants {unknown}: not a variant; one of {', '.join(VARIANTS)}")
    bench_cfg = load_config(ToyBenchmarkConfig, None, args.bench)
    for variant in args.variants:  # each run's recipe as it will be loaded
        try:
            load_config(ExclMMConfig, ROOT / "configs/exclmm/toy.yaml", [*VARIANTS[variant], *args.settings])
        except ConfigError as e:
            raise ConfigError(f"--set {' '.join(args.settings)} (variant {variant!r}): {e}") from None
    work = check_output_key("--workdir", args.workdir)
    torch.set_num_threads(1)
    backbone = load_toy_backbone(Path(args.backbone_dir), args.gap)
    check_recipe(work, {"bench": asdict(bench_cfg), "set": list(args.settings), "gap": args.gap,
                        "backbone": backbone.identity})
    bench = write_benchmarks(work / "benchmarks", bench_cfg, which=("exclcoco",))["exclcoco"]
    test_root, train_root = bench / "test", bench / "train"
    data, _ = load_exclcoco(test_root)
    truth = {str(q["id"]): set(q["ground_truth"]) for q in data["queries"]}
    combos = combinations(data)
    cache = work / "feature_cache"
    common = dict(backbone=backbone, cache_dir=cache, batch_size=args.batch_size, progress=False)

    results: dict[str, list[dict]] = {"random ranking": [random_ranking(data, seed) for seed in args.seeds],
                                      "CLIP text-only": []}
    clip = evaluate("exclcoco", test_root, methods=["text-only", "text-only+deo"], out_dir=work / "eval" / "clip",
                    **common)
    clip_ap = per_query_ap(clip, "text-only", truth)
    deo_ap = per_query_ap(clip, "text-only+deo", truth)
    clip["methods"]["text-only+deo"]["_sign"] = sign_vs(deo_ap, clip_ap, combos)
    timings = {}
    for variant in args.variants:
        results[variant] = []
        for seed in args.seeds:
            run = work / "train" / f"{''.join(c if c.isascii() and c.isalnum() else '_' for c in variant)}-seed{seed}"
            shared = work / "train" / FEATURES_NAME
            run.mkdir(parents=True, exist_ok=True)
            if shared.is_file() and not (run / FEATURES_NAME).is_file():  # the same frozen features for every run
                copy_atomic(shared, run / FEATURES_NAME)
                copy_atomic(shared.with_suffix(".json"), run / shared.with_suffix(".json").name)
            cfg = load_config(ExclMMConfig, ROOT / "configs/exclmm/toy.yaml", [
                f"backbone.pretrained={backbone.cfg.pretrained}", f"data.train={train_root}",
                f"data.cache_dir={cache}", f"run.output_dir={run}", f"run.seed={seed}", "run.progress=false",
                *VARIANTS[variant], *args.settings])
            started = time.perf_counter()
            export = train_exclmm(cfg, backbone)
            timings.setdefault(variant, []).append(time.perf_counter() - started)
            if not shared.is_file():
                copy_atomic((run / FEATURES_NAME).with_suffix(".json"), shared.with_suffix(".json"))
                copy_atomic(run / FEATURES_NAME, shared)  # last: the tensors' presence means both are there
            res = evaluate("exclcoco", test_root, methods=["exclmm"], exclmm=load_exclmm(export, backbone.identity),
                           out_dir=work / "eval" / run.name, **common)
            res["methods"]["exclmm"]["_sign"] = sign_vs(per_query_ap(res, "exclmm", truth), clip_ap, combos)
            results[variant].append(res["methods"]["exclmm"])
            log.info("%s seed %d: %s", variant, seed, res["methods"]["exclmm"])
    results["CLIP text-only"] = [clip["methods"]["text-only"]] * len(args.seeds)
    results["CLIP text-only + DEO"] = [clip["methods"]["text-only+deo"]] * len(args.seeds)
    backbone_note = toy_clip_report(Path(args.backbone_dir))
    table = format_table(results, len(data["queries"]), len(data["images"]))
    table += f"\n\nbackbone: {backbone_note.get('weights')} (step {backbone_note.get('step', 'final')})"
    table += "\ntraining seconds per run (mean): " + ", ".join(
        f"{v}: {statistics.mean(t):.0f}" for v, t in timings.items())
    print(table)
    write_text_atomic(work / "table.md", table + "\n")
    write_json_atomic(work / "results.json", {"results": results, "train_seconds": timings}, indent=1)
    return 0


def random_ranking(data: dict, seed: int, depth: int = 10) -> dict[str, float]:
    """The metrics of a uniformly random ranking (the base rate: ground-truth sets are large)."""
    g = torch.Generator().manual_seed(seed)
    ids = list(data["images"])
    index = {i: k for k, i in enumerate(ids)}
    ranked = torch.stack([torch.randperm(len(ids), generator=g)[:depth] for _ in data["queries"]])
    relevant = [frozenset(index[i] for i in q["ground_truth"]) for q in data["queries"]]
    rel = M.relevance_matrix(ranked, relevant)
    n_rel = torch.tensor([len(r) for r in relevant])
    return {k: 100 * v for k, v in M.exclusion_metrics(rel, n_rel).items()}


def format_table(results: dict[str, list[dict]], n_queries: int, n_images: int) -> str:
    names = list(M.EXCLUSION_METRICS)
    lines = [f"Toy ExclCOCO test: {n_queries} queries, {n_images} images; mean ± std over seeds (percent); "
             "sign test vs CLIP on AP@5 over label combinations (better/worse combinations per seed, largest p)",
             "", "| method | " + " | ".join(names) + " | better/worse vs CLIP | p (max) |",
             "|---" * (len(names) + 3) + "|"]
    for method, runs in results.items():
        cells = []
        for n in names:
            vals = [r[n] for r in runs]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.1f} ± {sd:.1f}")
        signs = [r["_sign"] for r in runs if "_sign" in r]
        sign = ", ".join(f"{b}/{w}" for b, w, _ in signs) if signs else "—"
        p = f"{max(s[2] for s in signs):.1e}" if signs else "—"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {sign} | {p} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
