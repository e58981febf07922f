"""Generation memory and prompts on real shapes and formats: KV bytes per token of the LLaVA-1.6
configs (built as config objects, no weights), the prefix store sized in bytes, prefix waves that
keep every stage-1 prefix for stage 2, and llava-hf LLaVA-NeXT folders with their real chat
templates (the current ones and the old one with the ``<\\s>`` typo)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from demind.errors import DemindError
from demind.gen.config import GenConfig
from demind.engines.base import request_seed
from demind.gen.generate import ChunkItem, IntentGenerator
from demind.engines.memory import (
    GIB,
    WavePlanner,
    kv_bytes_per_token,
    prefix_store_budget,
    prefix_wave_size,
)
from demind.engines.chat import render, repaired_chat_template
from demind.gen.prompts import load_prompts
from demind.engines.tiny_llava import build_tiny_llava_next
from tests.helpers import FIXTURES

# transformers 5 deprecates generate's past_key_values (FutureWarning, removed in 6.0): the engine uses the new name
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

TEMPLATES = json.loads((FIXTURES / "llava_hf" / "chat_templates.json").read_text(encoding="utf-8"))
LLAVA_16_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
OLD_FIXED_CAP_TOKENS = 131_072  # the earlier token cap of the prefix store


@pytest.fixture(autouse=True, scope="module")
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def llava_16_config(text: str):
    """LlavaNextConfig of llava-hf's LLaVA-1.6 ``text`` model (its config.json's shapes; the default
    vision config is CLIP-L/336)."""
    from transformers import LlamaConfig, LlavaNextConfig, MistralConfig

    shapes = {
        "mistral-7b": (MistralConfig, dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8, sliding_window=None)),
        "vicuna-7b": (LlamaConfig, dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=32)),
        "vicuna-13b": (LlamaConfig, dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                         num_attention_heads=40, num_key_value_heads=40)),
    }
    cls, kwargs = shapes[text]
    return LlavaNextConfig(text_config=cls(vocab_size=32064, **kwargs), image_grid_pinpoints=LLAVA_16_PINPOINTS)


def weight_bytes_bf16(config) -> int:
    """Bytes of the model's bf16 weights, counted on the meta device (nothing is allocated)."""
    from transformers import LlavaNextForConditionalGeneration

    with torch.device("meta"):
        model = LlavaNextForConditionalGeneration(config)
    return 2 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("text, kib_per_token", [("mistral-7b", 128), ("vicuna-7b", 512), ("vicuna-13b", 800)])
def test_kv_bytes_per_token_of_llava_16(text, kib_per_token):
    """layers x 2 x KV heads x head dim x 2 bytes: GQA (Mistral's 8 KV heads) keeps 4x less than Vicuna."""
    assert kv_bytes_per_token(llava_16_config(text), 2) == kib_per_token * 1024
    assert kv_bytes_per_token(llava_16_config(text).text_config, 4) == 2 * kib_per_token * 1024  # fp32, text config


@pytest.mark.parametrize("text, card_bytes, tokens", [
    ("mistral-7b", 80e9, 247_446), ("mistral-7b", 24e9, 33_823), ("vicuna-13b", 80e9, 32_529),
])
def test_prefix_store_fits_the_card_where_the_old_token_cap_did_not(text, card_bytes, tokens):
    """Half of what the bf16 weights leave free on an 80 GB / 24 GB card, in tokens of KV. The old
    fixed cap of 131,072 tokens is 100 GiB for Vicuna-13B (more than the card) and 16 GiB for
    Mistral-7B (more than a 24 GB card has left)."""
    config = llava_16_config(text)
    per_token = kv_bytes_per_token(config, 2)
    free = int(card_bytes - weight_bytes_bf16(config))
    budget = prefix_store_budget(0, 0.5, free, per_token, device="cuda:0")
    assert budget.tokens == tokens == int(free * 0.5) // per_token
    assert budget.bytes <= free / 2
    assert f"{tokens:,} tokens" in budget.describe() and "0.5 of" in budget.describe()
    if text == "vicuna-13b" or card_bytes == 24e9:
        assert OLD_FIXED_CAP_TOKENS * per_token > free


