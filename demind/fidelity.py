"""Geometric Fidelity Quantization (GFQ, ConeSep, CVPR 2026) for MLLM-written descriptions.

An MLLM hallucinates: some T_rew / T_int do not describe their image. GFQ scores each
(image, description) pair against a *noise boundary*: how similar an image and a text are
when they have nothing to do with each other.

Definitions (all cosines of L2-normalised frozen-CLIP embeddings, one text kind at a time):

* s_i = cos(v_i, t_i): the sample's image-text similarity.
* Noise boundary. K random pairings (K = 4): in pairing k every text t_j of the pool (the
  shard for the cache, the batch in training) is paired with a Gaussian sample g_kj standing
  in for an image, g_kj ~ N(mu, diag(sigma^2)) with mu, sigma the per-dimension mean and
  standard deviation of the pool's image embeddings, and with the texts in a random order
  (text pi_k(j)). The boundary and its spread are

      B   = mean over k, j of cos(g_kj, t_pi_k(j))
      tau = standard deviation of the same K * N cosines (at least 1e-4).

  Why a Gaussian *fitted to the images* rather than N(0, I): CLIP's image and text
  embeddings sit in two narrow cones (the modality gap), so any image has cosine ~0.1-0.3
  with any text; an isotropic Gaussian would put B at 0 for every backbone, below every
  real pair. The fitted Gaussian keeps the image cone's direction and loses all content,
  which is what "an image with nothing to do with the text" means.
* Fidelity F_i = sigmoid((s_i - B) / tau), in (0, 1).

  Why this form: F = 0.5 exactly at the boundary, so ConeSep's threshold omega = 0.5 means
  "no more similar than a contentless image is to a random text"; dividing by tau measures
  the distance in units of the random pairings' own spread, so no constant is tuned per
  backbone; and nothing is estimated from the clean samples (a "clean mode" would be the
  noisy mode at 80 % noise). F is monotone in s within a pool, so ranking metrics (AUROC)
  of F equal those of s; omega only sets the operating point.

No encoder runs here: everything is computed from embeddings the feature cache already
holds (:mod:`demind.features`). :func:`composed_boundary` is the same boundary through a composition
model (supervised training on triplets, :mod:`demind.triplets`): there the "pair" is a composed
query and its target image, as in the paper. :func:`pixel_boundary` is the boundary as ConeSep's
code computes it (N(0, 1) pixel images through the frozen encoder, :func:`pixel_noise_features`, and
the model; the mean over every (query, target) pair), the triplet trainer's default; its fidelity
function, x^2 (1 - x^2), is :func:`demind.robust.cone_fidelity`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from demind.schema import GFQ_PAIRINGS, GFQ_THRESHOLD

logger = logging.getLogger(__name__)

MIN_TAU = 1e-4  # well above float32 rounding of cosines
TEXT_KINDS = ("int", "rew")  # T_int and T_rew; T_ori is the web alt-text, not written by the MLLM


@dataclass(frozen=True)
class NoiseBoundary:
    """B and tau of one pool (see the module docstring)."""

    boundary: float
    tau: float


def pairing_similarities(fake_images: torch.Tensor, texts: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    """Cosines of K random pairings.

    fake_images: (K, N, D) stand-in images; texts: (N, D); perms: (K, N) long, a permutation
    of the texts per pairing. Returns (K, N): cos(fake_images[k, j], texts[perms[k, j]]).
    """
    paired = texts[perms]  # (K, N, D)
    return F.cosine_similarity(fake_images.float(), paired.float(), dim=-1)


def boundary_from_pairings(fake_images: torch.Tensor, texts: torch.Tensor, perms: torch.Tensor) -> NoiseBoundary:
    """B = mean, tau = std (population, at least MIN_TAU) of :func:`pairing_similarities`."""
    sims = pairing_similarities(fake_images, texts, perms).flatten()
    tau = float(sims.std(unbiased=False)) if sims.numel() > 1 else 0.0
    return NoiseBoundary(float(sims.mean()), max(tau, MIN_TAU))


def draw_pairings(image_emb: torch.Tensor, num_texts: int, k: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K pairings' stand-in images (K, N, D) from N(mu, diag sigma^2) of ``image_emb`` (M, D)
    (normalised first) and text permutations (K, N)."""
    images = F.normalize(image_emb.float(), dim=-1)
    mu = images.mean(0)
    sigma = images.std(0, unbiased=False) if images.shape[0] > 1 else torch.zeros_like(mu)
    noise = torch.randn(k, num_texts, images.shape[1], generator=generator)
    perms = torch.stack([torch.randperm(num_texts, generator=generator) for _ in range(k)])
    return (mu + sigma * noise.to(mu.device)), perms.to(mu.device)


