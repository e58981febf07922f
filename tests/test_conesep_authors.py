"""ConeSep as its authors' code computes it (github iLearn-Lab/CVPR26-ConeSep): each form against values
computed by hand on small tensors, TME's noise construction, and the objective each mode assembles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

SCALE = 1 / 0.07


# --------------------------------------------------------------------------- the forms, by hand


def test_rcl_loss_is_the_complementary_sum_over_the_other_targets():
    from demind.robust import rcl_loss

    eye = torch.eye(3)
    # scale ln 2: logits ln 2 on the diagonal, 0 elsewhere -> p_ii = 2/4, p_ij = 1/4
    loss = rcl_loss(eye, eye, math.log(2))
    assert loss.shape == (3,)
    assert torch.allclose(loss, torch.full((3,), -2 * math.log(0.75)), atol=1e-6)  # 0.5754 each
    # B = 2, scale 1: p_01 = 1 / (1 + e); -log(1 - p_01) = log(1 + e) - 1
    assert torch.allclose(rcl_loss(torch.eye(2), torch.eye(2), 1.0), torch.full((2,), math.log(1 + math.e) - 1),
                          atol=1e-6)


def test_cone_fidelity_is_x2_1_minus_x2_of_the_clamped_normalised_similarity():
    from demind.robust import cone_fidelity

    # s - B = [-0.1, 0.2, 0.5, -0.2] -> clamped [0, 0.2, 0.5, 0] -> / 0.5 -> x = [0, 0.4, 1, 0]
    f = cone_fidelity(torch.tensor([0.2, 0.5, 0.8, 0.1]), 0.3)
    assert torch.allclose(f, torch.tensor([0.0, 0.16 * 0.84, 0.0, 0.0]), atol=1e-6)
    # not monotone: the batch's most similar triplet has F = 0, as the cone's far edge
    assert f[2] < f[1]
    assert torch.equal(cone_fidelity(torch.tensor([0.1, 0.2]), 0.5), torch.zeros(2))  # none above: no 0 / 0


def test_omega_is_a_share_of_the_batch():
    from demind.robust import share_noisy

    f = torch.tensor([0.0, 0.1344, 0.0, 0.0])
    # int(0.5 * 4) = 2 lowest, ties by position: rows 0 and 2 (row 2 is the most similar triplet)
    assert share_noisy(f, 0.5).tolist() == [True, False, True, False]
    assert share_noisy(f, 0.3).tolist() == [True, False, False, False]  # int(1.2) = 1
    assert share_noisy(torch.rand(128), 0.5).sum() == 64  # half of every batch, whatever F is


def test_target_oriented_loss_on_softmax_probabilities():
    from demind.robust import nbl_target_oriented

    eye = torch.eye(2)
    # scale ln 3: q_ii = 3/4, q_ij = 1/4; labels -1 (own), +1 (other); sum over 4 entries / B = 2
    expected = math.log(1 + math.exp(0.75)) + math.log(1 + math.exp(-0.25))
    assert nbl_target_oriented(eye, eye, math.log(3)).item() == pytest.approx(expected, abs=1e-6)


def test_fixed_slack_band_on_the_own_pair():
    from demind.robust import nbl_fixed_band

    query = torch.tensor([[1.0, 0.0]] * 3)
    cos = torch.tensor([0.0, -0.005, -0.5])  # above the band, inside it, below it
    negative = torch.stack([cos, (1 - cos ** 2).sqrt()], dim=1)
    expected = SCALE * (0.002 + 0.0 + (0.5 - 0.007)) / 3
    assert nbl_fixed_band(query, negative, SCALE, pairs="own").item() == pytest.approx(expected, rel=1e-5)


def test_fixed_slack_band_as_the_codes_tensors_broadcast():
    from demind.robust import nbl_fixed_band

    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    negative = torch.tensor([[0.6, 0.8], [-0.8, 0.6]])
    # products q_ik * n_jk over (i, j, k): 0.6, 0, -0.8, 0 | 0, 0.8, 0, 0.6; each above -0.002 costs
    # v + 0.002, each below -0.007 costs -0.007 - v: 0.602 + 0.002 + 0.793 + 0.002 + 0.002 + 0.802 + 0.002 + 0.602
    expected = SCALE * 2.807 / 8
    assert nbl_fixed_band(query, negative, SCALE).item() == pytest.approx(expected, rel=1e-5)


def test_pixel_boundary_is_the_mean_over_every_pair_of_stand_ins():
    from demind.fidelity import pixel_boundary

    v, u = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    texts = torch.stack([u, u])  # one text: the draw with replacement cannot change it

    def compose(r, t):
        return F.normalize(r + t, dim=-1)

    # one stand-in image v: composed (v + u) / sqrt 2, cos with v = 1 / sqrt 2 for every (i, j)
    b = pixel_boundary(compose, v.unsqueeze(0), texts, 3, torch.Generator().manual_seed(0))
    assert b.boundary == pytest.approx(1 / math.sqrt(2), abs=1e-6)


def test_pixel_noise_features_go_through_the_frozen_image_encoder():
    from demind.fidelity import pixel_noise_features

    class Encoder:
        image_size = 4
        embed_dim = 3

        def encode_image(self, pixels):
            assert pixels.shape[1:] == (3, 4, 4)
            return pixels.mean(dim=(2, 3))

    a = pixel_noise_features(Encoder(), 5, seed=1, batch_size=2)
    pixels = torch.randn(5, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(a, pixels.mean(dim=(2, 3)))  # N(0, 1) pixels, the same draw in batches


def numpy_code_sinkhorn(cost, allowed, reg=0.03, iters=100, stop=1e-4):
    """The code's log-domain iterations, written out in NumPy (float64)."""
    import numpy as np

    n, m = cost.shape
    u, v = np.zeros(n), np.zeros(m)

    def kernel(u, v):
        k = (u[:, None] + v[None, :] - cost) / reg
        k[~allowed] = -1e6
        return k

    def lse(a):
        top = a.max(1, keepdims=True)
        return (np.log(np.exp(a - top).sum(1, keepdims=True) + 1e-10) + top)[:, 0]

    for _ in range(iters):
        previous = u
        u = reg * (np.log(1 / n) - lse(kernel(u, v))) + u
        v = reg * (np.log(1 / m) - lse(kernel(u, v).T)) + v
        if np.abs(u - previous).sum() < stop:
            break
    return np.exp(kernel(u, v))


