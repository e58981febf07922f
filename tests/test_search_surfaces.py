"""The search, index, serve and publish surfaces as a new user tries them: a combiner checkpoint's
search reads the reference image (what each method reads comes from its registry entry), user text
holding braces is never read as a template, numeric options are range-checked and a missing vLLM is
said before any model loads, an error names only flags the command has, an index inside its image
folder does not list its own files, and a combiner's published card is a combiner's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import TINY_CLIP


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_image(path: Path, seed: int, size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def combiner_checkpoint(tmp_path_factory, tiny_backbone) -> Path:
    """A random combiner (demind-train-triplets' model) on the tiny backbone, its weights in a file."""
    from demind.backbone import FrozenCLIP
    from demind.checkpoint import save_checkpoint
    from demind.combiner import Combiner
    from demind.schema import BackboneConfig, CombinerConfig

    folder = tmp_path_factory.mktemp("combiner")
    weights = folder / "tiny-clip-weights.pt"
    torch.save(tiny_backbone.model.state_dict(), weights)
    backbone = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(weights)))
    torch.manual_seed(0)
    model = Combiner(CombinerConfig(projection_dim=8, hidden_dim=16, dropout=0.0), backbone).eval()
    return save_checkpoint(folder / "combiner.safetensors", model)


@pytest.fixture(scope="module")
def gallery_index(tmp_path_factory, combiner_checkpoint) -> tuple[Path, Path]:
    """(image folder of 6 random images, its index, kept inside it as photos/.index)."""
    from demind.cli.index import main

    photos = tmp_path_factory.mktemp("photos")
    for i in range(6):
        write_image(photos / f"img{i}.png", i)
    assert main(["--images", str(photos), "--index", str(photos / ".index"), "--checkpoint",
                 str(combiner_checkpoint), "--num-workers", "0", "run.progress=false"]) == 0
    return photos, photos / ".index"


def search(argv: list[str]) -> tuple[int, dict | None]:
    from demind.cli.search import main

    out = Path(argv[argv.index("--index") + 1]).parent.parent / "search-out.json"  # beside the image folder
    status = main([*argv, "--out", str(out), "run.progress=false"])
    return status, json.loads(out.read_text()) if out.is_file() else None


# ------------------------------------------------------------------ what a method reads: one registry


def test_every_method_says_what_it_reads_and_search_asks_the_registry():
    from demind.retrieval import METHOD_SPECS, METHODS, method_spec

    assert set(METHOD_SPECS) == set(METHODS)
    assert method_spec("combiner").image and method_spec("combiner").words == "text"
    assert method_spec("text-only+rerank").image  # the verifier reads the reference
    assert method_spec("demind+deo-adam") == METHOD_SPECS["demind"]
    import demind.search.query as query

    assert not any(hasattr(query, name) for name in ("IMAGE_METHODS", "TEXT_METHODS", "PROMPT_METHODS"))


def test_a_combiner_search_reads_the_reference_image(combiner_checkpoint, gallery_index):
    photos, index = gallery_index
    scores = {}
    for ref in ("img0.png", "img3.png"):
        status, written = search(["--index", str(index), "--checkpoint", str(combiner_checkpoint), "--method",
                                  "combiner", "--image", str(photos / ref), "--text", "make it red",
                                  "--keep-reference"])
        assert status == 0
        scores[ref] = {h["name"]: h["score"] for h in written["queries"][0]["results"]}
    assert scores["img0.png"] != scores["img3.png"]  # a zero image feature gave the same scores for any reference
    status, written = search(["--index", str(index), "--checkpoint", str(combiner_checkpoint), "--method",
                              "combiner", "--text", "make it red"])
    assert status == 1 and "needs a reference image" in written["queries"][0]["error"]


def test_a_combiner_checkpoint_answers_with_its_own_method_by_default(combiner_checkpoint, gallery_index):
    from demind.checkpoint import load_backbone_and_model
    from demind.search.index import load_index
    from demind.search.query import Searcher
    from demind.search.server import create_app

    photos, index = gallery_index
    status, written = search(["--index", str(index), "--checkpoint", str(combiner_checkpoint), "--image",
                              str(photos / "img0.png"), "--text", "make it red"])
    assert status == 0 and written["queries"][0]["method"] == "combiner"
    backbone, model = load_backbone_and_model(combiner_checkpoint)
    client = create_app(Searcher(backbone, model, load_index(index))).test_client()
    assert client.get("/api/info").get_json()["methods"][0]["name"] == "combiner"  # the page's choice at first


