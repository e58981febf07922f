"""Reliability: one test per finding, each reproducing the finding's command on tiny
models and generated data. Every test here fails on commit ccbd3bf (checked by running this
file against a checkout of it) and passes now.

Finding 1: a batch size of 0/-1 hung training      -> test_finding1_*
Finding 2: make_shards lost CSV rows silently        -> test_finding2_*
Finding 3: one duplicated key stopped data_gen       -> test_finding3_*
Finding 4: a corrupted checkpoint gave believable results -> test_finding4_*
Finding 5: bad config values failed late or silently -> test_finding5_*
Finding 6: disk full / read-only output              -> test_finding6_*
Finding 7: smoke checkpoints could not be evaluated  -> test_finding7_*
Finding 8: tracebacks, silent truncation, noise, log windows after resume -> test_finding8_*
"""

from __future__ import annotations

import errno
import io
import json
import logging
import shutil
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import REPO_ROOT, TINY_CLIP, write_cirr_layout

SMOKE = REPO_ROOT / "configs" / "train" / "smoke.yaml"


def png_bytes(seed: int, size: tuple[int, int] = (8, 8)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def train_config(*overrides: str):
    from demind.training import load_train_config

    return load_train_config(SMOKE, list(overrides))


# ------------------------------------------------------------------ finding 1


@pytest.mark.parametrize("value", ["0", "-1"])
def test_finding1_nonpositive_batch_size_is_a_config_error_not_a_hang(value):
    from demind.config import ConfigError

    with pytest.raises(ConfigError) as info:
        train_config(f"optim.global_batch_size={value}")
    message = str(info.value)
    assert "optim.global_batch_size" in message and f"= {value}" in message and ">= 1" in message
    assert "command line" in message


# ------------------------------------------------------------------ finding 2


def write_images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"img{i:03d}.png").write_bytes(png_bytes(i))


def test_finding2_csv_rows_are_isolated_and_counted(tmp_path):
    from demind.gen.ingest import build_shards
    from demind.gen.reader import iter_shard

    images = tmp_path / "images"
    write_images(images, 8)
    rows = [
        b"image,caption,source",
        b"img000.jpg,missing file,web",                       # line 2: missing image
        b"img001.png,a red square,web",                        # line 3: ok
        b'img003.png,"unterminated quote caption,web',         # line 4: unterminated quote
        b"img004.png,a blue circle,web",                       # line 5: ok (was swallowed)
        b"img005.png,a green star,web",                        # line 6: ok (was swallowed)
        b"img006.png,extra,columns,here",                      # line 7: extra columns
        b"img007.png,caf\xe9 au lait,web",                     # line 8: not UTF-8 (latin-1 byte)
        b"img002.png,a yellow line,web",                       # line 9: ok
    ]
    csv_path = tmp_path / "captions.csv"
    csv_path.write_bytes(b"\n".join(rows) + b"\n")
    report = build_shards(images, csv_path, tmp_path / "out", samples_per_shard=2)

    by_line = {r["line"]: r for r in report.skipped_rows}
    assert sorted(by_line) == [2, 4, 7, 8]
    assert by_line[4]["reason"] == "malformed CSV row"
    assert by_line[7]["reason"] == "wrong number of columns"
    assert by_line[8]["reason"] == "not UTF-8" and "byte" in by_line[8]["detail"]
    assert all(r["file"] == str(csv_path) for r in report.skipped_rows)
    assert report.rows_read == 8 == report.written + sum(report.skipped.values())

    captions = [s.caption for tar in sorted((tmp_path / "out").glob("*.tar")) for s in iter_shard(tar)]
    assert captions == ["a red square", "a blue circle", "a green star", "a yellow line"]
    metas = [s.meta for tar in sorted((tmp_path / "out").glob("*.tar")) for s in iter_shard(tar)]
    assert all(None not in m and "null" not in m for m in metas)


