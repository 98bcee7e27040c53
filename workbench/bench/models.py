"""The contenders: one set of weights, four ways to run it.

For a ViT, a timm ``VisionTransformer`` is built (a registered timm architecture with
timm's seeded init, or, for a study model, the timm model with the study config's
hyper-parameters) and its weights are mapped onto the glass-box model with
``glassbox_from_timm``, so every variant carries identical weights:

- ``glass_written``: glass-box, hand-written softmax(QKᵀ/√d)V (what analysis and training use);
- ``glass_fast``: glass-box, ``scaled_dot_product_attention``;
- ``timm_unfused``: timm with ``fused_attn=False`` (its written-out attention);
- ``timm_fused``: timm with ``fused_attn=True`` (its default on current PyTorch), the reference.

A CNN study model has no timm counterpart; it is timed alone (``glass``) for scale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.bench.flops import (
    cnn_forward_flops,
    cnn_train_flops,
    vit_forward_flops,
    vit_train_flops,
)
from workbench.convert.timm_vit import glassbox_from_timm
from workbench.equivalence import set_timm_fused
from workbench.models.cnn import CNN, CNNConfig
from workbench.models.registry import (
    STUDY_MODELS,
    model_config,
    timm_vit_architectures,
    unknown_model,
)
from workbench.models.vit import ViTConfig, count_parameters

VARIANTS = ("glass_written", "glass_fast", "timm_unfused", "timm_fused")
REFERENCE = "timm_fused"
LABELS = {
    "glass_written": "glass-box, hand-written attention",
    "glass_fast": "glass-box, fast path (SDPA)",
    "timm_unfused": "timm, fused_attn=False",
    "timm_fused": "timm, fused_attn=True",
    "glass": "glass-box CNN (no timm counterpart)",
}
# CNN configs carry no image size; these are the studies' datasets.
CNN_IMAGE_SIZE = {"fmnist_cnn": 28, "cifar_cnn": 32}


@dataclass
class BenchModel:
    """One architecture with its runnable variants and its analytic work per image.

    Attributes:
        name: Model name as given (timm architecture or study model).
        kind: "vit" or "cnn".
        image_size: Input side in pixels.
        in_channels: Input channels.
        num_classes: Classifier outputs.
        variants: Variant id -> module in eval mode, all with the same weights.
        forward_flops: Analytic forward FLOPs per image.
        train_flops: Analytic forward + backward FLOPs per image.
        parameters: Number of parameters.
        weights: Where the weights came from.
    """

    name: str
    kind: str
    image_size: int
    in_channels: int
    num_classes: int
    variants: dict[str, nn.Module] = field(repr=False)
    forward_flops: int
    train_flops: int
    parameters: int
    weights: str


def timm_from_config(cfg: ViTConfig) -> nn.Module:
    """The timm ``VisionTransformer`` with a glass-box config's hyper-parameters.

    timm registers no model identical to the study ViTs, so this builds one directly. The
    round trip through ``glassbox_from_timm`` must give back the same architecture, which
    ``build_bench_model`` checks.
    """
    from timm.models.vision_transformer import VisionTransformer

    if cfg.pos_embed != "learned":
        raise ValueError(
            f"timm_from_config: pos_embed={cfg.pos_embed!r} is not mapped (only 'learned')"
        )
    # fmt: skip
    return VisionTransformer(
        img_size=cfg.image_size,
        patch_size=cfg.patch_size,
        in_chans=cfg.in_channels,
        num_classes=cfg.num_classes,
        embed_dim=cfg.dim,
        depth=cfg.depth,
        num_heads=cfg.heads,
        mlp_ratio=cfg.hidden_dim / cfg.dim,
        qkv_bias=cfg.qkv_bias,
        class_token=cfg.class_token,
        reg_tokens=cfg.register_tokens,
        no_embed_class=cfg.no_embed_class,
        global_pool="token" if cfg.pooling == "cls" else "avg",
        fc_norm=cfg.fc_norm,
        drop_rate=cfg.head_dropout,
        pos_drop_rate=cfg.pos_dropout,
        proj_drop_rate=cfg.dropout,
        attn_drop_rate=cfg.attn_dropout,
    )


def _same_architecture(a: ViTConfig, b: ViTConfig) -> bool:
    keys = ("image_size", "patch_size", "in_channels", "num_classes", "dim", "depth", "heads", "hidden_dim",
            "qkv_bias", "pooling", "class_token", "register_tokens", "uses_fc_norm", "layer_norm_eps")  # fmt: skip
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _vit_variants(timm_model: nn.Module) -> dict[str, nn.Module]:
    glass, audit = glassbox_from_timm(timm_model.eval())
    if (
        not audit.complete
    ):  # glassbox_from_timm raises on any mismatch; this guards the audit itself
        raise RuntimeError(f"incomplete weight mapping: {audit.summary()}")
    unfused = copy.deepcopy(timm_model)
    set_timm_fused(unfused, False)
    set_timm_fused(timm_model, True)
    # Separate instances (deep copies, same values) so that no variant toggles a flag
    # inside the timed call.
    return {
        "glass_written": glass.set_fast_attention(False),
        "glass_fast": copy.deepcopy(glass).set_fast_attention(True),
        "timm_unfused": unfused,
        "timm_fused": timm_model,
    }


def build_bench_model(name: str, device: torch.device | str = "cpu", seed: int = 0) -> BenchModel:
    """Build every variant of ``name`` with identical, seeded weights on ``device``.

    Args:
        name: A timm ViT architecture (any whose options the glass-box model implements) or a study model name.
        device: Where the modules go.
        seed: Seed of the (timm) initialisation; weights are random, labelled as such.
    """
    torch.manual_seed(seed)
    if name not in STUDY_MODELS and name in timm_vit_architectures():
        import timm

        timm_model = timm.create_model(name, pretrained=False)
        weights = f"{name} seeded random init (seed {seed}, NOT PRETRAINED)"
    elif name in STUDY_MODELS and isinstance(STUDY_MODELS[name], ViTConfig):
        cfg = model_config(name)
        timm_model = timm_from_config(cfg)
        weights = f"timm VisionTransformer with {name}'s hyper-parameters, seeded random init (seed {seed})"
    elif name in STUDY_MODELS:
        cfg = model_config(name)
        assert isinstance(cfg, CNNConfig)
        model = CNN(cfg).to(device).eval()
        size = CNN_IMAGE_SIZE.get(name, 32)
        # fmt: skip
        return BenchModel(
            name,
            "cnn",
            size,
            cfg.in_channels,
            cfg.num_classes,
            {"glass": model},
            cnn_forward_flops(cfg, size)["total"],
            cnn_train_flops(cfg, size),
            count_parameters(model)[0],
            f"seeded random init (seed {seed})",
        )
    else:
        raise unknown_model(name, timm_arms=False, timm_vits=True)
    variants = {k: m.to(device).eval() for k, m in _vit_variants(timm_model.eval()).items()}
    cfg = variants["glass_written"].cfg
    if cfg.image_hw[0] != cfg.image_hw[1]:
        raise ValueError(
            f"{name}: the benchmark times square images only; image_size={cfg.image_size}"
        )
    if name in STUDY_MODELS and not _same_architecture(cfg, model_config(name)):
        raise RuntimeError(f"{name}: the timm twin maps back to {cfg}, not {model_config(name)}")
    # fmt: skip
    return BenchModel(
        name,
        "vit",
        cfg.image_hw[0],
        cfg.in_channels,
        cfg.num_classes,
        variants,
        vit_forward_flops(cfg)["total"],
        vit_train_flops(cfg),
        count_parameters(variants["glass_written"])[0],
        weights,
    )
