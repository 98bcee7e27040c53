"""Activation patching: how much of a clean run's answer one activation carries into a corrupted run.

For each pair (clean image, corrupted image) the model runs on both; then, one location at a
time, one run is repeated with the other run's activation at that location patched in, in
both directions as Heimersheim and Nanda ("How to use and interpret activation patching",
2024) and TransformerLens name them:

- denoising (the causal tracing of Meng et al. 2022): the corrupted run with the clean run's
  activation patched in: is this location *sufficient* to bring the clean answer back?
  Arrays ``resid_ld``, ``branch_ld``, ``head_ld`` (and ``*_prob``).
- noising: the clean run with the corrupted run's activation patched in: is this location
  *necessary* for the clean answer? Arrays ``noising_resid_ld``, ... (and ``*_prob``).

The metric is the fraction of the clean-vs-corrupted logit difference restored (denoising) or
removed (noising)::

    LD(run) = logit[clean label] - logit[contrast class]      (contrast: the corrupting image's label)
    restored(location) = (mean LD(patched) - mean LD(corrupted)) / (mean LD(clean) - mean LD(corrupted))
    removed(location)  = (mean LD(clean) - mean LD(patched)) / (mean LD(clean) - mean LD(corrupted))

with the means over the pairs (a ratio of means, not a mean of ratios: a pair whose
corruption barely moves the logits cannot blow it up; Heimersheim and Nanda 2024). 0 is no
effect, 1 the whole difference; the clean label's probability under each patch is kept
beside it.

Some residual locations are fixed by construction, whatever the weights and images:
``resid_reads`` (depth, tokens) says, from the model itself (the gradient of the logits with
respect to block i's output, exactly zero or not), which positions the readout depends on.
A position it does not read restores and removes exactly 0 (e.g. a patch token at the last
block, under a class-token head); a block where it reads one position only gives that
position exactly 1 (the class token at the last block). ``fixed_by_construction`` turns the
map into those locations, which an agreement between seeds must leave out (they agree by
construction).

Locations, each patched on its own (the clean activation replaces the corrupted one):

- ``resid``: ``blocks.i.resid2`` (block i's output, the residual stream) at one token position:
  a grid blocks x token positions;
- ``branch``: ``blocks.i.attn`` or ``blocks.i.mlp`` (the branch output, every position);
- ``head``: one head's output ``blocks.i.attn.z[:, :, h]`` (every position): blocks x heads.

Pairs (``make_pairs``) are stated and seeded: ``pairs`` clean images drawn from the split, each
with a corrupting image of another class; the corrupted image is that image (``class``) or the
clean image with ``replaced_patches`` of its patches (seeded positions) taken from it
(``patches``). The clean images are a seeded class-stratified sample of the split
(``stratified``, ``workbench.sample``: a split stored by class still gives every class its
share), or, as protocols frozen before that rule drew them, a uniform draw of positions
(``uniform``). Pairs depend on the split and the seed only, so every seed of a study sees the
same pairs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from workbench.interventions.cache import run_with_cache
from workbench.interventions.spec import InterventionError
from workbench.models.hooks import attached
from workbench.models.vit import VisionTransformer
from workbench.sample import class_counts, stratified_positions

CORRUPTIONS = ("class", "patches")
# How the clean images are drawn: ``uniform`` is the rule of the protocols frozen before the
# stratified sample existed (workbench.protocol.intervention.UNIFORM_PAIRS_PROTOCOLS).
PAIR_SAMPLES = ("stratified", "uniform")
# The two directions, as the arrays of a result name them: prefix of the patched keys.
DIRECTIONS = {"denoising": "", "noising": "noising_"}
PATCHED = ("resid", "branch", "head")


@dataclass(frozen=True)
class Pairs:
    """Clean and corrupting images (positions in the split), and which patches a corruption replaces.

    Attributes:
        clean: (P,) the clean images.
        source: (P,) each clean image's corrupting image (another class).
        replaced: (P, K) patch indices (row-major over the patch grid) taken from the corrupting
            image; K = 0 for ``class`` corruption (the corrupted image is the corrupting one).
    """

    clean: np.ndarray
    source: np.ndarray
    replaced: np.ndarray


def make_pairs(
    labels: np.ndarray,
    count: int,
    seed: int,
    *,
    corruption: str = "class",
    replaced_patches: int = 0,
    num_patches: int = 0,
    sample: str = "uniform",
    keys: np.ndarray | None = None,
) -> Pairs:
    """``count`` seeded (clean, corrupting) pairs from a split's labels.

    Args:
        sample: ``stratified``: the clean images are ``stratified_positions(labels, count, seed,
            keys)`` (interleaved by class); ``uniform``: ``count`` positions drawn without
            replacement by ``numpy.random.default_rng(seed)``, sorted (the old rule, kept bit for
            bit). Either way the same generator then draws each corrupting image among the
            other classes' images, then the replaced patches.
        keys: What identifies each image across machines (the source-split index), for the
            stratified sample's within-class order; default: its position.

    Raises:
        InterventionError: Too few images, one class only, or more patches than the grid has.
    """
    if corruption not in CORRUPTIONS:
        raise InterventionError(
            f"corruption {corruption!r}: must be one of {', '.join(CORRUPTIONS)}"
        )
    if sample not in PAIR_SAMPLES:
        raise InterventionError(f"sample {sample!r}: must be one of {', '.join(PAIR_SAMPLES)}")
    labels = np.asarray(labels)
    if count < 1 or count > len(labels):
        raise InterventionError(f"patching pairs={count}: the split has {len(labels)} images")
    if len(np.unique(labels)) < 2:
        raise InterventionError("patching needs images of at least 2 classes to corrupt with")
    if corruption == "patches" and not 0 < replaced_patches <= num_patches:
        raise InterventionError(
            f"replaced_patches={replaced_patches}: must be 1 to the model's {num_patches} patches"
        )
    rng = np.random.default_rng(seed)
    if sample == "uniform":
        clean = np.sort(rng.choice(len(labels), size=count, replace=False))
    else:
        clean = stratified_positions(labels, count, seed, keys)
    source = np.array([rng.choice(np.flatnonzero(labels != labels[c])) for c in clean])
    k = replaced_patches if corruption == "patches" else 0
    replaced = np.array(
        [np.sort(rng.choice(num_patches, size=k, replace=False)) for _ in clean], dtype=np.int64
    ).reshape(count, k)
    return Pairs(clean, source, replaced)


def corrupt(
    x_clean: torch.Tensor, x_source: torch.Tensor, replaced: np.ndarray, cfg
) -> torch.Tensor:
    """The clean images with the listed patches taken from the source images (model inputs, (B, C, H, W)).

    With no patch listed (``class`` corruption) the corrupted image is the source image.
    """
    if replaced.shape[1] == 0:
        return x_source
    out = x_clean.clone()
    ph, pw = cfg.patch_hw
    cols = cfg.grid[1]
    for b in range(len(out)):
        for p in replaced[b]:
            r, c = divmod(int(p), cols)
            rows, colsl = slice(r * ph, (r + 1) * ph), slice(c * pw, (c + 1) * pw)
            out[b, :, rows, colsl] = x_source[b, :, rows, colsl]
    return out


@dataclass
class PatchingResult:
    """Per-pair logit differences and clean-label probabilities under every patch.

    Attributes:
        clean_ld, corrupted_ld: (P,) the logit difference of the clean and the corrupted run.
        clean_prob, corrupted_prob: (P,) the clean label's probability in each run.
        resid_ld, resid_prob: (P, depth, tokens): ``blocks.i.resid2`` patched at one position.
        branch_ld, branch_prob: (P, depth, 2): ``blocks.i.attn``, ``blocks.i.mlp`` patched.
        head_ld, head_prob: (P, depth, heads): ``blocks.i.attn.z`` head h patched.
            These six are denoising: the clean activation patched into the corrupted run.
        noising_resid_ld, ...: The same six for noising: the corrupted activation patched
            into the clean run.
        resid_reads: (depth, tokens) bool: whether the logits depend on block i's output at
            position t at all (``readout_reads``).
        seconds: Evaluation time.
        branch_pos_ld, head_pos_ld, ...: With the protocol's ``positions``: each branch
            (P, depth, 2, tokens) and each head (P, depth, heads, tokens) patched at one token
            position, denoising and (``noising_`` prefix) noising, with ``*_prob``; else None.
    """

    clean_ld: np.ndarray
    corrupted_ld: np.ndarray
    clean_prob: np.ndarray
    corrupted_prob: np.ndarray
    resid_ld: np.ndarray
    resid_prob: np.ndarray
    branch_ld: np.ndarray
    branch_prob: np.ndarray
    head_ld: np.ndarray
    head_prob: np.ndarray
    noising_resid_ld: np.ndarray
    noising_resid_prob: np.ndarray
    noising_branch_ld: np.ndarray
    noising_branch_prob: np.ndarray
    noising_head_ld: np.ndarray
    noising_head_prob: np.ndarray
    resid_reads: np.ndarray
    seconds: float = 0.0
    # ``positions``: (P, depth, 2, tokens) and (P, depth, heads, tokens), both directions; else None
    branch_pos_ld: np.ndarray | None = None
    branch_pos_prob: np.ndarray | None = None
    head_pos_ld: np.ndarray | None = None
    head_pos_prob: np.ndarray | None = None
    noising_branch_pos_ld: np.ndarray | None = None
    noising_branch_pos_prob: np.ndarray | None = None
    noising_head_pos_ld: np.ndarray | None = None
    noising_head_pos_prob: np.ndarray | None = None

    def restored(self, patched_ld: np.ndarray) -> np.ndarray:
        """Fraction of the logit difference restored, a ratio of means over the pairs (axis 0)."""
        return restored_fraction(patched_ld, self.clean_ld, self.corrupted_ld)

    def removed(self, patched_ld: np.ndarray) -> np.ndarray:
        """Noising: fraction of the logit difference removed, a ratio of means over the pairs."""
        return removed_fraction(patched_ld, self.clean_ld, self.corrupted_ld)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}


def restored_fraction(patched_ld: np.ndarray, clean_ld: np.ndarray, corrupted_ld: np.ndarray):
    """(mean patched - mean corrupted) / (mean clean - mean corrupted), means over axis 0."""
    gap = float(np.mean(clean_ld, dtype=np.float64) - np.mean(corrupted_ld, dtype=np.float64))
    if gap == 0.0:
        return np.full(patched_ld.shape[1:], np.nan)
    return (
        np.mean(patched_ld, axis=0, dtype=np.float64) - np.mean(corrupted_ld, dtype=np.float64)
    ) / gap


def removed_fraction(patched_ld: np.ndarray, clean_ld: np.ndarray, corrupted_ld: np.ndarray):
    """(mean clean - mean patched) / (mean clean - mean corrupted), means over axis 0 (noising)."""
    return 1.0 - restored_fraction(patched_ld, clean_ld, corrupted_ld)


def effect_fraction(direction: str, patched_ld, clean_ld, corrupted_ld) -> np.ndarray:
    """``restored`` for denoising, ``removed`` for noising: 0 no effect, 1 the whole difference."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r}: must be one of {', '.join(DIRECTIONS)}")
    frac = restored_fraction if direction == "denoising" else removed_fraction
    return frac(patched_ld, clean_ld, corrupted_ld)


