"""Top-k inner-product search over an index's rows: exact (the default), FAISS flat (the same
ranking by FAISS's kernel, over the same rows), FAISS HNSW (approximate, for large galleries) and
FAISS IVF (approximate, inverted lists over float16 rows: builds far faster than HNSW and holds the
rows once, at the index's own float16 size, for galleries beyond a memory-resident HNSW).

An index's rows are L2-normalised blocks (its memory-mapped float16 parts, :mod:`demind.search.index`);
no ranker joins them into one matrix, HNSW keeps a float32 copy (its graph search reads its own
rows), IVF a float16 one in its lists. Measured against the bare matrix product, and the HNSW and
IVF settings chosen by recall@10 on CLIP-like clustered vectors, in BENCHMARKS.md (search).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from demind.config import MissingDependencyError
from demind.search.names import RANKERS

log = logging.getLogger(__name__)

KINDS = RANKERS  # the search commands' choices (search/names.py, torch-free for --help)
APPROXIMATE = ("faiss-hnsw", "faiss-ivf")  # the rest return exactly the exact top k


HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 128  # chosen by recall@10 on clustered vectors (BENCHMARKS.md)
# nlist ~ 4 sqrt(N), at most N / 39 (FAISS's minimum of 39 training rows a list); nprobe chosen by
# recall@10 >= 0.95 on clustered vectors at 100k rows (BENCHMARKS.md, search)
IVF_LISTS_PER_SQRT_ROW, IVF_TRAIN_PER_LIST, IVF_NPROBE = 4, 39, 16
IVF_MIN_LISTS = 16  # fewer rows than 16 lists of 39 (624): exact search instead, logged
CHUNK_ROWS = 8192  # rows converted to float32 at a time: a 16 MiB buffer that stays in cache


def _float_chunks(blocks: list[torch.Tensor], chunk: int = CHUNK_ROWS):
    """(offset, (n, D) float32 rows) over ``blocks``: float32 rows are passed as they are (no copy),
    others converted a chunk at a time into one reused buffer."""
    offset, buffer = 0, None
    for block in blocks:
        for start in range(0, len(block), chunk):
            rows = block[start:start + chunk]
            if rows.dtype != torch.float32:
                if buffer is None:
                    buffer = torch.empty(chunk, rows.shape[1])
                rows = buffer[:len(rows)].copy_(rows)
            yield offset + start, rows
        offset += len(block)


def exact_top_k(blocks: list[torch.Tensor], queries: torch.Tensor, k: int,
                batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, D) queries against the rows of ``blocks`` -> (B, k) inner products and row indices, best first.

    A row-major product (rows (n, D) @ queries (D, B)) over each chunk of rows in their stored
    precision, converted to float32 a chunk at a time, written into one (N, B) score buffer; queries
    in batches of ``batch``."""
    total = sum(len(b) for b in blocks)
    if len(queries) == 1 and blocks and all(b.dtype == torch.float16 for b in blocks):
        found = _exact_top_k_fp16(blocks, queries[0].float(), k, total)
        if found is not None:
            return found
    out_scores, out_rows = [], []
    for first in range(0, len(queries), batch):
        q = queries[first:first + batch].float().T.contiguous()
        scores = torch.empty(total, q.shape[1])
        for offset, rows in _float_chunks(blocks):
            torch.mm(rows, q, out=scores[offset:offset + len(rows)])
        top = torch.topk(scores, k, dim=0)
        out_scores.append(top.values.T)
        out_rows.append(top.indices.T)
    return torch.cat(out_scores), torch.cat(out_rows)


FP16_MARGIN = 2e-3  # > twice the error of a float16 product of unit vectors (output and query rounding)


