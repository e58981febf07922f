"""Rendering toy scenes to pixels, with nuisance detail that no text mentions.

``render_scene(scene, nuisance_seed)`` is a pure function: same arguments, same bytes.
Two renders of one scene with different nuisance seeds are two *photographs* of it:
lighting, white balance, jitter, rotation, clutter, texture phase and noise all change,
the semantics do not. Shape masks and outlines are drawn at 2x and box-downsampled (anti-aliased edges);
textures and camera effects are computed at the output size (speed: ~3 ms per image).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .decor import draw_decor, draw_details
from .world import POSITIONS, Scene, ToyObject
from demind.seeding import derive_seed

IMAGE_SIZE = 64
SUPERSAMPLE = 2  # for shape masks and outlines only

COLOUR_RGB = {
    "red": (215, 40, 40), "green": (45, 165, 60), "blue": (40, 85, 220), "yellow": (240, 210, 45),
    "purple": (135, 60, 180), "orange": (245, 135, 30), "pink": (245, 135, 190), "white": (245, 245, 242),
}
BACKGROUND_RGB = {
    "grass": (70, 140, 50), "sand": (220, 195, 140), "water": (50, 110, 170),
    "snow": (228, 234, 245), "brick": (155, 70, 50), "wood": (140, 95, 55),
    # backgrounds only a theme brings
    "leaves": (160, 90, 35), "dark sky": (22, 28, 62), "seabed": (25, 95, 115),
}
# each theme's colour cast on the whole photograph (per-channel gain; night also darkens)
THEME_CAST = {"autumn": (1.08, 1.0, 0.86), "winter": (0.96, 1.02, 1.12), "night": (0.62, 0.66, 0.86),
              "underwater": (0.78, 1.0, 1.06), "festive": (1.06, 1.0, 0.94)}
CELL_CENTRES = {
    name: (0.2 + 0.3 * (i % 3), 0.2 + 0.3 * (i // 3)) for i, name in enumerate(POSITIONS)
}
RADIUS = {"small": 0.11, "large": 0.2}  # fraction of the image side
PAPER_RGB = np.array([236, 231, 220], dtype=np.float32)


@dataclass
class RenderedScene:
    """A rendered image plus per-object ground truth.

    image: (H, W, 3) uint8. masks: oid -> (H, W) bool visible region (after occlusion).
    boxes: oid -> (x1, y1, x2, y2) in pixels of the visible region.
    """

    image: np.ndarray
    masks: dict[int, np.ndarray]
    boxes: dict[int, tuple[int, int, int, int]]

    def pil(self) -> Image.Image:
        return Image.fromarray(self.image)


# ----------------------------------------------------------------------------- shapes

def unit_polygon(shape: str) -> list[tuple[float, float]]:
    """Outline of ``shape`` centred at 0 with radius about 1 (y points down)."""
    if shape == "circle":
        return [(math.cos(t), math.sin(t)) for t in np.linspace(0, 2 * math.pi, 40, endpoint=False)]
    if shape == "square":
        return [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]
    if shape == "triangle":
        return [(math.cos(a), math.sin(a) + 0.15) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "star":
        return [((1.0 if k % 2 == 0 else 0.45) * math.cos(-math.pi / 2 + k * math.pi / 5),
                 (1.0 if k % 2 == 0 else 0.45) * math.sin(-math.pi / 2 + k * math.pi / 5)) for k in range(10)]
    if shape == "cross":
        a, b = 0.3, 0.9
        return [(-a, -b), (a, -b), (a, -a), (b, -a), (b, a), (a, a), (a, b), (-a, b), (-a, a), (-b, a), (-b, -a), (-a, -a)]
    if shape == "diamond":
        return [(0.0, -1.0), (0.7, 0.0), (0.0, 1.0), (-0.7, 0.0)]
    if shape == "hexagon":
        return [(0.95 * math.cos(k * math.pi / 3), 0.95 * math.sin(k * math.pi / 3)) for k in range(6)]
    if shape == "heart":
        pts = []
        for t in np.linspace(0, 2 * math.pi, 36, endpoint=False):
            x = 16 * math.sin(t) ** 3
            y = 13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)
            pts.append((x / 17.0, -y / 17.0 + 0.05))
        return pts
    raise ValueError(f"unknown shape {shape!r}")


def _place(points: list[tuple[float, float]], cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    c, s = math.cos(rot), math.sin(rot)
    return [(cx + r * (x * c - y * s), cy + r * (x * s + y * c)) for x, y in points]


def _polygon_mask(points: list[tuple[float, float]], size: int) -> np.ndarray:
    """Anti-aliased coverage in [0, 1], (size, size): drawn at 2x, box-downsampled."""
    big = size * SUPERSAMPLE
    img = Image.new("L", (big, big), 0)
    ImageDraw.Draw(img).polygon([(x * SUPERSAMPLE, y * SUPERSAMPLE) for x, y in points], fill=255)
    return np.asarray(img.resize((size, size), Image.BOX), dtype=np.float32) / 255.0


def _line_mask(draw_fn, size: int) -> np.ndarray:
    """Anti-aliased lines: ``draw_fn(draw, scale)`` draws at 2x; returns (size, size) in [0, 1]."""
    big = size * SUPERSAMPLE
    img = Image.new("L", (big, big), 0)
    draw_fn(ImageDraw.Draw(img), SUPERSAMPLE)
    return np.asarray(img.resize((size, size), Image.BOX), dtype=np.float32) / 255.0


# ----------------------------------------------------------------------- backgrounds

def _low_freq(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Smooth noise in about [-1, 1], (size, size)."""
    small = Image.fromarray(rng.normal(size=(cells, cells)).astype(np.float32), mode="F")
    return np.asarray(small.resize((size, size), Image.BICUBIC), dtype=np.float32)


