"""Intent-data generation job, end to end on CPU with a tiny random LLaVA-NeXT.

The real generation command (``demind.cli.generate.main``, behind ``data_gen/run.py``) runs over input shards written here; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from demind.cli.generate import main as generate_main
from demind.errors import DemindError
from demind.cli.make_shards import main as make_shards_main
from demind.gen.config import GenConfig
from demind.engines.base import GenRequest, GenResult, request_seed
from demind.engines.transformers_engine import SeededRowSampler
from demind.engines.vllm_engine import build_vllm_requests, results_from_outputs
from demind.gen.generate import ChunkItem, IntentGenerator
from demind.engines import render
from demind.gen.prompts import intent_conversation, load_prompts, rewrite_conversation
from demind.gen.quality import clean_output, max_ngram_count, quality_flags
from demind.gen.plan import ShardSpecError, parse_shard_range
from demind.gen.reader import RawSample, SkippedSample, decode_and_shrink, iter_shard
from helpers import jpeg_bytes, make_sample, shard_writer_killed_at, write_img2dataset_shards, write_input_shard

CORRUPT_KEY = "000010002"


@pytest.fixture(autouse=True, scope="module")
def restore_torch_threads():
    """The tiny-cpu config sets torch to one thread; give other test modules their default back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def run_main(repo_root):
    return generate_main


@pytest.fixture
def input_shards(tmp_path) -> Path:
    """Two img2dataset-style shards: 00000.tar (4 samples), 00001.tar (4 samples, one corrupt image)."""
    root = tmp_path / "in"
    assert write_img2dataset_shards(root) == CORRUPT_KEY
    return root


def base_argv(repo_root: Path, tiny: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return ["--input", str(inp), "--output", str(out), "--config", str(repo_root / "configs/data_gen/tiny-cpu.yaml"),
            "run.progress=false", f"engine.model={tiny}", "sampling.rewrite_max_tokens=12", "sampling.intent_max_tokens=8",
            *extra]


def read_output(path: Path) -> list[dict]:
    return list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))


def texts_by_key(out_dir: Path) -> dict[str, tuple[bytes, bytes]]:
    return {s["__key__"]: (s["rew.txt"], s["int.txt"]) for tar in sorted(out_dir.glob("*.tar")) for s in read_output(tar)}


# ---------------------------------------------------------------- end to end


def test_two_shards_become_intent_shards(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json"]
    printed = capsys.readouterr().out
    assert "to do           :      2  (0-1)" in printed
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert "prefill/img  hit %" in printed and len(rows) == 2 and all(row[-2] == "100" for row in rows)

    for shard in range(2):
        inputs = {s["__key__"]: s for s in read_output(input_shards / f"0000{shard}.tar")}
        samples = read_output(out / f"0000{shard}.tar")
        stats = json.loads((out / f"0000{shard}_stats.json").read_text())
        expected_keys = sorted(k for k in inputs if k != CORRUPT_KEY)
        assert sorted(s["__key__"] for s in samples) == expected_keys
        recount_flags = 0
        for s in samples:
            src = inputs[s["__key__"]]
            assert set(s) - {"__key__", "__url__", "__local_path__"} == {"jpg", "txt", "rew.txt", "int.txt", "json"}
            assert s["jpg"] == src["jpg"]  # image bytes unchanged
            assert s["txt"] == src["txt"]
            rewritten, intent = s["rew.txt"].decode(), s["int.txt"].decode()
            assert rewritten == rewritten.strip() and intent == intent.strip() and "\n" not in rewritten
            meta = json.loads(s["json"])
            assert {k: meta[k] for k in json.loads(src["json"])} == json.loads(src["json"])  # input metadata kept
            gen = meta["generation"]
            assert gen["model"] == str(tiny_llava) and gen["engine"] == "transformers"
            assert gen["prompt_version"] == "v1" and gen["mode"] == "cot"
            assert gen["sampling"]["intent_max_tokens"] == 8
            for stage in ("rewrite", "intent"):
                rec = gen[stage]
                assert rec["finish_reason"] in ("stop", "length")
                assert 1 <= rec["attempts"] <= 2 and rec["prompt_tokens"] > 0
                assert rec["seed"] in [request_seed(0, s["__key__"], stage, a) for a in range(rec["attempts"])]
                assert ("truncated" in rec["flags"]) == (rec["finish_reason"] == "length")
            assert gen["flags"] == [f"{st}:{f}" for st in ("rewrite", "intent") for f in gen[st]["flags"]]
            assert max(gen["image_size_seen"]) <= 64  # io.image_max_side of tiny-cpu.yaml
            recount_flags += bool(gen["flags"])

        assert stats["samples_in"] == 4 and stats["written"] == len(expected_keys)
        assert stats["samples_flagged"] == recount_flags
        # every stage-2 request (retries too) found stage 1's prefix in the store; what it served is not prefilled
        eng = stats["engine_tokens"]
        gens = [json.loads(s["json"])["generation"] for s in samples]
        assert eng["stage2_requests"] == sum(g["intent"]["attempts"] for g in gens) == eng["stage2_hits"]
        assert eng["stage2_hit_rate"] == 1.0 and 0 < eng["cached"] < eng["prompt"]
        assert eng["prefilled_per_sample"] == round(eng["prefilled"] / stats["written"], 1)
        assert stats["text_tokens"]["intent"]["count"] == len(expected_keys)
        if shard == 1:
            assert stats["skipped"] == {"undecodable image": 1}
            assert stats["skipped_samples"][0]["key"] == CORRUPT_KEY
        else:
            assert stats["skipped"] == {}


def test_rerun_skips_done_shards_and_text_is_seeded_per_key(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    out = tmp_path / "out"
    argv = base_argv(repo_root, tiny_llava, input_shards, out)
    assert run_main(argv) == 0
    first = texts_by_key(out)
    stats_before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*_stats.json")}
    capsys.readouterr()

    assert run_main(argv) == 0  # same command again: nothing redone
    assert "already done    :      2  (0-1)" in capsys.readouterr().out
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*_stats.json")} == stats_before

    assert run_main(argv + ["--overwrite"]) == 0  # forced redo: identical text, key by key
    assert texts_by_key(out) == first

    # batch mates do not change a key's text: one request per generate() call gives the same outputs
    single = tmp_path / "single"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, single, "engine.batch_size=1")) == 0
    assert texts_by_key(single) == first

    # another base seed gives other text
    other = tmp_path / "other"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, other, "run.seed=1")) == 0
    assert texts_by_key(other) != first


