"""FashionIQ, COCO, ImageNet-R and CIRCO readers and runs on tiny fixtures written in their
official on-disk formats; missing-image accounting; errors that name the expected path."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import torch
import pytest
from PIL import Image

from demind.config import ConfigError
from demind.errors import InputError
from demind.eval import evaluate, format_table, load_backbone_and_model
from demind.eval.coco import build_coco_queries, coco_texts, read_coco
from demind.eval.fashioniq import read_fashioniq
from demind.eval.harness import read_benchmark
from demind.eval.options import CocoOptions, FashionIQOptions, ReaderOptions
from demind.retrieval import ImageReadError
from demind.eval.structures import DataLayoutError
from demind.model import DeMinds
from demind.schema import ModelConfig
from helpers import TINY_CLIP, run_eval_command

RNG = np.random.default_rng(0)


def write_image(path: Path, size: tuple[int, int] = (12, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


@pytest.fixture(scope="module")
def tiny_model(tiny_backbone):
    return DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16, gate_init=0.5),
                   tiny_backbone).eval()


# ------------------------------------------------------------------ FashionIQ
def make_fashioniq(root: Path) -> Path:
    """dress: 5 queries, 3 unusable (missing reference, missing target, target outside the split);
    one split image missing from disk. shirt uses .jpg files; toptee is complete."""
    for i in range(6):
        write_image(root / "images" / f"d{i}.png")
    for prefix, ext in (("s", "jpg"), ("t", "png")):
        for i in range(4):
            write_image(root / "images" / f"{prefix}{i}.{ext}")
    write_image(root / "images" / "outside.png")
    caps = ["is red", "has long sleeves"]
    write_json(root / "captions" / "cap.dress.val.json", [
        {"target": "d1", "candidate": "d0", "captions": caps},
        {"target": "d2", "candidate": "gone", "captions": caps},
        {"target": "gone2", "candidate": "d3", "captions": caps},
        {"target": "outside", "candidate": "d4", "captions": caps},
        {"target": "d5", "candidate": "d2", "captions": caps},
    ])
    write_json(root / "image_splits" / "split.dress.val.json", [f"d{i}" for i in range(6)] + ["dead_link"])
    for cat, prefix in (("shirt", "s"), ("toptee", "t")):
        write_json(root / "captions" / f"cap.{cat}.val.json",
                   [{"target": f"{prefix}{i + 1}", "candidate": f"{prefix}{i}", "captions": caps} for i in range(3)])
        write_json(root / "image_splits" / f"split.{cat}.val.json", [f"{prefix}{i}" for i in range(4)])
    return root


def test_fashioniq_prompts_follow_the_chosen_caption_order(tmp_path):
    root = make_fashioniq(tmp_path)
    released = read_fashioniq(root).groups[0].queries[0]
    assert released.qid == "dress:0" and released.targets == ("d1",)
    assert released.prompt == "a photo of * , has long sleeves and is red"  # Pic2Word's released order
    in_file_order = read_fashioniq(root, caption_order="file").groups[0].queries[0]
    assert in_file_order.prompt == "a photo of * , is red and has long sleeves"


def test_fashioniq_text_only_and_image_plus_text_encode_the_whole_prompt_by_default(tmp_path):
    root = make_fashioniq(tmp_path)
    released = read_fashioniq(root)
    assert released.options["text_form"] == "released"
    query = released.groups[0].queries[0]
    assert query.text == query.prompt == "a photo of * , has long sleeves and is red"  # Pic2Word's evaluate_fashion
    captions = read_fashioniq(root, text_form="captions").groups[0].queries[0]
    assert (captions.prompt, captions.text) == ("a photo of * , has long sleeves and is red",
                                                "has long sleeves and is red")
    file_order = read_fashioniq(root, caption_order="file").groups[0].queries[0]
    assert file_order.text == "a photo of * , is red and has long sleeves"
    file_captions = read_fashioniq(root, caption_order="file", text_form="captions").groups[0].queries[0]
    assert file_captions.text == "is red and has long sleeves"
    via_options = read_benchmark("fashioniq", root, options=ReaderOptions(fashioniq=FashionIQOptions(text="captions")))
    assert via_options.groups[0].queries[0].text == "has long sleeves and is red"
    with pytest.raises(ValueError, match="text form"):
        read_fashioniq(root, text_form="prompt")


def test_fashioniq_missing_images_are_counted_and_reported(tmp_path, capsys):
    root = make_fashioniq(tmp_path / "fiq")
    results = run_eval_command(["--benchmark", "fashioniq", "--data-root", str(root), "--backbone", f"{TINY_CLIP}:none",
                    "--out", str(tmp_path / "out"), "--num-workers", "0", "run.progress=false"])
    dress = results["counts"]["dress"]
    assert (dress["queries"], dress["evaluated"], dress["skipped"]) == (5, 2, 3)
    assert dress["skip_reasons"] == {"missing_reference": 1, "missing_target": 1, "target_not_in_gallery": 1}
    assert {s["qid"] for s in dress["skipped_queries"]} == {"dress:1", "dress:2", "dress:3"}
    assert (dress["gallery"], dress["gallery_missing"], dress["gallery_missing_names"]) == (6, 1, ["dead_link"])
    assert results["counts"]["shirt"]["skipped"] == 0 and results["counts"]["shirt"]["gallery"] == 4
    printed = capsys.readouterr().out
    assert "dress: evaluated 2 of 5 queries" in printed and "missing_reference" in printed
    assert "evaluated 2 of 5" in (tmp_path / "out" / "table.md").read_text()

    rankings = json.loads((tmp_path / "out" / "rankings" / "image-only.json").read_text())
    assert set(rankings) == {"dress:0", "dress:4", "shirt:0", "shirt:1", "shirt:2", "toptee:0", "toptee:1", "toptee:2"}
    assert set(rankings["shirt:1"]) == {"s0", "s1", "s2", "s3"}  # ids, no folder or extension
    metrics = results["methods"]["image-only"]
    # the whole (tiny) gallery is ranked, so every evaluated target is within the top 10
    assert metrics["dress/R@10"] == metrics["average/R@50"] == 100.0
    assert list(metrics)[:2] == ["dress/R@10", "dress/R@50"] and "toptee/R@50" in metrics


def test_a_corrupt_image_fails_the_command_naming_the_file(tmp_path, tiny_backbone):
    root = make_fashioniq(tmp_path)
    (root / "images" / "t2.png").write_bytes(b"not a png")
    with pytest.raises(ImageReadError, match="t2.png"):
        evaluate("fashioniq", root, backbone=tiny_backbone, methods="image-only", progress=False)


# ----------------------------------------------------------------------- COCO
COCO_CATEGORIES = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "person"}]


def coco_ann(ann_id: int, image_id: int, cat: int, box: list[float], crowd: int = 0) -> dict:
    x, y, w, h = box
    polygon = [[x, y, x + w, y, x + w, y + h, x, y + h]]
    seg = {"counts": [0, 40 * 40], "size": [40, 40]} if crowd else polygon
    return {"id": ann_id, "image_id": image_id, "category_id": cat, "bbox": box, "segmentation": seg,
            "iscrowd": crowd, "area": w * h}


def make_coco(root: Path) -> Path:
    """4 images of 40x40: three with several qualifying objects, one with only a tiny object."""
    images, anns = [], []
    for i in range(1, 5):
        name = f"{i:012d}.jpg"
        write_image(root / "val2017" / name, (40, 40))
        images.append({"id": i, "file_name": name, "width": 40, "height": 40})
    aid = iter(range(100, 200))
    for i in range(1, 4):
        anns += [coco_ann(next(aid), i, 1, [2, 2, 14, 14]), coco_ann(next(aid), i, 2, [20, 20, 15, 12]),
                 coco_ann(next(aid), i, 3, [5, 20, 12, 15]), coco_ann(next(aid), i, 3, [0, 0, 40, 40], crowd=1)]
    anns.append(coco_ann(next(aid), 4, 2, [0, 0, 2, 2]))  # 0.25% of the image: below the bound
    write_json(root / "annotations" / "instances_val2017.json",
               {"images": images, "annotations": anns, "categories": COCO_CATEGORIES})
    return root


def test_coco_query_draw_is_seeded_and_respects_the_bounds(tmp_path):
    instances = json.loads((make_coco(tmp_path) / "annotations" / "instances_val2017.json").read_text())
    first = build_coco_queries(instances, seed=0)
    assert first == build_coco_queries(instances, seed=0)
    assert [q.file_name for q in first] == [f"{i:012d}.jpg" for i in (1, 2, 3)]  # image 4 has no candidate
    draws = {tuple(q.query_class for q in build_coco_queries(instances, seed=s)) for s in range(6)}
    assert len(draws) > 1  # the seed matters
    for q in first:
        assert q.query_class not in q.other_classes and q.segmentation is not None
        x1, y1, x2, y2 = q.box
        assert 0.05 < (x2 - x1) * (y2 - y1) / 1600 < 0.5  # the crowd region (whole image) never qualifies
        assert set(q.other_classes) | {q.query_class} == {"cat", "dog", "person"}


def test_coco_prompt_forms():
    assert coco_texts("cat", ("dog", "person"), "released") == (
        "a photo of * and cat and dog and person", "a photo of cat and dog and person")
    assert coco_texts("cat", ("dog", "person"), "prose") == ("a photo of * , dog and person", "a photo of dog and person")
    # an image with no other class: Pic2Word joins [""] and keeps a dangling "and"
    assert coco_texts("airplane", (), "released") == ("a photo of * and airplane and ", "a photo of airplane and ")
    assert coco_texts("airplane", (), "trimmed") == ("a photo of * and airplane", "a photo of airplane")
    assert coco_texts("cat", ("dog", "person"), "trimmed") == coco_texts("cat", ("dog", "person"), "released")
    with pytest.raises(ValueError, match="prompt form"):
        coco_texts("cat", (), "tidy")


def test_coco_end_to_end_with_masked_crops(tmp_path, tiny_backbone, tiny_model):
    root = make_coco(tmp_path / "coco")
    results = evaluate("coco", root, backbone=tiny_backbone, model=tiny_model, out_dir=tmp_path / "out", progress=False)
    assert set(results["methods"]["demind"]) == {"R@1", "R@5", "R@10"}
    # three queries, a gallery of three: every target is within the top 5
    assert all(v["R@5"] == 100.0 for v in results["methods"].values())
    assert results["encoding"]["queries"]["encoded"] == 3  # crops are encoded apart from the gallery
    rankings = json.loads((tmp_path / "out" / "rankings" / "demind.json").read_text())
    assert set(rankings) == {"000000000001.jpg", "000000000002.jpg", "000000000003.jpg"}
    assert set(rankings["000000000001.jpg"]) == {"000000000001", "000000000002", "000000000003"}
    assert results["reader_options"]["seed"] == 0 and results["reader_options"]["prompt_form"] == "released"
    assert results["reader_options"]["query_resize"] == "released"


def write_pic2word_csv(path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "query_regions", "query_class", "classes"])
        writer.writerow(["000000000001.jpg", "2.0;2.0;16.5;16.0 ", "cat", "dog;person"])  # Pic2Word's trailing space
        writer.writerow(["000000000002.jpg", "20;20;35;32 ", "dog", ""])


def test_coco_pic2word_csv_prefers_the_masked_folder_and_warns_without_it(tmp_path):
    root = make_coco(tmp_path)
    write_pic2word_csv(tmp_path / "coco_eval.csv")
    data = read_coco(root, csv_path=tmp_path / "coco_eval.csv")
    queries = data.groups[0].queries
    assert [q.qid for q in queries] == ["000000000001.jpg", "000000000002.jpg"]
    assert queries[0].reference.box == (2.0, 2.0, 16.0, 16.0)  # int(float(x)), as Pic2Word reads it
    assert queries[0].prompt == "a photo of * and cat and dog and person"
    assert (queries[1].prompt, queries[1].text) == ("a photo of * and dog and ", "a photo of dog and ")  # empty classes
    trimmed = read_coco(root, csv_path=tmp_path / "coco_eval.csv", prompt_form="trimmed").groups[0].queries[1]
    assert (trimmed.prompt, trimmed.text) == ("a photo of * and dog", "a photo of dog")
    assert queries[0].reference.path.parent.name == "val2017"
    assert any("NOT masked" in n for n in data.notes)

    for name in ("000000000001.jpg", "000000000002.jpg"):
        write_image(root / "val2017_masked" / name, (40, 40))
    masked = read_coco(root, csv_path=tmp_path / "coco_eval.csv")
    assert masked.groups[0].queries[0].reference.path.parent.name == "val2017_masked"
    assert not any("NOT masked" in n for n in masked.notes)


def stripes_image(path: Path) -> tuple[float, float, float, float]:
    """An 80x40 image whose box (8, 4, 72, 36) holds four 16 px wide vertical stripes,
    red | green | blue | white, on grey; returns the box."""
    pixels = np.full((40, 80, 3), 128, dtype=np.uint8)
    for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]):
        pixels[4:36, 8 + 16 * i: 8 + 16 * (i + 1)] = colour
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return (8.0, 4.0, 72.0, 36.0)


def test_query_regions_are_resized_to_the_square_or_centre_cropped_by_value(tmp_path, tiny_backbone):
    from demind.retrieval import ImageRefDataset, image_transforms
    from demind.retrieval import ImageRef

    box = stripes_image(tmp_path / "stripes.png")
    refs = [ImageRef("q", tmp_path / "stripes.png", box, resize=mode) for mode in ("squash", "backbone")]
    squashed, cropped = ImageRefDataset(refs, image_transforms(tiny_backbone))[0], ImageRefDataset(
        refs, image_transforms(tiny_backbone))[1]
    size = tiny_backbone.image_size  # 32: the 64x32 region becomes 32x32 either way
    assert squashed.shape == cropped.shape == (3, size, size)
    normalise = tiny_backbone.preprocess.transforms[-1]
    mean, std = torch.tensor(normalise.mean).view(3, 1, 1), torch.tensor(normalise.std).view(3, 1, 1)
    rgb = lambda t: (t * std + mean)[:, size // 2]  # noqa: E731 - (3, W) colours of the middle row
    red, green, blue, white = (torch.tensor(c, dtype=torch.float32) for c in
                               ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)))
    # squash: the whole region, each stripe 8 px wide; centre-crop: only its middle half (green | blue)
    for column, squash_colour, crop_colour in ((3, red, green), (12, green, green), (20, blue, blue),
                                               (28, white, blue)):
        assert torch.allclose(rgb(squashed)[:, column], squash_colour, atol=0.02), column
        assert torch.allclose(rgb(cropped)[:, column], crop_colour, atol=0.02), column


def test_squash_keeps_the_backbones_size_and_normalisation(tmp_path, tiny_backbone):
    """On a square image, straight resize and resize + centre-crop are the same operation."""
    from demind.retrieval import squash_preprocess

    write_image(tmp_path / "square.png", (50, 50))
    image = Image.open(tmp_path / "square.png").convert("RGB")
    assert torch.allclose(squash_preprocess(tiny_backbone)(image), tiny_backbone.preprocess(image), atol=1e-6)


def test_the_query_resize_mode_is_part_of_the_cache_key(tmp_path, tiny_backbone):
    from demind.retrieval import ImageRef

    root = make_coco(tmp_path / "coco")
    assert read_coco(root).groups[0].queries[0].reference.resize == "squash"
    assert read_coco(root, query_resize="center-crop").groups[0].queries[0].reference.resize == "backbone"
    squashed = ImageRef("q", root / "a.jpg", (1, 2, 3, 4), resize="squash")
    assert squashed.cache_key == ImageRef("q", root / "a.jpg", (1, 2, 3, 4)).cache_key + "|resize=squash"
    with pytest.raises(ValueError, match="resize must be one of"):
        ImageRef("q", root / "a.jpg", resize="crop")
    with pytest.raises(ValueError, match="query resize"):
        read_coco(root, query_resize="squash")

    def run(mode: str) -> dict:
        return evaluate("coco", root, backbone=tiny_backbone, methods="image-only", cache_dir=tmp_path / "cache",
                        options=ReaderOptions(coco=CocoOptions(query_resize=mode)), progress=False)

    first, other, again = run("released"), run("center-crop"), run("released")
    assert first["encoding"]["queries"] == {"images": 3, "cached": 0, "encoded": 3}
    assert other["encoding"]["queries"]["encoded"] == 3  # a changed option re-encodes the crops ...
    assert other["encoding"]["gallery"]["cached"] == 3  # ... but not the full images
    assert again["encoding"]["queries"] == {"images": 3, "cached": 3, "encoded": 0}
    assert again["methods"] == first["methods"]


# ----------------------------------------------------------------- ImageNet-R
def make_imagenet_r(data: Path) -> Path:
    """Pic2Word's layout: data/imgnet/{lists}, paths in the lists start with imgnet/.
    Class 0 has 2 cartoon, 1 origami and 1 toy image; class 1 one cartoon; no sculptures."""
    root = data / "imgnet"
    queries = [("imgnet/real/n0/a.JPEG", 0), ("imgnet/real/n0/b.JPEG", 0), ("imgnet/real/n1/c.JPEG", 1)]
    targets = [("imgnet/imagenet-r/n0/cartoon_0.jpg", 0), ("imgnet/imagenet-r/n0/cartoon_1.jpg", 0),
               ("imgnet/imagenet-r/n0/origami_0.jpg", 1000), ("imgnet/imagenet-r/n0/toy_0.jpg", 2000),
               ("imgnet/imagenet-r/n1/cartoon_0.jpg", 1), ("imgnet/real/n1/d.JPEG", 6001)]
    for rel, _ in queries + targets:
        write_image(data / rel)
    for name, items in (("imgnet_real_query.txt", queries), ("imgnet_targets.txt", targets)):
        (root / name).write_text("".join(f"{p} {label} \n" for p, label in items))
    return root


def test_imagenet_r_recall_is_pic2word_fraction_per_domain(tmp_path, tiny_backbone, tiny_model):
    root = make_imagenet_r(tmp_path / "data")
    results = evaluate("imagenet-r", root, backbone=tiny_backbone, model=tiny_model,
                       methods="demind,image-only", out_dir=tmp_path / "out", progress=False)
    assert list(results["counts"]) == ["cartoon", "origami", "toy", "sculpture"]
    # a 6-image gallery is fully ranked within K=10: a query scores 1 if it has any relevant
    # target (all of them are found), 0 if its class has no image in the domain
    for method in ("demind", "image-only"):
        m = results["methods"][method]
        assert m["cartoon/R@10"] == pytest.approx(100.0)
        assert m["origami/R@10"] == m["toy/R@10"] == pytest.approx(200.0 / 3)
        assert m["sculpture/R@50"] == 0.0
        assert m["average/R@10"] == pytest.approx((100.0 + 2 * 200.0 / 3 + 0.0) / 4)
    rankings = json.loads((tmp_path / "out" / "rankings" / "demind.json").read_text())
    assert "2:sculpture" in rankings and "imgnet/imagenet-r/n0/cartoon_1" in rankings["0:cartoon"]
    table = format_table(results)
    assert "NOT a hit rate" in table and "Cartoon R@10" in table
    assert any("sculpture: 3 of 3 queries have no relevant target" in d for d in results["definitions"])
    prompts = {g.name: g.queries[0].prompt for g in read_benchmark("imagenet-r", root).groups}
    assert prompts == {d: f"a {d} of *" for d in ("cartoon", "origami", "toy", "sculpture")}


# ---------------------------------------------------------------------- CIRCO
def make_circo(root: Path) -> Path:
    info = [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (11, 22, 33, 44, 55, 66)]
    for im in info:
        write_image(root / "COCO2017_unlabeled" / "unlabeled2017" / im["file_name"])
    write_json(root / "COCO2017_unlabeled" / "annotations" / "image_info_unlabeled2017.json", {"images": info})
    write_json(root / "annotations" / "val.json", [
        {"id": 0, "reference_img_id": 11, "target_img_id": 22, "relative_caption": "is red",
         "shared_concept": "a car", "gt_img_ids": [22, 33]},
        {"id": 1, "reference_img_id": 44, "target_img_id": 55, "relative_caption": "has two",
         "shared_concept": "a dog", "gt_img_ids": [55]},
    ])
    write_json(root / "annotations" / "test.json", [
        {"id": 0, "reference_img_id": 66, "relative_caption": "at night", "shared_concept": "a street"}])
    return root


def average_precision(ranked: list[str], relevant: set[str], k: int) -> float:
    hits, total = 0, 0.0
    for i, name in enumerate(ranked[:k], start=1):
        if name in relevant:
            hits += 1
            total += hits / i
    return total / min(k, len(relevant))


def test_circo_map_matches_the_rankings_and_test_submission_uses_ids(tmp_path, tiny_backbone, tiny_model):
    root = make_circo(tmp_path / "circo")
    results = evaluate("circo", root, backbone=tiny_backbone, model=tiny_model, out_dir=tmp_path / "val",
                       progress=False)
    rankings = json.loads((tmp_path / "val" / "rankings" / "demind.json").read_text())
    gts = {"0": {"000000000022", "000000000033"}, "1": {"000000000055"}}
    for k in (5, 10, 25, 50):
        expected = 100.0 * sum(average_precision(rankings[q], gts[q], k) for q in gts) / 2
        assert results["methods"]["demind"][f"mAP@{k}"] == pytest.approx(expected)
    assert len(rankings["0"]) == 6  # the reference is not excluded (official protocol)

    test = evaluate("circo", root, split="test", backbone=tiny_backbone, model=tiny_model, methods="demind",
                    out_dir=tmp_path / "test", progress=False)
    submission = json.loads(Path(test["files"]["submissions"][0]).read_text())
    assert set(submission) == {"0"} and sorted(submission["0"]) == [11, 22, 33, 44, 55, 66]


@pytest.mark.parametrize("relpath, change, message", [
    ("annotations/val.json", lambda d: {"queries": d}, r"val\.json must be a list of objects, got a JSON object"),
    ("annotations/val.json", lambda d: [{**d[0], "relative_caption": None}, d[1]],
     r"val\.json\[0\]\.relative_caption must be a string \(got null\)"),
    ("annotations/val.json", lambda d: [d[0], {k: v for k, v in d[1].items() if k != "gt_img_ids"}],
     r"val\.json\[1\]\.gt_img_ids must be a list \(missing\)"),
    ("annotations/val.json", lambda d: [{**d[0], "reference_img_id": "11"}, d[1]],
     r"val\.json\[0\]\.reference_img_id must be an integer \(got \"11\"\)"),
    ("COCO2017_unlabeled/annotations/image_info_unlabeled2017.json", lambda d: d["images"],
     r"image_info_unlabeled2017\.json must be an object"),
    ("COCO2017_unlabeled/annotations/image_info_unlabeled2017.json",
     lambda d: {"images": [{"id": 11}, *d["images"][1:]]}, r"images\[0\]\.file_name must be a string \(missing\)"),
])
def test_malformed_circo_files_name_file_entry_and_field(tmp_path, relpath, change, message):
    root = make_circo(tmp_path / "circo")
    path = root / relpath
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(InputError, match=message):
        read_benchmark("circo", root)


@pytest.mark.parametrize("change, message", [
    (lambda d: {**d, "images": {"1": "a.jpg"}}, r"images must be a list of objects, got a JSON object"),
    (lambda d: {**d, "images": [{k: v for k, v in d["images"][0].items() if k != "width"}, *d["images"][1:]]},
     r"images\[0\]\.width must be an integer \(missing\)"),
    (lambda d: {**d, "annotations": [{**d["annotations"][0], "category_id": "2"}, *d["annotations"][1:]]},
     r"annotations\[0\]\.category_id must be an integer \(got \"2\"\)"),
])
def test_malformed_coco_instances_name_file_entry_and_field(tmp_path, change, message):
    root = make_coco(tmp_path)
    path = root / "annotations" / "instances_val2017.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(InputError, match=r"instances_val2017\.json: " + message):
        read_benchmark("coco", root)


# ------------------------------------------------------------------- layouts
@pytest.mark.parametrize("benchmark_name, expected", [
    ("fashioniq", "images"),
    ("coco", "val2017"),
    ("imagenet-r", "imgnet_real_query.txt"),
    ("circo", "annotations/val.json"),
    ("cirr", "captions/cap.rc2.val.json"),
])
def test_missing_files_name_the_expected_path_and_layout(tmp_path, benchmark_name, expected):
    with pytest.raises(DataLayoutError, match=expected) as err:
        read_benchmark(benchmark_name, tmp_path)
    assert str(tmp_path) in str(err.value) and "Expected layout" in str(err.value)


def test_unknown_method_and_model_methods_without_checkpoint_are_errors(tmp_path, tiny_backbone):
    root = make_circo(tmp_path)
    with pytest.raises(ValueError, match="need a trained model"):
        evaluate("circo", root, backbone=tiny_backbone, methods="demind", progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        evaluate("circo", root, backbone=tiny_backbone, methods="image_only", progress=False)
    with pytest.raises(ConfigError, match="NAME:TAG_OR_PATH"):
        load_backbone_and_model(backbone="ViT-B-32")
    with pytest.raises(ConfigError, match="give a checkpoint"):
        load_backbone_and_model()


def test_reader_options_reach_the_readers(tmp_path):
    root = make_coco(tmp_path)
    prose = read_benchmark("coco", root, options=ReaderOptions(coco=CocoOptions(prompt="prose", seed=3)))
    assert prose.options["seed"] == 3 and " , " in prose.groups[0].queries[0].prompt


def test_a_loaded_checkpoint_evaluates_like_the_model_and_train_mode_is_restored(tmp_path, tiny_backbone,
                                                                                  tiny_model):
    from demind.checkpoint import save_checkpoint

    root = make_circo(tmp_path / "circo")
    ckpt = save_checkpoint(tmp_path / "tiny.safetensors", tiny_model)
    backbone, loaded = load_backbone_and_model(ckpt, tiny_backbone)
    assert backbone is tiny_backbone and not loaded.training
    from_path = evaluate("circo", root, backbone=backbone, model=loaded, methods="demind", progress=False)
    tiny_model.train()
    from_object = evaluate("circo", root, model=tiny_model, methods="demind", progress=False)
    assert tiny_model.training  # evaluated in eval mode, then restored
    tiny_model.eval()
    assert from_path["methods"] == from_object["methods"]
    assert from_path["backbone"]["name"] == tiny_backbone.identity["name"]


def test_feature_cache_keeps_finished_parts_after_a_crash_and_resumes(tmp_path, tiny_backbone):
    from demind.retrieval import ImageFeatureCache, encode_image_refs
    from demind.retrieval import ImageRef

    refs = []
    for i in range(10):
        write_image(tmp_path / "img" / f"{i}.png")
        refs.append(ImageRef(str(i), tmp_path / "img" / f"{i}.png"))
    (tmp_path / "img" / "7.png").write_bytes(b"broken")  # the run dies in the second part
    cache = ImageFeatureCache(tmp_path / "cache", "tiny", "bench", "val")
    with pytest.raises(ImageReadError, match="7.png"):
        encode_image_refs(tiny_backbone, refs, cache, batch_size=2, part_size=4, progress=False)
    assert set(cache.load("gallery")) == {"0", "1", "2", "3"}  # the finished part survived

    write_image(tmp_path / "img" / "7.png")
    resumed, stats = encode_image_refs(tiny_backbone, refs, cache, batch_size=2, part_size=4, progress=False)
    assert stats.as_dict() == {"images": 10, "cached": 4, "encoded": 6}
    fresh, _ = encode_image_refs(tiny_backbone, refs, None, batch_size=3, progress=False)
    assert all(torch.allclose(resumed[n], fresh[n], atol=1e-5) for n in fresh)  # cached == uncached
