"""Training throughput with vs without the frozen-feature cache, and peak memory as shards grow.

    python -m benchmarks.bench_train --backbone ViT-B-32 --batch 16 --steps 6 --json out.json

1. Throughput: synthetic 256 px JPEG intent shards, the real trainer (demind.training.train)
   run twice on the same randomly initialised backbone, once decoding images and running the
   frozen encoders every step, once on features cached by ``demind.features`` beforehand.
   samples/s is the median of the per-step values in metrics.jsonl, first step excluded;
   the ratio cached/uncached comes from one invocation (same machine, same load).
2. Memory: peak RSS of a training process (tiny backbone) that streams 2, 8, 32, ... shards
   once, with and without the cache; each size runs in a fresh subprocess.

Prints a table and JSON. Timings: the test suite runs it only at a tiny size
(tests/test_benchmarks_smoke.py), never for its numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/model/tiny-clip.json"


def train_overrides(shards: Path, run: Path, backbone: str, batch: int, steps: int, features: str,
                    small_model: bool) -> list[str]:
    out = [f"data.shards={shards}", f"run.output_dir={run}", f"backbone.name={backbone}", "backbone.pretrained=null",
           f"optim.global_batch_size={batch}", f"optim.max_steps={steps}", "optim.warmup_steps=1", "optim.lr=1e-5",
           "run.log_every=1", f"run.save_every={steps}", "run.trackers=[]", "run.device=cpu", "data.num_workers=1",
           f"data.features={features}", "data.shuffle_buffer=64", "data.resample=true"]
    if small_model:
        out += ["model.num_queries=2", "model.num_blocks=2", "model.num_heads=4", "model.mapping_hidden=64"]
    return out


def run_training(overrides: list[str]) -> list[dict]:
    """Train in this process; return metrics.jsonl rows."""
    from accelerate.state import AcceleratorState, GradientState

    from demind.training import load_train_config, train

    cfg = load_train_config(None, overrides)
    train(cfg)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return [json.loads(line) for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]


def build_cache(overrides: list[str]) -> float:
    """Run ``python -m demind.features`` in-process; return its seconds."""
    from demind.cli import features

    start = time.perf_counter()
    features.main(overrides)
    return time.perf_counter() - start


def throughput(args: argparse.Namespace, work: Path) -> dict:
    from toyworld.synthetic import write_synthetic_shards

    shards = work / "shards_tp"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=args.batch * (args.steps + 1),
                           image_size=256, seed=0, text_lengths=args.text_lengths)
    base = dict(shards=shards, backbone=args.backbone, batch=args.batch, steps=args.steps, small_model=False)
    cache_s = build_cache(train_overrides(run=work / "unused", features="auto", **base))
    per_run = {}
    for mode, features in (("uncached", "null"), ("cached", "auto")):
        rows = run_training(train_overrides(run=work / f"run_{mode}", features=features, **base))
        per_run[mode] = statistics.median(r["samples_per_s"] for r in rows[1:])
    return dict(backbone=f"{args.backbone} (random init)", global_batch=args.batch, steps_timed=args.steps - 1,
                text_lengths=args.text_lengths,
                uncached_samples_per_s=round(per_run["uncached"], 2), cached_samples_per_s=round(per_run["cached"], 2),
                ratio_cached_over_uncached=round(per_run["cached"] / per_run["uncached"], 2),
                cache_build_s=round(cache_s, 1), cache_build_samples=2 * args.batch * (args.steps + 1))


def memory_child(shards: Path, run: Path, features: str, batch: int, steps: int) -> None:
    """Stream every shard once (epoch mode) and print the peak RSS in MiB as JSON."""
    run_training(train_overrides(shards=shards, run=run, backbone=str(TINY), batch=batch, steps=steps,
                                 features=features, small_model=True) + ["data.resample=false"])
    # The trainer process, and its largest DataLoader worker (a finished child process).
    print(json.dumps(dict(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          worker_peak_rss_mib=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)))


def memory(args: argparse.Namespace, work: Path) -> list[dict]:
    from toyworld.synthetic import write_synthetic_shards

    rows = []
    per_shard, batch = 64, 64
    for count in args.shard_counts:
        shards = work / f"shards_mem_{count}"
        write_synthetic_shards(shards, num_shards=count, samples_per_shard=per_shard, image_size=128, seed=count)
        build_cache(train_overrides(shards=shards, run=work / "unused", backbone=str(TINY), batch=batch, steps=1,
                                    features="auto", small_model=True))
        steps = count * per_shard // batch  # one pass over all shards
        for mode, features in (("uncached", "null"), ("cached", "auto")):
            cmd = [sys.executable, "-m", "benchmarks.bench_train", "--memory-child", str(shards), str(work / f"run_mem_{count}_{mode}"),
                   features, str(batch), str(steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True).stdout
            peak = json.loads(out.strip().splitlines()[-1])
            rows.append(dict(shards=count, samples=count * per_shard, mode=mode,
                             peak_rss_mib=round(peak["peak_rss_mib"], 1),
                             worker_peak_rss_mib=round(peak["worker_peak_rss_mib"], 1)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="ViT-B-32", help="open_clip model name, randomly initialised")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--text-lengths", choices=("short", "cc3m"), default="short",
                        help="synthetic texts: 3-4 words, or CC3M-like (T_ori ~12 words, T_rew ~65, T_int ~27 tokens)")
    parser.add_argument("--shard-counts", type=int, nargs="*", default=[2, 8, 32])
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    if args.memory_child:
        shards, run, features, batch, steps = args.memory_child
        memory_child(Path(shards), Path(run), features, int(batch), int(steps))
        return 0
    results: dict = dict(torch_threads=torch.get_num_threads(), device="cpu", gpu=torch.cuda.is_available())
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        work = Path(tmp)
        if not args.skip_throughput:
            results["throughput"] = throughput(args, work)
        if not args.skip_memory:
            results["memory"] = memory(args, work)
    if "throughput" in results:
        t = results["throughput"]
        print(f"\n{'backbone':<28}{'batch':>6}{'uncached/s':>12}{'cached/s':>10}{'ratio':>7}")
        print(f"{t['backbone']:<28}{t['global_batch']:>6}{t['uncached_samples_per_s']:>12}"
              f"{t['cached_samples_per_s']:>10}{t['ratio_cached_over_uncached']:>7}")
    if "memory" in results:
        print(f"\n{'shards':>7}{'samples':>9}{'mode':>10}{'trainer peak RSS MiB':>22}{'worker peak RSS MiB':>21}")
        for row in results["memory"]:
            print(f"{row['shards']:>7}{row['samples']:>9}{row['mode']:>10}{row['peak_rss_mib']:>22}"
                  f"{row['worker_peak_rss_mib']:>21}")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