def test_kill_mid_shard_then_rerun_resumes(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    out = tmp_path / "out"
    argv = base_argv(repo_root, tiny_llava, input_shards, out, "engine.chunk_size=1")
    # the process "dies" after one sample of the second shard has been written (its writer kept to the end)
    with shard_writer_killed_at("00001.tar", written=1) as killed_writers, pytest.raises(KeyboardInterrupt):
        run_main(argv)
    assert (out / "00000_stats.json").is_file()
    assert (out / "00001.tar.tmp").is_file()  # the partial shard exists only under its tmp name
    assert not (out / "00001.tar").exists() and not (out / "00001_stats.json").exists()
    done_stats = (out / "00000_stats.json").read_bytes()
    done_mtime = (out / "00000.tar").stat().st_mtime_ns

    capsys.readouterr()
    assert run_main(argv) == 0
    printed = capsys.readouterr().out
    assert "already done    :      1  (0)" in printed and "to redo         :      1  (1)" in printed
    assert (out / "00000_stats.json").read_bytes() == done_stats  # finished shard not redone
    assert (out / "00000.tar").stat().st_mtime_ns == done_mtime
    assert not list(out.glob("*.tmp"))
    keys = [s["__key__"] for tar in sorted(out.glob("*.tar")) for s in read_output(tar)]
    assert len(keys) == len(set(keys)) == 7  # 8 inputs, one corrupt image
    assert json.loads((out / "00001_stats.json").read_text())["written"] == 3


def test_shard_option_picks_a_range_and_reports_missing(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "--shard", "1-5")) == 0
    printed = capsys.readouterr().out
    assert "not in input    :      4  (2-5)" in printed
    assert sorted(p.name for p in out.glob("*.tar")) == ["00001.tar"]
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "--shard", "7-9")) == 2
    assert "none of the requested shards" in capsys.readouterr().err


def test_unreadable_input_shard_fails_alone(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    data = (input_shards / "00001.tar").read_bytes()
    (input_shards / "00001.tar").write_bytes(data[:700])  # truncated mid-member
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out)) == 1
    printed = capsys.readouterr().out
    assert "shard 1 FAILED" in printed and "00001.tar is not a readable tar" in printed
    assert (out / "00000_stats.json").is_file()
    assert not (out / "00001_stats.json").exists()  # so the next run retries it


