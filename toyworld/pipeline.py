"""The quickstart: the whole method on the toy world, on a CPU, in minutes.

``run_quickstart(cfg)`` does, each step cached so a rerun only does what is missing:

1. toy intent shards (``<workdir>/shards``) and toy benchmarks (``<workdir>/benchmarks``);
2. the toy CLIP backbone (trained once, ``<workdir>/backbone``);
3. the frozen-feature cache of the shards (``demind.features``);
4. De-MINDS training through ``demind.training.train`` (the code behind ``train.py``),
   one run per (variant, seed); the Table 5 ablations are variants;
5. every method through the evaluation harness (``demind.eval.harness.evaluate``), with
   per-modification-type recall on the toy CIRR (``implicit``: the themes); the
   negation-aware ``+deo`` variants (:mod:`demind.negation`) with a paired sign test against their base method on the
   exclusion set and toy CIRR, and how many toy CIRR queries DEO touches; the query-time MLLM family
   (``osrcir``, ``cirevl``, ``demind+mllm``) on the toy CIRR, its descriptions from the toy MLLM
   (:mod:`toyworld.describer`, noise model ``mllm.*``), stored and reused like the features;
6. a paper-style table (mean ± std over seeds), ``results.json``, a recall@K plot
   (:mod:`toyworld.results`) and ``search.json``, what ``demind-serve --quickstart`` serves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from demind.settings import RunSection, device_setting, resolve_device, setting
from demind.io import check_output_dir, write_json_atomic

from .benchmarks import ToyBenchmarkConfig, write_benchmarks
from .clip_config import PACKAGE_ROOT, ToyBackboneConfig, model_config_path
from .describer import FAMILY_METHODS, ToyMLLMConfig, toy_mllm_setup, toy_model_id, toy_outcomes
from .intent_data import ToyShardConfig, write_toy_shards
from .results import (ablation_paired, cirr_targets, deo_paired, deo_touched, family_paired, format_ablation_paired,
                      format_deo, format_family_paired, format_paired, format_per_type, format_quickstart_table,
                      load_cirr_truth_and_rankings, metrics_table, paired_vs_demind, per_type_metrics, plot_recall,
                      recall_by_type, summarise)
from .world import WORLD_VERSION

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


BENCH_FOLDERS = {"cirr": "cirr", "imagenet-r": "imgnet", "coco": "coco", "exclusion": "exclusion"}


@dataclass
class ToyRunConfig(RunSection):
    """demind-quickstart's and demind-toy-clip's ``run`` section: the settings every command spells the
    same way (docs/commands.md)."""

    device: str = device_setting("cpu")  # the toy numbers in the docs are CPU runs
    progress: bool = setting(True, help="progress bars on a terminal (a line per 10 % in a log file)")
    seed: int | None = setting(None, ge=0, help="the seed of the one De-MINDS run, as seeds=[N] (seeds lists several)")


@dataclass
class QuickstartConfig:
    workdir: str = setting("runs/quickstart", output="dir", help="where every stage writes; a rerun reuses what is there")
    train_config: str = setting("configs/train/toy.yaml", refuses="configs/train/no-such-recipe.yaml",
                                help="the De-MINDS training recipe")
    train_overrides: list[str] = setting(
        default_factory=list, free="dotted overrides, each checked by the training config's own rules when it loads",
        help="training overrides, e.g. 'train_overrides=[optim.max_steps=500,optim.lr=1e-4]' "
             "(a new set trains and evaluates a new run folder)")
    seeds: list[int] = setting(default_factory=lambda: [0], ge=0, help="De-MINDS training seeds, e.g. [0,1,2]")
    ablations: bool = setting(False, help="also train and evaluate the Table 5 variants")
    benchmarks: list[str] = setting(default_factory=lambda: ["cirr", "imagenet-r", "coco", "exclusion"],
                                    choices=tuple(BENCH_FOLDERS), help="toy benchmarks to evaluate on")
    eval_batch_size: int = setting(256, ge=1, help="images per encoding batch in evaluation")
    reevaluate: bool = setting(False, help="evaluate again although this run's results are there")
    run: ToyRunConfig = field(default_factory=ToyRunConfig)
    shards: ToyShardConfig = field(default_factory=ToyShardConfig)
    toy_benchmarks: ToyBenchmarkConfig = field(default_factory=ToyBenchmarkConfig)
    backbone: ToyBackboneConfig = field(default_factory=ToyBackboneConfig)
    mllm: ToyMLLMConfig = field(default_factory=ToyMLLMConfig)

    @property
    def seed_list(self) -> list[int]:
        """The De-MINDS seeds to run: ``run.seed`` alone when given, else ``seeds``."""
        return [self.run.seed] if self.run.seed is not None else list(self.seeds)

    def config_problems(self) -> list[tuple[str, str]]:
        """Checks that need several fields, or a section that lives in a module without rules."""
        problems = []
        if not self.seeds:
            problems.append(("seeds", "needs at least one seed"))
        if self.run.seed is not None and self.seeds not in ([0], [self.run.seed]):
            problems.append(("run.seed", f"= {self.run.seed} and seeds = {self.seeds}: give one of them"))
        if not self.benchmarks:
            problems.append(("benchmarks", f"needs at least one of {', '.join(BENCH_FOLDERS)}"))
        if not repository_file(self.train_config).is_file():
            problems.append(("train_config", f"= {self.train_config!r}: no such file (from the current folder or "
                                             f"the repository's)"))
        if self.mllm.p_ignore + self.mllm.p_drop + self.mllm.p_garble > 1:
            problems.append(("mllm.p_ignore", "+ mllm.p_drop + mllm.p_garble must sum to at most 1"))
        return problems

    @property
    def progress(self) -> bool:
        return self.run.progress


def toy_backbone_config(model_config: str | Path, weights: str | Path):
    """The BackboneConfig of the trained toy CLIP, with absolute paths: the checkpoints record it,
    and must load from any folder."""
    from demind.schema import BackboneConfig

    return BackboneConfig(name=str(model_config_path(model_config)), pretrained=str(Path(weights).resolve()))


def prepare_backbone(cfg: QuickstartConfig):
    """Train or reuse the toy CLIP (with its modality gap); returns (FrozenCLIP, its report, log of its logit scale)."""
    from demind.backbone import FrozenCLIP

    from .clip_cache import ensure_toy_backbone, with_modality_gap

    weights, report = ensure_toy_backbone(cfg.backbone, Path(cfg.workdir) / "backbone", cfg.progress)
    weights, model_config = with_modality_gap(cfg.backbone, weights)
    backbone = FrozenCLIP(toy_backbone_config(model_config, weights), device=resolve_device(cfg.run.device))
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


def run_name(cfg: QuickstartConfig, variant: str, seed: int) -> str:
    """``demind-seed0``; with ``train_overrides`` a hash of them is appended, so another recipe never
    reuses a model trained (or results evaluated) with other settings."""
    name = f"{variant}-seed{seed}"
    if cfg.train_overrides:
        name += "-" + hashlib.sha256("\n".join(cfg.train_overrides).encode()).hexdigest()[:10]
    return name


def variant_overrides(cfg: QuickstartConfig, variant: str) -> list[str]:
    """The variant's overrides, then the user's; a variant without the gate (``model.fusion=add`` or
    ``intent_only``) drops ``optim.gate_lr``, the lr of the parameter it ablates."""
    user = list(cfg.train_overrides)
    if any(o.startswith("model.fusion=") and o != "model.fusion=gate" for o in VARIANTS[variant]):
        dropped = [o for o in user if o.startswith("optim.gate_lr=")]
        if dropped:
            logger.info("%s: no gate, so %s does not apply", variant, ", ".join(dropped))
        user = [o for o in user if o not in dropped]
    return [*VARIANTS[variant], *user]


def repository_file(name: str) -> Path:
    """``name`` from the current folder, else the repository's file of that name, so the quickstart's
    default recipe (``configs/train/toy.yaml``) is found from any folder."""
    path = Path(name)
    return PACKAGE_ROOT / path if not path.is_file() and (PACKAGE_ROOT / path).is_file() else path


def train_variant(cfg: QuickstartConfig, backbone, variant: str, seed: int, log_scale: float) -> Path:
    """Train one (variant, seed) run with the trainer's own code; reuse a finished export."""
    from demind.training import EXPORT_NAME, load_train_config, train

    # keyed by the backbone, so a retrained backbone never reuses a model trained on another
    run_dir = Path(cfg.workdir) / "train" / backbone.identity_str / run_name(cfg, variant, seed)
    export = run_dir / EXPORT_NAME
    if export.is_file():
        logger.info("reusing %s", export)
        return export
    overrides = [
        f"backbone.name={backbone.cfg.name}", f"backbone.pretrained={backbone.cfg.pretrained}",
        f"data.shards={Path(cfg.workdir) / 'shards'}", f"run.output_dir={run_dir}", f"run.seed={seed}",
        f"model.init_logit_scale={log_scale}", f"run.progress={str(cfg.progress).lower()}",
        f"run.device={cfg.run.device}",
        *variant_overrides(cfg, variant),
    ]
    return train(load_train_config(repository_file(cfg.train_config), overrides))