def test_configured_bytes_win_and_unknown_free_memory_is_refused():
    budget = prefix_store_budget(8 * GIB, 0.5, 100 * GIB, 819_200)
    assert (budget.bytes, budget.tokens, budget.source) == (8 * GIB, 10_485, "engine.prefix_store_bytes")
    with pytest.raises(DemindError, match=r"cannot tell how much memory mps has free .* set engine.prefix_store_bytes"):
        prefix_store_budget(0, 0.5, None, 819_200, device="mps")


def test_the_old_token_cap_key_is_refused_naming_the_byte_setting():
    from demind.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'engine.prefix_cache_tokens' was removed: .* engine.prefix_store_bytes"):
        load_config(GenConfig, None, ["engine.prefix_cache_tokens=131072"])
    cfg = load_config(GenConfig, None, ["engine.prefix_store_bytes=8589934592", "engine.prefix_store_fraction=0.3"])
    assert (cfg.engine.prefix_store_bytes, cfg.engine.prefix_store_fraction) == (8 * GIB, 0.3)
    with pytest.raises(ConfigError, match="engine.prefix_store_fraction"):
        load_config(GenConfig, None, ["engine.prefix_store_fraction=1.5"])


def test_wave_size_follows_the_cache():
    assert prefix_wave_size(1024, None, 3000) == 1024  # no prefix cache: one wave
    assert prefix_wave_size(1024, 32_529, 3000) == 9  # Vicuna-13B on 80 GB: 0.9 x 32,529 / 3,000
    assert prefix_wave_size(1024, 400_000, 3000) == 120
    assert prefix_wave_size(5, 400_000, 3000) == 5
    assert prefix_wave_size(1024, 1000, 3000) == 1  # less than a sample: one at a time
    planner = WavePlanner(100_000, 4096)
    assert planner.size(1024) == 21  # before any sample: max_model_len tokens per sample
    planner.observe([900, 1000])
    planner.observe([800])
    assert planner.sample_tokens == 1000 and planner.size(1024) == 90


# ----------------------------------------------------------------------------- tiny LLaVA-NeXT


def items(n: int, seed: int = 0) -> list[ChunkItem]:
    rng = np.random.default_rng(seed)
    words = ["a", "red", "dog", "on", "the", "street", "tree"]
    return [ChunkItem(f"k{i}", " ".join(rng.choice(words, 3 + i % 8)),
                      Image.fromarray(rng.integers(0, 255, (20 + 7 * (i % 7), 40 - 3 * (i % 7), 3), dtype=np.uint8)))
            for i in range(n)]