def test_bad_config_and_missing_vllm_are_clear_errors(repo_root, tiny_llava, run_main, input_shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "sampling.temprature=0.1")) == 2
    err = capsys.readouterr().err
    assert "sampling.temprature" in err and "temperature" in err
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "engine.name=tensorrt")) == 2
    assert "'engine.name' = 'tensorrt' must be one of" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:
        assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "engine.name=vllm")) == 2
        assert "pip install 'demind[vllm]'" in capsys.readouterr().err
    assert not out.exists() or not list(out.glob("*.tar"))


def test_single_prompt_mode(repo_root, tiny_llava, run_main, input_shards, tmp_path):
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out, "prompts.mode=single", "--shard", "0")) == 0
    for s in read_output(out / "00000.tar"):
        gen = json.loads(s["json"])["generation"]
        assert s["rew.txt"] == b"" and gen["rewrite"] is None and gen["mode"] == "single"
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["text_tokens"]["rewrite"]["count"] == 0 and stats["text_tokens"]["intent"]["count"] == 4


def test_make_shards_then_read(repo_root, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(5):
        (images / f"{i}.jpg").write_bytes(jpeg_bytes(i, (20, 16)))
    (images / "broken.png").write_bytes(b"not a png")
    csv_path = tmp_path / "captions.csv"
    csv_path.write_text("image,caption,source\n0.jpg,a cat,web\n1.jpg,,web\nnope.jpg,a bus,web\n"
                        "2.jpg,\"a dog, black\",web\nbroken.png,a fish,web\n3.jpg,a tree,web\n4.jpg,a car,web\n")
    make_shards = make_shards_main
    out = tmp_path / "shards"
    assert make_shards(["--images", str(images), "--captions", str(csv_path), "--output", str(out),
                        "--samples-per-shard", "2"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 4 samples into 2 shard(s)" in printed
    assert "line 3: missing caption" in printed and "line 4: missing image" in printed and "line 6: unreadable image" in printed
    samples = [s for tar in sorted(out.glob("*.tar")) for s in iter_shard(tar)]
    assert all(isinstance(s, RawSample) for s in samples)
    assert [s.key for s in samples] == ["000000", "000001", "000010", "000011"]  # img2dataset keys: shard id + index
    assert [s.caption for s in samples] == ["a cat", "a dog, black", "a tree", "a car"]
    assert samples[1].meta["source"] == "web" and samples[1].meta["image_path"] == "2.jpg"
    assert samples[0].image_bytes == (images / "0.jpg").read_bytes()
    assert json.loads((out / "00000_stats.json").read_text())["successes"] == 2

    jsonl = tmp_path / "captions.jsonl"
    jsonl.write_text('{"image": "0.jpg", "caption": "a cat"}\n{broken\n{"caption": "no image field"}\n')
    out2 = tmp_path / "shards2"
    assert make_shards(["--images", str(images), "--captions", str(jsonl), "--output", str(out2)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 1 samples" in printed and "line 2: malformed json line" in printed and "line 3: malformed json line" in printed
    assert make_shards(["--images", str(images), "--captions", str(csv_path), "--output", str(tmp_path / "out3"),
                        "--caption-column", "text"]) == 2
    assert "no column(s) ['text']" in capsys.readouterr().err


# ---------------------------------------------------------------- units


@pytest.mark.parametrize("spec, expected", [
    ("0-99", ((0, 99),)),
    ("0-9,20-29", ((0, 9), (20, 29))),
    ("7", ((7, 7),)),
    ("3, 1-2 ,2", ((1, 3),)),
])
def test_parse_shard_range(spec, expected):
    assert parse_shard_range(spec).ranges == expected


@pytest.mark.parametrize("spec", ["", "a-b", "5-2", "1-", "-3", "1..3", "0-9;20"])
def test_parse_shard_range_rejects_bad_input(spec):
    with pytest.raises(ShardSpecError, match="--shard"):
        parse_shard_range(spec)


def test_prompt_rendering_with_chat_template(tiny_llava):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_llava)
    prompts = load_prompts("v1")
    caption = "a {weird} caption"  # braces must pass through literally
    stage1 = render(processor, rewrite_conversation(prompts, caption))
    rewrite_text = prompts.rewrite.replace("{caption}", caption)
    assert stage1 == f"USER: <image> {rewrite_text} ASSISTANT:"
    assert '"a {weird} caption"' in stage1
    stage2 = render(processor, intent_conversation(prompts, caption, "a red dog"))
    assert stage2 == f"USER: <image> {rewrite_text} ASSISTANT: a red dog </s> USER: {prompts.intent} ASSISTANT:"
    assert stage2.count("<image>") == 1  # the image is sent once, in the first turn

    no_template = SimpleNamespace(chat_template=None, apply_chat_template=None)
    with pytest.raises(DemindError, match="no chat template"):
        render(no_template, rewrite_conversation(prompts, caption))
    with pytest.raises(FileNotFoundError, match="available versions"):
        load_prompts("v999")


def test_vllm_request_building_without_vllm():
    images = [Image.new("RGB", (8, 6)), Image.new("RGB", (5, 5))]
    requests = [GenRequest(prompt=f"USER: <image> p{i} ASSISTANT:", image=img, seed=100 + i, max_new_tokens=32)
                for i, img in enumerate(images)]
    cfg = GenConfig().sampling
    prompts, params = build_vllm_requests(requests, cfg)
    assert prompts == [{"prompt": "USER: <image> p0 ASSISTANT:", "multi_modal_data": {"image": images[0]}},
                       {"prompt": "USER: <image> p1 ASSISTANT:", "multi_modal_data": {"image": images[1]}}]
    assert prompts[1]["multi_modal_data"]["image"] is images[1]
    assert params == [{"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": 32, "seed": 100 + i,
                       "skip_special_tokens": True} for i in range(2)]

    outputs = [SimpleNamespace(prompt_token_ids=[1] * 50,
                               outputs=[SimpleNamespace(text=" a dog", finish_reason="stop", token_ids=[5, 6, 2])]),
               SimpleNamespace(prompt_token_ids=[1] * 40,
                               outputs=[SimpleNamespace(text="x y", finish_reason="length", token_ids=[7] * 32)])]
    # a vLLM that does not report num_cached_tokens: prefilled in full, and said so (no hit rate is made up)
    assert results_from_outputs(outputs) == [GenResult(" a dog", "stop", 50, 3, cache_reported=False),
                                             GenResult("x y", "length", 40, 32, cache_reported=False)]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_engine_without_vllm_says_how_to_install():
    from demind.engines import build_engine

    cfg = GenConfig()
    with pytest.raises(ImportError, match=r"pip install 'demind\[vllm\]'"):
        build_engine(cfg.engine, cfg.sampling)


@pytest.mark.gpu
def test_vllm_engine_runs_the_job(repo_root, tiny_llava, run_main, input_shards, tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    argv = base_argv(repo_root, tiny_llava, input_shards, out, "engine.name=vllm", "engine.dtype=float32",
                     "engine.max_model_len=512", "engine.gpu_memory_utilization=0.3", "engine.enforce_eager=true")
    assert run_main(argv) == 0
    assert sorted(s["__key__"] for s in read_output(out / "00001.tar")) == ["000010000", "000010001", "000010003"]
    first = texts_by_key(out)
    assert run_main(argv + ["--overwrite"]) == 0
    assert texts_by_key(out) == first  # per-request seeds on vLLM too


def test_seeded_row_sampler_is_independent_of_batch_mates():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    sampler = SeededRowSampler([11, 22, 33], temperature=1.0, top_p=0.95, suppress_ids=[4])
    alone = SeededRowSampler([22], temperature=1.0, top_p=0.95, suppress_ids=[4])
    draws_batched = [sampler.choose(logits)[1].item() for _ in range(20)]
    draws_alone = [alone.choose(logits[1:2])[0].item() for _ in range(20)]
    assert draws_batched == draws_alone
    assert len(set(draws_batched)) > 1  # it does sample
    # forced logits: greedy search must pick exactly the drawn token
    forced = SeededRowSampler([1, 2, 3], 1.0, 1.0, []).__call__(None, logits)
    assert (torch.isfinite(forced).sum(dim=1) == 1).all()
    # temperature 0 = argmax; a suppressed id is never produced; tiny top_p keeps only the top token
    spiked = logits.clone()
    spiked[:, 4] = 100.0
    assert SeededRowSampler([1, 2, 3], 0.0, 1.0, []).choose(spiked).tolist() == [4, 4, 4]
    assert 4 not in SeededRowSampler([1, 2, 3], 0.0, 1.0, [4]).choose(spiked).tolist()
    assert SeededRowSampler([1, 2, 3], 1.0, 1e-6, [4]).choose(spiked).tolist() == logits.argmax(1).tolist()


def test_clean_output():
    assert clean_output('Rewritten caption: "A red car on a street."') == "A red car on a street."
    assert clean_output("**Instruction:** make the dog black") == "make the dog black"
    assert clean_output("Sure! Here is the rewritten caption:\n The image shows a cat  on a mat.") == "A cat on a mat."
    assert clean_output("In this image, two dogs play.") == "Two dogs play."
    assert clean_output("“Change the sky to night.”") == "Change the sky to night."
    assert clean_output("A caption that is fine.") == "A caption that is fine."


def test_quality_flags():
    assert quality_flags("", "stop") == ["empty"]
    assert quality_flags(" ... ", "stop") == ["empty"]
    assert quality_flags("I'm sorry, but I cannot help with that.", "stop") == ["refusal"]
    assert quality_flags("As an AI language model I see a dog.", "stop") == ["refusal"]
    assert quality_flags("a red dog a red dog a red dog", "stop") == ["repetition"]
    assert max_ngram_count("a red dog a red dog a red dog", 3) == 3
    assert quality_flags("a red dog on a red mat", "stop") == []
    assert quality_flags("a dog on a beach at", "length") == ["truncated"]


class ScriptedEngine:
    """Returns preset texts per (key, stage, attempt), via the seed of each request."""

    name = "scripted"
    model_id = "scripted"

    def __init__(self, renderer, script: dict[tuple[str, str, int], str]):
        self.renderer = renderer
        self.by_seed = {request_seed(0, k, st, a): text for (k, st, a), text in script.items()}
        self.calls = []

    def generate(self, requests):
        self.calls.append(len(requests))
        return [GenResult(self.by_seed[r.seed], "stop", 10, 5) for r in requests]

    def count_tokens(self, texts):
        return [len(t.split()) for t in texts]


def test_flagged_output_is_retried_once_with_a_new_seed_then_kept_with_flag(tiny_llava):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_llava)
    script = {
        ("k1", "rewrite", 0): "A red dog.", ("k1", "intent", 0): "make it red",
        ("k2", "rewrite", 0): "I'm sorry, I cannot.", ("k2", "rewrite", 1): "A blue car.",
        ("k2", "intent", 0): "make it blue",
        ("k3", "rewrite", 0): "A tree.", ("k3", "intent", 0): "", ("k3", "intent", 1): "go go go go go go",
    }
    engine = ScriptedEngine(processor, script)
    cfg = GenConfig()
    gen = IntentGenerator(engine, cfg, load_prompts("v1"))
    items = [ChunkItem(k, "a caption", Image.new("RGB", (4, 4))) for k in ("k1", "k2", "k3")]
    out = gen.generate(items)
    assert [o.rewrite.text for o in out] == ["A red dog.", "A blue car.", "A tree."]
    assert out[1].rewrite.attempts == 2 and out[1].rewrite.flags == [] and out[1].rewrite.first_flags == ["refusal"]
    assert out[1].rewrite.seed == request_seed(0, "k2", "rewrite", 1)
    # k3: both attempts flagged ("empty", then "repetition"): kept after one retry, with the retry's flag
    assert out[2].intent.attempts == 2 and out[2].intent.flags == ["repetition"]
    assert out[2].intent.first_flags == ["empty"] and out[2].intent.text == "go go go go go go"
    assert engine.calls == [3, 1, 3, 1]  # stage calls batched; retries only for flagged samples

    greedy = GenConfig()
    greedy.sampling.temperature = 0.0  # a new seed cannot change greedy text: no retry
    engine.calls.clear()
    out = IntentGenerator(engine, greedy, load_prompts("v1")).generate(items)
    assert engine.calls == [3, 3] and out[1].rewrite.flags == ["refusal"] and out[1].rewrite.attempts == 1


def test_reader_reports_every_bad_sample(tmp_path):
    good = make_sample("00000001", 1, "a dog")
    no_caption = make_sample("00000002", 2, "x")
    del no_caption["txt"]
    bad_json = make_sample("00000003", 3, "a cat")
    bad_json["json"] = b"{not json"
    long_caption = make_sample("00000004", 4, "word " * 500)
    no_image = make_sample("00000005", 5, "a bus")
    del no_image["jpg"]
    duplicate = make_sample("00000001", 6, "again")
    path = tmp_path / "00000.tar"
    write_input_shard(path, [good, no_caption, bad_json, long_caption, no_image, duplicate])
    items = list(iter_shard(path, max_caption_chars=1000))
    assert isinstance(items[0], RawSample) and items[0].caption == "a dog" and items[0].meta["key"] == "00000001"
    assert [(i.key, i.reason) for i in items[1:]] == [
        ("00000002", "missing caption"), ("00000003", "malformed json"), ("00000004", "caption too long"),
        ("00000005", "missing image"), ("00000001", "duplicate key")]
    assert all(isinstance(i, SkippedSample) for i in items[1:])


def test_decode_and_shrink_shrinks_longest_side_only():
    img = decode_and_shrink(jpeg_bytes(0, (100, 40)), max_side=50)
    assert img.size == (50, 20) and img.mode == "RGB"
    assert decode_and_shrink(jpeg_bytes(0, (30, 20)), max_side=50).size == (30, 20)  # never enlarged
    with pytest.raises(ValueError, match="^UnidentifiedImageError: cannot identify image file$"):
        decode_and_shrink(b"garbage", 50)  # the reason, without the BytesIO repr (the category is the caller's)


def test_prefetched_yields_in_order_reraises_and_stops_early():
    from demind.gen.job import prefetched

    assert list(prefetched(iter(range(10)), depth=2)) == list(range(10))
    assert list(prefetched(iter(range(3)), depth=0)) == [0, 1, 2]

    def failing():
        yield 1
        raise ValueError("bad shard")

    got = []
    with pytest.raises(ValueError, match="bad shard"):
        for item in prefetched(failing(), depth=1):
            got.append(item)
    assert got == [1]

    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    for item in prefetched(endless(), depth=1):
        if item == 2:
            break
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count <= 5  # the producer stopped with the consumer


def test_plan_states_from_files_on_disk(tmp_path):
    from demind.gen.plan import format_plan, make_plan

    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    out.mkdir()
    for i in range(5):
        write_input_shard(inp / f"{i:05d}.tar", [make_sample(f"{i:05d}0000", i, "a cat")])
    (out / "00000.tar").write_bytes(b"x")
    (out / "00000_stats.json").write_text("{}")  # done
    (out / "00001.tar.tmp").write_bytes(b"x")  # killed while writing the tar
    (out / "00002.tar").write_bytes(b"x")  # killed between the tar rename and the stats file
    plan = make_plan(str(inp), out, None, overwrite=False)
    assert [(t.shard_id, t.state) for t in plan.tasks] == [(0, "done"), (1, "redo"), (2, "redo"), (3, "new"), (4, "new")]
    assert [t.shard_id for t in plan.todo] == [1, 2, 3, 4]
    assert "already done    :      1  (0)" in format_plan(plan)
    assert [t.state for t in make_plan(str(inp), out, "0-1", overwrite=True).tasks] == ["redo", "redo"]
    brace = make_plan(str(inp / "{00003..00004}.tar"), out, None, overwrite=False)  # brace pattern input
    assert [t.shard_id for t in brace.tasks] == [3, 4]
    # a shard the pattern names but the disk lacks is an error, as for the trainer
    with pytest.raises(ShardSpecError, match=r"2 of 4 shards from --input=.* do not exist, e\.g\. .*00005\.tar"):
        make_plan(str(inp / "{00003..00006}.tar"), out, None, overwrite=False)
    with pytest.raises(ShardSpecError, match="no number"):
        (inp / "extra.tar").write_bytes(b"")
        make_plan(str(inp), out, None, overwrite=False)


# ---------------------------------------------------------------- reliability


def test_finding3_duplicate_key_is_skipped_and_the_job_goes_on(repo_root, tiny_llava, run_main, tmp_path, capsys):
    """Members a1.jpg a1.txt a1.jpg a1.txt a2.jpg a2.txt: the second a1 is skipped and counted,
    the shard finishes, the good shard after it too; and run.progress=false hides the weight-loading bar."""
    inp = tmp_path / "in"
    inp.mkdir()
    with tarfile.open(inp / "00000.tar", "w") as tar:
        for name, data in [("a1.jpg", jpeg_bytes(1, (40, 30))), ("a1.txt", b"a red dog"),
                           ("a1.jpg", jpeg_bytes(2, (40, 30))), ("a1.txt", b"a blue dog"),
                           ("a2.jpg", jpeg_bytes(3, (40, 30))), ("a2.txt", b"a green dog")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    write_input_shard(inp / "00001.tar", [make_sample("00001000", 5, "a cat on a mat")])
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, inp, out)) == 0
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["samples_in"] == 3 and stats["written"] == 2 and stats["skipped"] == {"duplicate key": 1}
    assert [s["__key__"] for s in read_output(out / "00000.tar")] == ["a1", "a2"]
    assert json.loads((out / "00001_stats.json").read_text())["written"] == 1
    assert "Loading weights" not in capsys.readouterr().err  # finding 8: run.progress=false hides it


def test_finding6_unwritable_output_fails_before_the_model_loads(repo_root, tiny_llava, run_main, input_shards,
                                                                   tmp_path, monkeypatch, capsys):
    import errno

    from demind.engines.transformers_engine import TransformersEngine

    def no_engine(*args, **kwargs):
        raise AssertionError("the model was loaded although the output cannot be written")

    real_write = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".demind-write-probe"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write(self, data)

    monkeypatch.setattr(TransformersEngine, "__init__", no_engine)
    monkeypatch.setattr(Path, "write_bytes", read_only)
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out)) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out}: read-only file system" in err and "Traceback" not in err


