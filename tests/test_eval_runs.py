"""Evaluation runs as a user meets them again later: a second run into the same ``--out``, a limited
(``--limit``) run found beside the checkpoint by ``demind-publish``, and ``METHOD+rerank`` named in
``--methods`` (the form docs/mllm.md lists)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from demind.cli.evaluate import main as evaluate_main
from helpers import write_cirr_layout

NAMES = [f"dev-{k}-a-img0" for k in range(6)]


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def cirr(tmp_path_factory) -> Path:
    """A tiny CIRR val split: 6 images, 3 queries."""
    return write_cirr_layout(tmp_path_factory.mktemp("cirr"), "val", "dev", {n: png(k) for k, n in enumerate(NAMES)}, [
        {"pairid": k, "reference": NAMES[k], "target_hard": NAMES[k + 1], "caption": "make it red",
         "img_set": {"id": k, "members": NAMES}} for k in range(3)])


def run_eval(cirr: Path, out: Path, checkpoint: Path, *extra: str) -> int:
    return evaluate_main(["--benchmark", "cirr", "--data-root", str(cirr), "--checkpoint", str(checkpoint),
                          "--out", str(out), "--num-workers", "0", "run.progress=false", "run.device=cpu", *extra])


# ----------------------------------------------------------------------------- a second run into one --out


def test_a_second_run_into_the_same_out_leaves_only_its_own_rankings(cirr, tiny_checkpoint, tmp_path, caplog):
    out = tmp_path / "eval"
    assert run_eval(cirr, out, tiny_checkpoint, "--methods", "image-only,text-only,demind") == 0
    assert sorted(p.name for p in (out / "rankings").iterdir()) == ["demind.json", "image-only.json", "text-only.json"]
    (out / "rankings" / "notes.txt").write_text("mine")  # not a file demind-eval writes: kept
    assert run_eval(cirr, out, tiny_checkpoint, "--methods", "demind") == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["demind"]
    assert sorted(p.name for p in (out / "rankings").iterdir()) == ["demind.json", "notes.txt"]
    assert sorted(Path(p).name for p in results["files"]["rankings"].values()) == ["demind.json"]
    assert "removed 2 output file(s) of the previous evaluation" in caplog.text
    assert (out / "feature_cache").is_dir()  # the image features stay: the second run reused them


# ----------------------------------------------------------------------------- publishing a limited run


def test_publish_skips_a_limited_run_it_finds_and_refuses_one_it_is_given(cirr, tiny_checkpoint, tmp_path, capsys):
    from demind.cli.publish import main as publish_main
    from demind.release.cards import read_front_matter

    run = tmp_path / "run"
    run.mkdir()
    checkpoint = Path(shutil.copy(tiny_checkpoint, run / "demind.safetensors"))
    assert run_eval(cirr, run / "eval" / "cirr-smoke", checkpoint, "--methods", "demind", "--limit", "1") == 0
    release = tmp_path / "release"
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(release)]) == 0
    card = (release / "README.md").read_text()
    assert "model-index" not in read_front_matter(card)
    assert "eval/cirr-smoke/results.json" in card and "--limit 1" in card  # marked in the body, not as a result
    assert not list((release / "results").glob("*.json")) if (release / "results").exists() else True

    assert run_eval(cirr, run / "eval" / "cirr", checkpoint, "--methods", "demind") == 0
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(release), "--overwrite"]) == 0
    front = read_front_matter((release / "README.md").read_text())
    (entry,) = front["model-index"][0]["results"]  # the full run only
    full = json.loads((run / "eval" / "cirr" / "results.json").read_text())
    assert {m["type"]: m["value"] for m in entry["metrics"]} == pytest.approx(full["methods"]["demind"], abs=1e-4)

    capsys.readouterr()
    limited = run / "eval" / "cirr-smoke" / "results.json"
    assert publish_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "named"), "--results",
                         str(limited)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cirr-smoke" in errors[0] and "--limit 1" in errors[0]


# ----------------------------------------------------------------------------- METHOD+rerank in --methods


def test_methods_may_name_a_rerank_variant(cirr, tiny_checkpoint, tmp_path, monkeypatch):
    import demind.mllm.session as session
    from demind.mllm.rerank import Reranker

    class ByName:
        def score(self, queries, candidates):
            return [[float(c.name[-5]) if c.name[-5].isdigit() else 0.0 for c in cands] for cands in candidates]

    monkeypatch.setattr(session.MLLMRun, "reranker",
                        lambda self: Reranker(ByName(), self.setup.rerank.k) if self.setup.rerank.k else None)
    out = tmp_path / "eval"
    assert run_eval(cirr, out, tiny_checkpoint, "--methods", "image-only,demind+rerank", "rerank.k=3",
                    "engine.name=transformers", "engine.model=never-loaded") == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["image-only", "demind", "demind+rerank"]  # only the named one re-ranked


def test_a_rerank_variant_without_rerank_k_names_rerank_k(cirr, tiny_checkpoint, tmp_path, capsys):
    assert run_eval(cirr, tmp_path / "eval", tiny_checkpoint, "--methods", "osrcir+rerank",
                    "engine.name=transformers", "engine.model=never-loaded") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rerank.k" in errors[0] and "'osrcir+rerank'" in errors[0]
    assert not (tmp_path / "eval" / "feature_cache").exists()  # refused before any image was encoded
