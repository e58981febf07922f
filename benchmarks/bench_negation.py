"""Negation (DEO) numbers: the optimisation's latency per query, and the quickstart's
``+deo`` results per seed.

    python -m benchmarks.bench_negation --latency              # DEO solve time per query
    python -m benchmarks.bench_negation --methods-latency      # whole +deo query vs base, toy CLIP
    python -m benchmarks.bench_negation --workdir runs/quickstart  # toy tables per seed
    python -m benchmarks.bench_negation --backbone-only toyworld/model_configs/toy-clip-cnn-text2.json:WEIGHTS.safetensors \
        --benchmarks runs/quickstart/benchmarks --out runs/deo-bb               # Text-only / Image+Text +- DEO

Latency: the time to turn (e_o, sub-query embeddings) into e_u, exact (closed form) vs the
paper's 20 Adam steps, for one query at a time (the paper's 0.016 s for 20 steps on a CPU)
and for a batch of 256, at D = 128 (toy CLIP) and 768 (ViT-L/14). Encoding the sub-queries
is extra and method-dependent; the quickstart's ``query_timing`` (results.json of each
evaluation) holds the whole +deo query time next to the base method's.
Backbone-only: Text-only and Image+Text need no De-MINDS training, so their +deo rows (and
paired tests) come from the toy CLIP alone, the same for every training seed.
Toy tables: exclusion mAP@10 and toy CIRR R@10 per seed for every base and +deo method,
mean ± std, and the paired counts. ``--json PATH`` writes the latency rows, the methods' latency
and the backbone-only numbers there. Timings: the test suite runs it only at a tiny size
(tests/test_benchmarks_smoke.py), never for its numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_eval import interleaved_medians
from demind.io import write_json_atomic
from demind.negation.deo import DEOConfig, SubQueries, optimise


def time_solver(cfg: DEOConfig, batch: int, dim: int, repeats: int) -> float:
    """Median seconds per call of :func:`optimise` on random unit embeddings (1 positive, 1 negative)."""
    g = torch.Generator().manual_seed(0)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    e_o = unit(batch, dim)
    sub = SubQueries(unit(batch, 1, dim), torch.ones(batch, 1, dtype=torch.bool), unit(batch, 1, dim),
                     torch.ones(batch, 1, dtype=torch.bool))
    optimise(e_o, sub, cfg)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimise(e_o, sub, cfg)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency_table(repeats: int, dims: tuple[int, ...] = (128, 768), batches: tuple[int, ...] = (1, 256)) -> list[dict]:
    rows = []
    for dim in dims:
        for batch in batches:
            exact = time_solver(DEOConfig(mode="exact"), batch, dim, repeats)
            adam = time_solver(DEOConfig(mode="adam", steps=20), batch, dim, repeats)
            rows.append({"dim": dim, "batch": batch, "exact_s_per_query": exact / batch,
                         "adam20_s_per_query": adam / batch, "adam_over_exact": adam / exact})
    return rows


@torch.no_grad()
def methods_latency(model_config: str, batch: int, repeats: int) -> dict[str, float]:
    """Seconds per query of each base method and its +deo variant on the toy CLIP architecture
    (random weights: timing does not depend on them), every query holding one negation."""
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.retrieval import build_methods
    from demind.model import DeMinds

    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=model_config, pretrained=None))
    model = DeMinds(ModelConfig(), backbone).eval()
    names = ["text-only", "text-only+deo", "text-only+deo-adam", "mapping-only", "mapping-only+deo",
             "demind", "demind+deo", "demind+deo-adam"]
    methods = dict(zip(names, build_methods(names, backbone, model)))
    ref = torch.randn(batch, backbone.embed_dim)
    prompts = ["a photo of * , without the red square"] * batch
    texts = ["a photo of a blue circle and a green triangle on grass without the red square"] * batch
    t = interleaved_medians({n: (lambda m=m: m.embed(ref, prompts, texts)) for n, m in methods.items()}, repeats)
    return {n: v / batch for n, v in t.items()}


def toy_tables(workdir: Path) -> str:
    """Per-seed exclusion mAP@10 / toy CIRR R@10 of every method, and the +deo paired counts."""
    summary = json.loads((workdir / "results.json").read_text())
    evals = sorted((workdir / "eval").glob("*/demind-seed*"))
    per_seed: dict[int, dict] = {}
    for folder in evals:
        seed = int(folder.name.rsplit("seed", 1)[1])
        per_seed[seed] = {b: json.loads((folder / b / "results.json").read_text()) for b in ("exclusion", "cirr")
                          if (folder / b / "results.json").is_file()}
    seeds = sorted(per_seed)
    methods = list(per_seed[seeds[0]]["exclusion"]["methods"])
    lines = [f"seeds {seeds}", "method | " + " | ".join(f"excl mAP@10 s{s}" for s in seeds)
             + " | mean ± std | " + " | ".join(f"CIRR R@10 s{s}" for s in seeds) + " | mean ± std"]
    for m in methods:
        ex = [per_seed[s]["exclusion"]["methods"][m]["mAP@10"] for s in seeds]
        ci = [per_seed[s]["cirr"]["methods"][m]["R@10"] for s in seeds]
        sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
        lines.append(f"{m} | " + " | ".join(f"{v:.1f}" for v in ex) + f" | {statistics.fmean(ex):.1f} ± {sd(ex):.1f} | "
                     + " | ".join(f"{v:.1f}" for v in ci) + f" | {statistics.fmean(ci):.1f} ± {sd(ci):.1f}")
    timing = per_seed[seeds[0]]["exclusion"]["query_timing"]
    lines.append("query time per query, exclusion, seed %d: " % seeds[0]
                 + ", ".join(f"{m} {1000 * t['seconds_per_query']:.2f} ms" for m, t in timing.items()))
    lines.append(summary.get("deo_table", ""))
    return "\n".join(lines)


def backbone_only(spec: str, benchmarks: Path, out: Path, numbers: dict | None = None) -> str:
    """Text-only and Image+Text with and without DEO on the toy exclusion set and toy CIRR (the
    metrics also go into ``numbers[bench]`` when given)."""
    from demind.checkpoint import load_backbone_and_model
    from demind.eval import evaluate
    from toyworld.results import deo_paired, deo_touched

    backbone, _ = load_backbone_and_model(None, spec)
    methods = ["text-only", "text-only+deo", "image+text", "image+text+deo"]
    lines = []
    for bench, folder, key in (("exclusion", "exclusion", "mAP@10"), ("cirr", "cirr", "R@10")):
        root = benchmarks / folder
        results = evaluate(bench, root, backbone=backbone, methods=methods, out_dir=out / bench,
                           batch_size=256, progress=False)
        ranked = {m: json.loads(Path(f).read_text()) for m, f in results["files"]["rankings"].items()}
        if bench == "exclusion":
            data = json.loads((root / "exclusion.json").read_text())
            targets = {str(q["id"]): set(q["positives"]) for q in data["queries"]}
            paired = deo_paired(ranked, targets, (10,), ap=True)
        else:
            captions = json.loads((root / "captions" / "cap.rc2.val.json").read_text())
            targets = {str(e["pairid"]): {e["target_hard"]} for e in captions}
            paired = deo_paired(ranked, targets, (10,), ap=False)
            lines.append(f"  toy CIRR touched: {deo_touched(captions, ranked)}")
        lines.append(f"{bench} {key}: " + ", ".join(f"{m} {results['methods'][m][key]:.1f}" for m in methods))
        if numbers is not None:
            numbers[bench] = {m: results["methods"][m][key] for m in methods}
        for m, v in paired.items():
            (k, c), = v.items()
            lines.append(f"  {m} vs base, {k}: better on {c['only_deo']}, worse on {c['only_base']} (p {c['p']:.2g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", action="store_true")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--methods-latency", action="store_true")
    p.add_argument("--model-config", default="toyworld/model_configs/toy-clip-cnn-text2.json")
    p.add_argument("--workdir", help="a finished quickstart workdir")
    p.add_argument("--backbone-only", help="NAME:WEIGHTS of a trained toy CLIP (Text-only / Image+Text +- DEO)")
    p.add_argument("--benchmarks", default="runs/quickstart/benchmarks", help="the quickstart's benchmarks folder")
    p.add_argument("--out", default="runs/deo-backbone-only", help="evaluation outputs (and feature cache)")
    p.add_argument("--json", help="write the numbers here (latency rows, methods' latency, backbone-only metrics)")
    p.add_argument("--dims", default="128,768", help="embedding sizes of --latency")
    p.add_argument("--batches", default="1,256", help="batch sizes of --latency")
    p.add_argument("--methods-batches", default="1,64", help="batch sizes of --methods-latency")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: on a shared machine a spinning second thread costs more than it gives)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    numbers: dict = {}
    if args.latency:
        rows = latency_table(args.repeats, tuple(int(d) for d in args.dims.split(",")),
                             tuple(int(b) for b in args.batches.split(",")))
        numbers["latency"] = rows
        print(f"torch threads {torch.get_num_threads()}")
        print("D | batch | exact s/query | Adam-20 s/query | Adam / exact")
        for r in rows:
            print(f"{r['dim']} | {r['batch']} | {r['exact_s_per_query']:.2e} | {r['adam20_s_per_query']:.2e} | "
                  f"{r['adam_over_exact']:.0f}")
    if args.methods_latency:
        numbers["methods_latency_s_per_query"] = {}
        for batch in (int(b) for b in args.methods_batches.split(",")):
            per_query = methods_latency(args.model_config, batch, args.repeats)
            numbers["methods_latency_s_per_query"][str(batch)] = per_query
            print(f"batch {batch}, ms per query: " + ", ".join(f"{n} {1000 * v:.2f}" for n, v in per_query.items()))
    if args.backbone_only:
        numbers["backbone_only"] = {}
        print(backbone_only(args.backbone_only, Path(args.benchmarks), Path(args.out), numbers["backbone_only"]))
    if args.workdir:
        print(toy_tables(Path(args.workdir)))
    if args.json:
        write_json_atomic(args.json, numbers, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