def noise_boundary(image_emb: torch.Tensor, text_emb: torch.Tensor, k: int = GFQ_PAIRINGS,
                   generator: torch.Generator | None = None) -> NoiseBoundary:
    """GFQ's boundary of a pool: image_emb (N, D), text_emb (N, D) (raw or normalised)."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    fake, perms = draw_pairings(image_emb, text_emb.shape[0], k, generator)
    return boundary_from_pairings(fake, text_emb.to(fake.device), perms)


def composed_boundary(compose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ref_emb: torch.Tensor,
                      text_emb: torch.Tensor, target_emb: torch.Tensor, k: int = GFQ_PAIRINGS,
                      generator: torch.Generator | None = None) -> NoiseBoundary:
    """GFQ's boundary through a composition model, as ConeSep computes it (its Eq. 2): K pairings
    of stand-in references and targets, each drawn like :func:`draw_pairings` from a Gaussian fitted
    to the pool's reference (N, D) and target (N, D) image features, with the pool's texts (N, D) in a
    random order; B = mean and tau = std of cos(compose(r_fake, t_perm), v_fake).

    ``compose``: (M, D) images, (M, D) texts -> (M, D) composed queries (the model being trained;
    called once on K * N rows). The caller decides on gradients (GFQ runs under ``no_grad``)."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    fake_refs, perms = draw_pairings(ref_emb, text_emb.shape[0], k, generator)
    fake_targets, _ = draw_pairings(target_emb, text_emb.shape[0], k, generator)
    texts = text_emb.to(fake_refs.device)[perms]  # (K, N, D)
    composed = compose(fake_refs.flatten(0, 1), texts.flatten(0, 1))
    sims = F.cosine_similarity(composed.float(), fake_targets.flatten(0, 1).to(composed.device), dim=-1)
    tau = float(sims.std(unbiased=False)) if sims.numel() > 1 else 0.0
    return NoiseBoundary(float(sims.mean()), max(tau, MIN_TAU))


def pixel_noise_features(backbone, count: int, seed: int = 0, batch_size: int = 256) -> torch.Tensor:
    """(count, D) raw frozen features of N(0, 1) pixel images (preprocessed space), as ConeSep's code
    draws its boundary's stand-in images (``torch.randn(B, 3, 224, 224)`` through the visual encoder).
    The encoder is frozen, so a pool drawn once stands in for fresh draws per batch."""
    size = backbone.image_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    generator = torch.Generator().manual_seed(seed)
    parts = []
    with torch.no_grad():
        for start in range(0, count, batch_size):
            pixels = torch.randn(min(batch_size, count - start), 3, h, w, generator=generator)
            parts.append(backbone.encode_image(pixels).float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0, backbone.embed_dim)


