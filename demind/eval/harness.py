"""Zero-shot evaluation: read a benchmark, encode its images once, score every method.

    from demind.eval import evaluate
    results = evaluate("cirr", "data/CIRR", backbone=backbone, model=model, out_dir="runs/eval/cirr")

Nothing here catches exceptions: a failure anywhere fails the evaluation with its traceback.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from demind.backbone import FrozenCLIP
from demind.config import ConfigError, config_problems
from demind.settings import Rule
from demind.errors import InputError, NonFiniteError
from demind.io import check_output_dir
from demind.logs import progress_bar
from demind.eval import metrics as M
from demind.eval.circo import read_circo
from demind.eval.cirr import read_cirr
from demind.eval.coco import read_coco
from demind.eval.exclcoco import read_exclcoco
from demind.eval.exclusion import read_exclusion
from demind.eval.fashioniq import read_fashioniq
from demind.retrieval import ImageFeatureCache, encode_image_refs, stack_features
from demind.eval.imagenet_r import read_imagenet_r
from demind.retrieval import (
    RERANK_SUFFIX, RetrievalMethod, build_methods, checkpoint_kind, parse_method_names, split_rerank_requests)
from demind.eval.reports import combine_group_metrics, group_counts, write_reports
from demind.retrieval import ImageRef
from demind.eval.structures import BenchmarkData, QueryGroup
from demind.eval.options import BENCHMARKS, ReaderOptions
from demind.model import DeMinds

log = logging.getLogger(__name__)

RANKING_DEPTH = 50


# The numeric arguments of evaluate(), checked with the same declared rules as the configs.
RUN_ARGUMENT_RULES = {"batch_size": Rule(ge=1), "num_workers": Rule(ge=0), "limit": Rule(ge=1)}


def check_evaluation_arguments(options: ReaderOptions, **values: Any) -> None:
    """One ConfigError listing every bad option or argument (name, value, allowed range)."""
    problems = [f"{key} = {value!r} must be {RUN_ARGUMENT_RULES[key].describe()}"
                for key, value in values.items()
                if isinstance(value, bool) or not RUN_ARGUMENT_RULES[key].allows(value)
                or not isinstance(value, (int, type(None)))]
    problems += [message for _, message in config_problems(options)]
    if problems:
        raise ConfigError("invalid evaluation options: " + "; ".join(problems))


def read_benchmark(benchmark: str, data_root: str | Path, split: str = "val", limit: int | None = None,
                   options: ReaderOptions | None = None) -> BenchmarkData:
    """Dispatch to the benchmark's reader; ``limit`` keeps the first N queries (smoke runs)."""
    opt = options or ReaderOptions()
    if benchmark == "cirr":
        return read_cirr(data_root, split, limit)
    if benchmark == "fashioniq":
        return read_fashioniq(data_root, split, limit, caption_order=opt.fashioniq.caption_order,
                              text_form=opt.fashioniq.text)
    if benchmark == "coco":
        c = opt.coco
        return read_coco(data_root, split, limit, csv_path=c.csv, prompt_form=c.prompt,
                         query_resize=c.query_resize, seed=c.seed, min_area=c.min_area, max_area=c.max_area)
    if benchmark == "imagenet-r":
        return read_imagenet_r(data_root, split, limit)
    if benchmark == "circo":
        return read_circo(data_root, split, limit)
    if benchmark == "exclusion":
        return read_exclusion(data_root, split, limit)
    if benchmark == "exclcoco":
        return read_exclcoco(data_root, split, limit)
    raise InputError(f"unknown benchmark {benchmark!r}; choose from {', '.join(BENCHMARKS)}")


@dataclass
class GroupOutcome:
    """One method on one query group: metrics (fractions), top-50 names, subset top-3 names."""

    metrics: dict[str, float]
    rankings: dict[str, list[str]]
    subset_rankings: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    texts: Counter = field(default_factory=Counter)  # query texts encoded / cut to the backbone's context


