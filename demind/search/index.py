"""A searchable gallery index: every image under a folder, encoded once by a frozen backbone.

Layout of an index folder::

    backbone.json            backbone identity, slug and precision (written first, checked on every rerun)
    embeddings/part-*        (n, D) L2-normalised rows, float16 (.safetensors, exactly the part's rows) and
                             their names and per-file keys (.json, written last, read only by the builder):
                             entries of the one embedding cache (:mod:`demind.embedding_cache`)
    index.json               the parts in row order, the names once in row order, unreadable files
                             (written last); search memory-maps the listed parts and reads no record

An index of an earlier layout still opens (read by :mod:`demind.search.index_upgrade`), and the next
``demind-index`` run rewrites it in this one.

Images are the image files under the folder and the image members of the uncompressed tar
shards under it (WebDataset / img2dataset shards, read in place: ``00000.tar/KEY.jpg``). A
file's key is its relative path, size and modification time (a shard member's: its shard's),
so a rerun encodes only new or changed files and drops removed ones. Parts are written every ``part_size`` images; a killed
build keeps them and the rerun resumes. ``index.json`` is the done-marker: a folder without it
is an unfinished build that search refuses to load. A gallery that outgrows one machine:
:mod:`demind.search.ray_index` encodes the missing images on a Ray cluster into the same parts.
"""

from __future__ import annotations

import logging
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from demind.backbone import FrozenCLIP
from demind.errors import InputError
from demind.embedding_cache import cache_identity, cache_slug, check_backbone, map_tensor, with_precision
from demind.imaging import DECODABLE_EXTENSIONS
from demind.io import check_output_dir, read_json, write_json_atomic
from demind.retrieval import (DamagedPartError, ImageFeatureCache, ImageRef, adopt_unoriented, encode_image_refs,
                              file_version, is_earlier_part)
from demind.search.index_manifest import (
    INDEX_FORMAT, MANIFEST, GalleryIndexError, previous_manifest, read_manifest, rebuild_advice, recorded_root)
from demind.search.index_upgrade import load_earlier_rows
from demind.shard_format import SHARD_SUFFIX

log = logging.getLogger(__name__)

STORED_DTYPE = "float16"  # measured: top-10 unchanged within float16 rounding (BENCHMARKS.md, search)
DTYPES = {"float16": torch.float16, "float32": torch.float32}
BACKBONE_FILE = "backbone.json"
ROLE = "embeddings"


@dataclass
class IndexBuildStats:
    """What one build or update did."""

    images: int = 0            # image files found under the folder
    indexed: int = 0           # images in the finished index
    cached: int = 0            # reused from an earlier (possibly killed) build
    encoded: int = 0           # encoded by this run
    removed: int = 0           # in the previous index, gone from the folder
    unreadable: dict[str, str] = field(default_factory=dict)  # name -> reason, not in the index
    skipped: dict[str, str] = field(default_factory=dict)  # files that are not images -> reason
    seconds: float = 0.0
    members: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # shard member -> (shard, offset, length)

    def as_dict(self) -> dict:
        return {"images": self.images, "indexed": self.indexed, "cached": self.cached,
                "encoded": self.encoded, "removed": self.removed, "unreadable": len(self.unreadable),
                "seconds": round(self.seconds, 2),
                "encoded_per_s": round(self.encoded / self.seconds, 1) if self.seconds > 0 else None}


