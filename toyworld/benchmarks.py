"""Held-out toy benchmarks written in the real benchmarks' on-disk formats.

``write_benchmarks(root)`` writes, each from its own seed stream (disjoint from the
backbone's and the intent shards' scenes):

* ``root/cirr/``: CIRR rc2 layout (generator and versions: :mod:`toyworld.cirr`) —
  ``captions/cap.rc2.val.json`` (entries ``pairid``,
  ``reference``, ``target_hard``, ``target_soft``, ``caption``, ``img_set`` {``id``,
  ``members``, ``reference_rank``, ``target_rank``}, plus ``toy_type``: the named modification's
  type, for per-type recall; ``implicit`` for the themes), ``image_splits/split.rc2.val.json`` (name ->
  ``./dev/NAME.png``: the sets' members and, in ``cirr-2``, gallery look-alikes outside any set),
  ``dev/*.png``.
* ``root/imgnet/``: Pic2Word's ``imgnet_real_query.txt`` and ``imgnet_targets.txt``
  (``path label `` lines; paths ``imgnet/real/<class>/...`` and
  ``imgnet/imagenet-r/<class>/<domain>_<i>.png`` relative to ``root``), label = class +
  1000 * domain index (cartoon 0, origami 1, toy 2, sculpture 3: the toy world's styles
  carry these names), photo distractors labelled class + 6000 as in Pic2Word's list.
  Class = shape, in the order of ``world.SHAPES``.
* ``root/coco/``: Pic2Word's ``coco_eval.csv`` (``id,query_regions,query_class,classes``,
  box ``x1;y1;x2;y2``), ``val2017/<id>.jpg`` and ``val2017_masked/<id>.jpg`` (pixels
  outside the query object's visible mask set to white, as Pic2Word's prepare_data.py).
  Query objects have a box area between 5 % and 50 % of the image.
* ``root/exclusion/exclusion.json`` (format ``demind-toy-exclusion/1``) and
  ``exclusion/images/*.png``::

      {"format": "demind-toy-exclusion/1", "description": "...",
       "images": {NAME: "images/NAME.png", ...},
       "queries": [{"id": 0, "reference": NAME, "target": NAME,
                    "text": "a photo of a blue circle on grass without the red square",
                    "modification": "without the red square",
                    "excluded": {"shape": "square", "colour": "red"},
                    "positives": [NAME, ...], "hard_negatives": [NAME, ...]}, ...]}

  ``text`` is a text-only query, ``modification`` the composed one (with ``reference``).
  ``positives`` = every gallery image showing every kept object (shape and colour), the
  same background and style, and no object with the excluded shape and colour;
  ``hard_negatives`` = gallery images that match except that they show the excluded
  object. Gallery = every image in ``images``.

* ``root/exclcoco/``: the ExclCOCO set (format ``demind-exclcoco/1``, documented in
  :mod:`demind.exclcoco_builder`) built by the same builder from a toy COCO-format split:
  ``coco/annotations/{instances,captions}_{train,test}.json`` (categories = the 64
  coloured shapes, "red circle", or with ``exclcoco_labels="shape"`` the 8 shapes; one instance per object with its rendered box, three captions per image: two full
  descriptions and one web alt-text), ``coco/{train,test}/*.png``, and the benchmarks
  ``train/exclcoco.json`` (ExclMM's training queries) and ``test/exclcoco.json`` (the
  evaluation data root). Labels = object categories only (``caption_min_images=0``); train
  and test scenes come from disjoint seed streams.

Each folder gets ``toy_benchmark.json`` last (config + world version): the done-marker.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image
from demind.logs import progress_bar

from demind.settings import setting
from demind.io import atomic_path, write_json_atomic, write_text_atomic

from .cache_upgrade import current_benchmark_config
from .cirr import CIRR_DESIGNS, CIRR_VERSIONS, CirrDesign, write_cirr
from .parallel import parallel_map
from .render import render_scene, save_png
from .texts import alt_text, article, full_description, noun_phrase, with_article
from .world import (
    BACKGROUNDS, COLOURS, DOMAINS, POSITIONS, SHAPES, SIZES, WORLD_VERSION, Scene, ToyObject, sample_scene,
    stream_seed, with_details)
from demind.seeding import derive_seed

logger = logging.getLogger(__name__)

BENCHMARKS = ("cirr", "imgnet", "coco", "exclusion", "exclcoco")
REAL_DISTRACTOR_OFFSET = 6000  # Pic2Word's list labels real distractors class + 6000
# In the done-marker: 2 added the optional ``target_description`` (the oracle method's text) to
# toy CIRR and exclusion queries; folders written before are rewritten (same images).
TOY_BENCHMARK_FORMAT = 2


@dataclass
class ToyBenchmarkConfig:
    """Sizes of the toy benchmarks (defaults sized for the CPU quickstart)."""

    cirr_sets: int = setting(300, ge=1)              # 6 images and 2 queries per set
    imgnet_queries_per_class: int = setting(25, ge=1)
    imgnet_targets_per_domain: int = setting(10, ge=1)  # per class and domain
    imgnet_distractors_per_class: int = setting(10, ge=0)
    coco_images: int = setting(500, ge=1)
    exclusion_queries: int = setting(150, ge=1)       # 5 images per query
    exclcoco_train_images: int = setting(3000, ge=1)
    exclcoco_test_images: int = setting(1000, ge=1)
    # object category of the toy ExclCOCO: "colour shape" (64, "red circle") or "shape" (8). The
    # toy CLIP is shape-blind (shape probe R@10 7 %, colour 44 %, BENCHMARKS.md), so on shape
    # labels every method sits at the base rate; coloured shapes give it something to see.
    exclcoco_labels: str = setting("colour shape", choices=("colour shape", "shape"))
    image_size: int = setting(64, ge=8)
    # share of toy CIRR sets whose edit is a theme (an implicit intent)
    cirr_implicit_share: float = setting(0.2, ge=0, le=1)
    # the toy CIRR generator (toyworld/cirr.py): cirr-3, with the toy CLIP's modality gap, meets real
    # CIRR's baseline profile; cirr-1 and cirr-2 kept for comparisons
    cirr_version: str = setting("cirr-3", choices=CIRR_VERSIONS)


def exclusion_format() -> int:
    """The exclusion-file format demind.eval reads (imported here, not at the top: the evaluation
    package loads torch, and the toy commands' --help must not)."""
    from demind.eval import EXCLUSION_FORMAT

    return EXCLUSION_FORMAT


def _write_json(path: Path, data: Any) -> None:
    write_json_atomic(path, data, indent=1)


def _marker(folder: Path, name: str, cfg: ToyBenchmarkConfig, design: CirrDesign | None = None) -> dict[str, Any]:
    marker = {"benchmark": name, "world_version": WORLD_VERSION, "format": TOY_BENCHMARK_FORMAT,
              "config": asdict(cfg)}
    if design is not None and design != CIRR_DESIGNS[cfg.cirr_version]:
        # a toy CIRR drawn with another design than its version's (toyworld.lab.cirr_calibrate); through JSON,
        # so that tuples compare as the lists a written marker reads back
        marker["design"] = json.loads(json.dumps(asdict(design)))
    return marker


def is_done(folder: Path, name: str, cfg: ToyBenchmarkConfig, design: CirrDesign | None = None) -> bool:
    """Whether ``folder`` holds toy benchmark ``name`` written from this config (and CIRR design) by
    this world version: its done-marker, written last, records all three."""
    path = folder / "toy_benchmark.json"
    try:
        marker = json.loads(path.read_text())
        marker["config"] = current_benchmark_config(marker["config"])  # an earlier marker: toyworld.cache_upgrade
        return marker == _marker(folder, name, cfg, design)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


# ------------------------------------------------------------------------ ImageNet-R

def single_object_scene(rng: random.Random, shape: str, style: str) -> Scene:
    """One object of ``shape`` in ``style`` with its redundant details (no theme: the class is the
    shape and the domain the style, and a theme would be neither)."""
    obj = ToyObject(0, shape, rng.choice(COLOURS), rng.choice(SIZES), rng.choice(POSITIONS))
    scene = Scene((obj,), rng.choice(BACKGROUNDS), style)
    return with_details(scene, rng)


def write_imgnet(folder: Path, cfg: ToyBenchmarkConfig, progress: bool = True) -> None:
    """Lists in ``folder`` (``<root>/imgnet``); image paths relative to ``<root>``, as in
    Pic2Word's data/ folder, so they start with ``imgnet/``."""
    root = folder.parent
    query_lines, target_lines = [], []
    jobs: list[tuple[str, Scene, int]] = []  # (relative path, scene, nuisance seed)
    for c, shape in enumerate(SHAPES):
        rng = random.Random(stream_seed("imgnet", c))
        for i in range(cfg.imgnet_queries_per_class):
            path = f"imgnet/real/{shape}/real_{i}.png"
            jobs.append((path, single_object_scene(rng, shape, "photo"), derive_seed("imgnet", path)))
            query_lines.append(f"{path} {c} ")
        for d, domain in enumerate(DOMAINS):
            for i in range(cfg.imgnet_targets_per_domain):
                path = f"imgnet/imagenet-r/{shape}/{domain}_{i}.png"
                jobs.append((path, single_object_scene(rng, shape, domain), derive_seed("imgnet", path)))
                target_lines.append(f"{path} {c + 1000 * d} ")
        for i in range(cfg.imgnet_distractors_per_class):
            path = f"imgnet/real/{shape}/distractor_{i}.png"
            jobs.append((path, single_object_scene(rng, shape, "photo"), derive_seed("imgnet", path)))
            target_lines.append(f"{path} {c + REAL_DISTRACTOR_OFFSET} ")
    for path, scene, seed in progress_bar(jobs, desc="toy ImageNet-R", unit="img", disable=not progress):
        save_png(render_scene(scene, seed, cfg.image_size).image, root / path)
    for name, lines in (("imgnet_real_query.txt", query_lines), ("imgnet_targets.txt", target_lines)):
        write_text_atomic(folder / name, "\n".join(lines) + "\n")


# ------------------------------------------------------------------------------ COCO

def write_coco(folder: Path, cfg: ToyBenchmarkConfig, progress: bool = True,
               min_area: float = 0.05, max_area: float = 0.5) -> None:
    rows = []
    area_img = cfg.image_size * cfg.image_size
    for i in progress_bar(range(cfg.coco_images), desc="toy COCO", unit="img", disable=not progress):
        rng = random.Random(stream_seed("coco", i))
        name = f"{i + 1:012d}.jpg"
        while True:
            scene = sample_scene(rng, num_objects=rng.choice((2, 3)), style="photo")
            rendered = render_scene(scene, derive_seed("coco", name, rng.random()), cfg.image_size)
            candidates = []
            for obj in scene.objects:
                x1, y1, x2, y2 = rendered.boxes[obj.oid]
                if min_area * area_img < (x2 - x1) * (y2 - y1) < max_area * area_img:
                    candidates.append(obj)
            if candidates:
                break
        query = rng.choice(candidates)
        mask = rendered.masks[query.oid][..., None]
        masked = (rendered.image * mask + (1 - mask) * 255).astype(np.uint8)
        for sub, img in (("val2017", rendered.image), ("val2017_masked", masked)):
            (folder / sub).mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / sub / name, format="JPEG", quality=95)
        others = [o.shape for o in scene.objects if o.oid != query.oid]
        box = ";".join(str(v) for v in rendered.boxes[query.oid])
        rows.append([name, box + " ", query.shape, ";".join(others)])
    with atomic_path(folder / "coco_eval.csv") as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "query_regions", "query_class", "classes"])
        writer.writerows(rows)


