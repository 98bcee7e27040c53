"""Interventions as small frozen values, named in the analysis mode's stage vocabulary.

Each intervention has one stable ``name`` (used as MLflow metric key, report row and
protocol entry) and ``parse`` reads that name back:

===============================  ===========================================================
``blocks.1.attn.head2.zero``     head 2 of block 1 zero-ablated (its output before ``out_proj``)
``blocks.1.attn.head2.mean``     the same head replaced by its mean over a reference set
``blocks.1.attn.skip``           block 1's attention branch skipped (``resid1 = x``)
``blocks.1.mlp.skip``            block 1's MLP branch skipped (``resid2 = resid1``)
``pos_embed.zero``               the position embedding set to zero
``tokens.registers.drop``        the register tokens removed from the sequence after ``pos_add``
``tokens.class.drop``            the class token removed (mean or attention pooling only)
``blocks.1.resid2.patch``        the stage's activation replaced by one given per example
===============================  ===========================================================

An ``InterventionSet`` applies several at once under its own name (``set.<name>``).
``check`` validates interventions against a model config: an unknown stage, block or head
is one ``InterventionError`` line listing the valid ones; a combination that cannot be
done exactly is refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Union

from workbench.models.vit import ViTConfig, stage_names_of

HEAD_MODES = ("zero", "mean")
BRANCHES = ("attn", "mlp")
TOKEN_KINDS = ("registers", "class")
# Stages computed inline in a module without a module boundary around them: replacing them
# would need a change to the model itself, which the default path must not see.
UNPATCHABLE = {
    "attn_pool.probs": "AttentionPool computes its map inline (no module boundary to replace it at)"
}


class InterventionError(ValueError):
    """An intervention does not fit the model, or cannot be done exactly; one line, naming the valid values."""


@dataclass(frozen=True)
class HeadAblation:
    """One head's output (its slice of the input of ``attn.out_proj``) zeroed or set to its reference mean."""

    block: int
    head: int
    mode: Literal["zero", "mean"] = "zero"

    def __post_init__(self) -> None:
        _index("block", self.block)
        _index("head", self.head)
        if self.mode not in HEAD_MODES:
            raise InterventionError(
                f"head ablation mode {self.mode!r}: must be one of {', '.join(HEAD_MODES)}"
            )

    @property
    def name(self) -> str:
        return f"blocks.{self.block}.attn.head{self.head}.{self.mode}"


@dataclass(frozen=True)
class SkipBranch:
    """A block's attention or MLP branch left out: the residual stream passes unchanged."""

    block: int
    branch: Literal["attn", "mlp"]

    def __post_init__(self) -> None:
        _index("block", self.block)
        if self.branch not in BRANCHES:
            raise InterventionError(f"branch {self.branch!r}: must be one of {', '.join(BRANCHES)}")

    @property
    def name(self) -> str:
        return f"blocks.{self.block}.{self.branch}.skip"


@dataclass(frozen=True)
class ZeroPosEmbed:
    """The learned position embedding replaced by zeros (every token keeps its content only)."""

    @property
    def name(self) -> str:
        return "pos_embed.zero"


@dataclass(frozen=True)
class DropTokens:
    """Register tokens (or the class token) removed from the sequence right after ``pos_add``.

    The remaining tokens keep their positions; pooling reads the shortened sequence with the
    shortened prefix count.
    """

    tokens: Literal["registers", "class"]

    def __post_init__(self) -> None:
        if self.tokens not in TOKEN_KINDS:
            raise InterventionError(
                f"tokens {self.tokens!r}: must be one of {', '.join(TOKEN_KINDS)}"
            )

    @property
    def name(self) -> str:
        return f"tokens.{self.tokens}.drop"


@dataclass(frozen=True)
class PatchStage:
    """A stage's activation replaced by a stored one, per example (activation patching).

    The values are given at run time (``forward.run(..., patches={stage: tensor})``), one row
    per example of the batch, in the stage's own shape.
    """

    stage: str

    @property
    def name(self) -> str:
        return f"{self.stage}.patch"


Single = Union[HeadAblation, SkipBranch, ZeroPosEmbed, DropTokens, PatchStage]


@dataclass(frozen=True)
class InterventionSet:
    """Several interventions applied together under one name (``set.<name>``)."""

    label: str
    items: tuple[Single, ...]

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", str(self.label)):
            raise InterventionError(
                f"set name {self.label!r}: use lowercase letters, digits, '_' and '-'"
            )
        if not self.items:
            raise InterventionError(f"set {self.label!r}: empty; give at least one intervention")

    @property
    def name(self) -> str:
        return f"set.{self.label}"


Intervention = Union[Single, InterventionSet]


