"""Which neighbours of a query become its targets and its hard negatives.

MegaPairs (arXiv 2412.14475, section 3.1) retrieves each query image's nearest neighbours under
several similarity models and keeps a pair when its similarity lies in a window (0.8 < s < 0.96:
related, but not a near-duplicate); the other retrieved images serve as hard negatives. Where the
paper is silent we chose, and say so here:

* **Self and near-duplicates.** The query itself is never its own neighbour. A neighbour that *any*
  signal scores at or above its window's top is a near-duplicate of the query and is neither a
  target nor a hard negative (it would be a false negative), even where another signal's window
  holds it.
* **Targets** (at most K): the signals take turns, each giving its next in-window neighbour by
  descending similarity that is not taken yet, so every signal contributes (MegaPairs's
  heterogeneous pairs). A target several signals found is one pair carrying each signal and score
  (pairs are deduplicated per query; (a, b) and (b, a) are two pairs, two different retrieval tasks).
* **Hard negatives** (at most H, MegaPairs: 5): the other images of the same neighbour lists, not a
  target and not a near-duplicate, hardest (highest similarity under any signal) first. In-window
  neighbours beyond the K targets are among them, as MegaPairs's "the rest of the retrieved set".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Selection:
    """One query's pairs: targets [(row, signals, {signal: score})] best first, hard negatives [row]."""

    targets: list[tuple[int, list[str], dict[str, float]]] = field(default_factory=list)
    hard_negatives: list[int] = field(default_factory=list)


def without_self(scores: torch.Tensor, rows: torch.Tensor, query_rows: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, k) neighbour lists with the query's own row (and FAISS's -1 fillers) set to -inf / -1."""
    drop = (rows == query_rows[:, None]) | (rows < 0)
    return scores.masked_fill(drop, float("-inf")), rows.masked_fill(drop, -1)


def in_window_counts(scores: torch.Tensor, low: float, high: float) -> int:
    """Neighbours of a batch inside (low, high)."""
    return int(((scores > low) & (scores < high)).sum())


def select_pairs(found: dict[str, tuple[torch.Tensor, torch.Tensor]], windows: dict[str, tuple[float, float]],
                 k: int, h: int) -> list[Selection]:
    """Targets and hard negatives of B queries from each signal's (B, n) neighbour lists (scores and
    corpus rows, best first, self already removed by :func:`without_self`); ``windows`` signal ->
    (low, high). Returns B :class:`Selection` (empty for a query without an in-window neighbour)."""
    signals = list(found)
    lists = {s: (found[s][0].tolist(), found[s][1].tolist()) for s in signals}
    batch = len(next(iter(lists.values()))[0])
    out = []
    for b in range(batch):
        near_dup, window_hits, seen = set(), {}, {}
        for s in signals:
            low, high = windows[s]
            hits = []
            for score, row in zip(lists[s][0][b], lists[s][1][b]):
                if row < 0:
                    continue
                seen[row] = max(seen.get(row, float("-inf")), score)
                if score >= high:
                    near_dup.add(row)
                elif score > low:
                    hits.append((row, score))
            window_hits[s] = hits
        window_hits = {s: [(r, sc) for r, sc in hits if r not in near_dup] for s, hits in window_hits.items()}
        out.append(_choose(window_hits, seen, near_dup, signals, k, h))
    return out


def _choose(window_hits: dict[str, list[tuple[int, float]]], seen: dict[int, float], near_dup: set[int],
            signals: list[str], k: int, h: int) -> Selection:
    chosen: list[int] = []
    cursors = {s: 0 for s in signals}
    while len(chosen) < k and any(cursors[s] < len(window_hits[s]) for s in signals):
        for s in signals:
            hits = window_hits[s]
            while cursors[s] < len(hits) and hits[cursors[s]][0] in chosen:
                cursors[s] += 1
            if cursors[s] < len(hits) and len(chosen) < k:
                chosen.append(hits[cursors[s]][0])
                cursors[s] += 1
    selection = Selection()
    for row in chosen:
        scores = {s: round(sc, 5) for s in signals for r, sc in window_hits[s] if r == row}
        selection.targets.append((row, list(scores), scores))
    taken = set(chosen)
    rest = sorted((row for row in seen if row not in taken and row not in near_dup), key=lambda r: -seen[r])
    selection.hard_negatives = rest[:h]
    return selection


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """{"5%": ..., "95%": ...} of the finite ``values`` (a sample of neighbour similarities)."""
    values = values[torch.isfinite(values)].float()
    if values.numel() == 0:
        return {}
    got = torch.quantile(values[:1_000_000], torch.tensor(QUANTILES))
    return {f"{int(q * 100)}%": round(float(v), 4) for q, v in zip(QUANTILES, got)}