def engine_config(model: Path, store_bytes: int = 0, prefix_cache: bool = True) -> GenConfig:
    cfg = GenConfig()
    cfg.engine.name, cfg.engine.model, cfg.engine.dtype, cfg.engine.batch_size = "transformers", str(model), "float32", 3
    cfg.engine.prefix_cache, cfg.engine.prefix_store_bytes, cfg.engine.cpu_threads = prefix_cache, store_bytes, 1
    cfg.sampling.rewrite_max_tokens, cfg.sampling.intent_max_tokens = 10, 6
    return cfg


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny random LLaVA-NeXT saved as llava-hf folders with the test template and each real one."""
    from demind.engines.tiny_llava import TINY_CHAT_TEMPLATE

    root = tmp_path_factory.mktemp("llava-hf")
    return {key: build_tiny_llava_next(root / key, chat_template=template)
            for key, template in {"tiny": TINY_CHAT_TEMPLATE, **TEMPLATES}.items()}


def test_store_bytes_follow_the_kv_arithmetic_and_waves_keep_every_prefix(tiny_folders, caplog):
    """The kept prefixes take len(ids) x kv_bytes_per_token bytes. With a store of 3.5 stage-1
    prompts, a 7-sample chunk runs in waves and every stage-2 request finds its prefix (same text
    as a full prefill); as one wave the store overflows and stage 2 misses."""
    from demind.engines.transformers_engine import PrefixStore, TransformersEngine

    folder = tiny_folders["tiny"]
    chunk = items(7)
    full_cfg = engine_config(folder, prefix_cache=False)
    full = IntentGenerator(TransformersEngine(full_cfg.engine, full_cfg.sampling, "cpu"), full_cfg,
                           load_prompts("v1")).generate(chunk)
    sample_tokens = max(o.intent.prompt_tokens for o in full) + full_cfg.sampling.intent_max_tokens
    stage1_tokens = max(o.rewrite.prompt_tokens for o in full)

    kept: list = []
    put = PrefixStore.put
    PrefixStore.put = lambda self, prefix: (kept.append(prefix), put(self, prefix))[1]
    try:
        runs = {}
        for waves in (True, False):
            probe = TransformersEngine(full_cfg.engine, full_cfg.sampling, "cpu")
            per_token = kv_bytes_per_token(probe.model.config, 4)
            cfg = engine_config(folder, store_bytes=int(3.5 * stage1_tokens * per_token))  # 3.5 stage-1 prompts
            cfg.engine.max_model_len = sample_tokens  # the first wave is sized like the later ones
            with caplog.at_level(logging.INFO, logger="demind.engines.transformers_engine"):
                engine = TransformersEngine(cfg.engine, cfg.sampling, "cpu")
            assert f"= {engine.prefix_capacity_tokens:,} tokens" in caplog.text
            generator = IntentGenerator(engine, cfg, load_prompts("v1"))
            if not waves:
                generator.waves.capacity_tokens = None  # the whole chunk as one wave, as before
            runs[waves] = (generator.generate(chunk), engine.prefixes.dropped)
    finally:
        PrefixStore.put = put
    assert kept and all(p.nbytes == len(p.ids) * per_token for p in kept)

    (waved, dropped), (one_wave, dropped_one) = runs[True], runs[False]
    assert [(o.rewrite.text, o.intent.text) for o in waved] == [(o.rewrite.text, o.intent.text) for o in full]
    assert dropped == 0 and all(o.intent.prefix_hits == o.intent.attempts for o in waved)
    assert dropped_one > 0 and sum(o.intent.prefix_hits for o in one_wave) < sum(o.intent.attempts for o in one_wave)
    assert [(o.rewrite.text, o.intent.text) for o in one_wave] == [(o.rewrite.text, o.intent.text) for o in full]


# ----------------------------------------------------------------------------- llava-hf chat templates


def test_old_llava_hf_template_is_repaired_to_the_current_one():
    assert "<\\s>" in TEMPLATES["mistral_old"]  # the fixture carries the typo
    assert repaired_chat_template(TEMPLATES["mistral_old"]) == TEMPLATES["mistral"]
    for key in ("mistral", "vicuna"):
        assert repaired_chat_template(TEMPLATES[key]) == TEMPLATES[key]


def stage_prompts(folder: Path) -> tuple[list[str], list[str], object, list]:
    """Stage-1 and stage-2 prompts (first attempts) the job sends for a small chunk, through the
    real loading path; the engine and the outputs."""
    from demind.engines.transformers_engine import TransformersEngine

    cfg = engine_config(folder)
    engine = TransformersEngine(cfg.engine, cfg.sampling, "cpu")
    sent: dict[int, str] = {}
    generate = engine.generate
    engine.generate = lambda requests: (sent.update((r.seed, r.prompt) for r in requests), generate(requests))[1]
    chunk = items(3)
    outputs = IntentGenerator(engine, cfg, load_prompts("v1")).generate(chunk)
    stage1 = [sent[request_seed(cfg.run.seed, it.key, "rewrite", 0)] for it in chunk]
    stage2 = [sent[request_seed(cfg.run.seed, it.key, "intent", 0)] for it in chunk]
    assert all(o.intent.prefix_hits == o.intent.attempts for o in outputs)  # the prefix still matches
    return stage1, stage2, engine, outputs


@pytest.mark.parametrize("key", ["mistral", "mistral_old", "vicuna"])
def test_llava_hf_folders_render_stage_two_without_the_typo(tiny_folders, key):
    """A llava-hf folder with its real template: the stage-2 prompt continues stage 1's word for
    word, and turn 1 is closed by the end-of-sequence token where the template closes it, never
    by the literal ``<\\s>``."""
    stage1, stage2, engine, outputs = stage_prompts(tiny_folders[key])
    tokenizer = engine.tokenizer
    for first, second, out in zip(stage1, stage2, outputs):
        assert second.startswith(first) and "<\\s>" not in second
        eos_count = tokenizer(second, add_special_tokens=False).input_ids.count(tokenizer.eos_token_id)
        if key.startswith("mistral"):
            assert first.startswith("[INST] <image>\n") and first.endswith(" [/INST]")
            assert second.startswith(f"{first} {out.rewrite.text}</s> [INST] ") and eos_count == 1
        else:  # the Vicuna template closes no turn with </s>
            assert first.startswith("USER: <image>\n") and first.endswith("ASSISTANT:")
            assert f"ASSISTANT: {out.rewrite.text} USER: " in second and eos_count == 0


def test_old_and_current_mistral_templates_give_the_same_prompts(tiny_folders):
    old = stage_prompts(tiny_folders["mistral_old"])
    current = stage_prompts(tiny_folders["mistral"])
    assert old[0] == current[0] and old[1] == current[1]
    processor = old[2].processor
    raw = processor.apply_chat_template([{"role": "assistant", "content": [{"type": "text", "text": "a dog"}]}],
                                        tokenize=False)
    assert raw == " a dog<\\s> "  # what the old template gives unrepaired
    assert render(processor, [{"role": "assistant", "content": [{"type": "text", "text": "a dog"}]}]) == " a dog</s> "


class LRUPrefixLLM:
    """A stand-in for ``vllm.LLM`` that keeps what vLLM's prefix cache keeps: each finished
    request's tokens, least recently used dropped beyond ``num_gpu_blocks x block_size`` tokens. A
    prompt that starts with a held sequence is served that much from the cache (``num_cached_tokens``).
    Tokens: one a word, 100 for the image."""

    def __init__(self, blocks: int, **kwargs):
        from types import SimpleNamespace

        self.capacity = blocks * 16
        self.held: list[tuple[str, int]] = []  # (prompt, tokens), oldest first
        self.llm_engine = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=16))

    @staticmethod
    def tokens(text: str) -> int:
        return len(text.split()) + 99 * text.count("<image>")

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        outputs = []
        for prompt, p in zip(prompts, params):
            text = prompt["prompt"]
            hit = max((n for held, n in self.held if text.startswith(held)), default=0)
            answer = " ".join(["dog"] * p["max_tokens"])
            n = self.tokens(text)
            self.held = [(h, m) for h, m in self.held if h != text] + [(text, n)]
            while sum(m for _, m in self.held) > self.capacity:
                self.held.pop(0)
            outputs.append(SimpleNamespace(prompt_token_ids=[0] * n, num_cached_tokens=hit, outputs=[
                SimpleNamespace(text=answer, finish_reason="length", token_ids=[0] * p["max_tokens"])]))
        return outputs


@pytest.mark.parametrize("waves", [True, False])
def test_vllm_chunk_runs_in_waves_that_its_cache_holds(tiny_folders, monkeypatch, waves):
    """A 64-sample chunk against a KV cache of 1,440 tokens (about five stage-1 prompts): in waves
    (of 2 here) every stage-2 request hits stage 1's prefix; as one 64-sample call (the earlier
    behaviour) none does, as the shard stats show."""
    from types import SimpleNamespace

    from demind.engines import vllm_engine
    from demind.gen.job import ShardStats

    fake = SimpleNamespace(LLM=lambda **kw: LRUPrefixLLM(blocks=90, **kw), SamplingParams=dict, __version__="0.11.0")
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake)
    cfg = GenConfig()
    cfg.engine.model, cfg.engine.chunk_size, cfg.engine.max_model_len = str(tiny_folders["tiny"]), 64, 1024
    cfg.sampling.retries = 0
    engine = vllm_engine.VLLMEngine(cfg.engine, cfg.sampling)
    assert engine.prefix_capacity_tokens == 1440
    generator = IntentGenerator(engine, cfg, load_prompts("v1"))
    if not waves:
        generator.waves.capacity_tokens = None
    stats = ShardStats()
    for out in generator.generate(items(64)):
        stats.written += 1
        stats.add_output(out)
    cache = stats.cache_stats()
    assert cache["stage2_requests"] == 64
    if waves:
        assert cache["stage2_hits"] == 64 and cache["stage2_hit_rate"] == 1.0
    else:  # stage 1's last prompts pushed out the first ones before stage 2 asked for them
        assert cache["stage2_hits"] == 0 and cache["stage2_hit_rate"] == 0.0
