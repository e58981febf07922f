"""Procedural toy scenes: the semantic spec, seeded sampling and single edits.

A :class:`Scene` is the ground truth that every text and every benchmark label is
computed from; pixels come from :mod:`toyworld.render`. Everything is a pure function
of integer seeds, so the same seed gives the same scene, texts and image bytes on any
machine. Design choices are argued in ``docs/lab-notes/toy-world.md``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from demind.errors import InputError

SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond", "hexagon", "heart")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "pink", "white")
SIZES = ("small", "large")
POSITIONS = ("top left", "top", "top right", "left", "center", "right",
             "bottom left", "bottom", "bottom right")
BACKGROUNDS = ("grass", "sand", "water", "snow", "brick", "wood")
STYLES = ("photo", "cartoon", "origami", "toy", "sculpture")
# Pic2Word's ImageNet-R domain order: label = class + 1000 * index.
DOMAINS = ("cartoon", "origami", "toy", "sculpture")
# Web images are mostly photographs.
STYLE_WEIGHTS = (0.6, 0.1, 0.1, 0.1, 0.1)
OBJECT_COUNT_WEIGHTS = {1: 0.35, 2: 0.4, 3: 0.25}
EDIT_KINDS = ("colour", "shape", "size", "position", "add", "remove", "background", "style")

# The world's version string, in every cache key and done-marker: bump it when sampling or
# rendering changes, so that caches keyed on it go stale. 2.1: painted sculptures.
WORLD_VERSION = "toy-world-2.1"

# ------------------------------------------------- themes and details (implicit intents, redundancy)

IMPLICIT = "implicit"  # the edit kind of a theme (an implicit intent); not in EDIT_KINDS


@dataclass(frozen=True)
class Theme:
    """An implicit intent: a bundle of concrete attributes, and how people name it.

    palette: object colours; background: the theme's background (None: kept); decor: added
    objects (names as texts say them); nouns: "make it feel like {noun}"; adjective: "a
    {adjective} look"; when: "the same scene {when}".
    """

    name: str
    palette: tuple[str, ...]
    background: str | None
    decor: tuple[str, ...]
    nouns: tuple[str, ...]
    adjective: str
    when: str


THEMES: dict[str, Theme] = {t.name: t for t in (
    Theme("autumn", ("orange", "yellow", "red"), "leaves", ("falling leaves",),
          ("autumn", "early fall", "fall"), "autumnal", "in autumn"),
    Theme("winter", ("white", "blue"), "snow", ("snowflakes",), ("winter", "a winter day"), "wintry", "in winter"),
    Theme("night", ("blue", "purple", "white"), "dark sky", ("a moon", "stars"), ("night", "nighttime"),
          "nocturnal", "at night"),
    Theme("underwater", ("blue", "green", "yellow"), "seabed", ("bubbles", "seaweed"),
          ("the bottom of the sea", "being underwater"), "underwater", "under the sea"),
    Theme("festive", ("red", "green", "yellow"), None, ("string lights", "confetti"),
          ("a holiday", "a celebration"), "festive", "for the holidays"),
)}
THEME_BACKGROUNDS = ("leaves", "dark sky", "seabed")  # backgrounds only a theme brings
P_THEME = 0.25  # share of scenes sampled with a theme applied

# Redundant detail: small items on the border band that every edit keeps and no edit names.
DETAIL_KINDS = ("fence", "cloud", "flower", "rock", "tree", "lamp", "sign", "ball")
DETAIL_SLOTS = 5  # positions along the top strip (clouds) or the bottom strip (the rest)
DETAIL_COUNT_WEIGHTS = {2: 0.5, 3: 0.5}


@dataclass(frozen=True)
class Detail:
    """One redundant item: kind, slot (0..DETAIL_SLOTS-1 along its strip) and tone (0..2)."""

    kind: str
    slot: int
    tone: int

# Disjoint seed streams: scene seed = stream base + index. No two uses share a scene.
SEED_STREAMS = {
    "web": 1_000_000_000,        # backbone (the "web CLIP") training scenes
    "web_eval": 1_900_000_000,   # the backbone's own held-out recall check
    "cc3m": 2_000_000_000,       # toy intent shards (De-MINDS training data)
    "cirr": 3_000_000_000,
    "imgnet": 3_100_000_000,
    "coco": 3_200_000_000,
    "exclusion": 3_300_000_000,
    "exclcoco_train": 3_400_000_000,  # ExclMM's training split of the toy ExclCOCO
    "exclcoco_test": 3_500_000_000,
    "exclinst_train": 3_600_000_000,  # the exclusion instrument (toyworld/exclusion_instrument.py)
    "exclinst_test": 3_700_000_000,
}


@dataclass(frozen=True)
class ToyObject:
    """One object; ``oid`` tracks identity across edits (a recoloured circle keeps it)."""

    oid: int
    shape: str
    colour: str
    size: str
    position: str


@dataclass(frozen=True)
class Scene:
    """The semantic content of an image: objects, background, style (domain)."""

    objects: tuple[ToyObject, ...]
    background: str
    style: str
    # Sampled scenes have details (and a share a theme); a scene built without them (a benchmark's
    # single object, a test's) leaves them out of to_dict / canonical:
    theme: str | None = None            # the theme applied (THEMES), if any
    decor: tuple[str, ...] = ()         # the theme's added objects
    details: tuple[Detail, ...] = ()    # redundant detail no edit concerns

    def has_scene_extras(self) -> bool:
        return self.theme is not None or bool(self.decor) or bool(self.details)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"objects": [dataclasses.asdict(o) for o in self.objects],
                                "background": self.background, "style": self.style}
        if self.has_scene_extras():
            data.update(theme=self.theme, decor=list(self.decor), details=[dataclasses.asdict(d) for d in self.details])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scene":
        return cls(tuple(ToyObject(**o) for o in data["objects"]), data["background"], data["style"],
                   data.get("theme"), tuple(data.get("decor", ())), tuple(Detail(**d) for d in data.get("details", ())))

    def canonical(self) -> tuple:
        """Identity-free content: two scenes with equal canonical forms look the same."""
        objs = sorted((o.shape, o.colour, o.size, o.position) for o in self.objects)
        if self.has_scene_extras():
            return (tuple(objs), self.background, self.style, self.theme, self.decor, self.details)
        return (tuple(objs), self.background, self.style)

    def object_with_shape(self, shape: str) -> ToyObject | None:
        return next((o for o in self.objects if o.shape == shape), None)


def stream_seed(stream: str, index: int) -> int:
    """Seed of scene ``index`` in a named stream (see SEED_STREAMS)."""
    if stream not in SEED_STREAMS:
        raise ValueError(f"unknown seed stream {stream!r}; known: {sorted(SEED_STREAMS)}")
    return SEED_STREAMS[stream] + index


def _sample_object(rng: random.Random, oid: int, used_shapes: set[str], used_cells: set[str],
                   colour: str | None = None, shape: str | None = None) -> ToyObject:
    shape = shape or rng.choice([s for s in SHAPES if s not in used_shapes])
    return ToyObject(
        oid=oid,
        shape=shape,
        colour=colour or rng.choice(COLOURS),
        size=rng.choice(SIZES),
        position=rng.choice([p for p in POSITIONS if p not in used_cells]),
    )


def sample_scene(rng: random.Random, num_objects: int | None = None, style: str | None = None,
                 background: str | None = None) -> Scene:
    """A random scene; distinct shapes and grid cells within the scene.

    The objects, background and style first, then the details, then with probability P_THEME a
    random theme applied (which may replace ``background``)."""
    scene = _sample_base_scene(rng, num_objects, style, background)
    scene = with_details(scene, rng)
    if rng.random() < P_THEME:
        scene = apply_theme(scene, rng.choice(list(THEMES)), rng)
    return scene


def sample_details(rng: random.Random) -> tuple[Detail, ...]:
    """2-3 details in distinct slots of their strip (clouds on top, the rest at the bottom)."""
    counts, weights = zip(*DETAIL_COUNT_WEIGHTS.items())
    details: list[Detail] = []
    for _ in range(rng.choices(counts, weights)[0]):
        kind = rng.choice([k for k in DETAIL_KINDS if k not in {d.kind for d in details}])
        top = kind == "cloud"
        used = {d.slot for d in details if (d.kind == "cloud") == top}
        details.append(Detail(kind, rng.choice([i for i in range(DETAIL_SLOTS) if i not in used]), rng.randrange(3)))
    return tuple(details)


def with_details(scene: Scene, rng: random.Random) -> Scene:
    """``scene`` with freshly sampled details."""
    return dataclasses.replace(scene, details=sample_details(rng))


def apply_theme(scene: Scene, theme: str, rng: random.Random) -> Scene:
    """The theme's bundle applied to ``scene``: every object's colour redrawn from the
    palette, the theme's background (when it has one), its decor, and ``theme`` set."""
    if theme not in THEMES:
        raise InputError(f"unknown theme {theme!r}; known: {', '.join(THEMES)}")
    bundle = THEMES[theme]
    objects = tuple(dataclasses.replace(o, colour=rng.choice(bundle.palette)) for o in scene.objects)
    return dataclasses.replace(scene, objects=objects, background=bundle.background or scene.background,
                               decor=bundle.decor, theme=theme)


