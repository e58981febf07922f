"""The noise modes of supervised triplet training (``robust.mode``): one batch's loss, and each mode's
noise detector.

* ``none``: InfoNCE (symmetric, tau = ``optim.temperature``) of composed queries f(r, m) against the
  frozen target features, every triplet.
* ``small-loss`` (TME / DivideMix style): at the start of each epoch after the warm-up, every
  triplet's InfoNCE loss under the current model (eval mode, in batches of the training size), a
  two-component Gaussian mixture on the losses (scikit-learn), P(clean) = posterior of the low-mean
  component; triplets below ``gmm_threshold`` leave the loss for that epoch.
* ``gfq``: per batch, ConeSep's GFQ through the model being trained flags noisy triplets (below);
  they leave the InfoNCE loss.
* ``rcl``: RCL's complementary contrastive loss (:func:`demind.robust.rcl_loss`) on every triplet.
* ``conesep``: L_robust + zeta * L_intra (+ nu * L_inter in the warm-up epochs) + kappa * L_ul (BTU,
  :func:`demind.robust.btu_loss`, masked entropic OT, after the warm-up), as ConeSep's code
  (github iLearn-Lab/CVPR26-ConeSep, ``lavis/models/blip2_models/ConeSep.py``, ``ConeSep.forward``;
  weights from ``train.py``'s defaults) does it by default:

  - L_robust (``robust_loss``): ``rcl``, RCL's loss on *every* triplet (``robust_infoNCE`` without
    labels); the noisy flags feed only BTU. ``infonce``: InfoNCE on the unflagged ones (our earlier form).
  - GFQ flags (``omega_form``, ``fidelity``, ``boundary``): s_i = cos(f(r_i, m_i), t_i); the boundary B
    from N(0, 1) pixel images through the frozen encoder and the model (``pixel``,
    :func:`demind.fidelity.pixel_boundary`) or a Gaussian fitted to the batch's features (``fitted``,
    :func:`demind.fidelity.composed_boundary`); F = x^2 (1 - x^2) of the clamped, batch-normalised
    s - B (``cone``, :func:`demind.robust.cone_fidelity`) or sigmoid((s - B) / tau) (``sigmoid``); the
    int(omega * B) lowest F are noisy (``share``, :func:`demind.robust.share_noisy`) or F < omega
    (``threshold``).
  - NBL's negative (``negative``): ``phrase``, F_neg = f(r, e(negation phrase + m) + P_neg), P_neg a
    learnable offset starting at 0 (the code's negative query tokens start as a copy of the query
    tokens and read "<phrase> <modification>"); ``prompt``: F_neg = f(r, P_neg).
  - NBL's losses (``nbl``): ``authors``, L_intra = the fixed slack band
    (:func:`demind.robust.nbl_fixed_band`, weight zeta = 0.8, every epoch; ``band=code``: on every
    pair's coordinate products, as the code's tensors broadcast; ``band=own``: on cos(F_c_i, F_neg_i)) and L_inter = the
    target-oriented loss on softmax probabilities (:func:`demind.robust.nbl_target_oriented`, weight
    nu = 0.5, warm-up epochs only); ``siglip``: our L_intra = SigLIP push + nu * batch band
    (:func:`demind.robust.nbl_loss`), weight zeta, every epoch.
  - BTU (``btu``): ``paper``, the default, as the paper describes it (:func:`demind.robust.btu_loss`;
    the anchors detached); ``code``, as the code computes it (:func:`demind.robust.code_btu_loss`: rows
    [softmax(scale * cos(q_i, t)) | cos(t_i, F_neg)], the noisy rows sent to the last column, the
    code's Sinkhorn, softmaxed soft labels; F_neg not detached).
* ``conesep-nobtu``: without L_ul. ``conesep-nonbl``: without NBL's losses (F_neg stays the untrained
  negative composition, BTU's anchors). ``conesep-nogfq``: BTU's noisy flags from the similarity alone
  (the int(omega * B) lowest s_i; no boundary, no fidelity function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from demind.fidelity import composed_boundary, fidelity_from_similarity, pixel_boundary
from demind.losses import per_sample_info_nce, weighted_mean
from demind.robust import (
    btu_loss, code_btu_loss, cone_fidelity, gmm_clean_probability, nbl_fixed_band, nbl_loss, nbl_target_oriented,
    rcl_loss, share_noisy)
from demind.trainkit import ONE_PROCESS, ProcessShare
from demind.triplets.config import TripletRobustConfig

CONESEP_MODES = ("conesep", "conesep-nobtu", "conesep-nonbl", "conesep-nogfq")
GFQ_MODES = ("gfq", "conesep", "conesep-nobtu", "conesep-nonbl")
NEGATIVE_MODES = CONESEP_MODES  # the negative compositions are computed (BTU's anchors)
NBL_MODES = ("conesep", "conesep-nobtu", "conesep-nogfq")  # NBL's losses train P_neg
BTU_MODES = ("conesep", "conesep-nonbl", "conesep-nogfq")
# negation phrases of the kind ConeSep's code prefixes to the modification (our wording)
NEGATION_PHRASES = ("there is no", "the image does not show", "the scene lacks", "no sign of",
                    "the picture has no", "nothing shows", "without any", "not showing")
NOISE_IMAGE_POOL = 2048


@dataclass
class ModeInputs:
    """What the authors' forms need besides the triplets' features.

    phrase_features: (U * P, D) raw text features of "<phrase> <text>" for each distinct training text u
    and negation phrase p (row u * P + p); text_rows: (N,) long, each triplet's distinct-text row;
    noise_images: (M, D) raw features of N(0, 1) pixel images (:func:`demind.fidelity.pixel_noise_features`)."""

    phrase_features: torch.Tensor | None = None
    text_rows: torch.Tensor | None = None
    noise_images: torch.Tensor | None = None

    def negative_text(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        """(B, D) the negated texts of triplets ``rows``, one phrase drawn per row (the code draws one per
        sample per step); None without phrase features."""
        if self.phrase_features is None or self.text_rows is None:
            return None
        choice = torch.randint(len(NEGATION_PHRASES), (len(rows),), generator=generator)
        return self.phrase_features[self.text_rows[rows.cpu()] * len(NEGATION_PHRASES) + choice]


    def for_batch(self, rows: torch.Tensor, generator: torch.Generator, device) -> dict:
        """:func:`batch_loss`'s ``negative_text`` and ``noise_images`` for the global batch ``rows``."""
        negative = self.negative_text(rows, generator)
        return {"negative_text": negative.to(device) if negative is not None else None,
                "noise_images": self.noise_images.to(device) if self.noise_images is not None else None}


