"""The exclusion instrument: its AUCs on hand-computed cases, the clause deletion, and the data's
structure (as many hard negatives as ground-truth images, three objects in every image)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from benchmarks.exclusion_instrument import delete_exclusion_clause, evaluate_scores
from demind.eval import load_exclcoco
from demind.eval import metrics as M
from toyworld.exclusion_instrument import FANO_LINES, INSTRUMENT_LABELS, InstrumentConfig, write_instrument


def test_aucs_by_hand():
    # gallery 0..4; ground truth {0, 2}, hard negatives {1, 3}, the rest {4}
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.3],
                           [0.2, 0.2, 0.2, 0.2, 0.9],   # blind to everything: ties -> 0.5; inclusion 0
                           [0.1, 0.9, 0.2, 0.8, 0.0]])  # prefers the excluded object: 0
    aucs = M.exclusion_aucs(scores, [{0, 2}] * 3, [{1, 3}] * 3)
    # exclusion, row 0: (.9>.1) (.9>.5) (.5>.1) (.5=.5 -> 1/2) = 3.5 / 4; inclusion: .9 .1 .5 .5 vs .3 -> 3 / 4
    assert aucs["exclusion AUC"] == pytest.approx([0.875, 0.5, 0.0])
    assert aucs["inclusion AUC"] == pytest.approx([0.75, 0.0, 1.0])
    assert math.isnan(M.pairwise_auc(torch.tensor([1.0]), torch.tensor([])))


def test_evaluate_scores_gives_the_eight_metrics_and_per_query_values():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.3]])
    out = evaluate_scores(scores, [{0, 2}], [{1, 3}])
    # ranking 0, (2|3), (3|2), 4, 1: AP@1 = 1 (percent 100)
    assert out["means"]["AP@1"] == 100.0 and out["means"]["exclusion AUC"] == pytest.approx(0.875)
    assert len(out["per_query"]["AP@5"]) == 1


def test_clause_deletion():
    assert delete_exclusion_clause("a photo of a red circle and a blue square without a green star") == \
        "a photo of a red circle and a blue square"
    assert delete_exclusion_clause("a red circle except for a blue square") == "a red circle"
    with pytest.raises(ValueError, match="no exclusion clause"):
        delete_exclusion_clause("a red circle")


def test_instrument_balances_hard_negatives_and_ground_truth(tmp_path):
    cfg = InstrumentConfig(train_scenes_per_triple=1, test_scenes_per_triple=2, image_size=24)
    root = write_instrument(tmp_path / "inst", cfg, progress=False)
    data, files = load_exclcoco(root / "test")
    assert len(files) == 4 * 2 * len(FANO_LINES) and all(p.is_file() for p in files.values())
    assert len(data["queries"]) == 3 * 2 * len(FANO_LINES)
    triples = {frozenset(INSTRUMENT_LABELS[k] for k in t) for t in FANO_LINES}
    for q in data["queries"]:
        assert len(q["include"]) == 2 and frozenset([*q["include"], q["exclude"]]) in triples
        assert len(q["ground_truth"]) == len(q["hard_negatives"]) == 2  # the triple's variants and bases
        assert q["image_id"] in q["hard_negatives"]
    instances = json.loads((root / "coco" / "annotations" / "instances_test.json").read_text())
    per_image = {}
    for a in instances["annotations"]:
        per_image[a["image_id"]] = per_image.get(a["image_id"], 0) + 1
    assert sorted(set(per_image.values())) == [2, 3]  # a variant: two labels and an unlabelled white shape
    captions = json.loads((root / "coco" / "annotations" / "captions_test.json").read_text())["annotations"]
    assert any("white" in c["caption"] for c in captions)
    marker = (root / "instrument.json").stat().st_mtime_ns
    write_instrument(tmp_path / "inst", cfg, progress=False)  # done: reused, not rewritten
    assert (root / "instrument.json").stat().st_mtime_ns == marker


def test_held_out_triples_leave_their_pairs_out_of_training(tmp_path):
    """A held-out triple's scenes are left out of the training split: no training image holds two of
    its labels together; the other triples keep the very scenes they have without the hold-out."""
    from toyworld.exclusion_instrument import triple_of

    cfg = InstrumentConfig(train_scenes_per_triple=2, test_scenes_per_triple=1, image_size=24, held_out_triples=[2])
    root = write_instrument(tmp_path / "fold2", cfg, progress=False, splits=("train",))
    assert not (root / "test").exists()
    data, files = load_exclcoco(root / "train")
    assert len(files) == 4 * 2 * (len(FANO_LINES) - 1)
    assert {triple_of(q["include"], q["exclude"]) for q in data["queries"]} == set(range(7)) - {2}
    held = {INSTRUMENT_LABELS[k] for k in FANO_LINES[2]}
    instances = json.loads((root / "coco" / "annotations" / "instances_train.json").read_text())
    names = {c["id"]: c["name"] for c in instances["categories"]}
    labels: dict = {}
    for a in instances["annotations"]:
        labels.setdefault(a["image_id"], set()).add(names[a["category_id"]])
    assert all(len(ls & held) <= 1 for ls in labels.values())
    full = write_instrument(tmp_path / "all", dataclasses.replace(cfg, held_out_triples=[]), progress=False,
                            splits=("train",))
    kept = sorted(p.name for p in (root / "coco" / "train").glob("*.png"))
    assert all((full / "coco" / "train" / n).read_bytes() == (root / "coco" / "train" / n).read_bytes() for n in kept)
    with pytest.raises(ValueError, match="not one of the instrument's triples"):
        triple_of(["red circle", "green square"], "pink hexagon")


def test_held_out_and_in_domain_values_come_from_the_right_folds():
    """Query 0 of triple 0, query 1 of triple 1, query 2 of triple 5 (no fold holds it out): held-out
    = the fold that held the query's triple out; in-domain = the mean over the other folds."""
    from benchmarks.exclusion_report import assemble

    def run(v):
        return {m: list(v) for m in ("exclusion AUC", "inclusion AUC", "AP@1", "AP@5")}
    by_run = {(0, 0): run([0.1, 0.2, 0.3]), (1, 0): run([0.5, 0.6, 0.7])}
    out = assemble(by_run, [0, 1, 5], [0, 1], seed=0)
    assert out["held-out"]["exclusion AUC"] == [0.1, 0.6, None]
    assert out["in-domain"]["exclusion AUC"] == pytest.approx([0.5, 0.2, 0.5])


