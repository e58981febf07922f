"""Zero-shot composed image retrieval evaluation (CIRR, FashionIQ, COCO, ImageNet-R, CIRCO, and our exclusion set).

Library entry point::

    from demind.eval import evaluate, load_backbone_and_model
    backbone, model = load_backbone_and_model("model.safetensors", device="cuda")
    results = evaluate("cirr", "data/CIRR", backbone=backbone, model=model, out_dir="runs/eval/cirr")

``load_backbone_and_model`` lives in :mod:`demind.checkpoint` (re-exported here).
Command line: ``demind-eval --help`` or ``python -m demind.eval --help`` (:mod:`demind.cli.evaluate`).
"""

from demind.checkpoint import load_backbone_and_model
from demind.eval.exclcoco import load_exclcoco
from demind.eval.exclusion import FORMAT as EXCLUSION_FORMAT
from demind.eval.harness import BENCHMARKS, CocoOptions, ReaderOptions, evaluate, read_benchmark
from demind.eval.metrics import paired_ap, paired_hits, sign_test_p
from demind.eval.reports import TITLES, format_table, markdown_table
from demind.retrieval import METHODS

__all__ = [
    "BENCHMARKS",
    "EXCLUSION_FORMAT",
    "METHODS",
    "TITLES",
    "CocoOptions",
    "ReaderOptions",
    "evaluate",
    "format_table",
    "load_backbone_and_model",
    "load_exclcoco",
    "markdown_table",
    "paired_ap",
    "paired_hits",
    "sign_test_p",
    "read_benchmark",
]
