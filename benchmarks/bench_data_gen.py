"""Benchmark of the generation job with the tiny random LLaVA-NeXT, on CPU.

    python -m benchmarks.bench_data_gen --samples 64 --batch-size 8

Measures, in one run:
1. images/s of the transformers engine (both stages, the job's own IntentGenerator)
   with ``--batch-size`` rows per generate() vs one image at a time, and their ratio;
   batched with stage 1's prefix kept for stage 2 (``engine.prefix_cache``, default) vs
   prefilled again, with the prompt tokens prefilled per image;
2. the job's own overhead per sample outside the engine (read, decode + resize,
   prompt rendering, cleaning, writing): the wall time outside engine calls in a full
   job run (decoding in the main thread, and one chunk ahead in a background thread),
   and each step's cost timed alone.
The tiny model makes the engine cheap, so (2) is the job's cost, not the model's.
Prints a table and writes JSON to --json.

    .venv-vllm/bin/python -m benchmarks.bench_data_gen --engines transformers,vllm --samples 64

(in the venv of ``bash scripts/setup.sh --vllm``) instead compares the two engines on the same images:
start-up seconds, images/s of both stages through the job's IntentGenerator (median of --repeats, after
a warm-up), prompt tokens prefilled per image and stage-2 prefix hits. On a CPU with the tiny random
model these are code-path figures (scheduling, prefix caching, per-request overhead of each engine),
not a model's throughput, and vLLM's CPU build is not vLLM on a GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from demind.gen.config import GenConfig
from demind.engines.transformers_engine import TransformersEngine
from demind.gen.generate import ChunkItem, IntentGenerator
from demind.gen.job import run_plan
from demind.gen.plan import make_plan
from demind.engines import render
from demind.gen.prompts import intent_conversation, load_prompts, rewrite_conversation
from demind.gen.reader import RawSample, decode_and_shrink, iter_shard
from demind.shard_format import ShardWriter, encode_sample, sample_key
from demind.engines.tiny_llava import build_tiny_llava_next


def make_input_shard(path: Path, samples: int, width: int, height: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(path) as tar:
        for i in range(samples):
            # smooth random images compress like photos, unlike white noise
            small = rng.integers(0, 255, (height // 16, width // 16, 3), dtype=np.uint8)
            img = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=90)
            key = sample_key(0, i, 4)
            caption = f"a photo of a red dog number {i} playing on the beach near the water"
            tar.write({"__key__": key, "jpg": buf.getvalue(), "txt": caption.encode(),
                       "json": json.dumps({"key": key, "caption": caption}).encode()})


def time_engines(items: list[ChunkItem], batch_size: int, cfg: GenConfig, repeats: int
                 ) -> dict[str, tuple[float, float]]:
    """Median images/s of both stages and prompt tokens prefilled per image, for ``batch_size``
    rows per generate() and one row at a time, each with and without the prefix cache; runs interleaved so that load from other processes hits all alike."""
    variants = {"batched": (batch_size, True), "batched_no_prefix_cache": (batch_size, False), "single": (1, True),
                "single_no_prefix_cache": (1, False)}
    generators = {}
    for name, (rows, prefix_cache) in variants.items():
        cfg.engine.batch_size, cfg.engine.prefix_cache = rows, prefix_cache
        generators[name] = IntentGenerator(TransformersEngine(cfg.engine, cfg.sampling, device=cfg.run.device), cfg, load_prompts("v1"))
        generators[name].generate(items[: min(4, len(items))])  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in variants}
    prefilled: dict[str, float] = {}
    for _ in range(repeats):
        for name, generator in generators.items():
            start = time.perf_counter()
            outputs = generator.generate(items)
            rates[name].append(len(items) / (time.perf_counter() - start))
            prefilled[name] = sum(o.rewrite.prefilled_tokens + o.intent.prefilled_tokens for o in outputs) / len(items)
    cfg.engine.prefix_cache = True
    return {name: (statistics.median(rates[name]), prefilled[name]) for name in variants}


def time_overhead_parts(shard: Path, out_dir: Path, cfg: GenConfig, renderer) -> dict[str, float]:
    """ms per sample of each job step outside the engine, timed separately on the same shard."""
    prompts = load_prompts("v1")
    start = time.perf_counter()
    raws = [s for s in iter_shard(shard, cfg.io.max_caption_chars) if isinstance(s, RawSample)]
    read = time.perf_counter() - start
    start = time.perf_counter()
    images = [decode_and_shrink(s.image_bytes, cfg.io.image_max_side) for s in raws]
    decode = time.perf_counter() - start
    start = time.perf_counter()
    for s in raws:
        render(renderer, rewrite_conversation(prompts, s.caption))
        render(renderer, intent_conversation(prompts, s.caption, "a rewritten caption " * 8))
    prompt = time.perf_counter() - start
    writer = ShardWriter(out_dir / "parts.tar")
    start = time.perf_counter()
    for s in raws:
        writer.write(encode_sample(s.key, s.image_ext, s.image_bytes, s.caption, "rewritten " * 40, "intent " * 15,
                                   {**s.meta, "generation": {"flags": []}}))
    writer.commit()
    write = time.perf_counter() - start
    n = len(raws)
    assert len(images) == n
    return {k: round(1000 * v / n, 3) for k, v in
            {"read": read, "decode_resize": decode, "prompt_render_2_stages": prompt, "write": write}.items()}


def compare_engines(items: list[ChunkItem], cfg: GenConfig, engines: list[str], repeats: int) -> dict[str, dict]:
    """Per engine (built from ``cfg`` with ``engine.name`` set): start seconds, median images/s of both
    stages over ``repeats`` after a warm-up, prompt tokens prefilled per image, stage-2 prefix hits."""
    from demind.engines import build_engine

    results = {}
    for name in engines:
        cfg.engine.name = name
        start = time.perf_counter()
        engine = build_engine(cfg.engine, cfg.sampling, device=cfg.run.device, seed=cfg.run.seed)
        started = time.perf_counter() - start
        generator = IntentGenerator(engine, cfg, load_prompts("v1"))
        generator.generate(items[: min(4, len(items))])  # warm-up (vLLM: its first batch shapes)
        rates, outputs = [], []
        for _ in range(repeats):
            engine.release_prefixes()  # each repeat starts with an empty prefix cache, on both engines
            if hasattr(engine, "llm"):
                engine.llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = generator.generate(items)
            rates.append(len(items) / (time.perf_counter() - start))
        hits = sum(o.intent.prefilled_tokens < o.intent.prompt_tokens for o in outputs)
        results[name] = {"start_s": round(started, 1), "images_per_s": round(statistics.median(rates), 2),
                         "prefilled_tokens_per_image": round(sum(o.rewrite.prefilled_tokens + o.intent.prefilled_tokens
                                                                 for o in outputs) / len(items), 1),
                         "stage2_hits": f"{hits}/{len(outputs)}"}
        if hasattr(engine, "llm"):  # vLLM: stop its engine process before the next engine starts
            engine.llm.llm_engine.engine_core.shutdown()
        del generator, engine
    cfg.engine.name = "transformers"
    return results


def print_engine_comparison(results: dict[str, dict], samples: int) -> None:
    print(f"code-path figures: tiny random LLaVA-NeXT on this CPU, {samples} images, both stages")
    print(f"{'engine':<14} {'start s':>8} {'img/s':>8} {'prefill/img':>12} {'stage-2 hits':>13}")
    for name, r in results.items():
        print(f"{name:<14} {r['start_s']:>8.1f} {r['images_per_s']:>8.2f} {r['prefilled_tokens_per_image']:>12.1f} "
              f"{r['stage2_hits']:>13}")
    if {"transformers", "vllm"} <= set(results):
        ratio = results["vllm"]["images_per_s"] / results["transformers"]["images_per_s"]
        print(f"ratio vllm / transformers img/s: {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="engine timings repeated; the median is reported")
    parser.add_argument("--chunk-size", type=int, default=16, help="engine.chunk_size for the full-job runs")
    parser.add_argument("--image-size", default="800x600", help="WxH of the synthetic JPEGs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--engines", default=None,
                        help="compare these engines instead (e.g. transformers,vllm; vllm needs .venv-vllm)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    width, height = (int(v) for v in args.image_size.lower().split("x"))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_llava_next(tmp / "tiny")
        (tmp / "in").mkdir()
        make_input_shard(tmp / "in" / "00000.tar", args.samples, width, height)
        cfg = GenConfig()
        cfg.engine.name, cfg.engine.model, cfg.run.device, cfg.engine.dtype = "transformers", str(model_dir), "cpu", "float32"
        cfg.engine.chunk_size = args.samples
        cfg.sampling.rewrite_max_tokens, cfg.sampling.intent_max_tokens = 24, 12
        cfg.sampling.retries = 0  # equal work in both engine timings
        items = [ChunkItem(s.key, s.caption, decode_and_shrink(s.image_bytes, cfg.io.image_max_side))
                 for s in iter_shard(tmp / "in" / "00000.tar") if isinstance(s, RawSample)]

        if args.engines:
            cfg.engine.batch_size, cfg.engine.cpu_threads = args.batch_size, args.threads
            compared = compare_engines(items, cfg, [e.strip() for e in args.engines.split(",")], args.repeats)
            print_engine_comparison(compared, len(items))
            result = {"samples": args.samples, "repeats": args.repeats, "image_size": args.image_size,
                      "threads": args.threads, "batch_size": args.batch_size, "engines": compared,
                      "note": "code-path figures: tiny random model on CPU, not a model's throughput"}
            print(json.dumps(result))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            return 0

        timed = time_engines(items, args.batch_size, cfg, args.repeats)
        batched, single, no_prefix = timed["batched"][0], timed["single"][0], timed["batched_no_prefix_cache"][0]

        cfg.engine.batch_size = args.batch_size
        cfg.engine.chunk_size = args.chunk_size
        engine = TransformersEngine(cfg.engine, cfg.sampling, device=cfg.run.device)
        job = {}
        for prefetch in (0, 1):  # decode in the main thread vs one chunk ahead in a background thread
            cfg.io.prefetch_chunks = prefetch
            plan = make_plan(str(tmp / "in"), tmp / f"out{prefetch}", None, overwrite=False)
            job[prefetch] = run_plan(plan, cfg, engine, load_prompts("v1"), show_progress=False).finished[0]
        parts = time_overhead_parts(tmp / "in" / "00000.tar", tmp, cfg, engine.renderer)

    result = {
        "samples": args.samples, "repeats": args.repeats, "image_size": args.image_size, "threads": args.threads, "batch_size": args.batch_size,
        "engine_images_per_s_batched": round(batched, 2),
        "engine_images_per_s_single": round(single, 2),
        "batched_over_single": round(batched / single, 2),
        "engine_images_per_s_batched_no_prefix_cache": round(no_prefix, 2),
        "engine_images_per_s_single_no_prefix_cache": round(timed["single_no_prefix_cache"][0], 2),
        "batched_over_single_no_prefix_cache": round(no_prefix / timed["single_no_prefix_cache"][0], 2),
        "prefix_cache_speedup": round(batched / no_prefix, 2),
        "prefilled_tokens_per_image": {name: round(t[1], 1) for name, t in timed.items()},
        "chunk_size": args.chunk_size,
        "job_images_per_s_prefetch0": job[0]["images_per_s"],
        "job_images_per_s_prefetch1": job[1]["images_per_s"],
        "job_overhead_ms_per_sample_prefetch0": job[0]["overhead_ms_per_sample"],
        "job_overhead_ms_per_sample_prefetch1": job[1]["overhead_ms_per_sample"],
        "overhead_breakdown_ms_per_sample": parts,
    }
    print(f"{'measure':<44} {'value':>10}")
    print(f"{'engine img/s, batch ' + str(args.batch_size):<44} {batched:>10.2f}")
    print(f"{'engine img/s, one at a time':<44} {single:>10.2f}")
    print(f"{'ratio batched / one at a time':<44} {batched / single:>10.2f}")
    print(f"{'engine img/s, batch, stage 1 prefix prefilled again':<44} {no_prefix:>10.2f}")
    print(f"{'ratio prefix kept / prefilled again':<44} {batched / no_prefix:>10.2f}")
    print(f"{'ratio batched / one at a time, no prefix cache':<44} "
          f"{no_prefix / timed['single_no_prefix_cache'][0]:>10.2f}")
    print(f"{'prompt tokens prefilled per image, kept / again':<44} "
          f"{timed['batched'][1]:>5.0f} / {timed['batched_no_prefix_cache'][1]:.0f}")
    for prefetch in (0, 1):
        print(f"{f'full job img/s, io.prefetch_chunks={prefetch}':<44} {job[prefetch]['images_per_s']:>10.2f}")
        print(f"{f'job time outside engine, ms/sample, prefetch={prefetch}':<44} "
              f"{job[prefetch]['overhead_ms_per_sample']:>10.2f}")
    print("cost of each step outside the engine, timed alone:")
    for name, ms in parts.items():
        print(f"{'  ' + name + ', ms/sample':<44} {ms:>10.2f}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
