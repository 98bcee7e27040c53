"""Which images of a split an acting study scores: a seeded class-stratified sample, the first N, or named positions.

A validation split is stored in source order, and a source may be ordered by class (CIFAR-10's
JPEG copy is): "the first N images" of such a split can be one class only. An acting study
therefore scores a class-stratified sample (``stratified_positions``): every class of the split
gets ``N // C`` images, the ``N % C`` left over go one each to classes in a seeded order, and a
class with too few images gives all it has, its shortfall spread over the others the same way.
Within a class the images are taken in a seeded order.

The seeded orders are ranks of a BLAKE2b hash of (seed, what is ranked): no random generator is
involved, so the sample is the same on every machine and with every NumPy version. The sample is
returned interleaved (the first of every class, then the second, ...), so its first few images,
the ones a report draws, show several classes.

``class_counts`` and ``sample_problems`` say what a sample holds and when it is too thin to
speak for the data: a class of the split with no scored image, or fewer than ``MIN_PER_CLASS``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

SAMPLES = ("first", "stratified")
# A class with fewer scored images than this is too thin for a per-class reading or a mean over
# classes to mean much; the report warns and ``--strict`` refuses (docs/attribution.md).
MIN_PER_CLASS = 10


def seeded_rank(seed: int, keys: np.ndarray, salt: str) -> np.ndarray:
    """A seeded, machine-independent order key per item: the first 8 bytes of BLAKE2b(seed, salt, key)."""
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(f"{seed}/{salt}/{int(k)}".encode(), digest_size=8).digest(), "big"
            )
            for k in keys
        ],
        dtype=np.uint64,
    )


def class_quotas(sizes: np.ndarray, n: int, order: np.ndarray) -> np.ndarray:
    """How many images each class gives: ``n`` spread as evenly as ``sizes`` allow.

    Args:
        sizes: ``(C,)`` images of each class in the split.
        n: Images wanted in all (at most ``sizes.sum()``).
        order: The classes in the order that receives the remainder (a seeded order).
    """
    quota = np.zeros_like(sizes)
    left = int(n)
    active = [int(c) for c in order if sizes[c] > 0]
    while left > 0 and active:
        share, extra = divmod(left, len(active))
        for i, c in enumerate(active):
            give = min(share + (1 if i < extra else 0), int(sizes[c] - quota[c]))
            quota[c] += give
            left -= give
        active = [c for c in active if quota[c] < sizes[c]]
    return quota


def stratified_positions(labels: np.ndarray, n: int, seed: int, keys: np.ndarray | None = None):
    """Positions (into ``labels``) of a seeded class-stratified sample of ``n``, interleaved by class.

    Args:
        labels: ``(M,)`` the split's class labels.
        n: Sample size, 1 to ``M``.
        seed: The sample's seed (a protocol's ``sample_seed``).
        keys: ``(M,)`` what identifies each image across machines (the source dataset index);
            default: its position. The within-class order is ranked on these.

    Raises:
        ValueError: ``n`` outside 1..M.
    """
    labels = np.asarray(labels)
    if not 1 <= n <= len(labels):
        raise ValueError(f"a sample of {n} from a split of {len(labels)} images")
    keys = np.arange(len(labels)) if keys is None else np.asarray(keys)
    classes, inverse = np.unique(labels, return_inverse=True)
    sizes = np.bincount(inverse, minlength=len(classes))
    class_order = np.argsort(seeded_rank(seed, classes, "class"), kind="stable")
    quota = class_quotas(sizes, n, class_order)
    image_rank = seeded_rank(seed, keys, "image")
    chosen, rounds = [], []
    for c in range(len(classes)):
        members = np.flatnonzero(inverse == c)
        picked = members[np.argsort(image_rank[members], kind="stable")[: quota[c]]]
        chosen.append(picked)
        rounds.append(np.arange(len(picked)))
    positions, within = np.concatenate(chosen), np.concatenate(rounds)
    place = np.empty(len(classes), dtype=np.int64)
    place[class_order] = np.arange(len(classes))
    interleave = np.lexsort((place[inverse[positions]], within))
    return positions[interleave]


def sample_positions(
    labels: np.ndarray,
    n: int,
    sample: str,
    seed: int,
    keys: np.ndarray | None = None,
    indices: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The positions a protocol scores: ``indices`` when named, else the first ``n`` or a stratified sample.

    Raises:
        ValueError: An unknown ``sample``, ``n`` larger than the split, or a named position outside it.
    """
    m = len(labels)
    if indices is not None:
        bad = [i for i in indices if not 0 <= i < m]
        if bad:
            raise ValueError(f"position {bad[0]} is outside the split's {m} images")
        return np.asarray(indices, dtype=np.int64)
    if sample not in SAMPLES:
        raise ValueError(f"sample={sample!r}: must be one of {', '.join(SAMPLES)}")
    if not 1 <= n <= m:
        raise ValueError(f"a sample of {n} from a split of {m} images")
    if sample == "first":
        return np.arange(n, dtype=np.int64)
    return stratified_positions(labels, n, seed, keys)


@dataclass(frozen=True)
class ClassCounts:
    """How many scored images each class of the data has: ``classes[i]`` has ``counts[i]``."""

    classes: np.ndarray
    counts: np.ndarray

    def problems(self, min_per_class: int = MIN_PER_CLASS) -> list[str]:
        """Why the sample is too thin to speak for the data (empty when it is not), one line each."""
        missing = [int(c) for c, n in zip(self.classes, self.counts) if n == 0]
        thin = [
            (int(c), int(n)) for c, n in zip(self.classes, self.counts) if 0 < n < min_per_class
        ]
        out = []
        if missing:
            out.append(
                f"{len(missing)} of {len(self.classes)} classes have no scored image "
                f"(class{'es' if len(missing) > 1 else ''} {_listed(missing)})"
            )
        if thin:
            out.append(
                f"{len(thin)} class{'es have' if len(thin) > 1 else ' has'} fewer than {min_per_class} scored "
                f"images ({_listed([f'{c}: {n}' for c, n in thin])})"
            )
        return out


def _listed(items: list, most: int = 8) -> str:
    shown = ", ".join(map(str, items[:most]))
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def class_counts(labels: np.ndarray, classes: np.ndarray) -> ClassCounts:
    """Scored images per class of ``classes`` (every class of the data, the absent ones too)."""
    labels, classes = np.asarray(labels), np.asarray(classes)
    counts = np.array([(labels == c).sum() for c in classes], dtype=np.int64)
    return ClassCounts(classes.astype(np.int64), counts)
