"""Chat conversations in the Hugging Face format and their rendering by the model's own template.

Conversations are content lists with ``{"type": "image"}`` entries; :func:`render` turns one into
the prompt string with the processor's ``apply_chat_template``, so the same conversation works for
Mistral-, Vicuna-, Qwen- or any other chat format. Every prompt an engine runs (generation, the
describers, re-ranking, the negation rewriter, the triplet job) is rendered here.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from demind.errors import InputError

logger = logging.getLogger(__name__)

# Older llava-hf LLaVA-NeXT chat templates end assistant turns with '<\\s>' (in the Jinja source; it
# renders as the literal text <\s>) where '</s>' was meant: the typo would reach stage 2's prompt as
# four characters instead of the end-of-sequence token that closes turn 1.
_EOS_TYPO = re.compile(r"<\\{1,2}s>")

Conversation = list[dict[str, Any]]


class ChatTemplateRenderer(Protocol):
    """Anything with a Hugging Face ``apply_chat_template`` (a processor or tokenizer)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def fill_prompt(template: str, **values: str) -> str:
    """``{name}`` fields of a prompt ``template`` replaced by ``values``, in one pass over the template:
    a value is never read again, so a user's text or a model's caption that holds braces ("put the
    {candidate} logo on it", a caption with "{modification}") is inserted as it is (not
    ``str.format``, not one ``str.replace`` after another)."""
    if not values:
        return template
    pattern = re.compile("|".join(re.escape("{" + name + "}") for name in values))
    return pattern.sub(lambda m: values[m.group(0)[1:-1]], template)


def user_turn(text: str, with_image: bool | int) -> dict[str, Any]:
    """A user turn: ``with_image`` image placeholders (True: one) before the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(int(with_image))]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def assistant_turn(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


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
    if _text_only_tokenizer(renderer):
        conversation = [{**turn, "content": _joined_text(turn["content"])} for turn in conversation]
    return renderer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)


def _text_only_tokenizer(renderer: Any) -> bool:
    """A text-only model's tokenizer (its processor): no image processor of its own."""
    return hasattr(renderer, "convert_tokens_to_ids") and not hasattr(renderer, "image_processor")


def _joined_text(content: Any) -> Any:
    """A turn's text items as one string, what text-only chat templates expect (Llama 3's trims it);
    content with an image item is left as it is (a text-only model is refused images when it runs)."""
    if isinstance(content, str) or any(item.get("type") != "text" for item in content):
        return content
    return "".join(item["text"] for item in content)
