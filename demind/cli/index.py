"""``demind-index``: encode every image under a folder into a search index.

    demind-index --images photos/ --index runs/photos-index --checkpoint runs/paper/demind.safetensors

Rerunning the same command encodes only new or changed files (by size and modification time)
and drops removed ones; a killed run resumes from its finished parts. Unreadable images are
skipped, counted and listed in ``index.json``; every other file that is not an image (a caption,
a video) is named and counted as skipped, with its reason.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

from demind.cli.common import DISTRIBUTOR_FLAGS, Flag, config_parser, run_config_command
from demind.cli.model_options import MODEL_FLAGS, ModelOptions, load_model
from demind.settings import DistributorOptions, setting
from demind.imaging import DECODABLE_EXTENSIONS
from demind.search.names import faiss_problem


@dataclass
class IndexConfig(ModelOptions, DistributorOptions):
    images: str | None = setting(None, input="dir", help="folder of images, searched recursively (required)")
    index: str | None = setting(None, output="dir", help="index folder to create or update (required)")
    batch_size: int = setting(64, ge=1, help="images per encoding batch")
    num_workers: int = setting(2, ge=0, help="image-decoding workers")
    part_size: int = setting(1024, ge=1, help="images per saved part (what a kill can lose)")
    measure_rankers: bool = setting(False, help="also build the approximate rankers (faiss-hnsw, faiss-ivf, "
                                                "faiss-ivfpq) over the index, record their build time and recall@10 "
                                                "and save them in it (search and serve then load them; costly)")
    new_folder: bool = setting(False, help="let an index built from another folder follow --images (drops the "
                                           "files only in the old folder)")

    def config_problems(self) -> list[tuple[str, str]]:
        problems = [(key, f"is required: give --{key} DIR") for key in ("images", "index") if getattr(self, key) is None]
        if not self.checkpoint and not self.backbone.spec:
            problems.append(("checkpoint", "is required: give --checkpoint CKPT (the index is encoded by its frozen "
                                           "backbone), or --backbone NAME:TAG"))
        missing = faiss_problem("= true") if self.measure_rankers else None
        return problems + ([("measure_rankers", missing)] if missing else []) + self.distributor_problems()


FLAGS = {**MODEL_FLAGS, "--images": Flag("images"), "--index": Flag("index"), "--batch-size": Flag("batch_size"),
         "--num-workers": Flag("num_workers"), "--part-size": Flag("part_size"), "--new-folder": Flag("new_folder"),
         "--measure-rankers": Flag("measure_rankers"), **DISTRIBUTOR_FLAGS}


def build_parser():
    return config_parser(IndexConfig, "demind-index", __doc__.split("\n\n")[0], FLAGS)


def run(cfg: IndexConfig) -> int:
    from demind.search.expectations import describe, read_record, record_rankers
    from demind.search.index import build_index, load_index  # model code (torch): not for --help
    from demind.search.ranker_store import remove_stale_rankers

    previous = read_record(cfg.index)  # before the build rewrites index.json: kept while still current
    if cfg.distributor == "ray":
        from demind.search.ray_index import UnitsFailedError

        try:
            stats = build_on_ray(cfg)
        except UnitsFailedError as e:  # as demind-generate: exit 1 when units of the job failed
            print(f"index {cfg.index} not finished: {e}")
            return 1
    else:
        backbone, _ = load_model(cfg)
        stats = build_index(cfg.images, cfg.index, backbone, cfg.batch_size, cfg.num_workers, cfg.part_size,
                            progress=cfg.run.progress, new_root=cfg.new_folder)
    s = stats.as_dict()
    rate = f" at {s['encoded_per_s']} images/s" if s["encoded"] else ""
    print(f"index {cfg.index}: {s['indexed']} images ({s['encoded']} encoded{rate}, {s['cached']} reused, "
          f"{s['removed']} removed, {s['unreadable']} unreadable, {len(stats.skipped)} skipped) in {s['seconds']} s")
    print_some("unreadable", stats.unreadable, f"listed in {cfg.index}/index.json")
    if stats.skipped:
        kinds = Counter(reason for reason in stats.skipped.values())
        print(f"  skipped {len(stats.skipped)} file(s) that are not images the index reads "
              f"({', '.join(DECODABLE_EXTENSIONS)}): " + ", ".join(f"{n} x {k}" for k, n in kinds.most_common()))
        print_some("skipped", stats.skipped, "convert them to one of the formats above to index them")
    for kind in remove_stale_rankers(cfg.index):
        print(f"  removed the saved {kind} ranker: the index changed (a search start builds it again)")
    rankers = record_rankers(load_index(cfg.index), cfg.measure_rankers, previous)
    print(f"rankers on this index (recorded in {cfg.index}/index.json):")
    for kind, entry in rankers.items():
        print("  " + describe(kind, entry))
    return 0


def build_on_ray(cfg: IndexConfig):
    """The build with the images encoded on Ray workers (the backbones load there)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from demind.distributed import RayOptions
    from demind.search.ray_index import BackboneSource, build_index_on_ray

    options = RayOptions(workers=cfg.workers, address=cfg.ray_address or os.environ.get("RAY_ADDRESS") or None,
                         shard_attempts=cfg.shard_attempts, name_prefix="demind-index")
    print(f"encoding on Ray ({options.address or 'local cluster'})", flush=True)
    source = BackboneSource(cfg.checkpoint, cfg.backbone.spec, cfg.backbone.precision)
    with logging_redirect_tqdm():
        return build_index_on_ray(cfg.images, cfg.index, source, options, cfg.batch_size, cfg.num_workers,
                                  cfg.part_size, progress=cfg.run.progress, new_root=cfg.new_folder,
                                  device=cfg.run.device)


def print_some(what: str, entries: dict[str, str], rest: str, shown: int = 10) -> None:
    """The first ``shown`` of {name: reason}, one a line, then how many more and where they are."""
    for name, reason in list(entries.items())[:shown]:
        print(f"  {what}: {name}: {reason}")
    if len(entries) > shown:
        print(f"  ... and {len(entries) - shown} more {what} ({rest})")


def main(argv: list[str] | None = None) -> int:
    """``demind-index``: build or update the index; prints its counts."""
    return run_config_command(IndexConfig, build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