def fixed_by_construction(reads: np.ndarray) -> np.ndarray:
    """``(depth, tokens)`` bool: residual locations whose fraction is 0 or 1 whatever the weights.

    From ``resid_reads``: a position the readout does not read is fixed at 0; in a block where
    it reads one position only, that position carries all of it: fixed at 1.
    """
    reads = np.asarray(reads, dtype=bool)
    only = reads.sum(axis=1, keepdims=True) == 1
    return ~reads | (reads & only)


def readout_reads(model: VisionTransformer, x: torch.Tensor) -> np.ndarray:
    """``(depth, tokens)`` bool: whether the logits depend on block i's output at position t.

    The gradient of the logits (projected on a fixed random direction, so no sum can cancel)
    with respect to each block's output on the images ``x``: exactly zero at a position means
    no path from it to the readout (a CLS head reads the class token only after the last
    block; a mean-pooling head reads every position).
    """
    depth = model.cfg.depth
    _, cache = run_with_cache(model, x, names_filter=lambda n: n.endswith(".resid2"))
    out = []
    with torch.enable_grad():
        for i in range(depth):
            tokens = cache[f"blocks.{i}.resid2"].detach().clone().requires_grad_(True)
            logits = model.forward_head(model.forward_blocks(tokens, i + 1)).float()
            direction = torch.randn(
                logits.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float32
            ).to(logits.device)
            (grad,) = torch.autograd.grad((logits * direction).sum(), [tokens])
            out.append((grad != 0).any(dim=2).any(dim=0).cpu().numpy())  # (tokens,)
    return np.stack(out)


