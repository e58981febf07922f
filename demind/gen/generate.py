"""The two generation stages (seed paper section 3.2) over a chunk of decoded samples.

Stage 1 (caption rewriting): image + T_ori -> T_rew.
Stage 2 (intention reasoning): the same conversation continued -> T_int.
Each output is cleaned and checked; a flagged output is retried with a new seed
(``sampling.retries`` times), and the attempt with the fewest flags is kept, flags and all.
With a prefix cache, a chunk runs in waves (stage 1 then stage 2) no larger than the cache
holds, so that stage 2 finds stage 1's prefix (:mod:`demind.engines.memory`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from demind.engines import Conversation, Engine, GenRequest, GenResult, WavePlanner, render, request_seed
from demind.gen.config import GenConfig
from demind.gen.prompts import PromptSet, intent_conversation, rewrite_conversation, single_conversation
from demind.gen.quality import clean_output, quality_flags

logger = logging.getLogger(__name__)


@dataclass
class StageOutput:
    """The kept attempt of one stage for one sample."""

    text: str  # cleaned
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    seed: int
    prefilled_tokens: int = 0  # prompt tokens the engine computed (fewer than prompt_tokens with a prefix cache)
    # every attempt's prompt tokens, and the requests (attempts) that the prefix cache served in part;
    # cache_reported False: the engine does not say (counted as prefilled in full)
    requested_tokens: int = 0
    prefix_hits: int = 0
    cache_reported: bool = True
    attempts: int = 1
    flags: list[str] = field(default_factory=list)
    first_flags: list[str] = field(default_factory=list)  # flags of attempt 1 when it was retried

    def record(self) -> dict[str, Any]:
        """The stage's entry in the sample's ``json.generation``."""
        rec: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "seed": self.seed,
            "attempts": self.attempts,
            "flags": self.flags,
        }
        if self.attempts > 1:
            rec["first_attempt_flags"] = self.first_flags
        return rec


@dataclass
class ChunkItem:
    """A decoded sample ready for the engine."""

    key: str
    caption: str
    image: Image.Image  # shrunk RGB


@dataclass
class ChunkOutput:
    rewrite: StageOutput | None  # None in single-prompt mode
    intent: StageOutput


class IntentGenerator:
    """Runs the configured stages on an engine; ``engine_seconds`` accumulates time inside the engine."""

    def __init__(self, engine: Engine, cfg: GenConfig, prompts: PromptSet):
        self.engine = engine
        self.cfg = cfg
        self.prompts = prompts
        self.engine_seconds = 0.0
        # the engine's resolved context length (engine.max_model_len 0: the model's own)
        self.waves = WavePlanner(getattr(engine, "prefix_capacity_tokens", None),
                                 getattr(engine, "max_model_len", None) or cfg.engine.max_model_len)

    def generate(self, items: list[ChunkItem]) -> list[ChunkOutput]:
        """Both stages (or the single prompt) for every item, in order; in waves that the engine's
        prefix cache holds (stage 1's KV of a wave is still there when its stage 2 runs)."""
        if self.cfg.prompts.mode == "single":
            convs = [single_conversation(self.prompts, it.caption) for it in items]
            intents = self.run_stage("intent", items, convs, self.cfg.sampling.intent_max_tokens) if items else []
            return [ChunkOutput(None, out) for out in intents]
        outputs: list[ChunkOutput] = []
        while len(outputs) < len(items):
            wave = items[len(outputs) : len(outputs) + self.waves.size(len(items) - len(outputs))]
            outputs += self._two_stages(wave)
            self.waves.observe([o.intent.prompt_tokens + self.cfg.sampling.intent_max_tokens for o in outputs[-len(wave):]])
        return outputs

    def _two_stages(self, items: list[ChunkItem]) -> list[ChunkOutput]:
        """Stage 1 (rewrite), then stage 2 (intent) continuing the same conversations."""
        sampling = self.cfg.sampling
        convs = [rewrite_conversation(self.prompts, it.caption) for it in items]
        try:
            # Stage 2's prompt starts with stage 1's, so the engine may keep stage 1's prefix.
            rewrites = self.run_stage("rewrite", items, convs, sampling.rewrite_max_tokens, keep_prefix=True)
            convs = [intent_conversation(self.prompts, it.caption, rw.text) for it, rw in zip(items, rewrites)]
            intents = self.run_stage("intent", items, convs, sampling.intent_max_tokens)
        finally:
            release = getattr(self.engine, "release_prefixes", None)
            if release is not None:
                release()
        return [ChunkOutput(rw, it) for rw, it in zip(rewrites, intents)]

    def run_stage(
        self, stage: str, items: list[ChunkItem], conversations: list[Conversation], max_new_tokens: int,
        keep_prefix: bool = False,
    ) -> list[StageOutput]:
        """One stage for all items, then retries of the flagged ones with new seeds.

        ``keep_prefix``: a later stage continues these conversations (see GenRequest)."""
        prompts = [render(self.engine.renderer, conv) for conv in conversations]
        outputs = self._attempt(stage, items, prompts, max_new_tokens, list(range(len(items))), attempt=0,
                                keep_prefix=keep_prefix)
        # With greedy decoding a new seed gives the same text, so retrying would only cost time.
        retries = self.cfg.sampling.retries if self.cfg.sampling.temperature > 0 else 0
        for attempt in range(1, retries + 1):
            todo = [i for i, out in enumerate(outputs) if out.flags]
            if not todo:
                break
            retried = self._attempt(stage, items, prompts, max_new_tokens, todo, attempt)
            for i, new in zip(todo, retried):
                old = outputs[i]
                # every attempt's prefill was paid for, and each attempt is a request the cache may serve
                new.prefilled_tokens += old.prefilled_tokens
                new.requested_tokens += old.requested_tokens
                new.prefix_hits += old.prefix_hits
                new.cache_reported = new.cache_reported and old.cache_reported
                new.attempts = attempt + 1
                new.first_flags = old.first_flags if old.attempts > 1 else old.flags
                # keep the attempt with fewer problems; on a tie the newer one
                if len(new.flags) <= len(old.flags):
                    outputs[i] = new
                else:
                    old.attempts, old.first_flags = new.attempts, new.first_flags
                    old.prefilled_tokens, old.requested_tokens = new.prefilled_tokens, new.requested_tokens
                    old.prefix_hits, old.cache_reported = new.prefix_hits, new.cache_reported
        return outputs

    def _attempt(
        self, stage: str, items: list[ChunkItem], prompts: list[str], max_new_tokens: int, indices: list[int], attempt: int,
        keep_prefix: bool = False,
    ) -> list[StageOutput]:
        requests = [
            GenRequest(
                prompt=prompts[i],
                image=items[i].image,
                seed=request_seed(self.cfg.run.seed, items[i].key, stage, attempt),
                max_new_tokens=max_new_tokens,
                keep_prefix=keep_prefix,
            )
            for i in indices
        ]
        start = time.perf_counter()
        results = self.engine.generate(requests)
        self.engine_seconds += time.perf_counter() - start
        if len(results) != len(requests):
            raise RuntimeError(f"engine {self.engine.name} returned {len(results)} results for {len(requests)} requests")
        return [self._stage_output(res, req.seed) for res, req in zip(results, requests)]

    def _stage_output(self, result: GenResult, seed: int) -> StageOutput:
        text = clean_output(result.text)
        q = self.cfg.quality
        flags = quality_flags(text, result.finish_reason, q.repeat_ngram, q.max_ngram_repeats)
        return StageOutput(
            text=text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            output_tokens=result.output_tokens,
            seed=seed,
            prefilled_tokens=result.prefilled_tokens,
            requested_tokens=result.prompt_tokens,
            prefix_hits=int(result.prefilled_tokens < result.prompt_tokens),
            cache_reported=result.cache_reported,
            flags=flags,
        )
