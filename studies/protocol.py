"""Frozen study protocols: a YAML file, validated, typed and hashed, expanded into cells.

A protocol is a base config (dataset split, model, optimiser, budget), a list of arms
(overrides of the base; exactly one is the reference) and a list of seeds. Cells are
arms × seeds, and the seed is the pairing key: every arm of a seed gets the same split and
the same seed. Everything is checked at load time, including building every arm's model
config, so a typo fails before any training starts. Schema (``optim``/``run`` optional)::

    name: fmnist_vit_vs_cnn              # [a-z0-9_-], equal to the file stem
    description: What the study tests.
    dataset: {name: fashion_mnist, train_size: 3200, val_size: 800, split_seed: 42, hflip: true}
    model: {name: fmnist_vit, dim: 96}   # a registry name plus field overrides
    optim: {lr: 1e-3, weight_decay: 1e-4}
    run: {epochs: 50, batch_size: 128, patience: 5, monitor: val_accuracy, evaluate_test: true}
    arms:
      - {name: vit, reference: true}
      - {name: cnn, overrides: {model: {name: fmnist_cnn}}}   # sections: model/dataset/optim/run
    seeds: [0, 1, 2]

The hash is sha256 of canonical JSON of the validated protocol with defaults filled:
formatting, comments and key order do not change it; any value does (the description and
the order of arms and seeds included, which are content too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import types
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from workbench.data.locate import DATASET_NAMES
from workbench.models.registry import STUDY_MODELS, model_config
from workbench.train.config import DataSpec, ModelSpec, OptimConfig, RunConfig, TrainConfig

SCHEMA_VERSION = 1  # bump when the canonical form changes, so old and new hashes never collide
SHORT_HASH_LEN = 12
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
TOP_KEYS = ("name", "description", "dataset", "model", "optim", "run", "arms", "seeds")
REQUIRED_TOP = ("name", "description", "dataset", "model", "arms", "seeds")
ARM_KEYS = ("name", "reference", "overrides")
OVERRIDE_SECTIONS = ("model", "dataset", "optim", "run")
# Where the data lives is per machine (the data fingerprint identifies the data): run time.
DATASET_KEYS = tuple(f.name for f in fields(DataSpec) if f.name != "path")
# Pairing by seed needs the identical split in every arm, so arms may not change these.
SPLIT_KEYS = ("name", "split_seed", "train_size", "val_size", "subset")
OPTIM_KEYS = tuple(f.name for f in fields(OptimConfig))
RUN_KEYS = ("epochs", "batch_size", "eval_batch_size", "patience", "monitor", "checkpoint_every_steps", "amp", "evaluate_test")
# Keys people reach for, with the reason they are not protocol keys.
KEY_HINTS = {
    ("run", "seed"): " (seeds come from the protocol's 'seeds' list, one cell per seed)",
    ("run", "device"): " (a run-time choice: Cell.train_config(device=...))",
    ("run", "deterministic"): " (a run-time choice: Cell.train_config(deterministic=...))",
    ("dataset", "path"): " (where the data lives is per machine: Cell.train_config(data_path=...))",
}


class ProtocolError(ValueError):
    """A protocol file is invalid; the message names the file, the key path and the value."""


class ProtocolFrozenError(ProtocolError):
    """A protocol name was already run with different content."""


class ProtocolDirtyError(ProtocolError):
    """A protocol file is not committed, so runs could not be traced to its content."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 numbers and booleans, refusing duplicate keys.

    PyYAML follows YAML 1.1, where ``1e-3`` is a string and ``off`` is false: ``lr: 1e-3``
    and ``amp: off`` would fail confusingly. A repeated key would silently keep the last value.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", node.value[i][0].start_mark)
        return super().construct_mapping(node, deep=deep)


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag != _BOOL] for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


@dataclass(frozen=True)
class Arm:
    """One arm of a protocol.

    Attributes:
        name: Safe identifier, unique within the protocol.
        reference: Whether the other arms are compared against this one.
        overrides: ``{section: {key: value}}`` as written, type-checked (hashed as is).
        config: The base with the overrides merged; ``run.seed`` is a placeholder.
    """

    name: str
    reference: bool
    overrides: dict[str, dict[str, Any]]
    config: TrainConfig


@dataclass(frozen=True)
class Cell:
    """One training run of a protocol: an arm at a seed."""

    protocol_name: str
    protocol_hash: str
    arm: str
    seed: int
    is_reference: bool
    config: TrainConfig = field(repr=False)

    @property
    def key(self) -> str:
        """Unique within the protocol, e.g. ``vit/seed1``."""
        return f"{self.arm}/seed{self.seed}"

    def train_config(self, *, device: str = "auto", deterministic: bool = True, data_path: str | None = None) -> TrainConfig:
        """The cell's full config plus the run-time settings a protocol leaves open.

        Args:
            device: ``auto``, ``cuda``, ``mps`` or ``cpu``.
            deterministic: Deterministic kernels.
            data_path: Where this machine keeps the dataset, if not in the usual places.
        """
        c = self.config
        return replace(c, data=replace(c.data, path=data_path), run=replace(c.run, device=device, deterministic=deterministic))


