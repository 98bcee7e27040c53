"""Intervention protocols: a grid of interventions on trained cells or on a pretrained timm ViT.

An intervention protocol trains nothing. It names what it acts on, either the finished ViT
cells of an ablation protocol (pinned by file and hash; the arms; every seed) or one
pretrained timm ViT (a pinned checkpoint, a seeded random init or a local file) with a
labelled dataset, and a grid of interventions evaluated on every cell. Schema::

    name: smoke_heads                         # [a-z0-9_-], equal to the file stem
    description: What the study asks.
    acts_on: {protocol: smoke, hash: 7aa839f2..., arms: [vit]}   # studies/protocols/smoke.yaml
    # or: pretrained: {model: vit_small_patch14_reg4_dinov2.lvd142m, weights: hub,
    #                  dataset: image_folder, class_index: {cat: 281, dog: 207}}
    interventions:
      heads: all                  # all | none | [blocks.1.attn.head2, ...]
      head_modes: [zero, mean]
      branches: all               # all | none | [blocks.0.attn, blocks.2.mlp, ...]
      position_embedding: true
      tokens: [registers]         # drop the register tokens (class: the class token)
      patches: [blocks.1.resid2]  # each example gets another example's activation there
      sets: [{name: block0_heads, items: [blocks.0.attn.head0.zero, blocks.0.attn.head1.zero]}]
    evaluation: {split: val, batch_size: 256, mean_images: 1000, mean_seed: 0}
    patching: {pairs: 64, corruption: class, seed: 0}   # optional: activation patching
      # optional inside it: attribution_patching: true (AtP and AtP-IG beside the exact grid),
      # ig_steps: 5 (AtP-IG's steps); at their defaults they are not hashed
    # patching.sample: stratified (default) | uniform: how the clean images are drawn

Which clean images patching pairs: a seeded class-stratified sample of ``pairs`` images
(``workbench.sample``, seeded by ``patching.seed``), each with a corrupting image of another
class drawn as before. A protocol frozen before this rule drew its clean images uniformly
(``sample: uniform``), and its hash has no ``sample`` in it; such a protocol (its hash is in
``UNIFORM_PAIRS_PROTOCOLS``) keeps its hash and its pairs with the key left out. Any other
protocol that leaves ``sample`` out gets the stratified sample, and ``sample: stratified`` is
part of its hash (``sample: uniform`` is left out of the canonical content, as in the old files).

Cells are the acted-on protocol's arms × seeds (seed-major), one for a pretrained model.
Keys, types, errors and the hash follow ``workbench.protocol.common``; the grid is checked
against every acted-on arm's model when the file is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from workbench.data.locate import DATASET_NAMES
from workbench.interventions.spec import (
    BRANCHES,
    HEAD_MODES,
    TOKEN_KINDS,
    DropTokens,
    HeadAblation,
    Intervention,
    InterventionError,
    InterventionSet,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
    check,
    parse,
)
from workbench.interventions.patching import CORRUPTIONS
from workbench.interventions.read_across import NotGlassBoxViT, glassbox_config
from workbench.models.registry import model_config
from workbench.models.timm_arm import TimmModelConfig
from workbench.models.vit import ViTConfig
from workbench.protocol import common
from workbench.protocol.common import SCHEMA_VERSION, SHORT_HASH_LEN, ProtocolError, canonical_json
from workbench.protocol.files import load_file
from workbench.kinds import DEFAULT_KIND

TOP_KEYS = (
    "name",
    "description",
    "acts_on",
    "pretrained",
    "interventions",
    "evaluation",
    "patching",
)
REQUIRED_TOP = ("name", "description", "interventions")
SPLITS = ("val", "test")
# The intervention protocols with a ``patching`` section frozen (and run) before
# ``patching.sample`` existed: they drew their clean images uniformly, and a file that leaves
# ``sample`` out keeps that meaning and its hash only if its hash is one of these (hash -> name).
UNIFORM_PAIRS_PROTOCOLS = {
    "380b069b9ab44e8e274fc5ff9f5ad0110edec3e7201ff7cdf164af2c8666757e": "fmnist_seed_recipe_patching",
    "ea79dd36bb488539bc48e8deda486b12cb9fddc644167e68662abee71282d312": "smoke_patching",
}
PRETRAINED_ARM = "pretrained"


class InterventionProtocolError(ProtocolError):
    """An intervention protocol is invalid; the message names the file, the dotted key and the value."""


@dataclass(frozen=True)
class ActsOn:
    """The trained cells: an ablation protocol (a file beside this one) pinned by its full hash.

    Attributes:
        protocol: The ablation protocol's name (its file sits beside this one).
        hash: Its full protocol hash: the file must still have it.
        arms: Which of its ViT arms to act on: glass-box ViTs, and timm ViTs (`timm/<architecture>`)
            read across to the glass-box ViT by the exact mapping; a CNN (a timm one too) is refused.
            Empty: every ViT arm.
    """

    protocol: str
    hash: str
    arms: tuple[str, ...] = ()  # empty: every ViT arm


@dataclass(frozen=True)
class Pretrained:
    """A pretrained timm ViT and the labelled dataset it is evaluated on.

    Attributes:
        model: A pinned checkpoint name (``workbench/convert/pinned_checkpoints.json``) or a timm
            ViT architecture.
        weights: ``hub`` (the pinned checkpoint, sha256-checked), ``random`` (seeded timm init,
            NOT pretrained) or a local safetensors / weights-only file.
        seed: Seed of a ``random`` init; the cell's seed.
        timm_kwargs: Passed to ``timm.create_model`` (a reduced size for tests).
        dataset: A dataset name (``image_folder`` for your own labelled images).
        split_seed: Seed of a carved validation split and of ``subset``.
        val_size: Validation images carved from the training split when the dataset has no
            validation split; null: the dataset's default.
        subset: Keep at most this many images of every split, stratified by class; null: all.
        class_index: Dataset class name -> model output index; default: the dataset's label
            order, which needs a head with exactly the dataset's classes.
    """

    model: str
    weights: str = "hub"
    seed: int = 0
    timm_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset: str = "image_folder"
    split_seed: int = 0
    val_size: int | None = None
    subset: int | None = None
    class_index: dict[str, Any] | None = None


@dataclass(frozen=True)
class Grid:
    """Which interventions every cell gets, each evaluated on its own.

    Attributes:
        heads: Heads to ablate one at a time: ``all``, ``none`` or names like ``blocks.1.attn.head2``.
        head_modes: How a head is ablated: ``zero`` and/or ``mean`` (its mean over training images).
        branches: Residual branches to skip one at a time: ``all``, ``none`` or names like
            ``blocks.0.attn``, ``blocks.2.mlp``.
        position_embedding: Also evaluate the model with its position embedding zeroed.
        tokens: Tokens to drop: ``registers`` and/or ``class``.
        patches: Stages where each example gets another example's activation (``blocks.1.resid2``).
        sets: Named sets of interventions applied together: ``{name, items}``.
    """

    heads: str | tuple[str, ...] = "all"
    head_modes: tuple[str, ...] = ("zero", "mean")
    branches: str | tuple[str, ...] = "all"
    position_embedding: bool = True
    tokens: tuple[str, ...] = ()
    patches: tuple[str, ...] = ()
    sets: tuple[dict[str, Any], ...] = ()

    def expand(self, cfg: ViTConfig) -> list[Intervention]:
        """The grid's interventions for a model, in report order: per block its heads, then its branches."""
        heads = (
            [(b, h) for b in range(cfg.depth) for h in range(cfg.heads)]
            if self.heads == "all"
            else []
            if self.heads == "none"
            else [(p.block, p.head) for p in map(_head_of, self.heads)]
        )
        branches = (
            [(b, k) for b in range(cfg.depth) for k in BRANCHES]
            if self.branches == "all"
            else []
            if self.branches == "none"
            else [_branch_of(text) for text in self.branches]
        )
        out: list[Intervention] = []
        for block in range(cfg.depth):
            out += [HeadAblation(b, h, m) for b, h in heads if b == block for m in self.head_modes]
            out += [SkipBranch(b, k) for b, k in branches if b == block]
        out += [HeadAblation(b, h, m) for b, h in heads if b >= cfg.depth for m in self.head_modes]
        # refused by check() with the valid blocks
        out += [SkipBranch(b, k) for b, k in branches if b >= cfg.depth]
        out += [ZeroPosEmbed()] if self.position_embedding else []
        out += [DropTokens(t) for t in self.tokens] + [PatchStage(s) for s in self.patches]
        return out + [
            InterventionSet(s["name"], tuple(parse(i) for i in s["items"])) for s in self.sets
        ]


