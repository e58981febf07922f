"""The ``describe`` and ``rerank`` sections of ``demind-eval``'s config (the engine section is
:class:`demind.engines.EngineConfig`, the same ``engine.name`` / ``engine.model`` keys as generation)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from demind.settings import setting

# beside the generation prompts (demind/gen/prompts/<version>/), versioned the same way
DESCRIBE_PROMPT_ROOT = Path(__file__).resolve().parents[1] / "gen" / "prompts" / "describe"
PROMPT_FILES = {"caption": (), "rewrite": ("{caption}", "{modification}"), "osrcir": ("{modification}",),
                "verify": ("{modification}", "{candidate}")}  # the files of a prompt set and their fields


def describer_prompt_problem(version: str) -> str | None:
    """Why ``describe.prompts`` names no prompt set (no folder, or a file missing), or None; the files'
    fields are checked when they are read (:func:`demind.mllm.describers.load_describer_prompts`)."""
    folder = Path(version) if Path(version).is_dir() else DESCRIBE_PROMPT_ROOT / version
    if not folder.is_dir():
        available = sorted(p.name for p in DESCRIBE_PROMPT_ROOT.iterdir() if p.is_dir())
        return (f"describer prompt version {version!r} not found: no folder {folder}; available: {available} "
                f"(or pass describe.prompts=/path/to/folder)")
    missing = [f"{name}.txt" for name in PROMPT_FILES if not (folder / f"{name}.txt").is_file()]
    return f"{folder} lacks {', '.join(missing)}" if missing else None

DESCRIBERS = ("cirevl", "osrcir")


@dataclass
class DescribeOptions:
    """How the MLLM describers (methods ``cirevl``, ``osrcir``, ``demind+mllm``) run."""

    prompts: str = setting("v1", refuses="no-such-version", help="describer prompt version (demind/gen/prompts/describe/<version>) or a folder")
    samples: int = setting(1, ge=1, help="descriptions per query; > 1 is an LDRE-style ensemble (needs temperature > 0)")
    temperature: float = setting(0.0, ge=0, help="sampling temperature (0 = greedy)")
    top_p: float = setting(0.9, gt=0, le=1)
    max_tokens: int = setting(320, ge=1, help="OSrCIR's reasoning + description, in tokens")
    caption_max_tokens: int = setting(80, ge=1, help="CIReVL's reference caption")
    rewrite_max_tokens: int = setting(80, ge=1, help="CIReVL's rewritten description")
    image_max_side: int = setting(672, ge=1, help="reference images are shrunk to this longest side (LLaVA-1.6: 672)")
    chunk: int = setting(64, ge=1, help="queries per stored part (a kill loses at most one part's work)")
    seed: int = setting(0, ge=0, help="every request's seed derives from (seed, query id, stage, sample)")
    ensemble_tau: float = setting(0.05, gt=0, help="ensemble weights: softmax(consensus / tau), see docs/mllm.md")
    hybrid_weight: float = setting(0.5, ge=0, le=1, help="demind+mllm: (1 - w) De-MINDS query + w description")
    hybrid_describer: str = setting("osrcir", choices=DESCRIBERS, help="the describer demind+mllm uses")
    store: str | None = setting(None, output="dir", help="store of MLLM answers, keyed by content (default CACHE_DIR/descriptions, "
                                           "else OUT/descriptions; in search INDEX/descriptions); must be writable")

    def config_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.samples > 1 and self.temperature == 0:
            problems.append(("samples", f"= {self.samples} needs describe.temperature > 0 (greedy samples are "
                                        f"identical)"))
        missing = describer_prompt_problem(self.prompts)
        if missing:
            problems.append(("prompts", missing))
        return problems


@dataclass
class RerankOptions:
    """MLLM re-ranking of a method's top K (variants ``METHOD+rerank``; off while k = 0)."""

    k: int = setting(0, ge=0, le=50, help="candidates re-scored per query (0 = off; at most the 50 ranked)")
    methods: str | None = setting(None, refuses=",", help="comma-separated methods to re-rank (default: every method run)")
    batch_size: int = setting(8, ge=1, help="(query, candidate) pairs per forward pass")
    prefix_reuse: bool = setting(True, help="prefill each query's reference part once for its K candidates")
    yes: str = setting("yes", refuses=" ", help="the answer word whose log-probability scores a match")
    no: str = setting("no", refuses="yes", help="the answer word scored against it")

    def config_problems(self) -> list[tuple[str, str]]:
        problems = [(name, f"= {word!r} is empty: give the answer word (rerank.{name}=...)")
                    for name, word in (("yes", self.yes), ("no", self.no)) if not word.strip()]
        if not problems and self.yes.strip() == self.no.strip():
            problems.append(("no", f"= {self.no!r} equals rerank.yes: give two different answer words"))
        if self.methods is not None and not [n for n in self.methods.split(",") if n.strip()]:
            problems.append(("methods", f"= {self.methods!r} names no method: name the methods to re-rank "
                                        f"(rerank.methods=osrcir,demind), or leave it out to re-rank every method"))
        return problems
