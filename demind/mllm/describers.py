"""Describers: (reference image, modification text) -> target description(s), through a data_gen engine.

* :class:`CIReVLDescriber` (CIReVL, ICLR'24): the MLLM captions the reference, then the same
  model, text only, rewrites the caption with the modification.
* :class:`OSrCIRDescriber` (OSrCIR, CVPR'25): one call with the image and the modification, a
  reflective chain of thought (reference, intent, reflection, target), the description parsed
  from the answer (:mod:`demind.mllm.parse`).

``describe.samples`` > 1 draws several descriptions per query (seeds per sample; LDRE's
ensemble, weighted by the method: :mod:`demind.retrieval.mllm_methods`). Every answer is kept in
a :class:`~demind.mllm.store.AnswerStore` chunk by chunk, keyed by what it depends on (the
model's content, the reference's pixels, the modification text, the prompt texts, the settings);
the engine is built only when a query has no stored answer (:class:`LazyEngine`). An answer without
a parsable description is counted, logged, and replaced by the modification text alone
(:func:`modification_text`).

Seeds derive from (``describe.seed``, query id, stage, sample): with ``describe.temperature`` > 0
a query asked again under another id finds the sample stored for the same content, a valid draw.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from demind.mllm.config import DESCRIBE_PROMPT_ROOT, PROMPT_FILES, DescribeOptions
from demind.mllm.parse import parse_description
from demind.mllm.store import AnswerStore
from demind.errors import InputError, MissingInputError
from demind.imaging import resize_longest_side
from demind.engines import Engine, GenRequest, fill_prompt, render, request_seed, user_turn
from demind.templates import PLACEHOLDER, TEMPLATES
from demind.retrieval import Query, load_image

log = logging.getLogger(__name__)

LOGGED_EXAMPLES = 3  # unparsable answers shown in the log per call (all are counted and stored)


@dataclass(frozen=True)
class DescriberPrompts:
    """One version of the describer prompts; ``sha``: short hash of all four texts."""

    version: str
    sha: str
    caption: str
    rewrite: str
    osrcir: str
    verify: str

    @property
    def id(self) -> str:
        return f"{self.version}@{self.sha}"


def load_describer_prompts(version: str = "v1") -> DescriberPrompts:
    """``demind/gen/prompts/describe/<version>/`` (or a folder path) with caption, rewrite, osrcir, verify.txt."""
    folder = Path(version) if Path(version).is_dir() else DESCRIBE_PROMPT_ROOT / version
    if not folder.is_dir():
        available = sorted(p.name for p in DESCRIBE_PROMPT_ROOT.iterdir() if p.is_dir())
        raise MissingInputError(f"describer prompt version {version!r} not found: no folder {folder}; available: "
                                f"{available} (or pass describe.prompts=/path/to/folder)")
    texts = {}
    for name, fields in PROMPT_FILES.items():
        path = folder / f"{name}.txt"
        if not path.is_file():
            raise MissingInputError(f"prompt file {path} is missing; a describer prompt set needs "
                                    f"{', '.join(n + '.txt' for n in PROMPT_FILES)}")
        texts[name] = path.read_text(encoding="utf-8").strip()
        for f in fields:
            if texts[name].count(f) != 1:
                raise InputError(f"prompt file {path} must contain {f} exactly once")
    digest = hashlib.sha256("\x00".join(texts[n] for n in PROMPT_FILES).encode()).hexdigest()[:12]
    return DescriberPrompts(version=folder.name, sha=digest, **texts)


def modification_text(query: Query) -> str:
    """The words of the request: ``query.text``, without the ``a photo of * ,`` template head where the
    benchmark's baseline text is the whole prompt (FashionIQ's released protocol). Only that head goes:
    a ``*`` in a user's own words ("replace the * logo") is part of the request."""
    text = query.text
    head = TEMPLATES["cirr"].split(PLACEHOLDER, 1)[0] + PLACEHOLDER  # "a photo of *"
    if text == query.prompt and text.startswith(head):
        text = text[len(head):].lstrip(" ,")
    return text.strip() or query.text


class LazyEngine:
    """Builds the engine on first use: a run whose answers are all stored never loads the model."""

    def __init__(self, factory: Callable[[], Engine]) -> None:
        self.factory = factory
        self._engine: Engine | None = None

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def get(self) -> Engine:
        if self._engine is None:
            self._engine = self.factory()
        return self._engine


