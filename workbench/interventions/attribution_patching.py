"""Attribution patching (AtP): the linear estimate of every exact patch, from a few gradients.

Exact patching (``workbench.interventions.patching``) runs one patched forward per location
and direction. AtP (Nanda 2023, "Attribution patching"; Syed et al. 2023) replaces each
with its first-order Taylor estimate around the target run, for the same metric, the logit
difference ``LD = logit[clean label] - logit[contrast class]``::

    denoising: LD(corrupted with a_clean at l) ~ LD(corrupted) + (a_clean - a_corr) . dLD/da |corrupted run
    noising:   LD(clean with a_corr at l)      ~ LD(clean)     + (a_corr - a_clean) . dLD/da |clean run

with the dot product over the location's elements: one position of ``blocks.i.resid2``; every
position of ``blocks.i.attn`` / ``blocks.i.mlp``; head h's slice of ``blocks.i.attn.z`` (before
the output projection). The gradients come from one forward + backward of each run
(``run_with_cache(..., incl_bwd=True)``), and each run is the other direction's source, so
both directions cost 2 forwards and 2 backwards per batch of pairs, against
``2 + 2 * depth * (tokens + 2 + heads)`` (partial) forwards for the exact grid.

AtP-IG (integrated gradients; Marks et al. 2024, Hanna et al. 2024's EAP-IG) averages the
gradient over ``steps`` points on the straight line from the target run to the source run,
``alpha = j / steps`` for ``j = 0 .. steps - 1`` (a left Riemann sum, so ``steps = 1`` is AtP
itself), and multiplies the average by the same activation difference. The line is drawn
(``ig_path``) either at the embedding, the residual entering block 0 (``embedding``, as
EAP-IG: ``2 * steps`` forwards and backwards for both directions, every location's gradient
from the same runs), or at each hook site in turn, that site's whole activation interpolated
and the rest of the run the target's (``site``, as Marks et al.: ``2 * (1 + (steps - 1) *
sites)``, ``sites = 4 * depth``).

The estimates come as the exact grid's arrays, the same keys with a prefix (``atp_resid_ld``,
``atp_noising_head_ld``, ``atp_ig_branch_ld``, ...) and the same shapes (pairs, depth, ...),
so ``patching.effect_fraction`` turns both into restored / removed fractions alike. Beside
them, ``{method}_position_branch_change`` (depth, 2, tokens) and ``{method}_position_head_change``
(depth, heads, tokens) split a branch's or a head's estimated LD change over the token positions
(the dot product per position; they sum over positions to the location's change exactly), which
exact patching cannot give without a patch per position.

Two controls score what an estimate with no information in it gets: ``atp_shuffled``, AtP with
each hook site's gradient vectors permuted over the examples and positions of a batch (and the
heads, at ``attn.z``; seeded), so every location's activation difference meets another example's
gradient at another place (the activation differences, and so every magnitude, are AtP's own);
and ``random_scores``, ``draws`` seeded standard-normal scores per location.
``agreement`` scores an estimate against the exact patches location by location: Spearman's
rho over the locations, the overlap of the ten largest |effects|, the share of locations with
the same sign, and the locations where the two differ most.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import spearmanr

from workbench.interventions.cache import run_with_cache
from workbench.interventions.patching import (
    DIRECTIONS,
    PATCHED,
    Pairs,
    corrupt,
    effect_fraction,
    split_pairs,
)
from workbench.interventions.spec import InterventionError
from workbench.models.vit import VisionTransformer

METHODS = ("atp", "atp_ig")
CONTROL = "atp_shuffled"  # AtP with shuffled gradients: a control, not a method
ESTIMATES = (*METHODS, CONTROL)
RANDOM_DRAWS = 100  # random-score draws per cell: the random control's mean and spread
IG_PATHS = ("embedding", "site")
BRANCHES = ("attn", "mlp")


def _first(model: VisionTransformer) -> str:
    """The hook point of the residual entering block 0 (as ``patching.patch_batch`` names it)."""
    return "norm_pre" if model.cfg.norm_pre else "pos_add"


def sites(model: VisionTransformer) -> list[str]:
    """The hook points whose activations the grid patches, in forward order per block."""
    return [
        f"blocks.{i}.{stage}"
        for i in range(model.cfg.depth)
        for stage in ("attn.z", "attn", "mlp", "resid2")
    ]


def stated_passes(method: str, steps: int, depth: int, ig_path: str = "embedding") -> dict:
    """Forwards and backwards of ``estimate_batch`` for both directions, per batch of pairs."""
    if method in ("atp", CONTROL) or steps == 1:
        runs = 2
    elif ig_path == "embedding":
        runs = 2 * steps
    else:
        runs = 2 * (1 + (steps - 1) * 4 * depth)
    return {"forward": runs, "backward": runs}


def exact_passes(depth: int, tokens: int, heads: int) -> dict:
    """Forwards of ``patching.patch_batch`` (the two runs, then one partial forward per
    location and direction); it runs no backward."""
    return {"forward": 2 + 2 * depth * (tokens + 2 + heads), "backward": 0}


def _ld_metric(y: torch.Tensor, contrast: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The summed logit difference: each pair's gradient is its own (the pairs do not mix)."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None])).sum()

    return metric


def _run(model, x, names, metric, hooks=()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward: per-pair LD, and the activations and gradients at ``names``."""
    with torch.enable_grad():
        # the input carries the graph, so frozen weights still leave one to differentiate
        x = x.detach().clone().requires_grad_(True)
        logits, cache = run_with_cache(
            model, x, names_filter=names, fwd_hooks=hooks, incl_bwd=True, metric=metric
        )
    logits = logits.detach().float()
    return logits, {k: v.detach() for k, v in cache.items()}


