"""The captioned corpus pairs are mined from, found again by key: :func:`open_corpus`.

Pair shards and triplet shards hold corpus *keys*, never image bytes: a pair names two images
of a corpus that may hold a million (CC3M), each image in up to K pairs and H hard-negative lists,
so copying them would multiply the corpus on disk. Instead the pairs manifest records the corpus
(:func:`corpus_record`: its shard paths and a content digest) and :class:`Corpus` reads an image
or caption straight out of its input shard: an uncompressed tar member is a byte span
(:class:`demind.retrieval.ImageRef` with ``span``), decoded by the one decoder.

The digest is sha256 over each shard's file name, size and the sha256 of its stats file (the
done-marker every writer leaves; :func:`demind.features.shard_fingerprint`, the feature cache's
rule): cheap on a million images, and it changes whenever a shard is rewritten. A corpus given
to a later stage (generation, training) is compared by digest, so a moved corpus is accepted
and another one refused, naming both.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from demind.errors import InputError
from demind.features import shard_fingerprint
from demind.pairs.manifest import CorpusMismatchError, read_pairs_manifest
from demind.retrieval import ImageReadError, ImageRef, file_version, load_image
from demind.shard_format import CAPTION_FIELD, IMAGE_FIELDS, resolve_shards, shard_name


def corpus_record(spec: str, setting: str = "--input") -> dict[str, Any]:
    """What names a corpus: {"spec", "shards" (paths), "fingerprints", "digest"} for the shard
    list ``spec`` (a folder, a brace pattern; :func:`demind.shard_format.resolve_shards`)."""
    return shards_record(resolve_shards(spec, setting), spec)


def shards_record(shards: list[str], spec: str) -> dict[str, Any]:
    """:func:`corpus_record` of an already resolved shard list."""
    prints = [{"shard": Path(s).name, **shard_fingerprint(s)} for s in shards]
    digest = hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()
    return {"spec": str(spec), "shards": [str(s) for s in shards], "fingerprints": prints, "digest": digest}


def check_same_corpus(recorded: dict[str, Any], given: dict[str, Any], what: str, fix: str) -> None:
    """Refuse ``what`` (pairs or triplets) made from another corpus than ``given``, naming both."""
    if recorded.get("digest") != given.get("digest"):
        raise CorpusMismatchError(
            f"{what} were mined from corpus {recorded.get('spec')!r} (digest {str(recorded.get('digest'))[:12]}) "
            f"but the corpus given is {given.get('spec')!r} (digest {str(given.get('digest'))[:12]}); {fix}")


@dataclass(frozen=True)
class CorpusEntry:
    """Where one sample lives: its shard, the image member's (offset, length) and extension, the
    caption member's span (None when the sample has no caption)."""

    shard: str
    image: tuple[int, int] | None
    ext: str | None
    caption: tuple[int, int] | None


def index_shard(shard: str | Path) -> dict[str, CorpusEntry]:
    """key -> :class:`CorpusEntry` of one uncompressed tar shard (member headers only; no image is read).

    A member name splits at its first dot (WebDataset's rule): ``KEY.jpg``, ``KEY.txt``. A
    damaged tar keeps the members read before the damage."""
    members: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                base = info.name.rsplit("/", 1)[-1]
                key, _, field = base.partition(".")
                members.setdefault(key, {})[field.lower()] = (info.offset_data, info.size)
    except (tarfile.TarError, OSError):
        pass  # read what precedes the damage; the missing samples count as skipped where looked up
    out = {}
    for key, fields in members.items():
        ext = next((f for f in IMAGE_FIELDS if f in fields), None)
        out[key] = CorpusEntry(str(shard), fields.get(ext) if ext else None, ext, fields.get(CAPTION_FIELD))
    return out


