"""ExclCOCO builder: ground truth against an independent predicate, counts, determinism, bad input, reader."""

from __future__ import annotations

import json
import re

import pytest
import torch

from demind.eval.exclcoco import read_exclcoco
from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco
from demind.exclcoco_labels import singular
from toyworld.synthetic import write_synthetic_coco


@pytest.fixture(scope="module")
def fixture_coco(tmp_path_factory):
    folder = tmp_path_factory.mktemp("coco")
    instances, captions, images = write_synthetic_coco(folder, 120, seed=3, write_images=True)
    return folder, instances, captions, images


def build(fixture_coco, out, **kw):
    _, instances, captions, images = fixture_coco
    cfg = ExclCocoConfig(caption_min_images=10, **kw)
    path, counts = build_exclcoco(instances, captions, out, images, cfg)
    return json.loads(path.read_text()), counts


def independent_labels(instances_path, captions_path, word_labels):
    """Per image: categories from the instances, plus word labels found by a plain regex
    (word, word+s, word+es) in its captions -- written without the builder's code."""
    inst = json.loads(instances_path.read_text())
    names = {c["id"]: c["name"] for c in inst["categories"]}
    labels = {str(i["id"]): set() for i in inst["images"]}
    for a in inst["annotations"]:
        labels[str(a["image_id"])].add(names[a["category_id"]])
    for c in json.loads(captions_path.read_text())["annotations"]:
        text = c["caption"].lower()
        for w in word_labels:
            if re.search(rf"\b{w}(s|es)?\b", text):
                labels[str(c["image_id"])].add(w)
    return labels


def test_ground_truth_matches_an_independent_predicate(fixture_coco, tmp_path):
    _, instances, captions, _ = fixture_coco
    data, counts = build(fixture_coco, tmp_path / "out")
    assert data["labels"]["caption_words"]  # the scene words of the fixture pass the threshold
    labels = independent_labels(instances, captions, data["labels"]["caption_words"])
    assert len(data["queries"]) > 50
    for q in data["queries"]:
        expected = sorted((i for i, have in labels.items()
                           if set(q["include"]) <= have and q["exclude"] not in have), key=int)
        assert q["ground_truth"] == expected, q["id"]
        hard = sorted((i for i, have in labels.items() if set(q["include"]) | {q["exclude"]} <= have), key=int)
        assert q["hard_negatives"] == hard and q["image_id"] in hard, q["id"]
        positive = labels[q["image_id"]]
        assert set(q["include"]) <= positive and q["exclude"] in positive  # the caption's image shows all
        assert q["image_id"] not in q["ground_truth"]
        assert q["exclude"] not in q["include"] and len(q["include"]) >= 1
        assert q["exclude"].split()[-1][:3] in q["query"] or q["exclude"] in q["query"]
        assert any(p in q["query"] for p in (" without ", " but not ", " with no ", " except for "))


def test_counts_add_up_and_build_is_deterministic(fixture_coco, tmp_path):
    data, counts = build(fixture_coco, tmp_path / "a")
    again, _ = build(fixture_coco, tmp_path / "b")
    assert counts.captions_read == 600
    assert counts.pairs_formed == counts.kept + sum(counts.dropped.values())
    assert counts.kept == len(data["queries"])
    assert counts.dropped.get("no ground truth", 0) > 0  # some combinations have no ground truth
    assert data["queries"] == again["queries"]
    other, _ = build(fixture_coco, tmp_path / "c", seed=1)
    assert [q["query"] for q in other["queries"]] != [q["query"] for q in data["queries"]]