def strip_theme(scene: Scene, rng: random.Random) -> Scene:
    """A plausible unthemed scene that ``apply_theme`` turns into ``scene``: random object
    colours, a random plain background where the theme brought one, no decor, no theme."""
    if scene.theme is None:
        return scene
    bundle = THEMES[scene.theme]
    objects = tuple(dataclasses.replace(o, colour=rng.choice(COLOURS)) for o in scene.objects)
    background = scene.background
    if bundle.background is not None:
        background = rng.choice([b for b in BACKGROUNDS if b != scene.background])
    return dataclasses.replace(scene, objects=objects, background=background, decor=(), theme=None)


def _sample_base_scene(rng: random.Random, num_objects: int | None, style: str | None,
                     background: str | None) -> Scene:
    if num_objects is None:
        counts, weights = zip(*OBJECT_COUNT_WEIGHTS.items())
        num_objects = rng.choices(counts, weights)[0]
    objects: list[ToyObject] = []
    for oid in range(num_objects):
        objects.append(_sample_object(rng, oid, {o.shape for o in objects}, {o.position for o in objects}))
    return Scene(
        objects=tuple(objects),
        background=background or rng.choice(BACKGROUNDS),
        style=style or rng.choices(STYLES, STYLE_WEIGHTS)[0],
    )


