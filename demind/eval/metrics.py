"""Retrieval metrics on rankings. Values are fractions in [0, 1]; reports show percentages.

Three definitions are in use in the ZS-CIR literature, and they are not interchangeable:

* :func:`recall_at_k` -- hit rate: a query counts 1 if *any* relevant image is in its
  top K (CIRR, FashionIQ, COCO; one target each).
* :func:`fraction_recall_at_k` -- Pic2Word's ImageNet-R "Recall@K": per query, the fraction
  of *all* its relevant targets found in the top K, averaged over queries. A query with no
  relevant target contributes 0 (the released code divides by ``n_relevant + 1e-5``).
* :func:`map_at_k` -- CIRCO's mAP@K: AP@K = sum_{i<=K} P@i * rel_i / min(K, n_relevant).

The exclusion benchmarks (ExclCOCO, :mod:`demind.eval.exclcoco`) report the eight metrics of
the ExclMM paper's Table 1, which the paper names but does not define. Ours, with binary
relevance rel_i (1 if the image at rank i is a ground-truth image), G the ground-truth set,
averaged over queries (:func:`exclusion_metrics`):

* AP@K   = sum_{i<=K} P@i * rel_i / min(K, |G|)         (= :func:`map_at_k`; AP@1 = rel_1)
* MRR@K  = 1 / (rank of the first relevant image) if it is within K, else 0
* NDCG@K = DCG@K / IDCG@K, DCG@K = sum_{i<=K} rel_i / log2(i + 1),
           IDCG@K = sum_{i<=min(K, |G|)} 1 / log2(i + 1)  (the ideal ranking puts all of G first)
* Hits@K = 1 if any of the top K is relevant, else 0    (= :func:`recall_at_k`)

Where the file lists each query's hard negatives H (images with every included object *and* the
excluded one), two AUCs over the scores of the whole gallery (:func:`exclusion_aucs`), averaged
over the queries where they are defined (:func:`mean_aucs`):

* exclusion AUC = P(score of an image in G > score of an image in H), ties 1/2 (0.5: blind to the
  exclusion);
* inclusion AUC = the same with G u H against every other gallery image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def top_k_indices(
    queries: torch.Tensor,
    gallery: torch.Tensor,
    k: int,
    exclude: Sequence[int | None] | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Rank the gallery for each query by cosine similarity.

    queries: (Q, D), gallery: (N, D), both L2-normalised.
    exclude: per query, a gallery index never ranked (or None).
    Returns (Q, min(k, N - 1 if any exclusion else N)) gallery indices, best first.
    Queries are scored in chunks so a 40k x 50k score matrix never exists at once.
    """
    n_gallery = gallery.shape[0]
    has_exclusion = exclude is not None and any(e is not None for e in exclude)
    k = min(k, n_gallery - 1 if has_exclusion else n_gallery)
    out = []
    for start in range(0, queries.shape[0], chunk_size):
        scores = queries[start : start + chunk_size] @ gallery.T
        if has_exclusion:
            for row, idx in enumerate(exclude[start : start + chunk_size]):
                if idx is not None:
                    scores[row, idx] = float("-inf")
        out.append(scores.topk(k, dim=1).indices)
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.long)


def relevance_matrix(ranked: torch.Tensor, relevant: Sequence[set[int] | frozenset[int]]) -> torch.Tensor:
    """(Q, K) ranked gallery indices and one relevant-index set per query -> (Q, K) bool."""
    rows = [[int(i) in rel for i in row] for row, rel in zip(ranked.tolist(), relevant)]
    return torch.tensor(rows, dtype=torch.bool).reshape(ranked.shape)


