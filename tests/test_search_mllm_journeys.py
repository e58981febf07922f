"""What a new user met with the MLLM methods in search, beyond the stores: a modification text holding
``*``, a gallery file deleted after indexing in a batch of queries, a negative with a ``+rerank``
method (CLI and page), and the wording of gallery errors."""

from __future__ import annotations

import json

import pytest

from demind.gen import GenResult
from demind.search.query import SearchError, SearchQuery

from test_search import one_torch_thread, write_image  # noqa: F401  (module fixtures)
from test_search_mllm import Renderer, index_dir, loaded, search_cli, searcher_with, setup_with  # noqa: F401


class RecordingEngine:
    """Answers every request "Target description: a photo" (yes/no logits aside) and keeps the prompts."""

    name = "scripted"
    model_id = "scripted"
    prefix_capacity_tokens = None

    def __init__(self) -> None:
        self.prompts: list[str] = []

    @property
    def renderer(self):
        return Renderer()

    def generate(self, requests):
        self.prompts += [r.prompt for r in requests]
        return [GenResult(text="Target description: a photo of a heart", finish_reason="stop", prompt_tokens=1,
                          output_tokens=1) for _ in requests]

    def count_tokens(self, texts):
        return [len(t.split()) for t in texts]

    def release_prefixes(self):
        pass


class KnowsNothing:
    """A verifier that scores every candidate alike (stands in for the MLLM's yes/no answer)."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def score(self, queries, candidates):
        self.asked.append([c.name for c in candidates[0]])
        return [[0.5 for _ in cands] for cands in candidates]


# ----------------------------------------------------------------------------- a '*' in the words


@pytest.mark.parametrize("method", ["osrcir", "cirevl"])
def test_a_star_in_the_modification_text_reaches_the_describer_whole(loaded, index_dir, method):  # noqa: F811
    engine = RecordingEngine()
    searcher = searcher_with(loaded, index_dir, setup_with(engine, store=None))
    text = "replace the * logo with a red heart"
    searcher.search(SearchQuery(image=searcher.index.path_of("img1.png"), text=text, method=method, k=3))
    assert any(text in prompt for prompt in engine.prompts), engine.prompts