@dataclass
class GalleryIndex:
    """A loaded index: ``blocks``, its (n_i, D) L2-normalised rows (memory-mapped parts, float16 or
    float32) whose concatenation is in the order of ``names``; one (N, D) tensor is taken as one block."""

    directory: Path
    root: Path
    names: list[str]
    blocks: list[torch.Tensor] | torch.Tensor
    backbone: dict
    backbone_slug: str
    precision: str
    members: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # shard member -> (shard, offset, length)

    def __post_init__(self) -> None:
        if isinstance(self.blocks, torch.Tensor):
            self.blocks = [self.blocks]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def features(self) -> torch.Tensor:
        """(N, D) float32 copy of every row (for small galleries and tests; rankers read ``blocks``)."""
        dim = self.blocks[0].shape[1] if self.blocks else 0
        return torch.cat([b.float() for b in self.blocks]) if self.blocks else torch.zeros(0, dim)

    def path_of(self, name: str) -> Path:
        """The image file of an indexed name (for a shard member: its shard)."""
        return self.root / self.members[name][0] if name in self.members else self.root / name

    def image_ref(self, name: str) -> ImageRef:
        """What :func:`demind.retrieval.load_image` reads to show an indexed image (upright, as it was
        encoded: EXIF orientation applied)."""
        if name in self.members:
            shard, offset, length = self.members[name]
            return ImageRef(name=name, path=self.root / shard, span=(offset, length), orient=True)
        return ImageRef(name=name, path=self.root / name, orient=True)


