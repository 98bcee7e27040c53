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


def _is_identity(module: object) -> bool:
    return module is None or isinstance(module, nn.Identity)


class _Reader:
    """Reads options off timm modules, collecting every unsupported one by name."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.norms: set[tuple[str, float, bool]] = set()
        self.acts: set[str] = set()
        self.dropouts: set[float] = set()

    def refuse(self, option: str) -> None:
        if option not in self.problems:
            self.problems.append(option)

    def check(self, condition: bool, option: str) -> None:
        if not condition:
            self.refuse(option)

    def norm(self, module: nn.Module | None, where: str) -> bool:
        """Record a norm's kind; True when there is one (not an identity)."""
        from timm.layers import LayerNorm, RmsNorm

        if _is_identity(module):
            return False
        if getattr(module, "_fast_norm", False):
            self.refuse(f"fast_norm (fused/apex norm kernels) in {where}")
        elif type(module) in (nn.LayerNorm, LayerNorm):  # both run F.layer_norm
            self.check(module.elementwise_affine, f"LayerNorm without affine weights in {where}")
            self.norms.add(("layernorm", module.eps, module.bias is not None))
        elif type(module) is RmsNorm:
            self.check(module.elementwise_affine, f"RmsNorm without affine weights in {where}")
            self.norms.add(("rmsnorm", module.eps, True))  # no bias to switch off
        else:
            self.refuse(f"norm_layer={type(module).__name__}")
        return True

    def act(self, module: nn.Module, where: str) -> None:
        from timm.layers import activations as ta

        kinds = {
            nn.GELU: lambda m: "gelu" if m.approximate == "none" else "gelu_tanh",
            ta.GELU: lambda m: "gelu",
            ta.GELUTanh: lambda m: "gelu_tanh",
            ta.QuickGELU: lambda m: "quick_gelu",
            nn.SiLU: lambda m: "silu",
            nn.Sigmoid: lambda m: "sigmoid",
            ta.Sigmoid: lambda m: "sigmoid" if not m.inplace else None,
        }
        kind = kinds[type(module)](module) if type(module) in kinds else None
        if kind is None:
            self.refuse(f"act_layer={type(module).__name__} in {where}")
        else:
            self.acts.add(kind)

    def mlp(self, mlp: nn.Module, where: str) -> tuple[str, int, bool, bool]:
        """(mlp_layer, hidden width, bias, inner norm) of a timm MLP."""
        from timm.layers import GluMlp, Mlp, SwiGLU

        kind = {Mlp: "mlp", GluMlp: "glu", SwiGLU: "swiglu"}.get(type(mlp))
        if kind is None:
            self.refuse(f"mlp_layer={type(mlp).__name__}")
            return "mlp", 1, True, False
        firsts = [mlp.fc1_g, mlp.fc1_x] if kind == "swiglu" else [mlp.fc1]
        for layer in firsts + [mlp.fc2]:
            self.check(type(layer) is nn.Linear, f"{type(mlp).__name__} with convolutional layers")
        biases = {layer.bias is not None for layer in firsts + [mlp.fc2]}
        self.check(len(biases) == 1, f"MLP with bias on only some projections in {where}")
        if kind == "glu":
            self.check(mlp.chunk_dim == -1, "GluMlp on channels-first tensors")
        self.act(mlp.act, where)
        self.dropouts.update({mlp.drop1.p, mlp.drop2.p})
        return kind, firsts[0].out_features, biases.pop(), self.norm(mlp.norm, where)

    def eps_and_kind(self) -> tuple[str, float, bool]:
        if len(self.norms) > 1:
            self.refuse(
                "mixed norm layers "
                + ", ".join(
                    f"{k} eps={e:g}{'' if b else ' no bias'}" for k, e, b in sorted(self.norms)
                )
            )
        return min(self.norms) if self.norms else ("layernorm", 1e-6, True)


