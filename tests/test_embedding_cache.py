"""The one embedding cache (demind.embedding_cache): a training feature cache, an evaluation gallery
and a search index built on the same images with the same backbone share the key rule and the
stored vectors, each refuses another backbone's cache with the same message, parts written before
still load, and compaction writes only the live rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from toyworld.synthetic import write_synthetic_shards
from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig
from demind.embedding_cache import EmbeddingCacheError, cache_identity, cache_slug, map_tensor, write_entry
from demind.features import FeatureCacheError, ShardFeatureCache, build_feature_cache
from demind.retrieval import ImageFeatureCache, ImageRef, encode_image_refs
from demind.search.index import build_index, check_index_backbone, list_gallery_images, load_index
from demind.search.index_manifest import GalleryIndexError
from helpers import TINY_CLIP

pytestmark = pytest.mark.usefixtures("one_thread_and_fresh_accelerator")

MISMATCH = re.compile(r"was made with backbone .* but this run uses .* \(differs in [^)]*\)")


@pytest.fixture(scope="module")
def other_backbone(tiny_backbone, tmp_path_factory) -> FrozenCLIP:
    """The tiny CLIP with other weights (from a file): another identity (``pretrained: sha256:...``)."""
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in tiny_backbone.model.state_dict().items()}
    weights = tmp_path_factory.mktemp("other") / "other-weights.pt"
    torch.save(state, weights)
    return FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(weights)))


@pytest.fixture()
def three_caches(tmp_path, tiny_backbone):
    """One folder of shards encoded three ways by one backbone: training cache, eval gallery, search index."""
    shards_dir = tmp_path / "shards"
    write_synthetic_shards(shards_dir, num_shards=2, samples_per_shard=4)
    shards = sorted(str(p) for p in shards_dir.glob("*.tar"))
    train_dir = tmp_path / "train" / cache_slug(tiny_backbone)
    build_feature_cache(shards, train_dir, tiny_backbone, batch_size=4, num_workers=0, progress=False)
    refs, bad = list_gallery_images(shards_dir)
    assert not bad and len(refs) == 8
    gallery = ImageFeatureCache.for_backbone(tmp_path / "eval", tiny_backbone, "bench", "val")
    raw, stats = encode_image_refs(tiny_backbone, refs, gallery, batch_size=4, progress=False)
    assert stats.encoded == 8
    build_index(shards_dir, tmp_path / "index", tiny_backbone, batch_size=4, part_size=4, progress=False)
    return dict(shards=shards, shards_dir=shards_dir, train=train_dir, gallery=gallery, refs=refs, raw=raw,
                index=tmp_path / "index")


def test_training_cache_eval_gallery_and_search_index_share_the_key_rule_and_vectors(three_caches, tiny_backbone):
    c = three_caches
    key = cache_identity(tiny_backbone)
    slug = cache_slug(tiny_backbone)
    # one key: every record names the same identity, every folder the same slug
    shard_records = [json.loads(p.read_text()) for p in sorted(c["train"].glob("*.json"))]
    assert [r["backbone"] for r in shard_records] == [key, key]
    assert c["train"].name == slug and c["gallery"].dir.parts[-3] == slug
    assert {json.loads(p.read_text())["backbone"] == key for p in (c["gallery"].dir / "gallery").glob("*.json")} == {True}
    backbone_json = json.loads((c["index"] / "backbone.json").read_text())
    assert backbone_json["identity"] == key and backbone_json["slug"] == slug
    assert {json.loads(p.read_text())["backbone"] == key for p in (c["index"] / "embeddings").glob("*.json")} == {True}
    # one vector per image: the three caches hold the same embeddings (same decoder, same tower)
    cache = ShardFeatureCache(c["train"], key)
    train = torch.stack([s["image_emb"] for shard in c["shards"] for s in cache.samples(shard)])
    gallery = torch.stack([c["raw"][r.name] for r in c["refs"]])
    index = load_index(c["index"])
    assert index.names == [r.name for r in c["refs"]]
    assert torch.allclose(train, gallery, atol=1e-5)
    assert torch.allclose(index.features.float(), F.normalize(gallery, dim=-1), atol=2e-3)


def test_each_refuses_another_backbones_cache_with_the_same_message(three_caches, other_backbone):
    c = three_caches
    messages = []
    with pytest.raises(FeatureCacheError) as info:
        ShardFeatureCache.find(c["train"], c["shards"], cache_identity(other_backbone), required=True)
    messages.append(str(info.value))
    with pytest.raises(EmbeddingCacheError) as info:
        encode_image_refs(other_backbone, c["refs"], c["gallery"], progress=False)
    messages.append(str(info.value))
    with pytest.raises(GalleryIndexError) as info:
        build_index(c["shards_dir"], c["index"], other_backbone, progress=False)
    messages.append(str(info.value))
    with pytest.raises(GalleryIndexError) as info:
        check_index_backbone(load_index(c["index"]), other_backbone)
    messages.append(str(info.value))
    found = [MISMATCH.search(m) for m in messages]
    assert all(found), messages
    assert len({m.group(0) for m in found}) == 1  # word for word the same refusal
    assert "differs in pretrained random:" in found[0].group(0) and "!= sha256:" in found[0].group(0)
    # each names where the cache is and the command that rebuilds it
    assert str(c["train"]) in messages[0] and "python -m demind.features" in messages[0]
    assert str(c["gallery"].dir) in messages[1] and "encode its images again" in messages[1]
    assert str(c["index"]) in messages[2] and "rebuild it" in messages[2]
    assert "demind-index --images" in messages[3]


def test_parts_and_indexes_written_before_the_one_cache_still_load(tmp_path, tiny_backbone):
    """Legacy torch.save parts (``part-*.pt``), a legacy eval folder (``<identity>-<precision>``) and
    a legacy index (backbone.json with that slug, the identity without the precision) load."""
    from demind.retrieval.cache_upgrade import legacy_image_slug, read_part  # the legacy readers

    root = tmp_path / "images"
    build_index_images(root, 5)
    refs, _ = list_gallery_images(root)
    fresh, _ = encode_image_refs(tiny_backbone, refs, None, progress=False)
    legacy = ImageFeatureCache(tmp_path / "eval", legacy_image_slug(tiny_backbone), "bench", "val")
    (legacy.dir / "gallery").mkdir(parents=True)
    torch.save({"names": [r.name for r in refs], "keys": [r.cache_key for r in refs],
                "features": torch.stack([fresh[r.name] for r in refs])}, legacy.dir / "gallery" / "part-00000.pt")
    cache = ImageFeatureCache.for_backbone(tmp_path / "eval", tiny_backbone, "bench", "val")
    assert cache.dir == legacy.dir
    again, stats = encode_image_refs(tiny_backbone, refs, cache, progress=False)
    assert stats.as_dict() == {"images": 5, "cached": 5, "encoded": 0}
    assert all(torch.equal(again[n], fresh[n]) for n in fresh)

    # an index of the earlier layout: .pt parts, old slug, identity without the precision
    index_dir = tmp_path / "old-index"
    build_index(root, index_dir, tiny_backbone, part_size=3, progress=False)
    new = load_index(index_dir)
    pairs = []
    for record_path in sorted((index_dir / "embeddings").glob("part-*.json")):
        record = json.loads(record_path.read_text())
        tensors = record_path.with_suffix(".safetensors")
        features = map_tensor(tensors, "features", EmbeddingCacheError, "part", "").float() * 3  # raw: not unit
        torch.save({"names": record["names"], "keys": record["keys"], "features": features},
                   record_path.with_suffix(".pt"))
        pairs += [[n, k] for n, k in zip(record["names"], record["keys"])]
        record_path.unlink()
        tensors.unlink()
    old_slug = legacy_image_slug(tiny_backbone)
    (index_dir / "backbone.json").write_text(json.dumps({"identity": tiny_backbone.identity, "slug": old_slug,
                                                         "precision": "fp32", "embed_dim": 32}))
    manifest = json.loads((index_dir / "index.json").read_text())
    for key in ("parts", "dtype"):
        del manifest[key]
    manifest.update(format="demind-index/1", backbone=tiny_backbone.identity, backbone_slug=old_slug, images=pairs)
    (index_dir / "index.json").write_text(json.dumps(manifest))
    assert read_part(sorted((index_dir / "embeddings").glob("part-*.pt"))[0])["features"].shape == (3, 32)
    old = load_index(index_dir)
    assert old.names == new.names and torch.allclose(old.features, new.features, atol=1e-3)
    check_index_backbone(old, tiny_backbone)  # the same backbone: accepted
    # the next build reuses every row and rewrites the index in the current layout
    assert build_index(root, index_dir, tiny_backbone, part_size=3, progress=False).encoded == 0
    assert not list((index_dir / "embeddings").glob("*.pt"))
    assert json.loads((index_dir / "index.json").read_text())["format"] == "demind-index/2"
    rewritten = load_index(index_dir)
    assert rewritten.names == new.names and torch.allclose(rewritten.features, new.features, atol=1e-3)


def build_index_images(folder: Path, count: int, start: int = 0) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"img{i:02d}.png")


def test_compaction_after_removing_files_writes_only_the_live_rows(tmp_path, tiny_backbone):
    """The old compaction defect: a part saved from a row slice held the whole matrix (10 parts: 10x the bytes)."""
    root = tmp_path / "images"
    build_index_images(root, 16)
    build_index(root, tmp_path / "idx", tiny_backbone, part_size=8, progress=False)
    before = load_index(tmp_path / "idx")
    for i in (1, 6, 12):
        (root / f"img{i:02d}.png").unlink()
    stats = build_index(root, tmp_path / "idx", tiny_backbone, part_size=8, progress=False)
    assert (stats.removed, stats.encoded, stats.indexed) == (3, 0, 13)
    after = load_index(tmp_path / "idx")
    tensor_files = sorted((tmp_path / "idx" / "embeddings").glob("part-*.safetensors"))
    rows = sum(map_tensor(p, "features", EmbeddingCacheError, "part", "").shape[0] for p in tensor_files)
    stored = map_tensor(tensor_files[0], "features", EmbeddingCacheError, "part", "")
    row_bytes = rows * stored.shape[1] * stored.element_size()
    assert rows == 13 and len(tensor_files) == 2
    written = sum(p.stat().st_size for p in tensor_files)
    assert written <= 1.2 * row_bytes, (written, row_bytes)
    records = sorted((tmp_path / "idx" / "embeddings").glob("part-*.json"))
    assert sum(len(json.loads(p.read_text())["names"]) for p in records) == 13
    # the live features are unchanged
    old_row = {n: i for i, n in enumerate(before.names)}
    assert torch.equal(after.features, before.features[[old_row[n] for n in after.names]])


def test_an_entry_holds_exactly_its_rows_and_a_damaged_one_is_one_error(tmp_path):
    matrix = torch.randn(100, 16)
    tensors, record = write_entry(tmp_path / "part", {"features": matrix[10:20]}, {"format": "x"})
    assert tensors.stat().st_size < 10 * 16 * 4 + 200  # not the whole (100, 16) storage
    assert torch.equal(map_tensor(tensors, "features", EmbeddingCacheError, "part", ""), matrix[10:20])
    assert json.loads(record.read_text()) == {"format": "x"}
    tensors.write_bytes(tensors.read_bytes()[:200])
    with pytest.raises(EmbeddingCacheError, match=r"part .*part\.safetensors is truncated or corrupted.*; rebuild"):
        map_tensor(tensors, "features", EmbeddingCacheError, "part", "rebuild")


def test_random_access_advice_on_a_mapped_tensor_keeps_its_values(tmp_path):
    """advise_random_access (faiss-ivfpq's mapped rows): taken by the OS on Linux, values unchanged."""
    import sys

    from demind.embedding_cache import advise_random_access

    rows = torch.randn(300, 16)
    write_entry(tmp_path / "part", {"features": rows}, {"rows": 300})
    mapped = map_tensor(tmp_path / "part.safetensors", "features", EmbeddingCacheError, "part", "")
    taken = advise_random_access(mapped)
    assert taken if sys.platform.startswith("linux") else taken in (True, False)
    assert torch.equal(mapped, rows) and advise_random_access(torch.zeros(0)) is False
