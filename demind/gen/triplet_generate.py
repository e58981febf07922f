"""``TripletGenerator``: a chunk of image pairs -> relation descriptions -> retrieval instructions.

Stage 1 (describer, an MLLM): both images in one prompt (source, then target) and their captions
-> a description in MegaPairs's form ("Both images ... However, the source image ..., whereas the
target image ..."). A flagged description (empty, refusal, repetitive, cut at the token limit) is
retried with a new seed ``sampling.retries`` times and the attempt with the fewest flags is kept;
an empty or refused one fails the pair.

Stage 2 (writer, an LLM on text alone; the describer's model or another): ``instructions.count``
instructions from the description and in-context examples. Mode ``json``: one call answers
``{"instructions": [...]}``, decoded under that JSON schema where the engine offers structured
output (vLLM), else parsed; an answer that is not the structure is retried, then the pair is a
counted failure. Mode ``each``: one call per instruction (different from those already written),
the structure built here; any model can follow it, at ``count`` calls per pair.

Every request's seed derives from (run.seed, pair key, stage, attempt): the texts do not depend on
batching, chunking or the distributor.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from demind.engines import Engine, GenRequest, GenResult, render, request_seed
from demind.gen.quality import clean_output, quality_flags
from demind.gen.relation import (
    InstructionError, TripletPrompts, describe_conversation, instruct_conversation, instruct_one_conversation,
    instructions_schema, parse_instructions, valid_instructions)
from demind.gen.triplet_config import TripletGenConfig

FAILING_FLAGS = ("empty", "refusal")  # a description with one of these fails its pair (after the retries)


@dataclass
class PairItem:
    """One pair as the generator sees it: images already shrunk to ``io.image_max_side``."""

    key: str
    source_image: Image.Image
    target_image: Image.Image
    source_caption: str
    target_caption: str


@dataclass
class Usage:
    """Calls and tokens of one pair, per stage ("describe", "instruct")."""

    calls: Counter = field(default_factory=Counter)
    prompt_tokens: Counter = field(default_factory=Counter)
    output_tokens: Counter = field(default_factory=Counter)

    def add(self, stage: str, result: GenResult) -> None:
        self.calls[stage] += 1
        self.prompt_tokens[stage] += result.prompt_tokens
        self.output_tokens[stage] += result.output_tokens


@dataclass
class TripletOutput:
    """What the two stages made of one pair: ``error`` is None when it has its instructions."""

    description: str = ""
    description_flags: list[str] = field(default_factory=list)
    description_attempts: int = 0
    instructions: list[str] = field(default_factory=list)
    instruction_attempts: int = 0
    instruction_retries: int = 0  # calls beyond the one each instruction (mode each) or the pair (json) needs
    error: str | None = None
    usage: Usage = field(default_factory=Usage)


class TripletGenerator:
    """The two stages on a chunk of pairs; ``describer`` and ``writer`` may be one engine."""

    def __init__(self, describer: Engine, writer: Engine, prompts: TripletPrompts, cfg: TripletGenConfig):
        self.describer, self.writer, self.prompts, self.cfg = describer, writer, prompts, cfg
        self.engine_seconds = 0.0
        # greedy decoding gives a retry the same text: one attempt
        self.attempts = cfg.sampling.retries + 1 if cfg.sampling.temperature > 0 else 1
        ins = cfg.instructions
        self.schema = instructions_schema(ins.count, ins.max_chars)

    def _run(self, engine: Engine, requests: list[GenRequest]) -> list[GenResult]:
        start = time.perf_counter()
        try:
            return engine.generate(requests) if requests else []
        finally:
            self.engine_seconds += time.perf_counter() - start

    def generate(self, items: list[PairItem]) -> list[TripletOutput]:
        """Outputs in the order of ``items``."""
        outs = [TripletOutput() for _ in items]
        self.describe(items, outs)
        ready = [(item, out) for item, out in zip(items, outs) if out.error is None]
        if self.cfg.instructions.mode == "json":
            self.write_json(ready)
        else:
            self.write_each(ready)
        return outs

    def describe(self, items: list[PairItem], outs: list[TripletOutput]) -> None:
        """Stage 1 with retries of flagged descriptions; the fewest flags win, earliest first."""
        s = self.cfg.sampling
        best: list[tuple[int, str, list[str]] | None] = [None] * len(items)
        todo = list(range(len(items)))
        for attempt in range(self.attempts):
            if not todo:
                break
            requests = [GenRequest(render(self.describer.renderer, describe_conversation(
                self.prompts, items[i].source_caption, items[i].target_caption)), items[i].source_image,
                request_seed(self.cfg.run.seed, items[i].key, "describe", attempt), s.description_max_tokens,
                more_images=(items[i].target_image,)) for i in todo]
            again = []
            for i, result in zip(todo, self._run(self.describer, requests)):
                outs[i].usage.add("describe", result)
                outs[i].description_attempts = attempt + 1
                text = clean_output(result.text)
                flags = quality_flags(text, result.finish_reason)
                if best[i] is None or len(flags) < len(best[i][2]):
                    best[i] = (attempt, text, flags)
                if flags:
                    again.append(i)
            todo = again
        for out, (_, text, flags) in zip(outs, best):
            out.description, out.description_flags = text, flags
            failing = [f for f in flags if f in FAILING_FLAGS]
            if failing:
                out.error = f"description {failing[0]}"

    def write_json(self, ready: list[tuple[PairItem, TripletOutput]]) -> None:
        """Stage 2, mode json: one call per pair; an answer that does not parse is retried."""
        s, ins = self.cfg.sampling, self.cfg.instructions
        todo = ready
        reasons: dict[int, str] = {}
        for attempt in range(self.attempts):
            if not todo:
                break
            requests = [GenRequest(render(self.writer.renderer, instruct_conversation(
                self.prompts, out.description, ins.count,
                self.prompts.examples_for(item.key, self.cfg.prompts.examples, self.cfg.run.seed))), None,
                request_seed(self.cfg.run.seed, item.key, "instruct", attempt), s.instruction_max_tokens,
                json_schema=self.schema) for item, out in todo]
            again = []
            for (item, out), result in zip(todo, self._run(self.writer, requests)):
                out.usage.add("instruct", result)
                out.instruction_attempts = attempt + 1
                out.instruction_retries += attempt > 0
                try:
                    out.instructions = parse_instructions(result.text, ins.count, ins.max_chars, ins.min_words)
                except InstructionError as e:
                    reasons[id(out)] = str(e)
                    again.append((item, out))
            todo = again
        for _, out in todo:
            out.error = f"unparsable instructions ({reasons[id(out)]})"

    def write_each(self, ready: list[tuple[PairItem, TripletOutput]]) -> None:
        """Stage 2, mode each: instruction after instruction, each different from the ones before."""
        s, ins = self.cfg.sampling, self.cfg.instructions
        for slot in range(ins.count):
            todo = [(item, out) for item, out in ready if out.error is None]
            for attempt in range(self.attempts):
                if not todo:
                    break
                requests = [GenRequest(render(self.writer.renderer, instruct_one_conversation(
                    self.prompts, out.description,
                    self.prompts.examples_for(item.key, self.cfg.prompts.examples, self.cfg.run.seed),
                    out.instructions)), None, request_seed(self.cfg.run.seed, item.key, f"instruct{slot}", attempt),
                    s.instruction_max_tokens) for item, out in todo]
                again = []
                for (item, out), result in zip(todo, self._run(self.writer, requests)):
                    out.usage.add("instruct", result)
                    out.instruction_attempts += 1
                    out.instruction_retries += attempt > 0
                    try:
                        out.instructions = valid_instructions(out.instructions + [result.text], slot + 1,
                                                              ins.max_chars, ins.min_words)
                    except InstructionError:
                        again.append((item, out))
                todo = again
            for _, out in todo:
                out.error = f"invalid instruction {slot + 1} of {ins.count}"

    def record(self) -> dict[str, Any]:
        """The models and prompts every triplet records (``generation``)."""
        s = self.cfg.sampling
        return {"describer": {"engine": self.describer.name, "model": self.describer.model_id},
                "writer": {"engine": self.writer.name, "model": self.writer.model_id},
                "prompt_version": self.prompts.version, "prompt_sha": dict(self.prompts.sha),
                "instruction_mode": self.cfg.instructions.mode,
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": self.cfg.run.seed,
                             "description_max_tokens": s.description_max_tokens,
                             "instruction_max_tokens": s.instruction_max_tokens}}
