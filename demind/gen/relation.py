"""The triplet job's texts: versioned prompt files, the two conversations, and the instruction structure.

Prompt files live in ``demind/gen/triplet_prompts/<version>/`` (their README says what each holds):
the describer's ``describe.txt`` (both images in one user turn, source first), the writer's
``instruct.txt`` (all instructions as one JSON object) or ``instruct_one.txt`` (one a call), and
``examples.json``, the pool of in-context examples. Fields are filled in one pass
(:func:`demind.engines.fill_prompt`: captions and descriptions may hold braces). Every triplet records the version and each file's sha256.

The writer's answer has a validated structure, :func:`instructions_schema` (``{"instructions":
[str, ...]}``); :func:`parse_instructions` reads it out of an answer (the JSON object may sit among
other words) and says why an answer is not one.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demind.engines import Conversation, fill_prompt, user_turn
from demind.errors import InputError, MissingInputError
from demind.gen.quality import clean_output

PROMPT_ROOT = Path(__file__).resolve().parent / "triplet_prompts"
FILES = ("describe.txt", "instruct.txt", "instruct_one.txt", "examples.json")
FIELDS = {"describe.txt": ("{source_caption}", "{target_caption}"),
          "instruct.txt": ("{description}", "{count}", "{examples}"),
          "instruct_one.txt": ("{description}", "{examples}", "{previous}")}


def instructions_schema(count: int, max_chars: int) -> dict[str, Any]:
    """The JSON schema of the writer's answer: ``{"instructions": [count .. count strings]}``."""
    return {"type": "object", "additionalProperties": False, "required": ["instructions"],
            "properties": {"instructions": {"type": "array", "minItems": count, "maxItems": count,
                                            "items": {"type": "string", "minLength": 1, "maxLength": max_chars}}}}


@dataclass(frozen=True)
class TripletPrompts:
    version: str
    describe: str
    instruct: str
    instruct_one: str
    examples: tuple[dict[str, Any], ...]
    sha: dict[str, str]  # file name -> sha256 (first 12 hex digits), recorded with every triplet

    def examples_for(self, key: str, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` examples of the pool for one pair, drawn by a seed of (run seed, key): stable across reruns."""
        if n <= 0 or not self.examples:
            return []
        rng = random.Random(hashlib.sha256(f"{seed}:{key}:examples".encode()).hexdigest())
        return rng.sample(list(self.examples), min(n, len(self.examples)))


def load_triplet_prompts(version: str) -> TripletPrompts:
    """Prompt set ``version`` (a folder name under demind/gen/triplet_prompts/ or a folder path)."""
    folder = Path(version) if Path(version).is_dir() else PROMPT_ROOT / version
    if not folder.is_dir():
        available = sorted(p.name for p in PROMPT_ROOT.iterdir() if p.is_dir())
        raise MissingInputError(f"prompts.version={version!r}: no folder {folder}; available versions: {available} "
                                f"(or a path to a folder with {', '.join(FILES)})")
    texts = {}
    for name in FILES:
        path = folder / name
        if not path.is_file():
            raise MissingInputError(f"prompt file {path} is missing; a triplet prompt set needs {', '.join(FILES)}")
        texts[name] = path.read_text(encoding="utf-8").strip()
    for name, fields in FIELDS.items():
        for f in fields:
            if texts[name].count(f) != 1:
                raise InputError(f"prompt file {folder / name} must contain {f} exactly once")
    try:
        examples = json.loads(texts["examples.json"])
        assert isinstance(examples, list) and all(
            isinstance(e, dict) and isinstance(e.get("description"), str) and isinstance(e.get("instructions"), list)
            for e in examples)
    except (ValueError, AssertionError):
        raise InputError(f"{folder / 'examples.json'} must be a JSON list of {{\"description\": str, "
                         f"\"instructions\": [str, ...]}}") from None
    sha = {name: hashlib.sha256(texts[name].encode()).hexdigest()[:12] for name in FILES}
    return TripletPrompts(folder.name, texts["describe.txt"], texts["instruct.txt"], texts["instruct_one.txt"],
                          tuple(examples), sha)


def describe_conversation(prompts: TripletPrompts, source_caption: str, target_caption: str) -> Conversation:
    """The describer's one turn: the source image, the target image, then the text."""
    return [user_turn(fill_prompt(prompts.describe, source_caption=source_caption, target_caption=target_caption),
                      with_image=2)]


def _examples_text(examples: list[dict[str, Any]], as_json: bool) -> str:
    if not examples:
        return ""
    lines = ["Examples:"]
    for e in examples:
        answer = json.dumps({"instructions": e["instructions"]}) if as_json else e["instructions"][0]
        lines.append(f'Description: "{e["description"]}"\nAnswer: {answer}')
    return "\n".join(lines)


def instruct_conversation(prompts: TripletPrompts, description: str, count: int,
                          examples: list[dict[str, Any]]) -> Conversation:
    """The writer's turn, text only: every instruction at once, as JSON."""
    return [user_turn(fill_prompt(prompts.instruct, description=description, count=str(count),
                           examples=_examples_text(examples, as_json=True)), with_image=False)]


def instruct_one_conversation(prompts: TripletPrompts, description: str, examples: list[dict[str, Any]],
                              previous: list[str]) -> Conversation:
    """The writer's turn for one more instruction, different from ``previous``."""
    before = ("Already written (write a different one): " + "; ".join(f'"{p}"' for p in previous)) if previous else ""
    return [user_turn(fill_prompt(prompts.instruct_one, description=description, previous=before,
                           examples=_examples_text(examples, as_json=False)), with_image=False)]


class InstructionError(ValueError):
    """An answer that is not the instruction structure (the reason is the message)."""


def _json_candidates(text: str) -> list[str]:
    """The text itself, then each span from a '{' to the last '}' (an object among other words)."""
    out = [text.strip()]
    end = text.rfind("}")
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        if end > start:
            out.append(text[start:end + 1])
    return out


def parse_instructions(text: str, count: int, max_chars: int, min_words: int) -> list[str]:
    """The instructions of a writer's answer ``{"instructions": [...]}``: cleaned, distinct, at most
    ``max_chars`` and at least ``min_words`` words each; the first ``count``. Raises
    :class:`InstructionError` saying why the answer is not that structure."""
    data = None
    for candidate in _json_candidates(text):
        try:
            data = json.loads(candidate)
            break
        except ValueError:
            continue
    if data is None:
        raise InstructionError("no JSON object in the answer")
    items = data.get("instructions") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(items, list):
        raise InstructionError("no 'instructions' list in the JSON answer")
    return valid_instructions([i for i in items if isinstance(i, str)], count, max_chars, min_words)


def valid_instructions(items: list[str], count: int, max_chars: int, min_words: int) -> list[str]:
    """The first ``count`` distinct valid instructions of ``items``, or :class:`InstructionError`."""
    kept: list[str] = []
    for item in items:
        text = clean_output(item)
        if text and len(text) <= max_chars and len(text.split()) >= min_words \
                and text.lower() not in {k.lower() for k in kept}:
            kept.append(text)
    if len(kept) < count:
        raise InstructionError(f"{len(kept)} valid instruction(s) of the {count} asked")
    return kept[:count]
