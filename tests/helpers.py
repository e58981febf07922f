"""Test-only constants and builders, shared by the test files (``from helpers import ...``;
``tests/`` is on the import path because pytest puts tests/conftest.py's folder there).

Nothing here ships: builders that the benchmarks also use live in the installed packages (synthetic
shards and COCO-format data: :mod:`toyworld.synthetic`; the tiny LLaVA-NeXT of the CPU smoke config:
:mod:`demind.engines.tiny_llava`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"  # vendored third-party files (each folder has its licence)

# The tiny random open_clip model of the library's tests (32-d, one layer per tower, 32x32 images).
TINY_CLIP = REPO_ROOT / "configs" / "model" / "tiny-clip.json"

# A tiny ViT toy CLIP at the toy world's resolution (64x64 images, 56-token context) for the toy
# tests and the noisy-description benchmarks, which train and evaluate on rendered scenes.
TINY_TOY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 1, "width": 32, "head_width": 8, "patch_size": 16},
    "text_cfg": {"context_length": 56, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1},
}


def run_eval_command(argv: list[str]) -> dict:
    """The real ``demind-eval`` command on ``argv``; returns the results.json it wrote to --out."""
    from demind.cli.evaluate import main as evaluate_main

    assert evaluate_main(argv) == 0
    return json.loads((Path(argv[argv.index("--out") + 1]) / "results.json").read_text())


def kill_at_checkpoint(command: list[str], cwd: Path, env: dict[str, str], run: Path, step: int,
                       timeout_s: float) -> int:
    """Start ``command`` in its own process group and SIGKILL the whole group (trainer, DataLoader
    workers, a launcher's children) once the run's step-``step`` checkpoint exists. Returns the exit
    status; fails when the checkpoint never appeared (with the command's stderr)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    marker = run / "checkpoints" / f"step_{step:08d}" / "trainer_state.json"
    deadline = time.time() + timeout_s
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), f"no checkpoint at step {step}; the command said:\n" + \
        proc.stderr.read().decode(errors="replace")[-3000:]
    return proc.returncode


def write_cirr_layout(root: Path, split: str, folder: str, images: dict[str, bytes], captions: list[dict]) -> Path:
    """CIRR's official layout under ``root``: ``folder``/NAME.png for each of ``images`` {name: bytes},
    ``image_splits/split.rc2.SPLIT.json`` naming them, and ``captions/cap.rc2.SPLIT.json``."""
    (root / folder).mkdir(parents=True)
    for name, data in images.items():
        (root / folder / f"{name}.png").write_bytes(data)
    (root / "image_splits").mkdir()
    (root / "image_splits" / f"split.rc2.{split}.json").write_text(
        json.dumps({name: f"./{folder}/{name}.png" for name in images}))
    (root / "captions").mkdir()
    (root / "captions" / f"cap.rc2.{split}.json").write_text(json.dumps(captions))
    return root


# ---------------------------------------------------------------- generation job inputs


def jpeg_bytes(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB JPEG of ``size`` (width, height), the same bytes for the same seed."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def write_input_shard(path: Path, samples: list[dict]) -> None:
    import webdataset as wds

    with open(path, "wb") as f, wds.TarWriter(f, encoder=False) as tar:
        for s in samples:
            tar.write(s)


def make_sample(key: str, seed: int, caption: str, image: bytes | None = None) -> dict:
    """One img2dataset sample (jpg, txt, json); the image random from ``seed`` unless given."""
    meta = {"key": key, "url": f"http://example.com/{key}.jpg", "caption": caption}
    return {"__key__": key, "jpg": image if image is not None else jpeg_bytes(seed, (40 + seed, 30)),
            "txt": caption.encode(), "json": json.dumps(meta).encode()}


def write_img2dataset_shards(root: Path) -> str:
    """Two img2dataset-style shards in ``root``: 00000.tar (4 samples), 00001.tar (4 samples, the third
    image corrupt). Returns the corrupt sample's key."""
    root.mkdir(parents=True, exist_ok=True)
    corrupt_key = ""
    for shard in range(2):
        samples = [make_sample(f"0000{shard}000{i}", 10 * shard + i, f"a red dog {shard} {i} on the street")
                   for i in range(4)]
        if shard == 1:
            samples[2]["jpg"] = b"\xff\xd8\xff this is not a jpeg"
            corrupt_key = samples[2]["__key__"]
        write_input_shard(root / f"0000{shard}.tar", samples)
    return corrupt_key


# ---------------------------------------------------------------- re-ranking inputs


def write_rerank_queries(folder: Path, sizes: list[tuple[int, int]]) -> tuple[list, list, list]:
    """Random PNGs of ``sizes`` (width, height) in ``folder`` as ImageRefs named 0, 1, ...; two queries
    (on images 0 and 3) and their candidate lists (images 1.. and 0..2). Returns (refs, queries, candidates)."""
    import numpy as np
    from PIL import Image

    from demind.retrieval import ImageRef, Query

    rng = np.random.default_rng(1)
    refs = []
    for i, (w, h) in enumerate(sizes):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        refs.append(ImageRef(str(i), path))
    queries = [Query("q1", refs[0], "a photo of * , make it red", "make it red"),
               Query("q2", refs[3], "a photo of * , two of them", "two of them")]
    return refs, queries, [refs[1:], refs[:3]]


# ---------------------------------------------------------------- a generation job killed mid-shard


@contextmanager
def shard_writer_killed_at(shard_name: str, written: int) -> Iterator[list]:
    """Within the block, ShardWriter dies (KeyboardInterrupt) when ``shard_name`` has ``written`` samples
    and the killed writer cleans nothing up, as a killed process would: its tmp file stays. Yields the
    killed writers, which must stay referenced (collecting an uncommitted writer removes its tmp like
    abandon does). The real write and abandon are back after the block."""
    from demind.shard_format import ShardWriter

    real_write, real_abandon = ShardWriter.write, ShardWriter.abandon
    killed_writers: list = []

    def dying_write(self, sample):
        if self.path.name == shard_name and self.count == written:
            raise KeyboardInterrupt("injected kill")
        real_write(self, sample)

    def killed(self):
        self._tar.close()
        self._file.close()
        killed_writers.append(self)

    ShardWriter.write, ShardWriter.abandon = dying_write, killed
    try:
        yield killed_writers
    finally:
        ShardWriter.write, ShardWriter.abandon = real_write, real_abandon


# ---------------------------------------------------------------- the trainer's data, one process


def one_process_data(cfg, backbone):
    """What :func:`demind.training.build_data` gives the one process of a fresh run: (loader, cache or None),
    at the micro batch the trainer derives (``micro_batch_size(cfg.optim, 1)``)."""
    from types import SimpleNamespace

    from demind.training import TrainState, build_data, micro_batch_size

    one_process = SimpleNamespace(process_index=0, num_processes=1)
    return build_data(cfg, one_process, backbone, TrainState(), micro_batch=micro_batch_size(cfg.optim, 1))
