"""Ablation protocols: a base config, arms that override it, seeds; validated, typed, hashed.

A protocol is a base config (dataset split, model, optimiser, budget), a list of arms
(overrides of the base; exactly one is the reference) and a list of seeds. Cells are
arms × seeds, and the seed is the pairing key: every arm of a seed gets the same split and
the same seed. Everything is checked at load time, including building every arm's model
config, so a typo fails before any training starts. Schema (``optim``/``run`` optional)::

    name: fmnist_vit_vs_cnn              # [a-z0-9_-], equal to the file stem
    description: What the study tests.
    dataset: {name: fashion_mnist, train_size: 3200, val_size: 800, split_seed: 42, hflip: true}
    model: {name: fmnist_vit, dim: 96}   # a registry name plus field overrides
    # or any timm model: {name: timm/resnet18, num_classes: 10} (kwargs of timm.create_model)
    optim: {lr: 1e-3, weight_decay: 1e-4}
    run: {epochs: 50, batch_size: 128, patience: 5, monitor: val_accuracy, evaluate_test: true}
    recipe: {mixup_alpha: 0.8, ema_decay: 0.999}   # optional, timm's recipe parts (all off by default)
    fast_path: {compile: true}           # optional, how the training step runs (all off by default)
    arms:
      - {name: vit, reference: true}
      - {name: cnn, overrides: {model: {name: fmnist_cnn}}}   # sections: model/dataset/optim/run/recipe/fast_path
    seeds: [0, 1, 2]

The hash is sha256 of canonical JSON of the validated protocol with defaults filled (see
``workbench.protocol.common``); the description and the order of arms and seeds are content too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from workbench.data.locate import DATASET_NAMES
from workbench.models.registry import STUDY_MODELS, model_config
from workbench.models.timm_arm import (
    LIST_HINT,
    TIMM_PREFIX,
    TimmModelError,
    is_timm_name,
    marker_hint,
)
from workbench.protocol import common
from workbench.protocol.common import SCHEMA_VERSION, SHORT_HASH_LEN, ProtocolError, canonical_json
from workbench.train.config import (
    DataSpec,
    FastPathConfig,
    ModelSpec,
    OptimConfig,
    RecipeConfig,
    RunConfig,
    TrainConfig,
)

TOP_KEYS = (
    "name",
    "description",
    "dataset",
    "model",
    "optim",
    "run",
    "recipe",
    "fast_path",
    "arms",
    "seeds",
)
REQUIRED_TOP = ("name", "description", "dataset", "model", "arms", "seeds")
ARM_KEYS = ("name", "reference", "overrides")
OVERRIDE_SECTIONS = ("model", "dataset", "optim", "run", "recipe", "fast_path")
# Where the data lives is per machine (the data fingerprint identifies the data): run time.
DATASET_KEYS = common.field_names(DataSpec, exclude=("path",))
# Pairing by seed needs the identical split in every arm, so arms may not change these.
SPLIT_KEYS = ("name", "split_seed", "train_size", "val_size", "subset")
OPTIM_KEYS = common.field_names(OptimConfig)
# Seeds, device and determinism are chosen per cell at run time (Cell.train_config); every
# other RunConfig field is a protocol key (a new field enters the hash: the pinned-hash test says so).
RUNTIME_RUN_KEYS = ("seed", "device", "deterministic")
RUN_KEYS = common.field_names(RunConfig, exclude=RUNTIME_RUN_KEYS)
# timm's recipe parts: hashed only where they differ from their off default (RecipeConfig.changed),
# so every protocol written before the section existed keeps its hash.
RECIPE_KEYS = common.field_names(RecipeConfig)
# How the training step runs: hashed, like the recipe, only where a part is on.
FAST_PATH_KEYS = common.field_names(FastPathConfig)
# Keys people reach for, with the reason they are not protocol keys.
KEY_HINTS = {
    ("run", "seed"): " (seeds come from the protocol's 'seeds' list, one cell per seed)",
    ("run", "device"): " (a run-time choice: Cell.train_config(device=...))",
    ("run", "deterministic"): " (a run-time choice: Cell.train_config(deterministic=...))",
    ("dataset", "path"): " (where the data lives is per machine: Cell.train_config(data_path=...))",
}


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

    def train_config(
        self, *, device: str = "auto", deterministic: bool = True, data_path: str | None = None
    ) -> TrainConfig:
        """The cell's full config plus the run-time settings a protocol leaves open.

        Args:
            device: ``auto``, ``cuda``, ``mps`` or ``cpu``.
            deterministic: Deterministic kernels.
            data_path: Where this machine keeps the dataset, if not in the usual places.
        """
        cfg = self.config
        return replace(
            cfg,
            data=replace(cfg.data, path=data_path),
            run=replace(cfg.run, device=device, deterministic=deterministic),
        )


@dataclass(frozen=True)
class Protocol:
    """A validated ablation protocol; build it with ``load_protocol`` or ``parse_protocol``.

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
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    fast_path: FastPathConfig = field(default_factory=FastPathConfig)

    kind = "ablation"

    @property
    def short_hash(self) -> str:
        return self.hash[:SHORT_HASH_LEN]

    @property
    def reference(self) -> Arm:
        return next(a for a in self.arms if a.reference)

    def canonical_json(self) -> str:
        """The exact text that is hashed (worth logging next to the file)."""
        return canonical_json(self.canonical)

    def cells(self) -> list[Cell]:
        """Arms × seeds, seed-major: every arm of the first seed (file order), then the next seed.

        Seed-major so that an interrupted study has complete pairs for the seeds it finished,
        which is what a paired comparison can use.
        """
        return [
            Cell(
                self.name,
                self.hash,
                a.name,
                seed,
                a.reference,
                replace(a.config, run=replace(a.config.run, seed=seed)),
            )
            for seed in self.seeds
            for a in self.arms
        ]


