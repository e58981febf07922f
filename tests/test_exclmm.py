"""ExclMM: losses by hand, identity at initialisation, end-to-end training with the tiny CLIP,
evaluation in the harness, bad input, and kill-and-resume to the same weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from demind.cli import train_exclmm as cli
from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco
from toyworld.synthetic import write_synthetic_coco
from demind.trainkit.state_file import read_train_state_extra
from demind.exclmm import losses as L
from demind.exclmm.features import FEATURES_NAME, load_features
from demind.exclmm.train import STATE_NAME
from demind.exclmm.model import ExclusionQueryEncoder, SparseSpace, sentence_code, top_t_mask


def test_sparsity_losses_by_hand():
    z = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.5, 0.0]])
    # unit means 0.5, 0.5, 0 ; rho 0.2 -> (0.3^2 + 0.3^2 + 0) = 0.18
    assert L.average_sparsity_loss(z, 0.2).item() == pytest.approx(0.18)
    # rows: 0 + 0.25 + 0 = 0.25 and 0 + 0.25 + 0 = 0.25 -> mean 0.25
    assert L.partial_sparsity_loss(z).item() == pytest.approx(0.25)
    assert L.reconstruction_loss(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])).item() == pytest.approx(5.0)


def test_query_losses_by_hand():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    gt = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    pos = torch.tensor([[1.5, 0.0], [0.0, 0.0]])
    # margin 1: row 0: max(0, 1 - 2 + 1.5) = 0.5 ; row 1: max(0, 1 - 1 + 0) = 0 -> 0.25
    assert L.triplet_loss(q, gt, pos, margin=1.0).item() == pytest.approx(0.25)
    # logits q @ gt.T = [[2, 1], [0, 1]]; row 1 masks image 0 (also relevant) -> its loss is 0
    also = torch.tensor([[False, False], [True, False]])
    expected = (-(2 - torch.logsumexp(torch.tensor([2.0, 1.0]), 0))).item() / 2
    assert L.query_contrastive_loss(q, gt, also).item() == pytest.approx(expected)


def test_paper_triplet_eq16_by_hand():
    """Eq. 16: max(0, d(ip, exc_cp) - d(ip, exc_cx) + m), d = 1 - cos, mean over rows."""
    ip = torch.tensor([[1.0, 0.0], [1.0, 0.0], [3.0, 4.0]])
    cp = torch.tensor([[1.0, 1.0], [0.0, 1.0], [3.0, 4.0]])
    cx = torch.tensor([[0.0, 2.0], [5.0, 0.0], [4.0, -3.0]])
    # row 0: d(ip, cp) = 1 - 1/sqrt(2) = 0.29289, d(ip, cx) = 1 -> max(0, -0.70711 + 0.2) = 0
    # row 1: d(ip, cp) = 1, d(ip, cx) = 0 -> 1 + 0.2 = 1.2
    # row 2: d(ip, cp) = 0, d(ip, cx) = 1 - 0 = 1 -> max(0, -1 + 0.2) = 0;  with m = 1.5: 0.5
    assert L.paper_triplet_loss(ip, cp, cx, margin=0.2).item() == pytest.approx(1.2 / 3, abs=1e-6)
    assert L.paper_triplet_loss(ip, cp, cx, margin=1.5).item() == pytest.approx(
        (max(0.0, 0.29289 - 1 + 1.5) + 2.5 + 0.5) / 3, abs=1e-4)
    # cosine: scaling any embedding changes nothing
    assert L.paper_triplet_loss(7 * ip, 0.1 * cp, 3 * cx, margin=0.2).item() == pytest.approx(1.2 / 3, abs=1e-6)
    # both queries get gradient (the positive query is encoded, so F_theta learns from it too)
    ip2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    cp_ = torch.tensor([[0.0, 1.0], [1.0, 1.0]], requires_grad=True)
    cx_ = torch.tensor([[1.0, 1.0], [0.0, 1.0]], requires_grad=True)
    # row 0: 1 - 0.29289 + 0.2 > 0 (gradient); row 1: 0.29289 - 1 + 0.2 < 0 (none)
    L.paper_triplet_loss(ip2, cp_, cx_, margin=0.2).backward()
    assert cp_.grad[0].abs().sum() > 0 and cx_.grad[0].abs().sum() > 0
    assert cp_.grad[1].abs().sum() == 0 and cx_.grad[1].abs().sum() == 0


def test_normalised_symmetric_contrastive_eq12_eq15_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[2.0, 0.0], [0.0, 3.0]])  # normalised: the identity, so logits = I at tau 1
    expected = torch.log1p(torch.exp(torch.tensor(-1.0))).item()  # -log(e / (e + 1)) = 0.31326, both directions
    assert L.normalised_contrastive_loss(a, b).item() == pytest.approx(expected)
    assert L.normalised_contrastive_loss(a, b, tau=0.5).item() == pytest.approx(
        torch.log1p(torch.exp(torch.tensor(-2.0))).item())
    # a pair marked also-relevant leaves both denominators: only the own logit is left, loss 0
    also = torch.tensor([[False, True], [True, False]])
    assert L.normalised_contrastive_loss(a, b, also_relevant=also).item() == pytest.approx(0.0, abs=1e-6)
    # asymmetric case: text 0 matches image 0 but image 1 is also close to text 0
    a2 = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    logits = torch.nn.functional.normalize(a2, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T
    rows = torch.nn.functional.cross_entropy(logits, torch.arange(2))
    cols = torch.nn.functional.cross_entropy(logits.T, torch.arange(2))
    assert L.normalised_contrastive_loss(a2, b).item() == pytest.approx(0.5 * (rows + cols).item())
    assert rows.item() != pytest.approx(cols.item())  # the two directions differ: both are in the loss


def test_earlier_forms_of_an_older_export():
    from demind.exclmm.run_upgrade import form_of

    old = {"space": {"top_t": 16}, "query": {"space": "sparse"}}
    assert form_of(old, "query", "triplet") == "gt-vs-positive" and form_of(old, "space", "image_mask") == "top_t"
    assert form_of({"space": {}, "query": {"contrastive": "paper"}}, "query", "contrastive") == "paper"


def test_masks_sentence_codes_and_identity_at_init():
    h = torch.tensor([[0.1, 0.9, 0.5, 0.0]])
    assert top_t_mask(h, 2).tolist() == [[False, True, True, False]]
    space = SparseSpace(clip_dim=4, code_dim=4, hidden=8, top_t=1)
    z_c = torch.tensor([[0.0, 0.0, 0.0, 0.3]])
    assert space.mask(h, z_c).tolist() == [[False, True, False, True]]
    codes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert sentence_code(codes, [[0, 1], [], [2]]).tolist() == [[0.5, 0.5], [0.0, 0.0], [1.0, 1.0]]
    f = ExclusionQueryEncoder(4, 8)
    s = torch.rand(3, 4)
    assert torch.equal(f(s), s)  # stage 2 starts from stage-1 retrieval


@pytest.fixture(scope="module")
def train_split(tmp_path_factory):
    root = tmp_path_factory.mktemp("exclmm-data")
    instances, captions, images = write_synthetic_coco(root / "coco", 40, split="train", seed=5, write_images=True)
    build_exclcoco(instances, captions, root / "train", images, ExclCocoConfig(caption_min_images=5), split="train")
    return root / "train"


def smoke_args(repo_root, train_dir, run_dir, *extra):
    return ["--config", str(repo_root / "configs/exclmm/smoke.yaml"),
            f"backbone.name={repo_root / 'configs/model/tiny-clip.json'}", f"data.train={train_dir}",
            f"run.output_dir={run_dir}", *extra]


def test_train_end_to_end_and_evaluate(repo_root, train_split, tmp_path, capsys):
    from demind.backbone import build_backbone
    from demind.schema import BackboneConfig
    from demind.eval.harness import evaluate
    from demind.exclmm import load_exclmm

    run = tmp_path / "run"
    assert cli.main(smoke_args(repo_root, train_split, run)) == 0
    export = run / "exclmm.safetensors"
    assert export.is_file() and (run / "config.yaml").is_file()
    before = {k: v.clone() for k, v in load_file(export).items()}
    torch.manual_seed(0)  # the run built its random backbone after seeding with run.seed = 0
    backbone = build_backbone(BackboneConfig(name=str(repo_root / "configs/model/tiny-clip.json"), pretrained=None))
    model = load_exclmm(export, backbone.identity)
    assert not torch.equal(model.query_encoder.net[-1].weight, torch.zeros_like(model.query_encoder.net[-1].weight))
    feats = load_features(run / FEATURES_NAME)
    codes = model.sae.encode(feats["word_vectors"])
    assert 0 < (codes > 0).float().mean() < 1  # the word codes are alive and sparse, not all 0 or all 1
    results = evaluate("exclcoco", train_split, backbone=backbone, methods=["text-only", "exclmm"], exclmm=model,
                       out_dir=tmp_path / "eval", progress=False)
    for name in ("text-only", "exclmm"):
        got = results["methods"][name]
        assert set(got) == {"AP@1", "AP@5", "MRR@5", "MRR@10", "NDCG@5", "NDCG@10", "Hits@5", "Hits@10",
                            "exclusion AUC", "inclusion AUC"}  # the builder's file lists hard negatives
        assert all(0.0 <= v <= 100.0 for v in got.values())
        assert got["Hits@10"] >= got["Hits@5"] >= got["AP@1"]
    assert cli.main(smoke_args(repo_root, train_split, run)) == 0  # finished: left as is
    assert all(torch.equal(before[k], v) for k, v in load_file(export).items())
    assert cli.main(smoke_args(repo_root, train_split, run, "run.seed=1")) == 2  # another recipe, same folder
    assert "written with another config (run.seed (0 -> 1))" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trained on backbone"):
        load_exclmm(export, {"name": "other"})


def test_paper_form_trains_and_scores_by_cosine(repo_root, train_split, tmp_path):
    """The paper's form (Eq. 12/15 normalised and symmetric, z_c OR Top_t image mask, unmasked
    reconstruction, Eq. 16 with the positive query encoded) trains end to end and ranks by cosine;
    the default (earlier) form ranks by dot product."""
    from demind.exclmm import load_exclmm
    from demind.exclmm.config import PAPER_OVERRIDES

    assert cli.main(smoke_args(repo_root, train_split, tmp_path / "paper", *PAPER_OVERRIDES)) == 0
    model = load_exclmm(tmp_path / "paper" / "exclmm.safetensors")
    assert model.cfg["query"]["triplet"] == "paper" and model.cfg["space"]["image_mask"] == "zc_or_top_t"
    assert model.cosine_scores
    codes = model.encode_images(torch.randn(3, model.sae.encoder.weight.shape[1]))
    norms = codes.norm(dim=-1)
    assert torch.all((norms - 1).abs() < 1e-5) or (norms == 0).any()
    lines = [json.loads(x) for x in (tmp_path / "paper" / "metrics.jsonl").read_text().splitlines()]
    assert any(x["phase"] == "query" and x["tri"] > 0 for x in lines)  # Eq. 16 was active
    model.cfg["query"]["contrastive"] = "dot"
    assert not model.cosine_scores
    feats = load_features(tmp_path / "paper" / FEATURES_NAME)
    assert feats["positive_queries"].shape == feats["queries"].shape  # Eq. 16's encoded positive caption
    assert len(feats["positive_words"]) == len(feats["queries"])



def test_bad_input_is_one_clear_line(repo_root, tmp_path, capsys):
    assert cli.main(smoke_args(repo_root, tmp_path / "nothing", tmp_path / "run")) == 2
    assert "exclcoco.json does not exist" in capsys.readouterr().err
    assert cli.main(smoke_args(repo_root, tmp_path, tmp_path / "run", "space.nope=1")) == 2
    assert "unknown config key 'space.nope'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("stop", [[], ["stop.window=6", "stop.tol=0.01"]], ids=["fixed-steps", "plateau-rule"])
def test_killed_run_resumes_to_the_same_weights(repo_root, train_split, tmp_path, stop):
    """With the plateau rule too: its window means are saved with the state, so the resumed run
    stops each phase at the same step as the uninterrupted one."""
    steps = ["sae.steps=60", "space.steps=60", "query.steps=60", "run.save_every=3", *stop]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root))
    command = [sys.executable, "-m", "demind.cli.train_exclmm"]
    reference = tmp_path / "uninterrupted"
    subprocess.run([*command, *smoke_args(repo_root, train_split, reference, *steps)], env=env, check=True,
                   cwd=repo_root, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*command, *smoke_args(repo_root, train_split, killed, *steps)], env=env, cwd=repo_root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    state = killed / STATE_NAME
    while proc.poll() is None and time.time() < deadline:
        if state.exists() and read_train_state_extra(state)["phase"] == "space":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed in phase 'space'"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "exclmm.safetensors").exists()
    subprocess.run([*command, *smoke_args(repo_root, train_split, killed, *steps)], env=env, check=True,
                   cwd=repo_root, capture_output=True)
    a, b = load_file(reference / "exclmm.safetensors"), load_file(killed / "exclmm.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the log too: lines logged after the last saved state are dropped and logged again, same means
    logged = [[{k: v for k, v in json.loads(line).items() if k != "rows_per_s"}
               for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (reference, killed)]
    assert logged[0] == logged[1] and (stop or len(logged[0]) == 3 * 60 // 4)
    phases = [json.loads((run / "phases.json").read_text()) for run in (reference, killed)]
    assert phases[0] == phases[1]


def test_features_reused_from_their_record_and_recomputed_after_a_stop_before_it(train_split, tiny_backbone,
                                                                                 tmp_path, monkeypatch):
    import demind.exclmm.features as features
    from demind.exclmm.config import ExclDataConfig

    data = ExclDataConfig(train=str(train_split), encode_batch_size=64)
    first = features.prepare_features(data, tiny_backbone, tmp_path, progress=False)
    record = tmp_path / FEATURES_NAME.replace(".safetensors", ".json")
    assert record.is_file()
    monkeypatch.setattr(features, "encode_texts", lambda *a, **k: pytest.fail("recomputed although finished"))
    again = features.prepare_features(data, tiny_backbone, tmp_path, progress=False)
    assert torch.equal(again["images"], first["images"]) and again["vocab"] == first["vocab"]
    monkeypatch.undo()
    record.unlink()  # a run stopped after the tensors, before its done-marker
    redone = features.prepare_features(data, tiny_backbone, tmp_path, progress=False)
    assert record.is_file() and torch.equal(redone["word_vectors"], first["word_vectors"])
