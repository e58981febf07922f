"""Generated triplets (MegaPairs-style) beside De-MINDS on the toy world (design, fixed before the runs:
docs/lab-notes/generated-triplets.md).

    python -m benchmarks.generated_triplets --workdir runs/generated-triplets

Pairs are mined in the toy intent corpus (``demind-mine-pairs``' library; no toy CIRR label is read), a toy
pair describer and instruction writer that read the two toy scenes (failure rates fixed in advance, as the
toy describers fix theirs: :data:`P_IGNORE`, :data:`P_DROP`, :data:`P_GARBLE`) write the triplet shards in
``demind-generate-triplets``' schema (:func:`write_triplets`: directly, the toy describer is not an MLLM
engine), and ``demind-train-triplets data.source=generated`` trains the combiner. It is scored zero-shot on
the toy CIRR test beside De-MINDS trained on the same images' intent captions, the combiner trained on
labelled toy CIRR triplets (the supervised ceiling) and the untrained baselines, with
``benchmarks.conesep_triplets``' test set and scoring (demind-eval's code). Each run's result is kept
(``runs/<arm>/<size>/seed<N>/eval.json``): a killed run resumes, a rerun only aggregates. Outputs:
``generated_triplets.md`` (BENCHMARKS.md-ready), ``generated_triplets.json``, ``generated_triplets.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import tarfile
import time
from pathlib import Path

from benchmarks.conesep_triplets import paired_tests, per_query_avg, score_method
from toyworld.results import mean_std

log = logging.getLogger("benchmarks.generated_triplets")

SIZES = (1000, 3000, 9000)
SEEDS = (0, 1, 2)
SAMPLES_PER_SHARD = 500
P_IGNORE, P_DROP, P_GARBLE = 0.2, 0.1, 0.05  # fixed before the runs (the lab note)
INSTRUCTIONS = 3
MINING = ["image.low=-1", "image.high=1", "caption.low=-1", "caption.high=1", "mining.neighbours=20",
          "mining.targets=2", "mining.hard_negatives=5", "second.enabled=false"]
WINDOW_QUANTILES = ("25%", "95%")
METRICS = ("R@1", "R@5", "R@10", "Rsubset@1", "Avg")


# --------------------------------------------------------------------------- the toy describer and writer


def read_scenes(shards: list[str]) -> dict:
    """key -> the toy scene each intent sample records (``json.toy.scene``)."""
    from toyworld.world import Scene

    scenes = {}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    scenes[member.name.split(".", 1)[0]] = Scene.from_dict(meta["toy"]["scene"])
    return scenes


def revert_one(reference, target, rng: random.Random):
    """``target`` with one of its differences from ``reference`` undone (the describer missed it), or
    None when there is only one difference or it cannot be undone alone (a theme)."""
    from toyworld.world import scene_diff

    try:
        changes = [c for c in scene_diff(reference, target) if c.kind != "implicit"]
    except ValueError:  # a theme to remove: the toy texts cannot say it; nothing is dropped
        return None
    if len(changes) < 2:
        return None
    change = rng.choice(changes)
    objects = list(target.objects)
    if change.kind == "remove":
        objects.append(change.before)
    elif change.kind == "add":
        objects = [o for o in objects if o.oid != change.after.oid]
    elif change.kind == "shape":
        objects = [change.before if o.oid == change.after.oid else o for o in objects]
    elif change.kind in ("colour", "size", "position"):
        objects = [dataclasses.replace(o, **{change.kind: getattr(change.before, change.kind)})
                   if o.oid == change.after.oid else o for o in objects]
    elif change.kind == "background":
        return dataclasses.replace(target, background=reference.background)
    elif change.kind == "style":
        return dataclasses.replace(target, style=reference.style)
    return dataclasses.replace(target, objects=tuple(objects))


def describe_and_instruct(reference, target, seed: int) -> tuple[str, list[str], str | None, int]:
    """(description, instructions, failure, writer attempts) of one pair; instructions [] = a counted skip.

    The describer perceives the pair (p_ignore: no change, p_drop: one difference missed); the writer
    writes INSTRUCTIONS texts from that perception with the toy LLM of De-MINDS's T_int
    (``modification_text``, pool ``llm``, p_description 0.15, p_keep 0.3); an answer garbled with
    p_garble is retried once."""
    from toyworld.texts import full_description, modification_text

    rng = random.Random(seed)
    draw, failure, perceived = rng.random(), None, target
    if draw < P_IGNORE:
        failure, perceived = "ignore", reference
    elif draw < P_IGNORE + P_DROP:
        dropped = revert_one(reference, target, rng)
        failure, perceived = ("drop", dropped) if dropped is not None else ("drop", reference)
    description = (f"Both images are toy scenes. However, the source image shows {full_description(reference, rng)} "
                   f"whereas the target image shows {full_description(perceived, rng)}")
    for attempt in (1, 2):
        if rng.random() < P_GARBLE:
            continue  # unparsable: retried once, then the pair is skipped
        texts = []
        for _ in range(INSTRUCTIONS):
            try:
                texts.append(modification_text(reference, perceived, rng, "llm", p_description=0.15, p_keep=0.3))
            except ValueError:  # no difference perceived (or a theme to remove): the reference described
                texts.append("the same scene: " + full_description(reference, rng).rstrip("."))
        return description, texts, failure, attempt
    return description, [], "garbled", 2


def write_triplets(pairs: Path, out: Path, scenes: dict) -> dict:
    """Triplet shards from the pair shards in ``pairs`` (``demind-generate-triplets``' schema and manifest),
    one per pair shard with its stats file last; returns totals."""
    from demind.io import write_json_atomic
    from demind.seeding import derive_seed
    from demind.shard_format import JSON_FIELD, ShardOutput, ShardWriter

    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((pairs / "pairs_manifest.json").read_text())
    write_json_atomic(out / "triplets_manifest.json", {
        "format": "demind-triplets/1", "pairs": {"folder": str(pairs)}, "corpus": manifest["corpus"],
        "backbone": manifest["backbone"], "describer": {"engine": "toy-world", "model": "toy-pair-describer",
                                                        "p_ignore": P_IGNORE, "p_drop": P_DROP},
        "writer": {"engine": "toy-world", "model": "toyworld.texts llm pool", "p_garble": P_GARBLE}}, indent=1)
    totals = {"pairs": 0, "triplets": 0, "skipped": 0, "ignore": 0, "drop": 0, "retried": 0}
    for shard in sorted(pairs.glob("pairs-*.tar")):
        target = ShardOutput.of(out / shard.name.replace("pairs-", "triplets-"))
        if target.is_done():
            totals.update({k: totals[k] + v for k, v in target.load_stats()["totals"].items()})
            continue
        counts = dict.fromkeys(totals, 0)
        with tarfile.open(shard) as tar, ShardWriter(target.tar) as writer:
            for member in tar:
                record = json.loads(tar.extractfile(member).read())
                for pair in record["targets"]:
                    counts["pairs"] += 1
                    description, texts, failure, attempts = describe_and_instruct(
                        scenes[record["reference"]], scenes[pair["key"]],
                        derive_seed("toy-triplets", record["reference"], pair["key"]))
                    counts["retried"] += attempts > 1
                    if failure in ("ignore", "drop"):
                        counts[failure] += 1
                    if not texts:
                        counts["skipped"] += 1
                        continue
                    counts["triplets"] += len(texts)
                    writer.write({"__key__": f"{record['reference']}_{pair['key']}", JSON_FIELD: json.dumps({
                        "reference": record["reference"], "target": pair["key"], "instructions": texts,
                        "hard_negatives": [k for k in record["hard_negatives"] if k != pair["key"]],
                        "description": description, "signals": pair["signals"], "scores": pair["scores"],
                        "generation": {"engine": "toy-world", "failure": failure}}).encode()})
        target.mark_done({"shard": target.tar.name, "totals": counts})
        totals.update({k: totals[k] + v for k, v in counts.items()})
    return totals


# --------------------------------------------------------------------------- the arms


def corpus_spec(corpus: Path, size: int, per_shard: int = SAMPLES_PER_SHARD) -> str:
    """The first ``size`` images of the toy corpus (nested: a smaller corpus is a prefix of a larger one)."""
    last = size // per_shard - 1
    return str(corpus / f"{{00000..{last:05d}}}.tar") if last else str(corpus / "00000.tar")


def mine(workdir: Path, corpus: str, out: Path, windows: list[str], backbone) -> dict:
    from demind.config import load_config
    from demind.pairs.config import MinePairsConfig
    from demind.pairs.job import mine_pairs

    cfg = load_config(MinePairsConfig, None, [f"input={corpus}", f"output={out}", *MINING, *windows,
                                              f"backbone.name={backbone.cfg.name}",
                                              f"backbone.pretrained={backbone.cfg.pretrained}", "run.progress=false"])
    mine_pairs(cfg, backbone)
    return mining_totals(out)


def mining_totals(out: Path) -> dict:
    """Queries, pairs and the mining rate of a pair folder, from its shards' stats (a resumed run too)."""
    stats = [json.loads(p.read_text()) for p in sorted(out.glob("pairs-*_stats.json"))]
    totals = {k: sum(s[k] for s in stats) for k in ("queries", "written", "pairs", "hard_negatives")}
    elapsed = sum(s["elapsed_s"] for s in stats)
    return {**totals, "mining_s": round(elapsed, 2), "pairs_per_s": round(totals["pairs"] / elapsed, 1) if elapsed else None,
            "similarity_quantiles": stats[0]["similarity_quantiles"] if stats else {}}


def windows_from(quantiles: dict) -> list[str]:
    """The design's rule: each signal's window is (25 %, 95 %) of the smallest corpus's neighbour similarities."""
    low, high = WINDOW_QUANTILES
    return [f"{s}.{edge}={q[key]}" for s, q in quantiles.items() for edge, key in (("low", low), ("high", high))]


def run_dir(workdir: Path, arm: str, size, seed) -> Path:
    return workdir / "runs" / arm / str(size) / f"seed{seed}"


def train_combiner(workdir, arm, size, seed, base, backbone, test, data_cache: dict, **data) -> dict:
    from demind.checkpoint import load_checkpoint
    from demind.io import write_json_atomic
    from demind.retrieval import CombinerQuery
    from demind.triplets.train import load_training_data, train_triplets

    out = run_dir(workdir, arm, size, seed)
    if (out / "eval.json").is_file():
        return json.loads((out / "eval.json").read_text())
    cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, **data),
                              run=dataclasses.replace(base.run, seed=seed, output_dir=str(out)))
    key = (arm, size)
    if key not in data_cache:
        data_cache.clear()
        data_cache[key] = load_training_data(cfg, backbone)
    t0 = time.perf_counter()
    path = train_triplets(cfg, backbone, data_cache[key])
    result = score_method(CombinerQuery(backbone, load_checkpoint(path, backbone)), test)
    result.update(train_seconds=round(time.perf_counter() - t0, 2), triplets=int(data_cache[key].reference.shape[0]))
    write_json_atomic(out / "eval.json", result)
    return result


