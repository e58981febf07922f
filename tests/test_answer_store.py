"""The one rule of stored MLLM answers (demind/mllm/store.py): an answer is keyed by what it depends on
(the model's content, the reference's pixels, the modification text, the prompt texts, the settings; a
re-ranking score also the candidate's pixels), never by a name. Each ingredient changed alone asks the model
again; each label changed alone (folder, query id, benchmark split, index name) finds the stored answer.
Also: a store whose model is absent (copied to another machine), two writers, damaged files, an unwritable
store, re-ranking words that cannot work, changed captions, a copied index, and the docs' layout."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from demind.mllm import DescribeOptions, MLLMSetup, MLLMVerifier, RerankOptions
from demind.mllm.config import DESCRIBE_PROMPT_ROOT
from demind.retrieval import ImageRef, Query
from helpers import REPO_ROOT, TINY_CLIP
from test_search_mllm import ScriptedEngine, index_dir, loaded, searcher_with  # noqa: F401  (module fixtures)
from test_search import one_torch_thread, write_image  # noqa: F401

TEXT = "make it look like winter"


# ----------------------------------------------------------------------------- a small world

def write_png(path: Path, seed: int = 0, change_pixel: bool = False, compress: int = 6) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    if change_pixel:
        pixels[0, 0] = 255 - pixels[0, 0]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, compress_level=compress)
    return path


def write_model(folder: Path, weights: bytes = b"w" * 64) -> Path:
    """A model folder as the key reads it: config, tokenizer files and weights (no engine loads it here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llava_next"}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text("documentation is not part of the content")
    return folder


def query(qid: str, image: Path, text: str = TEXT) -> Query:
    return Query(qid, ImageRef(image.name, image), f"a photo of * , {text}", text)


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = write_model(root / "models" / "llava")
        self.image = write_png(root / "images" / "ref.png")
        self.candidate = write_png(root / "images" / "cand.png", seed=1)
        self.store = root / "store"
        self.prompts = "v1"
        self.benchmark = ("cirr", "val")
        self.describe: dict = {}
        self.rerank: dict = {}
        self.queries = [query("q1", self.image)]
        self.candidates = [[ImageRef(self.candidate.name, self.candidate)]]

    def setup(self, engine=None, factory=None) -> MLLMSetup:
        engine = engine or ScriptedEngine({TEXT: "a snowy street"})
        return MLLMSetup(factory or (lambda: engine), model=str(self.model), engine_name="scripted",
                         describe=DescribeOptions(prompts=self.prompts, store=str(self.store), **self.describe),
                         rerank=RerankOptions(k=1, **self.rerank))

    def describe_requests(self, factory=None) -> int:
        """Requests the model got to describe the world's queries (0: all answered by the store)."""
        engine = ScriptedEngine({TEXT: "a snowy street"})
        self.setup(engine, factory).bind(*self.benchmark, None).describer("osrcir").describe(self.queries)
        return engine.requests

    def scored_pairs(self, monkeypatch) -> int:
        """(query, candidate) pairs the verifier had to score (0: all answered by the store)."""
        scored = []

        def score_query(verifier, q, cands):
            scored.extend(cands)
            return [float(len(scored))] * len(cands)

        monkeypatch.setattr(MLLMVerifier, "_score_query", score_query)
        self.setup().bind(*self.benchmark, None).reranker().verifier.score(self.queries, self.candidates)
        return len(scored)


def copy_prompts(target: Path, edit: str | None = None) -> str:
    shutil.copytree(DESCRIBE_PROMPT_ROOT / "v1", target)
    if edit:
        path = target / edit
        path.write_text(path.read_text() + "\nBe brief.")
    return str(target)


# each change alone: (what, change, asked again?)
DESCRIBE_CHANGES = [
    ("model weights content", lambda w: (w.model / "model.safetensors").write_bytes(b"v" * 64), True),
    ("reference pixels", lambda w: write_png(w.image, change_pixel=True), True),
    ("modification text", lambda w: setattr(w, "queries", [query("q1", w.image, TEXT + " at night")]), True),
    ("prompt text (same version name)", lambda w: setattr(w, "prompts", copy_prompts(w.root / "p" / "v1", "osrcir.txt")),
     True),
    ("generation setting", lambda w: w.describe.update(max_tokens=100), True),
    ("model folder name (label)", lambda w: setattr(w, "model", Path(shutil.move(w.model, w.root / "models" / "other"))),
     False),
    ("model documentation (not content)", lambda w: (w.model / "README.md").write_text("edited"), False),
    ("query id (label)", lambda w: setattr(w, "queries", [query("another-id", w.image)]), False),
    ("benchmark and split (labels)", lambda w: setattr(w, "benchmark", ("search", "my-index")), False),
    ("image file name and bytes, same pixels (labels)",
     lambda w: setattr(w, "queries", [query("q1", write_png(w.root / "elsewhere" / "renamed.png", compress=1))]), False),
    ("prompt folder name, same texts (label)", lambda w: setattr(w, "prompts", copy_prompts(w.root / "p" / "v7")), False),
    ("the other kind's prompt file", lambda w: setattr(w, "prompts", copy_prompts(w.root / "p" / "v1", "verify.txt")),
     False),
    ("store folder moved (label)", lambda w: setattr(w, "store", Path(shutil.move(w.store, w.root / "moved"))), False),
]


@pytest.mark.parametrize("what, change, asked_again", DESCRIBE_CHANGES, ids=[c[0] for c in DESCRIBE_CHANGES])
def test_each_key_ingredient_asks_again_and_each_label_reuses(tmp_path, what, change, asked_again):
    world = World(tmp_path)
    assert world.describe_requests() == 1
    assert world.describe_requests() == 0  # the same content: the store answers
    change(world)
    assert world.describe_requests() == (1 if asked_again else 0), what


VERIFY_CHANGES = [
    ("candidate pixels", lambda w: write_png(w.candidate, seed=1, change_pixel=True), True),
    ("reference pixels", lambda w: write_png(w.image, change_pixel=True), True),
    ("modification text", lambda w: setattr(w, "queries", [query("q1", w.image, "make it red")]), True),
    ("model weights content", lambda w: (w.model / "model.safetensors").write_bytes(b"v" * 64), True),
    ("verify prompt text", lambda w: setattr(w, "prompts", copy_prompts(w.root / "p" / "v1", "verify.txt")), True),
    ("answer words (settings)", lambda w: w.rerank.update(yes="dog", no="cat"), True),
    ("candidate file name (label)", lambda w: setattr(w, "candidates", [[ImageRef(
        "renamed.png", shutil.copy(w.candidate, w.root / "renamed.png"))]]), False),
    ("query id (label)", lambda w: setattr(w, "queries", [query("another-id", w.image)]), False),
    ("index name (label)", lambda w: setattr(w, "benchmark", ("search", "idx2")), False),
    ("a describer's prompt file", lambda w: setattr(w, "prompts", copy_prompts(w.root / "p" / "v1", "osrcir.txt")),
     False),
]


@pytest.mark.parametrize("what, change, asked_again", VERIFY_CHANGES, ids=[c[0] for c in VERIFY_CHANGES])
def test_each_verifier_key_ingredient_scores_again_and_each_label_reuses(tmp_path, monkeypatch, what, change,
                                                                        asked_again):
    world = World(tmp_path)
    assert world.scored_pairs(monkeypatch) == 1
    assert world.scored_pairs(monkeypatch) == 0
    change(world)
    assert world.scored_pairs(monkeypatch) == (1 if asked_again else 0), what


def test_a_large_file_is_hashed_once_then_remembered_by_size_and_mtime(tmp_path, monkeypatch):
    import demind.identity as identity

    world = World(tmp_path)
    world.describe_requests()
    hashed = []
    real = identity.file_sha256
    monkeypatch.setattr(identity, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    identity._FILE_HASHES.clear()
    assert world.describe_requests() == 0 and hashed == []  # a new process: the memo answers
    (world.model / "model.safetensors").write_bytes(b"v" * 64)  # same size, new mtime and content
    assert world.describe_requests() == 1 and hashed == ["model.safetensors"]


def replace_keeping_mtime(path: Path, write) -> None:
    """``write(path)`` new content of the same size, then the old modification time put back
    (what ``touch -r``, ``cp -p`` and ``rsync -t`` leave)."""
    stat = path.stat()
    size = stat.st_size
    write(path)
    assert path.stat().st_size == size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def replace_by_another_file(path: Path, data: bytes) -> None:
    """A new file (another inode) renamed over ``path``, with the old modification time."""
    stat = path.stat()
    other = path.with_name(path.name + ".new")
    other.write_bytes(data)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, path)


SAME_SIZE_SAME_MTIME = [
    ("model weights rewritten in place", lambda w: replace_keeping_mtime(
        w.model / "model.safetensors", lambda p: p.write_bytes(b"v" * 64))),
    ("model weights replaced by another file", lambda w: replace_by_another_file(
        w.model / "model.safetensors", b"v" * 64)),
    ("reference image edited", lambda w: replace_keeping_mtime(
        w.image, lambda p: write_png(p, change_pixel=True, compress=0))),
]


@pytest.mark.parametrize("what, change", SAME_SIZE_SAME_MTIME, ids=[c[0] for c in SAME_SIZE_SAME_MTIME])
def test_a_file_replaced_with_its_size_and_mtime_kept_is_read_again(tmp_path, what, change):
    import demind.identity as identity

    world = World(tmp_path)
    world.image = write_png(world.image, compress=0)  # stored pixels: an edited pixel keeps the size
    world.queries = [query("q1", world.image)]
    assert world.describe_requests() == 1
    identity._FILE_HASHES.clear()  # a new process
    assert world.describe_requests() == 0
    change(world)
    identity._FILE_HASHES.clear()
    assert world.describe_requests() == 1, what  # before: answered from the old content


def test_digests_of_the_older_rule_are_not_used_and_said_once(tmp_path, caplog):
    import demind.identity as identity
    from demind.mllm import DigestMemo

    world = World(tmp_path)
    assert world.describe_requests() == 1
    memo = world.store / "digests.jsonl"
    current = memo.read_text().splitlines()
    assert current and all(json.loads(line)["format"] == "demind-digests/2" for line in current)
    older = [json.dumps({"memo": json.loads(line)["memo"][::-1], "sha256": "0" * 64}) for line in current]
    memo.write_text("\n".join(older) + "\n")  # lines written before the rule held ctime and inode
    identity._FILE_HASHES.clear()
    with caplog.at_level(logging.INFO, logger="demind.mllm.digest_memo"):
        loaded = DigestMemo(memo)
        digest = loaded.file(world.model / "model.safetensors")
        loaded.save()
    assert digest != "0" * 64
    said = [r.getMessage() for r in caplog.records if "older rule" in r.getMessage()]
    assert len(said) == 1 and f"{len(older)} digests" in said[0] and str(memo) in said[0]
    assert all(json.loads(line).get("format") == "demind-digests/2" for line in memo.read_text().splitlines())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="demind.mllm.digest_memo"):
        DigestMemo(memo)
    assert not [r for r in caplog.records if "older rule" in r.getMessage()]  # said once: the memo was rewritten


