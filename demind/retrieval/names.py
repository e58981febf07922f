"""The names of the retrieval methods: what a config, a query file or ``--help`` may say.

Torch-free, so the commands list and check method names without loading a model; the registry
that builds the methods (:mod:`demind.retrieval.methods`) reads them, and the face :mod:`demind.retrieval` offers them.
"""

from __future__ import annotations

METHOD_LABELS = {
    "image-only": "Image-only",
    "text-only": "Text-only",
    "image+text": "Image+Text",
    "mapping-only": "Mapping only (Pic2Word-style)",
    "demind": "De-MINDS",
    "exclmm": "ExclMM",
    "oracle": "Oracle (target's description)",
    "cirevl": "CIReVL (MLLM caption + rewrite)",
    "osrcir": "OSrCIR (MLLM reflective CoT)",
    "demind+mllm": "De-MINDS + MLLM description",
    "combiner": "Combiner (supervised on triplets)",
}

DESCRIBED_METHODS = ("cirevl", "osrcir")
HYBRID_METHOD = "demind+mllm"
MLLM_METHODS = DESCRIBED_METHODS + (HYBRID_METHOD,)

METHODS = tuple(METHOD_LABELS)
EXCLMM_METHODS = ("exclmm",)
CHECKPOINT_METHODS = ("mapping-only", "demind", HYBRID_METHOD)
# the method of a combiner checkpoint (demind-train-triplets): that checkpoint serves it and no other
COMBINER_METHODS = ("combiner",)
# not in the default set: real benchmarks have no target descriptions (oracle); an MLLM is a choice (docs/mllm.md)
ON_REQUEST_METHODS = ("oracle", *MLLM_METHODS)
RERANK_SUFFIX = "+rerank"  # a method's ranking with its top K re-ordered by an MLLM (demind.mllm.rerank)
# DEO variants: suffix -> solver mode (see demind.negation.deo)
DEO_SUFFIXES = {"+deo": "exact", "+deo-adam": "adam"}
DEO_BASES = ("text-only", "image+text", "mapping-only", "demind", HYBRID_METHOD)
DEO_METHODS = tuple(f"{b}{s}" for b in DEO_BASES for s in DEO_SUFFIXES)


def unavailable_methods(model_kind: str | None) -> tuple[str, ...]:
    """The methods a loaded checkpoint of ``model_kind`` cannot serve: None (no checkpoint) -> every
    checkpoint method; "demind" -> the combiner's; "combiner" -> De-MINDS's."""
    if model_kind is None:
        return CHECKPOINT_METHODS + COMBINER_METHODS
    return CHECKPOINT_METHODS if model_kind == "combiner" else COMBINER_METHODS


def split_rerank(name: str) -> tuple[str, bool]:
    """``"osrcir+rerank"`` -> ("osrcir", True); ``"demind"`` -> ("demind", False)."""
    if name.endswith(RERANK_SUFFIX):
        return name[: -len(RERANK_SUFFIX)], True
    return name, False


def split_rerank_requests(names: str | list[str] | None) -> tuple[list[str] | None, list[str]]:
    """Method names as a user lists them (a list or one comma-separated string; None: the defaults) ->
    (the methods to run, those whose ``+rerank`` variant is asked for): ``"image-only,osrcir+rerank"``
    -> ``(["image-only", "osrcir"], ["osrcir"])``; None -> ``(None, [])``. A ``+rerank`` variant is its
    method's ranking with the top ``rerank.k`` re-ordered by an MLLM, so its method runs too."""
    if names is None:
        return None, []
    run, reranked = [], []
    for name in filter(None, (n.strip() for n in (names.split(",") if isinstance(names, str) else names))):
        base, is_reranked = split_rerank(name)
        if is_reranked:
            reranked.append(base)
        run.append(base)
    return list(dict.fromkeys(run)), list(dict.fromkeys(reranked))