def _ld_prob(logits: torch.Tensor, y: torch.Tensor, contrast: torch.Tensor):
    logits = logits.float()
    ld = logits.gather(1, y[:, None]) - logits.gather(1, contrast[:, None])
    prob = logits.softmax(-1).gather(1, y[:, None])
    return ld[:, 0].cpu().numpy(), prob[:, 0].cpu().numpy()


KEEP = ("resid2", "attn", "mlp", "attn.z")


def _patch_grid(
    model, entering, source, y, contrast, positions: bool = False
) -> dict[str, np.ndarray]:
    """Every location of one run patched, one at a time, with the other run's activation.

    ``entering``: the target run's tokens entering each block (``depth + 1``: the last is the
    last block's output); ``source``: the other run's cached activations. A patch in block i
    starts from the target's tokens entering block i (the blocks before it would compute them
    again); a residual patch at block i's output starts at block i + 1 with one position replaced.
    With ``positions``, each branch and each head is also patched at one token position at a time.
    """
    cfg = model.cfg
    depth, heads = cfg.depth, cfg.heads
    B, N = entering[0].shape[0], entering[0].shape[1]
    resid = np.zeros((2, B, depth, N), dtype=np.float32)
    branch = np.zeros((2, B, depth, 2), dtype=np.float32)
    head = np.zeros((2, B, depth, heads), dtype=np.float32)
    out: dict[str, np.ndarray] = {}
    if positions:
        out = _patch_positions(model, entering, source, y, contrast)

    def tail(tokens: torch.Tensor, start: int) -> torch.Tensor:
        return model.forward_head(model.forward_blocks(tokens, start))

    for i in range(depth):
        source_out = source[f"blocks.{i}.resid2"]
        for t in range(N):
            tokens = entering[i + 1].clone()
            tokens[:, t] = source_out[:, t]
            resid[:, :, i, t] = _ld_prob(tail(tokens, i + 1), y, contrast)
        for j, kind in enumerate(("attn", "mlp")):
            value = source[f"blocks.{i}.{kind}"]
            with attached(model, [(f"blocks.{i}.{kind}", lambda a, v=value: v)]):
                branch[:, :, i, j] = _ld_prob(tail(entering[i], i), y, contrast)
        z = source[f"blocks.{i}.attn.z"]
        for h in range(heads):

            def one_head(a, h=h, z=z):
                a = a.clone()
                a[:, :, h] = z[:, :, h]
                return a

            with attached(model, [(f"blocks.{i}.attn.z", one_head)]):
                head[:, :, i, h] = _ld_prob(tail(entering[i], i), y, contrast)
    return {
        "resid_ld": resid[0],
        "resid_prob": resid[1],
        "branch_ld": branch[0],
        "branch_prob": branch[1],
        "head_ld": head[0],
        "head_prob": head[1],
        **out,
    }