def needs_inputs(cfg: TripletRobustConfig) -> tuple[bool, bool]:
    """(negation phrases, pixel-noise pool) the configured mode and forms need."""
    return (cfg.mode in NEGATIVE_MODES and cfg.negative == "phrase",
            cfg.mode in GFQ_MODES and cfg.boundary == "pixel")


def mode_inputs(cfg: TripletRobustConfig, backbone, texts: list[str], cache_dir: str, batch_size: int = 256
                ) -> ModeInputs:
    """The :class:`ModeInputs` of ``cfg`` for the training ``texts`` (phrase features from the text cache)."""
    from demind.fidelity import pixel_noise_features
    from demind.triplets.features import text_features

    phrases, pixels = needs_inputs(cfg)
    inputs = ModeInputs()
    if phrases:
        unique = sorted(set(texts))
        negated = [f"{p} {u}" for u in unique for p in NEGATION_PHRASES]
        inputs.phrase_features = text_features(backbone, negated, cache_dir, batch_size)
        row = {u: i for i, u in enumerate(unique)}
        inputs.text_rows = torch.tensor([row[t] for t in texts], dtype=torch.long)
    if pixels:
        inputs.noise_images = pixel_noise_features(backbone, NOISE_IMAGE_POOL, seed=0, batch_size=batch_size)
    return inputs


def start_negative_offset(model, cfg: TripletRobustConfig) -> None:
    """The phrase form's P_neg is an offset that starts at 0 (the negative path starts as the positive one)."""
    if cfg.mode in NEGATIVE_MODES and cfg.negative == "phrase":
        with torch.no_grad():
            model.negative_prompt.zero_()