def pixel_boundary(compose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise_images: torch.Tensor,
                   text_emb: torch.Tensor, k: int, generator: torch.Generator) -> NoiseBoundary:
    """ConeSep's boundary as its code computes it: B stand-in references and B stand-in targets drawn
    from ``noise_images`` (M, D) (:func:`pixel_noise_features`), B texts drawn with replacement from the
    batch's ``text_emb`` (B, D); B = the mean of the (B, B) matrix cos(compose(r_i, t_i), v_j) over
    every (i, j) (the code's ``(sim.mean() + sim.T.mean()) / 2``), averaged over ``k`` draws (the code
    draws once); tau = the std of those cosines (unused by the cone fidelity)."""
    b, m = text_emb.shape[0], noise_images.shape[0]
    sims = []
    for _ in range(k):
        refs = noise_images[torch.randint(m, (b,), generator=generator).to(noise_images.device)]
        targets = noise_images[torch.randint(m, (b,), generator=generator).to(noise_images.device)]
        texts = text_emb[torch.randint(b, (b,), generator=generator).to(text_emb.device)]
        composed = compose(refs.to(text_emb.device), texts).float()
        sims.append(composed @ F.normalize(targets.float(), dim=-1).to(composed.device).T)
    sims = torch.stack(sims)
    tau = float(sims.std(unbiased=False)) if sims.numel() > 1 else 0.0
    return NoiseBoundary(float(sims.mean()), max(tau, MIN_TAU))


def fidelity_from_similarity(sims: torch.Tensor, boundary: NoiseBoundary) -> torch.Tensor:
    """F = sigmoid((s - B) / tau), same shape as ``sims``."""
    return torch.sigmoid((sims.float() - boundary.boundary) / boundary.tau)


def pair_similarity(image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
    """(N,) cos(v_i, t_i) of row-aligned (N, D) embeddings."""
    return F.cosine_similarity(image_emb.float(), text_emb.float(), dim=-1)


def gfq_fidelity(image_emb: torch.Tensor, text_emb: torch.Tensor, k: int = GFQ_PAIRINGS,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, NoiseBoundary]:
    """Per-sample fidelity (N,) of row-aligned image (N, D) and text (N, D) embeddings, the pool
    being these N samples; and the pool's boundary."""
    boundary = noise_boundary(image_emb, text_emb, k, generator)
    return fidelity_from_similarity(pair_similarity(image_emb, text_emb), boundary), boundary


# --------------------------------------------------------------------------- report


def histogram(values: torch.Tensor, bins: int = 10) -> list[int]:
    """Counts of ``values`` in ``bins`` equal bins over [0, 1] (1.0 in the last)."""
    if values.numel() == 0:
        return [0] * bins
    return torch.histc(values.float().clamp(0, 1), bins=bins, min=0.0, max=1.0).long().tolist()


def fidelity_summary(fidelities: dict[str, torch.Tensor], omega: float = GFQ_THRESHOLD, bins: int = 10
                     ) -> dict[str, Any]:
    """Per text kind: samples, histogram counts over [0, 1], share (and count) below omega, mean."""
    out: dict[str, Any] = {"omega": omega}
    for kind, values in fidelities.items():
        below = int((values < omega).sum())
        out[kind] = dict(samples=int(values.numel()), below_omega=below,
                         share_below_omega=round(below / max(values.numel(), 1), 4),
                         mean=round(float(values.float().mean()), 4) if values.numel() else None,
                         histogram=histogram(values, bins))
    return out


def plot_fidelity(fidelities: dict[str, torch.Tensor], path: str | Path, omega: float = GFQ_THRESHOLD,
                  bins: int = 20) -> Path | None:
    """A PNG with one histogram per text kind and omega marked; None (logged) without matplotlib."""
    from demind.plots import file_pyplot

    plt = file_pyplot("fidelity plot")
    if plt is None:
        return None
    from demind.io import write_bytes_atomic
    import io

    fig, axes = plt.subplots(1, len(fidelities), figsize=(4.5 * len(fidelities), 3.2), squeeze=False)
    for ax, (kind, values) in zip(axes[0], fidelities.items()):
        ax.hist(values.float().numpy(), bins=bins, range=(0, 1), color="tab:blue")
        ax.axvline(omega, color="tab:red", linestyle="--", label=f"omega = {omega:g}")
        share = float((values < omega).float().mean()) if values.numel() else 0.0
        ax.set_title(f"T_{kind}: {share:.1%} below omega")
        ax.set_xlabel("GFQ fidelity F")
        ax.set_ylabel("samples")
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path = Path(path)
    write_bytes_atomic(path, buf.getvalue())
    return path
