"""The digest memo: a file's sha256 and an image's pixel digest, remembered by path and
:func:`demind.io.file_version` in ``<store>/digests.jsonl`` (:class:`DigestMemo`), and the digests the keys
of :mod:`demind.mllm.store` are made of (its docstring's "Digests are remembered" says why).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from PIL import Image

from demind.io import file_version, reporting_output_errors, write_text_atomic
from demind.mllm.store_upgrade import warn_earlier_digests

log = logging.getLogger(__name__)

DIGEST_FORMAT = "demind-digests/2"  # a digests.jsonl line keyed by demind.io.file_version
LARGE_FILE = 1 << 28  # bytes: reading a file this large to hash it is said in the log


def sha_of(value: Any) -> str:
    """sha256 of a JSON value (keys sorted): the hash of a key's ingredients."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def pixel_digest(picture: Image.Image) -> str:
    """sha256 of decoded pixels (mode and size included): the same image in another file, format or
    folder has the same digest; a changed pixel changes it."""
    digest = hashlib.sha256(f"{picture.mode}:{picture.size[0]}x{picture.size[1]}:".encode())
    digest.update(picture.tobytes())
    return digest.hexdigest()


def text_digest(*texts: str) -> str:
    """sha256 of prompt texts (a kind's prompt files, in order)."""
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()


class DigestMemo:
    """File and pixel digests remembered by path and :func:`demind.io.file_version` (size, mtime,
    ctime, inode), in memory and, with a ``path``, appended to a JSON-lines file shared by every
    process using the store (a torn or foreign line is ignored: the digest is computed again).

    ``trusted`` False (``DEMIND_REHASH=1``, read by the commands) reads every file again: for a file
    system that keeps no change time or inode (FAT, some network mounts) after an edit that put the
    modification time back."""

    trusted = True

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._known: dict[str, str] = {}
        self._new: list[dict[str, Any]] = []
        self._earlier = 0  # lines of the older rule (size and mtime only): dropped at the next save
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    if entry.get("format") != DIGEST_FORMAT:
                        self._earlier += 1
                        continue
                    self._known[entry["memo"]] = entry["sha256"]
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    continue
            warn_earlier_digests(path, self._earlier)

    @staticmethod
    def _memo_key(what: str, path: Path, extra: Any = None) -> str:
        return sha_of([what, str(path.resolve()), file_version(path.stat()), extra])

    def _recall(self, memo: str) -> str | None:
        return self._known.get(memo) if self.trusted else None

    def _remember(self, memo: str, digest: str) -> str:
        self._known[memo] = digest
        self._new.append({"format": DIGEST_FORMAT, "memo": memo, "sha256": digest})
        return digest

    def file(self, path: Path) -> str:
        """sha256 of the file's bytes."""
        from demind.identity import file_sha256

        memo = self._memo_key("file", path)
        known = self._recall(memo)
        if known is not None:
            return known
        size = path.stat().st_size
        if size >= LARGE_FILE:
            log.info("reading %s (%.1f GB) once to key stored answers by the model's content; its digest is "
                     "remembered by size, times and inode in %s", path, size / 1e9, self.path or "memory")
        return self._remember(memo, file_sha256(path))

    def pixels(self, ref: Any) -> str:
        """:func:`pixel_digest` of an :class:`~demind.retrieval.ImageRef` as :func:`demind.retrieval.load_image`
        decodes it (orientation, mask and crop applied; the describers' resize is a setting)."""
        from demind.retrieval import load_image

        seg = sha_of(ref.segmentation) if ref.segmentation is not None else None
        try:
            memo = self._memo_key("pixels", Path(ref.path), [ref.span, ref.box, seg, ref.orient])
        except OSError:  # a missing or unreadable file: load_image's one error naming it
            return pixel_digest(load_image(ref))
        return self._recall(memo) or self._remember(memo, pixel_digest(load_image(ref)))

    def save(self) -> None:
        """Append the digests computed since the last save (nothing without a path)."""
        if self.path is None or not self._new:
            return
        if self._earlier:  # written again without the older rule's lines (they would only be counted again)
            entries = [{"format": DIGEST_FORMAT, "memo": m, "sha256": d} for m, d in self._known.items()]
            write_text_atomic(self.path, "".join(json.dumps(e) + "\n" for e in entries))
            self._earlier, self._new = 0, []
            return
        lines = "".join(json.dumps(e) + "\n" for e in self._new)
        with reporting_output_errors(self.path), self.path.open("a", encoding="utf-8") as f:
            f.write(lines)
        self._new = []