@dataclass(frozen=True)
class Protocol:
    """A validated protocol; build it with ``load_protocol`` or ``parse_protocol``.

    ``run.seed`` of the base is a placeholder: seeds come from ``seeds``, one cell each.
    """

    name: str
    description: str
    dataset: DataSpec
    model: ModelSpec
    optim: OptimConfig
    run: RunConfig
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    hash: str
    canonical: dict[str, Any] = field(repr=False, compare=False)
    source: str = field(default="<protocol>", compare=False)

    @property
    def short_hash(self) -> str:
        return self.hash[:SHORT_HASH_LEN]

    @property
    def reference(self) -> Arm:
        return next(a for a in self.arms if a.reference)

    def canonical_json(self) -> str:
        """The exact text that is hashed (worth logging next to the file)."""
        return _canonical_json(self.canonical)

    def cells(self) -> list[Cell]:
        """Arms × seeds, seed-major: every arm of the first seed (file order), then the next seed.

        Seed-major so that an interrupted study has complete pairs for the seeds it finished,
        which is what a paired comparison can use.
        """
        return [
            Cell(self.name, self.hash, a.name, seed, a.reference, replace(a.config, run=replace(a.config.run, seed=seed)))
            for seed in self.seeds
            for a in self.arms
        ]


def load_protocol(path: str | Path) -> Protocol:
    """Read, validate and hash a protocol file.

    Raises:
        ProtocolError: Unreadable file, bad YAML, unknown key, bad value, or a name other
            than the file stem (names map to files one to one).
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:  # a stream, so YAML errors name the file and line
            data = yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ProtocolError(f"{path}: cannot read protocol file: {e}") from e
    except yaml.YAMLError as e:
        raise ProtocolError(f"{path}: invalid YAML: {e}") from e
    protocol = parse_protocol(data, source=str(path))
    if protocol.name != path.stem:
        raise ProtocolError(f"{path}: name {protocol.name!r} must equal the file name stem {path.stem!r}")
    return protocol


def parse_protocol(data: Any, source: str = "<protocol>") -> Protocol:
    """Validate parsed YAML content into a ``Protocol``; ``source`` starts every error message."""

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(f"{source}: {msg}")

    top = _mapping(data, "", TOP_KEYS, fail)
    missing = [k for k in REQUIRED_TOP if k not in top]
    if missing:
        raise fail(f"missing required key(s) {', '.join(missing)}")
    name = _identifier(top["name"], "name", fail)
    if not isinstance(top["description"], str) or not top["description"].strip():
        raise fail(f"description={top['description']!r}: must be a non-empty string")
    base = {
        "dataset": _section(top["dataset"], "dataset", DataSpec, DATASET_KEYS, fail),
        "model": _model_section(top["model"], "model", None, fail),
        "optim": _section(top.get("optim"), "optim", OptimConfig, OPTIM_KEYS, fail),
        "run": _section(top.get("run"), "run", RunConfig, RUN_KEYS, fail),
    }
    if base["dataset"].get("name") not in DATASET_NAMES:
        raise fail(f"dataset.name={base['dataset'].get('name')!r}: must be one of {', '.join(DATASET_NAMES)}")
    # Build the base before the arms so a bad base value is reported once, as the base's.
    data = _build(DataSpec, base["dataset"], "dataset", fail)
    optim = _build(OptimConfig, base["optim"], "optim", fail)
    run = _build(RunConfig, base["run"], "run", fail)
    if not isinstance(top["arms"], list) or not top["arms"]:
        raise fail(f"arms={top['arms']!r}: must be a non-empty list of arms")
    arms = [_arm(raw, f"arms[{i}]", base, fail) for i, raw in enumerate(top["arms"])]
    _check_arms(arms, fail)
    seeds = _seeds(top["seeds"], fail)

    canonical = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "description": top["description"],
        "dataset": {k: v for k, v in dataclasses.asdict(data).items() if k != "path"},
        "model": base["model"],
        "optim": dataclasses.asdict(optim),
        "run": {k: getattr(run, k) for k in RUN_KEYS},
        "arms": [{"name": a.name, "reference": a.reference, "overrides": a.overrides} for a in arms],
        "seeds": list(seeds),
    }
    canonical = json.loads(_canonical_json(canonical))  # exactly what is hashed (tuples as lists)
    model = ModelSpec(base["model"]["name"], dict(base["model"]["overrides"]))
    digest = hashlib.sha256(_canonical_json(canonical).encode()).hexdigest()
    return Protocol(name, top["description"], data, model, optim, run, tuple(arms), seeds, digest, canonical, source)


def check_frozen(protocol: Protocol, previous_hashes: set[str]) -> None:
    """Refuse a protocol whose name was already run with other content.

    Args:
        protocol: The loaded protocol.
        previous_hashes: Full hashes recorded for earlier runs of this protocol name.

    Raises:
        ProtocolFrozenError: ``previous_hashes`` holds a hash other than ``protocol.hash``.
    """
    others = sorted(h for h in previous_hashes if h and h != protocol.hash)
    if others:
        raise ProtocolFrozenError(
            f"protocol {protocol.name!r} was already run with hash {', '.join(h[:SHORT_HASH_LEN] for h in others)}; "
            f"this file has hash {protocol.short_hash}: protocols are frozen once run — "
            "make a new protocol file with a new name"
        )


def protocol_file_is_dirty(path: str | Path) -> bool:
    """Whether the file differs from its committed version (untracked, modified, staged, ignored).

    Outside a git repository, or without git, a file counts as dirty: nothing could tie a
    run to its content. ``check_clean`` says which case it was.
    """
    return _dirty_reason(Path(path)) is not None


def check_clean(path: str | Path, allow_dirty: bool = False) -> None:
    """Raise ``ProtocolDirtyError`` naming the file unless it is committed or ``allow_dirty``."""
    reason = None if allow_dirty else _dirty_reason(Path(path))
    if reason:
        raise ProtocolDirtyError(
            f"{path}: {reason}; commit it first so runs can be traced to its content (or allow dirty files to run it anyway)"
        )


# --- helpers -----------------------------------------------------------------------------


def _dirty_reason(path: Path) -> str | None:
    if not path.is_file():
        return "protocol file does not exist"
    try:  # run git in the file's folder, so the file's own repository answers
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--", path.name],
            cwd=path.resolve().parent, capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot ask git about the protocol file ({e}); treated as uncommitted"
    if out.returncode != 0:
        return f"not inside a git repository (git: {out.stderr.strip()}); treated as uncommitted"
    if not out.stdout.strip():
        return None
    status = out.stdout[:2]
    what = {"??": "untracked", "!!": "ignored by git"}.get(status, f"has uncommitted changes (git status {status.strip()!r})")
    return f"protocol file is {what}"


def _identifier(value: Any, where: str, fail) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise fail(f"{where}={value!r}: must be a safe identifier of lowercase letters, digits, '_' and '-'")
    return value


def _mapping(value: Any, where: str, valid: tuple[str, ...], fail, label: str = "here") -> dict:
    """``value`` (``None`` = empty) as a dict with only ``valid`` keys; errors name the dotted path."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise fail(f"{where or 'protocol'}={value!r}: must be a mapping")
    for key in value:
        if key not in valid:
            hint = KEY_HINTS.get((where.rsplit(".", 1)[-1], key), "")
            raise fail(f"unknown key {f'{where}.{key}' if where else key!r}{hint}; valid keys {label}: {', '.join(valid)}")
    return value


