"""ExclCOCO query texts written by an LLM through the data_gen engines (``query_source="llm"``).

The few-shot prompt is ``demind/gen/exclusion_prompts/<version>.txt``; the builder
(:func:`demind.exclcoco_builder.build_exclcoco`) keeps the template text wherever the LLM's output is
flagged or does not name the excluded label.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

from demind.errors import InputError, MissingInputError
from demind.imaging import decode_image

PROMPT_ROOT = Path(__file__).resolve().parent / "exclusion_prompts"


def load_exclusion_prompt(version: str) -> tuple[str, str]:
    """(prompt text with {caption} {include} {exclude}, sha) of ``exclusion_prompts/<version>.txt``."""
    path = Path(version) if Path(version).is_file() else PROMPT_ROOT / f"{version}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in PROMPT_ROOT.glob("*.txt"))
        raise MissingInputError(f"exclusion prompt {version!r} not found ({path}); available: {known}")
    text = path.read_text(encoding="utf-8").strip()
    for slot in ("{caption}", "{include}", "{exclude}"):
        if text.count(slot) != 1:
            raise InputError(f"exclusion prompt {path} must contain {slot} exactly once")
    return text, hashlib.sha256(text.encode()).hexdigest()[:12]


def llm_query_writer(engine: Any, prompt_version: str = "v1", seed: int = 0, max_new_tokens: int = 40,
                     image_max_side: int = 672, repeat_ngram: int = 3, max_ngram_repeats: int = 2) -> Callable:
    """An ``llm`` for :func:`build_exclcoco` on a data_gen engine (vLLM or transformers).

    Each request: the positive image and the few-shot prompt with the caption, include and
    exclude labels; per-request seed from (seed, query id). Outputs are cleaned and checked
    with data_gen's quality rules; a flagged output is None (the builder keeps the template).
    """

    from demind.engines import GenRequest, fill_prompt, render, request_seed, user_turn
    from demind.gen.quality import clean_output, quality_flags

    prompt, sha = load_exclusion_prompt(prompt_version)

    def write(queries: list[dict[str, Any]]) -> list[str | None]:
        requests = []
        for q in queries:
            path = Path(q["image_path"])
            if not path.is_file():
                raise MissingInputError(f"image {path} of query {q['id']} does not exist (check --image-root)")
            image = decode_image(path, orient=True, max_side=image_max_side)
            # one pass: a caption or label that holds "{exclude}" is not filled again
            text = fill_prompt(prompt, caption=q["positive_query"], include=", ".join(q["include"]), exclude=q["exclude"])
            rendered = render(engine.renderer, [user_turn(text, with_image=True)])
            requests.append(GenRequest(rendered, image, request_seed(seed, q["id"], "exclusion", 0), max_new_tokens))
        out = []
        for result in engine.generate(requests):
            text = clean_output(result.text)
            flags = quality_flags(text, result.finish_reason, repeat_ngram, max_ngram_repeats)
            out.append(None if flags else text)
        return out

    write.record = {"version": prompt_version, "sha": sha, "engine": getattr(engine, "name", "?"),
                    "model": getattr(engine, "model_id", "?")}
    return write
