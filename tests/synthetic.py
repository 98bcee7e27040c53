"""Small learnable image data built in memory, for training tests (no files, no network)."""

from __future__ import annotations

import numpy as np

from workbench.data import prepare
from workbench.data.dataset import make_image_dataset
from workbench.train.config import DataSpec, ModelSpec, OptimConfig, RunConfig, TrainConfig


def synthetic_images(n: int, seed: int, channels: int = 1, size: int = 28, classes: int = 10):
    """Noise with a bright horizontal band whose position encodes the class."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    images = rng.integers(0, 60, (n, channels, size, size)).astype(np.uint8)
    for k in range(classes):
        images[labels == k, :, 2 * k : 2 * k + 6, :] += 150
    return images, labels


def synthetic_data(n_train: int = 320, n_val: int = 80, n_test: int = 100, seed: int = 0):
    ds = make_image_dataset(
        name="fashion_mnist",
        display_name="synthetic bands",
        class_names=tuple(f"c{k}" for k in range(10)),
        arrays={
            "train": synthetic_images(n_train + n_val, seed),
            "test": synthetic_images(n_test, seed + 1),
        },
        source="synthetic (tests)",
    )
    return prepare("fashion_mnist", dataset=ds, split_seed=0, train_size=n_train, val_size=n_val)


def tiny_config(epochs: int = 3, **run) -> TrainConfig:
    """A 2-block ViT small enough to train in seconds on one core."""
    model = ModelSpec(
        "fmnist_vit",
        {"dim": 32, "depth": 2, "heads": 2, "mlp_hidden": 64, "patch_size": 7, "dropout": 0.1},
    )
    data = DataSpec("fashion_mnist", hflip=True, rotate_degrees=5, translate_fraction=0.06)
    return TrainConfig(
        model,
        data,
        OptimConfig(lr=3e-3, warmup_epochs=0.5),
        RunConfig(epochs=epochs, batch_size=32, seed=0, device="cpu", **run),
    )


# A timm ViT arm shaped like tiny_config's model, for the synthetic 28 x 28 grey images.
TIMM_ARM = ModelSpec(
    "timm/vit_tiny_patch16_224",
    {
        "img_size": 28,
        "patch_size": 7,
        "in_chans": 1,
        "num_classes": 10,
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "mlp_ratio": 2.0,
        "drop_path_rate": 0.1,
    },
)
