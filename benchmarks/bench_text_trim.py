"""Text-tower cost with padding trimmed (ours) vs open_clip's full 77-position forward.

    PYTHONPATH=. python benchmarks/bench_text_trim.py --model ViT-B-32 --batch 32 --repeats 5

Both paths compute the same pooled embeddings (checked here and in tests); the ratio is
taken within one run, timings interleaved, median of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from demind.backbone import BackboneConfig, FrozenCLIP

CAPTIONS = [
    "a photo of * , show three bottles of soft drink on a wooden table instead of one",
    "a photo of * , make it red and remove the dog",
    "* * * *",
    "a photo of * , has two children instead of one and is outdoors",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=args.model, pretrained=None))
    for prompts in (CAPTIONS[:2] + CAPTIONS[3:], CAPTIONS[2:3]):
        texts = [prompts[i % len(prompts)] for i in range(args.batch)]
        tokens = backbone.tokenize(texts)
        with torch.no_grad():
            assert torch.allclose(backbone.encode_text(texts).pooled, backbone.model.encode_text(tokens), atol=1e-4)
        full, trimmed = [], []
        for _ in range(args.repeats):
            with torch.no_grad():
                t0 = time.perf_counter()
                backbone.model.encode_text(tokens)
                t1 = time.perf_counter()
                backbone.encode_text(texts)
                t2 = time.perf_counter()
            full.append(t1 - t0)
            trimmed.append(t2 - t1)
        f, t = statistics.median(full), statistics.median(trimmed)
        label = "intention prompt '* * * *'" if len(prompts) == 1 else "CIRR-style prompts"
        print(f"{args.model} batch {args.batch}, {label}: full 77 positions {f * 1e3:.1f} ms, "
              f"trimmed {t * 1e3:.1f} ms, speed-up x{f / t:.2f}")


if __name__ == "__main__":
    main()
