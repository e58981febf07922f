"""What keying MLLM answers by content costs a rerun: the model's weights and every reference image are
digested, so a rerun from the store reads them again unless the digest memo (``digests.jsonl``: a file's
digest by path, size and mtime, as git's index) remembers them.

    python -m benchmarks.bench_answer_store                       # 512 MB of weights, 400 queries
    python -m benchmarks.bench_answer_store --weights-mb 64 --queries 50 --json out.json

A scripted engine answers (no model runs: the figure is the store's own cost). Three runs over the same
queries, each in a fresh :class:`demind.mllm.MLLMRun` with the process's file-hash cache cleared (a
new process): the first (weights hashed, references decoded, answers written), a rerun with the memo, and
a rerun with ``digests.jsonl`` deleted. References are synthetic 800x600 JPEGs, as in bench_describers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_describers import synthetic_queries
from toyworld.synthetic import ScriptedEngine

ANSWER = "Target description: a red car on a street"


def write_model(folder: Path, megabytes: int) -> Path:
    """A model folder whose weights file holds ``megabytes`` MB of random bytes (plus a config)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llava_next"}')
    with (folder / "model.safetensors").open("wb") as f:
        for _ in range(megabytes):
            f.write(os.urandom(1 << 20))
    return folder


def timed_run(model: Path, store: Path, queries: list) -> tuple[float, int]:
    """(seconds, requests) of one describe pass in a fresh run, as a new process would see it."""
    import demind.identity as identity
    from demind.mllm import DescribeOptions, MLLMSetup

    identity._FILE_HASHES.clear()  # the process's own cache: a new process starts without it
    engine = ScriptedEngine(lambda request: ANSWER)  # answers at once: the figure is the store's own cost
    started = time.perf_counter()
    run = MLLMSetup(lambda: engine, model=str(model), engine_name=engine.name,
                    describe=DescribeOptions(store=str(store))).bind("bench", "val", None)
    run.describer("osrcir").describe(queries)
    return time.perf_counter() - started, engine.requests


def measure(workdir: Path, weights_mb: int, queries: int) -> dict[str, Any]:
    model = write_model(workdir / "model", weights_mb)
    images = workdir / "images"
    images.mkdir(parents=True, exist_ok=True)
    asked, _ = synthetic_queries(images, queries, 0)
    store = workdir / "store"
    first, generated = timed_run(model, store, asked)
    memo, asked_memo = timed_run(model, store, asked)
    (store / "digests.jsonl").unlink()
    no_memo, asked_no_memo = timed_run(model, store, asked)
    assert generated == queries and asked_memo == asked_no_memo == 0, "the reruns must be answered by the store"
    return {"weights_mb": weights_mb, "queries": queries, "first_run_s": round(first, 3),
            "rerun_with_memo_s": round(memo, 3), "rerun_without_memo_s": round(no_memo, 3),
            "rerun_ms_per_query_with_memo": round(1000 * memo / queries, 3),
            "memo_speedup": round(no_memo / memo, 1) if memo > 0 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights-mb", type=int, default=512)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-answer-store-") as tmp:
        out = measure(Path(tmp), args.weights_mb, args.queries)
    print(f"{out['queries']} queries, {out['weights_mb']} MB of weights (a scripted engine: the store's own cost)")
    print(f"  first run (weights hashed, references decoded, answers written): {out['first_run_s']:.2f} s")
    print(f"  rerun with the digest memo:    {out['rerun_with_memo_s']:.3f} s "
          f"({out['rerun_ms_per_query_with_memo']:.2f} ms a query)")
    print(f"  rerun without the digest memo: {out['rerun_without_memo_s']:.2f} s  (memo: {out['memo_speedup']}x faster)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