def test_demind_rehash_reads_every_file_again(tmp_path, monkeypatch):
    import demind.identity as identity
    import demind.mllm.digest_memo as digest_memo
    from demind.cli import common
    from demind.mllm import DigestMemo

    without_ctime = lambda stat: f"{stat.st_size}-{stat.st_mtime_ns}"  # noqa: E731 -- FAT, some network mounts
    monkeypatch.setattr(digest_memo, "file_version", without_ctime)
    monkeypatch.setattr(identity, "file_version", without_ctime)
    monkeypatch.setattr(DigestMemo, "trusted", True)
    world = World(tmp_path)
    assert world.describe_requests() == 1
    replace_keeping_mtime(world.model / "model.safetensors", lambda p: p.write_bytes(b"v" * 64))
    identity._FILE_HASHES.clear()
    assert world.describe_requests() == 0  # such a file system cannot tell: what the docs say remains
    monkeypatch.setenv("DEMIND_REHASH", "1")
    common.apply_rehash_request()
    assert DigestMemo.trusted is False
    identity._FILE_HASHES.clear()
    assert world.describe_requests() == 1


# ----------------------------------------------------------------------------- the store's own methods

def test_image_digest_is_the_pixels_digest_and_save_digests_remembers_it(tmp_path, monkeypatch):
    from demind.mllm import AnswerStore, pixel_digest

    image = write_png(tmp_path / "images" / "ref.png")
    expected = pixel_digest(Image.open(image).convert("RGB"))
    (tmp_path / "store").mkdir()  # as MLLMSetup.bind leaves it (check_store_root)
    store = AnswerStore(tmp_path / "store", "osrcir")
    assert store.image_digest(ImageRef("ref.png", image)) == expected
    copy = write_png(tmp_path / "elsewhere" / "copy.png", compress=1)  # other bytes, the same pixels
    assert store.image_digest(ImageRef("copy.png", copy)) == expected
    changed = write_png(tmp_path / "images" / "changed.png", change_pixel=True)
    assert store.image_digest(ImageRef("changed.png", changed)) != expected
    memo = tmp_path / "store" / "digests.jsonl"
    assert not memo.exists()  # computed, not yet saved
    store.save_digests()
    lines = [json.loads(line) for line in memo.read_text().splitlines()]
    assert len(lines) == 3 and {line["format"] for line in lines} == {"demind-digests/2"}
    assert sorted(line["sha256"] for line in lines).count(expected) == 2
    store.save_digests()
    assert len(memo.read_text().splitlines()) == 3  # nothing new: nothing appended
    monkeypatch.setattr("demind.retrieval.load_image", lambda ref: pytest.fail(f"{ref.path} was decoded again"))
    assert AnswerStore(tmp_path / "store", "verify").image_digest(ImageRef("ref.png", image)) == expected


