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

from demind.retrieval.refs import (IMAGE_EXTENSIONS, RESIZE_MODES, ImageReadError, ImageRef, Query, canonical_name,
                                   load_image, strip_image_extension)
from demind.retrieval.cache import (DamagedPartError, EncodeStats, ImageFeatureCache, ImageRefDataset,
                                    backbone_cache_slug, encode_image_refs, image_transforms, squash_preprocess,
                                    stack_features)
from demind.retrieval.methods import (CHECKPOINT_METHODS, DEO_BASES, DEO_METHODS, EXCLMM_METHODS, METHOD_LABELS,
                                      METHODS, NEGATIVE_TEMPLATE, ON_REQUEST_METHODS, DEOMethod, DeMindsQuery,
                                      ImageOnly, ImagePlusText, MappingOnly, Oracle, RetrievalMethod, TextOnly,
                                      RERANK_SUFFIX, build_methods, method_label, parse_method_names,
                                      split_deo_name)
from demind.retrieval.mllm_methods import (DESCRIBED_METHODS, HYBRID_METHOD, MLLM_METHODS, DescribedQuery,
                                           HybridQuery, ensemble_embeddings)

__all__ = [
    "CHECKPOINT_METHODS", "DEO_BASES", "DEO_METHODS", "EXCLMM_METHODS", "IMAGE_EXTENSIONS", "METHODS", "METHOD_LABELS",
    "NEGATIVE_TEMPLATE", "ON_REQUEST_METHODS", "RESIZE_MODES",
    "DESCRIBED_METHODS", "HYBRID_METHOD", "MLLM_METHODS", "RERANK_SUFFIX", "DescribedQuery", "HybridQuery",
    "ensemble_embeddings",
    "DEOMethod", "DamagedPartError", "DeMindsQuery", "EncodeStats", "ImageFeatureCache", "ImageOnly", "ImagePlusText",
    "ImageReadError", "ImageRef", "ImageRefDataset", "MappingOnly", "Oracle", "Query", "RetrievalMethod", "TextOnly",
    "backbone_cache_slug", "build_methods", "canonical_name", "encode_image_refs", "image_transforms", "load_image",
    "method_label", "parse_method_names", "split_deo_name", "squash_preprocess", "stack_features",
    "strip_image_extension",
]