def _section(value: Any, where: str, cls: type, valid: tuple[str, ...], fail) -> dict[str, Any]:
    """A config section with keys checked against ``valid`` and values against ``cls``'s types."""
    hints = get_type_hints(cls)
    return {k: _coerce(v, hints[k], f"{where}.{k}", fail) for k, v in _mapping(value, where, valid, fail).items()}


def _model_section(value: Any, where: str, base_name: str | None, fail) -> dict[str, Any]:
    """``{name, overrides}``, overrides type-checked against the named registry model's config."""
    if not isinstance(value, dict):
        raise fail(f"{where}={value!r}: must be a mapping with a model 'name' and field overrides")
    raw = dict(value)
    name = raw.pop("name", base_name)
    if name not in STUDY_MODELS:
        raise fail(f"{where}.name={name!r}: must be one of the study models {', '.join(STUDY_MODELS)}")
    valid = tuple(f.name for f in fields(STUDY_MODELS[name]))
    _mapping(raw, where, ("name",) + valid, fail, label=f"for model {name}")
    hints = get_type_hints(type(STUDY_MODELS[name]))
    model = {"name": name, "overrides": {k: _coerce(v, hints[k], f"{where}.{k}", fail) for k, v in raw.items()}}
    if name != base_name:  # a complete model; an arm's fields on the base model are checked merged
        _check_model(model, where, fail)
    return model


def _check_model(model: dict[str, Any], where: str, fail) -> None:
    """Build the model config now, so a bad field combination fails at load time, not mid-run."""
    try:
        model_config(model["name"], **model["overrides"])
    except (ValueError, TypeError, KeyError) as e:
        raise fail(f"bad model in {where!r} ({model['name']} with {model['overrides']}): {e}") from e