@dataclass(frozen=True)
class InterventionEvaluation:
    """Where and how every intervention is measured, and the report's interval settings.

    Attributes:
        split: ``val`` (default) or ``test`` (then evaluated once per cell, as the protocol says).
        batch_size: Batch size of the evaluations.
        mean_images: Training images whose per-head mean replaces a head in ``mean`` ablation,
            drawn with ``mean_seed``.
        mean_seed: Seed of the draw of those training images.
        patch_seed: Seed of the derangement giving each example its patch source (another example).
        attention_maps: Record each head's mean attention map on the split, for the report.
        confidence: Confidence level of the report's intervals (t and bootstrap); the number of
            resamples is the report's ``--resamples``, as for every protocol kind.
        seed: Seed of the report's bootstrap.
    """

    split: Literal["val", "test"] = "val"
    batch_size: int = 256
    mean_images: int = 1000
    mean_seed: int = 0
    patch_seed: int = 0
    attention_maps: bool = True
    confidence: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class PatchingSpec:
    """Activation patching on every cell (``workbench.interventions.patching``); absent: none.

    Attributes:
        pairs: Clean images drawn from the evaluated split, each paired with a corrupting image
            of another class (the same pairs for every seed).
        corruption: ``class`` (the corrupted image is the corrupting image) or ``patches`` (the
            clean image with ``replaced_patches`` patches, at seeded positions, taken from it).
        replaced_patches: How many patches a ``patches`` corruption replaces.
        seed: Seed of the pairs (the stratified sample too) and of the replaced positions.
        attribution_patching: Also estimate every patch by attribution patching, AtP and
            AtP-IG (``workbench.interventions.attribution_patching``), logged beside the exact
            grid and scored against it.
        ig_steps: AtP-IG's interpolation steps (used with ``attribution_patching``).
        sample: ``stratified`` (a seeded class-stratified sample of clean images) or
            ``uniform`` (positions drawn uniformly; what protocols frozen before this key meant).
        positions: Also patch each branch and each head at one token position at a time (maps
            blocks x branch x position and blocks x head x position, both directions): about
            ``heads + 2`` times the residual grid's forwards more.
        edges: Also each edge from a head to a later reader of the class token's residual, by
            exact path patching and by edge AtP (``workbench.interventions.edge_patching``).
    """

    pairs: int = 64
    corruption: str = "class"
    replaced_patches: int = 0
    seed: int = 0
    attribution_patching: bool = False
    ig_steps: int = 5
    sample: Literal["stratified", "uniform"] = "stratified"
    positions: bool = False
    edges: bool = False

    def canonical(self) -> dict[str, Any]:
        """The hashed form (``canonical_patching``)."""
        return canonical_patching(self)


