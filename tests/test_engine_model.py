"""``engine.model`` that no engine can load (a missing folder, an empty folder, a Hub id absent from the
cache while offline, a folder transformers cannot read): one line naming ``engine.model`` and the fix,
from the file system alone, in every command (the bad-input sweep's ``engine.model`` rows run
demind-generate, demind-eval and demind-search) and as a 400 on the page."""

from __future__ import annotations

import json

import pytest

from demind.engines.model_ref import EngineModelError, check_engine_model, local_model_folder

from test_search import one_torch_thread, write_image  # noqa: F401  (module fixtures)
from test_search_mllm import index_dir, loaded, searcher_with  # noqa: F401  (module fixtures)


@pytest.fixture()
def offline_empty_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_hub_model(cache, repo: str) -> None:
    """The Hugging Face cache's layout of ``repo`` at main: refs/main and a snapshot with config.json."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


@pytest.mark.parametrize("case, value, words", [
    ("missing folder", "{tmp}/no-llava", ["no such folder", "make_tiny_model.py"]),
    ("relative missing folder", "./runs/llava", ["no such folder"]),
    ("empty folder", "{tmp}/empty", ["is an empty folder", "config.json"]),
    ("folder without config.json", "{tmp}/weights-only", ["holds no config.json"]),
    ("a file", "{tmp}/model.safetensors", ["is a file"]),
    ("Hub id not cached, offline", "demind-test/not-cached", ["HF_HUB_OFFLINE=1", "hf download demind-test/not-cached"]),
    ("not a name at all", "two words", ["no such folder"]),
    ("unset", "", ["is not set"]),
])
def test_a_model_that_cannot_load_is_one_line_naming_engine_model(tmp_path, offline_empty_cache, case, value, words):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(EngineModelError) as e:
        check_engine_model(value.format(tmp=tmp_path))
    message = str(e.value)
    assert "\n" not in message and message.startswith("engine.model")
    for word in words:
        assert word in message


def test_a_saved_folder_and_a_cached_hub_id_pass_offline(tmp_path, offline_empty_cache):
    folder = tmp_path / "llava"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    check_engine_model(str(folder))
    assert local_model_folder(str(folder)) == folder
    cache_hub_model(offline_empty_cache, "demind-test/cached-llava")
    check_engine_model("demind-test/cached-llava")
    assert local_model_folder("demind-test/cached-llava").name == "0" * 40
    assert local_model_folder("demind-test/not-cached") is None


def test_online_an_uncached_hub_id_is_left_to_the_download(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    check_engine_model("demind-test/not-cached")  # no network is asked here: the engine downloads it


def test_a_folder_transformers_cannot_read_is_one_line_from_build_engine(tmp_path):
    from demind.engines import EngineConfig, SamplingConfig
    from demind.engines import build_engine

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(EngineModelError) as e:
        build_engine(EngineConfig(name="transformers", model=str(folder)), SamplingConfig(), device="cpu")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"engine.model={folder}: the transformers engine cannot load")


def test_the_page_answers_400_with_the_line_and_keeps_serving(loaded, index_dir, tmp_path, offline_empty_cache):  # noqa: F811
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.cli.model_options import SearchEngineConfig, build_mllm_setup
    from demind.settings import QueryRunConfig
    from demind.mllm import DescribeOptions, RerankOptions
    from demind.search.server import create_app

    for model in (str(tmp_path / "no-llava"), "demind-test/not-cached"):
        setup = build_mllm_setup(SearchEngineConfig(name="transformers", model=model), DescribeOptions(store=None),
                                 RerankOptions(), QueryRunConfig(device="cpu", progress=False))
        client = create_app(searcher_with(loaded, index_dir, setup)).test_client()
        answer = client.post("/api/search", data={"gallery_name": "img1.png", "text": "make it red",
                                                  "method": "osrcir"})
        error = answer.get_json()["error"]
        assert answer.status_code == 400 and error.startswith("engine.model=") and "\n" not in error
        assert str(tmp_path) not in error  # the page names no server path
        ok = client.post("/api/search", data={"gallery_name": "img1.png", "text": "make it red", "method": "demind"})
        assert ok.status_code == 200
