"""Where a run's data came from, as an MLflow dataset input.

MLflow records a dataset as a name, a digest and a *source*. The source says where the data
can be found again: a local file or folder is a ``LocalArtifactDatasetSource`` holding the
resolved path the data was read from, a download is an ``HTTPDatasetSource`` holding the
URL it came from (the library's own URL: torchvision for Fashion-MNIST and CIFAR-10,
medmnist for RetinaMNIST). Data built in memory (tests, notebooks) has no place to point
at and is recorded as a ``CodeDatasetSource`` with its description. The digest is the
data fingerprint (sha256 of the decoded images and labels), cut to MLflow's 36 characters;
the full fingerprint is the ``data.fingerprint`` param.
"""

from __future__ import annotations

from pathlib import Path

from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.http_dataset_source import HTTPDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from workbench.data import PreparedData

# MLflow keeps dataset digests to 36 characters; the full fingerprint is logged as a param.
DIGEST_CHARS = 36


def download_url(name: str, image_size: int) -> str:
    """The URL a dataset download fetches, read off the library that downloads it."""
    if name == "fashion_mnist":
        from torchvision.datasets import FashionMNIST

        # the folder of its four files (train/test images and labels)
        return FashionMNIST.mirrors[0]
    if name == "cifar10":
        from torchvision.datasets import CIFAR10

        return CIFAR10.url
    if name == "retinamnist":
        import medmnist

        info = medmnist.INFO["retinamnist"]
        return info["url"] if image_size == 28 else info[f"url_{image_size}"]
    raise ValueError(f"no download URL known for dataset {name!r}")


def dataset_source(data: PreparedData) -> DatasetSource:
    """The MLflow source of ``data``: local path, download URL, or in-memory description."""
    used = data.resolution.used if data.resolution is not None else None
    if used is None or used.path is None:
        return CodeDatasetSource(tags={"description": data.source[:500]})
    if used.kind == "download":
        return HTTPDatasetSource(url=download_url(data.name, int(data.train.images.shape[-1])))
    # registered by mlflow.data at import
    from mlflow.data.sources import (
        LocalArtifactDatasetSource,
    )

    return LocalArtifactDatasetSource(str(Path(used.path).expanduser().resolve()))


def training_dataset_input(data: PreparedData) -> DatasetInput:
    """``data`` as an MLflow dataset input in the "training" context."""
    dataset = MetaDataset(
        source=dataset_source(data),
        name=f"{data.name}-split{data.split_seed}",
        digest=data.data_fingerprint[:DIGEST_CHARS],
    )
    return DatasetInput(dataset._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, "training")])
