"""timm models as study arms: ``model: {name: timm/<architecture>, <keyword arguments>}``.

An arm may name any architecture ``timm.create_model`` builds. The prefix ``timm/`` marks it
(a study model's name never has a slash), and every other key of the model section is a
keyword argument of ``timm.create_model(architecture, pretrained=False, **kwargs)``, passed as
written: ``num_classes``, ``in_chans``, ``img_size`` where the model takes it,
``drop_path_rate``, ... An arm always trains from scratch, so the keys that would load weights
or change what the model returns are refused by name.

The config is checked by building the model on PyTorch's ``meta`` device (shapes only, no
memory, no init): an unknown architecture or a keyword argument the model does not take is
one line naming it, when the protocol is loaded. The trainer builds the real model under the
cell's seed, as it builds every arm (``workbench.train.loop.Trainer``), so its init is a
function of the seed alone.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TIMM_PREFIX = "timm/"
# Keyword arguments of timm.create_model an arm may not pass, and why.
REFUSED_KWARGS = {
    "pretrained": "an arm trains from scratch: the model is always built with pretrained=False",
    "pretrained_cfg": "an arm trains from scratch: no pretrained config is read",
    "pretrained_cfg_overlay": "an arm trains from scratch: no pretrained config is read",
    "checkpoint_path": "an arm trains from scratch: no checkpoint is loaded (a transfer protocol adapts one)",
    "cache_dir": "an arm trains from scratch: nothing is downloaded",
    "features_only": "an arm's model maps images to class logits",
}
LIST_HINT = "list valid names with `workbench models --timm PATTERN`"


class TimmModelError(ValueError):
    """A timm arm that cannot be built; ``key`` is the model-section key at fault (``name`` or a kwarg)."""

    def __init__(self, key: str, value: Any, why: str):
        super().__init__(why)
        self.key, self.value = key, value

    def line(self, where: str) -> str:
        """The one line an entry point prints, with the section's dotted path (``arms[1].overrides.model``)."""
        return f"{where}.{self.key}={self.value!r}: {self}"


def is_timm_name(name: object) -> bool:
    """Whether a model name marks a timm architecture (``timm/resnet18``)."""
    return isinstance(name, str) and name.startswith(TIMM_PREFIX)


def _frozen(value: Any) -> Any:
    """A hashable copy of a YAML value (lists to tuples, mappings to sorted item tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class TimmModelConfig:
    """A timm architecture and the keyword arguments of ``timm.create_model`` (``pretrained=False``).

    Attributes:
        architecture: The timm name, without the ``timm/`` prefix (``resnet18``).
        kwargs: Keyword arguments as written in the protocol; equal configs have equal kwargs.
    """

    architecture: str
    kwargs: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise TimmModelError(
                "name",
                self.architecture,
                f"must be {TIMM_PREFIX}<a timm architecture>; {LIST_HINT}",
            )
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise TimmModelError("kwargs", self.kwargs, "must be a mapping of keyword arguments")
        for key, why in REFUSED_KWARGS.items():
            if key in self.kwargs:
                raise TimmModelError(key, self.kwargs[key], why)

    def __hash__(self) -> int:  # kwargs is a dict: hash its frozen, sorted form
        return hash((self.architecture, _frozen(self.kwargs)))

    @property
    def name(self) -> str:
        """The protocol's model name, ``timm/<architecture>``."""
        return TIMM_PREFIX + self.architecture

    def canonical(self) -> str:
        """Architecture and kwargs as sorted JSON: the same text for the same model, however written."""
        return json.dumps(
            {"name": self.name, "kwargs": self.kwargs}, sort_keys=True, separators=(",", ":")
        )

    # What the data checks (workbench.train.fits) compare, read from the model timm builds.
    @property
    def num_classes(self) -> int:
        return int(shape_model(self).num_classes)

    @property
    def in_channels(self) -> int:
        return int(self.kwargs.get("in_chans", 3))  # timm.create_model's default

    @property
    def fixed_image_hw(self) -> tuple[int, int] | None:
        """The only input size the model takes (a ViT's patch embedding with a strict size), else None."""
        embed = getattr(shape_model(self), "patch_embed", None)
        if (
            embed is None
            or not getattr(embed, "strict_img_size", False)
            or getattr(embed, "img_size", None) is None
        ):
            return None
        if getattr(shape_model(self), "dynamic_img_size", False):
            return None
        return tuple(int(s) for s in embed.img_size)


def create(cfg: TimmModelConfig) -> nn.Module:
    """``timm.create_model(architecture, pretrained=False, **kwargs)`` on the current default device.

    The model carries its config as ``.cfg`` (as the glass-box models do), so a fresh copy for
    the reload proof or the logged model is ``build_model(model.cfg)``.
    """
    import timm  # a slow import: only when a protocol names a timm model

    try:
        model = timm.create_model(cfg.architecture, pretrained=False, **cfg.kwargs)
    except RuntimeError as err:
        if str(err).startswith("Unknown model"):
            raise TimmModelError(
                "name",
                cfg.name,
                f"timm {timm.__version__} has no architecture {cfg.architecture!r}; {LIST_HINT}",
            ) from None
        raise TimmModelError("name", cfg.name, f"timm.create_model failed: {err}") from None
    except TypeError as err:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(err))
        if bad and bad.group(1) in cfg.kwargs:
            key = bad.group(1)
            raise TimmModelError(
                key,
                cfg.kwargs[key],
                f"timm {cfg.architecture} does not take this keyword argument ({err})",
            ) from None
        raise TimmModelError(
            "name",
            cfg.name,
            f"timm.create_model({cfg.architecture!r}, **{cfg.kwargs}) failed: {err}",
        ) from None
    except (ValueError, AssertionError, KeyError) as err:
        raise TimmModelError(
            "name",
            cfg.name,
            f"timm.create_model({cfg.architecture!r}, **{cfg.kwargs}) "
            f"failed: {type(err).__name__}: {err}",
        ) from None
    model.cfg = cfg  # an attribute, not a module: the state dict is timm's own
    return model


@functools.lru_cache(maxsize=64)
def shape_model(cfg: TimmModelConfig) -> nn.Module:
    """The model built on the meta device, in eval mode: shapes, no memory, no init; cached per config.

    Built with the global RNG state saved and restored, so whether the cache was warm never
    changes the draws of a cell's init that follows.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return create(cfg).eval()


def checked(architecture: str, kwargs: dict[str, Any]) -> TimmModelConfig:
    """The config, built once on the meta device so that a bad name or kwarg fails now, in one line."""
    cfg = TimmModelConfig(architecture, dict(kwargs))
    shape_model(cfg)
    return cfg


def refuses_input(cfg: TimmModelConfig, shape: tuple[int, int, int]) -> str | None:
    """Why the model cannot take one image of ``shape`` (C, H, W), from a forward on the meta device; None if it can."""
    try:
        with torch.no_grad():
            out = shape_model(cfg)(torch.zeros((1, *shape), device="meta"))
    except Exception as err:  # whatever timm raises for this input: said, not hidden
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if out.ndim != 2:
        return f"it returns shape {tuple(out.shape)}, not (batch, classes) logits"
    return None


def marker_hint(name: object) -> str:
    """`` (timm has resnet18: write timm/resnet18)`` for a timm name written without the marker, else ""."""
    if not isinstance(name, str) or "/" in name:
        return ""
    import timm

    return f" (timm has {name}: write {TIMM_PREFIX}{name})" if timm.is_model(name) else ""
