"""What a theme adds to a picture (its decor) and the redundant details on the border strips.

Both are drawn on the background, behind the objects, by :func:`toyworld.render.render_scene`.
"""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image, ImageDraw

from .world import DETAIL_SLOTS, Detail


DECOR_COLOURS = {"leaf": ((225, 115, 30), (200, 60, 30), (235, 185, 40)),
                 "bulb": ((230, 40, 40), (40, 200, 70), (245, 210, 40), (60, 110, 240)),
                 "confetti": ((240, 60, 60), (60, 200, 90), (250, 220, 50), (70, 120, 250), (240, 120, 220))}


def draw_decor(canvas: np.ndarray, decor: tuple[str, ...], rng: random.Random) -> None:
    """A theme's added objects, over the background and behind the objects (in place).
    Where each item falls is nuisance (``rng``); which items there are is the scene's."""
    img = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    size = canvas.shape[0]
    u = size / 128.0  # sizes given for a 128-px image
    for name in decor:
        if name == "falling leaves":
            for _ in range(rng.randint(7, 10)):
                x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(3, 5) * u
                draw.ellipse([x - r, y - 0.45 * r, x + r, y + 0.45 * r], fill=rng.choice(DECOR_COLOURS["leaf"]))
        elif name == "snowflakes":
            for _ in range(rng.randint(8, 12)):
                x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(2.5, 4.5) * u
                for a in (0, math.pi / 3, 2 * math.pi / 3):
                    dx, dy = r * math.cos(a), r * math.sin(a)
                    draw.line([x - dx, y - dy, x + dx, y + dy], fill=(250, 252, 255), width=max(1, round(u)))
        elif name == "a moon":
            x, y, r = rng.uniform(0.15, 0.85) * size, rng.uniform(0.08, 0.25) * size, rng.uniform(8, 10) * u
            draw.ellipse([x - r, y - r, x + r, y + r], fill=(248, 242, 200))
            draw.ellipse([x - 0.4 * r, y - 1.1 * r, x + 1.4 * r, y + 0.7 * r], fill=(26, 32, 70))  # crescent
        elif name == "stars":
            for _ in range(rng.randint(6, 9)):
                x, y, r = rng.uniform(0, size), rng.uniform(0, 0.6 * size), rng.uniform(1.5, 2.5) * u
                draw.polygon([(x, y - 2 * r), (x + 0.5 * r, y), (x, y + 2 * r), (x - 0.5 * r, y)], fill=(255, 250, 215))
                draw.polygon([(x - 2 * r, y), (x, y + 0.5 * r), (x + 2 * r, y), (x, y - 0.5 * r)], fill=(255, 250, 215))
        elif name == "bubbles":
            for _ in range(rng.randint(6, 9)):
                x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(2, 4.5) * u
                draw.ellipse([x - r, y - r, x + r, y + r], outline=(205, 235, 255), width=max(1, round(u)))
        elif name == "seaweed":
            for _ in range(rng.randint(2, 3)):
                x0, h = rng.uniform(0.05, 0.95) * size, rng.uniform(0.3, 0.5) * size
                pts = [(x0 + 4 * u * math.sin(k * 0.9 + x0), size - k * h / 8) for k in range(9)]
                draw.line(pts, fill=(40, 145, 70), width=max(1, round(3 * u)))
        elif name == "string lights":
            y0, sag = rng.uniform(0.06, 0.14) * size, rng.uniform(0.04, 0.08) * size
            pts = [(k * size / 8, y0 + sag * math.sin(math.pi * k / 8)) for k in range(9)]
            draw.line(pts, fill=(40, 40, 40), width=max(1, round(u)))
            for k, (x, y) in enumerate(pts[1:-1]):
                r = 2.5 * u
                draw.ellipse([x - r, y, x + r, y + 2 * r], fill=DECOR_COLOURS["bulb"][k % 4])
        elif name == "confetti":
            for _ in range(rng.randint(12, 18)):
                x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(1.2, 2.2) * u
                draw.rectangle([x - r, y - 0.5 * r, x + r, y + 0.5 * r], fill=rng.choice(DECOR_COLOURS["confetti"]))
        else:
            raise ValueError(f"unknown decor {name!r}")
    canvas[:] = np.asarray(img, dtype=np.float32)