def _interpolated(name: str, source: torch.Tensor, alpha: float):
    def hook(a: torch.Tensor, hook_point) -> torch.Tensor:
        return a + alpha * (source.to(a.dtype) - a)

    return (name, hook)


def _mean_grads(model, x, target, source, names, metric, steps, ig_path) -> dict:
    """The gradient at each site averaged over ``alpha = j / steps``; ``j = 0`` is ``target``."""
    total = {n: target[f"{n}_grad"].double() for n in names}
    for j in range(1, steps):
        alpha = j / steps
        if ig_path == "embedding":
            first = _first(model)
            hook = _interpolated(first, source[first], alpha)
            _, cache = _run(model, x, names, metric, [hook])
            for n in names:
                total[n] += cache[f"{n}_grad"].double()
        else:
            for n in names:
                _, cache = _run(model, x, [n], metric, [_interpolated(n, source[n], alpha)])
                total[n] += cache[f"{n}_grad"].double()
    return {n: g / steps for n, g in total.items()}


def _shuffled(grads: dict, generator: torch.Generator) -> dict:
    """Each site's gradient vectors permuted over examples and positions (and heads at
    ``attn.z``): the shuffled-gradient control."""
    out = {}
    for name, g in grads.items():
        flat = g.reshape(-1, g.shape[-1])  # (B * N [* heads], D or head dim)
        order = torch.randperm(len(flat), generator=generator).to(flat.device)
        out[name] = flat[order].reshape(g.shape)
    return out


def _deltas(model, target, source, grads) -> dict[str, np.ndarray]:
    """``(a_source - a_target) . grad`` summed over each location's elements: the LD change;
    for branches and heads also per position (``position_branch``, ``position_head``)."""

    def dot(name: str, dims) -> torch.Tensor:
        diff = source[name].double() - target[name].double()
        return (diff * grads[name]).sum(dim=dims)

    out = {k: [] for k in (*PATCHED, "position_branch", "position_head")}
    for i in range(model.cfg.depth):
        out["resid"].append(dot(f"blocks.{i}.resid2", (2,)))  # (B, N)
        per = torch.stack([dot(f"blocks.{i}.{k}", (2,)) for k in BRANCHES], dim=1)  # (B, 2, N)
        out["position_branch"].append(per)
        out["branch"].append(per.sum(dim=2))
        z = dot(f"blocks.{i}.attn.z", (3,))  # z is (B, N, heads, d): (B, N, heads)
        out["position_head"].append(z.transpose(1, 2))  # (B, heads, N)
        out["head"].append(z.sum(dim=1))
    return {k: torch.stack(v, dim=1).cpu().numpy() for k, v in out.items()}


