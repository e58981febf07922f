"""Every speed figure of the GPU table (BENCHMARKS.md) on one GPU, in one command, with random weights at the real shapes.

    python -m benchmarks.bench_gpu --json bench_gpu.json          # one GPU, < 10 min
    python -m benchmarks.bench_gpu --tiny --json bench_tiny.json  # CPU, tiny shapes (a test runs it)

Sections (``--only`` picks some; each runs on its own, an error is recorded in the JSON and the
others still run):

* ``tower``   -- the ViT-L-14 image tower alone, images/s, fp32 / amp_bf16 / pure_bf16;
* ``cache``   -- the training feature cache end to end (``demind.features.build_feature_cache``:
  224 px JPEG decode in DataLoader workers, pinned memory, image + teacher text towers), images/s
  per precision;
* ``gallery`` -- evaluation gallery encoding (``demind.eval`` path), 256 px JPEGs, 8 workers;
* ``query``   -- De-MINDS vs mapping-only query latency at batch 1 and 32, per query mode
  (eager / compile / cudagraphs, ``DeMinds.set_query_mode``);
* ``train``   -- the paper recipe (global batch 1024, bf16, cached features) on synthetic shards
  with CC3M-like text lengths and with short texts; text-tower checkpointing on/off; samples/s
  and peak GPU memory;
* ``gen``     -- intent generation with the transformers engine and LLaVA-1.6 Mistral-7B shapes
  (random bf16 weights, built and saved once under ``--workdir``), 800x600 JPEGs, T_rew 65 /
  T_int 27 tokens, stage 1's prefix kept for stage 2 vs prefilled again; prompt tokens
  prefilled per image.
* ``describe`` -- query-time MLLM reasoning (``demind.mllm``) at the same shapes: OSrCIR and
  CIReVL descriptions/s and re-ranking candidates/s (``benchmarks/bench_describers.py``'s ``measure``).

Random weights: outputs run to their token limit and features are meaningless, which is what a
throughput figure needs. Prints the table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks import gpu_models
from benchmarks.bench_eval import gallery_throughput, query_latency

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("tower", "cache", "gallery", "query", "train", "gen", "describe")
# The speed goals on one H100, for the printed table.
GOALS = {"cache": ">= 2,500 img/s", "query": "<= 1.2x at batch 1", "gen": ">= 6 img/s", "train": ">= 6,000 samples/s"}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------- sections
def bench_tower(args: argparse.Namespace, work: Path) -> dict:
    """Image tower alone on random pixels, images/s per precision."""
    out = {}
    for precision in args.precisions:
        backbone = gpu_models.build_clip(args.tiny, args.device, precision=precision)
        side = backbone.image_size if isinstance(backbone.image_size, int) else backbone.image_size[0]
        pixels = torch.randn(args.tower_batch, 3, side, side, device=args.device)
        seconds = timed(lambda: backbone.encode_image(pixels), args.device, args.repeats)
        out[precision] = round(args.tower_batch / seconds, 1)
        del backbone
    return {"images_per_s": out, "batch": args.tower_batch}


def synthetic_shards(work: Path, name: str, samples: int, image_size: int, text_lengths: str, shards: int) -> Path:
    """Intent shards of ``samples`` JPEGs in ``shards`` tars (reused when already written)."""
    from toyworld.synthetic import write_synthetic_shards

    folder = work / name
    if not (folder / f"{shards - 1:05d}.tar").is_file():
        write_synthetic_shards(folder, num_shards=shards, samples_per_shard=max(1, samples // shards),
                               image_size=image_size, seed=0, text_lengths=text_lengths)
    return folder


def bench_cache(args: argparse.Namespace, work: Path) -> dict:
    """build_feature_cache end to end (decode + both frozen towers + write), images/s per precision."""
    from demind.features import build_feature_cache

    folder = synthetic_shards(work, "shards_cache", args.cache_images, 224, "cc3m", max(1, args.workers))
    shards = sorted(str(p) for p in folder.glob("*.tar"))
    out = {}
    for precision in args.precisions:
        backbone = gpu_models.build_clip(args.tiny, args.device, precision=precision)
        summary = build_feature_cache(shards, work / f"cache_{precision}", backbone, batch_size=args.cache_batch,
                                      num_workers=args.workers, device=args.device, progress=False)
        out[precision] = round(summary["samples"] / summary["seconds"], 1)
        del backbone
    return {"images_per_s": out, "images": args.cache_images, "workers": args.workers, "batch": args.cache_batch}


def bench_gallery(args: argparse.Namespace, work: Path) -> dict:
    """Evaluation gallery encoding (decode + preprocess + encode, no cache), images/s per precision."""
    out = {}
    for precision in args.precisions:
        backbone = gpu_models.build_clip(args.tiny, args.device, precision=precision)
        out[precision] = round(gallery_throughput(backbone, args.gallery_images, 256, args.cache_batch,
                                                  min(8, args.workers)), 1)
        del backbone
    return {"images_per_s": out, "images": args.gallery_images, "workers": min(8, args.workers)}


def bench_query(args: argparse.Namespace, work: Path) -> dict:
    """ms per query, De-MINDS vs mapping-only, per query mode and batch size."""
    from demind.model import DeMinds
    from demind.schema import ModelConfig

    backbone = gpu_models.build_clip(args.tiny, args.device)
    model = DeMinds(ModelConfig(), backbone).to(args.device).eval()
    out: dict[str, Any] = {}
    for mode in args.query_modes:
        try:
            model.set_query_mode(mode, backend=args.compile_backend)
            rows = {}
            for batch in args.query_batches:
                r = query_latency(model, batch, args.repeats)
                rows[batch] = {"demind_ms": round(r["demind_s"] * 1e3, 3), "mapping_ms": round(r["mapping_s"] * 1e3, 3),
                               "ratio": round(r["ratio"], 2)}
            out[mode] = rows
        except Exception as exn:  # a mode that fails (e.g. no compiler) must not hide the others
            out[mode] = {"error": f"{type(exn).__name__}: {exn}"}
        finally:
            model.set_query_mode("eager")
    return out


def bench_train(args: argparse.Namespace, work: Path) -> dict:
    """Paper recipe on cached features: samples/s (median over steps, first two excluded), peak memory."""
    from accelerate.state import AcceleratorState, GradientState

    from demind.cli import features
    from demind.training import load_train_config, train

    batch, steps = args.train_batch, args.train_steps
    config = REPO / ("configs/train/smoke.yaml" if args.tiny else "configs/train/paper.yaml")
    out = {}
    for text_lengths in ("cc3m", "short"):
        # Images are only decoded by the cache builder (resized to 224 px there), so small JPEGs save time.
        folder = synthetic_shards(work, f"shards_train_{text_lengths}", batch * (steps + 1), 64, text_lengths, 4)
        base = [f"data.shards={folder}", "backbone.pretrained=null", f"data.num_workers={min(4, args.workers)}",
                f"backbone.precision={args.train_precision}", f"data.cache_batch_size={args.cache_batch}",
                "data.shards_per_group=1", "data.resample=true", f"optim.global_batch_size={batch}",
                f"optim.max_steps={steps}", "optim.warmup_steps=1", "run.log_every=1", f"run.save_every={steps}",
                "run.trackers=[]", f"run.device={'cpu' if args.device == 'cpu' else 'auto'}"]  # paper.yaml: bf16
        if args.tiny:
            base.append(f"backbone.name={gpu_models.TINY_CLIP}")
        torch.manual_seed(0)  # the random backbone the trainer builds with run.seed 0
        features.main(["--config", str(config), *base, f"run.device={args.device}"])
        for checkpointing in (False, True) if text_lengths == "cc3m" else (False,):
            run = work / f"run_{text_lengths}_{int(checkpointing)}"
            cfg = load_train_config(str(config), base + [f"run.output_dir={run}",
                                                         f"backbone.grad_checkpointing={str(checkpointing).lower()}"])
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            train(cfg)
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            rate = statistics.median(r["samples_per_s"] for r in rows[2:] or rows[-1:])
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
            out[f"{text_lengths}{'_checkpointing' if checkpointing else ''}"] = {
                "samples_per_s": round(rate, 1), "peak_gib": round(peak, 1) if peak is not None else None}
    return {"global_batch": batch, "steps": steps, "backbone_precision": args.train_precision, "runs": out}


def bench_gen(args: argparse.Namespace, work: Path) -> dict:
    """Both stages through the job's IntentGenerator; images/s and prompt tokens prefilled per image."""
    from PIL import Image

    from demind.gen.config import GenConfig
    from demind.engines.transformers_engine import TransformersEngine
    from demind.gen.generate import ChunkItem, IntentGenerator
    from demind.gen.prompts import load_prompts
    from demind.gen.reader import decode_and_shrink

    model_dir, build_s = gpu_models.build_llava(args.llava_dir or work / "llava", args.tiny, args.device)
    rng = np.random.default_rng(0)
    items = []
    for i in range(args.gen_images):
        small = rng.integers(0, 255, (600 // 16, 800 // 16, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(small).resize((800, 600), Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=90)
        caption = f"a photo of a red dog number {i} playing on the beach near the water"
        items.append(ChunkItem(f"{i:09d}", caption, decode_and_shrink(buf.getvalue(), 672)))
    cfg = GenConfig()
    cfg.engine.name, cfg.engine.model, cfg.run.device = "transformers", str(model_dir), args.device
    cfg.engine.dtype = "float32" if args.device == "cpu" else "bfloat16"
    cfg.sampling.rewrite_max_tokens, cfg.sampling.intent_max_tokens = args.gen_tokens
    cfg.sampling.retries = 0  # equal work in every run
    out: dict[str, Any] = {"model_build_s": round(build_s, 1), "images": len(items)}
    engine = TransformersEngine(cfg.engine, cfg.sampling, device=cfg.run.device)  # loaded once; batch and prefix store set per run
    store, capacity = engine.prefixes, engine.prefix_capacity_tokens  # sized from the free memory after loading
    out["prefix_store_tokens"] = capacity
    for batch in args.gen_batches:
        for prefix_cache in (True, False):
            engine.batch_size = batch
            engine.prefixes, engine.prefix_capacity_tokens = (store, capacity) if prefix_cache else (None, None)
            generator = IntentGenerator(engine, cfg, load_prompts("v1"))
            generator.generate(items[:batch])  # warm-up
            sync(args.device)
            start = time.perf_counter()
            # as the job with engine.chunk_size = batch: a chunk's kept prefixes stay within the prefix store
            outputs = [o for i in range(0, len(items), batch) for o in generator.generate(items[i : i + batch])]
            sync(args.device)
            seconds = time.perf_counter() - start
            prefilled = sum(o.rewrite.prefilled_tokens + o.intent.prefilled_tokens for o in outputs) / len(items)
            out[f"batch{batch}_{'prefix_kept' if prefix_cache else 'prefilled_again'}"] = {
                "images_per_s": round(len(items) / seconds, 2), "prefilled_tokens_per_image": round(prefilled, 1),
                "output_tokens_per_image": round(sum(o.rewrite.output_tokens + o.intent.output_tokens
                                                     for o in outputs) / len(items), 1)}
    return out


# ----------------------------------------------------------------------------- describe
def bench_describe(args: argparse.Namespace, work: Path) -> dict:
    """OSrCIR / CIReVL descriptions/s and re-ranking candidates/s, LLaVA-1.6 7B shapes (random weights):
    OSrCIR 160 output tokens (reasoning + description), CIReVL caption 60 + rewrite 40, K = 20."""
    from benchmarks.bench_describers import measure

    model_dir, build_s = gpu_models.build_llava(args.llava_dir or work / "llava", args.tiny, args.device)
    tokens = {"osrcir": 6, "caption": 4, "rewrite": 4} if args.tiny else {"osrcir": 160, "caption": 60, "rewrite": 40}
    queries, batch, k = (4, 2, 3) if args.tiny else (64, 32, 20)
    return {"model_build_s": round(build_s, 1), **measure(model_dir, args.device, queries, batch, tokens, k)}


RUNNERS = {"tower": bench_tower, "cache": bench_cache, "gallery": bench_gallery, "query": bench_query,
           "train": bench_train, "gen": bench_gen, "describe": bench_describe}


# ----------------------------------------------------------------------------- report
def query_cells(r: dict) -> str:
    cells = []
    for mode, rows in r.items():
        if "error" in rows:
            cells.append(f"{mode}: {rows['error']}")
            continue
        cells += [f"{mode} b{b}: {v['demind_ms']:.2f}/{v['mapping_ms']:.2f} ({v['ratio']}x)" for b, v in rows.items()]
    return "; ".join(cells)


def table(results: dict) -> list[tuple[str, str, str]]:
    """(what, measured, goal) rows in the order of BENCHMARKS.md's GPU table."""
    rows = []
    s = results["sections"]

    def add(name: str, what: str, fmt: Callable[[dict], str]) -> None:
        if name in s:
            rows.append((what, s[name]["error"] if "error" in s[name] else fmt(s[name]), GOALS.get(name, "")))

    per_precision = lambda r: ", ".join(f"{k} {v:,.0f}" for k, v in r["images_per_s"].items())  # noqa: E731
    add("gen", "generation, transformers engine, img/s (prefilled tokens/img)", lambda r: "; ".join(
        f"{k}: {v['images_per_s']} ({v['prefilled_tokens_per_image']:.0f})" for k, v in r.items() if isinstance(v, dict)))
    add("describe", "query-time MLLM: OSrCIR / CIReVL descriptions/s, re-rank candidates/s", lambda r: (
        f"{r['osrcir']['descriptions_per_s']} / {r['cirevl']['descriptions_per_s']}, "
        f"{r['rerank_prefix_reuse']['candidates_per_s']} (full prefill {r['rerank_full_prefill']['candidates_per_s']})"))
    add("cache", "feature cache end to end, img/s", per_precision)
    add("tower", "image tower alone, img/s", per_precision)
    add("train", "training, batch 1024 cached, samples/s (peak GiB)", lambda r: "; ".join(
        f"{k}: {v['samples_per_s']:,.0f} ({v['peak_gib']})" for k, v in r["runs"].items()))
    add("query", "query ms De-MINDS / mapping-only (ratio)", query_cells)
    add("gallery", "gallery encoding, img/s", per_precision)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models and sizes, runs on a CPU in seconds")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--workdir", default=None, help="keeps shards and the 7B model between runs (default: a temp dir)")
    p.add_argument("--llava-dir", default=None, help="folder of the random LLaVA-1.6 7B (built there if missing)")
    p.add_argument("--precisions", default="fp32,amp_bf16,pure_bf16")
    p.add_argument("--query-modes", default="eager,compile,cudagraphs")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--train-precision", default="amp_bf16",
                   help="backbone.precision of the train section's cache and run (its text tower runs under the "
                        "recipe's bf16 autocast either way; amp_bf16 builds the cache in seconds)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.precisions = args.precisions.split(",")
    args.query_modes = args.query_modes.split(",")
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    big = not args.tiny
    args.workers = min(16, os.cpu_count() or 1) if big else 0
    args.repeats = 20 if big else 1
    args.tower_batch = 256 if big else 4
    args.cache_images, args.cache_batch = (8192, 512) if big else (16, 8)
    args.gallery_images = 512 if big else 8
    args.query_batches = [1, 32] if big else [1, 2]
    args.train_batch, args.train_steps = (1024, 12) if big else (8, 3)
    args.gen_images, args.gen_batches = (64, [8, 32]) if big else (4, [2])
    args.gen_tokens = (65, 27) if big else (6, 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "tiny": args.tiny, "torch": torch.__version__, "sections": {}, "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            start = time.perf_counter()
            try:
                results["sections"][name] = RUNNERS[name](args, work)
            except Exception as exn:  # record and go on: one failing row must not lose the others
                traceback.print_exc()
                results["sections"][name] = {"error": f"{type(exn).__name__}: {exn}"}
            results["seconds"][name] = round(time.perf_counter() - start, 1)
            gc.collect()  # each section's models go before the next one's (the 7B needs the room)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            print(f"[{name}] {time.perf_counter() - start:.0f} s: {json.dumps(results['sections'][name])}", flush=True)
            if args.json:  # after every section, so a run stopped by a time limit keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\ndevice: {results['device']}{' (tiny shapes)' if args.tiny else ''}")
    print("| what | measured | goal |\n| --- | --- | --- |")
    for what, measured, goal in table(results):
        print(f"| {what} | {measured} | {goal} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