# ------------------------------------------------------------------------- exclusion

def _shows(scene: Scene, shape: str, colour: str) -> bool:
    return any(o.shape == shape and o.colour == colour for o in scene.objects)


def exclusion_positive(scene: Scene, kept: list[ToyObject], excluded: ToyObject, background: str, style: str) -> bool:
    """Every kept object (shape, colour), same background and style, and no excluded object."""
    return (scene.background == background and scene.style == style
            and all(_shows(scene, o.shape, o.colour) for o in kept)
            and not _shows(scene, excluded.shape, excluded.colour))


def write_exclusion(folder: Path, cfg: ToyBenchmarkConfig, progress: bool = True) -> None:
    images: dict[str, str] = {}
    scenes: dict[str, Scene] = {}
    specs = []
    for q in progress_bar(range(cfg.exclusion_queries), desc="toy exclusion", unit="query", disable=not progress):
        rng = random.Random(stream_seed("exclusion", q))
        reference = sample_scene(rng, num_objects=rng.choice((2, 3)))
        excluded = rng.choice(reference.objects)
        kept = [o for o in reference.objects if o.oid != excluded.oid]
        target = dataclasses.replace(reference, objects=tuple(kept))
        other = rng.choice(kept)
        partial = dataclasses.replace(reference, objects=tuple(o for o in reference.objects if o.oid != other.oid))
        group = {"ref": reference, "tgt": target, "dup1": reference, "dup2": reference, "partial": partial}
        names = {}
        for role, scene in group.items():
            name = f"excl-{q}-{role}"
            image = render_scene(scene, derive_seed("exclusion", name), cfg.image_size).image
            save_png(image, folder / "images" / f"{name}.png")
            images[name], scenes[name], names[role] = f"images/{name}.png", scene, name
        ex_np = f"{excluded.colour} {excluded.shape}"
        kept_text = " and ".join(with_article(noun_phrase(o, rng, p_size=0.3)) for o in kept)
        style = f"{article(reference.style)} {reference.style}"
        modification = rng.choice(("without the {x}", "remove the {x}", "no {x}")).format(x=ex_np)
        specs.append({"id": q, "reference": names["ref"], "target": names["tgt"],
                      "text": f"{style} of {kept_text} on {reference.background} without the {ex_np}",
                      "modification": modification,
                      "target_description": full_description(target, random.Random(derive_seed("exclusion", "description", q))),
                      "excluded": {"shape": excluded.shape, "colour": excluded.colour},
                      "_kept": kept, "_excluded": excluded, "_bg": reference.background, "_style": reference.style})
    queries = []
    for spec in specs:  # positives / hard negatives over the whole gallery, by predicate
        kept, ex = spec.pop("_kept"), spec.pop("_excluded")
        bg, style = spec.pop("_bg"), spec.pop("_style")
        spec["positives"] = sorted(n for n, s in scenes.items() if exclusion_positive(s, kept, ex, bg, style))
        spec["hard_negatives"] = sorted(
            n for n, s in scenes.items()
            if s.background == bg and s.style == style and all(_shows(s, o.shape, o.colour) for o in kept)
            and _shows(s, ex.shape, ex.colour))
        queries.append(spec)
    _write_json(folder / "exclusion.json", {
        "format": exclusion_format(),
        "description": ("Negation queries: retrieve images showing the kept objects but NOT the excluded one. "
                        "'text' is a text-only query; 'modification' is applied to 'reference' (composed). "
                        "positives/hard_negatives are computed from the scene specs over the whole gallery."),
        "images": images,
        "queries": queries,
    })


