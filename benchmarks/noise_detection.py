"""Noise detection on toy intent shards: GFQ fidelity vs a small-loss GMM detector (measurement a).

    python -m benchmarks.noise_detection --quickstart runs/quickstart --out runs/noise_detection
    python -m benchmarks.noise_detection --quickstart Q --out O --tiny     # a minute on a CPU

For hard and easy noise at ``--rate``: toy intent shards with ground-truth labels
(:mod:`toyworld.intent_data`), their feature cache with GFQ fidelity (pool = shard, K = 4,
:mod:`demind.fidelity`), and two detectors of "this sample's T_int / T_rew is wrong":

* **GFQ**: noisy when F < omega (0.5); ranking score 1 - F. Computed from frozen features only.
* **small loss** (TME / DivideMix style): De-MINDS trained ``--warmup-steps`` steps with
  ``training.noise.mode=none`` on the noisy shards, then each sample's loss in fixed batches of the
  training batch size (eval mode): for T_int the alignment loss of the query built from T_int plus
  the distillation loss, for T_rew the alignment loss of the query built from T_rew. A
  2-component Gaussian mixture (scikit-learn ``GaussianMixture``, DivideMix's settings:
  max_iter 20, tol 1e-2, reg_covar 5e-4) over the min-max-normalised losses; noisy when the
  posterior of the low-mean component is below 0.5; ranking score 1 - that posterior.

Per text (T_int, T_rew, and "either": GFQ min(F_int, F_rew), small loss the sum of the two
losses) it reports AUROC, precision and recall against the ground truth (noisy = positive).
Prints a table and writes ``<out>/noise_detection.json``. Shards, caches and the warm-up
training are resumable; scoring takes seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.noise_common import (TINY_TRAIN, NoiseBenchError, add_common_arguments, cell_config, group_name,
                                     load_backbone, noisy_shards, parse_choices, parse_floats, source_config)

logger = logging.getLogger("noise_detection")
TEXTS = ("int", "rew", "either")


def noise_truth(shards: list[Path]) -> dict[str, bool]:
    """key -> True when the toy sample's T_rew and T_int were corrupted (its json's ``noise``)."""
    import webdataset as wds

    truth = {}
    for shard in shards:
        for sample in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False):
            truth[sample["__key__"]] = json.loads(sample["json"])["noise"] is not None
    return truth


def cached_samples(directory: Path, shards: list[Path], backbone) -> dict[str, list]:
    """The feature cache's samples of ``shards`` in shard then tar order, as columns."""
    from demind.embedding_cache import cache_identity
    from demind.features import ShardFeatureCache

    cache = ShardFeatureCache(directory, cache_identity(backbone))
    columns: dict[str, list] = {}
    for shard in shards:
        for sample in cache.samples(str(shard)):
            for name, value in sample.items():
                columns.setdefault(name, []).append(value)
    return columns


