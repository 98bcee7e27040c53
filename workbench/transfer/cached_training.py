"""The linear and partial regimes trained by the workbench's ``Trainer`` on cached inputs.

Only the first blocks of the backbone are frozen in these regimes, so their output is
computed once (``features.compute_features``) and the trainable rest runs on it. The loop,
checkpoints, resume, epoch selection and reload proof are the ``Trainer``'s, as for the full
and scratch regimes; what changes is where a batch comes from (``CachedBatches``: the cache,
in the order ``TensorLoader`` draws for the same seed and epoch) and what the model is seen as
(``CachedView``: cached inputs in, logits out, its state the transfer model's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from workbench.data import derive_seed
from workbench.data.batches import Batch
from workbench.train.fast_path import TrainingForward
from workbench.transfer.any_model import AnyQWKTrainer
from workbench.transfer.features import CachedSplit
from workbench.transfer.regimes import QWKTrainer

# model -> the function from its cached inputs to its logits (``features.head_forward``, ...)
ForwardFactory = Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The epoch's permutation of n positions: ``TensorLoader(seed=seed).order(epoch)``."""
    generator = torch.Generator(device="cpu").manual_seed(derive_seed(seed, epoch, "order"))
    return torch.randperm(n, generator=generator)


class CachedBatches:
    """(inputs, labels, indices) batches of a cached split, with ``TensorLoader``'s interface.

    Shuffled: each epoch in ``epoch_order(seed, epoch)``, so a cached regime sees the images in
    the order the image regimes of the same seed see them. Not shuffled: in cache order.
    """

    def __init__(
        self, split: CachedSplit, batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.split, self.batch_size, self.seed, self.shuffle = split, batch_size, seed, shuffle

    def __len__(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.split)
        return epoch_order(self.seed, epoch, n) if self.shuffle else torch.arange(n)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        split = self.split
        order = self.order(epoch).to(split.inputs.device)
        for k in range(start_batch, len(self)):
            pos = order[k * self.batch_size : (k + 1) * self.batch_size]
            yield Batch(
                split.inputs.index_select(0, pos),
                split.labels.index_select(0, pos),
                split.indices.index_select(0, pos),
            )

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(0)


class CachedView(nn.Module):
    """A transfer model seen from the cache: cached inputs -> logits.

    Its state is the wrapped model's, under the model's own keys, so a checkpoint written
    through the view loads into a plain transfer model (the test evaluation does that).
    """

    def __init__(self, model: nn.Module, forward_of: ForwardFactory) -> None:
        super().__init__()
        self.model = model
        self._forward = forward_of(model)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self._forward(inputs)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)


class _OnCachedInputs:
    """Mixed in before a QWK trainer: train and evaluate on cached splits instead of images.

    The trainer is built on the image data as usual (its schedule counts the same batches:
    the cache holds one row per image), then its loaders and forward are replaced.
    """

    def __init__(
        self,
        cfg,
        data,
        run_dir,
        observer=None,
        model=None,
        *,
        cached: dict[str, CachedSplit],
        forward_of: ForwardFactory,
        **kwargs,
    ) -> None:
        if cfg.recipe.mixes or cfg.recipe.ema_decay is not None:
            raise ValueError("a cached regime trains without mixup, CutMix or EMA")
        super().__init__(cfg, data, run_dir, observer, model=model, **kwargs)
        self.forward_of = forward_of
        batches = CachedBatches(cached["train"], cfg.run.batch_size, seed=cfg.run.seed)
        if len(batches) != len(self.train_loader):  # the lr schedule was sized on the images
            raise ValueError(
                f"the cache has {len(cached['train'])} training rows, the split "
                f"{len(data.train)} images"
            )
        self.train_loader = batches
        self.eval_loaders = {
            "val": CachedBatches(cached["val"], cfg.run.eval_batch_size, shuffle=False)
        }
        self.view = CachedView(self.model, forward_of)
        self.forward = TrainingForward(self.view, cfg.fast_path)

    @property
    def evaluated_model(self) -> nn.Module:
        return self.view

    def _fresh_model(self) -> nn.Module:
        return CachedView(super()._fresh_model(), self.forward_of)


class CachedQWKTrainer(_OnCachedInputs, QWKTrainer):
    """``QWKTrainer`` (glass-box ViT source) on cached pooled features or tokens."""


class AnyCachedQWKTrainer(_OnCachedInputs, AnyQWKTrainer):
    """``AnyQWKTrainer`` (any other source) on cached pre-logit features."""
