"""open_clip's text transformer run on token embeddings: padding cut, length buckets, truncation.

:class:`demind.backbone.FrozenCLIP` embeds tokens (some replaced by pseudo-word vectors) and
runs them through these functions; they read the open_clip model and hold no state.
:func:`check_text_tower` refuses, at load, the text towers these functions cannot serve.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from demind.errors import DemindError, InputError

NEEDS = ("pseudo-word tokens need CLIP's own text transformer: end-of-text (argmax) pooling, a causal "
         "mask and CLIP's BPE tokenizer; use a CLIP / OpenCLIP / EVA-CLIP / MetaCLIP model with that text tower")


class UnsupportedTextTowerError(DemindError, ValueError):
    """A backbone whose text tower the pseudo-word path cannot run (named, with the reason)."""


def text_tower_problem(model_cfg: dict[str, Any]) -> str | None:
    """Why an open_clip model config's text tower cannot take pseudo-word tokens, or None.

    Read from the config, before any weights are built or downloaded. The pseudo-word path
    embeds tokens itself (CLIP's BPE ids, so ``*`` is one token), cuts padding after the
    end-of-text token (exact only under a causal mask) and pools there (argmax pooling).
    """
    text = model_cfg.get("text_cfg", {}) or {}
    if "hf_model_name" in text or model_cfg.get("custom_text"):
        return f"its text tower is not CLIP's text transformer ({text.get('hf_model_name', 'custom_text')})"
    if "hf_tokenizer_name" in text:
        return f"it uses the Hugging Face tokenizer {text['hf_tokenizer_name']}, not CLIP's BPE tokenizer"
    if text.get("pool_type", "argmax") != "argmax":
        return f"its text tower pools with pool_type {text['pool_type']!r}, not at the end-of-text token (argmax)"
    if text.get("no_causal_mask") or text.get("embed_cls"):
        return "its text tower has no causal mask" if text.get("no_causal_mask") else "its text tower pools a class token"
    return None


def check_text_tower(model_cfg: dict[str, Any] | None, name: str) -> None:
    """Raise :class:`UnsupportedTextTowerError` naming ``name`` when its text tower cannot serve."""
    problem = text_tower_problem(model_cfg or {})
    if problem:
        raise UnsupportedTextTowerError(f"backbone {name} is not supported: {problem}; {NEEDS}")


def check_built_text_tower(model: nn.Module, name: str) -> None:
    """The same refusal on a built open_clip model (a config may reach open_clip another way)."""
    if not hasattr(model, "token_embedding") or not hasattr(model, "transformer"):
        raise UnsupportedTextTowerError(f"backbone {name} is not supported: it has no built-in CLIP text "
                                        f"transformer; {NEEDS}")
    pool = getattr(model, "text_pool_type", "argmax")
    if pool != "argmax" or model.attn_mask is None:
        reason = f"pool_type {pool!r}" if pool != "argmax" else "no causal mask"
        raise UnsupportedTextTowerError(f"backbone {name} is not supported: its text tower has {reason}; {NEEDS}")
    if not getattr(model.transformer, "batch_first", False):
        # open_clip before 2.26 runs its text transformer sequence-first; text_layers feeds (B, L, W)
        raise UnsupportedTextTowerError(f"backbone {name}: this open_clip's text transformer is sequence-first; "
                                        "install open_clip_torch>=2.26 (pip install -U open_clip_torch)")


def truncate_keeping_placeholders(ids: list[int], budget: int, placeholder_id: int) -> list[int]:
    """Drop free-text tokens from the end until ``ids`` fits ``budget``; placeholders stay."""
    if len(ids) <= budget:
        return ids
    n_placeholders = sum(1 for i in ids if i == placeholder_id)
    if n_placeholders > budget:
        raise InputError(f"{n_placeholders} placeholders do not fit a context of {budget} word tokens")
    keep = list(ids)
    for pos in range(len(keep) - 1, -1, -1):
        if len(keep) <= budget:
            break
        if keep[pos] != placeholder_id:
            del keep[pos]
    return keep


def length_buckets(eot: torch.Tensor, max_buckets: int, min_saving: float = 0.3) -> list[torch.Tensor] | None:
    """Row indices sorted by EOT position in at most ``max_buckets`` equal groups, or None
    (run the batch whole) when splitting would not save at least ``min_saving`` of the
    padded positions: several small matmuls cost more than one big one (measured:
    splitting a batch of equal-length prompts in 4 made it 1.9x slower)."""
    if max_buckets <= 1 or eot.numel() < 2:
        return None
    order = torch.argsort(eot, stable=True)
    groups = [idx for idx in torch.tensor_split(order, max_buckets) if idx.numel()]
    padded_whole = eot.numel() * (int(eot.max()) + 1)
    padded_split = sum(idx.numel() * (int(eot[idx].max()) + 1) for idx in groups)
    return groups if padded_split <= (1.0 - min_saving) * padded_whole else None


def run_text_transformer(model: nn.Module, embedded: torch.Tensor, eot: torch.Tensor, max_buckets: int = 1,
                         min_saving: float = 0.3, layers: Callable | None = None,
                         length_multiple: int = 1) -> torch.Tensor:
    """An open_clip text tower on (B, L, W) token embeddings -> (B, L', W) features after ln_final.

    Under CLIP's causal mask no token sees the positions after it, so the positions after
    a text's EOT (padding) cannot change any output read at or before it: L' = max EOT + 1,
    and with ``max_buckets`` > 1 the texts run in length groups (:func:`length_buckets`),
    each cut after its own longest text; a row's positions after its group's length are
    zeros. A non-causal tower runs whole. ``eot`` (B,) may live on the CPU (then no device
    sync is needed to cut); ``length_multiple`` rounds L' up (fewer distinct shapes for a
    compiled path), ``layers`` replaces :func:`text_layers` (a compiled copy). Gradients
    flow to ``embedded`` and to any trainable weights of ``model``.
    """
    layers = layers or text_layers
    if model.attn_mask is None:
        return layers(model, embedded, None)
    eot = eot.cpu()  # free when the caller passes CPU positions

    def cut(n: int) -> int:
        return min(-(-n // length_multiple) * length_multiple, embedded.shape[1])

    length = cut(int(eot.max()) + 1)
    buckets = length_buckets(eot, max_buckets, min_saving)
    if buckets is None:
        return layers(model, embedded[:, :length], model.attn_mask)
    chunks = []
    for idx in buckets:
        own = cut(int(eot[idx].max()) + 1)
        out = layers(model, embedded[idx.to(embedded.device), :own], model.attn_mask)
        chunks.append(nn.functional.pad(out, (0, 0, 0, length - own)))
    order = torch.argsort(torch.cat(buckets)).to(embedded.device)
    return torch.cat(chunks)[order]  # back to the input order


def text_layers(model: nn.Module, embedded: torch.Tensor, causal_mask: torch.Tensor | None) -> torch.Tensor:
    """(b, l, W) token embeddings -> (b, l, W): positions, transformer, ln_final."""
    length = embedded.shape[1]
    cast_dtype = model.transformer.get_cast_dtype()
    x = embedded.to(cast_dtype) + model.positional_embedding[:length].to(cast_dtype)
    mask = causal_mask[:length, :length] if causal_mask is not None else None
    return model.ln_final(model.transformer(x, attn_mask=mask))