class Describer:
    """Base: stored answers first, the engine for the rest, fallback counted (see the module docstring)."""

    kind = ""

    def __init__(self, engine: LazyEngine, prompts: DescriberPrompts, options: DescribeOptions,
                 store: AnswerStore) -> None:
        self.engine = engine
        self.prompts = prompts
        self.options = options
        self.store = store
        self.generated = 0  # records answered by the model in this process
        self._told: set[str] = set()  # keys whose fallback was already logged
        self._used: dict[tuple[str, int], str] = {}  # (query id, sample) -> key, of the answers handed out

    def keys(self, queries: list[Query]) -> dict[tuple[str, int], str]:
        """(query id, sample) -> the answer's store key (:meth:`AnswerStore.key`)."""
        return {(q.qid, s): self.store.key(image=self.store.image_digest(q.reference), text=modification_text(q),
                                           sample=s)
                for q in queries for s in range(self.options.samples)}

    def _missing(self, queries: list[Query], keys: dict[tuple[str, int], str]) -> list[tuple[Query, int]]:
        """(query, sample) pairs without a stored answer, one per key (equal content is asked once)."""
        missing: dict[str, tuple[Query, int]] = {}
        for q in queries:
            for s in range(self.options.samples):
                if keys[q.qid, s] not in self.store:
                    missing.setdefault(keys[q.qid, s], (q, s))
        return list(missing.values())

    def describe(self, queries: list[Query]) -> list[list[str]]:
        """Per query, ``options.samples`` descriptions (the modification text where the answer had none)."""
        samples = range(self.options.samples)
        keys = self.keys(queries)
        missing = self._missing(queries, keys)
        if missing and self.store.rekey_from_model(self.engine.get):  # key by the files before generating
            keys = self.keys(queries)
            missing = self._missing(queries, keys)
        chunk = self.options.chunk * self.options.samples
        shared = self.store.ingredients()
        for start in range(0, len(missing), chunk):
            part = missing[start:start + chunk]
            answered = self._answer(part)
            self.store.add({keys[q.qid, s]: {**record, "image_sha256": self.store.image_digest(q.reference), **shared}
                            for (q, s), record in zip(part, answered)})
            self.generated += len(answered)
            log.info("%s: %d of %d descriptions generated (%s)", self.kind, start + len(part), len(missing),
                     self.store.folder)
        self.store.save_digests()
        out = [[self._description(q, self.store.records[keys[q.qid, s]]) for s in samples] for q in queries]
        self._used.update(keys)
        new = [(q, keys[q.qid, s]) for q in queries for s in samples
               if self.store.records[keys[q.qid, s]]["description"] is None and keys[q.qid, s] not in self._told]
        new = list({key: (q, key) for q, key in new}.values())
        if new:
            self._told.update(key for _, key in new)
            log.warning("%s: %d of %d answers have no parsable target description; the modification text alone "
                        "stands in for them (counts by reason: results.json mllm.describers.%s.fallback_reasons)",
                        self.kind, len(new), len(queries) * self.options.samples, self.kind)
            for q, key in new[:LOGGED_EXAMPLES]:
                r = self.store.records[key]
                log.warning("%s: no target description for query %s (%s): %r", self.kind, q.qid, r["status"],
                            r["raw"][:160])
        return out

    @staticmethod
    def _description(query: Query, record: dict[str, Any]) -> str:
        return record["description"] if record["description"] is not None else modification_text(query)

    def summary(self) -> dict[str, Any]:
        """Counts over the answers this process used (``records``; ``stored``: all the store holds of this
        kind, other runs' included): parsed, truncated-but-kept, fallbacks by reason."""
        status = Counter(self.store.records[key]["status"] for key in self._used.values())
        fallback = {k: v for k, v in status.items() if k not in ("ok", "truncated")}
        return {"records": len(self._used), "stored": len(self.store), "generated_now": self.generated,
                "parsed": status["ok"],
                "truncated_kept": status["truncated"], "fallback": sum(fallback.values()),
                "fallback_reasons": fallback, "damaged": self.store.damaged, "store": str(self.store.folder),
                "prompts": self.prompts.id, "model_loaded": self.engine.loaded}

    def _seed(self, key: str, stage: str, sample: int) -> int:
        return request_seed(self.options.seed, key, stage, sample)

    def _images(self, queries: list[Query]) -> dict[str, Image.Image]:
        """Each distinct reference (by pixel digest) decoded once, shrunk to ``describe.image_max_side``."""
        out: dict[str, Image.Image] = {}
        for q in queries:
            digest = self.store.image_digest(q.reference)
            if digest not in out:
                out[digest] = resize_longest_side(load_image(q.reference), self.options.image_max_side)
        return out

    def _image(self, images: dict[str, Image.Image], query: Query) -> Image.Image:
        return images[self.store.image_digest(query.reference)]

    def _answer(self, part: list[tuple[Query, int]]) -> list[dict[str, Any]]:
        """One record per (query, sample) of ``part``, in order."""
        raise NotImplementedError

    @staticmethod
    def _record(query: Query, sample: int, raw: str, finish: str, require_label: bool,
                **extra: Any) -> dict[str, Any]:
        parsed = parse_description(raw, truncated=finish == "length", require_label=require_label)
        return {"qid": query.qid, "sample": sample, "reference": query.reference.name,
                "modification": modification_text(query), **extra, "raw": raw, "finish_reason": finish,
                "description": parsed.description, "status": parsed.status}


