"""Write a small labelled image folder to try the workbench on your own data without having any.

    python scripts/make_shapes_folder.py DIR [--train 40] [--val 12] [--test 12] [--seed 0]

``DIR/{train,val,test}/{square,disc,cross}/<k>.png``: 32 x 32 RGB images of one bright shape
(a red square, a green disc or a blue cross) at a random place and size on dark noise. Any
folder of this layout (``train/<class>/``, optional ``val/`` and ``test/``, one image size)
is a dataset for ``dataset: {name: image_folder}`` with ``--data-path DIR`` (docs/data.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("square", "disc", "cross")
SIZE = 32


def shape_image(cls: str, rng: np.random.Generator) -> np.ndarray:
    """One (32, 32, 3) uint8 image of class ``cls``."""
    yy, xx = np.mgrid[:SIZE, :SIZE]
    img = rng.integers(0, 60, (SIZE, SIZE, 3)).astype(np.uint8)
    cx, cy, r = rng.integers(10, 22), rng.integers(10, 22), rng.integers(5, 9)
    if cls == "square":
        mask, channel = (abs(xx - cx) < r) & (abs(yy - cy) < r), 0
    elif cls == "disc":
        mask, channel = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r, 1
    else:
        mask = ((abs(xx - cx) < 2) & (abs(yy - cy) < r)) | ((abs(yy - cy) < 2) & (abs(xx - cx) < r))
        channel = 2
    img[mask, channel] = 200 + rng.integers(0, 55)
    return img


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--train", type=int, default=40, help="images per class in train/")
    parser.add_argument("--val", type=int, default=12, help="images per class in val/ (0: no val/)")
    parser.add_argument(
        "--test", type=int, default=12, help="images per class in test/ (0: no test/)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    counts = {"train": args.train, "val": args.val, "test": args.test}
    for split, n in counts.items():
        for cls in CLASSES if n else ():
            folder = args.folder / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                Image.fromarray(shape_image(cls, rng)).save(folder / f"{k}.png")
    total = sum(counts.values()) * len(CLASSES)
    print(
        f"{args.folder}: {total} images, {len(CLASSES)} classes ({', '.join(CLASSES)}), {SIZE} x {SIZE} RGB; "
        + ", ".join(f"{split} {n} per class" for split, n in counts.items() if n)
    )


if __name__ == "__main__":
    main()