DETAIL_TONES = {"fence": ((120, 80, 45), (235, 232, 225), (90, 90, 95)),
                "cloud": ((248, 248, 250), (205, 208, 215), (235, 225, 230)),
                "flower": ((240, 110, 170), (250, 250, 245), (250, 200, 40)),
                "rock": ((125, 120, 115), (95, 90, 85), (160, 150, 135)),
                "tree": ((40, 120, 45), (80, 140, 40), (30, 90, 50)),
                "lamp": ((250, 225, 120), (255, 245, 200), (250, 180, 90)),
                "sign": ((200, 40, 40), (40, 90, 200), (240, 200, 40)),
                "ball": ((230, 60, 60), (60, 110, 230), (245, 245, 245))}


def draw_details(canvas: np.ndarray, details: tuple[Detail, ...], rng: random.Random) -> None:
    """Redundant detail: small items in the border strips, behind the objects (in
    place). Kind, slot and tone are the scene's; a small jitter is nuisance (``rng``)."""
    img = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    size = canvas.shape[0]
    u = size / 128.0
    for d in details:
        x = (0.1 + 0.8 * d.slot / (DETAIL_SLOTS - 1)) * size + rng.uniform(-3, 3) * u
        y = (0.1 if d.kind == "cloud" else 0.9) * size + rng.uniform(-2, 2) * u
        tone = DETAIL_TONES[d.kind][d.tone]
        w = max(1, round(2 * u))
        if d.kind == "fence":
            for k in (-1, 0, 1):
                draw.line([x + 7 * k * u, y - 7 * u, x + 7 * k * u, y + 7 * u], fill=tone, width=w)
            for dy in (-3, 3):
                draw.line([x - 9 * u, y + dy * u, x + 9 * u, y + dy * u], fill=tone, width=w)
        elif d.kind == "cloud":
            for dx, r in ((-6, 5), (0, 7), (6, 5)):
                draw.ellipse([x + (dx - r) * u, y - r * u, x + (dx + r) * u, y + 0.6 * r * u], fill=tone)
        elif d.kind == "flower":
            draw.line([x, y, x, y + 8 * u], fill=(50, 130, 50), width=w)
            for k in range(5):
                a = 2 * math.pi * k / 5
                px, py = x + 3.5 * u * math.cos(a), y + 3.5 * u * math.sin(a)
                draw.ellipse([px - 2.5 * u, py - 2.5 * u, px + 2.5 * u, py + 2.5 * u], fill=tone)
            draw.ellipse([x - 2 * u, y - 2 * u, x + 2 * u, y + 2 * u], fill=(250, 210, 60))
        elif d.kind == "rock":
            draw.ellipse([x - 8 * u, y - 4 * u, x + 8 * u, y + 6 * u], fill=tone)
        elif d.kind == "tree":
            draw.rectangle([x - 1.5 * u, y, x + 1.5 * u, y + 9 * u], fill=(110, 70, 35))
            draw.polygon([(x, y - 11 * u), (x + 7 * u, y + 2 * u), (x - 7 * u, y + 2 * u)], fill=tone)
        elif d.kind == "lamp":
            draw.line([x, y - 8 * u, x, y + 9 * u], fill=(60, 60, 65), width=w)
            draw.ellipse([x - 3.5 * u, y - 12 * u, x + 3.5 * u, y - 5 * u], fill=tone)
        elif d.kind == "sign":
            draw.line([x, y - 2 * u, x, y + 9 * u], fill=(100, 75, 50), width=w)
            draw.rectangle([x - 6 * u, y - 8 * u, x + 6 * u, y - 1 * u], fill=tone)
        elif d.kind == "ball":
            draw.ellipse([x - 4.5 * u, y - 4.5 * u, x + 4.5 * u, y + 4.5 * u], fill=tone)
            draw.line([x - 4.5 * u, y, x + 4.5 * u, y], fill=(30, 30, 30), width=max(1, round(u)))
        else:
            raise ValueError(f"unknown detail {d.kind!r}")
    canvas[:] = np.asarray(img, dtype=np.float32)