# Optional patching settings: at this value they are left out of the canonical content (and the
# hash), so every protocol written before they existed keeps its hash; ``sample: uniform`` too, as
# in the files frozen before the key.
PATCHING_OPTIONAL = {
    "attribution_patching": False,
    "ig_steps": 5,
    "sample": "uniform",
    "positions": False,
    "edges": False,
}


def canonical_patching(spec: PatchingSpec) -> dict[str, Any]:
    """The hashed form of the patching section: optional settings at their default left out."""
    return {
        k: v
        for k, v in asdict(spec).items()
        if k not in PATCHING_OPTIONAL or v != PATCHING_OPTIONAL[k]
    }


@dataclass(frozen=True)
class InterventionCell:
    """One acted-on model: an arm at a seed (``pretrained`` at the init seed for a timm source)."""

    protocol_name: str
    protocol_hash: str
    arm: str
    seed: int

    @property
    def key(self) -> str:
        return f"{self.arm}/seed{self.seed}"


@dataclass(frozen=True)
class _Named:
    name: str


@dataclass(frozen=True, kw_only=True)
class ActingProtocol:
    """What a protocol acting on trained models (interventions, attribution) holds and answers the
    same way: its header, what it acts on, its hash; its arms and seeds (the acted-on cells, or the
    one pretrained model), cells and configs. A kind adds its sections as positional fields
    (keyword-only here, so a kind's own fields keep their place before these)."""

    name: str
    description: str
    acts_on: ActsOn | None
    pretrained: Pretrained | None
    hash: str
    canonical: dict = field(repr=False, compare=False)
    source_file: str = field(default="<protocol>", compare=False)
    source: Any = field(default=None, repr=False, compare=False)  # the acted-on ablation Protocol

    @property
    def short_hash(self) -> str:
        return self.hash[:SHORT_HASH_LEN]

    @property
    def arms(self) -> tuple[str, ...]:
        return (PRETRAINED_ARM,) if self.pretrained is not None else self.acts_on.arms

    @property
    def seeds(self) -> tuple[int, ...]:
        return (self.pretrained.seed,) if self.pretrained is not None else tuple(self.source.seeds)

    def canonical_json(self) -> str:
        return canonical_json(self.canonical)

    def cells(self) -> list[InterventionCell]:
        """Seed-major, as the acted-on protocol's cells."""
        return [
            InterventionCell(self.name, self.hash, arm, seed)
            for seed in self.seeds
            for arm in self.arms
        ]

    def model_config(self, arm: str) -> ViTConfig:
        """An acted-on arm's glass-box config (the trained cell's architecture, a timm ViT's read across)."""
        return arm_model_config(self.source, arm)


