"""Generated triplets (``data.source=generated``): the triplet shards of ``demind-generate-triplets``.

A folder of ``triplets-NNNNN.tar`` shards (their ``_stats.json`` done-markers beside them) and
``triplets_manifest.json``, whose ``corpus`` and ``backbone`` are those of the pairs it was made from
(shards/README.md, "Pair shards and triplet shards"). Each ``KEY.json`` is one (reference, target)
pair with several ``instructions``: **each instruction is one training triplet**, and the pair's
``hard_negatives`` (corpus keys) join that triplet's InfoNCE beside the in-batch targets
(:mod:`demind.triplets.hard_negatives`), as MegaPairs trains. Images are read by key from the corpus
(:func:`demind.pairs.open_corpus`); ``data.corpus`` names where it lies now if it moved, and another
corpus is refused naming both. Pairs mined with another frozen CLIP than the trainer's are refused
too (:func:`check_mined_backbone`): the neighbours, windows and hard negatives were that model's.

A record without a reference, a target or an instruction is a counted skip (``malformed``), as is
a shard without its done-marker (``unfinished_shard``, an interrupted generation; logged).
"""

from __future__ import annotations

import json
import logging
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

from demind.embedding_cache import backbone_mismatch
from demind.errors import InputError
from demind.pairs import CorpusMismatchError, open_corpus
from demind.shard_format import JSON_FIELD, ShardOutput, shard_name
from demind.triplets.readers import Triplet, TripletSet

log = logging.getLogger(__name__)

TRIPLETS_MANIFEST = "triplets_manifest.json"
"""The manifest ``demind-generate-triplets`` writes beside its shards (its format: demind-triplets/1)."""


def read_triplets_folder_manifest(folder: Path) -> dict[str, Any]:
    """The triplet folder's manifest, checked for what the trainer reads of it (corpus, backbone)."""
    path = folder / TRIPLETS_MANIFEST
    if not folder.is_dir():
        raise InputError(f"data.path={folder} is not a folder of generated triplet shards (demind-generate-triplets "
                         f"--output)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path} cannot be read ({e}); data.path must be a folder written by "
                         f"demind-generate-triplets") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("corpus"), dict):
        raise InputError(f"{path} records no corpus; generate the triplets again with demind-generate-triplets")
    return manifest


def _instructions(record: Any) -> list[str] | None:
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) and record[k]
                                               for k in ("reference", "target")):
        return None
    found = record.get("instructions")
    texts = [t.strip() for t in found if isinstance(t, str) and t.strip()] if isinstance(found, list) else []
    return texts or None


def _shard_records(shard: Path) -> list[tuple[str, Any]]:
    out = []
    with tarfile.open(shard, mode="r:") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith("." + JSON_FIELD):
                try:
                    out.append((member.name.split(".", 1)[0], json.loads(tar.extractfile(member).read())))
                except (ValueError, UnicodeDecodeError):
                    out.append((member.name.split(".", 1)[0], None))
    return out


def read_generated_triplets(path: str | Path, corpus: str = "", limit: int | None = None) -> TripletSet:
    """Every instruction of every finished triplet shard under ``path`` as a :class:`Triplet` (qid
    ``KEY:i``), its hard negatives as ImageRefs into the corpus; ``limit``: the first N triplets."""
    folder = Path(path)
    manifest = read_triplets_folder_manifest(folder)
    lookup = open_corpus(manifest, corpus or None, setting="data.corpus")
    skipped: dict[str, str] = {}
    counts: Counter = Counter()
    triplets: list[Triplet] = []
    shards = sorted(folder.glob("*.tar"))
    for shard in shards:
        if not ShardOutput.of(shard).is_done():
            counts["unfinished_shard"] += 1
            log.warning("%s has no done-marker (an interrupted generation): left out; rerun "
                        "demind-generate-triplets to finish it", shard)
            continue
        for key, record in _shard_records(shard):
            texts = _instructions(record)
            if texts is None:
                skipped[f"{shard_name(shard)}/{key}"] = "malformed"
                continue
            keys = [record["reference"], record["target"], *[k for k in record.get("hard_negatives") or []
                                                              if isinstance(k, str)]]
            missing = [k for k in keys if k not in lookup]
            if missing:
                skipped[f"{shard_name(shard)}/{key}"] = f"key {missing[0]} not in the corpus"
                continue
            reference, target = lookup.ref(keys[0]), lookup.ref(keys[1])
            hard = tuple(lookup.ref(k) for k in dict.fromkeys(keys[2:]) if k not in keys[:2])
            for i, text in enumerate(texts):
                triplets.append(Triplet(f"{key}:{i}", reference, text, target, None, hard))
                if limit is not None and len(triplets) >= limit:
                    return _finish(triplets, skipped, counts, folder)
    return _finish(triplets, skipped, counts, folder)


def _finish(triplets: list[Triplet], skipped: dict[str, str], counts: Counter, folder: Path) -> TripletSet:
    if skipped:
        reasons = Counter(r.split(" ")[0] if r != "malformed" else r for r in skipped.values())
        log.warning("generated triplets %s: skipped %d records (%s), e.g. %s", folder, len(skipped),
                    dict(reasons), next(iter(skipped.items())))
    if not triplets:
        raise InputError(f"data.path={folder} holds no finished triplet shard with a readable triplet "
                         f"({dict(counts) or 'no .tar shards'}); run demind-generate-triplets first")
    return TripletSet(triplets, skipped, "generated")


def check_mined_backbone(path: str | Path, identity: dict[str, Any]) -> None:
    """Refuse triplets whose pairs were mined with another frozen CLIP than ``identity`` (the trainer's
    :func:`demind.embedding_cache.cache_identity`), naming both."""
    folder = Path(path)
    recorded = read_triplets_folder_manifest(folder).get("backbone")
    mismatch = backbone_mismatch(recorded, identity) if recorded else None
    if mismatch:
        raise CorpusMismatchError(f"the pairs behind {folder} {mismatch}; train with the backbone the pairs were "
                                  f"mined with (backbone.name / backbone.pretrained), or mine them again with this one")
