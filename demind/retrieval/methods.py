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
* ``cirevl``, ``osrcir``, ``demind+mllm`` (on request): an MLLM's target description at query
  time, alone or mixed with De-MINDS's query (:mod:`demind.retrieval.mllm_methods`).
* ``<method>+deo`` (text-only, image+text, mapping-only, demind): the base method's query
  refined by DEO for negation (:class:`DEOMethod`, :mod:`demind.negation`); ``+deo`` solves
  DEO exactly (closed form), ``+deo-adam`` runs the paper's 20 Adam steps.

Every other method returns (B, D) L2-normalised query embeddings and keeps the gallery as is.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from demind.errors import InputError
from demind.backbone import FrozenCLIP
from demind.config import ConfigError
from demind.retrieval.methods_base import RetrievalMethod
from demind.retrieval.mllm_methods import build_mllm_method
from demind.retrieval.names import (
    DEO_BASES, DEO_METHODS, DEO_SUFFIXES, EXCLMM_METHODS, METHOD_LABELS, METHODS, MLLM_METHODS, ON_REQUEST_METHODS,
    split_rerank, unavailable_methods, unknown_methods)
from demind.retrieval.refs import Query
from demind.model import DeMinds
from demind.templates import PLACEHOLDER
from demind.negation import DEOConfig, Decomposer, RuleDecomposer, SubQueries, optimise

# Negatives are encoded as text with this template: the prefix every composed query starts
# with ("a photo of * , ...") and CLIP's standard prompt, so the negative sits where the
# queries' texts do; no article, since a negative may be plural or a mass noun ("people").
NEGATIVE_TEMPLATE = "a photo of {neg}"


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
                              f"toy benchmarks carry one (regenerate them with the current toyworld.benchmarks)")
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


class CombinerQuery(TrainedMethod):
    """A combiner trained on triplets (:mod:`demind.triplets`): f(reference feature, text feature)."""

    name = "combiner"

    def embed(self, ref_features, prompts, texts):
        text = self._text_embeddings(texts)
        return self.model(ref_features.to(text.device), text)


class ExclMMQuery(RetrievalMethod):
    """ExclMM: the query text through CLIP's text tower, its words' vectors for the z_q mask,
    the sparse text encoder and F_theta; the gallery through the sparse image encoder."""

    name = "exclmm"

    def __init__(self, backbone: FrozenCLIP, exclmm) -> None:
        super().__init__(backbone)
        self.exclmm = exclmm.to(backbone.device).eval()
        self._word_vectors: dict[str, torch.Tensor] = {}

    def _words(self, texts: list[str]) -> list[torch.Tensor]:
        words = [self.exclmm.words_of(t) for t in texts]
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


def checkpoint_kind(model) -> str | None:
    """"combiner" for a combiner trained on triplets, "demind" for a De-MINDS model, None for no model."""
    if model is None:
        return None
    return "combiner" if getattr(getattr(model, "cfg", None), "architecture", None) == "combiner" else "demind"


def parse_method_names(spec: str | list[str] | tuple[str, ...] | None, have_model: bool,
                       have_exclmm: bool = False, model_kind: str = "demind") -> list[str]:
    """``"demind,image-only"`` -> names, validated. None -> all methods the inputs allow.
    ``model_kind``: the loaded checkpoint's kind (:func:`checkpoint_kind`) when ``have_model``."""
    blocked = unavailable_methods(model_kind if have_model else None)
    if spec is None:
        defaults = [m for m in METHODS if m not in ON_REQUEST_METHODS and m not in blocked]
        return [m for m in defaults if have_exclmm or m not in EXCLMM_METHODS]
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = unknown_methods(names)
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS + DEO_METHODS)}")
    needs_model = [n for n in names if split_deo_name(n)[0] in blocked]
    if needs_model and not have_model:
        raise ConfigError(f"method(s) {needs_model} need a trained model: pass --checkpoint CKPT")
    if needs_model:
        wanted = "a combiner trained on triplets (demind-train-triplets)" if model_kind == "demind" else \
            "a De-MINDS checkpoint"
        raise ConfigError(f"method(s) {needs_model} need {wanted}; the checkpoint given is a {model_kind} one")
    if "exclmm" in names and not have_exclmm:
        raise ConfigError("method 'exclmm' needs a trained ExclMM: pass --exclmm runs/exclmm/exclmm.safetensors")
    return names


def method_label(name: str) -> str:
    """Display name: "demind+deo" -> "De-MINDS + DEO"; "osrcir+rerank" -> "OSrCIR (...) + MLLM re-rank";
    unknown names are shown as they are."""
    plain, reranked = split_rerank(name)
    if reranked:
        return method_label(plain) + " + MLLM re-rank"
    base, mode = split_deo_name(name)
    label = METHOD_LABELS.get(base, base)
    return label if mode is None else f"{label} + DEO" + (" (Adam)" if mode == "adam" else "")


