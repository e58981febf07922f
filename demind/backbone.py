"""The frozen CLIP backbone (open_clip), with text encoding through pseudo-word tokens.

Every method in this project (Pic2Word-style mapping, De-MINDS, the baselines) asks the
same thing of CLIP: embed images, embed text, and embed text in which some token
embeddings are replaced by vectors we compute (S*, or the refined intention queries).
:class:`FrozenCLIP` does all three from one open_clip model whose weights never change;
gradients still flow *through* its text tower into the replaced vectors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import open_clip
import torch
import torch.nn as nn

from demind.errors import DemindError, InputError, MissingInputError
from demind.config import ConfigError, validate
from demind.hubref import hub_unreachable
from demind.plugins import require_timm_model
from demind.schema import RANDOM_TAGS, BackboneConfig, pretrained_names_a_file
from demind.templates import PLACEHOLDER
from demind.identity import backbone_identity, config_activation, identity_slug, tag_activation
from demind.text_tower import (
    check_built_text_tower, check_text_tower, run_text_transformer, text_layers, truncate_keeping_placeholders)

log = logging.getLogger(__name__)

# open_clip's precision names -> the autocast dtype the towers run under (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None, "fp16": None, "bf16": None, "pure_fp16": None, "pure_bf16": None,
    "amp": torch.float16, "amp_bf16": torch.bfloat16, "amp_bfloat16": torch.bfloat16,
}




class TextOutput(NamedTuple):
    """One text-tower forward pass.

    pooled: (B, D) projected embedding at the end-of-text token, not normalised.
    tokens: (B, L', W) final-layer per-token features (after the final LayerNorm), for the
        first L' = (last end-of-text position in the batch) + 1 <= L positions.
    mask: (B, L') bool, True on word tokens: not start-of-text, end-of-text or padding.
    eot: (B,) long, index of the end-of-text token.
    """

    pooled: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    eot: torch.Tensor


def _resolve_model_name(name: str) -> str:
    """Register a model-config JSON with open_clip and return its registry name."""
    if not name.endswith(".json"):
        return name
    path = Path(name)
    if not path.is_file():
        raise MissingInputError(
            f"backbone model config {path} does not exist; give an open_clip model name "
            f"(see open_clip.list_models()) or the path of a model-config JSON"
        )
    open_clip.add_model_config(path)
    require_timm_model(open_clip.get_model_config(path.stem), path)  # a plugin's tower: load its package
    return path.stem


@contextlib.contextmanager
def quiet_random_init_notice() -> Iterator[None]:
    """open_clip warns "No pretrained weights loaded" through the root logger on every random
    initialisation; for ``pretrained: null`` that is what was asked for, so it goes to debug."""

    def keep(record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("No pretrained weights loaded"):
            log.debug("%s", record.getMessage())
            return False
        return True

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def text_width(cfg: BackboneConfig) -> int | None:
    """The text tower's width W from the model config, without building the model (None if unknown)."""
    try:
        config = open_clip.get_model_config(_resolve_model_name(cfg.name))
        return int(config["text_cfg"]["width"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def backbone_activation(model_name: str, model_cfg: dict | None, pretrained: str | None) -> str:
    """``quick_gelu`` or ``gelu``: the pretrained tag's own activation, else the model config's.

    open_clip (from 2.29) builds the model config's activation whatever the tag was trained
    with and only warns: ``ViT-L-14`` + ``openai`` would run OpenAI's QuickGELU weights
    through GELU. The tag decides; a tag trained with GELU on a ``-quickgelu`` config is refused.
    """
    configured = config_activation(model_cfg)
    wanted = tag_activation(model_name, pretrained) or configured
    if wanted == "gelu" and configured == "quick_gelu":
        raise ConfigError(
            f"backbone {model_name} with pretrained {pretrained}: the weights were trained with GELU but the "
            f"model config builds QuickGELU; use the model name without '-quickgelu'")
    return wanted


def check_built_activation(model: nn.Module, activation: str, cfg: BackboneConfig) -> None:
    """The built towers run ``activation`` (open_clip's ``QuickGELU`` modules present or absent)."""
    quick = any(type(m).__name__ == "QuickGELU" for m in model.modules())
    if quick != (activation == "quick_gelu"):
        raise RuntimeError(f"open_clip {open_clip.__version__} built {cfg.name}:{cfg.pretrained} with "
                           f"{'QuickGELU' if quick else 'GELU'}, but {activation} was asked for")


class BackboneWeightsError(DemindError, RuntimeError):
    """A pretrained tag whose weights open_clip could not fetch (no network, unknown tag)."""


def weights_unavailable(error: Exception, cfg: BackboneConfig, model_name: str) -> BackboneWeightsError | None:
    """open_clip's download failure (or unknown tag) as one error naming the backbone and the fix;
    None for any other error, which keeps its traceback.

    open_clip >= 2.29 wraps a failed download in a RuntimeError ("Failed to download weights ...");
    earlier releases let the downloader's OSError through, which is read the same way when
    ``cfg.pretrained`` is one of the model's pretrained tags (not a local file)."""
    message = str(error)
    if isinstance(error, OSError) and open_clip.get_pretrained_cfg(model_name, cfg.pretrained or ""):
        message = f"Failed to download weights ({message})"
    if message.startswith("Pretrained weights ("):  # releases before 2.29 word an unknown tag so
        message = f"Pretrained value '{cfg.pretrained}' is not a known tag or valid file path"
    if not message.startswith(("Failed to download weights", "Pretrained value")):
        return None
    return BackboneWeightsError(
        f"backbone {cfg.name}:{cfg.pretrained}: {message.splitlines()[0]}. {offline_fix(model_name)}")


def offline_fix(model_name: str) -> str:
    """What to do when a backbone's weights cannot be downloaded (the end of every such error)."""
    return (f"Check the network, or put the weights in the Hugging Face cache and set HF_HUB_OFFLINE=1, or give "
            f"a local weights file as backbone.pretrained (tags of this model: "
            f"open_clip.list_pretrained_tags_by_model({model_name!r}))")


def weights_out_of_reach(cfg: BackboneConfig, model_name: str) -> BackboneWeightsError | None:
    """A pretrained tag whose weights (on the Hugging Face Hub) are not in the local cache while the
    Hub cannot be reached: one error, in seconds, before the model is built. None when the weights
    are a local file, are cached, come from elsewhere, or the Hub answers (open_clip downloads)."""
    if not cfg.pretrained or Path(cfg.pretrained).exists():
        return None
    source = (open_clip.get_pretrained_cfg(model_name, cfg.pretrained) or {}).get("hf_hub", "")
    if not source:
        return None  # an unknown tag (open_clip names it) or a plain URL
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    repo_id, filename = source.rstrip("/").rsplit("/", 1) if not source.endswith("/") else (source.rstrip("/"), "")
    names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
    if filename.endswith((".bin", ".pth")):
        names.insert(0, filename[:-4] + ".safetensors")  # open_clip prefers the safetensors twin
    if any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in names):
        return None
    reason = hub_unreachable()
    if reason is None:
        return None
    return BackboneWeightsError(f"backbone {cfg.name}:{cfg.pretrained}: Failed to download weights: {repo_id} is not "
                                f"in the Hugging Face cache and {reason}. {offline_fix(model_name)}")


class FrozenCLIP(nn.Module):
    """An open_clip CLIP whose weights are frozen and which always stays in eval mode.

    Attributes: ``embed_dim`` (D, joint space), ``width`` (W, text token width),
    ``context_length`` (L), ``preprocess`` (PIL image -> (3, H, W) tensor), ``identity``.
    """

    def __init__(self, cfg: BackboneConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        model_name = _resolve_model_name(cfg.name)  # a missing file is FileNotFoundError, as open() says it
        if pretrained_names_a_file(cfg.pretrained) and not Path(cfg.pretrained).exists():
            raise MissingInputError(
                f"backbone checkpoint {cfg.pretrained} does not exist; give an existing file or an open_clip "
                f"pretrained tag (see open_clip.list_pretrained_tags_by_model({model_name!r}))"
            )
        validate(cfg)  # a config built in code meets the rules a loaded one does
        self.cfg = cfg
        model_cfg = open_clip.get_model_config(model_name)
        check_text_tower(model_cfg, cfg.name)  # before any weights are built or downloaded
        if out_of_reach := weights_out_of_reach(cfg, model_name):  # no network: now, not after minutes of retries
            raise out_of_reach
        self.activation = backbone_activation(model_name, model_cfg, cfg.pretrained)
        with contextlib.ExitStack() as stack:
            if not cfg.pretrained:
                # A random draw from backbone.seed alone (the CPU generator is restored after),
                # so every command rebuilds the same backbone from the same config.
                stack.enter_context(torch.random.fork_rng(devices=[]))
                stack.enter_context(quiet_random_init_notice())
                torch.manual_seed(cfg.seed)
            try:
                model, _, preprocess = open_clip.create_model_and_transforms(
                    model_name, pretrained=cfg.pretrained, precision=cfg.precision, device=device,
                    force_quick_gelu=self.activation == "quick_gelu",
                )
            except (RuntimeError, OSError) as e:
                raise weights_unavailable(e, cfg, model_name) or e
        check_built_text_tower(model, cfg.name)
        check_built_activation(model, self.activation, cfg)
        model.set_grad_checkpointing(cfg.grad_checkpointing)
        self.model = model.requires_grad_(False).eval()
        self.preprocess: Callable = preprocess
        self.tokenizer = open_clip.get_tokenizer(model_name)
        # BPE with text cleaning costs ~0.15 ms per text; prompts repeat (the intention
        # prompt on every row, templates with few fills), so ids are memoised.
        # texts encoded / cut to the context (from the end, placeholders kept); read by the
        # trainer and the evaluation so that truncation is counted in their outputs
        self.text_counts: Counter = Counter()
        self._token_ids = functools.lru_cache(maxsize=1 << 16)(lambda text: tuple(self.tokenizer.encode(text)))
        self._templates: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The text layers' function and the length rounding: swapped by compile_text_layers
        # for a compiled / CUDA-graph path (fixed lengths bound the number of captured graphs).
        self.text_layers: Callable = text_layers
        self.length_multiple = 1
        self.identity = backbone_identity(cfg, self.model, self.activation)
        self.identity_str = identity_slug(self.identity)
        self.embed_dim: int = self._infer_embed_dim()
        self.width: int = model.token_embedding.weight.shape[1]
        self.context_length: int = model.positional_embedding.shape[0]
        self.image_size = preprocess.transforms[0].size if hasattr(preprocess, "transforms") else None
        self.placeholder_id = self._single_token_id(PLACEHOLDER)
        self.sot_id = self.tokenizer.sot_token_id
        self.eot_id = self.tokenizer.eot_token_id

    def compile_text_layers(self, options: dict | None, length_multiple: int = 1) -> None:
        """Run the text layers through ``torch.compile(**options)`` (None: eager again), with
        text lengths rounded up to ``length_multiple`` (exact under the causal mask)."""
        self.text_layers = text_layers if options is None else torch.compile(text_layers, **options)
        self.length_multiple = length_multiple

    def _infer_embed_dim(self) -> int:
        proj = self.model.text_projection
        return proj.out_features if isinstance(proj, nn.Linear) else proj.shape[1]

    def _single_token_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text)
        if len(ids) != 1:
            raise InputError(f"placeholder {text!r} is not a single token for this tokenizer: {ids}")
        return ids[0]

    def train(self, mode: bool = True) -> "FrozenCLIP":
        # The backbone is frozen: dropout and any batch statistics stay in eval mode.
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return self.model.token_embedding.weight.device

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast for ``amp`` / ``amp_bf16`` backbones, a no-op otherwise."""
        dtype = PRECISIONS[self.cfg.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @property
    def image_dtype(self) -> torch.dtype:
        """The dtype the image tower's weights are stored in (its inputs are cast to it)."""
        # The first conv/linear weight: open_clip's ``bf16`` keeps e.g. class embeddings in fp32.
        layers = (m for m in self.model.visual.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
        first = next(layers, None)
        return first.weight.dtype if first is not None else next(self.model.visual.parameters()).dtype

    # ----------------------------------------------------------------- images
    @torch.no_grad()
    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) preprocessed images -> (B, D) float32 embeddings, not normalised.

        Images are cast to the tower's dtype (a ``pure_bf16`` tower takes bf16 pixels);
        ``non_blocking`` lets a copy from pinned memory overlap the previous batch's work.
        """
        images = images.to(self.device, dtype=self.image_dtype, non_blocking=True)
        with self.autocast():
            return self.model.encode_image(images).float()

    # ------------------------------------------------------------------- text
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """Texts -> (B, L) token ids: SOT, words, EOT, zero padding.

        Text longer than the context loses free-text tokens from its end; placeholders
        and the end-of-text token are never cut.
        """
        return self._tokenize_with_eot(texts)[0]

    def _tokenize_with_eot(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) token ids and (B,) EOT positions, both on the CPU: the lengths are known
        here, so nothing later has to read them back from the device."""
        budget = self.context_length - 2
        rows = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        eot = torch.empty(len(texts), dtype=torch.long)
        n_truncated = 0
        for i, text in enumerate(texts):
            row = self._token_row(text)
            if len(row) > self.context_length:
                n_truncated += 1
                ids = truncate_keeping_placeholders(list(row[1:-1]), budget, self.placeholder_id)
                row = (self.sot_id, *ids, self.eot_id)
            rows[i, : len(row)] = torch.as_tensor(row)
            eot[i] = len(row) - 1
        self.text_counts["encoded"] += len(texts)
        self.text_counts["truncated"] += n_truncated
        if n_truncated:
            log.debug("truncated %d of %d texts to the %d-token context", n_truncated, len(texts), self.context_length)
        return rows, eot

    def _token_row(self, text: str) -> tuple[int, ...]:
        """SOT, the text's memoised ids, EOT (not yet truncated)."""
        return (self.sot_id, *self._token_ids(text), self.eot_id)

    @torch.no_grad()
    def encode_text(self, texts: list[str]) -> TextOutput:
        """Plain text encoding (no placeholder substitution), without gradients."""
        tokens, eot = self._tokenize_with_eot(texts)
        tokens = tokens.to(self.device, non_blocking=True)
        with self.autocast():
            return self._encode_embedded(self.model.token_embedding(tokens), tokens, eot)

    def encode_with_pseudo_tokens(self, texts: list[str], pseudo: torch.Tensor) -> TextOutput:
        """Encode texts whose ``*`` placeholders are replaced by given token embeddings.

        texts: B strings, each with exactly K placeholders ``*`` (a separate word: write
            ``a photo of * , red``, since CLIP's BPE reads ``*,`` as another token).
        pseudo: (B, K, W) embeddings; the k-th placeholder of text b gets ``pseudo[b, k]``.
        Returns a :class:`TextOutput`; gradients flow into ``pseudo``.
        """
        if pseudo.dim() == 2:
            pseudo = pseudo.unsqueeze(1)
        batch, k, width = pseudo.shape
        if batch != len(texts) or width != self.width:
            raise ValueError(f"pseudo tokens of shape {tuple(pseudo.shape)} do not fit {len(texts)} texts of width {self.width}")
        tokens, eot = self._tokenize_with_eot(texts)
        # Checked on the CPU copy: no wait for the device.
        self._check_placeholder_counts(texts, (tokens == self.placeholder_id).sum(dim=1), k)
        tokens = tokens.to(self.device, non_blocking=True)
        return self._encode_with_pseudo(tokens, eot, pseudo)

    def encode_template_with_pseudo_tokens(self, template: str, pseudo: torch.Tensor) -> TextOutput:
        """:meth:`encode_with_pseudo_tokens` of one text repeated B times (the intention
        prompt ``* * * *``): tokenised and checked once per (text, device), then expanded."""
        if pseudo.dim() == 2:
            pseudo = pseudo.unsqueeze(1)
        key = (template, self.device, pseudo.shape[1])
        if key not in self._templates:
            tokens, eot = self._tokenize_with_eot([template])
            self._check_placeholder_counts([template], (tokens == self.placeholder_id).sum(dim=1), pseudo.shape[1])
            self._templates[key] = (tokens.to(self.device), eot)
        tokens, eot = self._templates[key]
        batch = pseudo.shape[0]
        return self._encode_with_pseudo(tokens.expand(batch, -1), eot.expand(batch), pseudo)

    def _encode_with_pseudo(self, tokens: torch.Tensor, eot: torch.Tensor, pseudo: torch.Tensor) -> TextOutput:
        """tokens (B, L) on the device, eot (B,) on the CPU, pseudo (B, K, W) -> TextOutput."""
        batch, _, width = pseudo.shape
        if batch != tokens.shape[0] or width != self.width:
            raise ValueError(f"pseudo tokens of shape {tuple(pseudo.shape)} do not fit {tokens.shape[0]} texts of width {self.width}")
        is_placeholder = tokens == self.placeholder_id
        embedded = self.model.token_embedding(tokens).to(pseudo.dtype)
        # Boolean-mask assignment walks rows then positions, matching pseudo's (b, k) order.
        embedded = embedded.masked_scatter(is_placeholder.unsqueeze(-1), pseudo.reshape(-1, width))
        with self.autocast():
            return self._encode_embedded(embedded, tokens, eot)

    def _check_placeholder_counts(self, texts: list[str], counts: torch.Tensor, expected: int) -> None:
        bad = (counts != expected).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise ValueError(
                f"text {texts[i]!r} has {int(counts[i])} placeholder tokens {PLACEHOLDER!r}, expected {expected} "
                f"({len(bad)} of {len(texts)} texts differ); write the placeholder as a separate word, "
                f"e.g. 'a photo of * , {{text}}'"
            )

    def _encode_embedded(self, embedded: torch.Tensor, tokens: torch.Tensor, eot_cpu: torch.Tensor) -> TextOutput:
        """Run the text transformer on (B, L, W) token embeddings; pool at EOT.

        Padding is cut and texts run in length buckets (:func:`run_text_transformer`), so
        the template ``* * * *`` costs 6 positions instead of 77 and a batch that mixes
        short and long captions no longer pads every one to the longest. Outputs keep the
        first L' = max EOT + 1 positions (rounded up to ``length_multiple``). The EOT
        positions come from the CPU (``eot_cpu``, (B,)), so cutting needs no device sync.
        """
        x = run_text_transformer(self.model, embedded, eot_cpu, self.cfg.text_buckets,
                                 layers=self.text_layers, length_multiple=self.length_multiple)
        eot = eot_cpu.to(x.device, non_blocking=True)
        tokens = tokens[:, : x.shape[1]]
        pooled = x[torch.arange(x.shape[0], device=x.device), eot]
        proj = self.model.text_projection
        if proj is not None:
            pooled = proj(pooled) if isinstance(proj, nn.Linear) else pooled @ proj
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        mask = (positions[None, :] > 0) & (positions[None, :] < eot[:, None])
        return TextOutput(pooled.float(), x.float(), mask, eot)


def build_backbone(cfg: BackboneConfig, device: str | torch.device = "cpu") -> FrozenCLIP:
    """Load the frozen backbone described by ``cfg``."""
    return FrozenCLIP(cfg, device=device)


def parse_backbone_spec(spec: str, precision: str = "fp32") -> BackboneConfig:
    """``NAME:TAG_OR_PATH`` -> BackboneConfig. ``NAME:none`` is a random-init backbone (smoke tests).

    NAME is an open_clip model name or a model-config JSON path; the tag is an open_clip
    pretrained tag or a local checkpoint file.
    """
    name, sep, tag = spec.partition(":")
    if not sep or not name or not tag:
        raise ConfigError(f"--backbone must be NAME:TAG_OR_PATH (e.g. ViT-L-14:openai, "
                          f"configs/model/tiny-clip.json:none), got {spec!r}")
    pretrained = None if tag.lower() in RANDOM_TAGS else tag
    if pretrained is None:
        log.warning("backbone %s has random weights: results are meaningful only as a smoke test", name)
    return BackboneConfig(name=name, pretrained=pretrained, precision=precision)
