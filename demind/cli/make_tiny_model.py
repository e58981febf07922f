r"""``demind-make-tiny-model`` (= ``python data_gen/make_tiny_model.py``): save a tiny random LLaVA-NeXT
(model + processor) for CPU smoke runs of the generation job, in the layout of llava-hf's folders, so
that the transformers engine and vLLM (its CPU build too) both load it.

    python data_gen/make_tiny_model.py --output shards/tiny-llava-next
    demind-make-tiny-model --family qwen2-vl --output shards/tiny-qwen2-vl   # several images per prompt
    demind-generate --input shards/mine --output shards/mine-intent \
        --config configs/data_gen/tiny-cpu.yaml engine.model=shards/tiny-llava-next

Its text is random words: it exercises the whole pipeline, not the quality of the data. An
``--output`` that holds something is refused; ``--overwrite`` replaces a LLaVA-NeXT model there whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from demind.cli.common import Flag, config_parser, run_config_command
from demind.errors import InputError
from demind.settings import setting


FAMILIES = ("llava-next", "qwen2-vl")
MODEL_TYPES = {"llava_next", "qwen2_vl"}  # what --overwrite may replace


@dataclass
class TinyModelRun:
    seed: int = setting(0, ge=0, help="weight initialisation seed")


@dataclass
class TinyModelConfig:
    family: str = setting("llava-next", choices=FAMILIES, help="llava-next (one image a prompt, the intent job) or "
                                                              "qwen2-vl (several images a prompt: the triplet job's "
                                                              "describer)")
    output: str = setting("shards/tiny-llava-next", output="dir",
                          help="folder to save the model and processor (new or empty; see overwrite)")
    overwrite: bool = setting(False, help="replace the LLaVA-NeXT model at output (refused when the folder holds "
                                          "files a tiny model does not have: nothing there is changed)")
    run: TinyModelRun = field(default_factory=TinyModelRun)

    def output_problems(self) -> list[tuple[str, str]]:
        """A folder that holds something already: refused without ``overwrite`` (as make-shards and
        publish refuse), and with it unless it holds a LLaVA-NeXT model (its ``config.json``)."""
        folder = Path(self.output)
        held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if not held:
            return []
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        if not self.overwrite:
            return [("output", f"{folder} already holds {len(held)} file(s) ({shown}); give a new or empty "
                               "--output, or --overwrite to replace the model there")]
        if llava_next_folder(folder):
            return []
        return [("output", f"--overwrite refused: {folder} does not hold a LLaVA-NeXT model (no config.json with "
                           f"model_type llava_next; it holds {shown}); nothing there was changed: choose another "
                           "--output")]


def llava_next_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a LLaVA-NeXT model (what ``--overwrite`` may replace)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in MODEL_TYPES


FLAGS = {"--output": Flag("output"), "--overwrite": Flag("overwrite"), "--family": Flag("family")}


def build_parser():
    return config_parser(TinyModelConfig, "data_gen/make_tiny_model.py", __doc__, FLAGS)


def make_tiny_model_command(cfg: TinyModelConfig) -> int:
    """Build and save the tiny model (beside ``output``, then swapped in whole: never a mix of two
    models); print where."""
    from demind.engines.tiny_llava import build_tiny_llava_next
    from demind.engines.tiny_qwen2vl import build_tiny_qwen2vl
    from demind.release.folders import building_beside, folder_files, swap_in

    out = Path(cfg.output).resolve()  # '.' has a parent to build beside in
    with building_beside(out) as build:
        (build_tiny_qwen2vl if cfg.family == "qwen2-vl" else build_tiny_llava_next)(build, seed=cfg.run.seed)
        foreign = sorted(folder_files(out) - folder_files(build)) if out.is_dir() else []
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise InputError(f"--overwrite refused: {out} holds file(s) a tiny model does not have: {shown}; move "
                             "them away or choose another --output (nothing there was changed)")
        swap_in(build, out)
    print(f"saved tiny {'Qwen2-VL' if cfg.family == 'qwen2-vl' else 'LLaVA-NeXT'} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_config_command(TinyModelConfig, build_parser(), make_tiny_model_command, argv)