class OSrCIRDescriber(Describer):
    """One image + modification call; the description after the last ``Target description:`` label."""

    kind = "osrcir"

    def _answer(self, part):
        engine = self.engine.get()
        images = self._images([q for q, _ in part])
        requests = [GenRequest(prompt=render(engine.renderer, [user_turn(
                        fill_prompt(self.prompts.osrcir, modification=modification_text(q)), with_image=True)]),
                        image=self._image(images, q), seed=self._seed(q.qid, "osrcir", s),
                        max_new_tokens=self.options.max_tokens) for q, s in part]
        results = engine.generate(requests)
        return [self._record(q, s, r.text, r.finish_reason, require_label=True) for (q, s), r in zip(part, results)]


class CIReVLDescriber(Describer):
    """Caption the reference (image call), then rewrite it with the modification (text-only call)."""

    kind = "cirevl"

    def _answer(self, part):
        engine = self.engine.get()
        images = self._images([q for q, _ in part])
        # one caption per (reference pixels, sample): CIRR references recur across queries
        first = {}
        for q, s in part:
            first.setdefault((self.store.image_digest(q.reference), s), q)
        caption_prompt = render(engine.renderer, [user_turn(self.prompts.caption, with_image=True)])
        results = engine.generate([GenRequest(prompt=caption_prompt, image=images[digest],
                                              seed=self._seed(q.reference.name, "caption", s),
                                              max_new_tokens=self.options.caption_max_tokens)
                                   for (digest, s), q in first.items()])
        captions = {}
        for key, r in zip(first, results):
            parsed = parse_description(r.text, truncated=r.finish_reason == "length", require_label=False)
            captions[key] = (r.text, parsed.description)
        records: list[dict[str, Any] | None] = [None] * len(part)
        to_rewrite = []
        for i, (q, s) in enumerate(part):
            raw_caption, caption = captions[(self.store.image_digest(q.reference), s)]
            if caption is None:  # nothing to rewrite: the query falls back, its caption answer kept
                records[i] = {**self._record(q, s, raw_caption, "stop", require_label=False, caption_raw=raw_caption,
                                             caption=None), "description": None, "status": "caption-empty"}
            else:
                to_rewrite.append((i, q, s, raw_caption, caption))
        if to_rewrite:
            requests = [GenRequest(prompt=render(engine.renderer, [user_turn(
                            fill_prompt(self.prompts.rewrite, caption=caption, modification=modification_text(q)),
                            with_image=False)]),
                            image=None, seed=self._seed(q.qid, "rewrite", s),
                            max_new_tokens=self.options.rewrite_max_tokens) for _, q, s, _, caption in to_rewrite]
            for (i, q, s, raw_caption, caption), r in zip(to_rewrite, engine.generate(requests)):
                records[i] = self._record(q, s, r.text, r.finish_reason, require_label=False,
                                          caption_raw=raw_caption, caption=caption)
        return records


DESCRIBER_CLASSES = {"cirevl": CIReVLDescriber, "osrcir": OSrCIRDescriber}
