"""ExclCOCO builder: ground truth against an independent predicate, counts, determinism, bad input, reader."""

from __future__ import annotations

import json
import re

import pytest

from demind.eval.exclcoco import read_exclcoco
from demind.exclcoco import ExclCocoConfig, build_exclcoco, singular
from benchmarks.synthetic import write_synthetic_coco


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
    from demind.exclcoco import LabelIndex, category_phrases, tokens

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
    from demind.gen.tiny_llava import build_tiny_llava_next

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
