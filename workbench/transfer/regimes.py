"""The four regimes: what is trainable and how the optimizer sees it; the QWK-selecting trainer.

- linear: only the head; trained on cached pooled features.
- partial: the last k blocks, the final norm (``norm`` or ``fc_norm``) and the head; trained
  on cached tokens entering block ``depth - k``.
- full: everything, optionally with layer-wise lr decay; trained on images.
- scratch: everything, of the source's architecture from a seeded random init
  (``source_model.scratch_model``), no layer decay; trained on images as full.

Every regime trains in the workbench's resumable ``Trainer`` (``QWKTrainer``, which selects
the first epoch with the highest validation QWK); the cached regimes through
``cached_training.CachedQWKTrainer``, whose batches follow the order ``TensorLoader`` draws
from (seed, epoch), so every regime of a seed sees the same data order.
"""

from __future__ import annotations


import pandas as pd

from workbench.models.vit import VisionTransformer
from workbench.train.loop import Trainer
from workbench.transfer.evaluate import val_metrics
from workbench.protocol.transfer import Regime

# Not decayed: biases, norm gains, position embeddings and prefix tokens (the usual ViT recipe).
NO_DECAY_NAMES = ("pos_embed", "cls_token", "register_tokens")


def trainable_prefixes(model: VisionTransformer, regime: Regime) -> tuple[str, ...]:
    """State-dict key prefixes the regime trains ("" = everything)."""
    if regime.kind in ("full", "scratch"):
        return ("",)
    if regime.kind == "linear":
        return ("head.",)
    depth = model.cfg.depth
    if regime.blocks > depth:
        raise ValueError(
            f"regime {regime.name}: blocks={regime.blocks} but the source has {depth} blocks"
        )
    return tuple(f"blocks.{i}." for i in range(depth - regime.blocks, depth)) + (
        "norm.",
        "fc_norm.",
        "head.",
    )


def freeze(model: VisionTransformer, regime: Regime) -> list[str]:
    """Set ``requires_grad`` for the regime; returns the trainable parameter names."""
    prefixes = trainable_prefixes(model, regime)
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(pre) for pre in prefixes))
        if p.requires_grad:
            names.append(name)
    return names


def layer_id(name: str, depth: int) -> int:
    """0 for the embedding (patches, positions, prefix tokens), i + 1 for block i, depth + 1 after."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.startswith(("patch_proj.", "pos_embed", "cls_token", "register_tokens")):
        return 0
    return depth + 1


def param_groups(
    model: VisionTransformer, lr: float, weight_decay: float, layer_decay: float | None
) -> list[dict]:
    """Trainable parameters grouped by (layer, decayed or not); deepest layer first.

    With ``layer_decay`` d, layer l gets ``lr * d ** (depth + 1 - l)``: the head keeps the
    base lr and the patch embedding gets the smallest. The head's group comes first so the
    logged ``lr`` (group 0) is the base lr.
    """
    depth = model.cfg.depth
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        layer = layer_id(name, depth)
        scale = 1.0 if layer_decay is None else layer_decay ** (depth + 1 - layer)
        no_decay = p.ndim <= 1 or name in NO_DECAY_NAMES
        group = groups.setdefault(
            (layer, no_decay),
            {
                "params": [],
                "lr": lr * scale,
                "weight_decay": 0.0 if no_decay else weight_decay,
                "layer": layer,
                "lr_scale": scale,
            },
        )
        group["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (-k[0], k[1]))]


class QWKTrainer(Trainer):
    """The workbench Trainer, selecting epochs by validation QWK, with layer-wise lr decay.

    Everything else (resumable full-state checkpoints, AMP, the reload proof) is the
    Trainer's. Give it data without a test split: selection must not be able to see it.
    """

    def __init__(
        self,
        cfg,
        data,
        run_dir,
        observer=None,
        model=None,
        *,
        num_classes: int,
        layer_decay: float | None = None,
    ) -> None:
        if data.test is not None:
            raise ValueError(
                "QWKTrainer selects on validation only: pass the data without its test split"
            )
        # read by the hooks during __init__
        self.num_classes, self.layer_decay = (
            num_classes,
            layer_decay,
        )
        super().__init__(cfg, data, run_dir, observer, model=model)

    def _param_groups(self) -> list:
        return param_groups(
            self.model, self.cfg.optim.lr, self.cfg.optim.weight_decay, self.layer_decay
        )

    def _validation_metrics(self, val: pd.DataFrame) -> dict[str, float]:
        return val_metrics(val, self.num_classes)

    def _monitored(self) -> tuple[str, bool]:
        return "val_qwk", True
