"""Official checksums of the dataset files and helpers to verify them.

Sources of the digests (copied, not computed here, except where said):

- Fashion-MNIST ``.gz`` md5s: ``torchvision.datasets.FashionMNIST.resources``.
- Fashion-MNIST decompressed md5s: the digests of the official files after ``gunzip``, as
  published alongside the ``.gz`` digests by several loaders. Needed because Debian's
  ``dataset-fashion-mnist`` re-packs the gzip container (no file name in the gzip header,
  another timestamp), so its ``.gz`` md5s differ while the decompressed bytes are the
  official ones.
- CIFAR-10 python batches: ``torchvision.datasets.CIFAR10.train_list/test_list/tgz_md5``.
- RetinaMNIST: ``medmnist.INFO["retinamnist"]["MD5"]`` and ``MD5_64/_128/_224``.
- ``cifar10-jpg.tar.gz``: sha256 of this project's offline JPEG copy (not an official file,
  so a different JPEG copy is accepted but reported as unverified).

``tests/test_data_checksums.py`` cross-checks these tables against torchvision and medmnist.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


FASHION_MNIST_GZ_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}

FASHION_MNIST_RAW_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}

CIFAR10_BATCH_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
}
CIFAR10_TGZ_MD5 = "c58f30108f718f92721af3b95e74349a"  # cifar-10-python.tar.gz

CIFAR10_JPEG_COPY_SHA256 = "45b041e867f5a40f79bfde38d3dd1fd511103d50068c1afecf6445e25234d4db"

# Image side length -> md5 of retinamnist[_SIZE].npz.
RETINAMNIST_MD5 = {
    28: "bd4c0672f1bba3e3a89f0e4e876791e4",
    64: "afda852cc34dcda56f86ad2b2457dbcc",
    128: "e48e916a24454daf90583d4e6efb1a18",
    224: "eae7e3b6f3fcbda4ae613ebdcbe35348",
}

_CHUNK = 1 << 20


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def bytes_digest(data: bytes, algorithm: str = "md5") -> str:
    """Hex digest of in-memory bytes."""
    return hashlib.new(algorithm, data).hexdigest()
