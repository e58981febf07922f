"""Release and reuse on the Hugging Face Hub, offline: ``demind-publish`` folders and cards from a
trained smoke run, ``hf-hub:`` checkpoints and shards read from a Hugging Face cache laid out on
disk as huggingface_hub writes it (``HF_HUB_OFFLINE=1``), intent shards through ``datasets``, and
the CC3M url list from a local parquet in the Hub table's schema. Nothing reaches the network."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from demind.checkpoint import CheckpointError, load_backbone_and_model, read_checked_tensors
from demind.cli.cc3m_list import main as cc3m_main
from demind.cli.publish import main as publish_main
from demind.eval.reports import markdown_table
from demind.release.cards import read_front_matter
from demind.release.publish import CardOptions, publish_checkpoint
from demind.release.folders import CARD_MARKER, PublishError
from demind.hubref import HubError, HubRef, parse_hub_ref
from demind.shard_format import INTENT_MEMBERS, resolve_shards
from toyworld.synthetic import write_synthetic_shards
from helpers import REPO_ROOT, TINY_CLIP, make_sample, run_eval_command, write_input_shard
from test_data_gen import base_argv
from test_eval_benchmarks import make_fashioniq

MODEL_REPO = "demind-test/smoke"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXTS = ["make it red", "a dog on the beach instead", "without the hat"]


def smoke_train_args(shards: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={shards}",
            f"run.output_dir={run}", f"backbone.name={TINY_CLIP}", *extra]


def train_quietly(args: list[str]) -> None:
    """The real train command on one torch thread, with a fresh Accelerate state afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    from demind.cli import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(args) == 0
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """A trained smoke run (the tiny recipe, 3 steps) evaluated by demind-eval on a tiny FashionIQ:
    RUN/demind.safetensors, RUN/config.yaml and RUN/eval/fashioniq/results.json."""
    root = tmp_path_factory.mktemp("smoke")
    write_synthetic_shards(root / "shards", num_shards=2, samples_per_shard=24)
    run = root / "run"
    train_quietly(smoke_train_args(root / "shards", run, "optim.max_steps=3", "run.save_every=3", "run.log_every=3"))
    data = make_fashioniq(root / "fashion-iq")
    run_eval_command(["--benchmark", "fashioniq", "--data-root", str(data), "--checkpoint", str(run / "demind.safetensors"),
                      "--out", str(run / "eval" / "fashioniq"), "--num-workers", "0", "run.progress=false"])
    return run


def query_embeddings(checkpoint: str | Path) -> torch.Tensor:
    """(3, D) De-MINDS query embeddings of fixed images and texts through load_backbone_and_model."""
    backbone, model = load_backbone_and_model(checkpoint)
    side = 32  # configs/model/tiny-clip.json's image size
    images = torch.linspace(0, 1, 3 * 3 * side * side).reshape(3, 3, side, side)
    with torch.no_grad():
        return model.query(backbone.encode_image(images), TEXTS)


# --------------------------------------------------------------------------- a Hugging Face cache on disk


