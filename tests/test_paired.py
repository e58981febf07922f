"""The paired-test helper: tests run across independent units, one test per seed."""

import pytest

from demind.eval import paired_by_unit, paired_per_seed, format_paired
from demind.eval.paired import unit_differences


def test_queries_that_share_a_unit_count_once():
    # 3 label combinations of 10 queries each; A beats B on every query. Read as 30 independent
    # queries, the sign test says p = 2 / 2**30; the three combinations are the independent
    # observations, and 3 of 3 in one direction has p = 2 * (1/2)**3 = 0.25.
    a = [1.0] * 30
    b = [0.0] * 30
    units = [q // 10 for q in range(30)]
    naive = paired_by_unit(a, b)
    clustered = paired_by_unit(a, b, units, unit="combination")
    assert naive.p_sign == pytest.approx(2 / 2**30)
    assert (clustered.n_units, clustered.better, clustered.worse) == (3, 3, 0)
    assert clustered.p_sign == pytest.approx(0.25)
    assert clustered.describe().startswith("3/0 of 3 combinations, mean +1")


def test_a_direction_carried_by_one_large_unit_is_not_significant():
    # Unit 0 (40 queries): A better by 1 on each. Units 1 and 2 (2 queries each): A worse by 1.
    # Per query 40 vs 4 (p ~ 1e-8); per unit 1 vs 2 (p = 1.0).
    a = [1.0] * 40 + [0.0] * 4
    b = [0.0] * 40 + [1.0] * 4
    units = [0] * 40 + [1, 1, 2, 2]
    assert paired_by_unit(a, b).p_sign < 1e-7
    test = paired_by_unit(a, b, units, unit="combination")
    assert (test.better, test.worse, test.p_sign) == (1, 2, 1.0)
    assert test.mean_diff == pytest.approx((1 - 1 - 1) / 3)


def test_unit_means_are_computed_by_hand():
    diffs = unit_differences([0.5, 0.7, 0.2, 0.9], [0.1, 0.1, 0.4, 0.9], ["x", "x", "y", "z"])
    assert diffs == pytest.approx({"x": 0.5, "y": -0.2, "z": 0.0})
    test = paired_by_unit([0.5, 0.7, 0.2, 0.9], [0.1, 0.1, 0.4, 0.9], ["x", "x", "y", "z"])
    assert (test.n_units, test.better, test.worse) == (3, 1, 1)  # the tie counts as a unit, not in the sign test
    assert test.p_sign == 1.0


def test_each_seed_gets_its_own_test_and_counts_are_never_summed():
    a = {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 0.0], 2: [0.0, 1.0, 1.0]}
    b = {0: [0.0, 0.0, 0.0], 1: [0.0, 0.0, 1.0], 5: [0.0, 0.0, 0.0]}
    tests = paired_per_seed(a, b)
    assert sorted(tests) == [0, 1]  # seed 2 and 5 are not shared
    assert (tests[0].better, tests[0].worse, tests[0].n_units) == (3, 0, 3)
    assert (tests[1].better, tests[1].worse) == (2, 1)
    assert format_paired(tests).startswith("seed 0: 3/0 of 3 queries, mean +1")


def test_per_seed_units_may_differ():
    tests = paired_per_seed({0: [1, 1], 1: [1, 1]}, {0: [0, 0], 1: [0, 0]}, {0: ["u", "u"], 1: ["u", "v"]}, "scene")
    assert tests[0].n_units == 1 and tests[1].n_units == 2


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="different numbers of queries"):
        paired_by_unit([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="unit labels"):
        paired_by_unit([1.0, 2.0], [1.0, 2.0], ["u"])
    with pytest.raises(ValueError, match="share no seed"):
        paired_per_seed({0: [1.0]}, {1: [1.0]})