def _exact_top_k_fp16(blocks: list[torch.Tensor], query: torch.Tensor, k: int,
                      total: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One (D,) query over float16 rows at the speed of torch's float16 matrix-vector product (it
    reads half the bytes; it accumulates in float32 and rounds each score to float16): every row
    within ``FP16_MARGIN`` of the k-th of those scores is rescored in float32, so the result is
    that of the float32 product. None when too many rows tie (the caller takes the float32 path)."""
    scores = torch.empty(total, dtype=torch.float16)
    offset, q16 = 0, query.half()
    for block in blocks:
        torch.mv(block, q16, out=scores[offset:offset + len(block)])
        offset += len(block)
    kth = float(torch.topk(scores, k).values[-1])
    candidates = torch.nonzero(scores.float() >= kth - FP16_MARGIN)[:, 0]
    if len(candidates) > 1 << 16:
        return None
    top = torch.topk(gather_rows(blocks, candidates) @ query, k)
    return top.values[None], candidates[top.indices][None]


class Ranker:
    """Top-k inner-product search over L2-normalised rows: one (N, D) tensor or the blocks of an index."""

    def __init__(self, features: torch.Tensor | list[torch.Tensor], kind: str = "exact", hnsw_m: int = HNSW_M,
                 ef_search: int = HNSW_EF_SEARCH, ef_construction: int = HNSW_EF_CONSTRUCTION,
                 nprobe: int = IVF_NPROBE) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown ranker {kind!r}; choose from {', '.join(KINDS)}")
        self.kind = kind
        self.blocks = [features] if isinstance(features, torch.Tensor) else list(features)
        self.size = sum(len(b) for b in self.blocks)
        self.faiss_index = None
        self.build_s, self.recall_at_10 = 0.0, 1.0  # what to expect of this ranker (exact ones: 1)
        self.settings: dict[str, int] = {}
        self.fallback: str | None = None  # why an approximate ranker searches exactly instead
        if kind == "faiss-ivf" and ivf_fallback(self.size):
            self.fallback = ivf_fallback(self.size)
            faiss_module()  # the user asked for FAISS: say so now, as on a large gallery
            log.info("faiss-ivf over %d rows: %s; searching exactly instead (the same top k, recall 1)", self.size,
                     self.fallback)
        elif kind in APPROXIMATE:
            start = time.perf_counter()
            if kind == "faiss-hnsw":
                self.faiss_index = build_hnsw_index(self.blocks, hnsw_m, ef_search, ef_construction)
                self.settings = {"M": hnsw_m, "efConstruction": ef_construction, "efSearch": ef_search}
            else:
                self.faiss_index = build_ivf_index(self.blocks, nprobe=nprobe)
                self.settings = {"nlist": self.faiss_index.nlist, "nprobe": self.faiss_index.nprobe}
            self.build_s = time.perf_counter() - start
            self.recall_at_10 = self.measured_recall()
            log.info("%s over %d rows (%s): built in %.1f s, recall@10 %.3f against exact search", kind, self.size,
                     ", ".join(f"{k} {v}" for k, v in self.settings.items()), self.build_s, self.recall_at_10)
        elif kind == "faiss-flat":
            faiss_module()  # the same exact result, by FAISS's kernel over the stored rows (no copy)

    @property
    def features(self) -> torch.Tensor:
        """(N, D) float32 copy of every row (small galleries, tests)."""
        return torch.cat([b.float() for b in self.blocks])

    def measured_recall(self, n: int = 100, k: int = 10) -> float:
        """recall@k of this ranker against exact search, on ``n`` queries made of the gallery (the
        normalised mean of two random rows: near the gallery, as real queries are, but not in it)."""
        if self.size < 2:
            return 1.0
        g = torch.Generator().manual_seed(0)
        pick = torch.randint(0, self.size, (n, 2), generator=g)
        queries = torch.nn.functional.normalize(gather_rows(self.blocks, pick[:, 0]) +
                                                gather_rows(self.blocks, pick[:, 1]), dim=-1)
        k = min(k, self.size)
        _, truth = exact_top_k(self.blocks, queries, k)
        _, found = self.top_k(queries, k)
        return sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(truth, found)) / (n * k)

    def top_k(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) queries -> (B, k') scores and row indices, best first; k' = min(k, N)."""
        k = min(k, self.size)
        queries = queries.float().cpu()
        if self.kind == "exact" or self.fallback:
            return exact_top_k(self.blocks, queries, k)
        if self.kind in APPROXIMATE:
            scores, rows = self.faiss_index.search(queries.contiguous().numpy(), k)
            return torch.from_numpy(scores), torch.from_numpy(rows).long()
        faiss, found = faiss_module(), []
        for offset, rows in _float_chunks(self.blocks, 1 << 16):
            scores, index = faiss.knn(queries.contiguous().numpy(), rows.numpy(), min(k, len(rows)),
                                      metric=faiss.METRIC_INNER_PRODUCT)
            found.append((torch.from_numpy(scores), torch.from_numpy(index).long() + offset))
        scores, rows = torch.cat([s for s, _ in found], 1), torch.cat([r for _, r in found], 1)
        top = torch.topk(scores, k, dim=1)
        return top.values, torch.gather(rows, 1, top.indices)


