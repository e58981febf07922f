"""Supervised training on triplets (demind.triplets): readers on official-format files, nested noise,
the trainer's resume after a kill, the combiner checkpoint in the method registry, GFQ through a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import TINY_CLIP, write_cirr_layout


def png(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)
    return path


# --------------------------------------------------------------------------- readers


def png_bytes(value: int) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_cirr_train(root: Path) -> None:
    """CIRR's rc2 training layout (captions, split naming ./train/NN/name.png, images)."""
    names = ["train-10108-0-img0", "train-10108-1-img1", "train-2217-3-img0"]
    captions = [
        {"pairid": 12063, "reference": names[0], "target_hard": names[1], "target_soft": {names[1]: 1.0},
         "caption": "remove all but one dog", "img_set": {"id": 1, "members": names[:2]}},
        {"pairid": 12064, "reference": names[2], "target_hard": names[0], "target_soft": {names[0]: 1.0},
         "caption": "make it a puppy", "img_set": {"id": 2, "members": [names[0], names[2]]}},
    ]
    write_cirr_layout(root, "train", "train/34", {n: png_bytes(40 * i) for i, n in enumerate(names)}, captions)


def test_cirr_train_reader_values(tmp_path):
    from demind.triplets.readers import read_cirr_train

    write_cirr_train(tmp_path)
    data = read_cirr_train(tmp_path)
    assert [(t.qid, t.reference.name, t.modification, t.target.name) for t in data.triplets] == [
        ("12063", "train-10108-0-img0", "remove all but one dog", "train-10108-1-img1"),
        ("12064", "train-2217-3-img0", "make it a puppy", "train-10108-0-img0")]
    assert data.triplets[0].target.path == tmp_path / "train" / "34" / "train-10108-1-img1.png"


def test_cirr_train_reader_names_a_missing_image(tmp_path):
    from demind.eval.structures import DataLayoutError
    from demind.triplets.readers import read_cirr_train

    write_cirr_train(tmp_path)
    (tmp_path / "train" / "34" / "train-10108-1-img1.png").unlink()
    with pytest.raises(DataLayoutError, match="train-10108-1-img1.png"):
        read_cirr_train(tmp_path)


def test_fashioniq_train_reader_values_and_counted_skips(tmp_path):
    from demind.triplets.readers import read_fashioniq_train

    for name, v in (("B001", 10), ("B002", 20), ("B003", 30)):
        png(tmp_path / "images" / f"{name}.png", v)
    (tmp_path / "captions").mkdir()
    dress = [{"target": "B002", "candidate": "B001", "captions": ["is darker", "has long sleeves"]},
             {"target": "B999", "candidate": "B001", "captions": ["a", "b"]}]  # a dead link
    shirt = [{"target": "B001", "candidate": "B003", "captions": ["is red ", "is plain"]}]
    (tmp_path / "captions" / "cap.dress.train.json").write_text(json.dumps(dress))
    (tmp_path / "captions" / "cap.shirt.train.json").write_text(json.dumps(shirt))
    data = read_fashioniq_train(tmp_path, ("dress", "shirt"))
    # demind-eval's defaults: captions[1] and captions[0] inside the prompt (Pic2Word's released code)
    assert [(t.qid, t.reference.name, t.target.name, t.modification) for t in data.triplets] == [
        ("dress:0", "B001", "B002", "a photo of * , has long sleeves and is darker"),
        ("shirt:0", "B003", "B001", "a photo of * , is plain and is red")]
    assert data.skipped == {"dress:1": "image B999 missing from images/"}
    plain = read_fashioniq_train(tmp_path, ("shirt",), caption_order="file", text_form="captions")
    assert plain.triplets[0].modification == "is red and is plain"


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_triplet_file_reader(tmp_path, suffix):
    from demind.triplets.readers import read_triplet_file

    png(tmp_path / "img" / "a.png", 1)
    png(tmp_path / "img" / "b.png", 2)
    rows = [{"reference": "img/a.png", "modification": "make it blue", "target": "img/b.png"},
            {"reference": "img/b.png", "modification": "make it red, please", "target": "img/a.png"}]
    path = tmp_path / f"triplets{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import csv

        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["reference", "modification", "target"])
            writer.writeheader()
            writer.writerows(rows)
    data = read_triplet_file(path)
    assert [(t.reference.path, t.modification, t.target.path) for t in data.triplets] == [
        (tmp_path / "img" / "a.png", "make it blue", tmp_path / "img" / "b.png"),
        (tmp_path / "img" / "b.png", "make it red, please", tmp_path / "img" / "a.png")]
    assert data.triplets[0].hard_modification is None


