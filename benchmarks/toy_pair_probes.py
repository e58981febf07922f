"""Pair probes of a trained toy CLIP (issue 20), and the ceilings of its R@10 probes.

    PYTHONPATH=. python benchmarks/toy_pair_probes.py --weights runs/quickstart/backbone/toy-clip-<key>.pt

Reads the weights only (the quickstart writes the same numbers into the backbone's report,
``pair_probes``); prints attribute -> % of held-out scenes whose own image beats the
one-attribute edit against its full description (chance 50), as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from demind.toy.backbone import ToyBackboneConfig, build_toy_model, pair_probes, probe_ceilings
from demind.toy.world import DEFAULT_WORLD, WORLDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="toy CLIP state dict (.pt) written by the quickstart")
    parser.add_argument("--model-config", default=ToyBackboneConfig().model_config)
    parser.add_argument("--scenes", type=int, default=600, help="held-out scenes per attribute")
    parser.add_argument("--world", default=DEFAULT_WORLD, choices=WORLDS, help="the toy world the CLIP was trained on")
    parser.add_argument("--ceiling-scenes", type=int, default=1000, help="held-out scenes of the R@10 probes")
    args = parser.parse_args()
    model, tokenizer, image_size = build_toy_model(ToyBackboneConfig(model_config=args.model_config))
    model.load_state_dict(torch.load(args.weights, weights_only=True))
    start = time.perf_counter()
    probes = pair_probes(model.eval(), tokenizer, image_size, args.scenes, args.world)
    print(json.dumps({"pair_probes": probes, "scenes": args.scenes, "seconds": round(time.perf_counter() - start, 1),
                      "heldout_probe_ceiling_R@10": probe_ceilings(args.ceiling_scenes, world=args.world)}, indent=1))


if __name__ == "__main__":
    main()
