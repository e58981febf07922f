"""The ``engine`` and ``sampling`` config sections: which model runs on which engine, and how it samples.

Every command that runs an MLLM reads these sections (``demind-generate``, ``demind-generate-triplets``,
``demind-eval``, ``demind-search``, ``demind-build-exclcoco``).
"""

from __future__ import annotations

from dataclasses import dataclass

from demind.settings import MAX_THREADS, setting


@dataclass
class EngineConfig:
    """Which model runs, on which engine, and how requests are grouped."""

    name: str = setting("vllm", choices=("vllm", "transformers"))  # "vllm" (offline LLM, continuous batching) or "transformers" (batched generate)
    # hub id or local folder (model + processor)
    model: str = setting("llava-hf/llava-v1.6-mistral-7b-hf",
                         free="a Hub id or a model folder, checked (one line naming engine.model) when the engine is "
                              "first needed: a rerun answered from the store needs no weights")
    dtype: str = setting("auto", choices=("auto", "bfloat16", "float16", "float32"))  # "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16", "float16", "float32"
    # Samples decoded and held at a time (host memory stays flat). With a prefix cache a chunk's stages
    # run in waves of as many samples as the cache holds (vLLM schedules a wave with continuous batching).
    chunk_size: int = setting(1024, ge=1)
    # Stage 2 continues stage 1's conversation, so its prefix (image + turn 1) is computed once:
    # the transformers engine keeps stage 1's prompt KV cache, vLLM (>= 0.8) turns on automatic prefix
    # caching; a chunk runs in waves that fit the cache, so stage 2 finds the prefix (shard stats:
    # engine_tokens.stage2_hit_rate).
    prefix_cache: bool = True
    # transformers only: bytes the kept stage-1 prefixes (their KV cache) may take on the engine's device.
    # 0 = prefix_store_fraction of the memory free once the model is loaded (torch.cuda.mem_get_info on a
    # GPU, available host memory on a CPU); the rest stays for the running batch. KV per token in bf16:
    # LLaVA-1.6 Mistral-7B 128 KiB, Vicuna-7B 512 KiB, Vicuna-13B 800 KiB (demind/engines/memory.py).
    prefix_store_bytes: int = setting(0, ge=0)
    prefix_store_fraction: float = setting(0.5, gt=0, lt=1)
    batch_size: int = setting(8, ge=1)  # rows per generate() call
    # torch CPU threads for this process (0 = torch's default); 1 suits tiny models; at most MAX_THREADS
    # (torch starts every thread asked for: 100,000 crashed the process after the model had loaded)
    cpu_threads: int = setting(0, ge=0, le=MAX_THREADS)
    # Longest prompt + answer in tokens: vLLM's context length; both engines also size their first
    # prefix wave with it (later waves use the longest stage-2 sequence seen). 0 = the model's own
    # (its text config's max_position_embeddings); a length above the model's is refused.
    max_model_len: int = setting(0, ge=0)
    # vLLM only (docs/generation.md, "Engine settings on a GPU and on vLLM's CPU build")
    tensor_parallel_size: int = setting(1, ge=1)
    # GPU: the share of each GPU's memory vLLM may take (weights, activations, KV cache); the KV cache
    # gets what is left. vLLM's CPU build is sized by kv_cache_gib instead (its share of host memory
    # is not passed: vLLM refuses it whenever other processes hold memory).
    gpu_memory_utilization: float = setting(0.9, gt=0, le=1)
    # GiB of KV cache (per GPU with tensor parallelism): vLLM's kv_cache_memory_bytes, on a GPU and
    # on vLLM's CPU build alike. 0 = on a GPU, what gpu_memory_utilization leaves; on the CPU build,
    # room for 64 sequences of max_model_len tokens, at most a quarter of the memory the weights leave.
    kv_cache_gib: float = setting(0.0, ge=0)
    enforce_eager: bool = False  # no CUDA graphs (GPU) / no torch.compile of the model (vLLM's CPU build)


@dataclass
class SamplingConfig:
    """Decoding parameters; every request's seed is derived from (run.seed, key, stage, attempt)."""

    temperature: float = setting(0.7, ge=0)  # 0 = greedy (then a retry cannot change the text and is skipped)
    top_p: float = setting(0.9, gt=0, le=1)
    rewrite_max_tokens: int = setting(160, ge=1)  # T_rew: the paper reports about 65 tokens on average
    intent_max_tokens: int = setting(64, ge=1)  # T_int: about 27 tokens
    retries: int = setting(1, ge=0)  # extra attempts (new seed) for an output that fails a quality check
