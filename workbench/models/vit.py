"""Glass-box Vision Transformer written from basic layers.

The model has one forward body, read top-down: ``embed`` -> ``blocks`` -> ``norm`` ->
``forward_head``. It is spelled out op by op so that, with the same weights, it is the same
function as timm's ``VisionTransformer``: the operations are the ones timm runs, in the
same order, which is what makes a 0.0 difference possible rather than merely small.

Every intermediate activation with a stage name is a hook point on that body
(``workbench.models.hooks``): analysis mode, interventions and probes attach hooks for one
call; with none attached the forward is the fast path. ``stage_names`` comes from the
model's hook points.

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

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.models import activation_cache
from workbench.models.hooks import (
    HookPoint,
    UserHook,
    attached,
    hook_points,
    name_hook_points,
    record_hooks,
    user_hooks,
)
from workbench.models.vit_config import ViTConfig
from workbench.models.vit_layers import (
    AttentionPool,
    Attention,
    LayerScale,
    make_drop_path,
    make_mlp,
    make_norm,
)

__all__ = [
    "ViTConfig",
    "VisionTransformer",
    "Block",
    "Analysis",
    "count_parameters",
    "stage_names_of",
]


def _point_if(enabled: bool, local_name: str) -> nn.Module:
    # An option that is off has no stage: an identity that is not a hook point keeps the
    # body the same for every family without adding a name to the stage list.
    return HookPoint(local_name) if enabled else nn.Identity()


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x))).

    Stages, in execution order: norm1, attn.* (inside Attention), attn, ls1, resid1, norm2,
    mlp.* (inside the MLP), mlp, ls2, resid2 (ls1 / ls2 only with LayerScale).

    ``drop_path`` is this block's stochastic-depth rate (timm's ``drop_path1`` / ``drop_path2``
    on the branch after LayerScale, before the residual add; not a stage: ``resid1`` / ``resid2``
    see its result). At 0 both are ``nn.Identity``, as in timm.
    """

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        scaled = cfg.layer_scale_init is not None
        self.norm1 = make_norm(cfg)
        self.hook_norm1 = HookPoint("norm1")
        self.attn = Attention(cfg)
        self.hook_attn = HookPoint("attn")
        self.ls1 = LayerScale(cfg.dim, cfg.layer_scale_init) if scaled else nn.Identity()
        self.hook_ls1 = _point_if(scaled, "ls1")
        self.drop_path1 = make_drop_path(drop_path)
        self.hook_resid1 = HookPoint("resid1")
        self.norm2 = make_norm(cfg)
        self.hook_norm2 = HookPoint("norm2")
        self.mlp = make_mlp(cfg)
        self.hook_mlp = HookPoint("mlp")
        self.ls2 = LayerScale(cfg.dim, cfg.layer_scale_init) if scaled else nn.Identity()
        self.hook_ls2 = _point_if(scaled, "ls2")
        self.drop_path2 = make_drop_path(drop_path)
        self.hook_resid2 = HookPoint("resid2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, N, D)
        x = self.hook_resid1(
            x
            + self.drop_path1(
                self.hook_ls1(self.ls1(self.hook_attn(self.attn(self.hook_norm1(self.norm1(x))))))
            )
        )
        return self.hook_resid2(
            x
            + self.drop_path2(
                self.hook_ls2(self.ls2(self.hook_mlp(self.mlp(self.hook_norm2(self.norm2(x))))))
            )
        )


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
    """ViT with timm's method names: forward_features, forward_head, forward_intermediates, forward."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # How many prefix (class and register) tokens precede the patches. An intervention
        # that drops prefix tokens lowers it for its one call (as timm's attribute of the name).
        self.num_prefix_tokens = cfg.num_prefix_tokens
        # A strided convolution is the patch projection: one linear map per non-overlapping
        # patch. It is also timm's op, which keeps the comparison exact.
        self.patch_proj = nn.Conv2d(
            cfg.in_channels, cfg.dim, cfg.patch_hw, stride=cfg.patch_hw, bias=cfg.patch_bias
        )
        self.hook_patch_embed = HookPoint("patch_embed")
        self.patch_norm = make_norm(cfg) if cfg.embed_norm else None
        self.hook_patch_embed_norm = _point_if(cfg.embed_norm, "patch_embed.norm")
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.class_token else None
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, cfg.register_tokens, cfg.dim))
            if cfg.register_tokens
            else None
        )
        pos_len = cfg.num_patches + (0 if cfg.no_embed_class else cfg.num_prefix_tokens)
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, pos_len, cfg.dim)) if cfg.pos_embed == "learned" else None
        )
        # the position term added to the tokens (1, L, D): a finer hook point, not a stage
        self.hook_pos_embed = (
            HookPoint("pos_embed", stage=False) if cfg.pos_embed == "learned" else nn.Identity()
        )
        self.pos_drop = nn.Dropout(cfg.pos_dropout)
        self.hook_pos_add = HookPoint("pos_add")
        self.norm_pre = make_norm(cfg) if cfg.norm_pre else nn.Identity()
        self.hook_norm_pre = _point_if(cfg.norm_pre, "norm_pre")
        self.blocks = nn.ModuleList(Block(cfg, drop_path=rate) for rate in drop_path_rates(cfg))
        self.norm = make_norm(cfg) if cfg.has_norm else nn.Identity()
        self.hook_norm = _point_if(cfg.has_norm, "norm")
        self.attn_pool = AttentionPool(cfg) if cfg.pooling == "map" else None
        self.hook_pool = _point_if(cfg.pooling != "cls", "pool")
        self.fc_norm = make_norm(cfg) if cfg.has_fc_norm else nn.Identity()
        self.hook_fc_norm = _point_if(cfg.has_fc_norm, "fc_norm")
        self.head_drop = nn.Dropout(cfg.head_dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes) if cfg.num_classes else nn.Identity()
        self.hook_head = HookPoint("head")
        name_hook_points(self)
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

    # ---- the forward, top-down ------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, N, D)."""
        return self.forward_blocks(self.embed(x))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the tokens entering the first block (B, P + h*w, D)."""
        # (B, C, h, w) -> (B, h*w, D)
        x = self.hook_patch_embed(self.patch_proj(x).flatten(2).transpose(1, 2))
        if self.patch_norm is not None:
            x = self.hook_patch_embed_norm(self.patch_norm(x))
        x = self.hook_pos_add(self.pos_drop(self._add_prefix_and_positions(x)))
        return self.hook_norm_pre(self.norm_pre(x))

    def _add_prefix_and_positions(self, x: torch.Tensor) -> torch.Tensor:
        prefix = [
            t.expand(x.shape[0], -1, -1)
            for t in (self.cls_token, self.register_tokens)
            if t is not None
        ]
        if self.pos_embed is None:
            return torch.cat(prefix + [x], dim=1) if prefix else x
        pos = self.hook_pos_embed(self.pos_embed)  # (1, L, D)
        if self.cfg.no_embed_class:
            # positions cover patches only; prefix tokens are concatenated afterwards
            x = x + pos
            return torch.cat(prefix + [x], dim=1) if prefix else x
        x = torch.cat(prefix + [x], dim=1) if prefix else x  # (B, P + h*w, D)
        return x + pos

    def forward_blocks(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The tokens entering block ``start`` (B, N, D) -> the normalised tokens after the last block."""
        for block in self.blocks[start:]:
            x = block(x)
        return self.hook_norm(self.norm(x))

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, N, D) -> one vector per image (B, D)."""
        if self.cfg.pooling == "cls":
            return x[:, 0]
        if not self.cfg.pool_include_prefix:
            x = x[:, self.num_prefix_tokens :]  # patch tokens only
        x = self.attn_pool(x) if self.attn_pool is not None else x.mean(dim=1)
        return self.hook_pool(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.hook_fc_norm(self.fc_norm(self.pool(x))))
        return x if pre_logits else self.hook_head(self.head(x))

    # ---- timm's intermediates -------------------------------------------------------
    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
    ):
        """timm's ``VisionTransformer.forward_intermediates``: the blocks' outputs at ``indices``.

        Same arguments and outputs as timm's (an int takes the last n blocks, a list the
        blocks at those indices, negative from the end); see
        ``workbench.models.intermediates`` for the layout.
        """
        from workbench.models.intermediates import forward_intermediates

        return forward_intermediates(
            self,
            x,
            indices=indices,
            return_prefix_tokens=return_prefix_tokens,
            norm=norm,
            stop_early=stop_early,
            output_fmt=output_fmt,
            intermediates_only=intermediates_only,
            output_dict=output_dict,
        )

    # ---- recorded forwards (hooks on the one forward) --------------------------------
    def forward_stages(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward on the current attention path, returning logits and every stage.

        On the fast path there are no ``attn.probs`` stages: the fused kernel never
        materialises the attention map, and recording does not change the path.
        """
        states: dict[str, torch.Tensor] = {}
        names = [
            n
            for n in self.stage_names()
            if not (n.endswith("probs") and self._probs_owner_is_fast(n))
        ]
        with attached(self, record_hooks(states, names)):
            logits = self(x)
        return logits, {n: states[n] for n in self.stage_names() if n in states}

    def _probs_owner_is_fast(self, stage: str) -> bool:
        return bool(self.get_submodule(stage.rsplit(".", 1)[0]).fast)

    def forward_analysis(self, x: torch.Tensor) -> Analysis:
        """Run the written-out attention path and return every stage and attention map.

        Analysis always uses the hand-written attention, whatever the fast-path setting,
        so attention maps exist and do not depend on how the model is usually run.
        """
        states: dict[str, torch.Tensor] = {}
        with attached(
            self, record_hooks(states, self.stage_names())
        ):  # probs hooks: written-out path
            logits = self(x)
        attentions = [states[f"blocks.{i}.attn.probs"] for i in range(self.cfg.depth)]
        return Analysis(
            logits=logits,
            hidden_states=states,
            attentions=attentions,
            pool_attention=states.get("attn_pool.probs"),
        )

    # ---- TransformerLens's methods (workbench/models/activation_cache.py) ------------
    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Hook-point name -> hook point, every stage and finer point in module order (TL's ``hook_dict``)."""
        return hook_points(self)

    def run_with_cache(
        self,
        x: torch.Tensor,
        names_filter: activation_cache.NamesFilter = None,
        incl_bwd: bool = False,
        fwd_hooks: Iterable[tuple[str, UserHook]] = (),
        metric: activation_cache.Metric | None = None,
    ) -> tuple[torch.Tensor, activation_cache.ActivationCache]:
        """``(logits, cache)`` of one forward: ``activation_cache.run_with_cache`` on this model."""
        return activation_cache.run_with_cache(self, x, names_filter, fwd_hooks, incl_bwd, metric)

    def run_with_hooks(
        self,
        x: torch.Tensor,
        fwd_hooks: Iterable[tuple[str, UserHook]] = (),
        bwd_hooks: Iterable[tuple[str, UserHook]] = (),
        metric: activation_cache.Metric | None = None,
    ) -> torch.Tensor:
        """Logits of one forward with hooks: ``activation_cache.run_with_hooks`` on this model."""
        return activation_cache.run_with_hooks(self, x, fwd_hooks, bwd_hooks, metric)

    @contextlib.contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[str, UserHook]] = (),
        bwd_hooks: Iterable[tuple[str, UserHook]] = (),
    ) -> Iterator[VisionTransformer]:
        """Hooks ``fn(tensor, hook)`` for the ``with`` block (TL's ``model.hooks``), removed when it ends.

        A backward inside the block runs the ``bwd_hooks`` on the gradients at their points.
        """
        with user_hooks(self, fwd_hooks, bwd_hooks):
            yield self

    def stage_names(self) -> list[str]:
        """Stage names in execution order: the model's hook points that are stages.

        The finer hook points (``blocks.i.attn.z``, ``pos_embed``) are not in the list; they
        are addressable by name (``hook_points(model)``, ``attached``).
        """
        return list(hook_points(self, stages_only=True))


def drop_path_rates(cfg: ViTConfig) -> list[float]:
    """Each block's stochastic-depth rate: timm's linear rule ``linspace(0, drop_path_rate, depth)``.

    timm is imported only when the rate is set: a plain model's import and build stay as they were.
    """
    if not cfg.drop_path_rate:
        return [0.0] * cfg.depth
    from timm.layers import calculate_drop_path_rates

    return calculate_drop_path_rates(cfg.drop_path_rate, cfg.depth)


def stage_names_of(cfg: ViTConfig) -> list[str]:
    """The stage names of a model with config ``cfg``, without building its weights."""
    return list(_stage_names_cached(cfg))


def _stage_names_cached(cfg: ViTConfig) -> tuple[str, ...]:
    key = repr(cfg)
    if key not in _STAGE_CACHE:
        with torch.device("meta"):  # no memory, no init cost: only the module tree is needed
            _STAGE_CACHE[key] = tuple(VisionTransformer(cfg).stage_names())
    return _STAGE_CACHE[key]


_STAGE_CACHE: dict[str, tuple[str, ...]] = {}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(number of parameters, number of parameter tensors)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)
