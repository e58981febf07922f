"""The default toy CLIP trained with several seeds: its pair probes, mean ± std.

    python -m toyworld.lab.clip_seeds --seeds 0 1 2 --out runs/toy_clip_seeds
    python -m toyworld.lab.clip_seeds --seeds 1 2 group_edits=[shape,size,position]

Trains (or reuses, keyed as the quickstart keys them) the toy CLIP of ``ToyBackboneConfig`` with each
seed, ``key=value`` overrides applied to every seed, and reads each one's pair probes from its
report. The seed moves the weights' initialisation and the order of batches and captions; the
training scenes and the probe scenes are the same for every seed. A killed run resumes where it
stopped (the toy CLIP's own training state), and finished seeds are reused. Prints a table of
the probes with mean and sample std, and writes ``<out>/toy_clip_seeds.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from pathlib import Path

from demind.config import load_config
from demind.io import write_json_atomic
from toyworld.clip_config import ToyBackboneConfig
from toyworld.clip_cache import ensure_toy_backbone
from toyworld.probes import PAIR_PROBE_ATTRIBUTES
from toyworld.world import WORLD_VERSION


def probes_by_seed(base: ToyBackboneConfig, seeds: list[int], cache_dir: Path, progress: bool
                   ) -> dict[int, dict[str, float]]:
    """seed -> attribute -> pair-probe accuracy (%), training each seed's toy CLIP if absent."""
    out = {}
    for seed in seeds:
        _, report = ensure_toy_backbone(dataclasses.replace(base, seed=seed), cache_dir, progress)
        out[seed] = {**report["pair_probes"], "train_seconds": report.get("train_seconds")}
    return out


def format_table(by_seed: dict[int, dict[str, float]]) -> str:
    """A Markdown table: one row per seed, then mean ± sample std over the seeds."""
    head = "| seed | " + " | ".join(PAIR_PROBE_ATTRIBUTES) + " | train s |"
    lines = [head, "| --- |" + " ---: |" * (len(PAIR_PROBE_ATTRIBUTES) + 1)]
    for seed, row in by_seed.items():
        lines.append(f"| {seed} | " + " | ".join(f"{row[a]:.1f}" for a in PAIR_PROBE_ATTRIBUTES)
                     + f" | {row['train_seconds']} |")
    if len(by_seed) > 1:
        cells = []
        for attribute in PAIR_PROBE_ATTRIBUTES:
            values = [row[attribute] for row in by_seed.values()]
            cells.append(f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}")
        lines.append("| mean ± std | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/toy_clip_seeds", help="cache of the toy CLIPs and the JSON result")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", help="ToyBackboneConfig key=value, e.g. steps=600")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    base = load_config(ToyBackboneConfig, None, args.overrides)
    out = Path(args.out)
    by_seed = probes_by_seed(base, args.seeds, out / "backbone", not args.quiet)
    table = format_table(by_seed)
    print(table)
    write_json_atomic(out / "toy_clip_seeds.json", {"world_version": WORLD_VERSION, "overrides": args.overrides,
                                                    "config": dataclasses.asdict(base), "pair_probes": by_seed,
                                                    "table": table}, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
