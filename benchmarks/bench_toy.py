"""Toy-world speed: the toy CLIP's training step (AdamW foreach vs fused) and scene
rendering in one process vs every core. Ratios are taken within one run.

    PYTHONPATH=. python benchmarks/bench_toy.py --steps 10 --render 2000

Both changes compute the same thing: fused AdamW is the same update in one kernel
(float rounding aside); rendering gives byte-identical images (tests/toyworld/test_clip.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from open_clip.loss import ClipLoss

from toyworld.clip import ToyBackboneConfig, build_toy_model, encode_text_trimmed, images_to_tensor
from toyworld.clip_data import render_pool
from toyworld.parallel import default_workers
from toyworld.texts import web_text


def time_steps(fused: bool, steps: int, pool: int = 512) -> dict[str, float]:
    """Median ms of the toy CLIP step's forward+backward and optimizer step (batch 128)."""
    torch.manual_seed(0)
    cfg = ToyBackboneConfig()
    model, tokenizer, size = build_toy_model(cfg)
    scenes, images = render_pool("web", pool, size, progress=False, workers=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
    loss_fn, rng = ClipLoss(), random.Random(0)
    compute, update = [], []
    for step in range(steps + 2):  # two warm-up steps
        idx = rng.sample(range(pool), cfg.batch_size)
        tokens = tokenizer([web_text(scenes[i], rng) for i in idx])
        t0 = time.perf_counter()
        image_f = model.encode_image(images_to_tensor(images[idx]), normalize=True)
        text_f = torch.nn.functional.normalize(encode_text_trimmed(model, tokens), dim=-1)
        loss = loss_fn(image_f, text_f, model.logit_scale.exp())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        optim.step()
        t2 = time.perf_counter()
        if step >= 2:
            compute.append(t1 - t0)
            update.append(t2 - t1)
    return {"forward_backward_ms": 1e3 * statistics.median(compute), "optimizer_ms": 1e3 * statistics.median(update)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--render", type=int, default=2000, help="scenes to render")
    args = parser.parse_args(argv)
    for fused in (False, True):
        t = time_steps(fused, args.steps)
        print(f"toy CLIP step, AdamW {'fused  ' if fused else 'foreach'}: forward+backward "
              f"{t['forward_backward_ms']:.0f} ms, optimizer {t['optimizer_ms']:.1f} ms")
    times = {}
    for workers in (1, default_workers()):
        start = time.perf_counter()
        _, images = render_pool("web", args.render, 64, progress=False, workers=workers)
        times[workers] = time.perf_counter() - start
        print(f"render {args.render} scenes with {workers} process(es): {times[workers]:.2f} s")
    print(f"rendering speed-up on {default_workers()} cores: x{times[1] / times[default_workers()]:.2f}")
    assert images.shape == (args.render, 64, 64, 3) and images.dtype == np.uint8


if __name__ == "__main__":
    main()
