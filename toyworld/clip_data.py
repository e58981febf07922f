"""The toy CLIP's training images and batches: the web pool, the hard-negative groups, one batch.

Every image is a pure function of its index (rendered over processes by :func:`parallel_map`;
the pixels do not depend on how the work is split).
"""

from __future__ import annotations

import random

import numpy as np

from toyworld.clip_config import ToyBackboneConfig
from .parallel import parallel_map
from .render import render_scene
from .texts import full_description, web_text
from .world import Scene, apply_edit, edit_is_possible, scene_from_seed, stream_seed
from demind.seeding import derive_seed


def _render_chunk(job: tuple[str, int, int, int]) -> np.ndarray:
    """Images of scenes ``start..stop-1`` of a stream, (n, H, W, 3) uint8 (a worker's share)."""
    stream, start, stop, image_size = job
    return np.stack([render_scene(scene_from_seed(stream_seed(stream, i)),
                                  derive_seed(stream, "nuisance", i), image_size).image for i in range(start, stop)])


def render_pool(stream: str, count: int, image_size: int, progress: bool = True,
                workers: int | None = None, chunk: int = 250) -> tuple[list[Scene], np.ndarray]:
    """Scenes ``0..count-1`` of a seed stream and their images, (count, H, W, 3) uint8.

    Rendered in chunks over ``workers`` processes (default: every core) when there is more
    than one chunk; the images do not depend on how the work is split.
    """
    scenes = [scene_from_seed(stream_seed(stream, i)) for i in range(count)]
    jobs = [(stream, start, min(start + chunk, count), image_size) for start in range(0, count, chunk)]
    parts = parallel_map(_render_chunk, jobs, workers if len(jobs) > 1 else 1, desc=f"render {stream}",
                         progress=progress, unit="chunk")
    return scenes, np.concatenate(list(parts))


def group_scenes(index: int, edits: tuple[str, ...]) -> list[Scene]:
    """Group ``index``: a training scene, then the scene with each edit of ``edits``
    applied (an impossible edit falls back to ``shape``, which every scene allows). Seeded by index."""
    base = scene_from_seed(derive_seed("toy-backbone-groups", index))
    rng = random.Random(derive_seed("toy-backbone-groups", "edits", index))
    return [base] + [apply_edit(base, kind if edit_is_possible(base, kind) else "shape", rng) for kind in edits]


def _render_group_chunk(job: tuple[int, int, tuple[str, ...], int]) -> np.ndarray:
    """Images of groups ``start..stop-1``, (n, 1 + len(edits), H, W, 3) uint8; one nuisance seed
    and per-part streams per group, so its members differ only where an edit shows."""
    start, stop, edits, image_size = job
    out = []
    for g in range(start, stop):
        seed = derive_seed("toy-backbone-groups", "nuisance", g)
        out.append(np.stack([render_scene(s, seed, image_size, per_part=True).image
                             for s in group_scenes(g, edits)]))
    return np.stack(out)


def render_group_pool(count: int, edits: tuple[str, ...], image_size: int, progress: bool = True,
                      chunk: int = 100) -> tuple[list[list[Scene]], np.ndarray]:
    """Groups ``0..count-1`` and their images, (count, 1 + len(edits), H, W, 3) uint8."""
    groups = [group_scenes(g, edits) for g in range(count)]
    jobs = [(start, min(start + chunk, count), tuple(edits), image_size) for start in range(0, count, chunk)]
    parts = parallel_map(_render_group_chunk, jobs, None if len(jobs) > 1 else 1, desc="render groups",
                         progress=progress, unit="chunk")
    return groups, np.concatenate(list(parts))


def groups_per_batch(cfg: "ToyBackboneConfig") -> int:
    """How many whole groups fill ``group_share`` of a batch (at least one random pair stays)."""
    size = 1 + len(cfg.group_edits)
    return min(int(round(cfg.group_share * cfg.batch_size / size)), (cfg.batch_size - 1) // size)


def draw_batch(cfg: ToyBackboneConfig, scenes: list[Scene], groups: list[list[Scene]], n_groups: int,
               rng: random.Random) -> tuple[np.ndarray, list[str], list[Scene]]:
    """One training batch: ``n_groups`` whole hard-negative groups (full descriptions), the
    rest random web images with web texts; a fresh caption per visit.

    Returns (B,) rows of the training pool (:func:`training_pool`: the ``len(scenes)`` web images,
    then each group's members in order), the B texts and the B scenes they show."""
    idx = rng.sample(range(len(scenes)), cfg.batch_size - n_groups * (1 + len(cfg.group_edits)))
    texts = [web_text(scenes[i], rng) for i in idx]  # a fresh caption per visit
    shown = [scenes[i] for i in idx]
    rows = list(idx)
    if n_groups:
        size = 1 + len(cfg.group_edits)
        chosen = rng.sample(range(len(groups)), n_groups)
        texts += [full_description(scene, rng) for g in chosen for scene in groups[g]]
        shown += [scene for g in chosen for scene in groups[g]]
        rows += [len(scenes) + g * size + m for g in chosen for m in range(size)]
    return np.array(rows), texts, shown


def training_pool(images: np.ndarray, group_images: np.ndarray | None) -> np.ndarray:
    """(N + G * members, H, W, 3) uint8: the web images, then every group's members in order (the
    rows :func:`draw_batch` draws)."""
    if group_images is None:
        return images
    return np.concatenate([images, group_images.reshape(-1, *group_images.shape[2:])])