def _coerce(value: Any, hint: Any, where: str, fail) -> Any:
    """``value`` checked against a type hint; an int becomes a float where a float is expected."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg, where, fail)
            except ProtocolError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is tuple and isinstance(value, (list, tuple)):
        item_hints = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_hints) == len(value):
            return tuple(_coerce(v, h, f"{where}[{i}]", fail) for i, (v, h) in enumerate(zip(value, item_hints)))
    elif hint is Any or (hint is type(None) and value is None) or (origin is dict and isinstance(value, dict)):
        return value
    elif hint in (bool, str) and isinstance(value, hint):
        return value
    elif hint in (int, float) and isinstance(value, (int, hint)) and not isinstance(value, bool):
        return hint(value)
    raise fail(f"{where}={value!r}: expected {_describe(hint)}")


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType, Literal):
        return " or ".join(repr(a) if origin is Literal else _describe(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}" if args[-1] is Ellipsis else f"a list of {len(args)} numbers"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _build(cls: type, kwargs: dict[str, Any], where: str, fail) -> Any:
    """Construct a config dataclass, turning its ValueError into a ProtocolError."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise fail(f"bad value in {where!r}: {e}") from e


def _arm(raw: Any, where: str, base: dict[str, Any], fail) -> Arm:
    arm = _mapping(raw, where, ARM_KEYS, fail)
    name = _identifier(arm.get("name"), f"{where}.name", fail)
    reference = arm.get("reference", False)
    if not isinstance(reference, bool):
        raise fail(f"{where}.reference={reference!r}: must be true or false")
    at = f"{where}.overrides"
    over = _mapping(arm.get("overrides"), at, OVERRIDE_SECTIONS, fail)
    norm = {
        "dataset": _section(over.get("dataset"), f"{at}.dataset", DataSpec, DATASET_KEYS, fail),
        "optim": _section(over.get("optim"), f"{at}.optim", OptimConfig, OPTIM_KEYS, fail),
        "run": _section(over.get("run"), f"{at}.run", RunConfig, RUN_KEYS, fail),
    }
    split = [k for k in SPLIT_KEYS if k in norm["dataset"]]
    if split:
        raise fail(
            f"{at}.dataset.{split[0]}: arms may not change the split ({', '.join(SPLIT_KEYS)}); "
            "pairing by seed needs the identical split in every arm"
        )
    if "evaluate_test" in norm["run"]:  # a paired comparison needs the test result in all arms or none
        raise fail(f"{at}.run.evaluate_test: is protocol-wide; set it in the top-level 'run' section")
    model = base["model"]
    if over.get("model"):
        m = _model_section(over["model"], f"{at}.model", model["name"], fail)
        norm["model"] = ({"name": m["name"]} if "name" in over["model"] else {}) | m["overrides"]
        if m["name"] == model["name"]:
            model = {"name": model["name"], "overrides": model["overrides"] | m["overrides"]}
            _check_model(model, f"{at}.model", fail)
        else:  # another model starts from its registry config: the base's fields belong to the base model
            model = m
    config = TrainConfig(
        model=ModelSpec(model["name"], dict(model["overrides"])),
        data=_build(DataSpec, base["dataset"] | norm["dataset"], f"{at}.dataset", fail),
        optim=_build(OptimConfig, base["optim"] | norm["optim"], f"{at}.optim", fail),
        run=_build(RunConfig, base["run"] | norm["run"], f"{at}.run", fail),
    )
    return Arm(name, reference, {k: v for k, v in norm.items() if v}, config)


def _check_arms(arms: list[Arm], fail) -> None:
    names = [a.name for a in arms]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fail(f"duplicate arm name(s) {', '.join(map(repr, dupes))}; arm names must be unique")
    refs = [a.name for a in arms if a.reference]
    if len(refs) != 1:
        raise fail(f"exactly one arm must have 'reference: true'; found {len(refs)}" + (f" ({', '.join(refs)})" if refs else ""))
    # An arm equal to another (say, an override restating the base) wastes compute and makes
    # a report compare a configuration with itself. Compare built architectures, since
    # {} and {patch_size: 4} can be the same model.
    seen: dict[tuple, str] = {}
    for arm in arms:
        c = arm.config
        resolved = (c.model.name, model_config(c.model.name, **c.model.overrides), c.data, c.optim, c.run)
        if resolved in seen:
            raise fail(f"arm {arm.name!r} resolves to the same config as arm {seen[resolved]!r}; drop one of them")
        seen[resolved] = arm.name


def _seeds(value: Any, fail) -> tuple[int, ...]:
    if not (isinstance(value, list) and value and all(type(s) is int and s >= 0 for s in value)):
        raise fail(f"seeds={value!r}: must be a non-empty list of integers >= 0")
    if len(set(value)) != len(value):
        raise fail(f"seeds={value!r}: seeds must be distinct")
    return tuple(value)


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