def parse_protocol(data: Any, source: str = "<protocol>") -> Protocol:
    """Validate parsed YAML content into a ``Protocol``; ``source`` starts every error message."""

    def fail(msg: str) -> ProtocolError:
        return ProtocolError(f"{source}: {msg}")

    common.check_finite(data, fail)
    top = common.mapping(data, "", TOP_KEYS, fail)
    common.required(top, REQUIRED_TOP, "", fail)
    name = common.identifier(top["name"], "name", fail)
    text = common.description(top["description"], fail)
    base = {
        "dataset": common.section(
            top["dataset"], "dataset", DataSpec, DATASET_KEYS, fail, KEY_HINTS
        ),
        "model": _model_section(top["model"], "model", None, fail),
        "optim": common.section(
            top.get("optim"), "optim", OptimConfig, OPTIM_KEYS, fail, KEY_HINTS
        ),
        "run": common.section(top.get("run"), "run", RunConfig, RUN_KEYS, fail, KEY_HINTS),
        "recipe": common.section(
            top.get("recipe"), "recipe", RecipeConfig, RECIPE_KEYS, fail, KEY_HINTS
        ),
        "fast_path": common.section(
            top.get("fast_path"), "fast_path", FastPathConfig, FAST_PATH_KEYS, fail, KEY_HINTS
        ),
    }
    if base["dataset"].get("name") not in DATASET_NAMES:
        raise fail(
            f"dataset.name={base['dataset'].get('name')!r}: must be one of {', '.join(DATASET_NAMES)}"
        )
    # Build the base before the arms so a bad base value is reported once, as the base's.
    data = common.build(DataSpec, base["dataset"], "dataset", fail)
    optim = common.build(OptimConfig, base["optim"], "optim", fail)
    run = common.build(RunConfig, base["run"], "run", fail)
    recipe = common.build(RecipeConfig, base["recipe"], "recipe", fail)
    fast_path = common.build(FastPathConfig, base["fast_path"], "fast_path", fail)
    if not isinstance(top["arms"], list) or not top["arms"]:
        raise fail(f"arms={top['arms']!r}: must be a non-empty list of arms")
    arms = [_arm(raw, f"arms[{i}]", base, fail) for i, raw in enumerate(top["arms"])]
    _check_arms(arms, fail)
    seeds = common.seeds(top["seeds"], fail)

    content = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "description": text,
        "dataset": _hashed_dataset(data),
        "model": base["model"],
        "optim": dataclasses.asdict(optim),
        "run": {k: getattr(run, k) for k in RUN_KEYS},
        "arms": [
            {"name": a.name, "reference": a.reference, "overrides": a.overrides} for a in arms
        ],
        "seeds": list(seeds),
    }
    if (
        recipe.changed()
    ):  # absent when every part is off: the hash of a protocol without recipe parts stays
        content["recipe"] = recipe.changed()
    if fast_path.changed():  # likewise: all off leaves every existing hash as it was
        content["fast_path"] = fast_path.changed()
    canonical, digest = common.canonical_and_hash(content)
    model = ModelSpec(base["model"]["name"], dict(base["model"]["overrides"]))
    return Protocol(
        name,
        text,
        data,
        model,
        optim,
        run,
        tuple(arms),
        seeds,
        digest,
        canonical,
        source,
        recipe,
        fast_path,
    )