class Corpus:
    """The images and captions of a corpus by key, read from its shards on demand.

    The index (key -> member spans) is built on first use from the tar headers, about 250 bytes
    a key (250 MB for a million images). ``lookup(key)`` -> (RGB PIL image, caption);
    :meth:`ref` gives the :class:`~demind.retrieval.ImageRef` the feature caches key by.
    Raises :class:`~demind.errors.InputError` for an unknown key and
    :class:`~demind.retrieval.ImageReadError` for an image that cannot be decoded."""

    def __init__(self, shards: list[str], record: dict[str, Any] | None = None):
        self.shards = [str(s) for s in shards]
        self.record = record
        self._index: dict[str, CorpusEntry] | None = None
        self._versions: dict[str, str] = {}

    @property
    def index(self) -> dict[str, CorpusEntry]:
        if self._index is None:
            self._index = {}
            for shard in self.shards:
                self._index.update(index_shard(shard))
        return self._index

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def entry(self, key: str) -> CorpusEntry:
        try:
            return self.index[key]
        except KeyError:
            where = self.record.get("spec") if self.record else ", ".join(map(shard_name, self.shards[:3]))
            raise InputError(f"key {key!r} is not in the corpus {where}; were the pairs mined from another "
                             f"corpus?") from None

    def ref(self, key: str) -> ImageRef:
        """The image of ``key`` as an ImageRef into its shard (decoded as a viewer shows it, EXIF
        orientation applied, as the feature cache and generation decode it)."""
        entry = self.entry(key)
        if entry.image is None:
            raise ImageReadError(f"sample {key!r} in {entry.shard} has no image member ({', '.join(IMAGE_FIELDS)})")
        if entry.shard not in self._versions:
            self._versions[entry.shard] = file_version(Path(entry.shard).stat())
        return ImageRef(key, Path(entry.shard), span=entry.image, version=self._versions[entry.shard], orient=True)

    def caption(self, key: str) -> str:
        """The caption (``KEY.txt``, T_ori) of ``key``; '' when the sample has none."""
        entry = self.entry(key)
        if entry.caption is None:
            return ""
        offset, length = entry.caption
        with open(entry.shard, "rb") as f:
            f.seek(offset)
            return f.read(length).decode("utf-8", errors="replace").strip()

    def image(self, key: str) -> Image.Image:
        """The RGB image of ``key`` (:func:`demind.retrieval.load_image`)."""
        return load_image(self.ref(key))

    def lookup(self, key: str) -> tuple[Image.Image, str]:
        """(RGB PIL image, caption) of ``key``."""
        return self.image(key), self.caption(key)

    __call__ = lookup


def open_corpus(manifest: dict[str, Any] | str | Path, corpus: str | None = None,
                setting: str = "corpus") -> Corpus:
    """The corpus a pairs manifest (``pairs_manifest.json``, its folder, or the loaded dict) was
    mined from, as a :class:`Corpus` whose ``lookup(key)`` gives (PIL image, caption).

    ``corpus``: where the corpus lies now, if it moved (a folder or brace pattern); it must hold the
    same content (digest), else :class:`CorpusMismatchError` naming both."""
    if not isinstance(manifest, dict):
        manifest = read_pairs_manifest(manifest)
    recorded = manifest["corpus"]
    if corpus:
        given = corpus_record(corpus, setting)
        check_same_corpus(recorded, given, "the pairs", f"point {setting} at the corpus the pairs were mined from")
        return Corpus(given["shards"], given)
    missing = [s for s in recorded["shards"] if not Path(s).is_file()]
    if missing:
        raise InputError(f"the corpus the pairs were mined from is not where the manifest says ({missing[0]} is "
                         f"missing); set {setting} to the folder where it lies now")
    check_same_corpus(recorded, shards_record(recorded["shards"], recorded["spec"]), "the pairs",
                      "its shards were rewritten since the pairs were mined; mine the pairs again")
    return Corpus(recorded["shards"], recorded)


Lookup = Callable[[str], tuple[Image.Image, str]]