def test_rekey_from_model_loads_only_without_weights_and_keys_by_the_files_that_arrive(tmp_path):
    from demind.mllm import AnswerStore, DigestMemo, ModelIdentity
    from demind.mllm.digest_memo import text_digest

    loads = []
    present = write_model(tmp_path / "models" / "here")
    store = AnswerStore(None, "osrcir", ModelIdentity(str(present), DigestMemo(), None))
    assert store.rekey_from_model(lambda: loads.append("here")) is False and loads == []
    assert store.model.source == "weights"

    arriving = tmp_path / "models" / "downloaded"  # the files come with the model, as a download does
    store = AnswerStore(None, "osrcir", ModelIdentity(str(arriving), DigestMemo(), None))
    before = store.key(image="i", text="t")
    assert store.model.current() == f"name:{arriving}"
    assert store.rekey_from_model(lambda: loads.append(write_model(arriving))) is True and loads == [arriving]
    files = ["config.json", "model.safetensors", "tokenizer_config.json"]  # README.md is documentation
    expected = text_digest(*[f"{name}\0{text_digest_of(arriving / name)}" for name in files])
    assert (store.model.current(), store.model.source) == (expected, "weights")
    assert store.key(image="i", text="t") != before


def text_digest_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_given_identity_keys_without_files_and_survives_loading(tmp_path, caplog):
    from demind.mllm import AnswerStore, DigestMemo, ModelIdentity

    identity = ModelIdentity("toy", DigestMemo(), tmp_path / "store")
    identity.given("toy-a")
    store = AnswerStore(None, "osrcir", identity)
    with caplog.at_level(logging.WARNING, logger="demind.mllm"):
        assert store.rekey_from_model(lambda: None) is True
    assert (identity.current(), identity.source) == ("given:toy-a", "given")
    assert not caplog.records  # no "keyed by this name" warning: the caller said what the answers depend on
    other = ModelIdentity("toy", DigestMemo(), None)
    other.given("toy-b")
    assert AnswerStore(None, "osrcir", other).key(image="i") != store.key(image="i")


