"""Controls for attribution maps: trivial baselines, per-image random draws, the planted oracle,
the insertion curve's start and the model-randomisation sanity check.

Every reading of a map needs something to be read against. The baselines here cost almost
nothing and set the bar a map must clear before its agreement with the causal effects means
anything:

- ``intensity``: each patch's mean input value (over its channels and pixels, as the model
  receives it, i.e. after normalisation). A map that does no better than "bright patches
  matter" has learnt nothing about the model.
- ``centre``: a centre prior, minus the distance of the patch's centre from the image centre
  (the same scores for every image): "the object is in the middle".
- ``oracle``: the exact single-token effects themselves as scores (``causal.single_token_effects``).
  Its Spearman rho is 1 by construction; its deletion and insertion AUCs are not the best
  possible, because those curves remove or keep tokens *together* and single-token effects do
  not add up. The oracle row shows, with numbers, that rho and the AUCs measure different things.
- Random draws (``random_draw_scores``): ``D`` independent random orders per image, each seeded
  from ``(random_seed, cell seed, image index, draw)`` with numpy's ``SeedSequence``: no draw is
  shared between cells, images or draws, and a draw does not depend on the batch it falls in.
  Their spread is the spread any method must be compared against.

The sanity check (``randomisation_check``) follows Adebayo et al., "Sanity Checks for Saliency
Maps" (NeurIPS 2018), cascading randomisation: the blocks' parameters are replaced by seeded
Gaussian noise of each tensor's own mean and standard deviation, from the last block down to
the first, one more block per step, and each map is recomputed on the randomised model. The
recorded number per step and image is Spearman's rho between the map of the trained model and
that of the randomised one. A map that still correlates with itself when every block is random
(``SURVIVES`` or more, mean over the images) does not depend on what the model learnt: flagged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.agreement import spearman_per_image
from workbench.attribution.causal import single_token_effects, true_log_prob
from workbench.attribution.glassbox import as_glassbox, evaluating, fused_attention
from workbench.attribution.token_drop import logits_keeping

# A map whose mean rank correlation with itself after every block is randomised is at least
# this is flagged as not depending on the trained weights.
SURVIVES = 0.5


@dataclass(frozen=True)
class Controls:
    """Which controls ``score_cell`` computes beside the methods.

    Attributes:
        random_draws: ``D`` random orders per image (0: none beyond the ``random`` method).
        sanity_check: Run the model-randomisation check on every method but ``random``.
        cell_seed: The acted-on cell's seed, mixed into every draw's seed.
    """

    random_draws: int = 0
    sanity_check: bool = False
    cell_seed: int = 0


# Methods that never run the model: the randomisation check flags them by construction.
MODEL_FREE = ("intensity", "centre")


def intensity(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each patch's mean input value over its channels and pixels: ``(B, P)`` float64 (the model is not run)."""
    glass = as_glassbox(model)
    (rows, cols), (ph, pw) = glass.cfg.grid, glass.cfg.patch_hw
    x = images.detach().to(torch.float64)[:, :, : rows * ph, : cols * pw]  # pixels the model sees
    B, C = x.shape[:2]
    per_patch = x.reshape(B, C, rows, ph, cols, pw).mean(dim=(1, 3, 5))  # (B, rows, cols)
    return per_patch.reshape(B, rows * cols).cpu()


def centre(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Centre prior: minus each patch centre's distance from the grid's centre, ``(B, P)`` (the same per image)."""
    glass = as_glassbox(model)
    rows, cols = glass.cfg.grid
    r, c = np.meshgrid(np.arange(rows) + 0.5, np.arange(cols) + 0.5, indexing="ij")  # (rows, cols)
    distance = np.hypot(r - rows / 2, c - cols / 2).reshape(-1)  # row-major: the tokens' order
    return torch.from_numpy(-distance).expand(images.shape[0], rows * cols).clone()


def random_draw_scores(
    num_patches: int, random_seed: int, cell_seed: int, image_index, draws: int
) -> np.ndarray:
    """``(draws, B, P)`` uniform scores, one generator per (random seed, cell seed, image, draw)."""
    index = np.asarray(image_index, dtype=np.int64)
    out = np.empty((draws, index.size, num_patches))
    for d in range(draws):
        for b, i in enumerate(index):
            sequence = np.random.SeedSequence([int(random_seed), int(cell_seed), int(i), d])
            out[d, b] = np.random.default_rng(sequence).random(num_patches)
    return out


@torch.inference_mode()
def insertion_start(model, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The insertion curve's first point, the class (and register) tokens alone with no patch.

    Returns ``(predicted class (B,), its probability (B,))``: what the model says before any
    patch is inserted (it reads the same sequence for every image, so it is one class).
    """
    glass = as_glassbox(model)
    with evaluating(glass), fused_attention(glass):
        empty = torch.arange(0).expand(images.shape[0], 1, 0)
        logits = logits_keeping(glass, images, empty)[:, 0]  # (B, classes)
        predicted = logits.argmax(dim=-1)
        prob = true_log_prob(logits, predicted).exp()
    return predicted.cpu().numpy(), prob.cpu().numpy()


def randomised_blocks(model, top: int, seed: int):
    """A copy of ``model`` with its last ``top`` blocks' parameters replaced by seeded noise.

    Each parameter tensor becomes Gaussian noise with the tensor's own mean and standard
    deviation (a constant tensor, e.g. a fresh LayerNorm weight, stays constant): the scale
    of the trained model, none of what it learnt.
    """
    glass = copy.deepcopy(as_glassbox(model))
    depth = glass.cfg.depth
    generator = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for block in range(depth - 1, depth - 1 - top, -1):
            for p in glass.blocks[block].parameters():
                mean, std = p.mean(), p.std() if p.numel() > 1 else torch.zeros(())
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.copy_((mean + std * noise.to(p.device)).to(p.dtype))
    return glass


def randomisation_check(
    model,
    images: torch.Tensor,
    labels: torch.Tensor,
    methods: Sequence[str],
    maps: dict[str, np.ndarray],
    compute: Callable[[object, torch.Tensor, torch.Tensor, str], torch.Tensor],
    *,
    seed: int,
    max_sequences: int = 4096,
) -> dict[str, np.ndarray]:
    """Per method, ``(L, B)`` Spearman rho between its map on the trained model and on the model
    with its top ``1..L`` blocks randomised (row ``j``: the last ``j + 1`` blocks random).

    Args:
        maps: method -> ``(B, P)`` scores of the trained model.
        compute: ``(model, images, labels, method) -> (B, P)`` scores of one method (``oracle``:
            the single-token effects of that model).
        seed: The noise's seed (step ``j`` draws with ``seed + j``).
    """
    glass = as_glassbox(model)
    depth = glass.cfg.depth
    out = {m: np.full((depth, images.shape[0]), np.nan) for m in methods}
    for step in range(depth):
        random_model = randomised_blocks(glass, step + 1, seed + step)
        for m in methods:
            if m == "oracle":
                now = single_token_effects(
                    random_model, images, labels, max_sequences=max_sequences
                ).effects
            else:
                now = compute(random_model, images, labels, m).to(torch.float64).cpu().numpy()
            out[m][step] = spearman_per_image(maps[m], now)
    return out
