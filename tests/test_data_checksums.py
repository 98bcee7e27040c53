"""The checksum tables agree with the libraries that publish the official digests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from workbench.data import checksums


def test_fashion_mnist_gz_md5_match_torchvision():
    from torchvision.datasets import FashionMNIST

    assert dict(FashionMNIST.resources) == checksums.FASHION_MNIST_GZ_MD5


def test_cifar10_md5_match_torchvision():
    from torchvision.datasets import CIFAR10

    assert dict(CIFAR10.train_list + CIFAR10.test_list) == checksums.CIFAR10_BATCH_MD5
    assert CIFAR10.tgz_md5 == checksums.CIFAR10_TGZ_MD5


def test_retinamnist_md5_match_medmnist_info():
    # Load medmnist/info.py on its own: importing the medmnist package takes seconds.
    spec = importlib.util.find_spec("medmnist")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("medmnist not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "info.py"
    info_spec = importlib.util.spec_from_file_location("_medmnist_info", path)
    info = importlib.util.module_from_spec(info_spec)
    info_spec.loader.exec_module(info)
    entry = info.INFO["retinamnist"]
    expected = {28: entry["MD5"], **{s: entry[f"MD5_{s}"] for s in (64, 128, 224)}}
    assert expected == checksums.RETINAMNIST_MD5
    assert entry["n_samples"] == {"train": 1080, "val": 120, "test": 400}
