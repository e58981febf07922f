"""The inference layer beneath evaluation and search: what turns images and composed queries
into embeddings and compares them.

* :mod:`~demind.retrieval.refs` -- :class:`ImageRef` (a file, a tar member or a COCO region) and
  :class:`Query`, read through the one decoder (:func:`load_image` -> :mod:`demind.imaging`);
* :mod:`~demind.retrieval.cache` -- batched gallery encoding (:func:`encode_image_refs`) into the
  gallery parts of the one embedding cache (:class:`ImageFeatureCache`, key rule in
  :mod:`demind.embedding_cache`);
* :mod:`~demind.retrieval.methods` -- the method registry: how each method turns a query into an
  embedding (``demind``, ``mapping-only``, the frozen baselines, ``exclmm``, ``+deo`` variants;
  the MLLM-description methods of :mod:`~demind.retrieval.mllm_methods`).

Evaluation (:mod:`demind.eval`: benchmark readers, metrics, protocols, reports) and search
(:mod:`demind.search`: index, CLI, page) both import this package's face, never each other's
modules.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.retrieval.refs import (
        IMAGE_EXTENSIONS, LEFT_OUT_ADVICE, RESIZE_MODES, ImageReadError, ImageRef, Query, canonical_name, load_image,
        reword, strip_image_extension)
    from demind.io import file_version  # the one rule of a changed file: ImageRef.version
    from demind.retrieval.cache import (
        DamagedPartError, EncodeStats, ImageFeatureCache, ImageRefDataset, backbone_cache_slug, encode_image_refs,
        image_transforms, squash_preprocess, stack_features)
    from demind.retrieval.cache_upgrade import adopt_unoriented, is_earlier_part
    from demind.retrieval.names import (
        CHECKPOINT_METHODS, COMBINER_METHODS, DEO_BASES, DEO_METHODS, DESCRIBED_METHODS, EXCLMM_METHODS, HYBRID_METHOD,
        METHODS, METHOD_LABELS, METHOD_SPECS, MLLM_METHODS, ON_REQUEST_METHODS, RERANK_SUFFIX, MethodSpec, base_method,
        method_spec, split_rerank, split_rerank_requests, unavailable_methods)
    from demind.retrieval.methods import (
        NEGATIVE_TEMPLATE, CombinerQuery, DEOMethod, DeMindsQuery, ImageOnly, ImagePlusText, MappingOnly, Oracle,
        TextOnly, build_methods, checkpoint_kind, method_label, parse_method_names, split_deo_name)
    from demind.retrieval.methods_base import RetrievalMethod
    from demind.retrieval.mllm_methods import DescribedQuery, HybridQuery, ensemble_embeddings

# Resolved on first use: the method names (demind.retrieval.names) load no torch, so a command's
# --help can list them; everything else imports its module (and torch) when first read.
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.retrieval.refs": ["IMAGE_EXTENSIONS", "LEFT_OUT_ADVICE", "RESIZE_MODES", "ImageReadError", "ImageRef",
                              "Query", "canonical_name", "load_image", "reword", "strip_image_extension"],
    "demind.io": ["file_version"],
    "demind.retrieval.cache": ["DamagedPartError", "EncodeStats", "ImageFeatureCache", "ImageRefDataset",
                               "backbone_cache_slug", "encode_image_refs", "image_transforms", "squash_preprocess",
                               "stack_features"],
    "demind.retrieval.cache_upgrade": ["adopt_unoriented", "is_earlier_part"],
    "demind.retrieval.names": ["CHECKPOINT_METHODS", "COMBINER_METHODS", "DEO_BASES", "DEO_METHODS",
                               "DESCRIBED_METHODS", "EXCLMM_METHODS", "HYBRID_METHOD", "METHOD_LABELS", "METHODS",
                               "METHOD_SPECS", "MethodSpec", "base_method", "method_spec", "MLLM_METHODS",
                               "ON_REQUEST_METHODS", "RERANK_SUFFIX", "split_rerank",
                               "split_rerank_requests", "unavailable_methods"],
    "demind.retrieval.methods": ["NEGATIVE_TEMPLATE", "CombinerQuery", "DEOMethod", "DeMindsQuery", "ImageOnly",
                                 "ImagePlusText", "MappingOnly", "Oracle", "TextOnly", "build_methods",
                                 "checkpoint_kind", "method_label", "parse_method_names", "split_deo_name"],
    "demind.retrieval.methods_base": ["RetrievalMethod"],
    "demind.retrieval.mllm_methods": ["DescribedQuery", "HybridQuery", "ensemble_embeddings"],
})

__all__ = [
    "CHECKPOINT_METHODS", "COMBINER_METHODS", "CombinerQuery", "checkpoint_kind", "unavailable_methods",
    "DEO_BASES", "DEO_METHODS", "EXCLMM_METHODS", "IMAGE_EXTENSIONS", "METHODS", "METHOD_LABELS", "METHOD_SPECS",
    "MethodSpec", "base_method", "method_spec",
    "NEGATIVE_TEMPLATE", "ON_REQUEST_METHODS", "RESIZE_MODES",
    "DESCRIBED_METHODS", "HYBRID_METHOD", "MLLM_METHODS", "RERANK_SUFFIX", "DescribedQuery", "HybridQuery",
    "ensemble_embeddings",
    "DEOMethod", "DamagedPartError", "DeMindsQuery", "EncodeStats", "ImageFeatureCache", "ImageOnly", "ImagePlusText",
    "ImageReadError", "ImageRef", "ImageRefDataset", "MappingOnly", "Oracle", "Query", "RetrievalMethod", "TextOnly",
    "backbone_cache_slug", "build_methods", "canonical_name", "encode_image_refs", "file_version", "image_transforms",
    "load_image",
    "adopt_unoriented", "is_earlier_part",
    "method_label", "parse_method_names", "split_deo_name", "squash_preprocess", "stack_features",
    "strip_image_extension", "LEFT_OUT_ADVICE", "reword", "split_rerank", "split_rerank_requests",
]
