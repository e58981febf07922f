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

# Resolved on first use: the method names (demind.retrieval.names) load no torch, so a command's
# --help can list them; everything else imports its module (and torch) when first read.
from demind.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.retrieval.refs": ["IMAGE_EXTENSIONS", "LEFT_OUT_ADVICE", "RESIZE_MODES", "ImageReadError", "ImageRef",
                              "Query", "canonical_name", "load_image", "reword", "strip_image_extension"],
    "demind.retrieval.cache": ["DamagedPartError", "EncodeStats", "ImageFeatureCache", "ImageRefDataset",
                               "backbone_cache_slug", "encode_image_refs", "image_transforms", "squash_preprocess",
                               "stack_features"],
    "demind.retrieval.cache_upgrade": ["adopt_unoriented", "is_earlier_part"],
    "demind.retrieval.names": ["CHECKPOINT_METHODS", "COMBINER_METHODS", "unavailable_methods", "DEO_BASES", "DEO_METHODS", "EXCLMM_METHODS", "METHOD_LABELS",
                               "METHODS", "ON_REQUEST_METHODS", "RERANK_SUFFIX", "DESCRIBED_METHODS",
                               "HYBRID_METHOD", "MLLM_METHODS", "split_rerank_requests"],
    "demind.retrieval.methods": ["NEGATIVE_TEMPLATE", "CombinerQuery", "DEOMethod", "DeMindsQuery", "ImageOnly", "ImagePlusText",
                                 "MappingOnly", "Oracle", "RetrievalMethod", "TextOnly", "build_methods", "checkpoint_kind",
                                 "method_label", "parse_method_names", "split_deo_name"],
    "demind.retrieval.mllm_methods": ["DescribedQuery", "HybridQuery", "ensemble_embeddings"],
})

__all__ = [
    "CHECKPOINT_METHODS", "DEO_BASES", "DEO_METHODS", "EXCLMM_METHODS", "IMAGE_EXTENSIONS", "METHODS", "METHOD_LABELS",
    "NEGATIVE_TEMPLATE", "ON_REQUEST_METHODS", "RESIZE_MODES",
    "DESCRIBED_METHODS", "HYBRID_METHOD", "MLLM_METHODS", "RERANK_SUFFIX", "DescribedQuery", "HybridQuery",
    "ensemble_embeddings",
    "DEOMethod", "DamagedPartError", "DeMindsQuery", "EncodeStats", "ImageFeatureCache", "ImageOnly", "ImagePlusText",
    "ImageReadError", "ImageRef", "ImageRefDataset", "MappingOnly", "Oracle", "Query", "RetrievalMethod", "TextOnly",
    "backbone_cache_slug", "build_methods", "canonical_name", "encode_image_refs", "image_transforms", "load_image",
    "adopt_unoriented", "is_earlier_part",
    "method_label", "parse_method_names", "split_deo_name", "squash_preprocess", "stack_features",
    "strip_image_extension", "LEFT_OUT_ADVICE", "reword", "split_rerank_requests",
]
