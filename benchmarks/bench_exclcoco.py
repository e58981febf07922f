"""Run time of the ExclCOCO builder on a generated COCO-format split of val2017's size.

    python -m benchmarks.bench_exclcoco [--images 5000] [--workdir runs/bench-exclcoco] [--json PATH]

The fixture (:func:`toyworld.synthetic.write_synthetic_coco`) has val2017's shape: 5,000 images,
5 captions each (25,000), COCO's 80 category names, ~7.3 instances per image (~36,000), captions
naming 1-3 categories (some through synonyms) and a scene word. Prints the fixture's counts and
the wall time of ``build_exclcoco`` (default recipe: caption words in >= 50 images, 3 combinations
per caption, templates). ``--json PATH`` writes the counts and the time there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from toyworld.synthetic import write_synthetic_coco
from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco
from demind.io import write_json_atomic


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--workdir", default="runs/bench-exclcoco")
    p.add_argument("--json", type=Path, help="write the fixture's counts and the build time here")
    args = p.parse_args(argv)
    work = Path(args.workdir)
    instances, captions, images = write_synthetic_coco(work / "coco", args.images, split="val2017")
    inst = json.loads(instances.read_text())
    n_caps = len(json.loads(captions.read_text())["annotations"])
    print(f"fixture: {len(inst['images'])} images, {n_caps} captions, {len(inst['categories'])} categories, "
          f"{len(inst['annotations'])} instances")
    started = time.perf_counter()
    path, counts = build_exclcoco(instances, captions, work / "out", images, ExclCocoConfig(), split="val2017")
    seconds = time.perf_counter() - started
    print(counts.summary())
    print(f"build_exclcoco: {seconds:.1f} s wall, output {path.stat().st_size / 1e6:.1f} MB")
    if args.json:
        write_json_atomic(args.json, {"images": len(inst["images"]), "captions": n_caps,
                                      "categories": len(inst["categories"]), "instances": len(inst["annotations"]),
                                      "build_seconds": seconds, "output_bytes": path.stat().st_size,
                                      "queries": len(json.loads(path.read_text())["queries"])}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