def evaluate(
    benchmark: str,
    data_root: str | Path,
    *,
    backbone: FrozenCLIP | None = None,
    model: DeMinds | None = None,
    methods: str | list[str] | None = None,
    split: str = "val",
    out_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    options: ReaderOptions | None = None,
    batch_size: int = 64,
    num_workers: int = 0,
    limit: int | None = None,
    progress: bool = True,
    exclmm: Any = None,
    mllm: Any = None,
    data: BenchmarkData | None = None,
) -> dict[str, Any]:
    """Evaluate ``methods`` on one benchmark split; returns the results dict (values in percent).

    backbone: the frozen CLIP (None: the model's backbone).  Load both with
        :func:`demind.checkpoint.load_backbone_and_model`.
    model: the trained De-MINDS model, needed for ``demind`` and ``mapping-only``. It is
        put in eval mode for the run (dropout off) and restored after.
    methods: names or a comma-separated string; None = every method the inputs allow.
    out_dir: where results.json, rankings/, table.md and submission files go (None: nothing written).
    cache_dir: image-feature cache (default ``<out_dir>/feature_cache``; no cache without either).
    exclmm: a loaded ExclMM (:func:`demind.exclmm.load_exclmm`), for the ``exclmm`` method.
    mllm: a :class:`demind.mllm.MLLMSetup`, for ``cirevl``, ``osrcir``, ``demind+mllm`` and the
        ``+rerank`` variants (``rerank.k``); its answers are kept under ``<cache_dir or out_dir>/descriptions``.
    data: the split as :func:`read_benchmark` read it with these arguments (demind-eval reads it before the
        model loads, so a broken data folder is refused first); None reads it here.
    """
    check_evaluation_arguments(options or ReaderOptions(), batch_size=batch_size, num_workers=num_workers, limit=limit)
    backbone = _resolve_backbone(backbone, model)
    data = data if data is not None else read_benchmark(benchmark, data_root, split, limit, options)
    method_objs, mllm_run, rerank_asked = _prepare_methods(methods, data, backbone, model, exclmm, mllm, cache_dir,
                                                           out_dir)
    cache = _prepare_feature_cache(cache_dir, out_dir, backbone, data)
    for note in data.notes:
        log.info(note)

    features, encoding = encode_benchmark_images(backbone, data, cache, batch_size, num_workers, progress)
    outcomes = _score_all(method_objs, data, features, backbone, model, mllm_run, rerank_asked, batch_size, progress)
    results = assemble_results(data, backbone, model, outcomes, encoding, limit)
    if mllm_run is not None:
        results["mllm"] = mllm_run.summary()
    if out_dir is not None:
        results["files"] = write_reports(Path(out_dir), results, data, outcomes)
    return results


def _resolve_backbone(backbone: FrozenCLIP | None, model: DeMinds | None) -> FrozenCLIP:
    """The backbone given, else the model's; ConfigError when neither is given."""
    if backbone is None:
        if model is None:
            raise ConfigError("evaluate() needs a backbone or a model; load them with "
                              "demind.checkpoint.load_backbone_and_model")
        backbone = model.backbone
    return backbone


def _prepare_methods(methods: str | list[str] | None, data: BenchmarkData, backbone: FrozenCLIP,
                     model: DeMinds | None, exclmm: Any, mllm: Any, cache_dir: str | Path | None,
                     out_dir: str | Path | None) -> tuple[list[RetrievalMethod], Any, list[str]]:
    """(the methods to score, the MLLM bound to this split or None, the methods asked ``+rerank``),
    every request refused before any image is encoded."""
    mllm_run = mllm.bind(data.benchmark, data.split, descriptions_root(cache_dir, out_dir)) if mllm else None
    methods, rerank_asked = split_rerank_requests(methods)  # "osrcir+rerank": osrcir runs, then is re-ranked
    names = parse_method_names(methods, model is not None, exclmm is not None, checkpoint_kind(model))
    check_rerank_request(rerank_asked, mllm)
    method_objs = build_methods(names, backbone, model, exclmm, mllm=mllm_run)
    if mllm_run is not None and mllm_run.reranker() is not None:  # a typo in rerank.methods: now, not after the run
        mllm_run.rerank_targets([m.name for m in method_objs])
    return method_objs, mllm_run, rerank_asked


def _prepare_feature_cache(cache_dir: str | Path | None, out_dir: str | Path | None, backbone: FrozenCLIP,
                           data: BenchmarkData) -> ImageFeatureCache | None:
    """The split's image-feature cache (default ``<out_dir>/feature_cache``; None without either),
    after checking that the output and cache folders can be written."""
    if cache_dir is None and out_dir is not None:
        cache_dir = Path(out_dir) / "feature_cache"
    for folder in (out_dir, cache_dir):  # before encoding: a read-only or full disk fails in seconds
        if folder is not None:
            check_output_dir(folder)
    return ImageFeatureCache.for_backbone(cache_dir, backbone, data.benchmark, data.split) if cache_dir else None


