"""How long an intervention grid takes: the code ``intervene`` runs, on seeded random-weight models.

The cost of evaluating interventions does not depend on the weights or the pixel values
(no data-dependent control flow), so a protocol's speed can be measured before any cell is
trained and without its dataset: one random-weight model of the acted-on architecture per
cell, random uint8 images of the split's size and shape, the protocol's batch size, mean
reference and attention maps. The reference measured in the same run is one intact forward
pass over the same images, so the loop's cost reads as forward-pass equivalents.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from workbench.data import NormStats
from workbench.interventions.evaluate import Inputs, evaluate, reference_means
from workbench.interventions.spec import HeadAblation, Intervention, flatten
from workbench.models.vit import ViTConfig, VisionTransformer


@dataclass(frozen=True)
class GridTiming:
    """Seconds per cell (mean reference + every intervention + attention maps) and the intact-pass reference."""

    cell_seconds: list[float]
    intact_seconds: list[float]  # one intact forward over the same images, per cell
    interventions: int
    examples: int
    threads: int

    @property
    def total(self) -> float:
        return sum(self.cell_seconds)

    @property
    def forward_equivalents(self) -> float:
        """Median over cells of (cell seconds / intact-pass seconds)."""
        return statistics.median(c / i for c, i in zip(self.cell_seconds, self.intact_seconds))


def time_grid(
    cfg: ViTConfig,
    grid: list[Intervention],
    cells: int,
    examples: int,
    batch_size: int,
    mean_images: int,
    attention_maps: bool = True,
    device: str = "cpu",
    say=lambda _: None,
) -> GridTiming:
    """Time ``cells`` evaluations of ``grid`` on ``examples`` random images, as ``intervene`` does them."""
    dev = torch.device(device)
    inputs = Inputs(NormStats((0.5,) * cfg.in_channels, (0.25,) * cfg.in_channels), batch_size, dev)
    needs_mean = any(isinstance(s, HeadAblation) and s.mode == "mean" for s in flatten(grid))
    cell_s, intact_s = [], []
    for seed in range(cells):
        gen = torch.Generator().manual_seed(seed)
        # the model's own init, seeded: the timing does not depend on the values
        torch.manual_seed(seed)
        model = VisionTransformer(cfg).eval().to(dev)
        images = torch.randint(
            0, 256, (examples, cfg.in_channels, *cfg.image_hw), dtype=torch.uint8, generator=gen
        )
        labels = torch.randint(0, max(cfg.num_classes, 1), (examples,), generator=gen)
        train = torch.randint(
            0,
            256,
            (max(mean_images, 1), cfg.in_channels, *cfg.image_hw),
            dtype=torch.uint8,
            generator=gen,
        )
        started = time.perf_counter()
        with torch.no_grad():
            for batch in inputs.loader(images, labels):
                model(batch.images)
        intact_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        means = reference_means(model, train, mean_images, 0, inputs)[0] if needs_mean else None
        evaluate(
            model,
            images,
            labels,
            torch.arange(examples),
            inputs,
            grid,
            means,
            attention_maps=attention_maps,
        )
        cell_s.append(time.perf_counter() - started)
        say(
            f"cell {seed + 1} of {cells}: {cell_s[-1]:.2f} s ({cell_s[-1] / intact_s[-1]:.1f} intact passes)"
        )
    return GridTiming(cell_s, intact_s, len(grid), examples, torch.get_num_threads())
