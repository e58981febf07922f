"""The quickstart: the whole method on the toy world, on a CPU, in minutes.

``run_quickstart(cfg)`` does, each step cached so a rerun only does what is missing:

1. toy intent shards (``<workdir>/shards``) and toy benchmarks (``<workdir>/benchmarks``) of the
   world ``cfg.world`` (v1: ``shards-v1``, ``benchmarks-v1``, ``results-v1.json``: :func:`world_path`);
2. the toy CLIP backbone (trained once, ``<workdir>/backbone``);
3. the frozen-feature cache of the shards (``demind.features``);
4. De-MINDS training through ``demind.training.train`` (the code behind ``train.py``),
   one run per (variant, seed); the Table 5 ablations are variants;
5. every method through the evaluation harness (``demind.eval.harness.evaluate``), with
   per-modification-type recall on the toy CIRR (``implicit``: World v2's themes); the
   negation-aware ``+deo`` variants (:mod:`demind.negation`) with a paired sign test against their base method on the
   exclusion set and toy CIRR, and how many toy CIRR queries DEO touches;
6. a paper-style table (mean ± std over seeds), ``results.json`` and a recall@K plot.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from demind.config import setting
from demind.io import atomic_path, write_json_atomic

from .backbone import ToyBackboneConfig, ensure_toy_backbone
from .benchmarks import ToyBenchmarkConfig, write_benchmarks
from .intent_data import ToyShardConfig, write_toy_shards
from .world import DEFAULT_WORLD, WORLDS

logger = logging.getLogger(__name__)

# Table 5 of the paper, as overrides of the training config.
VARIANTS: dict[str, list[str]] = {
    "demind": [],
    # w/o intent data: only original captions, hence no T_int to distil from either
    "only-original": ["data.targets.p_original=1.0", "data.targets.p_rewritten=0.0",
                      "data.targets.p_intent=0.0", "loss.distil=false"],
    "no-distil": ["loss.distil=false"],
    "no-gate": ["model.fusion=add"],
    "no-global": ["model.fusion=intent_only"],
}
ALL_METHODS = ("demind", "mapping-only", "image+text", "image-only", "text-only",
               "demind+deo", "mapping-only+deo", "image+text+deo", "text-only+deo", "oracle")
# the toy benchmarks whose queries carry the target's description, which the oracle reads
ORACLE_BENCHMARKS = ("cirr", "exclusion")
HEADLINE = {"cirr": ("R@1", "R@5", "R@10"), "imagenet-r": ("average/R@10", "average/R@50"),
            "coco": ("R@1", "R@5", "R@10"), "exclusion": ("mAP@5", "mAP@10")}
BENCH_FOLDERS = {"cirr": "cirr", "imagenet-r": "imgnet", "coco": "coco", "exclusion": "exclusion"}


@dataclass
class QuickstartConfig:
    workdir: str = "runs/quickstart"
    # the toy world (demind/toy/README.md, "World v2"): one setting for every stage; the quickstart
    # copies it into shards.world, toy_benchmarks.world and backbone.world
    world: str = setting(DEFAULT_WORLD, choices=WORLDS)
    train_config: str = "configs/train/toy.yaml"
    train_overrides: list[str] = field(default_factory=list)
    seeds: list[int] = setting(default_factory=lambda: [0], ge=0)
    ablations: bool = False          # also train and evaluate the Table 5 variants
    benchmarks: list[str] = setting(default_factory=lambda: ["cirr", "imagenet-r", "coco", "exclusion"],
                                    choices=tuple(BENCH_FOLDERS))
    eval_batch_size: int = setting(256, ge=1)
    progress: bool = True
    shards: ToyShardConfig = field(default_factory=ToyShardConfig)
    toy_benchmarks: ToyBenchmarkConfig = field(default_factory=ToyBenchmarkConfig)
    backbone: ToyBackboneConfig = field(default_factory=ToyBackboneConfig)

    def config_problems(self) -> list[tuple[str, str]]:
        """Checks that need several fields, or a section that lives in a module without rules."""
        problems = []
        if not self.seeds:
            problems.append(("seeds", "needs at least one seed"))
        if not self.benchmarks:
            problems.append(("benchmarks", f"needs at least one of {', '.join(BENCH_FOLDERS)}"))
        for key in ("num_samples", "samples_per_shard", "image_size"):
            if getattr(self.shards, key) < 1:
                problems.append((f"shards.{key}", f"= {getattr(self.shards, key)} must be >= 1"))
        if not 1 <= self.shards.jpeg_quality <= 100:
            problems.append(("shards.jpeg_quality", f"= {self.shards.jpeg_quality} must be in 1..100"))
        for section in WORLD_SECTIONS:
            value = getattr(self, section).world
            if value not in (self.world, "v1"):  # "v1" is the sections' default: world= sets them
                problems.append((f"{section}.world", f"= {value!r} differs from world = {self.world!r}; set the "
                                 f"world once, with world={value} (the quickstart passes it to every stage)"))
        return problems


WORLD_SECTIONS = ("shards", "toy_benchmarks", "backbone")  # the sections that carry a `world` field


def with_world(cfg: QuickstartConfig) -> QuickstartConfig:
    """``cfg`` with its ``world`` copied into every section that has one."""
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), world=cfg.world)
                                       for s in WORLD_SECTIONS})


def world_path(cfg: QuickstartConfig, name: str) -> Path:
    """Where a world-dependent output lives: ``<workdir>/<name>`` for the default world (v2),
    ``<workdir>/<stem>-<world><suffix>`` for another ("shards-v1", "results-v1.json"), so worlds never mix."""
    path = Path(cfg.workdir) / name
    return path if cfg.world == DEFAULT_WORLD else path.with_name(f"{path.stem}-{cfg.world}{path.suffix}")


# ------------------------------------------------------------------------ stages

def prepare_backbone(cfg: QuickstartConfig):
    """Train or reuse the toy CLIP; returns (FrozenCLIP, its report, log of its logit scale)."""
    from demind.backbone import BackboneConfig, FrozenCLIP

    weights, report = ensure_toy_backbone(cfg.backbone, Path(cfg.workdir) / "backbone", cfg.progress)
    backbone = FrozenCLIP(BackboneConfig(name=cfg.backbone.model_config, pretrained=str(weights)))
    # De-MINDS uses the backbone's own (fixed) temperature, as with CLIP's trained 100.
    log_scale = float(backbone.model.logit_scale.detach().clamp(max=math.log(100)))
    return backbone, report, log_scale


def build_features(cfg: QuickstartConfig, backbone, shards: list[Path]) -> Path:
    """Frozen image and T_int features of every shard, where ``data.features=auto`` finds them."""
    from demind.features import build_feature_cache, default_cache_dir

    names = [str(p) for p in shards]
    directory = default_cache_dir(names, backbone.identity_str)
    build_feature_cache(names, directory, backbone, batch_size=256, num_workers=0, progress=cfg.progress)
    return directory


def train_variant(cfg: QuickstartConfig, backbone, variant: str, seed: int, log_scale: float) -> Path:
    """Train one (variant, seed) run with the trainer's own code; reuse a finished export."""
    from demind.training import EXPORT_NAME, load_train_config, train

    # keyed by the backbone, so a retrained backbone never reuses a model trained on another
    run_dir = Path(cfg.workdir) / "train" / backbone.identity_str / f"{variant}-seed{seed}"
    export = run_dir / EXPORT_NAME
    if export.is_file():
        logger.info("reusing %s", export)
        return export
    overrides = [
        f"backbone.name={backbone.cfg.name}", f"backbone.pretrained={backbone.cfg.pretrained}",
        f"data.shards={world_path(cfg, 'shards')}", f"run.output_dir={run_dir}", f"run.seed={seed}",
        f"model.init_logit_scale={log_scale}", f"run.progress={str(cfg.progress).lower()}",
        *VARIANTS[variant], *cfg.train_overrides,
    ]
    return train(load_train_config(cfg.train_config, overrides))