def estimate_batch(
    model: VisionTransformer,
    x_clean: torch.Tensor,
    x_corrupt: torch.Tensor,
    y: torch.Tensor,
    contrast: torch.Tensor,
    method: str = "atp",
    steps: int = 5,
    ig_path: str = "embedding",
    generator: torch.Generator | None = None,
) -> dict[str, np.ndarray]:
    """The estimated patched LD of every location of the exact grid, both directions, one batch.

    Args:
        method: ``atp``, ``atp_ig`` or the control ``atp_shuffled`` (AtP's gradients shuffled
            with ``generator``; default: seeded 0).

    Returns:
        ``{method}_{key}`` for each of ``patch_batch``'s ``*_ld`` keys (``atp_resid_ld``
        (B, depth, tokens), ``atp_noising_head_ld`` (B, depth, heads), ...): the target run's
        LD plus the estimated change. Denoising's target is the corrupted run, noising's the
        clean run, as for the exact patches. And ``{method}_{prefix}position_branch_change``
        (B, depth, 2, tokens), ``..._position_head_change`` (B, depth, heads, tokens): each
        branch's and head's estimated LD change per token position (summing to its change).

    Raises:
        InterventionError: An unknown method or path, or fewer than one step.
    """
    if method not in ESTIMATES:
        raise InterventionError(f"attribution patching method {method!r}: one of {ESTIMATES}")
    if ig_path not in IG_PATHS:
        raise InterventionError(f"ig_path {ig_path!r}: must be one of {', '.join(IG_PATHS)}")
    if steps < 1:
        raise InterventionError(f"ig steps={steps!r}: must be a positive integer")
    steps = steps if method == "atp_ig" else 1
    names = sites(model)
    metric = _ld_metric(y, contrast)
    keep = [_first(model), *names]
    clean_logits, clean = _run(model, x_clean, keep, metric)
    corr_logits, corr = _run(model, x_corrupt, keep, metric)
    out = {}
    for direction, (x, target, source, logits) in {
        "denoising": (x_corrupt, corr, clean, corr_logits),
        "noising": (x_clean, clean, corr, clean_logits),
    }.items():
        base = (logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None]))[:, 0]
        grads = _mean_grads(model, x, target, source, names, metric, steps, ig_path)
        if method == CONTROL:
            grads = _shuffled(grads, generator or torch.Generator().manual_seed(0))
        prefix = f"{method}_{DIRECTIONS[direction]}"
        for kind, delta in _deltas(model, target, source, grads).items():
            if kind.startswith("position_"):
                out[f"{prefix}{kind}_change"] = delta.astype(np.float32)
                continue
            ld = base.double().cpu().numpy()[:, None, None] + delta
            out[f"{prefix}{kind}_ld"] = ld.astype(np.float32)
    return out


