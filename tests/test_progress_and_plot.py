"""Logs people like: bars only on a terminal, a line per 10 % elsewhere; encoding workers capped at
the CPUs there are; the training curves as a PNG beside metrics.jsonl."""

from __future__ import annotations

import io
import json
import logging

import pytest

from demind.logs import ProgressLines, on_terminal, progress_bar
from demind.settings import resolve_workers
from demind.training.plot import plot_training


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_a_line_per_ten_percent_not_a_redraw_per_step(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a log file
    assert not on_terminal()
    with caplog.at_level(logging.INFO, logger="demind"):
        bar = progress_bar(total=200, desc="encode", unit="img", min_s=0)
        assert isinstance(bar, ProgressLines)
        with bar:
            for _ in range(200):
                bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10  # 10 %, 20 %, ..., 100 %: one readable line each
    assert lines[0].startswith("encode: 20/200 img (10 %), ") and "s left" in lines[0]
    assert lines[-1].startswith("encode: 200/200 img (100 %), ") and "left" not in lines[-1]


def test_iterating_logs_too_and_disable_and_lines_off_are_silent(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="demind"):
        assert list(progress_bar(range(4), desc="sets", min_s=0)) == [0, 1, 2, 3]
        n = len(caplog.records)
        assert n == 4 and caplog.records[-1].getMessage().startswith("sets: 4/4 it (100 %)")
        for _ in progress_bar(range(4), desc="done in a blink"):  # under min_s (5 s): no lines at all
            pass
        assert len(caplog.records) == n
        for _ in progress_bar(range(4), desc="quiet", disable=True):
            pass
        for _ in progress_bar(range(4), desc="training logs its own lines", lines=False):
            pass
        assert len(caplog.records) == n


def test_slow_steps_get_a_line_at_ten_percent_after_five_seconds(monkeypatch, caplog):
    import demind.logs as logs

    clock = iter(range(0, 10_000, 3))  # every reading 3 s later
    monkeypatch.setattr(logs.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="demind"):
        with progress_bar(total=10, desc="train", unit="step") as bar:
            for _ in range(10):
                bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    # 3 s per step: a 10 % step is due only once 5 s have passed since the last line
    assert [line.split(",")[0] for line in lines] == [f"train: {n}/10 step ({10 * n} %)" for n in (2, 4, 6, 8, 10)]


def test_a_terminal_gets_tqdm(monkeypatch):
    monkeypatch.setattr("sys.stderr", FakeTTY())
    from tqdm.auto import tqdm

    bar = progress_bar(total=3, desc="x")
    assert isinstance(bar, tqdm)
    bar.close()


def test_workers_are_capped_at_the_cpus_this_process_may_use(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert resolve_workers(4) == 2 and resolve_workers(1) == 1 and resolve_workers(0) == 0


def test_training_plot_is_written_beside_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 2.0 / s, "distil": 1.0 / s, "align": 1.0 / s, "lr": 1e-4 * min(s, 5) / 5,
             "gate": -0.01 * s} for s in range(1, 11)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "lo', encoding="utf-8")
    out = plot_training(metrics)
    assert out == tmp_path / "training.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000  # three panels, not an empty canvas


def test_no_plot_without_steps_or_matplotlib(tmp_path, monkeypatch, caplog):
    assert plot_training(tmp_path / "metrics.jsonl") is None  # no file
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0, "distil": 1, "align": 1, "lr": 0.1, "gate": 0}\n', encoding="utf-8")
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level(logging.INFO, logger="demind"):
        assert plot_training(metrics) is None
    assert any("matplotlib is not installed" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "training.png").exists()


def test_every_bar_is_made_by_progress_bar():
    """A tqdm(...) built anywhere else would draw redraw-walls into log files again."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    makers = []
    for path in [*root.glob("demind/**/*.py"), *root.glob("toyworld/**/*.py"), *root.glob("data_gen/*.py")]:
        if path.name == "logs.py" and path.parent.name == "demind":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "tqdm":
                makers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert makers == []