def _patch_positions(model, entering, source, y, contrast) -> dict[str, np.ndarray]:
    """Each branch output and each head's output patched at one token position, one at a time:
    ``branch_pos_ld`` (B, depth, 2, N) and ``head_pos_ld`` (B, depth, heads, N), with ``*_prob``."""
    cfg = model.cfg
    depth, heads = cfg.depth, cfg.heads
    B, N = entering[0].shape[0], entering[0].shape[1]
    branch = np.zeros((2, B, depth, 2, N), dtype=np.float32)
    head = np.zeros((2, B, depth, heads, N), dtype=np.float32)

    def run(i: int, name: str, fn) -> tuple[np.ndarray, np.ndarray]:
        with attached(model, [(name, fn)]):
            return _ld_prob(model.forward_head(model.forward_blocks(entering[i], i)), y, contrast)

    for i in range(depth):
        for j, kind in enumerate(("attn", "mlp")):
            value = source[f"blocks.{i}.{kind}"]
            for t in range(N):

                def one_position(a, t=t, v=value):
                    a = a.clone()
                    a[:, t] = v[:, t]
                    return a

                branch[:, :, i, j, t] = run(i, f"blocks.{i}.{kind}", one_position)
        z = source[f"blocks.{i}.attn.z"]
        for h in range(heads):
            for t in range(N):

                def one_head_position(a, h=h, t=t, z=z):
                    a = a.clone()
                    a[:, t, h] = z[:, t, h]
                    return a

                head[:, :, i, h, t] = run(i, f"blocks.{i}.attn.z", one_head_position)
    return {
        "branch_pos_ld": branch[0],
        "branch_pos_prob": branch[1],
        "head_pos_ld": head[0],
        "head_pos_prob": head[1],
    }


