"""Top-k inner-product search over an index's rows: exact (the default), FAISS flat (the same
ranking by FAISS's kernel, over the same rows), FAISS HNSW (approximate, for large galleries),
FAISS IVF (approximate, inverted lists over float16 rows: builds far faster than HNSW and holds the
rows once, at the index's own float16 size, for galleries beyond a memory-resident HNSW) and FAISS
IVF-PQ (approximate, for galleries whose matrix does not fit in memory: product-quantised codes of
D/8 bytes a row in memory pick a shortlist, whose rows alone are read from the memory-mapped parts
and rescored exactly in float32, so its scores are exact search's).

An index's rows are L2-normalised blocks (its memory-mapped float16 parts, :mod:`demind.search.index`);
no ranker joins them into one matrix, HNSW keeps a float32 copy (its graph search reads its own
rows), IVF a float16 one in its lists, IVF-PQ only codes. Measured against the bare matrix product,
and the HNSW, IVF and IVF-PQ settings chosen by recall@10 on CLIP-like clustered vectors, in
BENCHMARKS.md (search). A built FAISS ranker is saved beside its index (:mod:`.ranker_store`).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from demind.errors import MissingDependencyError
from demind.embedding_cache import advise_random_access
from demind.search.names import FAISS_HINT, RANKERS

log = logging.getLogger(__name__)

KINDS = RANKERS  # the search commands' choices (search/names.py, torch-free for --help)
APPROXIMATE = ("faiss-hnsw", "faiss-ivf", "faiss-ivfpq")  # the rest return exactly the exact top k
IVF_KINDS = ("faiss-ivf", "faiss-ivfpq")  # inverted lists: too few rows to split -> exact search, logged


HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 128  # chosen by recall@10 on clustered vectors (BENCHMARKS.md)
HNSW_EF_ROWS = 100_000  # efSearch grows with the gallery: HNSW_EF_SEARCH per this many rows (hnsw_ef_search)
# nlist ~ 4 sqrt(N), at most N / 39 (FAISS's minimum of 39 training rows a list); nprobe chosen by
# recall@10 >= 0.95 on clustered vectors at 100k rows (BENCHMARKS.md, search)
IVF_LISTS_PER_SQRT_ROW, IVF_TRAIN_PER_LIST, IVF_NPROBE = 4, 39, 16
IVF_MIN_LISTS = 16  # fewer rows than 16 lists of 39 (624): exact search instead, logged
# IVF-PQ: the IVF lists above, each row a code of m = D / 8 sub-quantizers of 8 bits (D / 8 bytes:
# 64 at D = 512, 1/16 of its float16 row); nprobe lists read and a shortlist of candidates rescored
# exactly. Rule: the smallest shortlist, then nprobe, reaching recall@10 0.95 on clustered and midpoint
# queries, one step up in each for margin. The shortlist needed grows with N (100 at 100k rows, 400 at
# 1M: more rows within the codes' error of the 10th), so it is 0.8 sqrt(N), at least 100 (BENCHMARKS.md)
IVFPQ_DIMS_PER_CODE, IVFPQ_BITS, IVFPQ_NPROBE = 8, 8, 8
IVFPQ_SHORTLIST_PER_SQRT_ROW, IVFPQ_MIN_SHORTLIST = 0.8, 100
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
                 ef_search: int | None = None, ef_construction: int = HNSW_EF_CONSTRUCTION,
                 nprobe: int | None = None, shortlist: int | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown ranker {kind!r}; choose from {', '.join(KINDS)}")
        self.kind = kind
        self.blocks = [features] if isinstance(features, torch.Tensor) else list(features)
        self.size = sum(len(b) for b in self.blocks)
        self.faiss_index = None
        self.build_s, self.recall_at_10 = 0.0, 1.0  # what to expect of this ranker (exact ones: 1)
        self.settings: dict[str, int] = {}
        self.shortlist = 0  # faiss-ivfpq: candidates rescored exactly per query
        self.fallback: str | None = None  # why an approximate ranker searches exactly instead
        self.saved_at = None  # the saved FAISS file it was loaded from (demind.search.ranker_store), if any
        if exact_fallback(kind, self.size):
            self.fallback = exact_fallback(kind, self.size)
            faiss_module()  # the user asked for FAISS: say so now, as on a large gallery
            log.info("%s over %d rows: %s; searching exactly instead (the same top k, recall 1)", kind, self.size,
                     self.fallback)
        elif kind in APPROXIMATE:
            start = time.perf_counter()
            if kind == "faiss-hnsw":
                self.faiss_index = build_hnsw_index(self.blocks, hnsw_m, ef_search or hnsw_ef_search(self.size),
                                                    ef_construction)
            elif kind == "faiss-ivf":
                self.faiss_index = build_ivf_index(self.blocks, nprobe=nprobe or IVF_NPROBE)
            else:
                self.faiss_index = build_ivfpq_index(self.blocks, nprobe=nprobe or IVFPQ_NPROBE)
                self.shortlist = shortlist or ivfpq_shortlist(self.size)
            self.settings = faiss_settings(kind, self.faiss_index, self.shortlist)
            self.build_s = time.perf_counter() - start
            self.recall_at_10 = self.measured_recall()
            log.info("%s over %d rows (%s): built in %.1f s, recall@10 %.3f against exact search", kind, self.size,
                     ", ".join(f"{k} {v}" for k, v in self.settings.items()), self.build_s, self.recall_at_10)
            self.advise_scattered_reads()
        elif kind == "faiss-flat":
            faiss_module()  # the same exact result, by FAISS's kernel over the stored rows (no copy)

    @classmethod
    def from_faiss(cls, features: torch.Tensor | list[torch.Tensor], kind: str, faiss_index, build_s: float,
                   recall_at_10: float) -> "Ranker":
        """An approximate ranker over ``features`` from an already built (saved) FAISS index of them:
        nothing is built or measured; ``build_s`` and ``recall_at_10`` are those of its build."""
        ranker = cls(features, "exact")
        ranker.kind, ranker.faiss_index = kind, faiss_index
        ranker.shortlist = ivfpq_shortlist(ranker.size) if kind == "faiss-ivfpq" else 0
        ranker.settings = faiss_settings(kind, faiss_index, ranker.shortlist)
        ranker.build_s, ranker.recall_at_10 = build_s, recall_at_10
        ranker.advise_scattered_reads()
        return ranker

    def advise_scattered_reads(self) -> None:
        """faiss-ivfpq reads only its shortlist's rows: no read-ahead around them on a cold page
        (:func:`demind.embedding_cache.advise_random_access`; after the build, whose scans want it)."""
        if self.kind == "faiss-ivfpq":
            for block in self.blocks:
                advise_random_access(block)

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
        if self.kind == "faiss-ivfpq":
            return self._rescored_top_k(queries, k)
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


    def _rescored_top_k(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """IVF-PQ: (B, D) queries -> the shortlist of max(k, shortlist) rows by their codes' scores,
        those rows alone read from the blocks and rescored in float32 -> (B, k) exact scores, rows."""
        wanted = max(k, self.shortlist)
        _, ids = self.faiss_index.search(queries.contiguous().numpy(), wanted)
        ids = torch.from_numpy(ids).long()  # (B, S); -1 where the lists read held fewer than S rows
        valid = ids >= 0
        rows = gather_rows(self.blocks, ids.clamp(min=0).flatten()).view(*ids.shape, -1)
        scores = torch.einsum("bsd,bd->bs", rows, queries).masked_fill(~valid, float("-inf"))
        top = torch.topk(scores, k, dim=1)
        scores, found = top.values, torch.gather(ids, 1, top.indices)
        short = torch.isinf(scores).any(dim=1)  # fewer than k candidates in the lists read: exact search
        if short.any():
            scores[short], found[short] = exact_top_k(self.blocks, queries[short], k)
        return scores, found


def faiss_settings(kind: str, faiss_index, shortlist: int = 0) -> dict[str, int]:
    """The settings of a built FAISS ranker of ``kind``, read from its index (a saved one's too)."""
    faiss = faiss_module()
    if kind == "faiss-hnsw":
        return {"M": faiss_index.hnsw.nb_neighbors(1), "efConstruction": faiss_index.hnsw.efConstruction,
                "efSearch": faiss_index.hnsw.efSearch}
    settings = {"nlist": faiss_index.nlist, "nprobe": faiss_index.nprobe}
    if kind == "faiss-ivfpq":
        pq = faiss.downcast_index(faiss_index).pq
        settings.update(m=pq.M, nbits=pq.nbits, shortlist=shortlist)
    return settings


def faiss_module():
    try:
        import faiss
    except ImportError as e:
        raise MissingDependencyError(f"rankers faiss-flat, faiss-hnsw, faiss-ivf and faiss-ivfpq need FAISS: "
                                     f"{FAISS_HINT}") from e
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
    """(n,) global row indices -> (n, D) float32 rows of ``blocks``, without joining the blocks; only
    those rows are read (of memory-mapped parts: their pages). In sorted order, one ``index_select``
    per block touched, in the blocks' own dtype (a shortlist spread over hundreds of parts costs one
    small step per part, not per row), converted to float32 once."""
    starts = torch.tensor(np.cumsum([0] + [len(b) for b in blocks]))
    order = torch.argsort(indices)
    ordered = indices[order]
    which = torch.searchsorted(starts, ordered.contiguous(), right=True) - 1
    local = ordered - starts[which]
    touched, counts = torch.unique_consecutive(which, return_counts=True)
    dtype = blocks[0].dtype if all(b.dtype == blocks[0].dtype for b in blocks) else torch.float32
    got = torch.empty(len(indices), blocks[0].shape[1], dtype=dtype)
    first = 0
    for block, count in zip(touched.tolist(), counts.tolist()):
        rows, at = blocks[block], local[first:first + count]
        if rows.dtype == dtype:
            torch.index_select(rows, 0, at, out=got[first:first + count])
        else:
            got[first:first + count] = rows[at].to(dtype)
        first += count
    out = torch.empty(len(indices), blocks[0].shape[1])
    out[order] = got.float()
    return out


def ivf_lists(rows: int) -> int:
    """nlist for ``rows`` rows: ~4 sqrt(N), at most N / 39 so that k-means has FAISS's minimum of
    training rows per list (0 for galleries too small to split)."""
    return min(round(IVF_LISTS_PER_SQRT_ROW * math.sqrt(rows)), rows // IVF_TRAIN_PER_LIST)


def hnsw_ef_search(rows: int) -> int:
    """efSearch for ``rows`` rows: 128 per 100,000 rows, at least 128. Measured (BENCHMARKS.md, search):
    queries between two clusters need a search that grows with the clusters; the smallest efSearch
    reaching recall@10 0.95 on them was 128 at 100k (0.9985; 64: 0.905) and 1,024 at 1M (0.9925;
    512: 0.727), so this rule gives 1,280 at 1M."""
    return max(HNSW_EF_SEARCH, round(HNSW_EF_SEARCH * rows / HNSW_EF_ROWS))


def ivf_train_rows(rows: int, nlist: int, train_per_list: int = 64) -> torch.Tensor:
    """The (n,) evenly spaced rows an IVF index over ``rows`` rows is trained on: ``train_per_list`` a list."""
    return torch.linspace(0, rows - 1, min(rows, train_per_list * nlist)).round().long()


def default_settings(kind: str, rows: int, dim: int) -> dict[str, int]:
    """The settings a ranker of ``kind`` is built with over ``rows`` rows of width ``dim`` (what a
    recorded measurement or a saved ranker must match); {} for the exact ones and the fallbacks."""
    if kind == "faiss-hnsw":
        return {"M": HNSW_M, "efConstruction": HNSW_EF_CONSTRUCTION, "efSearch": hnsw_ef_search(rows)}
    if kind not in IVF_KINDS or ivf_fallback(rows):
        return {}
    nlist = ivf_lists(rows)
    if kind == "faiss-ivf":
        return {"nlist": nlist, "nprobe": min(IVF_NPROBE, nlist)}
    return {"nlist": nlist, "nprobe": min(IVFPQ_NPROBE, nlist), "m": pq_subquantizers(dim),
            "nbits": pq_bits(len(ivf_train_rows(rows, nlist))), "shortlist": ivfpq_shortlist(rows)}


def exact_fallback(kind: str, rows: int) -> str | None:
    """Why the approximate ranker ``kind`` searches ``rows`` rows exactly instead (builds nothing, claims
    no measured recall), else None: an empty index, or too few rows for IVF's lists."""
    if kind not in APPROXIMATE:
        return None
    if rows == 0:
        return "the index holds no images (nothing to build)"
    return ivf_fallback(rows) if kind in IVF_KINDS else None


def ivf_fallback(rows: int) -> str | None:
    """Why faiss-ivf (and faiss-ivfpq) searches ``rows`` rows exactly instead (too few to split into
    lists), else None."""
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
    nlist, sample = ivf_plan(blocks, nlist, train_per_list)
    dim = blocks[0].shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)
    return train_and_fill(index, blocks, sample, nprobe)


def ivf_plan(blocks: list[torch.Tensor], nlist: int | None, train_per_list: int) -> tuple[int, torch.Tensor]:
    """(nlist, the (n,) rows to train on) of an IVF index over ``blocks`` (nlist default: :func:`ivf_lists`)."""
    size = sum(len(b) for b in blocks)
    nlist = nlist or ivf_lists(size)
    if not 1 <= nlist <= size:
        raise ValueError(f"an IVF index over {size} rows needs 1 to {size} lists, not {nlist}")
    return nlist, ivf_train_rows(size, nlist, train_per_list)


def train_and_fill(index, blocks: list[torch.Tensor], sample: torch.Tensor, nprobe: int):
    """Train a FAISS IVF ``index`` on the ``sample`` rows, add every row of ``blocks`` in float32
    chunks, read ``nprobe`` lists a query; returns it."""
    index.train(np.ascontiguousarray(gather_rows(blocks, sample).numpy()))
    for _, rows in _float_chunks(blocks, 1 << 16):
        index.add(np.ascontiguousarray(rows.numpy()))
    index.nprobe = min(nprobe, index.nlist)
    return index


def ivfpq_shortlist(rows: int) -> int:
    """Candidates faiss-ivfpq rescores per query over ``rows`` rows: 0.8 sqrt(N), at least 100."""
    return max(IVFPQ_MIN_SHORTLIST, round(IVFPQ_SHORTLIST_PER_SQRT_ROW * math.sqrt(rows)))


def pq_subquantizers(dim: int) -> int:
    """m for rows of width ``dim``: D / 8 sub-quantizers (8 dims each) when 8 divides D, else the
    largest divisor of D below that (FAISS needs m to divide D; at least 1)."""
    most = max(1, dim // IVFPQ_DIMS_PER_CODE)
    return next(m for m in range(most, 0, -1) if dim % m == 0)


def pq_bits(train_rows: int) -> int:
    """Bits a sub-quantizer code: 8 (256 centroids), fewer when ``train_rows`` cannot give each of
    them FAISS's minimum of 39 training rows (a small gallery; at least 4 bits, 16 centroids)."""
    return max(4, min(IVFPQ_BITS, int(math.log2(max(train_rows, 1) / IVF_TRAIN_PER_LIST))))


def build_ivfpq_index(blocks: list[torch.Tensor], nlist: int | None = None, nprobe: int = IVFPQ_NPROBE,
                      train_per_list: int = 64):
    """FAISS IVF-PQ (approximate inner product) over the rows of ``blocks``: the lists of
    :func:`build_ivf_index`, each row kept as a product-quantised code of its residual
    (:func:`pq_subquantizers` x :func:`pq_bits`: D / 8 bytes at 8 bits) and its 8-byte id, nothing
    else; ``nprobe`` lists read per query. The ranker rescores the candidates from ``blocks``."""
    faiss = faiss_module()
    nlist, sample = ivf_plan(blocks, nlist, train_per_list)
    dim = blocks[0].shape[1]
    m, nbits = pq_subquantizers(dim), pq_bits(len(sample))
    if dim % IVFPQ_DIMS_PER_CODE:
        log.info("faiss-ivfpq: width %d is not a multiple of %d: %d sub-quantizers of %d dims", dim,
                 IVFPQ_DIMS_PER_CODE, m, dim // m)
    quantizer = faiss.IndexFlatIP(dim)  # kept alive by the index's Python wrapper
    index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
    return train_and_fill(index, blocks, sample, nprobe)


def resident_bytes(faiss_index) -> dict[str, int]:
    """What an IVF ranker holds per row in memory: its codes and ids ({"codes", "ids"} bytes)."""
    faiss = faiss_module()
    ivf = faiss.extract_index_ivf(faiss_index)
    return {"codes": ivf.ntotal * ivf.code_size, "ids": ivf.ntotal * 8}