def list_gallery_images(folder: str | Path, skipped: dict[str, str] | None = None, index_dir: str | Path | None = None
                        ) -> tuple[list[ImageRef], dict[str, str]]:
    """Every image under ``folder`` (recursive, sorted): files, and image members of ``*.tar`` shards.

    Returns (ImageRefs named by their path relative to ``folder`` (a shard member:
    ``shard.tar/member``), with ``version`` = size and mtime of the file or shard so the cache
    key changes with it, decoded as a viewer shows them (EXIF orientation applied); {name: error}
    for shards that cannot be listed and files that cannot be opened: dangling symbolic links,
    link loops). Every other file (not an image the decoder reads,
    :data:`demind.imaging.DECODABLE_EXTENSIONS`) is put in ``skipped`` as {name: reason}, so that
    a build names and counts it. ``index_dir``: an index kept inside the folder (``photos/.index``)
    is not walked: its own files are no input.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise GalleryIndexError(f"image folder {folder} does not exist or is not a folder")
    own = Path(index_dir).resolve() if index_dir is not None else None
    refs, bad_shards = [], {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if own is None or (Path(dirpath) / d).resolve() != own)
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            name = path.relative_to(folder).as_posix()
            extension = os.path.splitext(filename)[1].lower()
            if filename.endswith(SHARD_SUFFIX):
                try:
                    refs.extend(list_shard_images(path, name))
                except (tarfile.TarError, OSError) as e:
                    bad_shards[name] = f"cannot list shard {path}: {e}"
            elif extension in DECODABLE_EXTENSIONS:
                try:
                    version = file_version(path.stat())
                except OSError as e:  # a dangling symbolic link, a link loop, a file gone meanwhile
                    bad_shards[name] = f"cannot read {path}: {e.strerror or e}"
                    continue
                refs.append(ImageRef(name=name, path=path, version=version, orient=True))
            elif skipped is not None:
                skipped[name] = f"not an image file ({extension or 'no extension'})"
    return refs, bad_shards


def list_shard_images(shard: Path, shard_name: str) -> list[ImageRef]:
    """The image members of one uncompressed tar shard, read in place by byte span (no unpacking).

    A tar may hold two members of one name (``tar -r`` appends, extraction keeps the last):
    the later ones are named ``NAME#2``, ``NAME#3``... (logged), so every entry's features are
    those of the pixels its name shows. A compressed shard (``.tar`` holding gzip) has no byte
    spans and raises tarfile.ReadError."""
    version = file_version(shard.stat())
    refs, seen = [], set()
    with tarfile.open(shard, "r:") as tar:  # "r:" = uncompressed only
        for member in tar:
            if not (member.isfile() and os.path.splitext(member.name)[1].lower() in DECODABLE_EXTENSIONS):
                continue
            name, copy = f"{shard_name}/{member.name}", 1
            while name in seen:
                copy += 1
                name = f"{shard_name}/{member.name}#{copy}"
            if copy > 1:
                log.warning("shard %s holds another member named %s (at byte %d): indexed as %s", shard,
                            member.name, member.offset, name)
            seen.add(name)
            refs.append(ImageRef(name=name, path=shard, version=version, span=(member.offset_data, member.size),
                                 orient=True))
    return refs


def backbone_record(backbone: FrozenCLIP) -> dict:
    """What an index records about the backbone that encoded it: the one cache key
    (:func:`~demind.embedding_cache.cache_identity`, its slug), the precision and the width."""
    return {"identity": cache_identity(backbone), "slug": cache_slug(backbone),
            "precision": backbone.cfg.precision, "embed_dim": backbone.embed_dim}


def _check_or_write_backbone(index_dir: Path, backbone: FrozenCLIP) -> None:
    """The first build records the backbone; a rerun with another one is refused before any
    part is mixed in (features of two backbones are not comparable)."""
    record = backbone_record(backbone)
    path = index_dir / BACKBONE_FILE
    if path.is_file():
        try:
            found = read_json(path, fix=f"delete {index_dir} to rebuild it")
        except InputError as e:
            raise GalleryIndexError(str(e)) from None
        if not isinstance(found, dict):
            raise GalleryIndexError(f"{path} is not a backbone record (a JSON object); delete {index_dir} to rebuild it")
        check_backbone(with_precision(found.get("identity"), found.get("precision")), record["identity"],
                       f"index {index_dir}", f"give another --index folder, or delete {index_dir} to rebuild it",
                       GalleryIndexError)
        return
    write_json_atomic(path, record, indent=2)


def build_index(
    images: str | Path,
    index_dir: str | Path,
    backbone: FrozenCLIP,
    batch_size: int = 64,
    num_workers: int = 0,
    part_size: int = 1024,
    progress: bool = True,
    new_root: bool = False,
    dtype: str = STORED_DTYPE,
    encode_missing: Callable[[list[ImageRef], ImageFeatureCache], tuple[int, dict[str, str]]] | None = None,
) -> IndexBuildStats:
    """Build or update the index of every image under ``images`` into ``index_dir``.

    Only new or changed files are encoded (``encode_image_refs`` reuses every part whose key
    matches, and an entry of an index built before EXIF orientation was applied for every image
    stored upright: its record is rewritten, its row kept); files that failed to decode before
    and have not changed are not retried.
    When files were removed or changed the parts are compacted so they hold only live entries.
    An index built from another folder is refused unless ``new_root`` (it would drop every
    file only in the old folder). A damaged embedding part is deleted and its images encoded again; a
    damaged ``index.json`` is logged and rebuilt (:func:`_previous_manifest`). Rows are stored
    L2-normalised in ``dtype`` (an existing index keeps its own); an index of the earlier layout
    is rewritten in this one.

    ``encode_missing(refs, cache)`` (a distributed build, :mod:`demind.search.ray_index`) encodes
    the images no finished part holds into parts of ``cache`` before the local pass, and returns
    (images encoded, {name: why unreadable}); the local pass then finds them cached and only
    assembles the index (and compacts, as always).
    """
    start = time.perf_counter()
    images, index_dir = Path(images), Path(index_dir)
    _check_index_request(images, index_dir, part_size)
    previous = _follow_root(index_dir, images, new_root)
    _check_or_write_backbone(index_dir, backbone)
    refs, bad_shards, stats, todo = _gallery_todo(images, index_dir, previous)
    dtype, cache = _open_cache(index_dir, previous, dtype)
    features = _encode_gallery(backbone, todo, cache, stats, encode_missing, batch_size, num_workers, part_size,
                               progress)
    stats.unreadable.update(bad_shards)  # retried on every run (listing a shard or a link is cheap)
    keys = {r.name: r.cache_key for r in refs}
    names = [r.name for r in refs if r.name in features]
    stats.indexed = len(names)
    stats.removed = sum(1 for name in previous["images"] if name not in keys)
    parts = _live_or_compacted(cache, index_dir, names, keys, features, backbone, part_size)
    _write_index_manifest(index_dir, images, backbone, dtype, parts, stats, keys)
    stats.seconds = time.perf_counter() - start
    if stats.unreadable:
        log.warning("%d unreadable image(s) left out of the index, e.g. %s", len(stats.unreadable),
                    next(iter(stats.unreadable.values())))
    return stats


def _check_index_request(images: Path, index_dir: Path, part_size: int) -> None:
    """Refuse a part size below 1 and an index folder that is the image folder; check that
    ``index_dir`` can be written (before any model work)."""
    if part_size < 1:
        raise GalleryIndexError(f"part_size must be at least 1 (images per saved part), got {part_size}")
    if index_dir.resolve() == images.resolve():
        raise GalleryIndexError(f"--index {index_dir} is the image folder itself: its files would be read as "
                                f"images; give a folder of its own, e.g. --index {index_dir / '.index'}")
    check_output_dir(index_dir)


def _follow_root(index_dir: Path, images: Path, new_root: bool) -> dict:
    """The previous build's manifest (empty fields for a new index); an index built from another
    folder is refused unless ``new_root``, which follows ``images`` and says so."""
    previous, damaged = previous_manifest(index_dir, images)
    if previous["root"] and recorded_root(index_dir, previous) != images.resolve():
        if not new_root:
            raise GalleryIndexError(
                f"index {index_dir} was built from {previous['root']}, not {images.resolve()}: following the new "
                f"folder drops the {len(previous['images'])} indexed file(s) not in it; give --new-folder to do "
                f"that, or another --index folder")
        log.warning("index %s was built from %s; it now follows %s (files only in the old folder are dropped)",
                    index_dir, previous["root"], images.resolve())
    return previous


def _gallery_todo(images: Path, index_dir: Path, previous: dict
                  ) -> tuple[list[ImageRef], dict[str, str], IndexBuildStats, list[ImageRef]]:
    """Returns (every image under ``images``, {shard or link: why it cannot be listed}, the build's
    stats so far, the images to encode or reuse: all but those that failed before and have not changed)."""
    skipped: dict[str, str] = {}
    refs, bad_shards = list_gallery_images(images, skipped, index_dir)
    stats = IndexBuildStats(images=len(refs), skipped=skipped)
    stats.members = {r.name: (r.path.relative_to(images).as_posix(), *r.span) for r in refs if r.span}

    known_bad = previous["unreadable"]  # name -> [key, reason]; unchanged since it failed: not retried
    still_bad = {r.name for r in refs if r.name in known_bad and known_bad[r.name][0] == r.cache_key}
    stats.unreadable = {name: known_bad[name][1] for name in sorted(still_bad)}
    todo = [r for r in refs if r.name not in still_bad]
    return refs, bad_shards, stats, todo


def _open_cache(index_dir: Path, previous: dict, dtype: str) -> tuple[str, ImageFeatureCache]:
    """(the rows' stored dtype name, the index's embedding parts): an index keeps the dtype it was first stored in."""
    dtype = previous.get("dtype") or dtype  # an index keeps the form it was first stored in
    if dtype not in DTYPES:
        raise GalleryIndexError(f"index rows are stored as one of {', '.join(DTYPES)}, not {dtype!r}")
    cache = ImageFeatureCache.at(index_dir, f"give another --index folder, or delete {index_dir} to rebuild it",
                                 GalleryIndexError, dtype=DTYPES[dtype], normalise=True)
    return dtype, cache


def _encode_gallery(backbone: FrozenCLIP, todo: list[ImageRef], cache: ImageFeatureCache, stats: IndexBuildStats,
                    encode_missing: Callable[[list[ImageRef], ImageFeatureCache], tuple[int, dict[str, str]]] | None,
                    batch_size: int, num_workers: int, part_size: int, progress: bool) -> dict[str, torch.Tensor]:
    """Encode what no finished part holds (first through ``encode_missing`` when given), counting
    into ``stats``. Returns name -> (D,) L2-normalised row in the cache's stored dtype."""
    elsewhere = 0  # encoded by encode_missing: cache hits of the local pass
    if encode_missing is not None:
        held = _held_entries(cache, cache_identity(backbone))
        missing = [r for r in todo if (r.name, r.cache_key) not in held]
        adopted = {r.name for r in adopt_unoriented(cache, ROLE, missing, lambda name, key: (name, key) in held)}
        elsewhere, unreadable = encode_missing([r for r in missing if r.name not in adopted], cache)
        stats.unreadable.update(unreadable)
        todo = [r for r in todo if r.name not in unreadable]  # not decoded again here
    features, encode_stats = encode_image_refs(backbone, todo, cache, ROLE, batch_size, num_workers, part_size,
                                               progress, desc="index images", on_unreadable="skip")
    stats.cached, stats.encoded = encode_stats.cached - elsewhere, encode_stats.encoded + elsewhere
    stats.unreadable.update(encode_stats.unreadable)
    return features