def _score_all(method_objs: list[RetrievalMethod], data: BenchmarkData, features: dict[str, torch.Tensor],
               backbone: FrozenCLIP, model: DeMinds | None, mllm_run: Any, rerank_asked: list[str],
               batch_size: int, progress: bool) -> dict[str, dict[str, GroupOutcome]]:
    """method name -> query group name -> outcome, the ``+rerank`` variants added; ``features``: image
    name -> (D,) raw feature. The model is in eval mode meanwhile (dropout off), then restored."""
    galleries = {id(g[0].gallery): gallery_matrix(g[0], features, backbone.device)
                 for g in _groups_by_gallery(data.groups)}
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    outcomes: dict[str, dict[str, GroupOutcome]] = {}
    for method in method_objs:
        outcomes[method.name] = {
            g.name: score_group(method, g, method.map_gallery(galleries[id(g.gallery)]), features,
                                data.has_ground_truth, batch_size, progress)
            for g in data.groups
        }
    if mllm_run is not None:
        add_rerank_variants(outcomes, mllm_run, data, rerank_asked)
    if was_training:
        model.train()
    return outcomes


def descriptions_root(cache_dir: str | Path | None, out_dir: str | Path | None) -> Path | None:
    """Where MLLM answers are kept: beside the image features (shared across runs), else in the output."""
    folder = cache_dir if cache_dir is not None else out_dir
    return Path(folder) / "descriptions" if folder is not None else None


def check_rerank_request(asked: list[str], mllm: Any) -> None:
    """A named ``METHOD+rerank`` needs an MLLM and ``rerank.k`` > 0: one line naming them, before any work."""
    if not asked:
        return
    named = f"{asked[0]}{RERANK_SUFFIX}"
    if mllm is None:
        raise ConfigError(f"method {named!r} re-ranks with a multimodal LLM: give engine.name=transformers "
                          f"engine.model=DIR and rerank.k=20 (for example; see docs/mllm.md)")
    if mllm.rerank.k == 0:
        raise ConfigError(f"method {named!r} re-orders the top rerank.k results of {asked[0]}, and rerank.k is 0: "
                          f"give rerank.k=20 (for example; at most 50)")


def add_rerank_variants(outcomes: dict[str, dict[str, "GroupOutcome"]], mllm_run: Any, data: BenchmarkData,
                        asked: list[str] = ()) -> None:
    """``METHOD+rerank`` outcomes: each chosen method's top K re-ordered by the MLLM verifier. Chosen:
    ``rerank.methods`` (default every method run) and the ``asked`` ones (named as ``METHOD+rerank``);
    with names asked and no ``rerank.methods``, only those."""
    reranker = mllm_run.reranker()
    if reranker is None:
        return
    chosen = list(asked) if asked and mllm_run.setup.rerank.methods is None else \
        list(dict.fromkeys([*mllm_run.rerank_targets(list(outcomes)), *asked]))
    for name in chosen:
        outcomes[name + RERANK_SUFFIX] = {g.name: rerank_group(reranker, outcomes[name][g.name], g,
                                                               data.has_ground_truth) for g in data.groups}
        if any(g.hard_negatives is not None for g in data.groups):
            log.info("%s%s: no exclusion or inclusion AUC (the re-ranker orders the top K; the AUCs need a score "
                     "for every gallery image)", name, RERANK_SUFFIX)


def rerank_group(reranker: Any, base: "GroupOutcome", group: QueryGroup, has_ground_truth: bool) -> "GroupOutcome":
    """One group's re-ranked outcome: rankings past the top K and the subset top 3 are the base method's."""
    started = time.perf_counter()
    gallery = {ref.name: ref for ref in group.gallery}
    rankings = reranker.rerank(group.queries, base.rankings, gallery)
    seconds = time.perf_counter() - started
    metrics: dict[str, float] = {}
    if has_ground_truth and group.queries:
        index = {n: i for i, n in enumerate(gallery)}
        ranked = torch.tensor([[index[n] for n in rankings[q.qid]] for q in group.queries])
        subset = [[index[n] for n in base.subset_rankings[q.qid]] for q in group.queries] if group.subset_ks else []
        metrics = _group_metrics(group, ranked, _relevant_sets(group.queries, index, group.name), subset)
    return GroupOutcome(metrics, rankings, dict(base.subset_rankings), seconds)


