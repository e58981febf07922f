"""The paper's model sizes at reduced size: the files of llava-hf/llava-v1.6-mistral-7b-hf with small layers
(benchmarks/full_size_models.py), and the memory guard that refuses a run the machine cannot hold
(demind.engines.memory) -- at the 7B's real config, counted on the meta device (nothing allocated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import full_size_models as fsm
from demind.engines.config import EngineConfig
from demind.engines.memory import GIB, check_engine_memory, estimate_engine_memory, kv_bytes_per_token
from demind.errors import DemindError

IMAGE_TOKEN_KEYS = ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens")
PARAMS_7B = 7_566_747_648  # llava-v1.6-mistral-7b-hf: model.safetensors.index.json total_size 15,133,495,296 / 2


@pytest.fixture(scope="module")
def config_7b():
    from transformers import LlavaNextConfig

    return LlavaNextConfig.from_dict(fsm.llava_config())


def test_the_7b_config_has_the_published_sizes(config_7b):
    weights = fsm.weight_shapes(fsm.llava_config())
    assert sum(2 * fsm._numel(shape) for _, shape in weights) == 2 * PARAMS_7B
    assert [len(s) for s in fsm.shard_plan(weights)] and len(fsm.shard_plan(weights)) == 4  # the Hub's four shards
    names = {n for n, _ in weights}
    assert {"image_newline", "language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
            "multi_modal_projector.linear_2.bias", "vision_tower.vision_model.post_layernorm.weight"} <= names
    assert kv_bytes_per_token(config_7b, 2) == 128 * 1024  # 32 layers x 2 x 8 KV heads x 128 x bf16


def vllm_cpu(**kw) -> EngineConfig:
    return EngineConfig(name="vllm", model="m", dtype="bfloat16", max_model_len=4096, **kw)


def test_estimate_counts_weights_cache_and_activations(config_7b):
    est = estimate_engine_memory(vllm_cpu(kv_cache_gib=2.0), config_7b, on_cpu=True, vllm_cpu=True,
                                 available=23 * GIB, max_model_len=4096, params=PARAMS_7B)
    assert est.weights == 2 * PARAMS_7B and est.kv_cache == 2 * GIB
    assert est.activations == 4096 * (2 * 14336 + 4 * 4096) * 2
    # engine.kv_cache_gib 0 on the CPU build: the size the engine passes (64 sequences, at most 1/4 available)
    default = estimate_engine_memory(vllm_cpu(), config_7b, on_cpu=True, vllm_cpu=True, available=20 * GIB,
                                     max_model_len=4096, params=PARAMS_7B)
    # ... a quarter of what the 14.1 GiB of weights leave, not of the memory before they load (then 5 GiB)
    assert default.kv_cache == (20 * GIB - 2 * PARAMS_7B) // 4
    tf = EngineConfig(name="transformers", model="m", dtype="bfloat16", max_model_len=4096, batch_size=8)
    est = estimate_engine_memory(tf, config_7b, on_cpu=True, vllm_cpu=False, available=23 * GIB, max_model_len=4096,
                                 params=PARAMS_7B)
    assert est.kv_cache == 8 * 4096 * 128 * 1024


@pytest.mark.parametrize("engine,available,names", [
    (vllm_cpu(kv_cache_gib=4.0), 18, "lower engine.kv_cache_gib to"),
    (EngineConfig(name="transformers", model="m", dtype="bfloat16", max_model_len=4096), 18,
     "lower engine.batch_size to 3"),
    (EngineConfig(name="transformers", model="m", dtype="auto", max_model_len=4096), 23,
     "set engine.dtype=bfloat16"),
    (vllm_cpu(), 12, "the weights alone do not fit"),
    (EngineConfig(name="transformers", model="m", dtype="bfloat16", max_model_len=4096), 15.5,
     "even engine.batch_size=1 needs about 15.7 GiB: free memory first"),
])
def test_a_shortfall_is_one_line_naming_the_setting(config_7b, engine, available, names):
    with pytest.raises(DemindError) as err:
        check_engine_memory(engine, config_7b, device="cpu", vllm_cpu=engine.name == "vllm",
                            available=available * GIB, params=PARAMS_7B)
    line = str(err.value)
    assert "\n" not in line and names in line and f"but {available:.1f} GiB is available" in line


def test_the_cpu_builds_default_cache_leaves_room_for_the_7b_weights(config_7b):
    """engine.kv_cache_gib 0 on vLLM's CPU build with 20 GiB available: a quarter of the 5.9 GiB the bf16 weights
    leave (1.5 GiB, 12k tokens: three stage-2 sequences), so the shipped config runs; a quarter of the 20 GiB (5 GiB)
    would not fit beside the weights and the guard would refuse the default config."""
    est = check_engine_memory(vllm_cpu(), config_7b, device="cpu", vllm_cpu=True, available=20 * GIB, params=PARAMS_7B)
    assert est.kv_cache // (128 * 1024) >= 3 * 4096 - 1000


def test_a_run_that_fits_passes_and_vllm_on_a_gpu_is_left_to_vllm(config_7b):
    assert check_engine_memory(vllm_cpu(), config_7b, device="cpu", vllm_cpu=True, available=64 * GIB,
                               params=PARAMS_7B).total < 64 * GIB
    assert check_engine_memory(vllm_cpu(), config_7b, device="cuda", vllm_cpu=False, available=1,
                               params=PARAMS_7B) is None


def test_generate_refuses_before_loading_when_memory_is_short(repo_root, tiny_llava, tmp_path, monkeypatch, capsys):
    """demind-generate (every command, through build_engine) estimates the engine's memory from the model's
    config.json before loading it; a shortfall is one error line and exit 2, and no engine is built."""
    from demind.cli.generate import main
    from demind.engines import memory
    from helpers import write_img2dataset_shards

    write_img2dataset_shards(tmp_path / "in")
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 64 * 1024**2)

    def no_engine(*a, **kw):
        raise AssertionError("the engine was built although the memory check should have refused")

    monkeypatch.setattr("demind.engines.transformers_engine.TransformersEngine.__init__", no_engine)
    rc = main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--config",
               str(repo_root / "configs/data_gen/tiny-cpu.yaml"), "run.progress=false", f"engine.model={tiny_llava}"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"engine.model={tiny_llava}" in lines[0] and "0.1 GiB is available" in lines[0]


def test_the_folder_has_the_hub_files_and_loads(tmp_path):
    """The mid-size folder: every Hub file, the Hub's weight names, loadable by transformers with no key left over."""
    import torch
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    folder = fsm.write_llava_mistral_7b(tmp_path / "llava", small=True, sentencepiece=tmp_path / "absent.model",
                                        log=lambda *_: None)
    assert json.loads((folder / "config.json").read_text())["image_grid_pinpoints"] == fsm.PINPOINTS
    assert json.loads((folder / "processor_config.json").read_text())["num_additional_image_tokens"] == 1
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "language_model.model.layers.0.self_attn.k_proj.weight" in index["weight_map"]
    processor = AutoProcessor.from_pretrained(folder)
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "<image>", "<pad>"]) == [0, 1, 2, 32000, 32001]
    assert "STAND-IN" in (folder / "README.md").read_text()
    model, info = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.text_config.vocab_size == 32064


