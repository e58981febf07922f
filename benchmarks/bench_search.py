"""Search at scale: index build rate, query embedding latency, and, over synthetic CLIP-like
galleries of each ``--gallery`` size, what opening the index costs (time, resident memory), each
ranker's per-query latency against the bare matrix product, recall@10 of the approximate ones,
whether float16 rows change rankings, and the bytes compaction writes.

    .venv/bin/python -m benchmarks.bench_search --images runs/quickstart/benchmarks/cirr/dev \\
        --gallery 100000,1000000 --queries 200 --json bench_search.json
    .venv/bin/python -m benchmarks.bench_search --ivf-only --gallery 100000 --queries 200   # the faiss-ivf nprobe sweep
    .venv/bin/python -m benchmarks.bench_search --hnsw-only --gallery 1000000 --queries 200  # the chosen HNSW setting
    .venv/bin/python -m benchmarks.bench_search --ivfpq-only --gallery 100000 --queries 200  # faiss-ivfpq sweep

* Build rate: ``demind.search.index.build_index`` on the images of ``--images`` with the toy CLIP
  architecture (random weights: the same compute as the trained toy CLIP), from nothing and as a
  rerun with nothing changed.
* Query embedding: one De-MINDS, mapping-only and Image+Text query through ``Searcher.embed``.
* Per gallery size N (``--dim`` 512, ViT-B-32's width): a synthetic index written in the index's
  own layout (float16 L2-normalised parts of 4,096 rows, names once in the manifest) from
  *clustered* vectors like CLIP's (a shared direction, 2,000 clusters, per-row noise: unrelated
  rows at cosine ~0.37, same-cluster rows ~0.74; isotropic random vectors are HNSW's worst case
  and no gallery looks like them). Opening is timed in a fresh process (``open_s``, added RSS
  after opening and after the first query, against the stored matrix's bytes). Rankers are
  timed one query at a time (p50) and in batches of 32 (per query), against the bare product
  ``rows @ q`` of the same rows held in memory as float32 (``bare_fp32``, what the issue calls the
  plain matrix-vector product) and as float16 (``bare_fp16``). ``fp16`` compares the top 10 of
  float16 rows with that of the float32 rows. ``compaction`` removes 1 % of the rows and
  rewrites the parts (``ImageFeatureCache.replace_all``, what ``demind-index`` runs).
Timings, so never run in the test suite (a tiny smoke row checks the script runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig, ModelConfig
from demind.embedding_cache import cache_slug
from demind.model import DeMinds
from demind.retrieval import ImageFeatureCache
from demind.search.index import ROLE, GalleryIndex, build_index, load_index
from demind.search.index_manifest import INDEX_FORMAT, MANIFEST
from demind.search.query import Searcher, SearchQuery
from demind.search.ranker_store import open_ranker, save_ranker
from demind.search.rankers import (HNSW_EF_CONSTRUCTION, HNSW_M, IVFPQ_NPROBE, Ranker, build_hnsw_index,
                                   build_ivf_index, build_ivfpq_index, exact_top_k, faiss_module, gather_rows,
                                   ivfpq_shortlist, resident_bytes)

TOY_CLIP = Path(__file__).resolve().parents[1] / "toyworld" / "model_configs" / "toy-clip-cnn-text2.json"
TEXT = "make the square red and the background green"
PART_ROWS = 4096
K = 10


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 3), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 3)}


def timed(fn, repeats: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------- build and embed


def bench_build(images: Path, backbone: FrozenCLIP, workers: int) -> dict:
    print(f"building an index of {images} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        first = build_index(images, Path(tmp) / "index", backbone, batch_size=128, num_workers=workers, progress=False)
        rerun = build_index(images, Path(tmp) / "index", backbone, batch_size=128, num_workers=workers, progress=False)
    return {"images": first.indexed, "build_s": round(first.seconds, 2),
            "images_per_s": round(first.indexed / first.seconds, 1),
            "rerun_unchanged_s": round(rerun.seconds, 2), "rerun_encoded": rerun.encoded}


def bench_embed(backbone: FrozenCLIP, reference: Path, repeats: int, model_cfg: ModelConfig | None = None) -> dict:
    print("query embedding ...", flush=True)
    torch.manual_seed(0)
    model_cfg = model_cfg or ModelConfig(num_queries=4, num_blocks=6, num_heads=8, mapping_hidden=512)
    model = DeMinds(model_cfg, backbone).eval()
    index = GalleryIndex(Path("synthetic"), Path("."), ["a"], torch.ones(1, backbone.embed_dim) / backbone.embed_dim ** 0.5,
                         backbone.identity, cache_slug(backbone), backbone.cfg.precision)
    searcher = Searcher(backbone, model, index)
    out = {}
    for method in ("demind", "mapping-only", "image+text"):
        query = SearchQuery(image=reference, text=TEXT, method=method)
        out[method] = percentiles(timed(lambda: searcher.embed(query), repeats, warm=3))
    out["demind_over_mapping_only_p50"] = round(out["demind"]["p50_ms"] / out["mapping-only"]["p50_ms"], 3)
    # the query's text side alone (the reference image's embedding given): what the two methods differ in
    with torch.no_grad():
        from PIL import Image

        ref = backbone.encode_image(backbone.preprocess(Image.open(reference).convert("RGB")).unsqueeze(0))
        prompt = "a photo of * , " + TEXT
        for method in ("demind", "mapping-only"):
            embed = searcher.method(method).embed
            out[f"{method}_text_side"] = percentiles(timed(lambda: embed(ref, [prompt], [TEXT]), repeats, warm=3))
    out["demind_over_mapping_only_text_side_p50"] = round(
        out["demind_text_side"]["p50_ms"] / out["mapping-only_text_side"]["p50_ms"], 3)
    return out


def bench_embed_threads(backbone: FrozenCLIP, reference: Path, repeats: int, threads: list[int]) -> dict:
    """Batch-1 query latency per torch thread count (what ``run.threads`` chooses)."""
    before, out = torch.get_num_threads(), {}
    for n in threads:
        torch.set_num_threads(n)
        out[str(n)] = bench_embed(backbone, reference, repeats)
    torch.set_num_threads(before)
    return out


# --------------------------------------------------------------------------- synthetic galleries


def clustered(n: int, dim: int, seed: int, clusters: int = 2000) -> torch.Tensor:
    """(n, dim) L2-normalised CLIP-like rows: 0.6 * a shared direction + 0.6 * one of ``clusters``
    centres + noise of norm ~0.5 (the same centres and direction for every seed)."""
    base = torch.Generator().manual_seed(12345)
    shared = F.normalize(torch.randn(dim, generator=base), dim=0)
    centres = F.normalize(torch.randn(clusters, dim, generator=base), dim=-1)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, clusters, (n,), generator=g)
    rows = 0.6 * shared + 0.6 * centres[pick] + 0.5 * torch.randn(n, dim, generator=g) / dim ** 0.5
    return F.normalize(rows, dim=-1)


def write_synthetic_index(folder: Path, n: int, dim: int) -> tuple[torch.Tensor, float]:
    """An index folder in the layout ``build_index`` writes, of ``n`` clustered rows; returns the
    float32 rows (before rounding to float16) and the seconds it took."""
    start = time.perf_counter()
    cache = ImageFeatureCache.at(folder, dtype=torch.float16, normalise=True)
    identity = {"name": "synthetic", "pretrained": None}
    parts, names, chunks = [], [], []
    for first in range(0, n, PART_ROWS):
        rows = clustered(min(PART_ROWS, n - first), dim, seed=first)
        chunk_names = [f"img/{i:07d}.jpg" for i in range(first, first + len(rows))]
        record = cache.write_part(ROLE, chunk_names, [f"{x}|{len(x)}" for x in chunk_names], cache.stored(rows), identity)
        parts.append([record.stem, len(rows)])
        names += chunk_names
        chunks.append(rows)
    manifest = {"format": INDEX_FORMAT, "root": str(folder), "backbone": identity, "backbone_slug": "synthetic",
                "precision": "fp32", "embed_dim": dim, "dtype": "float16", "parts": parts, "images": names,
                "members": {}, "unreadable": {}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return torch.cat(chunks), time.perf_counter() - start


def _open_probe(folder: str, query: list[float]) -> dict:
    """In a fresh process: open the index, then rank one query (which reads every row)."""
    torch.set_num_threads(1)
    before = rss_mb()
    start = time.perf_counter()
    index = load_index(folder)
    opened = time.perf_counter() - start
    after_open = rss_mb()
    start = time.perf_counter()
    Ranker(index.blocks).top_k(torch.tensor([query]), K)
    first_query = time.perf_counter() - start
    return {"open_s": round(opened, 3), "added_rss_mb_after_open": round(after_open - before, 1),
            "first_query_s": round(first_query, 3), "added_rss_mb_after_first_query": round(rss_mb() - before, 1)}


def open_in_fresh_process(folder: Path, query: torch.Tensor) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_open_probe, (str(folder), query.tolist()))


def overlap(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [len(set(x.tolist()) & set(y.tolist())) / a.shape[1] for x, y in zip(a, b)]


def fp16_agreement(rows32: torch.Tensor, blocks: list[torch.Tensor], queries: torch.Tensor) -> dict:
    """Top 10 of the float16 rows against that of the float32 rows: the overlap, and for rows in one
    top 10 but not the other, how far (in float32 score) they are from the 10th score: only near-ties swap."""
    s32, r32 = torch.topk(queries @ rows32.T, K, dim=1)
    _, r16 = exact_top_k(blocks, queries, K)
    shared = overlap(r32, r16)
    gaps = []
    for q, a, b, tenth in zip(queries, r32, r16, s32[:, -1]):
        for row in set(a.tolist()) ^ set(b.tolist()):
            gaps.append(abs(float(q @ rows32[row]) - float(tenth)))
    return {"top10_overlap_mean": round(float(np.mean(shared)), 5), "top10_overlap_min": round(min(shared), 3),
            "queries_with_a_swap": sum(1 for x in shared if x < 1), "max_swapped_score_gap": round(max(gaps, default=0.0), 6)}


def bench_rankers(index, rows32: torch.Tensor, queries: torch.Tensor, repeats: int, hnsw: bool) -> dict:
    q1 = [q[None] for q in queries[:repeats]]
    out = {}
    it = iter(range(10 ** 9))
    bare32 = rows32.contiguous()
    bare16 = torch.cat(index.blocks) if len(index.blocks) > 1 else index.blocks[0].clone()
    out["bare_fp32"] = percentiles(timed(lambda: bare32 @ q1[next(it) % len(q1)][0], repeats))
    out["bare_fp16"] = percentiles(timed(lambda: bare16 @ q1[next(it) % len(q1)][0].half(), repeats))
    del bare16
    for kind in ("exact", "faiss-flat"):
        ranker = Ranker(index.blocks, kind)
        out[kind] = percentiles(timed(lambda: ranker.top_k(q1[next(it) % len(q1)], K), repeats))
        batch = queries[:32]
        out[kind]["batch32_per_query_ms"] = round(
            statistics.median(timed(lambda: ranker.top_k(batch, K), 3, warm=1)) * 1000 / len(batch), 3)
        out[kind]["vs_bare_fp32"] = round(out["bare_fp32"]["p50_ms"] / out[kind]["p50_ms"], 3)
        out[kind]["vs_bare_fp16"] = round(out["bare_fp16"]["p50_ms"] / out[kind]["p50_ms"], 3)
    if hnsw:
        out["faiss-hnsw"] = bench_hnsw(index.blocks, queries, repeats)
    return out


def bench_hnsw(blocks: list[torch.Tensor], queries: torch.Tensor, repeats: int,
               settings: tuple[tuple[int, int], ...] = ((16, 40), (32, 80)), midpoints: bool = False,
               ef_searches: tuple[int, ...] = (32, 64, 128, 256)) -> dict:
    """recall@10 (against the exact top 10 of the same rows) and latency per HNSW setting (M,
    efConstruction) and efSearch; with ``midpoints`` also on the midpoint query set (:func:`query_sets`)."""
    sets = query_sets(blocks, queries) if midpoints else {"clustered": queries}
    truths = {name: exact_top_k(blocks, q, K)[1] for name, q in sets.items()}
    out = {}
    for m, ef_construction in settings:
        start = time.perf_counter()
        index = build_hnsw_index(blocks, m, 64, ef_construction)
        build_s = time.perf_counter() - start
        print(f"HNSW M {m} efConstruction {ef_construction}: built in {build_s:.1f} s", flush=True)
        for ef_search in ef_searches:
            index.hnsw.efSearch = ef_search
            row = {}
            for name, q in sets.items():
                _, rows = index.search(q.numpy(), K)
                key = "recall_at_10" if name == "clustered" else f"recall_at_10_{name}"
                row[key] = round(float(np.mean(overlap(truths[name], torch.from_numpy(rows)))), 4)
            it = iter(range(10 ** 9))
            times = timed(lambda: index.search(queries[next(it) % len(queries)][None].numpy(), K), repeats)
            out[f"M{m}-efC{ef_construction}-ef{ef_search}"] = {**row, "build_s": round(build_s, 1),
                                                              **percentiles(times)}
        del index
    return out


def query_sets(blocks: list[torch.Tensor], queries: torch.Tensor) -> dict[str, torch.Tensor]:
    """``clustered``: ``queries`` (new rows of the gallery's clusters); ``midpoint``: the normalised
    mean of two random gallery rows, mostly of two clusters (the queries ``Ranker.measured_recall``
    and ``demind-index --measure-rankers`` use; harder for IVF, whose lists they straddle)."""
    g = torch.Generator().manual_seed(1)
    pick = torch.randint(0, sum(len(b) for b in blocks), (len(queries), 2), generator=g)
    midpoint = F.normalize(gather_rows(blocks, pick[:, 0]) + gather_rows(blocks, pick[:, 1]), dim=-1)
    return {"clustered": queries, "midpoint": midpoint}


def bench_ivf(blocks: list[torch.Tensor], queries: torch.Tensor, repeats: int) -> dict:
    """recall@10 (against the exact top 10 of the same rows) and latency per IVF nprobe, nlist by
    :func:`ivf_lists` (the ranker's). Two query sets: ``queries`` (new rows of the gallery's
    clusters) and ``midpoint`` (the normalised mean of two random gallery rows, mostly of two
    clusters: the queries ``Ranker.measured_recall`` and ``demind-index --measure-rankers`` use)."""
    sets = query_sets(blocks, queries)
    truths = {name: exact_top_k(blocks, q, K)[1] for name, q in sets.items()}
    start = time.perf_counter()
    index = build_ivf_index(blocks)
    out = {"nlist": index.nlist, "build_s": round(time.perf_counter() - start, 1)}
    for nprobe in (1, 2, 4, 8, 16, 32, 64, 128):
        index.nprobe = nprobe
        row = {}
        for name, q in sets.items():
            _, rows = index.search(q.numpy(), K)
            row[f"recall_at_10_{name}"] = round(float(np.mean(overlap(truths[name], torch.from_numpy(rows)))), 4)
        it = iter(range(10 ** 9))
        times = timed(lambda: index.search(queries[next(it) % len(queries)][None].numpy(), K), repeats)
        out[f"nprobe{nprobe}"] = {**row, **percentiles(times)}
    return out


IVFPQ_NPROBES, IVFPQ_SHORTLISTS = (4, 8, 16, 32, 64), (20, 50, 100, 200, 400, 800)


def bench_ivfpq(blocks: list[torch.Tensor], queries: torch.Tensor, repeats: int) -> dict:
    """recall@10 against exact search (both :func:`query_sets`) and p50 latency of the faiss-ivfpq
    ranker (codes, then the shortlist rescored from ``blocks``) per nprobe x shortlist; its build
    seconds and resident bytes (codes + ids, and the whole serialised FAISS index) against the
    float16 matrix's."""
    sets = query_sets(blocks, queries)
    truths = {name: exact_top_k(blocks, q, K)[1] for name, q in sets.items()}
    start = time.perf_counter()
    index = build_ivfpq_index(blocks)
    build_s = time.perf_counter() - start
    ranker = Ranker.from_faiss(blocks, "faiss-ivfpq", index, build_s, float("nan"))
    held = resident_bytes(index)
    matrix = sum(b.numel() for b in blocks) * 2
    out = {"nlist": index.nlist, "m": ranker.settings["m"], "nbits": ranker.settings["nbits"],
           "build_s": round(build_s, 1), "codes_bytes": held["codes"], "ids_bytes": held["ids"],
           "serialised_bytes": int(faiss_module().serialize_index(index).size), "fp16_matrix_bytes": matrix,
           "codes_and_ids_over_fp16_matrix": round((held["codes"] + held["ids"]) / matrix, 4)}
    print(f"IVF-PQ nlist {index.nlist} m {out['m']} nbits {out['nbits']}: built in {build_s:.1f} s", flush=True)
    chosen = (IVFPQ_NPROBE, ivfpq_shortlist(ranker.size))  # the ranker's default here
    grid = [(nprobe, shortlist, f"nprobe{nprobe}-shortlist{shortlist}")
            for nprobe in IVFPQ_NPROBES for shortlist in IVFPQ_SHORTLISTS]
    for nprobe, shortlist, key in grid + [(*chosen, f"chosen-nprobe{chosen[0]}-shortlist{chosen[1]}")]:
        index.nprobe, ranker.shortlist = nprobe, shortlist
        row = {}
        for name, q in sets.items():
            row[f"recall_at_10_{name}"] = round(float(np.mean(overlap(truths[name], ranker.top_k(q, K)[1]))), 4)
        it = iter(range(10 ** 9))
        times = timed(lambda: ranker.top_k(queries[next(it) % len(queries)][None], K), repeats)
        out[key] = {**row, **percentiles(times)}
    out["_index"] = index  # for the saved-ranker timing (dropped from the results)
    return out


def time_saved_ranker(folder: Path, faiss_index, build_s: float) -> dict:
    """Save the built faiss-ivfpq ranker into the index ``folder`` (what demind-index
    --measure-rankers does), then open the index and its ranker as a search start does: seconds and
    bytes, and whether it was loaded (not rebuilt)."""
    built = Ranker.from_faiss(load_index(folder).blocks, "faiss-ivfpq", faiss_index, build_s, 0.0)
    built.recall_at_10 = built.measured_recall()  # what the ranker measures and records of itself
    start = time.perf_counter()
    saved = save_ranker(built, folder)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    ranker = open_ranker(load_index(folder), "faiss-ivfpq")
    return {"recall_at_10_self_measured": built.recall_at_10, "save_s": round(save_s, 2),
            "file_bytes": saved.with_suffix(".faiss").stat().st_size, "start_s": round(time.perf_counter() - start, 2),
            "loaded_not_built": ranker.saved_at is not None}


def evict_parts(folder: Path) -> None:
    """Drop the index's part files from the OS page cache (posix_fadvise DONTNEED): their next reads
    come from the disk, as in a gallery larger than memory. Pages a live mapping has touched stay."""
    for path in (folder / ROLE).glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_queries(folder: Path, queries: torch.Tensor, n: int) -> dict:
    """p50 ms of one query whose rows come from the disk: per query the index and its ranker are
    opened anew (the saved faiss-ivfpq ranker is loaded), the parts evicted, then the query timed;
    ``n`` queries for faiss-ivfpq (it reads its shortlist's rows), 3 for exact (it reads every row).
    Two rows check the choice of advice: faiss-ivfpq with the OS's read-ahead kept (as before the
    ranker advised its rows), and exact with its rows advised as randomly read."""
    import demind.search.rankers as rankers_module

    out, advise = {}, rankers_module.advise_random_access
    rows = (("faiss-ivfpq", n, advise, False), ("faiss-ivfpq with read-ahead", n, lambda block: False, False),
            ("exact", 3, advise, False), ("exact advised as randomly read", 3, advise, True))
    for name, count, advice, advise_exact in rows:
        kind = name.split(" ")[0]
        rankers_module.advise_random_access = advice
        times = []
        for query in queries[:count]:
            gc.collect()  # the previous query's mappings go, so eviction can drop their pages
            index = load_index(folder)
            ranker = open_ranker(index, kind) if kind != "exact" else Ranker(index.blocks)
            for block in index.blocks if advise_exact else ():
                advise(block)
            evict_parts(folder)
            start = time.perf_counter()
            ranker.top_k(query[None], K)
            times.append(time.perf_counter() - start)
            del ranker, index
        out[name] = percentiles(times)
    rankers_module.advise_random_access = advise
    return out


def sweep_sizes(kind: str, measure: Callable, sizes: list[int], dim: int, n_queries: int, work: Path,
                cold: int = 0) -> dict:
    """``--ivf-only`` / ``--ivfpq-only`` / ``--hnsw-only``: per gallery size, a synthetic index, the exact
    ranker's latency (for scale) and ``measure(blocks, queries, repeats, folder)``, the ranker's sweep;
    with ``cold`` (faiss-ivfpq) also :func:`cold_queries` once the sweep's mappings are gone."""
    out = {}
    for n in sizes:
        print(f"{kind} over {n:,} x {dim} ...", flush=True)
        folder = work / f"index-{n}"
        write_synthetic_index(folder, n, dim)
        index = load_index(folder)
        queries = clustered(n_queries, dim, seed=10 ** 9)
        it = iter(range(10 ** 9))
        exact = Ranker(index.blocks)
        out[f"{n}x{dim}"] = {"exact": percentiles(timed(lambda: exact.top_k(queries[next(it) % n_queries][None], K),
                                                        min(n_queries, 50))),
                             kind: measure(index.blocks, queries, min(n_queries, 50), folder)}
        if cold:
            del index, exact
            out[f"{n}x{dim}"]["cold"] = cold_queries(folder, queries, cold)
        print(json.dumps(out[f"{n}x{dim}"], indent=1), flush=True)
    return out


def ivfpq_sweep(blocks: list[torch.Tensor], queries: torch.Tensor, repeats: int, folder: Path) -> dict:
    """The faiss-ivfpq sweep, then the chosen ranker saved into ``folder`` and a start that loads it."""
    built = bench_ivfpq(blocks, queries, repeats)
    built["saved"] = time_saved_ranker(folder, built.pop("_index"), built["build_s"])
    return built


def hnsw_sweep(ef_searches: tuple[int, ...]) -> Callable:
    """The chosen HNSW setting's efSearch sweep on both query sets."""
    return lambda blocks, queries, repeats, folder: bench_hnsw(
        blocks, queries, repeats, ((HNSW_M, HNSW_EF_CONSTRUCTION),), midpoints=True, ef_searches=ef_searches)


def bench_compaction(folder: Path, index) -> dict:
    """Remove 1 % of the rows and compact: bytes of the tensor files (and of every file) written
    against the bytes of the remaining rows."""
    keep = [i for i in range(len(index)) if i % 100 != 7]
    rows = torch.cat(index.blocks)[keep]
    names = [index.names[i] for i in keep]
    cache = ImageFeatureCache.at(folder, dtype=torch.float16, normalise=True)
    start = time.perf_counter()
    cache.replace_all(ROLE, names, [f"{x}|{len(x)}" for x in names], rows, PART_ROWS, {"name": "synthetic"})
    seconds = time.perf_counter() - start
    tensors = sum(p.stat().st_size for p in (folder / ROLE).glob("*.safetensors"))
    records = sum(p.stat().st_size for p in (folder / ROLE).glob("*.json"))
    row_bytes = rows.numel() * rows.element_size()
    return {"rows": len(keep), "row_bytes": row_bytes, "tensor_file_bytes": tensors, "record_bytes": records,
            "tensor_files_over_rows": round(tensors / row_bytes, 4),
            "all_part_files_over_rows": round((tensors + records) / row_bytes, 4), "seconds": round(seconds, 2)}


def bench_gallery(n: int, dim: int, n_queries: int, hnsw: bool, work: Path) -> dict:
    print(f"gallery of {n:,} x {dim} ...", flush=True)
    folder = work / f"index-{n}"
    rows32, write_s = write_synthetic_index(folder, n, dim)
    queries = clustered(n_queries, dim, seed=10 ** 9)
    out = {"write_s": round(write_s, 2), "matrix_mb_fp16": round(n * dim * 2 / 2 ** 20, 1),
           "matrix_mb_fp32": round(n * dim * 4 / 2 ** 20, 1)}
    out["open"] = open_in_fresh_process(folder, queries[0])
    out["open"]["added_rss_after_first_query_over_fp16_matrix"] = round(
        out["open"]["added_rss_mb_after_first_query"] / (n * dim * 2 / 2 ** 20), 3)  # not the rounded MiB
    index = load_index(folder)
    out["fp16"] = fp16_agreement(rows32, index.blocks, queries)
    out["rankers"] = bench_rankers(index, rows32, queries, min(n_queries, 50), hnsw)
    del rows32
    out["compaction"] = bench_compaction(folder, index)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", help="folder of images to index (toy CIRR dev: 1,800 images; required but with "
                                     "--ivf-only, --ivfpq-only or --hnsw-only)")
    p.add_argument("--ivf-only", action="store_true", help="only the faiss-ivf nprobe sweep at each --gallery size")
    p.add_argument("--ivfpq-only", action="store_true", help="only the faiss-ivfpq nprobe x shortlist sweep at each "
                                                             "--gallery size")
    p.add_argument("--hnsw-only", action="store_true", help="only the chosen faiss-hnsw setting's efSearch sweep at "
                                                            "each --gallery size (about 30 min a build at 1M, one thread)")
    p.add_argument("--ef-search", default="32,64,128,256", help="--hnsw-only: the efSearch values to measure")
    p.add_argument("--cold", type=int, default=0, help="--ivfpq-only: also time this many queries whose rows come "
                                                      "from the disk (parts evicted from the page cache), and 3 exact")
    p.add_argument("--gallery", default="100000", help="synthetic gallery sizes, comma-separated (e.g. 100000,1000000)")
    p.add_argument("--dim", type=int, default=512, help="embedding width (512: ViT-B-32)")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--workers", type=int, default=0, help="image-decoding workers for the build")
    p.add_argument("--threads", type=int, default=1, help="torch and FAISS CPU threads")
    p.add_argument("--hnsw-dims", default="512", help="widths to time HNSW at (empty: none)")
    p.add_argument("--hnsw-max", type=int, default=100_000, help="largest gallery to build HNSW for (slow on a CPU)")
    p.add_argument("--embed-threads", default="", help="thread counts to time batch-1 query embedding at (e.g. 1,2)")
    p.add_argument("--vit-b32", action="store_true", help="also time query embedding with a random-weight ViT-B-32 "
                                                           "backbone (the issue's shapes; slow to build)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import faiss

    faiss.omp_set_num_threads(args.threads)
    hnsw_dims = {int(d) for d in args.hnsw_dims.split(",") if d}
    command = "python -m benchmarks.bench_search " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.ivf_only or args.ivfpq_only or args.hnsw_only:
        sizes = [int(x) for x in args.gallery.split(",") if x]
        if args.ivf_only:
            key, kind, measure = "ivf", "faiss-ivf", lambda blocks, queries, repeats, _: bench_ivf(blocks, queries, repeats)
        elif args.ivfpq_only:
            key, kind, measure = "ivfpq", "faiss-ivfpq", ivfpq_sweep
        else:
            key, kind, measure = "hnsw", "faiss-hnsw", hnsw_sweep(tuple(int(x) for x in args.ef_search.split(",")))
        with tempfile.TemporaryDirectory() as tmp:
            results = {"command": command, "threads": args.threads, "load_before": os.getloadavg(),
                       key: sweep_sizes(kind, measure, sizes, args.dim, args.queries, Path(tmp),
                                        cold=args.cold if args.ivfpq_only else 0),
                       "load_after": os.getloadavg()}
        return write_results(results, args.json)
    if not args.images:
        p.error("--images is required (but with --ivf-only, --ivfpq-only or --hnsw-only)")
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=str(TOY_CLIP), pretrained=None))
    reference = next(p for p in sorted(Path(args.images).iterdir()) if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    results = {"command": command,
               "load_before": os.getloadavg(), "threads": args.threads, "cpus": os.cpu_count(),
               "build": bench_build(Path(args.images), backbone, args.workers),
               "embed": bench_embed(backbone, reference, repeats=50), "rank": {}}
    if args.embed_threads:
        results["embed_threads"] = bench_embed_threads(backbone, reference, 30,
                                                       [int(x) for x in args.embed_threads.split(",")])
    if args.vit_b32:
        vit = FrozenCLIP(BackboneConfig(name="ViT-B-32", pretrained=None))
        results["embed_vit_b32"] = bench_embed(vit, reference, 30, ModelConfig())
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.gallery.split(",") if x):
            hnsw = args.dim in hnsw_dims and n <= args.hnsw_max
            results["rank"][f"{n}x{args.dim}"] = bench_gallery(n, args.dim, args.queries, hnsw, Path(tmp))
            print(json.dumps(results["rank"][f"{n}x{args.dim}"], indent=1), flush=True)
    results["load_after"] = os.getloadavg()
    return write_results(results, args.json)


def write_results(results: dict, path: str | None) -> int:
    print(json.dumps(results, indent=2))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
