"""Every intervention of a grid over an in-memory split, in batches, per example.

For each batch the intact model runs once (``block_inputs``: its logits are ``model(x)``
bitwise, and it keeps the tokens entering every block); each intervention then starts from
the tokens entering the first block it edits, so a head in the last block costs one block,
not the whole model. Results are per example (predicted class and loss, intact and under
every intervention), which is what a paired, example-level bootstrap needs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workbench.data import NormStats, TensorLoader
from workbench.interventions.forward import (
    HeadMeans,
    block_inputs,
    capture,
    first_edit_block,
    head_means,
    run,
)
from workbench.interventions.spec import Intervention, InterventionError, PatchStage, check, flatten
from workbench.models.vit import VisionTransformer
from workbench.precision import resolve_amp


@dataclass(frozen=True)
class Inputs:
    """How a split's uint8 images become model inputs (as the trained cell's evaluation made them)."""

    norm: NormStats
    batch_size: int
    device: torch.device
    resize_to: int | None = None
    amp_dtype: torch.dtype | None = None

    def loader(
        self, images: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor | None = None
    ) -> TensorLoader:
        return TensorLoader(
            images,
            labels,
            indices,
            batch_size=self.batch_size,
            norm=self.norm,
            shuffle=False,
            device=self.device,
            resize_to=self.resize_to,
        )

    def autocast(self):
        return (
            torch.autocast(self.device.type, dtype=self.amp_dtype)
            if self.amp_dtype
            else contextlib.nullcontext()
        )


# Whether a kind that acts on a trained cell evaluates it in the precision the cell trained with
# (``run.amp``): an intervention's numbers are the trained model's, so as it was trained and
# validated. Attribution scores in float32 whatever the cell trained with: its drops' effects are
# differences of log-probabilities. Each kind reads its value here, so that the rule is part of
# the code identity of both kinds (``tracking.kinds.intervention_runs``, ``attribution_runs``).
INTERVENTION_AS_TRAINED = True
ATTRIBUTION_AS_TRAINED = False


def acted_inputs(
    norm: NormStats,
    image_side: int,
    model_side: int,
    *,
    batch_size: int,
    device: torch.device,
    amp: str | None,
    resize_to: int | None,
    as_trained: bool = True,
) -> Inputs:
    """How a kind that acts on a model feeds it: the data's normalisation, batch size and device, the
    input size and the precision.

    ``resize_to`` None on images of another side than the model's (a pretrained model's input
    size) resizes them to ``model_side``; ``amp`` is the cell's training precision, used when
    ``as_trained`` and float32 otherwise (``resolve_amp`` refuses one the device cannot run).
    """
    if resize_to is None and image_side != model_side:
        resize_to = model_side
    dtype = resolve_amp(amp if as_trained else "off", device)
    return Inputs(norm, batch_size, device, resize_to, dtype)


@dataclass
class Evaluation:
    """Per-example outcomes of the intact model and of every intervention on one split.

    Attributes:
        names: Intervention names, in grid order (rows of ``predicted`` and ``loss``).
        labels, indices: ``(N,)`` true classes and positions in the dataset's source split.
        intact_predicted, intact_loss: ``(N,)`` the intact model's class and cross-entropy.
        predicted, loss: ``(K, N)`` the same under each intervention.
        patch_sources: Name -> ``(N,)`` which example (position in the split) each example's
            activation came from, for activation patches.
        attention: ``(depth, heads, rows, cols)`` each head's mean attention map over the split
            (query: the class token, else the mean over query tokens; keys: patches), or None.
        seconds: Wall time of the loop (intact pass, every intervention, attention maps).
    """

    names: list[str]
    labels: np.ndarray
    indices: np.ndarray
    intact_predicted: np.ndarray
    intact_loss: np.ndarray
    predicted: np.ndarray
    loss: np.ndarray
    patch_sources: dict[str, np.ndarray] = field(default_factory=dict)
    attention: np.ndarray | None = None
    attention_query: str = ""
    seconds: float = 0.0

    @property
    def intact_accuracy(self) -> float:
        return float((self.intact_predicted == self.labels).mean())

    def correct(self) -> np.ndarray:
        """``(K, N)`` bool: each example right under each intervention."""
        return self.predicted == self.labels[None, :]

    def metrics(self) -> dict[str, dict[str, float]]:
        """Name -> accuracy, loss, their change against the intact model (and source agreement for patches)."""
        intact_acc, intact_loss = (
            self.intact_accuracy,
            float(self.intact_loss.astype(np.float64).mean()),
        )
        out = {}
        for k, name in enumerate(self.names):
            acc = float((self.predicted[k] == self.labels).mean())
            loss = float(self.loss[k].astype(np.float64).mean())
            out[name] = {
                "accuracy": acc,
                "loss": loss,
                "accuracy_change": acc - intact_acc,
                "loss_change": loss - intact_loss,
            }
            if (
                name in self.patch_sources
            ):  # follows the source: predicts what the intact model said for the source
                source = self.intact_predicted[self.patch_sources[name]]
                out[name]["source_agreement"] = float((self.predicted[k] == source).mean())
        return out


def derangement(n: int, seed: int) -> np.ndarray:
    """A seeded permutation with no fixed point (Sattolo's algorithm: one cycle through all n)."""
    if n < 2:
        raise InterventionError(
            f"activation patching needs at least 2 examples to take another's activation; got {n}"
        )
    rng = np.random.default_rng(seed)
    perm = np.arange(n)
    for i in range(n - 1, 0, -1):
        j = int(rng.integers(0, i))
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def reference_means(
    model: VisionTransformer, images: torch.Tensor, n: int, seed: int, inputs: Inputs
) -> tuple[HeadMeans, np.ndarray]:
    """Per-head means over ``n`` images drawn (seeded, without replacement) from ``images``; and their positions."""
    if n > len(images):
        raise InterventionError(
            f"mean ablation over {n} reference images: the training split has only {len(images)}"
        )
    chosen = np.sort(
        torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:n].numpy()
    )
    picked = images[torch.from_numpy(chosen)]
    loader = inputs.loader(picked, torch.zeros(len(picked), dtype=torch.int64))
    with torch.no_grad(), inputs.autocast():
        means = head_means(model, (batch.images for batch in loader))
    return means, chosen