def scene_from_seed(seed: int, **kwargs: Any) -> Scene:
    """``sample_scene`` from ``random.Random(seed)``; the other arguments pass on."""
    return sample_scene(random.Random(seed), **kwargs)


def _replace_object(scene: Scene, new: ToyObject) -> Scene:
    return dataclasses.replace(scene, objects=tuple(new if o.oid == new.oid else o for o in scene.objects))


def edit_is_possible(scene: Scene, kind: str) -> bool:
    if kind == "add":
        return len(scene.objects) < 3
    if kind == "remove":
        return len(scene.objects) >= 2
    if kind == IMPLICIT:
        return scene.theme is None
    return kind in EDIT_KINDS


def apply_edit(scene: Scene, kind: str, rng: random.Random, oid: int | None = None) -> Scene:
    """Return ``scene`` changed by one edit of ``kind`` (on object ``oid`` when given).

    Every edit changes what the image shows: a new colour differs from the old one, a new
    shape is not already in the scene, and so on.
    """
    if not edit_is_possible(scene, kind):
        raise ValueError(f"edit {kind!r} is not possible on a scene with {len(scene.objects)} objects"
                         + (f" and theme {scene.theme!r}" if kind == IMPLICIT else ""))
    by_id = {o.oid: o for o in scene.objects}
    target = by_id[oid] if oid is not None else rng.choice(scene.objects)
    shapes = {o.shape for o in scene.objects}
    cells = {o.position for o in scene.objects}
    if kind == "colour":
        return _replace_object(scene, dataclasses.replace(
            target, colour=rng.choice([c for c in COLOURS if c != target.colour])))
    if kind == "shape":
        return _replace_object(scene, dataclasses.replace(
            target, shape=rng.choice([s for s in SHAPES if s not in shapes])))
    if kind == "size":
        return _replace_object(scene, dataclasses.replace(
            target, size="large" if target.size == "small" else "small"))
    if kind == "position":
        return _replace_object(scene, dataclasses.replace(
            target, position=rng.choice([p for p in POSITIONS if p not in cells])))
    if kind == "add":
        new_oid = max(by_id) + 1
        return dataclasses.replace(scene, objects=scene.objects + (_sample_object(rng, new_oid, shapes, cells),))
    if kind == "remove":
        return dataclasses.replace(scene, objects=tuple(o for o in scene.objects if o.oid != target.oid))
    if kind == "background":
        return dataclasses.replace(scene, background=rng.choice([b for b in BACKGROUNDS if b != scene.background]))
    if kind == "style":
        return dataclasses.replace(scene, style=rng.choice([s for s in STYLES if s != scene.style]))
    if kind == IMPLICIT:
        return apply_theme(scene, rng.choice(list(THEMES)), rng)
    raise ValueError(f"unknown edit kind {kind!r}; known: {EDIT_KINDS + (IMPLICIT,)}")


