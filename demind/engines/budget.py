"""Does a job's prompt fit ``engine.max_model_len``? Asked before the engine starts.

vLLM validates every prompt against its context length only when the prompts arrive, a minute
into a run (its engine started, the model loaded), and the transformers engine sizes its first
prefix wave by it. :func:`check_prompt_fits` renders one of the job's own prompts with the model's
processor (no weights loaded), images included at the largest size the job sends
(``io.image_max_side`` square: the most image tokens), and refuses in one line naming the key
when that prompt and its answer's token limit do not fit.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from demind.config import ConfigError
from demind.engines.base import resolve_max_model_len
from demind.engines.chat import Conversation, render
from demind.engines.config import EngineConfig


def prompt_tokens(processor: Any, conversation: Conversation, images: list[Image.Image]) -> int:
    """Tokens of ``conversation`` rendered and processed with ``images`` (image tokens expanded)."""
    text = render(processor, conversation)
    if not hasattr(processor, "image_processor"):  # a text-only model's processor is its tokenizer
        return len(processor(text, add_special_tokens=False)["input_ids"])
    inputs = processor(images=images or None, text=[text], return_tensors="np")
    return int(inputs["input_ids"].shape[-1])


def check_prompt_fits(engine_cfg: EngineConfig, conversation: Conversation, n_images: int, image_side: int,
                      max_new_tokens: int, what: str, key: str = "engine.max_model_len") -> int:
    """Refuse (:class:`~demind.config.ConfigError` naming ``key``) a context length below ``what``
    (the job's prompt) plus ``max_new_tokens``; returns that prompt's tokens. ``n_images`` images of
    ``image_side`` px square stand for the job's largest."""
    from transformers import AutoConfig

    from demind.engines.model_ref import load_processor

    processor = load_processor(engine_cfg.model)
    limit = resolve_max_model_len(engine_cfg.max_model_len, AutoConfig.from_pretrained(engine_cfg.model),
                                  engine_cfg.model)
    images = [Image.new("RGB", (image_side, image_side), (128, 128, 128)) for _ in range(n_images)]
    tokens = prompt_tokens(processor, conversation, images)
    if tokens + max_new_tokens > limit:
        raise ConfigError(f"{key}={limit} is below what {what} needs: {tokens} prompt tokens (text and "
                          f"{n_images} image(s) of up to {image_side} px) + {max_new_tokens} answer tokens = "
                          f"{tokens + max_new_tokens}; set {key}={tokens + max_new_tokens} or more (0: the model's own "
                          f"context length)", key=key)
    return tokens
