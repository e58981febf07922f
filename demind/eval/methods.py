"""The compared methods: each turns (reference image feature, prompt, text) into a query.

* ``demind``: the trained De-MINDS query t_hat (``DeMinds.compose``).
* ``mapping-only``: S* in the prompt, no intention module (``DeMinds.mapping_only``), the
  Pic2Word-style baseline from the same checkpoint.
* ``image-only``, ``text-only``, ``image+text`` (sum of the normalised embeddings): the
  backbone alone.
* ``exclmm``: a trained ExclMM (:mod:`demind.exclmm`) answering the query text; it maps the
  gallery into its own space (``map_gallery``) and scores by dot product (its Eq. 18).
* ``oracle`` (headroom check, only when asked for): the target's ground-truth description
  through the frozen text tower; needs benchmarks that carry one (the toy benchmarks).

Every other method returns (B, D) L2-normalised query embeddings and keeps the gallery as is.
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
    "exclmm": "ExclMM",
    "oracle": "Oracle (target's description)",
}
METHODS = tuple(METHOD_LABELS)
EXCLMM_METHODS = ("exclmm",)
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

    def map_gallery(self, gallery: torch.Tensor) -> torch.Tensor:
        """(N, D) normalised gallery features -> what ``embed``'s queries are scored against."""
        return gallery
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


class ExclMMQuery(RetrievalMethod):
    """ExclMM: the query text through CLIP's text tower, its words' vectors for the z_q mask,
    the sparse text encoder and F_theta; the gallery through the sparse image encoder."""

    name = "exclmm"

    def __init__(self, backbone: FrozenCLIP, exclmm) -> None:
        super().__init__(backbone)
        self.exclmm = exclmm.to(backbone.device).eval()
        self._word_vectors: dict[str, torch.Tensor] = {}

    def _words(self, texts: list[str]) -> list[torch.Tensor]:
        from demind.exclmm import words_of

        words = [words_of(t) for t in texts]
        new = sorted({w for ws in words for w in ws} - set(self._word_vectors))
        if new:  # each word once per evaluation
            pooled = F.normalize(self.backbone.encode_text(new).pooled.float(), dim=-1)
            self._word_vectors.update(zip(new, pooled))
        empty = torch.zeros(0, self.backbone.embed_dim, device=self.backbone.device)
        return [torch.stack([self._word_vectors[w] for w in ws]) if ws else empty for ws in words]

    def embed(self, ref_features, prompts, texts):
        clip = self.backbone.encode_text(texts).pooled
        needs_words = self.exclmm.uses_stage1 and self.exclmm.cfg["space"]["zc_mask"]
        return self.exclmm.encode_queries(clip, self._words(texts) if needs_words else None)

    def map_gallery(self, gallery):
        return self.exclmm.encode_images(gallery)


def parse_method_names(spec: str | list[str] | tuple[str, ...] | None, have_model: bool,
                       have_exclmm: bool = False) -> list[str]:
    """``"demind,image-only"`` -> names, validated. None -> all methods the inputs allow."""
    if spec is None:
        defaults = [m for m in METHODS if m not in ON_REQUEST_METHODS]
        names = defaults if have_model else [m for m in defaults if m not in CHECKPOINT_METHODS]
        return [m for m in names if have_exclmm or m not in EXCLMM_METHODS]
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    needs_model = [n for n in names if n in CHECKPOINT_METHODS]
    if needs_model and not have_model:
        raise ConfigError(f"method(s) {needs_model} need a trained model: pass --checkpoint CKPT")
    if "exclmm" in names and not have_exclmm:
        raise ConfigError("method 'exclmm' needs a trained ExclMM: pass --exclmm runs/exclmm/exclmm.safetensors")
    return names


def build_methods(names: list[str], backbone: FrozenCLIP, model: DeMinds | None,
                  exclmm=None) -> list[RetrievalMethod]:
    """Method objects for ``names`` (see :func:`parse_method_names`); ``exclmm`` a loaded ExclMM."""
    simple = {"image-only": ImageOnly, "text-only": TextOnly, "image+text": ImagePlusText, "oracle": Oracle}
    methods: list[RetrievalMethod] = []
    for name in names:
        if name in simple:
            methods.append(simple[name](backbone))
        elif name == "exclmm":
            if exclmm is None:
                raise ConfigError("method 'exclmm' needs a trained ExclMM (--exclmm)")
            methods.append(ExclMMQuery(backbone, exclmm))
        elif model is None:
            raise ValueError(f"method {name!r} needs a trained model (checkpoint)")
        else:
            methods.append((DeMindsQuery if name == "demind" else MappingOnly)(backbone, model))
    return methods
