"""Loader benchmark: TensorLoader against a per-image torchvision pipeline.

Both sides do the same work on CIFAR-10-sized random uint8 images (N, 3, 32, 32): random
crop with 4 px padding, horizontal flip, affine (rotation within 5 degrees, translation
within 6 percent, bilinear), conversion to float and normalisation. The reference is the
usual torchvision ``Dataset`` + ``DataLoader`` with ``transforms.v2`` applied image by
image. Each side runs one full epoch per repeat; the median throughput is reported with
the spread, and the ratio ours / torchvision is measured in the same process.

With ``randaugment_ops`` (``--randaugment-ops``, 2 by default on the command line), a third
loader times the same TensorLoader with RandAugment added (torchvision v2's ops, drawn per
image, ``workbench.data.augment``) in the same rounds, so the cost of RandAugment is the
ratio of two loaders measured side by side.

This module never talks to MLflow: ``run_loader_benchmark`` returns a dict, which the CLI
and the tracking layer log.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import click
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import InterpolationMode, v2

from studies.runtime.options import threads_option
from workbench.bench.timing import Load, decide
from workbench.data import NORM_STATS, AugmentConfig, TensorLoader

AUGMENT = AugmentConfig(crop_padding=4, hflip=True, rotate_degrees=5.0, translate_fraction=0.06)
RANDAUGMENT_MAGNITUDE = 9


class _PerImageDataset(Dataset):
    """The reference: one image at a time through torchvision transforms v2."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        stats = NORM_STATS["cifar10"]
        self.transform = v2.Compose(
            [
                v2.RandomCrop(32, padding=AUGMENT.crop_padding),
                v2.RandomHorizontalFlip(),
                v2.RandomAffine(
                    degrees=AUGMENT.rotate_degrees,
                    translate=(AUGMENT.translate_fraction, AUGMENT.translate_fraction),
                    interpolation=InterpolationMode.BILINEAR,
                ),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(list(stats.mean), list(stats.std)),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i], i


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_epoch(batches, device: torch.device) -> tuple[float, int]:
    """Seconds for one pass, and the number of images seen (each batch lands on ``device``)."""
    _sync(device)
    start = time.perf_counter()
    n = 0
    for images, labels, _ in batches:
        images = images.to(device, non_blocking=True)
        n += len(labels)
    _sync(device)
    return time.perf_counter() - start, n


def run_loader_benchmark(
    n_images: int = 10_000,
    batch_size: int = 256,
    repeats: int = 3,
    num_workers: int = 0,
    device: str | None = None,
    seed: int = 0,
    torch_threads: int | None = None,
    randaugment_ops: int = 0,
) -> dict:
    """Measure training-loader throughput, ours versus torchvision, in images per second.

    Args:
        n_images: Images per epoch.
        batch_size: Images per batch.
        repeats: Epochs timed per side; the median is reported.
        num_workers: ``DataLoader`` worker processes for the torchvision side.
        device: Where batches must end up; default CUDA when available.
        seed: Seed of the random images and of both loaders.
        torch_threads: Intra-op threads for this measurement (restored afterwards);
            ``None`` keeps the current setting. Per-image pipelines run best with 1 (what
            DataLoader workers use), so compare at equal settings.
        randaugment_ops: Also time TensorLoader with RandAugment (this many ops, magnitude 9)
            in the same rounds; 0: not measured.

    Returns:
        A flat dict: settings, per-repeat seconds, median images/s per side with min/max,
        and ``ratio`` = ours / torchvision; with RandAugment also ``randaugment_images_per_s``
        (min, max) and ``randaugment_slowdown`` = ours without / ours with RandAugment.
    """
    previous_threads = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        return _run(n_images, batch_size, repeats, num_workers, device, seed, randaugment_ops)
    finally:
        torch.set_num_threads(previous_threads)


def _run(
    n_images: int,
    batch_size: int,
    repeats: int,
    num_workers: int,
    device: str | None,
    seed: int,
    randaugment_ops: int = 0,
) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    load = Load.begin()
    g = torch.Generator().manual_seed(seed)
    # (N, C, H, W)
    images = torch.randint(0, 256, (n_images, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n_images,), generator=g)

    ours = TensorLoader(images, labels, batch_size=batch_size, norm=NORM_STATS["cifar10"], seed=seed,
                        augment=AUGMENT, device=dev)  # fmt: skip
    # fmt: skip
    reference = DataLoader(
        _PerImageDataset(images, labels),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=dev.type == "cuda",
    )
    _time_epoch(ours.iter_epoch(-1), dev)  # warm-up: first-call allocations, CUDA kernels
    with_ra = None
    if randaugment_ops:
        with_ra = TensorLoader(
            images,
            labels,
            batch_size=batch_size,
            norm=NORM_STATS["cifar10"],
            seed=seed,
            augment=replace(
                AUGMENT,
                randaugment_ops=randaugment_ops,
                randaugment_magnitude=RANDAUGMENT_MAGNITUDE,
            ),
            device=dev,
        )
        _time_epoch(with_ra.iter_epoch(-1), dev)
    ours_s, ref_s, ra_s = [], [], []
    for r in range(repeats):
        ours_s.append(_time_epoch(ours.iter_epoch(r), dev)[0])
        ref_s.append(_time_epoch(reference, dev)[0])
        if with_ra is not None:  # in the same rounds as the loader without it
            ra_s.append(_time_epoch(with_ra.iter_epoch(r), dev)[0])

    def rate(seconds: list[float]) -> dict[str, float]:
        rates = [n_images / s for s in seconds]
        return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}

    o, t = rate(ours_s), rate(ref_s)
    # Seconds per epoch of the same images: the loaders without RandAugment do the same work
    # (the choice); RandAugment's verdict against TensorLoader is its cost, not a choice.
    per_round = {"TensorLoader": ours_s, "torchvision": ref_s}
    if ra_s:
        per_round["TensorLoader+RandAugment"] = ra_s
    decision = decide(per_round, "TensorLoader", ["TensorLoader", "torchvision"], "loader")
    load = load.finish()
    extra = {}
    if ra_s:
        a = rate(ra_s)
        extra = {
            "randaugment": f"{randaugment_ops} ops, magnitude {RANDAUGMENT_MAGNITUDE}, after crop and flip",
            "randaugment_seconds": ra_s,
            "randaugment_images_per_s": a["median"],
            "randaugment_images_per_s_min": a["min"],
            "randaugment_images_per_s_max": a["max"],
            "randaugment_slowdown": o["median"] / a["median"],
        }
    return {
        "n_images": n_images,
        "batch_size": batch_size,
        "repeats": repeats,
        "num_workers": num_workers,
        "device": str(dev),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "augment": "crop_padding=4, hflip, rotate 5 deg, translate 0.06, bilinear, normalise",
        "ours_seconds": ours_s,
        "torchvision_seconds": ref_s,
        "ours_images_per_s": o["median"],
        "ours_images_per_s_min": o["min"],
        "ours_images_per_s_max": o["max"],
        "torchvision_images_per_s": t["median"],
        "torchvision_images_per_s_min": t["min"],
        "torchvision_images_per_s_max": t["max"],
        "ratio": o["median"] / t["median"],
        **load.as_dict(),
        "verdicts": decision.lines,
        "use": decision.use,
        **extra,
    }


