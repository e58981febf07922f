"""Journeys across boundaries, as a new user meets them: photos from a phone, a tar with a repeated
name, a model published on one machine and loaded on another, an editor's config, a malformed
reference. Each test is one such case and failed on the code before it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import REPO_ROOT, TINY_CLIP, write_cirr_layout


# --------------------------------------------------------------------------- configs from other editors


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, capsys):
    from demind.cli.index import main

    config = tmp_path / "latin1.yaml"
    config.write_bytes("run:\n  device: cpu  # r\xe9glage\n".encode("latin-1"))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert "latin1.yaml" in err and "UTF-8" in err


def test_a_yaml_config_repeating_a_key_is_refused_naming_key_file_and_lines(tmp_path):
    from demind.cli.search import SearchConfig
    from demind.config import ConfigError, load_config

    config = tmp_path / "twice.yaml"
    config.write_text("k: 5\nrun:\n  device: cpu\nk: 7\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml.*'k' appears twice \(lines 1 and 4\)"):
        load_config(SearchConfig, config)
    config.write_text("run:\n  device: cpu\n  device: cuda\n")
    with pytest.raises(ConfigError, match=r"'device' appears twice \(lines 2 and 3\)"):
        load_config(SearchConfig, config)


def test_yaml_merge_keys_read_as_pyyaml_reads_them():
    import yaml

    from demind.config import _UniqueKeyLoader

    text = "a: &a {k: 1, j: 2}\nb:\n  <<: *a\n  k: 3\n"  # a merged key overridden is no repeat
    assert yaml.load(text, Loader=_UniqueKeyLoader) == yaml.safe_load(text) == {"a": {"k": 1, "j": 2},
                                                                                "b": {"k": 3, "j": 2}}


# --------------------------------------------------------------------------- malformed references


@pytest.mark.parametrize("revision", ["/etc", "../../x", "a\x01b", "main/", "a..b", "x y", "a:b"])
def test_a_hub_revision_outside_the_ref_grammar_names_the_setting(revision):
    from demind.hubref import HubError, parse_hub_ref

    with pytest.raises(HubError, match=r"^checkpoint=.*revision after '@'"):
        parse_hub_ref(f"hf-hub:a/b@{revision}", "checkpoint")


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "0123456789abcdef0123456789abcdef01234567"])
def test_git_refs_and_commits_stay_valid_revisions(revision):
    from demind.hubref import parse_hub_ref

    assert parse_hub_ref(f"hf-hub:a/b@{revision}", "checkpoint").revision == revision


# --------------------------------------------------------------------------- photos as a viewer shows them


def halves(width: int = 48, height: int = 24) -> np.ndarray:
    """(height, width, 3) uint8: left half red, right half blue, a green top row (so every
    rotation and flip is told apart)."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (255, 0, 0)
    pixels[:, width // 2:] = (0, 0, 255)
    pixels[:6] = (0, 255, 0)
    return pixels


def phone_jpeg(path: Path) -> Path:
    """A JPEG stored as phones store portrait photos: landscape pixels, EXIF orientation 6
    (a viewer rotates it 90 degrees clockwise)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(halves()).save(path, quality=95, exif=exif)
    return path


def test_an_exif_rotated_jpeg_decodes_as_a_viewer_shows_it(tmp_path):
    from demind.imaging import decode_image

    path = phone_jpeg(tmp_path / "portrait.jpg")
    upright = decode_image(path, orient=True)
    assert upright.size == (24, 48)  # portrait, as shown
    pixels = np.asarray(upright).astype(int)
    # rotated clockwise: the green top row is now the right column, red (left) is now on top
    assert pixels[5, 22, 1] > 180 and pixels[5, 22, 0] < 80, pixels[5, 22]
    assert pixels[10, 10, 0] > 200 and pixels[40, 10, 2] > 200
    assert decode_image(path, orient=False).size == (48, 24)  # benchmarks keep their protocol's decoding
    assert decode_image(path.read_bytes(), orient=True).size == (24, 48)


def test_a_16_bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    from demind.imaging import decode_image

    grey8 = np.tile(np.arange(0, 256, dtype=np.uint16), (8, 1))  # 0..255 ramps
    wide = Image.fromarray((grey8 * 257).astype(np.uint16))  # mode I;16
    wide.save(tmp_path / "deep.png")
    Image.fromarray(grey8.astype(np.uint8)).save(tmp_path / "eight.png")
    reopened = Image.open(tmp_path / "deep.png")
    assert reopened.mode in ("I;16", "I")  # a real 16-bit PNG, as Pillow opens it
    deep = np.asarray(decode_image(tmp_path / "deep.png")).astype(int)
    eight = np.asarray(decode_image(tmp_path / "eight.png")).astype(int)
    assert abs(deep.mean() - eight.mean()) < 1.0, (deep.mean(), eight.mean())  # not ~251: scaled, not clipped
    assert np.abs(deep - eight).max() <= 1


def test_a_multi_frame_gif_gives_its_first_frame(tmp_path):
    from demind.imaging import decode_image

    frames = [Image.fromarray(np.full((8, 8, 3), c, dtype=np.uint8)) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    assert tuple(np.asarray(decode_image(tmp_path / "anim.gif"))[4, 4]) == (255, 0, 0)


# --------------------------------------------------------------------------- a folder of phone photos, indexed


@pytest.fixture(scope="module")
def tiny_backbone():
    import torch

    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None, seed=3))
    torch.set_num_threads(threads)


def indexed_feature(index, name: str):
    return index.features[index.names.index(name)]


def test_the_index_encodes_and_shows_phone_photos_upright(tmp_path, tiny_backbone):
    from demind.imaging import decode_image
    from demind.retrieval import load_image
    from demind.search.index import build_index, load_index

    gallery = tmp_path / "photos"
    phone_jpeg(gallery / "portrait.jpg")
    decode_image(gallery / "portrait.jpg", orient=True).save(gallery / "upright.png")  # the same pixels, no EXIF
    decode_image(gallery / "portrait.jpg", orient=False).save(gallery / "sideways.png")
    build_index(gallery, tmp_path / "index", tiny_backbone, num_workers=0, progress=False)
    index = load_index(tmp_path / "index")
    portrait = indexed_feature(index, "portrait.jpg")
    assert float(portrait @ indexed_feature(index, "upright.png")) > 0.99999
    assert float(portrait @ indexed_feature(index, "sideways.png")) < 0.9999  # the test can tell them apart
    assert load_image(index.image_ref("portrait.jpg")).size == (24, 48)  # the thumbnail is upright too


def test_an_index_moved_with_its_images_finds_them_and_one_moved_alone_keeps_the_recorded_folder(
        tmp_path, tiny_backbone):
    import shutil

    from demind.retrieval import load_image
    from demind.search.index import build_index, load_index

    project = tmp_path / "project"
    phone_jpeg(project / "photos" / "portrait.jpg")
    build_index(project / "photos", project / "index", tiny_backbone, num_workers=0, progress=False)
    assert "project" not in json.loads((project / "index" / "index.json").read_text())["root_relative"]
    moved = tmp_path / "elsewhere" / "project"
    shutil.move(str(project), str(moved))  # another machine: the recorded absolute folder is gone
    index = load_index(moved / "index")
    assert index.root == (moved / "photos").resolve()
    assert load_image(index.image_ref("portrait.jpg")).size == (24, 48)
    stats = build_index(moved / "photos", moved / "index", tiny_backbone, num_workers=0, progress=False)
    # the moved pair updates as the same index (no second entry); its image is encoded once more, since a
    # move changes a file's change time, which the file rule holds so that a file replaced with its mtime
    # put back is never answered from the old content (demind.io.file_version)
    assert (stats.cached, stats.encoded, stats.indexed) == (0, 1, 1)
    again = build_index(moved / "photos", moved / "index", tiny_backbone, num_workers=0, progress=False)
    assert (again.cached, again.encoded) == (1, 0)
    shutil.move(str(moved / "index"), str(tmp_path / "index-alone"))  # the index alone: no folder beside it
    assert load_index(tmp_path / "index-alone").root == (moved / "photos").resolve()  # the recorded absolute one


def test_a_reference_photo_is_read_upright_from_a_path_and_from_an_upload(tmp_path):
    from demind.search.query import read_query_image

    path = phone_jpeg(tmp_path / "ref.jpg")
    assert read_query_image(path).size == (24, 48)
    assert read_query_image(path.read_bytes()).size == (24, 48)


def test_generation_inputs_and_training_shards_read_phone_photos_upright(tmp_path):
    from demind.gen.reader import decode_and_shrink

    data = phone_jpeg(tmp_path / "ref.jpg").read_bytes()
    assert decode_and_shrink(data, 64).size == (24, 48)
    assert decode_and_shrink(data, 24).size == (12, 24)  # shrunk after rotation: the long side is the height


def test_every_file_of_an_indexed_folder_is_indexed_or_named_as_skipped(tmp_path, tiny_backbone, capsys):
    """GIF and TIFF are decodable (the page takes GIF uploads): indexed. A caption file is named,
    counted and given its reason; a GIF-only folder is not "0 images"."""
    from demind.cli.index import run
    from demind.cli.index import IndexConfig
    from demind.search.index import build_index, load_index

    gallery = tmp_path / "mixed"
    gallery.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.gif", "b.tif", "c.TIFF", "d.png"):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(gallery / name)
    (gallery / "notes.txt").write_text("a caption")
    (gallery / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    stats = build_index(gallery, tmp_path / "index", tiny_backbone, num_workers=0, progress=False)
    assert sorted(load_index(tmp_path / "index").names) == ["a.gif", "b.tif", "c.TIFF", "d.png"]
    assert stats.skipped == {"clip.mp4": "not an image file (.mp4)", "notes.txt": "not an image file (.txt)"}

    import demind.cli.index as cli

    cli_cfg = IndexConfig(images=str(gallery), index=str(tmp_path / "index-cli"))
    cli_cfg.run.progress = False
    cli_cfg.num_workers = 0
    original = cli.load_model
    cli.load_model = lambda cfg: (tiny_backbone, None)
    try:
        assert run(cli_cfg) == 0
    finally:
        cli.load_model = original
    out = capsys.readouterr().out
    assert "4 images" in out and "2 skipped" in out
    assert "notes.txt: not an image file (.txt)" in out and "clip.mp4: not an image file (.mp4)" in out


def tar_with_members(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def png_bytes(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def solid_png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_repeated_member_name_in_a_shard_never_gives_disagreeing_entries(tmp_path, tiny_backbone):
    """Two members named k0.png: each entry's features are those of the pixels its thumbnail
    shows, and the names are unique (the second is renamed and the rename is said)."""
    import torch

    from demind.retrieval import load_image
    from demind.search.index import build_index, load_index

    gallery = tmp_path / "shards"
    tar_with_members(gallery / "00000.tar", [("k0.png", solid_png((255, 0, 0))), ("k0.txt", b"first"),
                                             ("k0.png", solid_png((0, 0, 255))), ("k1.png", png_bytes(3))])
    build_index(gallery, tmp_path / "index", tiny_backbone, num_workers=0, progress=False)
    index = load_index(tmp_path / "index")
    assert len(index.names) == len(set(index.names)) == 3
    direct = {}
    for name in index.names:
        shown = load_image(index.image_ref(name))
        with torch.no_grad():
            direct[name] = torch.nn.functional.normalize(
                tiny_backbone.encode_image(tiny_backbone.preprocess(shown).unsqueeze(0)), dim=-1)[0]
    firsts = [n for n in index.names if n.startswith("00000.tar/k0.png")]
    assert len(firsts) == 2
    assert not np.array_equal(np.asarray(load_image(index.image_ref(firsts[0]))),
                              np.asarray(load_image(index.image_ref(firsts[1]))))
    for name, other in (firsts, firsts[::-1]):
        # each entry's features are those of the pixels its thumbnail shows, not the other member's
        own, wrong = float(indexed_feature(index, name) @ direct[name]), float(indexed_feature(index, name) @ direct[other])
        assert own > 0.9999 and own - wrong > 1e-3, (name, own, wrong)


# --------------------------------------------------------------------------- the reference's copies


def test_demind_search_leaves_out_pixel_copies_of_the_reference_and_says_so(tmp_path, tiny_backbone, capsys,
                                                                             monkeypatch):
    import shutil

    import demind.cli.search as cli
    from demind.search.index import build_index

    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for seed in range(4):
        (gallery / f"img{seed}.png").write_bytes(png_bytes(seed))
    shutil.copy(gallery / "img2.png", gallery / "holiday-copy.png")
    reference = tmp_path / "elsewhere" / "ref.png"  # the user's own copy, outside the gallery
    reference.parent.mkdir()
    shutil.copy(gallery / "img2.png", reference)
    build_index(gallery, tmp_path / "index", tiny_backbone, num_workers=0, progress=False)
    monkeypatch.setattr(cli, "load_model", lambda cfg: (tiny_backbone, None))
    base = ["--index", str(tmp_path / "index"), "--image", str(reference), "--method", "image-only", "-k", "5"]

    assert cli.main([*base, "--out", str(tmp_path / "dropped.json")]) == 0
    record = json.loads((tmp_path / "dropped.json").read_text())["queries"][0]
    names = [h["name"] for h in record["results"]]
    assert "img2.png" not in names and "holiday-copy.png" not in names and len(names) == 3
    assert sorted(record["duplicates"]) == ["holiday-copy.png", "img2.png"]
    out = capsys.readouterr().out
    assert "left out 2 pixel copy(ies) of the reference" in out and "--keep-reference" in out

    assert cli.main([*base, "--keep-reference", "--out", str(tmp_path / "kept.json")]) == 0
    kept = json.loads((tmp_path / "kept.json").read_text())["queries"][0]
    assert sorted(h["name"] for h in kept["results"][:2]) == ["holiday-copy.png", "img2.png"]
    assert "duplicates" not in kept


# --------------------------------------------------------------------------- releases that travel and never destroy


def local_backbone_checkpoint(root: Path, run: str = "run", seed: int = 0, config_yaml: bool = True) -> Path:
    """A tiny De-MINDS checkpoint on a local backbone, as the quickstart's toy CLIP or a fine-tuned
    CLIP is: the model-config JSON in ROOT/repo/configs/, the weights file in ROOT/work/, the run
    folder ROOT/work/RUN (with its config.yaml)."""
    import shutil

    import torch

    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import save_checkpoint
    from demind.model import DeMinds

    config = root / "repo" / "configs" / "my-clip.json"
    weights = root / "work" / "my-clip-weights.pt"
    if not weights.is_file():
        config.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TINY_CLIP, config)
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(FrozenCLIP(BackboneConfig(name=str(config), pretrained=None)).model.state_dict(), weights)
    backbone = FrozenCLIP(BackboneConfig(name=str(config), pretrained=str(weights)))
    torch.manual_seed(seed)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16, gate_init=0.5), backbone)
    path = save_checkpoint(root / "work" / run / "demind.safetensors", model)
    if config_yaml:
        (path.parent / "config.yaml").write_text(f"data:\n  shards: {root / 'shards'}\nrun:\n  seed: {seed}\n")
    return path


def queries_of(checkpoint) -> "torch.Tensor":
    import torch

    from demind.checkpoint import load_backbone_and_model

    backbone, model = load_backbone_and_model(checkpoint)
    images = torch.linspace(0, 1, 2 * 3 * 32 * 32).reshape(2, 3, 32, 32)
    with torch.no_grad():
        return model.query(backbone.encode_image(images), ["make it red", "without the hat"])


def test_a_published_folder_is_self_contained_and_loads_after_the_backbone_files_are_gone(tmp_path):
    import shutil

    import torch

    from demind.cli.publish import main as publish_main

    checkpoint = local_backbone_checkpoint(tmp_path / "publisher")
    before = queries_of(checkpoint)
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "publisher" / "release")]) == 0
    release = tmp_path / "publisher" / "release"
    files = sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file())
    assert files == ["README.md", "backbone/my-clip-weights.pt", "backbone/my-clip.json", "config.json",
                     "demind.safetensors", "training_config.yaml"]
    for path in release.rglob("*"):  # no file holds a path of the publisher's machine
        if path.is_file():
            assert str(tmp_path).encode() not in path.read_bytes(), path
    config = json.loads((release / "config.json").read_text())
    assert config["backbone_config"]["name"] == "backbone/my-clip.json"
    assert config["backbone_config"]["pretrained"] == "backbone/my-clip-weights.pt"

    # another machine: the folder elsewhere, the publisher's backbone files gone
    moved = shutil.move(str(release), str(tmp_path / "elsewhere" / "model"))
    shutil.rmtree(tmp_path / "publisher")
    assert torch.equal(queries_of(moved), before)


def test_a_run_folder_loads_after_it_moved_and_the_repository_was_cloned_elsewhere(tmp_path):
    import shutil

    import torch

    checkpoint = local_backbone_checkpoint(tmp_path / "a")
    before = queries_of(checkpoint)
    shutil.move(str(tmp_path / "a" / "work"), str(tmp_path / "b-work"))  # the run folder and its weights moved
    shutil.rmtree(tmp_path / "a" / "repo")  # the model config's repository re-cloned elsewhere
    assert torch.equal(queries_of(tmp_path / "b-work" / "run" / "demind.safetensors"), before)


def test_a_run_folder_records_a_linked_model_config_by_its_link(tmp_path):
    """A Hugging Face snapshot's files are links to blobs named by hash: the record keeps the link's
    name (a .json), so the moved run folder still finds a model config, not an extensionless blob."""
    import shutil

    from demind.checkpoint import backbone_files_record
    from demind.schema import BackboneConfig

    blob = tmp_path / "hf" / "blobs" / "3f2a9"
    blob.parent.mkdir(parents=True)
    shutil.copy(TINY_CLIP, blob)
    link = tmp_path / "hf" / "snapshot" / "my-clip.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("..") / "blobs" / "3f2a9")
    record = backbone_files_record(BackboneConfig(name=str(link), pretrained=None), tmp_path / "run")
    assert record["name"] == "../hf/snapshot/my-clip.json"


def test_a_run_folder_loads_when_its_model_config_was_edited_since(tmp_path):
    """The repository's model config changed after training (another layer count, say): the
    checkpoint's own copy of the config it was trained with is used, not the edited file."""
    import torch

    checkpoint = local_backbone_checkpoint(tmp_path)
    before = queries_of(checkpoint)
    config = tmp_path / "repo" / "configs" / "my-clip.json"
    edited = json.loads(config.read_text())
    edited["vision_cfg"]["layers"] = 2
    config.write_text(json.dumps(edited))
    assert torch.equal(queries_of(checkpoint), before)


def test_publish_overwrite_never_replaces_another_runs_checkpoint(tmp_path, capsys):
    from demind.cli.publish import main as publish_main

    run_a = local_backbone_checkpoint(tmp_path, "runA", seed=1)
    run_b = local_backbone_checkpoint(tmp_path, "runB", seed=2)
    kept = {p.name: p.read_bytes() for p in run_b.parent.iterdir()}
    assert publish_main(["--checkpoint", str(run_a), "--out", str(run_b.parent), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "not written by demind-publish" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in run_b.parent.iterdir()} == kept


def test_publish_overwrite_leaves_exactly_the_new_publishs_files(tmp_path, capsys):
    from demind.cli.publish import main as publish_main

    run_a = local_backbone_checkpoint(tmp_path, "runA", seed=1)
    run_c = local_backbone_checkpoint(tmp_path, "runC", seed=3, config_yaml=False)
    out = tmp_path / "release"
    assert publish_main(["--checkpoint", str(run_a), "--out", str(out)]) == 0
    assert (out / "training_config.yaml").is_file()
    assert publish_main(["--checkpoint", str(run_c), "--out", str(out), "--overwrite"]) == 0
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert "training_config.yaml" not in files  # the old publish's file is gone with it
    assert sorted(json.loads((out / "config.json").read_text())["files"]) == files
    assert not [p for p in tmp_path.iterdir() if ".publish-" in p.name]  # nothing left beside it
    # a file added by hand is not demind-publish's: --overwrite refuses and changes nothing
    (out / "my-notes.md").write_text("mine")
    assert publish_main(["--checkpoint", str(run_a), "--out", str(out), "--overwrite"]) == 2
    assert "my-notes.md" in capsys.readouterr().err and (out / "my-notes.md").read_text() == "mine"
    assert not (out / "training_config.yaml").exists()


def test_publish_names_a_file_out_and_takes_a_published_folder_as_checkpoint(tmp_path, capsys):
    import torch

    from demind.cli.publish import main as publish_main

    checkpoint = local_backbone_checkpoint(tmp_path)
    (tmp_path / "a-file").write_text("x")
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--out" in err and "a-file" in err and "is a file" in err
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "first")]) == 0
    assert publish_main(["--checkpoint", str(tmp_path / "first"), "--out", str(tmp_path / "second")]) == 0
    assert torch.equal(queries_of(tmp_path / "second"), queries_of(checkpoint))
    first, second = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("first", "second"))
    assert second["files"] == first["files"] and second["backbone_config"] == first["backbone_config"]


