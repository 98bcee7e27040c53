"""Glass-box Vision Transformer written from basic layers.

The forward pass is spelled out op by op so that every intermediate activation has a
stable stage name (see ``stage_names``) and so that, with the same weights, it is the
same function as timm's ``VisionTransformer``: the operations are the ones timm runs, in
the same order, which is what makes a 0.0 difference possible rather than merely small.

Stages per block (8 for a plain ViT): ``norm1``, ``attn.qkv``, ``attn.probs`` (the
attention map), ``attn`` (after the output projection), ``resid1``, ``norm2``, ``mlp``,
``resid2``. Model-level stages: ``patch_embed``, ``pos_add``, ``norm``, ``fc_norm`` (mean
pooling only), ``pool`` (only where pooling computes something: a mean over tokens or
attention pooling; CLS pooling is an index into ``norm``), ``head``. ViT-B/16 therefore
has 4 + 12 x 8 = 100 stages.

Options of timm's ViT families add stages in the same vocabulary, only when switched on:
``patch_embed.norm`` (norm inside the patch embedding), ``norm_pre`` (CLIP),
``attn.q_norm`` / ``attn.k_norm`` (qk-norm), ``attn.norm`` and ``mlp.norm`` (inner norms),
``ls1`` / ``ls2`` (LayerScale), and for attention pooling (SigLIP) ``attn_pool.kv``,
``attn_pool.probs``, ``attn_pool.attn``, ``attn_pool.norm``, ``attn_pool.mlp`` before
``pool``. Without a classifier (num_classes=0) ``head`` is the identity: the features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.models.vit_config import ViTConfig
from workbench.models.vit_layers import AttentionPool, Attention, LayerScale, Recorder, make_mlp, make_norm

__all__ = ["ViTConfig", "VisionTransformer", "Block", "Analysis", "count_parameters", "BLOCK_STAGES"]

BLOCK_STAGES = ("norm1", "attn.qkv", "attn.probs", "attn", "resid1", "norm2", "mlp", "resid2")
POOL_STAGES = ("attn_pool.kv", "attn_pool.probs", "attn_pool.attn", "attn_pool.norm", "attn_pool.mlp")


def block_stages(cfg: ViTConfig) -> list[str]:
    """The stages of one block, in execution order, for the options ``cfg`` switches on."""
    names = ["norm1", "attn.qkv"]
    names += ["attn.q_norm", "attn.k_norm"] if cfg.qk_norm else []
    names += ["attn.probs"] + (["attn.norm"] if cfg.scale_attn_norm else []) + ["attn"]
    names += ["ls1"] if cfg.layer_scale_init is not None else []
    names += ["resid1", "norm2"] + (["mlp.norm"] if cfg.scale_mlp_norm else []) + ["mlp"]
    names += ["ls2"] if cfg.layer_scale_init is not None else []
    return names + ["resid2"]


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x)))."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        scaled = cfg.layer_scale_init is not None
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ls1 = LayerScale(cfg.dim, cfg.layer_scale_init) if scaled else nn.Identity()
        self.norm2 = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.ls2 = LayerScale(cfg.dim, cfg.layer_scale_init) if scaled else nn.Identity()

    def forward(self, x: torch.Tensor, record: Recorder | None = None, prefix: str = "") -> torch.Tensor:
        if record is None:
            x = x + self.ls1(self.attn(self.norm1(x)))
            return x + self.ls2(self.mlp(self.norm2(x)))
        return self._forward_recorded(x, record, prefix)

    def _forward_recorded(self, x: torch.Tensor, record: Recorder, prefix: str) -> torch.Tensor:
        # Same arithmetic as forward(), with every intermediate handed to the recorder.
        h = self.norm1(x)
        record(f"{prefix}norm1", h)
        h = self.attn(h, record, prefix)
        record(f"{prefix}attn", h)
        if isinstance(self.ls1, LayerScale):
            h = self.ls1(h)
            record(f"{prefix}ls1", h)
        x = x + h
        record(f"{prefix}resid1", x)
        h = self.norm2(x)
        record(f"{prefix}norm2", h)
        h = self.mlp(h, record, prefix)
        record(f"{prefix}mlp", h)
        if isinstance(self.ls2, LayerScale):
            h = self.ls2(h)
            record(f"{prefix}ls2", h)
        x = x + h
        record(f"{prefix}resid2", x)
        return x


@dataclass
class Analysis:
    """What the analysis mode returns.

    Attributes:
        logits: (B, num_classes), or the pre-logits features (B, dim) without a classifier.
        hidden_states: stage name -> activation, in execution order.
        attentions: one (B, heads, N, N) attention map per block.
        pool_attention: the attention-pool map (B, heads, 1, N_pooled) for
            pooling="map", else None. N_pooled excludes prefix tokens unless
            pool_include_prefix.
    """

    logits: torch.Tensor
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)
    attentions: list[torch.Tensor] = field(default_factory=list)
    pool_attention: torch.Tensor | None = None


class VisionTransformer(nn.Module):
    """ViT with timm's method names: forward_features, forward_head, forward."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # A strided convolution is the patch projection: one linear map per non-overlapping
        # patch. It is also timm's op, which keeps the comparison exact.
        self.patch_proj = nn.Conv2d(cfg.in_channels, cfg.dim, cfg.patch_hw, stride=cfg.patch_hw, bias=cfg.patch_bias)
        self.patch_norm = make_norm(cfg) if cfg.embed_norm else None
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.class_token else None
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, cfg.register_tokens, cfg.dim)) if cfg.register_tokens else None
        )
        pos_len = cfg.num_patches + (0 if cfg.no_embed_class else cfg.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_len, cfg.dim)) if cfg.pos_embed == "learned" else None
        self.pos_drop = nn.Dropout(cfg.pos_dropout)
        self.norm_pre = make_norm(cfg) if cfg.norm_pre else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = make_norm(cfg) if cfg.has_norm else nn.Identity()
        self.attn_pool = AttentionPool(cfg) if cfg.pooling == "map" else None
        self.fc_norm = make_norm(cfg) if cfg.has_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.head_dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes) if cfg.num_classes else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm-like init: truncated normal 0.02 for linears and positions, zeros for biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, LayerScale):
                nn.init.constant_(module.gamma, module.init)
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.register_tokens):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.cfg.dim**-0.5)

    def set_fast_attention(self, enabled: bool = True) -> "VisionTransformer":
        """Route attention through scaled_dot_product_attention (analysis mode never does)."""
        for module in self.modules():
            if isinstance(module, (Attention, AttentionPool)):
                module.fast = enabled
        return self

    # ---- forward pieces -------------------------------------------------------------
    def _embed(self, x: torch.Tensor, record: Recorder | None) -> torch.Tensor:
        x = self.patch_proj(x).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, D)
        if record:
            record("patch_embed", x)
        if self.patch_norm is not None:
            x = self.patch_norm(x)
            if record:
                record("patch_embed.norm", x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.register_tokens) if t is not None]
        if self.pos_embed is None:
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        elif self.cfg.no_embed_class:
            # positions cover patches only; prefix tokens are concatenated afterwards
            x = x + self.pos_embed
            x = torch.cat(prefix + [x], dim=1) if prefix else x
        else:
            x = torch.cat(prefix + [x], dim=1) if prefix else x  # (B, P + h*w, D)
            x = x + self.pos_embed
        x = self.pos_drop(x)
        if record:
            record("pos_add", x)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
            if record:
                record("norm_pre", x)
        return x

    def forward_features(self, x: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, N, D)."""
        x = self._embed(x, record)
        for i, block in enumerate(self.blocks):
            x = block(x, record, f"blocks.{i}.")
        x = self.norm(x)
        if record and self.cfg.has_norm:
            record("norm", x)
        return x

    def pool(self, x: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """Tokens (B, N, D) -> one vector per image (B, D)."""
        if self.cfg.pooling == "cls":
            return x[:, 0]
        if not self.cfg.pool_include_prefix:
            x = x[:, self.cfg.num_prefix_tokens :]  # patch tokens only
        x = self.attn_pool(x, record) if self.attn_pool is not None else x.mean(dim=1)
        if record:
            record("pool", x)
        return x

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False, record: Recorder | None = None
    ) -> torch.Tensor:
        x = self.pool(x, record)
        if self.cfg.has_fc_norm:
            x = self.fc_norm(x)
            if record:
                record("fc_norm", x)
        x = self.head_drop(x)
        if pre_logits:
            return x
        x = self.head(x)
        if record:
            record("head", x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_stages(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward on the current attention path, returning logits and every stage.

        On the fast path there are no ``attn.probs`` stages: the fused kernel never
        materialises the attention map.
        """
        states: dict[str, torch.Tensor] = {}

        def record(name: str, value: torch.Tensor) -> None:
            states[name] = value

        logits = self.forward_head(self.forward_features(x, record), record=record)
        return logits, states

    def forward_analysis(self, x: torch.Tensor) -> Analysis:
        """Run the written-out attention path and return every stage and attention map.

        Analysis always uses the hand-written attention, whatever the fast-path setting,
        so attention maps exist and do not depend on how the model is usually run.
        """
        modules = [m for m in self.modules() if isinstance(m, (Attention, AttentionPool))]
        fast = [m.fast for m in modules]
        self.set_fast_attention(False)
        try:
            logits, states = self.forward_stages(x)
        finally:
            for module, was_fast in zip(modules, fast):
                module.fast = was_fast
        attentions = [states[f"blocks.{i}.attn.probs"] for i in range(self.cfg.depth)]
        return Analysis(logits=logits, hidden_states=states, attentions=attentions,
                        pool_attention=states.get("attn_pool.probs"))

    def stage_names(self) -> list[str]:
        """Stage names in execution order, as forward_analysis records them."""
        cfg = self.cfg
        names = ["patch_embed"] + (["patch_embed.norm"] if cfg.embed_norm else []) + ["pos_add"]
        names += ["norm_pre"] if cfg.norm_pre else []
        per_block = block_stages(cfg)
        for i in range(cfg.depth):
            names += [f"blocks.{i}.{s}" for s in per_block]
        names += ["norm"] if cfg.has_norm else []
        names += list(POOL_STAGES) if cfg.pooling == "map" else []
        names += ["pool"] if cfg.pooling != "cls" else []
        names += ["fc_norm"] if cfg.has_fc_norm else []
        return names + ["head"]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(number of parameters, number of parameter tensors)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)