def test_finding6_disk_full_while_writing_is_one_line_naming_the_path(repo_root, tiny_llava, run_main, input_shards,
                                                                      tmp_path, monkeypatch, capsys):
    import errno

    from demind.gen import job

    def disk_full(self, sample):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(job.ShardWriter, "write", disk_full)
    out = tmp_path / "out"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, out)) == 2
    err = capsys.readouterr().err
    assert f"cannot write {out / '00000.tar'}: no space left on device" in err and "Traceback" not in err
    assert not (out / "00000_stats.json").exists()  # nothing marked done


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_stage_two_reuses_stage_one_prefix_with_the_same_text(tiny_llava, temperature):
    """Keeping stage 1's prompt KV (image + turn 1) prefills stage 2 only from the answer on:
    same texts as a full prefill, sampled and greedy, in batches with left padding of
    different images and captions, retries included; fewer prefilled tokens."""
    from demind.engines.transformers_engine import TransformersEngine

    rng = np.random.default_rng(0)
    sizes = [(40, 30), (30, 40), (64, 20), (20, 20), (50, 50), (33, 61), (64, 64)]
    items = [ChunkItem(f"k{i}", " ".join(rng.choice(["a", "red", "dog", "on", "the", "street", "tree"], 2 + 3 * i)),
                       Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
             for i, (w, h) in enumerate(sizes)]
    outs = {}
    for prefix_cache, budget in ((False, None), (True, None), ("full", 10 * 256)):
        cfg = GenConfig()
        cfg.engine.model, cfg.engine.dtype, cfg.engine.batch_size = str(tiny_llava), "float32", 3
        cfg.engine.prefix_cache, cfg.engine.cpu_threads = bool(prefix_cache), 1
        cfg.engine.prefix_store_bytes = budget or 0
        cfg.sampling.temperature = temperature
        cfg.sampling.rewrite_max_tokens, cfg.sampling.intent_max_tokens = 12, 8
        engine = TransformersEngine(cfg.engine, cfg.sampling, device="cpu")
        outs[prefix_cache] = IntentGenerator(engine, cfg, load_prompts("v1")).generate(items)
        if prefix_cache:
            assert len(engine.prefixes) == 0 and engine.prefixes.bytes == 0  # released at the end of the chunk
        if prefix_cache == "full":
            assert engine.prefixes.dropped > 0  # 10 tokens of KV (256 bytes each) hold no prompt
    full, reused, dropped = outs[False], outs[True], outs["full"]
    # Batches with a dropped prefix are prefilled in full: same text, more tokens than with room.
    assert [(o.rewrite.text, o.intent.text) for o in dropped] == [(o.rewrite.text, o.intent.text) for o in full]
    assert (sum(o.intent.prefilled_tokens for o in reused) < sum(o.intent.prefilled_tokens for o in dropped)
            <= sum(o.intent.prefilled_tokens for o in full))
    assert [(o.rewrite.text, o.intent.text) for o in reused] == [(o.rewrite.text, o.intent.text) for o in full]
    assert [o.intent.prompt_tokens for o in reused] == [o.intent.prompt_tokens for o in full]
    for a, b in zip(full, reused):
        assert b.rewrite.prefilled_tokens == a.rewrite.prefilled_tokens  # stage 1 is prefilled in full
        # stage 2 prefills only what follows stage 1's prompt, per attempt
        expected = b.intent.attempts * (b.intent.prompt_tokens - b.rewrite.prompt_tokens)
        assert a.intent.prefilled_tokens == a.intent.attempts * a.intent.prompt_tokens
        assert b.intent.prefilled_tokens == expected > 0
    if temperature > 0:
        assert len({o.intent.text for o in full}) > 1  # the texts really vary
        assert any(o.intent.attempts > 1 for o in full)  # retries of stage 2 reuse the prefix too


def test_vllm_engine_turns_on_prefix_caching_and_counts_cached_tokens(tiny_llava, monkeypatch):
    """Without vLLM installed: the engine asks for automatic prefix caching (engine.prefix_cache),
    reads its KV cache size (blocks x block size) for the prefix waves, refuses a vLLM older than
    0.8 with prefix caching on, and a result's prefilled tokens are its prompt tokens minus those
    vLLM served from the cache."""
    from types import SimpleNamespace

    from demind.engines import vllm_engine

    made = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            made.update(kwargs)
            cache_config = SimpleNamespace(num_gpu_blocks=2500, block_size=16)
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache_config))

    fake = SimpleNamespace(LLM=FakeLLM, SamplingParams=dict, __version__="0.11.0")
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake)
    for on in (True, False):
        cfg = GenConfig()
        cfg.engine.model, cfg.engine.prefix_cache = str(tiny_llava), on
        engine = vllm_engine.VLLMEngine(cfg.engine, cfg.sampling)
        assert made["enable_prefix_caching"] is on
        assert engine.prefix_capacity_tokens == (40_000 if on else None)
    fake.__version__ = "0.7.3"
    cfg.engine.prefix_cache = True
    with pytest.raises(DemindError, match=r"needs vLLM >= 0.8 .* found vLLM 0.7.3: pip install 'vllm>=0.8', or "
                                          r"engine.prefix_cache=false"):
        vllm_engine.VLLMEngine(cfg.engine, cfg.sampling)
    cfg.engine.prefix_cache = False
    vllm_engine.VLLMEngine(cfg.engine, cfg.sampling)  # without prefix caching an older vLLM is fine
    completion = SimpleNamespace(text="a dog", finish_reason="stop", token_ids=[5, 6])
    cached = SimpleNamespace(prompt_token_ids=list(range(100)), outputs=[completion], num_cached_tokens=96)
    uncached = SimpleNamespace(prompt_token_ids=list(range(100)), outputs=[completion], num_cached_tokens=0)
    first, second = vllm_engine.results_from_outputs([cached, uncached])
    assert (first.prompt_tokens, first.prefilled_tokens, first.cache_reported) == (100, 4, True)
    assert (second.prompt_tokens, second.prefilled_tokens, second.cache_reported) == (100, 100, True)


