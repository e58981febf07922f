"""Toy-world speed: the toy CLIP's training step (AdamW foreach vs fused) and scene
rendering in one process vs every core. Ratios are taken within one run.

    python -m benchmarks.bench_toy --steps 10 --render 2000

Both changes compute the same thing: fused AdamW is the same update in one kernel
(float rounding aside); rendering gives byte-identical images (tests/toyworld/test_clip.py).
``--json PATH`` writes the numbers there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from open_clip.loss import ClipLoss

from demind.io import write_json_atomic
from toyworld.clip import build_toy_model, encode_text_trimmed, images_to_tensor
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_data import render_pool
from toyworld.parallel import default_workers
from toyworld.texts import web_text


def time_steps(fused: bool, steps: int, pool: int = 512, batch: int | None = None) -> dict[str, float]:
    """Median ms of the toy CLIP step's forward+backward and optimizer step (batch: the recipe's, 128),
    on ``pool`` rendered web scenes."""
    torch.manual_seed(0)
    cfg = ToyBackboneConfig() if batch is None else ToyBackboneConfig(batch_size=batch)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--render", type=int, default=2000, help="scenes to render")
    parser.add_argument("--pool", type=int, default=512, help="rendered scenes the training steps draw from")
    parser.add_argument("--batch", type=int, default=None, help="toy CLIP batch (default: the recipe's)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    result: dict = {"steps": {}, "render_s": {}}
    for fused in (False, True):
        t = time_steps(fused, args.steps, args.pool, args.batch)
        result["steps"]["fused" if fused else "foreach"] = t
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
    result["render_s"] = {str(workers): seconds for workers, seconds in times.items()}
    if args.json:
        write_json_atomic(args.json, {"render_scenes": args.render, **result}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
