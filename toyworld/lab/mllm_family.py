"""The query-time MLLM family on the toy CIRR with the toy MLLM (toyworld/describer.py): how much a
describer of stated accuracy buys against the frozen baselines (and De-MINDS, given a checkpoint).

    python -m toyworld.lab.mllm_family                                   # frozen baselines + family
    python -m toyworld.lab.mllm_family --checkpoint runs/quickstart/demind-seed0/demind.safetensors

Writes the quickstart's toy CIRR (default version and size), loads the quickstart's toy CLIP (the
shipped weights with its modality gap), and evaluates text-only, image+text, the oracle and
``osrcir`` / ``cirevl`` for each noise level (``ToyDescriberNoise``: p_ignore / p_drop / p_garble),
plus ``demind`` and ``demind+mllm`` with ``--checkpoint`` (a De-MINDS trained on this toy CLIP).
Prints one JSON line per noise level with R@1/5/10 (``--json PATH``: the lines as one JSON list).
``--sets`` and ``--backbone KEY=VALUE ...`` (``ToyBackboneConfig``) make a smaller toy CIRR and
another toy CLIP recipe (a smoke run: tests/test_benchmarks_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from demind.config import load_config
from demind.io import write_json_atomic
from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmark
from toyworld.clip_config import ToyBackboneConfig
from toyworld.describer import ToyDescriberNoise, ToySceneEngine
from toyworld.pipeline import QuickstartConfig, prepare_backbone

NOISE_LEVELS = ((0.0, 0.0, 0.0), (0.2, 0.1, 0.05), (0.4, 0.2, 0.1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="runs/mllm-family")
    parser.add_argument("--checkpoint", default=None, help="a De-MINDS checkpoint on the quickstart's toy CLIP")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--sets", type=int, default=ToyBenchmarkConfig().cirr_sets, help="toy CIRR sets")
    parser.add_argument("--backbone", nargs="*", default=[], metavar="KEY=VALUE",
                        help="ToyBackboneConfig overrides of the toy CLIP (default: the shipped one)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from demind.checkpoint import load_backbone_and_model
    from demind.mllm import MLLMSetup
    from demind.eval import evaluate, read_benchmark

    workdir = Path(args.workdir)
    cfg = ToyBenchmarkConfig(cirr_sets=args.sets)
    folder = workdir / ("cirr" if args.sets == ToyBenchmarkConfig().cirr_sets else f"cirr-{args.sets}-sets")
    write_benchmark(folder, "cirr", cfg, progress=False)  # skipped when its done-marker records this config
    toy_clip = load_config(ToyBackboneConfig, None, args.backbone)
    backbone, _, _ = prepare_backbone(QuickstartConfig(workdir=str(workdir), backbone=toy_clip))
    model = None
    if args.checkpoint:
        _, model = load_backbone_and_model(args.checkpoint, backbone=backbone)
    queries = read_benchmark("cirr", folder).groups[0].queries
    methods = ["text-only", "image+text", "oracle", "osrcir", "cirevl"]
    methods += ["demind", "demind+mllm"] if model is not None else []
    rows = []
    for levels in NOISE_LEVELS:
        noise = ToyDescriberNoise(*levels)
        engine = ToySceneEngine(queries, cfg.cirr_version, cfg.cirr_implicit_share, noise)
        setup = MLLMSetup(lambda: engine, model=engine.model_id, engine_name=engine.name,
                          content_identity=engine.model_id)  # the toy MLLM has no files: its id states its content
        results = evaluate("cirr", folder, backbone=backbone, model=model, methods=methods, mllm=setup,
                           cache_dir=folder / "cache", batch_size=args.batch_size, progress=False)
        row = {m: {k: round(v, 1) for k, v in results["methods"][m].items() if k in ("R@1", "R@5", "R@10")}
               for m in methods}
        rows.append({"noise": dict(zip(("p_ignore", "p_drop", "p_garble"), levels)),
                     "toy_outcomes": engine.outcomes, "queries": len(queries), "R": row})
        print(json.dumps(rows[-1]))
    if args.json:
        write_json_atomic(args.json, rows, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