@pytest.mark.slow
def test_the_shipped_7b_config_runs_at_mid_size(repo_root, tmp_path, capsys):
    """configs/data_gen/llava-1.6-7b.yaml on the transformers engine against the 7B's own processor and
    config files with small layers: 672 px any-res images of four aspect ratios expand to their real
    image-token counts, the longest stage-2 request fits max_model_len 4096, and stage 2 finds stage 1's prefix."""
    from benchmarks.bench_full_size import image_token_counts, write_aspect_shard
    from demind.cli.generate import main

    folder = fsm.write_llava_mistral_7b(tmp_path / "llava", small=True, sentencepiece=tmp_path / "absent.model",
                                        log=lambda *_: None)
    tokens = image_token_counts(folder)
    assert tokens == {"672x672": 2928, "672x448": 2144, "672x336": 1752, "336x672": 1776}
    write_aspect_shard(tmp_path / "in")
    rc = main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--config",
               str(repo_root / "configs/data_gen/llava-1.6-7b.yaml"), f"engine.model={folder}", "run.device=cpu",
               "engine.name=transformers", "run.progress=false", "sampling.rewrite_max_tokens=6",
               "sampling.intent_max_tokens=4", "sampling.retries=0"])
    assert rc == 0, capsys.readouterr().err
    stats = json.loads((tmp_path / "out/00000_stats.json").read_text())
    assert stats["written"] == 4 and stats["engine_tokens"]["stage2_hit_rate"] == 1.0


@pytest.mark.parametrize("dropped", [("num_additional_image_tokens",),
                                     ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens")])
def test_an_older_llava_hf_processor_config_counts_the_models_image_tokens(tiny_llava, tmp_path, dropped):
    """llava-hf folders downloaded before 2024's processor updates lack these processor_config.json keys:
    transformers then counts one image token fewer than the model's features (or cannot count: no patch
    size), and every request of the transformers engine failed; vLLM counts from the model's config.
    The engines' processor takes them from the model's config."""
    import shutil

    from PIL import Image

    from demind.engines import build_engine, load_processor
    from demind.engines.config import SamplingConfig
    from demind.engines.base import GenRequest

    folder = tmp_path / "old"
    shutil.copytree(tiny_llava, folder)
    saved = json.loads((folder / "processor_config.json").read_text())
    for key in dropped:
        saved.pop(key)
    (folder / "processor_config.json").write_text(json.dumps(saved))
    current = load_processor(str(tiny_llava))
    older = load_processor(str(folder))
    assert [getattr(older, k) for k in IMAGE_TOKEN_KEYS] == [getattr(current, k) for k in IMAGE_TOKEN_KEYS]
    engine = build_engine(EngineConfig(name="transformers", model=str(folder), dtype="float32"),
                          SamplingConfig(temperature=0.0), device="cpu")
    prompt = engine.processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "a dog"}]}], add_generation_prompt=True, tokenize=False)
    [result] = engine.generate([GenRequest(prompt, Image.new("RGB", (40, 20)), seed=0, max_new_tokens=2)])
    assert result.output_tokens >= 1


def test_the_chat_template_is_the_one_the_tests_keep(repo_root):
    """The folder's chat_template.json is llava-hf's current Mistral template, as tests/fixtures/llava_hf has it."""
    fixture = json.loads((repo_root / "tests/fixtures/llava_hf/chat_templates.json").read_text())
    assert fsm.CHAT_TEMPLATE == fixture["mistral"]
