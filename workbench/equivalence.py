"""Stage-by-stage comparison of the glass-box ViT with timm's VisionTransformer.

timm's activations are captured with forward hooks on its own modules; the glass-box
model records the same stage names itself. The comparison is exact by default
(tolerance 0.0 in fp32): both run the same operations in the same order.

A comparison is only as strong as its weights: timm's own init makes every norm weight 1,
every bias 0 and every LayerScale gamma the same constant, so a mapping that swaps two
such tensors computes the same function. ``randomize_every_tensor`` gives every tensor
its own seeded random values before a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from workbench.convert.timm_vit import MappingAudit, glassbox_from_timm, timm_key_for
from workbench.models.vit import VisionTransformer


# Where timm computes each glass-box stage: (module path relative to the model or the
# block, "out" for the module's output or "in" for its input).
_BLOCK_POINTS = {
    "norm1": ("norm1", "out"),
    "attn.qkv": ("attn.qkv", "out"),
    "attn.q_norm": ("attn.q_norm", "out"),
    "attn.k_norm": ("attn.k_norm", "out"),
    "attn.probs": ("attn.attn_drop", "out"),  # only reached on the unfused path
    "attn.norm": ("attn.norm", "out"),
    "attn": ("attn", "out"),
    "ls1": ("ls1", "out"),
    "resid1": ("norm2", "in"),
    "norm2": ("norm2", "out"),
    "mlp.norm": ("mlp.norm", "out"),
    "mlp": ("mlp", "out"),
    "ls2": ("ls2", "out"),
    "resid2": ("", "out"),
}
_MODEL_POINTS = {
    "patch_embed.norm": ("patch_embed.norm", "out"),
    "pos_add": ("pos_drop", "out"),
    "norm_pre": ("norm_pre", "out"),
    "norm": ("norm", "out"),
    "attn_pool.kv": ("attn_pool.kv", "out"),
    "attn_pool.attn": ("attn_pool.proj_drop", "out"),
    "attn_pool.norm": ("attn_pool.norm", "out"),
    "attn_pool.mlp": ("attn_pool.mlp", "out"),
    "fc_norm": ("fc_norm", "out"),
    "head": ("head", "out"),
}
# Stages timm computes inline, with no module to hook: compared through what follows them.
NOT_EXPOSED_BY_TIMM = ("attn_pool.probs",)


# Spread of a tensor whose init is (nearly) constant: large enough that a swapped or
# missing tensor changes every stage after it, small enough to keep activations finite.
_MIN_RANDOM_SCALE = 0.02


@torch.no_grad()
def randomize_every_tensor(model: nn.Module, seed: int) -> int:
    """Overwrite every float tensor of ``model``'s state dict with seeded random values.

    Each tensor gets its own independent draw (normal, scaled like its current values:
    the root mean square, at least 0.02), so no two tensors share values and no tensor is
    constant: norm weights and biases, LayerScale gammas, class/register tokens, position
    embeddings, projections and biases alike. Non-persistent buffers are derived values
    that no weight mapping carries and are left alone.

    Returns:
        The number of tensors randomised.
    """
    gen = torch.Generator().manual_seed(seed)
    count = 0
    for tensor in model.state_dict().values():  # shares storage with the parameters
        if not tensor.is_floating_point():
            continue
        scale = (
            max(tensor.double().pow(2).mean().sqrt().item(), _MIN_RANDOM_SCALE)
            if tensor.numel()
            else 0.0
        )
        values = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * scale
        tensor.copy_(values.to(dtype=tensor.dtype, device=tensor.device))
        count += 1
    return count


def _flatten_patches(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D), as timm's PatchEmbed does


def _timm_hook_points(
    model: nn.Module, glass: VisionTransformer
) -> list[tuple[str, nn.Module, str, object]]:
    """(stage name, timm module, "out" or "in", transform or None) for every comparable stage."""
    cfg = glass.cfg
    points = []
    for name in glass.stage_names():
        transform = None
        if name in NOT_EXPOSED_BY_TIMM:
            continue
        if name == "patch_embed":
            path, where, transform = "patch_embed.proj", "out", _flatten_patches
        elif name == "pool":
            if cfg.pooling == "map":
                path, where = "attn_pool", "out"
            else:
                path, where = ("fc_norm" if cfg.has_fc_norm else "head_drop"), "in"
        elif name.startswith("blocks."):
            _, index, stage = name.split(".", 2)
            sub, where = _BLOCK_POINTS[stage]
            path = f"blocks.{index}" + (f".{sub}" if sub else "")
        else:
            path, where = _MODEL_POINTS[name]
        points.append((name, model.get_submodule(path), where, transform))
    return points


def comparable_stages(glass: VisionTransformer) -> list[str]:
    """The glass-box stages that timm exposes through a module, in execution order."""
    return [n for n in glass.stage_names() if n not in NOT_EXPOSED_BY_TIMM]


def timm_forward_stages(
    model: nn.Module, x: torch.Tensor, glass: VisionTransformer
) -> tuple[torch.Tensor, dict]:
    """Run timm on ``x`` and capture its activations under glass-box stage names."""
    states: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name, transform, value):
        states[name] = transform(value) if transform else value

    for name, module, where, transform in _timm_hook_points(model, glass):
        if where == "out":
            handles.append(
                module.register_forward_hook(lambda m, i, o, n=name, t=transform: keep(n, t, o))
            )
        else:
            handles.append(
                module.register_forward_pre_hook(lambda m, i, n=name, t=transform: keep(n, t, i[0]))
            )
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return logits, states


@dataclass
class StageDiff:
    index: int
    stage: str
    shape: tuple[int, ...]
    max_abs_diff: float
    mean_abs_diff: float
    passed: bool


def compare_stages(
    reference: dict, ours: dict, order: list[str], tolerance: float
) -> list[StageDiff]:
    """Per-stage max/mean absolute difference; a stage absent on either side fails."""
    rows = []
    for index, name in enumerate(order):
        a, b = reference.get(name), ours.get(name)
        if a is None or b is None or a.shape != b.shape:
            rows.append(
                StageDiff(
                    index,
                    name,
                    tuple(b.shape if b is not None else ()),
                    float("nan"),
                    float("nan"),
                    False,
                )
            )
            continue
        diff = (a.detach().double() - b.detach().double()).abs()
        max_abs = diff.max().item()
        rows.append(
            StageDiff(
                index, name, tuple(a.shape), max_abs, diff.mean().item(), max_abs <= tolerance
            )
        )
    return rows


@dataclass
class EquivalenceReport:
    """Everything one equivalence run measured."""

    architecture: str
    tolerance: float
    audit: MappingAudit
    stages: list[StageDiff]
    gradients: pd.DataFrame
    fused: dict[str, list[StageDiff]] = field(default_factory=dict)
    # The models' plain forward() logits (no hook attached: the path training and
    # benchmarks run), on both attention paths; asserted like the stages.
    forward: list[StageDiff] = field(default_factory=list)
    # forward_intermediates() of both models with the same arguments; asserted too.
    intermediates: list[StageDiff] = field(default_factory=list)

    @property
    def stages_passed(self) -> int:
        return sum(s.passed for s in self.stages)

    @property
    def gradients_passed(self) -> int:
        return int((self.gradients["max_abs_diff"] <= self.tolerance).sum())

    @property
    def passed(self) -> bool:
        return (
            self.audit.complete
            and self.stages_passed == len(self.stages)
            and self.gradients_passed == len(self.gradients)
            and all(row.passed for row in self.forward)
            and all(row.passed for row in self.intermediates)
        )

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.stages), default=float("nan"))

    @property
    def forward_max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.forward), default=float("nan"))

    def stage_table(self) -> pd.DataFrame:
        return pd.DataFrame([vars(s) for s in self.stages])

    def forward_table(self) -> pd.DataFrame:
        return pd.DataFrame([vars(s) for s in self.forward + self.intermediates])

    def fused_table(self) -> pd.DataFrame:
        frames = [
            pd.DataFrame([vars(s) for s in rows]).assign(comparison=name)
            for name, rows in self.fused.items()
        ]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.architecture}: {self.audit.summary()}; "
            f"{self.stages_passed} of {len(self.stages)} stages within {self.tolerance:g} "
            f"(max difference {self.max_abs_diff:.3g}); "
            f"{sum(r.passed for r in self.forward)} of {len(self.forward)} forward() logits within {self.tolerance:g} "
            f"(max difference {self.forward_max_abs_diff:.3g}); "
            f"{sum(r.passed for r in self.intermediates)} of {len(self.intermediates)} forward_intermediates() "
            f"outputs within {self.tolerance:g}; "
            f"{self.gradients_passed} of {len(self.gradients)} gradients within {self.tolerance:g} "
            f"(max difference {self.gradients['max_abs_diff'].max():.3g})"
        )


def set_timm_fused(model: nn.Module, fused: bool) -> None:
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused


def training_loss(out: torch.Tensor, num_classes: int, seed: int) -> torch.Tensor:
    """Cross-entropy on seeded labels; without a classifier, a seeded projection of the features."""
    gen = torch.Generator().manual_seed(seed)
    if num_classes:
        labels = torch.randint(0, num_classes, (out.shape[0],), generator=gen).to(out.device)
        return F.cross_entropy(out, labels)
    weights = torch.randn(out.shape[1:], generator=gen).to(out.device)
    return (out * weights).sum() / out.shape[0]


def compare_gradients(
    timm_model: nn.Module, glass: VisionTransformer, x: torch.Tensor, seed: int
) -> pd.DataFrame:
    """Per-parameter max |grad difference| of the same loss on both models."""
    for model in (timm_model, glass):
        model.zero_grad(set_to_none=True)
        training_loss(model(x), glass.cfg.num_classes, seed).backward()
    theirs = dict(timm_model.named_parameters())
    rows = []
    for name, param in glass.named_parameters():
        other = theirs[timm_key_for(name)].grad
        diff = (param.grad.double() - other.double()).abs().max().item()
        rows.append(
            {
                "tensor": name,
                "timm_tensor": timm_key_for(name),
                "shape": tuple(param.shape),
                "max_abs_diff": diff,
            }
        )
    for model in (timm_model, glass):
        model.zero_grad(set_to_none=True)
    return pd.DataFrame(rows)


def intermediates_of(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``forward_intermediates`` with timm's default arguments and with prefix tokens, normed, NLC.

    Row names say which call: the glass-box model and timm must give the same tensors.
    """
    final, per_block = model.forward_intermediates(x)  # every block, NCHW, not normed
    rows = {"forward_intermediates() features": final}
    rows.update({f"forward_intermediates() block {i}": y for i, y in enumerate(per_block)})
    if getattr(model, "num_prefix_tokens", 0):
        pairs = model.forward_intermediates(
            x,
            indices=[0, -1],
            return_prefix_tokens=True,
            norm=True,
            output_fmt="NLC",
            intermediates_only=True,
        )
        for i, (spatial, prefix) in zip((0, -1), pairs):
            rows[f"forward_intermediates(normed, NLC) block {i} patches"] = spatial
            rows[f"forward_intermediates(normed, NLC) block {i} prefix"] = prefix
    return rows


