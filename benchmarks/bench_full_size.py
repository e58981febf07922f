"""The paper's sizes, once, on a CPU: LLaVA-1.6 Mistral-7B on both engines, ViT-L/14 through features,
training and evaluation, with the shipped configs changed only in the model path and the device.

    python scripts/make_full_size_models.py --out models/full               # once: ~17 GB of random weights
    python -m benchmarks.bench_full_size --models models/full --work runs/full --json full.json
    python -m benchmarks.bench_full_size --models models/mid --small ...      # the same at small layers

Parts, each in a process of its own (its peak resident memory is its own), in this order:

* ``gen-transformers`` / ``gen-vllm`` -- configs/data_gen/llava-1.6-7b.yaml (engine.model, run.device=cpu;
  engine.name=transformers for the first) on one input shard of 4 images of 1:1, 3:2, 2:1 and 1:2 at 672 px:
  both stages through the job, image tokens per image, prompt and output tokens per stage, stage-2 prefix
  hits, the wave sizes the planner chose against the cache the engine reports, seconds per image per stage.
  Before loading, the memory guard (demind.engines.memory) estimates what the engine needs; a refusal is
  recorded as its one line and the part stops there.
* ``cache`` -- configs/train/paper.yaml's feature cache with ViT-L/14 on 256 images;
* ``train`` -- ``--train-steps`` steps of paper.yaml on the cached features, the global batch of 1,024 as
  gradient accumulation over the largest micro batch that ``--micro-batch`` says this machine holds;
* ``eval`` -- the trained model on a toy CIRR cut (8 sets).

Never run in CI (pytest does not collect it). The expected time of each part is printed first, from its FLOPs and a
matmul rate measured at start: on a CPU without AVX-512 bf16 runs several times slower than fp32, and the 7B parts
take hours to days; their memory (~20 GiB) is checked by each part before it loads.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("gen-transformers", "gen-vllm", "cache", "train", "eval")
# (width, height) at 672 px on the long side: 1:1, 3:2, 2:1, 1:2
ASPECTS = [(672, 672), (672, 448), (672, 336), (336, 672)]
CAPTIONS = ["a red dog playing on a sandy beach near the water", "an old stone house with a blue door in the snow",
            "a city street at night with cars and bright lights", "a tall tree in a green park on a sunny day"]
# Work of each part at full size, in FLOPs by precision (2 x parameters x tokens, x3 with a backward pass), and
# its resident memory in GiB; the time is said at start from a matmul rate measured on this machine.
# gen: 4 images, ~2,400 image + ~110 text tokens of prefill each, stage 2's new ~250 tokens, and 224 answer
# tokens a sample decoded at batch 4, twice (sampling.retries 1: random weights flag their text).
LLAVA_PARAMS, VIT_IMAGE_PARAMS, VIT_TEXT_PARAMS = 7.57e9, 0.30e9, 0.12e9
GEN_TOKENS = 2 * 4 * (2400 + 110 + 250 + 224)
WORK = {  # part: ({"bf16" | "fp32": FLOPs}, GiB)
    "gen-transformers": ({"bf16": 2 * LLAVA_PARAMS * GEN_TOKENS}, 19),
    "gen-vllm": ({"bf16": 2 * LLAVA_PARAMS * GEN_TOKENS}, 21),
    "cache": ({"fp32": 256 * 2 * (VIT_IMAGE_PARAMS * 257 + 3 * VIT_TEXT_PARAMS * 30)}, 4),
    "train": ({"fp32": 20 * 1024 * 3 * 2 * VIT_TEXT_PARAMS * 30}, 8),
    "eval": ({"fp32": 150 * 2 * (VIT_IMAGE_PARAMS * 257 + VIT_TEXT_PARAMS * 30)}, 4),
}


def matmul_rates() -> dict[str, float]:
    """FLOP/s of a (512 x 4096) @ (4096 x 4096) matmul in fp32 and bf16 on this machine now."""
    import torch

    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x, w = torch.randn(512, 4096, dtype=dtype), torch.randn(4096, 4096, dtype=dtype)
        torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        rates[name] = 2 * 512 * 4096 * 4096 / (time.perf_counter() - start)
    return rates


def expected(parts: list[str], small: bool) -> str:
    """The start-up line: minutes per part at this machine's matmul rates, and the largest part's memory."""
    if small:
        return "expect a few minutes and under 2 GiB a part"
    rates = matmul_rates()
    minutes = {p: sum(flops / rates[k] for k, flops in WORK[p][0].items()) / 60 for p in parts}
    each = ", ".join(f"{p} ~{m:,.0f} min" for p, m in minutes.items())
    return (f"matmul {rates['fp32'] / 1e9:.0f} GFLOP/s fp32, {rates['bf16'] / 1e9:.0f} bf16 here: expect {each} "
            f"(at least; attention and data loading come on top), up to {max(WORK[p][1] for p in parts)} GiB "
            f"resident (each part checks its memory before loading)")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def write_aspect_shard(folder: Path) -> Path:
    """One img2dataset-layout input shard (KEY.jpg, KEY.txt, KEY.json) of the :data:`ASPECTS` images."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "00000.tar"
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as tar:
        for i, ((w, h), caption) in enumerate(zip(ASPECTS, CAPTIONS)):
            small = rng.integers(0, 255, (h // 16, w // 16, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=90)
            key = f"{i:09d}"
            for ext, data in (("jpg", buf.getvalue()), ("txt", caption.encode()),
                              ("json", json.dumps({"key": key, "width": w, "height": h}).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


# ----------------------------------------------------------------------------- generation
def image_token_counts(model_dir: Path) -> dict[str, int]:
    """Image tokens of each :data:`ASPECTS` image as the model's processor expands ``<image>``."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    counts = {}
    for w, h in ASPECTS:
        ids = processor(images=Image.new("RGB", (w, h)), text=processor.image_token, return_tensors="pt").input_ids
        counts[f"{w}x{h}"] = int((ids == image_id).sum())
    return counts


def part_gen(engine_name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from demind.config import load_config
    from demind.engines import build_engine
    from demind.engines.memory import WavePlanner, check_memory_before_loading
    from demind.engines.vllm_engine import vllm_on_cpu
    from demind.errors import DemindError
    from demind.gen import generate as gen_module
    from demind.gen.config import GenConfig
    from demind.gen.job import run_plan
    from demind.gen.plan import make_plan
    from demind.gen.prompts import load_prompts

    model_dir = Path(args.models) / "llava-v1.6-mistral-7b-hf"
    overrides = [f"engine.model={model_dir}", "run.device=cpu", "run.progress=false"]
    if engine_name == "transformers":
        overrides.append("engine.name=transformers")
    cfg = load_config(GenConfig, str(REPO / "configs/data_gen/llava-1.6-7b.yaml"), overrides)
    out: dict[str, Any] = {"engine": engine_name, "overrides": overrides, "image_tokens": image_token_counts(model_dir)}
    try:
        estimate = check_memory_before_loading(cfg.engine, cfg.run.device, engine_name == "vllm" and vllm_on_cpu())
        out["memory_estimate_gib"] = round(estimate.total / 2**30, 2) if estimate else None
        start = time.perf_counter()
        engine = build_engine(cfg.engine, cfg.sampling, device=cfg.run.device, seed=cfg.run.seed)
    except (DemindError, ImportError) as e:
        out["refused"] = f"error: {e}"
        return out
    out["load_s"] = round(time.perf_counter() - start, 1)
    out["cache_tokens"] = getattr(engine, "prefix_capacity_tokens", None)
    stage_s: dict[str, float] = {}
    waves: list[int] = []
    run_stage, size = gen_module.IntentGenerator.run_stage, WavePlanner.size

    def timed_stage(self, stage, *a, **kw):
        t = time.perf_counter()
        try:
            return run_stage(self, stage, *a, **kw)
        finally:
            stage_s[stage] = stage_s.get(stage, 0.0) + time.perf_counter() - t

    def recorded_size(self, n):
        waves.append(size(self, n))
        return waves[-1]

    gen_module.IntentGenerator.run_stage, WavePlanner.size = timed_stage, recorded_size
    shard_in, shard_out = work / "gen_input", work / f"gen_{engine_name}"
    write_aspect_shard(shard_in)
    summary = run_plan(make_plan(str(shard_in), shard_out, "0", True), cfg, engine, load_prompts(cfg.prompts.version),
                       show_progress=False)
    stats = json.loads((shard_out / "00000_stats.json").read_text())
    samples = []
    with tarfile.open(shard_out / "00000.tar") as tar:
        for member in tar.getmembers():
            if member.name.endswith(".json"):
                rec = json.load(tar.extractfile(member))
                samples.append({stage: {k: rec["generation"][stage][k] for k in ("prompt_tokens", "output_tokens",
                                                                                 "attempts")}
                                for stage in ("rewrite", "intent") if stage in rec.get("generation", {})})
    n = len(ASPECTS)
    out.update(failed=bool(summary.failed), waves=waves, samples=samples, engine_tokens=stats.get("engine_tokens"),
               seconds_per_image={k: round(v / n, 1) for k, v in stage_s.items()},
               max_model_len=cfg.engine.max_model_len)
    return out


# ----------------------------------------------------------------------------- CLIP
def train_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    clip = (["backbone.name=" + str(REPO / "configs/model/tiny-clip.json"), "backbone.pretrained=null"] if args.small
            else [f"backbone.pretrained={Path(args.models) / 'ViT-L-14.safetensors'}"])
    return clip + [f"data.shards={work / 'clip_shards'}", "run.device=cpu", f"run.output_dir={work / 'train'}"]


def part_cache(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from toyworld.synthetic import write_synthetic_shards
    from demind.cli import features

    write_synthetic_shards(work / "clip_shards", num_shards=4, samples_per_shard=args.cache_images // 4,
                           image_size=256, seed=0, text_lengths="cc3m")
    start = time.perf_counter()
    rc = features.main(["--config", str(REPO / "configs/train/paper.yaml"), *train_overrides(args, work)])
    seconds = time.perf_counter() - start
    return {"rc": rc, "images": args.cache_images, "seconds": round(seconds, 1),
            "images_per_s": round(args.cache_images / seconds, 2)}


def part_train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from demind.training import load_train_config, train

    accum = args.global_batch // args.micro_batch
    cfg = load_train_config(str(REPO / "configs/train/paper.yaml"), train_overrides(args, work) + [
        f"optim.max_steps={args.train_steps}", f"optim.grad_accum_steps={accum}", "run.log_every=1",
        f"optim.global_batch_size={args.global_batch}",
        f"run.save_every={args.train_steps}", "run.trackers=[]"])
    start = time.perf_counter()
    train(cfg)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines()]
    rate = statistics.median(r["samples_per_s"] for r in rows[1:] or rows) if rows else 0.0  # the trainer's own
    return {"steps": args.train_steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
            "grad_accum_steps": accum, "seconds": round(seconds, 1), "samples_per_s": round(rate, 2),
            "paper_20_steps_min": round(20 * 1024 / rate / 60, 1) if rate else None,
            "last": rows[-1] if rows else None}


def part_eval(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from demind.checkpoint import load_backbone_and_model
    from demind.eval.harness import evaluate
    from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmark

    # written again when its done-marker records another config or world version
    root = write_benchmark(work / "toy_cirr", "cirr", ToyBenchmarkConfig(cirr_sets=8), progress=False)
    checkpoint = sorted((work / "train").glob("*.safetensors"))
    backbone, model = load_backbone_and_model(checkpoint[-1] if checkpoint else None)
    start = time.perf_counter()
    result = evaluate("cirr", root, backbone=backbone, model=model, progress=False, out_dir=work / "eval")
    return {"seconds": round(time.perf_counter() - start, 1), "checkpoint": str(checkpoint[-1]) if checkpoint else None,
            "result": json.loads(json.dumps(result, default=str))}


# ----------------------------------------------------------------------------- driver
def run_part(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One part in this process: its result with its wall time and this process's peak resident memory."""
    start = time.perf_counter()
    if name.startswith("gen-"):
        result = part_gen(name[4:], args, work)
    else:
        result = {"cache": part_cache, "train": part_train, "eval": part_eval}[name](args, work)
    result.update(part=name, wall_s=round(time.perf_counter() - start, 1), peak_rss_gib=round(peak_rss_gib(), 2),
                  # the largest of its finished child processes (DataLoader workers, vLLM's engine core)
                  peak_rss_child_gib=round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2))
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="scripts/make_full_size_models.py's --out")
    parser.add_argument("--work", default="runs/bench_full_size")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--small", action="store_true", help="models written with --small; the tiny CLIP")
    parser.add_argument("--cache-images", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=64, help="a divisor of --global-batch")
    parser.add_argument("--global-batch", type=int, default=1024,
                        help="paper.yaml's 1024; less for a timing run (then the 20 steps at 1024 are extrapolated)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # run one part in this process (the driver's children)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.part:
        print(json.dumps(run_part(args.part, args, work)))
        return 0
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown or args.global_batch % args.micro_batch:
        print(f"error: --only takes {', '.join(PARTS)} (got {sorted(unknown)}); --micro-batch divides --global-batch",
              file=sys.stderr)
        return 2
    print(f"bench_full_size: {', '.join(parts)}; {expected(parts, args.small)}", flush=True)
    results = {}
    for name in parts:
        cmd = [sys.executable, "-m", "benchmarks.bench_full_size", *(argv or sys.argv[1:]), "--part", name]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        results[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "part": name, "rc": proc.returncode, "error": proc.stderr.strip().splitlines()[-3:]}
        print(json.dumps(results[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
