"""MLflow side of attribution studies: what a cell logs, and the cells read back for the report.

Layout, as for interventions: one experiment per attribution protocol; one parent run per study
(protocol hash + training code fingerprint, tag ``attribution=true``); a child run per acted-on
model (arm, seed), tagged ``cell=true``, ``attribution=true``, ``arm``, ``seed``,
``source_run_id`` (the trained cell) and keyed by ``run_key`` = protocol hash, arm, seed, the
acted-on weights (the trained cell's run id, or the pretrained weights' sha256), data and split
fingerprints and ``attribution_code_fingerprint()``. A child logs

- per method ``<m>``: ``rho/<m>`` (mean Spearman rho over the images where it is defined),
  ``rho_undefined/<m>``, ``deletion_auc/<m>``, ``insertion_auc/<m>`` (true-class probability),
  ``deletion_accuracy_auc/<m>``, ``insertion_accuracy_auc/<m>``;
- per block ``i``: ``high_norm_fraction/block<i>`` (patch tokens above k x the block's median),
  ``median_norm/block<i>``, ``cls_attention_on_high_norm/block<i>`` and
  ``high_norm_token_share/block<i>`` (mean over the images with such a token), and
  ``high_norm_effect/block<i>`` / ``other_effect/block<i>`` (mean causal effect, NaN-free: a
  block without such a token logs no effect);
- ``cls_attention_on_top_effects`` (the share of the last block's CLS attention over the patches
  that falls on the ``TOP_TOKENS`` tokens of largest causal effect, mean over images; chance is
  ``TOP_TOKENS / patches``) and ``cls_attention_concentration`` (the share on its own
  ``TOP_TOKENS`` most-attended tokens);
- per block ``i``, how concentrated CLS attention is (``workbench.attribution.concentration``; means
  over images): ``cls_attention_entropy/block<i>`` (normalised entropy over the patches),
  ``cls_attention_top1/block<i>`` and ``cls_attention_topk/block<i>`` (share on the top 1 and the
  top ``attention_concentration_k`` patch tokens), ``cls_attention_on_self/block<i>``, with
  register tokens ``cls_attention_on_registers/block<i>`` and ``register_norm/block<i>`` (their
  mean L2 norm); per head ``h`` ``cls_attention_entropy_head<h>/block<i>``;
- ``intact_accuracy``, ``intact_log_prob``, ``images``, ``patches``, ``forwards``, the reload
  proof and ``evaluation_seconds``;
- the mean curves as metric histories, step = patch tokens removed (deletion) or kept
  (insertion): ``deletion_curve/<m>`` and ``insertion_curve/<m>`` (mean true-class probability
  over the images), so the MLflow UI draws them;

and the artifacts ``attribution/per_image.npz`` (compressed; ``PER_IMAGE_KEYS``) and
``attribution/summary.json``.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from tracking.kinds.intervention_runs import choose_cells
from tracking.record import queries
from tracking.record.queries import CellRecord
from tracking.record.sink import RunSink
from workbench.attribution import CellAttribution
from workbench.attribution.token_norms import PlantedControl
from workbench.sample import ClassCounts
from workbench.train.evaluate import ReloadProof
from workbench.train.fingerprint import PROJECT_ROOT, TRAINING_ROOTS, closure_fingerprint

ARTIFACT_DIR = "attribution"
PER_IMAGE = f"{ARTIFACT_DIR}/per_image.npz"
SUMMARY = f"{ARTIFACT_DIR}/summary.json"
# Where the attribution kind's code identity starts (``workbench.train.fingerprint``): the
# training roots, the interventions library (the token drop is an intervention's hook; the
# precision and input rule) and the attribution library, with rollout's product; their import
# closure is hashed with them. Figures, the summary rows and the benchmark only read results.
ATTRIBUTION_ROOTS = TRAINING_ROOTS + (
    "workbench/interventions",
    "workbench/attribution",
    "workbench/analysis/rollout.py",
    "workbench/sample.py",  # which images are scored
)
ATTRIBUTION_READ_SIDE = (
    "workbench/interventions/summary.py",
    "workbench/interventions/benchmark.py",
    "workbench/attribution/attribution_figures.py",
)
# How concentrated CLS attention is per block (``workbench.attribution.concentration``), block first:
# ``(L, N)`` heads averaged, ``*_heads`` ``(L, N, H)``; ``attention_top_k`` the k of ``cls_attention_topk``.
# Optional when read: evidence exported before they existed lacks them (the report leaves their table out).
CONCENTRATION_ARRAYS = {
    "cls_attention_top1": "top1",
    "cls_attention_topk": "topk",
    "cls_attention_entropy": "entropy",
    "cls_attention_on_registers": "registers",
    "cls_attention_on_self": "self_share",
    "cls_attention_top1_heads": "top1_heads",
    "cls_attention_topk_heads": "topk_heads",
    "cls_attention_entropy_heads": "entropy_heads",
    "cls_attention_on_registers_heads": "registers_heads",
}
CONCENTRATION_KEYS = ("attention_top_k", *CONCENTRATION_ARRAYS)
# per_image.npz: the arrays without a method in their name; per method m also scores/<m>,
# rho/<m>, deletion_prob/<m>, insertion_prob/<m>, deletion_correct/<m>, insertion_correct/<m>.
PER_IMAGE_KEYS = (
    "methods",
    "labels",
    "indices",
    "predicted",
    "full_log_prob",
    "effects",
    "fractions",
    "norms",
    "prefix_norms",
    "median_norm",
    "norm_threshold",
    "cls_attention",
    "grid",
    "prefix",
    "random_seed",
    "example_images",
    *CONCENTRATION_KEYS,
)
# "does CLS attend to the tokens that matter?": its attention on the 5 of largest effect
TOP_TOKENS = 5
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the zip format's earliest date: no time in the bytes
# The controls' arrays (``workbench.attribution.controls``), present when the protocol asked for
# them: ``insertion_start_*`` ``(N,)`` always (the class token alone: its predicted class and
# probability); ``random_draws/<measure>`` ``(D, N)`` per random draw; the model-randomisation
# check (``workbench.attribution.controls.RandomisationCheck``): ``sanity_layers`` (S,) the
# layers from the logits down and ``sanity_<cascade|independent>/<rho|abs_rho|ssim>/<method>``
# ``(S, N)``. Evidence from before the cascade holds ``sanity/<method>`` ``(L, N)`` instead: rho
# with the top ``1..L`` blocks randomised, a fresh draw per step.
CONTROL_KEYS = ("insertion_start_predicted", "insertion_start_prob")
METHOD_ARRAYS = (
    "scores",
    "rho",
    "deletion_prob",
    "insertion_prob",
    "deletion_correct",
    "insertion_correct",
)


def attribution_fingerprint(
    root: Path = PROJECT_ROOT, versions: dict[str, str] | None = None
) -> str:
    """The attribution kind's fingerprint of the checkout at ``root`` (``closure_fingerprint``)."""
    return closure_fingerprint(ATTRIBUTION_ROOTS, root, versions, ATTRIBUTION_READ_SIDE)


