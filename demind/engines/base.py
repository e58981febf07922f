"""The interface every generation engine implements."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from demind.config import ConfigError


@dataclass
class GenRequest:
    """One prompt with its image; ``seed`` makes the sampled text a function of the request alone."""

    prompt: str  # already rendered by the chat template; holds the image placeholder when there is an image
    image: Image.Image | None  # RGB, already shrunk to io.image_max_side; None: a text-only request
    seed: int
    max_new_tokens: int
    # Stage 1 of a conversation that a later request continues: an engine with a prefix
    # cache keeps this prompt's KV (image + turn 1) for that request (see Engine.release_prefixes).
    keep_prefix: bool = False
    # Images after ``image``, in the order of the prompt's image placeholders (a pair's target image):
    # one prompt, several images (vLLM: limit_mm_per_prompt; transformers: the processor takes them all).
    more_images: tuple[Image.Image, ...] = ()
    # A JSON schema the answer must follow: vLLM constrains decoding to it (structured output) where
    # it offers that; the transformers engine generates freely, and the caller parses and retries.
    json_schema: dict[str, Any] | None = None

    @property
    def images(self) -> list[Image.Image]:
        """Every image of the prompt, in placeholder order."""
        return ([self.image] if self.image is not None else []) + list(self.more_images)


@dataclass
class GenResult:
    text: str  # decoded, special tokens removed, not yet cleaned
    finish_reason: str  # "stop" (end of sequence) or "length" (hit max_new_tokens)
    prompt_tokens: int  # text + image tokens of the prompt
    output_tokens: int
    prefilled_tokens: int | None = None  # prompt tokens actually computed (fewer with a prefix cache); None = all
    cache_reported: bool = True  # False: the engine does not say what its prefix cache served (prefilled = all)

    def __post_init__(self) -> None:
        if self.prefilled_tokens is None:
            self.prefilled_tokens = self.prompt_tokens


@dataclass
class TokenScores:
    """Log-probabilities of chosen tokens as the first answer token of one prompt."""

    logprobs: list[float]  # one per asked token id, in the order asked (log-softmax over the whole vocabulary)
    prompt_tokens: int
    prefilled_tokens: int  # prompt tokens computed (fewer where a prefix cache served the rest)


class Engine(Protocol):
    """Generates text for image prompts. ``renderer`` renders conversations (chat template)."""

    name: str
    model_id: str
    # Tokens of KV the engine's prefix cache holds (None: no prefix cache, or its size is unknown);
    # IntentGenerator runs stage 1 and stage 2 in waves that fit it.
    prefix_capacity_tokens: int | None

    @property
    def renderer(self) -> Any: ...

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Results in the order of ``requests``."""
        ...

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each text with the model's tokenizer (no special tokens)."""
        ...

    def release_prefixes(self) -> None:
        """Drop prefixes kept for ``keep_prefix`` requests (their conversations are done)."""
        ...


def request_seed(base_seed: int, key: str, stage: str, attempt: int) -> int:
    """A 31-bit seed that depends only on the sample key, the stage and the attempt.

    Hash-derived (not Python's salted ``hash``) so it is identical across processes and reruns.
    """
    digest = hashlib.sha256(f"{base_seed}:{key}:{stage}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def model_context_length(model_config: Any) -> int | None:
    """The context length a model was built for: its text config's ``max_position_embeddings``
    (what vLLM takes as the default ``max_model_len`` too); None where the config has none."""
    text = getattr(model_config, "text_config", None) or model_config
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if n else None


def resolve_max_model_len(requested: int, model_config: Any, model_id: str) -> int:
    """``engine.max_model_len``: 0 -> the model's own context length; a length above it is refused
    (ConfigError) before an engine starts. With no length in the config, 0 is refused too."""
    own = model_context_length(model_config)
    if requested == 0:
        if own is None:
            raise ConfigError(f"engine.max_model_len: {model_id}'s config states no context length "
                              f"(max_position_embeddings); set engine.max_model_len")
        return own
    if own is not None and requested > own:
        raise ConfigError(f"engine.max_model_len={requested} is above {model_id}'s context length of {own:,} tokens "
                          f"(its max_position_embeddings): set engine.max_model_len={own} or less, or 0 for the model's")
    return requested
