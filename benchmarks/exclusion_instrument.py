"""ExclMM against CLIP, CLIP + DEO and its own ablations on the exclusion instrument, on label
combinations held out of training and on trained ones, each trained row run until its loss stops.

    python -m benchmarks.exclusion_instrument --quickstart runs/quickstart --workdir runs/exclusion-instrument --folds 0 1 2

The instrument (:mod:`toyworld.exclusion_instrument`): each query "A and B without C" has as many
hard negatives (A, B and C) as ground-truth images (A and B), so a method that ignores the
exclusion sits at exclusion AUC 0.5. The design, written before the runs, is
docs/lab-notes/exclmm-held-out.md; the results are in docs/negation.md.

* **Folds** (``--folds``): fold k trains every row on the instrument's training split without the
  scenes of Fano triple k (``InstrumentConfig.held_out_triples``), and scores all 420 test queries.
  A query's *held-out* score is the one of the fold that held its triple out; its *in-domain*
  score the mean over the folds that trained on its triple.
* **Rows**: CLIP text-only, CLIP with the exclusion clause deleted, CLIP + DEO (untrained); and
  trained (``configs/exclmm/toy.yaml`` plus :data:`PLATEAU`: each phase stops when its loss stops
  falling, capped): :data:`TRAINED`, at the temperature they name, and the "stage 1 only" rows
  read from those runs' ``stage1.safetensors``. ``--trained`` picks rows; they run in the order of
  their priority (all folds and seeds of one before the next).
* **Metrics**: exclusion AUC, inclusion AUC, AP@1, AP@5 (:mod:`demind.eval.metrics`); mean ± std
  over seeds, held-out and in-domain apart.
* **Paired tests** (:mod:`demind.eval.paired`): unit = the (include, exclude) combination (the
  queries of one combination share their ground truth and hard negatives), one test per seed.
* **Gate**: CLIP's inclusion AUC per label must be >= 0.8.

Writes ``<workdir>/table.md``, ``results.json`` and ``curves/*.png`` (loss per logged step of
every trained phase). ``<workdir>/recipe.json`` records what the workdir was made from (instrument
config, ``--set``, backbone); a rerun with other settings is refused, a rerun with the same ones
reuses the finished runs. ``--no-train`` reports the runs that are finished and lists the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

from demind.exclmm.config import EARLIER_OVERRIDES, PAPER_OVERRIDES

log = logging.getLogger("exclusion_instrument")
ROOT = Path(__file__).resolve().parents[1]
TAU_001 = ["space.tau=0.01", "query.tau=0.01", "query.clip_tau=0.01"]
# each phase until its loss stops falling (demind.exclmm.train.Plateau), capped far above where it stops (the SAE
# at 2,200-3,800 steps, the others at <= 4,400: docs/lab-notes/exclmm-held-out.md); a log line every 100 steps
PLATEAU = ["stop.window=200", "stop.tol=0.01", "sae.steps=30000", "space.steps=6000", "query.steps=6000",
           "run.log_every=100", "run.save_every=500"]
# name -> (priority, overrides); the runs go by priority (docs/lab-notes/exclmm-held-out.md)
TRAINED = {
    "ExclMM (paper's form)": (1, [*PAPER_OVERRIDES, *TAU_001]),
    "F_θ on CLIP (no stage 1)": (1, [*PAPER_OVERRIDES, *TAU_001, "query.space=clip"]),
    "ExclMM (paper's form, τ 1)": (2, list(PAPER_OVERRIDES)),
    "w/o L_t (L_c weight kept)": (3, [*PAPER_OVERRIDES, *TAU_001, "query.lambda_t=0"]),
    "ExclMM (earlier variants)": (4, list(EARLIER_OVERRIDES)),
}
# rows read from another row's runs: the model when its stage 1 ended
STAGE1_ROWS = {"stage 1 only": "ExclMM (paper's form)", "stage 1 only (τ 1)": "ExclMM (paper's form, τ 1)"}
FIXED = ("CLIP text-only", "CLIP, clause deleted", "CLIP + DEO")
CUES = (" without ", " but not ", " with no ", " except for ")  # demind.exclcoco_builder.TEMPLATES' clauses
GATE = 0.8
METRICS = ("exclusion AUC", "inclusion AUC", "AP@1", "AP@5")


def delete_exclusion_clause(text: str) -> str:
    """The query text up to its exclusion clause: "a photo of a dog without a cat" -> "a photo of a dog"."""
    for cue in CUES:
        if cue in text:
            return text.split(cue)[0]
    raise ValueError(f"no exclusion clause ({', '.join(c.strip() for c in CUES)}) in {text!r}")


def method_scores(method, texts: list[str], gallery):
    """(Q, N) scores of a retrieval method (demind.retrieval.methods) for text queries."""
    import torch

    ref = torch.zeros(len(texts), gallery.shape[1])  # text methods read no reference image
    with torch.no_grad():
        q = method.embed(ref, texts, texts).float()
        return q @ method.map_gallery(gallery).float().T


def evaluate_scores(scores, truth: list[set[int]], hard: list[set[int]]) -> dict:
    """The eight metrics (means), and per query AP@1, AP@5 and the two AUCs."""
    import torch

    from demind.eval import metrics as M

    ranked = scores.topk(min(10, scores.shape[1]), dim=1).indices
    rel = M.relevance_matrix(ranked, truth)
    n_rel = torch.tensor([len(t) for t in truth])
    means = {k: 100 * v for k, v in M.exclusion_metrics(rel, n_rel).items()}
    aucs = M.exclusion_aucs(scores, truth, hard)  # demind-eval's ExclCOCO AUCs, averaged the same way
    per_query = {"AP@1": (100 * rel[:, 0].float()).tolist(),
                 "AP@5": (100 * M.average_precision_at_k(rel, n_rel, 5)).tolist(), **aucs}
    means.update(M.mean_aucs(aucs))
    return {"means": means, "per_query": per_query}


def label_gate(backbone, gallery, instances_path: Path, image_ids: list[str]) -> dict[str, float]:
    """CLIP's inclusion AUC per label: "a photo of a <label>" against the images showing it."""
    import torch
    import torch.nn.functional as F

    from demind.coco_files import INSTANCE_FIELDS, load_coco
    from demind.eval import metrics as M

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