@lru_cache(maxsize=1)
def attribution_code_fingerprint() -> str:
    """This checkout's attribution code identity, once per process: a change there scores a cell again."""
    return attribution_fingerprint()


# ---------------------------------------------------------------- what a cell logs


def per_image_arrays(
    cell: CellAttribution, example_images: np.ndarray, counts: ClassCounts | None = None
) -> dict[str, np.ndarray]:
    """What ``per_image.npz`` holds: every per-image number the report reads, and the example images.

    With ``counts`` (the scored images per class of the evaluated split, ``workbench.sample``) also
    ``sample_classes`` and ``class_counts`` ``(C,)``: every class of the split, absent ones included,
    which the labels alone cannot show.

    Shapes (N images, P patch tokens, F curve points, L blocks): ``scores/<m>``, ``effects``,
    ``cls_attention`` ``(N, P)``; ``rho/<m>`` ``(N,)``; curves ``(N, F)``; ``norms`` ``(L, N, P)``
    (block first); ``prefix_norms`` ``(L, N, prefix)``; ``example_images`` the first ``E`` scored
    images as the dataset holds them, uint8 ``(E, C, H, W)``.
    """
    norms = cell.norms
    arrays = {
        "methods": np.array(cell.methods),
        "labels": cell.labels.astype(np.int64),
        "indices": np.asarray(cell.image_index, dtype=np.int64),
        "predicted": cell.causal.predicted.astype(np.int64),
        "full_log_prob": cell.causal.full_log_prob,
        "effects": cell.causal.effects,
        "fractions": cell.curves.fractions,
        "norms": norms.norms.transpose(1, 0, 2),
        "prefix_norms": norms.prefix_norms.transpose(1, 0, 2),
        "median_norm": norms.median,
        "norm_threshold": np.float64(norms.k),
        "cls_attention": norms.cls_attention,
        "grid": np.array(norms.layout.grid, dtype=np.int64),
        "prefix": np.int64(norms.layout.prefix),
        "random_seed": np.int64(cell.seed),
        "example_images": np.asarray(example_images, dtype=np.uint8),
        "attention_top_k": np.int64(norms.concentration.top_k),
    }
    for key, field in CONCENTRATION_ARRAYS.items():
        values = getattr(norms.concentration, field)  # (N, L) or (N, L, H)
        arrays[key] = np.swapaxes(values, 0, 1)  # block first, as ``norms``
    if cell.start_predicted is not None:
        arrays |= {
            "insertion_start_predicted": cell.start_predicted.astype(np.int64),
            "insertion_start_prob": cell.start_prob,
        }
    if counts is not None:
        arrays |= {"sample_classes": counts.classes, "class_counts": counts.counts}
    arrays |= {f"random_draws/{k}": v for k, v in cell.draws.items()}
    if cell.sanity is not None:
        arrays |= cell.sanity.arrays()
    for m in cell.methods:
        arrays |= {
            f"scores/{m}": cell.scores[m],
            f"rho/{m}": cell.rho[m],
            f"deletion_prob/{m}": cell.curves.deletion_prob[m],
            f"insertion_prob/{m}": cell.curves.insertion_prob[m],
            f"deletion_correct/{m}": cell.curves.deletion_correct[m],
            f"insertion_correct/{m}": cell.curves.insertion_correct[m],
        }
    return arrays


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """MLflow stores NaN, but a report reading it back has no use for one: an undefined number is not logged."""
    return {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}


