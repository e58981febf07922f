"""Configuration of the triplet job (``demind-generate-triplets``): pair shards -> triplet shards.

Two model roles, MegaPairs's: the **describer** (``engine``: an MLLM that sees both images of a
pair in one prompt and writes how they relate) and the **writer** (``writer``: an LLM that writes
retrieval instructions from that description, on text alone; by default the describer's model,
loaded once). Loaded with :func:`demind.config.load_config`::

    cfg = load_config(TripletGenConfig, "configs/data_gen/triplets-tiny-cpu.yaml", ["engine.name=vllm"])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.engines import EngineConfig, SamplingConfig
from demind.gen.config import GenRunConfig
from demind.settings import setting

INSTRUCTION_MODES = ("json", "each")


@dataclass
class WriterConfig:
    """The instruction writer: a model run on text alone, on the describer's engine (``engine.name``)."""

    model: str = setting("", free="a folder or Hub id, checked with engine.model before any model loads",
                         help="the writer's model, a folder or Hub id; '' = the describer's (engine.model), "
                              "one engine for both roles")
    dtype: str = setting("auto", choices=("auto", "bfloat16", "float16", "float32"),
                         help="the writer's dtype when it is another model")
    max_model_len: int = setting(0, ge=0, help="the writer's context length when it is another model (0: its own)")


@dataclass
class TripletSamplingConfig:
    """Decoding of both roles; every request's seed derives from (run.seed, pair key, stage, attempt)."""

    temperature: float = setting(0.7, ge=0, help="0 = greedy (a retry then cannot change the text)")
    top_p: float = setting(0.9, gt=0, le=1)
    description_max_tokens: int = setting(160, ge=1, help="the relation description's length limit")
    instruction_max_tokens: int = setting(192, ge=1, help="the writer's answer (mode json: every instruction; "
                                                          "mode each: one)")
    retries: int = setting(2, ge=0, help="extra attempts (new seed) for a flagged description or an "
                                         "instruction answer that does not parse; then the pair is a counted failure")

    def engine_sampling(self) -> SamplingConfig:
        """What an engine reads of the sampling section (temperature, top_p)."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p)


@dataclass
class TripletPromptConfig:
    """Versioned prompt files (``demind/gen/triplet_prompts/<version>/``) and in-context examples."""

    version: str = setting("v1", free="a version name or folder, read (and refused if incomplete) before any model "
                                      "loads", help="a folder under demind/gen/triplet_prompts/, or a path to a folder with "
                                      "describe.txt, instruct.txt, instruct_one.txt, examples.json")
    examples: int = setting(2, ge=0, help="in-context examples in each writer prompt, drawn per pair (seeded) "
                                          "from the pool in examples.json")


@dataclass
class InstructionConfig:
    """How many instructions a pair gets and the structure they are written in."""

    count: int = setting(3, ge=3, help="instructions per pair (at least 3)")
    mode: str = setting("json", choices=INSTRUCTION_MODES,
                        help="json: one call writes all of them as a JSON object (vLLM: structured output; "
                             "transformers: parsed, retried, failures counted); each: one call per instruction, "
                             "the structure built by the job (any model, count calls per pair)")
    max_chars: int = setting(300, ge=10, help="an instruction longer than this is invalid")
    min_words: int = setting(2, ge=1, help="an instruction shorter than this is invalid")


@dataclass
class TripletIOConfig:
    image_max_side: int = setting(672, ge=1, help="images are shrunk so the longest side is at most this")
    log_every: int = setting(1000, ge=0, help="one log line every N pairs within a shard")


@dataclass
class TripletGenConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    writer: WriterConfig = field(default_factory=WriterConfig)
    sampling: TripletSamplingConfig = field(default_factory=TripletSamplingConfig)
    prompts: TripletPromptConfig = field(default_factory=TripletPromptConfig)
    instructions: InstructionConfig = field(default_factory=InstructionConfig)
    io: TripletIOConfig = field(default_factory=TripletIOConfig)
    run: GenRunConfig = field(default_factory=GenRunConfig)

    def writer_engine(self) -> EngineConfig | None:
        """The writer's engine section, or None when the describer's engine writes too."""
        if not self.writer.model or self.writer.model == self.engine.model:
            return None
        return EngineConfig(**{**vars(self.engine), "model": self.writer.model, "dtype": self.writer.dtype,
                               "max_model_len": self.writer.max_model_len, "prefix_cache": False})