def _live_or_compacted(cache: ImageFeatureCache, index_dir: Path, names: list[str], keys: dict[str, str],
                       features: dict[str, torch.Tensor], backbone: FrozenCLIP, part_size: int
                       ) -> list[tuple[Path, dict]]:
    """The parts' (record path, record) in order, holding exactly the index's ``names`` (rows in
    ``features``, each (D,)): the parts as they are, or rewritten from ``features`` when they hold more."""
    parts = _live_parts(cache, {n: keys[n] for n in names})
    if parts is None:  # removed, changed or unreadable entries, or rows not in the stored form: compact
        # (their rows would otherwise stay in the parts for ever, and the parts must hold exactly the index)
        log.info("compacting %s to its %d live entries", index_dir, len(names))
        rows = [f if f.dtype == cache.dtype and f.dtype != torch.float32 else cache.stored(f[None])[0]
                for f in (features[n] for n in names)]
        cache.replace_all(ROLE, names, [keys[n] for n in names], torch.stack(rows) if rows else
                          torch.zeros(0, backbone.embed_dim, dtype=cache.dtype), part_size, cache_identity(backbone))
        parts = _live_parts(cache, {n: keys[n] for n in names})
    return parts


def _write_index_manifest(index_dir: Path, images: Path, backbone: FrozenCLIP, dtype: str,
                          parts: list[tuple[Path, dict]], stats: IndexBuildStats, keys: dict[str, str]) -> None:
    """Write ``index.json``, the done-marker: the parts in row order, the names once, the unreadable files."""
    order = [name for _, record in parts for name in record["names"]]

    record = backbone_record(backbone)
    write_json_atomic(index_dir / MANIFEST, {
        "format": INDEX_FORMAT,
        "root": str(images.resolve()),
        # also relative to the index folder: an index moved together with its images (a project folder
        # copied to another machine) still finds them; "root" serves an index moved on its own
        "root_relative": os.path.relpath(images.resolve(), index_dir.resolve()),
        "backbone": record["identity"], "backbone_slug": record["slug"],
        "precision": record["precision"], "embed_dim": record["embed_dim"], "dtype": dtype,
        "parts": [[path.stem, record["rows"]] for path, record in parts],
        "images": order,  # names once, in row order (keys: in the parts' records, for the next build)
        "members": {n: stats.members[n] for n in order if n in stats.members},
        "unreadable": {n: [keys.get(n), reason] for n, reason in sorted(stats.unreadable.items())},
    })


