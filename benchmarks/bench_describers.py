"""Query-time MLLM cost: OSrCIR and CIReVL descriptions/s and re-ranking candidates/s through the
transformers engine, with random weights (outputs run to their token limit, which is what a throughput
figure needs).

    python -m benchmarks.bench_describers                         # CPU, the tiny LLaVA-NeXT, seconds
    python -m benchmarks.bench_describers --queries 32 --json out.json

:func:`measure` is shared with ``benchmarks/bench_gpu.py``'s ``describe`` section, which runs it at
LLaVA-1.6 Mistral-7B shapes on a GPU. Queries are synthetic: 800x600 JPEG references (shrunk to
``image_max_side`` as in evaluation) and CIRR-length modification texts; nothing is stored
(a :class:`~demind.mllm.MemoryStore`), so every answer is generated.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from demind.mllm import (CIReVLDescriber, DescribeOptions, LazyEngine, MemoryStore, MLLMVerifier,
                         OSrCIRDescriber, RerankOptions, load_describer_prompts)
from demind.retrieval import ImageRef, Query

MODIFICATION = "show three of them on a wooden table and make the background darker"  # ~13 words, CIRR's mean


def synthetic_queries(folder: Path, n: int, candidates: int) -> tuple[list[Query], list[ImageRef]]:
    """``n`` queries on distinct 800x600 JPEG references, and ``candidates`` gallery images."""
    rng = np.random.default_rng(0)
    refs = []
    for i in range(n + candidates):
        path = folder / f"img{i:05d}.jpg"
        small = rng.integers(0, 255, (600 // 16, 800 // 16, 3), dtype=np.uint8)
        Image.fromarray(small).resize((800, 600), Image.Resampling.BILINEAR).save(path, format="JPEG", quality=90)
        refs.append(ImageRef(path.stem, path))
    queries = [Query(qid=str(i), reference=refs[i], prompt=f"a photo of * , {MODIFICATION}", text=MODIFICATION)
               for i in range(n)]
    return queries, refs[n:]


def measure(model_dir: str | Path, device: str, queries: int, batch: int, tokens: dict[str, int], k: int,
            image_max_side: int = 672) -> dict[str, Any]:
    """Descriptions/s of each describer and candidates/s of the re-ranker (after one warm-up batch)."""
    from demind.engines import EngineConfig, SamplingConfig
    from demind.engines import build_engine

    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = build_engine(EngineConfig(name="transformers", model=str(model_dir), dtype=dtype, batch_size=batch,
                                       prefix_cache=False), SamplingConfig(temperature=0.0), device=device)
    lazy = LazyEngine(lambda: engine)
    prompts = load_describer_prompts()
    options = DescribeOptions(max_tokens=tokens["osrcir"], caption_max_tokens=tokens["caption"],
                              rewrite_max_tokens=tokens["rewrite"], image_max_side=image_max_side, chunk=queries)
    out: dict[str, Any] = {"queries": queries, "batch": batch, "tokens": tokens, "k": k}
    with tempfile.TemporaryDirectory(prefix="bench_describers_") as tmp:
        qs, gallery = synthetic_queries(Path(tmp), queries + batch, k)
        warm, timed_qs = qs[:batch], qs[batch:]
        for name, cls in (("osrcir", OSrCIRDescriber), ("cirevl", CIReVLDescriber)):
            cls(lazy, prompts, options, MemoryStore()).describe(warm)  # warm-up: kernels, allocator
            describer = cls(lazy, prompts, options, MemoryStore())
            start = time.perf_counter()
            describer.describe(timed_qs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            out[name] = {"descriptions_per_s": round(queries / seconds, 3), "seconds": round(seconds, 2)}
        # random-weight tokenizers (tiny and gpu_models' 7B) are word-level over the tiny words: no "yes"
        for reuse in (True, False):
            rerank = RerankOptions(k=k, batch_size=batch, yes="dog", no="cat", prefix_reuse=reuse)
            MLLMVerifier(lazy, prompts, rerank, MemoryStore(), image_max_side).score(warm[:1], [gallery])
            verifier = MLLMVerifier(lazy, prompts, rerank, MemoryStore(), image_max_side)
            start = time.perf_counter()
            verifier.score(timed_qs, [gallery] * len(timed_qs))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            out["rerank_" + ("prefix_reuse" if reuse else "full_prefill")] = {
                "candidates_per_s": round(queries * k / seconds, 2), "seconds": round(seconds, 2),
                "prompt_tokens_per_candidate": round(verifier.prefilled_tokens / (queries * k), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k", type=int, default=10, help="re-ranked candidates per query")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny model gains nothing from more)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from demind.engines.tiny_llava import build_tiny_llava_next

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tiny_llava_") as tmp:
        model_dir = build_tiny_llava_next(tmp)
        results = measure(model_dir, args.device, args.queries, args.batch,
                          {"osrcir": 48, "caption": 24, "rewrite": 24}, args.k, image_max_side=64)
    results["device"] = args.device
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