def random_edit(scene: Scene, rng: random.Random, exclude: tuple[str, ...] = ()) -> tuple[str, Scene]:
    """One random possible edit whose kind is not in ``exclude``; returns (kind, new scene)."""
    kinds = [k for k in EDIT_KINDS if k not in exclude and edit_is_possible(scene, k)]
    kind = rng.choice(kinds)
    return kind, apply_edit(scene, kind, rng)


@dataclass(frozen=True)
class Change:
    """One difference between a source and a target scene, for writing texts.

    kind: one of EDIT_KINDS, or IMPLICIT (a theme applied). ``before``/``after`` are the object
    before and after (None for add / remove respectively); ``old``/``new`` hold the background
    or style, or for IMPLICIT the themes; ``colours`` (IMPLICIT) the target's object colours,
    the palette's realisation.
    """

    kind: str
    before: ToyObject | None = None
    after: ToyObject | None = None
    old: str | None = None
    new: str | None = None
    colours: tuple[str, ...] = ()


def scene_diff(source: Scene, target: Scene) -> list[Change]:
    """Differences from ``source`` to ``target``, objects matched by ``oid``.

    An object whose shape changed is one "shape" change (colour/size/position changes on
    it are folded into the replacement's description); otherwise each attribute is its own
    change. Order: removals, object edits, additions, background, style.
    """
    src = {o.oid: o for o in source.objects}
    tgt = {o.oid: o for o in target.objects}
    changes = [Change("remove", before=src[i]) for i in sorted(src) if i not in tgt]
    for i in sorted(src):
        if i not in tgt:
            continue
        a, b = src[i], tgt[i]
        if a.shape != b.shape:
            changes.append(Change("shape", before=a, after=b))
            continue
        for attr, kind in (("colour", "colour"), ("size", "size"), ("position", "position")):
            if getattr(a, attr) != getattr(b, attr):
                changes.append(Change(kind, before=a, after=b))
    changes += [Change("add", after=tgt[i]) for i in sorted(tgt) if i not in src]
    if source.background != target.background:
        changes.append(Change("background", old=source.background, new=target.background))
    if source.style != target.style:
        changes.append(Change("style", old=source.style, new=target.style))
    if source.theme != target.theme:
        changes = _fold_theme(source, target, changes)
    return changes


def _fold_theme(source: Scene, target: Scene, changes: list[Change]) -> list[Change]:
    """One IMPLICIT change first, absorbing the bundle's colour and background changes; every
    other difference stays its own change."""
    if target.theme is None:
        raise ValueError(f"no modification text can remove a theme ({source.theme!r}): toy texts only apply themes")
    bundle = THEMES[target.theme]

    def in_bundle(c: Change) -> bool:
        return ((c.kind == "colour" and c.after.colour in bundle.palette)
                or (c.kind == "background" and c.new == bundle.background))

    implicit = Change(IMPLICIT, old=source.theme, new=target.theme,
                      colours=tuple(dict.fromkeys(o.colour for o in target.objects)))
    return [implicit] + [c for c in changes if not in_bundle(c)]


def modification_type(changes: list[Change]) -> str:
    """Label for per-type recall: the single change's kind, or "multi"."""
    return changes[0].kind if len(changes) == 1 else "multi"
