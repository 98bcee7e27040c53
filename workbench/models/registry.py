"""Model names the workbench knows: study models, timm arms (``timm/<architecture>``) and timm ViTs."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from workbench.models.cnn import CNN, CNNConfig
from workbench.models.timm_arm import (
    LIST_HINT,
    TIMM_PREFIX,
    TimmModelConfig,
    checked,
    create,
    is_timm_name,
    marker_hint,
)
from workbench.models.vit import ViTConfig, VisionTransformer

# timm modules whose architectures the glass-box ViT is checked against. Any architecture
# of these modules is accepted by name; whether it is implemented is decided by its
# options (workbench.convert.timm_vit.config_from_timm), never by a list of names.
TIMM_VIT_MODULES = ("vision_transformer", "vision_transformer_hybrid", "deit")


def timm_vit_architectures(modules: tuple[str, ...] = TIMM_VIT_MODULES) -> list[str]:
    """Every architecture name of timm's ViT modules, sorted."""
    import timm

    return sorted({name for module in modules for name in timm.list_models(module=module)})


STUDY_MODELS: dict[str, ViTConfig | CNNConfig] = {
    # The Fashion-MNIST seed study's models (105,546 and 117,498 parameters).
    "fmnist_vit": ViTConfig(
        image_size=28,
        patch_size=4,
        in_channels=1,
        num_classes=10,
        dim=64,
        depth=3,
        heads=4,
        mlp_hidden=128,
    ),
    "fmnist_cnn": CNNConfig(in_channels=1, num_classes=10),
    # CIFAR-10 ablation base: 32 px, patch 4, width 192 (arms override fields).
    "cifar_vit": ViTConfig(
        image_size=32,
        patch_size=4,
        in_channels=3,
        num_classes=10,
        dim=192,
        depth=6,
        heads=4,
        mlp_ratio=2.0,
    ),
    "cifar_cnn": CNNConfig(in_channels=3, num_classes=10),
}


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def unknown_model(
    name: str,
    pinned: tuple[str, ...] = (),
    *,
    study: bool = True,
    timm_arms: bool = True,
    timm_vits: bool = False,
) -> UnknownModel:
    """The one line for a name the caller does not take, naming only what that caller takes.

    Args:
        pinned: Pinned checkpoint names the caller takes.
        study: The caller takes the study models (``fmnist_vit``, ...).
        timm_arms: It takes ``timm/<architecture>``: study arms and ``workbench train``.
        timm_vits: It takes a bare timm ViT architecture (equivalence, timm sources, benchmarks).
    """
    givens = []
    if study:
        givens.append(f"a study model ({', '.join(STUDY_MODELS)})")
    if timm_arms:
        givens.append(
            f"a timm architecture as {TIMM_PREFIX}<name> (e.g. {TIMM_PREFIX}resnet18; {LIST_HINT})"
        )
    if timm_vits:
        givens.append(
            f"any timm ViT architecture (timm.list_models(module=...) for {', '.join(TIMM_VIT_MODULES)}, "
            "e.g. vit_base_patch16_224, vit_base_patch16_clip_224, vit_small_patch14_dinov2, "
            "vit_base_patch16_siglip_224)"
        )
    if pinned:
        givens.append(f"a pinned checkpoint ({', '.join(pinned)})")
    return UnknownModel(
        f"unknown model {name!r}{marker_hint(name) if timm_arms else ''}; give {', or '.join(givens)}"
    )


def model_config(name: str, **overrides) -> ViTConfig | CNNConfig | TimmModelConfig:
    """The config of a named study model with field overrides applied (validated).

    A ``timm/<architecture>`` name gives a ``TimmModelConfig`` whose overrides are the keyword
    arguments of ``timm.create_model``, checked by building it on the meta device.
    """
    if is_timm_name(name):
        return checked(name[len(TIMM_PREFIX) :], overrides)
    if name not in STUDY_MODELS:
        raise unknown_model(name)
    base = STUDY_MODELS[name]
    unknown = sorted(set(overrides) - set(base.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"{name}: unknown model field(s) {', '.join(unknown)}; valid: {', '.join(base.__dataclass_fields__)}"
        )
    return replace(base, **overrides)


def build_model(cfg: ViTConfig | CNNConfig | TimmModelConfig) -> nn.Module:
    """The model of a config, initialised from the global RNG (the trainer seeds it per cell)."""
    if isinstance(cfg, TimmModelConfig):
        return create(cfg)
    return VisionTransformer(cfg) if isinstance(cfg, ViTConfig) else CNN(cfg)
