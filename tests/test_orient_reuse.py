"""Upgrading to EXIF-oriented decoding re-encodes only the images it turns.

Keys of ``orient`` refs end in ``|orient``; an index or cache written before holds the same
images under the key without it. Such an entry is reused exactly when the file has no EXIF
orientation or 1 (read from its header, :func:`demind.imaging.orientation_changes_pixels`), and
is recorded under the new key so that the next run reads no header; an image stored rotated was
encoded sideways and is encoded again.
"""

from __future__ import annotations

import io
import logging
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile

import demind.retrieval.refs as refs_module
import demind.search.index as index_module
from demind.embedding_cache import cache_identity
from demind.imaging import decode_image, orientation_changes_pixels
from demind.retrieval import ImageFeatureCache, ImageRef, encode_image_refs
from demind.retrieval.refs import orientation_changes
from demind.search.index import build_index, list_gallery_images, load_index
from test_search import one_torch_thread  # noqa: F401  (module fixture: one torch thread)

REUSED = "images reused from before EXIF orientation was applied (no orientation tag)"


def photo_bytes(seed: int, orientation: int | None = None, fmt: str = "JPEG", xmp: bytes | None = None) -> bytes:
    """A 40 x 24 noise image (not square: a rotation changes what the backbone sees)."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    options = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif
    if xmp is not None:
        options["xmp"] = xmp
    out = io.BytesIO()
    image.save(out, fmt, quality=95, **options) if fmt == "JPEG" else image.save(out, fmt, **options)
    return out.getvalue()


def png_chunks(data: bytes) -> list[bytes]:
    chunks, at = [], 8
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        chunks.append(data[at:at + length + 12])
        at += length + 12
    return chunks


def png_exif_after_pixels(orientation: int) -> bytes:
    """A PNG whose eXIf chunk follows its IDAT (allowed by the first PNG EXIF extension): Pillow
    finds it only when it decodes the image."""
    data = photo_bytes(3, orientation, "PNG")
    chunks = png_chunks(data)
    exif = [c for c in chunks if c[4:8] == b"eXIf"]
    rest = [c for c in chunks if c[4:8] != b"eXIf"]
    assert len(exif) == 1 and rest[-1][4:8] == b"IEND"
    return data[:8] + b"".join(rest[:-1] + exif + rest[-1:])


def decoder_turns(data: bytes) -> bool:
    return not np.array_equal(np.asarray(decode_image(data, orient=True)), np.asarray(decode_image(data)))


@pytest.fixture()
def pixel_loads(monkeypatch) -> list[int]:
    """Counts Pillow's pixel decodes (``ImageFile.load``) while a test runs."""
    calls = [0]
    real = ImageFile.ImageFile.load

    def counting(self):
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return calls


XMP_ROTATED = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
               b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [None, 1, 3, 6, 8, 9])
def test_header_check_agrees_with_the_decoder_and_decodes_no_pixel(fmt, orientation, pixel_loads):
    data = photo_bytes(0, orientation, fmt)
    changes = orientation_changes_pixels(data)
    assert pixel_loads[0] == 0  # the header alone
    assert changes == (orientation in (3, 6, 8))
    assert changes == decoder_turns(data)


def test_xmp_orientation_counts_and_a_file_path_is_read(tmp_path, pixel_loads):
    path = tmp_path / "xmp.jpg"
    path.write_bytes(photo_bytes(1, xmp=XMP_ROTATED))
    upright = tmp_path / "upright.jpg"
    upright.write_bytes(photo_bytes(1))
    assert orientation_changes_pixels(path) is True and orientation_changes_pixels(str(upright)) is False
    assert pixel_loads[0] == 0
    assert decoder_turns(path.read_bytes())


@pytest.mark.parametrize("orientation", [1, 6])
def test_png_exif_after_its_pixels_is_found(orientation):
    data = png_exif_after_pixels(orientation)
    assert orientation_changes_pixels(data) == (orientation == 6) == decoder_turns(data)


def test_unreadable_sources_answer_changes(tmp_path):
    assert orientation_changes_pixels(b"not an image") is True
    assert orientation_changes_pixels(tmp_path / "missing.jpg") is True
    shard = tmp_path / "cut.tar"
    shard.write_bytes(b"\0" * 100)
    assert orientation_changes(ImageRef(name="cut.tar/a.jpg", path=shard, span=(50, 500), orient=True)) is True


# --------------------------------------------------------------------------- the search index

ROTATED = {"turned.jpg", "shard.tar/side.jpg"}


