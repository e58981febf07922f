"""Text-tower cost: open_clip's full 77-position forward vs ours (padding trimmed after the
batch's last EOT, in one length bucket or in ``text_buckets`` sorted by length).

    python -m benchmarks.bench_text_trim --model ViT-B-32 --batch 32 --repeats 5

All paths compute the same pooled embeddings (checked here and in tests); ratios are taken
within one run, timings interleaved, median of the repeats. ``--json PATH`` writes the rows there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig
from demind.io import write_json_atomic

CIRR_STYLE = [
    "a photo of * , show three bottles of soft drink on a wooden table instead of one",
    "a photo of * , make it red and remove the dog",
    "a photo of * , has two children instead of one and is outdoors",
]
INTENTION = ["* * * *"]
# De-MINDS training targets: a short alt-text (T_ori), a ~65-token rewritten caption
# (T_rew) and a ~27-token intention (T_int), mixed in one batch as the sampler mixes them.
TRAINING_MIX = [
    "a photo of * , actor attends the premiere",
    "a photo of * , a man in a dark suit and a white shirt stands on a red carpet in front of a wall of "
    "logos; the background is blurred with photographers and bright lights; the colours are mostly red, "
    "black and white; the style is a candid event photograph with flash lighting",
    "a photo of * , make the man wear a dark suit and stand on a red carpet in front of photographers",
    "a photo of * , dog on the beach",
]


def time_paths(backbone: FrozenCLIP, texts: list[str], repeats: int) -> tuple[float, float, float]:
    """Median seconds of (open_clip full, trimmed one bucket, trimmed ``text_buckets``)."""
    tokens = backbone.tokenize(texts)
    buckets = backbone.cfg.text_buckets
    runs: tuple[list[float], list[float], list[float]] = ([], [], [])
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            backbone.model.encode_text(tokens)
            t1 = time.perf_counter()
            backbone.cfg.text_buckets = 1
            backbone.encode_text(texts)
            t2 = time.perf_counter()
            backbone.cfg.text_buckets = buckets
            backbone.encode_text(texts)
            t3 = time.perf_counter()
            for times, value in zip(runs, (t1 - t0, t2 - t1, t3 - t2)):
                times.append(value)
    return tuple(statistics.median(t) for t in runs)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=args.model, pretrained=None))
    rows = []
    for label, prompts in (("CIRR-style prompts", CIRR_STYLE), ("intention prompt '* * * *'", INTENTION),
                           ("training mix T_ori/T_rew/T_int", TRAINING_MIX)):
        texts = [prompts[i % len(prompts)] for i in range(args.batch)]
        with torch.no_grad():
            reference = backbone.model.encode_text(backbone.tokenize(texts))
            assert torch.allclose(backbone.encode_text(texts).pooled, reference, atol=1e-4)
        full, one, many = time_paths(backbone, texts, args.repeats)
        rows.append({"prompts": label, "full_ms": full * 1e3, "trimmed_1_bucket_ms": one * 1e3,
                     "trimmed_buckets_ms": many * 1e3, "buckets": backbone.cfg.text_buckets})
        print(f"{args.model} batch {args.batch}, {label}: full 77 positions {full * 1e3:.1f} ms | trimmed, "
              f"1 bucket {one * 1e3:.1f} ms (x{full / one:.2f}) | trimmed, {backbone.cfg.text_buckets} buckets "
              f"{many * 1e3:.1f} ms (x{full / many:.2f}; x{one / many:.2f} over 1 bucket)")
    if args.json:
        write_json_atomic(args.json, {"model": args.model, "batch": args.batch, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
