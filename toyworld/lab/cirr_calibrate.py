"""The toy CIRR's three untrained baselines for one generator design: the calibration tool.

    python -m toyworld.lab.cirr_calibrate                          # the frozen cirr-3 (gap 50)
    python -m toyworld.lab.cirr_calibrate --version cirr-1 --gap 0
    python -m toyworld.lab.cirr_calibrate unnamed_edits=2 p_description=0.7

Writes the toy CIRR (the quickstart's size and seeds) with the version's frozen
:class:`toyworld.cirr.CirrDesign`, or with ``key=value`` overrides of it, evaluates Image-only,
Text-only and Image+Text with the quickstart's toy CLIP (the shipped weights, extended by the
modality gap ``--gap``; no training of any method) through the evaluation harness, prints R@1/5/10/50
and whether R@10 meets the published CIRR profile, and appends one JSON line to
``<workdir>/calibration.jsonl``. ``--backbone KEY=VALUE ...`` changes the toy CLIP's recipe
(``ToyBackboneConfig``; another recipe is trained, not shipped). The rule it serves is in
``docs/lab-notes/calibrated-cirr.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from demind.config import load_config
from toyworld.benchmarks import ToyBenchmarkConfig, write_benchmark
from toyworld.cirr import CIRR_DESIGNS, CIRR_VERSIONS
from toyworld.clip_config import ToyBackboneConfig
from toyworld.pipeline import QuickstartConfig, prepare_backbone

# Published CIRR test R@10, CLIP ViT-L/14 (Pic2Word's tables): the calibration target.
TARGET = {"image-only": 34.0, "text-only": 55.5, "image+text": 49.1}
TOLERANCE = 6.0


def meets_profile(r10: dict[str, float]) -> bool:
    """Each R@10 within TOLERANCE of TARGET, and Text-only > Image+Text > Image-only."""
    close = all(abs(r10[m] - t) <= TOLERANCE for m, t in TARGET.items())
    return close and r10["text-only"] > r10["image+text"] > r10["image-only"]


def parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="CirrDesign fields as key=value")
    parser.add_argument("--version", default=ToyBenchmarkConfig().cirr_version, choices=CIRR_VERSIONS)
    parser.add_argument("--gap", type=float, default=ToyBackboneConfig().modality_gap,
                        help="the toy CLIP's modality gap (backbone.modality_gap; 0: as trained)")
    parser.add_argument("--workdir", default="runs/calibrate-cirr")
    parser.add_argument("--sets", type=int, default=ToyBenchmarkConfig().cirr_sets)
    parser.add_argument("--backbone", nargs="*", default=[], metavar="KEY=VALUE",
                        help="ToyBackboneConfig overrides of the toy CLIP (default: the shipped one)")
    parser.add_argument("--batch-size", type=int, default=256, help="evaluation batch size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    design = dataclasses.replace(CIRR_DESIGNS[args.version],
                                 **{k: tuple(v) if isinstance(v, list) else v for k, v in
                                    ((k, parse_value(v)) for k, v in (o.split("=", 1) for o in args.overrides))})
    workdir = Path(args.workdir)
    cfg = ToyBenchmarkConfig(cirr_sets=args.sets, cirr_version=args.version)
    key = hashlib.sha256(json.dumps([args.version, args.sets, dataclasses.asdict(design)]).encode()).hexdigest()[:12]
    folder = workdir / f"cirr-{key}"
    start = time.perf_counter()
    write_benchmark(folder, "cirr", cfg, progress=False, design=design)  # skipped when its marker records this design
    written = time.perf_counter() - start
    toy_clip = load_config(ToyBackboneConfig, None, [*args.backbone, ("modality_gap", args.gap)])
    backbone, _, _ = prepare_backbone(QuickstartConfig(workdir=str(workdir), backbone=toy_clip))

    from demind.eval import evaluate

    results = evaluate("cirr", folder, backbone=backbone, methods=list(TARGET), cache_dir=folder / "cache",
                       batch_size=args.batch_size, progress=False)
    metrics = {m: {k: round(v, 1) for k, v in results["methods"][m].items() if k.startswith("R@")} for m in TARGET}
    r10 = {m: metrics[m]["R@10"] for m in TARGET}
    record = {"version": args.version, "sets": args.sets, "modality_gap": args.gap,
              "design": dataclasses.asdict(design), "R@10": r10,
              "meets_profile": meets_profile(r10), "metrics": metrics, "seconds": round(time.perf_counter() - start, 1),
              "write_seconds": round(written, 1)}
    with (workdir / "calibration.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
