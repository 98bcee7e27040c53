"""The glass-box ViT's architecture, as one frozen, validated dataclass.

Fields mirror timm's ``VisionTransformer`` arguments where one exists, so a timm model's
options read straight across (see ``workbench.convert.timm_vit.config_from_timm``). The
defaults are a plain ViT-B/16; every option defaults to "off", so a plain ViT's modules,
parameters and stage names never change when options are added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

NORM_LAYERS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "sigmoid")
MLP_LAYERS = ("mlp", "swiglu", "glu")
POOLINGS = ("cls", "mean", "map")


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a glass-box ViT. Validated on construction.

    ``mlp_hidden`` overrides ``mlp_ratio`` when set (the Fashion-MNIST study model uses
    a hidden width of 128 at dim 64). For ``mlp_layer="glu"`` it is the width of the
    packed first projection (value and gate together), as in timm's ``GluMlp``.

    Family options (all off by default):
        norm_layer / norm_bias: RMSNorm (AIMv2) or LayerNorm without bias.
        act: MLP activation: exact or tanh GELU, QuickGELU (OpenAI CLIP), SiLU, sigmoid.
        mlp_layer: "mlp" (fc1-act-fc2), "swiglu" (separate gate and value projections,
            timm ``SwiGLU``), "glu" (one packed projection split in two, timm ``GluMlp``;
            with act="silu" and glu_gate_last=False it is timm's ``SwiGLUPacked``).
        qkv_bias / proj_bias / mlp_bias: bias switches of the projections.
        qk_norm, scale_attn_norm, scale_mlp_norm: norms on q and k, on the attention
            output before its projection, on the MLP hidden activation.
        layer_scale_init: LayerScale (DeiT III, DINOv2): residual branches times a
            learned per-channel gain initialised to this value.
        norm_pre / patch_bias / embed_norm: a norm before the blocks (CLIP), a patch
            projection without bias, a norm inside the patch embedding (AIMv2).
        pooling "map": attention pooling with one learned latent query (SigLIP).
        pool_include_prefix: pool over class/register tokens too.
        final_norm: False drops the norm after the blocks (and fc_norm).
        drop_path_rate: stochastic depth (timm's ``drop_path_rate``): block i drops its
            residual branches with probability ``drop_path_rate * i / (depth - 1)``
            (timm's ``calculate_drop_path_rates``), in training only; 0: off, and the
            blocks hold ``nn.Identity`` there, as timm's do.
        num_classes 0: no classifier; the model returns pre-logits features.
    """

    image_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_channels: int = 3
    num_classes: int = 1000
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    mlp_hidden: int | None = None
    qkv_bias: bool = True
    pos_embed: Literal["learned", "none"] = "learned"
    pooling: Literal["cls", "mean", "map"] = "cls"
    class_token: bool = True
    register_tokens: int = 0
    no_embed_class: bool = False
    fc_norm: bool | None = None
    dropout: float = 0.0
    attn_dropout: float = 0.0
    pos_dropout: float = 0.0
    head_dropout: float = 0.0
    drop_path_rate: float = 0.0
    layer_norm_eps: float = 1e-6
    norm_layer: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_bias: bool = True
    act: Literal["gelu", "gelu_tanh", "quick_gelu", "silu", "sigmoid"] = "gelu"
    mlp_layer: Literal["mlp", "swiglu", "glu"] = "mlp"
    glu_gate_last: bool = True
    proj_bias: bool = True
    mlp_bias: bool = True
    qk_norm: bool = False
    scale_attn_norm: bool = False
    scale_mlp_norm: bool = False
    layer_scale_init: float | None = None
    norm_pre: bool = False
    patch_bias: bool = True
    embed_norm: bool = False
    final_norm: bool = True
    pool_include_prefix: bool = False
    pool_mlp_hidden: int | None = None

    def __post_init__(self) -> None:
        def bad(key: str, value: object, why: str) -> ValueError:
            return ValueError(f"ViTConfig.{key}={value!r}: {why}")

        for key in ("in_channels", "dim", "depth", "heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, value, "must be a positive integer")
        if (
            not isinstance(self.num_classes, int)
            or isinstance(self.num_classes, bool)
            or self.num_classes < 0
        ):
            raise bad("num_classes", self.num_classes, "must be an integer >= 0 (0: no classifier)")
        for key in ("image_size", "patch_size"):
            value = getattr(self, key)
            ok = (
                isinstance(value, int)
                and not isinstance(value, bool)
                or (isinstance(value, (tuple, list)) and len(value) == 2)
            )
            if not ok or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in _pair(value)
            ):
                raise bad(
                    key, value, "must be a positive integer or a (height, width) pair of them"
                )
        if any(p > i for i, p in zip(self.image_hw, self.patch_hw)):
            raise bad(
                "patch_size", self.patch_size, f"must not exceed image_size={self.image_size}"
            )
        # As in timm, a size that the patch does not divide leaves the last rows/columns of
        # pixels unseen (the strided convolution floors), e.g. 384 px with 14 px patches.
        if self.dim % self.heads:
            raise bad("heads", self.heads, f"must divide dim={self.dim}")
        for key in ("mlp_hidden", "pool_mlp_hidden"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(key, value, "must be a positive integer or None")
        if not self.mlp_ratio > 0:
            raise bad("mlp_ratio", self.mlp_ratio, "must be > 0")
        if self.pos_embed not in ("learned", "none"):
            raise bad("pos_embed", self.pos_embed, "must be 'learned' or 'none'")
        if self.pooling not in POOLINGS:
            raise bad("pooling", self.pooling, f"must be one of {', '.join(POOLINGS)}")
        if self.pooling == "cls" and not self.class_token:
            raise bad("pooling", self.pooling, "CLS pooling needs class_token=True")
        if not isinstance(self.register_tokens, int) or self.register_tokens < 0:
            raise bad("register_tokens", self.register_tokens, "must be an integer >= 0")
        if self.fc_norm and self.pooling == "cls":
            raise bad("fc_norm", self.fc_norm, "fc_norm goes with mean or attention pooling only")
        for key in ("dropout", "attn_dropout", "pos_dropout", "head_dropout", "drop_path_rate"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise bad(key, value, "must be in [0, 1)")
        if not self.layer_norm_eps > 0:
            raise bad("layer_norm_eps", self.layer_norm_eps, "must be > 0")
        for key, allowed in (
            ("norm_layer", NORM_LAYERS),
            ("act", ACTIVATIONS),
            ("mlp_layer", MLP_LAYERS),
        ):
            if getattr(self, key) not in allowed:
                raise bad(key, getattr(self, key), f"must be one of {', '.join(allowed)}")
        if self.norm_layer == "rmsnorm" and not self.norm_bias:
            raise bad(
                "norm_bias", self.norm_bias, "RMSNorm has no bias; norm_bias applies to layernorm"
            )
        if self.mlp_layer == "glu" and self.hidden_dim % 2:
            raise bad("mlp_hidden", self.hidden_dim, "a packed GLU MLP needs an even hidden width")
        if self.layer_scale_init is not None and not self.layer_scale_init > 0:
            raise bad(
                "layer_scale_init", self.layer_scale_init, "must be > 0 or None (no LayerScale)"
            )
        if self.pool_include_prefix and self.pooling == "cls":
            raise bad("pool_include_prefix", True, "applies to mean or attention pooling only")

    # ---- derived sizes ---------------------------------------------------------------
    @property
    def image_hw(self) -> tuple[int, int]:
        return _pair(self.image_size)

    @property
    def patch_hw(self) -> tuple[int, int]:
        return _pair(self.patch_size)

    @property
    def grid(self) -> tuple[int, int]:
        """Patches along height and width."""
        return self.image_hw[0] // self.patch_hw[0], self.image_hw[1] // self.patch_hw[1]

    @property
    def hidden_dim(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else int(self.dim * self.mlp_ratio)

    @property
    def pool_hidden_dim(self) -> int:
        return (
            self.pool_mlp_hidden
            if self.pool_mlp_hidden is not None
            else int(self.dim * self.mlp_ratio)
        )

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.register_tokens

    @property
    def uses_fc_norm(self) -> bool:
        # timm's default: a norm after pooling replaces the final norm for mean pooling.
        return self.pooling == "mean" if self.fc_norm is None else self.fc_norm

    @property
    def has_norm(self) -> bool:
        return self.final_norm and not self.uses_fc_norm

    @property
    def has_fc_norm(self) -> bool:
        return self.final_norm and self.uses_fc_norm

    def to_dict(self) -> dict:
        return asdict(self)
