"""Pair probes of a trained toy CLIP, and the ceilings of its R@10 probes.

    python -m toyworld.lab.pair_probes --weights runs/quickstart/backbone/toy-clip-<key>.safetensors

Reads the weights only (the quickstart writes the same numbers into the backbone's report,
``pair_probes``); prints attribute -> % of held-out scenes whose own image beats the
one-attribute edit against its full description (chance 50), as JSON. ``--breakdown`` adds each
probe broken down by the scene's style, number of objects and theme (where the toy CLIP fails,
and where the world itself hides an edit), as JSON and as a table. ``--json PATH`` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from demind.io import write_json_atomic
from toyworld.clip import build_toy_model
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_cache import load_weights
from toyworld.clip_eval import clip_pair_scorer, probe_ceilings
from toyworld.probes import pair_probe_breakdown, pair_probe_cases, probe_accuracies, score_pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="toy CLIP weights (.safetensors) written by the quickstart")
    parser.add_argument("--model-config", default=ToyBackboneConfig().model_config)
    parser.add_argument("--scenes", type=int, default=600, help="held-out scenes per attribute")
    parser.add_argument("--ceiling-scenes", type=int, default=1000, help="held-out scenes of the R@10 probes")
    parser.add_argument("--breakdown", action="store_true", help="each probe by style, number of objects and theme")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    model, tokenizer, image_size = build_toy_model(ToyBackboneConfig(model_config=args.model_config))
    load_weights(model, Path(args.weights))
    start = time.perf_counter()
    cases = pair_probe_cases(args.scenes)
    wins = score_pairs(clip_pair_scorer(model.eval(), tokenizer), cases, image_size)
    result = {"pair_probes": probe_accuracies(wins), "scenes": args.scenes,
              "seconds": round(time.perf_counter() - start, 1),
              "heldout_probe_ceiling_R@10": probe_ceilings(args.ceiling_scenes)}
    if args.breakdown:
        result["breakdown"] = pair_probe_breakdown(wins, cases)
    print(json.dumps(result, indent=1))
    if args.breakdown:
        print(format_breakdown(result["breakdown"]))
    if args.json:
        write_json_atomic(args.json, result, indent=1)
    return 0


def format_breakdown(breakdown: dict) -> str:
    """One line per attribute and property: value accuracy% (n)."""
    lines = []
    for attribute, by_property in breakdown.items():
        for prop, groups in by_property.items():
            cells = "  ".join(f"{value} {g['accuracy']:.1f} ({g['n']})" for value, g in groups.items())
            lines.append(f"{attribute:<10} by {prop:<7} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