def test_a_combiner_negative_says_it_has_no_deo_variant(combiner_checkpoint, gallery_index):
    photos, index = gallery_index
    status, written = search(["--index", str(index), "--checkpoint", str(combiner_checkpoint), "--method", "combiner",
                              "--image", str(photos / "img0.png"), "--text", "make it red", "--negative", "dog"])
    error = written["queries"][0]["error"]
    assert status == 1 and "has no DEO variant" in error and "reads no text" not in error


def test_the_page_reads_the_combiners_reference_too(combiner_checkpoint, gallery_index):
    from demind.checkpoint import load_backbone_and_model
    from demind.search.index import load_index
    from demind.search.query import Searcher
    from demind.search.server import create_app

    backbone, model = load_backbone_and_model(combiner_checkpoint)
    client = create_app(Searcher(backbone, model, load_index(gallery_index[1]))).test_client()
    answers = [client.post("/api/search", data={"gallery_name": ref, "text": "make it red", "method": "combiner"})
               for ref in ("img1.png", "img4.png")]
    assert [a.status_code for a in answers] == [200, 200]
    firsts = [{r["name"]: r["score"] for r in a.get_json()["results"]} for a in answers]
    shared = set(firsts[0]) & set(firsts[1])
    assert any(firsts[0][n] != firsts[1][n] for n in shared)
    refused = client.post("/api/search", data={"text": "make it red", "method": "combiner"})
    assert refused.status_code == 400 and "needs a reference image" in refused.get_json()["error"]


# ------------------------------------------------------------------ an index inside its image folder


def test_an_index_inside_its_image_folder_is_not_its_own_input(combiner_checkpoint, gallery_index, capsys):
    from demind.cli.index import main

    photos, index = gallery_index
    capsys.readouterr()
    assert main(["--images", str(photos), "--index", str(index), "--checkpoint", str(combiner_checkpoint),
                 "--num-workers", "0", "run.progress=false"]) == 0
    out = capsys.readouterr().out
    assert "6 images (0 encoded" in out and "0 skipped" in out and ".json" not in out.split("rankers")[0]


