"""Test-only constants and builders, shared by the test files (``from helpers import ...``;
``tests/`` is on the import path through ``pythonpath`` in pyproject's pytest section).

Nothing here ships: builders that the benchmarks also use live beside them (synthetic shards and
COCO-format data: :mod:`benchmarks.synthetic`) or in the package (the tiny LLaVA-NeXT of the CPU
smoke config: :mod:`demind.gen.tiny_llava`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
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
