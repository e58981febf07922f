"""Zero-shot composed image retrieval evaluation (CIRR, FashionIQ, COCO, ImageNet-R, CIRCO, and our exclusion set).

Library entry point::

    from demind.eval import evaluate, load_backbone_and_model
    backbone, model = load_backbone_and_model("model.safetensors", device="cuda")
    results = evaluate("cirr", "data/CIRR", backbone=backbone, model=model, out_dir="runs/eval/cirr")

``load_backbone_and_model`` lives in :mod:`demind.checkpoint` (re-exported here).
Command line: ``demind-eval --help`` or ``python -m demind.eval --help`` (:mod:`demind.cli.evaluate`).
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.checkpoint import load_backbone_and_model
    from demind.eval.cirr import find_image_root
    from demind.eval.exclcoco import load_exclcoco
    from demind.eval.fashioniq import FASHIONIQ_CATEGORIES, captions_file, fashioniq_texts
    from demind.eval.structures import DataLayoutError, index_image_folder, raise_if_missing, require_dir, require_file
    from demind.eval.exclusion import EXCLUSION_FORMAT
    from demind.eval.options import BENCHMARKS, CocoOptions, ReaderOptions
    from demind.eval.harness import evaluate, read_benchmark
    from demind.eval.metrics import paired_ap, paired_hits, pairwise_auc, sign_test_p
    from demind.eval.paired import PairedTest, format_paired, paired_by_unit, paired_per_seed
    from demind.eval.reports import TITLES, format_table, markdown_table

# Resolved on first use: importing demind.eval.options (demind-eval --help) loads no model code or torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.checkpoint": ["load_backbone_and_model"],
    "demind.eval.cirr": ["find_image_root"],
    "demind.eval.exclcoco": ["load_exclcoco"],
    "demind.eval.fashioniq": ["FASHIONIQ_CATEGORIES", "captions_file", "fashioniq_texts"],
    "demind.eval.structures": ["DataLayoutError", "index_image_folder", "raise_if_missing", "require_dir",
                               "require_file"],
    "demind.eval.exclusion": ["EXCLUSION_FORMAT"],
    "demind.eval.options": ["BENCHMARKS", "CocoOptions", "ReaderOptions"],
    "demind.eval.harness": ["evaluate", "read_benchmark"],
    "demind.eval.metrics": ["pairwise_auc", "paired_ap", "paired_hits", "sign_test_p"],
    "demind.eval.paired": ["PairedTest", "format_paired", "paired_by_unit", "paired_per_seed"],
    "demind.eval.reports": ["TITLES", "format_table", "markdown_table"],
})

__all__ = [
    "BENCHMARKS",
    "EXCLUSION_FORMAT",
    "TITLES",
    "CocoOptions",
    "ReaderOptions",
    "evaluate",
    "format_table",
    "load_backbone_and_model",
    "load_exclcoco",
    "markdown_table",
    "pairwise_auc",
    "paired_ap",
    "paired_hits",
    "PairedTest",
    "format_paired",
    "paired_by_unit",
    "paired_per_seed",
    "sign_test_p",
    "read_benchmark",
    "DataLayoutError",
    "FASHIONIQ_CATEGORIES",
    "fashioniq_texts",
    "captions_file",
    "find_image_root",
    "index_image_folder",
    "raise_if_missing",
    "require_dir",
    "require_file",
]
