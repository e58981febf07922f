"""What the toy CLIP sees: held-out text-to-image recall, one-attribute probes and pair probes."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import torch

from .clip import image_side, encode_toy_images
from toyworld.clip_config import ToyBackboneConfig
from .clip_data import render_pool
from .probes import PairScorer, pair_probe_cases, probe_ceiling, run_pair_probes
from .texts import alt_text, article, full_description
from .world import Scene, scene_from_seed, stream_seed
from demind.seeding import derive_seed

logger = logging.getLogger(__name__)


@torch.no_grad()
def text_to_image_recall(model: torch.nn.Module, tokenizer: Any, images: np.ndarray | torch.Tensor, texts: list[str],
                         ks: tuple[int, ...] = (1, 5, 10), batch: int = 250) -> dict[str, float]:
    """Text i should retrieve image i among all images. Returns {"R@k": fraction}.

    ``images``: (N, H, W, 3) uint8, or their (N, D) embeddings from :func:`encode_toy_images`
    (several text sets against one image set encode the images once)."""
    model.eval()
    img = images if isinstance(images, torch.Tensor) else encode_toy_images(model, images, batch)
    txt = torch.cat([model.encode_text(tokenizer(texts[i:i + batch]), normalize=True)
                     for i in range(0, len(texts), batch)])
    sims = txt @ img.T                                   # (N texts, N images)
    correct = sims.diagonal().unsqueeze(1)
    rank = (sims > correct).sum(dim=1)                  # 0 = retrieved first
    return {f"R@{k}": float((rank < k).float().mean()) for k in ks}


def probe_text(scene: Scene, attribute: str) -> str:
    """A text naming one attribute of a scene only: what the backbone can see of it.

    ``shape``: "a photo of a heart and a star"; ``colour``: "a photo of a red object and a
    blue object"; ``background``: "a photo on grass"; ``position``: "a photo of an object
    at the top left and ..." (the style word replaces "photo").
    """
    head = f"{article(scene.style)} {scene.style}"
    if attribute == "background":
        return f"{head} on {scene.background}"
    phrase = {"shape": lambda o: f"a {o.shape}", "colour": lambda o: f"a {o.colour} object",
              "position": lambda o: f"an object at the {o.position}"}[attribute]
    return f"{head} of " + " and ".join(phrase(o) for o in scene.objects)


PROBED_ATTRIBUTES = ("shape", "colour", "position", "background")


def evaluate_toy_clip(model: torch.nn.Module, tokenizer: Any, image_size: int, num_scenes: int,
                      progress: bool = True) -> dict[str, dict[str, float]]:
    """Text-to-image recall on held-out scenes: full descriptions, alt-texts, and
    texts that name one attribute only (``probe:shape`` ...), which show what the backbone sees."""
    scenes, images = render_pool("web_eval", num_scenes, image_size, progress)
    images = encode_toy_images(model, images)  # one image pass for all six text sets
    rng = random.Random(derive_seed("web_eval", "texts"))
    recall = {
        "full_description": text_to_image_recall(model, tokenizer, images, [full_description(s, rng) for s in scenes]),
        "alt_text": text_to_image_recall(model, tokenizer, images, [alt_text(s, rng) for s in scenes]),
    }
    for attribute in PROBED_ATTRIBUTES:
        recall[f"probe:{attribute}"] = text_to_image_recall(model, tokenizer, images,
                                                            [probe_text(s, attribute) for s in scenes])
    return recall


def clip_pair_scorer(model: torch.nn.Module, tokenizer, batch: int = 250) -> PairScorer:
    """The toy CLIP's cosine similarity of image i and text i, (N,)."""
    encoded: dict[tuple[str, ...], torch.Tensor] = {}  # every attribute scores the same descriptions

    @torch.no_grad()
    def score(images: np.ndarray, texts: list[str]) -> torch.Tensor:
        img = encode_toy_images(model, images, batch)
        key = tuple(texts)
        if key not in encoded:
            encoded.clear()
            encoded[key] = torch.cat([model.encode_text(tokenizer(texts[i:i + batch]), normalize=True)
                                      for i in range(0, len(texts), batch)])
        return (img * encoded[key]).sum(dim=-1)

    return score


def probe_ceilings(num_scenes: int, k: int = 10) -> dict[str, float]:
    """``probe:<attribute>`` -> R@k (fraction) of a perfect model on the held-out probe texts of
    :func:`evaluate_toy_clip` (their ambiguity caps it: :func:`toyworld.probes.probe_ceiling`)."""
    scenes = [scene_from_seed(stream_seed("web_eval", i)) for i in range(num_scenes)]
    return {f"probe:{a}": round(probe_ceiling(scenes, a, k), 4) for a in PROBED_ATTRIBUTES}


def pair_probes(model: torch.nn.Module, tokenizer: Any, image_size: int, num_scenes: int,
                ) -> dict[str, float]:
    """attribute -> pair-probe accuracy in % (chance 50) on ``num_scenes`` held-out scenes."""
    return run_pair_probes(clip_pair_scorer(model, tokenizer), pair_probe_cases(num_scenes), image_size)


def _add_probe_reports(report: dict[str, Any], model: torch.nn.Module, tokenizer: Any, cfg: ToyBackboneConfig
                       ) -> dict[str, Any]:
    """The report plus the pair probes and the R@10 probe ceilings (backfilled into older reports)."""
    report = dict(report)
    report["pair_probes"] = pair_probes(model, tokenizer, image_side(model), cfg.num_pair_probe_scenes)
    report["pair_probe_scenes"] = cfg.num_pair_probe_scenes
    report["heldout_probe_ceiling_R@10"] = probe_ceilings(cfg.num_eval_scenes)
    logger.info("toy CLIP pair probes (%%, chance 50): %s", json.dumps(report["pair_probes"]))
    return report


def format_backbone_report(report: dict[str, Any]) -> str:
    """The pair probes (main table) and the held-out R@K recall with each probe's ceiling."""
    lines = []
    if "pair_probes" in report:
        lines.append(f"toy CLIP pair probes ({report.get('pair_probe_scenes', '?')} held-out scenes; % of scenes "
                     "whose own image beats the one-attribute edit against its description; chance 50):")
        lines.append("  " + "  ".join(f"{a} {v:.1f}" for a, v in report["pair_probes"].items()))
    ceilings = report.get("heldout_probe_ceiling_R@10", {})
    lines.append("toy CLIP held-out text->image recall (R@1 / R@5 / R@10, %; probe = a text naming one attribute; "
                 "ceiling = R@10 of a perfect model):")
    for texts, recall in report["heldout_text_to_image"].items():
        ceiling = f"   (ceiling {100 * ceilings[texts]:.1f})" if texts in ceilings else ""
        lines.append(f"  {texts:<17} " + " / ".join(f"{100 * v:.1f}" for v in recall.values()) + ceiling)
    return "\n".join(lines)
