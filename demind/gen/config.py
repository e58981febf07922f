"""Configuration of the intent-data generation job (``data_gen/run.py``).

Loaded with :func:`demind.config.load_config`::

    cfg = load_config(GenConfig, "configs/data_gen/llava-1.6-7b.yaml", ["engine.name=transformers"])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.engines import EngineConfig, SamplingConfig
from demind.settings import RunSection, setting


@dataclass
class PromptConfig:
    """Versioned prompt texts, rendered through the processor's chat template."""

    version: str = setting("v1", refuses="no-such-version")  # a folder under demind/gen/prompts/, or a path to one
    mode: str = setting("cot", choices=("cot", "single"))  # "cot": rewrite then reason (two turns); "single": intent in one turn (w/o CoT ablation)

    def config_problems(self) -> list[tuple[str, str]]:
        """The prompt files exist and hold their fields (read, never run): checked with the config."""
        from demind.errors import DemindError
        from demind.gen.prompts import load_prompts

        try:
            load_prompts(self.version)
        except DemindError as e:
            return [("version", f"= {self.version!r}: {e}")]
        return []


@dataclass
class QualityConfig:
    """Checks applied to every cleaned output."""

    repeat_ngram: int = setting(3, ge=1)  # n of the word n-grams counted for the repetition check
    max_ngram_repeats: int = setting(2, ge=0)  # an n-gram seen more often than this flags the output as repetitive
    # Optional GFQ fidelity stage (demind/gen/fidelity_stage.py): an open_clip model (name
    # or model JSON) scores each sample's T_rew and T_int against its image; a score below
    # fidelity_omega flags the sample ("intent:low_fidelity"), it is never dropped. null = off.
    fidelity_clip: str | None = setting(None, refuses="configs/model/no-such-model.json")
    fidelity_pretrained: str | None = setting(None, refuses="weights/no-such-checkpoint.pt")  # tag or weights path
    fidelity_omega: float = setting(0.5, gt=0, lt=1)
    fidelity_pool: int = setting(256, ge=2)  # recent samples the noise boundary is estimated on

    def input_problems(self) -> list[tuple[str, str]]:
        """The fidelity CLIP's files exist, by the backbone's own rule (a name or tag is open_clip's)."""
        from demind.schema import BackboneConfig

        clip = BackboneConfig(name=self.fidelity_clip or "ViT-B-32", pretrained=self.fidelity_pretrained)
        keys = {"name": "fidelity_clip", "pretrained": "fidelity_pretrained"}
        return [(keys[key], message) for key, message in clip.input_problems()]


@dataclass
class IOConfig:
    """Input handling."""

    image_max_side: int = setting(672, ge=1)  # images are shrunk so the longest side is at most this (LLaVA-1.6: 672)
    max_caption_chars: int = setting(2000, ge=1)  # longer captions are skipped and counted, not silently cut
    log_every: int = setting(1000, ge=0)  # one log line every N samples within a shard
    # chunks read and decoded by a background thread while the engine works on the current one
    # (0 = read in the main thread); memory holds up to 2 + prefetch_chunks decoded chunks
    prefetch_chunks: int = setting(1, ge=0)


@dataclass
class GenRunConfig(RunSection):
    """demind-generate's and demind-generate-triplets's ``run`` section: where the transformers engine (and
    the fidelity stage) runs, vLLM placing itself; the seed of every request; progress bars."""

    progress: bool = setting(True, help="progress bars (also the weight-loading bars of transformers)")
    seed: int = setting(0, ge=0, help="every request's sampling seed derives from (seed, key, stage, attempt)")


@dataclass
class GenConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    io: IOConfig = field(default_factory=IOConfig)
    run: GenRunConfig = field(default_factory=GenRunConfig)