class Header(NamedTuple):
    """An acting protocol's checked header: its top mapping, name and description, the file it was
    read from and ``fail(msg)``, the kind's error with that file starting its message."""

    top: dict
    name: str
    text: str
    source: str
    fail: Callable[[str], ProtocolError]


class ActedSources(NamedTuple):
    """What an acting protocol acts on: exactly one of ``acts_on`` and ``pretrained``, and the
    acted-on ablation protocol (with ``acts_on``)."""

    acts_on: ActsOn | None
    pretrained: Pretrained | None
    acted: Any


def parse_header(
    data: Any, source: str, error: type[ProtocolError], top_keys: tuple[str, ...], required
) -> Header:
    """The header of an acting protocol, with exactly one of acts_on / pretrained."""

    def fail(msg: str) -> ProtocolError:
        return error(f"{source}: {msg}")

    common.check_finite(data, fail)
    top = common.mapping(data, "", top_keys, fail)
    common.required(top, required, "", fail)
    name = common.identifier(top["name"], "name", fail)
    text = common.description(top["description"], fail)
    if ("acts_on" in top) == ("pretrained" in top):
        raise fail(
            "give exactly one of acts_on (trained cells of an ablation protocol) or pretrained (a timm ViT)"
        )
    return Header(top, name, text, source, fail)


def evaluation_section(head: Header, settings: type):
    """The ``evaluation`` section as ``settings`` (a dataclass; its defaults where it is absent)."""
    return settings(
        **common.section(
            head.top.get("evaluation"),
            "evaluation",
            settings,
            common.field_names(settings),
            head.fail,
        )
    )