# ----------------------------------------------------------------------------- the weights absent

def test_a_store_copied_to_a_machine_without_the_model_answers_and_names_the_stored_identity(tmp_path, caplog):
    world = World(tmp_path)
    assert world.describe_requests() == 1
    setup = world.setup()
    first = setup.bind("cirr", "val", None)
    first.describer("osrcir").describe(world.queries)
    identity = first.summary()["model_identity"]
    assert first.summary()["model_identity_source"] == "weights" and len(identity) == 64

    def no_model():
        raise AssertionError("the model was loaded although every answer is stored")

    # "another machine": the store copied elsewhere, the model's folder absent (the same path, then another
    # path with the same folder name)
    moved = Path(shutil.copytree(world.store, tmp_path / "machine-b" / "store"))
    shutil.rmtree(world.model)
    for model in (world.model, tmp_path / "machine-b" / "models" / "llava"):
        world.store, world.model = moved, model
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="demind.mllm"):
            run = world.setup(factory=no_model).bind("cirr", "val", None)
            run.describer("osrcir").describe(world.queries)
        assert run.summary()["model_identity"] == identity and run.summary()["model_identity_source"] == "store"
        assert run.summary()["model_loaded"] is False
        lines = [r.getMessage() for r in caplog.records if "no model files on this machine" in r.getMessage()]
        assert len(lines) == 1 and identity[:16] in lines[0]
    # a query no one answered still needs the model: it is loaded (and here it cannot be)
    world.queries = [query("q2", world.image, "make it red")]
    with pytest.raises(AssertionError, match="the model was loaded"):
        world.describe_requests(factory=no_model)


def test_a_model_without_files_is_keyed_by_its_name_with_a_warning(tmp_path, caplog):
    world = World(tmp_path)
    world.model = Path("scripted-model")  # neither a folder nor in the Hugging Face cache, even after loading
    with caplog.at_level(logging.WARNING, logger="demind.mllm"):
        assert world.describe_requests() == 1
    assert any("keyed by this name" in r.getMessage() for r in caplog.records)
    assert world.describe_requests() == 0