# -------------------------------------------------------------------------- ExclCOCO

def _render_exclcoco_image(job: tuple[str, int, int, str]) -> dict[str, Any]:
    """Render scene ``index`` of ``stream`` into ``path``; returns its objects, boxes and captions."""
    stream, index, size, path = job
    rng = random.Random(stream_seed(stream, index))
    scene = sample_scene(rng)
    rendered = render_scene(scene, derive_seed(stream, index), size)
    save_png(rendered.image, Path(path))
    captions = [full_description(scene, rng), full_description(scene, rng), alt_text(scene, rng)]
    objects = [(o.shape, o.colour, [float(v) for v in rendered.boxes[o.oid]]) for o in scene.objects]
    return {"objects": objects, "captions": captions}


def toy_categories(labels: str) -> list[str]:
    """Category names of the toy ExclCOCO: ``shape`` or ``colour shape`` (see ToyBenchmarkConfig)."""
    if labels == "shape":
        return list(SHAPES)
    if labels == "colour shape":
        return [f"{c} {s}" for c in COLOURS for s in SHAPES]
    raise ValueError(f"exclcoco_labels must be 'shape' or 'colour shape', got {labels!r}")


def write_toy_coco_split(folder: Path, split: str, stream: str, count: int, image_size: int,
                         progress: bool = True, labels: str = "colour shape"
                         ) -> tuple[Path, Path, Path]:
    """A COCO-format split of toy scenes: instances (categories: :func:`toy_categories`) and captions."""
    image_dir = folder / split
    jobs = [(stream, i, image_size, str(image_dir / f"{i + 1:012d}.png")) for i in range(count)]
    images, annotations, captions = [], [], []
    names = toy_categories(labels)
    categories = [{"id": k + 1, "name": n, "supercategory": "shape"} for k, n in enumerate(names)]
    for i, out in enumerate(parallel_map(_render_exclcoco_image, jobs, desc=f"toy ExclCOCO {split}",
                                         progress=progress, unit="img")):
        image_id = i + 1
        images.append({"id": image_id, "file_name": f"{image_id:012d}.png", "width": image_size,
                       "height": image_size})
        for shape, colour, (x1, y1, x2, y2) in out["objects"]:
            name = shape if labels == "shape" else f"{colour} {shape}"
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": names.index(name) + 1, "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1), "iscrowd": 0})
        for text in out["captions"]:
            captions.append({"id": len(captions) + 1, "image_id": image_id, "caption": text})
    ann = folder / "annotations"
    instances = ann / f"instances_{split}.json"
    _write_json(instances, {"images": images, "annotations": annotations, "categories": categories})
    caption_path = ann / f"captions_{split}.json"
    _write_json(caption_path, {"images": images, "annotations": captions})
    return instances, caption_path, image_dir


