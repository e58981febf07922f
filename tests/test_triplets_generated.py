"""demind-train-triplets on generated triplets: data.source=generated (triplet shards over a mined pair
folder, images found by key in the corpus) and data.source=megapairs (MegaPairs's released layout),
with each triplet's hard negatives in the InfoNCE beside the in-batch targets. The triplet shards are
written here by a small writer in the schema of shards/README.md (what demind-generate-triplets writes)."""

from __future__ import annotations

import json
import random
import tarfile
from pathlib import Path

import pytest
import torch

from helpers import TINY_CLIP, make_sample, write_input_shard

WORDS = ["dog", "cat", "car", "tree", "house", "boat", "bird", "lamp", "chair", "cup", "red", "blue", "green"]


def png(path: Path, value: int) -> Path:
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)
    return path


# ---------------------------------------------------------------- the loss


def test_without_hard_negatives_the_loss_is_the_in_batch_infonce():
    from demind.losses import per_sample_info_nce
    from demind.triplets.hard_negatives import hard_negative_info_nce

    torch.manual_seed(0)
    q, t = (torch.nn.functional.normalize(torch.randn(6, 8), dim=-1) for _ in range(2))
    hard = torch.randn(6, 3, 8)
    none = torch.zeros(6, 3, dtype=torch.bool)
    assert torch.allclose(hard_negative_info_nce(q, t, hard, none, 14.0), per_sample_info_nce(q, t, 14.0), atol=1e-6)
    # a hard negative equal to the query's own target direction is the hardest: row 0's loss rises, others stay
    hard[0, 0] = q[0] * 3.0
    one = none.clone()
    one[0, 0] = True
    with_hard = hard_negative_info_nce(q, t, hard, one, 14.0)
    plain = per_sample_info_nce(q, t, 14.0)
    assert with_hard[0] > plain[0] + 1.0 and torch.allclose(with_hard[1:], plain[1:], atol=1e-6)
    # by hand: the query->target cross-entropy over [in-batch targets, own hard negative]
    logits = torch.cat([14.0 * q[0] @ t.T, (14.0 * q[0] @ torch.nn.functional.normalize(hard[0, 0], dim=0))[None]])
    forward = -torch.log_softmax(logits, 0)[0]
    backward = -torch.log_softmax(14.0 * t[0] @ q.T, 0)[0]
    assert torch.isclose(with_hard[0], 0.5 * (forward + backward), atol=1e-5)


# ---------------------------------------------------------------- generated triplet shards


def write_triplet_folder(pairs: Path, out: Path, instructions: int = 2) -> int:
    """Triplet shards from a pair folder in demind-generate-triplets' schema (the manifest carries the
    pairs' corpus and backbone); returns the number of triplets (pairs x instructions)."""
    from demind.shard_format import ShardOutput, ShardWriter

    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((pairs / "pairs_manifest.json").read_text())
    (out / "triplets_manifest.json").write_text(json.dumps(
        {"format": "demind-triplets/1", "corpus": manifest["corpus"], "backbone": manifest["backbone"]}))
    total = 0
    for shard in sorted(pairs.glob("pairs-*.tar")):
        target = out / shard.name.replace("pairs-", "triplets-")
        with tarfile.open(shard) as tar, ShardWriter(target) as writer:
            for member in tar.getmembers():
                record = json.loads(tar.extractfile(member).read())
                for pair in record["targets"]:
                    texts = [f"show it with {w} instead" for w in WORDS[:instructions]]
                    writer.write({"__key__": f"{record['reference']}_{pair['key']}", "json": json.dumps(
                        {"reference": record["reference"], "target": pair["key"], "instructions": texts,
                         "hard_negatives": record["hard_negatives"], "description": "Both images ...",
                         "signals": pair["signals"], "scores": pair["scores"],
                         "generation": {"engine": "test"}}).encode()})
                    total += instructions
        ShardOutput.of(target).mark_done({"written": total})
    return total


