"""Generation on a local Ray cluster: shards/s with 1 and 2 workers, and the scheduling cost per shard.

    python -m benchmarks.bench_distributed_gen [--shards 16 --samples 24] [--workdir DIR]

Needs Ray (pip install -e '.[distributed]'). In one run, on one local Ray cluster, with the tiny
random LLaVA-NeXT on the transformers engine (one torch thread per worker):
1. the same input shards through ``run_plan_on_ray`` (what ``--distributor ray`` runs) with 1
   worker, then 2, twice each: shards/s from the first shard handed out to the last one back
   (``shards/s``: a second worker still loading its engine is counted), and from the moment every
   worker is up (``up shards/s``: how Ray scales); the 2-worker / 1-worker ratio of each, best run
   of each (at most 2, and only where 2 CPU cores are free: the load average is printed);
2. the scheduling overhead per shard: each shard's round trip at the driver minus the time the
   worker spent inside it (its ``elapsed_s``): sending the task, Ray's queueing, returning stats;
   measured on 1-sample shards too (run first: they also warm up Ray and the page cache).
Prints a table and writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from benchmarks.bench_data_gen import make_input_shard
from demind.config import load_config
from demind.gen.config import GenConfig
from demind.gen.plan import make_plan
from demind.engines.tiny_llava import build_tiny_llava_next

REPO = Path(__file__).resolve().parents[1]


def timed_job(plan, cfg: GenConfig, workers: int, name: str) -> dict:
    """One job through ``run_plan_on_ray`` (fresh workers); its metrics plus the run's name."""
    from demind.gen.job import IntentShardJob
    from demind.gen.ray_job import RayOptions, run_plan_on_ray  # Ray: an optional extra

    summary = run_plan_on_ray(plan, cfg, RayOptions(workers=workers), IntentShardJob.load, show_progress=False)
    assert not summary.failed and len(summary.finished) == len(plan.todo), summary.failed
    return {"name": name, "shards": len(summary.finished), **summary.metrics}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--samples", type=int, default=24, help="samples per shard")
    p.add_argument("--empty-shards", type=int, default=20, help="shards of one sample, for the overhead alone")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import ray  # an optional extra ('.[distributed]'): imported only when the benchmark runs

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-distributed-gen-"))
    tiny = build_tiny_llava_next(work / "tiny-llava-next")
    for name, shards, samples in (("in", args.shards, args.samples), ("in1", args.empty_shards, 1)):
        (work / name).mkdir(parents=True, exist_ok=True)
        for i in range(shards):
            make_input_shard(work / name / f"{i:05d}.tar", samples, 320, 240)
    cfg = load_config(GenConfig, REPO / "configs/data_gen/tiny-cpu.yaml",
                      [f"engine.model={tiny}", "run.progress=false", "sampling.rewrite_max_tokens=12",
                       "sampling.intent_max_tokens=8"])

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    # the 1-sample shards first: they also warm the page cache and Ray's worker pool
    for run, n, inp in (("overhead, 1-sample shards", 2, "in1"), ("1 worker", 1, "in"), ("2 workers", 2, "in"),
                        ("1 worker", 1, "in"), ("2 workers", 2, "in")):
        plan = make_plan(str(work / inp), work / f"out-{len(rows)}", None, overwrite=True)
        rows.append(timed_job(plan, cfg, n, run))
        print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()

    def best(name: str, key: str = "shards_per_s") -> float:
        return max(r.get(key, 0.0) for r in rows if r["name"] == name)

    print(f"\n{'run':<28} {'shards':>6} {'wall s':>8} {'work s':>8} {'shards/s':>9} {'up shards/s':>12} "
          f"{'overhead ms/shard':>18}")
    for r in rows:
        print(f"{r['name']:<28} {r['shards']:>6} {r['wall_s']:>8.2f} {r['work_s']:>8.2f} {r['shards_per_s']:>9.3f} "
              f"{r.get('all_up_shards_per_s', 0):>12.3f} {r['overhead_ms_per_shard']:>18.1f}")
    ratio = best("2 workers") / best("1 worker")
    up_ratio = best("2 workers", "all_up_shards_per_s") / best("1 worker", "all_up_shards_per_s")
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} cores")
    print(f"2 workers / 1 worker (best of 2 each): {ratio:.2f}x shards/s, {up_ratio:.2f}x once every worker is up "
          f"({args.shards} shards x {args.samples} samples)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio_2_over_1": round(ratio, 3),
                                                "ratio_2_over_1_all_up": round(up_ratio, 3)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
