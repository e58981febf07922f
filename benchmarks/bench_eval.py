"""Evaluation-side timings: De-MINDS query latency vs the mapping-only (Pic2Word-style)
query, and gallery encoding throughput.

    python -m benchmarks.bench_eval --backbone ViT-B-32:none --device cpu

The paper reports 0.017 s (De-MINDS) vs 0.012 s (mapping only) per query on a GPU, a ratio
of 1.42. Both queries here start from the same precomputed reference-image feature; the
"end to end" rows add the reference image's encoding, which both methods share.
Prints a table and writes JSON (``--json``). Timings: the test suite runs it only at a tiny size
(tests/test_benchmarks_smoke.py), never for its numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from demind.backbone import build_backbone
from demind.retrieval import encode_image_refs
from demind.backbone import parse_backbone_spec
from demind.retrieval import ImageRef
from demind.model import DeMinds
from demind.templates import TEMPLATES, fill_template
from demind.schema import ModelConfig

CAPTION = "show three bottles of soft drink on a wooden table instead of one"


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median wall time of each function, timed in alternation (A, B, C, A, B, C, ...) so that a
    load change on a shared machine hits every function alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def query_latency(model: DeMinds, batch: int, repeats: int) -> dict[str, float]:
    """Seconds per query for compose (De-MINDS) and mapping_only, at a given batch size."""
    backbone = model.backbone
    features = torch.randn(batch, backbone.embed_dim, device=backbone.device)
    prompts = [fill_template(TEMPLATES["cirr"], text=CAPTION)] * batch
    side = backbone.image_size if isinstance(backbone.image_size, int) else backbone.image_size[0]
    pixels = torch.randn(batch, 3, side, side, device=backbone.device)
    t = interleaved_medians({
        "demind": lambda: model.compose(features, prompts),
        "mapping": lambda: model.mapping_only(features, prompts),
        "image": lambda: backbone.encode_image(pixels),
    }, repeats)
    demind, mapping, image = (t[k] / batch for k in ("demind", "mapping", "image"))
    return {"demind_s": demind, "mapping_s": mapping, "ratio": demind / mapping,
            "image_encode_s": image, "end_to_end_ratio": (demind + image) / (mapping + image)}


def gallery_throughput(backbone, n_images: int, size: int, batch_size: int, num_workers: int) -> float:
    """Images/s through the evaluation's real path: JPEG decode, preprocess, encode (no cache)."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        refs = []
        for i in range(n_images):
            path = Path(tmp) / f"{i:06d}.jpg"
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=90)
            refs.append(ImageRef(path.stem, path))
        encode_image_refs(backbone, refs[:batch_size], None, batch_size=batch_size, num_workers=0, progress=False)  # warm-up
        start = time.perf_counter()
        encode_image_refs(backbone, refs, None, batch_size=batch_size, num_workers=num_workers, progress=False)
        return n_images / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", default="ViT-B-32:none", help="NAME:TAG (none = random init)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,32", help="query batch sizes to time")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--images", type=int, default=256, help="gallery images for the throughput test")
    p.add_argument("--image-size", type=int, default=256, help="side of the generated JPEGs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    backbone = build_backbone(parse_backbone_spec(args.backbone), device=args.device)
    model = DeMinds(ModelConfig(), backbone).to(args.device).eval()  # the paper's sizes: 4 queries, 6 blocks
    print(f"backbone {args.backbone} on {args.device}, torch threads {torch.get_num_threads()}, "
          f"De-MINDS trainable parameters {model.num_trainable_parameters() / 1e6:.1f}M")
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        rows[batch] = query_latency(model, batch, args.repeats)
        r = rows[batch]
        print(f"batch {batch:>3}: De-MINDS {r['demind_s'] * 1e3:8.2f} ms/query   mapping-only {r['mapping_s'] * 1e3:8.2f} "
              f"ms/query   ratio {r['ratio']:.2f}   (+ image encode {r['image_encode_s'] * 1e3:.2f} ms: ratio "
              f"{r['end_to_end_ratio']:.2f})   paper (GPU): 17/12 ms = 1.42")
    throughput = gallery_throughput(backbone, args.images, args.image_size, args.batch_size, args.num_workers)
    print(f"gallery encoding: {throughput:.1f} images/s ({args.images} JPEGs of {args.image_size}px, "
          f"batch {args.batch_size}, {args.num_workers} workers)")
    out = {"backbone": args.backbone, "device": args.device, "threads": torch.get_num_threads(),
           "query_latency": rows, "gallery_images_per_s": throughput}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