# --- helpers -----------------------------------------------------------------------------


def _model_section(value: Any, where: str, base_name: str | None, fail) -> dict[str, Any]:
    """``{name, overrides}``, overrides type-checked against the named registry model's config.

    A ``timm/<architecture>`` name takes any other key as a keyword argument of
    ``timm.create_model``, checked by building the model on the meta device.
    """
    if not isinstance(value, dict):
        raise fail(f"{where}={value!r}: must be a mapping with a model 'name' and field overrides")
    raw = dict(value)
    name = raw.pop("name", base_name)
    if is_timm_name(name):
        model = {"name": name, "overrides": raw}
    elif name not in STUDY_MODELS:
        raise fail(
            f"{where}.name={name!r}: must be one of the study models {', '.join(STUDY_MODELS)}, or a timm "
            f"architecture as {TIMM_PREFIX}<name>{marker_hint(name)}; {LIST_HINT}"
        )
    else:
        config_cls = type(STUDY_MODELS[name])
        common.mapping(
            raw, where, ("name",) + common.field_names(config_cls), fail, label=f"for model {name}"
        )
        model = {
            "name": name,
            "overrides": common.section(raw, where, config_cls, tuple(raw), fail),
        }
    if name != base_name:  # a complete model; an arm's fields on the base model are checked merged
        _check_model(model, where, fail)
    return model


def _check_model(model: dict[str, Any], where: str, fail) -> None:
    """Build the model config now, so a bad field combination fails at load time, not mid-run."""
    try:
        model_config(model["name"], **model["overrides"])
    except TimmModelError as e:  # the key at fault, in one line
        raise fail(e.line(where)) from e
    except (ValueError, TypeError, KeyError) as e:
        raise fail(
            f"bad model in {where!r} ({model['name']} with {model['overrides']}): {e}"
        ) from e


