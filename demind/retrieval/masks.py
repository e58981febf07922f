"""COCO instance masks without pycocotools: polygons and (compressed or plain) RLE.

pycocotools is not a dependency: COCO query construction needs only ``annToMask``,
which is three small decoders. Polygons are rasterised with PIL, which may differ from
pycocotools on boundary pixels (their rasteriser samples at a 5x upscale); interiors agree.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from demind.errors import InputError


def rle_counts_from_string(s: str) -> list[int]:
    """Decode COCO's compressed RLE string (pycocotools ``rleFrString``) to run lengths.

    Each count is stored in 5-bit groups as characters offset by 48; from the third count
    on, the value is a delta to the count two places before.
    """
    counts: list[int] = []
    pos = 0
    while pos < len(s):
        value, shift, more = 0, 0, True
        while more:
            c = ord(s[pos]) - 48
            value |= (c & 0x1F) << (5 * shift)
            more = bool(c & 0x20)
            pos += 1
            shift += 1
            if not more and (c & 0x10):
                value |= -1 << (5 * shift)  # sign-extend a negative delta
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
    return counts


def rle_to_mask(counts: list[int], height: int, width: int) -> np.ndarray:
    """Run lengths (alternating 0s and 1s, starting with 0s, column-major) -> (H, W) uint8."""
    flat = np.zeros(height * width, dtype=np.uint8)
    pos, value = 0, 0
    for run in counts:
        if value:
            flat[pos : pos + run] = 1
        pos += run
        value ^= 1
    if pos != height * width:
        raise InputError(f"RLE covers {pos} pixels, expected {height}x{width}={height * width}")
    return flat.reshape(width, height).T.copy()  # COCO RLE runs down columns


def polygons_to_mask(polygons: list[list[float]], height: int, width: int) -> np.ndarray:
    """COCO polygons ``[[x1, y1, x2, y2, ...], ...]`` -> (H, W) uint8 union mask."""
    canvas = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(canvas)
    for poly in polygons:
        if len(poly) >= 6:
            draw.polygon([(float(poly[i]), float(poly[i + 1])) for i in range(0, len(poly) - 1, 2)], fill=1)
    return np.asarray(canvas, dtype=np.uint8).copy()


def decode_segmentation(segmentation: Any, height: int, width: int) -> np.ndarray:
    """Any COCO ``segmentation`` field -> (H, W) uint8 mask with values 0/1.

    ``height``/``width`` are the decoded image's size; an RLE's own ``size`` must match it.
    """
    if isinstance(segmentation, list):
        return polygons_to_mask(segmentation, height, width)
    if isinstance(segmentation, dict) and "counts" in segmentation:
        rle_h, rle_w = segmentation.get("size", (height, width))
        if (rle_h, rle_w) != (height, width):
            raise InputError(f"RLE of size {rle_h}x{rle_w} does not fit an image of {height}x{width}")
        counts = segmentation["counts"]
        if isinstance(counts, (bytes, str)):
            counts = rle_counts_from_string(counts.decode() if isinstance(counts, bytes) else counts)
        return rle_to_mask(list(counts), height, width)
    raise InputError(f"unknown COCO segmentation format: {type(segmentation).__name__}")