def make_gallery(folder: Path, rotated: bool = True) -> Path:
    """Four upright files (no tag, tag 1, a PNG) and a tar shard; with ``rotated``, a phone photo
    stored turned (tag 6) and a shard member stored turned (tag 8)."""
    folder.mkdir(parents=True)
    (folder / "plain.jpg").write_bytes(photo_bytes(10))
    (folder / "normal.jpg").write_bytes(photo_bytes(11, 1))
    (folder / "shot.png").write_bytes(photo_bytes(12, fmt="PNG"))
    members = {"up.jpg": photo_bytes(13)}
    if rotated:
        (folder / "turned.jpg").write_bytes(photo_bytes(14, 6))
        members["side.jpg"] = photo_bytes(15, 8)
    with tarfile.open(folder / "shard.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder


def build_before_orientation(monkeypatch, gallery: Path, index: Path, backbone) -> None:
    """An index as demind-index built it before ``ImageRef.orient``: decoded as stored, keys without ``|orient``."""
    real = list_gallery_images

    def unoriented(folder, *args, **kwargs):
        refs, bad = real(folder, *args, **kwargs)
        return [replace(r, orient=False) for r in refs], bad

    with monkeypatch.context() as patch:
        patch.setattr(index_module, "list_gallery_images", unoriented)
        build_index(gallery, index, backbone, progress=False, part_size=4)
    keys = [k for _, record in ImageFeatureCache.at(index).records("embeddings") for k in record["keys"]]
    assert keys and not any("|orient" in k for k in keys)


def rows(index: Path) -> dict[str, torch.Tensor]:
    loaded = load_index(index)
    return dict(zip(loaded.names, loaded.features))


@pytest.fixture()
def header_reads(monkeypatch) -> list[str]:
    """The sources whose EXIF header the cache lookup reads."""
    seen = []
    real = refs_module.orientation_changes_pixels

    def counting(source):
        seen.append(source)
        return real(source)

    monkeypatch.setattr(refs_module, "orientation_changes_pixels", counting)
    return seen


def test_upgrading_an_index_encodes_only_the_rotated_images(tmp_path, tiny_backbone, monkeypatch, header_reads,
                                                              caplog):
    gallery, index = make_gallery(tmp_path / "photos"), tmp_path / "index"
    build_before_orientation(monkeypatch, gallery, index, tiny_backbone)
    before = rows(index)
    assert len(before) == 6 and not header_reads

    with caplog.at_level(logging.INFO, logger="demind.retrieval.cache"):
        stats = build_index(gallery, index, tiny_backbone, progress=False, part_size=4)
    assert (stats.encoded, stats.cached, stats.indexed) == (2, 4, 6)
    assert len(header_reads) == 6  # one header per image held under its old key, no more
    assert sum(f"4 {REUSED}" in r.getMessage() for r in caplog.records) == 1
    after = rows(index)
    for name in set(before) - ROTATED:
        assert torch.equal(after[name], before[name]), name  # the very row, not a re-encoding
    refs = [r for r in list_gallery_images(gallery)[0] if r.name in ROTATED]
    fresh, _ = encode_image_refs(tiny_backbone, refs, None, progress=False)
    for name in ROTATED:
        expected = F.normalize(fresh[name].float(), dim=-1).half().float()
        assert torch.allclose(after[name], expected, atol=2e-3), name  # encoded upright now
        assert (after[name] - before[name]).abs().max() > 0.02, name  # it was sideways before (10x the tolerance)
    keys = [k for _, record in ImageFeatureCache.at(index).records("embeddings") for k in record["keys"]]
    assert len(keys) == 6 and all("|orient" in k for k in keys)  # compacted: no stale sideways row is kept

    header_reads.clear()
    again = build_index(gallery, index, tiny_backbone, progress=False, part_size=4)
    assert (again.encoded, again.cached) == (0, 6) and not header_reads
    assert all(torch.equal(rows(index)[n], after[n]) for n in after)


def test_an_upright_gallery_keeps_its_rows_and_only_records_are_rewritten(tmp_path, tiny_backbone, monkeypatch,
                                                                          header_reads):
    gallery, index = make_gallery(tmp_path / "photos", rotated=False), tmp_path / "index"
    build_before_orientation(monkeypatch, gallery, index, tiny_backbone)
    before = rows(index)
    tensor_files = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (index / "embeddings").glob("*.safetensors")}

    stats = build_index(gallery, index, tiny_backbone, progress=False, part_size=4)
    assert (stats.encoded, stats.cached) == (0, 4) and len(header_reads) == 4
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes())
            for p in (index / "embeddings").glob("*.safetensors")} == tensor_files  # no row read or written
    assert all(torch.equal(rows(index)[n], before[n]) for n in before)
    header_reads.clear()
    assert build_index(gallery, index, tiny_backbone, progress=False, part_size=4).encoded == 0 and not header_reads


def test_a_distributed_build_ships_only_the_rotated_images(tmp_path, tiny_backbone, monkeypatch, header_reads):
    gallery, index = make_gallery(tmp_path / "photos"), tmp_path / "index"
    build_before_orientation(monkeypatch, gallery, index, tiny_backbone)
    shipped = []

    def encode_missing(refs, cache):  # as demind.search.ray_index does: encode elsewhere, write parts here
        shipped.extend(r.name for r in refs)
        features, _ = encode_image_refs(tiny_backbone, refs, None, progress=False)
        cache.write_part("embeddings", [r.name for r in refs], [r.cache_key for r in refs],
                         cache.stored(torch.stack([features[r.name] for r in refs])), cache_identity(tiny_backbone))
        return len(refs), {}

    stats = build_index(gallery, index, tiny_backbone, progress=False, part_size=4, encode_missing=encode_missing)
    assert set(shipped) == ROTATED  # the upright ones were adopted before anything was shipped
    assert len(header_reads) == 6  # once each: the local pass finds every image under its new key
    assert (stats.encoded, stats.cached, stats.indexed) == (2, 4, 6)


def test_an_evaluation_cache_reuses_its_raw_features(tmp_path, tiny_backbone, header_reads):
    folder = make_gallery(tmp_path / "photos")
    refs = [ImageRef(name=p.name, path=p) for p in sorted(folder.glob("*.*g"))]
    cache = ImageFeatureCache(tmp_path / "cache", "tiny", "photos", "all")
    old, first = encode_image_refs(tiny_backbone, refs, cache, progress=False)
    assert first.encoded == 4
    oriented = [replace(r, orient=True) for r in refs]
    new, stats = encode_image_refs(tiny_backbone, oriented, cache, progress=False)
    assert (stats.cached, stats.encoded) == (3, 1) and len(header_reads) == 4
    assert all(torch.equal(new[n], old[n]) for n in old if n != "turned.jpg")
    header_reads.clear()
    _, third = encode_image_refs(tiny_backbone, oriented, cache, progress=False)
    assert (third.cached, third.encoded) == (4, 0) and not header_reads
