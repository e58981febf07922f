"""The README's main job: the whole De-MINDS pipeline on the toy world, on a CPU.

    python pipelines/quickstart.py                      # one seed, all methods
    python pipelines/quickstart.py seeds=[0,1,2] ablations=true
    python pipelines/quickstart.py --config my.yaml backbone.steps=600 workdir=runs/qs2

Generates the toy intent shards and benchmarks, trains (or reuses) the toy CLIP,
caches frozen features, trains De-MINDS with train.py's code, evaluates every method
with the evaluation harness, prints the table and writes <workdir>/results.json and
<workdir>/recall_at_k.png. Everything is cached: a rerun only does what is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from demind.config import ConfigError, load_config  # noqa: E402
from demind.logs import setup_logging  # noqa: E402
from demind.toy.pipeline import QuickstartConfig, run_quickstart  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelines/quickstart.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML with QuickstartConfig keys (optional)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. seeds=[0,1,2] backbone.steps=600")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        cfg = load_config(QuickstartConfig, args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))
    if args.quiet:
        cfg.progress = False
    summary = run_quickstart(cfg)
    print()
    print(summary["table"])
    for table in ("per_type_table", "paired_table"):
        if summary[table]:
            print()
            print(summary[table])
    print("\ntoy CLIP held-out text->image recall (R@1 / R@5 / R@10, %; probe = a text naming one attribute):")
    for texts, recall in summary["backbone"]["heldout_text_to_image"].items():
        print(f"  {texts:<17} " + " / ".join(f"{100 * v:.1f}" for v in recall.values()))
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["timings_s"].items()))
    print(f"results: {Path(cfg.workdir) / 'results.json'}" + (f"\nplot: {summary['plot']}" if summary["plot"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
