"""Image features for evaluation: batched encoding through the frozen backbone, cached on disk.

The cache is a folder per (backbone identity and precision, benchmark, split, role):
``<cache_dir>/<backbone>/<benchmark>/<split>/<role>/part-00000.pt``. Each part holds the
names, per-image cache keys (file, crop, mask) and (n, D) raw features of one chunk, written
atomically (tmp file, then ``os.replace``) as soon as the chunk is encoded; a killed run
keeps its finished parts, and a rerun encodes only what no part holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from demind.backbone import FrozenCLIP
from demind.eval.structures import ImageRef, load_image
from demind.io import atomic_path

log = logging.getLogger(__name__)


def backbone_cache_slug(backbone: FrozenCLIP) -> str:
    """Cache folder name: the backbone's identity slug (which fingerprints random-init
    weights) plus its precision (fp16 features differ)."""
    return f"{backbone.identity_str}-{backbone.cfg.precision}"


class ImageRefDataset(Dataset):
    """ImageRefs -> (3, H, W) tensors through the backbone's eval preprocessing."""

    def __init__(self, refs: list[ImageRef], preprocess: Callable) -> None:
        self.refs = refs
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.preprocess(load_image(self.refs[index]))


@dataclass
class EncodeStats:
    """How many images a call needed, found in the cache, and encoded."""

    images: int = 0
    cached: int = 0
    encoded: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"images": self.images, "cached": self.cached, "encoded": self.encoded}


class ImageFeatureCache:
    """On-disk features for one backbone, benchmark and split, in atomic parts per role."""

    def __init__(self, root: str | Path, backbone_slug: str, benchmark: str, split: str) -> None:
        self.dir = Path(root) / backbone_slug / benchmark / split

    def _role_dir(self, role: str) -> Path:
        return self.dir / role

    def load(self, role: str) -> dict[str, tuple[str, torch.Tensor]]:
        """name -> (cache key, (D,) feature) over all parts; later parts win."""
        found: dict[str, tuple[str, torch.Tensor]] = {}
        role_dir = self._role_dir(role)
        if not role_dir.is_dir():
            return found
        for part in sorted(role_dir.glob("part-*.pt")):
            data = torch.load(part, map_location="cpu", weights_only=True)
            for name, key, feature in zip(data["names"], data["keys"], data["features"]):
                found[name] = (key, feature)
        return found

    def write_part(self, role: str, names: list[str], keys: list[str], features: torch.Tensor) -> Path:
        """Write one chunk of (n, D) features atomically; returns the part's path."""
        role_dir = self._role_dir(role)
        role_dir.mkdir(parents=True, exist_ok=True)
        index = len(list(role_dir.glob("part-*.pt")))
        path = role_dir / f"part-{index:05d}.pt"
        while path.exists():
            index += 1
            path = role_dir / f"part-{index:05d}.pt"
        with atomic_path(path) as tmp:
            torch.save({"names": names, "keys": keys, "features": features.contiguous()}, tmp)
        return path


def unique_refs(refs: list[ImageRef]) -> list[ImageRef]:
    """Drop repeated names; two different images under one name is an error."""
    by_name: dict[str, ImageRef] = {}
    for ref in refs:
        seen = by_name.get(ref.name)
        if seen is None:
            by_name[ref.name] = ref
        elif seen.cache_key != ref.cache_key:
            raise ValueError(f"two different images share the name {ref.name!r}: {seen.cache_key} and {ref.cache_key}")
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
) -> tuple[dict[str, torch.Tensor], EncodeStats]:
    """Raw (not normalised) image features for ``refs``, from the cache where possible.

    Returns (name -> (D,) float32 feature, stats). Images missing from the cache are decoded
    with ``backbone.preprocess`` in a DataLoader and encoded in batches of ``batch_size``;
    every ``part_size`` images are written to the cache as one part.
    """
    refs = unique_refs(refs)
    stats = EncodeStats(images=len(refs))
    cached = cache.load(role) if cache is not None else {}
    features: dict[str, torch.Tensor] = {}
    todo = []
    for ref in refs:
        hit = cached.get(ref.name)
        if hit is not None and hit[0] == ref.cache_key:
            features[ref.name] = hit[1]
        else:
            todo.append(ref)
    stats.cached = len(features)
    log.info("%s: %d images, %d from cache, %d to encode", desc, len(refs), stats.cached, len(todo))
    for start in range(0, len(todo), part_size):
        chunk = todo[start : start + part_size]
        chunk_features = _encode_chunk(backbone, chunk, batch_size, num_workers, progress, desc, start, len(todo))
        if cache is not None:
            cache.write_part(role, [r.name for r in chunk], [r.cache_key for r in chunk], chunk_features)
        features.update({r.name: f for r, f in zip(chunk, chunk_features)})
        stats.encoded += len(chunk)
        if len(todo) > part_size:
            log.info("%s: encoded %d/%d images", desc, stats.encoded, len(todo))
    return features, stats


def _encode_chunk(backbone: FrozenCLIP, refs: list[ImageRef], batch_size: int, num_workers: int,
                  progress: bool, desc: str, done: int, total: int) -> torch.Tensor:
    """(n, D) float32 CPU features for one chunk of images."""
    # Decoding runs in worker processes; pinned batches copy to the GPU asynchronously.
    loader = DataLoader(ImageRefDataset(refs, backbone.preprocess), batch_size=batch_size,
                        num_workers=num_workers, shuffle=False, pin_memory=backbone.device.type == "cuda",
                        prefetch_factor=4 if num_workers > 0 else None)
    out = []
    with tqdm(total=total, initial=done, unit="img", desc=desc, disable=not progress, leave=False) as bar:
        for images in loader:
            out.append(backbone.encode_image(images).cpu())
            bar.update(images.shape[0])
    return torch.cat(out)


def stack_features(features: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """(len(names), D) rows of ``features`` in the order of ``names``."""
    return torch.stack([features[n] for n in names]) if names else torch.zeros(0, 0)