def write_search_files(cfg: QuickstartConfig, exports: dict[int, Path]) -> Path:
    """``<workdir>/search.json`` (:mod:`demind.search.run_manifest`): what ``demind-serve --quickstart``
    serves: the De-MINDS export of the lowest seed, the toy CIRR dev images as the gallery, and
    where their index goes."""
    from demind.search import write_search_manifest

    workdir = Path(cfg.workdir)
    return write_search_manifest(workdir, exports[min(exports)], workdir / "benchmarks" / "cirr" / "dev",
                                 workdir / "search-index")


STAMP_NAME = "quickstart-stamp.json"


def evaluation_stamp(cfg: QuickstartConfig, export: Path, methods: list[str]) -> dict[str, Any]:
    """What one benchmark's results were computed from: the checkpoint's bytes, the methods, the
    toy benchmarks' recipe and world (and the toy MLLM where the family ran). Equal stamps: the
    stored results stand for a new evaluation."""
    stamp = {"checkpoint_sha256": hashlib.sha256(Path(export).read_bytes()).hexdigest(), "methods": list(methods),
             "toy_benchmarks": asdict(cfg.toy_benchmarks), "world_version": WORLD_VERSION}
    if any(m in FAMILY_METHODS for m in methods):
        stamp["toy_mllm"] = toy_mllm_identity(cfg)
    return stamp