def test_paired_tests_count_combinations_not_queries():
    """20 queries of one combination all better and one query of each of 4 others worse: over
    queries that reads as 20/4 (p 0.002); over combinations it is 1/4 (p 0.375), one test per seed."""
    from benchmarks.exclusion_report import paired_cell

    combos = [("A", "B")] * 20 + [("C", "D"), ("E", "F"), ("G", "H"), ("I", "J")]
    a = {s: {"held-out": {"exclusion AUC": [0.9] * 20 + [0.4] * 4}} for s in (0, 1)}
    b = {s: {"held-out": {"exclusion AUC": [0.5] * 24}} for s in (0, 1)}
    cell, tests = paired_cell(a, b, combos, "exclusion AUC", "held-out", [0, 1])
    assert cell == "1/4 of 5 (p 0.38); 1/4 of 5 (p 0.38)"
    assert tests["0"]["unit"] == "combination" and tests["0"]["p_sign"] == pytest.approx(0.375)
    assert M.sign_test_p(20, 4) < 0.01  # what the per-query test said


@pytest.mark.parametrize("argv, names", [
    (["--set", "space.top_t=0"], ["space.top_t"]),
    (["--set", "sae.nope=1"], ["sae.nope"]),
    (["--instrument", "style=bogus"], ["style", "bogus"]),
    (["--instrument", "test_scenes_per_triple=0"], ["test_scenes_per_triple"]),
    (["--instrument", "held_out_triples=[1]"], ["--folds"]),
    (["--seeds", "-1"], ["--seeds"]),
])
def test_bad_settings_are_one_error_line_before_any_work(tmp_path, capsys, argv, names):
    from benchmarks.exclusion_instrument import main

    work = tmp_path / "work"
    assert main(["--quickstart", str(tmp_path / "qs"), "--workdir", str(work), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(n in err for n in names), err
    assert not (tmp_path / "qs").exists() and not (work / "instrument").exists()


def test_unwritable_workdir_is_one_error_line(tmp_path, capsys):
    from benchmarks.exclusion_instrument import main

    (tmp_path / "a-file").write_text("x")
    assert main(["--quickstart", str(tmp_path / "qs"), "--workdir", str(tmp_path / "a-file" / "work")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--workdir" in err and err.count("\n") == 1


def test_a_workdir_made_with_other_settings_is_refused(tmp_path):
    from benchmarks.exclusion_instrument import check_recipe
    from demind.config import ConfigError

    recipe = {"instrument": {"image_size": 64}, "set": [], "backbone": {"name": "toy"}}
    check_recipe(tmp_path, recipe)
    check_recipe(tmp_path, recipe)  # the same: reused
    with pytest.raises(ConfigError, match=r"other settings \(set \(\[\] -> \['query.steps=5'\]\)\)"):
        check_recipe(tmp_path, {**recipe, "set": ["query.steps=5"]})
    with pytest.raises(ConfigError, match="instrument.image_size"):
        check_recipe(tmp_path, {**recipe, "instrument": {"image_size": 32}})
    old = tmp_path / "old"
    (old / "train").mkdir(parents=True)  # an earlier version's workdir: no record of what made it
    with pytest.raises(ConfigError, match="earlier version of this benchmark"):
        check_recipe(old, recipe)


@pytest.mark.parametrize("argv, names", [
    (["--set", "run.log_every=0"], ["run.log_every"]),
    (["--bench", "no_such_key=1"], ["no_such_key"]),
    (["--variants", "bogus"], ["bogus"]),
])
def test_exclmm_toy_bad_settings_are_one_error_line(tmp_path, capsys, argv, names):
    """The sibling benchmark (toy ExclCOCO): the same checks, before the backbone or the data."""
    from benchmarks.exclmm_toy import main

    assert main(["--backbone-dir", str(tmp_path / "none"), "--workdir", str(tmp_path / "w"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(n in err for n in names), err
    assert not (tmp_path / "w" / "benchmarks").exists()
    assert main(["--backbone-dir", str(tmp_path / "none"), "--workdir", str(tmp_path / "w")]) == 2
    assert "no trained toy CLIP" in capsys.readouterr().err  # was a bare SystemExit message