def load_index(index_dir: str | Path, root: str | Path | None = None) -> GalleryIndex:
    """Open a finished index; ``root`` overrides where its images live (a moved folder).

    Returns a :class:`GalleryIndex` whose blocks are the parts' rows, memory-mapped (an index of an
    earlier layout: one normalised float32 block, :func:`~demind.search.index_upgrade.load_earlier_rows`).
    """
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    if manifest is None:
        hint = (" (it holds parts of an unfinished build: rerun demind-index to finish it)"
                if (index_dir / ROLE).is_dir() else "")
        raise GalleryIndexError(f"no index at {index_dir}: {MANIFEST} is missing{hint}; "
                                f"build one with demind-index --images DIR --index {index_dir} --checkpoint CKPT")
    root = Path(root) if root else recorded_root(index_dir, manifest)
    blocks = (_map_parts(index_dir, manifest) if manifest["format"] == INDEX_FORMAT else  # an earlier layout
              load_earlier_rows(index_dir, manifest, ROLE, GalleryIndexError,
                                rebuild_advice(index_dir, manifest["root"])))
    return GalleryIndex(directory=index_dir, root=root, names=manifest["images"], blocks=blocks,
                        backbone=manifest["backbone"], backbone_slug=manifest["backbone_slug"],
                        precision=manifest["precision"],
                        members={n: tuple(v) for n, v in manifest.get("members", {}).items()})


