"""demind-generate-triplets: pair shards -> triplet shards (MegaPairs-style), on the shared shard runner.

Pair shards are written by hand here (the layout of shards/README.md) over a two-shard corpus with one
corrupt image; the describer and writer are the tiny random Qwen2-VL (several images a prompt) that
both engines load (the vLLM run: tests/test_vllm.py)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from toyworld.synthetic import ScriptedEngine
from demind.gen.relation import load_triplet_prompts, parse_instructions, InstructionError
from demind.gen.triplet_config import TripletGenConfig
from demind.gen.triplet_generate import PairItem, TripletGenerator
from helpers import write_img2dataset_shards, write_input_shard


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    from demind.engines.tiny_qwen2vl import build_tiny_qwen2vl

    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


def write_pairs(folder: Path, corpus: Path, shards: dict[int, list[dict]]) -> Path:
    """Pair shards ``pairs-NNNNN.tar`` (one KEY.json per query) and the pairs manifest of ``corpus``."""
    from demind.pairs import corpus_record
    from demind.pairs.manifest import write_pairs_manifest

    folder.mkdir(parents=True, exist_ok=True)
    for shard_id, records in shards.items():
        write_input_shard(folder / f"pairs-{shard_id:05d}.tar",
                          [{"__key__": r["reference"], "json": json.dumps(r).encode()} for r in records])
        (folder / f"pairs-{shard_id:05d}_stats.json").write_text(json.dumps({"pairs": sum(len(r["targets"])
                                                                                          for r in records)}))
    write_pairs_manifest(folder, {"corpus": corpus_record(str(corpus)), "backbone": {"name": "tiny"}, "recipe": {}})
    return folder


def query(ref: str, targets: list[str], negatives: list[str]) -> dict:
    return {"reference": ref, "targets": [{"key": t, "signals": ["image"], "scores": {"image": 0.9}} for t in targets],
            "hard_negatives": negatives}


@pytest.fixture
def pairs(tmp_path) -> tuple[Path, Path, str]:
    corpus = tmp_path / "corpus"
    corrupt = write_img2dataset_shards(corpus)  # 000000000..000000003, 000010000..000010003; one corrupt
    folder = write_pairs(tmp_path / "pairs", corpus, {
        0: [query("000000000", ["000000001", "000010000"], ["000000002", "000000003"]),
            query("000000001", ["000000002"], ["000000000"])],
        1: [query("000010000", ["000010001", corrupt], ["000010003"]),
            query("000010001", ["000010003", "nokey"], [])]})
    return corpus, folder, corrupt


def argv(repo_root: Path, model: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    return ["--pairs", str(folder), "--output", str(out), "--config",
            str(repo_root / "configs/data_gen/triplets-tiny-cpu.yaml"), "run.progress=false", f"engine.model={model}",
            *extra]


def read_triplets(out: Path) -> dict[str, dict]:
    records = {}
    for tar in sorted(out.glob("triplets-*.tar")):
        with tarfile.open(tar) as t:
            for m in t:
                records[m.name.removesuffix(".json")] = json.loads(t.extractfile(m).read())
    return records


def test_pair_shards_become_triplet_shards_and_a_rerun_skips_them(repo_root, tiny_qwen, pairs, tmp_path, capsys):
    from demind.cli.generate_triplets import main

    corpus, folder, corrupt = pairs
    out = tmp_path / "triplets"
    assert main(argv(repo_root, tiny_qwen, folder, out)) == 0
    records = read_triplets(out)
    # 7 pairs: the corrupt image's pair and the unknown key's are counted skips, the rest are triplets
    assert sorted(records) == ["000000000_000000001", "000000000_000010000", "000000001_000000002",
                               "000010000_000010001", "000010001_000010003"]
    r = records["000000000_000000001"]
    assert r["reference"] == "000000000" and r["target"] == "000000001"
    assert len(r["instructions"]) == 3 and len(set(r["instructions"])) == 3 and all(r["instructions"])
    assert r["hard_negatives"] == ["000000002", "000000003"] and r["signals"] == ["image"]
    assert r["scores"] == {"image": 0.9} and r["description"]
    assert r["captions"]["target"] == "a red dog 0 1 on the street"
    gen = r["generation"]
    assert gen["describer"]["model"] == str(tiny_qwen) and gen["writer"]["model"] == str(tiny_qwen)
    assert set(gen["prompt_sha"]) == {"describe.txt", "instruct.txt", "instruct_one.txt", "examples.json"}
    assert gen["calls"]["describe"] >= 1 and gen["calls"]["instruct"] >= 3
    stats = json.loads((out / "triplets-00001_stats.json").read_text())
    assert stats["pairs_in"] == 4 and stats["written"] == 2
    assert stats["skipped"] == {"unreadable image": 1, "missing image": 1}
    assert {s["key"] for s in stats["skipped_samples"]} == {f"000010000_{corrupt}", "000010001_nokey"}
    assert stats["per_pair"]["calls"] >= 4 and stats["tokens"]["describe"]["prompt"] > 0
    manifest = json.loads((out / "triplets_manifest.json").read_text())
    assert manifest["corpus"]["digest"] and manifest["describer"]["model"] == str(tiny_qwen)
    # a rerun skips both finished shards and writes the same triplets
    capsys.readouterr()
    assert main(argv(repo_root, tiny_qwen, folder, out)) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert read_triplets(out) == records


def test_the_triplets_do_not_depend_on_chunking(repo_root, tiny_qwen, pairs, tmp_path):
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(argv(repo_root, tiny_qwen, folder, a, "--shard", "0")) == 0
    assert main(argv(repo_root, tiny_qwen, folder, b, "--shard", "0", "engine.chunk_size=1", "engine.batch_size=1")) == 0
    assert read_triplets(a) == read_triplets(b)


def test_dry_run_prints_the_plan_and_loads_nothing(repo_root, pairs, tmp_path, capsys):
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    assert main(argv(repo_root, tmp_path / "no-model", folder, tmp_path / "out", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "triplet plan" in out and "to do           :      2" in out and "dry run" in out
    assert not (tmp_path / "out" / "triplets_manifest.json").exists()


def test_pairs_of_another_corpus_are_refused_naming_both(repo_root, tiny_qwen, pairs, tmp_path, capsys):
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    other = tmp_path / "other"
    write_input_shard(other.mkdir() or other / "00000.tar", [])
    assert main(argv(repo_root, tiny_qwen, folder, tmp_path / "out", "--corpus", str(other))) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(tmp_path / "corpus") in err and str(other) in err and "Traceback" not in err


def test_a_prompt_over_max_model_len_is_one_line_before_the_engine_starts(repo_root, tiny_qwen, pairs, tmp_path,
                                                                         capsys, monkeypatch):
    import demind.engines as engines
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    monkeypatch.setattr(engines, "build_engine", lambda *a, **k: pytest.fail("the engine must not start"))
    assert main(argv(repo_root, tiny_qwen, folder, tmp_path / "out", "engine.max_model_len=40")) == 2
    err = capsys.readouterr().err
    assert "error: engine.max_model_len=40 is below what the describer's prompt needs" in err
    assert "Traceback" not in err


def test_a_changed_recipe_is_refused_then_overwrite_redoes_every_shard(repo_root, tiny_qwen, pairs, tmp_path, capsys):
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    out = tmp_path / "out"
    assert main(argv(repo_root, tiny_qwen, folder, out, "--shard", "0")) == 0
    first = read_triplets(out)
    assert main(argv(repo_root, tiny_qwen, folder, out, "--shard", "1", "sampling.temperature=0.5")) == 2
    err = capsys.readouterr().err
    assert "another recipe: sampling.temperature (0.7 -> 0.5)" in err and "--overwrite" in err
    # a setting that does not change the triplets is not a new recipe
    assert main(argv(repo_root, tiny_qwen, folder, out, "--shard", "1", "engine.batch_size=2")) == 0
    assert main(argv(repo_root, tiny_qwen, folder, out, "sampling.temperature=0.5", "--overwrite")) == 0
    assert read_triplets(out)["000000000_000000001"] != first["000000000_000000001"]


def test_a_run_that_stopped_before_its_first_shard_takes_a_new_recipe(repo_root, tiny_qwen, pairs, tmp_path,
                                                                      monkeypatch):
    """The manifest is written before the engine loads; a run whose engine did not start wrote no shard,
    so the rerun with another setting is not refused as another recipe."""
    import demind.engines as engines
    from demind.cli.generate_triplets import main
    from demind.errors import DemindError

    _, folder, _ = pairs
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(engines, "build_engine", lambda *a, **k: (_ for _ in ()).throw(DemindError("no GPU memory left")))
        assert main(argv(repo_root, tiny_qwen, folder, out, "sampling.temperature=0.5")) == 2
    assert (out / "triplets_manifest.json").exists()
    assert main(argv(repo_root, tiny_qwen, folder, out, "--shard", "0")) == 0
    assert json.loads((out / "triplets_manifest.json").read_text())["recipe"]["sampling"]["temperature"] == 0.7


def test_a_describer_that_renders_one_image_a_prompt_is_refused(repo_root, pairs, tmp_path, capsys):
    """A model whose chat template puts one image in a prompt cannot describe a pair: refused before any shard."""
    from demind.cli.generate_triplets import main
    from demind.engines.tiny_llava import build_tiny_llava_next

    one_image = ("{% for message in messages %}USER: <image> {% for item in message['content'] %}"
                 "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endfor %}ASSISTANT:")
    model = build_tiny_llava_next(tmp_path / "one-image", chat_template=one_image)
    _, folder, _ = pairs
    out = tmp_path / "out"
    assert main(argv(repo_root, model, folder, out, "io.image_max_side=32")) == 2
    err = capsys.readouterr().err
    assert "puts 1 image(s) in a prompt that holds 2" in err and "Traceback" not in err
    assert not list(out.glob("triplets-*"))


def test_a_killed_run_leaves_no_half_shard_and_the_rerun_completes(repo_root, tiny_qwen, pairs, tmp_path, monkeypatch):
    from demind.cli.generate_triplets import main
    from demind.gen import triplet_generate

    _, folder, _ = pairs
    out = tmp_path / "out"
    real = triplet_generate.TripletGenerator.generate
    calls = []

    def dies_in_shard_1(self, items):
        calls.append(items[0].key)
        if items[0].key.startswith("000010000"):
            raise KeyboardInterrupt  # what a kill looks like to the shard writer
        return real(self, items)

    monkeypatch.setattr(triplet_generate.TripletGenerator, "generate", dies_in_shard_1)
    with pytest.raises(KeyboardInterrupt):
        main(argv(repo_root, tiny_qwen, folder, out, "engine.chunk_size=1"))
    assert (out / "triplets-00000_stats.json").exists()
    assert not (out / "triplets-00001.tar").exists() and not (out / "triplets-00001_stats.json").exists()
    monkeypatch.setattr(triplet_generate.TripletGenerator, "generate", real)
    assert main(argv(repo_root, tiny_qwen, folder, out)) == 0
    assert (out / "triplets-00001_stats.json").exists()


# ---------------------------------------------------------------- the two stages, scripted


def scripted_items(n: int):
    from PIL import Image

    return [PairItem(f"k{i}", Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8)), f"cap {i}", f"tgt {i}")
            for i in range(n)]


def scripted_cfg(**instructions) -> TripletGenConfig:
    cfg = TripletGenConfig()
    cfg.instructions.mode = "json"
    for k, v in instructions.items():
        setattr(cfg.instructions, k, v)
    return cfg


GOOD = json.dumps({"instructions": ["make it red please", "turn it at night", "add a second dog"]})


def test_an_unparsable_answer_is_retried_then_counted():
    """Mode json on an engine without structured output: an answer that is not the structure gets a
    new seed; after sampling.retries the pair fails with the reason, the others go on."""
    asked: dict[str, int] = {}

    def answer(request):
        if request.image is not None:  # the describer: both images in one request
            assert len(request.images) == 2
            return "Both images show a dog. However, the source image is day, whereas the target image is night."
        assert request.json_schema["properties"]["instructions"]["minItems"] == 3
        key = "k0" if "cap 0" in request.prompt else "?"
        asked[request.prompt] = asked.get(request.prompt, 0) + 1
        return "Sure, here: " + GOOD if asked[request.prompt] >= 2 else "not json at all"

    engine = ScriptedEngine(answer)
    gen = TripletGenerator(engine, engine, load_triplet_prompts("v1"), scripted_cfg())
    outs = gen.generate(scripted_items(2))
    assert [o.error for o in outs] == [None, None]
    assert outs[0].instructions == ["make it red please", "turn it at night", "add a second dog"]
    assert outs[0].instruction_attempts == 2 and outs[0].usage.calls == {"describe": 1, "instruct": 2}

    never = ScriptedEngine(lambda r: "Both images ... However ..." if r.image is not None else '{"instructions": ["make it red"]}')
    outs = TripletGenerator(never, never, load_triplet_prompts("v1"), scripted_cfg()).generate(scripted_items(1))
    assert outs[0].error == "unparsable instructions (1 valid instruction(s) of the 3 asked)"
    assert outs[0].usage.calls["instruct"] == 3  # one try and sampling.retries (2) more


def test_the_instruction_structure_is_validated():
    assert parse_instructions('x {"instructions": ["a b", "c d", "e f", "g h"]} y', 3, 300, 2) == ["a b", "c d", "e f"]
    for bad, why in [("[1, 2]", "0 valid"), ('{"other": 1}', "no 'instructions'"), ("{oops", "no JSON"),
                     ('{"instructions": ["a b", "A B", "c d"]}', "2 valid")]:
        with pytest.raises(InstructionError, match=why):
            parse_instructions(bad, 3, 300, 2)


def test_intent_job_prompt_over_max_model_len_is_one_line_before_the_engine_starts(repo_root, tiny_llava, tmp_path,
                                                                                  capsys, monkeypatch):
    """demind-generate engine.max_model_len below what a prompt needs: one line naming the key before any
    engine starts (vLLM refused it only when the prompts arrived, after its minute-long start)."""
    import demind.engines as engines
    from demind.cli.generate import main
    from helpers import write_img2dataset_shards

    inputs = tmp_path / "in"
    write_img2dataset_shards(inputs)
    monkeypatch.setattr(engines, "build_engine", lambda *a, **k: pytest.fail("the engine must not start"))
    argv_ = ["--input", str(inputs), "--output", str(tmp_path / "out"), "--config",
             str(repo_root / "configs/data_gen/tiny-cpu.yaml"), f"engine.model={tiny_llava}", "engine.max_model_len=40"]
    for engine in ("transformers", "vllm"):
        assert main(argv_ + [f"engine.name={engine}"]) == 2
        err = capsys.readouterr().err
        assert "error: engine.max_model_len=40 is below what the intent stage's prompt" in err
        assert "Traceback" not in err


def test_vllm_requests_carry_both_images_and_the_schema_as_structured_output():
    """What the vLLM engine hands vLLM for a pair (tested without vLLM): the images in placeholder order,
    and the writer's JSON schema as the structured-output parameter this vLLM offers."""
    from types import SimpleNamespace

    from PIL import Image

    from demind.engines import GenRequest, SamplingConfig
    from demind.engines.vllm_engine import build_vllm_requests, structured_output_params

    a, b = Image.new("RGB", (4, 4)), Image.new("RGB", (5, 5))
    schema = {"type": "object"}
    prompts, params = build_vllm_requests([GenRequest("p", a, 1, 8, more_images=(b,)), GenRequest("q", a, 2, 8),
                                           GenRequest("w", None, 3, 8, json_schema=schema)], SamplingConfig())
    assert prompts[0]["multi_modal_data"]["image"] == [a, b] and prompts[1]["multi_modal_data"]["image"] is a
    assert prompts[2] == {"prompt": "w"} and params[2]["json_schema"] is schema and "json_schema" not in params[0]

    class Params:  # vLLM >= 0.11 / earlier / none
        def __init__(self, json):
            self.json = json

    assert structured_output_params(SimpleNamespace(StructuredOutputsParams=Params), schema)["structured_outputs"].json \
        is schema
    assert structured_output_params(SimpleNamespace(GuidedDecodingParams=Params), schema)["guided_decoding"].json \
        is schema
    assert structured_output_params(SimpleNamespace(), schema) == {}