def estimate_pairs(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor,
    pairs: Pairs,
    inputs,
    method: str = "atp",
    steps: int = 5,
    ig_path: str = "embedding",
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """``estimate_batch`` over every pair of a split, batched as ``patching.patch_pairs`` is
    (the same pairs and corruption, so the arrays line up with its result row by row);
    ``seed`` seeds the control's shuffles (one generator for the whole split)."""
    if model.training:
        raise InterventionError("patching measures the trained function: call model.eval() first")
    clean_idx, source_idx = torch.from_numpy(pairs.clean), torch.from_numpy(pairs.source)
    y_all, contrast_all = labels[clean_idx], labels[source_idx]
    clean_loader = inputs.loader(images[clean_idx], y_all)
    source_loader = inputs.loader(images[source_idx], contrast_all)
    parts, done = [], 0
    generator = torch.Generator().manual_seed(seed)
    with inputs.autocast():
        for clean, source in zip(clean_loader, source_loader):
            b = len(clean.labels)
            x_corrupt = corrupt(
                clean.images, source.images, pairs.replaced[done : done + b], model.cfg
            )
            # fmt: skip
            parts.append(
                estimate_batch(
                    model,
                    clean.images,
                    x_corrupt,
                    clean.labels,
                    source.labels,
                    method,
                    steps,
                    ig_path,
                    generator,
                )
            )
            done += b
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def estimate_split(
    model: VisionTransformer, images, labels, indices, inputs, spec
) -> dict[str, np.ndarray]:
    """AtP, AtP-IG (``spec.ig_steps`` steps, the embedding path) and the controls on the
    protocol's pairs (``patching.split_pairs``, the pairs ``patching.patch_split`` patches).

    Returns:
        ``estimate_pairs``' arrays of each of ``ESTIMATES`` (the per-position changes as their
        means over the pairs: (depth, 2 or heads, tokens), to keep the evidence small);
        ``random_scores`` (``RANDOM_DRAWS``, locations), seeded by ``spec.seed``; per estimate
        ``{method}_passes`` (forwards, backwards per batch of pairs, both directions) and
        ``{method}_seconds`` (wall time over the split).
    """
    pairs = split_pairs(labels.cpu().numpy(), indices.cpu().numpy(), spec, model.cfg.num_patches)
    cfg, out = model.cfg, {}
    for method in ESTIMATES:
        started = time.perf_counter()
        arrays = estimate_pairs(
            model, images, labels, pairs, inputs, method, spec.ig_steps, seed=spec.seed
        )
        out[f"{method}_seconds"] = np.array(time.perf_counter() - started)
        passes = stated_passes(method, spec.ig_steps, cfg.depth)
        out[f"{method}_passes"] = np.array([passes["forward"], passes["backward"]])
        for k, v in arrays.items():
            out[k] = v.mean(axis=0, dtype=np.float64) if "_position_" in k else v
    tokens = out["atp_resid_ld"].shape[2]
    out["random_scores"] = random_scores(cfg.depth * (tokens + 2 + cfg.heads), spec.seed)
    return out


def random_scores(locations: int, seed: int, draws: int = RANDOM_DRAWS) -> np.ndarray:
    """(draws, locations) standard-normal scores (``numpy.random.default_rng(seed)``): the random
    control, in ``location_names`` order."""
    return np.random.default_rng(seed).standard_normal((draws, locations))


# ---- scoring against the exact patches ------------------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """An estimate against the exact patches over the kept locations of one direction.

    Attributes:
        rho: Spearman's rho between the two fractions (restored or removed), over locations.
        top_overlap: Share of the ``top`` largest |exact| locations among the ``top`` largest
            |estimate| ones.
        sign_agreement: Share of locations where both have the same sign (0 counts as a sign).
        worst: ``(location, exact, estimate)`` of the largest |estimate - exact|, largest first.
        pair_rho: (P,) the same rho per pair, on each pair's LD change (NaN where constant;
            empty for scores that have no pairs, the random control's).
        locations: How many locations were scored.
    """

    rho: float
    top_overlap: float
    sign_agreement: float
    worst: tuple[tuple[str, float, float], ...]
    pair_rho: np.ndarray
    locations: int

    def metrics(self) -> dict[str, float]:
        return {
            "rho": self.rho,
            "top10_overlap": self.top_overlap,
            "sign_agreement": self.sign_agreement,
            "pair_rho_mean": float(np.nanmean(self.pair_rho))
            if np.isfinite(self.pair_rho).any()
            else float("nan"),
        }


def location_names(depth: int, tokens: int, heads: int) -> list[str]:
    """The grid's locations in the order ``_flat`` lays them out: residuals, branches, heads."""
    resid = [f"blocks.{i}.resid2[{t}]" for i in range(depth) for t in range(tokens)]
    branch = [f"blocks.{i}.{kind}" for i in range(depth) for kind in BRANCHES]
    head = [f"blocks.{i}.attn.head{h}" for i in range(depth) for h in range(heads)]
    return resid + branch + head


def _flat(arrays: dict, prefix: str, direction: str, per) -> np.ndarray:
    """(..., locations): ``per(array)`` of each kind, concatenated in ``location_names`` order."""
    parts = [per(arrays[f"{prefix}{DIRECTIONS[direction]}{kind}_ld"]) for kind in PATCHED]
    return np.concatenate([p.reshape(*p.shape[: p.ndim - 2], -1) for p in parts], axis=-1)


def location_fractions(arrays: dict, method: str, direction: str = "denoising") -> np.ndarray:
    """(locations,) the restored (denoising) or removed (noising) fraction of every location in
    ``location_names`` order: the exact patches' (``method`` "") or an estimate's."""
    clean, corrupted = arrays["clean_ld"], arrays["corrupted_ld"]
    prefix = f"{method}_" if method else ""
    return _flat(
        arrays, prefix, direction, lambda ld: effect_fraction(direction, ld, clean, corrupted)
    )


def grid_names(arrays: dict) -> np.ndarray:
    """``location_names`` of the grid ``arrays`` (``PatchingResult.arrays()``) were patched on."""
    m = arrays["resid_ld"]
    return np.array(location_names(m.shape[1], m.shape[2], arrays["head_ld"].shape[2]))


def _rho(a: np.ndarray, b: np.ndarray) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def _scored(e, a, names, top: int, worst: int, pair_rho: np.ndarray) -> Agreement:
    """``Agreement`` of scores ``a`` against exact fractions ``e`` over the same locations."""
    n = min(top, len(e))
    top_e = np.argsort(-np.abs(e), kind="stable")[:n]
    top_a = np.argsort(-np.abs(a), kind="stable")[:n]
    order = np.argsort(-np.abs(a - e), kind="stable")[:worst]
    return Agreement(
        rho=_rho(e, a),
        top_overlap=len(set(top_e) & set(top_a)) / max(n, 1),
        sign_agreement=float(np.mean(np.sign(e) == np.sign(a))),
        worst=tuple((str(names[i]), float(e[i]), float(a[i])) for i in order),
        pair_rho=pair_rho,
        locations=len(e),
    )


def _keep(keep, count: int) -> np.ndarray:
    return np.ones(count, dtype=bool) if keep is None else np.asarray(keep, dtype=bool)


def agreement(
    exact: dict[str, np.ndarray],
    estimate: dict[str, np.ndarray],
    method: str = "atp",
    direction: str = "denoising",
    keep: np.ndarray | None = None,
    top: int = 10,
    worst: int = 5,
) -> Agreement:
    """Score ``estimate`` (``estimate_pairs``'s arrays) against ``exact`` (``PatchingResult.arrays()``).

    Args:
        keep: (locations,) bool in ``location_names`` order; None: every location. Leave out
            what both get by construction (a residual position the readout never reads:
            0 in both), or the agreement is inflated.
    """
    clean, corrupted = exact["clean_ld"], exact["corrupted_ld"]

    def change(ld):  # per pair, oriented as the fraction is: restored or removed LD
        target = corrupted if direction == "denoising" else clean
        sign = 1.0 if direction == "denoising" else -1.0
        return sign * (ld.astype(np.float64) - target.astype(np.float64)[:, None, None])

    e = location_fractions(exact, "", direction)
    a = location_fractions(
        {**estimate, "clean_ld": clean, "corrupted_ld": corrupted}, method, direction
    )
    pe, pa = _flat(exact, "", direction, change), _flat(estimate, f"{method}_", direction, change)
    names = grid_names(exact)
    keep = _keep(keep, len(names))
    pe, pa = pe[:, keep], pa[:, keep]
    pair_rho = np.array([_rho(pe[p], pa[p]) for p in range(len(pe))])
    return _scored(e[keep], a[keep], names[keep], top, worst, pair_rho)


def random_agreement(
    exact: dict[str, np.ndarray],
    scores: np.ndarray,
    direction: str = "denoising",
    keep: np.ndarray | None = None,
    top: int = 10,
) -> list[Agreement]:
    """Each draw of ``random_scores`` (draws, locations) scored as ``agreement`` scores an
    estimate (the same fractions, locations and ``keep``); no per-pair rho (``pair_rho`` empty)."""
    e, names = location_fractions(exact, "", direction), grid_names(exact)
    keep = _keep(keep, len(names))
    return [_scored(e[keep], s[keep], names[keep], top, 0, np.array([])) for s in scores]


def read_locations(reads: np.ndarray, depth: int, heads: int) -> np.ndarray:
    """``keep`` for ``agreement``: every location but the residual positions the readout never
    reads (``PatchingResult.resid_reads`` False: 0 in both by construction)."""
    reads = np.asarray(reads, dtype=bool).reshape(-1)
    return np.concatenate([reads, np.ones(depth * (len(BRANCHES) + heads), dtype=bool)])


def comparison_metrics(exact: dict[str, np.ndarray], estimates: dict, reads, model, steps: int):
    """Flat metrics of AtP, AtP-IG and the controls against the exact grid (``estimate_split``'s
    arrays; those of ``ESTIMATES`` present, the random control where ``random_scores`` is).

    Per estimate and direction: ``{method}_rho/{direction}``, ``_top10_overlap``,
    ``_sign_agreement`` and ``_pair_rho_mean`` over every location the readout reads
    (``read_locations``); ``random_{rho,top10_overlap,sign_agreement}/{direction}``, the means
    over the draws; the passes of each per batch of pairs (``{method}_forwards``,
    ``{method}_backwards``, ``exact_forwards``).
    """
    cfg = model.cfg
    keep = read_locations(reads, cfg.depth, cfg.heads)
    out: dict[str, float] = {}
    for method in (m for m in ESTIMATES if f"{m}_resid_ld" in estimates):
        for direction in DIRECTIONS:
            scored = agreement(exact, estimates, method, direction, keep)
            out |= {f"{method}_{k}/{direction}": v for k, v in scored.metrics().items()}
        passes = stated_passes(method, steps, cfg.depth)
        out |= {f"{method}_forwards": passes["forward"], f"{method}_backwards": passes["backward"]}
    if "random_scores" in estimates:
        for direction in DIRECTIONS:
            draws = random_agreement(exact, estimates["random_scores"], direction, keep)
            for k in ("rho", "top10_overlap", "sign_agreement"):
                out[f"random_{k}/{direction}"] = float(np.mean([d.metrics()[k] for d in draws]))
    tokens = exact["resid_ld"].shape[2]
    out["exact_forwards"] = exact_passes(cfg.depth, tokens, cfg.heads)["forward"]
    return {k: float(v) for k, v in out.items()}