def _refuse_family(model: nn.Module) -> None:
    """Refuse, by name, model classes and patch embeddings the glass-box model is not."""
    from timm.layers import PatchEmbed
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    names = {
        "VisionTransformerDistilled": "distillation token (VisionTransformerDistilled, DeiT distilled)",
    }
    kind = type(model).__name__
    if type(model) is not TimmViT:
        raise UnsupportedTimmModel(
            f"unsupported timm ViT options: {names.get(kind, f'model class {kind}')}; "
            "only timm.models.vision_transformer.VisionTransformer is implemented"
        )
    pe = model.patch_embed
    if type(pe) is not PatchEmbed:
        what = (
            "HybridEmbed patch embedding (CNN backbone stem, hybrid ViT)"
            if type(pe).__name__ == "HybridEmbed"
            else f"embed_layer={type(pe).__name__}"
        )
        raise UnsupportedTimmModel(f"unsupported timm ViT options: {what}")


def _read_embedding(r: _Reader, model: nn.Module) -> tuple[bool, bool, bool, bool]:
    """Patch embedding and the model-level norms, pool and head: (embed_norm, norm_pre, norm, fc_norm)."""
    pe = model.patch_embed
    r.check(not model.dynamic_img_size, "dynamic_img_size=True")
    r.check(not getattr(pe, "dynamic_img_pad", False), "dynamic_img_pad=True")
    r.check(
        getattr(pe, "flatten", True) or model.dynamic_img_size,
        "patch_embed without flatten (output_fmt)",
    )
    r.check(
        type(pe.proj) is nn.Conv2d
        and tuple(pe.proj.stride) == tuple(pe.patch_size)
        and tuple(pe.proj.padding) == (0, 0),
        "patch_embed projection other than a patch-strided Conv2d",
    )
    r.check(type(model.patch_drop) is nn.Identity, "patch_drop_rate > 0")
    embed_norm = r.norm(pe.norm, "patch_embed")
    norm_pre = r.norm(model.norm_pre, "norm_pre")
    has_norm = r.norm(model.norm, "norm")
    has_fc_norm = r.norm(model.fc_norm, "fc_norm")
    r.check(model.global_pool in ("token", "avg", "map"), f"global_pool={model.global_pool!r}")
    r.check(isinstance(model.head, (nn.Linear, nn.Identity)), f"head={type(model.head).__name__}")
    r.check(
        not isinstance(model.head, nn.Identity) or model.num_classes == 0,
        "head replaced by an identity",
    )
    return embed_norm, norm_pre, has_norm, has_fc_norm


def _read_attention_pool(r: _Reader, model: nn.Module) -> int | None:
    """The MAP head's options (``global_pool="map"``): its MLP's hidden width, or None without one."""
    from timm.layers import AttentionPoolLatent, Mlp

    if model.global_pool != "map":
        return None
    pool, pool_hidden = model.attn_pool, None
    if type(pool) is not AttentionPoolLatent:
        r.refuse(f"attention pool {type(pool).__name__}")
        return None
    r.check(pool.latent_len == 1 and pool.pool == "token", "attention pool with several latents")
    r.check(pool.pos_embed is None, "attention pool with its own position embedding")
    r.check(
        type(pool.q) is nn.Linear and _is_identity(pool.q_norm),
        "attention pool without q projection or with qk-norm",
    )
    r.check(
        pool.num_heads == model.blocks[0].attn.num_heads
        if hasattr(model.blocks[0], "attn")
        else False,
        "attention pool heads differ from the blocks'",
    )
    r.check(
        pool.latent.shape[-1] == model.embed_dim and type(pool.mlp) is Mlp,
        "attention pool latent_dim / mlp",
    )
    r.check(
        all(getattr(pool, n).bias is not None for n in ("q", "kv", "proj")),
        "attention pool without biases",
    )
    r.check(pool.proj_drop.p == 0.0, "attention pool dropout")
    if type(pool.mlp) is Mlp:
        kind, pool_hidden, bias, inner = r.mlp(pool.mlp, "attn_pool")
        r.check(bias and not inner, "attention pool MLP without bias or with an inner norm")
    r.check(r.norm(pool.norm, "attn_pool"), "attention pool without norm")
    return pool_hidden