def cell_metrics(cell: CellAttribution) -> dict[str, float]:
    """The metrics of one cell (see the module docstring), computed from ``cell`` alone."""
    metrics = {
        "intact_accuracy": cell.intact_accuracy,
        "intact_log_prob": float(cell.causal.full_log_prob.mean()),
        "images": len(cell.labels),
        "patches": cell.causal.effects.shape[1],
        "forwards": cell.forwards,
        "evaluation_seconds": cell.seconds,
        "norm_threshold": cell.norms.k,
    }
    top = min(TOP_TOKENS, cell.causal.effects.shape[1])
    metrics |= {
        "attention_top_tokens": top,
        "cls_attention_on_top_effects": float(cell.cls_attention_on_top_effects(top).mean()),
        "cls_attention_concentration": float(cell.cls_attention_concentration(top).mean()),
    }
    for s in cell.summary():
        metrics |= {
            f"rho/{s.method}": s.mean_rho,
            f"rho_undefined/{s.method}": s.undefined_rho,
            f"deletion_auc/{s.method}": s.deletion_auc,
            f"insertion_auc/{s.method}": s.insertion_auc,
            f"deletion_accuracy_auc/{s.method}": s.deletion_accuracy_auc,
            f"insertion_accuracy_auc/{s.method}": s.insertion_accuracy_auc,
        }
    metrics |= control_metrics(cell)
    norms = cell.norms
    # (N, L), NaN where an image has no high-norm token at a block
    share, tokens = norms.attention_share()
    inside, outside = norms.effect_of_outliers(cell.causal.effects)
    with np.errstate(invalid="ignore"):
        for block in range(norms.median.shape[0]):
            has = np.isfinite(share[:, block])
            metrics |= {
                f"high_norm_fraction/block{block}": float(norms.outlier_fraction[block]),
                f"median_norm/block{block}": float(norms.median[block]),
                f"images_with_high_norm/block{block}": int(has.sum()),
            }
            if has.any():
                metrics |= {
                    f"cls_attention_on_high_norm/block{block}": float(share[has, block].mean()),
                    f"high_norm_token_share/block{block}": float(tokens[has, block].mean()),
                }
            metrics |= {
                f"high_norm_effect/block{block}": float(inside[block]),
                f"other_effect/block{block}": float(outside[block]),
            }
    return _finite(metrics | concentration_metrics(cell))


