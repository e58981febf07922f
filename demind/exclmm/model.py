"""ExclMM modules (paper section 3) over frozen CLIP embeddings.

* :class:`SparseAutoencoder` -- stage 1, step 1: word vector x (D) -> sparse code z (d) in [0, 1]
  (a capped ReLU, as SPINE, whose three losses Eq. 2-4 are) -> reconstruction (D).
* :func:`sentence_code` -- step 2 (Eq. 5): a sentence's code is the mean of its words' codes.
* :class:`SparseSpace` -- step 3 (Eq. 8-11): image and text encoders E_v, E_t from CLIP
  embeddings into the d-dimensional sparse space (capped ReLU), the masks
  (text: ``1[z_c > 0] OR Top_t(h)``; image: ``Top_t(h)``) and the decoders D_v, D_t.
* :class:`ExclusionQueryEncoder` -- stage 2: F_theta over the frozen sparse text code of an
  exclusion query; residual, with a zero-initialised last layer so that at initialisation
  F_theta is the identity (stage-1 retrieval).

All inputs are L2-normalised CLIP embeddings (the scale of raw CLIP features differs across
backbones). Similarity in the sparse space is, in the earlier form (the default), the dot product
(Eq. 12 at tau = 1, Eq. 18): codes lie in [0, 1]^d and only about t + |z_c| entries are non-zero,
so logits lie in [0, ~t]: a usable softmax at tau = 1, which a cosine (logits in [-1, 1]) would
not give. The paper's form (``query.contrastive=paper``) uses the cosine, as the paper writes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from demind.identity import same_backbone
from demind.errors import DemindError, InputError
from demind.exclmm.run_upgrade import form_of
from demind.tensor_files import read_format_metadata


def capped_relu(x: torch.Tensor) -> torch.Tensor:
    """min(1, max(0, x)): SPINE's activation; codes in [0, 1]."""
    return x.clamp(0.0, 1.0)


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))


class SparseAutoencoder(nn.Module):
    """One hidden layer of width d: ``z = capped_relu(W x_s + b)``, ``x_s_hat = W' z + b'``.

    x_s is the word vector standardised per dimension over the training vocabulary (buffers
    ``mean``, ``std``). Unit-norm CLIP vectors have entries of about 1/sqrt(D); unstandardised,
    their reconstruction error is so small next to the partial-sparsity term (a sum over d
    units) that every unit dies at 0 -- which is what happened before this was added. GloVe
    vectors, which SPINE was tuned on, have entries of order 1.
    """

    def __init__(self, input_dim: int, code_dim: int) -> None:
        super().__init__()
        self.encoder = nn.Linear(input_dim, code_dim)
        self.decoder = nn.Linear(code_dim, input_dim)
        self.register_buffer("mean", torch.zeros(input_dim))
        self.register_buffer("std", torch.ones(input_dim))

    @torch.no_grad()
    def set_statistics(self, vectors: torch.Tensor) -> None:
        """Per-dimension mean and std of the (V, D) training word vectors."""
        self.mean.copy_(vectors.mean(dim=0))
        self.std.copy_(vectors.std(dim=0).clamp(min=1e-6))

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) word vectors -> (N, d) codes in [0, 1]."""
        return capped_relu(self.encoder(self.standardise(x)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, D) -> (codes (N, d), reconstructions (N, D), standardised targets (N, D))."""
        z = self.encode(x)
        return z, self.decoder(z), self.standardise(x)


def sentence_code(word_codes: torch.Tensor, word_index: list[list[int]]) -> torch.Tensor:
    """Eq. 5: (V, d) word codes, per sentence the indices of its words -> (S, d) mean codes.

    A sentence without any known word gets the zero code (its mask is then Top_t alone).
    """
    out = torch.zeros(len(word_index), word_codes.shape[1], dtype=word_codes.dtype, device=word_codes.device)
    for i, idx in enumerate(word_index):
        if idx:
            out[i] = word_codes[torch.as_tensor(idx, device=word_codes.device)].mean(dim=0)
    return out


def top_t_mask(h: torch.Tensor, t: int) -> torch.Tensor:
    """(N, d) -> (N, d) bool, True at each row's t largest entries."""
    t = min(t, h.shape[1])
    mask = torch.zeros_like(h, dtype=torch.bool)
    return mask.scatter(1, h.topk(t, dim=1).indices, True)