def toy_mllm_identity(cfg: QuickstartConfig) -> dict[str, Any]:
    """The toy MLLM's noise model and store identity (results.json ``toy_mllm``, the evaluation stamp)."""
    noise = cfg.mllm.noise
    tb = cfg.toy_benchmarks
    return {"noise": asdict(noise), "model": toy_model_id(tb.cirr_version, tb.cirr_implicit_share, noise)}


def describe_settings() -> dict[str, Any]:
    """The describer settings the family ran with: demind-eval's ``describe`` defaults (the quickstart sets none)."""
    from demind.mllm import DescribeOptions

    o = DescribeOptions()
    return {k: getattr(o, k) for k in ("prompts", "samples", "temperature", "hybrid_weight", "hybrid_describer")}


def family_summary(cfg: QuickstartConfig, runs: dict[str, dict[int, dict[str, dict[str, Any]]]]) -> dict[str, Any] | None:
    """results.json ``toy_mllm``: the noise model and level, how the toy MLLM answered the toy CIRR's
    queries, and per seed the describers' store counts (``model_loaded`` false: all answers reused)."""
    by_seed = {seed: b["cirr"]["mllm"] for seed, b in runs.get("demind", {}).items() if "mllm" in b.get("cirr", {})}
    if not by_seed:
        return None
    tb, root = cfg.toy_benchmarks, Path(cfg.workdir) / "benchmarks" / BENCH_FOLDERS["cirr"]
    return {**toy_mllm_identity(cfg), "methods": list(FAMILY_METHODS),
            "outcomes": toy_outcomes(root, tb.cirr_version, tb.cirr_implicit_share, cfg.mllm.noise),
            "describe": describe_settings(),
            "runs": by_seed}


