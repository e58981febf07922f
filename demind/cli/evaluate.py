"""``demind-eval`` / ``python -m demind.eval``: one benchmark, one command, a table and files you can check.

    demind-eval --benchmark cirr --data-root data/CIRR --checkpoint runs/demind/demind.safetensors \
        --split val --out runs/eval/cirr
    demind-eval --config my-eval.yaml fashioniq.caption_order=file run.device=cpu
    demind-eval --benchmark cirr --data-root data/CIRR --out runs/eval/cirr-mllm --methods cirevl,osrcir \
        engine.name=transformers engine.model=llava-hf/llava-v1.6-mistral-7b-hf rerank.k=20

Loads the backbone and model (:func:`demind.cli.model_options.load_model`), then runs
:func:`demind.eval.evaluate`. Every setting is a key of :class:`EvalConfig` (``--help`` lists
them); the benchmark-specific ones live in their benchmark's section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.cli.common import Flag, config_parser, run_config_command
from demind.cli.model_options import (MODEL_FLAGS, BackboneChoice, build_mllm_setup, checkpoint_setting, engine_problems,
                                      load_model, query_mode_problems)
from demind.settings import QueryRunConfig, setting
from demind.mllm.config import DescribeOptions, RerankOptions
from demind.engines import EngineConfig
from demind.eval.options import BENCHMARKS, CocoOptions, FashionIQOptions
from demind.retrieval.names import METHODS, method_name_problems


@dataclass
class EvalConfig:
    """One evaluation run: benchmark, data, model, methods, and where the files go."""

    benchmark: str | None = setting(None, choices=BENCHMARKS, help="which benchmark (required)")
    data_root: str | None = setting(None, free="the benchmark's folder: read in its official layout (a missing file "
                                                  "named) before any model loads", help="the benchmark's folder in its official layout (required)")
    out: str | None = setting(None, output="dir", help="output folder (required)")
    checkpoint: str | None = checkpoint_setting()
    exclmm: str | None = setting(None, input="file", help="trained ExclMM export (exclmm.safetensors) for the exclmm method")
    split: str = setting("val", choices=("val", "test", "test1"), help="val, or test (CIRR test1, CIRCO test)")
    methods: str | None = setting(None, refuses="no-such-method", help=f"comma-separated subset of {','.join(METHODS)}, or a negation-aware "
                                             "variant BASE+deo / BASE+deo-adam (default: all base methods the "
                                             "checkpoint/backbone allow, except oracle; the MLLM methods "
                                             "cirevl, osrcir, demind+mllm need engine.model: docs/mllm.md); "
                                             "METHOD+rerank re-ranks METHOD's top rerank.k with the MLLM")
    cache_dir: str | None = setting(None, output="dir", help="image-feature cache (default OUT/feature_cache); share it across runs")
    batch_size: int = setting(64, ge=1, help="images per encoding batch")
    num_workers: int = setting(4, ge=0, help="image-decoding workers")
    limit: int | None = setting(None, ge=1, help="evaluate only the first N queries (of each FashionIQ category; smoke runs; "
                                                           "flagged in outputs)")
    backbone: BackboneChoice = field(default_factory=BackboneChoice)
    fashioniq: FashionIQOptions = field(default_factory=FashionIQOptions)
    coco: CocoOptions = field(default_factory=CocoOptions)
    # MLLM methods (cirevl, osrcir, demind+mllm) and re-ranking: the generation engine's keys (docs/mllm.md)
    engine: EngineConfig = field(default_factory=EngineConfig)
    describe: DescribeOptions = field(default_factory=DescribeOptions)
    rerank: RerankOptions = field(default_factory=RerankOptions)
    run: QueryRunConfig = field(default_factory=QueryRunConfig)

    def config_problems(self) -> list[tuple[str, str]]:
        flags = {"benchmark": "--benchmark", "data_root": "--data-root", "out": "--out"}
        problems = [(key, f"is required: give {flag} or {key}=...") for key, flag in flags.items()
                    if getattr(self, key) is None]
        problems += method_name_problems("methods", self.methods)
        problems += query_mode_problems(self.checkpoint, self.run)
        if needs_mllm(self):  # before the gallery is encoded, not on the first missing answer
            problems += [(f"engine.{key}", message) for key, message in engine_problems(self.engine)]
        return problems


FLAGS = {
    "--benchmark": Flag("benchmark"), "--data-root": Flag("data_root"), "--out": Flag("out"),
    "--checkpoint": MODEL_FLAGS["--checkpoint"], "--exclmm": Flag("exclmm"), "--backbone": MODEL_FLAGS["--backbone"],
    "--precision": MODEL_FLAGS["--precision"], "--split": Flag("split"), "--methods": Flag("methods"),
    "--cache-dir": Flag("cache_dir"), "--batch-size": Flag("batch_size"), "--num-workers": Flag("num_workers"),
    "--limit": Flag("limit"),
    "--fashioniq-caption-order": Flag("fashioniq.caption_order"), "--fashioniq-text": Flag("fashioniq.text"),
    "--coco-csv": Flag("coco.csv"), "--coco-prompt": Flag("coco.prompt"),
    "--coco-query-resize": Flag("coco.query_resize"), "--coco-seed": Flag("coco.seed"),
}


def build_parser():
    return config_parser(EvalConfig, "demind-eval", __doc__.split("\n\n")[0], FLAGS)


def reader_options(cfg: EvalConfig):
    """The ReaderOptions the benchmark sections ask for."""
    from demind.eval.options import ReaderOptions

    return ReaderOptions(fashioniq=cfg.fashioniq, coco=cfg.coco)


def evaluate_command(cfg: EvalConfig) -> int:
    """Load, evaluate, print the table and the files written."""
    from demind.eval.harness import evaluate, read_benchmark
    from demind.eval.reports import format_table

    # the data first: a broken benchmark folder is refused before the model (minutes for ViT-L/14) loads
    data = read_benchmark(cfg.benchmark, cfg.data_root, cfg.split, cfg.limit, reader_options(cfg))
    backbone, model = load_model(cfg)
    exclmm = None
    if cfg.exclmm:
        from demind.exclmm import load_exclmm

        exclmm = load_exclmm(cfg.exclmm, backbone.identity, backbone.device)
    results = evaluate(
        cfg.benchmark, cfg.data_root, backbone=backbone, model=model, methods=cfg.methods, split=cfg.split,
        out_dir=cfg.out, cache_dir=cfg.cache_dir, options=reader_options(cfg), batch_size=cfg.batch_size,
        num_workers=cfg.num_workers, limit=cfg.limit, progress=cfg.run.progress, exclmm=exclmm,
        mllm=mllm_setup(cfg), data=data,
    )
    print(format_table(results))
    print(f"results: {results['files']['results']}\ntable: {results['files']['table']}")
    for path in results["files"]["submissions"]:
        print(f"submission: {path}")
    return 0


def mllm_setup(cfg: EvalConfig):
    """The MLLM of the ``engine`` section when a method or ``rerank.k`` needs one (else None); the engine
    itself is built only when an answer is missing from the store (a rerun loads no model)."""
    if not needs_mllm(cfg):
        return None
    return build_mllm_setup(cfg.engine, cfg.describe, cfg.rerank, cfg.run)


def needs_mllm(cfg: EvalConfig) -> bool:
    """Whether a method asked for (an MLLM method, ``METHOD+rerank``) or ``rerank.k`` runs the MLLM."""
    from demind.retrieval.names import MLLM_METHODS, base_method, split_rerank_requests

    names, reranked = split_rerank_requests(cfg.methods or "")
    return cfg.rerank.k > 0 or bool(reranked) or any(base_method(n) in MLLM_METHODS for n in names)


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(EvalConfig, build_parser(), evaluate_command, argv)