def split_deo_name(name: str) -> tuple[str, str | None]:
    """``"demind+deo-adam"`` -> ("demind", "adam"); ``"demind"`` -> ("demind", None)."""
    for suffix, mode in sorted(DEO_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return name[: -len(suffix)], mode
    return name, None


def build_methods(names: list[str], backbone: FrozenCLIP, model: DeMinds | None, exclmm=None,
                  decomposer: Decomposer | None = None, deo: DEOConfig | None = None,
                  mllm=None) -> list[RetrievalMethod]:
    """Method objects for ``names`` (see :func:`parse_method_names`); ``exclmm`` a loaded ExclMM.

    ``+deo`` methods use ``decomposer`` (default: the rule decomposer) and ``deo`` (default:
    :class:`DEOConfig()`); the name's suffix sets the mode (``+deo`` exact, ``+deo-adam`` Adam).
    ``mllm``: a :class:`demind.mllm.MLLMRun`, for ``cirevl``, ``osrcir`` and ``demind+mllm``.
    """
    simple = {"image-only": ImageOnly, "text-only": TextOnly, "image+text": ImagePlusText, "oracle": Oracle}
    methods: list[RetrievalMethod] = []
    for name in names:
        base_name, mode = split_deo_name(name)
        if mode is not None:
            base = build_methods([base_name], backbone, model, mllm=mllm)[0]
            cfg = replace(deo, mode=mode) if deo is not None else DEOConfig(mode=mode)  # the name decides the mode
            methods.append(DEOMethod(base, decomposer or RuleDecomposer(), cfg, suffix=name[len(base_name):]))
        elif name in simple:
            methods.append(simple[name](backbone))
        elif name in MLLM_METHODS:
            methods.append(build_mllm_method(name, backbone, model, mllm))
        elif name == "exclmm":
            if exclmm is None:
                raise ConfigError("method 'exclmm' needs a trained ExclMM (--exclmm)")
            methods.append(ExclMMQuery(backbone, exclmm))
        elif name == "combiner":
            if checkpoint_kind(model) != "combiner":
                raise InputError("method 'combiner' needs a combiner checkpoint (demind-train-triplets)")
            methods.append(CombinerQuery(backbone, model))
        elif model is None:
            raise InputError(f"method {name!r} needs a trained model (checkpoint)")
        else:
            methods.append((DeMindsQuery if name == "demind" else MappingOnly)(backbone, model))
    return methods


class DEOMethod(RetrievalMethod):
    """A base method's query refined by DEO (:mod:`demind.negation`).

    Per query: e_o = the base method's query; the words it reads (``base.language``) are
    decomposed; a query without negatives keeps e_o exactly. Otherwise the positive sub-queries
    are the base method run on the positive text(s) (composed methods: the same reference
    with the positive prompt, e.g. "a photo of *"), the negatives are text embeddings of
    :data:`NEGATIVE_TEMPLATE`, and e_u comes from :func:`demind.negation.deo.optimise`.
    A positive with no words left (text methods: "remove the dog") restates nothing, so its
    sub-query is e_o itself.
    """

    def __init__(self, base: RetrievalMethod, decomposer: Decomposer, cfg: DEOConfig, suffix: str = "+deo",
                 negative_template: str = NEGATIVE_TEMPLATE) -> None:
        if base.name not in DEO_BASES:
            why = "reads no text, so DEO has nothing to decompose" if base.language is None else "has no DEO variant"
            raise InputError(f"method {base.name!r} {why}; DEO works with {', '.join(DEO_BASES)}")
        super().__init__(base.backbone)
        self.base = base
        self.decomposer = decomposer
        self.cfg = cfg
        self.name = base.name + suffix
        self.negative_template = negative_template
        self.touched = 0  # queries whose embedding DEO changed (had a negative), over all calls

    @property
    def label(self) -> str:
        return method_label(self.name)

    @property
    def language(self) -> str | None:
        return self.base.language

    def query_texts(self, queries: list[Query]) -> list[str]:
        return self.base.query_texts(queries)  # demind+mllm+deo: the base's descriptions, not the bare text

    def embed(self, ref_features, prompts, texts):
        e_o = self.base.embed(ref_features, prompts, texts)
        words = prompts if self.language == "prompts" else texts
        decompositions = self.decomposer.decompose(list(words))
        active = [i for i, d in enumerate(decompositions) if d.has_negation]
        if not active:
            return e_o
        self.touched += len(active)
        positives = self._positive_embeddings(ref_features, prompts, texts, decompositions, active, e_o)
        negatives = self._negative_embeddings([decompositions[i].negatives for i in active])
        sub = SubQueries.from_lists(positives, negatives, e_o.shape[1], e_o.device)
        out = e_o.clone()
        out[active] = optimise(e_o[active], sub, self.cfg).to(out.dtype)
        return out

    def _positive_embeddings(self, ref_features, prompts, texts, decompositions, active, e_o) -> list[torch.Tensor]:
        """Per active query, (P_b, D) positive sub-query embeddings through the base method."""
        rows: list[tuple[int, str]] = []
        for i in active:
            for text in decompositions[i].positive_texts:
                if self._is_usable_positive(text):
                    rows.append((i, text))
        encoded = torch.zeros(0, e_o.shape[1], device=e_o.device)
        if rows:
            index = torch.tensor([i for i, _ in rows], device=ref_features.device)
            new_words = [t for _, t in rows]
            sub_prompts = new_words if self.language == "prompts" else [prompts[i] for i, _ in rows]
            sub_texts = new_words if self.language == "texts" else [texts[i] for i, _ in rows]
            encoded = self.base.embed(ref_features[index], sub_prompts, sub_texts)
        out = []
        for i in active:
            mine = [encoded[k] for k, (j, _) in enumerate(rows) if j == i]
            out.append(torch.stack(mine) if mine else e_o[i : i + 1])
        return out

    def _is_usable_positive(self, text: str) -> bool:
        if self.language == "prompts":
            return text.count(PLACEHOLDER) == 1  # the template must keep its one placeholder
        return bool(text.strip())

    def _negative_embeddings(self, negatives: list[tuple[str, ...]]) -> list[torch.Tensor]:
        """Per active query, (N_b, D) normalised text embeddings of its negatives in the template."""
        flat = [self.negative_template.format(neg=n) for group in negatives for n in group]
        encoded = self._text_embeddings(flat)
        out, start = [], 0
        for group in negatives:
            out.append(encoded[start : start + len(group)])
            start += len(group)
        return out