def reusable_results(out_dir: Path, stamp: dict[str, Any]) -> dict[str, Any] | None:
    """The results.json of an earlier evaluation with the same stamp, or None (evaluate again)."""
    try:
        if json.loads((out_dir / STAMP_NAME).read_text(encoding="utf-8")) != stamp:
            return None
        results = json.loads((out_dir / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    logger.info("reusing the evaluation in %s (reevaluate=true evaluates again)", out_dir)
    return results


def evaluate_run(cfg: QuickstartConfig, backbone, export: Path, variant: str, seed: int,
                 methods: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every benchmark for one trained model; returns benchmark -> results dict."""
    from demind.checkpoint import load_backbone_and_model
    from demind.eval import CocoOptions, ReaderOptions, evaluate

    backbone, model = load_backbone_and_model(export, backbone)
    bench_root = Path(cfg.workdir) / "benchmarks"
    out = {}
    for bench in cfg.benchmarks:
        root = bench_root / BENCH_FOLDERS[bench]
        options = ReaderOptions(coco=CocoOptions(csv=str(root / "coco_eval.csv"))) if bench == "coco" else None
        bench_methods = [m for m in methods if (m != "oracle" or bench in ORACLE_BENCHMARKS)
                         and (m not in FAMILY_METHODS or bench == "cirr")]  # the toy MLLM reads toy CIRR scenes
        out_dir = Path(cfg.workdir) / "eval" / backbone.identity_str / run_name(cfg, variant, seed) / bench
        stamp = evaluation_stamp(cfg, export, bench_methods)
        results = reusable_results(out_dir, stamp) if not cfg.reevaluate else None
        if results is None:
            tb = cfg.toy_benchmarks
            mllm = (toy_mllm_setup(root, tb.cirr_version, tb.cirr_implicit_share, cfg.mllm.noise)
                    if "toy_mllm" in stamp else None)
            results = evaluate(bench, root, backbone=backbone, model=model, methods=bench_methods, out_dir=out_dir,
                               cache_dir=Path(cfg.workdir) / "eval" / "feature_cache", options=options,
                               batch_size=cfg.eval_batch_size, progress=cfg.progress, mllm=mllm)
            write_json_atomic(out_dir / STAMP_NAME, stamp)  # written last: the done marker of this evaluation
        if bench == "cirr":
            captions, ranked = load_cirr_truth_and_rankings(root, results["files"]["rankings"])
            results["per_type"] = recall_by_type(captions, ranked)
            if "demind" in methods:
                results["paired"] = paired_vs_demind(captions, ranked)
            if any(m in ranked for m in FAMILY_METHODS):
                results["family_paired"] = family_paired(captions, ranked)
            results["deo_paired"] = deo_paired(ranked, cirr_targets(captions), (10,), ap=False)
            results["deo_touched"] = deo_touched(captions, ranked)
        if bench == "exclusion":
            data = json.loads((root / "exclusion.json").read_text())
            ranked = {m: json.loads(Path(f).read_text()) for m, f in results["files"]["rankings"].items()}
            targets = {str(q["id"]): set(q["positives"]) for q in data["queries"]}
            results["deo_paired"] = deo_paired(ranked, targets, (10,), ap=True)
        out[bench] = results
    return out


def trained_gate(export: Path) -> float:
    """tanh(alpha) of a trained De-MINDS export: the weight of t* in t_hat = t_cls + tanh(alpha) t*
    (near 0: the intention branch barely reaches the query)."""
    from demind.checkpoint import read_checked_tensors

    return math.tanh(float(read_checked_tensors(export)["gate"]))


def search_example(workdir: Path) -> dict[str, str] | None:
    """A query to try with demind-search: the first toy CIRR query's reference image and caption."""
    try:
        first = json.loads((workdir / "benchmarks" / "cirr" / "captions" / "cap.rc2.val.json").read_text())[0]
    except (OSError, ValueError, IndexError):
        return None
    return {"image": str(workdir / "benchmarks" / "cirr" / "dev" / f"{first['reference']}.png"),
            "text": first["caption"]}


def training_curves(export: Path) -> Path | None:
    """The loss / lr / gate plot beside the run's metrics.jsonl (drawn now for a run trained before
    the trainer drew it)."""
    from demind.training import PLOT_NAME, plot_training

    existing = export.parent / PLOT_NAME
    return existing if existing.is_file() else plot_training(export.parent / "metrics.jsonl")


def run_quickstart(cfg: QuickstartConfig) -> dict[str, Any]:
    """Run (or finish) the whole quickstart; returns the summary written to results.json."""
    workdir = check_output_dir(cfg.workdir)  # before any stage: a workdir under a file is one line
    model_config_path(cfg.backbone.model_config)  # and a missing model config
    timings: dict[str, float] = {}

    def timed(name: str, fn, *args):
        start = time.perf_counter()
        value = fn(*args)
        timings[name] = round(time.perf_counter() - start, 1) + timings.get(name, 0.0)
        logger.info("%s done in %.1f s", name, time.perf_counter() - start)
        return value

    logger.info("toy world %s", WORLD_VERSION)
    shards = timed("shards", write_toy_shards, workdir / "shards", cfg.shards, cfg.progress)
    timed("benchmarks", write_benchmarks, workdir / "benchmarks", cfg.toy_benchmarks,
          ("cirr", "imgnet", "coco", "exclusion"), cfg.progress)
    backbone, backbone_report, log_scale = timed("backbone", prepare_backbone, cfg)
    timed("features", build_features, cfg, backbone, shards)

    variants = list(VARIANTS) if cfg.ablations else ["demind"]
    runs: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    gates: dict[str, dict[int, float]] = {}
    exports: dict[int, Path] = {}  # the full model's, per seed: what search serves
    for variant in variants:
        family = FAMILY_METHODS if cfg.mllm.family else ()
        methods = ALL_METHODS + family if variant == "demind" else ("demind",)
        for seed in cfg.seed_list:
            export = timed("train", train_variant, cfg, backbone, variant, seed, log_scale)
            gates.setdefault(variant, {})[seed] = trained_gate(export)
            if variant == "demind":
                exports[seed] = export
            runs.setdefault(variant, {})[seed] = timed("evaluate", evaluate_run, cfg, backbone, export,
                                                       variant, seed, methods)
    rows = summarise(runs)
    table = format_quickstart_table(rows)
    per_type = format_per_type(rows)
    paired = format_paired(runs)
    deo = format_deo(runs)
    ablations = ablation_paired(Path(cfg.workdir) / "benchmarks" / BENCH_FOLDERS["cirr"], runs)
    plot = plot_recall(rows, workdir / "recall_at_k.png")
    checkpoint = exports[min(exports)] if exports else None
    training_plot = training_curves(checkpoint) if checkpoint else None
    summary = {"world_version": WORLD_VERSION, "rows": rows, "table": table, "per_type_table": per_type,
               "paired_table": paired, "family_table": format_family_paired(runs), "deo_table": deo, "ablation_table": format_ablation_paired(ablations),
               "ablation_paired": ablations,
               "paired": {seed: b["cirr"].get("paired") for seed, b in runs.get("demind", {}).items() if "cirr" in b},
               "backbone_probes": backbone_report.get("pair_probes"),
               "metrics": metrics_table(runs), "per_type": per_type_metrics(runs), "gate": gates,
               "deo": {seed: {bench: {k: b[bench][k] for k in ("deo_paired", "deo_touched") if k in b[bench]}
                              for bench in ("exclusion", "cirr") if bench in b}
                       for seed, b in runs.get("demind", {}).items()},
               "toy_mllm": family_summary(cfg, runs),
               "family_paired": {seed: b["cirr"]["family_paired"] for seed, b in runs.get("demind", {}).items()
                                 if "family_paired" in b.get("cirr", {})}, "timings_s": timings,
               "backbone": backbone_report, "config": asdict(cfg), "plot": str(plot) if plot else None,
               "checkpoint": str(checkpoint) if checkpoint else None,
               "training_plot": str(training_plot) if training_plot else None,
               "search_example": search_example(workdir)}
    write_json_atomic(workdir / "results.json", summary, indent=2, default=str)
    write_search_files(cfg, exports)
    return summary
