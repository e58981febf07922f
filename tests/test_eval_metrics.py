"""Evaluation metrics against hand-computed cases, oracle retrieval, names, masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from demind.eval import metrics as M
from demind.retrieval.masks import decode_segmentation, rle_counts_from_string, rle_to_mask
from demind.retrieval import ImageRef, canonical_name, load_image, strip_image_extension


def random_unit(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_oracle_queries_give_perfect_recall_and_map():
    gallery = random_unit(40)
    targets = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:25]
    queries = gallery[targets]  # each query is its target's own embedding
    ranked = M.top_k_indices(queries, gallery, 10)
    rel = M.relevance_matrix(ranked, [{int(t)} for t in targets])
    assert M.recall_at_k(rel, [1, 5, 10]) == {1: 1.0, 5: 1.0, 10: 1.0}
    assert M.map_at_k(rel, torch.ones(25, dtype=torch.long), [1, 5]) == {1: 1.0, 5: 1.0}
    assert M.fraction_recall_at_k(rel, torch.ones(25, dtype=torch.long), [1]) == {1: 1.0}


def test_random_queries_do_not_get_perfect_recall():
    gallery = random_unit(40)
    rel = M.relevance_matrix(M.top_k_indices(random_unit(25, seed=5), gallery, 1), [{i} for i in range(25)])
    assert M.recall_at_k(rel, [1])[1] < 0.5


def test_exclusion_removes_the_reference_even_when_it_scores_best():
    gallery = random_unit(10)
    queries = gallery[[3, 7]]  # each query is identical to the image we exclude
    ranked = M.top_k_indices(queries, gallery, 5, exclude=[3, None])
    assert 3 not in ranked[0].tolist() and ranked.shape == (2, 5)
    assert ranked[1, 0].item() == 7  # no exclusion for the second query
    # the full ranking has one fewer entry when something is excluded
    assert M.top_k_indices(queries, gallery, 50, exclude=[3, None]).shape == (2, 9)


def test_top_k_in_chunks_equals_one_shot():
    gallery, queries = random_unit(30), random_unit(11, seed=3)
    assert torch.equal(M.top_k_indices(queries, gallery, 7, chunk_size=4), M.top_k_indices(queries, gallery, 7))


def test_recall_hit_rate_hand_computed():
    # query 0: target at rank 2; query 1: at rank 4; query 2: not in the top 5
    rel = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    got = M.recall_at_k(rel, [1, 2, 4, 5])
    assert got == pytest.approx({1: 0.0, 2: 1 / 3, 4: 2 / 3, 5: 2 / 3})


def test_recall_subset_hand_computed():
    # gallery of 5 one-hot-ish vectors; the query prefers 4 > 2 > 1 > 0 > 3
    gallery = torch.eye(5)
    query = F.normalize(torch.tensor([[0.2, 0.3, 0.4, 0.1, 0.5]]), dim=-1)
    subset = [[0, 1, 2]]  # members minus the reference (4 is not in the subset)
    ranked = M.rank_within_subsets(query, gallery, subset)
    assert ranked == [[2, 1, 0]]
    assert M.recall_subset_at_k(ranked, [1], [1, 2, 3]) == {1: 0.0, 2: 1.0, 3: 1.0}
    two = M.recall_subset_at_k([[2, 1, 0], [0, 2, 1]], [1, 0], [1, 2])
    assert two == {1: 0.5, 2: 1.0}


def test_fraction_recall_imagenet_r_definition_hand_computed():
    # q0 has 4 relevant targets, 2 in the top 2 and 3 in the top 3; q1 has 1 relevant, at rank 3;
    # q2's class has no image in the domain -> contributes 0, as in Pic2Word's code.
    rel = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    n_relevant = torch.tensor([4, 1, 0])
    got = M.fraction_recall_at_k(rel, n_relevant, [1, 2, 3])
    assert got == pytest.approx({1: (1 / 4 + 0 + 0) / 3, 2: (2 / 4) / 3, 3: (3 / 4 + 1) / 3})
    # and it is not the hit rate
    assert M.recall_at_k(rel, [1])[1] == pytest.approx(1 / 3)


def test_map_hand_computed():
    # relevant at ranks 1 and 3, 3 ground truths: AP@3 = (1/1 + 2/3) / min(3, 3)
    # second query: relevant at rank 2, 1 ground truth: AP@3 = (1/2) / 1
    rel = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    got = M.map_at_k(rel, torch.tensor([3, 1]), [1, 3])
    assert got[1] == pytest.approx((1.0 + 0.0) / 2)  # AP@1: q0 = 1/min(1,3) = 1, q1 = 0
    assert got[3] == pytest.approx(((1 + 2 / 3) / 3 + 0.5) / 2)
    with pytest.raises(ValueError, match="ground-truth"):
        M.map_at_k(rel, torch.tensor([0, 1]), [1])


def test_canonical_name_ignores_path_spelling():
    spellings = ["dev-244-0-img0", "./dev/dev-244-0-img0.png", "dev\\dev-244-0-img0.png", "/abs/dev/dev-244-0-img0.PNG"]
    assert {canonical_name(s) for s in spellings} == {"dev-244-0-img0"}
    assert canonical_name("B00006M009") == "B00006M009"
    assert strip_image_extension("imgnet/imagenet-r/n01/toy_3.jpg") == "imgnet/imagenet-r/n01/toy_3"


def test_compressed_rle_hand_computed():
    # counts [1, 2, 1]: one 0, two 1s, one 0, column-major over 2x2 -> [[0, 1], [1, 0]].
    # Small counts are one character each (value + 48); deltas start at the 4th count.
    assert rle_counts_from_string("121") == [1, 2, 1]
    assert decode_segmentation({"counts": "121", "size": [2, 2]}, 2, 2).tolist() == [[0, 1], [1, 0]]
    # [0, 1, 2, 1]: the 4th is stored as 1 - counts[1] = 0 -> '0'
    assert rle_counts_from_string("0120") == [0, 1, 2, 1]
    # [0, 3, 1, 0]: the 4th is 0 - 3 = -3 -> 5-bit two's complement 29 with the sign bit -> chr(29 + 48) = 'M'
    assert rle_counts_from_string("031M") == [0, 3, 1, 0]
    assert decode_segmentation({"counts": "031M", "size": [2, 2]}, 2, 2).tolist() == [[1, 1], [1, 0]]
    # column-major: a 2x3 mask whose first column is on
    assert rle_to_mask([0, 2, 4], 2, 3).tolist() == [[1, 0, 0], [1, 0, 0]]


def test_masked_crop_has_white_background(tmp_path):
    pixels = np.zeros((20, 20, 3), dtype=np.uint8)
    pixels[:, :] = (200, 10, 10)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    square = [[5, 5, 15, 5, 15, 15, 5, 15]]  # polygon covering x, y in [5, 15]
    ref = ImageRef("q", tmp_path / "img.png", box=(2.0, 2.0, 18.0, 18.0), segmentation=square)
    crop = np.asarray(load_image(ref))
    assert crop.shape == (16, 16, 3)
    assert tuple(crop[0, 0]) == (255, 255, 255)  # outside the object: masked white
    assert tuple(crop[8, 8]) == (200, 10, 10)  # inside: the object's pixels
    assert ref.cache_key != ImageRef("q", tmp_path / "img.png", box=(2.0, 2.0, 18.0, 18.0)).cache_key


def test_paired_hits_and_sign_test_by_hand():
    from demind.eval.metrics import paired_hits, sign_test_p

    targets = {"q1": {"t1"}, "q2": {"t2"}, "q3": {"t3"}, "q4": {"t4"}}
    a = {"q1": ["t1", "x"], "q2": ["x", "t2"], "q3": ["x", "y"], "q4": ["t4", "y"]}
    b = {"q1": ["x", "t1"], "q2": ["t2", "x"], "q3": ["x", "t3"], "q4": ["y", "x"]}
    # at K=1: q1 and q4 only A, q2 only B, q3 neither
    assert paired_hits(a, b, targets, k=1) == (2, 1)
    # at K=2: q4 only A, q3 only B, q1 and q2 both
    assert paired_hits(a, b, targets, k=2) == (1, 1)
    # 2 vs 1 discordant: P(split at least as uneven) = 2 * (C(3,0) + C(3,1)) / 8 = 1.0
    assert sign_test_p(2, 1) == 1.0
    # 9 vs 1: 2 * (1 + 10) / 1024
    assert abs(sign_test_p(9, 1) - 22 / 1024) < 1e-12 and sign_test_p(1, 9) == sign_test_p(9, 1)
    assert sign_test_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="different queries"):
        paired_hits(a, {"q1": []}, targets, k=1)


def test_exclusion_metrics_hand_computed():
    # three queries, ranks 1..10; ground-truth counts 3, 1, 2
    rel = torch.zeros(3, 10, dtype=torch.bool)
    rel[0, [1, 3, 9]] = True   # hits at ranks 2, 4, 10
    rel[1, 0] = True           # hit at rank 1
    n_relevant = torch.tensor([3, 1, 2])  # query 2's two images lie beyond rank 10
    got = M.exclusion_metrics(rel, n_relevant)
    assert list(got) == list(M.EXCLUSION_METRICS)
    # query 0: AP@5 = (P@2 + P@4) / min(5, 3) = (1/2 + 2/4) / 3 = 1/3
    assert got["AP@1"] == pytest.approx((0 + 1 + 0) / 3)
    assert got["AP@5"] == pytest.approx((1 / 3 + 1 + 0) / 3)
    assert got["MRR@5"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert got["MRR@10"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    idcg3 = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    ndcg5_q0 = (1 / math.log2(3) + 1 / math.log2(5)) / idcg3          # 0.49819...
    ndcg10_q0 = (1 / math.log2(3) + 1 / math.log2(5) + 1 / math.log2(11)) / idcg3
    assert ndcg5_q0 == pytest.approx(0.49819, abs=1e-5)
    assert got["NDCG@5"] == pytest.approx((ndcg5_q0 + 1 + 0) / 3)
    assert got["NDCG@10"] == pytest.approx((ndcg10_q0 + 1 + 0) / 3)
    assert got["Hits@5"] == pytest.approx(2 / 3)
    assert got["Hits@10"] == pytest.approx(2 / 3)


def test_mrr_takes_the_first_hit_and_ndcg_caps_the_ideal_at_k():
    rel = torch.tensor([[False, False, True, True, True, True]])
    assert M.mrr_at_k(rel, [2, 3]) == {2: 0.0, 3: pytest.approx(1 / 3)}
    # 9 ground-truth images, k = 2: ideal DCG = 1 + 1/log2(3) (only two slots)
    perfect = torch.tensor([[True, True, False]])
    assert M.ndcg_at_k(perfect, torch.tensor([9]), [2]) == {2: pytest.approx(1.0)}
    with pytest.raises(ValueError, match="at least one ground-truth"):
        M.ndcg_at_k(perfect, torch.tensor([0]), [2])