def test_fidelity_stage_scores_and_flags_every_output(repo_root, tiny_llava, run_main, input_shards, tmp_path):
    """quality.fidelity_clip: each sample's json gains GFQ fidelity of T_rew and T_int against its
    image (recomputed here from the same CLIP and pool), a score below omega is a counted flag,
    and nothing is dropped."""
    import torch
    import torch.nn.functional as F
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig
    from demind.fidelity import fidelity_from_similarity, noise_boundary, pair_similarity

    clip = str(repo_root / "configs/model/tiny-clip.json")
    out = tmp_path / "out"
    argv = base_argv(repo_root, tiny_llava, input_shards, out, f"quality.fidelity_clip={clip}",
                     "quality.fidelity_omega=0.5", "engine.chunk_size=2")
    assert run_main(argv) == 0
    plain = tmp_path / "plain"
    assert run_main(base_argv(repo_root, tiny_llava, input_shards, plain, "engine.chunk_size=2")) == 0
    assert texts_by_key(out) == texts_by_key(plain)  # the stage only reads

    backbone = FrozenCLIP(BackboneConfig(name=clip, pretrained=None))
    samples = read_output(out / "00000.tar")
    metas = [json.loads(s["json"])["generation"] for s in samples]
    assert len(samples) == 4 and all(set(m["fidelity"]) == {"rewrite", "intent"} for m in metas)
    # recompute the last chunk's scores: the pool is the whole 4-sample shard by then
    with torch.no_grad():
        images = []
        for s in samples:  # as the reader decodes them (io.image_max_side of tiny-cpu.yaml)
            images.append(backbone.preprocess(decode_and_shrink(s["jpg"], 64)))
        img_emb = F.normalize(backbone.encode_image(torch.stack(images)).float(), dim=-1)
        txt_emb = F.normalize(backbone.encode_text([s["int.txt"].decode() for s in samples]).pooled.float(), dim=-1)
    boundary = noise_boundary(img_emb, txt_emb, 4, torch.Generator().manual_seed(0 * 1_000_003 + 4))
    expected = fidelity_from_similarity(pair_similarity(img_emb[2:], txt_emb[2:]), boundary)
    got = torch.tensor([m["fidelity"]["intent"] for m in metas[2:]])
    assert torch.allclose(got, expected, atol=2e-3), (got, expected)

    stats = json.loads((out / "00000_stats.json").read_text())
    low = sum(m["fidelity"][st] < 0.5 for m in metas for st in ("rewrite", "intent"))
    assert stats["flagged"].get("rewrite:low_fidelity", 0) + stats["flagged"].get("intent:low_fidelity", 0) == low
    for m in metas:
        assert ("intent:low_fidelity" in m["flags"]) == (m["fidelity"]["intent"] < 0.5)
