"""The quickstart's table in docs/quickstart.md is written from a results.json by
``python -m toyworld.cli.docs_tables``; the numbers it rendered sit in docs/quickstart-table.json.
Fast: the document shows exactly those numbers, and the README does not copy them. Slow: a fresh
default quickstart lands within the variation the document states."""

from __future__ import annotations

import json

import pytest

from toyworld.cli.docs_tables import (BEGIN, DOCUMENTS, END, FAMILY, NUMBERS, ROOT, VARIATION, main, render,
                                      table_numbers)


def documented() -> dict:
    return json.loads((ROOT / NUMBERS).read_text(encoding="utf-8"))


def test_the_documents_show_the_recorded_numbers():
    assert DOCUMENTS == ("docs/quickstart.md",)
    for name in DOCUMENTS:
        block = render(documented())
        text = (ROOT / name).read_text(encoding="utf-8")
        assert f"{BEGIN}\n{block}\n{END}" in text, f"{name}: run python -m toyworld.cli.docs_tables RESULTS"
        assert f"within {VARIATION['recall_points']:g} recall point" in block
    # the toy table has one home: the README links to it and shows none of its rows
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert BEGIN not in readme and "| mapping-only" not in readme and "docs/quickstart.md" in readme


def test_the_family_rows_and_the_toy_mllm_noise_are_shown():
    """The query-time family sits in the table with the toy MLLM's noise level, from results.json."""
    numbers = documented()
    assert set(FAMILY) <= set(numbers["rows"]) and set(numbers["toy_mllm"]["noise"]) == {"p_ignore", "p_drop", "p_garble"}
    noise = numbers["toy_mllm"]["noise"]
    block = render(numbers).replace("\n", " ")  # the prose is wrapped
    assert f"p_ignore {noise['p_ignore']:g}" in block and f"p_garble {noise['p_garble']:g}" in block
    assert "| OSrCIR" in block and "| De-MINDS + MLLM" in block
    # without the family (mllm.family=false) the table is the trained and frozen rows alone
    bare = {**numbers, "rows": {m: r for m, r in numbers["rows"].items() if m not in FAMILY}}
    bare.pop("toy_mllm")
    assert "OSrCIR" not in render(bare) and "toy MLLM" not in render(bare)


def fake_results(shift: float = 0.0) -> dict:
    """A results.json as the quickstart writes it, for the table's six methods."""
    numbers = documented()
    rows, paired = {}, {}
    for method, cell in numbers["rows"].items():
        rows[method] = {"metrics": {"cirr:R@5": [cell["R@5"] + shift, 0.0], "cirr:R@10": [cell["R@10"] + shift, 0.0]},
                        "per_type": {"all": {"n": numbers["queries"]},
                                     "implicit": {"n": cell["implicit_n"], "R@10": [cell["implicit_R@10"], 0.0]}}}
        if "paired_R@10" in cell:
            paired[method] = {"R@10": cell["paired_R@10"]}
    return {"world_version": numbers["world_version"], "rows": rows, "paired": {numbers["seed"]: paired},
            "config": {"toy_benchmarks": {"cirr_version": numbers["cirr_version"]}},
            "toy_mllm": {**numbers["toy_mllm"], "model": "toy-scenes", "runs": {}}}


def test_the_command_writes_checks_and_refuses(tmp_path, capsys):
    for name in DOCUMENTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / NUMBERS).write_text((ROOT / NUMBERS).read_text(encoding="utf-8"), encoding="utf-8")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(fake_results()), encoding="utf-8")
    assert table_numbers(fake_results()) == documented()
    assert main([str(results), "--root", str(tmp_path), "--check"]) == 0
    results.write_text(json.dumps(fake_results(shift=1.0)), encoding="utf-8")
    assert main([str(results), "--root", str(tmp_path), "--check"]) == 1  # stale: nothing written
    assert (tmp_path / "docs/quickstart.md").read_text(encoding="utf-8") == (ROOT / "docs/quickstart.md").read_text(
        encoding="utf-8")
    assert main([str(results), "--root", str(tmp_path)]) == 0
    assert main([str(results), "--root", str(tmp_path), "--check"]) == 0
    moved = json.loads((tmp_path / NUMBERS).read_text(encoding="utf-8"))
    assert moved["rows"]["demind"]["R@10"] == pytest.approx(documented()["rows"]["demind"]["R@10"] + 1.0)
    assert main([str(tmp_path / "absent.json"), "--root", str(tmp_path)]) == 2
    assert "run the quickstart first" in capsys.readouterr().err


@pytest.mark.slow
def test_a_fresh_quickstart_lands_within_the_stated_variation(tmp_path):
    """docs/quickstart.md's promise: the default quickstart from a fresh clone, compared with the document."""
    from toyworld.pipeline import QuickstartConfig, ToyRunConfig, run_quickstart

    fresh = table_numbers(json.loads(json.dumps(run_quickstart(QuickstartConfig(
        workdir=str(tmp_path / "qs"), run=ToyRunConfig(progress=False))), default=str)))
    for method, cell in documented()["rows"].items():
        for key in ("R@5", "R@10"):
            assert abs(fresh["rows"][method][key] - cell[key]) <= VARIATION["recall_points"], (method, key)
        if "paired_R@10" in cell:
            for side in ("only_demind", "only_other"):
                got = fresh["rows"][method]["paired_R@10"][side]
                assert abs(got - cell["paired_R@10"][side]) <= VARIATION["paired_queries"], (method, side)
