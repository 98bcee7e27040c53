"""Any model as a transfer source, through timm's generic interfaces (no per-family code).

The glass-box ViT path (``source_model``, ``features``, ``regimes``) is kept as it is; a source
that is not a ViT the glass box can hold (a timm CNN or any other timm model, trained as an arm
or named by architecture, or the study CNN) goes through this module:

- features for the linear probe: ``forward_head(forward_features(x), pre_logits=True)``,
  and a new head by ``reset_classifier(num_classes)`` (the study CNN, which has timm's
  ``forward_features`` / ``forward_head`` but no ``reset_classifier``, gets a new ``head``);
- ``partial``: the last ``blocks`` groups of timm's ``group_matcher()``, the grouping timm's
  own layer decay uses (``timm.optim.param_groups_layer_decay``), plus the top group (the
  head and whatever timm puts with it) trainable, the rest frozen; trained on images;
- ``full`` with ``layer_decay``: ``param_groups_layer_decay`` itself;
- ``scratch``: the architecture from the seeded init an ablation arm uses.

A model without ``group_matcher()`` (the study CNN) refuses ``partial`` and ``layer_decay``
in one line naming the key.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
from torch import nn

from workbench.data import TensorLoader, derive_seed
from workbench.models.cnn import CNN, CNNConfig
from workbench.models.registry import build_model
from workbench.models.timm_arm import TimmModelConfig
from workbench.protocol.transfer import Regime
from workbench.transfer.features import CachedSplit, FeatureCache
from workbench.transfer.regimes import QWKTrainer

# Batch norms whose running statistics a frozen part keeps.
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class RegimeRefused(ValueError):
    """A regime this model cannot take; the message names the protocol key."""


def classifier(model: nn.Module) -> nn.Module:
    """The module that maps pre-logit features to logits: timm's ``get_classifier()``, the study CNN's ``head``."""
    return model.get_classifier() if hasattr(model, "get_classifier") else model.head


def pooled_features(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, D): what the head reads, ``forward_head(forward_features(x), pre_logits=True)``."""
    return model.forward_head(model.forward_features(images), pre_logits=True)


def with_num_classes(cfg, num_classes: int):
    """The config of the same architecture with ``num_classes`` outputs (what a fresh build for a reload needs)."""
    if isinstance(cfg, TimmModelConfig):
        return TimmModelConfig(cfg.architecture, {**cfg.kwargs, "num_classes": num_classes})
    if isinstance(cfg, CNNConfig):
        return replace(cfg, num_classes=num_classes)
    raise TypeError(f"no generic transfer path for a {type(cfg).__name__}")


def reset_head(model: nn.Module, num_classes: int, seed: int) -> nn.Module:
    """A new ``num_classes`` head, drawn from ``derive_seed(seed, "transfer-head")`` alone (in a forked RNG).

    timm: ``reset_classifier(num_classes)`` (the model's own head init); the study CNN: a new
    ``nn.Linear`` (PyTorch's default init). The same seed gives every regime the same head.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "transfer-head"))
        if hasattr(model, "reset_classifier"):
            model.reset_classifier(num_classes)
        elif isinstance(model, CNN):
            model.head = nn.Linear(model.head.in_features, num_classes)
        else:
            raise TypeError(
                f"{type(model).__name__} has neither reset_classifier() nor a study CNN head"
            )
    model.cfg = with_num_classes(model.cfg, num_classes)
    return model


def transfer_copy(source: nn.Module, num_classes: int, seed: int) -> nn.Module:
    """A copy of the source with the seed's new head (the source is not modified)."""
    model = copy.deepcopy(source)
    return reset_head(model, num_classes, seed)


