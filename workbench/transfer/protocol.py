"""Transfer protocols: a source checkpoint, a dataset, regimes × seeds, validated and hashed.

The ablation schema (``studies/protocol.py``) describes arms that train one registry model
from scratch; a transfer protocol instead starts every cell from one source checkpoint
and varies what is trained. Schema (``run``/``evaluation`` optional)::

    name: retina_transfer                      # [a-z0-9_-], equal to the file stem
    description: What the study tests.
    source:
      model: vit_base_patch16_224.augreg_in21k_ft_in1k   # timm architecture or pinned name
      weights: hub        # hub | random | path | runs:/<id>[/<artifact>] | protocol:<name>/<arm>/seed<k>
    dataset: {name: retinamnist, size: auto, split_seed: 0}
    run: {batch_size: 64, eval_batch_size: 256, amp: off, log_checkpoints: true}
    evaluation: {n_resamples: 2000, confidence: 0.95, seed: 0}
    regimes:
      - {name: linear_probe, kind: linear, reference: true, epochs: 100, lr: 1.0e-3}
      - {name: partial_ft, kind: partial, blocks: 2, epochs: 20, lr: 1.0e-4}
      - {name: full_ft, kind: full, epochs: 20, lr: 5.0e-5, layer_decay: 0.75}
    seeds: [0, 1, 2]

Cells are regimes × seeds; the seed is the pairing key (same split, data order and head
init for every regime of a seed). The hash is sha256 of canonical JSON of the validated
content with defaults filled, so formatting and comments do not change it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from workbench.train.config import OptimConfig

SCHEMA_VERSION = 1
SHORT_HASH_LEN = 12
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
REGIME_KINDS = ("linear", "partial", "full")
RETINA_SIZES = (28, 64, 128, 224)
MIN_RESAMPLES = 1000  # the report's intervals rest on at least this many bootstrap resamples
TOP_KEYS = ("name", "description", "source", "dataset", "run", "evaluation", "regimes", "seeds")
REQUIRED_TOP = ("name", "description", "source", "dataset", "regimes", "seeds")
OPTIM_KEYS = tuple(f.name for f in fields(OptimConfig))


class TransferProtocolError(ValueError):
    """A transfer protocol is invalid; the message names the file, the dotted key and the value."""


@dataclass(frozen=True)
class SourceSpec:
    """Where the pretrained backbone comes from.

    Attributes:
        weights: ``hub`` (the pinned timm checkpoint), ``random`` (seeded timm init, NOT
            PRETRAINED), a local safetensors / workbench checkpoint path, ``runs:/<id>[/path]``
            (an MLflow run of this workbench) or ``protocol:<name>/<arm>/seed<k>`` (the
            finished cell of an ablation protocol).
        model: timm architecture or pinned checkpoint name; needed for timm weights.
        seed: Seed of a ``random`` init.
    """

    weights: str
    model: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class TransferData:
    """The target dataset. ``size: auto`` uses files at the model's input size when present."""

    name: str = "retinamnist"
    size: int | str = "auto"
    split_seed: int = 0
    subset: int | None = None
    train_size: int | None = None
    val_size: int | None = None


@dataclass(frozen=True)
class TransferRunSpec:
    """Batching and numerics shared by every regime (shared batch size keeps batches paired)."""

    batch_size: int = 64
    eval_batch_size: int = 256
    amp: str = "off"
    log_checkpoints: bool = True