def test_an_upload_with_the_hub_unreachable_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants as constants

    from demind.cli.publish import main as publish_main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    import demind.release.publish as publish

    checkpoint = local_backbone_checkpoint(tmp_path)
    for probe in ("before the upload", "the connection fails during it"):
        status = publish_main(["--checkpoint", str(checkpoint), "--repo", "demind-test/unreachable"])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err and err.count("error:") == 1, (probe, err[-2000:])
        assert "cannot reach the Hugging Face Hub" in err and "demind-test/unreachable" in err
        monkeypatch.setattr(publish, "hub_unreachable", lambda: None)  # the probe passes: httpx's error is caught


# --------------------------------------------------------------------------- a GPU launch on a machine without one


class FakeState:
    def __init__(self, cpu: bool) -> None:
        self._cpu = cpu


class FakeAccelerator:
    """What Accelerate sets up when ``multi_gpu.yaml`` starts 4 processes where torch sees no GPU."""

    def __init__(self, *args, cpu: bool = False, **kwargs) -> None:
        from accelerate.utils import DistributedType

        self.distributed_type, self.num_processes = DistributedType.MULTI_CPU, 4
        self.state = FakeState(cpu)


def test_a_gpu_launch_on_a_machine_without_one_is_refused_naming_the_cpu_config(tmp_path, monkeypatch):
    import accelerate

    from demind.config import ConfigError, load_config
    from demind.trainkit import CPU_LAUNCH_CONFIG
    from demind.training.accel import setup
    from demind.training.config import TrainConfig

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    cfg = load_config(TrainConfig, REPO_ROOT / "configs/train/smoke.yaml", [f"run.output_dir={tmp_path}",
                                                                          "run.device=auto", "run.trackers=[]"])
    with pytest.raises(ConfigError, match=r"started 4 processes for GPUs, but torch sees no GPU.*"
                                          + CPU_LAUNCH_CONFIG.replace(".", r"\.") + r".*run\.device=cpu"):
        setup(cfg)
    assert (REPO_ROOT / CPU_LAUNCH_CONFIG).is_file()
    cpu = load_config(TrainConfig, REPO_ROOT / "configs/train/smoke.yaml", [f"run.output_dir={tmp_path}",
                                                                          "run.device=cpu", "run.trackers=[]"])
    assert isinstance(setup(cpu), FakeAccelerator)  # asked for on purpose: several CPU processes train