def quickstart_search_paths(workdir: str | Path = "runs/quickstart") -> dict[str, Path]:
    """What ``demind-serve --quickstart`` searches after a quickstart run: the De-MINDS export of
    the lowest seed (newest backbone when the toy CLIP was retrained), the toy CIRR dev images as
    the gallery (of the default world, v2), and where their index goes. FileNotFoundError naming
    what to run otherwise."""
    from demind.training import EXPORT_NAME

    workdir = Path(workdir)
    exports = list((workdir / "train").glob(f"*/demind-seed*/{EXPORT_NAME}"))
    if not exports:
        raise FileNotFoundError(f"no trained De-MINDS model under {workdir / 'train'}: run the quickstart first "
                                f"(python pipelines/quickstart.py workdir={workdir})")
    newest_backbone = max(exports, key=lambda p: p.stat().st_mtime).parents[1]
    seed = lambda p: int(p.parent.name.rsplit("seed", 1)[1])  # noqa: E731
    checkpoint = min((p for p in exports if p.parents[1] == newest_backbone), key=seed)
    gallery = workdir / "benchmarks" / "cirr" / "dev"
    if not gallery.is_dir():
        raise FileNotFoundError(f"the toy gallery {gallery} is missing: rerun the quickstart")
    return {"checkpoint": checkpoint, "images": gallery, "index": workdir / "search-index"}