def test_triplet_file_errors_name_file_and_line(tmp_path):
    from demind.errors import InputError
    from demind.triplets.readers import read_triplet_file

    png(tmp_path / "a.png", 1)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"reference": "a.png", "modification": "x", "target": "a.png"}) + "\n"
                    + json.dumps({"reference": "a.png", "target": "a.png"}) + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl:2: 'modification'"):
        read_triplet_file(path)
    path.write_text(json.dumps({"reference": "a.png", "modification": "x", "target": "gone.png"}) + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl:1: target image .*gone\.png"):
        read_triplet_file(path)
    with pytest.raises(InputError, match="must end in .jsonl or .csv"):
        read_triplet_file(tmp_path / "t.txt")


# --------------------------------------------------------------------------- noise


def test_noise_shares_are_exact_and_nested():
    from demind.triplets.noise import noisy_mask

    n = 1000
    masks = {r: noisy_mask(n, r) for r in (0.0, 0.2, 0.5, 0.8)}
    assert [int(m.sum()) for m in masks.values()] == [0, 200, 500, 800]
    assert bool((masks[0.2] <= masks[0.5]).all()) and bool((masks[0.5] <= masks[0.8]).all())
    # fixed: the same triplets every call; the first 7 triplets' draws decide them at 50 %
    assert torch.equal(noisy_mask(n, 0.5), masks[0.5])
    assert noisy_mask(7, 0.5).sum() == 4  # round(3.5) -> 4 (banker's rounding keeps 4)


def test_easy_and_hard_noise_values():
    from demind.errors import InputError
    from demind.triplets.noise import easy_donors, inject_noise

    texts = ["a", "b", "a", "c", "d", "e"]
    hard = ["A", "B", "A2", "C", "D", "E"]
    donors = easy_donors(texts)
    assert all(texts[d] != t for d, t in zip(donors, texts))  # another triplet's text, never the same text
    noisy, mask = inject_noise(texts, hard, 0.5, "easy")
    assert int(mask.sum()) == 3
    assert [noisy[i] for i in range(6)] == [texts[donors[i]] if mask[i] else texts[i] for i in range(6)]
    noisy_hard, mask_hard = inject_noise(texts, hard, 0.5, "hard")
    assert torch.equal(mask, mask_hard)  # the same triplets for both kinds
    assert noisy_hard == [hard[i] if mask[i] else texts[i] for i in range(6)]
    with pytest.raises(InputError, match="hard_modification"):
        inject_noise(texts, None, 0.5, "hard")
    assert inject_noise(texts, None, 0.0, "hard")[0] == texts


# --------------------------------------------------------------------------- GFQ through a model, AUROC


def test_composed_boundary_by_hand():
    from demind.fidelity import composed_boundary, draw_pairings

    torch.manual_seed(0)
    refs, texts, targets = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    compose = lambda image, text: image + text  # noqa: E731
    boundary = composed_boundary(compose, refs, texts, targets, 2, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    fake_refs, perms = draw_pairings(refs, 6, 2, g)
    fake_targets, _ = draw_pairings(targets, 6, 2, g)
    sims = torch.nn.functional.cosine_similarity(fake_refs + texts[perms], fake_targets, dim=-1).flatten()
    assert boundary.boundary == pytest.approx(float(sims.mean()), abs=1e-6)
    assert boundary.tau == pytest.approx(float(sims.std(unbiased=False)), abs=1e-6)


def test_auroc_matches_the_pairwise_definition():
    from demind.triplets.train import auroc

    scores = torch.tensor([0.1, 0.4, 0.4, 0.8, 0.3, 0.4])
    positive = torch.tensor([False, True, False, True, False, True])
    pairs = [(p, n) for p in scores[positive] for n in scores[~positive]]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert auroc(scores, positive) == pytest.approx(expected)
    assert auroc(scores, torch.zeros(6, dtype=torch.bool)) is None


# --------------------------------------------------------------------------- trainer


def write_tiny_triplets(folder: Path, n: int = 24) -> Path:
    rows = []
    for i in range(n):
        png(folder / "img" / f"{i}.png", (37 * i) % 255)
        rows.append({"reference": f"img/{i}.png", "modification": f"make it shade {i % 5}",
                     "target": f"img/{(i + 1) % n}.png", "hard_modification": f"make it shade {(i + 2) % 5}"})
    path = folder / "triplets.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_config(folder: Path, out: Path, mode: str = "none", epochs: int = 3, **extra):
    from demind.config import load_config
    from demind.triplets.config import TripletTrainConfig

    overrides = [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "data.source=file",
                 f"data.path={folder / 'triplets.jsonl'}", f"data.cache_dir={folder / 'cache'}",
                 f"run.output_dir={out}", "run.device=cpu", "run.progress=false", f"robust.mode={mode}",
                 f"optim.epochs={epochs}", "optim.batch_size=8", "model.projection_dim=16", "model.hidden_dim=16",
                 *[f"{k}={v}" for k, v in extra.items()]]
    return load_config(TripletTrainConfig, None, overrides)


@pytest.fixture(scope="module")
def tiny_triplets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("triplets")
    write_tiny_triplets(folder)
    return folder


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_weights(tiny_triplets, tmp_path, monkeypatch,
                                                    one_thread_and_fresh_accelerator):
    import demind.triplets.train as train_module

    cfg = tiny_config(tiny_triplets, tmp_path / "whole", "conesep", **{"noise.rate": 0.5})
    whole = train_module.train_triplets(cfg)

    saves = []
    real_save = train_module.save_train_state

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        saves.append(kwargs["extra"]["epoch"])
        if len(saves) == 2:
            raise KeyboardInterrupt  # killed right after epoch 2's state reached the disk

    killed = tiny_config(tiny_triplets, tmp_path / "killed", "conesep", **{"noise.rate": 0.5})
    monkeypatch.setattr(train_module, "save_train_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_module.train_triplets(killed)
    assert (tmp_path / "killed" / "state.safetensors").is_file()
    assert not (tmp_path / "killed" / "combiner.safetensors").exists()
    monkeypatch.setattr(train_module, "save_train_state", real_save)
    resumed = train_module.train_triplets(killed)
    a, b = weights(whole), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2, 3]  # no epoch logged twice
    detection = json.loads((tmp_path / "killed" / "detection.json").read_text())
    assert detection["noisy"] == 12 and 0.0 <= detection["auroc"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["small-loss", "gfq", "conesep-nobtu"])
def test_every_mode_trains(tiny_triplets, tmp_path, mode, one_thread_and_fresh_accelerator):
    from demind.triplets.train import train_triplets

    cfg = tiny_config(tiny_triplets, tmp_path / mode, mode, epochs=2,
                      **{"noise.rate": 0.5, "noise.kind": "hard", "optim.warmup_epochs": 1})
    path = train_triplets(cfg)
    lines = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)
    assert lines[0]["kept"] == 1.0  # the warm-up epoch trains on every triplet
    assert path.is_file()


def test_combiner_checkpoint_in_the_registry(tiny_triplets, tmp_path, one_thread_and_fresh_accelerator):
    from demind.checkpoint import load_backbone_and_model
    from demind.config import ConfigError
    from demind.retrieval import build_methods, checkpoint_kind, parse_method_names
    from demind.triplets.train import train_triplets

    path = train_triplets(tiny_config(tiny_triplets, tmp_path / "run", epochs=1, **{"run.detection": "false"}))
    backbone, model = load_backbone_and_model(path)
    assert checkpoint_kind(model) == "combiner"
    assert parse_method_names(None, True, model_kind="combiner") == ["image-only", "text-only", "image+text",
                                                                     "combiner"]
    assert "combiner" not in parse_method_names(None, True, model_kind="demind")
    with pytest.raises(ConfigError, match="need a De-MINDS checkpoint"):
        parse_method_names("demind", True, model_kind="combiner")
    with pytest.raises(ConfigError, match="combiner trained on triplets"):
        parse_method_names("combiner", True, model_kind="demind")
    method = build_methods(["combiner"], backbone, model)[0]
    refs = torch.randn(2, backbone.embed_dim)
    queries = method.embed(refs, ["a photo of * , x", "a photo of * , y"], ["make it red", "make it blue"])
    text = torch.nn.functional.normalize(backbone.encode_text(["make it red", "make it blue"]).pooled, dim=-1)
    assert torch.allclose(queries, model(refs, text), atol=1e-6)
    assert torch.allclose(queries.norm(dim=-1), torch.ones(2), atol=1e-5)


def test_a_combiner_checkpoint_serves_search(tiny_triplets, tmp_path, one_thread_and_fresh_accelerator):
    from demind.checkpoint import load_backbone_and_model
    from demind.search.index import build_index, load_index
    from demind.search.query import SearchError, Searcher, SearchQuery
    from demind.triplets.train import train_triplets

    path = train_triplets(tiny_config(tiny_triplets, tmp_path / "run", epochs=1, **{"run.detection": "false"}))
    backbone, model = load_backbone_and_model(path)
    build_index(tiny_triplets / "img", tmp_path / "index", backbone, progress=False)
    searcher = Searcher(backbone, model, load_index(tmp_path / "index"))
    assert "combiner" in searcher.available_methods() and "demind" not in searcher.available_methods()
    hits = searcher.search(SearchQuery(tiny_triplets / "img" / "0.png", "make it shade 1", method="combiner", k=3,
                                       exclude="0.png"))
    assert len(hits) == 3 and "0.png" not in [h.name for h in hits]
    with pytest.raises(SearchError, match="De-MINDS checkpoint"):
        searcher.validate(SearchQuery(None, "make it red", method="demind"))


def test_query_mode_on_a_combiner_is_refused_in_one_line(tiny_triplets, tmp_path, one_thread_and_fresh_accelerator):
    from demind.checkpoint import load_backbone_and_model
    from demind.cli.model_options import apply_query_mode
    from demind.errors import InputError
    from demind.triplets.train import train_triplets

    path = train_triplets(tiny_config(tiny_triplets, tmp_path / "run", epochs=1, **{"run.detection": "false"}))
    _, model = load_backbone_and_model(path)
    apply_query_mode(model, "eager")  # nothing to do
    with pytest.raises(InputError, match="combiner"):
        apply_query_mode(model, "compile")


def test_demind_eval_scores_a_combiner_checkpoint(tiny_triplets, tmp_path, capsys, one_thread_and_fresh_accelerator):
    from demind.cli.evaluate import main as evaluate
    from demind.triplets.train import train_triplets

    path = train_triplets(tiny_config(tiny_triplets, tmp_path / "run", epochs=1, **{"run.detection": "false"}))
    members = [f"dev-{i}-img0" for i in range(4)]
    captions = [{"pairid": i, "reference": members[i], "target_hard": members[(i + 1) % 4], "caption": f"make it shade {i}",
                 "img_set": {"id": 0, "members": members}} for i in range(4)]
    root = write_cirr_layout(tmp_path / "cirr", "val", "dev", {m: png_bytes(50 * i) for i, m in enumerate(members)},
                             captions)
    assert evaluate(["--benchmark", "cirr", "--data-root", str(root), "--checkpoint", str(path), "--out",
                     str(tmp_path / "eval"), "run.device=cpu", "num_workers=0"]) == 0
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert set(results["methods"]) == {"image-only", "text-only", "image+text", "combiner"}
    assert results["model_config"]["architecture"] == "combiner"
    assert set(results["methods"]["combiner"]) >= {"R@1", "R@5", "Rsubset@1"}
