"""benchmarks/bench_gpu.py (``python -m benchmarks.bench_gpu``) at tiny shapes on the CPU, so the GPU
benchmark command cannot rot."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_gpu


def check_sections(results: dict, sections: list[str]) -> None:
    for name in sections:
        assert "error" not in results["sections"][name], (name, results["sections"][name])


def test_bench_gpu_tiny_quick_sections(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--tiny", "--only", "tower,cache,gallery,query,gen", "--query-modes", "eager",
                           "--precisions", "fp32,amp_bf16", "--json", str(out)]) == 0
    results = json.loads(out.read_text())  # what a GPU run leaves behind
    check_sections(results, ["tower", "cache", "gallery", "query", "gen"])
    s = results["sections"]
    assert set(s["cache"]["images_per_s"]) == {"fp32", "amp_bf16"} and min(s["cache"]["images_per_s"].values()) > 0
    assert s["query"]["eager"]["1"]["demind_ms"] > 0
    kept, again = s["gen"]["batch2_prefix_kept"], s["gen"]["batch2_prefilled_again"]
    assert 0 < kept["prefilled_tokens_per_image"] < again["prefilled_tokens_per_image"]
    printed = capsys.readouterr().out
    assert "| feature cache end to end, img/s |" in printed and "| generation, transformers engine" in printed


@pytest.mark.slow
def test_bench_gpu_tiny_every_section(tmp_path):
    """Every section, training (3 recipes) and the compiled query path included."""
    out = tmp_path / "b.json"
    assert bench_gpu.main(["--tiny", "--compile-backend", "aot_eager", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    check_sections(results, list(bench_gpu.SECTIONS))
    runs = results["sections"]["train"]["runs"]
    assert set(runs) == {"cc3m", "cc3m_checkpointing", "short"} and all(r["samples_per_s"] > 0 for r in runs.values())
    assert set(results["sections"]["query"]) == {"eager", "compile", "cudagraphs"}


def test_unknown_section_is_an_error(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--tiny", "--only", "tower,speed"])
    assert "unknown sections ['speed']" in capsys.readouterr().err
