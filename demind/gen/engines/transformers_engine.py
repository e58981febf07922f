"""The ``transformers`` engine: batched ``generate`` with left padding, CPU or GPU.

For small runs and tests. Per-request seeds are honoured inside a batch by
:class:`SeededRowSampler`, so a sample's text does not depend on its batch mates.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig, LogitsProcessor

from demind.gen.config import EngineConfig, SamplingConfig
from demind.gen.engines.base import GenRequest, GenResult

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SeededRowSampler(LogitsProcessor):
    """Sample each row with its own ``torch.Generator`` and hand the choice to greedy search.

    ``generate`` samples a batch from one global RNG, so a row's text would depend on the
    other rows. Here each row draws from its own generator (one draw per step), then all
    logits but the drawn token are set to -inf, and ``generate(do_sample=False)`` picks it.
    With temperature 0 the row takes the argmax. ``suppress_ids`` (e.g. the image token)
    can never be produced.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float, suppress_ids: list[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p
        self.suppress_ids = sorted(set(suppress_ids))

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (B, V) -> chosen token ids (B,)."""
        scores = scores.detach().float().cpu()
        if self.suppress_ids:
            scores[:, self.suppress_ids] = float("-inf")
        if self.temperature == 0:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.stack(
            [torch.multinomial(row, 1, generator=g)[0] for row, g in zip(probs, self.generators)]
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        chosen = self.choose(scores).to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(-1, chosen[:, None], 0.0)
        return forced


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"engine.dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


class TransformersEngine:
    """Hugging Face ``AutoModelForImageTextToText`` + its processor, batched with left padding."""

    name = "transformers"

    def __init__(self, engine_cfg: EngineConfig, sampling_cfg: SamplingConfig):
        self.model_id = engine_cfg.model
        self.batch_size = engine_cfg.batch_size
        self.sampling = sampling_cfg
        if engine_cfg.cpu_threads > 0:
            # Small models on a shared CPU run far faster on one thread than with contended thread pools.
            torch.set_num_threads(engine_cfg.cpu_threads)
        self.device = resolve_device(engine_cfg.device)
        self.dtype = resolve_dtype(engine_cfg.dtype, self.device)
        self.processor = AutoProcessor.from_pretrained(engine_cfg.model)
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.padding_side = "left"  # decoder-only generation needs the prompt flush right
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForImageTextToText.from_pretrained(engine_cfg.model, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.eos_ids = self._eos_ids()
        image_token_id = getattr(self.processor, "image_token_id", None)
        self.suppress_ids = [image_token_id] if image_token_id is not None else []
        logger.info("transformers engine: %s on %s (%s), batch %d", self.model_id, self.device, self.dtype, self.batch_size)

    @property
    def renderer(self) -> Any:
        return self.processor

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        results: list[GenResult] = []
        for start in range(0, len(requests), self.batch_size):
            results.extend(self._generate_batch(requests[start : start + self.batch_size]))
        return results

    @torch.inference_mode()
    def _generate_batch(self, batch: list[GenRequest]) -> list[GenResult]:
        images = [r.image for r in batch]
        if any(i is None for i in images) and any(i is not None for i in images):
            raise ValueError("a batch mixes text-only requests (image None) with image requests; send them apart")
        inputs = self.processor(
            images=images if images[0] is not None else None, text=[r.prompt for r in batch], return_tensors="pt",
            padding=True,
        ).to(self.device, dtype=self.dtype)
        max_new = max(r.max_new_tokens for r in batch)
        sampler = SeededRowSampler([r.seed for r in batch], self.sampling.temperature, self.sampling.top_p, self.suppress_ids)
        config = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=False,  # sampling happens in SeededRowSampler, per row
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=sorted(self.eos_ids),
        )
        output = self.model.generate(**inputs, generation_config=config, logits_processor=[sampler])
        new_tokens = output[:, inputs["input_ids"].shape[1] :].cpu()
        prompt_lengths = inputs["attention_mask"].sum(dim=1).tolist()
        return [
            self._result(row.tolist(), request.max_new_tokens, int(n_prompt))
            for row, request, n_prompt in zip(new_tokens, batch, prompt_lengths)
        ]

    def _result(self, token_ids: list[int], max_new_tokens: int, prompt_tokens: int) -> GenResult:
        """Cut at the first EOS (rows that stopped early are padded) and at the row's own limit."""
        end = next((i for i, t in enumerate(token_ids) if t in self.eos_ids), None)
        if end is not None and end < max_new_tokens:
            kept, reason = token_ids[:end], "stop"
        else:
            kept, reason = token_ids[:max_new_tokens], "length"
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return GenResult(text=text, finish_reason=reason, prompt_tokens=prompt_tokens, output_tokens=len(kept))