# ----------------------------------------------------------------------------- two writers, damage

def test_two_processes_sharing_a_store_keep_both_their_answers(tmp_path):
    world = World(tmp_path)
    other = write_png(tmp_path / "images" / "other.png", seed=3)
    engines = [ScriptedEngine({TEXT: "a snowy street"}), ScriptedEngine({TEXT: "a snowy field"})]
    # both open the store before either writes (demind-serve and demind-search on one index)
    describers = [world.setup(e).bind("search", "idx", None).describer("osrcir") for e in engines]
    describers[0].describe([query("a", world.image)])
    describers[1].describe([query("b", other)])
    parts = list(world.store.rglob("part-*.json"))
    assert len(parts) == 2 and len({p.name for p in parts}) == 2
    world.queries = [query("a", world.image), query("b", other)]
    assert world.describe_requests() == 0  # a third process finds both


def damage_first_part(world: World, edit) -> Path:
    (part,) = world.store.rglob("part-*.json")
    data = json.loads(part.read_text())
    part.write_text(edit(data))
    return part


@pytest.mark.parametrize("case, edit, asked", [
    ("a record null", lambda d: json.dumps({**d, "records": {k: None for k in d["records"]}}), 1),
    ("a record without its description", lambda d: json.dumps(
        {**d, "records": {k: {"raw": "x"} for k in d["records"]}}), 1),
    ("records a list", lambda d: json.dumps({**d, "records": list(d["records"].values())}), 1),
    ("not JSON", lambda d: json.dumps(d)[:40], 1),
    ("a JSON list", lambda d: "[1, 2]", 1),
])
def test_a_damaged_part_or_record_is_asked_again_counted_and_logged(tmp_path, caplog, case, edit, asked):
    world = World(tmp_path)
    world.describe_requests()
    part = damage_first_part(world, edit)
    engine = ScriptedEngine({TEXT: "a snowy street"})
    with caplog.at_level(logging.WARNING, logger="demind.mllm"):
        run = world.setup(engine).bind("cirr", "val", None)
        describer = run.describer("osrcir")
        assert describer.describe(world.queries) == [["a snowy street"]]
    assert engine.requests == asked and describer.summary()["damaged"] == 1
    assert [r.getMessage() for r in caplog.records if part.name in r.getMessage()], case
    assert world.describe_requests() == 0  # the answer written again is found by the next run


def test_a_stray_copy_of_a_part_is_read_not_a_traceback(tmp_path):
    world = World(tmp_path)
    world.describe_requests()
    (part,) = world.store.rglob("part-*.json")
    shutil.copy(part, part.with_name("part-00000 copy.json"))
    assert world.describe_requests() == 0


@pytest.mark.parametrize("content", ["[1, 2]", '{"format": "something-else/9"}', "{broken"])
def test_a_foreign_store_json_is_one_error_naming_it(tmp_path, content):
    from demind.errors import InputError

    world = World(tmp_path)
    world.describe_requests()
    (world.store / "store.json").write_text(content)
    with pytest.raises(InputError, match=re.escape(str(world.store / "store.json"))) as e:
        world.describe_requests()
    assert "\n" not in str(e.value) and "delete" in str(e.value)


# ----------------------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def toy_cirr(tmp_path_factory) -> Path:
    from toyworld.benchmarks import ToyBenchmarkConfig
    from toyworld.cirr import write_cirr

    root = tmp_path_factory.mktemp("toycirr") / "cirr"
    write_cirr(root, ToyBenchmarkConfig(cirr_sets=4), progress=False)
    return root


def scripted_engines(monkeypatch) -> list:
    """demind.engines.build_engine replaced by a scripted engine; the list records each build."""
    import demind.engines as engines

    built: list = []

    def build_engine(cfg, sampling, device=None, seed=0):
        built.append(cfg.model)
        return ScriptedEngine({})

    monkeypatch.setattr(engines, "build_engine", build_engine)
    return built


def eval_argv(root: Path, out: Path, *extra: str, benchmark: str = "cirr") -> list[str]:
    return ["--benchmark", benchmark, "--data-root", str(root), "--backbone", f"{TINY_CLIP}:none", "--out", str(out),
            "--num-workers", "0", "--methods", "osrcir", "run.progress=false", "engine.name=transformers",
            "engine.model=scripted-model", *extra]


