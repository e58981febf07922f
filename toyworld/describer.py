"""A toy MLLM for the query-time family (``cirevl``, ``osrcir``, ``demind+mllm``: docs/mllm.md): an engine
behind demind's ``Engine`` interface that answers the describer prompts by reading the toy CIRR's scenes.

It stands in for an MLLM whose reasoning is right except for stated failure rates, as the toy
annotators stand in for people. Per (query, sample), drawn from the query id (reproducible):

* ``p_ignore``: the change is not applied -- the answer describes the reference scene (the commonest
  failure of real describers: a caption of the reference);
* ``p_drop``: one object of the target scene is left out of the description (a missed detail);
* ``p_garble``: the answer has no ``Target description:`` label (it exercises the counted fallback to
  the modification text);
* otherwise the target scene's description, in a fresh phrasing (its own rng: not the oracle's text).

CIReVL's caption requests get the reference scene's description, its rewrite requests the answer
above. The scenes come from the caption file's image names (``dev-<set>-<member>-img0``) rebuilt with
:func:`toyworld.cirr.cirr_set` for the benchmark's version; an engine for another toy CIRR version or
implicit share than the files were written with would read other scenes (the config must match).
Requests are matched to queries by their seeds (``request_seed(describe.seed, query id, stage,
sample)``), which the describers derive the same way.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from demind.settings import setting
from demind.engines import GenResult, request_seed
from toyworld.cirr import cirr_set
from toyworld.texts import full_description
from toyworld.world import WORLD_VERSION
from demind.seeding import derive_seed

_NAME = re.compile(r"^dev-(\d+)-(\d+)-img0$")


@dataclass(frozen=True)
class ToyDescriberNoise:
    """Failure rates of the toy describer (see the module docstring); all 0 = a perfect reasoner."""

    p_ignore: float = 0.0
    p_drop: float = 0.0
    p_garble: float = 0.0

    def __post_init__(self) -> None:
        if min(self.p_ignore, self.p_drop, self.p_garble) < 0 or self.p_ignore + self.p_drop + self.p_garble > 1:
            raise ValueError(f"toy describer rates must be >= 0 and sum to at most 1: {self}")


# The quickstart's toy MLLM methods (on the toy CIRR only: the other toy benchmarks have no scenes to read).
FAMILY_METHODS = ("osrcir", "cirevl", "demind+mllm")


@dataclass
class ToyMLLMConfig:
    """The quickstart's toy MLLM: whether it runs the query-time family, and its noise model.

    The default level (p_ignore 0.2, p_drop 0.1, p_garble 0.05: about one answer in three goes wrong)
    was chosen before the quickstart reported the family; docs/quickstart.md says why."""

    family: bool = setting(True, help="also evaluate osrcir, cirevl and demind+mllm on the toy CIRR, "
                                      "their descriptions from the toy MLLM (toyworld/describer.py)")
    p_ignore: float = setting(0.2, ge=0, le=1, help="share of answers that ignore the change (describe the reference)")
    p_drop: float = setting(0.1, ge=0, le=1, help="share of answers that leave one object of the target out")
    p_garble: float = setting(0.05, ge=0, le=1, help="share of answers without a 'Target description:' label "
                                                     "(the counted fallback to the modification text)")

    @property
    def noise(self) -> ToyDescriberNoise:
        return ToyDescriberNoise(self.p_ignore, self.p_drop, self.p_garble)


def toy_model_id(cirr_version: str, implicit_share: float, noise: ToyDescriberNoise) -> str:
    """The toy MLLM's identity in the description stores: the world, the toy CIRR it reads and its noise
    model (another level, version or world never reuses these answers)."""
    return (f"toy-scenes_{WORLD_VERSION}_{cirr_version}_share{implicit_share}"
            f"_ignore{noise.p_ignore}_drop{noise.p_drop}_garble{noise.p_garble}")


def toy_mllm_setup(cirr_root: str | Path, cirr_version: str, implicit_share: float, noise: ToyDescriberNoise):
    """An :class:`demind.mllm.MLLMSetup` whose engine is the toy MLLM for the toy CIRR under
    ``cirr_root``, built (reading the queries) only when a stored answer is missing."""
    from demind.mllm import MLLMSetup

    def build() -> "ToySceneEngine":
        from demind.eval import read_benchmark

        return ToySceneEngine(read_benchmark("cirr", cirr_root).groups[0].queries, cirr_version, implicit_share, noise)

    model = toy_model_id(cirr_version, implicit_share, noise)  # a program without files: its name is its content
    return MLLMSetup(build, model=model, engine_name=ToySceneEngine.name, content_identity=model)


def toy_outcomes(cirr_root: str | Path, cirr_version: str, implicit_share: float,
                 noise: ToyDescriberNoise) -> dict[str, int]:
    """How many of the toy CIRR's queries the toy MLLM answers right / ignoring the change / dropping an
    object / garbled (one sample each; a drop on a one-object target stays right)."""
    from demind.eval import read_benchmark

    queries = read_benchmark("cirr", cirr_root).groups[0].queries
    return dict(ToySceneEngine(queries, cirr_version, implicit_share, noise).outcomes)


class _Renderer:
    """The toy engine's chat template: the turns' texts joined (its prompts are never tokenised)."""

    chat_template = "toy"

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        return " ".join(item.get("text", "<image>") for turn in conversation for item in turn["content"])


class ToySceneEngine:
    """The toy MLLM (see the module docstring); ``queries``: the toy CIRR's, ``samples`` per query."""

    name = "toy-scenes"
    prefix_capacity_tokens = None

    def __init__(self, queries: list[Any], cirr_version: str, implicit_share: float,
                 noise: ToyDescriberNoise = ToyDescriberNoise(), seed: int = 0, samples: int = 1) -> None:
        self.noise = noise
        self.model_id = toy_model_id(cirr_version, implicit_share, noise)
        self.outcomes: dict[str, int] = {"target": 0, "ignore": 0, "drop": 0, "garble": 0}
        self._sets: dict[int, Any] = {}
        self._version, self._share = cirr_version, implicit_share
        self._answers: dict[int, str] = {}
        for q in queries:
            ref = self._scene(q.reference.name)
            for s in range(samples):
                self._answers[request_seed(seed, q.reference.name, "caption", s)] = self._describe(ref, q.reference.name)
                answer = self._answer(q, ref, s)
                self._answers[request_seed(seed, q.qid, "osrcir", s)] = answer
                self._answers[request_seed(seed, q.qid, "rewrite", s)] = answer

    @property
    def renderer(self) -> _Renderer:
        return _Renderer()

    def _scene(self, name: str):
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not a toy CIRR member name (dev-<set>-<member>-img0)")
        set_id, member = int(match.group(1)), int(match.group(2))
        if set_id not in self._sets:
            self._sets[set_id] = cirr_set(self._version, set_id, self._share)[0]
        return self._sets[set_id].members[member]

    @staticmethod
    def _describe(scene: Any, *key: Any) -> str:
        return full_description(scene, random.Random(derive_seed("toy-describer", "phrasing", *key)))

    def _answer(self, query: Any, reference: Any, sample: int) -> str:
        rng = random.Random(derive_seed("toy-describer", "noise", query.qid, sample))
        target = self._scene(query.targets[0])
        draw, n = rng.random(), self.noise
        if draw < n.p_garble:
            kind, text = "garble", "The image shows some shapes; the user wants something different."
        elif draw < n.p_garble + n.p_ignore:
            kind, text = "ignore", self._describe(reference, query.qid, sample, "ignore")
        elif draw < n.p_garble + n.p_ignore + n.p_drop and len(target.objects) > 1:
            kept = list(target.objects)
            kept.pop(rng.randrange(len(kept)))
            kind, text = "drop", self._describe(replace(target, objects=tuple(kept)), query.qid, sample, "drop")
        else:
            kind, text = "target", self._describe(target, query.qid, sample)
        self.outcomes[kind] += 1
        if kind == "garble":
            return text
        return f"Reference: a toy scene.\nIntent: apply the change.\nReflection: done.\nTarget description: {text}"

    def generate(self, requests: list[Any]) -> list[GenResult]:
        out = []
        for r in requests:
            text = self._answers.get(r.seed)
            if text is None:
                raise KeyError(f"the toy describer has no answer for request seed {r.seed} (a query it was not "
                               f"built for, or another describe.seed)")
            out.append(GenResult(text=text, finish_reason="stop", prompt_tokens=0, output_tokens=len(text.split())))
        return out

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def release_prefixes(self) -> None:
        pass
