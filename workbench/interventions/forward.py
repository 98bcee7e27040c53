"""Interventions as hooks on the glass-box ViT's one forward.

``run(model, x, interventions)`` evaluates an unmodified ``VisionTransformer`` under
interventions. Without any, it is ``model(x)`` itself: nothing is attached. With some,
it is still ``model(x)``, with hooks attached for that one call at the model's hook points
(``workbench.models.hooks``):

- ``<stage>.patch``: the stage's hook point returns the stored activation;
- ``blocks.i.attn|mlp.skip``: the branch's last hook point (``ls1``/``ls2`` with LayerScale,
  else ``attn``/``mlp``) returns zeros, so the residual adds nothing (``x + 0`` is ``x``);
- ``tokens.registers|class.drop``: the ``pos_add`` hook point returns the sequence without
  those tokens (the kept tokens keep their positions), and the model's prefix count is
  lowered for the call, so pooling reads the same patch tokens;
- ``pos_embed.zero``: the ``pos_embed`` hook point (the position term added to the tokens)
  returns zeros; the parameter is never touched;
- ``blocks.i.attn.head<h>.zero|mean``: the hook point holding the heads right before
  ``blocks.i.attn.out_proj`` replaces head ``h``'s slice: ``blocks.i.attn.z``, each head's
  output ``(B, N, heads, d)``, or in families with ``attn.norm`` that norm's stage
  ``blocks.i.attn.norm`` ``(B, N, heads * d)``, which is ``out_proj``'s input there.

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

from workbench.interventions.spec import (
    DropTokens,
    HeadAblation,
    Intervention,
    InterventionError,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
    check,
    patchable_stages,
)
from workbench.models.hooks import attached, record_hooks
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


_AFTER_BLOCKS = ("norm", "pool", "fc_norm", "head")


class _Plan:
    """What one intervened call attaches: stage hooks, head pre-hooks, the prefix count, the positions."""

    def __init__(
        self,
        model: VisionTransformer,
        singles,
        patches: Mapping[str, torch.Tensor],
        means: HeadMeans | None,
    ) -> None:
        cfg = model.cfg
        self.heads: dict[int, list[HeadAblation]] = {}
        for s in singles:
            if isinstance(s, HeadAblation):
                self.heads.setdefault(s.block, []).append(s)
        if any(h.mode == "mean" for hs in self.heads.values() for h in hs) and means is None:
            raise InterventionError("mean ablation needs the reference means (head_means=...)")
        self.means = means
        stages = [s.stage for s in singles if isinstance(s, PatchStage)]
        missing = [s for s in stages if s not in patches]
        if missing:
            raise InterventionError(
                f"{missing[0]}.patch: no stored activation given for stage {missing[0]!r}"
            )
        self.hooks = [(s, _replacer(s, patches[s])) for s in stages]
        for s in singles:
            if isinstance(s, SkipBranch):
                last = (
                    ("ls1" if s.branch == "attn" else "ls2")
                    if cfg.layer_scale_init is not None
                    else s.branch
                )
                self.hooks.append((f"blocks.{s.block}.{last}", torch.zeros_like))
        drop = {s.tokens for s in singles if isinstance(s, DropTokens)}
        self.prefix_left = cfg.num_prefix_tokens
        if drop:
            keep, self.prefix_left = _kept_tokens(cfg, drop)
            # (B, N - dropped, D)
            self.hooks.append(("pos_add", lambda x: x.index_select(1, keep.to(x.device))))
        self.zero_pos = any(isinstance(s, ZeroPosEmbed) for s in singles)
        if self.zero_pos:
            self.hooks.append(("pos_embed", torch.zeros_like))
        # after any patch on the same point: the head edit is what out_proj receives
        for block, ablations in self.heads.items():
            self.hooks.append(
                (heads_point(cfg, block), _head_hook(block, ablations, cfg.heads, means))
            )


def _replacer(stage: str, value: torch.Tensor):
    def replace(x: torch.Tensor) -> torch.Tensor:
        if value.shape != x.shape:
            raise InterventionError(
                f"{stage}.patch: stored activation has shape {tuple(value.shape)}, the stage "
                f"has {tuple(x.shape)}"
            )
        return value.to(dtype=x.dtype, device=x.device)

    return replace


def _kept_tokens(cfg, drop: set[str]) -> tuple[torch.Tensor, int]:
    # Layout: [class token] [register tokens] [patches]; the kept tokens keep their positions.
    first_register = int(cfg.class_token)
    removed = (
        set(range(first_register, first_register + cfg.register_tokens))
        if "registers" in drop
        else set()
    )
    removed |= {0} if "class" in drop else set()
    total = cfg.num_prefix_tokens + cfg.num_patches
    return torch.tensor([i for i in range(total) if i not in removed]), cfg.num_prefix_tokens - len(
        removed
    )


# ------------------------------------------------------------------------------ hooks


def heads_point(cfg, block: int) -> str:
    """The hook point whose value, seen as heads, is block ``block``'s ``out_proj`` input."""
    return f"blocks.{block}.attn.norm" if cfg.scale_attn_norm else f"blocks.{block}.attn.z"