def _arm(raw: Any, where: str, base: dict[str, Any], fail) -> Arm:
    arm = common.mapping(raw, where, ARM_KEYS, fail)
    name = common.identifier(arm.get("name"), f"{where}.name", fail)
    reference = arm.get("reference", False)
    if not isinstance(reference, bool):
        raise fail(f"{where}.reference={reference!r}: must be true or false")
    at = f"{where}.overrides"
    over = common.mapping(arm.get("overrides"), at, OVERRIDE_SECTIONS, fail)
    norm = {
        "dataset": common.section(
            over.get("dataset"), f"{at}.dataset", DataSpec, DATASET_KEYS, fail, KEY_HINTS
        ),
        "optim": common.section(
            over.get("optim"), f"{at}.optim", OptimConfig, OPTIM_KEYS, fail, KEY_HINTS
        ),
        "run": common.section(over.get("run"), f"{at}.run", RunConfig, RUN_KEYS, fail, KEY_HINTS),
        "recipe": common.section(
            over.get("recipe"), f"{at}.recipe", RecipeConfig, RECIPE_KEYS, fail, KEY_HINTS
        ),
        "fast_path": common.section(
            over.get("fast_path"),
            f"{at}.fast_path",
            FastPathConfig,
            FAST_PATH_KEYS,
            fail,
            KEY_HINTS,
        ),
    }
    split = [k for k in SPLIT_KEYS if k in norm["dataset"]]
    if split:
        raise fail(
            f"{at}.dataset.{split[0]}: arms may not change the split ({', '.join(SPLIT_KEYS)}); "
            "pairing by seed needs the identical split in every arm"
        )
    if (
        "evaluate_test" in norm["run"]
    ):  # a paired comparison needs the test result in all arms or none
        raise fail(
            f"{at}.run.evaluate_test: is protocol-wide; set it in the top-level 'run' section"
        )
    model = base["model"]
    if over.get("model"):
        m = _model_section(over["model"], f"{at}.model", model["name"], fail)
        norm["model"] = ({"name": m["name"]} if "name" in over["model"] else {}) | m["overrides"]
        if m["name"] == model["name"]:
            model = {"name": model["name"], "overrides": model["overrides"] | m["overrides"]}
            _check_model(model, f"{at}.model", fail)
        else:  # another model starts from its registry config: the base's fields belong to the base model
            model = m
    run = common.build(RunConfig, base["run"] | norm["run"], f"{at}.run", fail)
    recipe = common.build(RecipeConfig, base["recipe"] | norm["recipe"], f"{at}.recipe", fail)
    if recipe.mixes and run.batch_size % 2:  # timm's Mixup pairs image i with image B-1-i
        where = f"{at}.run.batch_size" if "batch_size" in norm["run"] else "run.batch_size"
        raise fail(
            f"{where}={run.batch_size}: mixup and CutMix (recipe.mixup_alpha / recipe.cutmix_alpha) need "
            "an even batch size (timm's Mixup pairs each image with another)"
        )
    config = TrainConfig(
        model=ModelSpec(model["name"], dict(model["overrides"])),
        data=common.build(DataSpec, base["dataset"] | norm["dataset"], f"{at}.dataset", fail),
        optim=common.build(OptimConfig, base["optim"] | norm["optim"], f"{at}.optim", fail),
        run=run,
        recipe=recipe,
        fast_path=common.build(
            FastPathConfig, base["fast_path"] | norm["fast_path"], f"{at}.fast_path", fail
        ),
    )
    return Arm(name, reference, {k: v for k, v in norm.items() if v}, config)


def _check_train_subset(data: DataSpec, i: int, overridden: bool, fail) -> None:
    """A training subset must fit in the training split the protocol carves (where it says)."""
    if data.train_subset is None:
        return
    where = f"arms[{i}].overrides.dataset.train_subset" if overridden else "dataset.train_subset"
    for key, size in (("train_size", data.train_size), ("subset", data.subset)):
        if size is not None and data.train_subset > size:
            raise fail(
                f"{where}={data.train_subset}: more than the {size} training images of "
                f"dataset.{key}"
            )


def _hashed_dataset(data: DataSpec) -> dict[str, Any]:
    """The dataset section as hashed: without the per-machine path, and without
    ``train_subset`` when null, so protocols written before the key keep their hash."""
    content = {k: v for k, v in dataclasses.asdict(data).items() if k != "path"}
    if content["train_subset"] is None:
        del content["train_subset"]
    return content


def _check_arms(arms: list[Arm], fail) -> None:
    for i, arm in enumerate(arms):
        data, run = arm.config.data, arm.config.run
        where = (
            f"arms[{i}].overrides.run.batch_size"
            if "batch_size" in arm.overrides.get("run", {})
            else "run.batch_size"
        )
        common.check_batch_fits(run.batch_size, where, data.train_size, data.subset, fail)
        _check_train_subset(data, i, "train_subset" in arm.overrides.get("dataset", {}), fail)
    common.unique_names([a.name for a in arms], "arm", fail)
    common.one_reference([a.name for a in arms if a.reference], "arm", fail)
    # An arm equal to another (say, an override restating the base) wastes compute and makes
    # a report compare a configuration with itself. Compare built architectures, since
    # {} and {patch_size: 4} can be the same model.
    seen: dict[tuple, str] = {}
    for arm in arms:
        cfg = arm.config
        resolved = (
            cfg.model.name,
            model_config(cfg.model.name, **cfg.model.overrides),
            cfg.data,
            cfg.optim,
            cfg.run,
            cfg.recipe,
            cfg.fast_path,
        )
        if resolved in seen:
            raise fail(
                f"arm {arm.name!r} resolves to the same config as arm {seen[resolved]!r}; drop one of them"
            )
        seen[resolved] = arm.name
