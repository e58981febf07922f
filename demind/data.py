"""Streaming intent shards (WebDataset tars) into training batches.

A sample in an intent shard is ``KEY.jpg`` (image), ``KEY.txt`` (original caption
T_ori), ``KEY.rew.txt`` (rewritten caption T_rew), ``KEY.int.txt`` (pseudo-manipulation
description T_int) and ``KEY.json`` (metadata, unused here); see ``shards/README.md``.  Field names and shard
lists (``resolve_shards``) come from ``demind.shard_format``.

Every process reads its own, deterministic stream, so that a run can resume exactly:

* The shard list is cut into *groups* of ``data.shards_per_group`` shards per reader
  (one reader = one (process, DataLoader worker) pair).  With ``data.resample`` a
  group is drawn with replacement (webdataset's ``ResampledShards``); without it,
  every epoch is a fresh permutation of the shards split between the readers
  (webdataset's ``split_by_node`` + ``split_by_worker``).
* Inside a group the samples pass a shuffle buffer and get their target
  description drawn (``demind.targets.sample_target_text``); both use a random
  generator seeded by (seed, process, worker, group), so any group can be
  regenerated on its own.
* Each batch carries the reader's position ``(group, samples consumed in the group)``.
  The trainer stores the positions of the batches it consumed in its checkpoint; on
  resume a reader jumps straight to its group and replays (without decoding any
  image) the part of that group it had already produced.

Raw shards yield decoded images ``(B, 3, H, W)``.  With a frozen-feature cache
(``demind.features``) the same stream yields cached image embeddings and teacher
text embeddings instead and no image is read or decoded.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from demind.settings import setting
from demind.errors import DemindError, InputError
from demind.imaging import decode_image
from demind.shard_format import CAPTION_FIELD, IMAGE_FIELDS, INTENT_FIELD, REWRITTEN_FIELD
from demind.schema import MISSING_TEXT_CHOICES
from demind.targets import TargetSampling, sample_target_kind

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_SKIPS = 1000  # this many unusable samples in a row: the data is broken, stop


class ShardFormatError(DemindError, ValueError):
    """An intent shard that lacks a field the trainer needs."""


# --------------------------------------------------------------------------- shard groups


def _seeded_rng(*parts: Any) -> random.Random:
    # String seeds go through SHA-512 in random.Random: stable across runs and hosts.
    return random.Random(":".join(str(p) for p in parts))


def group_shards(shards: list[str], group: int, *, seed: int, rank: int, world_size: int,
                 worker: int, num_workers: int, per_group: int, resample: bool) -> list[str]:
    """The shards a reader (rank, worker) reads in its ``group``-th group."""
    if resample:
        rng = _seeded_rng(seed, "resample", rank, worker, group)
        return [rng.choice(shards) for _ in range(per_group)]
    readers = world_size * num_workers
    reader = rank * num_workers + worker
    own = len(range(reader, len(shards), readers))
    groups_per_epoch = -(-own // per_group)
    epoch, chunk = divmod(group, groups_per_epoch)
    order = list(shards)
    _seeded_rng(seed, "epoch", epoch).shuffle(order)
    mine = order[reader::readers]
    return mine[chunk * per_group:(chunk + 1) * per_group]


def check_reader_count(num_shards: int, world_size: int, num_workers: int, resample: bool) -> None:
    """Without resampling every reader needs at least one shard per epoch."""
    readers = world_size * max(num_workers, 1)
    if not resample and num_shards < readers:
        raise InputError(
            f"{num_shards} shards cannot feed {readers} readers ({world_size} processes x "
            f"{max(num_workers, 1)} workers) without resampling; set data.resample=true or "
            f"lower data.num_workers"
        )


# --------------------------------------------------------------------------- samples


@dataclass
class ReaderStats:
    """Counts of skipped or patched samples; sent to the trainer with each batch."""

    counts: Counter = field(default_factory=Counter)

    def add(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    def take(self) -> dict[str, int]:
        """Return the counts since the last call and reset them."""
        out = dict(self.counts)
        self.counts.clear()
        return out


def _text(sample: dict[str, Any], name: str) -> str:
    value = sample[name]
    return value.decode("utf-8").strip() if isinstance(value, bytes) else str(value).strip()


def raw_texts(sample: dict[str, Any], shard: str, missing_text: str, stats: ReaderStats
              ) -> tuple[tuple[str, str, str], list[str]] | None:
    """((original, rewritten, intent), fallbacks) of a raw tar sample.

    A missing ``rew.txt``/``int.txt`` raises ShardFormatError naming the shard, key and
    field, unless ``missing_text == "original"``: then the caption stands in and the
    field's label ("rewritten"/"intent") is listed in ``fallbacks`` (counted when the
    sample is consumed).  An empty field (data_gen's single-prompt mode writes an empty
    ``rew.txt``) also falls back to the caption, counted as ``empty_<label>``.  A sample without a caption is malformed: returns None (the
    caller skips it; it is counted here).
    """
    key = sample.get("__key__", "?")
    if CAPTION_FIELD not in sample:
        logger.warning("skipping sample %s in shard %s: no %s field", key, shard, CAPTION_FIELD)
        stats.add("skipped_no_caption")
        return None
    original = _text(sample, CAPTION_FIELD)
    out, fallbacks = [original], []
    for name, label in ((REWRITTEN_FIELD, "rewritten"), (INTENT_FIELD, "intent")):
        if name in sample:
            text = _text(sample, name)
            if not text:
                # data_gen's single-prompt ("w/o CoT") mode writes an empty rew.txt on purpose.
                fallbacks.append(f"empty_{label}")
                text = original
            out.append(text)
            continue
        if missing_text != "original":
            raise ShardFormatError(
                f"shard {shard}: sample {key!r} has no {name!r} field (the {label} caption); "
                f"intent shards need both 'rew.txt' and 'int.txt' (make them with data_gen/run.py), "
                f"or set data.missing_text=original to use the original caption instead"
            )
        fallbacks.append(label)
        out.append(original)
    return (out[0], out[1], out[2]), fallbacks


def image_bytes(sample: dict[str, Any]) -> bytes | None:
    for name in IMAGE_FIELDS:
        if name in sample:
            return sample[name]
    return None


def decode_to_tensor(data: bytes, transform: Callable) -> torch.Tensor:
    """JPEG/PNG bytes -> (3, H, W) float tensor through the backbone's eval transform.

    Decoded as a viewer shows it (EXIF orientation applied), as generation saw it when it wrote
    the descriptions (:func:`demind.imaging.decode_image`)."""
    return transform(decode_image(data, orient=True))


def read_tar_samples(shard: str, missing_text: str, stats: ReaderStats) -> Iterator[dict[str, Any]]:
    """Samples of one raw shard: dict(key, shard, image=bytes, original, rewritten, intent, fallbacks)."""
    import webdataset as wds

    def count_and_continue(exn: Exception) -> bool:
        # A truncated tar or unreadable member: log, count, keep reading what is left.
        logger.warning("shard %s: read error, skipping: %s", shard, exn)
        stats.add("tar_errors")
        return True

    for sample in wds.tarfile_samples([{"url": shard}], handler=count_and_continue):
        parsed = raw_texts(sample, shard, missing_text, stats)
        if parsed is None:
            continue
        (original, rewritten, intent), fallbacks = parsed
        yield dict(key=sample["__key__"], shard=shard, image=image_bytes(sample),
                   original=original, rewritten=rewritten, intent=intent, fallbacks=fallbacks)


def shuffled(samples: Iterator[Any], buffer_size: int, rng: random.Random) -> Iterator[Any]:
    """Deterministic shuffle buffer: memory stays at ``buffer_size`` samples."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        i = rng.randrange(len(buffer))
        buffer[i], sample = sample, buffer[i]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