def test_code_sinkhorn_follows_the_codes_iterations():
    import numpy as np

    from demind.robust import code_sinkhorn

    # by hand, constant cost c, nothing masked: the first u-step gives u = c + reg * log(1/8), so K = log(1/8)
    # in every cell, the v-step lse over 2 rows is log(1/4) = log q: v stays 0; the second u-step moves
    # nothing (err 0 < 1e-4, stop): the plan is 1/8 everywhere (up to the code's 1e-10 in the lse)
    flat = code_sinkhorn(torch.full((2, 4), 0.5, dtype=torch.float64), torch.ones(2, 4, dtype=torch.bool))
    assert torch.allclose(flat, torch.full((2, 4), 1 / 8, dtype=torch.float64), atol=1e-9)
    cost = np.array([[0.2, 0.9, 0.5, 0.1], [0.7, 0.3, 0.6, 1.0]])
    allowed = np.array([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=bool)
    plan = code_sinkhorn(torch.from_numpy(cost), torch.from_numpy(allowed))
    assert np.allclose(plan.numpy(), numpy_code_sinkhorn(cost, allowed), atol=1e-12)
    assert plan[0, 3] == 0 and plan[1, 1] == 0  # exp(-1e6): no mass on a closed path
    assert np.allclose(plan.sum(0).numpy(), 1 / 4, atol=1e-6)  # columns exact after the last v-step
    # 100 iterations at most: reg 0.03 on this cost stops early or at 100, as the code; a 1-step run differs
    one = code_sinkhorn(torch.from_numpy(cost), torch.from_numpy(allowed), num_iters=1)
    assert np.allclose(one.numpy(), numpy_code_sinkhorn(cost, allowed, iters=1), atol=1e-12)
    assert not np.allclose(one.numpy(), plan.numpy(), atol=1e-4)


def test_code_btu_loss_by_hand():
    import numpy as np

    from demind.robust import code_btu_loss, code_btu_paths

    def unit(deg):
        return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]

    q = torch.tensor([unit(10), unit(100), unit(200)], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([unit(20), unit(80), unit(250)], dtype=torch.float64)
    n = torch.tensor([unit(190), unit(300), unit(45)], dtype=torch.float64, requires_grad=True)
    noisy = torch.tensor([False, True, False])
    # B = 3, columns [t0 t1 t2 | n0 n1 n2]: the last column (n2) closed to clean rows, noisy row 1 not to t1
    allowed = np.array([[1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=bool)
    onehot = np.array([[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0]], dtype=float)
    got_allowed, got_onehot = code_btu_paths(noisy)
    assert np.array_equal(got_allowed.numpy(), allowed) and np.array_equal(got_onehot.numpy(), onehot)

    qn, tn, nn = (x.detach().numpy() for x in (q, t, n))
    logits = SCALE * qn @ tn.T
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    anchor = np.array([[tn[i] @ nn[j] for j in range(3)] for i in range(3)])  # rows: targets
    sims = np.concatenate([probs, anchor], axis=1)  # (3, 6)

    def soft(s, mask, hard):
        cost = (1 - s) / (1 - s).max()
        plan = numpy_code_sinkhorn(cost, mask)
        y = 0.7 * plan / plan.sum(1, keepdims=True) + 0.3 * hard
        y = np.exp(y) / np.exp(y).sum(1, keepdims=True)  # the code's softmax over the soft labels
        return y

    def kl(y, s):  # KLDivLoss(batchmean) against log_softmax(s)
        log_p = s - np.log(np.exp(s).sum(1, keepdims=True))
        return (y * (np.log(y) - log_p)).sum() / s.shape[0]

    expected = (kl(soft(sims, allowed, onehot), sims) + kl(soft(sims.T, allowed.T, onehot.T), sims.T)) / 2
    loss = code_btu_loss(q, t, n, noisy, SCALE, 0.7)
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    loss.backward()
    assert q.grad.abs().sum() > 0 and n.grad.abs().sum() > 0  # the negatives are not detached, as in the code
    # nothing flagged (possible with omega_form=threshold): the last negative's t2v row has no open path;
    # it gets no plan share (the code, which always flags int(omega * B) >= 1, would give 0 / 0 there)
    assert torch.isfinite(code_btu_loss(q, t, n, torch.zeros(3, dtype=torch.bool), SCALE, 0.7))


# --------------------------------------------------------------------------- TME noise


def test_tme_noise_splits_the_noisy_share_into_thirds():
    from demind.triplets.noise import image_noise_rows, inject_noise, noise_order, tme_rows

    n, rate = 20, 0.35  # round(7) noisy: thirds cut at int(7 / 3) = 2 and int(14 / 3) = 4 -> 2, 2, 3
    rows = tme_rows(n, rate)
    noisy = noise_order(n)[:7]
    groups = [noisy[:2], noisy[2:4], noisy[4:]]
    for part in range(3):
        assert sorted(rows[part].tolist()) == list(range(n))  # a permutation
        moved = set(torch.nonzero(rows[part] != torch.arange(n)).flatten().tolist())
        assert moved <= set(groups[part])  # only its own third moves, within that third
        assert sorted(rows[part, groups[part]].tolist()) == sorted(groups[part])
    texts = [f"text {i}" for i in range(n)]
    noisy_texts, mask = inject_noise(texts, None, rate, "tme")
    assert noisy_texts == [texts[j] for j in rows[1].tolist()]
    assert mask.tolist() == (rows != torch.arange(n)).any(0).tolist()
    ref_rows, tgt_rows = image_noise_rows(n, rate, "tme")
    assert torch.equal(ref_rows, rows[0]) and torch.equal(tgt_rows, rows[2])
    assert image_noise_rows(n, rate, "hard") is None
    assert torch.equal(tme_rows(n, rate), rows)  # fixed: the same for every seed and mode


# --------------------------------------------------------------------------- the objective per mode


def tiny_batch(b: int = 8, d: int = 6):
    from demind.combiner import Combiner
    from demind.schema import CombinerConfig

    torch.manual_seed(0)
    model = Combiner(CombinerConfig(embed_dim=d, projection_dim=8, hidden_dim=8, dropout=0.0))
    ref, text, target, negated, pool = (torch.randn(b, d) for _ in range(5))
    return model, ref, text, target, negated, pool


def robust_config(mode: str, **kw):
    from demind.triplets.config import TripletRobustConfig

    return TripletRobustConfig(mode=mode, **kw)


def run_loss(mode: str, after_warmup: bool, **kw):
    from demind.triplets.modes import batch_loss, start_negative_offset

    model, ref, text, target, negated, pool = tiny_batch()
    cfg = robust_config(mode, **kw)
    start_negative_offset(model, cfg)
    terms = batch_loss(model, ref, text, target, cfg, SCALE, after_warmup=after_warmup, clean_prior=None,
                       generator=torch.Generator().manual_seed(0), negative_text=negated, noise_images=pool)
    return terms, model, (ref, text, target, negated), cfg


@pytest.mark.parametrize("after_warmup", [False, True])
def test_conesep_default_objective_is_the_codes(after_warmup):
    from demind.robust import nbl_fixed_band, nbl_target_oriented, rcl_loss

    terms, model, (ref, text, target, negated), cfg = run_loss("conesep", after_warmup)
    assert (cfg.zeta, cfg.nu, cfg.kappa, cfg.omega, cfg.omega_form) == (0.8, 0.5, 0.5, 0.5, "share")
    assert torch.equal(model.negative_prompt.detach(), torch.zeros_like(model.negative_prompt))  # offset at 0
    query, target_n = model(ref, text), F.normalize(target, dim=-1)
    negative = model.negative(ref, negated)
    assert torch.allclose(negative, model(ref, negated))  # offset 0: the negated text through the same model
    robust = rcl_loss(query, target_n, SCALE).mean()  # every triplet, flagged or not
    assert torch.allclose(terms["nce"], robust, atol=1e-6) and terms["kept"] == 1
    band = nbl_fixed_band(query, negative, SCALE)
    assert torch.allclose(terms["intra"], band, atol=1e-6)
    if after_warmup:
        assert terms["flagged"] == 0.5 and terms["inter"] == 0 and terms["ul"] > 0
        expected = robust + 0.8 * band + 0.5 * terms["ul"]
    else:
        inter = nbl_target_oriented(negative, target_n, SCALE)
        assert torch.allclose(terms["inter"], inter, atol=1e-6) and terms["ul"] == 0 and terms["flagged"] == 0
        expected = robust + 0.8 * band + 0.5 * inter
    assert torch.allclose(terms["loss"], expected, atol=1e-5)


def test_ablations_drop_their_module():
    rcl, *_ = run_loss("rcl", True)
    assert rcl["intra"] == 0 and rcl["ul"] == 0 and rcl["flagged"] == 0
    nobtu, *_ = run_loss("conesep-nobtu", True)
    assert nobtu["ul"] == 0 and nobtu["intra"] > 0
    nonbl, *_ = run_loss("conesep-nonbl", True)
    assert nonbl["intra"] == 0 and nonbl["ul"] > 0 and nonbl["flagged"] == 0.5
    nogfq, model, (ref, text, target, _), _ = run_loss("conesep-nogfq", True)
    assert nogfq["ul"] > 0 and nogfq["flagged"] == 0.5
    for terms in (rcl, nobtu, nonbl, nogfq):
        assert torch.allclose(terms["nce"], rcl["nce"], atol=1e-6)  # the same L_robust in every row


def test_nogfq_flags_the_lowest_similarities():
    from demind.triplets.modes import batch_fidelity, batch_similarity, noisy_flags

    model, ref, text, target, _, pool = tiny_batch()
    sims = batch_similarity(model, ref, text, target)
    lowest = set(torch.argsort(sims)[:4].tolist())
    cfg = robust_config("conesep")
    fidelity = batch_fidelity(model, ref, text, target, 1, torch.Generator().manual_seed(0), cfg, pool)
    flagged = set(torch.nonzero(noisy_flags(fidelity, cfg)).flatten().tolist())
    assert len(flagged) == 4
    assert set(torch.nonzero(noisy_flags(sims, cfg)).flatten().tolist()) == lowest


OLD_FORMS = dict(omega_form="threshold", fidelity="sigmoid", boundary="fitted", robust_loss="infonce",
                 negative="prompt", nbl="siglip", zeta=0.5, pairings=4)


def test_our_earlier_forms_stay_selectable():
    from demind.fidelity import composed_boundary, fidelity_from_similarity
    from demind.losses import per_sample_info_nce, weighted_mean
    from demind.robust import nbl_loss

    model, ref, text, target, _, _ = tiny_batch()
    from demind.triplets.modes import batch_loss

    cfg = robust_config("conesep-nobtu", **OLD_FORMS)
    terms = batch_loss(model, ref, text, target, cfg, SCALE, after_warmup=True, clean_prior=None,
                       generator=torch.Generator().manual_seed(3))
    model.eval()
    boundary = composed_boundary(model, ref, text, target, 4, torch.Generator().manual_seed(3))
    query, target_n = model(ref, text), F.normalize(target, dim=-1)
    clean = fidelity_from_similarity(F.cosine_similarity(query, target_n, dim=-1), boundary) >= 0.5
    nce = weighted_mean(per_sample_info_nce(query, target_n, SCALE), clean.float())
    intra = nbl_loss(model.negative(ref), target_n, query, 0.5)
    assert torch.allclose(terms["nce"], nce, atol=1e-6)
    assert torch.allclose(terms["loss"], nce + 0.5 * intra, atol=1e-5)
    assert terms["kept"] == clean.float().mean()


def test_btu_paper_stays_the_default_and_code_is_selectable():
    from demind.robust import btu_loss, code_btu_loss, nbl_fixed_band, rcl_loss
    from demind.triplets.modes import batch_fidelity, noisy_flags

    paper, model, (ref, text, target, negated), cfg = run_loss("conesep", True)
    assert cfg.btu == "paper"  # the default, fixed before any run
    _, _, _, _, _, pool = tiny_batch()
    query, target_n, negative = model(ref, text), F.normalize(target, dim=-1), model.negative(ref, negated)
    fidelity = batch_fidelity(model, ref, text, target, 1, torch.Generator().manual_seed(0), cfg, pool)
    noisy = noisy_flags(fidelity, cfg)
    ul, _ = btu_loss(query, target_n, negative, noisy, SCALE, 0.7, cfg.sinkhorn_reg, cfg.sinkhorn_iters)
    assert torch.equal(paper["ul"], ul)  # bit for bit the paper's form, as before the option
    explicit, *_ = run_loss("conesep", True, btu="paper")
    assert torch.equal(explicit["loss"], paper["loss"])
    code, *_ = run_loss("conesep", True, btu="code")
    assert torch.allclose(code["ul"], code_btu_loss(query, target_n, negative, noisy, SCALE, 0.7), atol=1e-6)
    assert not torch.allclose(code["ul"], paper["ul"])
    robust, band = rcl_loss(query, target_n, SCALE).mean(), nbl_fixed_band(query, negative, SCALE)
    assert torch.allclose(code["loss"], robust + 0.8 * band + 0.5 * code["ul"], atol=1e-5)
    for mode in ("conesep-nonbl", "conesep-nogfq"):
        terms, *_ = run_loss(mode, True, btu="code")
        assert torch.isfinite(terms["ul"]) and terms["ul"] > 0
    warm, *_ = run_loss("conesep", False, btu="code")
    assert warm["ul"] == 0  # BTU after the warm-up only, in either form


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("mode", ["conesep", "conesep-nogfq", "rcl", "conesep-btucode"])
def test_authors_forms_train_on_tme_noise(tmp_path, mode, one_thread_and_fresh_accelerator):
    import json

    from test_triplets import tiny_config, write_tiny_triplets

    from demind.triplets.train import train_triplets

    write_tiny_triplets(tmp_path / "data")
    extra = {"noise.rate": 0.5, "noise.kind": "tme"}
    if mode == "conesep-btucode":
        extra["robust.btu"] = "code"
    cfg = tiny_config(tmp_path / "data", tmp_path / mode, mode.replace("-btucode", ""), epochs=3, **extra)
    train_triplets(cfg)
    lines = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert all(math.isfinite(x["loss"]) for x in lines)
    if mode != "rcl":
        assert [x["flagged"] for x in lines] == [0, 0, 0.5]  # two warm-up epochs, then half of each batch
        assert lines[2]["ul"] > 0
    detection = json.loads((tmp_path / mode / "detection.json").read_text())
    assert detection["noisy"] > 0 and detection["auroc"] is not None


# --------------------------------------------------------------------------- the benchmark's tests


def fake_result(hit5: str, sub1: str) -> dict:
    return {"qids": [f"q{i}" for i in range(len(hit5))], "units": ["a", "a", "b", "b", "c", "c"][: len(hit5)],
            "hit5": hit5, "subset1": sub1}


def test_benchmark_tests_per_seed_over_sets_never_summed():
    from benchmarks.conesep_triplets import paired_tests, verdict

    # A beats B on both queries of set a, in both seeds: one set better (not two queries), per seed
    a = {0: fake_result("110000", "110000"), 1: fake_result("110000", "110000")}
    b = {0: fake_result("000000", "000000"), 1: fake_result("000000", "000000")}
    tests = paired_tests(a, b)
    assert sorted(tests) == [0, 1]
    for t in tests.values():
        assert (t["unit"], t["n_units"], t["better"], t["worse"]) == ("set", 3, 1, 0)
        assert t["p_sign"] == 1.0  # one set of three: nothing to conclude
    row = {"Avg": (40.0, 0.1), "vs_b": {s: dict(t, p_sign=0.01) for s, t in tests.items()}}
    assert verdict(row, {"Avg": (39.0, 0.1)}, "vs_b")["holds"]  # two seeds in favour, none against
    row["vs_b"][1] = dict(row["vs_b"][1], better=0, worse=1)
    assert not verdict(row, {"Avg": (39.0, 0.1)}, "vs_b")["holds"]  # one seed significantly against