def test_max_per_caption_and_categories_only(fixture_coco, tmp_path):
    capped, counts = build(fixture_coco, tmp_path / "capped", max_queries=25, max_ground_truth=10)
    assert len(capped["queries"]) == 25 and max(len(q["ground_truth"]) for q in capped["queries"]) <= 10
    assert counts.dropped["over max_queries (seeded subset)"] > 0 and counts.dropped["over max_ground_truth"] > 0
    assert counts.pairs_formed == counts.kept + sum(counts.dropped.values())
    one, counts = build(fixture_coco, tmp_path / "one", max_per_caption=1)
    assert max(sum(q["caption_id"] == c for q in one["queries"]) for c in {q["caption_id"] for q in one["queries"]}) == 1
    _, instances, captions, images = fixture_coco
    path, _ = build_exclcoco(instances, captions, tmp_path / "cats", images, ExclCocoConfig(caption_min_images=0))
    data = json.loads(path.read_text())
    assert data["labels"]["caption_words"] == []
    cats = set(data["labels"]["categories"])
    assert all(set(q["include"]) | {q["exclude"]} <= cats for q in data["queries"])


def test_singular_and_synonyms():
    assert [singular(w) for w in ("dogs", "buses", "people", "skis", "cities", "grass", "glasses")] == \
        ["dog", "bus", "person", "ski", "city", "grass", "glass"]
    from demind.exclcoco_labels import LabelIndex, category_phrases, tokens

    index = LabelIndex(["person", "dog", "hot dog"], [], category_phrases(["person", "dog", "hot dog"]))
    assert index.mentioned(tokens("Two men eat hot dogs")) == ["person", "hot dog"]
    assert index.mentioned(tokens("A dog and a hot dog")) == ["dog", "hot dog"]


def test_bad_input_names_the_file(tmp_path):
    (tmp_path / "instances_val.json").write_text(json.dumps({"images": []}))
    (tmp_path / "captions_val.json").write_text("{not json")
    with pytest.raises(ValueError, match="instances_val.json lacks the COCO key"):
        build_exclcoco(tmp_path / "instances_val.json", tmp_path / "captions_val.json", tmp_path / "o", tmp_path)
    with pytest.raises(FileNotFoundError, match="nothere.json does not exist"):
        build_exclcoco(tmp_path / "nothere.json", tmp_path / "captions_val.json", tmp_path / "o", tmp_path)


def _set(data, key, i, field, value):
    if value is _DROP:
        del data[key][i][field]
    else:
        data[key][i][field] = value


_DROP = object()


@pytest.mark.parametrize("which, change, message", [
    ("instances", lambda d: _set(d, "annotations", 0, "category_id", "2"),
     r"instances_val2017.json: annotations\[0\].category_id must be an integer \(got \"2\"\)"),
    ("instances", lambda d: d.update(images={"1": "a.jpg"}), r"instances_val2017.json: images must be a list of objects, got a JSON object"),
    ("instances", lambda d: _set(d, "annotations", 1, "image_id", _DROP),
     r"instances_val2017.json: annotations\[1\].image_id must be an integer \(missing\)"),
    ("captions", lambda d: _set(d, "annotations", 2, "caption", None),
     r"captions_val2017.json: annotations\[2\].caption must be a string \(got null\)"),
    ("captions", lambda d: d.update(annotations=[5]), r"captions_val2017.json: annotations\[0\] must be an object"),
])
def test_malformed_coco_entries_name_file_entry_and_field(fixture_coco, tmp_path, which, change, message):
    """A string category id used to be dropped silently (kept 0, exit 0); the rest were tracebacks."""
    from demind.errors import InputError

    _, instances, captions, images = fixture_coco
    paths = {"instances": instances, "captions": captions}
    copy = tmp_path / paths[which].name
    data = json.loads(paths[which].read_text())
    change(data)
    copy.write_text(json.dumps(data))
    paths[which] = copy
    with pytest.raises(InputError, match=message):
        build_exclcoco(paths["instances"], paths["captions"], tmp_path / "out", images, ExclCocoConfig())


def test_reader_gives_text_queries_over_the_whole_split(fixture_coco, tmp_path):
    data, _ = build(fixture_coco, tmp_path / "out")
    bench = read_exclcoco(tmp_path / "out")
    group = bench.groups[0]
    assert group.metric == "exclusion" and len(group.gallery) == 120
    q0, raw = group.queries[0], data["queries"][0]
    assert q0.text == raw["query"] and q0.targets == tuple(raw["ground_truth"]) and q0.exclude is None
    assert q0.reference.name == raw["image_id"] and q0.reference.path.is_file()
    broken = dict(data, queries=[dict(raw, ground_truth=[raw["image_id"]])])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "exclcoco.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="cannot be ground truth"):
        read_exclcoco(tmp_path / "bad")