def gallery_features(backbone, files: dict, cache_dir: Path):
    """(N, D) normalised CLIP features of the test images, through the evaluation image cache."""
    import torch
    import torch.nn.functional as F

    from demind.retrieval import ImageFeatureCache, ImageRef, encode_image_refs

    cache = ImageFeatureCache.for_backbone(cache_dir, backbone, "exclusion-instrument", "test")
    raw, _ = encode_image_refs(backbone, [ImageRef(i, p) for i, p in files.items()], cache, "gallery", 256,
                               progress=False, desc="instrument test images")
    return F.normalize(torch.stack([raw[i] for i in files]).float(), dim=-1)


def slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name)


def row_config(work: Path, name: str, fold: int, seed: int, backbone, settings: list[str]):
    """The ExclMMConfig of one trained row's run on fold ``fold`` (the method's own settings win)."""
    from demind.config import load_config
    from demind.exclmm.config import ExclMMConfig

    run = work / "train" / f"fold{fold}" / f"{slug(name)}-seed{seed}"
    fold_train = work / "folds" / f"heldout-{fold}" / "train"
    return load_config(ExclMMConfig, ROOT / "configs/exclmm/toy.yaml", [
        f"backbone.name={backbone.cfg.name}", f"backbone.pretrained={backbone.cfg.pretrained}",
        f"data.train={fold_train}", f"data.cache_dir={work / 'feature_cache'}", f"run.output_dir={run}",
        f"run.seed={seed}", "run.progress=false", *PLATEAU, *settings, *TRAINED[name][1]])


def copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def fold_features(work: Path, fold: int, backbone, settings: list[str]) -> Path:
    """The frozen features of fold ``fold``'s training split, computed once into ``train/fold<k>/shared``."""
    from demind.exclmm.features import FEATURES_NAME, prepare_features

    cfg = row_config(work, "ExclMM (paper's form)", fold, 0, backbone, settings)
    shared = work / "train" / f"fold{fold}" / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    prepare_features(cfg.data, backbone, shared, progress=False)
    return shared / FEATURES_NAME


