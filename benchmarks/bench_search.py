"""Search timings: index build rate, query embedding latency, and ranking latency over a
100,000-image gallery, exact matrix product vs FAISS (flat and HNSW).

    PYTHONPATH=. python benchmarks/bench_search.py --images runs/quickstart/benchmarks/cirr/dev \\
        --gallery 100000 --queries 200 --json runs/bench_search.json

* Build rate: ``demind.search.index.build_index`` on the images of ``--images`` with the toy
  CLIP architecture (toyworld/model_configs/toy-clip-cnn-text2.json, random weights: the same compute as the
  trained toy CLIP), once from nothing and once as a rerun with nothing changed.
* Query embedding: one De-MINDS query (toy recipe: 4 queries, 6 blocks) and one mapping-only
  query, reference image encoding included, through ``Searcher.embed``.
* Ranking: top-20 over ``--gallery`` synthetic L2-normalised embeddings (D = 128, the toy
  CLIP; and D = 768, ViT-L-14) with ``Ranker`` exact / faiss-flat / faiss-hnsw, one query at a
  time, p50 and p95 over ``--queries`` queries; HNSW recall@20 against exact.
The gallery embeddings are synthetic because encoding 100,000 images on the shared build CPU
would take longer than the measurement is worth; ranking cost does not depend on pixel content.
Timings, so never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from demind.backbone import BackboneConfig, FrozenCLIP
from demind.retrieval import backbone_cache_slug
from demind.model import DeMinds, ModelConfig
from demind.search.index import GalleryIndex, build_index
from demind.search.query import Ranker, Searcher, SearchQuery

TOY_CLIP = Path(__file__).resolve().parents[1] / "toyworld" / "model_configs" / "toy-clip-cnn-text2.json"
TEXT = "make the square red and the background green"


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 3), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 3)}


def bench_build(images: Path, backbone: FrozenCLIP, workers: int) -> dict:
    print(f"building an index of {images} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        first = build_index(images, Path(tmp) / "index", backbone, batch_size=128, num_workers=workers,
                            progress=False)
        rerun = build_index(images, Path(tmp) / "index", backbone, batch_size=128, num_workers=workers,
                            progress=False)
    return {"images": first.indexed, "build_s": round(first.seconds, 2),
            "images_per_s": round(first.indexed / first.seconds, 1),
            "rerun_unchanged_s": round(rerun.seconds, 2), "rerun_encoded": rerun.encoded}


def bench_embed(backbone: FrozenCLIP, reference: Path, repeats: int) -> dict:
    print("query embedding ...", flush=True)
    torch.manual_seed(0)
    model = DeMinds(ModelConfig(num_queries=4, num_blocks=6, num_heads=8, mapping_hidden=512), backbone).eval()
    index = GalleryIndex(Path("synthetic"), Path("."), ["a"], torch.ones(1, backbone.embed_dim) / backbone.embed_dim ** 0.5,
                         backbone.identity, backbone_cache_slug(backbone), backbone.cfg.precision)
    searcher = Searcher(backbone, model, index)
    out = {}
    for method in ("demind", "mapping-only", "image+text"):
        query = SearchQuery(image=reference, text=TEXT, method=method)
        for _ in range(3):
            searcher.embed(query)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            searcher.embed(query)
            times.append(time.perf_counter() - start)
        out[method] = percentiles(times)
    return out


def bench_rank(n: int, dim: int, n_queries: int, kinds: tuple[str, ...], k: int = 20) -> dict:
    print(f"ranking {n} x {dim} ...", flush=True)
    generator = torch.Generator().manual_seed(0)
    gallery = torch.nn.functional.normalize(torch.randn(n, dim, generator=generator), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(n_queries, dim, generator=generator), dim=-1)
    out, exact_rows = {}, None
    for kind in kinds:
        start = time.perf_counter()
        ranker = Ranker(gallery, kind)
        build_s = time.perf_counter() - start
        for q in queries[:5]:
            ranker.top_k(q[None], k)
        times, rows = [], []
        for q in queries:
            start = time.perf_counter()
            _, r = ranker.top_k(q[None], k)
            times.append(time.perf_counter() - start)
            rows.append(r[0].tolist())
        if kind == "exact":
            exact_rows = rows
        recall = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(rows, exact_rows)]))
        out[kind] = {**percentiles(times), "build_s": round(build_s, 2), "recall_at_20_vs_exact": round(recall, 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", required=True, help="folder of images to index (toy CIRR dev: 1,800 images)")
    p.add_argument("--gallery", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--workers", type=int, default=0, help="image-decoding workers for the build")
    p.add_argument("--threads", type=int, default=1, help="torch and FAISS CPU threads (1: on the shared 2-core "
                                                           "machine more threads only spin against other jobs)")
    p.add_argument("--hnsw-dims", default="128", help="dimensions to time HNSW at (its build is slow on a CPU)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import faiss

    faiss.omp_set_num_threads(args.threads)
    hnsw_dims = {int(d) for d in args.hnsw_dims.split(",") if d}
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=str(TOY_CLIP), pretrained=None))
    reference = next(Path(args.images).glob("*.png"))
    results = {"command": "PYTHONPATH=. python benchmarks/bench_search.py " + " ".join(sys.argv[1:]),
               "load_before": os.getloadavg(), "threads": args.threads, "cpus": os.cpu_count(),
               "build": bench_build(Path(args.images), backbone, args.workers),
               "embed": bench_embed(backbone, reference, repeats=50),
               "rank": {f"{args.gallery}x{dim}": bench_rank(args.gallery, dim, args.queries,
                                                           ("exact", "faiss-flat") + (("faiss-hnsw",) if dim in hnsw_dims else ()))
                        for dim in (128, 768)},
               "load_after": os.getloadavg()}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
