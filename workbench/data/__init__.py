"""Data layer: datasets as in-memory uint8 tensors, seeded splits, fast batch loaders.

Usage::

    from workbench.data import AugmentConfig, TensorLoader, prepare

    data = prepare("fashion_mnist", split_seed=0, train_size=3200, val_size=800)
    print(data.display_name, data.data_fingerprint[:12], data.split_fingerprint[:12])
    print(data.source)                         # format, path and checksum status
    train = TensorLoader.from_split(
        data.train, batch_size=128, norm=data.norm, seed=1,
        augment=AugmentConfig(crop_padding=2, hflip=True),
    )
    val = TensorLoader.from_split(data.val, batch_size=512, norm=data.norm, shuffle=False)
    for epoch in range(10):
        for images, labels, indices in train.iter_epoch(epoch):   # resume: start_batch=k
            ...

    # Pretrained ViT on 28 px RetinaMNIST: resize each batch on the device.
    data = prepare("retinamnist", path="retinamnist.npz")
    loader = TensorLoader.from_split(data.train, batch_size=64, norm=IMAGENET_STATS,
                                     seed=0, resize_to=224)

Where data comes from, in order: ``path=``, ``$WORKBENCH_DATA_DIR``, the user cache
(``$WORKBENCH_CACHE_DIR``, default ``~/.cache/glassbox-workbench``), system-wide copies
(Debian's ``/usr/share/datasets/fashion-mnist``), then a download when ``download=True``.
Decoded tensors are cached, so only the first load of a source decodes it.
"""

from workbench.data.augment import AugmentConfig, augment_batch, sample_params
from workbench.data.cache import cache_dir
from workbench.data.dataset import ImageDataset, Resolution, SplitTensors
from workbench.data.errors import (
    ChecksumMismatch,
    DataFormatError,
    DatasetNotFound,
    Place,
    SplitSizeError,
)
from workbench.data.load_dataset import load_dataset
from workbench.data.batches import Batch, TensorLoader, derive_seed
from workbench.data.prepare import DEFAULT_SIZES, PreparedData, PreparedSplit, prepare
from workbench.data.locate import DATASET_NAMES
from workbench.data.splits import SplitIndices, make_split, split_fingerprint, stratified_subset
from workbench.data.transforms import (
    IMAGENET_STATS,
    NORM_STATS,
    NormStats,
    compute_norm_stats,
    normalize,
    resize_batch,
)

__all__ = [
    "SplitSizeError",
    "DATASET_NAMES",
    "DEFAULT_SIZES",
    "IMAGENET_STATS",
    "NORM_STATS",
    "AugmentConfig",
    "Batch",
    "ChecksumMismatch",
    "DataFormatError",
    "DatasetNotFound",
    "ImageDataset",
    "NormStats",
    "Place",
    "PreparedData",
    "PreparedSplit",
    "Resolution",
    "SplitIndices",
    "SplitTensors",
    "TensorLoader",
    "augment_batch",
    "cache_dir",
    "compute_norm_stats",
    "derive_seed",
    "load_dataset",
    "make_split",
    "normalize",
    "prepare",
    "resize_batch",
    "sample_params",
    "split_fingerprint",
    "stratified_subset",
]