def lay_out_hub_cache(cache: Path, repo_id: str, repo_type: str, folder: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``folder`` into ``cache`` as huggingface_hub's snapshot_download leaves a download:
    ``{type}s--ORG--NAME/blobs/<id>`` (sha256 for LFS files, the git blob sha1 for others),
    ``snapshots/<commit>/<path>`` relative symlinks to the blobs, ``refs/<ref>`` holding the commit,
    and the tree listing ``trees/<commit>.json``. Returns the snapshot folder."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel, data = path.relative_to(folder).as_posix(), path.read_bytes()
        git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = path.suffix in (".safetensors", ".tar")  # stored with LFS on the Hub (its .gitattributes)
        sha256 = hashlib.sha256(data).hexdigest()
        blob = storage / "blobs" / (sha256 if lfs else git_sha1)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / COMMIT / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        files[rel] = {"size": len(data), "blob_id": git_sha1, **({"lfs_sha256": sha256, "lfs_size": len(data)} if lfs else {})}
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(COMMIT)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": files}, indent=1))
    return storage / "snapshots" / COMMIT


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=tmp for this process (huggingface_hub reads both at import,
    so its constants are set too)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


# --------------------------------------------------------------------------- checkpoints


def test_published_folder_loads_with_the_same_query_embeddings(smoke_run, tmp_path):
    checkpoint = smoke_run / "demind.safetensors"
    out = tmp_path / "release"
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "README.md", "backbone/tiny-clip.json", "config.json", "demind.safetensors", "results/fashioniq-val.json",
        "training_config.yaml"]
    # the same tensors; only the backbone's recorded paths changed (relative to the folder)
    assert read_checked_tensors(out / "demind.safetensors").keys() == read_checked_tensors(checkpoint).keys()
    assert all(torch.equal(a, b) for a, b in zip(read_checked_tensors(out / "demind.safetensors").values(),
                                                 read_checked_tensors(checkpoint).values()))
    config = json.loads((out / "config.json").read_text())
    assert config["library_name"] == "demind" and config["backbone_model_config"] == "backbone/tiny-clip.json"
    # the copied training config and results do not show the publisher's disk
    for name in ("training_config.yaml", "results/fashioniq-val.json"):
        text = (out / name).read_text()
        assert str(smoke_run) not in text and str(tmp_path) not in text, name
    assert str(smoke_run) in (smoke_run / "config.yaml").read_text() + (smoke_run / "eval/fashioniq/results.json").read_text()

    # the folder publishes again as it is: the same files, its evaluation kept
    assert publish_main(["--checkpoint", str(out), "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text())["files"] == config["files"]

    backbone, _ = load_backbone_and_model(out)
    assert backbone.cfg.name == str(out / "backbone" / "tiny-clip.json")  # the folder's own copy
    assert torch.equal(query_embeddings(out), query_embeddings(checkpoint))
    # another backbone is refused, naming both
    weights = tmp_path / "other-weights.pt"
    torch.save(backbone.model.state_dict(), weights)
    with pytest.raises(CheckpointError, match=r"trained on backbone .*'random:.*loaded backbone is .*other-weights\.pt"):
        load_backbone_and_model(out, backbone=f"{TINY_CLIP}:{weights}")


def test_hf_hub_reference_loads_offline_from_the_cache(smoke_run, offline_hub_cache, tmp_path):
    """hf-hub:ORG/NAME (main, a tag, a commit) read from the cache with HF_HUB_OFFLINE=1 gives the
    original query embeddings; a repository not in the cache is one error naming it."""
    folder = publish_checkpoint(smoke_run / "demind.safetensors", tmp_path / "release", CardOptions(repo=MODEL_REPO))
    snapshot = lay_out_hub_cache(offline_hub_cache, MODEL_REPO, "model", folder, refs=("main", "v1"))
    expected = query_embeddings(smoke_run / "demind.safetensors")
    for ref in (f"hf-hub:{MODEL_REPO}", f"hf-hub:{MODEL_REPO}@v1", f"hf-hub:{MODEL_REPO}@{COMMIT}"):
        assert torch.equal(query_embeddings(ref), expected), ref
    backbone, _ = load_backbone_and_model(f"hf-hub:{MODEL_REPO}")
    assert backbone.cfg.name == str(snapshot / "backbone" / "tiny-clip.json")
    with pytest.raises(HubError, match="checkpoint='hf-hub:demind-test/absent'.*not \\(completely\\) in the Hugging Face cache"):
        load_backbone_and_model("hf-hub:demind-test/absent")
    (snapshot / "demind.safetensors").unlink()  # a partial download
    # A huggingface_hub that keeps the tree listing (trees/<commit>.json) knows a file is missing; an
    # older one returns the folder, and the checkpoint reader names the missing file instead.
    knows_trees = importlib.util.find_spec("huggingface_hub._tree_cache") is not None
    error, message = ((HubError, "not \\(completely\\) in the Hugging Face cache") if knows_trees else
                      (CheckpointError, "folder without demind.safetensors"))
    with pytest.raises(error, match=message):
        load_backbone_and_model(f"hf-hub:{MODEL_REPO}")


@pytest.mark.slow
def test_hf_hub_reference_loads_in_a_fresh_offline_process(smoke_run, tmp_path):
    """The same from a fresh process whose environment alone says HF_HUB_OFFLINE=1 and HF_HUB_CACHE=tmp
    (huggingface_hub reads both at import)."""
    folder = publish_checkpoint(smoke_run / "demind.safetensors", tmp_path / "release", CardOptions(repo=MODEL_REPO))
    lay_out_hub_cache(tmp_path / "hf-cache", MODEL_REPO, "model", folder, refs=("main", "v1"))
    script = (
        "import json, sys\n"
        "from test_hub import query_embeddings\n"
        "from demind.hubref import HubError\n"
        "out = {ref: query_embeddings(ref).tolist() for ref in sys.argv[1:4]}\n"
        "try:\n    query_embeddings(sys.argv[4])\nexcept HubError as e:\n    out['error'] = str(e)\n"
        "print(json.dumps(out))\n")
    refs = [f"hf-hub:{MODEL_REPO}", f"hf-hub:{MODEL_REPO}@v1", f"hf-hub:{MODEL_REPO}@{COMMIT}", "hf-hub:demind-test/absent"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HOME": str(tmp_path / "hf-home"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, *refs], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = query_embeddings(smoke_run / "demind.safetensors")
    for ref in refs[:3]:
        torch.testing.assert_close(torch.tensor(result[ref]), expected, rtol=0, atol=1e-6)
    assert "demind-test/absent" in result["error"] and "not (completely) in the Hugging Face cache" in result["error"]


def test_model_card_front_matter_parses_and_its_table_is_the_runs_results(smoke_run, tmp_path):
    out = publish_checkpoint(smoke_run / "demind.safetensors", tmp_path / "release",
                             CardOptions(repo=MODEL_REPO, tags=["smoke"], datasets=["demind-test/intent"]))
    card = (out / "README.md").read_text()
    results = json.loads((smoke_run / "eval" / "fashioniq" / "results.json").read_text())
    front = read_front_matter(card)
    assert yaml.safe_load(card.split("---\n")[1]) == front
    assert front["library_name"] == "demind" and front["license"] == "apache-2.0"
    assert {"demind", "composed-image-retrieval", "smoke"} <= set(front["tags"])
    assert front["datasets"] == ["demind-test/intent"]
    assert "base_model" not in front  # a random-init backbone has no Hub repository
    assert front["demind"]["backbone"] == {"name": "backbone/tiny-clip.json", "pretrained": None}  # no publisher path
    (entry,) = front["model-index"][0]["results"]
    assert entry["dataset"] == {"name": "FashionIQ", "type": "fashioniq", "split": "val"}
    assert {m["type"]: m["value"] for m in entry["metrics"]} == pytest.approx(results["methods"]["demind"], abs=1e-4)
    # the body's table: one row per evaluated method, every value the results.json's to 2 decimals
    table = [line for line in card.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {r.strip("|").split("|")[0].strip(): [float(c) for c in r.strip("|").split("|")[1:]] for r in table[2:]}
    assert len(rows) == len(results["methods"]) >= 2
    expected_table = markdown_table(results)
    assert "\n".join(table) in expected_table and header[0] == "Method"
    from demind.retrieval import method_label

    for method, values in results["methods"].items():
        assert rows[method_label(method)] == [round(v, 2) for v in values.values()]
    assert f'load_backbone_and_model("hf-hub:{MODEL_REPO}")' in card and card.rstrip().endswith(CARD_MARKER)


def test_card_claims_no_numbers_without_results_and_refuses_another_models(smoke_run, tmp_path):
    out = tmp_path / "none"
    assert publish_main(["--checkpoint", str(smoke_run / "demind.safetensors"), "--out", str(out), "--results"]) == 0
    card = (out / "README.md").read_text()
    assert "model-index" not in read_front_matter(card) and "reports no numbers" in card
    assert not any(line.startswith("| ") for line in card.splitlines())
    other = json.loads((smoke_run / "eval" / "fashioniq" / "results.json").read_text())
    other["model_config"]["num_queries"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(PublishError, match="other.json does not evaluate checkpoint .*model config differs"):
        publish_checkpoint(smoke_run / "demind.safetensors", tmp_path / "x", CardOptions(), [str(tmp_path / "other.json")])
    # an existing folder is replaced only on request
    assert publish_main(["--checkpoint", str(smoke_run / "demind.safetensors"), "--out", str(out)]) == 2
    assert publish_main(["--checkpoint", str(smoke_run / "demind.safetensors"), "--out", str(out), "--overwrite"]) == 0
    assert "model-index" in read_front_matter((out / "README.md").read_text())


def record_hub_api(monkeypatch) -> list[tuple[str, str, dict]]:
    """Replace huggingface_hub.HfApi with one that records its create_repo and upload_folder calls
    (name, repo id, keyword arguments plus the folder's ``files``); returns the record. The Hub
    counts as reachable (demind.release.publish probes it before an upload)."""
    import huggingface_hub

    import demind.release.publish as publish

    monkeypatch.setattr(publish, "hub_unreachable", lambda: None)

    calls: list[tuple[str, str, dict]] = []

    class RecordingApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))
            kind = "datasets/" if kw.get("repo_type") == "dataset" else ""
            return f"https://huggingface.co/{kind}{repo_id}"

        def upload_folder(self, **kw):
            files = sorted(p.relative_to(kw["folder_path"]).as_posix() for p in Path(kw["folder_path"]).rglob("*") if p.is_file())
            calls.append(("upload_folder", kw["repo_id"], {**kw, "files": files}))

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return calls


def test_upload_is_one_create_and_one_upload_folder_call(smoke_run, monkeypatch, capsys):
    """The upload's wiring (the real call needs the network): what is sent and the URL printed."""
    calls = record_hub_api(monkeypatch)
    assert publish_main(["--checkpoint", str(smoke_run / "demind.safetensors"), "--repo", MODEL_REPO]) == 0
    (c_name, c_repo, c_kw), (u_name, u_repo, u_kw) = calls
    assert (c_name, c_repo, c_kw) == ("create_repo", MODEL_REPO, {"repo_type": "model", "private": False, "exist_ok": True})
    assert u_name == "upload_folder" and u_repo == MODEL_REPO and "demind.safetensors" in u_kw["files"]
    assert f"https://huggingface.co/{MODEL_REPO}" in capsys.readouterr().out


# --------------------------------------------------------------------------- intent shards


@pytest.fixture(scope="module")
def intent_shards(tmp_path_factory, repo_root) -> Path:
    """Two intent shards written by the real generation command (tiny random LLaVA-NeXT, CPU)."""
    from demind.cli.generate import main as generate_main
    from demind.engines.tiny_llava import build_tiny_llava_next

    root = tmp_path_factory.mktemp("intent")
    (root / "in").mkdir()
    for shard in range(2):
        write_input_shard(root / "in" / f"0000{shard}.tar",
                          [make_sample(f"0000{shard}000{i}", 10 * shard + i, f"a red dog {shard} {i}") for i in range(3)])
    threads = torch.get_num_threads()
    try:
        assert generate_main(base_argv(repo_root, build_tiny_llava_next(root / "llava"), root / "in", root / "out")) == 0
    finally:
        torch.set_num_threads(threads)
    return root / "out"


def same_json_modulo_schema(read, written) -> bool:
    """``read`` equals ``written`` but for keys ``datasets`` adds as None (one Arrow schema for all rows)."""
    if isinstance(written, dict):
        return (isinstance(read, dict) and set(written) <= set(read)
                and all(read[k] is None for k in set(read) - set(written))
                and all(same_json_modulo_schema(read[k], v) for k, v in written.items()))
    if isinstance(written, list):
        return isinstance(read, list) and len(read) == len(written) and all(map(same_json_modulo_schema, read, written))
    return read == written


def test_datasets_reads_every_field_of_the_intent_shards(intent_shards, tmp_path):
    import datasets
    import webdataset as wds

    tars = sorted(str(p) for p in intent_shards.glob("*.tar"))
    ds = datasets.load_dataset("webdataset", data_files={"train": tars}, split="train", cache_dir=str(tmp_path / "ds"))
    raw = {s["__key__"]: s for t in tars for s in wds.WebDataset(t, shardshuffle=False, empty_check=False)}
    assert len(ds) == len(raw) == 6
    for row in ds:
        sample = raw[row["__key__"]]
        # every member of the sample is a field, and no field is made up
        fields = {k for k in sample if not k.startswith("__")}
        assert fields == {"jpg", "txt", "rew.txt", "int.txt", "json"}
        assert {k for k in row if not k.startswith("__")} == fields
        for field in ("txt", "rew.txt", "int.txt"):
            assert row[field] == sample[field].decode("utf-8")
        assert same_json_modulo_schema(row["json"], json.loads(sample["json"]))
        # the image decodes to the same pixels as the JPEG in the tar
        assert np.array_equal(np.asarray(row["jpg"].convert("RGB")),
                              np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB")))


def test_shard_upload_is_a_dataset_repository_without_partial_files(intent_shards, tmp_path, monkeypatch, capsys):
    """demind-publish --shards DIR --repo ORG/NAME --repo-type dataset: the card is written into the
    folder, and the upload (recorded; the real call needs the network) sends the tars, their stats
    and the card, never a partial ``.tmp`` file."""
    import fnmatch

    folder = tmp_path / "shards"
    folder.mkdir()
    for p in intent_shards.iterdir():
        if p.is_file():
            (folder / p.name).write_bytes(p.read_bytes())
    (folder / "00009.tar.tmp").write_bytes(b"half a shard")  # a shard still being written
    calls = record_hub_api(monkeypatch)
    repo = "demind-test/intent-shards"
    assert publish_main(["--shards", str(folder), "--repo", repo, "--repo-type", "dataset"]) == 0
    (c_name, c_repo, c_kw), (u_name, u_repo, u_kw) = calls
    assert c_name == "create_repo" and c_repo == repo and c_kw["repo_type"] == "dataset"
    assert u_name == "upload_folder" and u_repo == repo and u_kw["repo_type"] == "dataset"
    assert Path(u_kw["folder_path"]) == folder and (folder / "README.md").is_file()
    sent = sorted(p.name for p in folder.iterdir()
                  if any(fnmatch.fnmatch(p.name, pattern) for pattern in u_kw["allow_patterns"]))
    assert sent == sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp"))
    assert "00000.tar" in sent and "README.md" in sent
    assert repo in capsys.readouterr().out


def test_dataset_card_from_the_stats_and_the_folder_loads_by_its_card(intent_shards, tmp_path):
    import datasets

    card_dir = tmp_path / "card"
    assert publish_main(["--shards", str(intent_shards), "--out", str(card_dir), "--tags", "smoke"]) == 0
    card = (card_dir / "README.md").read_text()
    front = read_front_matter(card)
    stats = [json.loads(p.read_text()) for p in sorted(intent_shards.glob("*_stats.json"))]
    assert front["license"] == "other" and "webdataset" in front["tags"] and "smoke" in front["tags"]
    assert front["demind"]["samples"] == sum(s["written"] for s in stats) == 6
    assert front["demind"]["model"] == stats[0]["model"] and front["demind"]["prompt_version"] == "v1"
    for member, _ in INTENT_MEMBERS:
        assert f"`{member}`" in card
    flagged = sum(s["samples_flagged"] for s in stats)
    assert f"| samples_flagged | {flagged} |" in card and "temperature: 0.7" in card
    # the card's configs make the folder loadable as a Hub dataset repository is
    folder = tmp_path / "repo"
    folder.mkdir()
    for p in intent_shards.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "README.md").write_text(card)
    ds = datasets.load_dataset(str(folder), split="train", cache_dir=str(tmp_path / "ds"))
    assert len(ds) == 6 and {"jpg", "txt", "rew.txt", "int.txt", "json"} <= set(ds.column_names)


def test_every_intent_member_is_in_the_shards_readme():
    readme = (REPO_ROOT / "shards" / "README.md").read_text().split("## Intent shards", 1)[1]
    for member, _ in INTENT_MEMBERS:
        assert f"`{member}`" in readme


def test_trainer_reads_an_hf_hub_shard_repository_offline(offline_hub_cache, tmp_path):
    shards = tmp_path / "shards"
    write_synthetic_shards(shards, num_shards=2, samples_per_shard=16)
    snapshot = lay_out_hub_cache(offline_hub_cache, "demind-test/shards", "dataset", shards)
    assert resolve_shards("hf-hub:demind-test/shards") == [str(snapshot / "00000.tar"), str(snapshot / "00001.tar")]
    run = tmp_path / "run"
    train_quietly(smoke_train_args(Path("unused"), run, "data.shards=hf-hub:demind-test/shards", "optim.max_steps=1",
                                   "run.save_every=1", "data.features=none"))
    assert (run / "demind.safetensors").is_file()
    with pytest.raises(HubError, match="data.shards='hf-hub:demind-test/other'.*not \\(completely\\) in the"):
        resolve_shards("hf-hub:demind-test/other")


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("spec, ref", [
    ("hf-hub:org/name", HubRef("org/name")),
    ("hf-hub:org/name@v1.0", HubRef("org/name", "v1.0")),
    ("hf-hub:org/name/sub/dir@refs/pr/3", HubRef("org/name", "refs/pr/3", "sub/dir")),
])
def test_hub_references_parse(spec, ref):
    assert parse_hub_ref(spec, "checkpoint") == ref and str(ref) == spec


@pytest.mark.parametrize("spec", ["hf-hub:name", "hf-hub:org/name@", "hf-hub:/org/name", "org/name"])
def test_malformed_hub_references_name_the_setting(spec):
    with pytest.raises(HubError, match="checkpoint=.*ORG/NAME@REVISION"):
        parse_hub_ref(spec, "checkpoint")


def test_a_repository_id_the_hub_refuses_is_one_error(offline_hub_cache):
    with pytest.raises(HubError, match="checkpoint='hf-hub:org/na--me' is not a valid repository id"):
        load_backbone_and_model("hf-hub:org/na--me")


# --------------------------------------------------------------------------- CC3M in


def write_cc3m_parquet(path: Path) -> list[tuple[str, str]]:
    """A parquet in the Hub table's schema (image_url, caption), a caption with a tab and a newline."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [(f"http://images.example/{i}.jpg", f"caption {i} of a dog") for i in range(5)]
    rows[2] = (rows[2][0], "a caption\twith a tab\nand a newline")
    pq.write_table(pa.table({"image_url": [u for u, _ in rows], "caption": [c for _, c in rows]}), path)
    return rows


def test_cc3m_url_list_is_what_img2dataset_reads(tmp_path, capsys):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    rows = write_cc3m_parquet(tmp_path / "cc3m.parquet")
    assert cc3m_main(["--source", str(tmp_path / "cc3m.parquet"), "--out", str(tmp_path / "cc3m.tsv"), "--limit", "4"]) == 0
    assert "img2dataset --url_list" in capsys.readouterr().out
    # img2dataset reads a tsv url list with pyarrow's csv reader, tab-delimited
    table = pacsv.read_csv(tmp_path / "cc3m.tsv", parse_options=pacsv.ParseOptions(delimiter="\t")).to_pylist()
    assert [r["url"] for r in table] == [u for u, _ in rows[:4]]
    assert [r["caption"] for r in table] == [" ".join(c.split()) for _, c in rows[:4]]
    assert cc3m_main(["--source", str(tmp_path / "cc3m.parquet"), "--out", str(tmp_path / "cc3m-list.parquet")]) == 0
    assert pq.read_table(tmp_path / "cc3m-list.parquet").to_pydict() == {
        "url": [u for u, _ in rows], "caption": [c for _, c in rows]}


def test_cc3m_from_a_hub_dataset_id_goes_through_datasets(tmp_path, monkeypatch, capsys):
    """The default source, the Hub's Conceptual Captions id, is read with datasets.load_dataset (its
    cache, offline mode, tokens). No network here: datasets' own parquet builder serves the same
    table from a local file in the Hub table's schema, so the branch runs on a real Dataset."""
    import datasets
    import pyarrow.csv as pacsv

    rows = write_cc3m_parquet(tmp_path / "cc3m.parquet")
    asked = []
    real_load = datasets.load_dataset

    def load_from_the_local_copy(path, name=None, split=None, **kwargs):
        asked.append((path, name, split))
        return real_load("parquet", data_files={"train": str(tmp_path / "cc3m.parquet")}, split=split,
                         cache_dir=str(tmp_path / "ds-cache"))

    monkeypatch.setattr(datasets, "load_dataset", load_from_the_local_copy)
    assert cc3m_main(["--out", str(tmp_path / "cc3m.tsv")]) == 0
    assert asked == [("google-research-datasets/conceptual_captions", "unlabeled", "train")]
    table = pacsv.read_csv(tmp_path / "cc3m.tsv", parse_options=pacsv.ParseOptions(delimiter="\t")).to_pylist()
    assert [r["url"] for r in table] == [u for u, _ in rows]
    assert "img2dataset --url_list" in capsys.readouterr().out


def test_cc3m_bad_inputs_are_one_line(tmp_path, capsys):
    write_cc3m_parquet(tmp_path / "cc3m.parquet")
    assert cc3m_main(["--source", str(tmp_path / "cc3m.parquet"), "--out", str(tmp_path / "x.csv")]) == 2
    assert cc3m_main(["--source", str(tmp_path / "cc3m.parquet"), "--out", str(tmp_path / "x.tsv"),
                      "--split", "validation"]) == 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"url": ["u"], "text": ["t"]}), tmp_path / "other.parquet")
    assert cc3m_main(["--source", str(tmp_path / "other.parquet"), "--out", str(tmp_path / "x.tsv")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert ".tsv or .parquet" in err[0] and "split" in err[1] and "image_url" in err[2]
    assert not (tmp_path / "x.tsv").exists()


def test_base_model_is_the_hub_repository_open_clip_names():
    from demind.release.cards import base_model_id

    import open_clip

    assert base_model_id("ViT-B-32", "laion2b_s34b_b79k") == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    # open_clip names a Hub copy of OpenAI's weights from 2.29 on; before that they are a URL: no base model
    openai_on_hub = bool(open_clip.get_pretrained_cfg("ViT-L-14", "openai").get("hf_hub"))
    assert base_model_id("ViT-L-14", "openai") == ("timm/vit_large_patch14_clip_224.openai" if openai_on_hub else None)
    assert base_model_id("ViT-L-14", None) is None and base_model_id("ViT-L-14", "no-such-tag") is None


def test_features_of_hub_shards_need_an_output_folder(capsys):
    from demind.cli.features import main as features_main

    argv = ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"backbone.name={TINY_CLIP}",
            "data.shards=hf-hub:demind-test/shards"]
    assert features_main(argv) == 2
    assert "cache.out" in capsys.readouterr().err
