"""The exclusion instrument: a toy ExclCOCO where exclusion, not inclusion, decides the ranking.

On the toy ExclCOCO (:func:`toyworld.benchmarks.write_exclcoco`) a query has about 1.5 images
with every included object *and* the excluded one, so a method that ignores "without X" loses
little. Here co-occurrence is controlled so that every query has as many such hard negatives as
ground-truth images:

* **Labels**: seven coloured shapes with seven different colours (:data:`INSTRUMENT_LABELS`), so
  the toy CLIP, which sees colour far better than shape, can tell every label apart (the
  benchmark checks it: each label's inclusion AUC under CLIP).
* **Base scenes** hold the three labels of one line of the Fano plane (:data:`FANO_LINES`:
  seven triples, every pair of labels in exactly one triple), on a random background, with
  random sizes and grid cells; ``scenes_per_triple`` per triple and split.
* **Variants**: each base scene is also rendered three times with one object dropped and a white
  shape (no label; white is no label's colour) in another cell in its place, so every image holds
  three objects (without it, a query that prefers images with fewer objects would look like one
  that understands "without"); the kept objects move to another free cell or change size with
  probability 1/2 each, and the render noise is new. A scene ABC so gives ABC, ABw, AwC and wBC.
* **Queries** come from the unchanged ExclCOCO builder (:func:`demind.exclcoco_builder.build_exclcoco`,
  categories only, templates) over a COCO-format split of these images; only the queries whose
  positive image is a base scene are kept (include two labels, exclude the third), the others
  are counted as dropped (as are a base scene's queries from an alt text naming two of its labels). For "A and B without C" the ground truth is every ABw variant of the
  triple's scenes and the hard negatives every ABC base scene: the same number, by
  construction (only triple ABC holds the pair AB).

Output (per split ``train`` / ``test``): ``coco/annotations/{instances,captions}_<split>.json``,
``coco/<split>/*.png`` and ``<split>/exclcoco.json`` (format ``demind-exclcoco/1``, with
``hard_negatives`` per query); ``instrument.json`` last (config, world version): the done-marker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from demind.settings import setting
from demind.io import write_json_atomic

from .parallel import parallel_map
from .render import render_scene, save_png
from .texts import alt_text, full_description
from .world import BACKGROUNDS, POSITIONS, SHAPES, SIZES, STYLES, WORLD_VERSION, Scene, ToyObject, stream_seed, with_details
from demind.seeding import derive_seed

logger = logging.getLogger(__name__)

INSTRUMENT_FORMAT = 1
# one shape per colour: the toy CLIP sees colour (probe R@10 44 %) far better than shape (7 %)
INSTRUMENT_LABELS = ("red circle", "green square", "blue triangle", "yellow star", "purple cross",
                     "orange diamond", "pink hexagon")
# the object that takes a dropped one's place: a colour no label has, any shape
DISTRACTOR_COLOUR = "white"
# the Fano plane: 7 triples of 7 points, every pair of points in exactly one triple
FANO_LINES = ((0, 1, 3), (1, 2, 4), (2, 3, 5), (3, 4, 6), (4, 5, 0), (5, 6, 1), (6, 0, 2))
STREAMS = {"train": "exclinst_train", "test": "exclinst_test"}


@dataclass
class InstrumentConfig:
    """Sizes of the exclusion instrument (4 images and 3 queries per base scene)."""

    train_scenes_per_triple: int = setting(60, ge=1, help="base scenes per label triple in the training split")
    test_scenes_per_triple: int = setting(20, ge=1, help="base scenes per label triple in the test split")
    image_size: int = setting(64, ge=8)
    style: str = setting("photo", choices=STYLES, help="the toy world's style of every image")
    held_out_triples: list[int] = setting(default_factory=list, ge=0, le=len(FANO_LINES) - 1,
                                          help="triples (indices into FANO_LINES) left out of the training split: "
                                               "no training image holds any two of their labels together, and "
                                               "their three (include, exclude) combinations are never trained on")

    def config_problems(self) -> list[tuple[str, str]]:
        if len(set(self.held_out_triples)) != len(self.held_out_triples):
            return [("held_out_triples", f"= {self.held_out_triples} repeats a triple")]
        if len(self.held_out_triples) >= len(FANO_LINES):
            return [("held_out_triples", "holds out every triple: nothing would be left to train on")]
        return []


def triple_of(include: list[str], exclude: str) -> int:
    """The index in :data:`FANO_LINES` of the triple a query "include without exclude" comes from."""
    labels = {INSTRUMENT_LABELS.index(x) for x in [*include, exclude]}
    for k, line in enumerate(FANO_LINES):
        if labels == set(line):
            return k
    raise ValueError(f"{include} without {exclude!r} is not one of the instrument's triples")


def base_scene(rng: random.Random, labels: list[str], style: str) -> Scene:
    """Three objects with the given "colour shape" labels, distinct cells, random sizes and background."""
    cells = rng.sample(POSITIONS, len(labels))
    objects = tuple(ToyObject(oid=k, shape=lab.split()[1], colour=lab.split()[0], size=rng.choice(SIZES),
                              position=cell) for k, (lab, cell) in enumerate(zip(labels, cells)))
    return with_details(Scene(objects, rng.choice(BACKGROUNDS), style), rng)


def drop_one(scene: Scene, oid: int, rng: random.Random) -> Scene:
    """``scene`` with object ``oid`` replaced by a :data:`DISTRACTOR_COLOUR` shape (no label) in
    another free cell, so every image holds three objects (a query that prefers fewer objects
    gains nothing); each kept object moves to a free cell and changes size with probability 1/2
    each (small nuisance, so a variant is not a copy of its base)."""
    kept = [o for o in scene.objects if o.oid != oid]
    used = {o.position for o in scene.objects}
    moved = []
    for o in kept:
        if rng.random() < 0.5:
            new = rng.choice([p for p in POSITIONS if p not in used])
            used.discard(o.position)
            used.add(new)
            o = dataclasses.replace(o, position=new)
        if rng.random() < 0.5:
            o = dataclasses.replace(o, size=[s for s in SIZES if s != o.size][0])
        moved.append(o)
    distractor = ToyObject(oid=oid, shape=rng.choice(SHAPES), colour=DISTRACTOR_COLOUR, size=rng.choice(SIZES),
                           position=rng.choice([p for p in POSITIONS if p not in used]))
    return dataclasses.replace(scene, objects=tuple(moved) + (distractor,))


def scene_group(stream: str, index: int, style: str) -> list[tuple[str, Scene]]:
    """Base scene ``index`` of ``stream`` (its triple: ``index % 7``) and its three drop-one variants."""
    rng = random.Random(stream_seed(stream, index))
    labels = [INSTRUMENT_LABELS[k] for k in FANO_LINES[index % len(FANO_LINES)]]
    base = base_scene(rng, labels, style)
    return [("base", base)] + [(f"drop{o.oid}", drop_one(base, o.oid, rng)) for o in base.objects]


def _render(job: tuple[str, int, str, int, str]) -> list[dict[str, Any]]:
    """Render one base scene's group into ``folder``; per image its role, objects, boxes, captions."""
    stream, index, style, size, folder = job
    out = []
    for role, scene in scene_group(stream, index, style):
        name = f"{index:06d}-{role}"
        rendered = render_scene(scene, derive_seed(stream, name), size)
        save_png(rendered.image, Path(folder) / f"{name}.png")
        rng = random.Random(derive_seed(stream, "captions", name))
        out.append({"name": name, "role": role,
                    "objects": [(f"{o.colour} {o.shape}", [float(v) for v in rendered.boxes[o.oid]])
                                for o in scene.objects],
                    "captions": [full_description(scene, rng), full_description(scene, rng), alt_text(scene, rng)]})
    return out


