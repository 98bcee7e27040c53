"""Glass-box Vision Transformer written from basic layers.

The forward pass is spelled out op by op so that every intermediate activation has a
stable stage name (see ``stage_names``) and so that, with the same weights, it is the
same function as timm's ``VisionTransformer``: the operations are the ones timm runs, in
the same order, which is what makes a 0.0 difference possible rather than merely small.

Stages per block (8): ``norm1``, ``attn.qkv``, ``attn.probs`` (the attention map),
``attn`` (after the output projection), ``resid1``, ``norm2``, ``mlp``, ``resid2``.
Model-level stages: ``patch_embed``, ``pos_add``, ``norm``, ``fc_norm`` (mean pooling
only), ``pool`` (only where pooling computes something: a mean over tokens; CLS pooling
is an index into ``norm``), ``head``. ViT-B/16 therefore has 4 + 12 x 8 = 100 stages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

Recorder = Callable[[str, torch.Tensor], None]
BLOCK_STAGES = ("norm1", "attn.qkv", "attn.probs", "attn", "resid1", "norm2", "mlp", "resid2")


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a glass-box ViT. Validated on construction.

    Attributes mirror timm's ``VisionTransformer`` arguments where one exists.
    ``mlp_hidden`` overrides ``mlp_ratio`` when set (the Fashion-MNIST study model uses
    a hidden width of 128 at dim 64).
    """

    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    mlp_hidden: int | None = None
    qkv_bias: bool = True
    pos_embed: Literal["learned", "none"] = "learned"
    pooling: Literal["cls", "mean"] = "cls"
    class_token: bool = True
    register_tokens: int = 0
    no_embed_class: bool = False
    fc_norm: bool | None = None
    dropout: float = 0.0
    attn_dropout: float = 0.0
    pos_dropout: float = 0.0
    head_dropout: float = 0.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        def bad(key: str, value: object, why: str) -> ValueError:
            return ValueError(f"ViTConfig.{key}={value!r}: {why}")

        for key in ("image_size", "patch_size", "in_channels", "num_classes", "dim", "depth", "heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, value, "must be a positive integer")
        if self.image_size % self.patch_size:
            raise bad("patch_size", self.patch_size, f"must divide image_size={self.image_size}")
        if self.dim % self.heads:
            raise bad("heads", self.heads, f"must divide dim={self.dim}")
        if self.mlp_hidden is not None and (not isinstance(self.mlp_hidden, int) or self.mlp_hidden < 1):
            raise bad("mlp_hidden", self.mlp_hidden, "must be a positive integer or None")
        if not self.mlp_ratio > 0:
            raise bad("mlp_ratio", self.mlp_ratio, "must be > 0")
        if self.pos_embed not in ("learned", "none"):
            raise bad("pos_embed", self.pos_embed, "must be 'learned' or 'none'")
        if self.pooling not in ("cls", "mean"):
            raise bad("pooling", self.pooling, "must be 'cls' or 'mean'")
        if self.pooling == "cls" and not self.class_token:
            raise bad("pooling", self.pooling, "CLS pooling needs class_token=True")
        if not isinstance(self.register_tokens, int) or self.register_tokens < 0:
            raise bad("register_tokens", self.register_tokens, "must be an integer >= 0")
        if self.fc_norm and self.pooling == "cls":
            raise bad("fc_norm", self.fc_norm, "fc_norm goes with mean pooling only")
        for key in ("dropout", "attn_dropout", "pos_dropout", "head_dropout"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise bad(key, value, "must be in [0, 1)")
        if not self.layer_norm_eps > 0:
            raise bad("layer_norm_eps", self.layer_norm_eps, "must be > 0")

    @property
    def hidden_dim(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else int(self.dim * self.mlp_ratio)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.register_tokens

    @property
    def uses_fc_norm(self) -> bool:
        # timm's default: a norm after pooling replaces the final norm for mean pooling.
        return self.pooling == "mean" if self.fc_norm is None else self.fc_norm

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Multi-head self-attention from one packed QKV projection."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.qkv_bias)
        self.attn_drop = nn.Dropout(cfg.attn_dropout)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.out_drop = nn.Dropout(cfg.dropout)
        self.fast = False  # use scaled_dot_product_attention instead of the written-out form

    def forward(self, x: torch.Tensor, record: Recorder | None = None, prefix: str = "") -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x)  # (B, N, 3C)
        if record:
            record(f"{prefix}attn.qkv", qkv)
        qkv = qkv.reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)  # each (B, H, N, d)
        if self.fast:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            # softmax(Q K^T / sqrt(d)) V. Scaling q before the product (not the scores
            # after it) is what timm does; the same rounding gives bit-identical outputs.
            q = q * self.scale
            scores = q @ k.transpose(-2, -1)  # (B, H, N, N)
            probs = scores.softmax(dim=-1)
            if record:
                record(f"{prefix}attn.probs", probs)
            out = self.attn_drop(probs) @ v  # (B, H, N, d)
        out = out.transpose(1, 2).reshape(B, N, C)  # (B, N, C): heads concatenated
        return self.out_drop(self.out_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.hidden_dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, record: Recorder | None = None, prefix: str = "") -> torch.Tensor:
        if record is None:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        return self._forward_recorded(x, record, prefix)

    def _forward_recorded(self, x: torch.Tensor, record: Recorder, prefix: str) -> torch.Tensor:
        # Same arithmetic as forward(), with every intermediate handed to the recorder.
        h = self.norm1(x)
        record(f"{prefix}norm1", h)
        h = self.attn(h, record, prefix)
        record(f"{prefix}attn", h)
        x = x + h
        record(f"{prefix}resid1", x)
        h = self.norm2(x)
        record(f"{prefix}norm2", h)
        h = self.mlp(h)
        record(f"{prefix}mlp", h)
        x = x + h
        record(f"{prefix}resid2", x)
        return x


@dataclass
class Analysis:
    """What the analysis mode returns.

    Attributes:
        logits: (B, num_classes).
        hidden_states: stage name -> activation, in execution order.
        attentions: one (B, heads, N, N) attention map per block.
    """

    logits: torch.Tensor
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)
    attentions: list[torch.Tensor] = field(default_factory=list)