class SparseSpace(nn.Module):
    """Stage 1, step 3: E_v, E_t (D -> d, capped ReLU) and D_v, D_t (d -> D)."""

    def __init__(self, clip_dim: int, code_dim: int, hidden: int, top_t: int) -> None:
        super().__init__()
        self.top_t = top_t
        self.image_encoder = mlp(clip_dim, hidden, code_dim)
        self.text_encoder = mlp(clip_dim, hidden, code_dim)
        self.image_decoder = mlp(code_dim, hidden, clip_dim)
        self.text_decoder = mlp(code_dim, hidden, clip_dim)

    def mask(self, h: torch.Tensor, z_c: torch.Tensor | None) -> torch.Tensor:
        """Eq. 8-9: ``1[z_c > 0] OR Top_t(h)`` (Top_t alone without a caption code)."""
        m = top_t_mask(h, self.top_t)
        return m | (z_c > 0) if z_c is not None else m

    def image_code(self, clip_image: torch.Tensor) -> torch.Tensor:
        """(N, D) normalised CLIP image embeddings -> (N, d) E_i^d, unmasked (Eq. 6)."""
        return capped_relu(self.image_encoder(clip_image))

    def text_code(self, clip_text: torch.Tensor) -> torch.Tensor:
        """(N, D) normalised CLIP text embeddings -> (N, d) E_c^d, unmasked (Eq. 7)."""
        return capped_relu(self.text_encoder(clip_text))

    def encode_image(self, clip_image: torch.Tensor, z_c: torch.Tensor | None = None) -> torch.Tensor:
        """(N, D) normalised CLIP image embeddings -> (N, d) masked sparse codes (Eq. 10).

        ``z_c``: the paired caption's code, for the paper's training mask ``z_c OR Top_t``
        (``space.image_mask=zc_or_top_t``). At retrieval an image has no caption, so the gallery
        is always Top_t alone; with ``top_t`` training does the same (a mask taken from the
        paired caption can hand the contrastive loss the answer: in an early run, image and text
        codes aligned in training and not at all at inference).
        """
        h = self.image_code(clip_image)
        return h * self.mask(h, z_c)

    def encode_text(self, clip_text: torch.Tensor, z_c: torch.Tensor | None = None) -> torch.Tensor:
        """(N, D) normalised CLIP text embeddings -> (N, d) masked sparse codes (Eq. 11)."""
        h = self.text_code(clip_text)
        return h * self.mask(h, z_c)