def train_row(work: Path, name: str, fold: int, seed: int, backbone, settings: list[str], train: bool) -> Path | None:
    """Train (or reuse) one row's run; None when ``train`` is off and it is not finished."""
    from demind.exclmm.features import FEATURES_NAME
    from demind.exclmm.train import EXPORT_NAME, train_exclmm

    cfg = row_config(work, name, fold, seed, backbone, settings)
    run = Path(cfg.run.output_dir)
    if not train:
        return run / EXPORT_NAME if (run / EXPORT_NAME).is_file() else None
    shared = fold_features(work, fold, backbone, settings)
    run.mkdir(parents=True, exist_ok=True)
    if not (run / FEATURES_NAME).is_file():  # the tensors, then the record (the done-marker), each atomically
        copy_atomic(shared, run / FEATURES_NAME)
        copy_atomic(shared.with_suffix(".json"), run / shared.with_suffix(".json").name)
    return train_exclmm(cfg, backbone)


def quickstart_config(folder: Path):
    """The QuickstartConfig of a finished quickstart run folder (its results.json), so its toy CLIP is
    reused as trained; without one, the default recipe (the shipped weights, expanded into it)."""
    from toyworld.pipeline import QuickstartConfig

    if (folder / "results.json").is_file():
        from benchmarks.noise_common import source_config

        return dataclasses.replace(source_config(folder), workdir=str(folder))
    log.info("%s has no results.json: the default toy CLIP (shipped weights) is set up there", folder)
    return QuickstartConfig(workdir=str(folder))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quickstart", default="runs/quickstart", help="the quickstart's run folder (its toy CLIP)")
    p.add_argument("--workdir", default="runs/exclusion-instrument")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--folds", type=int, nargs="+", default=list(range(7)), choices=range(7), metavar="TRIPLE",
                   help="Fano triples held out, one fold each (default all seven)")
    p.add_argument("--instrument", nargs="*", default=[], metavar="KEY=VALUE", help="InstrumentConfig overrides")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", dest="settings",
                   help="ExclMMConfig overrides for every trained run (before the row's own)")
    p.add_argument("--trained", nargs="*", default=list(TRAINED), choices=list(TRAINED), metavar="ROW",
                   help=f"trained rows (default all: {', '.join(TRAINED)})")
    p.add_argument("--no-train", action="store_true", help="report the finished runs only; list the others")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the instrument and every fold's features, then stop (before parallel workers)")
    return p


def check_args(args: argparse.Namespace):
    """Every setting checked before anything is rendered or loaded -> (InstrumentConfig, work folder)."""
    from demind.config import ConfigError, load_config
    from demind.config_checks import check_output_key
    from demind.exclmm.config import ExclMMConfig
    from toyworld.exclusion_instrument import InstrumentConfig

    if any(s < 0 for s in args.seeds):
        raise ConfigError(f"--seeds {args.seeds}: seeds are >= 0")
    if len(set(args.folds)) != len(args.folds) or len(set(args.seeds)) != len(args.seeds):
        raise ConfigError("--folds and --seeds each name a value once")
    cfg = load_config(InstrumentConfig, None, args.instrument)
    if cfg.held_out_triples:
        raise ConfigError("--instrument held_out_triples: the folds set it; use --folds")
    for name in args.trained:  # the row's own settings on top of --set, as the runs will load them
        try:
            load_config(ExclMMConfig, ROOT / "configs/exclmm/toy.yaml", [*PLATEAU, *args.settings, *TRAINED[name][1]])
        except ConfigError as e:
            raise ConfigError(f"--set {' '.join(args.settings)} (row {name!r}): {e}") from None
    work = check_output_key("--workdir", args.workdir)
    return cfg, work


def check_recipe(work: Path, recipe: dict) -> None:
    """Refuse a workdir made from other settings (what its outputs were made from: recipe.json)."""
    from demind.config import ConfigError, config_changes
    from demind.io import read_json, write_json_atomic

    path = work / "recipe.json"
    if path.is_file():
        changes = config_changes(read_json(path), recipe)
        if changes:
            raise ConfigError(f"{work} was made with other settings ({'; '.join(changes)}); use another --workdir, "
                              "or delete it to start over")
        return
    if (work / "train").exists() or (work / "instrument").exists():
        raise ConfigError(f"{work} holds runs of an earlier version of this benchmark, made from settings it did "
                          "not record; use another --workdir, or delete it to start over")
    write_json_atomic(path, recipe, indent=1)


