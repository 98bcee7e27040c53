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

The sanity check (``randomisation_check``) is the model-randomisation test of Adebayo et al.,
"Sanity Checks for Saliency Maps" (NeurIPS 2018), in both of its forms:

- cascading randomisation: the layers are re-initialised from the logits down, cumulatively:
  the head, the final norm, the last block, ..., the first block, then the embeddings (patch
  projection, class and register tokens, positions); one more layer per step;
- independent randomisation: one layer at a time, every other layer trained.

Re-initialisation uses the model's own init (``reinitialised``): one fresh
``VisionTransformer(cfg)`` built under a seeded generator, i.e. ``reset_parameters``
(truncated normal, std 0.02, for linear weights and positions, zero biases, normal std 1e-6
for the class and register tokens, LayerScale's constant) and PyTorch's defaults where it
leaves a layer alone (the patch projection's Kaiming-uniform convolution, LayerNorm's ones
and zeros). It is drawn once: the values a layer takes at step k are the values it keeps at
every later step (nested draws), and the independent test uses the same values. Each map is
recomputed on every randomised model and compared with the trained model's map, per image:
Spearman's rho, Spearman's rho of the absolute values, and SSIM on the patch grid
(``workbench.attribution.agreement``). A map that still correlates with itself when every
layer is random (rho at least ``SURVIVES``, mean over the images) does not depend on what the
model learnt: flagged. ``intensity`` and ``centre`` never run the model: they are the check's
positive control (rho, absolute rho and SSIM stay 1 at every step).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.attribution.agreement import (
    abs_spearman_per_image,
    spearman_per_image,
    ssim_per_image,
)
from workbench.attribution.causal import single_token_effects, true_log_prob
from workbench.attribution.glassbox import as_glassbox, evaluating, fused_attention
from workbench.attribution.token_drop import logits_keeping
from workbench.models.vit import VisionTransformer

# A map whose mean rank correlation with itself after every layer is randomised is at least
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


# The check's metrics, per step and image (``compare_maps``).
SANITY_METRICS = ("rho", "abs_rho", "ssim")
# Its two forms: cumulative from the logits down, and one layer at a time.
SANITY_MODES = ("cascade", "independent")
EMBEDDINGS = "embed"


def cascade_layers(model) -> list[tuple[str, tuple[str, ...]]]:
    """The model's layers from the logits down, each with its parameter names.

    Order: ``head``, ``fc_norm`` and ``attn_pool`` where the model has them, the final
    ``norm``, ``blocks.L-1`` ... ``blocks.0``, then ``embed`` (every parameter before the
    blocks: patch projection and norm, class and register tokens, positions, ``norm_pre``).
    A layer without parameters (an identity norm) is left out.
    """
    glass = as_glassbox(model)
    depth = glass.cfg.depth
    order = ["head", "fc_norm", "attn_pool", "norm"]
    order += [f"blocks.{i}" for i in range(depth - 1, -1, -1)] + [EMBEDDINGS]

    def layer(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "blocks":
            return ".".join(parts[:2])
        return parts[0] if parts[0] in order else EMBEDDINGS

    names = [n for n, _ in glass.named_parameters()]
    members = {g: tuple(n for n in names if layer(n) == g) for g in order}
    return [(g, members[g]) for g in order if members[g]]


def reinitialised(model, seed: int) -> dict[str, torch.Tensor]:
    """One draw of every parameter from the model's own init, seeded (CPU, float32).

    A fresh ``VisionTransformer(cfg)`` is built under a forked generator seeded with ``seed``
    (the global random state is left as it was), so every layer gets exactly the distribution
    its constructor gives it (see the module docstring).
    """
    glass = as_glassbox(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        fresh = type(glass)(glass.cfg)
    return {n: p.detach() for n, p in fresh.named_parameters()}


def randomised(model, draw: dict[str, torch.Tensor], names) -> VisionTransformer:
    """A copy of ``model`` with the named parameters replaced by their values in ``draw``."""
    glass = copy.deepcopy(as_glassbox(model))
    params = dict(glass.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(draw[n].to(device=params[n].device, dtype=params[n].dtype))
    return glass


def randomised_models(model, seed: int, mode: str) -> Iterator[tuple[str, VisionTransformer]]:
    """``(layer, model)`` per step of one form of the check, all from one draw (``reinitialised``).

    ``cascade``: step k (from 0) has the first k + 1 layers of ``cascade_layers``
    re-initialised (named by layer k); ``independent``: step k has only layer k re-initialised.
    """
    if mode not in SANITY_MODES:
        raise ValueError(f"mode={mode!r}: must be one of {', '.join(SANITY_MODES)}")
    draw = reinitialised(model, seed)
    layers = cascade_layers(model)
    done: list[str] = []
    for name, params in layers:
        done += params
        yield name, randomised(model, draw, done if mode == "cascade" else params)


@dataclass
class RandomisationCheck:
    """Both forms of the check on one set of images.

    Attributes:
        layers: The layers in cascade order (``cascade_layers``): step k of ``cascade`` has
            the first k + 1 of them random; step k of ``independent`` only the k-th.
        cascade, independent: ``(mode's) metric -> method -> (len(layers), B)`` the map of the
            randomised model against the trained model's, per step and image (NaN where a
            metric is undefined, e.g. rho of a constant map).
    """

    layers: tuple[str, ...]
    cascade: dict[str, dict[str, np.ndarray]]
    independent: dict[str, dict[str, np.ndarray]]

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat: ``sanity_layers`` and ``sanity_<mode>/<metric>/<method>`` ``(S, B)``."""
        out: dict[str, np.ndarray] = {"sanity_layers": np.array(self.layers)}
        for mode in SANITY_MODES:
            for metric, per_method in getattr(self, mode).items():
                out |= {f"sanity_{mode}/{metric}/{m}": v for m, v in per_method.items()}
        return out


def compare_maps(trained: np.ndarray, now: np.ndarray, grid) -> dict[str, np.ndarray]:
    """Per image: rho, absolute-value rho and SSIM between two ``(B, P)`` maps."""
    return {
        "rho": spearman_per_image(trained, now),
        "abs_rho": abs_spearman_per_image(trained, now),
        "ssim": ssim_per_image(trained, now, grid),
    }


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
) -> RandomisationCheck:
    """Cascading and independent randomisation (Adebayo et al. 2018) of every method's map.

    Args:
        maps: method -> ``(B, P)`` scores of the trained model.
        compute: ``(model, images, labels, method) -> (B, P)`` scores of one method (``oracle``:
            the single-token effects of that model).
        seed: The re-initialisation's seed (one draw for every step and both forms).
    """
    glass = as_glassbox(model)
    layers = tuple(name for name, _ in cascade_layers(glass))
    out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for mode in SANITY_MODES:
        table = {
            k: {m: np.full((len(layers), images.shape[0]), np.nan) for m in methods}
            for k in SANITY_METRICS
        }
        for step, (_, random_model) in enumerate(randomised_models(glass, seed, mode)):
            for m in methods:
                if m == "oracle":
                    now = single_token_effects(
                        random_model, images, labels, max_sequences=max_sequences
                    ).effects
                else:
                    now = compute(random_model, images, labels, m).to(torch.float64).cpu().numpy()
                for metric, values in compare_maps(maps[m], now, glass.cfg.grid).items():
                    table[metric][m][step] = values
        out[mode] = table
    return RandomisationCheck(layers, out["cascade"], out["independent"])