def write_coco_split(folder: Path, split: str, scenes: int, cfg: InstrumentConfig,
                     progress: bool = True) -> tuple[Path, Path, Path, set[str]]:
    """A COCO-format split (categories = :data:`INSTRUMENT_LABELS`); returns the instances and
    captions files, the image folder and the ids of the base scenes. The training split leaves out
    the scenes of ``cfg.held_out_triples`` (the others are the same scenes as without them)."""
    image_dir = folder / "coco" / split
    skip = set(cfg.held_out_triples) if split == "train" else set()
    jobs = [(STREAMS[split], i, cfg.style, cfg.image_size, str(image_dir)) for i in range(scenes)
            if i % len(FANO_LINES) not in skip]
    images, annotations, captions, bases = [], [], [], set()
    categories = [{"id": k + 1, "name": n, "supercategory": "shape"} for k, n in enumerate(INSTRUMENT_LABELS)]
    for group in parallel_map(_render, jobs, desc=f"exclusion instrument {split}", progress=progress, unit="scene"):
        for item in group:
            image_id = len(images) + 1
            images.append({"id": image_id, "file_name": f"{item['name']}.png", "width": cfg.image_size,
                           "height": cfg.image_size})
            if item["role"] == "base":
                bases.add(str(image_id))
            for label, (x1, y1, x2, y2) in item["objects"]:
                if label not in INSTRUMENT_LABELS:  # the white distractor: an object of no category
                    continue
                annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                    "category_id": INSTRUMENT_LABELS.index(label) + 1,
                                    "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
            for text in item["captions"]:
                captions.append({"id": len(captions) + 1, "image_id": image_id, "caption": text})
    ann = folder / "coco" / "annotations"
    instances, caption_path = ann / f"instances_{split}.json", ann / f"captions_{split}.json"
    write_json_atomic(instances, {"images": images, "annotations": annotations, "categories": categories})
    write_json_atomic(caption_path, {"images": images, "annotations": captions})
    return instances, caption_path, image_dir, bases