def _index(what: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InterventionError(f"{what} {value!r}: must be an integer >= 0")


def flatten(interventions: tuple[Intervention, ...] | list[Intervention]) -> tuple[Single, ...]:
    """The single interventions of ``interventions``, sets expanded, in order."""
    out: list[Single] = []
    for item in interventions:
        out.extend(item.items if isinstance(item, InterventionSet) else (item,))
    return tuple(out)


# ------------------------------------------------------------------------------ names

_PATTERNS: list[tuple[re.Pattern, object]] = [
    (
        re.compile(r"blocks\.(\d+)\.attn\.head(\d+)\.(zero|mean)"),
        lambda m: HeadAblation(int(m[1]), int(m[2]), m[3]),
    ),
    (re.compile(r"blocks\.(\d+)\.(attn|mlp)\.skip"), lambda m: SkipBranch(int(m[1]), m[2])),
    (re.compile(r"pos_embed\.zero"), lambda m: ZeroPosEmbed()),
    (re.compile(r"tokens\.(registers|class)\.drop"), lambda m: DropTokens(m[1])),
    (re.compile(r"(.+)\.patch"), lambda m: PatchStage(m[1])),
]
NAME_FORMS = (
    "blocks.<i>.attn.head<h>.zero|mean",
    "blocks.<i>.attn|mlp.skip",
    "pos_embed.zero",
    "tokens.registers|class.drop",
    "<stage>.patch",
)


def parse(text: str) -> Single:
    """The intervention a name stands for (the inverse of ``.name``)."""
    for pattern, make in _PATTERNS:
        match = pattern.fullmatch(str(text))
        if match:
            return make(match)
    raise InterventionError(
        f"intervention {text!r}: not a known form; use one of {', '.join(NAME_FORMS)}"
    )


# ------------------------------------------------------------------------------ checks


def patchable_stages(cfg: ViTConfig) -> list[str]:
    """Every stage of the analysis vocabulary whose activation can be replaced exactly."""
    with_meta = _stage_names(cfg)
    return [s for s in with_meta if s not in UNPATCHABLE]


def _stage_names(cfg: ViTConfig) -> list[str]:
    return stage_names_of(cfg)  # the model's hook points, built on the meta device (no weights)


def compact_stage_list(stages: list[str]) -> str:
    """``patch_embed, pos_add, blocks.{0-11}.{norm1, attn.qkv, ...}, norm, head``: one readable line."""
    in_block = [s.startswith("blocks.") for s in stages]
    if not any(in_block):
        return ", ".join(stages)
    first, last = in_block.index(True), len(in_block) - in_block[::-1].index(True)
    blocks = sorted({int(s.split(".")[1]) for s in stages[first:last]})
    per_block = [
        s.split(".", 2)[2] for s in stages[first:last] if s.startswith(f"blocks.{blocks[0]}.")
    ]
    middle = f"blocks.{{{blocks[0]}-{blocks[-1]}}}.{{{', '.join(per_block)}}}"
    return ", ".join(stages[:first] + [middle] + stages[last:])


def check(
    cfg: ViTConfig, interventions: tuple[Intervention, ...] | list[Intervention]
) -> tuple[Single, ...]:
    """Validate ``interventions`` (applied together) against a model; returns them flattened.

    Raises:
        InterventionError: An unknown block, head or stage (the valid ones listed), an
            option the model does not have, a duplicate, or a combination that cannot be
            done exactly.
    """
    singles = flatten(interventions)
    names = [s.name for s in singles]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InterventionError(f"{', '.join(dupes)}: given more than once in one intervention")
    stages = _stage_names(cfg)
    for s in singles:
        _check_one(cfg, s, stages)
    patched = [s.stage for s in singles if isinstance(s, PatchStage)]
    dropped = [s for s in singles if isinstance(s, DropTokens)]
    if dropped and patched:
        raise InterventionError(
            f"{dropped[0].name} with {patched[0]}.patch: dropping tokens changes the shape of every "
            "later stage, so a stored activation of the intact sequence does not fit"
        )
    if dropped and any(isinstance(s, HeadAblation) and s.mode == "mean" for s in singles):
        raise InterventionError(
            f"{dropped[0].name} with a mean ablation: the reference mean is per token position of "
            "the intact sequence, which dropping tokens shifts"
        )
    skipped = {f"blocks.{s.block}.{s.branch}" for s in singles if isinstance(s, SkipBranch)}
    for stage in patched:
        inside = _branch_of(stage)
        if inside in skipped:
            raise InterventionError(
                f"{stage}.patch with {inside}.skip: the skipped branch never computes that stage"
            )
    return singles


def _branch_of(stage: str) -> str | None:
    """``blocks.i.attn`` or ``blocks.i.mlp`` when ``stage`` is computed inside that branch."""
    parts = stage.split(".")
    if len(parts) < 3 or parts[0] != "blocks":
        return None
    inner = ".".join(parts[2:])
    if inner in ("norm1", "ls1") or inner.startswith("attn"):
        return f"blocks.{parts[1]}.attn"
    if inner in ("norm2", "ls2") or inner.startswith("mlp"):
        return f"blocks.{parts[1]}.mlp"
    return None


def _check_one(cfg: ViTConfig, s: Single, stages: list[str]) -> None:
    if isinstance(s, (HeadAblation, SkipBranch)) and s.block >= cfg.depth:
        raise InterventionError(
            f"{s.name}: block {s.block} does not exist; valid blocks: 0-{cfg.depth - 1}"
        )
    if isinstance(s, HeadAblation) and s.head >= cfg.heads:
        raise InterventionError(
            f"{s.name}: head {s.head} does not exist; valid heads: 0-{cfg.heads - 1} "
            f"({cfg.heads} per block)"
        )
    if isinstance(s, ZeroPosEmbed) and cfg.pos_embed != "learned":
        raise InterventionError(
            f"{s.name}: the model has no position embedding (pos_embed={cfg.pos_embed!r})"
        )
    if isinstance(s, DropTokens):
        if s.tokens == "registers" and not cfg.register_tokens:
            raise InterventionError(f"{s.name}: the model has no register tokens")
        if s.tokens == "class" and not cfg.class_token:
            raise InterventionError(f"{s.name}: the model has no class token")
        if s.tokens == "class" and cfg.pooling == "cls":
            raise InterventionError(
                f"{s.name}: the model pools with the class token (pooling='cls'), "
                "so its output cannot be read without it"
            )
    if isinstance(s, PatchStage):
        if s.stage in UNPATCHABLE and s.stage in stages:
            raise InterventionError(f"{s.name}: {UNPATCHABLE[s.stage]}")
        if s.stage not in stages:
            valid = compact_stage_list([x for x in stages if x not in UNPATCHABLE])
            raise InterventionError(f"{s.name}: unknown stage {s.stage!r}; valid stages: {valid}")