class VisionTransformer(nn.Module):
    """ViT with timm's method names: forward_features, forward_head, forward."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # A strided convolution is the patch projection: one linear map per non-overlapping
        # patch. It is also timm's op, which keeps the comparison exact.
        self.patch_proj = nn.Conv2d(cfg.in_channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.class_token else None
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, cfg.register_tokens, cfg.dim)) if cfg.register_tokens else None
        )
        pos_len = cfg.num_patches + (0 if cfg.no_embed_class else cfg.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_len, cfg.dim)) if cfg.pos_embed == "learned" else None
        self.pos_drop = nn.Dropout(cfg.pos_dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.Identity() if cfg.uses_fc_norm else nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.fc_norm = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps) if cfg.uses_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.head_dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm-like init: truncated normal 0.02 for linears and positions, zeros for biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.register_tokens):
            if token is not None:
                nn.init.normal_(token, std=1e-6)

    def set_fast_attention(self, enabled: bool = True) -> "VisionTransformer":
        """Route attention through scaled_dot_product_attention (analysis mode never does)."""
        for block in self.blocks:
            block.attn.fast = enabled
        return self

    # ---- forward pieces -------------------------------------------------------------
    def _embed(self, x: torch.Tensor, record: Recorder | None) -> torch.Tensor:
        x = self.patch_proj(x).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, D)
        if record:
            record("patch_embed", x)
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
        return x

    def forward_features(self, x: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, N, D)."""
        x = self._embed(x, record)
        for i, block in enumerate(self.blocks):
            x = block(x, record, f"blocks.{i}.")
        x = self.norm(x)
        if record and not self.cfg.uses_fc_norm:
            record("norm", x)
        return x

    def pool(self, x: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """Tokens (B, N, D) -> one vector per image (B, D)."""
        if self.cfg.pooling == "cls":
            return x[:, 0]
        x = x[:, self.cfg.num_prefix_tokens :].mean(dim=1)  # average over patch tokens only
        if record:
            record("pool", x)
        return x

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False, record: Recorder | None = None
    ) -> torch.Tensor:
        x = self.pool(x, record)
        if self.cfg.uses_fc_norm:
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
        fast = [block.attn.fast for block in self.blocks]
        self.set_fast_attention(False)
        try:
            logits, states = self.forward_stages(x)
        finally:
            for block, was_fast in zip(self.blocks, fast):
                block.attn.fast = was_fast
        attentions = [states[f"blocks.{i}.attn.probs"] for i in range(self.cfg.depth)]
        return Analysis(logits=logits, hidden_states=states, attentions=attentions)

    def stage_names(self) -> list[str]:
        """Stage names in execution order, as forward_analysis records them."""
        names = ["patch_embed", "pos_add"]
        for i in range(self.cfg.depth):
            names += [f"blocks.{i}.{s}" for s in BLOCK_STAGES]
        if self.cfg.uses_fc_norm:
            names += ["pool", "fc_norm"] if self.cfg.pooling == "mean" else ["fc_norm"]
        else:
            names += ["norm"] + (["pool"] if self.cfg.pooling == "mean" else [])
        return names + ["head"]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(number of parameters, number of parameter tensors)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)
