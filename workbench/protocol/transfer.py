"""Transfer protocols: a source checkpoint, a dataset, regimes × seeds, validated and hashed.

An ablation protocol (``workbench.protocol.ablation``) describes arms that train one
registry model from scratch; a transfer protocol instead starts every cell from one source
checkpoint and varies what is trained. Schema (``run``/``evaluation`` optional)::

    name: retina_transfer                      # [a-z0-9_-], equal to the file stem
    description: What the study tests.
    source:
      model: vit_base_patch16_224.augreg_in21k_ft_in1k   # timm architecture or pinned name
      weights: hub        # hub | random | path | runs:/<id>[/<artifact>] | protocol:<name>/<arm>/seed<k>
      sha256: null        # optional pin: the resolved checkpoint file's sha256 (64 hex), checked before any run opens
    dataset: {name: retinamnist, size: auto, split_seed: 0}
    run: {batch_size: 64, eval_batch_size: 256, amp: off, log_checkpoints: true}
    evaluation: {n_resamples: 2000, confidence: 0.95, seed: 0}
    regimes:                                   # regime fields plus any OptimConfig field
      - {name: linear_probe, kind: linear, reference: true, epochs: 100, lr: 1.0e-3}
      - {name: partial_ft, kind: partial, blocks: 2, epochs: 20, lr: 1.0e-4}
      - {name: full_ft, kind: full, epochs: 20, lr: 5.0e-5, layer_decay: 0.75}
      - {name: scratch, kind: scratch, epochs: 20, lr: 1.0e-3}   # the source's architecture, seeded random init
    seeds: [0, 1, 2]

Cells are regimes × seeds; the seed is the pairing key (same split, data order and head
init for every regime of a seed). Keys, types and the hash follow ``workbench.protocol.common``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, get_type_hints

from workbench.data.locate import DATASET_NAMES
from workbench.protocol.common import (
    ProtocolError,
    SCHEMA_VERSION,
    SHORT_HASH_LEN,
    build,
    canonical_and_hash,
    canonical_json,
    check_batch_fits,
    check_finite,
    description as description_of,
    field_names,
    identifier,
    mapping,
    one_reference,
    required,
    section,
    seeds as seeds_of,
    unique_names,
)
from workbench.train.config import OptimConfig

REGIME_KINDS = ("linear", "partial", "full", "scratch")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
RETINA_SIZES = (28, 64, 128, 224)
AMP_MODES = ("off", "bf16", "fp16")
MIN_RESAMPLES = 1000  # the report's intervals rest on at least this many bootstrap resamples
TOP_KEYS = ("name", "description", "source", "dataset", "run", "evaluation", "regimes", "seeds")
REQUIRED_TOP = ("name", "description", "source", "dataset", "regimes", "seeds")
OPTIM_KEYS = field_names(OptimConfig)


class TransferProtocolError(ProtocolError):
    """A transfer protocol is invalid; the message names the file, the dotted key and the value."""


@dataclass(frozen=True)
class SourceSpec:
    """Where the source model comes from: a glass-box / timm ViT, or any model the workbench trains or timm builds.

    Attributes:
        weights: ``hub`` (the pinned timm checkpoint), ``random`` (seeded timm init, NOT
            PRETRAINED), a local safetensors / workbench checkpoint path, ``runs:/<id>[/path]``
            (an MLflow run of this workbench) or ``protocol:<name>/<arm>/seed<k>`` (the
            finished cell of an ablation protocol).
        model: timm architecture or pinned checkpoint name; needed for timm weights. A timm ViT
            is mapped onto the glass-box ViT; any other timm architecture (``resnet18``,
            ``convnext_atto``, ...) is kept as timm builds it (``random`` or a local file; ``hub``
            fetches only the pinned ViT checkpoints).
        seed: Seed of a ``random`` init.
        sha256: Optional pin: the sha256 (64 lowercase hex digits) of the checkpoint file the
            weights resolve to; the runner refuses any other file before a run opens. Absent
            from the hashed form when null, so protocols without a pin keep their hash.
    """

    weights: str
    model: str | None = None
    seed: int = 0
    sha256: str | None = None


@dataclass(frozen=True)
class TransferData:
    """The target dataset.

    Attributes:
        name: The dataset (retinamnist, or another of the workbench's datasets).
        size: RetinaMNIST's image side: 28, 64, 128 or 224; ``auto``: the file at the source
            model's input size when present, else 28 px upsampled in batches.
        split_seed: Seed of carved splits and of ``subset``.
        subset: Keep at most this many images of every split, stratified by class; null: all.
        train_size: Training images carved from the official training split (datasets without
            a validation split); null: the dataset's default.
        val_size: Validation images carved likewise; null: the dataset's default.
    """

    name: str = "retinamnist"
    size: int | str = "auto"
    split_seed: int = 0
    subset: int | None = None
    train_size: int | None = None
    val_size: int | None = None


@dataclass(frozen=True)
class TransferRunSpec:
    """Batching and numerics shared by every regime (shared batch size keeps batches paired).

    Attributes:
        batch_size: Training batch size of every regime.
        eval_batch_size: Batch size of feature caching and evaluation.
        amp: Autocast precision: off, bf16 or fp16.
        log_checkpoints: Log each cell's selected checkpoint to MLflow as an artifact.
    """

    batch_size: int = 64
    eval_batch_size: int = 256
    amp: str = "off"
    log_checkpoints: bool = True


@dataclass(frozen=True)
class Evaluation:
    """Bootstrap settings of the test-set intervals and paired regime comparisons.

    Attributes:
        n_resamples: Bootstrap resamples of each interval (at least 1000).
        confidence: Confidence level of every interval, in (0, 1).
        seed: Seed of the bootstrap resampling.
    """

    n_resamples: int = 2000
    confidence: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class Regime:
    """One way of adapting the source: what is trained, for how long, how fast.

    Attributes:
        name: Safe identifier, unique within the protocol.
        kind: ``linear`` (a new head on frozen features), ``partial`` (the last ``blocks``
            blocks too), ``full`` (every parameter) or ``scratch`` (every parameter of the
            source's architecture from a random init seeded by the cell's seed, not from the
            source's weights: the from-scratch baseline, never pretrained).
        reference: Whether the other regimes are compared against this one (exactly one is).
        epochs: Training epochs (the ceiling when ``patience`` stops earlier).
        optim: The optimiser (its fields are written flat in the regime: ``lr: 1.0e-4``).
        blocks: Partial regime: the last ``blocks`` transformer blocks are trained (with the
            final norm and the head); for a source that is not a glass-box ViT, the last
            ``blocks`` groups of timm's ``group_matcher()`` below the head's group (a model
            without one, the study CNN, refuses ``partial``).
        layer_decay: Layer-wise lr decay: layer ``l`` of ``L + 1`` gets ``lr * decay**(L + 1 - l)``;
            partial and full only (refused for linear and scratch). For a source that is not a
            glass-box ViT the layers are timm's ``group_matcher()`` groups
            (``timm.optim.param_groups_layer_decay``); a model without one refuses it.
        patience: Early stopping after this many epochs without a better validation QWK.
    """

    name: str
    kind: str
    reference: bool
    epochs: int
    optim: OptimConfig
    blocks: int | None = None
    layer_decay: float | None = None
    patience: int | None = None


@dataclass(frozen=True)
class TransferCell:
    """One regime at one seed."""

    protocol_name: str
    protocol_hash: str
    regime: Regime
    seed: int

    @property
    def key(self) -> str:
        return f"{self.regime.name}/seed{self.seed}"


@dataclass(frozen=True)
class TransferProtocol:
    name: str
    description: str
    source: SourceSpec
    dataset: TransferData
    run: TransferRunSpec
    evaluation: Evaluation
    regimes: tuple[Regime, ...]
    seeds: tuple[int, ...]
    hash: str
    canonical: dict = field(repr=False, compare=False)
    source_file: str = field(default="<protocol>", compare=False)

    kind = "transfer"

    @property
    def short_hash(self) -> str:
        return self.hash[:SHORT_HASH_LEN]

    @property
    def reference(self) -> Regime:
        return next(r for r in self.regimes if r.reference)

    def canonical_json(self) -> str:
        return canonical_json(self.canonical)

    def cells(self) -> list[TransferCell]:
        """Seed-major (every regime of a seed before the next seed), so finished seeds are complete pairs."""
        return [TransferCell(self.name, self.hash, r, s) for s in self.seeds for r in self.regimes]


def parse_transfer_protocol(data: Any, source: str = "<protocol>") -> TransferProtocol:
    """Validate parsed YAML into a ``TransferProtocol``; ``source`` starts every error message.

    Raises:
        TransferProtocolError: Naming the dotted key and the value.
    """

    def fail(msg: str) -> TransferProtocolError:
        return TransferProtocolError(f"{source}: {msg}")

    check_finite(data, fail)
    top = mapping(data, "", TOP_KEYS, fail)
    required(top, REQUIRED_TOP, "", fail)
    name = identifier(top["name"], "name", fail)
    text = description_of(top["description"], fail)
    raw_source = section(top["source"], "source", SourceSpec, field_names(SourceSpec), fail)
    if "weights" not in raw_source:
        raise fail(
            "source.weights: required (hub, random, a path, runs:/<id>[/path] or protocol:<name>/<arm>/seed<k>)"
        )
    src = SourceSpec(**raw_source)
    if src.weights in ("hub", "random") and not src.model:
        raise fail(
            f"source.model: required with weights {src.weights!r} (a timm architecture or pinned checkpoint name)"
        )
    if src.sha256 is not None and not SHA256_RE.match(src.sha256):
        raise fail(
            f"source.sha256={src.sha256!r}: must be 64 lowercase hex digits (the sha256 of the checkpoint file)"
        )
    if src.sha256 is not None and src.weights == "random":
        raise fail(
            "source.sha256: a random init has no checkpoint file to pin; drop the key or name a file"
        )
    dataset = TransferData(
        **section(top["dataset"], "dataset", TransferData, field_names(TransferData), fail)
    )
    if dataset.name not in DATASET_NAMES:
        raise fail(f"dataset.name={dataset.name!r}: must be one of {', '.join(DATASET_NAMES)}")
    if dataset.size != "auto" and dataset.size not in RETINA_SIZES:
        raise fail(f"dataset.size={dataset.size!r}: must be 'auto' or one of {RETINA_SIZES}")
    for key in ("subset", "train_size", "val_size"):
        if getattr(dataset, key) is not None and getattr(dataset, key) < 1:
            raise fail(
                f"dataset.{key}={getattr(dataset, key)!r}: must be a positive integer or null"
            )
    run = TransferRunSpec(
        **section(top.get("run"), "run", TransferRunSpec, field_names(TransferRunSpec), fail)
    )
    for key in ("batch_size", "eval_batch_size"):
        if getattr(run, key) < 1:
            raise fail(f"run.{key}={getattr(run, key)!r}: must be a positive integer")
    check_batch_fits(run.batch_size, "run.batch_size", dataset.train_size, dataset.subset, fail)
    if run.amp not in AMP_MODES:
        raise fail(f"run.amp={run.amp!r}: must be one of {', '.join(AMP_MODES)}")
    evaluation = Evaluation(
        **section(top.get("evaluation"), "evaluation", Evaluation, field_names(Evaluation), fail)
    )
    if evaluation.n_resamples < MIN_RESAMPLES:
        raise fail(f"evaluation.n_resamples={evaluation.n_resamples}: must be >= {MIN_RESAMPLES}")
    if not 0.0 < evaluation.confidence < 1.0:
        raise fail(f"evaluation.confidence={evaluation.confidence!r}: must be in (0, 1)")
    if not isinstance(top["regimes"], list) or not top["regimes"]:
        raise fail(f"regimes={top['regimes']!r}: must be a non-empty list")
    regimes = tuple(_regime(raw, f"regimes[{i}]", fail) for i, raw in enumerate(top["regimes"]))
    _check_regimes(regimes, fail)
    seeds = seeds_of(top["seeds"], fail)

    # no pin: the old hash
    source_content = {k: v for k, v in asdict(src).items() if k != "sha256" or v is not None}
    canonical, digest = canonical_and_hash(
        {
            "schema": SCHEMA_VERSION,
            "kind": "transfer",
            "name": name,
            "description": text,
            "source": source_content,
            "dataset": asdict(dataset),
            "run": asdict(run),
            "evaluation": asdict(evaluation),
            "regimes": [asdict(r) for r in regimes],
            "seeds": list(seeds),
        }
    )
    return TransferProtocol(
        name, text, src, dataset, run, evaluation, regimes, seeds, digest, canonical, source
    )


# --- helpers -----------------------------------------------------------------------------

# A regime's keys are its own fields plus the optimiser's, written flat (``lr: 1e-4``).
REGIME_KEYS = field_names(Regime, exclude=("optim",)) + OPTIM_KEYS


def _regime_hints() -> dict[str, Any]:
    return {k: v for k, v in get_type_hints(Regime).items() if k != "optim"} | get_type_hints(
        OptimConfig
    )


def _regime(raw: Any, where: str, fail) -> Regime:
    values = section(raw, where, _regime_hints(), REGIME_KEYS, fail)
    required(values, ("name", "kind", "epochs"), where, fail)
    name = identifier(values.pop("name"), f"{where}.name", fail)
    kind = values.pop("kind")
    if kind not in REGIME_KINDS:
        raise fail(f"{where}.kind={kind!r}: must be one of {', '.join(REGIME_KINDS)}")
    optim = build(OptimConfig, {k: values.pop(k) for k in OPTIM_KEYS if k in values}, where, fail)
    regime = Regime(
        name=name,
        kind=kind,
        reference=values.get("reference", False),
        epochs=values["epochs"],
        optim=optim,
        blocks=values.get("blocks"),
        layer_decay=values.get("layer_decay"),
        patience=values.get("patience"),
    )
    if regime.epochs < 1:
        raise fail(f"{where}.epochs={regime.epochs!r}: must be a positive integer")
    if regime.patience is not None and regime.patience < 1:
        raise fail(f"{where}.patience={regime.patience!r}: must be a positive integer or null")
    if kind == "scratch":
        for key in ("blocks", "layer_decay"):
            if getattr(regime, key) is not None:
                raise fail(
                    f"{where}.{key}={getattr(regime, key)!r}: not for kind 'scratch' (trained from a seeded "
                    "random init, every parameter at the base lr); drop the key"
                )
    if (kind == "partial") != (regime.blocks is not None):
        raise fail(
            f"{where}.blocks: required for kind 'partial' and only there (got {regime.blocks!r} for {kind!r})"
        )
    if regime.blocks is not None and regime.blocks < 0:
        raise fail(
            f"{where}.blocks={regime.blocks!r}: must be >= 0 (the number of last blocks trained)"
        )
    if regime.layer_decay is not None and (kind == "linear" or not 0.0 < regime.layer_decay <= 1.0):
        raise fail(
            f"{where}.layer_decay={regime.layer_decay!r}: must be in (0, 1], and only for partial or full"
        )
    return regime


def _check_regimes(regimes: tuple[Regime, ...], fail) -> None:
    unique_names([r.name for r in regimes], "regime", fail)
    one_reference([r.name for r in regimes if r.reference], "regime", fail)
    seen: dict[str, str] = {}
    for r in regimes:
        key = canonical_json({k: v for k, v in asdict(r).items() if k not in ("name", "reference")})
        if key in seen:
            raise fail(f"regime {r.name!r} is the same as regime {seen[key]!r}; drop one of them")
        seen[key] = r.name