def one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_changed_captions_are_described_again(toy_cirr, tmp_path, monkeypatch):
    from demind.cli.evaluate import main

    built = scripted_engines(monkeypatch)
    out = tmp_path / "out"
    assert main(eval_argv(toy_cirr, out)) == 0
    first = json.loads((out / "results.json").read_text())["mllm"]["describers"]["osrcir"]
    assert first["generated_now"] == first["records"] > 0 and len(built) == 1
    assert main(eval_argv(toy_cirr, out)) == 0
    assert json.loads((out / "results.json").read_text())["mllm"]["describers"]["osrcir"]["generated_now"] == 0
    changed = Path(shutil.copytree(toy_cirr, tmp_path / "cirr-changed"))
    captions = changed / "captions" / "cap.rc2.val.json"
    captions.write_text(json.dumps([{**c, "caption": c["caption"] + " at night"}
                                    for c in json.loads(captions.read_text())]))
    assert main(eval_argv(changed, out)) == 0
    again = json.loads((out / "results.json").read_text())["mllm"]["describers"]["osrcir"]
    assert again["generated_now"] == first["records"]


def test_fashioniq_caption_order_is_part_of_the_key(tmp_path, monkeypatch):
    from demind.cli.evaluate import main
    from test_eval_benchmarks import make_fashioniq

    scripted_engines(monkeypatch)
    root = make_fashioniq(tmp_path / "fiq")
    out = tmp_path / "out"
    assert main(eval_argv(root, out, benchmark="fashioniq")) == 0
    first = json.loads((out / "results.json").read_text())["mllm"]["describers"]["osrcir"]
    for path in (root / "captions").glob("cap.*.val.json"):
        path.write_text(json.dumps([{**e, "captions": e["captions"][::-1]} for e in json.loads(path.read_text())]))
    assert main(eval_argv(root, out, benchmark="fashioniq")) == 0
    again = json.loads((out / "results.json").read_text())["mllm"]["describers"]["osrcir"]
    assert first["generated_now"] > 0 and again["generated_now"] == first["generated_now"]


def test_an_unwritable_store_is_refused_before_any_model_loads_in_demind_eval(toy_cirr, tmp_path, monkeypatch,
                                                                            capsys):
    from demind.cli.evaluate import main

    built = scripted_engines(monkeypatch)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    assert main(eval_argv(toy_cirr, tmp_path / "out", f"describe.store={a_file / 'store'}")) == 2
    line = one_error(capsys)
    assert "describe.store" in line and "a-file" in line and built == []


def test_an_unwritable_store_is_refused_before_any_model_loads_in_demind_search(index_dir, tiny_checkpoint,  # noqa: F811
                                                                              tmp_path, monkeypatch, capsys):
    from demind.cli.search import main

    built = scripted_engines(monkeypatch)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    reference = str(index_dir.parent / "gallery" / "img3.png")
    assert main(["--index", str(index_dir), "--checkpoint", str(tiny_checkpoint), "run.progress=false",
                 "--image", reference, "--text", TEXT, "--method", "osrcir", "engine.name=transformers",
                 "engine.model=scripted-model", f"describe.store={a_file / 'store'}"]) == 2
    line = one_error(capsys)
    assert "describe.store" in line and "a-file" in line and built == []


def test_a_copied_index_finds_its_stored_descriptions(loaded, index_dir, tmp_path):  # noqa: F811
    from demind.search.index import load_index
    from demind.search.query import Searcher, SearchQuery

    loads: list = []

    def setup():
        def factory():
            loads.append(1)
            return ScriptedEngine({TEXT: "a snowy street"})
        return MLLMSetup(factory, model="scripted-model", engine_name="scripted")

    reference = str(index_dir.parent / "gallery" / "img3.png")
    asked = SearchQuery(image=reference, text=TEXT, method="osrcir", k=3)
    first = searcher_with(loaded, index_dir, setup()).search_with_details(asked)
    assert loads == [1] and first.description == "a snowy street"
    copy = Path(shutil.copytree(index_dir, tmp_path / "idx2"))
    searcher = Searcher(loaded[0], loaded[1], load_index(copy), mllm=setup())
    assert searcher.search_with_details(asked).description == "a snowy street" and loads == [1]


# ----------------------------------------------------------------------------- re-ranking words
# (the tiny LLaVA's words: no "yes", no "no")