class ExclusionQueryEncoder(nn.Module):
    """Stage 2: F_theta(s) = s + MLP(s), not clamped: a negative entry penalises images active on
    that dimension, which is how a query says "not X" against non-negative image codes (a [0, 1]
    clamp can only say it by absence, and dimensions pushed below 0 stop getting gradients).

    ``space="clip"`` is the "CLIP embeddings without stage 1" ablation: input and output are CLIP
    text embeddings, compared with CLIP image embeddings by cosine.
    """

    def __init__(self, dim: int, hidden: int, space: str = "sparse") -> None:
        super().__init__()
        if space not in ("sparse", "clip"):
            raise InputError(f"space must be 'sparse' or 'clip', got {space!r}")
        self.space = space
        self.net = mlp(dim, hidden, dim)
        nn.init.zeros_(self.net[-1].weight)  # identity at initialisation
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, dim) query embeddings (sparse: any sign; clip: L2-normalised)."""
        out = s + self.net(s)
        return out if self.space == "sparse" else F.normalize(out, dim=-1)


WORD_PATTERN = re.compile(r"[a-z]+")
FORMAT = "demind-exclmm/1"


def words_of(sentence: str) -> list[str]:
    """Lower-case alphabetic words, as spelled (no stemming): the units of Eq. 5."""
    return WORD_PATTERN.findall(sentence.lower())


class ExclMM(nn.Module):
    """The trained model: SAE (word codes), sparse space, query encoder; config and backbone identity.

    Retrieval (Eq. 18): score(query, image) = F_theta(E_t(query) masked) . E_v(image) masked
    (Top_t; images have no caption at inference), both l2-normalised (a cosine) when stage 2
    trained on normalised codes (``query.contrastive=paper``). In the ``clip`` ablation: cosine
    of F_theta(CLIP text) with the CLIP image embedding.
    """

    def __init__(self, cfg: dict[str, Any], clip_dim: int, backbone_identity: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone_identity = backbone_identity
        sae, space, query = cfg["sae"], cfg["space"], cfg["query"]
        self.sae = SparseAutoencoder(clip_dim, sae["code_dim"])
        self.space = SparseSpace(clip_dim, sae["code_dim"], space["hidden"], space["top_t"])
        q_dim = clip_dim if query["space"] == "clip" else sae["code_dim"]
        self.query_encoder = ExclusionQueryEncoder(q_dim, query["hidden"], query["space"])

    @classmethod
    def from_config(cls, cfg: Any, clip_dim: int, backbone_identity: dict[str, Any]) -> "ExclMM":
        return cls(asdict(cfg) if is_dataclass(cfg) else cfg, clip_dim, backbone_identity)

    @property
    def uses_stage1(self) -> bool:
        return self.cfg["query"]["space"] == "sparse"

    @property
    def cosine_scores(self) -> bool:
        """Whether retrieval scores are cosines: the paper's Eq. 15 trains on l2-normalised
        codes, so Eq. 18 ranks by cosine; the ``dot`` form ranks by the dot product it trained on."""
        return not self.uses_stage1 or form_of(self.cfg, "query", "contrastive") == "paper"

    def _scored(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) if self.cosine_scores else x

    def phase_module(self, phase: str) -> nn.Module:
        return {"sae": self.sae, "space": self.space, "query": self.query_encoder}[phase]

    # the query's words as the model splits them, reached through the model so that the
    # evaluation (which ExclMM's trainer builds on) needs no import of demind.exclmm
    words_of = staticmethod(words_of)

    @staticmethod
    def sentence_codes(word_codes: torch.Tensor, word_index: list[list[int]]) -> torch.Tensor:
        return sentence_code(word_codes, word_index)

    @torch.no_grad()
    def encode_images(self, clip_images: torch.Tensor) -> torch.Tensor:
        """(N, D) CLIP image embeddings (any scale) -> (N, d) gallery codes (or (N, D) normalised)."""
        x = F.normalize(clip_images.float(), dim=-1)
        return self._scored(self.space.encode_image(x)) if self.uses_stage1 else x

    @torch.no_grad()
    def encode_queries(self, clip_texts: torch.Tensor, word_vectors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """(N, D) CLIP text embeddings of exclusion queries -> (N, d) query codes (Eq. 18's left side).

        word_vectors: per query, its words' normalised CLIP vectors (n_i, D), for the z_q mask
            (needed when the model was trained with ``space.zc_mask``).
        """
        x = F.normalize(clip_texts.float(), dim=-1)
        if not self.uses_stage1:
            return self.query_encoder(x)
        z_q = None
        if self.cfg["space"]["zc_mask"]:
            if word_vectors is None:
                raise ValueError("this ExclMM uses the z_c mask: pass each query's word vectors")
            z_q = torch.stack([self.sae.encode(v.float()).mean(dim=0) if len(v) else
                               torch.zeros(self.cfg["sae"]["code_dim"], device=x.device) for v in word_vectors])
        return self._scored(self.query_encoder(self.space.encode_text(x, z_q)))

    def save(self, path: str | Path) -> Path:
        """Weights (safetensors) + config + backbone identity, written atomically."""
        from safetensors.torch import save_file

        from demind.io import atomic_path

        meta = {"format": FORMAT, "config": json.dumps(self.cfg), "backbone_identity": json.dumps(self.backbone_identity)}
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return Path(path)


def read_export_config(path: str | Path) -> dict[str, Any]:
    """The training config recorded in an export."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {})["config"])


class ExclMMExportError(DemindError, ValueError):
    """A file given as an ExclMM export that is not one (unreadable, or another format)."""


def load_exclmm(path: str | Path, backbone_identity: dict[str, Any] | None = None,
                device: str | torch.device = "cpu") -> ExclMM:
    """Load an export; with ``backbone_identity`` it must match the one it was trained on."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_format_metadata(path, FORMAT, ExclMMExportError, "ExclMM export",
                                "an ExclMM export is the exclmm.safetensors that demind-train-exclmm writes")
    identity = json.loads(meta["backbone_identity"])
    # the same comparison as De-MINDS checkpoints: by content, older file-name records accepted
    if backbone_identity is not None and not same_backbone(identity, backbone_identity):
        raise InputError(f"{path} was trained on backbone {identity}, but the loaded backbone is "
                         f"{backbone_identity}; load the backbone it was trained on")
    state = load_file(str(path))
    cfg = json.loads(meta["config"])
    clip_dim = state["sae.encoder.weight"].shape[1]
    model = ExclMM(cfg, clip_dim, identity)
    model.load_state_dict(state)
    return model.to(device).eval()