class LoneAccelerator(FakeAccelerator):
    """What Accelerate 1.x sets up instead in each process of such a launch: one process alone."""

    def __init__(self, *args, cpu: bool = False, **kwargs) -> None:
        from accelerate.utils import DistributedType

        super().__init__(cpu=cpu)
        self.distributed_type, self.num_processes = DistributedType.NO, 1


def test_a_gpu_launch_whose_processes_each_train_alone_is_refused(tmp_path, monkeypatch):
    """`accelerate launch --config_file multi_gpu.yaml` (WORLD_SIZE=2, read by demind-train) where
    Accelerate gives each process a run of its own, all writing one folder (measured here: the real
    launch on this CPU machine printed "processes 1 (DistributedType.NO, cpu)" twice, before)."""
    import accelerate

    from demind.config import ConfigError, load_config
    from demind.training.accel import setup
    from demind.training.config import TrainConfig

    monkeypatch.setattr(accelerate, "Accelerator", LoneAccelerator)
    cfg = load_config(TrainConfig, REPO_ROOT / "configs/train/smoke.yaml", [f"run.output_dir={tmp_path}",
                                                                          "run.device=auto", "run.trackers=[]"])
    with pytest.raises(ConfigError, match=r"started 2 processes for GPUs.*DistributedType\.NO, 1 process"):
        setup(cfg, launched_processes=2)
    assert isinstance(setup(cfg), LoneAccelerator)  # one process, as launched: nothing to refuse


