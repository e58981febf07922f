"""The De-MINDS model (seed paper, section 3.3 and appendix B), over a frozen CLIP.

Reading top to bottom:

1. ``MappingNetwork`` turns the reference image embedding v into one pseudo-word token S*.
2. The target description P = ``a photo of S* , {T}`` goes through the frozen text tower
   once, giving its pooled embedding t_cls and its per-token word features.
3. ``IntentionModule``: n learnable queries attend to [queries; word features] in 6 blocks.
4. The refined queries go through the frozen text tower as n consecutive pseudo-word
   tokens (``* * * *``), giving the intention embedding t*.
5. The gate: t_hat = t_cls + tanh(alpha) * t*, with alpha = 0 at initialisation.

Only the mapping network, the queries/blocks, alpha and (optionally) the temperature are
trainable; the backbone is held but not registered, so state_dict() holds our weights only.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from demind.backbone import PLACEHOLDER, FrozenCLIP
from demind.config import ConfigError, setting, validate
from demind.errors import DemindError, InputError

TEMPLATES = {
    "cirr": "a photo of * , {text}",
    "domain": "a {domain} of *",
    "objects": "a photo of * , {objects}",
}
FUSIONS = ("gate", "add", "intent_only")
# How the refined queries X^n enter the frozen text tower: as the blocks leave them (the paper does
# not say), or each rescaled to the mean norm of the token-embedding table (the scale the tower's
# first layer was trained on), keeping its direction.
QUERY_SCALES = ("none", "token_norm")
QUERY_MODES = ("eager", "compile", "cudagraphs")


@dataclass
class ModelConfig:
    """De-MINDS hyper-parameters (paper defaults). ``fusion`` selects the Table 5 ablations:
    ``gate`` (the method), ``add`` (w/o gate: t_cls + t*), ``intent_only`` (w/o global feature: t*)."""

    num_queries: int = setting(4, ge=1)
    num_blocks: int = setting(6, ge=1)
    num_heads: int = setting(8, ge=1)  # must divide the backbone's text width (checked with the backbone)
    ff_mult: int = setting(4, ge=1)
    mapping_hidden: int = setting(512, ge=1)
    mapping_dropout: float = setting(0.1, ge=0, lt=1)
    gate_init: float = 0.0
    fusion: str = setting("gate", choices=FUSIONS)
    template: str = setting(TEMPLATES["cirr"], help="training prompt: one '*' and '{text}'")
    learnable_temperature: bool = False
    init_logit_scale: float = math.log(100.0)  # CLIP's trained value; used unless learnable
    # ConeSep's NBL (training.noise.mode=conesep): learnable negative prompt tokens; 0 = none.
    # Used in training only; queries never read them.
    negative_tokens: int = setting(0, ge=0)
    query_scale: str = setting("none", choices=QUERY_SCALES)

    def config_problems(self) -> list[tuple[str, str]]:
        try:
            ok = template_field(self.template) == "text"
        except TemplateError:
            ok = False
        if not ok:
            return [("template", f"= {self.template!r} must hold one {PLACEHOLDER!r} and '{{text}}' (no other "
                                 f"fields, format specs or conversions)")]
        return []


class ComposeOutput(NamedTuple):
    """t_hat: (B, D) the composed query; t_cls: (B, D) the global (S*) embedding;
    t_star: (B, D) the intention embedding. All L2-normalised."""

    t_hat: torch.Tensor
    t_cls: torch.Tensor
    t_star: torch.Tensor


TEMPLATE_FIELDS = ("text", "domain", "objects")  # the fields the templates above fill
MAX_TEMPLATE_CHARS = 1000  # a prompt is cut to CLIP's 77 tokens anyway


class TemplateError(DemindError, ValueError):
    """A query template that is not ``literal text + one '*' + one plain {field}``; the message says why."""


def _template_parts(template: str) -> list[tuple[str, str | None]]:
    """``"a {domain} of *"`` -> ``[("a ", "domain"), (" of *", None)]``: literal text and plain field names.

    Only bare names from :data:`TEMPLATE_FIELDS` are fields: a format spec (``{text:>100000000}``
    would pad to 100 MB), a conversion (``{text!r}``), attribute or index access
    (``{text.__class__}``, ``{text[0]}``) and positional fields (``{}``, ``{0}``) are refused, so
    filling a template costs no more than joining its parts."""
    if not isinstance(template, str):
        raise TemplateError(f"the template must be a text such as {TEMPLATES['cirr']!r}, got {type(template).__name__}")
    shown = template if len(template) <= 80 else template[:77] + "..."
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"the template is {len(template):,} characters; at most {MAX_TEMPLATE_CHARS:,} are "
                            f"allowed, e.g. {TEMPLATES['cirr']!r}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:  # an unmatched '{' or '}'
        raise TemplateError(f"template {shown!r} has an unmatched '{{' or '}}'; write a literal brace as "
                            f"'{{{{' or '}}}}', e.g. {TEMPLATES['cirr']!r}") from None
    parts: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is None:
            parts.append((literal, None))
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if conversion or spec:
            problem = "a conversion" if conversion else "a format spec"
            raise TemplateError(f"template {shown!r}: field {field[:40]} has {problem}; fields are plain names "
                                f"such as '{{text}}'")
        if name not in TEMPLATE_FIELDS:
            raise TemplateError(f"template {shown!r}: field {field[:40]} is not one of "
                                f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (no positional fields, "
                                f"attribute or index access)")
        parts.append((literal, name))
    return parts


def template_field(template: str) -> str:
    """The one ``{field}`` a query template takes: ``"a {domain} of *"`` -> ``"domain"``.

    TemplateError when the template holds not exactly one ``*`` and one plain field (see
    :func:`_template_parts`)."""
    fields = {name for _, name in _template_parts(template) if name}
    if len(fields) != 1 or template.count(PLACEHOLDER) != 1:
        shown = template if len(template) <= 80 else template[:77] + "..."
        raise TemplateError(f"a query template needs one {PLACEHOLDER!r} (the reference image's pseudo-word) and "
                            f"one field such as '{{text}}', got {shown!r}")
    return fields.pop()


def fill_template(template: str, **fields: str) -> str:
    """``fill_template("a photo of * , {text}", text="red")`` -> ``"a photo of * , red"``.

    The parts are joined, never ``str.format``-ed, so a template cannot pad, convert or reach
    into attributes (TemplateError instead). A ``*`` inside a field value would be read as a
    placeholder; it becomes a space.
    """
    clean = {k: " ".join(str(v).replace(PLACEHOLDER, " ").split()) for k, v in fields.items()}
    out = []
    for literal, name in _template_parts(template):
        out.append(literal)
        if name is not None:
            if name not in clean:
                raise TemplateError(f"template field {{{name}}} has no value; give {name}=...")
            out.append(clean[name])
    return "".join(out)


class MappingNetwork(nn.Module):
    """f_theta: (B, D) image embedding -> (B, W) pseudo-word token S*.

    Three fully connected layers with ReLU and dropout (Pic2Word's design). The input is
    L2-normalised first so the mapping does not depend on the backbone's embedding scale.
    """

    def __init__(self, embed_dim: int, width: int, hidden: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, width),
        )

    def forward(self, image_emb: torch.Tensor) -> torch.Tensor:
        # Normalised in float32, then cast to the weights' dtype: DeepSpeed's bf16 casts the weights
        # and Accelerate turns autocast off under it, while cached embeddings stay float32.
        return self.layers(F.normalize(image_emb.float(), dim=-1).to(self.layers[0].weight.dtype))


class IntentionBlock(nn.Module):
    """One block of Eq. 1 / Algorithm 1 (pre-LayerNorm residual form):

    Q <- Q + MHA(LN(Q), LN([Q; P]), LN([Q; P]));  Q <- Q + FFN(LN(Q)).
    """

    def __init__(self, width: int, num_heads: int, ff_mult: int) -> None:
        super().__init__()
        self.norm_q = nn.LayerNorm(width)
        self.norm_kv = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads, batch_first=True)
        self.norm_ff = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, ff_mult * width), nn.GELU(), nn.Linear(ff_mult * width, width))

    def forward(self, queries: torch.Tensor, words: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """queries (B, n, W), words (B, L, W), pad (B, n + L) True where ignored -> (B, n, W)."""
        context = self.norm_kv(torch.cat([queries, words], dim=1))
        attended, _ = self.attn(self.norm_q(queries), context, context, key_padding_mask=pad, need_weights=False)
        queries = queries + attended
        return queries + self.ff(self.norm_ff(queries))


class IntentionModule(nn.Module):
    """n learnable queries refined by word features of the target description.

    forward: words (B, L, W), mask (B, L) bool True on real word tokens -> (B, n, W).
    """

    def __init__(self, width: int, num_queries: int = 4, num_blocks: int = 6, num_heads: int = 8, ff_mult: int = 4) -> None:
        super().__init__()
        # CLIP initialises token embeddings with std 0.02; the queries start at that scale.
        self.queries = nn.Parameter(torch.randn(num_queries, width) * 0.02)
        self.blocks = nn.ModuleList(IntentionBlock(width, num_heads, ff_mult) for _ in range(num_blocks))

    def forward(self, words: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        words = words.to(self.queries.dtype)  # the text tower's dtype -> ours (bf16 under DeepSpeed's bf16)
        batch = words.shape[0]
        queries = self.queries.unsqueeze(0).expand(batch, -1, -1)
        query_pad = torch.zeros(batch, queries.shape[1], dtype=torch.bool, device=words.device)
        pad = torch.cat([query_pad, ~mask], dim=1)
        for block in self.blocks:
            queries = block(queries, words, pad)
        return queries


def heads_problem(num_heads: int, width: int) -> str | None:
    """Why ``num_heads`` cannot split the text width W into equal heads (None when it can): the one
    wording of the rule, read by TrainConfig at load and by DeMinds for a config built in code."""
    if num_heads >= 1 and width % num_heads == 0:
        return None
    divisors = [d for d in (1, 2, 4, 8, 16, 32) if width % d == 0]
    return f"= {num_heads} must divide the backbone's text width {width}; choose one of {divisors}"


def check_heads_divide_width(num_heads: int, width: int) -> None:
    """Multi-head attention splits the text width W into ``num_heads`` equal heads."""
    problem = heads_problem(num_heads, width)
    if problem:
        raise ConfigError(f"config key 'model.num_heads' {problem}", key="model.num_heads")


class DeMinds(nn.Module):
    """Trainable De-MINDS modules around a frozen CLIP (held, not registered)."""

    def __init__(self, cfg: ModelConfig, backbone: FrozenCLIP) -> None:
        super().__init__()
        self.cfg = cfg
        self.__dict__["backbone"] = backbone  # not a submodule: checkpoints hold our weights only
        validate(cfg)  # a config built in code meets the rules a loaded one does
        check_heads_divide_width(cfg.num_heads, backbone.width)
        self.mapping = MappingNetwork(backbone.embed_dim, backbone.width, cfg.mapping_hidden, cfg.mapping_dropout)
        self.intention = IntentionModule(backbone.width, cfg.num_queries, cfg.num_blocks, cfg.num_heads, cfg.ff_mult)
        self.gate = nn.Parameter(torch.tensor(float(cfg.gate_init)))
        scale = torch.tensor(float(cfg.init_logit_scale))
        if cfg.learnable_temperature:
            self.logit_scale = nn.Parameter(scale)
        else:
            self.register_buffer("logit_scale", scale)
        self.intent_prompt = " ".join([PLACEHOLDER] * cfg.num_queries)
        # a plain float, not a buffer: derived from the frozen backbone, so checkpoints stay as they were
        self.token_norm = float(backbone.model.token_embedding.weight.detach().float().norm(dim=-1).mean())
        if cfg.negative_tokens:
            # P_neg, at CLIP's token-embedding scale like the intention queries
            self.negative_prompt = nn.Parameter(torch.randn(cfg.negative_tokens, backbone.width) * 0.02)
            # the target-description prompt with P_neg in place of the description: "a photo of * , * *"
            self.negative_template = cfg.template.replace("{text}", " ".join([PLACEHOLDER] * cfg.negative_tokens))

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - torch's signature
        # .to(device) also moves the held backbone, so one call places everything. A dtype cast
        # (.half(), .bfloat16(), DeepSpeed's bf16 engine) stops at our weights: the frozen tower's
        # precision is backbone.precision's to choose, and caches and checkpoints record it.
        probe = torch.zeros((), device=self.backbone.device)
        moved = fn(probe)
        if moved.dtype == probe.dtype:
            self.backbone._apply(fn, recurse)
        elif moved.device != probe.device:  # .to(device, dtype): the device part only
            self.backbone._apply(lambda t: t.to(moved.device), recurse)
        return super()._apply(fn, recurse)

    # Scalars are saved and loaded 0-dim however they are held: under DeepSpeed they are (1,)
    # (demind.training.zero.hold_scalars_as_vectors), and checkpoints stay interchangeable.
    SCALARS = ("gate", "logit_scale")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - torch's signature
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self.SCALARS:
            if prefix + name in destination:
                destination[prefix + name] = destination[prefix + name].reshape(())

    def _load_from_state_dict(self, state_dict, prefix, *args):  # noqa: ANN001 - torch's signature
        for name in self.SCALARS:
            if prefix + name in state_dict and getattr(self, name, None) is not None:
                state_dict[prefix + name] = state_dict[prefix + name].reshape(getattr(self, name).shape)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def temperature_scale(self) -> torch.Tensor:
        """exp(logit_scale), capped at 100 as in CLIP."""
        return self.logit_scale.exp().clamp(max=100.0)

    def pseudo_token(self, image_emb: torch.Tensor) -> torch.Tensor:
        """(B, D) image embedding -> (B, W) S*."""
        return self.mapping(image_emb.to(self.backbone.device))

    def mapping_only(self, image_emb: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Pic2Word-style query: S* in the prompt, no intention module. Returns (B, D), L2-normalised."""
        out = self.backbone.encode_with_pseudo_tokens(prompts, self.pseudo_token(image_emb))
        return F.normalize(out.pooled, dim=-1)

    def scale_queries(self, refined: torch.Tensor) -> torch.Tensor:
        """``model.query_scale``: refined queries (B, n, W) as the blocks leave them (``none``) or each
        rescaled to L2 norm ``token_norm`` (``token_norm``), the mean norm of a token embedding."""
        if self.cfg.query_scale == "none":
            return refined
        return refined * (self.token_norm / refined.norm(dim=-1, keepdim=True).clamp_min(1e-12))

    def intention_embedding(self, words: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Word features (B, L, W) with mask (B, L) -> t* (B, D), L2-normalised."""
        refined = self.scale_queries(self.intention(words, mask))
        out = self.backbone.encode_template_with_pseudo_tokens(self.intent_prompt, refined)
        return F.normalize(out.pooled, dim=-1)

    def compose(self, image_emb: torch.Tensor, prompts: list[str]) -> ComposeOutput:
        """Reference image embeddings (B, D) and prompts holding one ``*`` each -> queries.

        The prompt's single forward pass yields both t_cls (pooled) and the word features
        that the intention queries read.
        """
        target = self.backbone.encode_with_pseudo_tokens(prompts, self.pseudo_token(image_emb))
        t_cls = F.normalize(target.pooled, dim=-1)
        t_star = self.intention_embedding(target.tokens, target.mask)
        return ComposeOutput(self.fuse(t_cls, t_star), t_cls, t_star)

    def negative_composition(self, image_emb: torch.Tensor) -> torch.Tensor:
        """NBL's diagonal negative composition F_neg: the query's own S* composed with the learnable
        negative prompt P_neg instead of a description. (B, D) image embeddings -> (B, D) L2-normalised."""
        if not self.cfg.negative_tokens:
            raise ValueError("negative_composition needs model.negative_tokens >= 1 (ConeSep's negative prompt)")
        s_star = self.pseudo_token(image_emb).unsqueeze(1)  # (B, 1, W)
        tokens = torch.cat([s_star, self.negative_prompt.unsqueeze(0).expand(s_star.shape[0], -1, -1)
                            .to(s_star.dtype)], dim=1)
        out = self.backbone.encode_template_with_pseudo_tokens(self.negative_template, tokens)
        return F.normalize(out.pooled, dim=-1)

    def fuse(self, t_cls: torch.Tensor, t_star: torch.Tensor) -> torch.Tensor:
        """Gate (or an ablation of it) on normalised embeddings -> (B, D) normalised t_hat."""
        if self.cfg.fusion == "gate":
            fused = t_cls + torch.tanh(self.gate) * t_star
        elif self.cfg.fusion == "add":
            fused = t_cls + t_star
        else:
            fused = t_star
        return F.normalize(fused, dim=-1)

    def forward(self, image_emb: torch.Tensor, target_texts: list[str]) -> ComposeOutput:
        """Training step input: image embeddings (B, D) and target descriptions T (B strings),
        filled into ``cfg.template``."""
        prompts = [fill_template(self.cfg.template, text=t) for t in target_texts]
        return self.compose(image_emb, prompts)

    def query(self, image_emb: torch.Tensor, texts: list[str], template: str = TEMPLATES["cirr"],
              mapping_only: bool = False) -> torch.Tensor:
        """The inference API: reference image embeddings (B, D) and B texts (modification
        text, domain name, or object list) filled into ``template`` -> (B, D) L2-normalised
        queries. ``mapping_only`` gives the Pic2Word-style query from the same weights."""
        field = template_field(template)
        prompts = [fill_template(template, **{field: t}) for t in texts]
        if mapping_only:
            return self.mapping_only(image_emb, prompts)
        return self.compose(image_emb, prompts).t_hat

    def set_query_mode(self, mode: str = "eager", backend: str = "inductor") -> None:
        """How queries run: ``eager`` (default), ``compile`` (``torch.compile`` of the text
        layers, the mapping and the intention module, dynamic shapes), or ``cudagraphs``
        (compiled with ``mode="reduce-overhead"``: CUDA graphs replay the launches; text
        lengths are rounded up to multiples of 8, exact under the causal mask, so a handful
        of graphs cover every prompt). Weights and state_dict keys are unchanged; meant for
        inference (evaluation, serving), where the launch overhead of two text passes and
        six blocks at batch 1 dominates on a GPU.
        """
        if mode not in QUERY_MODES:
            raise InputError(f"query mode must be one of {QUERY_MODES}, got {mode!r}")
        if mode == "eager":
            self.backbone.compile_text_layers(None)
            for module in (self.mapping, self.intention):
                module._compiled_call_impl = None  # undo nn.Module.compile
            return
        options: dict = {"backend": backend}
        if mode == "cudagraphs":
            options.update(mode="reduce-overhead", dynamic=False)
        else:
            options.update(dynamic=True)
        self.backbone.compile_text_layers(options, length_multiple=8 if mode == "cudagraphs" else 1)
        self.mapping.compile(**options)
        self.intention.compile(**options)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def build_model(cfg: ModelConfig, backbone: FrozenCLIP) -> DeMinds:
    """A fresh De-MINDS model on ``backbone``'s device."""
    return DeMinds(cfg, backbone).to(backbone.device)
