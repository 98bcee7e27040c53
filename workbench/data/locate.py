"""Where each dataset comes from: source resolution, in a fixed and reported order.

Order: an explicit path; ``$WORKBENCH_DATA_DIR``; the user cache (earlier downloads);
system-wide copies (Debian's ``/usr/share/datasets/fashion-mnist``); a normal download
into the user cache, only when ``download=True``. Every place looked is recorded, so both
the logged source and the not-found error can list them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.data import cifar10, fashion_mnist, retinamnist
from workbench.data.cache import CACHE_ENV, downloads_dir
from workbench.data.dataset import Resolution
from workbench.data.errors import DatasetNotFound, Place
from workbench.data.image_folder import is_tar, looks_like_image_folder

DATASET_NAMES = ("fashion_mnist", "cifar10", "retinamnist", "image_folder")
DATA_DIR_ENV = "WORKBENCH_DATA_DIR"
# System-wide copies installed by OS packages; tests replace this table.
SYSTEM_DIRS: dict[str, tuple[Path, ...]] = {
    "fashion_mnist": (Path("/usr/share/datasets/fashion-mnist"),)
}


@dataclass(frozen=True)
class Located:
    """A usable copy of a dataset.

    Attributes:
        kind: Format tag: ``"idx"``, ``"batches"``, ``"batches_tar"``, ``"jpeg_folder"``,
            ``"jpeg_tar"``, ``"npz"``, ``"folder"``, ``"tar"``.
        path: The file or folder to read.
        files: Source files, in a fixed order; ``()`` for folders of many images.
    """

    kind: str
    path: Path
    files: tuple[Path, ...] = ()


def _locate_fashion_mnist(path: Path, size: int | None) -> tuple[Located | None, str]:
    folder = path.parent if path.is_file() else path
    files, note = fashion_mnist.find_files(folder)
    return (Located("idx", folder, tuple(files)) if files else None), note


def _locate_cifar10(path: Path, size: int | None) -> tuple[Located | None, str]:
    kind, p, note = cifar10.locate(path)
    if kind is None:
        return None, note
    files = (
        tuple(cifar10.batch_files(p)) if kind == "batches" else (p,) if kind.endswith("tar") else ()
    )
    return Located(kind, p, files), note


def _locate_retinamnist(path: Path, size: int | None) -> tuple[Located | None, str]:
    if path.is_file():
        return Located("npz", path, (path,)), "found"
    if not path.is_dir():
        return None, "no such file or folder"
    p, note = retinamnist.find_file(path, size or 28)
    return (Located("npz", p, (p,)) if p else None), note


def _locate_image_folder(path: Path, size: int | None) -> tuple[Located | None, str]:
    if is_tar(path):
        return Located("tar", path, (path,)), "found"
    if path.is_dir() and looks_like_image_folder(path):
        return Located("folder", path), "found"
    return None, "not a folder with train/<class>/ images, nor a tar of one"


LOCATORS: dict[str, Callable[[Path, int | None], tuple[Located | None, str]]] = {
    "fashion_mnist": _locate_fashion_mnist,
    "cifar10": _locate_cifar10,
    "retinamnist": _locate_retinamnist,
    "image_folder": _locate_image_folder,
}


def _download_fashion_mnist(root: Path, size: int | None) -> None:
    from torchvision.datasets import FashionMNIST

    FashionMNIST(str(root), train=True, download=True)  # fetches all four files, md5-checked


def _download_cifar10(root: Path, size: int | None) -> None:
    from torchvision.datasets import CIFAR10

    CIFAR10(str(root), train=True, download=True)  # fetches and unpacks cifar-10-batches-py


def _download_retinamnist(root: Path, size: int | None) -> None:
    import medmnist  # imported here: it takes seconds and is only needed to download

    medmnist.RetinaMNIST(split="train", root=str(root), download=True, size=size or 28)


# Tests replace entries to exercise the download path offline.
DOWNLOADERS: dict[str, Callable[[Path, int | None], None]] = {
    "fashion_mnist": _download_fashion_mnist,
    "cifar10": _download_cifar10,
    "retinamnist": _download_retinamnist,
}

HINTS = {
    "fashion_mnist": [
        "Debian/Ubuntu without internet: sudo apt install dataset-fashion-mnist "
        "(installs the official files in /usr/share/datasets/fashion-mnist)",
        "pass the folder holding train-images-idx3-ubyte.gz etc.: --data-path DIR / load_dataset(name, path=DIR)",
        f"or put them in ${DATA_DIR_ENV}/fashion-mnist/",
    ],
    "cifar10": [
        "pass cifar-10-batches-py (or cifar-10-python.tar.gz), or the JPEG copy "
        "(cifar10-jpg.tar.gz, or the folder from `tar xzf cifar10-jpg.tar.gz -C DIR`): --data-path PATH",
        f"or put one of them in ${DATA_DIR_ENV}/",
    ],
    "retinamnist": [
        "pass the npz file: --data-path /path/to/retinamnist.npz",
        f"or put retinamnist.npz (retinamnist_224.npz for 224 px) in ${DATA_DIR_ENV}/",
    ],
    "image_folder": [
        "pass a folder with train/<class>/*.jpg|png (optional val/, test/) or a tar of it: --data-path DIR"
    ],
}
_DOWNLOAD_HINT = (
    "on a machine with internet: download=True (--download) fetches it into the user cache"
)


def check_name(name: str) -> str:
    """Return ``name`` if it is a known dataset, else raise ``ValueError`` listing them."""
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASET_NAMES}")
    return name


def resolve(
    name: str, path: str | os.PathLike | None, download: bool, size: int | None = None
) -> tuple[Located, Resolution]:
    """Find a usable copy of dataset ``name``.

    An explicit path that is not usable is an error right away: silently reading other
    data than the user pointed at would be worse than stopping.

    Args:
        name: One of ``DATASET_NAMES``.
        path: Explicit file or folder, or ``None``.
        download: Allow a download into the user cache as the last resort.
        size: RetinaMNIST image size (selects ``retinamnist_<size>.npz``).

    Returns:
        The located copy and the resolution record (places looked, place used).

    Raises:
        DatasetNotFound: Nothing usable anywhere; the message lists every place looked.
    """
    locate = LOCATORS[check_name(name)]
    places: list[Place] = []
    hints = HINTS[name] + ([_DOWNLOAD_HINT] if name in DOWNLOADERS else [])

    def attempt(kind: str, where: Path) -> Located | None:
        found, note = locate(where, size)
        places.append(Place(kind, str(where), note))
        return found

    if path is not None:
        found = attempt("explicit path", Path(path).expanduser())
        if found:
            return found, Resolution(tuple(places), places[-1])
        raise DatasetNotFound(name, places, hints)
    places.append(Place("explicit path", None, "none given"))
    if name == "image_folder":
        raise DatasetNotFound(name, places, hints)

    candidates = []
    if os.environ.get(DATA_DIR_ENV):
        candidates.append((f"${DATA_DIR_ENV}", Path(os.environ[DATA_DIR_ENV]).expanduser()))
    else:
        places.append(Place(f"${DATA_DIR_ENV}", None, "not set"))
    candidates.append((f"user cache (${CACHE_ENV} or ~/.cache)", downloads_dir(name)))
    candidates += [("system-wide", d) for d in SYSTEM_DIRS.get(name, ())]
    for kind, where in candidates:
        if found := attempt(kind, where):
            return found, Resolution(tuple(places), places[-1])

    if not download:
        places.append(Place("download", None, "not allowed: download=False"))
        raise DatasetNotFound(name, places, hints)
    root = downloads_dir(name)
    try:
        root.mkdir(parents=True, exist_ok=True)
        DOWNLOADERS[name](root, size)
    except Exception as e:  # any network or server failure ends in the one clear error
        places.append(Place("download", str(root), f"failed: {type(e).__name__}: {e}"))
        raise DatasetNotFound(name, places, hints) from e
    found, note = locate(root, size)
    places.append(
        Place("download", str(root), "downloaded" if found else f"downloaded, but {note}")
    )
    if not found:
        raise DatasetNotFound(name, places, hints)
    return found, Resolution(tuple(places), places[-1])