def faiss_module():
    try:
        import faiss
    except ImportError as e:
        raise MissingDependencyError("rankers faiss-flat, faiss-hnsw and faiss-ivf need FAISS: "
                                     "pip install -e '.[search]' "
                                     "(faiss-cpu)") from e
    return faiss


def build_hnsw_index(blocks: list[torch.Tensor], hnsw_m: int = HNSW_M, ef_search: int = HNSW_EF_SEARCH,
                     ef_construction: int = HNSW_EF_CONSTRUCTION):
    """FAISS HNSW (approximate inner product) over the rows of ``blocks``; it keeps its own float32
    copy of the rows, which its graph search reads."""
    faiss = faiss_module()
    index = faiss.IndexHNSWFlat(blocks[0].shape[1] if blocks else 1, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.hnsw.efSearch = ef_search
    for _, rows in _float_chunks(blocks, 1 << 16):
        index.add(np.ascontiguousarray(rows.numpy()))
    return index


def gather_rows(blocks: list[torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
    """(n,) global row indices -> (n, D) float32 rows of ``blocks``, without joining the blocks."""
    starts = torch.tensor(np.cumsum([0] + [len(b) for b in blocks]))
    which = torch.searchsorted(starts, indices.contiguous(), right=True) - 1
    out = torch.empty(len(indices), blocks[0].shape[1])
    for block in torch.unique(which).tolist():
        mask = which == block
        out[mask] = blocks[block][indices[mask] - starts[block]].float()
    return out


def ivf_lists(rows: int) -> int:
    """nlist for ``rows`` rows: ~4 sqrt(N), at most N / 39 so that k-means has FAISS's minimum of
    training rows per list (0 for galleries too small to split)."""
    return min(round(IVF_LISTS_PER_SQRT_ROW * math.sqrt(rows)), rows // IVF_TRAIN_PER_LIST)


def ivf_fallback(rows: int) -> str | None:
    """Why faiss-ivf searches ``rows`` rows exactly instead (too few to split into lists), else None."""
    if ivf_lists(rows) >= IVF_MIN_LISTS:
        return None
    return f"{rows} rows are fewer than {IVF_MIN_LISTS} lists of {IVF_TRAIN_PER_LIST} training rows"


def build_ivf_index(blocks: list[torch.Tensor], nlist: int | None = None, nprobe: int = IVF_NPROBE,
                    train_per_list: int = 64):
    """FAISS IVF (approximate inner product) over the rows of ``blocks``: ``nlist`` k-means lists
    (default :func:`ivf_lists`) trained on up to ``train_per_list`` evenly spaced rows a list; rows
    kept as float16 (scalar quantizer fp16: the index's stored values, so scores within a list are
    those of exact search), ``nprobe`` lists read per query."""
    faiss = faiss_module()
    size = sum(len(b) for b in blocks)
    nlist = nlist or ivf_lists(size)
    if not 1 <= nlist <= size:
        raise ValueError(f"an IVF index over {size} rows needs 1 to {size} lists, not {nlist}")
    dim = blocks[0].shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)
    sample = torch.linspace(0, size - 1, min(size, train_per_list * nlist)).round().long()
    index.train(np.ascontiguousarray(gather_rows(blocks, sample).numpy()))
    for _, rows in _float_chunks(blocks, 1 << 16):
        index.add(np.ascontiguousarray(rows.numpy()))
    index.nprobe = min(nprobe, nlist)
    return index