def make_input(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A deterministic input batch: "gaussian" noise or "uniform" pixels normalised like ImageNet."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    if kind == "uniform":
        pixels = torch.rand(shape, generator=gen)
        mean = torch.tensor([0.485, 0.456, 0.406][: shape[1]] or [0.5]).view(1, -1, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225][: shape[1]] or [0.25]).view(1, -1, 1, 1)
        return (pixels - mean) / std
    raise ValueError(f"input kind {kind!r}: must be 'gaussian' or 'uniform'")


def run_equivalence(
    timm_model: nn.Module,
    architecture: str,
    batch: int = 2,
    seed: int = 0,
    tolerance: float = 0.0,
    input_kind: str = "gaussian",
    device: str = "cpu",
    gradients: bool = True,
) -> EquivalenceReport:
    """Compare timm (unfused attention) with the glass-box model stage by stage.

    Also compares both models' plain ``forward()`` logits, timm unfused against the
    glass-box written path and timm fused against the glass-box fast path (asserted:
    the same kernels run on each side), and measures, for the report only, timm's fused
    attention stage by stage against the glass-box fast and hand-written paths.
    """
    timm_model = timm_model.to(device).eval()
    glass, audit = glassbox_from_timm(timm_model)
    glass = glass.to(device).eval()
    cfg = glass.cfg
    x = make_input(input_kind, (batch, cfg.in_channels, *cfg.image_hw), seed).to(device)
    order = comparable_stages(glass)

    set_timm_fused(timm_model, False)
    with torch.no_grad():
        logits, ref = timm_forward_stages(timm_model, x, glass)
        _, ours = glass.set_fast_attention(False).forward_stages(x)
        stages = compare_stages(ref, ours, order, tolerance)
        # forward() with no hook attached: the fast path a training run takes (the stage
        # record above is the same body with recording hooks attached for one call).
        plain = {"forward()": glass(x)}
        ours_intermediates = intermediates_of(glass, x)

        set_timm_fused(timm_model, True)
        logits_fused, ref_fused = timm_forward_stages(timm_model, x, glass)
        fused_order = [n for n in order if not n.endswith("attn.probs")]
        _, ours_fast = glass.set_fast_attention(True).forward_stages(x)
        plain_fast = {"forward() fast attention": glass(x)}
        fused = {
            "timm_fused_vs_glassbox_fast": compare_stages(
                ref_fused, ours_fast, fused_order, tolerance
            ),
            "timm_fused_vs_glassbox_written": compare_stages(
                ref_fused, ours, fused_order, tolerance
            ),
        }
        # Same kernels on both sides (timm unfused vs written, timm fused vs fast): exact.
        timm_logits = {"forward()": logits, "forward() fast attention": logits_fused}
        forward = compare_stages(timm_logits, {**plain, **plain_fast}, list(timm_logits), tolerance)
        set_timm_fused(timm_model, False)
        theirs = intermediates_of(timm_model, x)
        intermediates = compare_stages(theirs, ours_intermediates, list(theirs), tolerance)
    set_timm_fused(timm_model, False)
    glass.set_fast_attention(False)
    grads = (
        compare_gradients(timm_model, glass, x, seed)
        if gradients
        else pd.DataFrame(columns=["tensor", "max_abs_diff"])
    )
    return EquivalenceReport(
        architecture, tolerance, audit, stages, grads, fused, forward, intermediates
    )
