r"""``demind-make-tiny-model`` (= ``python data_gen/make_tiny_model.py``): save a tiny random LLaVA-NeXT
(model + processor) for CPU smoke runs of the generation job, in the layout of llava-hf's folders, so
that the transformers engine and vLLM (its CPU build too) both load it.

    python data_gen/make_tiny_model.py --output shards/tiny-llava-next
    demind-generate --input shards/mine --output shards/mine-intent \
        --config configs/data_gen/tiny-cpu.yaml engine.model=shards/tiny-llava-next

Its text is random words: it exercises the whole pipeline, not the quality of the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting


@dataclass
class TinyModelRun:
    seed: int = setting(0, ge=0, help="weight initialisation seed")


@dataclass
class TinyModelConfig:
    output: str = setting("shards/tiny-llava-next", help="folder to save the model and processor")
    run: TinyModelRun = field(default_factory=TinyModelRun)


FLAGS = {"--output": Flag("output")}


def build_parser():
    return config_parser(TinyModelConfig, "data_gen/make_tiny_model.py", __doc__, FLAGS)


def make_tiny_model_command(cfg: TinyModelConfig) -> int:
    """Build and save the tiny model; print where."""
    from demind.engines.tiny_llava import build_tiny_llava_next
    from demind.io import check_output_dir

    check_output_dir(cfg.output)  # a file in the way is one error line, before the model is built
    path = build_tiny_llava_next(cfg.output, seed=cfg.run.seed)
    print(f"saved tiny LLaVA-NeXT to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(TinyModelConfig, build_parser(), make_tiny_model_command, argv)