def recall_at_k(relevance: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """Hit rate: fraction of queries with at least one relevant image in the top k.

    relevance: (Q, K) bool.
    """
    _check_ks(relevance, ks)
    return {k: relevance[:, :k].any(dim=1).float().mean().item() for k in ks}


def fraction_recall_at_k(relevance: torch.Tensor, n_relevant: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """Pic2Word's ImageNet-R recall: mean over queries of (relevant in top k) / (all relevant).

    relevance: (Q, K) bool; n_relevant: (Q,) count of relevant gallery images per query.
    A query with ``n_relevant == 0`` contributes 0, as in the released code.
    """
    _check_ks(relevance, ks)
    n = n_relevant.float()
    safe = n.clamp(min=1.0)
    out = {}
    for k in ks:
        found = relevance[:, :k].sum(dim=1).float()
        out[k] = torch.where(n > 0, found / safe, torch.zeros_like(found)).mean().item()
    return out


def map_at_k(relevance: torch.Tensor, n_relevant: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """CIRCO's mAP@k: AP@k = sum_{i<=k} precision@i * rel_i / min(k, n_relevant), averaged.

    relevance: (Q, K) bool; n_relevant: (Q,) number of ground-truth images per query (> 0).
    """
    _check_ks(relevance, ks)
    return {k: average_precision_at_k(relevance, n_relevant, k).mean().item() for k in ks}


def average_precision_at_k(relevance: torch.Tensor, n_relevant: torch.Tensor, k: int) -> torch.Tensor:
    """(Q,) per-query AP@k of :func:`map_at_k` (for paired per-query comparisons)."""
    _check_ks(relevance, [k])
    if (n_relevant <= 0).any():
        raise ValueError("mAP needs at least one ground-truth image per query")
    rel = relevance.float()
    ranks = torch.arange(1, rel.shape[1] + 1, dtype=torch.float32)
    precision_at_hits = rel.cumsum(dim=1) / ranks * rel
    return precision_at_hits[:, :k].sum(dim=1) / n_relevant.float().clamp(max=k)


def mrr_at_k(relevance: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """MRR@k: mean over queries of 1 / rank of the first relevant image within the top k (0 if none).

    relevance: (Q, K) bool.
    """
    _check_ks(relevance, ks)
    rel = relevance.float()
    reciprocal = rel / torch.arange(1, rel.shape[1] + 1, dtype=torch.float32)
    out = {}
    for k in ks:
        first = reciprocal[:, :k].max(dim=1).values if rel.shape[1] else torch.zeros(rel.shape[0])
        out[k] = first.mean().item()  # the largest 1/i among hits is the first hit's
    return out


def ndcg_at_k(relevance: torch.Tensor, n_relevant: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """Binary NDCG@k: DCG@k = sum_{i<=k} rel_i / log2(i+1), divided by the ideal DCG of
    min(k, n_relevant) relevant images at the top; averaged over queries.

    relevance: (Q, K) bool; n_relevant: (Q,) ground-truth counts (> 0).
    """
    _check_ks(relevance, ks)
    if (n_relevant <= 0).any():
        raise ValueError("NDCG needs at least one ground-truth image per query")
    depth = max(max(ks), relevance.shape[1])
    discount = 1.0 / torch.log2(torch.arange(2, depth + 2, dtype=torch.float64))
    ideal_cum = discount.cumsum(0)  # ideal_cum[j - 1] = IDCG with j relevant images at the top
    rel = relevance.double()
    out = {}
    for k in ks:
        kk = min(k, rel.shape[1])
        dcg = (rel[:, :kk] * discount[:kk]).sum(dim=1)
        idcg = ideal_cum[n_relevant.long().clamp(max=k) - 1]
        out[k] = (dcg / idcg).mean().item()
    return out


EXCLUSION_METRICS = ("AP@1", "AP@5", "MRR@5", "MRR@10", "NDCG@5", "NDCG@10", "Hits@5", "Hits@10")


def exclusion_metrics(relevance: torch.Tensor, n_relevant: torch.Tensor) -> dict[str, float]:
    """The ExclMM paper's Table 1 metrics (see the module docstring for the definitions).

    relevance: (Q, K >= 10 unless the gallery is smaller) bool; n_relevant: (Q,) > 0.
    Returns name -> fraction, in the order of :data:`EXCLUSION_METRICS`.
    """
    ap = map_at_k(relevance, n_relevant, (1, 5))
    mrr = mrr_at_k(relevance, (5, 10))
    ndcg = ndcg_at_k(relevance, n_relevant, (5, 10))
    hits = recall_at_k(relevance, (5, 10))
    return {"AP@1": ap[1], "AP@5": ap[5], "MRR@5": mrr[5], "MRR@10": mrr[10],
            "NDCG@5": ndcg[5], "NDCG@10": ndcg[10], "Hits@5": hits[5], "Hits@10": hits[10]}


def pairwise_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counted 1/2 (the Mann-Whitney AUC).

    positive: (P,), negative: (M,) scores. NaN when either is empty (no pair to compare).
    Computed from mid-ranks (U = rank sum of the positives - P(P+1)/2), O((P+M) log(P+M)):
    a gallery-wide inclusion AUC never builds a P x M matrix.
    """
    if positive.numel() == 0 or negative.numel() == 0:
        return float("nan")
    values = torch.cat([positive.reshape(-1), negative.reshape(-1)]).double()
    _, inverse, counts = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    mid_ranks = counts.cumsum(0).double() - (counts.double() - 1) / 2  # tied values share their mean rank
    n_pos, n_neg = positive.numel(), negative.numel()
    u = mid_ranks[inverse[:n_pos]].sum().item() - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


EXCLUSION_AUCS = ("exclusion AUC", "inclusion AUC")


def exclusion_aucs(scores: torch.Tensor, truth: Sequence[set[int] | frozenset[int]],
                   hard: Sequence[set[int] | frozenset[int]]) -> dict[str, list[float]]:
    """Per query, the two AUCs of an exclusion query ("A and B without C"):

    * ``exclusion AUC``: among the images showing every included object, how often a ground-truth
      image (no C) outscores a hard negative (with C) -- 0.5 for a method blind to the exclusion;
    * ``inclusion AUC``: ground truth and hard negatives together (every included object) against
      the rest of the gallery -- whether the method finds the included objects at all.

    scores: (Q, N) query-gallery scores; truth, hard: per query, gallery indices (disjoint).
    Returns name -> Q values (NaN where a set is empty).
    """
    excl, incl = [], []
    for row, g, h in zip(scores.detach().cpu(), truth, hard):
        g_idx, h_idx = torch.tensor(sorted(g), dtype=torch.long), torch.tensor(sorted(h), dtype=torch.long)
        both = torch.zeros(row.shape[0], dtype=torch.bool)
        both[g_idx] = True
        both[h_idx] = True
        excl.append(pairwise_auc(row[g_idx], row[h_idx]))
        incl.append(pairwise_auc(row[both], row[~both]))
    return {"exclusion AUC": excl, "inclusion AUC": incl}


def query_gallery_aucs(queries: torch.Tensor, gallery: torch.Tensor, truth: Sequence[set[int] | frozenset[int]],
                       hard: Sequence[set[int] | frozenset[int]], chunk_size: int = 1024) -> dict[str, list[float]]:
    """:func:`exclusion_aucs` of the scores ``queries @ gallery.T`` ((Q, D) and (N, D), on one device),
    in chunks of queries so a Q x N score matrix never exists at once."""
    out: dict[str, list[float]] = {name: [] for name in EXCLUSION_AUCS}
    for start in range(0, queries.shape[0], chunk_size):
        end = start + chunk_size
        part = exclusion_aucs(queries[start:end] @ gallery.T, truth[start:end], hard[start:end])
        for name in EXCLUSION_AUCS:
            out[name] += part[name]
    return out


def mean_aucs(per_query: dict[str, list[float]]) -> dict[str, float]:
    """Name -> mean over the queries where that AUC is defined (not NaN); NaN when none is.
    The one averaging of :func:`exclusion_aucs` (demind-eval and the exclusion instrument)."""
    out = {}
    for name in EXCLUSION_AUCS:
        defined = [v for v in per_query[name] if not math.isnan(v)]
        out[name] = sum(defined) / len(defined) if defined else float("nan")
    return out


def undefined_aucs(per_query: dict[str, list[float]]) -> dict[str, tuple[int, int]]:
    """Name -> (queries where that AUC is undefined (NaN: no pair to compare), queries), for the
    AUCs undefined somewhere: what :func:`mean_aucs` left out of its mean, to be said in a log line."""
    counts = {name: (sum(math.isnan(v) for v in per_query[name]), len(per_query[name])) for name in EXCLUSION_AUCS}
    return {name: c for name, c in counts.items() if c[0]}


def rank_within_subsets(
    queries: torch.Tensor, gallery: torch.Tensor, subsets: Sequence[Sequence[int]]
) -> list[list[int]]:
    """CIRR's subset ranking: order each query's subset members by similarity.

    queries: (Q, D), gallery: (N, D), L2-normalised; subsets: gallery indices per query.
    Returns per query the subset's gallery indices, best first.
    """
    ranked = []
    for q, members in zip(queries, subsets):
        idx = torch.as_tensor(list(members), dtype=torch.long, device=gallery.device)
        order = torch.argsort(gallery[idx] @ q, descending=True)
        ranked.append(idx[order].tolist())
    return ranked


def recall_subset_at_k(subset_rankings: Sequence[Sequence[int]], targets: Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """Recall_subset@k: fraction of queries whose target is among the top k of its subset."""
    if len(subset_rankings) != len(targets):
        raise ValueError("one subset ranking per target expected")
    return {
        k: sum(t in list(r)[:k] for r, t in zip(subset_rankings, targets)) / max(len(targets), 1) for k in ks
    }


def cosine_normalise(x: torch.Tensor) -> torch.Tensor:
    """(.., D) -> L2-normalised float32 copy."""
    return F.normalize(x.float(), dim=-1)


def _check_ks(relevance: torch.Tensor, ks: Sequence[int]) -> None:
    if relevance.dim() != 2:
        raise ValueError(f"relevance must be (Q, K), got shape {tuple(relevance.shape)}")
    if any(k < 1 for k in ks):
        raise ValueError(f"k must be >= 1, got {list(ks)}")
    # k beyond K is allowed only because callers rank min(50, gallery size): a gallery
    # smaller than k is then fully ranked, and "top k" is the whole gallery.


def paired_hits(ranked_a: dict[str, list[str]], ranked_b: dict[str, list[str]], targets: dict[str, set[str]],
                k: int) -> tuple[int, int]:
    """Queries that only A / only B answers at K: (A hits and B misses, B hits and A misses).

    ranked_*: query id -> gallery names best first (``rankings/<method>.json``); targets:
    query id -> relevant names. Both methods must rank the same queries.
    """
    if set(ranked_a) != set(ranked_b):
        raise ValueError(f"the two rankings cover different queries ({len(ranked_a)} vs {len(ranked_b)})")
    only_a = only_b = 0
    for qid, relevant in targets.items():
        hit_a = any(name in relevant for name in ranked_a[qid][:k])
        hit_b = any(name in relevant for name in ranked_b[qid][:k])
        only_a += hit_a and not hit_b
        only_b += hit_b and not hit_a
    return only_a, only_b


def paired_ap(ranked_a: dict[str, list[str]], ranked_b: dict[str, list[str]], targets: dict[str, set[str]],
              k: int) -> tuple[int, int]:
    """Queries where A's AP@k is higher / lower than B's (ties carry no information), for
    :func:`sign_test_p` on a mAP benchmark. Arguments as in :func:`paired_hits`."""
    if set(ranked_a) != set(ranked_b):
        raise ValueError(f"the two rankings cover different queries ({len(ranked_a)} vs {len(ranked_b)})")
    qids = list(targets)

    def per_query(ranked: dict[str, list[str]]) -> torch.Tensor:
        relevance = torch.tensor([[name in targets[q] for name in ranked[q][:k]] + [False] * (k - len(ranked[q][:k]))
                                  for q in qids], dtype=torch.bool).reshape(len(qids), k)
        return average_precision_at_k(relevance, torch.tensor([len(targets[q]) for q in qids]), k)

    ap_a, ap_b = per_query(ranked_a), per_query(ranked_b)
    return int((ap_a > ap_b).sum()), int((ap_b > ap_a).sum())


def sign_test_p(only_a: int, only_b: int) -> float:
    """Exact two-sided sign (McNemar) test on discordant pairs: P(a split at least this
    uneven | A and B equally good). Ties (both hit or both miss) carry no information."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)