def acted_sources(head: Header, **acts_on_checks) -> ActedSources:
    """What the protocol acts on; ``acts_on_checks`` go to ``acts_on_section``.

    An ``acts_on`` protocol is read from the folder of the header's ``source`` file and must
    have the pinned hash.
    """
    if "acts_on" in head.top:
        acts_on, acted = acts_on_section(
            head.top["acts_on"], head.source, head.fail, **acts_on_checks
        )
        return ActedSources(acts_on, None, acted)
    return ActedSources(None, pretrained_section(head.top["pretrained"], head.fail), None)


def acting_fields(
    kind: str, head: Header, sources: ActedSources, evaluation, **sections
) -> dict[str, Any]:
    """The ``ActingProtocol`` fields of a parsed protocol, its canonical content and hash among
    them: its header, what it acts on and its ``evaluation``, then the kind's own ``sections``
    (every kind hashes the same keys for these, so none of them moves a hash)."""
    name, text, (acts_on, pretrained, acted) = head.name, head.text, sources
    canonical, digest = common.canonical_and_hash(
        {
            "schema": SCHEMA_VERSION,
            "kind": kind,
            "name": name,
            "description": text,
            "acts_on": asdict(acts_on) if acts_on else None,
            "pretrained": asdict(pretrained) if pretrained else None,
            "evaluation": asdict(evaluation),
            **sections,
        }
    )
    return dict(
        name=name,
        description=text,
        acts_on=acts_on,
        pretrained=pretrained,
        hash=digest,
        canonical=canonical,
        source_file=head.source,
        source=acted,
    )


@dataclass(frozen=True)
class InterventionProtocol(ActingProtocol):
    grid: Grid
    evaluation: InterventionEvaluation
    patching: PatchingSpec | None = None  # absent from the canonical form (and hash) when None

    kind = "intervention"

    @property
    def dataset(self) -> _Named:
        return _Named(
            self.pretrained.dataset if self.pretrained is not None else self.source.dataset.name
        )


def parse_intervention_protocol(data: Any, source: str = "<protocol>") -> InterventionProtocol:
    """Validate parsed YAML into an ``InterventionProtocol``; ``source`` starts every error message
    (the grid is checked against every acted-on arm's model as the file is read)."""
    head = parse_header(data, source, InterventionProtocolError, TOP_KEYS, REQUIRED_TOP)
    grid = _grid(head.top["interventions"], head.fail)
    evaluation = evaluation_section(head, InterventionEvaluation)
    _check_evaluation(evaluation, grid, head.fail)
    patching, implicit = (
        _patching(head.top["patching"], head.fail) if "patching" in head.top else (None, False)
    )
    sources = acted_sources(head)
    for arm in sources.acts_on.arms if sources.acts_on else ():
        cfg = arm_model_config(sources.acted, arm)
        _check_grid(grid, cfg, f"arm {arm}", head.fail)
        _check_patches(patching, cfg, f"arm {arm}", head.fail)

    def fields_with(patching: PatchingSpec | None) -> dict[str, Any]:
        return acting_fields(
            "intervention",
            head,
            sources,
            evaluation,
            interventions=asdict(grid),
            # only when given: every protocol without it keeps its hash
            **({"patching": patching.canonical()} if patching is not None else {}),
        )

    fields = fields_with(patching)
    if implicit and fields["hash"] not in UNIFORM_PAIRS_PROTOCOLS:
        # ``sample`` left out of a protocol not frozen before it existed: the stratified sample
        patching = replace(patching, sample="stratified")
        fields = fields_with(patching)
    return InterventionProtocol(grid, evaluation, patching, **fields)