def train_demind(workdir, size, seed, corpus: str, backbone, test) -> dict:
    from demind.checkpoint import load_backbone_and_model
    from demind.io import write_json_atomic
    from demind.retrieval import DeMindsQuery
    from demind.training import load_train_config, train

    out = run_dir(workdir, "demind", size, seed)
    if (out / "eval.json").is_file():
        return json.loads((out / "eval.json").read_text())
    log_scale = float(backbone.model.logit_scale.detach().clamp(max=math.log(100)))
    t0 = time.perf_counter()
    export = train(load_train_config("configs/train/toy.yaml", [
        f"backbone.name={backbone.cfg.name}", f"backbone.pretrained={backbone.cfg.pretrained}",
        f"data.shards={corpus}", f"run.output_dir={out}", f"run.seed={seed}", f"model.init_logit_scale={log_scale}",
        "run.progress=false", "run.device=cpu"]))
    _, model = load_backbone_and_model(export, backbone)
    result = score_method(DeMindsQuery(backbone, model), test)
    result["train_seconds"] = round(time.perf_counter() - t0, 2)
    write_json_atomic(out / "eval.json", result)
    return result


def run_all(args) -> dict:
    import torch

    from demind.backbone import build_backbone
    from demind.config import load_config
    from demind.io import write_json_atomic
    from demind.retrieval import ImageOnly, ImagePlusText, TextOnly
    from demind.shard_format import resolve_shards
    from demind.triplets.config import TripletTrainConfig
    from toyworld.intent_data import ToyShardConfig, write_toy_shards
    from toyworld.triplets import write_toy_triplets

    from benchmarks.conesep_triplets import TestSet

    torch.set_num_threads(args.threads)
    workdir = args.workdir
    toy = workdir / "toy"
    # supervised triplets, the toy CIRR test, the backbone
    write_toy_triplets(toy, args.train_sets, args.test_sets, progress=False)
    base = load_config(TripletTrainConfig, toy / "train.yaml", ["run.device=cpu", "run.progress=false",
                                                                 f"data.cache_dir={workdir / 'feature_cache'}",
                                                                 *([f"optim.epochs={args.epochs}"] if args.epochs else []),
                                                                 *args.set])
    backbone = build_backbone(base.backbone)
    test = TestSet(toy / "cirr", backbone, workdir / "feature_cache")
    corpus = workdir / "corpus"
    write_toy_shards(corpus, ToyShardConfig(num_samples=max(args.sizes), samples_per_shard=args.shard_size),
                     show_progress=False, workers=1)
    if args.part == "demind":  # a second process on a shared machine: the expensive arm alone
        for size, seed in [(size, seed) for size in sorted(args.sizes, reverse=True) for seed in args.seeds]:
            train_demind(workdir, size, seed, corpus_spec(corpus, size, args.shard_size), backbone, test)
            log.info("De-MINDS %d seed %d done", size, seed)
        return {}
    record = {"baselines": {}, "mining": {}, "writing": {}}
    for method in (ImageOnly(backbone), TextOnly(backbone), ImagePlusText(backbone)):
        record["baselines"][method.name] = score_method(method, test)["metrics"]
    started, cache = time.perf_counter(), {}
    for seed in args.seeds:
        train_combiner(workdir, "supervised", "cirr", seed, base, backbone, test, cache)
    calibration = mine(workdir, corpus_spec(corpus, min(args.sizes), args.shard_size), workdir / "calibration", [],
                       backbone)
    windows = windows_from(calibration["similarity_quantiles"])
    record["windows"] = windows
    record["calibration_quantiles"] = calibration["similarity_quantiles"]
    for size in sorted(args.sizes):
        spec = corpus_spec(corpus, size, args.shard_size)
        pairs, triplets = workdir / "pairs" / str(size), workdir / "triplets" / str(size)
        record["mining"][size] = mine(workdir, spec, pairs, windows, backbone)
        record["writing"][size] = write_triplets(pairs, triplets, read_scenes(resolve_shards(spec)))
        log.info("size %d: %s; %s", size, record["mining"][size], record["writing"][size])
        for seed in args.seeds:
            train_combiner(workdir, "generated", size, seed, base, backbone, test, cache, source="generated",
                           path=str(triplets), hard_negatives=5)
        if size == max(args.sizes):
            for seed in args.seeds:
                train_combiner(workdir, "generated-nohard", size, seed, base, backbone, test, cache,
                               source="generated", path=str(triplets), hard_negatives=0)
        log.info("generated arm at %d done (%.0fs so far)", size, time.perf_counter() - started)
    for size in ([] if args.skip_demind else sorted(args.sizes, reverse=True)):  # the expensive arm last (the cut)
        for seed in args.seeds:
            train_demind(workdir, size, seed, corpus_spec(corpus, size, args.shard_size), backbone, test)
            log.info("De-MINDS %d seed %d done (%.0fs so far)", size, seed, time.perf_counter() - started)
    write_json_atomic(workdir / "record.json", record, indent=1)
    return record