@pytest.mark.parametrize("extra, names", [
    (["rerank.k=2"], "rerank.yes='yes'"),
    (["rerank.k=2", "rerank.yes=dog", "rerank.no=cat", "rerank.methods=,"], "rerank.methods"),
    (["rerank.k=2", "rerank.yes=", "rerank.no=cat"], "rerank.yes"),
])
def test_rerank_words_that_cannot_work_are_refused_before_any_description(toy_cirr, tiny_llava, tmp_path,
                                                                          monkeypatch, capsys, extra, names):
    from demind.cli.evaluate import main
    from demind.engines.transformers_engine import TransformersEngine

    def no_model(*args, **kwargs):
        raise AssertionError("the MLLM was loaded before the re-ranking words were checked")

    monkeypatch.setattr(TransformersEngine, "__init__", no_model)
    argv = eval_argv(toy_cirr, tmp_path / "out", f"engine.model={tiny_llava}", *extra)
    assert main(argv) == 2
    line = one_error(capsys)
    assert names in line
    assert not (tmp_path / "out" / "descriptions" / "osrcir").exists()


def test_rerank_words_are_checked_in_search_before_any_description(index_dir, tiny_checkpoint, tiny_llava,  # noqa: F811
                                                                  monkeypatch, capsys):
    from demind.cli.search import main
    from demind.engines.transformers_engine import TransformersEngine

    def no_model(*args, **kwargs):
        raise AssertionError("the MLLM was loaded before the re-ranking words were checked")

    monkeypatch.setattr(TransformersEngine, "__init__", no_model)
    reference = str(index_dir.parent / "gallery" / "img3.png")
    assert main(["--index", str(index_dir), "--checkpoint", str(tiny_checkpoint), "run.progress=false",
                 "--image", reference, "--text", TEXT, "--method", "osrcir+rerank", "engine.name=transformers",
                 f"engine.model={tiny_llava}", "rerank.k=2"]) == 2
    assert "rerank.yes='yes'" in one_error(capsys)


# ----------------------------------------------------------------------------- the docs

def documented_layout() -> list[str]:
    """The path patterns of docs/mllm.md's store layout block (first word of each line)."""
    text = (REPO_ROOT / "docs" / "mllm.md").read_text()
    block = text.split("<!-- docs-test: text — the store's layout", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def test_the_documented_store_layout_is_the_written_one(tmp_path, monkeypatch):
    world = World(tmp_path)
    world.describe_requests()
    world.scored_pairs(monkeypatch)
    engine = ScriptedEngine({})
    world.setup(engine).bind("cirr", "val", None).describer("cirevl").describe(world.queries)
    written = sorted(p.relative_to(world.store).as_posix() for p in world.store.rglob("*") if p.is_file())
    patterns = documented_layout()
    assert patterns and all(p.startswith("<store>/") for p in patterns)
    regexes = {p: re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(p[len("<store>/"):]).replace(r"\<", "<")
                                    .replace(r"\>", ">")) + "$") for p in patterns}
    for path in written:
        assert any(r.match(path) for r in regexes.values()), f"{path} is not in docs/mllm.md's layout"
    for pattern, regex in regexes.items():
        assert any(regex.match(path) for path in written), f"docs/mllm.md shows {pattern}, which the store lacks"
    kinds = {path.split("/")[0] for path in written if "/part-" in path}
    assert kinds == {"osrcir", "cirevl", "verify"}
    record = next(iter(json.loads(next((world.store / "osrcir").glob("part-*.json")).read_text())["records"].values()))
    assert {"qid", "sample", "reference", "modification", "raw", "finish_reason", "description", "status",
            "image_sha256", "model", "model_identity", "prompt_sha256", "settings"} <= set(record)
    models = [json.loads(p.read_text()) for p in (world.store / "models").glob("*.json")]
    assert [m["reference"] for m in models] == [world.model.name]
    # no path of this machine in what the store writes: a moved or copied store holds nothing that names it
    assert not [p for p in written if str(tmp_path) in (world.store / p).read_text(encoding="utf-8")]


def test_demind_eval_reruns_from_a_copied_store_without_the_model_on_the_machine(toy_cirr, tiny_llava, tmp_path,
                                                                                  caplog):
    """demind-eval with the tiny LLaVA-NeXT, then its store copied to "another machine" where the model's
    folder is absent: the rerun loads no model, needs none, and names the stored model identity it used."""
    from demind.cli.evaluate import main

    model = Path(shutil.copytree(tiny_llava, tmp_path / "llava"))
    llava = ["engine.dtype=float32", "engine.cpu_threads=1", "describe.max_tokens=6", "describe.image_max_side=32"]
    out = tmp_path / "machine-a"
    assert main(eval_argv(toy_cirr, out, f"engine.model={model}", *llava)) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["mllm"]["model_loaded"] is True and first["mllm"]["model_identity_source"] == "weights"
    store = Path(shutil.copytree(out / "descriptions", tmp_path / "machine-b" / "descriptions"))
    shutil.rmtree(model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="demind.mllm"):
        assert main(eval_argv(toy_cirr, tmp_path / "machine-b" / "out", f"engine.model={model}",
                              f"describe.store={store}", *llava)) == 0
    again = json.loads((tmp_path / "machine-b" / "out" / "results.json").read_text())
    assert again["mllm"]["model_loaded"] is False and again["mllm"]["model_identity_source"] == "store"
    assert again["mllm"]["model_identity"] == first["mllm"]["model_identity"]
    assert again["mllm"]["describers"]["osrcir"]["generated_now"] == 0
    assert again["methods"]["osrcir"] == first["methods"]["osrcir"]
    assert any(first["mllm"]["model_identity"][:16] in r.getMessage() and "no model files" in r.getMessage()
               for r in caplog.records)