def test_llm_texts_accepted_only_when_they_name_the_excluded_label(fixture_coco, tmp_path):
    _, instances, captions, images = fixture_coco
    seen = []

    def fake_llm(queries):
        seen.extend(queries)
        # even rows name the excluded label (accepted), odd rows do not (template kept)
        return [f"{q['include'][0]} but no {q['exclude']}" if i % 2 == 0 else "something else"
                for i, q in enumerate(queries)]

    fake_llm.record = {"version": "fake"}
    path, counts = build_exclcoco(instances, captions, tmp_path / "llm", images,
                                  ExclCocoConfig(caption_min_images=10, query_source="llm"), llm=fake_llm)
    data = json.loads(path.read_text())
    assert all(q["image_path"].is_file() for q in seen)
    sources = [q["text_source"] for q in data["queries"]]
    assert sources[0::2] == ["llm"] * len(sources[0::2])
    assert set(sources[1::2]) == {"template (llm output rejected)"}
    assert data["queries"][0]["query"].endswith(f"but no {data['queries'][0]['exclude']}")
    assert counts.text_sources == {"llm": len(sources[0::2]), "template (llm output rejected)": len(sources[1::2])}
    assert data["prompt"] == {"version": "fake"}


@pytest.mark.slow
def test_llm_query_source_end_to_end_with_the_tiny_llava(fixture_coco, tmp_path, capsys):
    from demind.cli import build_exclcoco as cli
    from demind.engines.tiny_llava import build_tiny_llava_next

    folder, *_ = fixture_coco
    model = build_tiny_llava_next(tmp_path / "tiny-llava")
    config = tmp_path / "llm.yaml"
    config.write_text(f"engine: {{name: transformers, model: {model}, dtype: float32, batch_size: 16}}\n"
                      "sampling: {temperature: 0.7, top_p: 0.9}\nio: {image_max_side: 64}\nrun: {device: cpu, seed: 0}\n")
    args = ["--annotations", str(folder / "annotations"), "--split", "val2017", "--images", str(folder / "val2017"),
            "--out", str(tmp_path / "out"), "--caption-min-images", "0", "--max-per-caption", "1",
            "--query-source", "llm", "--llm-config", str(config)]
    assert cli.main(args) == 0
    data = json.loads((tmp_path / "out" / "exclcoco.json").read_text())
    assert data["prompt"]["version"] == "v1" and len(data["prompt"]["sha"]) == 12
    assert data["counts"]["kept"] == len(data["queries"]) == sum(data["counts"]["text_sources"].values())
    assert {q["text_source"] for q in data["queries"]} <= {"llm", "template (llm output rejected)"}
    assert "query text:" in capsys.readouterr().out
    assert cli.main([*args[:-4], "--query-source", "llm"]) == 2  # no --llm-config: one clear line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is required by query_source=llm: give --llm-config" in err


# ------------------------------------------------------------------ exclusion and inclusion AUC in demind-eval
# Six images; the scores are fixed by hand (a stub method, gallery i = unit vector i), so the AUCs are
# countable on paper. Query a: ground truth {3, 4}, hard negatives {1, 2}, the rest {5, 6};
# query b: ground truth {5}, hard negatives {2}, the rest {1, 3, 4, 6}.
HAND_SCORES = {"a and c without b": [0.9, 0.5, 0.8, 0.4, 0.6, 0.1],
               "d without e": [0.2, 0.3, 0.3, 0.1, 0.7, 0.3]}


def write_hand_case(root, with_hard_negatives=True):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    for i in range(1, 7):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / "images" / f"{i}.png")
    queries = [{"id": "a", "image_id": "1", "positive_query": "p", "query": "a and c without b", "include": ["a", "c"],
                "exclude": "b", "ground_truth": ["3", "4"], "hard_negatives": ["1", "2"]},
               {"id": "b", "image_id": "2", "positive_query": "p", "query": "d without e", "include": ["d"],
                "exclude": "e", "ground_truth": ["5"], "hard_negatives": ["2"]}]
    if not with_hard_negatives:
        for q in queries:
            del q["hard_negatives"]
    (root / "exclcoco.json").write_text(json.dumps(
        {"format": "demind-exclcoco/1", "split": "val", "image_root": "images", "queries": queries,
         "images": {str(i): f"{i}.png" for i in range(1, 7)}}))
    return root