def _read_block(r: _Reader, model: nn.Module, block: nn.Module, rates: list[float]) -> tuple | None:
    """One block's options as a tuple (every block must give the same), or None when refused;
    its drop-path rate is appended to ``rates``."""
    from timm.layers import LayerScale
    from timm.layers.attention import Attention as TimmAttention
    from timm.models.vision_transformer import Block as TimmBlock

    if type(block) is not TimmBlock:
        r.refuse(f"block_fn={type(block).__name__}")
        return None
    attn = block.attn
    r.norm(block.norm1, "blocks")
    r.norm(block.norm2, "blocks")
    rates.append(_drop_path_rate(r, block))
    scales = []
    for ls in (block.ls1, block.ls2):
        if type(ls) is LayerScale:
            r.check(not ls.inplace, "LayerScale inplace=True")
            scales.append(float(ls.init_values))
        else:
            r.check(_is_identity(ls), f"layer scale {type(ls).__name__}")
            scales.append(None)
    r.check(len(set(scales)) == 1, "LayerScale on only one residual branch")
    if type(attn) is not TimmAttention:
        r.refuse(f"attn_layer={type(attn).__name__}")
        return None
    r.check(
        attn.head_dim * attn.num_heads == model.embed_dim,
        "attn_head_dim other than dim / heads",
    )
    r.check(getattr(attn, "gate", None) is None, "gated attention")
    r.check(attn.proj.out_features == model.embed_dim, "attention dim_out")
    qk_norm = r.norm(attn.q_norm, "q_norm") | r.norm(attn.k_norm, "k_norm")
    r.dropouts.add(attn.proj_drop.p)
    mlp_kind, hidden, mlp_bias, mlp_norm = r.mlp(block.mlp, "blocks")
    return (
        attn.num_heads,
        attn.qkv.bias is not None,
        attn.proj.bias is not None,
        qk_norm,
        r.norm(attn.norm, "attn.norm"),
        attn.attn_drop.p,
        scales[0],
        mlp_kind,
        hidden,
        mlp_bias,
        mlp_norm,
        getattr(block.mlp, "gate_last", True),
    )


