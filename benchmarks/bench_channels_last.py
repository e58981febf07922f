"""Forward + backward time of a toy image tower in the contiguous and the channels-last layout.

    python -m benchmarks.bench_channels_last --model-config toyworld/model_configs/toy-clip-cnn-text2.json

One script run times both weight layouts on the same (contiguous) random batch, as the toy
pipeline feeds it (a ratio on this noisy machine): PyTorch runs a convolution channels-last when
its weight is, so ``demind_toy_convnet`` keeps its weights channels-last for the measured gain.
Prints one line per layout; ``--json PATH`` writes the rows there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from demind.io import write_json_atomic
from toyworld.clip import build_toy_model
from toyworld.clip_config import ToyBackboneConfig


def seconds_per_step(tower: torch.nn.Module, images: torch.Tensor, repeats: int) -> float:
    """Mean seconds of ``tower(images).sum().backward()`` after two warm-up steps."""
    for _ in range(2):
        tower(images).sum().backward()
    start = time.perf_counter()
    for _ in range(repeats):
        tower(images).sum().backward()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default=ToyBackboneConfig().model_config)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tower = build_toy_model(ToyBackboneConfig(model_config=args.model_config))[0].visual
    images = torch.randn(args.batch, 3, 64, 64)
    rows = []
    for layout in (torch.contiguous_format, torch.channels_last, torch.contiguous_format):
        tower = tower.to(memory_format=layout)
        rows.append((str(layout).split(".")[-1], seconds_per_step(tower, images, args.repeats)))
    for name, seconds in rows:
        print(f"{name:<18} {1000 * seconds:7.0f} ms forward+backward (batch {args.batch}, {args.threads} threads)")
    if args.json:
        write_json_atomic(args.json, {"model_config": args.model_config, "batch": args.batch, "threads": args.threads,
                                      "rows": [{"layout": name, "ms_forward_backward": 1000 * seconds}
                                               for name, seconds in rows]}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