def background_texture(name: str, rng: np.random.Generator, size: int) -> np.ndarray:
    """Photo-like texture of a background, (size, size, 3) float32 in 0..255."""
    base = np.array(BACKGROUND_RGB[name], dtype=np.float32)
    # Pattern periods are in pixels of a 128-px image; scale coordinates to keep them.
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) * (128.0 / size)
    phase = rng.uniform(0, 2 * math.pi)
    lum = 14 * _low_freq(rng, size, 6) + 6 * rng.normal(size=(size, size))
    if name == "grass":
        rep = max(2, size // 21)
        streaks = np.repeat(rng.normal(size=(size // rep + 1, size)), rep, axis=0)[:size]
        lum += 16 * streaks
    elif name == "sand":
        lum += 7 * np.sin(2 * math.pi * (yy + 3 * np.sin(xx / 10 + phase)) / 9)
    elif name == "water":
        lum += 15 * np.sin(2 * math.pi * yy / 7 + 2 * np.sin(2 * math.pi * xx / 40 + phase))
    elif name == "snow":
        lum = 0.5 * lum
        flakes = rng.random((size, size)) < 0.01
        lum[flakes] += 25
    elif name == "brick":
        row_h, brick_w = 16, 32  # in 128-px coordinates
        row = (yy // row_h).astype(int)
        col = ((xx + (row % 2) * brick_w / 2) // brick_w).astype(int)
        lum += 18 * np.sin(row * 12.9898 + col * 78.233 + phase)
        mortar = ((yy % row_h) < 2) | (((xx + (row % 2) * brick_w / 2) % brick_w) < 2)
    elif name == "wood":
        lum += 18 * np.sin(2 * math.pi * (xx + 6 * np.sin(yy / 17 + phase)) / 11)
    elif name == "dark sky":  # darker towards the top, with faint stars
        lum = 0.4 * lum - 10 * (1 - yy / 128.0)
        lum[rng.random((size, size)) < 0.006] += 110
    elif name == "seabed":  # light bands in the water over a sandy floor
        lum += 12 * np.sin(2 * math.pi * (xx + 0.5 * yy) / 23 + phase)
    tex = base[None, None, :] + lum[..., None] * (base[None, None, :] / 160.0 + 0.3)
    if name == "brick":
        tex[mortar] = (200, 198, 190)
    elif name == "leaves":  # a ground of leaves: brown patches mixed with orange and red ones
        mix = _low_freq(rng, size, 12)[..., None]
        tex = np.where(mix > 0.3, tex * np.array([1.35, 1.1, 0.7], np.float32),
                       np.where(mix < -0.3, tex * np.array([1.25, 0.6, 0.6], np.float32), tex))
    elif name == "seabed":
        floor = yy >= 100 + 6 * np.sin(xx / 15 + phase)
        tex[floor] = np.array((175, 155, 105), np.float32) + 8 * rng.normal(size=(int(floor.sum()), 1))
    return np.clip(tex, 0, 255)


def _box_blur(img: np.ndarray, factor: int) -> np.ndarray:
    size = img.shape[0]
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    small = pil.resize((size // factor, size // factor), Image.BOX)
    return np.asarray(small.resize((size, size), Image.BILINEAR), dtype=np.float32)


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


def stylise_background(tex: np.ndarray, style: str, rng: np.random.Generator) -> np.ndarray:
    """The background as each domain draws it; it stays recognisable in every style."""
    if style == "photo":
        return tex
    if style == "cartoon":
        return np.round(_box_blur(tex, max(1, tex.shape[0] // 16)) / 28.0) * 28.0
    if style == "origami":
        out = 0.7 * _box_blur(tex, max(1, tex.shape[0] // 32)) + 0.3 * PAPER_RGB
        size = tex.shape[0]
        yy, xx = np.mgrid[0:size, 0:size]
        off = rng.integers(0, size)
        creases = ((xx + yy + off) % (size // 2)) < 1
        out[creases] *= 0.85
        return out
    if style == "toy":
        blurred = _box_blur(tex, max(1, tex.shape[0] // 16))
        grey = _luma(blurred)[..., None]
        return np.clip(grey + 1.25 * (blurred - grey), 0, 255)
    if style == "sculpture":
        grey = _luma(tex)[..., None]
        return np.clip(0.6 * grey + 30, 0, 255) * np.array([1.0, 0.97, 0.92], dtype=np.float32)
    raise ValueError(f"unknown style {style!r}")


# --------------------------------------------------------------------------- objects

# Sculptures are painted stone: this share of the object's colour shows through the stone (fixed at
# one half before any measurement). Bare stone grey showed a colour only as a shade of grey, while
# every text named it.
SCULPTURE_PAINT = 0.5


def paints_sculptures(scene: Scene) -> bool:
    """Whether ``scene``'s sculpture objects are painted: scenes with details or a theme (every
    sampled scene carries 2-3 details); a hand-built bare scene keeps bare stone grey."""
    return scene.has_scene_extras()


def _shading_field(size: int, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """-1 on the lit side of the object, +1 on the far side (roughly)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    return np.clip(((xx - cx) * math.cos(angle) + (yy - cy) * math.sin(angle)) / r, -1.5, 1.5)


def _draw_object(canvas: np.ndarray, obj: ToyObject, style: str, geom: tuple[float, float, float, float],
                 light: tuple[float, float], rng: random.Random, painted: bool = False) -> np.ndarray:
    """Composite one object onto ``canvas`` (in place); returns its coverage mask (size, size).

    ``painted``: a sculpture's object is painted stone (``SCULPTURE_PAINT`` of the object's colour
    shows through the stone) rather than bare stone grey."""
    size = canvas.shape[0]
    cx, cy, r, rot = geom
    light_angle, light_strength = light
    shape_pts = unit_polygon(obj.shape)
    if style == "origami" and obj.shape in ("circle", "heart"):
        shape_pts = shape_pts[:: max(1, len(shape_pts) // 10)]  # paper folds have straight edges
    pts = _place(shape_pts, cx, cy, r, rot)
    mask = _polygon_mask(pts, size)
    base = np.array(COLOUR_RGB[obj.colour], dtype=np.float32)
    # The light comes from light_angle; the lit side is at -field.
    field = _shading_field(size, cx, cy, r, light_angle + math.pi)

    if style in ("photo", "toy", "sculpture"):
        dx, dy = -math.cos(light_angle) * 0.15 * r, -math.sin(light_angle) * 0.15 * r
        shadow = _polygon_mask([(x + dx, y + dy) for x, y in pts], size)
        canvas *= (1 - 0.35 * shadow * (1 - mask))[..., None]

    if style == "photo":
        colour = base[None, None, :] * (1 - 0.5 * light_strength * field)[..., None]
    elif style == "cartoon":
        colour = np.clip(base * 1.05, 0, 255)[None, None, :] * np.ones((size, size, 1), np.float32)
    elif style == "origami":
        colour = np.broadcast_to(base, (size, size, 3)).copy()  # facet edges fall back to the base
        centre = (cx, cy)
        for k in range(len(pts)):
            facet = _polygon_mask([centre, pts[k], pts[(k + 1) % len(pts)]], size) > 0.5
            mid = math.atan2((pts[k][1] + pts[(k + 1) % len(pts)][1]) / 2 - cy,
                             (pts[k][0] + pts[(k + 1) % len(pts)][0]) / 2 - cx)
            factor = 1.0 + 0.2 * math.cos(mid - light_angle) + rng.uniform(-0.05, 0.05)
            colour[facet] = np.clip(base * factor, 0, 255)
    elif style == "toy":
        sat = np.clip(_luma(base) + 1.3 * (base - _luma(base)), 0, 255)
        hx, hy = cx + math.cos(light_angle) * 0.4 * r, cy + math.sin(light_angle) * 0.4 * r
        yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
        dist = np.sqrt((xx - hx) ** 2 + (yy - hy) ** 2) / r
        colour = sat[None, None, :] * np.clip(1.2 - 0.35 * dist, 0.6, 1.2)[..., None]
        spec = np.clip(1 - dist / 0.3, 0, 1)[..., None]
        colour = colour * (1 - 0.8 * spec) + 255 * 0.8 * spec
    elif style == "sculpture":
        grey = 120 + 0.3 * _luma(base)
        stone = grey * np.array([1.0, 0.97, 0.92], dtype=np.float32)
        if painted:
            stone = (1 - SCULPTURE_PAINT) * stone + SCULPTURE_PAINT * base
        relief = 1 - 0.6 * light_strength * field
        colour = stone[None, None, :] * relief[..., None]
    else:
        raise ValueError(f"unknown style {style!r}")

    m = mask[..., None]
    canvas[:] = canvas * (1 - m) + np.clip(colour, 0, 255) * m
    if style in ("cartoon", "origami"):
        def draw_lines(draw: ImageDraw.ImageDraw, k: int) -> None:
            scaled = [(x * k, y * k) for x, y in pts]
            draw.polygon(scaled, outline=255, width=(3 if style == "cartoon" else 1) * k // 2 + 1)
            if style == "origami":  # crease lines from the centre
                for p in scaled[:: max(1, len(scaled) // 5)]:
                    draw.line([(cx * k, cy * k), p], fill=255, width=1)
        line = _line_mask(draw_lines, size)[..., None]
        ink = 0.0 if style == "cartoon" else 0.7
        canvas[:] = canvas * (1 - line) + (canvas * ink) * line
    return mask


def _draw_clutter(canvas: np.ndarray, rng: random.Random, count: int) -> None:
    """Small unnamed items: pebbles, leaves, specks. No caption ever mentions them."""
    img = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    size = canvas.shape[0]
    unit = size / 128.0  # clutter sizes are given for a 128-px image
    for _ in range(count):
        kind = rng.choice(("pebble", "leaf", "speck"))
        x, y = rng.uniform(0, size), rng.uniform(0, size)
        if kind == "pebble":
            rr = rng.uniform(2, 4.5) * unit
            g = rng.randint(90, 170)
            draw.ellipse([x - rr, y - 0.7 * rr, x + rr, y + 0.7 * rr], fill=(g, g - 10, g - 25))
        elif kind == "leaf":
            rr = rng.uniform(2.5, 5) * unit
            col = rng.choice(((60, 120, 40), (150, 120, 40), (120, 70, 30)))
            draw.ellipse([x - rr, y - 0.4 * rr, x + rr, y + 0.4 * rr], fill=col)
        else:
            rr = max(0.6, rng.uniform(0.8, 1.8) * unit)
            g = rng.choice((20, 235))
            draw.ellipse([x - rr, y - rr, x + rr, y + rr], fill=(g, g, g))
    canvas[:] = np.asarray(img, dtype=np.float32)


# ---------------------------------------------------------------------------- scenes

NOISE_SIGMA = {"photo": (2.0, 8.0), "cartoon": (0.0, 1.5), "origami": (1.0, 3.0), "toy": (1.0, 3.0),
               "sculpture": (3.0, 6.0)}


class _NuisanceStreams:
    """Where each nuisance draws its randomness from.

    Default (``per_part=False``): one shared sequence, in drawing order (the renderer's
    historical behaviour; every cached image depends on it). ``per_part=True``: each part
    of the photograph (light, background, clutter, each object by ``oid``, camera, noise)
    has its own stream derived from the seed, so two scenes that differ in one attribute,
    rendered with the same seed, differ only where that attribute shows (the pair probe).
    """

    def __init__(self, nuisance_seed: int, per_part: bool) -> None:
        self.seed, self.per_part = nuisance_seed, per_part
        self._py = random.Random(nuisance_seed)
        self._np = np.random.default_rng(self._py.getrandbits(63))

    def py(self, part: str) -> random.Random:
        return random.Random(derive_seed("nuisance", self.seed, part)) if self.per_part else self._py

    def np(self, part: str) -> np.random.Generator:
        return np.random.default_rng(derive_seed("nuisance", self.seed, part)) if self.per_part else self._np


def render_scene(scene: Scene, nuisance_seed: int, size: int = IMAGE_SIZE, per_part: bool = False) -> RenderedScene:
    """Draw ``scene``; every nuisance comes from ``nuisance_seed``.

    ``per_part=True`` draws each part's nuisance from its own stream (see
    :class:`_NuisanceStreams`): an edited scene then differs from the original, pixel for
    pixel, only where the edit shows. The default keeps the one shared stream.
    Returns the (size, size, 3) uint8 image with each object's visible mask and box.
    """
    streams = _NuisanceStreams(nuisance_seed, per_part)
    rng = streams.py("light")
    big = size
    light = (rng.uniform(0, 2 * math.pi), rng.uniform(0.15, 0.45))
    texture = background_texture(scene.background, streams.np("background"), big)
    canvas = stylise_background(texture, scene.style, streams.np("style")).astype(np.float32)
    rng = streams.py("clutter")
    _draw_clutter(canvas, rng, rng.randint(0, 4))
    if scene.details:  # a scene without details draws nothing more from its streams
        draw_details(canvas, scene.details, streams.py("details"))
    if scene.decor:
        draw_decor(canvas, scene.decor, streams.py("decor"))

    # Large objects first, so small ones stay visible on top.
    order = sorted(scene.objects, key=lambda o: (o.size != "large", o.oid))
    painted = paints_sculptures(scene)
    masks: dict[int, np.ndarray] = {}
    for obj in order:
        rng = streams.py(f"object{obj.oid}")
        fx, fy = CELL_CENTRES[obj.position]
        geom = (
            (fx + rng.uniform(-0.05, 0.05)) * big,
            (fy + rng.uniform(-0.05, 0.05)) * big,
            RADIUS[obj.size] * rng.uniform(0.88, 1.12) * big,
            0.0 if obj.shape == "circle" else math.radians(rng.uniform(-25, 25)),
        )
        mask = _draw_object(canvas, obj, scene.style, geom, light, rng, painted=painted)
        for oid in masks:  # later objects occlude earlier ones
            masks[oid] = masks[oid] * (1 - mask)
        masks[obj.oid] = mask

    # Camera: exposure, contrast, white balance, sensor noise.
    rng = streams.py("camera")
    brightness, contrast = rng.uniform(0.85, 1.15), rng.uniform(0.85, 1.15)
    gains = np.array([rng.uniform(0.94, 1.06) for _ in range(3)], dtype=np.float32)
    canvas = (canvas - 128) * contrast + 128
    canvas = canvas * brightness * gains[None, None, :]
    if scene.theme is not None:  # the theme's colour cast (no random draws)
        canvas = canvas * np.array(THEME_CAST[scene.theme], dtype=np.float32)[None, None, :]
    lo, hi = NOISE_SIGMA[scene.style]
    canvas += streams.np("noise").normal(scale=rng.uniform(lo, hi), size=canvas.shape)

    image = np.clip(canvas, 0, 255).round().astype(np.uint8)
    small_masks, boxes = {}, {}
    for oid, m in masks.items():
        sm = m >= 0.5
        small_masks[oid] = sm
        ys, xs = np.nonzero(sm)
        boxes[oid] = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1) if len(xs) else (0, 0, 0, 0)
    return RenderedScene(image, small_masks, boxes)


def render_image(scene: Scene, nuisance_seed: int, size: int = IMAGE_SIZE, per_part: bool = False) -> Image.Image:
    """Just the PIL image of :func:`render_scene`."""
    return render_scene(scene, nuisance_seed, size, per_part).pil()


def save_png(image: np.ndarray, path: Path) -> None:
    """Write an (H, W, 3) uint8 image as PNG, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format="PNG")
