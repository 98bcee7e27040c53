"""Strict mapping between timm's VisionTransformer and the glass-box ViT.

Two pure pieces:
- ``config_from_timm`` reads the architecture off a timm model and refuses, by name,
  every option the glass-box model does not implement (rather than silently computing a
  different function).
- ``map_timm_state_dict`` turns a timm state dict into a glass-box state dict and an
  audit. Every source tensor must be used exactly once, every target tensor filled, every
  shape equal; otherwise it raises naming every offending key with both shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from workbench.models.vit import ViTConfig, VisionTransformer


class UnsupportedTimmModel(ValueError):
    """The timm model uses an option the glass-box ViT does not implement."""


class WeightMappingError(ValueError):
    """A state dict does not map onto the glass-box model one-to-one."""


def _check(condition: bool, option: str, problems: list[str]) -> None:
    if not condition:
        problems.append(option)


def _is_identity(module: object) -> bool:
    return module is None or isinstance(module, nn.Identity)


def _is_plain_layernorm(module: object) -> bool:
    # timm.layers.LayerNorm subclasses nn.LayerNorm and runs F.layer_norm unless fast-norm is on
    return (
        isinstance(module, nn.LayerNorm)
        and module.elementwise_affine
        and module.bias is not None
        and not getattr(module, "_fast_norm", False)
    )


def config_from_timm(model: nn.Module) -> ViTConfig:
    """Derive the glass-box config from a timm VisionTransformer instance.

    Raises:
        UnsupportedTimmModel: naming each unsupported option found.
    """
    from timm.layers import Mlp
    from timm.layers.attention import Attention as TimmAttention
    from timm.models.vision_transformer import Block as TimmBlock
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if type(model) is not TimmViT:
        raise UnsupportedTimmModel(
            f"{type(model).__name__}: only timm.models.vision_transformer.VisionTransformer is supported "
            "(distilled, hybrid and other ViT families are not)"
        )
    problems: list[str] = []
    pe = model.patch_embed
    _check(not model.dynamic_img_size, "dynamic_img_size=True", problems)
    _check(not getattr(pe, "dynamic_img_pad", False), "dynamic_img_pad=True", problems)
    _check(_is_identity(pe.norm), "embed_norm_layer (a norm inside patch_embed)", problems)
    _check(pe.proj.bias is not None, "patch_embed without bias (pre_norm=True)", problems)
    _check(pe.img_size[0] == pe.img_size[1], f"non-square img_size={pe.img_size}", problems)
    _check(pe.patch_size[0] == pe.patch_size[1], f"non-square patch_size={pe.patch_size}", problems)
    _check(_is_identity(model.norm_pre), "pre_norm=True", problems)
    _check(model.attn_pool is None, f"global_pool={model.global_pool!r} (attention pooling)", problems)
    _check(model.global_pool in ("token", "avg"), f"global_pool={model.global_pool!r}", problems)
    _check(not model.pool_include_prefix, "pool_include_prefix=True", problems)
    _check(isinstance(model.head, nn.Linear), "num_classes=0 (no classifier head)", problems)
    _check(not (_is_identity(model.norm) and _is_identity(model.fc_norm)), "final_norm=False", problems)
    _check(type(model.patch_drop) is nn.Identity, "patch_drop_rate > 0", problems)

    norms = [model.norm, model.fc_norm] + [m for b in model.blocks for m in (getattr(b, "norm1", None), getattr(b, "norm2", None))]
    norms = [m for m in norms if not _is_identity(m)]
    _check(all(_is_plain_layernorm(m) for m in norms), "norm_layer other than an affine LayerNorm", problems)
    eps = {m.eps for m in norms if isinstance(m, nn.LayerNorm)}
    _check(len(eps) <= 1, f"mixed LayerNorm eps {sorted(eps)}", problems)

    for i, block in enumerate(model.blocks):
        if type(block) is not TimmBlock:
            problems.append(f"blocks.{i}: block_fn={type(block).__name__}")
            continue
        attn, mlp = block.attn, block.mlp
        if type(attn) is not TimmAttention:
            problems.append(f"blocks.{i}: attn_layer={type(attn).__name__}")
        else:
            _check(_is_identity(attn.q_norm) and _is_identity(attn.k_norm), f"blocks.{i}: qk_norm=True", problems)
            _check(_is_identity(attn.norm), f"blocks.{i}: scale_attn_norm=True", problems)
            _check(getattr(attn, "gate", None) is None, f"blocks.{i}: gated attention", problems)
            _check(attn.proj.bias is not None, f"blocks.{i}: proj_bias=False", problems)
            _check(attn.head_dim * attn.num_heads == model.embed_dim, f"blocks.{i}: attn_head_dim", problems)
        _check(_is_identity(block.ls1) and _is_identity(block.ls2), f"blocks.{i}: init_values (LayerScale)", problems)
        _check(_is_identity(block.drop_path1), f"blocks.{i}: drop_path_rate > 0 (stochastic depth)", problems)
        if type(mlp) is not Mlp:
            problems.append(f"blocks.{i}: mlp_layer={type(mlp).__name__}")
        else:
            act = mlp.act
            _check(type(act) is nn.GELU and act.approximate == "none", f"blocks.{i}: act_layer={act!r}", problems)
            _check(_is_identity(mlp.norm), f"blocks.{i}: scale_mlp_norm=True", problems)
            _check(mlp.fc1.bias is not None and mlp.fc2.bias is not None, f"blocks.{i}: mlp without bias", problems)
    if problems:
        # Report each option once even when every block repeats it.
        unique = list(dict.fromkeys(p.split(": ", 1)[-1] if p.startswith("blocks.") else p for p in problems))
        raise UnsupportedTimmModel("unsupported timm ViT options: " + "; ".join(unique))

    first = model.blocks[0]
    return ViTConfig(
        image_size=pe.img_size[0],
        patch_size=pe.patch_size[0],
        in_channels=pe.proj.in_channels,
        num_classes=model.head.out_features,
        dim=model.embed_dim,
        depth=len(model.blocks),
        heads=first.attn.num_heads,
        mlp_hidden=first.mlp.fc1.out_features,
        qkv_bias=first.attn.qkv.bias is not None,
        pos_embed="learned" if model.pos_embed is not None else "none",
        pooling="cls" if model.global_pool == "token" else "mean",
        class_token=model.cls_token is not None,
        register_tokens=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
        fc_norm=not _is_identity(model.fc_norm),
        dropout=first.attn.proj_drop.p,
        attn_dropout=first.attn.attn_drop.p,
        pos_dropout=model.pos_drop.p,
        head_dropout=model.head_drop.p,
        layer_norm_eps=eps.pop() if eps else 1e-6,
    )


def timm_key_for(glass_key: str) -> str:
    """The timm state-dict key that fills a glass-box key."""
    renames = {
        "patch_proj.": "patch_embed.proj.",
        "register_tokens": "reg_token",
        ".attn.out_proj.": ".attn.proj.",
    }
    key = glass_key
    for ours, theirs in renames.items():
        key = key.replace(ours, theirs)
    return key


@dataclass
class MappingAudit:
    """What a weight mapping did, for logs and reports."""

    source_tensors: int
    source_used: int
    target_tensors: int
    target_filled: int
    parameters: int
    pairs: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.source_used == self.source_tensors and self.target_filled == self.target_tensors

    def summary(self) -> str:
        return (
            f"{self.source_used} of {self.source_tensors} source tensors used, "
            f"{self.target_filled} of {self.target_tensors} target tensors filled, "
            f"{self.parameters:,} parameters"
        )


def target_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the glass-box state dict, without allocating weights."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def map_timm_state_dict(
    source: Mapping[str, torch.Tensor], cfg: ViTConfig
) -> tuple[dict[str, torch.Tensor], MappingAudit]:
    """Map a timm ViT state dict onto the glass-box model described by ``cfg``.

    Raises:
        WeightMappingError: listing every missing key, unexpected key and shape mismatch.
    """
    shapes = target_shapes(cfg)
    wanted = {timm_key_for(k): k for k in shapes}
    missing = [f"{src} (for {dst}, expected {list(shapes[dst])})" for src, dst in wanted.items() if src not in source]
    unexpected = [f"{k} {list(source[k].shape)}" for k in source if k not in wanted]
    mismatched = [
        f"{src}: checkpoint {list(source[src].shape)} vs model {list(shapes[dst])} ({dst})"
        for src, dst in wanted.items()
        if src in source and tuple(source[src].shape) != shapes[dst]
    ]
    if missing or unexpected or mismatched:
        lines = [f"state dict does not match the glass-box ViT ({len(source)} source tensors, {len(shapes)} target):"]
        lines += [f"  missing key: {m}" for m in missing]
        lines += [f"  unexpected key: {u}" for u in unexpected]
        lines += [f"  shape mismatch: {s}" for s in mismatched]
        raise WeightMappingError("\n".join(lines))
    mapped = {dst: source[src] for src, dst in wanted.items()}
    audit = MappingAudit(
        source_tensors=len(source),
        source_used=len(wanted),
        target_tensors=len(shapes),
        target_filled=len(mapped),
        parameters=sum(t.numel() for t in mapped.values()),
        pairs=[(src, dst, shapes[dst]) for src, dst in wanted.items()],
    )
    return mapped, audit


def glassbox_from_timm(model: nn.Module) -> tuple[VisionTransformer, MappingAudit]:
    """A glass-box ViT carrying a timm model's weights (same device and dtype)."""
    cfg = config_from_timm(model)
    state, audit = map_timm_state_dict(model.state_dict(), cfg)
    # Build on the meta device and take over copies of the tensors: no wasted random init.
    with torch.device("meta"):
        glass = VisionTransformer(cfg)
    glass.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True, assign=True)
    return glass.train(model.training), audit