def _patching(value: Any, fail) -> tuple[PatchingSpec, bool]:
    """The checked section, and whether ``sample`` was left out (then ``uniform`` for now:
    ``parse_intervention_protocol`` decides by the hash)."""
    raw = common.section(value, "patching", PatchingSpec, common.field_names(PatchingSpec), fail)
    implicit = "sample" not in raw
    spec = PatchingSpec(**{"sample": "uniform", **raw})
    if spec.corruption not in CORRUPTIONS:
        raise fail(
            f"patching.corruption={spec.corruption!r}: must be one of {', '.join(CORRUPTIONS)}"
        )
    if spec.pairs < 1:
        raise fail(f"patching.pairs={spec.pairs!r}: must be a positive integer")
    if spec.ig_steps < 1:
        raise fail(f"patching.ig_steps={spec.ig_steps!r}: must be a positive integer")
    if spec.replaced_patches < 0 or (spec.corruption == "patches") != (spec.replaced_patches > 0):
        raise fail(
            f"patching.replaced_patches={spec.replaced_patches!r}: give a positive count with "
            "corruption: patches, and none with corruption: class"
        )
    if spec.positions and spec.attribution_patching:
        raise fail(
            "patching.positions with patching.attribution_patching: AtP's cost is compared with "
            "the exact grid's time, which the per-position patches would inflate; run them as two "
            "protocols"
        )
    return spec, implicit


# --- sections ------------------------------------------------------------------------------


