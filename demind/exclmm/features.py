"""Frozen CLIP features of everything ExclMM training reads, computed once per run folder.

An entry of the one embedding cache (:mod:`demind.embedding_cache`): ``<output_dir>/features.safetensors``
holds the tensors (embeddings; the ragged word and ground-truth lists as flat values + offsets) and
``features.json`` (written last, the done-marker) the vocabulary, image ids, backbone identity
(:func:`~demind.embedding_cache.cache_identity`) and training split. Images go through the
evaluation image cache (:mod:`demind.retrieval.cache`, the same cache), so the harness reuses them.
A features file of an earlier version is still read (:mod:`demind.exclmm.run_upgrade`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demind.coco_files import CAPTION_FIELDS, load_coco
from demind.errors import InputError, MissingInputError
from demind.backbone import FrozenCLIP
from demind.embedding_cache import (EmbeddingCacheError, backbone_mismatch, cache_identity, entry_paths, read_record,
                                    read_tensors, stale_reason, write_entry)
from demind.eval import load_exclcoco
from demind.retrieval import ImageFeatureCache, encode_image_refs
from demind.retrieval import ImageRef
from demind.exclmm.model import words_of
from demind.exclmm.run_upgrade import EARLIER_FORMATS, earlier_record, load_earlier_features
from demind.trainkit import StateFileError

log = logging.getLogger(__name__)

FEATURES_NAME = "features.safetensors"
FEATURES_FORMAT = "demind-exclmm-features/2"  # /2: an entry of the one embedding cache
FEATURES_FIX = "delete it and rerun: the features are recomputed"
RAGGED = ("caption_words", "query_words", "positive_words", "query_truth")  # lists of int lists
# what the current trainer reads: features written before a key was added are recomputed
REQUIRED = ("positive_queries", "positive_words")


def pack_ragged(lists: list[list[int]]) -> dict[str, torch.Tensor]:
    """Int lists -> ``values`` (sum of lengths,) and ``offsets`` (len(lists) + 1,) int64 tensors
    (tensors, not JSON: COCO's captions would make a JSON header of tens of MB)."""
    lengths = torch.tensor([0] + [len(x) for x in lists], dtype=torch.int64)
    return {"values": torch.tensor([v for x in lists for v in x], dtype=torch.int64),
            "offsets": torch.cumsum(lengths, 0)}


def unpack_ragged(packed: dict[str, torch.Tensor]) -> list[list[int]]:
    """Inverse of :func:`pack_ragged`."""
    values, offsets = packed["values"].tolist(), packed["offsets"].tolist()
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


class ExclFeaturesError(EmbeddingCacheError):
    """An ExclMM features file that cannot be read; the message says to delete it and rerun."""


def save_features(path: Path, feats: dict[str, Any]) -> Path:
    """Write :func:`prepare_features`'s dict as one cache entry: tensors (ragged lists as
    ``<name>.values`` / ``<name>.offsets``) in ``path``, everything else in its ``.json``, last."""
    tensors, record = {}, {"format": FEATURES_FORMAT}
    for key, value in feats.items():
        if key in RAGGED:
            tensors.update({f"{key}.{part}": t for part, t in pack_ragged(value).items()})
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            record[key] = value
    write_entry(Path(path).with_suffix(""), tensors, record)
    return Path(path)


def features_record(path: str | Path) -> dict[str, Any] | None:
    """The json record of the features at ``path`` (the done-marker, written last), or None."""
    return read_record(entry_paths(Path(path).with_suffix(""))[1], ExclFeaturesError, FEATURES_FIX)


def load_features(path: str | Path, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dict :func:`prepare_features` returns, read from ``path`` (tensors on the CPU);
    ``record``: its json record when the caller already read it."""
    path = Path(path)
    record = record if record is not None else features_record(path)
    if record is None:  # written before the one cache: the JSON lives inside the safetensors file
        tree = load_earlier_features(path, FEATURES_FIX)
        return {k: unpack_ragged(v) if k in RAGGED else v for k, v in tree.items()}
    tensors = read_tensors(path, ExclFeaturesError, "ExclMM features", FEATURES_FIX)
    feats = {k: v for k, v in record.items() if k != "format"}
    for key, value in tensors.items():
        name, _, part = key.partition(".")
        if part:
            feats.setdefault(name, {})[part] = value
        else:
            feats[key] = value
    return {k: unpack_ragged(v) if k in RAGGED else v for k, v in feats.items()}


@torch.no_grad()
def encode_texts(backbone: FrozenCLIP, texts: list[str], batch_size: int) -> torch.Tensor:
    """(len(texts), D) L2-normalised pooled CLIP text embeddings, float32 on CPU."""
    out = [F.normalize(backbone.encode_text(texts[i:i + batch_size]).pooled.float(), dim=-1).cpu()
           for i in range(0, len(texts), batch_size)]
    return torch.cat(out) if out else torch.zeros(0, backbone.embed_dim)


def word_index(sentences: list[str], vocab: dict[str, int]) -> list[list[int]]:
    """Per sentence, the vocabulary indices of its words (Eq. 5's average runs over them)."""
    return [[vocab[w] for w in words_of(s) if w in vocab] for s in sentences]


def _reusable(path: Path, identity: dict[str, Any], train: Any) -> tuple[str | None, dict[str, Any] | None]:
    """(why the features at ``path`` must be recomputed, or None; the features when they are reusable).

    Decided from the json record alone (the tensors are read only when they will be used); tensors
    without a record are a run stopped before its done-marker (recomputed), or the earlier single-file
    layout; a damaged file is one error saying how to rebuild it."""
    record = features_record(path)
    if record is None:
        try:
            feats = load_features(path, record)
        except StateFileError:
            read_tensors(path, ExclFeaturesError, "ExclMM features", FEATURES_FIX)  # damaged: that error, as before
            return "has no record (a run stopped before writing it)", None  # whole tensors, no done-marker
        record = earlier_record(feats)
    else:
        feats = None
    why = (stale_reason(record, (FEATURES_FORMAT, *EARLIER_FORMATS)) or backbone_mismatch(record.get("backbone"), identity)
           or (None if record.get("train") == train else f"was made for data.train={record.get('train')}"))
    if why is None and feats is None:
        feats = load_features(path, record)
    missing = [k for k in REQUIRED if feats is not None and k not in feats]
    if why is None and missing:
        why = f"lacks {', '.join(missing)} (written by an earlier version)"
    return why, feats


def _read_captions(data_cfg: Any, data: dict[str, Any], row: dict[str, int]) -> tuple[list[dict], list[str]]:
    """The COCO captions of the split's images (``data.captions``, else the file the split was built
    from) and their texts, stripped; ``row``: image id -> its row."""
    captions_path = Path(data_cfg.captions or data["source"]["captions"])
    if not captions_path.is_file():
        raise MissingInputError(f"captions file {captions_path} not found; set data.captions to the COCO "
                                f"captions_{{split}}.json of the training split")
    caps = [c for c in load_coco(captions_path, CAPTION_FIELDS)["annotations"] if str(c["image_id"]) in row]
    return caps, [c["caption"].strip() for c in caps]


def prepare_features(data_cfg: Any, backbone: FrozenCLIP, run_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Frozen CLIP features of everything training reads, computed once (``features.safetensors``).

    data_cfg: the ``data`` section of the ExclMM config (``ExclDataConfig``: train, captions,
    cache_dir, encode_batch_size).

    Returns a dict: ``images`` (I, D) normalised, ``image_ids``; ``captions`` (C, D) and
    ``caption_image`` (C,) row of each caption's image, ``caption_words``; ``vocab`` (word list)
    and ``word_vectors`` (V, D) -- each word's pooled CLIP text embedding, alone, normalised;
    ``queries`` (Q, D), ``query_words``, ``query_truth`` (lists of image rows), ``query_positive`` (Q,);
    ``positive_queries`` (Q, D) and ``positive_words``: each query's positive caption (Eq. 16's cp).
    """
    path = run_dir / FEATURES_NAME
    identity = cache_identity(backbone)
    if path.is_file():
        why, feats = _reusable(path, identity, data_cfg.train)
        if why is None:
            return feats
        log.warning("%s %s; recomputing", path, why)
    if not data_cfg.train:
        raise InputError("data.train is empty: give the ExclCOCO folder of the training split "
                         "(python -m demind.cli.build_exclcoco ...)")
    data, files = load_exclcoco(data_cfg.train)
    image_ids = list(files)
    row = {i: k for k, i in enumerate(image_ids)}
    cache_root = Path(data_cfg.cache_dir or run_dir / "feature_cache")
    cache = ImageFeatureCache.for_backbone(cache_root, backbone, "exclcoco", data.get("split", "train"))
    refs = [ImageRef(i, p) for i, p in files.items()]
    raw, _ = encode_image_refs(backbone, refs, cache, "gallery", data_cfg.encode_batch_size, progress=progress,
                               desc="exclmm train images")
    images = F.normalize(torch.stack([raw[i] for i in image_ids]).float(), dim=-1)

    caps, caption_texts = _read_captions(data_cfg, data, row)
    queries = data["queries"]
    vocab = sorted({w for s in caption_texts + [t for q in queries for t in (q["query"], q["positive_query"])]
                    for w in words_of(s)})
    bs = data_cfg.encode_batch_size
    log.info("exclmm features: %d images, %d captions, %d queries, %d words", len(image_ids), len(caps),
             len(queries), len(vocab))
    vindex = {w: k for k, w in enumerate(vocab)}
    feats = {
        "backbone": identity, "train": data_cfg.train, "image_ids": image_ids, "images": images,
        "captions": encode_texts(backbone, caption_texts, bs),
        "caption_image": torch.tensor([row[str(c["image_id"])] for c in caps], dtype=torch.int64),
        "caption_words": word_index(caption_texts, vindex),
        "vocab": vocab, "word_vectors": encode_texts(backbone, vocab, bs),
        "queries": encode_texts(backbone, [q["query"] for q in queries], bs),
        "query_words": word_index([q["query"] for q in queries], vindex),
        # the positive query (the caption the exclusion query was made from): spar_cp of Eq. 16
        "positive_queries": encode_texts(backbone, [q["positive_query"] for q in queries], bs),
        "positive_words": word_index([q["positive_query"] for q in queries], vindex),
        "query_truth": [[row[i] for i in q["ground_truth"]] for q in queries],
        "query_positive": torch.tensor([row[q["image_id"]] for q in queries], dtype=torch.int64),
    }
    save_features(path, feats)
    return feats