# --------------------------------------------------------------------------- aggregation


def results_of(workdir: Path, arm: str, size, seeds) -> dict[int, dict]:
    found = {s: run_dir(workdir, arm, size, s) / "eval.json" for s in seeds}
    return {s: json.loads(p.read_text()) for s, p in found.items() if p.is_file()}


def row(arm: str, size, results: dict[int, dict]) -> dict:
    out = {"arm": arm, "size": size, "seeds": sorted(results)}
    for metric in METRICS:
        out[metric] = mean_std([r["metrics"][metric] for r in results.values()])
    return out


def baseline_per_query(workdir: Path) -> dict:
    """Image+Text's per-query record on the test (for the paired test; deterministic, scored once)."""
    from demind.io import write_json_atomic

    path = run_dir(workdir, "image+text", "-", 0) / "eval.json"
    if not path.is_file():
        from demind.backbone import build_backbone
        from demind.config import load_config
        from demind.retrieval import ImagePlusText
        from demind.triplets.config import TripletTrainConfig

        from benchmarks.conesep_triplets import TestSet

        base = load_config(TripletTrainConfig, workdir / "toy" / "train.yaml", [])
        backbone = build_backbone(base.backbone)
        write_json_atomic(path, score_method(ImagePlusText(backbone), TestSet(workdir / "toy" / "cirr", backbone,
                                                                               workdir / "feature_cache")))
    return json.loads(path.read_text())