class HandScores:
    """text-only stand-in whose query-gallery scores are HAND_SCORES (gallery image i = unit vector i)."""

    name = "text-only"

    def __init__(self, backbone):
        self.backbone = backbone

    def query_texts(self, queries):
        return [q.text for q in queries]

    def embed(self, ref_features, prompts, texts):
        return torch.tensor([HAND_SCORES[t] for t in texts])

    def map_gallery(self, gallery):
        return torch.eye(gallery.shape[0])


def test_demind_eval_reports_the_aucs_of_a_hand_computed_case(tmp_path, tiny_backbone, monkeypatch):
    from demind.eval import evaluate, harness

    monkeypatch.setattr(harness, "build_methods", lambda names, backbone, *a, **k: [HandScores(backbone)])
    results = evaluate("exclcoco", write_hand_case(tmp_path / "data"), backbone=tiny_backbone, methods="text-only",
                       out_dir=tmp_path / "out", progress=False)
    got = results["methods"]["text-only"]
    # exclusion, a: ground truth .8 .4 vs hard .9 .5 -> only .8 > .5: 1/4; b: .7 > .3: 1 -> mean 0.625
    # inclusion, a: .9 .5 .8 .4 vs .6 .1 -> 2 + 1 + 2 + 1 = 6/8; b: .7 .3 vs .2 .3 .1 .3 -> 4 + 3 (ties 1/2) = 7/8
    assert got["exclusion AUC"] == pytest.approx(62.5) and got["inclusion AUC"] == pytest.approx(81.25)
    assert got["AP@1"] == 50.0  # a's top image is a hard negative, b's is its ground truth
    assert list(got)[-2:] == ["exclusion AUC", "inclusion AUC"]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["methods"]["text-only"]
    assert saved["exclusion AUC"] == pytest.approx(62.5)
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| exclusion AUC | inclusion AUC |" in table and "| 62.50 | 81.25 |" in table


def test_an_old_file_without_hard_negatives_reports_no_aucs_and_says_why(tmp_path, capsys, caplog):
    from helpers import TINY_CLIP, run_eval_command

    root = write_hand_case(tmp_path / "data", with_hard_negatives=False)
    results = run_eval_command(["--benchmark", "exclcoco", "--data-root", str(root), "--backbone", f"{TINY_CLIP}:none",
                                "--methods", "text-only", "--out", str(tmp_path / "out"), "run.progress=false"])
    assert list(results["methods"]["text-only"]) == ["AP@1", "AP@5", "MRR@5", "MRR@10", "NDCG@5", "NDCG@10",
                                                     "Hits@5", "Hits@10"]
    why = "lists no hard_negatives (written before the builder recorded them): exclusion AUC and inclusion AUC " \
          "are not reported"
    assert sum(why in r.getMessage() for r in caplog.records) == 1  # one log line
    assert why in capsys.readouterr().out and why in (tmp_path / "out" / "table.md").read_text()  # and a footnote


def test_hard_negatives_must_be_on_every_query_in_the_gallery_and_not_ground_truth(tmp_path):
    from demind.errors import InputError

    root = write_hand_case(tmp_path / "data")
    data = json.loads((root / "exclcoco.json").read_text())
    for change, message in ((lambda q: q[1].pop("hard_negatives"), "query b lacks 'hard_negatives', which 1 of the 2"),
                            (lambda q: q[0].update(hard_negatives=["1", "9"]), r"names image ids not in 'images': \['9'\]"),
                            (lambda q: q[0].update(hard_negatives=["1", "3"]), r"images \['3'\] are both ground truth")):
        broken = json.loads(json.dumps(data))
        change(broken["queries"])
        (root / "exclcoco.json").write_text(json.dumps(broken))
        with pytest.raises(InputError, match=message):
            read_exclcoco(root)