def control_params(settings) -> dict[str, object]:
    """The controls' settings as params, only where the protocol set them (old runs have none)."""
    return {
        k: getattr(settings, k)
        for k in ("random_draws", "sanity_check")
        if getattr(settings, k) != type(getattr(settings, k))()
    }


def control_metrics(cell: CellAttribution) -> dict[str, float]:
    """The controls in numbers: the insertion start, the random draws' spread, the sanity check."""
    metrics: dict[str, float] = {}
    if cell.start_predicted is not None:
        counts = np.bincount(cell.start_predicted)
        metrics |= {
            "insertion_start_class": int(counts.argmax()),
            "insertion_start_share": float(counts.max() / counts.sum()),
            "insertion_start_prob": float(cell.start_prob.mean()),
        }
    for measure, values in cell.draws.items():  # (D, N): the spread of the per-draw means
        means = np.nanmean(values, axis=1)
        metrics |= {
            f"random_draws_mean/{measure}": float(means.mean()),
            f"random_draws_sd/{measure}": float(means.std(ddof=1)),
        }
    cascade = cell.sanity.cascade if cell.sanity is not None else {}
    for metric, per_method in cascade.items():  # (S, N): the last step has every layer random
        for m, values in per_method.items():
            last = values[-1][np.isfinite(values[-1])]  # rho is undefined for a constant map
            if last.size:
                metrics[f"sanity_all_random/{metric}/{m}"] = float(last.mean())
    return metrics


def concentration_metrics(cell: CellAttribution) -> dict[str, float]:
    """Per block: how concentrated CLS attention is, its share on the registers and their norm (means over images)."""
    c, norms = cell.norms.concentration, cell.norms
    registers = norms.layout.prefix - 1
    metrics: dict[str, float] = {"attention_concentration_k": c.top_k}
    with np.errstate(invalid="ignore"):
        for block in range(c.entropy.shape[1]):
            metrics |= {
                f"cls_attention_entropy/block{block}": float(c.entropy[:, block].mean()),
                f"cls_attention_top1/block{block}": float(c.top1[:, block].mean()),
                f"cls_attention_topk/block{block}": float(c.topk[:, block].mean()),
                f"cls_attention_on_self/block{block}": float(c.self_share[:, block].mean()),
            }
            metrics |= {
                f"cls_attention_entropy_head{h}/block{block}": float(
                    c.entropy_heads[:, block, h].mean()
                )
                for h in range(c.entropy_heads.shape[2])
            }
            if registers:
                metrics |= {
                    f"cls_attention_on_registers/block{block}": float(c.registers[:, block].mean()),
                    f"register_norm/block{block}": float(norms.prefix_norms[:, block, 1:].mean()),
                }
    return metrics


def _artifact(sink: RunSink, folder: Path, name: str, data: bytes) -> None:
    path = folder / name
    path.write_bytes(data)
    sink.log_artifact(path, artifact_path=ARTIFACT_DIR)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as an ``.npz`` (deflated, keys sorted, fixed timestamps) that ``numpy.load`` reads:
    the same arrays give the same bytes, logged or exported."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for key in sorted(arrays):
            body = io.BytesIO()
            np.save(body, np.asarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, body.getvalue(), compresslevel=9)
    return buffer.getvalue()