def test_finding2_rebuild_with_fewer_rows_leaves_no_stale_shards(tmp_path):
    from demind.gen.ingest import CaptionFileError, build_shards

    images = tmp_path / "images"
    write_images(images, 6)
    csv_path = tmp_path / "captions.csv"
    csv_path.write_text("image,caption\n" + "".join(f"img{i:03d}.png,caption {i}\n" for i in range(6)))
    out = tmp_path / "out"
    assert len(build_shards(images, csv_path, out, samples_per_shard=2).shards) == 3

    csv_path.write_text("image,caption\nimg000.png,only one\n")
    with pytest.raises(CaptionFileError, match="--overwrite"):
        build_shards(images, csv_path, out, samples_per_shard=2)
    report = build_shards(images, csv_path, out, samples_per_shard=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["00000.tar", "00000_stats.json"]
    assert sorted(p.name for p in report.removed) == ["00001.tar", "00001_stats.json", "00002.tar", "00002_stats.json"]


# ------------------------------------------------------------------ finding 3


def tar_with_members(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_finding3_duplicate_key_inside_a_tar_is_skipped_and_the_shard_goes_on(tmp_path):
    from demind.gen.reader import RawSample, SkippedSample, iter_shard

    path = tmp_path / "00000.tar"
    tar_with_members(path, [("a1.png", png_bytes(1)), ("a1.txt", b"first"), ("a1.png", png_bytes(2)),
                            ("a1.txt", b"second"), ("a2.png", png_bytes(3)), ("a2.txt", b"third")])
    items = list(iter_shard(path))
    assert [(type(i).__name__, i.key) for i in items] == [
        ("RawSample", "a1"), ("SkippedSample", "a1"), ("RawSample", "a2")]
    assert isinstance(items[0], RawSample) and items[0].caption == "first"
    assert isinstance(items[1], SkippedSample) and items[1].reason == "duplicate key"


# ------------------------------------------------------------------ finding 4


@pytest.fixture()
def tiny_checkpoint(tmp_path, tiny_backbone):
    from demind.checkpoint import save_checkpoint
    from demind.model import DeMinds
    from demind.schema import ModelConfig

    torch.manual_seed(0)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16), tiny_backbone)
    return save_checkpoint(tmp_path / "tiny.safetensors", model)


def test_finding4_corrupted_checkpoint_is_an_error_not_wrong_results(tiny_checkpoint, tiny_backbone):
    from demind.checkpoint import CheckpointError, load_checkpoint

    data = bytearray(tiny_checkpoint.read_bytes())
    data[-8:-4] = struct.pack("<f", float("nan"))  # four bytes near the end: a NaN inside the last tensor
    tiny_checkpoint.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(tiny_checkpoint, tiny_backbone)


