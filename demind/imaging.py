"""The one image decoder: bytes or a file -> an RGB PIL image, for every reader of the project.

Training data (:mod:`demind.data`), generation ingest and reader (:mod:`demind.gen`), the
evaluation and exclusion benchmarks, the search index, search references and the page's
uploads all decode through :func:`decode_image`; nothing else in ``demind/`` calls
``Image.open``. What differs between uses is an explicit argument, not separate code:

* ``orient``: apply the EXIF orientation tag (how phones store portrait photos), as every
  image viewer does. On for a user's own images (search, generation inputs, training
  shards); off for benchmark protocols, whose reference code decodes with
  ``Image.open(path).convert("RGB")`` and so never rotates (see docs/evaluation.md).
* ``max_side``: shrink (never enlarge) so that the longer side is at most this, decoding a large
  JPEG at a reduced scale first (generation inputs).
* ``max_pixels``: refuse an image larger than this from its header, before decoding any pixel
  (the page's uploads).

Whether ``orient`` changes an image at all is read from its header by
:func:`orientation_changes_pixels` (a cache of features decoded without orientation stays valid
for every image it does not change).

Every mode reaches 8-bit RGB by scaling, not clipping: a 16-bit greyscale PNG (``I;16``) is
divided down to 8 bits (Pillow's ``convert("RGB")`` clips it to near white); transparency is
composited on white; a multi-frame file (GIF, TIFF, APNG) gives its first frame.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
# Pillow's integer / float single-channel modes of more than 8 bits, and their full-scale values.
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
# What Pillow decodes that the project accepts from a user's folder (the search index names and
# counts everything else as skipped).
DECODABLE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

ImageSource = str | Path | bytes | bytearray | BinaryIO


class ImageDecodeError(ValueError):
    """Bytes or a file that do not decode to an image; the message is the decoder's, without
    object reprs. Callers wrap it in their own user error naming the file and the fix."""


class ImageTooLargeError(ImageDecodeError):
    """An image over ``max_pixels`` (or over Pillow's own decompression-bomb limit, then with no
    size), refused from its header before any pixel is decoded."""

    def __init__(self, message: str, width: int | None = None, height: int | None = None) -> None:
        super().__init__(message)
        self.width, self.height = width, height


def decode_image(source: ImageSource, *, orient: bool = False, max_side: int | None = None,
                 max_pixels: int | None = None) -> Image.Image:
    """Decode ``source`` (a path, bytes or a binary file object) to an 8-bit RGB image.

    Returns a loaded ``Image`` in mode RGB. Raises :class:`ImageDecodeError` (or its subclass
    :class:`ImageTooLargeError`) with the decoder's message when it is not a readable image;
    ``OSError`` of opening a missing or unreadable *path* is left to the caller, who names it.
    """
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        source = open(source, "rb")  # noqa: SIM115 -- closed below; a missing file raises OSError here
    try:
        with source, Image.open(source) as img:
            if max_pixels is not None and img.width * img.height > max_pixels:
                raise ImageTooLargeError(f"{img.width} x {img.height} pixels "
                                         f"({img.width * img.height / 1e6:.0f} megapixels); the limit is "
                                         f"{max_pixels / 1e6:g} megapixels", img.width, img.height)
            if max_side is not None and img.format == "JPEG" and max(img.size) >= 2 * max_side:
                # decode a large JPEG at 1/2, 1/4 or 1/8 scale (never below the target): much cheaper
                img.draft("RGB", shrunk_size(img.size, max_side))
            img.seek(0)  # multi-frame files: the first frame (what a thumbnail shows)
            img.load()
            rgb = to_rgb(ImageOps.exif_transpose(img) if orient else img)
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as e:  # beyond Pillow's own limit: refused by Image.open
        raise ImageTooLargeError(decoder_message(e)) from None
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ImageDecodeError(decoder_message(e)) from None
    return resize_longest_side(rgb, max_side) if max_side is not None else rgb


# EXIF orientations that ``ImageOps.exif_transpose`` turns into a flip or rotation; any other value
# (1 = normal, or a value outside 1..8) leaves the pixels as stored.
TRANSPOSING_ORIENTATIONS = frozenset(range(2, 9))
EXIF_ORIENTATION = 0x0112
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # where Pillow finds EXIF and XMP in a PNG


def orientation_changes_pixels(source: ImageSource) -> bool:
    """Whether ``decode_image(source, orient=True)`` may give other pixels than ``orient=False``.

    True when the file's EXIF (or XMP) orientation is a flip or rotation (2..8); False when it has
    no orientation or 1 (normal), which is what nearly every image holds, and then both decode to
    the same pixels. (A TIFF is turned upright by Pillow itself, with or without ``orient``; True
    for it too, as decoders before Pillow 13 did not.) Read from the header
    alone (``Image.open`` is lazy): no pixel is decoded, except in a PNG whose metadata chunks
    follow its pixel data, where Pillow finds them only by decoding. A source that cannot be
    opened or parsed answers True, so that its caller takes the ordinary decode path, which
    reports (or skips) it as it reports any unreadable image.
    """
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    try:
        if isinstance(source, (str, Path)):
            source = open(source, "rb")  # noqa: SIM115 -- closed by the with below
        with source, Image.open(source) as img:
            if img.format == "PNG" and not _png_metadata_after_pixels(source):
                # PngImageFile.getexif decodes the image to look past its pixel data; every
                # metadata chunk sits before it here, and Image.open has parsed those into info
                exif = Image.Image.getexif(img)
            else:
                exif = img.getexif()
            return exif.get(EXIF_ORIENTATION, 1) in TRANSPOSING_ORIENTATIONS
    except Exception:  # PIL raises many types; OSError for a missing file: decoding will name it
        return True


def _png_metadata_after_pixels(file: BinaryIO) -> bool:
    """Whether a PNG holds an EXIF or text chunk after its first IDAT (chunk headers read, data skipped)."""
    file.seek(0)
    if file.read(8) != _PNG_SIGNATURE:
        return True  # not a plain PNG: let Pillow's own reading decide
    after_pixels = False
    while len(header := file.read(8)) == 8:
        length, kind = int.from_bytes(header[:4], "big"), header[4:]
        if kind == b"IEND":
            return False
        after_pixels = after_pixels or kind == b"IDAT"
        if after_pixels and kind in _PNG_METADATA:
            return True
        file.seek(length + 4, io.SEEK_CUR)  # the data and its CRC
    return False


def to_rgb(image: Image.Image) -> Image.Image:
    """A decoded image as 8-bit RGB: wide modes scaled, transparency composited on white.

    Dropping the alpha channel would show whatever colour the file keeps under transparent
    pixels (often black, sometimes a hidden drawing); a white background is what a viewer shows."""
    if image.mode in WIDE_MODES:
        image = _wide_to_8bit(image)
    if image.mode not in ALPHA_MODES and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _wide_to_8bit(image: Image.Image) -> Image.Image:
    """A 16/32-bit integer or float single-channel image scaled to mode L.

    16-bit modes (and PNG's 16-bit greyscale, which Pillow may open as ``I``) span 0..65535;
    a float image spans 0..1 when its values stay in it, else 0..255 (clipped)."""
    values = np.asarray(image).astype(np.float64)
    if image.mode == "F":
        scale = 255.0 if values.size and values.max() <= 1.0 else 1.0
    elif image.mode == "I" and values.size and values.max() <= 255:
        scale = 1.0  # an 8-bit image stored as 32-bit integers
    else:
        scale = 255.0 / 65535.0
    return Image.fromarray(np.clip(np.rint(values * scale), 0, 255).astype(np.uint8), mode="L")


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def decoder_message(exc: BaseException) -> str:
    """``UnidentifiedImageError: cannot identify image file``: the decoder's message without the
    in-memory file object's repr (``<_io.BytesIO object at 0x…>``), which tells a user nothing."""
    text = _OBJECT_REPR.sub("", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def resize_longest_side(img: Image.Image, max_side: int) -> Image.Image:
    """Shrink keeping the aspect ratio (never enlarge) so that max(width, height) <= max_side."""
    new_size = shrunk_size(img.size, max_side)
    if new_size == img.size:
        return img
    return img.resize(new_size, Image.Resampling.BICUBIC)


def shrunk_size(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    """(width, height) scaled so the longer side is at most ``max_side`` (unchanged when it is)."""
    width, height = size
    longest = max(width, height)
    if longest <= max_side:
        return size
    scale = max_side / longest
    return max(1, round(width * scale)), max(1, round(height * scale))