def format_table(result: dict) -> str:
    """Plain-text table of a ``run_loader_benchmark`` result."""
    rows = [
        ("loader", "images/s (median)", "min", "max"),
        (
            "workbench TensorLoader",
            *(f"{result[f'ours_images_per_s{s}']:,.0f}" for s in ("", "_min", "_max")),
        ),
        (
            f"torchvision v2 + DataLoader (workers={result['num_workers']})",
            *(f"{result[f'torchvision_images_per_s{s}']:,.0f}" for s in ("", "_min", "_max")),
        ),
    ]
    if "randaugment_images_per_s" in result:
        rows.append(
            (
                f"workbench TensorLoader + RandAugment ({result['randaugment']})",
                *(f"{result[f'randaugment_images_per_s{s}']:,.0f}" for s in ("", "_min", "_max")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(
        f"ratio ours / torchvision: {result['ratio']:.1f}x  ({result['n_images']} images, batch "
        f"{result['batch_size']}, {result['repeats']} repeats, device {result['device']}, "
        f"{result['cpu_count']} CPUs, {result['torch_threads']} torch threads)"
    )
    if "randaugment_slowdown" in result:
        lines.append(
            f"RandAugment cost: TensorLoader {result['randaugment_slowdown']:.1f}x slower with it "
            "(median images/s without / with, same rounds)"
        )
    lines.append(
        f"load average {result['load_start']:.2f} at the start, {result['load_end']:.2f} at the end"
    )
    return "\n".join(lines + result["verdicts"])


@click.command("loader")
@click.option(
    "--n-images",
    default=10_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Images per epoch.",
)
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed epochs per loader (median reported).",
)
@click.option(
    "--num-workers",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="DataLoader workers for the torchvision side.",
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@threads_option
@click.option(
    "--torch-threads",
    "old_threads",
    default=None,
    type=click.IntRange(min=1),
    hidden=True,
    help="The former name of --threads.",
)
@click.option(
    "--randaugment-ops",
    default=2,
    show_default=True,
    type=click.IntRange(min=0, max=16),
    help="Also time TensorLoader with RandAugment (this many ops per image, magnitude 9); 0: not.",
)
def benchmark_loader(
    n_images: int,
    batch_size: int,
    repeats: int,
    num_workers: int,
    device: str | None,
    threads: int,
    old_threads: int | None,
    randaugment_ops: int,
) -> dict:
    """Compare TensorLoader with a per-image torchvision pipeline and print a table."""
    if old_threads is not None:
        click.echo("note: --torch-threads is now --threads, as in every other command", err=True)
    result = run_loader_benchmark(
        n_images,
        batch_size,
        repeats,
        num_workers,
        device,
        torch_threads=old_threads or threads or None,
        randaugment_ops=randaugment_ops,
    )
    click.echo(format_table(result))
    return result


if __name__ == "__main__":
    benchmark_loader()
