"""Training on noisy MLLM descriptions: the modes of ``training.noise``.

An MLLM hallucinates, so some T_rew / T_int do not match their image. GFQ
(:mod:`demind.fidelity`) gives each sample a fidelity F in (0, 1); ``noise.mode`` says
what the trainer does with it:

* ``none``: today's loss, F unused.
* ``filter``: a sample with F < omega leaves the loss (its row's weight is 0).
* ``downweight``: each sample's loss is weighted by F.
* ``conesep``: ConeSep's NBL + BTU (CVPR 2026), mapped onto De-MINDS below.

Which fidelity a term uses. De-MINDS has two contrastive terms (:mod:`demind.losses`):

* alignment, InfoNCE(t_hat_i, v_i): the composed query of the image's S* and the sampled
  target description T_i, against the image. Its fidelity is that of T_i: F_rew when T_i is
  T_rew, F_int when it is T_int, and 1 when it is T_ori (the web alt-text, which the MLLM did
  not write and which GFQ does not score);
* distillation, InfoNCE(t*_i, e(T_int_i)): the intention embedding against the frozen text
  embedding of T_int. Its fidelity is F_int, whatever T_i was.

ConeSep's roles, term by term (B = the process's micro batch):

==============  =================================  =====================================
role            alignment term                     distillation term
==============  =================================  =====================================
composition q   t_hat_i (gate of t_cls and t*)      t*_i (intention embedding)
target k        v_i, the frozen image embedding     e(T_int_i), the frozen teacher
negative        F_neg_i = text tower on             the same F_neg_i
anchor n        "a photo of S*_i , P_neg" (NBL)
noisy when      F(T_i) < omega                      F_int_i < omega
==============  =================================  =====================================

* **NBL** (L_intra): learnable negative prompt tokens P_neg (``model.negative_tokens``) take
  the place of the description in the query's own prompt, giving one negative composition
  F_neg_i per query. A reversed SigLIP-style sigmoid loss (SigLIP's initial scale 10 and
  bias -10) pushes F_neg_i away from its own target v_i (label -1) and towards the other
  targets v_j (label +1), each half weighted equally; a hinge keeps cos(F_neg_i, t_hat_i)
  inside the batch's [mean non-matching, mean matching] cos(t_hat, v) interval (query
  detached: the constraint shapes the anchor, not the query), weighted by nu:
  L_intra = L_push + nu * L_orth.
* **BTU** (L_ul), per term: cost C = 1 - [cos(q_i, k_j) | cos(q_i, n_j)], (B, 2B), detached.
  Masked paths: a noisy sample may not flow to its own target (i, i); a clean one may not flow
  to its own negative anchor (i, B + i). Entropic OT (Sinkhorn, POT's log-domain solver,
  uniform marginals 1/B over rows and 1/(2B) over columns, masked costs +inf so the plan is
  exactly 0 there) gives P*. Soft labels Y = gamma * B * P* + (1 - gamma) * L, where L is
  one-hot on the own target for clean samples and on the own negative anchor for noisy ones
  (rows of Y sum to 1). L_ul = mean_i KL(Y_i || softmax(scale * [cos(q_i, k) | cos(q_i, n)])),
  the anchors detached (they move by NBL only).
* **L_robust**: the De-MINDS loss on clean samples only (the filter mode's loss).
* Objective: L_robust + zeta * L_intra during the first ``noise.warmup_steps`` steps (the
  anchors learn where the boundary is before they serve as unlearning targets), then
  L_robust + kappa * L_ul + zeta * L_intra. L_ul sums the two terms' BTU losses (the
  distillation one only when distillation is on).

With several processes L_robust uses the global batch like the plain loss; NBL and BTU
work on each process's micro batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from demind.errors import InputError
from demind.schema import NoiseConfig
from demind.losses import Gather, demind_losses
from demind.model import ComposeOutput

SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -10.0


# --------------------------------------------------------------------------- fidelity per term


def target_fidelity(kinds: list[str], fidelity_int: torch.Tensor, fidelity_rew: torch.Tensor) -> torch.Tensor:
    """(B,) fidelity of each sample's sampled target text: F_int, F_rew, or 1 for T_ori."""
    ones = torch.ones_like(fidelity_int)
    by_kind = {"original": ones, "rewritten": fidelity_rew, "intent": fidelity_int}
    return torch.stack([by_kind[k][i] for i, k in enumerate(kinds)]) if kinds else ones


def sample_weights(mode: str, fidelity: torch.Tensor, omega: float) -> torch.Tensor | None:
    """(B,) per-sample loss weights: filter 1[F >= omega], downweight F, none None.
    conesep's L_robust uses the filter weights."""
    if mode == "none":
        return None
    if mode == "downweight":
        return fidelity.float()
    return (fidelity >= omega).float()