@torch.no_grad()
def patch_batch(
    model: VisionTransformer,
    x_clean: torch.Tensor,
    x_corrupt: torch.Tensor,
    y: torch.Tensor,
    contrast: torch.Tensor,
    positions: bool = False,
) -> dict[str, np.ndarray]:
    """Every location of the grid patched in both directions, for one batch.

    Denoising (``resid_ld``, ...): clean activations into the corrupted run; noising
    (``noising_resid_ld``, ...): corrupted activations into the clean run. ``positions``: also
    every branch and head at one position at a time (``branch_pos_ld``, ``head_pos_ld``, ...).
    """
    depth = model.cfg.depth
    first = "norm_pre" if model.cfg.norm_pre else "pos_add"
    want = lambda n: n == first or (n.startswith("blocks.") and n.split(".", 2)[2] in KEEP)  # noqa: E731
    clean_logits, clean = run_with_cache(model, x_clean, names_filter=want)
    corrupt_logits, corr = run_with_cache(model, x_corrupt, names_filter=want)

    def entering(cache):
        return [cache[first]] + [cache[f"blocks.{i}.resid2"] for i in range(depth)]

    clean_ld, clean_prob = _ld_prob(clean_logits, y, contrast)
    corrupted_ld, corrupted_prob = _ld_prob(corrupt_logits, y, contrast)
    denoising = _patch_grid(model, entering(corr), clean, y, contrast, positions)
    noising = _patch_grid(model, entering(clean), corr, y, contrast, positions)
    return {
        "clean_ld": clean_ld,
        "clean_prob": clean_prob,
        "corrupted_ld": corrupted_ld,
        "corrupted_prob": corrupted_prob,
        **denoising,
        **{DIRECTIONS["noising"] + k: v for k, v in noising.items()},
    }


def patch_pairs(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor,
    pairs: Pairs,
    inputs,
    positions: bool = False,
) -> PatchingResult:
    """The whole grid over every pair of a split (uint8 images), batched as ``inputs`` says.

    Args:
        model: Glass-box ViT in eval mode (unchanged).
        images, labels: The split (uint8 ``(N, C, H, W)``, labels in the model's classes).
        pairs: From ``make_pairs`` on these labels.
        positions: Also each branch and head at one token position (``PatchingResult``).
        inputs: ``evaluate.Inputs``: normalisation, batch size, device, resize, autocast.
    """
    if model.training:
        raise InterventionError("patching measures the trained function: call model.eval() first")
    started = time.perf_counter()
    clean_idx, source_idx = torch.from_numpy(pairs.clean), torch.from_numpy(pairs.source)
    y_all, contrast_all = labels[clean_idx], labels[source_idx]
    clean_loader = inputs.loader(images[clean_idx], y_all)
    source_loader = inputs.loader(images[source_idx], contrast_all)
    parts: list[dict[str, np.ndarray]] = []
    reads = None
    done = 0
    with inputs.autocast():
        for clean, source in zip(clean_loader, source_loader):
            b = len(clean.labels)
            x_corrupt = corrupt(
                clean.images, source.images, pairs.replaced[done : done + b], model.cfg
            )
            parts.append(
                patch_batch(model, clean.images, x_corrupt, clean.labels, source.labels, positions)
            )
            batch_reads = readout_reads(model, clean.images)
            reads = batch_reads if reads is None else reads | batch_reads
            done += b
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return PatchingResult(**joined, resid_reads=reads, seconds=time.perf_counter() - started)


def split_pairs(labels: np.ndarray, indices: np.ndarray, spec, num_patches: int) -> Pairs:
    """The protocol's pairs on one evaluated split (``make_pairs`` with the ``patching`` section's
    settings, each image keyed by its source-split index): what exact patching and attribution
    patching both act on."""
    return make_pairs(
        labels,
        spec.pairs,
        spec.seed,
        corruption=spec.corruption,
        replaced_patches=spec.replaced_patches,
        num_patches=num_patches,
        sample=spec.sample,
        keys=indices,
    )


def patch_split(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: torch.Tensor,
    inputs,
    spec,
) -> tuple[PatchingResult, dict[str, np.ndarray]]:
    """The protocol's patching on one evaluated split: the result and the pairs as logged.

    Args:
        spec: The protocol's ``patching`` section (pairs, corruption, replaced_patches, seed).

    Returns:
        The result and the pairs' arrays: ``clean_index`` and ``source_index`` (each image's
        position in the dataset's source split), ``clean_label``, ``contrast_label`` and
        ``replaced`` (the patch indices a ``patches`` corruption took), and ``sample_classes``
        and ``class_counts`` (the split's classes and the clean images of each: what the
        report's "Scored images" reads).
    """
    labels_np = labels.cpu().numpy()
    idx = indices.cpu().numpy()
    pairs = split_pairs(labels_np, idx, spec, model.cfg.num_patches)
    result = patch_pairs(model, images, labels, pairs, inputs, spec.positions)
    counts = class_counts(labels_np[pairs.clean], np.unique(labels_np))
    logged = {
        "clean_index": idx[pairs.clean],
        "source_index": idx[pairs.source],
        "clean_label": labels_np[pairs.clean],
        "contrast_label": labels_np[pairs.source],
        "replaced": pairs.replaced,
        "sample_classes": counts.classes,
        "class_counts": counts.counts,
    }
    return result, logged