def aggregate(args) -> dict:
    record = json.loads((args.workdir / "record.json").read_text())
    image_text = baseline_per_query(args.workdir)
    record["mining"] = {str(size): mining_totals(args.workdir / "pairs" / str(size)) for size in sorted(args.sizes)}
    rows, tests = [], {}
    supervised = results_of(args.workdir, "supervised", "cirr", args.seeds)
    for size in sorted(args.sizes):
        for arm in ("generated", "generated-nohard", "demind"):
            found = results_of(args.workdir, arm, size, args.seeds)
            if found:
                rows.append(row(arm, size, found))
        generated = results_of(args.workdir, "generated", size, args.seeds)
        demind = results_of(args.workdir, "demind", size, args.seeds)
        tests[size] = {"vs_demind": paired_tests(generated, demind), "vs_supervised": paired_tests(generated, supervised),
                       "vs_image+text": paired_tests(generated, {s: image_text for s in generated})}
        if size == max(args.sizes):
            tests[size]["vs_nohard"] = paired_tests(generated, results_of(args.workdir, "generated-nohard", size,
                                                                          args.seeds))
    rows.append(row("supervised", "toy CIRR train (5,000 triplets)", supervised))
    return {"rows": rows, "tests": tests, "record": record,
            "settings": {"sizes": list(args.sizes), "seeds": list(args.seeds), "p_ignore": P_IGNORE,
                         "p_drop": P_DROP, "p_garble": P_GARBLE, "instructions": INSTRUCTIONS, "mining": MINING}}