def test_the_builders_file_gives_hard_negatives_to_the_reader(fixture_coco, tmp_path):
    data, _ = build(fixture_coco, tmp_path / "out")
    group = read_exclcoco(tmp_path / "out").groups[0]
    assert group.hard_negatives == {str(q["id"]): tuple(q["hard_negatives"]) for q in data["queries"]}
    assert all(q["image_id"] in q["hard_negatives"] for q in data["queries"])  # the positive image is one


def test_a_row_without_the_aucs_prints_n_a():
    """A METHOD+rerank row has the eight metrics but no AUCs (no score for every gallery image)."""
    from demind.eval import format_table

    eight = {"AP@1": 50.0, "AP@5": 40.0, "MRR@5": 60.0, "MRR@10": 60.0, "NDCG@5": 45.0, "NDCG@10": 47.0,
             "Hits@5": 80.0, "Hits@10": 90.0}
    results = {"benchmark": "exclcoco", "split": "val", "backbone": {"name": "b", "pretrained": "p"},
               "has_ground_truth": True, "definitions": [], "counts": {}, "limit": None,
               "methods": {"text-only": {**eight, "exclusion AUC": 62.5, "inclusion AUC": 81.25},
                           "text-only+rerank": eight}}
    lines = format_table(results).splitlines()
    assert lines[0].startswith("ExclCOCO (val)") and lines[1].split()[-4:] == ["exclusion", "AUC", "inclusion", "AUC"]
    assert lines[3].split()[-2:] == ["62.50", "81.25"] and lines[4].split()[-2:] == ["n/a", "n/a"]


def test_a_query_without_a_pair_to_compare_is_left_out_of_the_mean_and_counted(tmp_path, tiny_backbone, monkeypatch,
                                                                                caplog):
    from demind.eval import evaluate, harness

    root = write_hand_case(tmp_path / "data")
    data = json.loads((root / "exclcoco.json").read_text())
    data["queries"][1]["hard_negatives"] = []  # b: no hard negative, so no exclusion AUC
    (root / "exclcoco.json").write_text(json.dumps(data))
    caplog.set_level("WARNING", logger="demind.eval.harness")
    monkeypatch.setattr(harness, "build_methods", lambda names, backbone, *a, **k: [HandScores(backbone)])
    got = evaluate("exclcoco", root, backbone=tiny_backbone, methods="text-only", progress=False)["methods"]["text-only"]
    # exclusion: a alone (1/4); inclusion, b: .7 against .2 .3 .3 .1 .3 -> 1, a 6/8 -> mean 0.875
    assert got["exclusion AUC"] == pytest.approx(25.0) and got["inclusion AUC"] == pytest.approx(87.5)
    assert "text-only (all): exclusion AUC undefined for 1 of 2 queries (no pair to compare); averaged over the rest" \
        in caplog.text


def test_a_reranked_row_has_no_aucs_and_a_log_line_says_why(tmp_path, caplog):
    from types import SimpleNamespace

    from demind.eval.harness import GroupOutcome, add_rerank_variants

    caplog.set_level("INFO", logger="demind.eval.harness")
    bench = read_exclcoco(write_hand_case(tmp_path / "data"))
    group = bench.groups[0]
    base = GroupOutcome({"AP@1": 0.5, "exclusion AUC": 0.625}, {"a": ["1", "3"], "b": ["5", "2"]})
    reranker = SimpleNamespace(rerank=lambda queries, rankings, gallery: {q: r[::-1] for q, r in rankings.items()})
    run = SimpleNamespace(reranker=lambda: reranker, rerank_targets=lambda names: names,
                          setup=SimpleNamespace(rerank=SimpleNamespace(methods=None)))
    outcomes = {"text-only": {group.name: base}}
    add_rerank_variants(outcomes, run, bench)
    reranked = outcomes["text-only+rerank"][group.name].metrics
    assert "AP@1" in reranked and not {"exclusion AUC", "inclusion AUC"} & set(reranked)
    assert "text-only+rerank: no exclusion or inclusion AUC" in caplog.text