@pytest.fixture(scope="module")
def generated(tmp_path_factory, repo_root):
    from demind.cli.mine_pairs import main

    root = tmp_path_factory.mktemp("generated")
    rng = random.Random(0)
    for s in range(2):
        (root / "corpus").mkdir(exist_ok=True)
        write_input_shard(root / "corpus" / f"0000{s}.tar", [
            make_sample(f"0000{s}{i:04d}", 100 * s + i, " ".join(rng.sample(WORDS, 4))) for i in range(12)])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo_root)
        assert main(["--input", str(root / "corpus"), "--output", str(root / "pairs"), "--config",
                     "configs/pairs/tiny-cpu.yaml", "run.progress=false"]) == 0
    count = write_triplet_folder(root / "pairs", root / "triplets")
    return root, count


def generated_config(root: Path, out: Path, **extra):
    from demind.config import load_config
    from demind.triplets.config import TripletTrainConfig

    overrides = [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "data.source=generated",
                 f"data.path={root / 'triplets'}", f"data.cache_dir={root / 'cache'}", f"run.output_dir={out}",
                 "run.device=cpu", "run.progress=false", "optim.epochs=2", "optim.batch_size=8",
                 "model.projection_dim=16", "model.hidden_dim=16", *[f"{k}={v}" for k, v in extra.items()]]
    return load_config(TripletTrainConfig, None, overrides)


def test_each_instruction_is_a_triplet_with_the_pairs_hard_negatives(generated):
    from demind.pairs import open_corpus
    from demind.triplets.generated import read_generated_triplets

    root, count = generated
    found = read_generated_triplets(root / "triplets")
    assert len(found.triplets) == count and found.source == "generated"
    first = found.triplets[0]
    assert first.qid.endswith(":0") and found.triplets[1].qid.endswith(":1")
    assert first.modification == "show it with dog instead" and first.target.name != first.reference.name
    assert 1 <= len(first.hard_negatives) <= 5
    assert first.reference.name not in {r.name for r in first.hard_negatives}
    # the ImageRefs read the corpus's own bytes (a span of its tar)
    lookup = open_corpus(json.loads((root / "pairs" / "pairs_manifest.json").read_text()))
    from demind.retrieval import load_image
    assert load_image(first.reference).tobytes() == lookup.image(first.reference.name).tobytes()


def test_training_on_generated_triplets_uses_the_hard_negatives(generated, tmp_path,
                                                                one_thread_and_fresh_accelerator):
    from demind.triplets.train import load_training_data, read_training_triplets, train_triplets

    root, count = generated
    cfg = generated_config(root, tmp_path / "run")
    data = load_training_data(cfg, _backbone(cfg))
    assert data.hard is not None and data.hard.features.shape[:2] == (count, 5) and data.hard.mask.any()
    assert torch.equal(data.hard.mask.sum(1), torch.tensor(
        [min(len(t.hard_negatives), 5) for t in read_training_triplets(cfg).triplets]))
    path = train_triplets(cfg)
    assert path.is_file()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["triplets"] == count
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)
    # H = 0: the in-batch loss alone (no hard-negative features are built)
    plain = generated_config(root, tmp_path / "plain", **{"data.hard_negatives": 0})
    assert load_training_data(plain, _backbone(plain)).hard is None


def _backbone(cfg):
    from demind.backbone import build_backbone

    return build_backbone(cfg.backbone)