def test_finding4_non_finite_weights_name_the_tensor(tiny_checkpoint, tiny_backbone):
    """A checkpoint whose checksum matches but which holds NaN (e.g. a diverged run's export)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from demind.checkpoint import CHECKSUM_KEY, CheckpointError, load_checkpoint
    from demind.tensor_files import tensors_sha256

    state = load_file(str(tiny_checkpoint))
    with safe_open(str(tiny_checkpoint), framework="pt") as f:
        meta = f.metadata()
    state["mapping.layers.0.weight"][0, 0] = float("nan")
    meta[CHECKSUM_KEY] = tensors_sha256(state)
    save_file(state, str(tiny_checkpoint), metadata=meta)
    with pytest.raises(CheckpointError, match=r"'mapping\.layers\.0\.weight' holds 1 non-finite"):
        load_checkpoint(tiny_checkpoint, tiny_backbone)


def test_finding4_non_finite_query_embedding_names_the_query(tiny_backbone):
    from demind.errors import NonFiniteError
    from demind.eval.harness import embed_queries

    class NanOnSecond:
        name, backbone = "fake", tiny_backbone

        def embed(self, refs, prompts, texts):
            out = torch.nn.functional.normalize(torch.randn(len(prompts), tiny_backbone.embed_dim), dim=-1)
            out[1, 0] = float("nan")
            return out

    with pytest.raises(NonFiniteError, match=r"query q2 \('two'\)"):
        embed_queries(NanOnSecond(), torch.zeros(3, tiny_backbone.embed_dim), ["one", "two", "three"],
                      ["one", "two", "three"], batch_size=8, qids=["q1", "q2", "q3"])


# ------------------------------------------------------------------ finding 5


@pytest.mark.parametrize("override, key, allowed", [
    ("optim.schedule=linear", "optim.schedule", "one of 'cosine', 'constant'"),
    ("optim.max_steps=1.5", "optim.max_steps", "must be an integer"),
    ("optim.max_steps=true", "optim.max_steps", "must be an integer"),
    ("optim.lr=-1", "optim.lr", "> 0"),
    ("model.num_heads=3", "model.num_heads", "must divide the backbone's text width"),
])
def test_finding5_bad_training_values_fail_at_load_naming_key_value_and_origin(override, key, allowed):
    from demind.config import ConfigError

    with pytest.raises(ConfigError) as info:
        train_config(override)
    message = str(info.value)
    assert key in message and allowed in message and "command line" in message
    assert "smoke.yaml" not in message  # the value came from the command line, not the file


@pytest.mark.parametrize("override, key, allowed", [
    ("io.max_caption_chars=-5", "io.max_caption_chars", ">= 1"),
    ("engine.chunk_size=1.7", "engine.chunk_size", "must be an integer"),
    ("sampling.top_p=0", "sampling.top_p", "> 0 and <= 1"),
])
def test_finding5_bad_generation_values_fail_at_load(override, key, allowed):
    from demind.config import ConfigError, load_config
    from demind.gen.config import GenConfig

    with pytest.raises(ConfigError) as info:
        load_config(GenConfig, REPO_ROOT / "configs" / "data_gen" / "tiny-cpu.yaml", [override])
    message = str(info.value)
    assert key in message and allowed in message and "command line" in message


def test_finding5_bad_evaluation_options_fail_before_any_work(tmp_path, tiny_backbone):
    from demind.config import ConfigError
    from demind.eval.harness import evaluate
    from demind.eval.options import CocoOptions, ReaderOptions

    with pytest.raises(ConfigError) as info:  # before the (missing) data is even looked at
        evaluate("cirr", tmp_path / "nowhere", backbone=tiny_backbone, batch_size=0,
                 options=ReaderOptions(coco=CocoOptions(min_area=0.7, prompt="poem")))
    message = str(info.value)
    assert "batch_size = 0 must be >= 1" in message and "'coco.prompt' = 'poem' must be one of" in message
    assert "coco.min_area" in message and "below coco.max_area" in message


def test_finding5_a_bad_value_in_the_file_names_the_file(tmp_path):
    from demind.config import ConfigError

    path = tmp_path / "bad.yaml"
    path.write_text(SMOKE.read_text().replace("max_steps: 20", "max_steps: 2.5"))
    from demind.training import load_train_config

    with pytest.raises(ConfigError, match=r"optim\.max_steps.*2\.5.*bad\.yaml"):
        load_train_config(path, [])


# ------------------------------------------------------------------ finding 6


def test_finding6_unwritable_output_is_one_error_naming_the_path(tmp_path, monkeypatch):
    from demind.errors import DemindError
    from demind.io import check_output_dir, write_text_atomic

    real_write = Path.write_bytes

    def read_only(self, data):
        if self.parent.name == "ro":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(DemindError, match=r"cannot write .*ro: read-only file system"):
        check_output_dir(tmp_path / "ro")

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(DemindError, match=r"cannot write .*results\.json: no space left on device"):
        write_text_atomic(tmp_path / "results.json", "{}")
    assert not (tmp_path / "results.json.tmp").exists()


# ------------------------------------------------------------------ finding 7


def test_finding7_smoke_checkpoint_on_a_random_backbone_evaluates(tmp_path):
    """Training on a random-init backbone, then evaluating with the checkpoint alone."""
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import load_backbone_and_model, save_checkpoint
    from demind.model import DeMinds

    torch.manual_seed(123)  # whatever the trainer's global seed ...
    trained_on = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None))
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16), trained_on)
    path = save_checkpoint(tmp_path / "smoke.safetensors", model)
    torch.manual_seed(456)  # ... and the evaluator's
    backbone, loaded = load_backbone_and_model(path, None)
    assert backbone.identity == trained_on.identity
    v = torch.randn(2, backbone.embed_dim)
    model.eval()
    assert torch.allclose(loaded(v, ["red", "blue"]).t_hat, model(v, ["red", "blue"]).t_hat, atol=1e-6)


def test_finding7_same_weights_under_another_file_name_are_the_same_backbone(tmp_path, tiny_backbone):
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from demind.model import DeMinds

    first = tmp_path / "weights-a.pt"
    torch.save(tiny_backbone.model.state_dict(), first)
    second = tmp_path / "copy" / "renamed.pt"
    second.parent.mkdir()
    shutil.copy(first, second)
    on_first = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(first)))
    path = save_checkpoint(tmp_path / "m.safetensors", DeMinds(ModelConfig(mapping_hidden=16, num_heads=4), on_first))
    load_checkpoint(path, FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(second))))

    other_weights = {k: v + 1 if v.is_floating_point() else v for k, v in tiny_backbone.model.state_dict().items()}
    torch.save(other_weights, tmp_path / "weights-a-other.pt")
    with pytest.raises(CheckpointError, match="load the backbone it was trained on"):  # another backbone: refused
        load_checkpoint(path, FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(tmp_path / "weights-a-other.pt"))))


# ------------------------------------------------------------------ finding 8


def test_finding8_skip_reason_is_clean(tmp_path):
    from demind.gen.config import GenConfig
    from demind.gen.job import ShardStats, decoded_chunks
    from demind.gen.reader import RawSample

    stats = ShardStats()
    samples = iter([RawSample("k1", "jpg", b"not an image", "a caption")])
    assert list(decoded_chunks(samples, GenConfig(), stats)) == []
    (skipped,) = stats.skipped_samples
    assert skipped["reason"] == "undecodable image"
    assert "undecodable image" not in skipped["detail"] and "object at 0x" not in skipped["detail"]
    assert skipped["detail"] == "UnidentifiedImageError: cannot identify image file"


def test_finding8_random_init_notice_is_not_a_warning(caplog):
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

    with caplog.at_level(logging.INFO):
        FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None))
    assert not [r for r in caplog.records if "No pretrained weights" in r.getMessage() and r.levelno >= logging.INFO]


def write_tiny_cirr(root: Path, long_caption: str) -> None:
    names = [f"dev-{i}-0-img0" for i in range(4)]
    entries = [dict(pairid=i, reference=names[i], target_hard=names[(i + 1) % 4],
                    target_soft={names[(i + 1) % 4]: 1.0}, caption=caption,
                    img_set=dict(id=i, members=names, reference_rank=i, target_rank=(i + 1) % 4))
               for i, caption in enumerate(["make it red", long_caption])]
    write_cirr_layout(root, "val", "dev", {name: png_bytes(i) for i, name in enumerate(names)}, entries)


def test_finding8_text_longer_than_the_context_is_counted_in_eval_results(tmp_path, tiny_backbone):
    from demind.eval.harness import evaluate

    write_tiny_cirr(tmp_path / "cirr", " ".join(["very"] * 200) + " red")
    results = evaluate("cirr", tmp_path / "cirr", backbone=tiny_backbone, methods="text-only,image+text",
                       out_dir=tmp_path / "out", progress=False)
    assert results["text_truncation"]["text-only"] == {"texts_encoded": 2, "texts_truncated": 1}
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["text_truncation"]["image+text"]["texts_truncated"] == 1


# ------------------------------------------------------------------ training (findings 6 and 8)


def synthetic_shards(directory: Path, **kwargs) -> None:
    from toyworld.synthetic import write_synthetic_shards

    write_synthetic_shards(directory, **kwargs)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def shards(tmp_path) -> Path:
    synthetic_shards(tmp_path / "shards", num_shards=2, samples_per_shard=24)
    return tmp_path / "shards"


def smoke(shards: Path, run: Path, *overrides: str):
    return train_config(f"data.shards={shards}", "data.features=null", f"run.output_dir={run}",
                        f"backbone.name={TINY_CLIP}", "run.progress=false", *overrides)


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_finding8_logged_losses_after_a_resume_equal_an_uninterrupted_run(shards, tmp_path):
    """save_every=3, log_every=4: a run resumed at step 3 logs step 4 over steps 1-4, as without the stop."""
    from accelerate.state import AcceleratorState, GradientState

    from demind.training import train

    args = ("optim.max_steps=8", "run.log_every=4", "run.save_every=3", "run.keep_checkpoints=3")
    whole = tmp_path / "whole"
    train(smoke(shards, whole, *args))
    expected = {m["step"]: (m["loss"], m["distil"], m["align"]) for m in read_metrics(whole)}
    assert sorted(expected) == [4, 8]

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for later in ("step_00000006", "step_00000008"):  # as if killed just after the step-3 checkpoint
        shutil.rmtree(resumed / "checkpoints" / later)
    (resumed / "demind.safetensors").unlink()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train(smoke(shards, resumed, *args))
    got = {m["step"]: (m["loss"], m["distil"], m["align"]) for m in read_metrics(resumed)}
    assert got == expected


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_finding8_training_text_longer_than_the_context_is_counted(shards, tmp_path):
    from demind.training import train

    long_template = "a photo of * , {text} " + "with " * 80  # every target description exceeds 77 tokens
    run = tmp_path / "run"
    train(smoke(shards, run, "optim.max_steps=2", "run.log_every=1", f"model.template={long_template}"))
    counts = read_metrics(run)[-1]["counts"]
    assert counts["text_truncated"] == 2 * 16  # 16 target descriptions per step, two steps


@pytest.mark.usefixtures("one_thread_and_fresh_accelerator")
def test_finding6_disk_full_during_a_checkpoint_names_disk_and_path(shards, tmp_path, monkeypatch):
    """torch.save reports a full disk as 'basic_ios::clear: iostream error', naming neither disk nor path."""
    import accelerate

    import demind.io
    from demind.errors import OutputLocationError
    from demind.training import train

    def full_disk_save(self, output_dir=None, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed; basic_ios::clear: iostream error")

    real_free = demind.io.free_bytes
    monkeypatch.setattr(accelerate.Accelerator, "save_state", full_disk_save)
    monkeypatch.setattr(demind.io, "free_bytes", lambda p: 0 if str(p).endswith(".tmp") else real_free(p))
    run = tmp_path / "run"
    with pytest.raises(OutputLocationError) as info:
        train(smoke(shards, run, "optim.max_steps=2", "run.save_every=2"))
    message = str(info.value)
    assert f"cannot write {run / 'checkpoints' / 'step_00000002.tmp'}: no space left on device" in message


def test_finding8_eval_command_smoke_checkpoint_runs_and_a_corrupted_one_is_one_error_line(tiny_checkpoint, tmp_path,
                                                                                           capsys):
    """The evaluation command with a checkpoint of a random-init backbone alone (finding 7) works;
    the same command on a corrupted copy exits 2 with one line, no traceback (findings 4 and 8)."""
    from demind.cli.evaluate import main

    write_tiny_cirr(tmp_path / "cirr", "make it blue")
    argv = ["--benchmark", "cirr", "--data-root", str(tmp_path / "cirr"), "run.device=cpu", "--num-workers", "0",
            "run.progress=false", "--methods", "demind,image-only"]
    assert main(argv + ["--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "ok")]) in (0, None)
    capsys.readouterr()

    data = bytearray(tiny_checkpoint.read_bytes())
    data[-8:-4] = struct.pack("<f", float("nan"))
    tiny_checkpoint.write_bytes(bytes(data))
    assert main(argv + ["--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [e for e in err.splitlines() if e.startswith("error:")]
    assert "is corrupted" in line and str(tiny_checkpoint) in line
