"""Load test of the search page as served (waitress, default limits): N clients for S seconds.

    python -m benchmarks.bench_serve_load --clients 20 --seconds 30 --json runs/bench_serve_load.json

A gallery of ``--images`` generated coloured squares is indexed with the toy CLIP architecture
(random weights: the toy CLIP's compute) and a random De-MINDS; the server runs in this process
with the settings ``demind-serve`` uses. Each client loops over the page's requests: info,
gallery filter, a thumbnail, a search from a gallery pick (De-MINDS, mapping-only or DEO with a
negative), and an upload search. Reported: requests by kind, errors (any status other than the
expected one, or a connection failure), latency p50/p95 per kind, whether every repeat of a
query returned the same ranking, peak worker threads, and resident memory at start, middle and
end (flat memory: no leak per request). Timings: the test suite runs it only at a tiny size
(tests/test_benchmarks_smoke.py), never for its numbers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch
from PIL import Image

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig, ModelConfig
from demind.model import DeMinds
from demind.search.index import build_index, load_index
from demind.search.query import Searcher
from demind.search.server import ServerSettings, create_app, start_server

TOY_CLIP = Path(__file__).resolve().parents[1] / "toyworld" / "model_configs" / "toy-clip-cnn-text2.json"
COLOURS = [(220, 40, 40), (40, 180, 60), (40, 80, 220), (230, 200, 40), (160, 60, 200), (20, 20, 20)]


def rss_mb() -> float:
    """Resident memory of this process in MB (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def write_gallery(folder: Path, n: int) -> None:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = Image.new("RGB", (64, 64), COLOURS[(i + 3) % len(COLOURS)])
        x, y, side = rng.randrange(8, 32), rng.randrange(8, 32), rng.randrange(12, 28)
        img.paste(COLOURS[i % len(COLOURS)], (x, y, x + side, y + side))
        img.save(folder / f"sq{i:04d}.png")


def multipart(fields: dict[str, str], upload: bytes | None) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if upload is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="ref.png"\r\n'
                     f'Content-Type: image/png\r\n\r\n'.encode() + upload + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def client_loop(port: int, names: list[str], upload: bytes, stop: float, seed: int, log: dict) -> None:
    rng = random.Random(seed)
    queries = [("demind", "make it red", ""), ("mapping-only", "make the background green", ""),
               ("demind", "make it blue", "the square")]
    while time.monotonic() < stop:
        method, text, negative = rng.choice(queries)
        pick = rng.choice(names[:10])
        requests = [
            ("info", "GET", "/api/info", None, {}),
            ("gallery", "GET", f"/api/gallery?limit=60&q=sq00{rng.randrange(10)}", None, {}),
            ("thumb", "GET", f"/thumb?name={rng.choice(names)}", None, {}),
            ("search", "POST", "/api/search", *multipart({"gallery_name": pick, "text": text, "method": method,
                                                          "negative": negative, "k": "20"}, None)),
            ("upload", "POST", "/api/search", *multipart({"text": "make it red", "method": "demind", "k": "10"},
                                                         upload)),
        ]
        for kind, verb, path, body, content_type in requests:
            headers = {"Content-Type": content_type} if body is not None else {}
            start = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request(verb, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                status = response.status
            except OSError as e:
                status, data = f"connection: {type(e).__name__}", b""
            elapsed = time.perf_counter() - start
            with log["lock"]:
                log["times"][kind].append(elapsed)
                if status != 200:
                    log["errors"].append(f"{kind} {path[:60]}: {status} {data[:120]!r}")
                elif verb == "POST":
                    ranking = tuple(r["name"] for r in json.loads(data)["results"])
                    key = (kind, pick if kind == "search" else "", method if kind == "search" else "", text)
                    log["rankings"][key].add(ranking)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--images", type=int, default=300, help="generated gallery size")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=str(TOY_CLIP), pretrained=None))
    model = DeMinds(ModelConfig(num_queries=4, num_blocks=6, num_heads=8, mapping_hidden=512), backbone).eval()
    with tempfile.TemporaryDirectory() as tmp:
        write_gallery(Path(tmp) / "gallery", args.images)
        build_index(Path(tmp) / "gallery", Path(tmp) / "index", backbone, progress=False)
        searcher = Searcher(backbone, model, load_index(Path(tmp) / "index"))
        settings = ServerSettings()
        server, _ = start_server(create_app(searcher, settings=settings), "127.0.0.1", 0)
        names = searcher.index.names
        upload = (Path(tmp) / "gallery" / names[5]).read_bytes()  # a gallery copy: left out of its results
        log = {"lock": threading.Lock(), "times": defaultdict(list), "errors": [], "rankings": defaultdict(set)}
        memory, peak_threads = {"start": rss_mb()}, threading.active_count()
        stop = time.monotonic() + args.seconds
        clients = [threading.Thread(target=client_loop, args=(server.port, names, upload, stop, i, log))
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        threads_without_clients = threading.active_count() - args.clients
        time.sleep(args.seconds / 2)
        memory["middle"] = rss_mb()
        while any(c.is_alive() for c in clients):
            peak_threads = max(peak_threads, threading.active_count() - args.clients)
            time.sleep(0.5)
        memory["end"] = rss_mb()
        server.shutdown()
    times = log["times"]
    results = {
        "command": "python -m benchmarks.bench_serve_load " + " ".join(sys.argv[1:] if argv is None else argv),
        "clients": args.clients, "seconds": args.seconds, "gallery": args.images, "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "server": {"threads": settings.threads, "connection_limit": settings.connection_limit},
        "requests": {k: len(v) for k, v in times.items()}, "errors": len(log["errors"]),
        "first_errors": log["errors"][:10],
        "latency_ms": {k: {"p50": round(statistics.median(v) * 1000, 1),
                           "p95": round(sorted(v)[int(0.95 * (len(v) - 1))] * 1000, 1)} for k, v in times.items()},
        "distinct_queries": len(log["rankings"]),
        "rankings_consistent": all(len(r) == 1 for r in log["rankings"].values()),
        "server_threads_start_peak": [threads_without_clients, peak_threads], "rss_mb": memory,
    }
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