def _attention_sums(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Sum over the batch of each head's attention map onto the patch tokens: ``(depth, heads, rows, cols)``."""
    cfg = model.cfg
    stages = [f"blocks.{i}.attn.probs" for i in range(cfg.depth)]
    _, acts = capture(model, x, stages)
    maps = torch.stack([acts[s].float() for s in stages])  # (depth, B, heads, N, N)
    n_prefix = cfg.num_prefix_tokens
    keys = maps[..., n_prefix:]  # attention onto patch tokens
    if cfg.class_token:
        rows, query = keys[..., 0, :], "the class token"  # (depth, B, heads, patches)
    else:
        rows, query = keys.mean(dim=-2), "the mean over query tokens"
    grid = rows.sum(dim=1).reshape(cfg.depth, cfg.heads, *cfg.grid)  # (depth, heads, rows, cols)
    return grid, query


@torch.no_grad()
def evaluate(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: torch.Tensor,
    inputs: Inputs,
    interventions: list[Intervention],
    means: HeadMeans | None = None,
    patch_seed: int = 0,
    attention_maps: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Evaluation:
    """The intact model and every intervention (each on its own) over one split.

    Args:
        model: Glass-box ViT in eval mode (unchanged).
        images, labels, indices: The split (uint8 ``(N, C, H, W)``, labels in the model's classes).
        inputs: Normalisation, batch size, device, resize and autocast of the evaluation.
        interventions: The grid; each is validated against the model first.
        means: Reference means, needed by ``mean`` head ablations.
        patch_seed: Seed of the derangement that gives each example its patch source.
        attention_maps: Also average each head's attention map over the split.
        progress: Called with the number of images done after each batch.
    """
    for item in interventions:
        check(model.cfg, [item])
    names = [item.name for item in interventions]
    n, k = len(labels), len(interventions)
    depth = model.cfg.depth
    starts = [first_edit_block(depth, flatten([item])) for item in interventions]
    patched = sorted(
        {s.stage for item in interventions for s in flatten([item]) if isinstance(s, PatchStage)}
    )
    sources = derangement(n, patch_seed) if patched else None
    predicted = np.zeros((k, n), dtype=np.int64)
    losses = np.zeros((k, n), dtype=np.float32)
    intact_pred, intact_loss = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.float32)
    attention, query = None, ""
    loader = inputs.loader(images, labels, indices)
    source_loader = (
        inputs.loader(images[torch.from_numpy(sources)], labels) if sources is not None else None
    )
    started = time.perf_counter()
    done = 0
    with inputs.autocast():
        for _b, batch in enumerate(zip(loader, source_loader or [None] * len(loader))):
            batch, source = batch
            x, y = batch.images, batch.labels
            rows = slice(done, done + len(y))
            logits, cache = block_inputs(model, x)
            intact_pred[rows], intact_loss[rows] = _outcome(logits, y)
            stored = capture(model, source.images, patched)[1] if source is not None else {}
            for j, (item, start) in enumerate(zip(interventions, starts)):
                resume = (start, cache[start]) if start >= 0 else None
                out = run(model, x, [item], patches=stored, head_means=means, resume=resume)
                predicted[j, rows], losses[j, rows] = _outcome(out, y)
            if attention_maps:
                sums, query = _attention_sums(model, x)
                attention = sums if attention is None else attention + sums
            done += len(y)
            if progress:
                progress(done)
    per_patch = {
        item.name: sources
        for item in interventions
        if sources is not None and any(isinstance(s, PatchStage) for s in flatten([item]))
    }
    return Evaluation(
        names,
        labels.cpu().numpy(),
        indices.cpu().numpy(),
        intact_pred,
        intact_loss,
        predicted,
        losses,
        per_patch,
        None if attention is None else (attention / n).cpu().numpy(),
        query,
        time.perf_counter() - started,
    )


def _outcome(logits: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    logits = logits.float()
    return logits.argmax(-1).cpu().numpy(), F.cross_entropy(
        logits, labels, reduction="none"
    ).cpu().numpy()