def test_search_applies_rerank_methods_or_refuses_them_at_start(loaded, index_dir):  # noqa: F811
    from demind.config import ConfigError

    def setup(methods):
        return MLLMSetup(lambda: ScriptedEngine({}), model="scripted-model", engine_name="scripted",
                         rerank=RerankOptions(k=3, methods=methods))

    offered = searcher_with(loaded, index_dir, setup("osrcir,demind")).available_methods()
    assert sorted(m for m in offered if m.endswith("+rerank")) == ["demind+rerank", "osrcir+rerank"]
    everything = searcher_with(loaded, index_dir, setup(None)).available_methods()
    assert {"demind+rerank", "osrcir+rerank", "cirevl+rerank", "text-only+rerank"} <= set(everything)
    with pytest.raises(ConfigError, match=r"rerank.methods names \['exclmm'\]"):
        searcher_with(loaded, index_dir, setup("exclmm"))


def test_results_count_the_answers_this_run_used_not_the_whole_shared_store(tmp_path):
    world = World(tmp_path)
    world.describe_requests()  # another split's answer in the shared store
    other = query("q2", write_png(tmp_path / "images" / "two.png", seed=5), "make it red")
    run = world.setup().bind("cirr", "test1", None)
    describer = run.describer("osrcir")
    describer.describe([other, other])
    summary = describer.summary()
    assert (summary["records"], summary["stored"], summary["generated_now"]) == (1, 2, 1)
    assert summary["fallback"] == 1 and summary["fallback_reasons"] == {"no-label": 1}


def test_without_the_files_the_identity_the_reference_last_had_answers(tmp_path):
    world = World(tmp_path)
    identities = []
    for weights in (b"a" * 64, b"b" * 64, b"a" * 64):  # retrained, then the first weights put back
        (world.model / "model.safetensors").write_bytes(weights)
        run = world.setup().bind("cirr", "val", None)
        run.describer("osrcir").describe(world.queries)
        identities.append(run.summary()["model_identity"])
    assert identities[0] == identities[2] != identities[1]
    shutil.rmtree(world.model)
    run = world.setup(factory=lambda: pytest.fail("the model was loaded")).bind("cirr", "val", None)
    run.describer("osrcir").describe(world.queries)
    assert run.summary()["model_identity"] == identities[2] and run.summary()["model_identity_source"] == "store"


def test_an_engine_without_files_keys_by_the_identity_its_setup_states(tmp_path, caplog):
    world = World(tmp_path)
    engine = ScriptedEngine({})
    for name in ("toy-a", "toy-a", "toy-b"):
        with caplog.at_level(logging.WARNING, logger="demind.mllm"):
            run = MLLMSetup(lambda: engine, model="toy", engine_name="toy", content_identity=name,
                            describe=DescribeOptions(store=str(world.store))).bind("cirr", "val", None)
            run.describer("osrcir").describe(world.queries)
    assert engine.requests == 2 and run.summary()["model_identity_source"] == "given"
    assert not [r for r in caplog.records if "keyed by this name" in r.getMessage()]


def test_a_store_of_the_older_layout_is_not_read_and_says_so(tmp_path, caplog):
    world = World(tmp_path)
    old = world.store / "cirr-val" / "osrcir" / "v1@6e82bbb978e0" / "llava-1a2b3c4d5e"
    old.mkdir(parents=True)
    (old / "store.json").write_text('{"format": "demind-descriptions/1"}')
    (old / "part-00000.json").write_text('{"format": "demind-descriptions/1", "records": {"q1#0": {}}}')
    with caplog.at_level(logging.WARNING, logger="demind.mllm"):
        assert world.describe_requests() == 1
    assert [r for r in caplog.records if "older layout" in r.getMessage() and str(old) in r.getMessage()]