def write_exclcoco(folder: Path, cfg: ToyBenchmarkConfig, progress: bool = True) -> None:
    from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco

    sizes = {"train": cfg.exclcoco_train_images, "test": cfg.exclcoco_test_images}
    for split, count in sizes.items():
        instances, captions, images = write_toy_coco_split(folder / "coco", split, f"exclcoco_{split}", count,
                                                           cfg.image_size, progress, cfg.exclcoco_labels)
        build_exclcoco(instances, captions, folder / split, images, ExclCocoConfig(caption_min_images=0),
                       split=split)


# ----------------------------------------------------------------------------- driver

WRITERS: dict[str, Callable[[Path, ToyBenchmarkConfig, bool], None]] = {
    "cirr": write_cirr, "imgnet": write_imgnet, "coco": write_coco, "exclusion": write_exclusion,
    "exclcoco": write_exclcoco,
}


def write_benchmarks(root: str | Path, cfg: ToyBenchmarkConfig | None = None,
                     which: tuple[str, ...] = BENCHMARKS, progress: bool = True) -> dict[str, Path]:
    """Write the toy benchmarks under ``root`` (skipping finished ones); returns name -> folder
    (the folder to give the evaluation readers as data root)."""
    cfg = cfg or ToyBenchmarkConfig()
    root = Path(root)
    unknown = [w for w in which if w not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown toy benchmarks {unknown}; known: {BENCHMARKS}")
    return {name: write_benchmark(root / name, name, cfg, progress) for name in which}


def write_benchmark(folder: str | Path, name: str, cfg: ToyBenchmarkConfig, progress: bool = True,
                    design: CirrDesign | None = None) -> Path:
    """Toy benchmark ``name`` into ``folder``, unless its done-marker says it was written from this
    config (and, for ``cirr``, this design) by this world version; returns ``folder``. A folder
    written otherwise, or without a marker, is written again: files that merely exist prove nothing."""
    if name not in WRITERS:
        raise ValueError(f"unknown toy benchmark {name!r}; known: {BENCHMARKS}")
    if design is not None and name != "cirr":
        raise ValueError(f"a CIRR design was given for the toy benchmark {name!r}; only cirr takes one")
    folder = Path(folder)
    if is_done(folder, name, cfg, design):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("writing toy benchmark %s into %s", name, folder)
    if design is not None:
        write_cirr(folder, cfg, progress, design=design)
    else:
        WRITERS[name](folder, cfg, progress)
    _write_json(folder / "toy_benchmark.json", _marker(folder, name, cfg, design))  # last: done-marker
    return folder