# --------------------------------------------------------------------------- BTU


def btu_allowed(noisy: torch.Tensor) -> torch.Tensor:
    """(B, 2B) bool, False on masked paths: (i, i) for noisy i, (i, B + i) for clean i."""
    b = noisy.shape[0]
    allowed = torch.ones(b, 2 * b, dtype=torch.bool, device=noisy.device)
    rows = torch.arange(b, device=noisy.device)
    allowed[rows, torch.where(noisy, rows, rows + b)] = False
    return allowed


def btu_labels(noisy: torch.Tensor) -> torch.Tensor:
    """(B, 2B) one-hot L: the own target (i) for clean i, the own negative anchor (B + i) for noisy i."""
    b = noisy.shape[0]
    labels = torch.zeros(b, 2 * b, device=noisy.device)
    rows = torch.arange(b, device=noisy.device)
    labels[rows, torch.where(noisy, rows + b, rows)] = 1.0
    return labels


def masked_sinkhorn(cost: torch.Tensor, allowed: torch.Tensor, reg: float, num_iters: int = 1000) -> torch.Tensor:
    """Entropic OT plan (B, 2B) between uniform marginals 1/B (rows) and 1/(2B) (columns),
    with exactly zero mass where ``allowed`` is False. POT's log-domain Sinkhorn, in float64.

    Feasible whenever B >= 2: each row and each column loses at most one path.
    """
    import ot

    import numpy as np

    b, n = cost.shape
    masked = torch.where(allowed, cost.detach().double(), torch.full_like(cost, float("inf"), dtype=torch.float64))
    # solved in NumPy on the CPU: POT's torch backend dispatches each of its ~1000 small iterations as
    # torch ops, which dominated the triplet runs' time; NumPy gives the same plan
    rows, cols = np.full(b, 1.0 / b), np.full(n, 1.0 / n)
    # an infinite cost is a kernel entry exp(-inf) = 0, so the solver itself puts no mass there; the
    # plan is returned as solved (not masked afterwards), so the logged masked mass is a real check
    plan = ot.sinkhorn(rows, cols, masked.cpu().numpy(), reg, method="sinkhorn_log", numItermax=num_iters,
                       stopThr=1e-7)
    return torch.from_numpy(plan).to(cost.device)


