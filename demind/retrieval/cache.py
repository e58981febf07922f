"""Image features for evaluation: batched encoding through the frozen backbone, cached on disk.

The cache is a folder per (backbone identity and precision, benchmark, split, role):
``<cache_dir>/<backbone>/<benchmark>/<split>/<role>/part-00000.{safetensors,json}``, entries of
the one embedding cache (:mod:`demind.embedding_cache`: key rule, identity refusal, writer,
reader). Each part holds the names, per-image cache keys (file, crop, mask, resize mode) and
(n, D) raw features of one chunk, written atomically as soon as the chunk is encoded; a
killed run keeps its finished parts, and a rerun encodes only what no part holds (an entry written
before EXIF orientation was applied is reused for every image whose orientation changes nothing:
:func:`~demind.retrieval.cache_upgrade.adopt_unoriented`). The search index
(``demind.search.index``) keeps its gallery embeddings in the same parts
(:meth:`ImageFeatureCache.at`), skipping unreadable images (``on_unreadable="skip"``) and compacting
parts when files change or go (:meth:`ImageFeatureCache.replace_all`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict
from torch.utils.data import DataLoader, Dataset
from demind.logs import progress_bar
from demind.settings import resolve_workers

from demind.backbone import FrozenCLIP
from demind.embedding_cache import (EmbeddingCacheError, cache_identity, cache_slug, check_backbone, read_record,
                                    read_tensors, write_entry)
from demind.errors import InputError
from demind.io import write_json_atomic
from demind.retrieval.cache_upgrade import (EARLIER_PART_SUFFIX, adopt_earlier_versions, adopt_unoriented,
                                            earlier_key_of, is_earlier_part, read_part, readable_slug, unoriented_key)
from demind.retrieval.refs import LEFT_OUT_ADVICE, ImageReadError, ImageRef, load_image, reword

log = logging.getLogger(__name__)


def backbone_cache_slug(backbone: FrozenCLIP) -> str:
    """Cache folder name of ``backbone``'s features: the one key rule's
    (:func:`demind.embedding_cache.cache_slug`; its identity slug, plus the precision unless fp32)."""
    return cache_slug(backbone)


def squash_preprocess(backbone: FrozenCLIP) -> Callable:
    """PIL image -> (3, H, W) tensor resized straight to the backbone's input size (no centre-crop).

    Pic2Word feeds its COCO query regions through ``Resize((n_px, n_px))`` instead of the
    resize + centre-crop of the other images. Size, interpolation and normalisation come from
    the open_clip preprocess config that ``backbone.preprocess`` was built from; only the
    resize mode is changed (open_clip's ``squash``).
    """
    cfg = merge_preprocess_dict(open_clip.get_model_preprocess_cfg(backbone.model), {"resize_mode": "squash"})
    return image_transform_v2(PreprocessCfg(**cfg), is_train=False)


def image_transforms(backbone: FrozenCLIP) -> dict[str, Callable]:
    """Resize mode (:data:`demind.retrieval.refs.RESIZE_MODES`) -> PIL image -> (3, H, W) tensor."""
    return {"backbone": backbone.preprocess, "squash": squash_preprocess(backbone)}


class ImageRefDataset(Dataset):
    """ImageRefs -> (3, H, W) tensors, each through the transform of its ``resize`` mode.

    With ``skip_unreadable`` an item is ``(tensor or None, error or None)`` so that one bad
    file (in a user's own folder) is counted instead of stopping the whole job.
    """

    def __init__(self, refs: list[ImageRef], transforms: dict[str, Callable], skip_unreadable: bool = False) -> None:
        self.refs = refs
        self.transforms = transforms
        self.skip_unreadable = skip_unreadable

    def __len__(self) -> int:
        return len(self.refs)

    def _load(self, index: int) -> torch.Tensor:
        ref = self.refs[index]
        return self.transforms[ref.resize](load_image(ref))

    def __getitem__(self, index: int):
        if not self.skip_unreadable:
            return self._load(index)
        try:
            return self._load(index), None
        except ImageReadError as e:
            return None, str(e)


def _collate_skipping(items: list[tuple[torch.Tensor | None, str | None]]):
    """(stacked readable images or None, positions of the readable ones, {position: error})."""
    good = [i for i, (t, _) in enumerate(items) if t is not None]
    errors = {i: err for i, (t, err) in enumerate(items) if t is None}
    stacked = torch.stack([items[i][0] for i in good]) if good else None
    return stacked, good, errors


@dataclass
class EncodeStats:
    """How many images a call needed, found in the cache, and encoded."""

    images: int = 0
    cached: int = 0
    encoded: int = 0
    unreadable: dict[str, str] = field(default_factory=dict)  # name -> error (on_unreadable="skip")

    def as_dict(self) -> dict[str, int]:
        return {"images": self.images, "cached": self.cached, "encoded": self.encoded}


class DamagedPartError(EmbeddingCacheError):
    """A feature part that cannot be read (truncated by a full disk, or not a part at all)."""


PART_FORMAT = "demind-image-features/1"


def _part_number(path: Path) -> int:
    return int(path.name.split(".")[0].split("-")[1])


class ImageFeatureCache:
    """On-disk image features for one backbone, benchmark and split, in atomic parts per role.

    A part is an entry of the one embedding cache (:mod:`demind.embedding_cache`):
    ``part-NNNNN.safetensors`` holds exactly its (n, D) rows (``features``), ``part-NNNNN.json``
    (written last) its format, backbone identity (:func:`~demind.embedding_cache.cache_identity`),
    names and per-image keys. Parts and folders of earlier versions are read through
    :mod:`demind.retrieval.cache_upgrade`.
    ``rebuild`` is the advice a refusal ends with; ``error`` the class it raises.
    """

    dtype: torch.dtype | None = None  # stored as encoded (evaluation: float32, numbers unchanged)
    normalise: bool = False

    def __init__(self, root: str | Path, backbone_slug: str, benchmark: str, split: str) -> None:
        self.dir = Path(root) / backbone_slug / benchmark / split
        self.rebuild = f"delete {self.dir} to encode its images again"
        self.error: type[Exception] = EmbeddingCacheError

    @classmethod
    def for_backbone(cls, root: str | Path, backbone: FrozenCLIP, benchmark: str, split: str) -> "ImageFeatureCache":
        """The cache of ``backbone``'s features under ``root``: ``<root>/<cache_slug>/<benchmark>/<split>``
        (the one key rule); a gallery encoded before the key rule is read where it lies
        (:func:`~demind.retrieval.cache_upgrade.readable_slug`)."""
        return cls(root, readable_slug(Path(root), cache_slug(backbone), backbone, (benchmark, split)), benchmark, split)

    @classmethod
    def at(cls, directory: str | Path, rebuild: str | None = None, error: type[Exception] = EmbeddingCacheError,
           dtype: torch.dtype | None = None, normalise: bool = False) -> "ImageFeatureCache":
        """A cache whose roles live directly under ``directory`` (the search index's folder);
        ``dtype`` / ``normalise``: the form rows are stored in (:meth:`stored`)."""
        cache = cls.__new__(cls)
        cache.dir = Path(directory)
        cache.rebuild = rebuild or f"delete {cache.dir} to encode its images again"
        cache.error = error
        cache.dtype, cache.normalise = dtype, normalise
        return cache

    def stored(self, features: torch.Tensor) -> torch.Tensor:
        """(n, D) features in the form this cache stores: L2-normalised (in float32) if ``normalise``,
        then cast to ``dtype``; unchanged for a cache of neither."""
        if self.normalise:
            features = torch.nn.functional.normalize(features.float(), dim=-1)
        return features.to(self.dtype) if self.dtype is not None else features

    def records(self, role: str) -> list[tuple[Path, dict]]:
        """(record path, record) of every finished part of ``role`` in the one-cache format, oldest
        first, without reading a tensor (parts of an earlier form are not listed)."""
        out = []
        for path in self.parts(role):
            if path.suffix == ".json":
                out.append((path, read_record(path, DamagedPartError, "")))
        return out

    def _role_dir(self, role: str) -> Path:
        return self.dir / role

    def parts(self, role: str) -> list[Path]:
        """The role's part files (tensor files, records and parts of an earlier form), oldest first."""
        role_dir = self._role_dir(role)
        files = [p for p in role_dir.glob("part-*") if p.suffix in (EARLIER_PART_SUFFIX, ".json", ".safetensors")] \
            if role_dir.is_dir() else []
        return sorted(files, key=lambda p: (_part_number(p), p.suffix))

    def read_parts(self, role: str, drop_damaged: bool = False, identity: dict | None = None) -> list[dict]:
        """Every finished part of ``role``, oldest first: {"names", "keys", "features" (n, D)}.

        ``identity`` (a :func:`~demind.embedding_cache.cache_identity`): a part recorded with another
        backbone is refused (:func:`~demind.embedding_cache.check_backbone`). A damaged part raises
        :class:`DamagedPartError`; with ``drop_damaged`` (a writer, which re-encodes what is missing)
        it is deleted with a warning instead, as is a tensor file whose record was never written.
        """
        out = []
        for path in self.parts(role):
            if path.suffix == ".safetensors":
                if drop_damaged and not path.with_suffix(".json").is_file():
                    path.unlink(missing_ok=True)  # a writer killed between the tensors and the record
                continue
            try:
                out.append(self._read(path, identity))
            except DamagedPartError as e:
                if not drop_damaged:
                    raise
                log.warning("%s; deleting it (its images are encoded again)", e)
                for stale in (path.with_suffix(".json"), path.with_suffix(".safetensors"), path):
                    stale.unlink(missing_ok=True)
        return out

    def _read(self, path: Path, identity: dict | None) -> dict:
        if is_earlier_part(path):
            return read_part(path, DamagedPartError)
        record = read_record(path, DamagedPartError, "")
        tensors_path = path.with_suffix(".safetensors")
        if (record.get("format") != PART_FORMAT or not isinstance(record.get("names"), list)
                or not isinstance(record.get("keys"), list) or len(record["names"]) != len(record["keys"])):
            raise DamagedPartError(f"feature part {path} is not a part of names and keys")
        if identity is not None and record.get("backbone") is not None:
            check_backbone(record["backbone"], identity, f"image features {self.dir}", self.rebuild, self.error)
        if not tensors_path.is_file():
            raise DamagedPartError(f"feature part {tensors_path} is missing")
        features = read_tensors(tensors_path, DamagedPartError, "feature part", "").get("features")
        if features is None or features.ndim != 2 or len(features) != len(record["names"]):
            raise DamagedPartError(f"feature part {tensors_path} does not hold the {len(record['names'])} rows "
                                   f"its record lists")
        return {"names": record["names"], "keys": record["keys"], "features": features}

    def load(self, role: str, drop_damaged: bool = False,
             identity: dict | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {cache key -> (D,) feature} over all parts; for a repeated key, later parts win.

        A name can hold several keys (a COCO query crop under each resize mode), so switching
        a reader option back and forth re-encodes nothing. ``drop_damaged`` and ``identity``: as
        in :meth:`read_parts`.
        """
        found: dict[str, dict[str, torch.Tensor]] = {}
        for data in self.read_parts(role, drop_damaged, identity):
            for name, key, feature in zip(data["names"], data["keys"], data["features"]):
                found.setdefault(name, {})[key] = feature
        return found

    def write_part(self, role: str, names: list[str], keys: list[str], features: torch.Tensor,
                   identity: dict | None = None) -> Path:
        """Write one chunk of (n, D) features as a part of the one cache (exactly its rows); returns
        the part's record (its done-marker)."""
        role_dir = self._role_dir(role)
        role_dir.mkdir(parents=True, exist_ok=True)
        # after the last existing part (not at their count): once old parts are removed by
        # replace_all, a count would sort a new part before older ones and lose "later wins"
        existing = self.parts(role)
        index = _part_number(existing[-1]) + 1 if existing else 0
        record = {"format": PART_FORMAT, "backbone": identity, "rows": len(names),
                  "dtype": str(features.dtype).removeprefix("torch."), "normalised": self.normalise,
                  "names": list(names), "keys": list(keys)}
        return write_entry(role_dir / f"part-{index:05d}", {"features": features}, record)[1]

    def rekey(self, role: str, renames: dict[str, tuple[str, str]]) -> int:
        """Record entries under new keys, ``renames`` = {name: (old key, new key)}, by rewriting
        (atomically) only the records that hold one; no row is read or written. Returns how many
        entries were renamed (an entry only in a part of an earlier form keeps its key)."""
        renamed = 0
        for path, record in self.records(role):
            keys = [renames[name][1] if renames.get(name, ("",))[0] == key else key
                    for name, key in zip(record["names"], record["keys"])]
            changed = sum(a != b for a, b in zip(keys, record["keys"]))
            if changed:
                write_json_atomic(path, {**record, "keys": keys})
                renamed += changed
        return renamed

    def replace_all(self, role: str, names: list[str], keys: list[str], features: torch.Tensor,
                    part_size: int = 4096, identity: dict | None = None) -> list[Path]:
        """Rewrite the role as exactly these (n, D) entries (drops removed or superseded ones).

        New parts are written after the old ones before the old ones are deleted (each record
        before its tensors), so a kill at any point leaves a cache that loads to the same entries
        (later parts win). Each part file holds only its own rows.
        """
        old = self.parts(role)
        new = [self.write_part(role, names[i:i + part_size], keys[i:i + part_size], features[i:i + part_size],
                               identity)
               for i in range(0, len(names), part_size)]
        for path in sorted(old, key=lambda p: p.suffix != ".json"):
            path.unlink(missing_ok=True)
        return new


def unique_refs(refs: list[ImageRef]) -> list[ImageRef]:
    """Drop repeated names; two different images under one name is an error."""
    by_name: dict[str, ImageRef] = {}
    for ref in refs:
        seen = by_name.get(ref.name)
        if seen is None:
            by_name[ref.name] = ref
        elif seen.cache_key != ref.cache_key:
            raise InputError(f"two different images share the name {ref.name!r}: {seen.cache_key} and {ref.cache_key}")
    return list(by_name.values())


@torch.no_grad()
def encode_image_refs(
    backbone: FrozenCLIP,
    refs: list[ImageRef],
    cache: ImageFeatureCache | None = None,
    role: str = "gallery",
    batch_size: int = 64,
    num_workers: int = 0,
    part_size: int = 4096,
    progress: bool = True,
    desc: str = "encode images",
    on_unreadable: str = "raise",
) -> tuple[dict[str, torch.Tensor], EncodeStats]:
    """Raw (not normalised) image features for ``refs``, from the cache where possible.

    Returns (name -> (D,) feature, stats): float32 as encoded, or in the cache's stored form
    (:meth:`ImageFeatureCache.stored`: the search index's normalised float16 rows). Images missing from the cache are decoded
    with ``backbone.preprocess`` (:func:`squash_preprocess` for ``resize="squash"``) in a
    DataLoader and encoded in batches of ``batch_size``; every ``part_size`` images are written
    to the cache as one part. ``on_unreadable``:
    ``"raise"`` (benchmarks: a broken file is an error naming it) or ``"skip"`` (a user's
    gallery: the image is left out, logged and listed in ``stats.unreadable``).
    """
    if on_unreadable not in ("raise", "skip"):
        raise ValueError(f"on_unreadable must be 'raise' or 'skip', got {on_unreadable!r}")
    refs = unique_refs(refs)
    stats = EncodeStats(images=len(refs))
    identity = cache_identity(backbone)
    features, todo = _cached_features(cache, role, refs, identity)
    stats.cached = len(features)
    log.info("%s: %d images, %d from cache, %d to encode", desc, len(refs), stats.cached, len(todo))
    for start in range(0, len(todo), part_size):
        chunk = todo[start : start + part_size]
        chunk_features, errors = _encode_chunk(backbone, chunk, batch_size, num_workers, progress, desc, start,
                                               len(todo), skip_unreadable=on_unreadable == "skip")
        for position, error in errors.items():
            error = reword(error, LEFT_OUT_ADVICE)  # a user's gallery, not a benchmark split
            log.warning("%s: skipping unreadable image: %s", desc, error)
            stats.unreadable[chunk[position].name] = error
        chunk = [r for i, r in enumerate(chunk) if i not in errors]
        if cache is not None:
            chunk_features = cache.stored(chunk_features)
        if cache is not None and chunk:
            cache.write_part(role, [r.name for r in chunk], [r.cache_key for r in chunk], chunk_features, identity)
        features.update({r.name: f for r, f in zip(chunk, chunk_features)})
        stats.encoded += len(chunk)
        if len(todo) > part_size:
            log.info("%s: encoded %d/%d images", desc, stats.encoded, len(todo))
    return features, stats


def _cached_features(cache: ImageFeatureCache | None, role: str, refs: list[ImageRef], identity: dict
                     ) -> tuple[dict[str, torch.Tensor], list[ImageRef]]:
    """(name -> (D,) feature the cache holds for ``refs``, the refs it holds none for, in order).

    An entry written before EXIF orientation was applied, or before file versions held change time
    and inode, is taken for every ref it still describes (:mod:`demind.retrieval.cache_upgrade`)."""
    cached = cache.load(role, drop_damaged=True, identity=identity) if cache is not None else {}
    features: dict[str, torch.Tensor] = {}
    todo = []
    for ref in refs:
        hit = cached.get(ref.name, {}).get(ref.cache_key)
        if hit is not None:
            features[ref.name] = hit
        else:
            todo.append(ref)
    if cache is not None and todo:  # a cache written before EXIF orientation was applied
        for ref in adopt_unoriented(cache, role, todo, lambda name, key: key in cached.get(name, {})):
            features[ref.name] = cached[ref.name][unoriented_key(ref)]
        todo = [ref for ref in todo if ref.name not in features]
    if cache is not None and todo:  # or before file versions held change time and inode
        for ref in adopt_earlier_versions(cache, role, todo, lambda name, key: key in cached.get(name, {})):
            features[ref.name] = cached[ref.name][earlier_key_of(ref)]
        todo = [ref for ref in todo if ref.name not in features]
    return features, todo


def _encode_chunk(backbone: FrozenCLIP, refs: list[ImageRef], batch_size: int, num_workers: int,
                  progress: bool, desc: str, done: int, total: int,
                  skip_unreadable: bool = False) -> tuple[torch.Tensor, dict[int, str]]:
    """(n_readable, D) float32 CPU features for one chunk, and {position in chunk: error} of
    the unreadable images (always empty unless ``skip_unreadable``)."""
    num_workers = resolve_workers(num_workers)  # no more decoding workers than cores
    loader = DataLoader(ImageRefDataset(refs, image_transforms(backbone), skip_unreadable), batch_size=batch_size,
                        num_workers=num_workers, shuffle=False, pin_memory=backbone.device.type == "cuda",
                        prefetch_factor=4 if num_workers > 0 else None,
                        collate_fn=_collate_skipping if skip_unreadable else None)
    # Decoding runs in worker processes; pinned batches copy to the GPU asynchronously.
    out, errors = [], {}
    with progress_bar(total=total, initial=done, unit="img", desc=desc, disable=not progress, leave=False) as bar:
        for batch_start, batch in zip(range(0, len(refs), batch_size), loader):
            if skip_unreadable:
                images, _, batch_errors = batch
                errors.update({batch_start + i: e for i, e in batch_errors.items()})
            else:
                images = batch
            if images is not None:
                out.append(backbone.encode_image(images).cpu())
            bar.update(min(batch_size, len(refs) - batch_start))
    return (torch.cat(out) if out else torch.zeros(0, backbone.embed_dim)), errors


def stack_features(features: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """(len(names), D) rows of ``features`` in the order of ``names``."""
    return torch.stack([features[n] for n in names]) if names else torch.zeros(0, 0)
