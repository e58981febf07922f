"""Negation: the rule decomposer against its labelled set, DEO's two solvers, the +deo methods."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from demind.eval.metrics import paired_ap
from demind.negation.decompose import RuleDecomposer
from demind.negation.deo import DEOConfig, SubQueries, adam_optimise, closed_form, deo_loss, optimise
from demind.negation.report import cirr_flags, is_correct, load_phrasings, normalise_phrase, rule_accuracy

RULES = RuleDecomposer()


# ------------------------------------------------------------------ decomposition

def test_labelled_set_is_large_varied_and_rules_reach_95_percent():
    items = load_phrasings()
    assert len(items) >= 150
    cues = {it["cue"] for it in items}
    for family in ("without", "with no", "no", "not", "except", "but not", "other than", "excluding", "minus",
                   "remove", "get rid of", "instead of", "take out", "lose the", "control"):
        assert family in cues, family
    assert sum(len(it["negatives"]) > 1 for it in items) >= 10  # several negatives in one query
    assert sum(it["cue"] == "control" for it in items) >= 30
    acc = rule_accuracy(RULES, items)
    assert acc.fraction >= 0.95, "\n".join(f"{f['query']!r} -> {f['got_positive']!r} {f['got_negatives']}"
                                           for f in acc.failures)


@pytest.mark.parametrize("query", ["a notebook on a desk", "a knot in a rope", "bus no. 5 at the station",
                                   "nothing but blue sky", "not only a cat but also a dog", "a cannot-miss sunset",
                                   "remove one dog from the image", "a photo of * , add a red square", ""])
def test_a_query_without_negation_comes_back_unchanged(query):
    d = RULES.decompose_one(query)
    assert d.positive == query and d.negatives == () and d.cues == () and not d.has_negation


def test_rule_decomposition_by_hand():
    d = RULES.decompose_one("same dress, without the belt and the scarf, no logo")
    assert d.positive == "same dress"
    assert d.negatives == ("belt", "scarf", "logo")
    # the removed spans are the cues with their phrases
    assert [d.query[s:e] for s, e in d.cues] == ["without the belt and the scarf", "no logo"]
    d = RULES.decompose_one("a mug without a handle on a wooden table")
    assert (d.positive, d.negatives) == ("a mug on a wooden table", ("handle",))
    # another article, or "as", after "and" starts a new (wanted) clause
    d = RULES.decompose_one("remove the hexagon and a photo version")
    assert (d.positive, d.negatives) == ("a photo version", ("hexagon",))
    d = RULES.decompose_one("remove the small diamond and as an origami")
    assert (d.positive, d.negatives) == ("as an origami", ("small diamond",))


def test_placeholder_keeps_its_own_word():
    """CLIP's BPE reads "*," as one token: the composed prompt's " * , " must survive."""
    d = RULES.decompose_one("a photo of * , remove the red square, with the same yellow square")
    assert d.positive == "a photo of * , with the same yellow square" and d.negatives == ("red square",)
    assert RULES.decompose_one("a photo of * , without the dog").positive == "a photo of *"


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="must be a string"):
        RULES.decompose([None])  # type: ignore[list-item]


def test_labelled_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"query": "a", "positive": "a", "negatives": [], "cue": "control"}\n{"query": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: missing key"):
        load_phrasings(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: not JSON"):
        load_phrasings(bad)


def test_scoring_normalises_determiners_and_punctuation():
    d = RULES.decompose_one("The kitchen, without any people.")
    assert normalise_phrase("The red square,") == "red square"
    assert is_correct(d, {"positive": "kitchen", "negatives": ["the people"]})
    assert not is_correct(d, {"positive": "kitchen", "negatives": ["people", "cats"]})


def test_cirr_flags_counts_by_cue(tmp_path):
    caps = [{"caption": "remove the dog"}, {"caption": "a cat instead of a dog"}, {"caption": "make it red"},
            {"caption": "the dog does not show its tongue and no leash"}]
    path = tmp_path / "cap.rc2.val.json"
    path.write_text(json.dumps(caps))
    flags = cirr_flags([path], RULES)
    assert flags["captions"] == 4 and flags["flagged"] == 3
    assert flags["by_cue"] == {"remove": 1, "instead of": 1, "not": 1, "no": 1}
    path.write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="expected a CIRR caption file"):
        cirr_flags([path], RULES)


# ---------------------------------------------------------------------------- DEO

def _problem(batch=4, dim=8, n_pos=2, n_neg=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    e_o = unit(batch, dim)
    positives = [unit(1 + (b % n_pos), dim) for b in range(batch)]
    negatives = [unit(1 + (b % n_neg), dim) for b in range(batch)]
    return e_o, SubQueries.from_lists(positives, negatives, dim), positives, negatives


def test_closed_form_by_hand():
    e_o = torch.tensor([[1.0, 0.0]])
    sub = SubQueries.from_lists([torch.tensor([[0.0, 1.0], [0.0, 3.0]])], [torch.tensor([[2.0, 0.0]])], 2)
    cfg = DEOConfig(lambda_p=1.0, lambda_n=0.5, lambda_o=1.0)
    # p_bar = (0, 2), n_bar = (2, 0): (1*(0,2) - 0.5*(2,0) + 1*(1,0)) / 1.5 = (0, 2) / 1.5
    assert torch.allclose(closed_form(e_o, sub, cfg), torch.tensor([[0.0, 2.0 / 1.5]]))


# lr: the paper's text weights put e* = 5 (p_bar - n_bar) + e_o far from e_o (curvature 0.2), so
# that case needs larger steps to arrive within 300; the claim tested is where Adam ends up.
@pytest.mark.parametrize("lambdas, lr", [((1.0, 1.0, 1.0), 0.1), ((1.0, 1.0, 0.2), 0.5), ((2.0, 0.5, 0.3), 0.1)])
def test_adam_converges_to_the_closed_form(lambdas, lr):
    lp, ln, lo = lambdas
    e_o, sub, _, _ = _problem()
    exact = DEOConfig(mode="exact", lambda_p=lp, lambda_n=ln, lambda_o=lo, normalise=False)
    long_adam = DEOConfig(mode="adam", steps=300, lr=lr, lambda_p=lp, lambda_n=ln, lambda_o=lo, normalise=False)
    e_star = closed_form(e_o, sub, exact)
    # the closed form is a stationary point of the loss ...
    x = e_star.clone().requires_grad_(True)
    deo_loss(x, e_o, sub, exact).sum().backward()
    assert x.grad.abs().max() < 1e-5
    # ... and where Adam ends up
    assert torch.allclose(adam_optimise(e_o, sub, long_adam), e_star, atol=1e-4)


def test_paper_schedule_lowers_the_loss_and_batches_exactly():
    e_o, sub, positives, negatives = _problem()
    cfg = DEOConfig(mode="adam", normalise=False)  # 20 steps
    e_u = adam_optimise(e_o, sub, cfg)
    assert (deo_loss(e_u, e_o, sub, cfg) < deo_loss(e_o, e_o, sub, cfg)).all()
    one_by_one = torch.cat([adam_optimise(e_o[b : b + 1], SubQueries.from_lists([positives[b]], [negatives[b]], 8), cfg)
                            for b in range(4)])
    assert torch.allclose(e_u, one_by_one, atol=1e-6)


def test_unbounded_loss_refused_exactly_and_capped_by_adam(caplog):
    e_o, sub, _, _ = _problem()
    with pytest.raises(ValueError, match="λp \\+ λo > λn"):
        optimise(e_o, sub, DEOConfig(mode="exact", lambda_n=2.0))
    cfg = DEOConfig(mode="adam", lambda_n=2.0, steps=20, lr=0.01, normalise=False)
    with caplog.at_level(logging.WARNING):
        e_u = adam_optimise(e_o, sub, cfg)
    assert "unbounded below" in caplog.text
    assert torch.isfinite(e_u).all()
    # Adam's per-coordinate step is bounded (about lr; (1 - beta1) / sqrt(1 - beta2) < 3.2 in the worst case)
    assert (e_u - e_o).abs().max() <= cfg.steps * cfg.lr * 3.2
    assert torch.allclose(optimise(e_o, sub, DEOConfig(mode="adam", lambda_n=2.0)).norm(dim=-1), torch.ones(4))


def test_queries_without_negatives_keep_e_o_exactly_and_outputs_are_unit_norm():
    e_o, _, positives, negatives = _problem()
    e_o = e_o * 1.5  # not normalised: a row DEO leaves alone is not even renormalised
    negatives[1] = torch.zeros(0, 8)
    negatives[3] = torch.zeros(0, 8)
    sub = SubQueries.from_lists(positives, negatives, 8)
    for mode in ("exact", "adam"):
        out = optimise(e_o, sub, DEOConfig(mode=mode))
        assert torch.equal(out[1], e_o[1]) and torch.equal(out[3], e_o[3])
        assert torch.allclose(out[[0, 2]].norm(dim=-1), torch.ones(2))
    raw = optimise(e_o, sub, DEOConfig(mode="exact", normalise=False))
    assert torch.allclose(raw[0], closed_form(e_o[:1], SubQueries.from_lists(positives[:1], negatives[:1], 8),
                                              DEOConfig())[0])


def test_deo_config_and_inputs_are_checked():
    with pytest.raises(ValueError, match="mode"):
        DEOConfig(mode="sgd")
    with pytest.raises(ValueError, match="no positive"):
        optimise(torch.ones(1, 2), SubQueries.from_lists([torch.zeros(0, 2)], [torch.ones(1, 2)], 2), DEOConfig())
    with pytest.raises(ValueError, match=r"must be \(k, 2\)"):
        SubQueries.from_lists([torch.ones(1, 3)], [torch.ones(1, 2)], 2)


# ---------------------------------------------------------------- paired metric

def test_paired_ap_by_hand():
    targets = {"q1": {"a"}, "q2": {"a", "b"}, "q3": {"c"}}
    a = {"q1": ["a", "x"], "q2": ["x", "a"], "q3": ["c", "x"]}  # AP@2: 1, 0.25, 1
    b = {"q1": ["x", "a"], "q2": ["a", "b"], "q3": ["c", "x"]}  # AP@2: 0.5, 1, 1
    assert paired_ap(a, b, targets, 2) == (1, 1)
    with pytest.raises(ValueError, match="different queries"):
        paired_ap(a, {"q1": ["a"]}, targets, 2)


# ------------------------------------------------------------------ +deo methods

@pytest.fixture(scope="module")
def deo_model(tiny_backbone):
    from demind.model import DeMinds
    from demind.schema import ModelConfig

    torch.manual_seed(0)
    return DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16, gate_init=0.5),
                   tiny_backbone).eval()


PROMPTS = ["a photo of * , without the red square", "a photo of * , make it blue", "a photo of * , remove the dog"]
TEXTS = ["a cat without a hat", "a blue cat", "remove the dog"]


def test_text_only_deo_by_hand(tiny_backbone):
    from demind.retrieval import build_methods, parse_method_names

    deo, base = build_methods(parse_method_names("text-only+deo,text-only", False), tiny_backbone, None)
    ref = torch.randn(3, tiny_backbone.embed_dim)
    with torch.no_grad():
        got = deo.embed(ref, PROMPTS, TEXTS)
        e_o = base.embed(ref, PROMPTS, TEXTS)
        enc = lambda t: F.normalize(tiny_backbone.encode_text(t).pooled, dim=-1)  # noqa: E731
        p, n = enc(["a cat"]), enc(["a photo of hat", "a photo of dog"])
    # λ = 1, 1, 1: e* = p - n + e_o, normalised; "remove the dog" restates nothing, so p = e_o
    assert torch.allclose(got[0], F.normalize(p[0] - n[0] + e_o[0], dim=-1), atol=1e-5)
    assert torch.allclose(got[2], F.normalize(e_o[2] - n[1] + e_o[2], dim=-1), atol=1e-5)
    assert torch.equal(got[1], e_o[1])  # no cue: the base query, bit for bit
    assert deo.touched == 2 and deo.label == "Text-only + DEO"


@pytest.mark.parametrize("name", ["demind", "mapping-only", "image+text"])
def test_composed_deo_uses_the_reference_with_the_positive_prompt(name, tiny_backbone, deo_model):
    from demind.retrieval import build_methods
    from demind.negation.deo import DEOConfig

    deo, base = build_methods([f"{name}+deo", name], tiny_backbone, deo_model, deo=DEOConfig(normalise=False))
    ref = torch.randn(3, tiny_backbone.embed_dim)
    with torch.no_grad():
        got = deo.embed(ref, PROMPTS, TEXTS)
        e_o = base.embed(ref, PROMPTS, TEXTS)
        if name == "image+text":  # reads the texts: positive "a cat" with the same reference
            p = base.embed(ref[:1], ["unused"], ["a cat"])[0]
            neg = "a photo of hat"
        else:  # reads the prompts: positive = the reference with "a photo of *"
            p = base.embed(ref[:1], ["a photo of *"], ["unused"])[0]
            neg = "a photo of red square"
        n = F.normalize(tiny_backbone.encode_text([neg]).pooled, dim=-1)[0]
    assert torch.allclose(got[0], p - n + e_o[0], atol=1e-5)
    assert torch.equal(got[1], e_o[1])


def test_deo_method_names_are_checked(tiny_backbone):
    from demind.retrieval import DEOMethod, ImageOnly, parse_method_names
    from demind.negation.deo import DEOConfig

    assert parse_method_names("text-only+deo,image+text+deo-adam", False) == ["text-only+deo", "image+text+deo-adam"]
    with pytest.raises(ValueError, match="need a trained model"):
        parse_method_names("demind+deo", False)
    with pytest.raises(ValueError, match="unknown method"):
        parse_method_names("image-only+deo", False)
    with pytest.raises(ValueError, match="reads no text"):
        DEOMethod(ImageOnly(tiny_backbone), RULES, DEOConfig())


def test_report_cli(tmp_path, capsys):
    from demind.cli.negation_report import main

    caps = tmp_path / "cap.rc2.val.json"
    caps.write_text(json.dumps([{"caption": "remove the dog"}, {"caption": "make it red"}]))
    assert main(["--cirr", str(caps), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "labelled phrasings" in out and "CIRR captions flagged: 1 of 2" in out
    assert json.loads((tmp_path / "r.json").read_text())["cirr"]["by_cue"] == {"remove": 1}
    assert main(["--phrasings", str(tmp_path / "missing.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err


def test_adam_variant_runs_inside_no_grad(tiny_backbone):
    """The harness embeds under torch.no_grad(); the Adam solver must still get gradients."""
    from demind.retrieval import build_methods

    deo, base = build_methods(["text-only+deo-adam", "text-only"], tiny_backbone, None)
    ref = torch.randn(3, tiny_backbone.embed_dim)
    with torch.no_grad():
        got, e_o = deo.embed(ref, PROMPTS, TEXTS), base.embed(ref, PROMPTS, TEXTS)
    assert deo.cfg.mode == "adam" and deo.label == "Text-only + DEO (Adam)"
    assert not torch.allclose(got[0], e_o[0]) and torch.equal(got[1], e_o[1])
    assert torch.allclose(got.norm(dim=-1), torch.ones(3))
