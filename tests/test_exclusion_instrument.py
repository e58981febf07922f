"""The exclusion instrument: its AUCs on hand-computed cases, the clause deletion, and the data's
structure (as many hard negatives as ground-truth images, three objects in every image)."""

from __future__ import annotations

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


def test_paired_tests_by_hand():
    from scipy.stats import wilcoxon

    from benchmarks.exclusion_instrument import paired

    a = {"per_query": {"AP@5": [1.0, 0.5, 0.2, 0.2], "exclusion AUC": [0.9, 0.8, 0.7, 0.6],
                       "inclusion AUC": [0.5, 0.5, 0.5, 0.5]}}
    b = {"per_query": {"AP@5": [0.5, 0.5, 0.1, 0.4], "exclusion AUC": [0.5, 0.5, 0.5, 0.7],
                       "inclusion AUC": [0.5, 0.5, 0.5, 0.5]}}
    out = paired(a, b)
    assert out["AP@5 better/worse"] == [2, 1]  # the tie is dropped
    assert out["AP@5 sign p"] == pytest.approx(1.0)  # 2 of 3: P(split at least this uneven) = 2 * 4/8
    assert out["exclusion AUC diff"] == pytest.approx((0.4 + 0.3 + 0.2 - 0.1) / 4)
    assert out["exclusion AUC Wilcoxon p"] == pytest.approx(wilcoxon([0.4, 0.3, 0.2, -0.1]).pvalue)
    assert out["inclusion AUC Wilcoxon p"] == 1.0 and out["inclusion AUC diff"] == 0.0  # all equal: no test
