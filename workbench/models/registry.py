"""Model names the workbench knows: study models and supported timm ViT architectures."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from workbench.models.cnn import CNN, CNNConfig
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
        image_size=28, patch_size=4, in_channels=1, num_classes=10, dim=64, depth=3, heads=4, mlp_hidden=128
    ),
    "fmnist_cnn": CNNConfig(in_channels=1, num_classes=10),
    # CIFAR-10 ablation base: 32 px, patch 4, width 192 (arms override fields).
    "cifar_vit": ViTConfig(image_size=32, patch_size=4, in_channels=3, num_classes=10, dim=192, depth=6, heads=4, mlp_ratio=2.0),
    "cifar_cnn": CNNConfig(in_channels=3, num_classes=10),
}


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def unknown_model(name: str, pinned: tuple[str, ...] = ()) -> UnknownModel:
    pins = f"; pinned checkpoints {', '.join(pinned)}" if pinned else ""
    return UnknownModel(
        f"unknown model {name!r}; give a study model ({', '.join(STUDY_MODELS)}), any timm ViT architecture "
        f"(timm.list_models(module=...) for {', '.join(TIMM_VIT_MODULES)}, e.g. vit_base_patch16_224, "
        f"vit_base_patch16_clip_224, vit_small_patch14_dinov2, vit_base_patch16_siglip_224){pins}"
    )


def model_config(name: str, **overrides) -> ViTConfig | CNNConfig:
    """The config of a named study model with field overrides applied (validated)."""
    if name not in STUDY_MODELS:
        raise unknown_model(name)
    base = STUDY_MODELS[name]
    unknown = sorted(set(overrides) - set(base.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{name}: unknown model field(s) {', '.join(unknown)}; valid: {', '.join(base.__dataclass_fields__)}")
    return replace(base, **overrides)


def build_model(cfg: ViTConfig | CNNConfig) -> nn.Module:
    return VisionTransformer(cfg) if isinstance(cfg, ViTConfig) else CNN(cfg)
