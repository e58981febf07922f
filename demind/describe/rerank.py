"""MLLM re-ranking of a method's top K: a verifier scores each (reference + modification, candidate)
pair, the top K is re-ordered by score, the rest of the ranking is kept as it was.

:class:`MLLMVerifier` asks the model, with the reference and the candidate images in one user
turn (``verify.txt``), whether the candidate shows what the user wants, and scores
log p(yes) - log p(no) of the first answer token from one forward pass (no decoding). It needs
the model's logits, so it runs on the transformers engine (the vLLM engine's generate() does not
return them here). Scores are stored like descriptions (:class:`RecordStore`, id
``<query>|<candidate>``), so a rerun re-ranks without loading the model.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from demind.describe.config import RerankOptions
from demind.describe.describers import DescriberPrompts, LazyEngine, fill, modification_text, shrink
from demind.describe.store import RecordStore
from demind.errors import InputError
from demind.gen import render
from demind.retrieval import ImageRef, Query, load_image

log = logging.getLogger(__name__)


class Verifier(Protocol):
    def score(self, queries: list[Query], candidates: list[list[ImageRef]]) -> list[list[float]]:
        """Per query, one score per candidate (higher: a better match)."""
        ...


def rerank_ranking(ranking: list[str], scores: list[float]) -> list[str]:
    """``ranking``'s first ``len(scores)`` names sorted by score (ties keep their order), the rest unchanged."""
    k = len(scores)
    order = sorted(range(k), key=lambda i: -scores[i])  # sorted() is stable: equal scores keep the base order
    return [ranking[i] for i in order] + ranking[k:]


class Reranker:
    """Re-orders each query's top ``k`` with ``verifier``."""

    def __init__(self, verifier: Verifier, k: int) -> None:
        self.verifier = verifier
        self.k = k

    def rerank(self, queries: list[Query], rankings: dict[str, list[str]],
               gallery: dict[str, ImageRef]) -> dict[str, list[str]]:
        tops = [rankings[q.qid][: self.k] for q in queries]
        scores = self.verifier.score(queries, [[gallery[n] for n in top] for top in tops])
        return {q.qid: rerank_ranking(rankings[q.qid], s) for q, s in zip(queries, scores)}


class MLLMVerifier:
    """Yes/no log-probability of the MLLM on [reference, candidate] images (see the module docstring)."""

    def __init__(self, engine: LazyEngine, prompts: DescriberPrompts, options: RerankOptions, store: RecordStore,
                 image_max_side: int = 672) -> None:
        self.engine = engine
        self.prompts = prompts
        self.options = options
        self.store = store
        self.image_max_side = image_max_side
        self.generated = 0

    def score(self, queries: list[Query], candidates: list[list[ImageRef]]) -> list[list[float]]:
        pairs = [(q, c) for q, cands in zip(queries, candidates) for c in cands]
        missing = list({self._id(q, c): (q, c) for q, c in pairs if self._id(q, c) not in self.store}.values())
        chunk = 64 * self.options.batch_size
        for start in range(0, len(missing), chunk):
            part = missing[start:start + chunk]
            scores = self._score_pairs(part)
            self.store.add({self._id(q, c): {"qid": q.qid, "candidate": c.name, "score": s}
                            for (q, c), s in zip(part, scores)})
            self.generated += len(part)
        return [[self.store.records[self._id(q, c)]["score"] for c in cands] for q, cands in zip(queries, candidates)]

    @staticmethod
    def _id(query: Query, candidate: ImageRef) -> str:
        return f"{query.qid}|{candidate.name}"

    def _answer_ids(self, tokenizer: Any) -> tuple[int, int]:
        ids = []
        for word in (self.options.yes, self.options.no):
            tokens = tokenizer(word, add_special_tokens=False).input_ids
            if not tokens or tokens[0] == tokenizer.unk_token_id:
                raise InputError(f"rerank.yes/no: the model's tokenizer has no token for {word!r}; name answer words "
                                 f"it knows (rerank.yes=..., rerank.no=...)")
            ids.append(tokens[0])
        if ids[0] == ids[1]:
            raise InputError(f"rerank.yes={self.options.yes!r} and rerank.no={self.options.no!r} start with the same "
                             f"token; pick two words that differ in their first token")
        return ids[0], ids[1]

    @torch.inference_mode()
    def _score_pairs(self, pairs: list[tuple[Query, ImageRef]]) -> list[float]:
        engine = self.engine.get()
        model, processor = getattr(engine, "model", None), getattr(engine, "processor", None)
        if model is None or processor is None or not hasattr(model, "forward"):
            raise InputError(f"re-ranking reads the model's answer probabilities, which the {engine.name} engine does "
                             f"not return here: run it with engine.name=transformers")
        yes, no = self._answer_ids(processor.tokenizer)
        images: dict[str, Any] = {}

        def image(ref: ImageRef):
            if ref.name not in images:
                images[ref.name] = shrink(load_image(ref), self.image_max_side)
            return images[ref.name]

        out: list[float] = []
        for start in range(0, len(pairs), self.options.batch_size):
            batch = pairs[start:start + self.options.batch_size]
            texts = [render(processor, [{"role": "user", "content": [
                        {"type": "image"}, {"type": "image"},
                        {"type": "text", "text": fill(self.prompts.verify, modification=modification_text(q))}]}])
                     for q, _ in batch]
            flat = [im for q, c in batch for im in (image(q.reference), image(c))]
            inputs = processor(images=flat, text=texts, return_tensors="pt", padding=True)
            inputs = inputs.to(engine.device, dtype=engine.dtype)
            # left padding (the engine sets it): the last position is every row's next-token prediction
            logits = model(**inputs).logits[:, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            out += (logp[:, yes] - logp[:, no]).cpu().tolist()
        return out

    def summary(self) -> dict[str, Any]:
        return {"k": self.options.k, "pairs_stored": len(self.store), "scored_now": self.generated,
                "store": str(self.store.folder), "model_loaded": self.engine.loaded}