def test_pairs_mined_with_another_backbone_are_refused_naming_both(generated, tmp_path, capsys):
    from demind.cli.train_triplets import main

    root, _ = generated
    argv = [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "backbone.seed=1", "data.source=generated",
            f"data.path={root / 'triplets'}", f"run.output_dir={tmp_path / 'run'}", "run.device=cpu",
            "run.progress=false", "optim.batch_size=8", "model.projection_dim=16", "model.hidden_dim=16"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the pairs behind") and "was made with backbone" in err and "but this run uses" in err
    assert not (tmp_path / "run" / "feature_cache").exists()  # refused before any image was encoded


def test_another_corpus_is_refused_naming_both(generated, tmp_path):
    from demind.pairs import CorpusMismatchError
    from demind.triplets.generated import read_generated_triplets

    root, _ = generated
    write_input_shard(tmp_path / "00000.tar", [make_sample("000000000", 1, "a red dog")])
    with pytest.raises(CorpusMismatchError, match=f"{root / 'corpus'}.*{tmp_path}"):
        read_generated_triplets(root / "triplets", corpus=str(tmp_path))


def test_an_unfinished_shard_and_a_malformed_record_are_counted_skips(generated, tmp_path):
    import shutil

    from demind.shard_format import ShardWriter
    from demind.triplets.generated import read_generated_triplets

    root, count = generated
    folder = tmp_path / "triplets"
    shutil.copytree(root / "triplets", folder)
    with ShardWriter(folder / "triplets-00009.tar") as writer:  # no stats file: an interrupted generation
        writer.write({"__key__": "x", "json": b'{"reference": "000000001"}'})
    with ShardWriter(folder / "triplets-00010.tar") as writer:
        writer.write({"__key__": "y", "json": b'{"reference": "000000001", "target": "000000002"}'})
    (folder / "triplets-00010_stats.json").write_text("{}")
    found = read_generated_triplets(folder)
    assert len(found.triplets) == count and found.skipped == {"triplets-00010/y": "malformed"}


def test_hard_negatives_with_a_noise_mode_are_refused():
    from demind.config import ConfigError, load_config
    from demind.triplets.config import TripletTrainConfig

    with pytest.raises(ConfigError, match="data.hard_negatives"):
        load_config(TripletTrainConfig, None, ["data.source=generated", "data.path=x", "robust.mode=gfq"])
    load_config(TripletTrainConfig, None, ["data.source=generated", "data.path=x", "robust.mode=gfq",
                                           "data.hard_negatives=0"])


# ---------------------------------------------------------------- MegaPairs's released layout


def write_megapairs(folder: Path, rows: int = 12) -> Path:
    for i in range(rows + 2):
        png(folder / "images" / f"{i}.png", (31 * i) % 255)
    lines = [{"q_img": f"images/{i}.png", "q_text": [f"make it shade {i % 4}", f"a darker one {i}"],
              "t_img": f"images/{i + 1}.png", "hns": [f"images/{(i + 2) % rows}.png", f"images/{(i + 5) % rows}.png"]}
             for i in range(rows)]
    lines.append({"q_img": "images/missing.png", "q_text": "anything", "t_img": "images/0.png", "hns": []})
    path = folder / "megapairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_megapairs_layout_is_read_with_hard_negatives_and_counted_skips(tmp_path):
    from demind.triplets.megapairs import read_megapairs

    found = read_megapairs(write_megapairs(tmp_path))
    assert len(found.triplets) == 24 and found.skipped == {"13": "image missing"}
    first = found.triplets[0]
    assert (first.reference.name, first.modification, first.target.name) == ("images/0.png", "make it shade 0",
                                                                              "images/1.png")
    assert [r.name for r in first.hard_negatives] == ["images/2.png", "images/5.png"]
    assert found.triplets[1].modification == "a darker one 0"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q_img": "images/0.png", "t_img": "images/1.png"}\n')
    from demind.errors import InputError
    with pytest.raises(InputError, match="bad.jsonl:1: a MegaPairs row needs q_img, q_text and t_img"):
        read_megapairs(bad)


def test_training_on_the_megapairs_layout(tmp_path, one_thread_and_fresh_accelerator):
    from demind.config import load_config
    from demind.triplets.config import TripletTrainConfig
    from demind.triplets.train import train_triplets

    path = write_megapairs(tmp_path)
    cfg = load_config(TripletTrainConfig, None, [
        f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", "data.source=megapairs", f"data.path={path}",
        f"run.output_dir={tmp_path / 'run'}", "run.device=cpu", "run.progress=false", "optim.epochs=1",
        "optim.batch_size=8", "model.projection_dim=16", "model.hidden_dim=16", "data.hard_negatives=2"])
    assert train_triplets(cfg).is_file()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["triplets"] == 24