@dataclass(frozen=True)
class Evaluation:
    """Bootstrap settings of the test-set intervals and paired regime comparisons."""

    n_resamples: int = 2000
    confidence: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class Regime:
    """One way of adapting the source: what is trained, for how long, how fast.

    Attributes:
        blocks: Partial regime: the last ``blocks`` transformer blocks are trained (with the
            final norm and the head).
        layer_decay: Layer-wise lr decay: layer ``l`` of ``L + 1`` gets ``lr * decay**(L + 1 - l)``.
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


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parse_transfer_protocol(data: Any, source: str = "<protocol>") -> TransferProtocol:
    """Validate parsed YAML into a ``TransferProtocol``; ``source`` starts every error message.

    Raises:
        TransferProtocolError: Naming the dotted key and the value.
    """

    def fail(msg: str) -> TransferProtocolError:
        return TransferProtocolError(f"{source}: {msg}")

    top = _mapping(data, "", TOP_KEYS, fail)
    missing = [k for k in REQUIRED_TOP if k not in top]
    if missing:
        raise fail(f"missing required key(s) {', '.join(missing)}")
    name = _identifier(top["name"], "name", fail)
    if not isinstance(top["description"], str) or not top["description"].strip():
        raise fail(f"description={top['description']!r}: must be a non-empty string")
    src = SourceSpec(**_typed(top["source"], "source", {"weights": str, "model": (str, None), "seed": int}, fail))
    if "weights" not in (top["source"] or {}):
        raise fail("source.weights: required (hub, random, a path, runs:/<id>[/path] or protocol:<name>/<arm>/seed<k>)")
    if src.weights in ("hub", "random") and not src.model:
        raise fail(f"source.model: required with weights {src.weights!r} (a timm architecture or pinned checkpoint name)")
    dataset = TransferData(**_typed(top["dataset"], "dataset", {
        "name": str, "size": (int, str), "split_seed": int, "subset": (int, None),
        "train_size": (int, None), "val_size": (int, None)}, fail))
    if dataset.size != "auto" and dataset.size not in RETINA_SIZES:
        raise fail(f"dataset.size={dataset.size!r}: must be 'auto' or one of {RETINA_SIZES}")
    for key in ("subset", "train_size", "val_size"):
        if getattr(dataset, key) is not None and getattr(dataset, key) < 1:
            raise fail(f"dataset.{key}={getattr(dataset, key)!r}: must be a positive integer or null")
    run = TransferRunSpec(**_typed(top.get("run"), "run", {
        "batch_size": int, "eval_batch_size": int, "amp": str, "log_checkpoints": bool}, fail))
    if run.batch_size < 1 or run.eval_batch_size < 1:
        raise fail(f"run: batch sizes must be positive, got {run.batch_size} and {run.eval_batch_size}")
    if run.amp not in ("off", "bf16", "fp16"):
        raise fail(f"run.amp={run.amp!r}: must be 'off', 'bf16' or 'fp16'")
    evaluation = Evaluation(**_typed(top.get("evaluation"), "evaluation",
                                     {"n_resamples": int, "confidence": float, "seed": int}, fail))
    if evaluation.n_resamples < MIN_RESAMPLES:
        raise fail(f"evaluation.n_resamples={evaluation.n_resamples}: must be >= {MIN_RESAMPLES}")
    if not 0.0 < evaluation.confidence < 1.0:
        raise fail(f"evaluation.confidence={evaluation.confidence!r}: must be in (0, 1)")
    if not isinstance(top["regimes"], list) or not top["regimes"]:
        raise fail(f"regimes={top['regimes']!r}: must be a non-empty list")
    regimes = tuple(_regime(raw, f"regimes[{i}]", fail) for i, raw in enumerate(top["regimes"]))
    _check_regimes(regimes, fail)
    seeds = top["seeds"]
    if not (isinstance(seeds, list) and seeds and all(type(s) is int and s >= 0 for s in seeds)) or len(set(seeds)) != len(seeds):
        raise fail(f"seeds={seeds!r}: must be a non-empty list of distinct integers >= 0")

    canonical = json.loads(canonical_json({
        "schema": SCHEMA_VERSION, "kind": "transfer", "name": name, "description": top["description"],
        "source": asdict(src), "dataset": asdict(dataset), "run": asdict(run), "evaluation": asdict(evaluation),
        "regimes": [asdict(r) for r in regimes], "seeds": list(seeds),
    }))
    digest = hashlib.sha256(canonical_json(canonical).encode()).hexdigest()
    return TransferProtocol(name, top["description"], src, dataset, run, evaluation, regimes, tuple(seeds),
                            digest, canonical, source)


# --- helpers -----------------------------------------------------------------------------

REGIME_TYPES = {"name": str, "kind": str, "reference": bool, "epochs": int, "blocks": (int, None),
                "layer_decay": (float, None), "patience": (int, None)}
OPTIM_TYPES = {"lr": float, "weight_decay": float, "betas": list, "warmup_epochs": float, "min_lr_ratio": float,
               "label_smoothing": float, "grad_clip": (float, None)}


def _regime(raw: Any, where: str, fail) -> Regime:
    values = _typed(raw, where, {**REGIME_TYPES, **OPTIM_TYPES}, fail)
    for key in ("name", "kind", "epochs"):
        if key not in values:
            raise fail(f"{where}.{key}: required")
    name = _identifier(values.pop("name"), f"{where}.name", fail)
    kind = values.pop("kind")
    if kind not in REGIME_KINDS:
        raise fail(f"{where}.kind={kind!r}: must be one of {', '.join(REGIME_KINDS)}")
    optim_args = {k: values.pop(k) for k in OPTIM_KEYS if k in values}
    try:
        optim = OptimConfig(**optim_args)
    except (ValueError, TypeError) as err:
        raise fail(f"bad optimiser value in {where!r}: {err}") from err
    regime = Regime(name=name, kind=kind, reference=values.get("reference", False), epochs=values["epochs"],
                    optim=optim, blocks=values.get("blocks"), layer_decay=values.get("layer_decay"),
                    patience=values.get("patience"))
    if regime.epochs < 1:
        raise fail(f"{where}.epochs={regime.epochs!r}: must be a positive integer")
    if regime.patience is not None and regime.patience < 1:
        raise fail(f"{where}.patience={regime.patience!r}: must be a positive integer or null")
    if (kind == "partial") != (regime.blocks is not None):
        raise fail(f"{where}.blocks: required for kind 'partial' and only there (got {regime.blocks!r} for {kind!r})")
    if regime.blocks is not None and regime.blocks < 0:
        raise fail(f"{where}.blocks={regime.blocks!r}: must be >= 0 (the number of last blocks trained)")
    if regime.layer_decay is not None and (kind == "linear" or not 0.0 < regime.layer_decay <= 1.0):
        raise fail(f"{where}.layer_decay={regime.layer_decay!r}: must be in (0, 1], and only for partial or full")
    return regime


def _check_regimes(regimes: tuple[Regime, ...], fail) -> None:
    names = [r.name for r in regimes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fail(f"duplicate regime name(s) {', '.join(map(repr, dupes))}")
    refs = [r.name for r in regimes if r.reference]
    if len(refs) != 1:
        raise fail(f"exactly one regime must have 'reference: true'; found {len(refs)}" + (f" ({', '.join(refs)})" if refs else ""))
    seen: dict[tuple, str] = {}
    for r in regimes:
        key = canonical_json({k: v for k, v in asdict(r).items() if k not in ("name", "reference")})
        if key in seen:
            raise fail(f"regime {r.name!r} is the same as regime {seen[key]!r}; drop one of them")
        seen[key] = r.name


def _identifier(value: Any, where: str, fail) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise fail(f"{where}={value!r}: must be a safe identifier of lowercase letters, digits, '_' and '-'")
    return value


def _mapping(value: Any, where: str, valid: tuple[str, ...], fail) -> dict:
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise fail(f"{where or 'protocol'}={value!r}: must be a mapping")
    for key in value:
        if key not in valid:
            dotted = f"{where}.{key}" if where else key
            raise fail(f"unknown key {dotted!r}; valid keys here: {', '.join(valid)}")
    return value


def _typed(value: Any, where: str, types: dict[str, Any], fail) -> dict[str, Any]:
    """Keys checked against ``types`` (a type, or a tuple of types where None allows null)."""
    out = {}
    for key, v in _mapping(value, where, tuple(types), fail).items():
        allowed = types[key] if isinstance(types[key], tuple) else (types[key],)
        if v is None and None in allowed:
            out[key] = None
        elif float in allowed and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)  # YAML writes 1 for 1.0
        elif any(t is not None and isinstance(v, t) and not (t is int and isinstance(v, bool)) for t in allowed):
            out[key] = tuple(v) if isinstance(v, list) else v
        else:
            names = " or ".join("null" if t is None else t.__name__ for t in allowed)
            raise fail(f"{where}.{key}={v!r}: expected {names}")
    return out
