"""Versioned prompt texts and the conversations of the two generation stages.

Prompt text lives in ``demind/gen/prompts/<version>/{rewrite,intent,single}.txt``.
Conversations use the Hugging Face chat format and are rendered by the model's own processor
(:func:`demind.engines.render`), so the same prompts work for Mistral-, Vicuna- or any other chat format.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from demind.engines import Conversation, assistant_turn, check_prompt_fits, fill_prompt, user_turn
from demind.errors import InputError, MissingInputError

PROMPT_ROOT = Path(__file__).resolve().parent / "prompts"
CAPTION_FIELD = "{caption}"


@dataclass(frozen=True)
class PromptSet:
    version: str
    rewrite: str  # contains {caption}
    intent: str
    single: str  # contains {caption}
    sha: str  # short hash of the three texts, recorded with every sample

    def fill(self, template: str, caption: str) -> str:
        # one pass, not str.format: captions may contain braces
        return fill_prompt(template, caption=caption)


def load_prompts(version: str) -> PromptSet:
    """Load prompt set ``version`` (a name under demind/gen/prompts/ or a folder path)."""
    folder = Path(version) if Path(version).is_dir() else PROMPT_ROOT / version
    if not folder.is_dir():
        available = sorted(p.name for p in PROMPT_ROOT.iterdir() if p.is_dir())
        raise MissingInputError(
            f"prompt version {version!r} not found: no folder {folder}; available versions: {available} "
            "(or pass prompts.version=/path/to/folder with rewrite.txt, intent.txt, single.txt)"
        )
    texts = {}
    for name in ("rewrite", "intent", "single"):
        path = folder / f"{name}.txt"
        if not path.is_file():
            raise MissingInputError(f"prompt file {path} is missing; a prompt set needs rewrite.txt, intent.txt, single.txt")
        texts[name] = path.read_text(encoding="utf-8").strip()
    for name in ("rewrite", "single"):
        if texts[name].count(CAPTION_FIELD) != 1:
            raise InputError(f"prompt file {folder / (name + '.txt')} must contain {CAPTION_FIELD} exactly once")
    digest = hashlib.sha256("\x00".join(texts[n] for n in ("rewrite", "intent", "single")).encode()).hexdigest()
    return PromptSet(version=folder.name, sha=digest[:12], **texts)


def rewrite_conversation(prompts: PromptSet, caption: str) -> Conversation:
    """Stage 1: the image and T_ori -> T_rew."""
    return [user_turn(prompts.fill(prompts.rewrite, caption), with_image=True)]


def intent_conversation(prompts: PromptSet, caption: str, rewritten: str) -> Conversation:
    """Stage 2: the same conversation continued with the model's T_rew -> T_int."""
    return rewrite_conversation(prompts, caption) + [
        assistant_turn(rewritten),
        user_turn(prompts.intent, with_image=False),
    ]


def single_conversation(prompts: PromptSet, caption: str) -> Conversation:
    """The w/o-CoT ablation: the image and T_ori -> T_int in one turn."""
    return [user_turn(prompts.fill(prompts.single, caption), with_image=True)]


def check_intent_prompt_fits(cfg, prompts: PromptSet) -> None:
    """``engine.max_model_len`` against the job's longest request, before any engine starts: stage 2
    (stage 1's prompt, its answer of up to ``rewrite_max_tokens``, the intent turn) and its
    ``intent_max_tokens``; in single-prompt mode the one prompt. ``cfg``: a GenConfig."""
    s = cfg.sampling
    if cfg.prompts.mode == "cot":
        # a word a token: as long an answer as stage 1 may write
        conversation = intent_conversation(prompts, "", " ".join(["word"] * s.rewrite_max_tokens))
        what = "the intent stage's prompt (the rewrite stage's prompt and answer, then the intent turn)"
    else:
        conversation, what = single_conversation(prompts, ""), "the single-prompt mode's prompt"
    check_prompt_fits(cfg.engine, conversation, 1, cfg.io.image_max_side, s.intent_max_tokens, what)
