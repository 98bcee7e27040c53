"""Attribution protocols: score attribution maps against exact causal effects on trained cells.

An attribution protocol trains nothing. It names what it acts on, the finished ViT cells of an
ablation protocol (pinned by file and hash; the arms; every seed) or one pretrained timm ViT with
a labelled dataset (the same two sections as an intervention protocol), which attribution
methods to score, and on which images. Schema::

    name: smoke_faithfulness                 # [a-z0-9_-], equal to the file stem
    description: What the study asks.
    acts_on: {protocol: smoke, hash: 7aa839f2..., arms: [vit]}   # studies/protocols/smoke.yaml
    # or: pretrained: {model: ..., weights: hub, dataset: image_folder, ...}  (as for interventions)
    attribution:
      methods: [cls_attention, rollout, chefer, grad_x_input, random]
      split: val               # val | test
      images: 200              # the first N images of the split, the same for every cell
      batch_size: 64
      norm_threshold: 10.0     # a token is high-norm above k x its block's median patch-token norm
      random_seed: 0           # seed of the random baseline's order
      examples: 4              # images shown with every method's map beside the causal-effect map
      random_draws: 10         # optional: random orders per image, each seeded per cell and image
      sanity_check: true       # optional: the model-randomisation check of every map
    evaluation: {confidence: 0.95, seed: 0}

Methods beside the five default ones: ``intensity`` and ``centre`` (trivial baselines) and
``oracle`` (the exact single-token effects as scores, a reference row). ``random_draws`` and
``sanity_check`` left out (or at their defaults, 0 and false) are not part of the hash, so a
protocol written before they existed keeps its hash and its old behaviour (one shared random
draw, no check).

Cells are the acted-on protocol's arms x seeds (seed-major), one for a pretrained model, as for
interventions. Keys, types, errors and the hash follow ``workbench.protocol.common``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from workbench.models.vit import ViTConfig
from workbench.protocol import common
from workbench.protocol.common import ProtocolError
from workbench.protocol.intervention import (
    ActingProtocol,
    InterventionCell,
    acted_sources,
    acting_fields,
    evaluation_section,
    parse_header,
)

TOP_KEYS = ("name", "description", "acts_on", "pretrained", "attribution", "evaluation")
REQUIRED_TOP = ("name", "description", "attribution")
SPLITS = ("val", "test")
# The methods' names, in report order; their definitions are in workbench.attribution.methods
# (the controls: workbench.attribution.controls). A protocol without ``methods`` scores the
# first five, as before the controls existed.
DEFAULT_METHODS = ("cls_attention", "rollout", "chefer", "grad_x_input", "random")
METHODS = (*DEFAULT_METHODS, "intensity", "centre", "oracle")
# Optional settings: at this value they are left out of the canonical content (and the hash).
OPTIONAL_DEFAULTS = {"random_draws": 0, "sanity_check": False}
MIN_DRAWS = 2  # a spread needs two draws; the controls protocols use 10


class AttributionProtocolError(ProtocolError):
    """An attribution protocol is invalid; the message names the file, the dotted key and the value."""


@dataclass(frozen=True)
class AttributionSettings:
    """What is scored, on which images.

    Attributes:
        methods: Attribution methods to score, of ``cls_attention``, ``rollout``, ``chefer``,
            ``grad_x_input``, ``random`` (docs/attribution.md defines each); ``random`` is the
            baseline the report shows beside the others; the controls ``intensity``,
            ``centre`` and ``oracle`` are reference rows.
        split: ``val`` (default) or ``test``.
        images: How many images of the split (the first ones, the same for every cell).
        batch_size: Images per forward pass (the causal effects run one pass per patch token).
        norm_threshold: k: a patch token is high-norm when its L2 norm exceeds k x the median
            patch-token norm of its block.
        random_seed: Seed of the random baseline's order.
        examples: Images drawn in the report with every method's map and the causal-effect map.
        random_draws: Random orders per image (0: the one shared draw of ``random`` alone);
            each is seeded from (``random_seed``, cell seed, image index, draw), and every
            comparison with random in the report is made against their spread.
        sanity_check: Recompute every map (but ``random``) as the blocks are randomised from
            the top down and flag a map that does not change (Adebayo et al. 2018).
    """

    methods: tuple[str, ...] = DEFAULT_METHODS
    split: Literal["val", "test"] = "val"
    images: int = 200
    batch_size: int = 64
    norm_threshold: float = 10.0
    random_seed: int = 0
    examples: int = 4
    random_draws: int = 0
    sanity_check: bool = False


@dataclass(frozen=True)
class AttributionEvaluation:
    """The report's interval settings: t-interval over seeds and the hierarchical bootstrap.

    Attributes:
        confidence: Confidence level of the report's intervals (t and bootstrap); the number of
            resamples is the report's ``--resamples``, as for every protocol kind.
        seed: Seed of the report's bootstrap.
    """

    confidence: float = 0.95
    seed: int = 0


AttributionCell = InterventionCell  # one acted-on model: an arm at a seed, as for interventions


@dataclass(frozen=True)
class AttributionProtocol(ActingProtocol):
    settings: AttributionSettings
    evaluation: AttributionEvaluation

    kind = "attribution"


def parse_attribution_protocol(data: Any, source: str = "<protocol>") -> AttributionProtocol:
    """Validate parsed YAML into an ``AttributionProtocol``; ``source`` starts every error message."""
    head = parse_header(data, source, AttributionProtocolError, TOP_KEYS, REQUIRED_TOP)
    settings = _settings(head.top["attribution"], head.fail)
    evaluation = evaluation_section(head, AttributionEvaluation)
    if not 0.0 < evaluation.confidence < 1.0:
        raise head.fail(f"evaluation.confidence={evaluation.confidence!r}: must be in (0, 1)")
    sources = acted_sources(
        head,
        acts="attribution maps are read off ViT attention and tokens",
        refuse=_not_cls_pooled,
    )
    fields = acting_fields(
        "attribution", head, sources, evaluation, attribution=canonical_settings(settings)
    )
    return AttributionProtocol(settings, evaluation, **fields)


def _not_cls_pooled(cfg: ViTConfig) -> str | None:
    """Why attribution cannot act on a ViT arm (the check ``workbench.attribution`` makes on the
    model itself, here at load so no run opens for it); None when it can."""
    if cfg.pooling != "cls":
        return (
            f"pooling={cfg.pooling!r}: the attribution methods read the class token's row, which "
            "only a CLS-pooling head reads (a mean or attention-pool head has no such row)"
        )
    if not cfg.num_classes:
        return (
            "num_classes=0: the model has no classifier, so there is no true-class logit to explain"
        )
    return None


def canonical_settings(settings: AttributionSettings) -> dict[str, Any]:
    """The hashed form of the settings: optional fields at their default are left out."""
    return {
        k: v
        for k, v in asdict(settings).items()
        if k not in OPTIONAL_DEFAULTS or v != OPTIONAL_DEFAULTS[k]
    }


def _settings(value: Any, fail) -> AttributionSettings:
    raw = common.section(
        value, "attribution", AttributionSettings, common.field_names(AttributionSettings), fail
    )
    methods = raw.get("methods", list(DEFAULT_METHODS))
    if (
        not isinstance(methods, (list, tuple))
        or not methods
        or not all(isinstance(m, str) for m in methods)
    ):
        raise fail(
            f"attribution.methods={list(methods) if isinstance(methods, tuple) else methods!r}: must be a non-empty list of {', '.join(METHODS)}"
        )
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise fail(f"attribution.methods: {bad[0]!r} is not a method; valid: {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise fail(f"attribution.methods={list(methods)!r}: lists a method twice")
    settings = AttributionSettings(**{**raw, "methods": tuple(m for m in METHODS if m in methods)})
    if settings.split not in SPLITS:
        raise fail(f"attribution.split={settings.split!r}: must be one of {', '.join(SPLITS)}")
    for key in ("images", "batch_size"):
        if getattr(settings, key) < 1:
            raise fail(f"attribution.{key}={getattr(settings, key)!r}: must be a positive integer")
    if not settings.norm_threshold > 1.0:
        raise fail(
            f"attribution.norm_threshold={settings.norm_threshold!r}: must be above 1 (a multiple of the median)"
        )
    if settings.random_draws != 0 and settings.random_draws < MIN_DRAWS:
        raise fail(
            f"attribution.random_draws={settings.random_draws!r}: must be 0 (one shared draw) "
            f"or at least {MIN_DRAWS} (a spread needs two draws; 10 is the house's choice)"
        )
    if settings.random_draws and "random" not in settings.methods:
        raise fail(
            "attribution.random_draws: the draws are the random baseline's; add random to "
            "attribution.methods"
        )
    if not 0 <= settings.examples <= settings.images:
        raise fail(
            f"attribution.examples={settings.examples!r}: must be between 0 and attribution.images "
            f"({settings.images})"
        )
    return settings