def _head_hook(block: int, ablations: list[HeadAblation], heads: int, means: HeadMeans | None):
    def hook(x: torch.Tensor) -> torch.Tensor:
        B, N = x.shape[:2]
        C = x.shape[2] * x.shape[3] if x.dim() == 4 else x.shape[2]
        d = C // heads
        x = x.clone()
        view = x if x.dim() == 4 else x.view(B, N, heads, d)  # (B, N, heads, d)
        for a in ablations:
            if a.mode == "zero":
                view[:, :, a.head] = 0.0
            else:
                mean = means.per_block[block]
                if mean.shape != (N, C):
                    raise InterventionError(
                        f"{a.name}: reference mean has shape {tuple(mean.shape)}, "
                        f"the heads have {(N, C)} per image"
                    )
                # (N, d) broadcast over B
                view[:, :, a.head] = mean[:, a.head * d : (a.head + 1) * d].to(x.dtype)
        return x

    return hook


@contextlib.contextmanager
def _attached(model: VisionTransformer, plan: _Plan, extra: list):
    """Every hook of ``plan`` (after ``extra``, the recorders), for one call; removed on exit."""
    try:
        model.num_prefix_tokens = plan.prefix_left
        with attached(model, extra + plan.hooks):
            yield
    finally:
        model.num_prefix_tokens = model.cfg.num_prefix_tokens


def _call(model: VisionTransformer, x: torch.Tensor, plan: _Plan, start: int = -1) -> torch.Tensor:
    """The model's forward from images, or from the tokens ``x`` entering block ``start`` (>= 0)."""
    if start < 0:
        return model(x)
    if plan.zero_pos:
        raise InterventionError(
            "pos_embed.zero acts before the blocks: it cannot resume at a block"
        )
    return model.forward_head(model.forward_blocks(x, start))


# ------------------------------------------------------------------------------ public


def _eval_only(model: VisionTransformer) -> None:
    if not isinstance(model, VisionTransformer):
        raise InterventionError(
            f"interventions act on the glass-box VisionTransformer, not {type(model).__name__}"
        )
    if model.training:
        raise InterventionError(
            "interventions measure the trained function: call model.eval() first "
            "(dropout would make every edit a random one)"
        )


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
        elif isinstance(s, PatchStage) and (
            s.stage in _AFTER_BLOCKS or s.stage.startswith("attn_pool.")
        ):
            continue
        else:
            return -1
    return first


def run(
    model: VisionTransformer,
    x: torch.Tensor,
    interventions: tuple[Intervention, ...] | list[Intervention] = (),
    patches: Mapping[str, torch.Tensor] | None = None,
    head_means: HeadMeans | None = None,
    resume: tuple[int, torch.Tensor] | None = None,
) -> torch.Tensor:
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
        return model(x)  # nothing attached: the default path
    start = -1
    if resume is not None:
        start, x = resume
        if not 0 <= start <= first_edit_block(model.cfg.depth, singles):
            raise InterventionError(
                f"resume at block {start}: the interventions edit block "
                f"{first_edit_block(model.cfg.depth, singles)} or earlier"
            )
    plan = _Plan(model, singles, patches or {}, head_means)
    with _attached(model, plan, []):
        return _call(model, x, plan, start)


def block_inputs(
    model: VisionTransformer, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Intact logits and the tokens entering each block; entry ``depth`` is the last block's output."""
    cfg = model.cfg
    first = "norm_pre" if cfg.norm_pre else "pos_add"
    ends = [f"blocks.{i}.resid2" for i in range(cfg.depth)]
    record: dict[str, torch.Tensor] = {}
    with attached(model, record_hooks(record, [first, *ends])):
        logits = model(x)
    return logits, [record[first]] + [record[s] for s in ends]


def capture(
    model: VisionTransformer,
    x: torch.Tensor,
    stages: Iterable[str] | None = None,
    interventions: tuple[Intervention, ...] | list[Intervention] = (),
    head_means: HeadMeans | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the activations of ``stages`` (default: every patchable stage), for patching later.

    ``attn.probs`` stages are read on the written-out attention path, as ``forward_analysis`` does.
    """
    _eval_only(model)
    valid = patchable_stages(model.cfg)
    wanted = list(valid if stages is None else stages)
    unknown = [s for s in wanted if s not in valid]
    if unknown:
        # raises the one-line error listing the valid stages
        check(model.cfg, [PatchStage(unknown[0])])
    singles = check(model.cfg, interventions)
    if any(isinstance(s, PatchStage) for s in singles):
        raise InterventionError(
            "capture records activations; patch them with run(..., patches=...)"
        )
    record: dict[str, torch.Tensor] = {}
    plan = _Plan(model, singles, {}, head_means)
    with _attached(model, plan, record_hooks(record, wanted)):
        logits = _call(model, x, plan)
    return logits, {s: record[s] for s in wanted if s in record}


@torch.no_grad()
def head_means(model: VisionTransformer, batches: Iterable[torch.Tensor]) -> HeadMeans:
    """Each block's mean ``out_proj`` input over the reference images, per token position.

    The model runs intact (``model(x)``); hooks on each block's heads point only read. Sums
    are kept in float64.
    """
    _eval_only(model)
    cfg = model.cfg
    sums: list[torch.Tensor | None] = [None] * len(model.blocks)

    def reader(i: int):
        def hook(x: torch.Tensor) -> None:
            part = x.reshape(x.shape[0], x.shape[1], cfg.dim).double().sum(dim=0)  # (N, heads * d)
            sums[i] = part if sums[i] is None else sums[i] + part

        return hook

    count = 0
    with attached(model, [(heads_point(cfg, i), reader(i)) for i in range(len(model.blocks))]):
        for x in batches:
            model(x)
            count += x.shape[0]
    if not count:
        raise InterventionError("mean ablation needs at least one reference image")
    return HeadMeans(tuple((s / count).float() for s in sums), count)
