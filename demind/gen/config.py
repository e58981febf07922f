"""Configuration of the intent-data generation job (``data_gen/run.py``).

Loaded with :func:`demind.config.load_config`::

    cfg = load_config(GenConfig, "configs/data_gen/llava-1.6-7b.yaml", ["engine.name=transformers"])
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE_NAMES = ("vllm", "transformers")
PROMPT_MODES = ("cot", "single")


@dataclass
class EngineConfig:
    """Which model runs, on which engine, and how requests are grouped."""

    name: str = "vllm"  # "vllm" (offline LLM, continuous batching) or "transformers" (batched generate)
    model: str = "llava-hf/llava-v1.6-mistral-7b-hf"  # hub id or local folder (model + processor)
    dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16", "float16", "float32"
    # Requests handed to the engine in one call. vLLM schedules them with continuous batching;
    # the bound keeps host memory flat (decoded images and vLLM's pixel tensors live per chunk).
    chunk_size: int = 1024
    # Stage 2 continues stage 1's conversation, so its prefix (image + turn 1) is computed once:
    # the transformers engine keeps stage 1's prompt KV cache, vLLM turns on automatic prefix caching.
    prefix_cache: bool = True
    # transformers only
    # Prompt tokens of kept stage-1 prefixes (oldest dropped; a batch with a dropped one is prefilled in full).
    # LLaVA-1.6 7B in bf16 keeps 128 KiB per token: 131,072 tokens = 16 GiB, about 48 images of 2.7k tokens, so
    # keep engine.chunk_size x prompt tokens below it.
    prefix_cache_tokens: int = 131072
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    batch_size: int = 8  # rows per generate() call
    cpu_threads: int = 0  # torch CPU threads for this process (0 = torch's default); 1 suits tiny models
    # vLLM only
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False


@dataclass
class SamplingConfig:
    """Decoding parameters; every request's seed is derived from (seed, key, stage, attempt)."""

    temperature: float = 0.7  # 0 = greedy (then a retry cannot change the text and is skipped)
    top_p: float = 0.9
    seed: int = 0
    rewrite_max_tokens: int = 160  # T_rew: the paper reports about 65 tokens on average
    intent_max_tokens: int = 64  # T_int: about 27 tokens
    retries: int = 1  # extra attempts (new seed) for an output that fails a quality check


@dataclass
class PromptConfig:
    """Versioned prompt texts, rendered through the processor's chat template."""

    version: str = "v1"  # a folder under demind/gen/prompts/, or a path to a folder with the same files
    mode: str = "cot"  # "cot": rewrite then reason (two turns); "single": intent in one turn (w/o CoT ablation)


@dataclass
class QualityConfig:
    """Checks applied to every cleaned output."""

    repeat_ngram: int = 3  # n of the word n-grams counted for the repetition check
    max_ngram_repeats: int = 2  # an n-gram seen more often than this flags the output as repetitive


@dataclass
class IOConfig:
    """Input handling."""

    image_max_side: int = 672  # images are shrunk so the longest side is at most this (LLaVA-1.6: 672)
    max_caption_chars: int = 2000  # longer captions are skipped and counted, not silently cut
    log_every: int = 1000  # one log line every N samples within a shard
    # chunks read and decoded by a background thread while the engine works on the current one
    # (0 = read in the main thread); memory holds up to 2 + prefetch_chunks decoded chunks
    prefetch_chunks: int = 1


@dataclass
class GenConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    io: IOConfig = field(default_factory=IOConfig)


def validate_config(cfg: GenConfig) -> None:
    """Raise ValueError for values the dataclass types cannot express (choices, ranges)."""
    problems = []
    if cfg.engine.name not in ENGINE_NAMES:
        problems.append(f"engine.name must be one of {ENGINE_NAMES}, got {cfg.engine.name!r}")
    if cfg.prompts.mode not in PROMPT_MODES:
        problems.append(f"prompts.mode must be one of {PROMPT_MODES}, got {cfg.prompts.mode!r}")
    if cfg.engine.cpu_threads < 0:
        problems.append("engine.cpu_threads must be >= 0")
    if cfg.engine.chunk_size < 1 or cfg.engine.batch_size < 1:
        problems.append("engine.chunk_size and engine.batch_size must be >= 1")
    if cfg.sampling.temperature < 0 or not 0 < cfg.sampling.top_p <= 1:
        problems.append("sampling.temperature must be >= 0 and sampling.top_p in (0, 1]")
    if cfg.sampling.retries < 0:
        problems.append("sampling.retries must be >= 0")
    if min(cfg.sampling.rewrite_max_tokens, cfg.sampling.intent_max_tokens) < 1:
        problems.append("sampling.*_max_tokens must be >= 1")
    if cfg.io.prefetch_chunks < 0:
        problems.append("io.prefetch_chunks must be >= 0")
    if cfg.io.image_max_side < 1:
        problems.append("io.image_max_side must be >= 1")
    if cfg.quality.repeat_ngram < 1:
        problems.append("quality.repeat_ngram must be >= 1")
    if problems:
        raise ValueError("invalid data_gen config: " + "; ".join(problems))
