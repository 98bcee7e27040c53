"""One model, one set of images: every method's scores, the exact causal effects, the curves, the norms.

``score_cell(model, images, labels, methods, seed, k)`` is the whole computation of one
cell of an attribution study, returned as plain arrays: per image and method (so the report
layer can pair cells by seed and image and use ``workbench.stats``'s t-interval over seeds
and hierarchical bootstrap) and summarised per method (``summary``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.attribution.agreement import (
    attention_mass_on,
    mean_rho,
    spearman_per_image,
    top_mask,
)
from workbench.attribution.causal import CausalEffects, single_token_effects
from workbench.attribution.curves import Curves, perturbation_curves
from workbench.attribution.glassbox import AttributionError, as_glassbox
from workbench.attribution.controls import (
    Controls,
    RandomisationCheck,
    insertion_start,
    random_draw_scores,
    randomisation_check,
)
from workbench.attribution.methods import ORACLE, attribute, check_methods, random_order
from workbench.attribution.token_norms import DEFAULT_K, TokenNorms, token_norms


@dataclass(frozen=True)
class MethodSummary:
    """One method's numbers over the cell's images.

    Attributes:
        mean_rho: Mean Spearman rho over the images where it is defined.
        undefined_rho: Images where rho is NaN (constant scores or effects).
        deletion_auc, insertion_auc: Mean AUC of the true-class probability curves.
        deletion_accuracy_auc, insertion_accuracy_auc: The same for the accuracy curves.
    """

    method: str
    mean_rho: float
    undefined_rho: int
    deletion_auc: float
    insertion_auc: float
    deletion_accuracy_auc: float
    insertion_accuracy_auc: float


@dataclass
class CellAttribution:
    """Everything ``score_cell`` computed, per image (index ``b`` = position in ``images``).

    Attributes:
        methods: The method names, in the order given.
        labels, image_index: ``(B,)`` true classes and the images' indices in their split (pairing key).
        scores: method -> ``(B, P)`` float64 attribution scores.
        causal: The single-token drop effects ``(B, P)`` and the intact model's log-probability.
        rho: method -> ``(B,)`` Spearman rho (NaN where undefined).
        curves: Deletion and insertion curves, per image.
        deletion_auc, insertion_auc: method -> ``(B,)`` per-image AUC of the probability curves.
        norms: Token norms per block.
        seed: The random baseline's seed.
        seconds: Wall time of the cell; ``forwards``: sequences run through the blocks.
        controls: What ``controls`` asked for; ``draws``: name -> ``(D, B)`` per random draw
            (``rho``, ``deletion_auc``, ``insertion_auc``; empty without draws); ``sanity``:
            the model-randomisation check, cascading and independent (``controls.RandomisationCheck``;
            None without the check); ``start_predicted`` / ``start_prob``: ``(B,)``
            the class predicted from the class token alone (the insertion curve's start) and
            its probability.
    """

    methods: tuple[str, ...]
    labels: np.ndarray
    image_index: np.ndarray
    scores: dict[str, np.ndarray]
    causal: CausalEffects
    rho: dict[str, np.ndarray]
    curves: Curves
    deletion_auc: dict[str, np.ndarray]
    insertion_auc: dict[str, np.ndarray]
    norms: TokenNorms
    seed: int
    seconds: float
    forwards: int
    controls: Controls = Controls()
    draws: dict[str, np.ndarray] = field(default_factory=dict)
    sanity: RandomisationCheck | None = None
    start_predicted: np.ndarray | None = None
    start_prob: np.ndarray | None = None

    @property
    def intact_accuracy(self) -> float:
        return float((self.causal.predicted == self.labels).mean())

    def cls_attention_on_top_effects(self, top: int = 5) -> np.ndarray:
        """``(B,)`` share of the last block's CLS attention on patches that falls on the ``top`` tokens of largest
        causal effect: "does CLS attend to the tokens that matter?" (``top / P`` if it attends at random)."""
        return attention_mass_on(self.norms.cls_attention, top_mask(self.causal.effects, top))

    def cls_attention_concentration(self, top: int = 5) -> np.ndarray:
        """``(B,)`` share of the last block's CLS attention on patches that falls on its own ``top`` tokens."""
        return attention_mass_on(self.norms.cls_attention, top_mask(self.norms.cls_attention, top))

    def summary(self) -> list[MethodSummary]:
        """Per method: mean rho, the mean deletion and insertion AUCs (the random baseline is a method)."""
        rows = []
        for m in self.methods:
            rho, undefined = mean_rho(self.rho[m])
            rows.append(
                MethodSummary(
                    method=m,
                    mean_rho=rho,
                    undefined_rho=undefined,
                    deletion_auc=float(self.deletion_auc[m].mean()),
                    insertion_auc=float(self.insertion_auc[m].mean()),
                    deletion_accuracy_auc=float(self.curves.deletion_auc(m, "correct").mean()),
                    insertion_accuracy_auc=float(self.curves.insertion_auc(m, "correct").mean()),
                )
            )
        return rows


def score_cell(
    model,
    images: torch.Tensor,
    labels: torch.Tensor,
    methods: Sequence[str],
    seed: int,
    k: float = DEFAULT_K,
    *,
    image_index=None,
    counts: Sequence[int] | None = None,
    batch_size: int = 100,
    max_sequences: int = 4096,
    progress: Callable[[int], None] | None = None,
    controls: Controls | None = None,
) -> CellAttribution:
    """Scores, causal effects, curves, rho and token norms of one model on one set of images.

    Args:
        model: A glass-box ViT with CLS pooling, or a timm ViT (converted exactly).
        images: ``(B, C, H, W)`` normalised as the model expects; ``labels`` ``(B,)`` true classes.
        methods: Names from ``methods.METHODS`` (``random`` is the baseline).
        seed: The random baseline's seed.
        k: Token-norm outlier factor (``norms > k x`` the block's median).
        image_index: ``(B,)`` the images' indices in their split, for pairing (default ``0..B-1``).
        counts: Curve grid of removed/kept token counts (must hold 0 and ``P``; default every count).
        batch_size: Images per batch (methods, drops and curves run batch by batch); ``max_sequences``
            bounds one widened drop call.
        progress: Called with the number of images of each batch once its methods, drops and curves
            are done (e.g. a tqdm bar's ``update``); the token norms, one cheap pass at the end, are not counted.
        controls: Random draws per image and the randomisation check
            (``workbench.attribution.controls``); with draws, ``random`` is draw 0 of each
            image's own draws instead of one shared ``(B, P)`` draw. ``oracle`` among
            ``methods`` scores the single-token effects themselves.
    """
    started = time.perf_counter()
    glass = as_glassbox(model)
    names = check_methods(methods)
    if images.shape[0] == 0:
        raise AttributionError("score_cell needs at least one image")
    labels = torch.as_tensor(labels).long()
    controls = controls or Controls()
    index = np.arange(images.shape[0]) if image_index is None else np.asarray(image_index)
    P = glass.cfg.num_patches
    # (D, B, P)
    draws = (
        torch.from_numpy(
            random_draw_scores(P, seed, controls.cell_seed, index, controls.random_draws)
        )
        if controls.random_draws
        else None
    )
    # Without draws the random order is one (B, P) draw for all images, as ``attribute`` draws
    # it: the same for any batch size. With draws it is each image's draw 0.
    if "random" not in names:
        drawn = None
    elif draws is not None:
        drawn = draws[0]
    else:
        drawn = random_order(glass, images, labels, seed=seed)
    model_methods = [m for m in names if m not in ("random", ORACLE)]
    scores: dict[str, list[torch.Tensor]] = {m: [] for m in names}
    effects, curves, draw_curves = [], [], []
    for start in range(0, images.shape[0], batch_size):
        x, y = images[start : start + batch_size], labels[start : start + batch_size]
        rows = slice(start, start + x.shape[0])
        part = (
            attribute(glass, x, y, model_methods, seed=seed, batch_size=batch_size)
            if model_methods
            else {}
        )
        if drawn is not None:
            part["random"] = drawn[rows]
        effect = single_token_effects(glass, x, y, max_sequences=max_sequences)
        if ORACLE in names:
            part[ORACLE] = torch.from_numpy(effect.effects)
        part = {m: part[m] for m in names}
        for m in names:
            scores[m].append(part[m])
        effects.append(effect)
        curves.append(
            perturbation_curves(glass, x, y, part, counts=counts, max_sequences=max_sequences)
        )
        if draws is not None:
            orders = {f"draw{d}": draws[d, rows] for d in range(draws.shape[0])}
            draw_curves.append(
                perturbation_curves(glass, x, y, orders, counts=counts, max_sequences=max_sequences)
            )
        if progress is not None:
            progress(int(x.shape[0]))
    causal, joined = CausalEffects.joined(effects), Curves.joined(curves)
    norms = token_norms(glass, images, k=k, batch_size=batch_size)
    arrays = {m: torch.cat(s).numpy() for m, s in scores.items()}
    forwards = causal.forwards + joined.forwards
    per_draw: dict[str, np.ndarray] = {}
    if draws is not None:
        both = Curves.joined(draw_curves)
        names_d = [f"draw{d}" for d in range(draws.shape[0])]
        per_draw = {
            "rho": np.stack(
                [spearman_per_image(draws[d].numpy(), causal.effects) for d in range(len(names_d))]
            ),
            "deletion_auc": np.stack([both.deletion_auc(n) for n in names_d]),
            "insertion_auc": np.stack([both.insertion_auc(n) for n in names_d]),
        }
        forwards += both.forwards
    sanity = None
    if controls.sanity_check:
        checked = [m for m in names if m != "random"]
        sanity = randomisation_check(
            glass,
            images,
            labels,
            checked,
            arrays,
            lambda model, x, y, m: attribute(model, x, y, [m], batch_size=batch_size)[m],
            seed=seed,
            max_sequences=max_sequences,
        )
    start_predicted, start_prob = insertion_start(glass, images)
    return CellAttribution(
        methods=names,
        labels=labels.cpu().numpy(),
        image_index=index,
        scores=arrays,
        causal=causal,
        rho={m: spearman_per_image(arrays[m], causal.effects) for m in names},
        curves=joined,
        deletion_auc={m: joined.deletion_auc(m) for m in names},
        insertion_auc={m: joined.insertion_auc(m) for m in names},
        norms=norms,
        seed=int(seed),
        seconds=time.perf_counter() - started,
        forwards=forwards,
        controls=controls,
        draws=per_draw,
        sanity=sanity,
        start_predicted=start_predicted,
        start_prob=start_prob,
    )