@torch.no_grad()
def per_sample_losses(model, columns: dict[str, list], batch_size: int) -> dict[str, torch.Tensor]:
    """(N,) losses per text in fixed batches of ``batch_size`` (the last may be smaller): see the module docstring."""
    import torch.nn.functional as F

    from demind.losses import per_sample_info_nce

    model.eval()
    scale = model.temperature_scale()
    out: dict[str, list[torch.Tensor]] = {"int": [], "rew": []}
    n = len(columns["key"])
    for start in range(0, n, batch_size):
        sl = slice(start, min(start + batch_size, n))
        image = torch.stack(columns["image_emb"][sl]).to(model.backbone.device)
        teacher = F.normalize(torch.stack(columns["teacher_emb"][sl]).to(image.device), dim=-1)
        v = F.normalize(image, dim=-1)
        q_int = model(image, columns["intent"][sl])
        q_rew = model(image, columns["rewritten"][sl])
        out["int"].append((per_sample_info_nce(q_int.t_hat, v, scale) + per_sample_info_nce(q_int.t_star, teacher, scale)).cpu())
        out["rew"].append(per_sample_info_nce(q_rew.t_hat, v, scale).cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def gmm_clean_posterior(losses: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(N,) posterior of the low-mean component of a 2-component GMM over min-max-normalised losses
    (:func:`demind.robust.gmm_clean_probability`, the small-loss detector triplet training uses)."""
    from demind.robust import gmm_clean_probability

    return gmm_clean_probability(losses, seed)


def detection_metrics(truth: torch.Tensor, score: torch.Tensor, flagged: torch.Tensor) -> dict[str, float]:
    """AUROC of ``score`` (higher = noisier), precision and recall of ``flagged``; noisy = positive."""
    from sklearn.metrics import roc_auc_score

    truth, flagged = truth.bool(), flagged.bool()
    tp = int((truth & flagged).sum())
    return {"auroc": float(roc_auc_score(truth.numpy(), score.numpy())) if 0 < truth.sum() < len(truth) else float("nan"),
            "precision": tp / max(int(flagged.sum()), 1), "recall": tp / max(int(truth.sum()), 1),
            "flagged": int(flagged.sum()), "noisy": int(truth.sum()), "samples": len(truth)}


def detect(columns: dict[str, list], truth_by_key: dict[str, bool], losses: dict[str, torch.Tensor], omega: float,
           seed: int) -> dict[str, dict[str, dict[str, float]]]:
    """detector -> text -> metrics."""
    truth = torch.tensor([truth_by_key[k] for k in columns["key"]])
    fid = {"int": torch.stack(columns["fidelity_int"]), "rew": torch.stack(columns["fidelity_rew"])}
    fid["either"] = torch.minimum(fid["int"], fid["rew"])
    losses = {**losses, "either": losses["int"] + losses["rew"]}
    out: dict[str, dict[str, dict[str, float]]] = {"gfq": {}, "small-loss": {}}
    for text in TEXTS:
        out["gfq"][text] = detection_metrics(truth, 1 - fid[text], fid[text] < omega)
        clean = gmm_clean_posterior(losses[text], seed)
        out["small-loss"][text] = detection_metrics(truth, 1 - clean, clean < 0.5)
    return out


def run_kind(out: Path, cfg, backbone, log_scale: float, kind: str, rate: float, args, overrides: list[str]
             ) -> dict[str, Any]:
    from demind.checkpoint import load_backbone_and_model
    from demind.features import default_cache_dir
    from demind.schema import GFQ_THRESHOLD
    from toyworld.pipeline import build_features, train_variant
    from demind.training import load_train_config

    shards = noisy_shards(out, cfg, kind, rate, args.num_samples)
    build_features(cfg, backbone, shards)
    group = group_name(kind, rate)
    warm = cell_config(out, cfg, group, "none", [*overrides, f"optim.max_steps={args.warmup_steps}",
                                                 f"optim.warmup_steps={max(1, args.warmup_steps // 10)}"],
                       folder=f"warmup-none-{args.warmup_steps}")
    export = train_variant(warm, backbone, "demind", args.seed, log_scale)
    _, model = load_backbone_and_model(export, backbone)
    train_cfg = load_train_config(warm.train_config, warm.train_overrides)
    columns = cached_samples(default_cache_dir([str(p) for p in shards], backbone.identity_str), shards, backbone)
    losses = per_sample_losses(model, columns, train_cfg.optim.global_batch_size)
    results = detect(columns, noise_truth(shards), losses, GFQ_THRESHOLD, args.seed)
    return {"kind": kind, "rate": rate, "warmup_steps": args.warmup_steps, "export": str(export), "results": results}


def format_table(runs: dict[str, Any]) -> str:
    header = ["noise", "detector", "text", "AUROC", "precision", "recall", "flagged/noisy/samples"]
    rows = [header]
    for run in runs.values():
        for detector, by_text in run["results"].items():
            for text, m in by_text.items():
                rows.append([f"{run['kind']} {run['rate']:.0%}", detector, f"T_{text}" if text != "either" else "either",
                             f"{m['auroc']:.3f}", f"{m['precision']:.3f}", f"{m['recall']:.3f}",
                             f"{m['flagged']}/{m['noisy']}/{m['samples']}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "64 samples, 3 warm-up steps: a smoke run")
    parser.add_argument("--rate", default="0.5", help="noise rate (or percentage), > 0")
    parser.add_argument("--warmup-steps", type=int, default=100, help="steps of mode-none training before the "
                                                                      "small-loss detector scores the samples")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    from demind.io import write_json_atomic

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        kinds = parse_choices(args.kinds, "kinds", ("hard", "easy"))
        (rate,) = parse_floats(args.rate, "rate")
        if rate == 0:
            raise NoiseBenchError("--rate must be above 0: detection needs noisy samples")
        if args.warmup_steps < 1:
            raise NoiseBenchError("--warmup-steps must be >= 1")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = source_config(args.quickstart)
        cfg.run.progress = False
        backbone, log_scale = load_backbone(args.quickstart, cfg)
    except NoiseBenchError as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2
    if args.tiny:
        args.num_samples = args.num_samples or 64
        args.warmup_steps = 3
    overrides = [*(TINY_TRAIN if args.tiny else []), *args.train_override]
    runs = {kind: run_kind(out, cfg, backbone, log_scale, kind, rate, args, overrides) for kind in kinds}
    table = format_table(runs)
    write_json_atomic(out / "noise_detection.json", {"runs": runs, "table": table,
                                                     "settings": {**vars(args), "overrides": overrides}}, indent=2)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