def test_an_index_that_is_the_image_folder_itself_is_refused(combiner_checkpoint, tmp_path, capsys):
    from demind.cli.index import main

    write_image(tmp_path / "photos" / "a.png", 1)
    assert main(["--images", str(tmp_path / "photos"), "--index", str(tmp_path / "photos"), "--checkpoint",
                 str(combiner_checkpoint), "run.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "is the image folder itself" in err and "Traceback" not in err
    assert not (tmp_path / "photos" / "backbone.json").exists()


# ------------------------------------------------------------------ messages name this command's flags


def test_search_for_exclmm_names_no_flag_search_lacks(combiner_checkpoint, gallery_index):
    photos, index = gallery_index
    status, written = search(["--index", str(index), "--checkpoint", str(combiner_checkpoint), "--text", "make it red",
                              "--method", "exclmm"])
    error = written["queries"][0]["error"]
    assert status == 1 and "--exclmm" not in error and "does not answer a query against a gallery index" in error


def test_error_messages_name_only_flags_the_command_has():
    """The sweep checks every error line with :func:`flags_named`; what it counts as this command's."""
    from test_bad_input_sweep import command_flags, flags_named

    from demind.search.query import UNSERVED

    assert flags_named("give --new-folder to do that, or another --index folder") == ["--new-folder", "--index"]
    assert flags_named("rebuild it with demind-index --images DIR --index NEW") == []
    assert flags_named("a limited run (demind-eval --limit 1); give that results.json") == []
    for why in UNSERVED.values():
        assert set(flags_named(why)) <= command_flags("demind-search"), why


# ------------------------------------------------------------------ user text is never a template


def test_filling_a_prompt_never_reads_a_value_as_a_field():
    from demind.engines import fill_prompt

    prompt = "Caption: {caption}\nChange: {modification}"
    assert fill_prompt(prompt, caption="a {modification} sign", modification="put the {caption} on it") == \
        "Caption: a {modification} sign\nChange: put the {caption} on it"


def test_rerank_takes_a_text_holding_the_candidate_field(tiny_llava, combiner_checkpoint, gallery_index, tmp_path):
    photos, index = gallery_index
    threads = torch.get_num_threads()
    try:
        status, written = search([
            "--index", str(index), "--checkpoint", str(combiner_checkpoint), "--image", str(photos / "img2.png"),
            "--text", "put the {candidate} logo on it", "--method", "text-only+rerank", "rerank.k=3", "rerank.yes=dog", "rerank.no=cat",
            "run.device=cpu", "engine.name=transformers", f"engine.model={tiny_llava}", "engine.dtype=float32",
            "engine.cpu_threads=1", f"describe.store={tmp_path / 'store'}", "describe.image_max_side=32"])
    finally:
        torch.set_num_threads(threads)
    record = written["queries"][0]
    assert status == 0 and record["reranked"] == 3 and len(record["results"]) == 5
    assert record["text"] == "put the {candidate} logo on it"


# ------------------------------------------------------------------ checked before any model loads


@pytest.fixture()
def no_model_loads(monkeypatch, tmp_path):
    """Loading a model fails the test; ``tmp_path/c.safetensors`` exists (the config check wants the file
    --checkpoint names), so what is refused is what the test gives, before any model loads."""
    import demind.checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(demind.checkpoint, "load_backbone_and_model", refuse)
    (tmp_path / "c.safetensors").write_bytes(b"")


@pytest.mark.parametrize("extra, names", [
    (["--threads", "100000"], ["threads", "100000", "<= 256"]),
    (["--timeout", "1e12"], ["timeout", "<= 86400"]),
    (["--port", "70000"], ["port", "70000"]),
    (["run.threads=100000"], ["run.threads", "<= 1024"]),  # torch's pool crashed (segmentation fault) at 100,000
    (["engine.model=some/llava", "engine.cpu_threads=100000"], ["engine.cpu_threads", "<= 1024"]),
    (["--new-folder"], ["new_folder", "--images"]),
])
def test_serve_numbers_out_of_range_are_one_line_before_any_model(extra, names, tmp_path, capsys, no_model_loads):
    from demind.cli.serve import main

    assert main(["--index", str(tmp_path / "ix"), "--checkpoint", str(tmp_path / "c.safetensors"), *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(n in err for n in names), err


@pytest.mark.parametrize("script", ["demind-search", "demind-serve", "demind-eval"])
def test_a_missing_vllm_is_said_before_any_model_loads(script, tmp_path, capsys, monkeypatch, no_model_loads):
    import demind.cli.model_options as model_options

    monkeypatch.setattr(model_options, "vllm_installed", lambda: False, raising=False)  # as without vLLM
    if script == "demind-eval":
        from demind.cli.evaluate import main

        argv = ["--benchmark", "cirr", "--data-root", str(tmp_path), "--out", str(tmp_path / "ev"), "--methods",
                "osrcir", "engine.name=vllm", "engine.model=some/llava"]
    else:
        from demind.cli.search import main as search_main
        from demind.cli.serve import main as serve_main

        main = search_main if script == "demind-search" else serve_main
        argv = ["--index", str(tmp_path / "ix"), "--checkpoint", str(tmp_path / "c.safetensors"), "engine.name=vllm",
                "engine.model=some/llava", *(["--text", "red"] if script == "demind-search" else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "engine.name" in err and "vLLM package" in err and "Traceback" not in err, err


# ------------------------------------------------------------------ a combiner's published card


def test_a_combiner_card_is_a_combiners_with_its_recipe_and_results(combiner_checkpoint, tmp_path):
    import shutil

    from demind.cli.evaluate import main as evaluate
    from demind.cli.publish import main
    from demind.release.cards import read_front_matter
    from helpers import write_cirr_layout

    run = tmp_path / "run"
    run.mkdir()
    for path in combiner_checkpoint.parent.iterdir():
        shutil.copy(path, run / path.name)
    config = {"data": {"source": "cirr", "path": "data/CIRR"}, "noise": {"kind": "easy", "rate": 0.2},
              "robust": {"mode": "gfq"}, "optim": {"epochs": 3, "batch_size": 64, "lr": 0.001}, "run": {"seed": 7}}
    (run / "run.json").write_text(json.dumps({"config": config, "triplets": 10}))  # demind-train-triplets' record
    members = [f"dev-{i}-img0" for i in range(4)]
    for i, name in enumerate(members):
        write_image(tmp_path / "png" / f"{name}.png", i)
    captions = [{"pairid": i, "reference": members[i], "target_hard": members[(i + 1) % 4], "caption": "make it red",
                 "img_set": {"id": 0, "members": members}} for i in range(4)]
    root = write_cirr_layout(tmp_path / "cirr", "val", "dev",
                             {m: (tmp_path / "png" / f"{m}.png").read_bytes() for m in members}, captions)
    assert evaluate(["--benchmark", "cirr", "--data-root", str(root), "--checkpoint", str(run / "combiner.safetensors"),
                     "--out", str(run / "eval"), "run.device=cpu", "num_workers=0", "run.progress=false"]) == 0
    metrics = json.loads((run / "eval" / "results.json").read_text())["methods"]["combiner"]
    assert main(["--checkpoint", str(run / "combiner.safetensors"), "--out", str(tmp_path / "pub")]) == 0
    card = (tmp_path / "pub" / "README.md").read_text()
    front = read_front_matter(card)
    assert "De-MINDS model" not in card and "intention module" not in card and "combiner" in card.lower()
    assert "zero-shot-composed-image-retrieval" not in front["tags"]
    assert "`robust.mode=gfq`" in card and "`optim.epochs=3`" in card
    (entry,) = front["model-index"][0]["results"]
    assert {m["type"]: m["value"] for m in entry["metrics"]} == {k: round(v, 4) for k, v in metrics.items()}
    assert (tmp_path / "pub" / "training_config.yaml").is_file()


def test_serve_refuses_an_address_it_cannot_listen_on_before_any_model(tmp_path, capsys, no_model_loads):
    import socket

    from demind.cli.serve import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for extra, said in ((["--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1"),
                            (["--host", "no-such-host.invalid", "--token", "t"], "no-such-host.invalid")):
            assert main(["--index", str(tmp_path / "ix"), "--checkpoint", str(tmp_path / "c.safetensors"),
                         *extra]) == 2
            err = capsys.readouterr().err
            assert said in err and "Traceback" not in err, err
    finally:
        taken.close()


@pytest.mark.parametrize("script", ["demind-search", "demind-serve --images"])
def test_rerank_words_the_model_lacks_are_said_before_any_model_or_encoding(script, tiny_llava, gallery_index, tmp_path,
                                                                            capsys, no_model_loads):
    from demind.cli.search import main as search_main
    from demind.cli.serve import main as serve_main

    photos, index = gallery_index
    mllm = ["engine.name=transformers", f"engine.model={tiny_llava}", "rerank.k=2",  # the tiny LLaVA has no "yes"
            f"describe.store={tmp_path / 'store'}"]
    if script == "demind-search":
        status = search_main(["--index", str(index), "--checkpoint", str(tmp_path / "c.safetensors"), "--image",
                              str(photos / "img0.png"), "--text", "red", *mllm])
    else:
        status = serve_main(["--images", str(photos), "--index", str(tmp_path / "new-index"), "--checkpoint",
                             str(tmp_path / "c.safetensors"), "--port", "0", *mllm])
        assert not (tmp_path / "new-index" / "index.json").exists()
    err = capsys.readouterr().err
    assert status == 2 and "rerank.yes='yes'" in err and "Traceback" not in err, err


@pytest.mark.parametrize("script, argv, key", [
    ("search", ["--index", "ix", "--text", "red", "--ranker", "faiss-hnsw"], "ranker"),
    ("serve", ["--index", "ix", "--ranker", "faiss-ivf"], "ranker"),
    ("index", ["--images", "photos", "--index", "ix", "--measure-rankers"], "measure_rankers"),
])
def test_a_faiss_ranker_without_faiss_is_said_before_any_model(script, argv, key, tmp_path, capsys, monkeypatch,
                                                                no_model_loads):
    import importlib
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "faiss" else
                        real(name, *a, **k))  # as without the search extra
    main = importlib.import_module(f"demind.cli.{script}").main
    assert main([*argv, "--checkpoint", str(tmp_path / "c.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "needs FAISS" in err and "Traceback" not in err, err


def test_the_exclusion_writer_fills_its_prompt_in_one_pass(tmp_path):
    from toyworld.synthetic import ScriptedEngine
    from demind.gen.exclusion import llm_query_writer

    engine = ScriptedEngine(lambda request: "a photo of a dog on grass")
    write = llm_query_writer(engine)
    image = write_image(tmp_path / "a.png", 0)
    write([{"id": "q1", "image_path": str(image), "positive_query": "a sign reading {exclude}", "include": ["dog"],
            "exclude": "cat"}])
    assert "a sign reading {exclude}" in engine.prompts[0]  # a caption's braces are its own text
