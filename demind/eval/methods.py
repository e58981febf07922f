"""The compared methods: each turns (reference image feature, prompt, text) into a query.

* ``demind``: the trained De-MINDS query t_hat (``DeMinds.compose``).
* ``mapping-only``: S* in the prompt, no intention module (``DeMinds.mapping_only``), the
  Pic2Word-style baseline from the same checkpoint.
* ``image-only``, ``text-only``, ``image+text`` (sum of the normalised embeddings): the
  backbone alone.
* ``oracle`` (headroom check, only when asked for): the target's ground-truth description
  through the frozen text tower; needs benchmarks that carry one (the toy benchmarks).

Every method returns (B, D) L2-normalised query embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.config import ConfigError
from demind.eval.structures import Query
from demind.model import DeMinds

METHOD_LABELS = {
    "image-only": "Image-only",
    "text-only": "Text-only",
    "image+text": "Image+Text",
    "mapping-only": "Mapping only (Pic2Word-style)",
    "demind": "De-MINDS",
    "oracle": "Oracle (target's description)",
}
METHODS = tuple(METHOD_LABELS)
CHECKPOINT_METHODS = ("mapping-only", "demind")
ON_REQUEST_METHODS = ("oracle",)  # not in the default set: real benchmarks have no target descriptions


class RetrievalMethod:
    """Base: ``embed(ref_features (B, D) raw, prompts, texts) -> (B, D)`` normalised queries."""

    name = ""

    def __init__(self, backbone: FrozenCLIP) -> None:
        self.backbone = backbone

    @property
    def label(self) -> str:
        return METHOD_LABELS[self.name]

    def embed(self, ref_features: torch.Tensor, prompts: list[str], texts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def query_texts(self, queries: list[Query]) -> list[str]:
        """The ``texts`` given to :meth:`embed` for these queries (the baselines' text)."""
        return [q.text for q in queries]

    def _text_embeddings(self, texts: list[str]) -> torch.Tensor:
        """(B, D) normalised text embeddings; repeated texts (ImageNet-R domains) are encoded once."""
        unique = list(dict.fromkeys(texts))
        pooled = F.normalize(self.backbone.encode_text(unique).pooled, dim=-1)
        row = {t: i for i, t in enumerate(unique)}
        return pooled[torch.tensor([row[t] for t in texts], device=pooled.device)]


class ImageOnly(RetrievalMethod):
    name = "image-only"

    def embed(self, ref_features, prompts, texts):
        return F.normalize(ref_features.float(), dim=-1)


class TextOnly(RetrievalMethod):
    name = "text-only"

    def embed(self, ref_features, prompts, texts):
        return self._text_embeddings(texts)


class ImagePlusText(RetrievalMethod):
    name = "image+text"

    def embed(self, ref_features, prompts, texts):
        image = F.normalize(ref_features.float().to(self.backbone.device), dim=-1)
        return F.normalize(image + self._text_embeddings(texts), dim=-1)


class Oracle(RetrievalMethod):
    """Headroom: the target's ground-truth description as the query (no reference image)."""

    name = "oracle"

    def query_texts(self, queries: list[Query]) -> list[str]:
        missing = [q.qid for q in queries if q.target_description is None]
        if missing:
            raise ConfigError(f"method oracle needs each query's target description, which this benchmark does not "
                              f"have ({len(missing)} of {len(queries)} queries lack it, e.g. {missing[0]}); only the "
                              f"toy benchmarks carry one (regenerate them with the current demind.toy.benchmarks)")
        return [q.target_description for q in queries]

    def embed(self, ref_features, prompts, texts):
        return self._text_embeddings(texts)


class TrainedMethod(RetrievalMethod):
    """A method that needs the trained De-MINDS weights."""

    def __init__(self, backbone: FrozenCLIP, model: DeMinds) -> None:
        super().__init__(backbone)
        self.model = model


class MappingOnly(TrainedMethod):
    name = "mapping-only"

    def embed(self, ref_features, prompts, texts):
        return self.model.mapping_only(ref_features, prompts)


class DeMindsQuery(TrainedMethod):
    name = "demind"

    def embed(self, ref_features, prompts, texts):
        return self.model.compose(ref_features, prompts).t_hat


def parse_method_names(spec: str | list[str] | tuple[str, ...] | None, have_model: bool) -> list[str]:
    """``"demind,image-only"`` -> names, validated. None -> all methods the inputs allow."""
    if spec is None:
        defaults = [m for m in METHODS if m not in ON_REQUEST_METHODS]
        return defaults if have_model else [m for m in defaults if m not in CHECKPOINT_METHODS]
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    needs_model = [n for n in names if n in CHECKPOINT_METHODS]
    if needs_model and not have_model:
        raise ConfigError(f"method(s) {needs_model} need a trained model: pass --checkpoint CKPT")
    return names


def build_methods(names: list[str], backbone: FrozenCLIP, model: DeMinds | None) -> list[RetrievalMethod]:
    """Method objects for ``names`` (see :func:`parse_method_names`)."""
    simple = {"image-only": ImageOnly, "text-only": TextOnly, "image+text": ImagePlusText, "oracle": Oracle}
    methods: list[RetrievalMethod] = []
    for name in names:
        if name in simple:
            methods.append(simple[name](backbone))
        elif model is None:
            raise ValueError(f"method {name!r} needs a trained model (checkpoint)")
        else:
            methods.append((DeMindsQuery if name == "demind" else MappingOnly)(backbone, model))
    return methods