def _strings(
    value: Any, where: str, fail, allowed: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise fail(f"{where}={value!r}: must be a list of strings")
    bad = [v for v in value if allowed is not None and v not in allowed]
    if bad:
        raise fail(f"{where}={bad[0]!r}: must be one of {', '.join(allowed)}")
    if len(set(value)) != len(value):
        raise fail(f"{where}={list(value)!r}: lists an entry twice")
    return tuple(value)


def _head_of(text: str) -> HeadAblation:
    return parse(f"{text}.zero")


def _branch_of(text: str) -> tuple[int, str]:
    item = parse(f"{text}.skip")
    return item.block, item.branch


def _selection(value: Any, where: str, fail, one) -> str | tuple[str, ...]:
    """``all``, ``none`` or a list of names, each read by ``one`` (which raises on a bad name)."""
    if value in ("all", "none"):
        return value
    items = _strings(value, where, fail)
    for i, text in enumerate(items):
        try:
            one(text)
        except InterventionError:
            raise fail(
                f"{where}[{i}]={text!r}: expected all, none or names like "
                f"{'blocks.1.attn.head2' if 'head' in where else 'blocks.0.attn or blocks.0.mlp'}"
            ) from None
    return items


def _grid(value: Any, fail) -> Grid:
    raw = common.mapping(value, "interventions", common.field_names(Grid), fail)
    modes = _strings(
        raw.get("head_modes", list(Grid.head_modes)), "interventions.head_modes", fail, HEAD_MODES
    )
    sets = raw.get("sets", [])
    if not isinstance(sets, list):
        raise fail(f"interventions.sets={sets!r}: must be a list of {{name, items}}")
    parsed_sets = []
    for i, s in enumerate(sets):
        where = f"interventions.sets[{i}]"
        entry = common.mapping(s, where, ("name", "items"), fail)
        common.required(entry, ("name", "items"), where, fail)
        items = _strings(entry["items"], f"{where}.items", fail)
        for j, item in enumerate(items):
            try:
                parse(item)
            except InterventionError as err:
                raise fail(f"{where}.items[{j}]: {err}") from None
        parsed_sets.append(
            {"name": common.identifier(entry["name"], f"{where}.name", fail), "items": list(items)}
        )
    common.unique_names([s["name"] for s in parsed_sets], "set", fail)
    position = raw.get("position_embedding", True)
    if not isinstance(position, bool):
        raise fail(f"interventions.position_embedding={position!r}: must be true or false")
    grid = Grid(
        heads=_selection(raw.get("heads", "all"), "interventions.heads", fail, _head_of),
        head_modes=modes,
        branches=_selection(raw.get("branches", "all"), "interventions.branches", fail, _branch_of),
        position_embedding=position,
        tokens=_strings(raw.get("tokens", []), "interventions.tokens", fail, TOKEN_KINDS),
        patches=_strings(raw.get("patches", []), "interventions.patches", fail),
        sets=tuple(parsed_sets),
    )
    if grid.heads != "none" and not grid.head_modes:
        raise fail("interventions.head_modes=[]: give zero and/or mean, or heads: none")
    return grid


def uses_mean(grid: Grid) -> bool:
    """Whether the grid ablates a head by its mean (then ``evaluation.mean_images`` are drawn)."""
    return (grid.heads != "none" and "mean" in grid.head_modes) or any(
        i.endswith(".mean") for s in grid.sets for i in s["items"]
    )


def _check_patches(patching: PatchingSpec | None, cfg: ViTConfig, what: str, fail) -> None:
    """A ``patches`` corruption replaces at most the model's patches (checked against every acted-on
    arm at load, against a pretrained model once it is built)."""
    if patching is not None and patching.replaced_patches > cfg.num_patches:
        raise fail(
            f"patching.replaced_patches={patching.replaced_patches}: the model of {what} has only "
            f"{cfg.num_patches} patches"
        )


def _check_evaluation(e: InterventionEvaluation, grid: Grid, fail) -> None:
    if e.split not in SPLITS:
        raise fail(f"evaluation.split={e.split!r}: must be one of {', '.join(SPLITS)}")
    if e.batch_size < 1:
        raise fail(f"evaluation.batch_size={e.batch_size!r}: must be a positive integer")
    if e.mean_images < (1 if uses_mean(grid) else 0):
        raise fail(
            f"evaluation.mean_images={e.mean_images!r}: mean ablation needs at least one reference image"
        )
    if not 0.0 < e.confidence < 1.0:
        raise fail(f"evaluation.confidence={e.confidence!r}: must be in (0, 1)")


def acts_on_section(
    value: Any, source: str, fail, acts: str = "interventions act on ViT stages", refuse=None
) -> tuple[ActsOn, Any]:
    """The ``acts_on`` section: the ablation protocol beside ``source``, pinned by hash, and its ViT arms.

    Shared by every kind that acts on trained cells (interventions, attribution); ``acts`` says
    in the refusal of a non-ViT arm why it must be one. ``refuse(cfg)``, when given, says why a
    ViT arm's config cannot be acted on by this kind (None: it can): such an arm is refused
    as a non-ViT one is, and left out of the default arms.
    """
    raw = common.section(value, "acts_on", ActsOn, common.field_names(ActsOn), fail)
    common.required(raw, ("protocol", "hash"), "acts_on", fail)
    name = common.identifier(raw["protocol"], "acts_on.protocol", fail)
    path = Path(source).parent / f"{name}.yaml"
    if not path.is_file():
        raise fail(f"acts_on.protocol={name!r}: no protocol file {path}")
    acted = load_file(path, DEFAULT_KIND)  # cells are trained by the default kind
    if raw["hash"] != acted.hash:
        raise fail(
            f"acts_on.hash={raw['hash']!r}: {path} has hash {acted.hash}; the cells acted on are pinned "
            "by the full hash of their protocol"
        )
    refusals = {a.name: not_vit_arm(acted, a.name) for a in acted.arms}
    unfit = {
        arm: refuse(arm_model_config(acted, arm)) if refuse and why is None else None
        for arm, why in refusals.items()
    }
    vit_arms = tuple(arm for arm, why in refusals.items() if why is None and unfit[arm] is None)
    arms = _strings(list(raw.get("arms") or vit_arms), "acts_on.arms", fail)
    for arm in arms:
        if arm not in refusals:
            raise fail(
                f"acts_on.arms: {arm!r} is not an arm of {name}; its arms: {', '.join(a.name for a in acted.arms)}"
            )
        if refusals[arm] is not None:
            raise fail(
                f"acts_on.arms: {arm!r} is not a ViT arm ({acts}): {refusals[arm]}; "
                f"ViT arms of {name}: {', '.join(vit_arms) or 'none'}"
            )
        if unfit[arm] is not None:
            raise fail(
                f"acts_on.arms: {arm!r}: {unfit[arm]}; arms of {name} it can act on: "
                f"{', '.join(vit_arms) or 'none'}"
            )
    if not arms:
        raise fail(f"acts_on: {name} has no ViT arm to act on")
    return ActsOn(name, raw["hash"], arms), acted


def _arm_config(acted, arm: str):
    """The arm's model config as the ablation protocol gives it (a study model's, or a timm arm's kwargs)."""
    model = next(a.config for a in acted.arms if a.name == arm).model
    return model_config(model.name, **model.overrides)


def not_vit_arm(acted, arm: str) -> str | None:
    """Why an arm of the acted-on protocol cannot be acted on (its model is no glass-box ViT); None if it can."""
    cfg = _arm_config(acted, arm)
    if isinstance(cfg, TimmModelConfig):
        try:
            glassbox_config(cfg)
        except NotGlassBoxViT as err:
            return str(err)
        return None
    return (
        None
        if isinstance(cfg, ViTConfig)
        else "its model is a CNN: no attention heads or tokens to act on"
    )


def arm_model_config(acted, arm: str) -> ViTConfig:
    """An acted-on arm's glass-box config: a study ViT's, or a timm ViT arm's through the exact mapping.

    Raises:
        NotGlassBoxViT: a timm arm that does not read across (``acts_on_section`` refuses it first).
    """
    cfg = _arm_config(acted, arm)
    return glassbox_config(cfg) if isinstance(cfg, TimmModelConfig) else cfg


def _check_grid(grid: Grid, cfg: ViTConfig, what: str, fail) -> None:
    """Every intervention of the grid must fit the model (an unknown head or stage fails now, not mid-study)."""
    for item in grid.expand(cfg):
        try:
            check(cfg, [item])
        except InterventionError as err:
            raise fail(f"interventions ({what}): {err}") from None


def pretrained_section(value: Any, fail) -> Pretrained:
    raw = common.section(value, "pretrained", Pretrained, common.field_names(Pretrained), fail)
    common.required(raw, ("model",), "pretrained", fail)
    spec = Pretrained(**raw)
    if spec.dataset not in DATASET_NAMES:
        raise fail(
            f"pretrained.dataset={spec.dataset!r}: must be one of {', '.join(DATASET_NAMES)}"
        )
    for key in ("val_size", "subset"):
        if getattr(spec, key) is not None and getattr(spec, key) < 1:
            raise fail(
                f"pretrained.{key}={getattr(spec, key)!r}: must be a positive integer or null"
            )
    index = spec.class_index or {}
    bad = [k for k, v in index.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise fail(
            f"pretrained.class_index.{bad[0]}={index[bad[0]]!r}: must be a model output index (integer >= 0)"
        )
    return spec


def check_against_model(
    protocol: InterventionProtocol, cfg: ViTConfig, what: str
) -> list[Intervention]:
    """The grid expanded for a model known only at run time (a pretrained source); one-line errors."""

    def fail(msg: str) -> InterventionProtocolError:
        return InterventionProtocolError(f"{protocol.source_file}: {msg}")

    _check_grid(protocol.grid, cfg, what, fail)
    _check_patches(protocol.patching, cfg, what, fail)
    return protocol.grid.expand(cfg)


def check_against_data(
    protocol: InterventionProtocol, labels: Any, train_images: int, data_name: str
) -> None:
    """The protocol's counts against the data, known once it is loaded (before any run opens):
    the patching pairs and their two classes among the evaluated images (``labels``), the mean
    ablation's reference images among the ``train_images``; one-line errors naming file and key."""

    def fail(msg: str) -> InterventionProtocolError:
        return InterventionProtocolError(f"{protocol.source_file}: {msg}")

    split, patching, e = protocol.evaluation.split, protocol.patching, protocol.evaluation
    if patching is not None and patching.pairs > len(labels):
        raise fail(
            f"patching.pairs={patching.pairs}: the {split} split of {data_name} has only "
            f"{len(labels)} images"
        )
    if patching is not None and len(set(labels.tolist())) < 2:
        raise fail(
            f"patching: the {split} split of {data_name} has images of one class only; a pair "
            "needs a corrupting image of another class"
        )
    if uses_mean(protocol.grid) and e.mean_images > train_images:
        raise fail(
            f"evaluation.mean_images={e.mean_images}: the training split of {data_name} has only "
            f"{train_images} images"
        )