def log_cell(
    sink: RunSink,
    cell: CellAttribution,
    example_images: np.ndarray,
    proof: ReloadProof | None,
    extra: dict,
    check=lambda: None,
    counts: ClassCounts | None = None,
    norm_control: PlantedControl | None = None,
) -> dict[str, float]:
    """The cell's metrics, its per-image arrays and a summary; ``check`` fences each write. Returns the metrics.

    ``counts``: the scored images per class of the evaluated split (``per_image_arrays``);
    ``norm_control``: the high-norm detector's planted positive control, logged as
    ``norm_control/threshold`` (the smallest planted ratio flagged in every image; absent when
    none was) and ``norm_control/detects`` (1: flagged from 2 k up, never below k), and as the
    ``norm_control/*`` arrays.
    """
    metrics = cell_metrics(cell)
    if norm_control is not None:
        metrics["norm_control/detects"] = float(norm_control.detects)
        if math.isfinite(norm_control.threshold):
            metrics["norm_control/threshold"] = norm_control.threshold
    if proof is not None:
        metrics |= {
            "reload_proof_passed": float(proof.passed),
            "reload_proof_max_abs_diff": proof.max_abs_prob_diff,
        }
    check()
    # A cell continued in place (its execution died after its lease was released, before its run
    # ended) already holds these: only what it lacks is logged, so each key keeps one value per step.
    sink.log_lacking_metrics(metrics)
    patches = cell.causal.effects.shape[1]
    for j, fraction in enumerate(cell.curves.fractions):
        check()
        sink.log_lacking_metrics(
            {
                f"{kind}_curve/{m}": float(getattr(cell.curves, f"{kind}_prob")[m][:, j].mean())
                for m in cell.methods
                for kind in ("deletion", "insertion")
            },
            step=round(fraction * patches),
        )
    summary = {
        "methods": list(cell.methods),
        "per_method": {s.method: vars(s) for s in cell.summary()},
        "images": len(cell.labels),
        "seconds": cell.seconds,
        "forwards": cell.forwards,
        "norm_threshold": cell.norms.k,
        "random_seed": cell.seed,
        **(
            {"class_counts": dict(zip(map(int, counts.classes), map(int, counts.counts)))}
            if counts is not None
            else {}
        ),
        "auc": "trapezoid over the fractions of patch tokens removed (deletion) or kept (insertion), 0 to 1, "
        "both ends included",
        "reload_proof": proof.summary()
        if proof is not None
        else "not applicable (pretrained weights)",
        **extra,
    }
    with tempfile.TemporaryDirectory() as tmp:
        check()
        _artifact(
            sink,
            Path(tmp),
            "per_image.npz",
            npz_bytes(
                per_image_arrays(cell, example_images, counts)
                | (norm_control.arrays() if norm_control is not None else {})
            ),
        )
        check()
        _artifact(
            sink,
            Path(tmp),
            "summary.json",
            json.dumps(summary, indent=1, sort_keys=True, default=float).encode(),
        )
    return metrics


# ---------------------------------------------------------------- read back for the report


@dataclass
class AttributionCellResult:
    """One finished attribution cell as the report reads it: its record and its ``per_image.npz`` arrays."""

    record: CellRecord
    arrays: dict[str, np.ndarray]

    @property
    def methods(self) -> list[str]:
        return [str(m) for m in self.arrays["methods"]]

    def per_method(self, name: str, method: str) -> np.ndarray:
        return self.arrays[f"{name}/{method}"]


def read_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def finished_cells(
    protocol_name: str, protocol_hash: str
) -> tuple[dict[tuple[str, int], CellRecord], list[CellRecord]]:
    """The newest finished run of each (arm, seed) of the hash, and every cell run (for the runs table).

    Only runs of the newest finished run's attribution code fingerprint are chosen (code
    versions are never mixed), by the rule of ``tracking.kinds.intervention_runs.choose_cells``.
    """
    records = queries.cell_records(protocol_name, protocol_hash)
    return choose_cells(records), records


def read_cell(record: CellRecord, workdir: Path) -> AttributionCellResult:
    """The per-image arrays a finished cell logged."""
    path = queries.download_artifact(record.run_id, PER_IMAGE, Path(workdir) / record.run_id)
    return AttributionCellResult(record, read_npz(path.read_bytes()))