def evaluate_run(cfg: QuickstartConfig, backbone, export: Path, variant: str, seed: int,
                 methods: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every benchmark for one trained model; returns benchmark -> results dict."""
    from demind.checkpoint import load_backbone_and_model
    from demind.eval.harness import ReaderOptions, evaluate

    backbone, model = load_backbone_and_model(export, backbone)
    bench_root = world_path(cfg, "benchmarks")
    out = {}
    for bench in cfg.benchmarks:
        root = bench_root / BENCH_FOLDERS[bench]
        options = ReaderOptions(coco_csv=str(root / "coco_eval.csv")) if bench == "coco" else None
        bench_methods = [m for m in methods if m != "oracle" or bench in ORACLE_BENCHMARKS]
        results = evaluate(bench, root, backbone=backbone, model=model, methods=bench_methods,
                           out_dir=Path(cfg.workdir) / "eval" / backbone.identity_str / f"{variant}-seed{seed}" / bench,
                           cache_dir=Path(cfg.workdir) / "eval" / "feature_cache", options=options,
                           batch_size=cfg.eval_batch_size, progress=cfg.progress)
        if bench == "cirr":
            captions, ranked = load_cirr_truth_and_rankings(root, results["files"]["rankings"])
            results["per_type"] = recall_by_type(captions, ranked)
            if "demind" in methods:
                results["paired"] = _paired(captions, ranked)
            results["deo_paired"] = deo_paired(ranked, cirr_targets(captions), (10,), ap=False)
            results["deo_touched"] = deo_touched(captions, ranked)
        if bench == "exclusion":
            data = json.loads((root / "exclusion.json").read_text())
            ranked = {m: json.loads(Path(f).read_text()) for m, f in results["files"]["rankings"].items()}
            targets = {str(q["id"]): set(q["positives"]) for q in data["queries"]}
            results["deo_paired"] = deo_paired(ranked, targets, (10,), ap=True)
        out[bench] = results
    return out


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
    from demind.eval.metrics import paired_hits, sign_test_p

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


def _paired(captions: list[dict[str, Any]], ranked: dict[str, dict[str, list[str]]], ks: tuple[int, ...] = (5, 10)
            ) -> dict[str, dict[str, dict[str, float]]]:
    """De-MINDS against every other method on the same toy-CIRR queries:
    other method -> "R@k" -> {"only_demind", "only_other", "p"} (exact sign test)."""
    targets = cirr_targets(captions)
    return {other: paired_recall(ranked["demind"], ranked[other], targets, ks, ("demind", "other"))
            for other in ranked if other != "demind"}


def deo_paired(ranked: dict[str, dict[str, list[str]]], targets: dict[str, set[str]], ks: tuple[int, ...],
                ap: bool) -> dict[str, dict[str, dict[str, float]]]:
    """Every ``X+deo`` method against its base X on the same queries:
    "X+deo" -> "AP@k" (per-query AP, mAP benchmarks) or "R@k" (hit) -> {"only_deo", "only_base", "p"}.
    ``only_*``: queries where that side is strictly better (AP) or alone in hitting (recall)."""
    from demind.eval.metrics import paired_ap, paired_hits, sign_test_p
    from demind.eval.methods import split_deo_name

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
    from demind.eval.methods import split_deo_name
    from demind.negation.decompose import RuleDecomposer

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


def ablation_paired(cfg: QuickstartConfig, runs: dict[str, dict[int, dict[str, dict[str, Any]]]],
                    ks: tuple[int, ...] = (5, 10)) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Every Table 5 variant against the full model of the same seed on the same toy-CIRR queries:
    variant -> seed -> "R@k" -> {"only_full", "only_variant", "p"} (exact sign test). Empty without
    ablations."""
    full = runs.get("demind", {})
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for seed in sorted(full):
        files = {variant: by_seed[seed]["cirr"]["files"]["rankings"]["demind"] for variant, by_seed in runs.items()
                 if seed in by_seed and "cirr" in by_seed[seed]}
        if "demind" not in files or len(files) < 2:
            continue
        # each ranking read once: the full model's serves every variant of its seed
        captions, ranked = load_cirr_truth_and_rankings(world_path(cfg, "benchmarks") / BENCH_FOLDERS["cirr"], files)
        targets = cirr_targets(captions)
        for variant in files.keys() - {"demind"}:
            out.setdefault(variant, {})[seed] = paired_recall(ranked["demind"], ranked[variant], targets, ks,
                                                              ("full", "variant"))
    return {variant: out[variant] for variant in runs if variant in out}  # in the order of VARIANTS


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


# ---------------------------------------------------------------------- summary

def mean_std(values: list[float]) -> tuple[float, float]:
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs: dict[str, dict[int, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """variant -> seed -> benchmark -> results  ==>  rows of mean ± std per (variant, method)."""
    rows: dict[str, dict[str, Any]] = {}
    for variant, by_seed in runs.items():
        seeds = sorted(by_seed)
        methods = by_seed[seeds[0]][next(iter(by_seed[seeds[0]]))]["methods"].keys()
        for method in methods:
            label = method if variant == "demind" else f"{method} [{variant}]"
            row: dict[str, Any] = {"variant": variant, "method": method, "seeds": seeds, "metrics": {}}
            for bench, keys in HEADLINE.items():
                if bench not in by_seed[seeds[0]] or method not in by_seed[seeds[0]][bench]["methods"]:
                    continue  # the oracle only where the benchmark has target descriptions
                for key in keys:
                    values = [by_seed[s][bench]["methods"][method][key] for s in seeds]
                    row["metrics"][f"{bench}:{key}"] = mean_std(values)
            if "cirr" in by_seed[seeds[0]]:
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


def trained_gate(export: Path) -> float:
    """tanh(alpha) of a trained De-MINDS export: the weight of t* in t_hat = t_cls + tanh(alpha) t*
    (near 0: the intention branch barely reaches the query)."""
    from demind.checkpoint import read_checked_tensors

    return math.tanh(float(read_checked_tensors(export)["gate"]))


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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no recall plot")
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


# ------------------------------------------------------------------------ driver

def run_quickstart(cfg: QuickstartConfig) -> dict[str, Any]:
    """Run (or finish) the whole quickstart; returns the summary written to results.json."""
    cfg = with_world(cfg)
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def timed(name: str, fn, *args):
        start = time.perf_counter()
        value = fn(*args)
        timings[name] = round(time.perf_counter() - start, 1) + timings.get(name, 0.0)
        logger.info("%s done in %.1f s", name, time.perf_counter() - start)
        return value

    logger.info("toy world %s", cfg.world)
    shards = timed("shards", write_toy_shards, world_path(cfg, "shards"), cfg.shards, cfg.progress)
    timed("benchmarks", write_benchmarks, world_path(cfg, "benchmarks"), cfg.toy_benchmarks,
          ("cirr", "imgnet", "coco", "exclusion"), cfg.progress)
    backbone, backbone_report, log_scale = timed("backbone", prepare_backbone, cfg)
    timed("features", build_features, cfg, backbone, shards)

    variants = list(VARIANTS) if cfg.ablations else ["demind"]
    runs: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    gates: dict[str, dict[int, float]] = {}
    for variant in variants:
        methods = ALL_METHODS if variant == "demind" else ("demind",)
        for seed in cfg.seeds:
            export = timed("train", train_variant, cfg, backbone, variant, seed, log_scale)
            gates.setdefault(variant, {})[seed] = trained_gate(export)
            runs.setdefault(variant, {})[seed] = timed("evaluate", evaluate_run, cfg, backbone, export,
                                                       variant, seed, methods)
    rows = summarise(runs)
    table = format_quickstart_table(rows)
    per_type = format_per_type(rows)
    paired = format_paired(runs)
    deo = format_deo(runs)
    ablations = ablation_paired(cfg, runs)
    plot = plot_recall(rows, world_path(cfg, "recall_at_k.png"))
    summary = {"world": cfg.world, "rows": rows, "table": table, "per_type_table": per_type,
               "paired_table": paired, "deo_table": deo, "ablation_table": format_ablation_paired(ablations),
               "ablation_paired": ablations,
               "paired": {seed: b["cirr"].get("paired") for seed, b in runs.get("demind", {}).items() if "cirr" in b},
               "backbone_probes": backbone_report.get("pair_probes"),
               "metrics": metrics_table(runs), "per_type": per_type_metrics(runs), "gate": gates,
               "deo": {seed: {bench: {k: b[bench][k] for k in ("deo_paired", "deo_touched") if k in b[bench]}
                              for bench in ("exclusion", "cirr") if bench in b}
                       for seed, b in runs.get("demind", {}).items()},
               "timings_s": timings,
               "backbone": backbone_report, "config": asdict(cfg), "plot": str(plot) if plot else None}
    write_json_atomic(world_path(cfg, "results.json"), summary, indent=2, default=str)
    return summary
