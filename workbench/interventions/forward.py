"""The intervened forward: the model's own submodules, called in the model's order, with edit points.

``run(model, x, interventions)`` evaluates an unmodified ``VisionTransformer`` under
interventions. Without any, it is ``model(x)`` itself: nothing is hooked, nothing is
copied. With some, it runs ``mirrored_forward``: ``VisionTransformer._embed``,
``Block.forward`` and ``forward_head`` written again from the model's submodules (same
calls, same order, so with no edit it is bitwise ``model(x)``; tests prove it on every
family), with an edit point at every stage that is not a module's output (``pos_add``,
``blocks.i.resid1``, ``blocks.i.resid2``, ...). Stages inside a module (``attn.qkv``,
``attn.probs``, ``attn.norm``, ``mlp.norm``, ``attn_pool.*``) are reached by forward
hooks on that module, and per-head ablation by a forward pre-hook on
``blocks.i.attn.out_proj`` (its input is the heads concatenated, ``(B, N, heads * d)``).
Hooks exist only for the duration of one call.

Where a head is ablated: at the input of ``out_proj``. For families with ``attn.norm``
(``scale_attn_norm``) that is after the norm over all heads, so the ablated head still took
part in that norm; zero-ablating every head then leaves exactly ``out_proj``'s bias, as in
every other family.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from workbench.interventions.spec import (
    DropTokens, HeadAblation, Intervention, InterventionError, PatchStage, SkipBranch, ZeroPosEmbed, check,
    patchable_stages,
)
from workbench.models.vit import VisionTransformer


@dataclass(frozen=True)
class HeadMeans:
    """Per-head reference means: for each block, the mean over reference images of ``out_proj``'s input.

    Attributes:
        per_block: One ``(N, heads * d)`` float32 tensor per block: the mean at each token
            position (a head's mean is its ``d``-wide slice).
        images: How many reference images the means are over.
    """

    per_block: tuple[torch.Tensor, ...]
    images: int


# stage suffix inside a block -> (submodule path below the block, what replaces the stage)
_BLOCK_HOOKED = {"attn.qkv": "attn.qkv", "attn.q_norm": "attn.q_norm", "attn.k_norm": "attn.k_norm",
                 "attn.probs": "attn.attn_drop", "attn.norm": "attn.norm", "mlp.norm": "mlp.norm"}
_AFTER_BLOCKS = ("norm", "pool", "fc_norm", "head")
_POOL_HOOKED = {"attn_pool.kv": "attn_pool.kv", "attn_pool.attn": "attn_pool.proj_drop",
                "attn_pool.norm": "attn_pool.norm", "attn_pool.mlp": "attn_pool.mlp"}


def _hooked_module(stage: str) -> str | None:
    """The submodule whose output is ``stage``, for stages computed inside a module."""
    if stage in _POOL_HOOKED:
        return _POOL_HOOKED[stage]
    parts = stage.split(".", 2)
    if parts[0] == "blocks" and len(parts) == 3 and parts[2] in _BLOCK_HOOKED:
        return f"blocks.{parts[1]}.{_BLOCK_HOOKED[parts[2]]}"
    return None


class _Plan:
    """What one intervened call does at each edit point."""

    def __init__(self, singles, patches: Mapping[str, torch.Tensor], means: HeadMeans | None,
                 record: dict[str, torch.Tensor] | None, wanted: set[str]) -> None:
        self.skip = {(s.block, s.branch) for s in singles if isinstance(s, SkipBranch)}
        self.zero_pos = any(isinstance(s, ZeroPosEmbed) for s in singles)
        self.drop = {s.tokens for s in singles if isinstance(s, DropTokens)}
        self.heads: dict[int, list[HeadAblation]] = {}
        for s in singles:
            if isinstance(s, HeadAblation):
                self.heads.setdefault(s.block, []).append(s)
        stages = [s.stage for s in singles if isinstance(s, PatchStage)]
        missing = [s for s in stages if s not in patches]
        if missing:
            raise InterventionError(f"{missing[0]}.patch: no stored activation given for stage {missing[0]!r}")
        self.patches = {s: patches[s] for s in stages}
        if any(h.mode == "mean" for hs in self.heads.values() for h in hs) and means is None:
            raise InterventionError("mean ablation needs the reference means (head_means=...)")
        self.means = means
        self.record, self.wanted = record, wanted

    def at(self, stage: str, x: torch.Tensor) -> torch.Tensor:
        """The edit point of ``stage``: record it, or replace it by its stored value."""
        if self.record is not None and stage in self.wanted:
            self.record[stage] = x
        value = self.patches.get(stage)
        if value is None:
            return x
        if value.shape != x.shape:
            raise InterventionError(f"{stage}.patch: stored activation has shape {tuple(value.shape)}, the stage "
                                    f"has {tuple(x.shape)}")
        return value.to(dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------------------ the mirror


def _embed(model: VisionTransformer, x: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, int]:
    """``VisionTransformer._embed`` with edit points; returns the tokens and the prefix count left."""
    cfg = model.cfg
    x = model.patch_proj(x).flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, D)
    x = plan.at("patch_embed", x)
    if model.patch_norm is not None:
        x = plan.at("patch_embed.norm", model.patch_norm(x))
    prefix = [t.expand(x.shape[0], -1, -1) for t in (model.cls_token, model.register_tokens) if t is not None]
    pos = model.pos_embed
    if pos is not None and plan.zero_pos:
        pos = torch.zeros_like(pos)  # the model's parameter is never touched
    if pos is None:
        x = torch.cat(prefix + [x], dim=1) if prefix else x
    elif cfg.no_embed_class:
        x = x + pos
        x = torch.cat(prefix + [x], dim=1) if prefix else x
    else:
        x = torch.cat(prefix + [x], dim=1) if prefix else x  # (B, P + h*w, D)
        x = x + pos
    x = plan.at("pos_add", model.pos_drop(x))
    n_prefix = cfg.num_prefix_tokens
    if plan.drop:
        x, n_prefix = _drop_tokens(x, cfg, plan.drop)
    if model.norm_pre is not None:
        x = plan.at("norm_pre", model.norm_pre(x))
    return x, n_prefix


def _drop_tokens(x: torch.Tensor, cfg, drop: set[str]) -> tuple[torch.Tensor, int]:
    # Layout: [class token] [register tokens] [patches]; the kept tokens keep their positions.
    first_register = int(cfg.class_token)
    removed = set(range(first_register, first_register + cfg.register_tokens)) if "registers" in drop else set()
    removed |= {0} if "class" in drop else set()
    keep = torch.tensor([i for i in range(x.shape[1]) if i not in removed], device=x.device)
    return x.index_select(1, keep), cfg.num_prefix_tokens - len(removed)  # (B, N - removed, D)


def _block(block: nn.Module, i: int, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``Block.forward`` (``x + ls1(attn(norm1(x)))``, then the MLP) with edit points."""
    p = f"blocks.{i}."
    if (i, "attn") not in plan.skip:
        h = plan.at(f"{p}norm1", block.norm1(x))
        h = plan.at(f"{p}attn", block.attn(h))
        h = block.ls1(h)  # nn.Identity without LayerScale: the same tensor
        if not isinstance(block.ls1, nn.Identity):
            h = plan.at(f"{p}ls1", h)
        x = x + h
    x = plan.at(f"{p}resid1", x)
    if (i, "mlp") not in plan.skip:
        h = plan.at(f"{p}norm2", block.norm2(x))
        h = plan.at(f"{p}mlp", block.mlp(h))
        h = block.ls2(h)
        if not isinstance(block.ls2, nn.Identity):
            h = plan.at(f"{p}ls2", h)
        x = x + h
    return plan.at(f"{p}resid2", x)


def _head(model: VisionTransformer, x: torch.Tensor, n_prefix: int, plan: _Plan) -> torch.Tensor:
    """``forward_head(pool(x))`` with edit points; ``n_prefix`` is the prefix left after dropping tokens."""
    cfg = model.cfg
    if cfg.pooling == "cls":
        x = x[:, 0]
    else:
        if not cfg.pool_include_prefix:
            x = x[:, n_prefix:]  # patch tokens only
        x = model.attn_pool(x) if model.attn_pool is not None else x.mean(dim=1)
        x = plan.at("pool", x)
    if cfg.has_fc_norm:
        x = plan.at("fc_norm", model.fc_norm(x))
    x = model.head_drop(x)
    return plan.at("head", model.head(x))


def _forward(model: VisionTransformer, x: torch.Tensor, plan: _Plan, start: int = -1) -> torch.Tensor:
    """The whole forward from images, or from the tokens ``x`` entering block ``start`` (>= 0)."""
    x, n_prefix = _embed(model, x, plan) if start < 0 else (x, model.cfg.num_prefix_tokens)
    for i in range(max(start, 0), len(model.blocks)):
        x = _block(model.blocks[i], i, x, plan)
    x = model.norm(x)
    if model.cfg.has_norm:
        x = plan.at("norm", x)
    return _head(model, x, n_prefix, plan)


# ------------------------------------------------------------------------------ hooks


def _head_hook(block: int, ablations: list[HeadAblation], heads: int, means: HeadMeans | None):
    def hook(module: nn.Module, args: tuple) -> tuple:
        (x,) = args
        B, N, C = x.shape
        d = C // heads
        x = x.clone()
        view = x.view(B, N, heads, d)  # (B, N, heads, d): the heads concatenated by Attention
        for a in ablations:
            if a.mode == "zero":
                view[:, :, a.head] = 0.0
            else:
                mean = means.per_block[block]
                if mean.shape != (N, C):
                    raise InterventionError(f"{a.name}: reference mean has shape {tuple(mean.shape)}, "
                                            f"the heads have {(N, C)} per image")
                view[:, :, a.head] = mean[:, a.head * d:(a.head + 1) * d].to(x.dtype)  # (N, d) broadcast over B
        return (x,)

    return hook


def _stage_hook(stage: str, plan: _Plan):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return plan.at(stage, output)

    return hook


@contextlib.contextmanager
def _hooks(model: VisionTransformer, plan: _Plan, stages: Iterable[str]):
    """Hooks for the head ablations and the in-module stages of this call; removed on exit."""
    handles, fast = [], []
    try:
        for block, ablations in plan.heads.items():
            out_proj = model.blocks[block].attn.out_proj
            handles.append(out_proj.register_forward_pre_hook(
                _head_hook(block, ablations, model.cfg.heads, plan.means)))
        for stage in stages:
            path = _hooked_module(stage)
            if path is None:
                continue
            handles.append(model.get_submodule(path).register_forward_hook(_stage_hook(stage, plan)))
            if stage.endswith("attn.probs"):  # the map exists only on the written-out path
                attn = model.get_submodule(path.rsplit(".", 1)[0])
                fast.append((attn, attn.fast))
                attn.fast = False
        yield
    finally:
        for handle in handles:
            handle.remove()
        for attn, was_fast in fast:
            attn.fast = was_fast


# ------------------------------------------------------------------------------ public


def _eval_only(model: VisionTransformer) -> None:
    if not isinstance(model, VisionTransformer):
        raise InterventionError(f"interventions act on the glass-box VisionTransformer, not {type(model).__name__}")
    if model.training:
        raise InterventionError("interventions measure the trained function: call model.eval() first "
                                "(dropout would make every edit a random one)")


def first_edit_block(depth: int, singles) -> int:
    """The first block an edit touches: the forward may start from the tokens entering it.

    -1: an edit before the blocks (positions, tokens, ``patch_embed``, ``pos_add``, ...);
    ``depth``: edits only after the last block (``norm``, pooling, ``head``).
    """
    first = depth
    for s in singles:
        if isinstance(s, (HeadAblation, SkipBranch)):
            first = min(first, s.block)
        elif isinstance(s, PatchStage) and s.stage.startswith("blocks."):
            first = min(first, int(s.stage.split(".")[1]))
        elif isinstance(s, PatchStage) and (s.stage in _AFTER_BLOCKS or s.stage.startswith("attn_pool.")):
            continue
        else:
            return -1
    return first


def run(model: VisionTransformer, x: torch.Tensor, interventions: tuple[Intervention, ...] | list[Intervention] = (),
        patches: Mapping[str, torch.Tensor] | None = None, head_means: HeadMeans | None = None,
        resume: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits of ``model`` on ``x`` under ``interventions`` (applied together).

    Args:
        model: A glass-box ViT in eval mode; it is not modified.
        x: Images ``(B, C, H, W)``, normalised as the model expects.
        interventions: Validated against the model first (``spec.check``).
        patches: Stage -> stored activation ``(B, ...)`` for each ``PatchStage``.
        head_means: Reference means for ``mean`` head ablations (``head_means(...)``).
        resume: ``(k, tokens)``: start from the intact tokens entering block ``k``
            (``block_inputs``) instead of from ``x``; every edit must lie at or after block ``k``.
            The blocks before ``k`` would compute exactly those tokens again.

    Returns:
        Logits ``(B, classes)``. With no intervention (and no ``resume``) this is ``model(x)`` itself.
    """
    _eval_only(model)
    singles = check(model.cfg, interventions)
    if not singles and resume is None:
        return model(x)  # nothing hooked, nothing mirrored: the default path
    start = -1
    if resume is not None:
        start, x = resume
        if not 0 <= start <= first_edit_block(model.cfg.depth, singles):
            raise InterventionError(f"resume at block {start}: the interventions edit block "
                                    f"{first_edit_block(model.cfg.depth, singles)} or earlier")
    plan = _Plan(singles, patches or {}, head_means, None, set())
    with _hooks(model, plan, plan.patches):
        return _forward(model, x, plan, start)


def block_inputs(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Intact logits and the tokens entering each block; entry ``depth`` is the last block's output."""
    cfg = model.cfg
    first = "norm_pre" if cfg.norm_pre else "pos_add"
    ends = [f"blocks.{i}.resid2" for i in range(cfg.depth)]
    record: dict[str, torch.Tensor] = {}
    logits = _forward(model, x, _Plan((), {}, None, record, {first, *ends}))
    return logits, [record[first]] + [record[s] for s in ends]


def mirrored_forward(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """The mirror with no edit at all (for the proofs that it is ``model(x)``)."""
    return _forward(model, x, _Plan((), {}, None, None, set()))


def capture(model: VisionTransformer, x: torch.Tensor, stages: Iterable[str] | None = None,
            interventions: tuple[Intervention, ...] | list[Intervention] = (),
            head_means: HeadMeans | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the activations of ``stages`` (default: every patchable stage), for patching later.

    ``attn.probs`` stages are read on the written-out attention path, as ``forward_analysis`` does.
    """
    _eval_only(model)
    valid = patchable_stages(model.cfg)
    wanted = list(valid if stages is None else stages)
    unknown = [s for s in wanted if s not in valid]
    if unknown:
        check(model.cfg, [PatchStage(unknown[0])])  # raises the one-line error listing the valid stages
    singles = check(model.cfg, interventions)
    if any(isinstance(s, PatchStage) for s in singles):
        raise InterventionError("capture records activations; patch them with run(..., patches=...)")
    record: dict[str, torch.Tensor] = {}
    plan = _Plan(singles, {}, head_means, record, set(wanted))
    with _hooks(model, plan, wanted):
        logits = _forward(model, x, plan)
    return logits, {s: record[s] for s in wanted if s in record}


@torch.no_grad()
def head_means(model: VisionTransformer, batches: Iterable[torch.Tensor]) -> HeadMeans:
    """Each block's mean ``out_proj`` input over the reference images, per token position.

    The model runs intact (``model(x)``); pre-hooks only read. Sums are kept in float64.
    """
    _eval_only(model)
    sums: list[torch.Tensor | None] = [None] * len(model.blocks)
    handles = []

    def reader(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            part = args[0].double().sum(dim=0)  # (N, heads * d)
            sums[i] = part if sums[i] is None else sums[i] + part
        return hook

    count = 0
    try:
        for i, block in enumerate(model.blocks):
            handles.append(block.attn.out_proj.register_forward_pre_hook(reader(i)))
        for x in batches:
            model(x)
            count += x.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    if not count:
        raise InterventionError("mean ablation needs at least one reference image")
    return HeadMeans(tuple((s / count).float() for s in sums), count)
