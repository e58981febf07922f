"""Versioned prompt texts and the conversations of the two generation stages.

Prompt text lives in ``demind/gen/prompts/<version>/{rewrite,intent,single}.txt``.
Conversations use the Hugging Face chat format (content lists with ``{"type": "image"}``)
and are rendered by the model's own processor (``apply_chat_template``), so the same
prompts work for Mistral-, Vicuna- or any other LLaVA chat format.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from demind.errors import InputError, MissingInputError

logger = logging.getLogger(__name__)

PROMPT_ROOT = Path(__file__).resolve().parent / "prompts"
# Older llava-hf LLaVA-NeXT chat templates end assistant turns with '<\\s>' (in the Jinja source; it
# renders as the literal text <\s>) where '</s>' was meant: the typo would reach stage 2's prompt as
# four characters instead of the end-of-sequence token that closes turn 1.
_EOS_TYPO = re.compile(r"<\\{1,2}s>")
CAPTION_FIELD = "{caption}"

Conversation = list[dict[str, Any]]


class ChatTemplateRenderer(Protocol):
    """Anything with a Hugging Face ``apply_chat_template`` (a processor or tokenizer)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class PromptSet:
    version: str
    rewrite: str  # contains {caption}
    intent: str
    single: str  # contains {caption}
    sha: str  # short hash of the three texts, recorded with every sample

    def fill(self, template: str, caption: str) -> str:
        # str.replace, not str.format: captions may contain braces.
        return template.replace(CAPTION_FIELD, caption)


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


def user_turn(text: str, with_image: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image"}] if with_image else []
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def assistant_turn(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


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


def repaired_chat_template(template: str) -> str:
    """``template`` with the ``<\\s>`` typo of older llava-hf templates written as ``</s>`` (what the
    current templates say); any other template comes back unchanged."""
    return _EOS_TYPO.sub("</s>", template)


_repaired_told: set[str] = set()


def render(renderer: ChatTemplateRenderer, conversation: Conversation) -> str:
    """The prompt string the model sees, with the generation prompt (e.g. ``ASSISTANT:``) appended.

    A template with the ``<\\s>`` typo is rendered repaired (:func:`repaired_chat_template`)."""
    template = getattr(renderer, "chat_template", None)
    if template is None:
        raise InputError(
            "the model's processor has no chat template; pick a chat model (e.g. llava-hf/llava-v1.6-mistral-7b-hf) "
            "or save a processor with a chat_template"
        )
    kwargs = {}
    if isinstance(template, str) and _EOS_TYPO.search(template):
        kwargs["chat_template"] = repaired_chat_template(template)
        if template not in _repaired_told:
            _repaired_told.add(template)
            logger.warning("the model's chat template ends assistant turns with the typo '<\\s>': rendered with '</s>' "
                           "(the end-of-sequence token), as current llava-hf templates do")
    return renderer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