def btu_loss(query: torch.Tensor, targets: torch.Tensor, anchors: torch.Tensor, noisy: torch.Tensor,
             logit_scale: torch.Tensor | float, gamma: float, reg: float, num_iters: int = 1000
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """BTU's unlearning loss of one term and the plan's mass on masked paths (should be 0).

    query, targets, anchors: (B, D) L2-normalised; noisy: (B,) bool. Returns (scalar loss, scalar mass).
    """
    b = query.shape[0]
    sims = torch.cat([query @ targets.T, query @ anchors.detach().T], dim=1)  # (B, 2B)
    allowed = btu_allowed(noisy)
    plan = masked_sinkhorn(1.0 - sims.detach(), allowed, reg, num_iters)
    masked_mass = plan[~allowed].sum().float()
    soft = (gamma * b * plan + (1 - gamma) * btu_labels(noisy).double()).float()
    log_q = F.log_softmax(logit_scale * sims, dim=1)
    kl = (torch.xlogy(soft, soft) - soft * log_q).sum(1)
    return kl.mean(), masked_mass


# --------------------------------------------------------------------------- NBL


def nbl_loss(negative: torch.Tensor, targets: torch.Tensor, query: torch.Tensor, nu: float) -> torch.Tensor:
    """L_intra = L_push + nu * L_orth of the negative compositions (B, D) against the targets (B, D)
    and the queries (B, D), all L2-normalised (see the module docstring)."""
    b = negative.shape[0]
    eye = torch.eye(b, dtype=torch.bool, device=negative.device)
    logits = SIGLIP_SCALE * negative @ targets.T + SIGLIP_BIAS
    own = F.softplus(logits[eye]).mean()  # -log sigmoid(-z): away from the own target
    others = F.softplus(-logits[~eye]).mean() if b > 1 else logits.new_zeros(())  # towards the others
    push = 0.5 * (own + others)
    with torch.no_grad():
        q_t = query @ targets.T
        upper = q_t[eye].mean()
        lower = q_t[~eye].mean() if b > 1 else upper
    c = (negative * query.detach()).sum(-1)
    orth = (F.relu(lower - c) + F.relu(c - upper)).mean()
    return push + nu * orth


# --------------------------------------------------------------------------- the authors' code's forms
# (github iLearn-Lab/CVPR26-ConeSep, lavis/models/blip2_models/ConeSep.py; used by demind.triplets.modes)

RCL_EPS = 1e-7  # the code's clamp of the probabilities (ConeSep.robust_infoNCE)
SLACK_BAND = (-0.007, -0.002)  # the code's fixed band of cos(F_c, F_neg) (query_oriented_learning)


def rcl_loss(query: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """(B,) RCL's complementary contrastive loss per query, as ConeSep's ``robust_infoNCE`` computes it:
    p = softmax_j(scale * cos(q_i, t_j)) clamped to [1e-7, 1 - 1e-7], loss_i = -sum_{j != i} log(1 - p_ij).
    query, targets: (B, D) L2-normalised. (The code averages an image-to-text and a "text-to-image"
    term, but the latter is the same row-softmax matrix transposed under a symmetric mask: the same sum.)"""
    p = F.softmax(scale * query @ targets.T, dim=1).clamp(RCL_EPS, 1 - RCL_EPS)
    off = ~torch.eye(query.shape[0], dtype=torch.bool, device=query.device)
    return -(torch.log1p(-p) * off).sum(1)


def cone_fidelity(sims: torch.Tensor, boundary: float) -> torch.Tensor:
    """(B,) ConeSep's ``fidelity_measure``: x = max(s - B, 0) / max_batch(.), F = x^2 (1 - x^2).

    Not monotone: 0 at or below the boundary, highest (1/4) at x = 1/sqrt(2), and 0 again for the
    batch's most similar triplet. A batch with no triplet above the boundary gives F = 0 everywhere
    (the code would divide by zero there)."""
    x = (sims.float() - boundary).clamp(min=0)
    top = x.max()
    x = x / top if float(top) > 0 else x
    return x.pow(2) * (1 - x.pow(2))


def share_noisy(fidelity: torch.Tensor, omega: float) -> torch.Tensor:
    """(B,) bool: the int(omega * B) triplets of lowest fidelity (the code's ``topk(largest=False)``;
    ties broken by position)."""
    count = int(omega * fidelity.shape[0])
    noisy = torch.zeros(fidelity.shape[0], dtype=torch.bool, device=fidelity.device)
    noisy[torch.argsort(fidelity, stable=True)[:count]] = True
    return noisy


def nbl_target_oriented(negative: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """The code's ``targe_oriented_learning``: q = softmax_j(scale * cos(F_neg_i, t_j)) (B, B); labels
    y = -1 on the diagonal, +1 elsewhere; loss = -sum_ij log sigmoid(y_ij q_ij) / B (on probabilities,
    no SigLIP scale or bias). negative, targets: (B, D) L2-normalised."""
    q = F.softmax(scale * negative @ targets.T, dim=1)
    labels = 1 - 2 * torch.eye(q.shape[0], device=q.device)
    return -F.logsigmoid(labels * q).sum() / q.shape[0]


def nbl_fixed_band(query: torch.Tensor, negative: torch.Tensor, scale: float,
                   band: tuple[float, float] = SLACK_BAND, pairs: str = "code") -> torch.Tensor:
    """The code's ``query_oriented_learning``: a fixed band (lo, hi) = (-0.007, -0.002) on scale * c,
    loss = mean relu(c - scale * hi) + relu(scale * lo - c); the query is not detached (both sides move).

    pairs="code": c as the code computes it, ``sum(S * S_no, dim=1)`` on S (B, 1, 1, D) and S_no (B, D),
    which broadcasts to c_ijk = scale * F_c[i, k] * F_neg[j, k], every (i, j) pair and coordinate k,
    averaged over B * B * D terms. pairs="own": c_i = scale * cos(F_c_i, F_neg_i), each query's own
    negative (what the function's name and the paper's Eq. 7 describe), averaged over B.
    query, negative: (B, D) L2-normalised."""
    lo, hi = band
    if pairs == "own":
        c = scale * (query * negative).sum(-1)
    else:
        c = scale * query.unsqueeze(1) * negative.unsqueeze(0)  # (B, B, D)
    return (F.relu(c - scale * hi) + F.relu(scale * lo - c)).mean()


# BTU as the code's ``ConeSep.forward`` computes it after the warm-up (``robust.btu=code``); the paper's
# form above (``btu_loss``) stays the default. The code's Sinkhorn constants:
CODE_SINKHORN_REG, CODE_SINKHORN_ITERS, CODE_SINKHORN_STOP = 0.03, 100, 1e-4
CODE_MASKED_LOGIT = -1e6  # the code's masked log-kernel entry (not -inf: exp gives 0, lse stays finite)


def code_sinkhorn(cost: torch.Tensor, allowed: torch.Tensor, reg: float = CODE_SINKHORN_REG,
                  num_iters: int = CODE_SINKHORN_ITERS, stop: float = CODE_SINKHORN_STOP) -> torch.Tensor:
    """(N, M) entropic OT plan between uniform marginals 1/N (rows) and 1/M (columns), as the code's
    ``sinkhorn_log_domain_torch``: potentials u (N,), v (M,) from 0; each iteration
    u += reg * (log 1/N - lse_j K_ij), then v += reg * (log 1/M - lse_i K_ij), with the log kernel
    K = (u_i + v_j - C_ij) / reg set to -1e6 where ``allowed`` is False, lse(a) = log(sum exp(a - max) +
    1e-10) + max; it stops after ``num_iters`` or once sum |u - u_prev| < ``stop``. Plan = exp(K).
    cost: (N, M); allowed: (N, M) bool. In cost's dtype."""
    n, m = cost.shape
    log_p, log_q = cost.new_full((n,), 1.0 / n).log(), cost.new_full((m,), 1.0 / m).log()

    def kernel(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ((u[:, None] + v[None, :] - cost) / reg).masked_fill(~allowed, CODE_MASKED_LOGIT)

    def lse(a: torch.Tensor) -> torch.Tensor:  # (R, C) -> (R,); the code's +1e-10 kept for an equal plan
        top = a.max(dim=1, keepdim=True).values
        return (torch.log(torch.exp(a - top).sum(1, keepdim=True) + 1e-10) + top).squeeze(1)

    u, v = cost.new_zeros(n), cost.new_zeros(m)
    for _ in range(num_iters):
        previous = u
        u = reg * (log_p - lse(kernel(u, v))) + u
        v = reg * (log_q - lse(kernel(u, v).T)) + v
        if float((u - previous).abs().sum()) < stop:
            break
    return torch.exp(kernel(u, v))


def code_btu_paths(noisy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The code's mask and one-hot labels over the (B, 2B) columns [B targets | B negatives].

    allowed (B, 2B) bool: the last column (negative B - 1) is closed to every clean row; a noisy row i
    may not go to its own target (i, i) but may go to the last column. labels (B, 2B): 1 at (i, i) for
    clean i, at (i, 2B - 1) for noisy i (every noisy row is sent to the one last column, as the
    code's ``M_v[:, -1]`` / ``L_v[NC, -1]`` do). noisy: (B,) bool."""
    b = noisy.shape[0]
    rows = torch.nonzero(noisy).flatten()
    allowed = torch.ones(b, 2 * b, dtype=torch.bool, device=noisy.device)
    allowed[:, -1] = False
    allowed[rows, rows] = False
    allowed[rows, -1] = True
    labels = torch.zeros(b, 2 * b, device=noisy.device)
    labels[torch.arange(b), torch.arange(b)] = 1.0
    labels[rows, rows] = 0.0
    labels[rows, -1] = 1.0
    return allowed, labels


def code_soft_labels(sims: torch.Tensor, allowed: torch.Tensor, labels: torch.Tensor, gamma: float
                     ) -> torch.Tensor:
    """(N, M) the code's soft labels for one direction: cost (1 - sims) / its max, plan P of
    :func:`code_sinkhorn`, Y = softmax_j(gamma * P / rowsum(P) + (1 - gamma) * labels). A row with no
    open column (the last negative's row in the t2v direction when nothing is flagged; the code always
    flags int(omega * B) >= 1) gets no plan share instead of the code's 0 / 0."""
    cost = 1 - sims
    plan = code_sinkhorn(cost / cost.max(), allowed)
    share = plan / plan.sum(1, keepdim=True).clamp_min(torch.finfo(plan.dtype).tiny)
    return F.softmax(gamma * share + (1 - gamma) * labels.to(plan.dtype), dim=1)


def code_btu_loss(query: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor, noisy: torch.Tensor,
                  scale: float, gamma: float) -> torch.Tensor:
    """BTU's L_ul as the code computes it (the paper's form: :func:`btu_loss`).

    S = [softmax_j(scale * cos(q_i, t_j)) | cos(t_i, n_j)], (B, 2B): the first block row-softmax
    probabilities of query i, the second the cosines of *target* i with negative j (the code's
    ``DNC_feats @ target_feats`` broadcasts as a batch over targets, so its rows are targets). Labels
    (no gradient): Y_v2t from S, Y_t2v from S^T (:func:`code_soft_labels`, masks of
    :func:`code_btu_paths`). L_ul = (KL(Y_v2t || softmax(S)) / B + KL(Y_t2v || softmax(S^T)) / (2B)) / 2
    (``KLDivLoss(batchmean)`` of log_softmax of S itself: no temperature on the logits). Gradients reach
    the query through the probabilities and the negatives through their cosines (not detached, as in
    the code). query, targets, negatives: (B, D) L2-normalised; noisy: (B,) bool. Returns a scalar."""
    sims = torch.cat([F.softmax(scale * query @ targets.T, dim=1), targets @ negatives.T], dim=1)
    with torch.no_grad():
        allowed, labels = code_btu_paths(noisy)
        y_v2t = code_soft_labels(sims, allowed, labels, gamma)
        y_t2v = code_soft_labels(sims.T, allowed.T, labels.T, gamma)
    v2t = F.kl_div(F.log_softmax(sims, dim=1), y_v2t, reduction="batchmean")
    t2v = F.kl_div(F.log_softmax(sims.T, dim=1), y_t2v, reduction="batchmean")
    return (v2t + t2v) / 2


# --------------------------------------------------------------------------- small-loss


def gmm_clean_probability(losses: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """(N,) posterior of the low-loss component of a 2-component GMM on min-max normalised losses
    (N,) (the small-loss detector, DivideMix's settings; scikit-learn)."""
    from sklearn.mixture import GaussianMixture

    import numpy as np

    x = losses.double().numpy()
    x = (x - x.min()) / max(x.max() - x.min(), 1e-12)
    gmm = GaussianMixture(n_components=2, max_iter=20, tol=1e-2, reg_covar=5e-4, random_state=seed)
    gmm.fit(x.reshape(-1, 1))
    clean = int(np.argmin(gmm.means_.ravel()))
    return torch.from_numpy(gmm.predict_proba(x.reshape(-1, 1))[:, clean]).float()


# --------------------------------------------------------------------------- one step


def noise_aware_losses(out: ComposeOutput, teacher_emb: torch.Tensor, image_emb: torch.Tensor,
                       logit_scale: torch.Tensor, cfg: NoiseConfig, fidelity_align: torch.Tensor,
                       fidelity_distil: torch.Tensor, *, negative: torch.Tensor | None = None,
                       after_warmup: bool = True, distil: bool = True, gather: Gather | None = None
                       ) -> dict[str, torch.Tensor]:
    """The loss of one batch under ``cfg.mode``.

    fidelity_align, fidelity_distil: (B,) F of each sample's target text and of its T_int.
    negative: (B, D) F_neg (conesep only). Returns the terms of :func:`demind.losses.demind_losses`
    ("loss", "distil", "align"; for conesep the latter two are L_robust's) plus "ul", "intra"
    (0 outside conesep), "noisy_align", "noisy_distil" (share of the batch below omega) and
    "ot_masked_mass" (the OT plans' mass on masked paths; 0).
    """
    noisy_align = fidelity_align < cfg.omega
    noisy_distil = fidelity_distil < cfg.omega
    terms = demind_losses(out, teacher_emb, image_emb, logit_scale, distil=distil, gather=gather,
                          align_weights=sample_weights(cfg.mode, fidelity_align, cfg.omega),
                          distil_weights=sample_weights(cfg.mode, fidelity_distil, cfg.omega))
    zero = terms["loss"].new_zeros(())
    terms.update(ul=zero, intra=zero, ot_masked_mass=zero,
                 noisy_align=noisy_align.float().mean(), noisy_distil=noisy_distil.float().mean())
    if cfg.mode != "conesep":
        return terms
    if negative is None:
        raise InputError("noise.mode=conesep needs the negative compositions (model.negative_tokens >= 1)")
    image = F.normalize(image_emb.float(), dim=-1)
    teacher = F.normalize(teacher_emb.float(), dim=-1)
    negative = negative.float()
    intra = nbl_loss(negative, image, out.t_hat, cfg.nu)
    loss = terms["loss"] + cfg.zeta * intra
    ul, mass = zero, zero
    if after_warmup:
        ul, mass = btu_loss(out.t_hat, image, negative, noisy_align, logit_scale, cfg.gamma,
                            cfg.sinkhorn_reg, cfg.sinkhorn_iters)
        if distil:
            ul_d, mass_d = btu_loss(out.t_star, teacher, negative, noisy_distil, logit_scale, cfg.gamma,
                                    cfg.sinkhorn_reg, cfg.sinkhorn_iters)
            ul, mass = ul + ul_d, mass + mass_d
        loss = loss + cfg.kappa * ul
    terms.update(loss=loss, ul=ul, intra=intra, ot_masked_mass=mass)
    return terms