def config_from_timm(model: nn.Module) -> ViTConfig:
    """Derive the glass-box config from a timm VisionTransformer instance, by capability.

    Every option is read off the modules (never off the model's name); any option the
    glass-box model does not implement is collected and refused by name. Works on a
    model built on the meta device (it reads shapes and types only).

    Raises:
        UnsupportedTimmModel: naming each unsupported option found.
    """
    _refuse_family(model)
    r = _Reader()
    embed_norm, norm_pre, has_norm, has_fc_norm = _read_embedding(r, model)
    pool_hidden = _read_attention_pool(r, model)
    block_rates: list[float] = []
    block_options = {_read_block(r, model, block, block_rates) for block in model.blocks}
    block_options.discard(None)
    r.check(len(block_options) <= 1, "blocks with different options")
    drop_path_rate = _drop_path_rule(r, block_rates)
    kind, eps, norm_bias = r.eps_and_kind()
    r.check(len(r.acts) <= 1, f"mixed activations {sorted(r.acts)}")
    r.check(len(r.dropouts) <= 1, "different dropout rates in attention and MLP")
    if r.problems:
        raise UnsupportedTimmModel("unsupported timm ViT options: " + "; ".join(r.problems))

    (
        heads,
        qkv_bias,
        proj_bias,
        qk_norm,
        attn_norm,
        attn_drop,
        ls_init,
        mlp_kind,
        hidden,
        mlp_bias,
        mlp_norm,
        gate_last,
    ) = block_options.pop()
    pe = model.patch_embed
    size = lambda pair: pair[0] if pair[0] == pair[1] else tuple(pair)  # noqa: E731
    pooling = {"token": "cls", "avg": "mean", "map": "map"}[model.global_pool]
    try:
        return ViTConfig(
            image_size=size(pe.img_size),
            patch_size=size(pe.patch_size),
            in_channels=pe.proj.in_channels,
            num_classes=model.head.out_features if isinstance(model.head, nn.Linear) else 0,
            dim=model.embed_dim,
            depth=len(model.blocks),
            heads=heads,
            mlp_hidden=hidden,
            qkv_bias=qkv_bias,
            pos_embed="learned" if model.pos_embed is not None else "none",
            pooling=pooling,
            class_token=model.cls_token is not None,
            register_tokens=model.num_reg_tokens,
            no_embed_class=model.no_embed_class,
            fc_norm=has_fc_norm if (has_norm or has_fc_norm) else None,
            dropout=r.dropouts.pop() if r.dropouts else 0.0,
            attn_dropout=attn_drop,
            pos_dropout=model.pos_drop.p,
            head_dropout=model.head_drop.p,
            drop_path_rate=drop_path_rate,
            layer_norm_eps=eps,
            norm_layer=kind,
            norm_bias=norm_bias,
            act=r.acts.pop() if r.acts else "gelu",
            mlp_layer=mlp_kind,
            glu_gate_last=gate_last,
            proj_bias=proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            scale_attn_norm=attn_norm,
            scale_mlp_norm=mlp_norm,
            layer_scale_init=ls_init,
            norm_pre=norm_pre,
            patch_bias=pe.proj.bias is not None,
            embed_norm=embed_norm,
            final_norm=has_norm or has_fc_norm,
            pool_include_prefix=model.pool_include_prefix,
            pool_mlp_hidden=pool_hidden,
        )
    except ValueError as err:  # a combination timm builds but the glass-box model does not
        raise UnsupportedTimmModel(f"unsupported timm ViT options: {err}") from err


def _drop_path_rate(r: _Reader, block: nn.Module) -> float:
    """A timm block's stochastic-depth rate (0.0 for identities); refused unless both branches share it."""
    from timm.layers import DropPath

    rates = []
    for module in (block.drop_path1, block.drop_path2):
        if _is_identity(module):
            rates.append(0.0)
        elif type(module) is DropPath and module.scale_by_keep:
            rates.append(float(module.drop_prob))
        else:
            r.refuse(f"drop path {type(module).__name__} (scale_by_keep=False or another kind)")
            rates.append(0.0)
    r.check(rates[0] == rates[1], "different drop path rates on a block's two branches")
    return rates[0]


def _drop_path_rule(r: _Reader, rates: list[float]) -> float:
    """The model's ``drop_path_rate``: the last block's, if every block follows timm's linear rule."""
    from timm.layers import calculate_drop_path_rates

    if not rates or not any(rates):
        return 0.0
    rate = rates[-1]
    r.check(
        rates == calculate_drop_path_rates(rate, len(rates)),
        "drop path rates other than timm's linear rule (linspace(0, drop_path_rate, depth))",
    )
    return rate


def timm_key_for(glass_key: str) -> str:
    """The timm state-dict key that fills a glass-box key."""
    renames = {
        "patch_proj.": "patch_embed.proj.",
        "patch_norm.": "patch_embed.norm.",
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
    missing = [
        f"{src} (for {dst}, expected {list(shapes[dst])})"
        for src, dst in wanted.items()
        if src not in source
    ]
    unexpected = [f"{k} {list(source[k].shape)}" for k in source if k not in wanted]
    mismatched = [
        f"{src}: checkpoint {list(source[src].shape)} vs model {list(shapes[dst])} ({dst})"
        for src, dst in wanted.items()
        if src in source and tuple(source[src].shape) != shapes[dst]
    ]
    if missing or unexpected or mismatched:
        lines = [
            f"state dict does not match the glass-box ViT ({len(source)} source tensors, {len(shapes)} target):"
        ]
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
    glass.load_state_dict(
        {k: v.detach().clone() for k, v in state.items()}, strict=True, assign=True
    )
    return glass.train(model.training), audit