@torch.no_grad()
def batch_fidelity(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, k: int,
                   generator: torch.Generator, cfg: TripletRobustConfig | None = None,
                   noise_images: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) GFQ fidelity of a batch through ``model`` (eval mode for the scoring, restored after), in
    ``cfg``'s forms (``boundary``, ``fidelity``; default: our earlier fitted boundary and sigmoid)."""
    was_training = model.training
    model.eval()
    if cfg is not None and cfg.boundary == "pixel":
        if noise_images is None:
            raise ValueError("robust.boundary=pixel needs the pixel-noise features (ModeInputs.noise_images)")
        boundary = pixel_boundary(model, noise_images, text, k, generator)
    else:
        boundary = composed_boundary(model, ref, text, target, k, generator)
    sims = F.cosine_similarity(model(ref, text), F.normalize(target.float(), dim=-1), dim=-1)
    model.train(was_training)
    if cfg is not None and cfg.fidelity == "cone":
        return cone_fidelity(sims, boundary.boundary)
    return fidelity_from_similarity(sims, boundary)


@torch.no_grad()
def batch_similarity(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) cos(f(r_i, m_i), t_i) through ``model`` in eval mode (``conesep-nogfq``'s score)."""
    was_training = model.training
    model.eval()
    sims = F.cosine_similarity(model(ref, text), F.normalize(target.float(), dim=-1), dim=-1)
    model.train(was_training)
    return sims


def noisy_flags(score: torch.Tensor, cfg: TripletRobustConfig) -> torch.Tensor:
    """(B,) bool: the int(omega * B) lowest scores (``omega_form=share``) or score < omega (``threshold``)."""
    return share_noisy(score, cfg.omega) if cfg.omega_form == "share" else score < cfg.omega


@torch.no_grad()
def per_sample_losses(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, scale: float,
                      batch_size: int, order: torch.Tensor, share: ProcessShare = ONE_PROCESS) -> torch.Tensor:
    """(N,) every triplet's InfoNCE loss under ``model`` (eval mode), in batches of ``batch_size``
    along ``order`` (the negatives of a loss are its batch's other targets, as in training).
    Several processes score every ``share.count``-th batch each and sum the (N,) results: every
    process gets all N losses, the same ones (each row comes from one process, zeros elsewhere)."""
    was_training = model.training
    model.eval()
    losses = torch.zeros(ref.shape[0])
    for number, start in enumerate(range(0, len(order), batch_size)):
        if number % share.count != share.index:
            continue
        rows = order[start : start + batch_size]
        query = model(ref[rows], text[rows])
        losses[rows] = per_sample_info_nce(query, F.normalize(target[rows].float(), dim=-1), scale).cpu()
    model.train(was_training)
    return share.total(losses)


def batch_loss(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig,
               scale: float, *, after_warmup: bool, clean_prior: torch.Tensor | None,
               generator: torch.Generator, forward=None, share: ProcessShare = ONE_PROCESS,
               negative_text: torch.Tensor | None = None, noise_images: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """The loss of one batch under ``cfg.mode`` and its terms ("loss", "nce": the contrastive term (InfoNCE
    or RCL), "intra", "inter", "ul", "kept": share of the batch in the contrastive term, "flagged": share
    flagged noisy). ``clean_prior``: (B,) bool from small-loss's epoch GMM (else None); negative_text:
    (B, D) the negated texts (``negative=phrase``); noise_images: (M, D) the pixel-noise pool.

    ref, text, target: (B, D) the global batch. This process composes its rows ``share.rows(B)``
    through ``forward`` (the model as Accelerate prepared it; default ``model``) and gathers every
    process's queries with gradients, so each process computes the one-process loss of the whole
    batch. The gather's backward sums the P processes' (equal) gradients into each process's rows
    and data parallelism averages them: the update is the one-process update of the global batch.
    GFQ's fidelity is computed on the whole batch (its boundary is fitted on the batch) and taken
    from the main process, so every process flags the same rows."""
    forward = forward if forward is not None else model
    rows = share.rows(ref.shape[0])
    with_negative = cfg.mode in NEGATIVE_MODES
    if with_negative:
        mine = negative_text[rows] if negative_text is not None else None
        out = forward(ref[rows], text[rows], with_negative=True, negative_text=mine)
        query, negative = (share.all_rows(o) for o in out)
    else:
        query, negative = share.all_rows(forward(ref[rows], text[rows])), None
    target_n = F.normalize(target.float(), dim=-1)
    noisy = batch_noisy(model, ref, text, target, cfg, after_warmup=after_warmup, clean_prior=clean_prior,
                        generator=generator, share=share, noise_images=noise_images)
    rcl = cfg.mode == "rcl" or (cfg.mode in CONESEP_MODES and cfg.robust_loss == "rcl")
    filtered = noisy is not None and not rcl  # the noisy flags leave the contrastive term
    if rcl:
        nce = rcl_loss(query, target_n, scale).mean()
    else:
        per = per_sample_info_nce(query, target_n, scale)
        nce = weighted_mean(per, (~noisy).float() if filtered else None)
    zero = nce.new_zeros(())
    terms = {"nce": nce, "intra": zero, "inter": zero, "ul": zero,
             "kept": (~noisy).float().mean() if filtered else nce.new_ones(()),
             "flagged": noisy.float().mean() if noisy is not None else zero}
    terms["loss"] = with_negative_terms(nce, terms, cfg, query, negative, target_n, noisy, scale, after_warmup)
    return terms


def batch_noisy(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig, *,
                after_warmup: bool, clean_prior: torch.Tensor | None, generator: torch.Generator,
                share: ProcessShare, noise_images: torch.Tensor | None) -> torch.Tensor | None:
    """(B,) bool: the batch's triplets the mode flags noisy (small-loss: the epoch's GMM; the GFQ modes:
    the fidelity of the whole batch, the main process's flags; ``conesep-nogfq``: the similarity),
    None in the warm-up and in the modes without a detector."""
    if after_warmup and cfg.mode == "small-loss":
        return ~clean_prior
    if after_warmup and cfg.mode in GFQ_MODES:
        fidelity = batch_fidelity(model, ref, text, target, cfg.pairings, generator, cfg, noise_images)
        return share.agree(noisy_flags(fidelity, cfg))
    if after_warmup and cfg.mode == "conesep-nogfq":
        return share.agree(share_noisy(batch_similarity(model, ref, text, target), cfg.omega))
    return None


def with_negative_terms(loss: torch.Tensor, terms: dict[str, torch.Tensor], cfg: TripletRobustConfig,
                        query: torch.Tensor, negative: torch.Tensor | None, target_n: torch.Tensor,
                        noisy: torch.Tensor | None, scale: float, after_warmup: bool) -> torch.Tensor:
    """``loss`` plus the mode's NBL terms (``intra``; ``inter`` in the warm-up) and BTU's ``ul`` (after
    the warm-up), each written into ``terms``."""
    if cfg.mode in NBL_MODES and cfg.nbl == "siglip":
        terms["intra"] = nbl_loss(negative, target_n, query, cfg.nu)
        loss = loss + cfg.zeta * terms["intra"]
    elif cfg.mode in NBL_MODES:
        terms["intra"] = nbl_fixed_band(query, negative, scale, pairs=cfg.band)
        loss = loss + cfg.zeta * terms["intra"]
        if not after_warmup:
            terms["inter"] = nbl_target_oriented(negative, target_n, scale)
            loss = loss + cfg.nu * terms["inter"]
    if after_warmup and cfg.mode in BTU_MODES:
        if cfg.btu == "code":
            terms["ul"] = code_btu_loss(query, target_n, negative, noisy, scale, cfg.gamma)
        else:
            terms["ul"], _ = btu_loss(query, target_n, negative, noisy, scale, cfg.gamma, cfg.sinkhorn_reg,
                                      cfg.sinkhorn_iters)
        loss = loss + cfg.kappa * terms["ul"]
    return loss


@torch.no_grad()
def noise_scores(model, ref: torch.Tensor, text: torch.Tensor, target: torch.Tensor, cfg: TripletRobustConfig,
                 scale: float, batch_size: int, seed: int, noise_images: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """(N,) each triplet's noise score under the mode's own detector (higher = more likely noisy):
    1 - F (GFQ modes, batches in index order; the cone F is not monotone in the similarity),
    -similarity (``conesep-nogfq``), 1 - P(clean) (small-loss), the loss itself (none, rcl)."""
    order = torch.arange(ref.shape[0])
    if cfg.mode in GFQ_MODES or cfg.mode == "conesep-nogfq":
        generator = torch.Generator().manual_seed(seed)
        scores = torch.zeros(ref.shape[0])
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            if cfg.mode == "conesep-nogfq":
                scores[rows] = -batch_similarity(model, ref[rows], text[rows], target[rows]).cpu()
            else:
                scores[rows] = 1 - batch_fidelity(model, ref[rows], text[rows], target[rows], cfg.pairings,
                                                  generator, cfg, noise_images).cpu()
        return scores
    losses = per_sample_losses(model, ref, text, target, scale, batch_size, order)
    return 1 - gmm_clean_probability(losses, seed) if cfg.mode == "small-loss" else losses
