"""Kill-and-rerun check of the two long jobs (BENCHMARKS.md, "Reliability").

    OMP_NUM_THREADS=1 python -m benchmarks.reliability_kill --data-gen-kills 6 --train-kills 6

data_gen: tiny random LLaVA-NeXT on CPU, 4 input shards x 12 samples; the job is started, sent
SIGKILL after a random delay, restarted, ... ``--data-gen-kills`` times, then run to the end.
Reports keys in / out, duplicates, missing, and whether every (T_rew, T_int) equals an
uninterrupted run's (texts are seeded per key, so they must).

training: the smoke recipe on the tiny CLIP (40 steps, a checkpoint every 5); SIGKILL after a
random delay ``--train-kills`` times (some land while a checkpoint is being written), then run
to the end. Reports whether the exported weights are bit-identical to an uninterrupted run's.
``--samples`` and ``--train-steps`` shrink both jobs (a smoke run); ``--json PATH`` writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_killed(cmd: list[str], ready, jitter: float, env: dict[str, str], timeout: float = 600) -> bool:
    """Start ``cmd``; once ``ready()`` is true, wait ``jitter`` s and SIGKILL its process group.

    Returns True if it was killed, False if it finished first (a failure raises with its stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + timeout
    while proc.poll() is None and not ready() and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(jitter)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
    err = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1]} failed before the kill (exit {proc.returncode}):\n{err[-2000:]}")
    return False


def written_since(paths, since: float) -> bool:
    """Whether any of ``paths`` was written after ``since`` (this run's own files, not a killed run's)."""
    for p in paths:
        try:
            if p.stat().st_mtime > since:
                return True
        except FileNotFoundError:  # renamed or removed meanwhile
            continue
    return False


def run_to_end(cmd: list[str], env: dict[str, str]) -> None:
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def input_sample(key: str, seed: int, caption: str) -> dict:
    """One img2dataset-style sample (jpg, txt, json) as ``write_intent_shard`` takes it: a random
    JPEG whose size follows the seed, as the data_gen tests' inputs."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (30, 40 + seed, 3), dtype=np.uint8)
    return {"key": key, "jpg": Image.fromarray(pixels), "txt": caption,
            "json": {"key": key, "url": f"http://example.com/{key}.jpg", "caption": caption}}


def data_gen_check(work: Path, kills: int, rng: random.Random, env: dict[str, str], per_shard: int) -> dict:
    import webdataset as wds

    from toyworld.synthetic import write_intent_shard
    from demind.engines.tiny_llava import build_tiny_llava_next

    tiny = build_tiny_llava_next(work / "tiny-llava")
    inp = work / "in"
    inp.mkdir()
    keys_in = []
    for shard in range(4):
        samples = [input_sample(f"{shard:05d}{i:04d}", 10 * shard + i, f"a red dog {shard} {i} on the street")
                   for i in range(per_shard)]
        keys_in += [s["key"] for s in samples]
        write_intent_shard(inp / f"{shard:05d}.tar", samples)

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "data_gen/run.py", "--input", str(inp), "--output", str(out), "--config",
                "configs/data_gen/tiny-cpu.yaml", "run.progress=false", f"engine.model={tiny}",
                "sampling.rewrite_max_tokens=12", "sampling.intent_max_tokens=8", "engine.chunk_size=4"]

    reference = work / "dg-reference"
    started = time.time()
    run_to_end(cmd(reference), env)
    clean_s = time.time() - started
    killed_out = work / "dg-killed"
    landed = 0
    for _ in range(kills):
        # killed while a shard is being written: its .tmp tar exists; then up to 2 s more
        since = time.time()
        ready = lambda: written_since(killed_out.glob("*.tmp"), since)  # noqa: E731
        landed += run_killed(cmd(killed_out), ready, rng.uniform(0.0, 2.0), env)
    run_to_end(cmd(killed_out), env)

    def texts(folder: Path) -> list[tuple[str, bytes, bytes]]:
        return [(s["__key__"], s["rew.txt"], s["int.txt"]) for tar in sorted(folder.glob("*.tar"))
                for s in wds.WebDataset(str(tar), shardshuffle=False, empty_check=False)]

    got, want = texts(killed_out), texts(reference)
    keys_out = [k for k, _, _ in got]
    return dict(kills_requested=kills, kills_landed=landed, keys_in=len(keys_in), keys_out=len(keys_out),
                duplicates=sum(c - 1 for c in Counter(keys_out).values()),
                missing=len(set(keys_in) - set(keys_out)),
                texts_equal_uninterrupted=sorted(got) == sorted(want), uninterrupted_s=round(clean_s, 1))


def train_check(work: Path, kills: int, rng: random.Random, env: dict[str, str], per_shard: int, steps: int
                ) -> dict:
    import torch
    from safetensors.torch import load_file

    from toyworld.synthetic import write_synthetic_shards

    shards = work / "shards"
    write_synthetic_shards(shards, num_shards=4, samples_per_shard=per_shard)

    def cmd(run: Path) -> list[str]:
        return [sys.executable, "train.py", "--config", "configs/train/smoke.yaml", f"data.shards={shards}",
                "data.features=null", f"run.output_dir={run}", f"optim.max_steps={steps}", "optim.warmup_steps=4",
                "optim.global_batch_size=8", "run.save_every=5", "run.log_every=1", "run.keep_checkpoints=2",
                "run.progress=false"]

    reference = work / "tr-reference"
    started = time.time()
    run_to_end(cmd(reference), env)
    clean_s = time.time() - started
    killed_run = work / "tr-killed"
    landed, during_save = 0, 0
    for i in range(kills):
        # even kills: as soon as a checkpoint is being written (its step_N.tmp folder exists);
        # odd kills: at a random moment after the first metrics line
        since = time.time()
        if i % 2 == 0:
            ready, jitter = (lambda: written_since((killed_run / "checkpoints").glob("*.tmp"), since)), 0.0
        else:
            ready, jitter = (lambda: written_since([killed_run / "metrics.jsonl"], since)), rng.uniform(0.0, 3.0)
        was_killed = run_killed(cmd(killed_run), ready, jitter, env)
        landed += was_killed
        during_save += was_killed and any((killed_run / "checkpoints").glob("*.tmp"))
    run_to_end(cmd(killed_run), env)
    a, b = load_file(str(reference / "demind.safetensors")), load_file(str(killed_run / "demind.safetensors"))
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return dict(kills_requested=kills, kills_landed=landed, kills_leaving_a_partial_checkpoint=during_save,
                final_weights_bit_identical=identical, uninterrupted_s=round(clean_s, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-gen-kills", type=int, default=6)
    parser.add_argument("--train-kills", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=12, help="samples per input shard (4 shards, both jobs)")
    parser.add_argument("--train-steps", type=int, default=40, help="training steps (a checkpoint every 5)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report = {}
        if args.data_gen_kills:
            report["data_gen"] = data_gen_check(work, args.data_gen_kills, rng, env, args.samples)
        if args.train_kills:
            report["training"] = train_check(work, args.train_kills, rng, env, args.samples, args.train_steps)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