# --------------------------------------------------------------------------- stream


@dataclass
class StreamSpec:
    """Everything a reader needs; plain data so it pickles into DataLoader workers."""

    shards: list[str]
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    shuffle_buffer: int = 1000
    shards_per_group: int = 4
    resample: bool = True
    missing_text: str = setting("error", choices=MISSING_TEXT_CHOICES)
    targets: TargetSampling = field(default_factory=TargetSampling)
    start: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per worker id: (group, samples already consumed in that group)."""


class IntentStream(IterableDataset):
    """Endless stream of batches for one process.

    Yields dicts with ``keys``, ``targets`` (sampled target descriptions), ``target_kinds``
    (which text each is: original / rewritten / intent), ``intents`` (T_int), ``rewritten``
    (T_rew), either ``images`` (B, 3, H, W) or ``image_emb``/``teacher_emb``/``rew_emb`` (B, D)
    from a feature cache, plus ``worker``,
    ``position`` (group, offset) and ``counts``.
    """

    def __init__(self, spec: StreamSpec, transform: Callable | None = None,
                 cache: Any | None = None):
        super().__init__()
        if transform is None and cache is None:
            raise ValueError("IntentStream needs an image transform or a feature cache")
        self.spec, self.transform, self.cache = spec, transform, cache

    # The reader's samples in one group, with target texts drawn and positions attached.
    def _group_samples(self, group: int, worker: int, num_workers: int, stats: ReaderStats
                       ) -> Iterator[dict[str, Any]]:
        s = self.spec
        shards = group_shards(s.shards, group, seed=s.seed, rank=s.rank, world_size=s.world_size,
                              worker=worker, num_workers=num_workers,
                              per_group=s.shards_per_group, resample=s.resample)
        rng = _seeded_rng(s.seed, "group", s.rank, worker, group)

        def chained() -> Iterator[dict[str, Any]]:
            for shard in shards:
                if self.cache is not None:
                    yield from self.cache.samples(shard)
                else:
                    yield from read_tar_samples(shard, s.missing_text, stats)

        for offset, sample in enumerate(shuffled(chained(), s.shuffle_buffer, rng)):
            # which text was drawn matters to the noise modes (GFQ scores T_rew and T_int)
            sample["target_kind"] = sample_target_kind(rng, s.targets)
            sample["target"] = sample[sample["target_kind"]]
            sample["position"] = (group, offset + 1)
            yield sample

    def _samples(self, worker: int, num_workers: int, stats: ReaderStats) -> Iterator[dict[str, Any]]:
        group, skip = self.spec.start.get(worker, (0, 0))
        if skip:
            logger.info("reader %d/%d resumes at group %d, skipping %d samples without decoding",
                        self.spec.rank, worker, group, skip)
        empty_groups = 0
        while True:
            produced = 0
            for sample in self._group_samples(group, worker, num_workers, stats):
                produced += 1
                if skip:
                    skip -= 1
                    if not skip:
                        stats.take()  # counts from the replayed part were reported before
                    continue
                yield sample
            skip = 0
            group += 1
            empty_groups = 0 if produced else empty_groups + 1
            if empty_groups > 2 * len(self.spec.shards) + 10:
                raise ShardFormatError(f"{empty_groups} shard groups in a row held no usable sample "
                                       f"(e.g. {self.spec.shards[0]}); counts so far: {dict(stats.counts)}")

    def _decoded(self, samples: Iterator[dict[str, Any]], stats: ReaderStats) -> Iterator[dict[str, Any]]:
        unusable = 0
        for sample in samples:
            for label in sample.pop("fallbacks", ()):
                stats.add(f"fallback_{label}")
            if self.cache is None:
                sample = self._with_pixels(sample, stats)
            if sample is None:
                unusable += 1
                if unusable >= MAX_CONSECUTIVE_SKIPS:
                    raise ShardFormatError(f"{unusable} samples in a row could not be used (last in shard "
                                           f"{self._last_shard}); the shards look broken: {dict(stats.counts)}")
                continue
            unusable = 0
            yield sample

    def _with_pixels(self, sample: dict[str, Any], stats: ReaderStats) -> dict[str, Any] | None:
        self._last_shard = sample["shard"]
        return with_pixels(sample, self.transform, stats)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stats = ReaderStats()
        batch: list[dict[str, Any]] = []
        for sample in self._decoded(self._samples(worker, num_workers, stats), stats):
            batch.append(sample)
            if len(batch) == self.spec.batch_size:
                yield collate(batch, worker, stats.take())
                batch = []


def collate(samples: list[dict[str, Any]], worker: int, counts: dict[str, int]) -> dict[str, Any]:
    """Stack a list of samples into a batch dict (see IntentStream)."""
    batch: dict[str, Any] = dict(
        keys=[s["key"] for s in samples],
        targets=[s["target"] for s in samples],
        target_kinds=[s["target_kind"] for s in samples],
        intents=[s["intent"] for s in samples],
        rewritten=[s["rewritten"] for s in samples],
        worker=worker,
        position=samples[-1]["position"],
        counts=counts,
    )
    if "pixels" in samples[0]:
        batch["images"] = torch.stack([s["pixels"] for s in samples])
    else:
        batch["image_emb"] = torch.stack([s["image_emb"] for s in samples])
        batch["teacher_emb"] = torch.stack([s["teacher_emb"] for s in samples])
        batch["rew_emb"] = torch.stack([s["rew_emb"] for s in samples])
    return batch


def with_pixels(sample: dict[str, Any], transform: Callable, stats: ReaderStats) -> dict[str, Any] | None:
    """Decode a read sample's ``image`` bytes into ``pixels`` (3, H, W); None, logged and
    counted (``skipped_no_image`` / ``skipped_corrupt_image``), if it has none or it is broken."""
    if sample["image"] is None:
        logger.warning("skipping sample %s in shard %s: no image field", sample["key"], sample["shard"])
        stats.add("skipped_no_image")
        return None
    try:
        sample["pixels"] = decode_to_tensor(sample.pop("image"), transform)
    except Exception as exn:  # PIL raises many types for a broken image
        logger.warning("skipping corrupt image %s in shard %s: %s", sample["key"], sample["shard"], exn)
        stats.add("skipped_corrupt_image")
        return None
    return sample


def build_loader(spec: StreamSpec, num_workers: int, transform: Callable | None = None,
                 cache: Any | None = None) -> DataLoader:
    """DataLoader over an IntentStream; batching happens inside the workers.

    DataLoader takes batches from its workers in strict rotation, which is what lets the
    trainer know which worker produced which batch.  Its own generator is private so
    that creating the iterator does not consume the global torch RNG (exact resume).
    """
    check_reader_count(len(spec.shards), spec.world_size, num_workers, spec.resample)
    return DataLoader(
        IntentStream(spec, transform=transform, cache=cache),
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(spec.seed),
    )