def scratch_copy(source: nn.Module, num_classes: int, seed: int) -> nn.Module:
    """The source's architecture from ``torch.manual_seed(derive_seed(seed, "init"))`` (an arm's init), the seed's head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        model = build_model(source.cfg)
    return reset_head(model, num_classes, seed)


def layer_map(model: nn.Module, key: str) -> dict[str, int]:
    """Parameter name -> group index of timm's ``group_matcher(coarse=False)`` (0 = stem, highest = the head's group)."""
    if not hasattr(model, "group_matcher"):
        raise RegimeRefused(
            f"{key}: {type(model).__name__} has no timm group_matcher(), so its layers cannot be "
            "grouped; use kind linear, full (without layer_decay) or scratch"
        )
    from timm.models import group_parameters

    return group_parameters(model, model.group_matcher(coarse=False), reverse=True)


def partial_names(model: nn.Module, blocks: int, key: str) -> list[str]:
    """The parameters a ``partial`` regime trains: the top group (head) and the ``blocks`` groups below it."""
    groups = layer_map(model, key)
    top = max(groups.values())
    head_ids = {id(p) for p in classifier(model).parameters()}
    head = [n for n, p in model.named_parameters() if id(p) in head_ids]
    if any(groups.get(n, top) != top for n in head):
        raise RegimeRefused(
            f"{key}: timm's group_matcher() of {type(model).__name__} does not put the classifier "
            "in its last group, so 'the last groups' is not defined for it; use kind linear or full"
        )
    if blocks > top:
        raise RegimeRefused(
            f"{key}={blocks}: {type(model).__name__} has {top} groups below its head in timm's "
            f"group_matcher() (stem and blocks); give at most {top}"
        )
    return [n for n, _ in model.named_parameters() if groups.get(n, top) >= top - blocks]


def freeze_for(model: nn.Module, regime: Regime, key: str) -> list[str]:
    """Set ``requires_grad`` for the regime; returns the trainable parameter names.

    Batch-norm layers whose parameters are all frozen are held in eval mode (a forward
    pre-hook), so their running statistics stay the source's: frozen means frozen.
    """
    if regime.kind == "linear":
        head = {id(p) for p in classifier(model).parameters()}
        names = [n for n, p in model.named_parameters() if id(p) in head]
    elif regime.kind == "partial":
        names = partial_names(model, regime.blocks, key)
    else:
        names = [n for n, _ in model.named_parameters()]
    trainable = set(names)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if isinstance(module, NORM_TYPES) and params and not any(p.requires_grad for p in params):
            module.register_forward_pre_hook(_hold_eval)
    return names


def _hold_eval(module: nn.Module, args) -> None:
    module.eval()  # a frozen batch norm normalises with the source's running statistics, and keeps them


def param_groups_any(
    model: nn.Module, lr: float, weight_decay: float, layer_decay: float | None, key: str
) -> list[dict]:
    """AdamW groups of the trainable parameters: timm's ``param_groups_layer_decay`` when ``layer_decay`` is set.

    Each group's ``lr`` is ``lr * lr_scale`` (the workbench's schedule scales every group's
    initial lr). Without layer decay: decayed / not decayed (ndim <= 1 or the model's
    ``no_weight_decay()``), as timm's ``param_groups_weight_decay``.
    """
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    skip = tuple(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else ()
    if layer_decay is None:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
        for g in groups:
            g["lr_scale"] = 1.0
    else:
        layer_map(model, key)  # refuses a model without group_matcher() by the key
        groups = param_groups_layer_decay(
            model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay
        )
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    # the head's (scale 1) first: the logged lr is the base lr
    return sorted(groups, key=lambda g: -g["lr_scale"])


SCRATCH_INIT_ANY = "the architecture's own init (timm's init for a timm model, PyTorch's defaults for the study CNN)"


def check_regimes(model: nn.Module, regimes: tuple[Regime, ...], where: str) -> None:
    """Refuse, before any run opens, a regime this model cannot take (``where`` starts the line: the protocol file)."""
    for i, regime in enumerate(regimes):
        if regime.kind == "partial":
            partial_names(model, regime.blocks, f"{where}: regimes[{i}].blocks")
        if regime.layer_decay is not None:
            layer_map(model, f"{where}: regimes[{i}].layer_decay")


@torch.no_grad()
def compute_pooled(
    model: nn.Module,
    splits: dict,
    norm,
    resize_to: int | None,
    device: torch.device,
    batch_size: int,
    amp_dtype: torch.dtype | None = None,
) -> FeatureCache:
    """The linear probe's cache for any model: ``pooled_features`` of every image, one eval-mode pass per split."""
    was_training = model.training
    model.eval()
    cache, started = FeatureCache(), time.perf_counter()
    for name, split in splits.items():
        loader = TensorLoader.from_split(
            split,
            batch_size=batch_size,
            norm=norm,
            shuffle=False,
            device=device,
            resize_to=resize_to,
        )
        pooled, labels, indices = [], [], []
        for images, y, idx in loader:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                pooled.append(pooled_features(model, images).float())  # (B, D)
            labels.append(y)
            indices.append(idx)
        cache.pooled[name] = CachedSplit(torch.cat(pooled), torch.cat(labels), torch.cat(indices))
        cache.images += len(split)
    model.train(was_training)
    cache.seconds = time.perf_counter() - started
    return cache


class AnyQWKTrainer(QWKTrainer):
    """``QWKTrainer`` with timm's parameter groups (``param_groups_any``) instead of the glass-box ViT's."""

    def _param_groups(self) -> list:
        return param_groups_any(
            self.model,
            self.cfg.optim.lr,
            self.cfg.optim.weight_decay,
            self.layer_decay,
            "layer_decay",
        )
