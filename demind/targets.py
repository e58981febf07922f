"""Target-description sampling: which text of an intent sample the model reads.

Per sample, T is the original caption, the rewritten caption or the pseudo-manipulation
description with probabilities 0.5 / 0.3 / 0.2 (the seed paper's Table 10, row 9; its
prose swaps two labels).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from demind.settings import setting


@dataclass
class TargetSampling:
    p_original: float = setting(0.5, ge=0, le=1)
    p_rewritten: float = setting(0.3, ge=0, le=1)
    p_intent: float = setting(0.2, ge=0, le=1)

    def config_problems(self) -> list[tuple[str, str]]:
        probs = (self.p_original, self.p_rewritten, self.p_intent)
        if abs(sum(probs) - 1.0) > 1e-6:
            return [("p_original", f"p_original + p_rewritten + p_intent must be 1, got {probs}")]
        return []


TARGET_KINDS = ("original", "rewritten", "intent")


def sample_target_kind(rng: random.Random, probs: TargetSampling) -> str:
    """Which text to read: one of TARGET_KINDS, drawn with the configured probabilities (one draw)."""
    u = rng.random()
    if u < probs.p_original:
        return "original"
    if u < probs.p_original + probs.p_rewritten:
        return "rewritten"
    return "intent"


def sample_target_text(original: str, rewritten: str, intent: str, rng: random.Random, probs: TargetSampling) -> str:
    """Draw one of the three texts with the configured probabilities."""
    return {"original": original, "rewritten": rewritten, "intent": intent}[sample_target_kind(rng, probs)]