def main(argv: list[str] | None = None) -> int:
    from demind.cli.common import add_debug_option, report_error
    from demind.errors import DemindError

    parser = build_parser()
    add_debug_option(parser)
    args = parser.parse_args(argv)
    from demind.logs import setup_logging

    setup_logging(packages=("toyworld", log.name))
    try:
        return run(args)
    except (DemindError, OSError) as e:
        return report_error(e, args)


def run(args: argparse.Namespace) -> int:
    inst_cfg, work = check_args(args)
    import torch

    from benchmarks.exclusion_report import write_report
    from demind.eval import load_exclcoco
    from demind.exclmm import load_exclmm
    from demind.exclmm.train import STAGE1_NAME
    from demind.retrieval.methods import ExclMMQuery, build_methods
    from toyworld.exclusion_instrument import triple_of, write_instrument
    from toyworld.pipeline import prepare_backbone

    torch.set_num_threads(1)
    backbone, _, _ = prepare_backbone(quickstart_config(Path(args.quickstart)))
    check_recipe(work, {"instrument": dataclasses.asdict(inst_cfg), "set": list(args.settings),
                        "backbone": backbone.identity})
    root = write_instrument(work / "instrument", inst_cfg, progress=False, splits=("test",))
    for fold in args.folds:
        write_instrument(work / "folds" / f"heldout-{fold}", dataclasses.replace(inst_cfg, held_out_triples=[fold]),
                         progress=False, splits=("train",))
        if not args.no_train:
            fold_features(work, fold, backbone, args.settings)
    data, files = load_exclcoco(root / "test")
    gallery = gallery_features(backbone, files, work / "feature_cache")
    if args.prepare_only:
        return 0
    image_ids = list(files)
    row = {i: k for k, i in enumerate(image_ids)}
    queries = data["queries"]
    truth = [{row[i] for i in q["ground_truth"]} for q in queries]
    hard = [{row[i] for i in q["hard_negatives"]} for q in queries]
    texts = [q["query"] for q in queries]
    gate = label_gate(backbone, gallery, Path(data["source"]["instances"]), image_ids)

    text_only, deo = build_methods(["text-only", "text-only+deo"], backbone, None)
    fixed = {"CLIP text-only": evaluate_scores(method_scores(text_only, texts, gallery), truth, hard),
             "CLIP, clause deleted": evaluate_scores(
                 method_scores(text_only, [delete_exclusion_clause(t) for t in texts], gallery), truth, hard),
             "CLIP + DEO": evaluate_scores(method_scores(deo, texts, gallery), truth, hard)}

    def score(export: Path) -> dict:
        method = ExclMMQuery(backbone, load_exclmm(export, backbone.identity))
        return evaluate_scores(method_scores(method, texts, gallery), truth, hard)["per_query"]

    # per_query[row][(fold, seed)] = {metric: [Q values]}; runs[row][(fold, seed)] = the run folder
    per_query: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    missing: list[str] = []
    for priority in sorted({TRAINED[n][0] for n in args.trained}):
        for seed in args.seeds:
            for fold in args.folds:
                for name in [n for n in args.trained if TRAINED[n][0] == priority]:
                    started = time.perf_counter()
                    export = train_row(work, name, fold, seed, backbone, args.settings, not args.no_train)
                    if export is None:
                        missing.append(f"{name}, fold {fold}, seed {seed}")
                        continue
                    runs.setdefault(name, {})[(fold, seed)] = export.parent
                    per_query.setdefault(name, {})[(fold, seed)] = score(export)
                    for s1, source in STAGE1_ROWS.items():
                        if source == name and (export.parent / STAGE1_NAME).is_file():
                            per_query.setdefault(s1, {})[(fold, seed)] = score(export.parent / STAGE1_NAME)
                    log.info("%s, fold %d, seed %d: %.0f s", name, fold, seed, time.perf_counter() - started)
    combos = [(tuple(sorted(q["include"])), q["exclude"]) for q in queries]
    triples = [triple_of(q["include"], q["exclude"]) for q in queries]
    table = write_report(work, fixed={n: r["per_query"] for n, r in fixed.items()}, trained=per_query, runs=runs,
                         combos=combos, triples=triples, folds=args.folds, seeds=args.seeds, gate=gate,
                         gate_min=GATE, missing=missing, n_images=len(image_ids), data=data)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