def _held_entries(cache: ImageFeatureCache, identity: dict) -> set[tuple[str, str]]:
    """(name, key) of every entry a finished part records, read from the records alone (a damaged
    record: the parts are read, and damaged ones deleted, first). A part whose tensors turn out
    damaged counts here and is encoded again by the local pass."""
    try:
        records = [record for _, record in cache.records(ROLE)]
    except DamagedPartError:
        records = cache.read_parts(ROLE, drop_damaged=True, identity=identity)
    return {(name, key) for record in records for name, key in zip(record["names"], record["keys"])}


def _live_parts(cache: ImageFeatureCache, live: dict[str, str]) -> list[tuple[Path, dict]] | None:
    """The parts' (record path, record) in order when they hold exactly the ``live`` {name: key}
    entries, once each, in the cache's stored form; None when the parts must be compacted."""
    if any(is_earlier_part(p) for p in cache.parts(ROLE)):
        return None  # parts of an earlier form (raw float32 rows): rewritten in the stored form
    parts = cache.records(ROLE)
    seen = 0
    for _, record in parts:
        if record.get("dtype") != str(cache.dtype).removeprefix("torch.") or not record.get("normalised"):
            return None
        for name, key in zip(record["names"], record["keys"]):
            if live.get(name) != key:
                return None
        seen += len(record["names"])
    return parts if seen == len(live) and len({n for _, r in parts for n in r["names"]}) == seen else None


def _map_parts(index_dir: Path, manifest: dict) -> list[torch.Tensor]:
    """Memory-map the rows of every part the manifest lists: no row is read until a query uses it."""
    blocks = []
    for stem, rows in manifest["parts"]:
        path = index_dir / ROLE / f"{stem}.safetensors"
        fix = f"{rebuild_advice(index_dir, manifest['root'])} (only the damaged part's images are encoded again)"
        if not path.is_file():
            raise GalleryIndexError(f"index {index_dir} lacks its part {path.name}; {fix}")
        block = map_tensor(path, "features", GalleryIndexError, f"index {index_dir}: feature part", fix)
        if block.shape != (rows, manifest["embed_dim"]):
            raise GalleryIndexError(f"index {index_dir}: part {path.name} holds {tuple(block.shape)} rows, "
                                    f"not the ({rows}, {manifest['embed_dim']}) listed; {fix}")
        blocks.append(block)
    return blocks


def check_index_backbone(index: GalleryIndex, backbone: FrozenCLIP) -> None:
    """Fail, naming both, when ``index`` was encoded by another backbone (or precision): the one
    refusal of :func:`demind.embedding_cache.check_backbone`."""
    check_backbone(with_precision(index.backbone, index.precision), cache_identity(backbone),
                   f"index {index.directory}", f"the checkpoint's backbone differs: rebuild the index with "
                   f"demind-index --images {index.root} --index NEW_DIR --checkpoint CKPT", GalleryIndexError)