def fmt(ms) -> str:
    return f"{ms[0]:.1f} ± {ms[1]:.1f}"


def seed_tests(tests: dict) -> str:
    return "; ".join(f"s{seed}: {t['better']}/{t['worse']}, p {t['p_sign']:.2g}" for seed, t in sorted(tests.items())) or "-"


def markdown(summary: dict, command: str) -> str:
    rec = summary["record"]
    lines = [f"`{command}`", "", "| arm | corpus images | seeds | R@1 | R@5 | R@10 | Rsub@1 | Avg |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in rec["baselines"].items():
        lines.append(f"| {name} (untrained) | - | - | {m['R@1']:.1f} | {m['R@5']:.1f} | {m['R@10']:.1f} | "
                     f"{m['Rsubset@1']:.1f} | {m['Avg']:.1f} |")
    for r in summary["rows"]:
        lines.append(f"| {r['arm']} | {r['size']} | {len(r['seeds'])} | " + " | ".join(fmt(r[m]) for m in METRICS) + " |")
    lines += ["", "Paired sign tests per seed over toy CIRR sets (generated better/worse, exact p; one test per seed):", "",
              "| corpus images | generated vs De-MINDS | generated vs supervised | generated vs Image+Text | "
              "generated vs no hard negatives |", "|---|---|---|---|---|"]
    for size, t in summary["tests"].items():
        lines.append(f"| {size} | {seed_tests(t['vs_demind'])} | {seed_tests(t['vs_supervised'])} | "
                     f"{seed_tests(t['vs_image+text'])} | {seed_tests(t.get('vs_nohard', {}))} |")
    lines += ["", "Mining and writing per corpus size (pairs, triplets after the writer's skips, mining rate):", "",
              "| corpus images | queries with a target | pairs | pairs/s | triplets | writer: ignored / dropped / skipped |",
              "|---|---|---|---|---|---|"]
    for size, m in rec["mining"].items():
        w = rec["writing"][size]
        lines.append(f"| {size} | {m['written']} of {m['queries']} | {m['pairs']} | {m['pairs_per_s']} | "
                     f"{w['triplets']} | {w['ignore']} / {w['drop']} / {w['skipped']} |")
    lines += ["", f"Windows (the design's rule, from the {min(summary['settings']['sizes'])}-image corpus): "
              + ", ".join(rec["windows"])]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    from demind.plots import file_pyplot

    plt = file_pyplot("generated-triplets plot")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for arm in ("generated", "demind"):
        rows = [r for r in summary["rows"] if r["arm"] == arm]
        if not rows:
            continue
        ax.errorbar([r["size"] for r in rows], [r["Avg"][0] for r in rows], yerr=[r["Avg"][1] for r in rows],
                    marker="o", capsize=3, label=arm)
    sup = next(r for r in summary["rows"] if r["arm"] == "supervised")
    ax.axhline(sup["Avg"][0], ls="--", c="k", label="supervised (toy CIRR labels)")
    ax.axhline(summary["record"]["baselines"]["text-only"]["Avg"], ls="-.", c="gray", label="text-only (untrained)")
    ax.axhline(summary["record"]["baselines"]["image+text"]["Avg"], ls=":", c="gray", label="image+text (untrained)")
    ax.set_xscale("log")
    ax.set_xlabel("corpus images")
    ax.set_ylabel("toy CIRR Avg")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/generated-triplets"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's cores)")
    parser.add_argument("--train-sets", type=int, default=2500, help="labelled toy CIRR sets of the supervised arm")
    parser.add_argument("--test-sets", type=int, default=1500, help="toy CIRR test sets")
    parser.add_argument("--shard-size", type=int, default=SAMPLES_PER_SHARD, help="corpus images per shard "
                                                                                  "(sizes are multiples of it)")
    parser.add_argument("--epochs", type=int, default=None, help="combiner epochs (default: the toy recipe's)")
    parser.add_argument("--set", nargs="*", default=[], help="combiner recipe overrides, e.g. optim.batch_size=8")
    parser.add_argument("--aggregate-only", action="store_true")
    parser.add_argument("--skip-demind", action="store_true", help="leave the De-MINDS runs to a --part demind process")
    parser.add_argument("--part", choices=("all", "demind"), default="all",
                        help="demind: only the De-MINDS runs, in a second process beside an 'all' one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.aggregate_only:
        run_all(args)
    if args.part == "demind":
        return 0
    summary = aggregate(args)
    from demind.io import write_json_atomic, write_text_atomic

    write_json_atomic(args.workdir / "generated_triplets.json", summary, indent=1)
    command = "python -m benchmarks.generated_triplets --workdir " + str(args.workdir)
    write_text_atomic(args.workdir / "generated_triplets.md", markdown(summary, command))
    plot(summary, args.workdir / "generated_triplets.png")
    print(markdown(summary, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
