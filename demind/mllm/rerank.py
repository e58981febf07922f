"""MLLM re-ranking of a method's top K: a verifier scores each (reference + modification, candidate)
pair, the top K is re-ordered by score, the rest of the ranking is kept as it was.

:class:`MLLMVerifier` asks the model, with the reference and the candidate images in one user
turn (``verify.txt``: the reference, the modification, then ``{candidate}``, the candidate image, and
the question), whether the candidate shows what the user wants, and scores log p(yes) - log p(no)
of the first answer token from one forward pass (no decoding); the part before the candidate is
prefilled once per query (``rerank.prefix_reuse``). On the transformers engine the score is
read from the model's logits here; an engine that scores tokens itself (``score_next_token``: the vLLM
engine, from vLLM's log-probabilities of the two answer tokens) is asked for the same two numbers, its
prefix cache serving the shared part. Scores are stored like descriptions (:class:`AnswerStore`, kind ``verify``: the
key adds the candidate's pixels to the reference's and the modification text), so a rerun re-ranks
without loading the model.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

import torch

from demind.mllm.config import RerankOptions
from demind.mllm.describers import DescriberPrompts, LazyEngine, modification_text
from demind.mllm.store import AnswerStore
from demind.imaging import resize_longest_side
from demind.errors import InputError
from demind.engines import fill_prompt, render
from demind.retrieval import ImageRef, Query, load_image

log = logging.getLogger(__name__)

CANDIDATE_FIELD = "{candidate}"  # where verify.txt puts the candidate image (after it: the question)


def cache_argument(module: Any) -> str:
    """The KV-cache argument of ``module.forward``: transformers 5 renamed ``past_key_values`` to ``cache``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


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
    """Yes/no log-probability of the MLLM on [reference, candidate] images (see the module docstring).

    ``rerank.prefix_reuse`` (default): per query, the prompt up to the candidate (system text, the
    reference image's tokens, the modification) is prefilled once, and its KV cache is shared by the
    query's K candidates, whose suffixes (candidate image + question) run in right-padded batches;
    positions continue from the prefix, so the scores equal a full prefill's up to float rounding
    (tested). Off: every (reference, candidate) prompt is prefilled whole, left-padded.
    """

    def __init__(self, engine: LazyEngine, prompts: DescriberPrompts, options: RerankOptions, store: AnswerStore,
                 image_max_side: int = 672) -> None:
        self.engine = engine
        self.prompts = prompts
        self.options = options
        self.store = store
        self.image_max_side = image_max_side
        self.generated = 0
        self.prefilled_tokens = 0  # prompt tokens run through the model in this process (reuse shows here)
        self._used: dict[tuple[str, str], str] = {}  # (query id, candidate) -> key, of the scores used

    def score(self, queries: list[Query], candidates: list[list[ImageRef]]) -> list[list[float]]:
        keys = self._keys(queries, candidates)
        pending = self._pending(queries, candidates, keys)
        if pending and self.store.rekey_from_model(self.engine.get):  # key by the files before scoring
            keys = self._keys(queries, candidates)
            pending = self._pending(queries, candidates, keys)
        shared = self.store.ingredients()
        chunk: list[tuple[Query, list[ImageRef]]] = []
        for i, item in enumerate(pending):  # stored in parts of about 64 queries: a kill loses one part
            chunk.append(item)
            if len(chunk) == 64 or i == len(pending) - 1:
                records = {}
                for q, cands in chunk:
                    for c, s in zip(cands, self._score_query(q, cands)):
                        records[keys[q.qid, c.name]] = {"qid": q.qid, "candidate": c.name, "score": s,
                                                        "modification": modification_text(q), **shared}
                self.store.add(records)
                self.generated += len(records)
                chunk = []
        self.store.save_digests()
        self._used.update(keys)
        return [[self.store.records[keys[q.qid, c.name]]["score"] for c in cands]
                for q, cands in zip(queries, candidates)]

    def _keys(self, queries: list[Query], candidates: list[list[ImageRef]]) -> dict[tuple[str, str], str]:
        """(query id, candidate name) -> the score's store key: the reference's and the candidate's pixels,
        the modification text, and the store's shared part (model content, verify.txt, settings)."""
        pixels = self.store.image_digest
        return {(q.qid, c.name): self.store.key(image=pixels(q.reference), text=modification_text(q),
                                                candidate=pixels(c))
                for q, cands in zip(queries, candidates) for c in cands}

    def _pending(self, queries: list[Query], candidates: list[list[ImageRef]],
                 keys: dict[tuple[str, str], str]) -> list[tuple[Query, list[ImageRef]]]:
        """Per query, its distinct candidates without a stored score (an equal pair is scored once)."""
        seen: set[str] = set()
        pending = []
        for q, cands in zip(queries, candidates):
            todo = []
            for c in {c.name: c for c in cands}.values():
                key = keys[q.qid, c.name]
                if key not in self.store and key not in seen:
                    seen.add(key)
                    todo.append(c)
            if todo:
                pending.append((q, todo))
        return pending

    def check_answer_words(self, model_folder: Any) -> None:
        """Refuse answer words the model's tokenizer has no token for, reading only its tokenizer files
        (no model) from ``model_folder``; without them (the files not here) the check waits for the model."""
        if model_folder is None:
            return
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 -- no tokenizer to read here: the check runs when the model loads
            log.debug("rerank.yes/no: the tokenizer of %s cannot be read without the model (%s)", model_folder, e)
            return
        self._answer_ids(tokenizer)

    def _answer_ids(self, tokenizer: Any) -> tuple[int, int]:
        ids = []
        for name, word in (("yes", self.options.yes), ("no", self.options.no)):
            tokens = tokenizer(word, add_special_tokens=False).input_ids
            if not tokens or tokens[0] == tokenizer.unk_token_id:
                raise InputError(f"rerank.{name}={word!r}: the model's tokenizer has no token for it; name an answer "
                                 f"word it knows (rerank.yes=..., rerank.no=...)")
            ids.append(tokens[0])
        if ids[0] == ids[1]:
            raise InputError(f"rerank.yes={self.options.yes!r} and rerank.no={self.options.no!r} start with the same "
                             f"token; pick two words that differ in their first token")
        return ids[0], ids[1]

    def _model(self) -> tuple[Any, Any, Any]:
        """(engine, model, processor); an engine without logits (vLLM here) is one clear error."""
        engine = self.engine.get()
        model, processor = getattr(engine, "model", None), getattr(engine, "processor", None)
        if model is None or processor is None or not hasattr(model, "lm_head"):
            raise InputError(f"re-ranking reads the model's answer probabilities, which the {engine.name} engine does "
                             f"not return: run it with engine.name=transformers or engine.name=vllm")
        return engine, model, processor

    def _prompt(self, processor: Any, query: Query) -> str:
        # split at the candidate first, then fill: the user's words may hold "{candidate}" themselves
        before, after = (fill_prompt(part, modification=modification_text(query))
                         for part in self.prompts.verify.split(CANDIDATE_FIELD))
        return render(processor, [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": before.strip()},
            {"type": "image"}, {"type": "text", "text": after.strip()}]}])

    def _score_query_on_engine(self, engine: Any, query: Query, candidates: list[ImageRef]) -> list[float]:
        """One query's candidates scored by the engine's ``score_next_token`` (vLLM), ``rerank.batch_size`` a call."""
        processor = engine.renderer
        yes, no = self._answer_ids(processor.tokenizer)
        reference = resize_longest_side(load_image(query.reference), self.image_max_side)
        prompt = self._prompt(processor, query)
        out: list[float] = []
        for start in range(0, len(candidates), self.options.batch_size):
            batch = [resize_longest_side(load_image(c), self.image_max_side) for c in candidates[start:start + self.options.batch_size]]
            scored = engine.score_next_token([(prompt, [reference, c]) for c in batch], [yes, no],
                                             reuse_prefix=self.options.prefix_reuse)
            self.prefilled_tokens += sum(s.prefilled_tokens for s in scored)
            out += [s.logprobs[0] - s.logprobs[1] for s in scored]
        return out

    @torch.inference_mode()
    def _score_query(self, query: Query, candidates: list[ImageRef]) -> list[float]:
        """One query's candidates, in batches of ``rerank.batch_size``."""
        if hasattr(self.engine.get(), "score_next_token"):
            return self._score_query_on_engine(self.engine.get(), query, candidates)
        engine, model, processor = self._model()
        yes, no = self._answer_ids(processor.tokenizer)
        reference = resize_longest_side(load_image(query.reference), self.image_max_side)
        prompt = self._prompt(processor, query)
        image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        prefix: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        out: list[float] = []
        for start in range(0, len(candidates), self.options.batch_size):
            batch = [resize_longest_side(load_image(c), self.image_max_side) for c in candidates[start:start + self.options.batch_size]]
            inputs = processor(images=[im for c in batch for im in (reference, c)], text=[prompt] * len(batch),
                               return_tensors="pt", padding=True)
            if not self.options.prefix_reuse:
                inputs = inputs.to(engine.device, dtype=engine.dtype)
                hidden = model.model(**inputs).last_hidden_state[:, -1]  # left padding: the last position is real
                self.prefilled_tokens += int(inputs["attention_mask"].sum())
            else:
                rows = [ids[mask.bool()] for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
                if prefix is None:
                    prefix = self._prefill(model, engine, rows[0], inputs, image_id)
                hidden = self._suffixes(model, engine, rows, inputs, prefix)
            logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
            out += (logp[:, yes] - logp[:, no]).cpu().tolist()
        return out

    def _prefill(self, model: Any, engine: Any, ids: torch.Tensor, inputs: Any, image_id: int
                 ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(prefix length n, per-layer (keys, values) of the prompt before the candidate image's tokens)."""
        from transformers import DynamicCache

        is_image = (ids == image_id).int()
        starts = (((is_image[1:] - is_image[:-1]) == 1).nonzero().flatten() + 1).tolist()  # image-token runs
        starts = [0] * int(is_image[0]) + starts
        if len(starts) != 2:
            raise ValueError(f"the verify prompt rendered {len(starts)} image blocks, expected 2 (reference, candidate)")
        n = starts[1]  # everything before the candidate's image tokens
        cache = DynamicCache()
        model.model(input_ids=ids[None, :n].to(engine.device),
                    pixel_values=inputs["pixel_values"][0:1].to(engine.device, dtype=engine.dtype),
                    image_sizes=inputs["image_sizes"][0:1].to(engine.device), use_cache=True,
                    **{cache_argument(model.model): cache})
        self.prefilled_tokens += n
        return n, [(layer.keys, layer.values) for layer in cache.layers]

    def _suffixes(self, model: Any, engine: Any, rows: list[torch.Tensor], inputs: Any,
                  prefix: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        """(B, hidden) at each row's last token: the suffixes right-padded after the shared prefix."""
        n, layers = prefix
        suffixes = [r[n:] for r in rows]
        width = max(len(s) for s in suffixes)
        ids = torch.full((len(rows), width), engine.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), n + width, dtype=torch.long)
        mask[:, :n] = 1
        for i, s in enumerate(suffixes):
            ids[i, : len(s)] = s
            mask[i, n : n + len(s)] = 1
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(k.expand(len(rows), -1, -1, -1).contiguous(),
                                              v.expand(len(rows), -1, -1, -1).contiguous()) for k, v in layers])
        hidden = model.model(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                             pixel_values=inputs["pixel_values"][1::2].to(engine.device, dtype=engine.dtype),
                             image_sizes=inputs["image_sizes"][1::2].to(engine.device), use_cache=True,
                             **{cache_argument(model.model): cache}).last_hidden_state
        self.prefilled_tokens += sum(len(s) for s in suffixes)
        last = torch.tensor([len(s) - 1 for s in suffixes], device=hidden.device)
        return hidden[torch.arange(len(rows), device=hidden.device), last]

    def summary(self) -> dict[str, Any]:
        return {"k": self.options.k, "pairs": len(self._used), "pairs_stored": len(self.store),
                "scored_now": self.generated,
                "damaged": self.store.damaged,
                "prefix_reuse": self.options.prefix_reuse, "prefilled_tokens": self.prefilled_tokens,
                "store": str(self.store.folder), "model_loaded": self.engine.loaded}
