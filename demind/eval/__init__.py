"""Zero-shot composed image retrieval evaluation (CIRR, FashionIQ, COCO, ImageNet-R, CIRCO, and our exclusion set).

Library entry point::

    from demind.eval import evaluate, load_backbone_and_model
    backbone, model = load_backbone_and_model("model.safetensors", None, device="cuda")
    results = evaluate("cirr", "data/CIRR", backbone=backbone, model=model, out_dir="runs/eval/cirr")

Command line: ``python -m demind.eval --help``.
"""

from demind.eval.harness import BENCHMARKS, ReaderOptions, evaluate, read_benchmark
from demind.eval.methods import METHODS, load_backbone_and_model
from demind.eval.reports import format_table, markdown_table

__all__ = [
    "BENCHMARKS",
    "METHODS",
    "ReaderOptions",
    "evaluate",
    "format_table",
    "load_backbone_and_model",
    "markdown_table",
    "read_benchmark",
]
