"""Cost of the triplet job (``demind-generate-triplets``) with the tiny random Qwen2-VL, on CPU.

    python -m benchmarks.bench_triplet_gen --pairs 48 --json bench_triplet_gen.json
    .venv-vllm/bin/python -m benchmarks.bench_triplet_gen --engines transformers,vllm --pairs 48

Pair shards are written by hand over a synthetic corpus (smooth random JPEGs, captions), then the job runs
through the shared shard runner (:func:`demind.gen.runner.run_plan`, what ``--distributor local`` runs), once
per engine and instruction mode: ``each`` (one writer call an instruction; what a random model can follow)
and ``json`` (one writer call a pair; the random model's answers do not parse on the transformers engine, so
its calls are the retries a failing pair costs, and vLLM decodes it under the JSON schema). Per pair: calls and
prompt / output tokens of each role (describer, writer), from the shard stats; pairs/s of the job (engine
start excluded) and the engine's share. On a CPU with the tiny model these are code-path figures, not a
model's throughput. Prints a table and writes JSON to --json.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from demind.config import load_config
from demind.engines.tiny_qwen2vl import build_tiny_qwen2vl
from demind.gen.plan import make_plan
from demind.gen.runner import run_plan
from demind.gen.triplet_config import TripletGenConfig
from demind.gen.triplet_job import OUTPUT_PREFIX, TripletJobSpec, TripletShardJob
from demind.pairs import corpus_record, open_corpus
from demind.pairs.manifest import write_pairs_manifest
from demind.shard_format import ShardWriter

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO_ROOT / "configs" / "data_gen" / "triplets-tiny-cpu.yaml"


def jpeg(rng: np.random.Generator, size: tuple[int, int]) -> bytes:
    small = rng.integers(0, 255, (size[1] // 16, size[0] // 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize(size, Image.Resampling.BILINEAR).save(buf, format="JPEG")
    return buf.getvalue()


def make_inputs(root: Path, pairs: int, size: tuple[int, int]) -> Path:
    """A corpus of ``pairs + 1`` images and one pair shard: image i paired with i + 1 (3 hard negatives)."""
    rng = np.random.default_rng(0)
    corpus, folder = root / "corpus", root / "pairs"
    corpus.mkdir(parents=True)
    folder.mkdir()
    keys = [f"{i:09d}" for i in range(pairs + 1)]
    with ShardWriter(corpus / "00000.tar") as tar:
        for i, key in enumerate(keys):
            tar.write({"__key__": key, "jpg": jpeg(rng, size), "txt": f"a dog {i} on a red street".encode()})
    with ShardWriter(folder / "pairs-00000.tar") as tar:
        for i in range(pairs):
            record = {"reference": keys[i], "targets": [{"key": keys[i + 1], "signals": ["image"],
                                                          "scores": {"image": 0.9}}],
                      "hard_negatives": [keys[(i + j) % len(keys)] for j in (2, 3, 4)]}
            tar.write({"__key__": keys[i], "json": json.dumps(record).encode()})
    write_pairs_manifest(folder, {"corpus": corpus_record(str(corpus)), "backbone": {"name": "synthetic"},
                                  "recipe": {}})
    return folder


def run_one(folder: Path, out: Path, overrides: list[str]) -> dict:
    """One job over the pair shard; the shard's stats, the engine start and the job's pairs/s."""
    cfg = load_config(TripletGenConfig, str(TINY_CONFIG), ["run.progress=false", *overrides])
    corpus = open_corpus(folder)
    start = time.perf_counter()
    job = TripletShardJob.load(TripletJobSpec(cfg, corpus))
    loaded = time.perf_counter()
    summary = run_plan(make_plan(str(folder), out, None, False, output_prefix=OUTPUT_PREFIX), job, show_progress=False)
    stats = summary.finished[0]
    return {"engine_start_s": round(loaded - start, 2), "pairs_per_s": stats["pairs_per_s"],
            "engine_pairs_per_s": round(stats["pairs_in"] / stats["engine_s"], 3) if stats["engine_s"] else None,
            "pairs": stats["pairs_in"], "written": stats["written"], "skipped": stats["skipped"],
            "calls_per_pair": {r: round(n / stats["generated"], 3) for r, n in stats["calls"].items()},
            "prompt_tokens_per_pair": {r: round(t["prompt"] / stats["generated"], 1) for r, t in stats["tokens"].items()},
            "output_tokens_per_pair": {r: round(t["output"] / stats["generated"], 1) for r, t in stats["tokens"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=48, help="pairs in the one pair shard")
    p.add_argument("--engines", default="transformers", help="comma-separated: transformers, vllm")
    p.add_argument("--modes", default="each,json", help="instructions.mode values to run")
    p.add_argument("--image-size", default="160x120", help="WxH of the corpus images (shrunk to io.image_max_side)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    size = tuple(int(x) for x in args.image_size.split("x"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_qwen2vl(root / "tiny-qwen2-vl")
        folder = make_inputs(root / "data", args.pairs, size)
        for engine in args.engines.split(","):
            for mode in args.modes.split(","):
                name = f"{engine}/{mode}"
                results[name] = run_one(folder, root / name.replace("/", "-"),
                                        [f"engine.name={engine}", f"engine.model={model}", f"instructions.mode={mode}"])
    print(f"{'engine/mode':<18} {'pair/s':>7} {'engine pair/s':>13} {'written':>8} {'calls/pair':>18} "
          f"{'prompt tok/pair':>22} {'out tok/pair':>18}")
    for name, r in results.items():
        calls = " + ".join(f"{v:g}" for v in r["calls_per_pair"].values())
        prompt = " + ".join(f"{v:g}" for v in r["prompt_tokens_per_pair"].values())
        output = " + ".join(f"{v:g}" for v in r["output_tokens_per_pair"].values())
        print(f"{name:<18} {r['pairs_per_s']:>7.2f} {r['engine_pairs_per_s'] or 0:>13.2f} {r['written']:>8} "
              f"{calls:>18} {prompt:>22} {output:>18}")
    print("(per pair: describe + instruct)")
    if args.json:
        args.json.write_text(json.dumps({"pairs": args.pairs, "image_size": args.image_size, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