@pytest.mark.slow  # a Ray cluster and a worker's engine: about 1.5 min on 2 CPUs
def test_the_triplet_job_on_a_ray_worker_writes_what_a_local_run_writes(repo_root, tiny_qwen, pairs, tmp_path):
    """--distributor ray runs the same job (TripletShardJob.load in each worker) through the shared runner:
    the triplets are those of a local run, and the summary counts pairs/s over the workers."""
    ray = pytest.importorskip("ray", reason="needs Ray: pip install -e '.[distributed]'")
    from demind.cli.generate_triplets import main

    _, folder, _ = pairs
    assert main(argv(repo_root, tiny_qwen, folder, tmp_path / "local")) == 0
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(argv(repo_root, tiny_qwen, folder, tmp_path / "ray", "--distributor", "ray", "--workers", "1")) == 0
    finally:
        ray.shutdown()
    assert read_triplets(tmp_path / "ray") == read_triplets(tmp_path / "local")
    assert sorted(p.name for p in (tmp_path / "ray").glob("*_stats.json")) == ["triplets-00000_stats.json",
                                                                              "triplets-00001_stats.json"]


def test_the_writer_may_be_a_text_only_llm(repo_root, tiny_qwen, pairs, tmp_path):
    """writer.model: another model, a text-only LLM (MegaPairs writes instructions with one): loaded by
    the engine as a causal LM with its tokenizer, its prompts rendered with string contents."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from demind.cli.generate_triplets import main
    from demind.engines.tiny_llava import word_level_tokenizer

    tokenizer = word_level_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | trim }} {% endfor %}"
                               "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    vocab = tokenizer.get_vocab()
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=2048,
                                       bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"]))
    llm.save_pretrained(tmp_path / "llm")
    tokenizer.save_pretrained(tmp_path / "llm")
    _, folder, _ = pairs
    out = tmp_path / "out"
    assert main(argv(repo_root, tiny_qwen, folder, out, "--shard", "0", f"writer.model={tmp_path / 'llm'}")) == 0
    records = read_triplets(out)
    assert len(records) == 3 and all(len(r["instructions"]) == 3 for r in records.values())
    gen = next(iter(records.values()))["generation"]
    assert gen["describer"]["model"] == str(tiny_qwen) and gen["writer"]["model"] == str(tmp_path / "llm")
    manifest = json.loads((out / "triplets_manifest.json").read_text())
    assert manifest["writer"]["model"] == str(tmp_path / "llm")


def test_make_tiny_model_writes_the_qwen2vl_in_the_hubs_layout(tmp_path):
    """demind-make-tiny-model --family qwen2-vl: a Qwen2-VL folder with the Hub's weight names (model.layers.*,
    visual.*, lm_head.*), which the transformers engine loads and whose chat template holds two images."""
    from safetensors import safe_open

    from demind.cli.make_tiny_model import main
    from demind.engines import EngineConfig, SamplingConfig, render, user_turn
    from demind.engines.transformers_engine import TransformersEngine

    out = tmp_path / "tiny-qwen2-vl"
    assert main(["--family", "qwen2-vl", "--output", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_vl"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        roots = {k.split(".")[0] for k in f.keys()}
    assert roots == {"model", "visual", "lm_head"}
    engine = TransformersEngine(EngineConfig(name="transformers", model=str(out), prefix_cache=False), SamplingConfig(),
                                device="cpu")
    assert render(engine.renderer, [user_turn("x", with_image=2)]).count("<|image_pad|>") == 2


def test_greedy_decoding_is_not_retried():
    """sampling.temperature=0: a retry would get the same text, so a failing answer costs one call."""
    never = ScriptedEngine(lambda r: "Both images ... However ..." if r.image is not None else "no json")
    cfg = scripted_cfg()
    cfg.sampling.temperature = 0.0
    outs = TripletGenerator(never, never, load_triplet_prompts("v1"), cfg).generate(scripted_items(1))
    assert outs[0].error.startswith("unparsable instructions") and outs[0].usage.calls["instruct"] == 1
