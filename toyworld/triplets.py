"""Toy training triplets for supervised composed retrieval, and the toy CIRR test they are scored on.

``python -m toyworld.cli.triplets --out runs/toy-triplets [--train-sets 2500] [--test-sets 1500]`` writes

* ``train/triplets.jsonl`` + ``train/images/``: the queries of toy CIRR sets ``first_set ...`` (the
  ``cirr-3`` generator of :mod:`toyworld.cirr`, set ids disjoint from the test's ``0 ... test_sets-1``),
  each (reference, modification, target) as the toy CIRR writes it, plus ``hard_modification``: the
  annotator's text for N1 (the same kind of edit with another outcome), drawn from its own stream;
* ``cirr/``: the toy CIRR test in CIRR's rc2 layout, written by :func:`toyworld.benchmarks.write_benchmarks`
  (its done-marker holds the whole config: another ``test_sets`` rewrites it);
* ``backbone/``: the default toy CLIP (shipped weights, modality gap), its copies rewritten when they
  differ from the source;
* ``train.yaml``: a ``demind-train-triplets`` recipe naming the backbone and the triplet file by absolute
  paths (``configs/triplets/toy.yaml`` is the same recipe for ``--out runs/toy-triplets``, by relative ones).

``toy_triplets.json`` is written last: a rerun with the same settings (the counts, the toy CLIP's recipe,
the world version) does nothing.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

from demind.io import write_bytes_atomic, write_json_atomic, write_text_atomic

from .benchmarks import ToyBenchmarkConfig, write_benchmarks
from .cirr import CIRR_DESIGNS, cirr_set
from .render import render_scene, save_png
from .texts import modification_text
from .world import WORLD_VERSION
from demind.seeding import derive_seed

FIRST_TRAIN_SET = 10_000
# the backbone's copies under fixed names (configs/triplets/toy.yaml names them); not
# toyworld.clip_config.TOY_CLIP_CONFIG, the shipped model config they are copied from
COPIED_CONFIG_NAME, COPIED_WEIGHTS_NAME = "toy-clip.json", "toy-clip.safetensors"


def set_triplets(set_id: int, version: str, implicit_share: float, image_size: int, images: Path) -> list[dict]:
    """The two triplets of toy CIRR set ``set_id``, their images rendered into ``images``."""
    design = CIRR_DESIGNS[version]
    cset, rng = cirr_set(version, set_id, implicit_share)
    order = list(range(len(cset.members)))
    rng.shuffle(order)  # the same draws as write_cirr, so captions equal the toy CIRR's
    rows = []
    for q, ((ref, tgt), (source, target)) in enumerate(zip(cset.queries, cset.texts)):
        caption = modification_text(source, target, rng, "annotator", design.p_description, design.p_keep,
                                    design.p_background, design.p_context)
        hard_rng = random.Random(derive_seed("triplet-hard", set_id, q))
        hard = modification_text(source, cset.members[2], hard_rng, "annotator", design.p_description,
                                 design.p_keep, design.p_background, design.p_context)
        names = {}
        for m in (ref, tgt):
            name = f"images/train-{set_id}-{m}.png"
            if not (images.parent / name).is_file():
                image = render_scene(cset.members[m], derive_seed("cirr", "nuisance", set_id, m), image_size).image
                save_png(image, images.parent / name)
            names[m] = name
        rows.append({"id": f"{set_id}-{q}", "reference": names[ref], "modification": caption,
                     "target": names[tgt], "hard_modification": hard})
    return rows


def write_toy_triplets(out: str | Path, train_sets: int = 2500, test_sets: int = 1500,
                       first_set: int = FIRST_TRAIN_SET, progress: bool = True) -> dict:
    """Write the toy triplets, test benchmark, backbone and recipe into ``out`` (see the module docstring)."""
    from demind.config import to_dict
    from demind.logs import progress_bar
    from toyworld.clip_config import ToyBackboneConfig
    from toyworld.clip_cache import ensure_toy_backbone, with_modality_gap
    from toyworld.pipeline import toy_backbone_config

    out = Path(out)
    if first_set < test_sets:
        raise ValueError(f"training sets start at {first_set}, inside the test's 0..{test_sets - 1}")
    cfg = ToyBackboneConfig()
    # format 2: the toy CLIP's recipe and the world version joined the settings (a marker of format 1
    # did not notice a changed toy CLIP, and its backbone copies were kept)
    settings = {"train_sets": train_sets, "test_sets": test_sets, "first_set": first_set,
                "backbone": to_dict(cfg), "world_version": WORLD_VERSION, "format": 2}
    marker = out / "toy_triplets.json"
    if marker.is_file() and json.loads(marker.read_text())["settings"] == settings:
        return json.loads(marker.read_text())
    bench = replace(ToyBenchmarkConfig(), cirr_sets=test_sets)
    rows = []
    for set_id in progress_bar(range(first_set, first_set + train_sets), desc="toy triplets", unit="set",
                               disable=not progress):
        rows += set_triplets(set_id, bench.cirr_version, bench.cirr_implicit_share, bench.image_size,
                             out / "train" / "images")
    write_text_atomic(out / "train" / "triplets.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_benchmarks(out, bench, which=("cirr",), progress=progress)  # skipped when done with this config
    weights, _ = ensure_toy_backbone(cfg, out / "backbone", progress)
    weights, model_config = with_modality_gap(cfg, weights)
    # copies under fixed names, so a committed recipe (configs/triplets/toy.yaml) can name them; a
    # backbone's identity is its content, so the copies are the same backbone; a copy of another
    # (older) toy CLIP is replaced
    for source, name in ((model_config, COPIED_CONFIG_NAME), (weights, COPIED_WEIGHTS_NAME)):
        data, copy = Path(source).read_bytes(), out / "backbone" / name
        if not (copy.is_file() and copy.read_bytes() == data):
            write_bytes_atomic(copy, data)
    backbone = toy_backbone_config(out / "backbone" / COPIED_CONFIG_NAME, out / "backbone" / COPIED_WEIGHTS_NAME)
    recipe = (f"# written by python -m toyworld.cli.triplets: the toy CLIP and the toy training triplets\n"
              f"backbone:\n  name: {backbone.name}\n  pretrained: {backbone.pretrained}\n"
              f"data:\n  source: file\n  path: {(out / 'train' / 'triplets.jsonl').resolve()}\n"
              f"  cache_dir: {(out / 'feature_cache').resolve()}\n")
    write_text_atomic(out / "train.yaml", recipe)
    record = {"settings": settings, "triplets": len(rows), "train": "train/triplets.jsonl", "test": "cirr",
              "recipe": "train.yaml"}
    write_json_atomic(marker, record, indent=1)
    return record
