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
      images: 200              # how many images of the split, the same for every cell
      sample: stratified       # stratified (default) | first: which images (workbench.sample)
      sample_seed: 0           # seed of the stratified sample
      # indices: [3, 17, ...]  # or: these positions of the split (then images and sample follow)
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

Which images: a seeded class-stratified sample of ``images`` (``workbench.sample``), unless the
protocol names ``indices`` (positions in the split) or says ``sample: first`` (the first
``images`` of the split, in the split's order). A protocol frozen before ``sample`` existed
scored the first images, and its hash has no ``sample`` in it; such a protocol (its hash is in
``FIRST_N_PROTOCOLS``) keeps its hash and its meaning with the key left out. Any other protocol
that leaves ``sample`` out gets the stratified sample, and ``sample: stratified`` is part of its
hash, so a hash means one sample rule only: ``sample: first`` is left out of the canonical
content (as in the old files), ``sample: stratified`` never is.

Cells are the acted-on protocol's arms x seeds (seed-major), one for a pretrained model, as for
interventions. Keys, types, errors and the hash follow ``workbench.protocol.common``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from workbench.models.vit import ViTConfig
from workbench.protocol import common
from workbench.protocol.common import ProtocolError
from workbench.protocol.intervention import (
    ActingProtocol,
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
# The attribution protocols frozen (and published) before ``sample`` existed: they scored the first
# ``images`` images of the split, and a file that leaves ``sample`` out keeps that meaning and its
# hash only if its hash is one of these (protocol hash -> name, for the reader).
FIRST_N_PROTOCOLS = {
    "1d328be6c95a5a4ed876b8b4f1eb6ebc0cb474f9d3e7c15257a6694a5428f73e": "smoke_faithfulness",
    "b6fc5222981d88a6d2b9a91e1b1a5d49c3ebe9f48ab874c96e965ef97e3a019f": "smoke_faithfulness_controls",
    "4a2a91bf9a58ec659371cf6fa242245f8977b30e41adaa8381434b6ad8a018dc": "fmnist_seed_recipe_faithfulness",
    "a7bbe9742053ecbd14be4016541e8c37aede5d22a4440a0dfdbaa9fdb8dc398b": "fmnist_seed_recipe_faithfulness_controls",
    "9f45c526b16548fd32ee2b9f5470369d77627c5b4cebbb5e5d24e857a436272f": "cifar10_registers_fp32_faithfulness",
    "228f8251ae37462c648f6dc65f7bde064b662e2cf70dd7095b23c183e3a8d38b": "cifar10_registers_faithfulness",
    "9e2ed197c3d57e8e20769c4597594d0246965f130dd91a75b3986d6bed409925": "smoke_timm_faithfulness",
}
SAMPLES = ("stratified", "first", "indices")
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
        images: How many images of the split (the same for every cell).
        sample: Which images: ``stratified`` (a seeded class-stratified sample: equal counts
            per class where ``images`` allows, ``workbench.sample``), ``first`` (the first
            ``images`` of the split in its order; what protocols frozen before this key meant) or
            ``indices`` (the positions ``indices`` names; set by giving them).
        sample_seed: Seed of the stratified sample.
        indices: Positions in the split to score, in this order; ``images`` is their count.
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
    sample: Literal["stratified", "first", "indices"] = "stratified"
    sample_seed: int = 0
    indices: tuple[int, ...] | None = None


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


@dataclass(frozen=True)
class AttributionProtocol(ActingProtocol):
    settings: AttributionSettings
    evaluation: AttributionEvaluation

    kind = "attribution"


def parse_attribution_protocol(data: Any, source: str = "<protocol>") -> AttributionProtocol:
    """Validate parsed YAML into an ``AttributionProtocol``; ``source`` starts every error message."""
    head = parse_header(data, source, AttributionProtocolError, TOP_KEYS, REQUIRED_TOP)
    settings, implicit = _settings(head.top["attribution"], head.fail)
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
    if implicit and fields["hash"] not in FIRST_N_PROTOCOLS:
        # ``sample`` left out of a protocol not frozen before it existed: the stratified sample
        settings = replace(settings, sample="stratified")
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
    """The hashed form of the settings: optional fields at their default are left out, and the
    sample's keys as the module docstring says (``first`` as the files frozen before it, without
    ``sample``; a seed only for a stratified sample; positions only when named)."""
    leave_out = {"sample_seed", "indices"} - {
        {"stratified": "sample_seed", "indices": "indices"}.get(settings.sample, "")
    }
    if settings.sample == "first":
        leave_out.add("sample")
    return {
        k: v
        for k, v in asdict(settings).items()
        if (k not in OPTIONAL_DEFAULTS or v != OPTIONAL_DEFAULTS[k]) and k not in leave_out
    }


def _sample(raw: dict, fail) -> tuple[dict, bool]:
    """``raw`` with its sample keys made consistent, and whether ``sample`` was left out (then
    ``first`` for now: ``parse_attribution_protocol`` decides by the hash)."""
    indices = raw.get("indices")
    if indices is not None:
        if raw.get("sample", "indices") != "indices" or "sample_seed" in raw:
            raise fail(
                "attribution.indices: names the images itself; leave out attribution.sample and "
                "attribution.sample_seed"
            )
        if not indices or any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise fail(
                f"attribution.indices={list(indices)!r}: must be a non-empty list of distinct "
                "positions >= 0 in the split"
            )
        if raw.get("images", len(indices)) != len(indices):
            raise fail(
                f"attribution.images={raw['images']!r}: attribution.indices names {len(indices)} "
                "images; leave images out or make it their count"
            )
        return {**raw, "sample": "indices", "images": len(indices)}, False
    if raw.get("sample") == "indices":
        raise fail("attribution.sample='indices': give the positions as attribution.indices")
    if "sample_seed" in raw and raw.get("sample", "stratified") != "stratified":
        raise fail(
            f"attribution.sample_seed: seeds a stratified sample; attribution.sample={raw['sample']!r} "
            "draws nothing"
        )
    if "sample" not in raw:
        return {**raw, "sample": "stratified" if "sample_seed" in raw else "first"}, (
            "sample_seed" not in raw
        )
    return raw, False


def _settings(value: Any, fail) -> tuple[AttributionSettings, bool]:
    """The checked settings, and whether ``sample`` was left out (``_sample``)."""
    raw = common.section(
        value, "attribution", AttributionSettings, common.field_names(AttributionSettings), fail
    )
    raw, implicit = _sample(raw, fail)
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
    return settings, implicit