def keep_base_queries(path: Path, bases: set[str]) -> int:
    """Keep the queries of ``path`` whose positive image is a base scene and that include the other
    two labels (a short alt-text caption can name two of the three); the others are counted in the
    file's ``counts.dropped``. Returns the number kept."""
    data = json.loads(path.read_text())
    kept = [q for q in data["queries"] if q["image_id"] in bases and len(q["include"]) == 2]
    dropped = len(data["queries"]) - len(kept)
    data["queries"] = kept
    data["counts"]["kept"] = len(kept)
    data["counts"]["dropped"]["not base scene: include two, exclude one (instrument)"] = dropped
    data["description"] = ("exclusion instrument (toyworld/exclusion_instrument.py): each base scene ABC is "
                           "rendered with its drop-one variants AB, AC, BC; queries 'A and B without C'")
    write_json_atomic(path, data)
    return len(kept)


def write_instrument(root: str | Path, cfg: InstrumentConfig | None = None, progress: bool = True,
                     splits: tuple[str, ...] = ("train", "test")) -> Path:
    """Write (or reuse) the instrument's ``splits`` under ``root``; returns ``root`` (``root/test`` is
    the data root). A folder written with another config is rewritten, never reused."""
    from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco

    cfg = cfg or InstrumentConfig()
    root = Path(root)
    marker = {"world_version": WORLD_VERSION, "format": INSTRUMENT_FORMAT, "config": asdict(cfg),
              "labels": list(INSTRUMENT_LABELS), "triples": [list(t) for t in FANO_LINES], "splits": list(splits)}
    done = root / "instrument.json"
    if done.is_file() and json.loads(done.read_text()) == marker:
        return root
    if done.is_file():
        done.unlink()  # being rewritten: no done-marker until it is whole again
        logger.info("%s was written with other settings; rewriting it", root)
    sizes = {"train": cfg.train_scenes_per_triple, "test": cfg.test_scenes_per_triple}
    for split, per_triple in ((s, sizes[s]) for s in splits):
        instances, captions, images, bases = write_coco_split(root, split, per_triple * len(FANO_LINES), cfg, progress)
        path, _ = build_exclcoco(instances, captions, root / split, images, ExclCocoConfig(caption_min_images=0),
                                 split=split)
        kept = keep_base_queries(path, bases)
        logger.info("exclusion instrument %s: %d images, %d queries", split, 4 * len(bases), kept)
    write_json_atomic(done, marker)  # last: the done-marker
    return root
