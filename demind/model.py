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

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.config import ConfigError, validate
from demind.errors import InputError
# the config section and the templates live in torch-free modules (read by --help and config checks)
from demind.schema import ModelConfig, heads_problem
from demind.settings import QUERY_MODES
from demind.templates import PLACEHOLDER, TEMPLATES, fill_template, template_field


class ComposeOutput(NamedTuple):
    """t_hat: (B, D) the composed query; t_cls: (B, D) the global (S*) embedding;
    t_star: (B, D) the intention embedding. All L2-normalised."""

    t_hat: torch.Tensor
    t_cls: torch.Tensor
    t_star: torch.Tensor


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
    # (demind.trainkit.hold_scalars_as_vectors), and checkpoints stay interchangeable.
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
        six blocks at batch 1 dominates on a GPU. On a CPU, ``compile`` with inductor also
        freezes the weights (inference graphs take them as constants, prepacked for the
        matrix kernels: ViT-B-32 batch-1 queries 1.8x faster, BENCHMARKS.md), so set the mode
        after the weights are loaded; the first query compiles (about a minute on 2 CPU cores),
        and the first of another batch size once more.
        """
        if mode not in QUERY_MODES:
            raise InputError(f"query mode must be one of {QUERY_MODES}, got {mode!r}")
        if mode == "eager":
            self.backbone.compile_text_layers(None)
            for module in (self.mapping, self.intention):
                module._compiled_call_impl = None  # undo nn.Module.compile
            return
        on_cpu = self.backbone.device.type == "cpu"
        if backend == "inductor" and on_cpu:
            check_cpp_compiler(mode)  # inductor writes C++ for the CPU: refuse now, not at the first query
        options: dict = {"backend": backend}
        if mode == "cudagraphs":
            options.update(mode="reduce-overhead", dynamic=False)
        else:
            options.update(dynamic=True)
        self.backbone.compile_text_layers(options, length_multiple=8 if mode == "cudagraphs" else 1)
        self.mapping.compile(**options)
        self.intention.compile(**options)
        if mode == "compile" and backend == "inductor" and on_cpu:
            self.backbone.text_layers = with_frozen_weights(self.backbone.text_layers)
            for module in (self.mapping, self.intention):
                module._compiled_call_impl = with_frozen_weights(module._compiled_call_impl)

    @torch.no_grad()
    def warm_up(self) -> None:
        """One batch-1 query of each kind (De-MINDS, mapping-only), so that a compiled query mode
        compiles now (about a minute on a CPU) and not at a user's first query."""
        reference = torch.zeros(1, self.backbone.embed_dim, device=self.backbone.device)
        self.query(reference, ["warm up"])
        self.query(reference, ["warm up"], mapping_only=True)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def with_frozen_weights(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile`` result) called with inductor's weight freezing on.

    Dynamo reads the setting when it traces a call (the first of each shape), so it is set
    around every call rather than for the process: other code's compiles stay as they were.
    Only graphs traced without gradients (queries under ``no_grad``) are frozen.
    """
    from torch._inductor import config as inductor_config

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        with inductor_config.patch(freezing=True):
            return compiled(*args, **kwargs)

    return call


def check_cpp_compiler(mode: str) -> None:
    """Raise :class:`InputError` when no C++ compiler is found (torch inductor's CPU code needs one)."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - inductor raises several kinds; one line names the fix
        raise InputError(f"query_mode={mode} on a CPU compiles C++ code and no C++ compiler was found ({e}): "
                         "install one (e.g. apt install g++) or use query_mode=eager") from None


def build_model(cfg: ModelConfig, backbone: FrozenCLIP) -> DeMinds:
    """A fresh De-MINDS model on ``backbone``'s device."""
    return DeMinds(cfg, backbone).to(backbone.device)
