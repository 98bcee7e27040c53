"""Where timm ViT weights come from: seeded random init, a pinned hub checkpoint, or a local file."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.convert.checkpoints import (
    CheckpointError,
    download_pinned,
    load_state_dict_file,
    read_lock,
)
from workbench.models.registry import timm_vit_architectures, unknown_model


@dataclass
class TimmWeights:
    """A timm model with its weights and a description of where they came from."""

    model: nn.Module
    architecture: str
    source: str  # "random", "hub" or "local"
    description: str
    sha256: str | None
    pretrained: bool

    def label(self) -> str:
        return self.description if self.pretrained else f"{self.description} (NOT PRETRAINED)"


def resolve_architecture(name: str) -> tuple[str, str | None]:
    """(timm architecture, pinned checkpoint name or None) for a model or checkpoint name."""
    pins = read_lock()
    if name in pins:
        return pins[name].architecture, name
    if name in timm_vit_architectures():
        return name, None
    raise unknown_model(name, tuple(sorted(pins)), study=False, timm_arms=False, timm_vits=True)


def load_timm_weights(
    name: str, source: str = "random", seed: int = 0, **model_kwargs
) -> TimmWeights:
    """Build a timm ViT and fill it from ``source``.

    Args:
        name: a timm ViT architecture or a pinned checkpoint name.
        source: "random" (seeded timm init, labelled not pretrained), "hub" (the pinned
            checkpoint, verified against its sha256), or a path to a safetensors/weights-only
            file or folder. A local file given for a pinned name must match its sha256.
        seed: seed of the random init.
        model_kwargs: passed to ``timm.create_model`` (e.g. a reduced width and depth).
    """
    import timm

    architecture, pin_name = resolve_architecture(name)
    if source == "hub":
        # Resolve (and refuse an unpinned name) before building the model: fails fast.
        if pin_name is None:
            raise CheckpointError(
                f"source 'hub' needs a pinned checkpoint name; {name!r} is an architecture"
            )
        entry = read_lock()[pin_name]
        path = download_pinned(entry)
    # A pinned name carries timm's pretrained tag ("arch.tag"): building from it takes the
    # tag's head size and image size (e.g. CLIP's 512-wide projection, DINOv2's 518 px).
    tagged = pin_name if pin_name and pin_name.split(".", 1)[0] == architecture else architecture
    torch.manual_seed(seed)
    model = timm.create_model(tagged, pretrained=False, **model_kwargs).eval()
    if source == "random":
        return TimmWeights(
            model,
            architecture,
            "random",
            f"{architecture} seeded random init (seed {seed})",
            None,
            False,
        )
    if source == "hub":
        state, sha = load_state_dict_file(path, expected_sha256=entry.sha256)
        kind, description = "hub", f"{entry.hub_repo}@{entry.revision}"
    else:
        expected = read_lock()[pin_name].sha256 if pin_name else None
        state, sha = load_state_dict_file(source, expected_sha256=expected)
        kind, description = "local", f"local file {source}"
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {source} do not fit timm {architecture}: {err}") from err
    return TimmWeights(model, architecture, kind, description, sha, True)