# --------------------------------------------------------------------------- partial benchmark runs


def tiny_cirr_test1(root: Path) -> Path:
    names = [f"test1-{k}-0-img0" for k in range(6)]
    return write_cirr_layout(root, "test1", "test1", {name: png_bytes(k) for k, name in enumerate(names)}, [
        {"pairid": k, "reference": names[k], "caption": "make it red", "img_set": {"id": k, "members": names}}
        for k in range(4)])


@pytest.mark.parametrize("bench_name", ["cirr", "circo"])
def test_a_limited_test_split_run_writes_no_file_that_looks_like_a_full_submission(bench_name, tmp_path):
    from demind.cli.evaluate import main as evaluate_main
    from test_eval_benchmarks import make_circo

    root = tiny_cirr_test1(tmp_path / "cirr") if bench_name == "cirr" else make_circo(tmp_path / "circo")
    checkpoint = local_backbone_checkpoint(tmp_path / "model")
    out = tmp_path / "out"
    assert evaluate_main(["--benchmark", bench_name, "--data-root", str(root), "--split", "test", "--checkpoint",
                          str(checkpoint), "--methods", "demind", "--limit", "1", "--out", str(out),
                          "--num-workers", "0", "run.progress=false"]) == 0
    written = sorted(p.name for p in (out / "submission").iterdir())
    usual = (["cirr_test1_demind_recall.json", "cirr_test1_demind_recall_subset.json"] if bench_name == "cirr"
             else ["circo_test_demind.json"])
    assert written == [f"partial-first1_{name}" for name in usual]
    for name in written:
        payload = json.loads((out / "submission" / name).read_text())
        assert payload["partial"].startswith("PARTIAL: the first 1 queries only")
    assert "partial-first" in (out / "table.md").read_text()


def test_overwrite_takes_a_folder_published_before_the_file_list_was_kept(tmp_path):
    from demind.cli.publish import main as publish_main

    checkpoint = local_backbone_checkpoint(tmp_path)
    out = tmp_path / "release"
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    del config["files"]  # as demind-publish wrote it before
    (out / "config.json").write_text(json.dumps(config))
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(out), "--overwrite"]) == 0
    assert "files" in json.loads((out / "config.json").read_text())
    (out / "README.md").write_text("# my own card\n")  # the user's card: not demind-publish's folder any more
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(out), "--overwrite"]) == 2
    assert (out / "README.md").read_text() == "# my own card\n"
