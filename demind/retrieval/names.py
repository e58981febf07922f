"""The names of the retrieval methods (what a config, a query file or ``--help`` may say) and what
each reads of a query (:data:`METHOD_SPECS`).

Torch-free, so the commands list and check method names without loading a model; the registry
that builds the methods (:mod:`demind.retrieval.methods`) reads them, and the face :mod:`demind.retrieval` offers them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MethodSpec:
    """What a retrieval method is called and what it reads of a query: the one record every command
    (search, the page, eval's DEO) asks, so a new method cannot be left out of a list of readers.

    image: it reads the reference image (a search without one is refused).
    words: how it reads the user's modification text: ``"prompt"`` (filled into the template with
        the reference's pseudo-word ``*``), ``"text"`` (as typed), None (not at all).
    """

    label: str
    image: bool
    words: str | None


METHOD_SPECS = {
    "image-only": MethodSpec("Image-only", image=True, words=None),
    "text-only": MethodSpec("Text-only", image=False, words="text"),
    "image+text": MethodSpec("Image+Text", image=True, words="text"),
    "mapping-only": MethodSpec("Mapping only (Pic2Word-style)", image=True, words="prompt"),
    "demind": MethodSpec("De-MINDS", image=True, words="prompt"),
    "exclmm": MethodSpec("ExclMM", image=False, words="text"),
    # reads the target's ground-truth description (a benchmark's), neither the image nor the user's words
    "oracle": MethodSpec("Oracle (target's description)", image=False, words=None),
    "cirevl": MethodSpec("CIReVL (MLLM caption + rewrite)", image=True, words="text"),
    "osrcir": MethodSpec("OSrCIR (MLLM reflective CoT)", image=True, words="text"),
    "demind+mllm": MethodSpec("De-MINDS + MLLM description", image=True, words="prompt"),
    "combiner": MethodSpec("Combiner (supervised on triplets)", image=True, words="text"),
}
METHOD_LABELS = {name: spec.label for name, spec in METHOD_SPECS.items()}

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


def method_spec(name: str) -> MethodSpec:
    """What the method ``name`` reads, its variants included: ``BASE+deo`` reads what BASE reads;
    ``METHOD+rerank`` also reads the reference image (the MLLM verifier compares it with each
    candidate). KeyError for a name that is no method."""
    spec = METHOD_SPECS[base_method(name)]
    return replace(spec, image=True) if split_rerank(name)[1] else spec


def base_method(name: str) -> str:
    """``"demind+deo-adam"`` -> ``"demind"``, ``"osrcir+rerank"`` -> ``"osrcir"``: the method a variant
    runs (what it reads and needs is its base's)."""
    plain = split_rerank(name)[0]
    return next((plain[: -len(s)] for s in sorted(DEO_SUFFIXES, key=len, reverse=True) if plain.endswith(s)), plain)


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


def unknown_methods(names: list[str]) -> list[str]:
    """The names of ``names`` that are no method nor a method's DEO variant (``+rerank`` already split off)."""
    return [n for n in names if n not in METHODS and n not in DEO_METHODS]


def method_name_problems(key: str, spec: str | None) -> list[tuple[str, str]]:
    """``[(key, message)]`` when the comma-separated ``spec`` names an unknown method, for a command's
    config check (torch-free: before any model loads); [] when every name is known or ``spec`` is None."""
    names, _ = split_rerank_requests(spec)
    unknown = unknown_methods(names or [])
    if not unknown:
        return []
    return [(key, f"= {spec!r}: unknown method(s) {unknown}; choose from {', '.join(METHODS + DEO_METHODS)} "
                  f"(any of them with {RERANK_SUFFIX})")]