def encode_benchmark_images(backbone: FrozenCLIP, data: BenchmarkData, cache: ImageFeatureCache | None,
                            batch_size: int, num_workers: int, progress: bool
                            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, int]]]:
    """Raw features for every gallery and reference image, each encoded once.

    References that are gallery images (CIRR, FashionIQ, CIRCO) reuse the gallery feature;
    the others (COCO crops, ImageNet-R real images) are encoded under the ``queries`` role.
    """
    gallery_refs = [ref for groups in _groups_by_gallery(data.groups) for ref in groups[0].gallery]
    tag = f"{data.benchmark}/{data.split}"
    features, gallery_stats = encode_image_refs(backbone, gallery_refs, cache, "gallery", batch_size, num_workers,
                                            progress=progress, desc=f"gallery {tag}")
    gallery_keys = {ref.name: ref.cache_key for ref in gallery_refs}
    references: list[ImageRef] = []
    for group in data.groups:
        for q in group.queries:
            key = gallery_keys.get(q.reference.name)
            if key is None:
                references.append(q.reference)
            elif key != q.reference.cache_key:
                raise InputError(f"query {q.qid}: reference {q.reference.name!r} ({q.reference.cache_key}) "
                                 f"differs from the gallery image of that name ({key})")
    query_features, query_stats = encode_image_refs(backbone, references, cache, "queries", batch_size, num_workers,
                                                progress=progress, desc=f"references {tag}")
    features = {**features, **query_features}
    return features, {"gallery": gallery_stats.as_dict(), "queries": query_stats.as_dict()}


def _groups_by_gallery(groups: list[QueryGroup]) -> list[list[QueryGroup]]:
    """Groups bucketed by gallery list identity (ImageNet-R's four domains share one gallery)."""
    buckets: dict[int, list[QueryGroup]] = {}
    for g in groups:
        buckets.setdefault(id(g.gallery), []).append(g)
    return list(buckets.values())


