"""Supervised shape proxy (issue 20): can an image tower learn which shapes a toy scene holds, fast?

    PYTHONPATH=. python benchmarks/toy_shape_proxy.py --model-config configs/model/toy-clip-cnn.json
    PYTHONPATH=. python benchmarks/toy_shape_proxy.py --model-config configs/model/toy-clip-rn.json
    PYTHONPATH=. python benchmarks/toy_shape_proxy.py --model-config configs/model/toy-clip-cnn.json \
        --vision '{"timm_pool": "avg"}'

Trains the image tower of an open_clip model config (``--vision`` overrides keys of its
``vision_cfg``) plus a linear head to predict the set of shapes of a scene (multi-label, 8
shapes) on "web" scenes, with the toy CLIP's optimiser (AdamW 1e-3, weight decay 0.1, batch
128), and reports every ``--every`` steps the share of held-out "web_eval" scenes whose whole
set is predicted exactly. Not a result about the toy CLIP: a cheap screen of image towers
before a contrastive run (demind/toy/README.md, "third recipe"). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import open_clip
import torch

from demind import towers  # noqa: F401  (registers demind_toy_convnet)
from demind.backbone import quiet_random_init_notice
from demind.io import write_json_atomic
from demind.toy.backbone import TAG_VALUES, attribute_targets, images_to_tensor, render_pool


def build_tower(model_config: str, overrides: dict) -> tuple[torch.nn.Module, int]:
    """The image tower of ``model_config`` with ``vision_cfg`` overrides, randomly initialised,
    and its output width (the config's ``embed_dim``)."""
    config = json.loads(Path(model_config).read_text())
    config["vision_cfg"].update(overrides)
    with tempfile.TemporaryDirectory() as tmp:  # open_clip registers configs from files
        path = Path(tmp) / f"shape-proxy-{Path(model_config).stem}.json"
        path.write_text(json.dumps(config))
        open_clip.add_model_config(path)
        with quiet_random_init_notice():
            return open_clip.create_model(path.stem, pretrained=None).visual, config["embed_dim"]


def run(model_config: str, overrides: dict, steps: int, every: int, train_scenes: int, eval_scenes: int,
        world: str, seed: int, progress: bool) -> dict:
    """Train the proxy; returns {"curve": [{step, loss, exact}], ...}."""
    torch.manual_seed(seed)
    tower, dim = build_tower(model_config, overrides)
    head = torch.nn.Linear(dim, len(TAG_VALUES["shape"]))
    scenes, images = render_pool("web", train_scenes, 64, progress, world=world)
    held_scenes, held_images = render_pool("web_eval", eval_scenes, 64, progress, world=world)
    target, held_target = attribute_targets(scenes, ("shape",)), attribute_targets(held_scenes, ("shape",)) > 0
    optim = torch.optim.AdamW([*tower.parameters(), *head.parameters()], lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    curve, start = [], time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, len(scenes), (128,), generator=generator)
        logits = head(tower(images_to_tensor(images[idx.numpy()])))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[idx])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            tower.eval()
            with torch.no_grad():
                predicted = head(tower(images_to_tensor(held_images))) > 0
            tower.train()
            exact = 100 * float((predicted == held_target).all(dim=1).float().mean())
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "exact": round(exact, 2),
                          "seconds": round(time.perf_counter() - start, 1)})
            print(f"step {step + 1:5d}  loss {loss.item():.3f}  held-out exact {exact:5.1f} %", flush=True)
    return {"model_config": model_config, "vision_overrides": overrides, "world": world, "seed": seed,
            "tower_params": sum(p.numel() for p in tower.parameters()), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="configs/model/toy-clip-cnn.json")
    parser.add_argument("--vision", default="{}", help="JSON object of vision_cfg overrides")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--train-scenes", type=int, default=6000)
    parser.add_argument("--eval-scenes", type=int, default=1000)
    parser.add_argument("--world", default="v2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the curve")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    result = run(args.model_config, json.loads(args.vision), args.steps, args.every, args.train_scenes,
                 args.eval_scenes, args.world, args.seed, not args.no_progress)
    print(f"{Path(args.model_config).stem} {args.vision}: {result['tower_params'] / 1e6:.2f} M params, "
          f"held-out exact {result['curve'][-1]['exact']:.1f} % after {args.steps} steps")
    if args.out:
        write_json_atomic(Path(args.out), result, indent=1)


if __name__ == "__main__":
    main()
