"""Stage-by-stage comparison of the glass-box ViT with timm's VisionTransformer.

timm's activations are captured with forward hooks on its own modules; the glass-box
model records the same stage names itself. The comparison is exact by default
(tolerance 0.0 in fp32): both run the same operations in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from workbench.convert.timm_vit import MappingAudit, glassbox_from_timm, timm_key_for
from workbench.models.vit import VisionTransformer


def _timm_hook_points(model: nn.Module, pooling: str, uses_fc_norm: bool) -> list[tuple[str, nn.Module, str]]:
    """(stage name, timm module, "out" or "in") in execution order."""
    points: list[tuple[str, nn.Module, str]] = [("patch_embed", model.patch_embed, "out"), ("pos_add", model.pos_drop, "out")]
    for i, b in enumerate(model.blocks):
        p = f"blocks.{i}."
        points += [
            (p + "norm1", b.norm1, "out"),
            (p + "attn.qkv", b.attn.qkv, "out"),
            (p + "attn.probs", b.attn.attn_drop, "out"),  # only reached on the unfused path
            (p + "attn", b.attn, "out"),
            (p + "resid1", b.norm2, "in"),
            (p + "norm2", b.norm2, "out"),
            (p + "mlp", b.mlp, "out"),
            (p + "resid2", b, "out"),
        ]
    if not uses_fc_norm:
        points.append(("norm", model.norm, "out"))
    if pooling == "mean":
        points.append(("pool", model.fc_norm if uses_fc_norm else model.head_drop, "in"))
    if uses_fc_norm:
        points.append(("fc_norm", model.fc_norm, "out"))
    points.append(("head", model.head, "out"))
    return points


def timm_forward_stages(model: nn.Module, x: torch.Tensor, glass: VisionTransformer) -> tuple[torch.Tensor, dict]:
    """Run timm on ``x`` and capture its activations under glass-box stage names."""
    states: dict[str, torch.Tensor] = {}
    handles = []
    for name, module, where in _timm_hook_points(model, glass.cfg.pooling, glass.cfg.uses_fc_norm):
        if where == "out":
            handles.append(module.register_forward_hook(lambda m, i, o, name=name: states.__setitem__(name, o)))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, i, name=name: states.__setitem__(name, i[0])))
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


def compare_stages(reference: dict, ours: dict, order: list[str], tolerance: float) -> list[StageDiff]:
    """Per-stage max/mean absolute difference; a stage absent on either side fails."""
    rows = []
    for index, name in enumerate(order):
        a, b = reference.get(name), ours.get(name)
        if a is None or b is None or a.shape != b.shape:
            rows.append(StageDiff(index, name, tuple(b.shape if b is not None else ()), float("nan"), float("nan"), False))
            continue
        diff = (a.detach().double() - b.detach().double()).abs()
        max_abs = diff.max().item()
        rows.append(StageDiff(index, name, tuple(a.shape), max_abs, diff.mean().item(), max_abs <= tolerance))
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
        )

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.stages), default=float("nan"))

    def stage_table(self) -> pd.DataFrame:
        return pd.DataFrame([vars(s) for s in self.stages])

    def fused_table(self) -> pd.DataFrame:
        frames = [pd.DataFrame([vars(s) for s in rows]).assign(comparison=name) for name, rows in self.fused.items()]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.architecture}: {self.audit.summary()}; "
            f"{self.stages_passed} of {len(self.stages)} stages within {self.tolerance:g} "
            f"(max difference {self.max_abs_diff:.3g}); "
            f"{self.gradients_passed} of {len(self.gradients)} gradients within {self.tolerance:g} "
            f"(max difference {self.gradients['max_abs_diff'].max():.3g})"
        )


def set_timm_fused(model: nn.Module, fused: bool) -> None:
    for block in model.blocks:
        block.attn.fused_attn = fused


def compare_gradients(timm_model: nn.Module, glass: VisionTransformer, x: torch.Tensor, seed: int) -> pd.DataFrame:
    """Per-parameter max |grad difference| of the same cross-entropy loss on both models."""
    labels = torch.randint(0, glass.cfg.num_classes, (x.shape[0],), generator=torch.Generator().manual_seed(seed))
    labels = labels.to(x.device)
    for model in (timm_model, glass):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), labels).backward()
    theirs = dict(timm_model.named_parameters())
    rows = []
    for name, param in glass.named_parameters():
        other = theirs[timm_key_for(name)].grad
        diff = (param.grad.double() - other.double()).abs().max().item()
        rows.append({"tensor": name, "timm_tensor": timm_key_for(name), "shape": tuple(param.shape), "max_abs_diff": diff})
    for model in (timm_model, glass):
        model.zero_grad(set_to_none=True)
    return pd.DataFrame(rows)


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

    Also measures, for the report only, timm's fused attention against the glass-box
    fast path and against its hand-written path.
    """
    timm_model = timm_model.to(device).eval()
    glass, audit = glassbox_from_timm(timm_model)
    glass = glass.to(device).eval()
    cfg = glass.cfg
    x = make_input(input_kind, (batch, cfg.in_channels, cfg.image_size, cfg.image_size), seed).to(device)
    order = glass.stage_names()

    set_timm_fused(timm_model, False)
    with torch.no_grad():
        _, ref = timm_forward_stages(timm_model, x, glass)
        _, ours = glass.set_fast_attention(False).forward_stages(x)
        stages = compare_stages(ref, ours, order, tolerance)

        set_timm_fused(timm_model, True)
        _, ref_fused = timm_forward_stages(timm_model, x, glass)
        fused_order = [n for n in order if not n.endswith("attn.probs")]
        _, ours_fast = glass.set_fast_attention(True).forward_stages(x)
        fused = {
            "timm_fused_vs_glassbox_fast": compare_stages(ref_fused, ours_fast, fused_order, tolerance),
            "timm_fused_vs_glassbox_written": compare_stages(ref_fused, ours, fused_order, tolerance),
        }
    set_timm_fused(timm_model, False)
    glass.set_fast_attention(False)
    grads = compare_gradients(timm_model, glass, x, seed) if gradients else pd.DataFrame(columns=["tensor", "max_abs_diff"])
    return EquivalenceReport(architecture, tolerance, audit, stages, grads, fused)