def gallery_matrix(group: QueryGroup, features: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """(N, D) L2-normalised gallery features of ``group``, on ``device`` (ranking runs there)."""
    return M.cosine_normalise(stack_features(features, [ref.name for ref in group.gallery])).to(device)


@torch.no_grad()
def embed_queries(method: RetrievalMethod, ref_features: torch.Tensor, prompts: list[str], texts: list[str],
                  batch_size: int, progress: bool = False, desc: str = "",
                  qids: list[str] | None = None) -> torch.Tensor:
    """(Q, D) raw reference features + prompts/texts -> (Q, D) normalised queries, batched,
    on the backbone's device. A non-finite query embedding is an error naming the query
    (NaN scores would rank arbitrarily and still print believable numbers)."""
    out = []
    device = method.backbone.device
    starts = range(0, len(prompts), batch_size)
    for start in progress_bar(starts, desc=desc, disable=not progress, leave=False, unit="batch"):
        end = start + batch_size
        emb = method.embed(ref_features[start:end].to(device), prompts[start:end], texts[start:end]).float()
        bad = (~torch.isfinite(emb).all(dim=1)).nonzero().flatten().tolist()
        if bad:
            i = start + bad[0]
            name = qids[i] if qids is not None else f"#{i}"
            raise NonFiniteError(
                f"method {method.name}: the embedding of query {name} ({prompts[i]!r}) is not finite "
                f"({len(bad)} of the {emb.shape[0]} queries in its batch); check the checkpoint and the reference "
                f"image features (a corrupted checkpoint or feature cache gives NaN)")
        out.append(emb)
    return torch.cat(out) if out else torch.zeros(0, method.backbone.embed_dim, device=device)


def score_group(method: RetrievalMethod, group: QueryGroup, gallery: torch.Tensor, features: dict[str, torch.Tensor],
                has_ground_truth: bool, batch_size: int, progress: bool = True) -> GroupOutcome:
    """Embed the group's queries with ``method``, rank its gallery (N, D normalised), compute its metrics."""
    names = [ref.name for ref in group.gallery]
    index = {n: i for i, n in enumerate(names)}
    queries = group.queries
    refs = stack_features(features, [q.reference.name for q in queries])
    started = time.perf_counter()
    texts_before = Counter(method.backbone.text_counts)
    embedded = embed_queries(method, refs, [q.prompt for q in queries], method.query_texts(queries), batch_size,
                             progress, desc=f"{method.name} {group.name}", qids=[q.qid for q in queries])
    texts = Counter(method.backbone.text_counts)
    texts.subtract(texts_before)
    if embedded.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    exclude = [index.get(q.exclude) if q.exclude is not None else None for q in queries]
    ranked = M.top_k_indices(embedded, gallery, RANKING_DEPTH, exclude).cpu()
    rankings = {q.qid: [names[i] for i in row] for q, row in zip(queries, ranked.tolist())}

    subset_rankings: dict[str, list[str]] = {}
    subset_ranked: list[list[int]] = []
    if group.subset_ks:
        subsets = [[index[m] for m in q.subset] for q in queries]
        subset_ranked = M.rank_within_subsets(embedded, gallery, subsets)
        subset_rankings = {q.qid: [names[i] for i in row[:3]] for q, row in zip(queries, subset_ranked)}

    metrics: dict[str, float] = {}
    if has_ground_truth and queries:
        relevant = _relevant_sets(queries, index, group.name)
        metrics = _group_metrics(group, ranked, relevant, subset_ranked)
        if group.hard_negatives is not None:  # over every gallery score, not the top 50
            hard = [frozenset(index[n] for n in group.hard_negatives[q.qid]) for q in queries]
            metrics.update(_auc_means(f"{method.name} ({group.name})",
                                      M.query_gallery_aucs(embedded, gallery, relevant, hard)))
    return GroupOutcome(metrics, rankings, subset_rankings, seconds, +texts)


def _auc_means(label: str, per_query: dict[str, list[float]]) -> dict[str, float]:
    """The AUCs' means over the queries where they are defined; the rest are counted in a log line."""
    for name, (undefined, total) in M.undefined_aucs(per_query).items():
        log.warning("%s: %s undefined for %d of %d queries (no pair to compare); %s", label, name, undefined,
                    total, "averaged over the rest" if undefined < total else "not reported")
    return {k: v for k, v in M.mean_aucs(per_query).items() if not math.isnan(v)}


def _relevant_sets(queries, index: dict[str, int], group: str) -> list[frozenset[int]]:
    """Per query, gallery indices of its targets; a target outside the gallery is an error."""
    memo: dict[int, frozenset[int]] = {}
    out = []
    for q in queries:
        key = id(q.targets)  # ImageNet-R queries share one tuple per class and domain
        if key not in memo:
            absent = [t for t in q.targets if t not in index]
            if absent:
                raise InputError(f"query {q.qid} ({group}): target(s) {absent[:3]} are not in the gallery")
            memo[key] = frozenset(index[t] for t in q.targets)
        out.append(memo[key])
    return out


def _group_metrics(group: QueryGroup, ranked: torch.Tensor, relevant: list[frozenset[int]],
                   subset_ranked: list[list[int]]) -> dict[str, float]:
    """Metric name -> fraction for one group."""
    rel = M.relevance_matrix(ranked, relevant)
    n_relevant = torch.tensor([len(r) for r in relevant])
    if group.metric == "recall":
        values = {f"R@{k}": v for k, v in M.recall_at_k(rel, group.ks).items()}
    elif group.metric == "fraction_recall":
        values = {f"R@{k}": v for k, v in M.fraction_recall_at_k(rel, n_relevant, group.ks).items()}
    elif group.metric == "map":
        values = {f"mAP@{k}": v for k, v in M.map_at_k(rel, n_relevant, group.ks).items()}
    elif group.metric == "exclusion":
        values = M.exclusion_metrics(rel, n_relevant)
    else:
        raise ValueError(f"unknown metric family {group.metric!r}")
    if group.subset_ks:
        targets = [next(iter(r)) for r in relevant]
        values.update({f"Rsubset@{k}": v for k, v in M.recall_subset_at_k(subset_ranked, targets, group.subset_ks).items()})
    return values


def assemble_results(data: BenchmarkData, backbone: FrozenCLIP, model: DeMinds | None,
                     outcomes: dict[str, dict[str, GroupOutcome]], encoding: dict,
                     limit: int | None) -> dict[str, Any]:
    """The results dict written to results.json (metric values in percent)."""
    methods = {}
    timing = {}
    truncation = {}
    for name, by_group in outcomes.items():
        texts = sum((o.texts for o in by_group.values()), Counter())
        truncation[name] = {"texts_encoded": texts["encoded"], "texts_truncated": texts["truncated"]}
        if texts["truncated"]:
            log.warning("%s: %d of %d query texts were longer than the backbone's %d-token context and were cut",
                        name, texts["truncated"], texts["encoded"], backbone.context_length)
        per_group = {g: o.metrics for g, o in by_group.items() if o.metrics}
        methods[name] = combine_group_metrics(per_group) if per_group else {}
        n_queries = sum(len(o.rankings) for o in by_group.values())
        seconds = sum(o.seconds for o in by_group.values())
        timing[name] = {"seconds": seconds, "seconds_per_query": seconds / max(n_queries, 1)}
    return {
        "benchmark": data.benchmark,
        "split": data.split,
        "has_ground_truth": data.has_ground_truth,
        "metric_unit": "percent",
        "definitions": data.notes,
        "methods": methods,
        "counts": {g.name: group_counts(g) for g in data.groups},
        "backbone": {**backbone.identity, "precision": backbone.cfg.precision},
        "model_config": asdict(model.cfg) if model is not None else None,
        "reader_options": data.options,
        "limit": limit,
        "encoding": encoding,
        "query_timing": timing,
        "text_truncation": truncation,
    }
