"""The source of a transfer study: a glass-box ViT with its weights, normalisation and provenance.

Sources are timm ViTs (pinned hub checkpoint, seeded random init, or a local file; named
bare or as an arm names them, ``timm/<architecture>``), mapped onto the glass-box model
through the strict mapping of ``workbench.convert.timm_vit``, or checkpoints written by this
workbench's training loop: a glass-box arm's loaded directly, a timm ViT arm's mapped. MLflow URIs
(``runs:/...``) are resolved to local files by the tracking layer before they get here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from workbench.convert.checkpoints import CheckpointError, sha256_file
from workbench.convert.timm_weights import load_timm_weights
from workbench.convert.timm_vit import glassbox_from_timm
from workbench.data import NORM_STATS, NormStats, PreparedSplit, derive_seed
from workbench.models.cnn import CNNConfig
from workbench.models.registry import build_model, model_config, timm_vit_architectures
from workbench.models.timm_arm import (
    TIMM_PREFIX,
    TimmModelConfig,
    TimmModelError,
    checked,
    is_timm_name,
)
from workbench.models.vit import ViTConfig, VisionTransformer
from workbench.train.checkpoint import FORMAT as TRAIN_FORMAT
from workbench.train.checkpoint import load_checkpoint

# ITU-R BT.601 luma: how an RGB target is shown to a source trained on grey images.
LUMA = (0.299, 0.587, 0.114)


class SourceError(ValueError):
    """A source checkpoint cannot be used; the message names the file or URI and what is wrong."""


@dataclass(frozen=True)
class SourceInfo:
    """Provenance of the source, for logs and the report.

    Attributes:
        kind: ``timm-hub``, ``timm-random``, ``timm-local`` or ``workbench-checkpoint``.
        uri: As given (``hub``, ``random``, a path, ``runs:/...``, ``protocol:...``).
        path: The local file read ("" for a random init).
        run_id: The MLflow run the file came from ("" when none).
        sha256: Of the file read ("" for a random init).
        pretrained: True only for a published pretrained checkpoint (``timm-hub``, a pinned
            hub revision); a local file or a workbench-trained checkpoint is not called
            pretrained, whatever its weights: ``provenance`` says what it is.
        description: One line saying what the weights are.
        architecture: timm architecture (with tag) or workbench model name.
        norm_from: Where the input mean/std come from.
        mapping: The strict mapping's audit summary for timm sources ("" otherwise).
    """

    kind: str
    uri: str
    path: str
    run_id: str
    sha256: str
    pretrained: bool
    description: str
    architecture: str
    norm_from: str
    mapping: str = ""

    def provenance(self) -> str:
        """What the weights are, in words a report can print as they are."""
        return {
            "timm-hub": "a published pretrained checkpoint (pinned timm hub revision)",
            "timm-random": "a seeded random init, NOT PRETRAINED",
            "timm-local": "a local weights file, not a published checkpoint (what it holds is what its sha256 names)",
            "workbench-checkpoint": (
                "a checkpoint trained with this workbench"
                + (f" (run {self.run_id})" if self.run_id else "")
                + ", not a published one"
            ),
        }.get(self.kind, f"{self.kind} weights")

    def label(self) -> str:
        return self.description if self.pretrained else f"{self.description} ({self.provenance()})"

    def as_params(self) -> dict[str, str]:
        """Flat ``source.*`` strings (MLflow keeps params to 6,000 characters; these are short)."""
        return {f"source.{k}": str(v) for k, v in asdict(self).items()} | {
            "source.label": self.label(),
            "source.provenance": self.provenance(),
        }


@dataclass
class SourceModel:
    """The source (head still on, CPU, eval mode), its input normalisation and provenance.

    ``model`` is a glass-box ViT (the ViT path of every regime), or any other model the
    workbench builds (a timm model, the study CNN), which ``workbench.transfer.any_model``
    adapts through timm's generic interfaces.
    """

    model: nn.Module
    norm: NormStats
    info: SourceInfo

    @property
    def cfg(self) -> ViTConfig | CNNConfig | TimmModelConfig:
        return self.model.cfg

    @property
    def is_vit(self) -> bool:
        """Whether the source is the glass-box ViT (its own regime paths) rather than any other model."""
        return isinstance(self.model, VisionTransformer)

    @property
    def in_channels(self) -> int:
        return self.cfg.in_channels

    @property
    def image_size(self) -> int | None:
        """The input side the model needs (images are resized to it), or None: it takes the data's size."""
        if self.is_vit:
            return self.cfg.image_size
        fixed = self.cfg.fixed_image_hw if isinstance(self.cfg, TimmModelConfig) else None
        return None if fixed is None else int(fixed[0])


def parse_weights(weights: str) -> tuple[str, str]:
    """``(scheme, rest)``: scheme is hub, random, run (``runs:/``), protocol (``protocol:``) or path."""
    if weights in ("hub", "random"):
        return weights, ""
    if weights.startswith("runs:/"):
        return "run", weights[len("runs:/") :].strip("/")
    if weights.startswith("protocol:"):
        return "protocol", weights[len("protocol:") :]
    if "://" in weights or weights.startswith("models:/"):
        raise SourceError(
            f"source weights {weights!r}: only runs:/<id>[/path] and protocol:<name>/<arm>/seed<k> URIs are supported"
        )
    return "path", weights


def parse_protocol_cell(rest: str) -> tuple[str, str, int]:
    """``name/arm/seed3`` -> ``(name, arm, 3)``."""
    parts = rest.split("/")
    if len(parts) != 3 or not parts[2].startswith("seed") or not parts[2][4:].isdigit():
        raise SourceError(f"protocol:{rest}: expected protocol:<protocol name>/<arm>/seed<k>")
    return parts[0], parts[1], int(parts[2][4:])


def timm_norm(name: str, model: nn.Module) -> tuple[NormStats, str]:
    """Mean/std from timm's pretrained config of ``name`` (with its tag) or of the model's default tag."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name) if "." in name else None
    if cfg is not None:
        return NormStats(tuple(cfg.mean), tuple(cfg.std)), f"timm pretrained_cfg of {name}"
    pc = getattr(model, "pretrained_cfg", None) or {}
    if "mean" not in pc:
        raise SourceError(f"timm model {name} has no pretrained_cfg mean/std")
    tag = f"{pc.get('architecture', name)}.{pc.get('tag', '')}".rstrip(".")
    return NormStats(tuple(pc["mean"]), tuple(pc["std"])), f"timm pretrained_cfg of {tag}"


def load_timm_source(
    name: str, weights: str, seed: int = 0, uri: str | None = None, run_id: str = ""
) -> SourceModel:
    """A timm ViT (``hub``, ``random`` or a local file) mapped strictly onto the glass-box model.

    Args:
        name: timm architecture or pinned checkpoint name.
        weights: ``hub``, ``random`` or a path to a safetensors / weights-only file.
        seed: Seed of a random init.
        uri: What the user gave (default ``weights``), for the provenance.
        run_id: MLflow run the file was downloaded from, if any.
    """
    # an arm's timm/<architecture> spelling
    name = name[len(TIMM_PREFIX) :] if is_timm_name(name) else name
    if not is_vit_name(name):
        return load_timm_any(name, weights, seed, uri, run_id)
    try:
        tw = load_timm_weights(name, weights, seed)
    except (CheckpointError, KeyError) as err:
        raise SourceError(f"source {name} with weights {uri or weights}: {err}") from err
    glass, audit = glassbox_from_timm(tw.model)
    # a pinned name carries its tag, e.g. .augreg_in21k_ft_in1k
    norm, norm_from = timm_norm(name, tw.model)
    kind = {"random": "timm-random", "hub": "timm-hub"}.get(tw.source, "timm-local")
    path = (
        ""
        if kind == "timm-random"
        else str(Path(weights).resolve())
        if kind == "timm-local"
        else tw.description
    )
    info = SourceInfo(
        kind=kind,
        uri=uri or weights,
        path=path,
        run_id=run_id,
        sha256=tw.sha256 or "",
        pretrained=kind == "timm-hub",
        description=f"timm {name}: {tw.description}",
        architecture=name,
        norm_from=norm_from,
        mapping=audit.summary(),
    )
    return SourceModel(glass.eval(), norm, info)


def is_vit_name(name: str) -> bool:
    """Whether ``name`` is a pinned checkpoint or a timm ViT architecture (the glass-box mapping), not any model."""
    from workbench.convert.checkpoints import read_lock

    return name in read_lock() or name in timm_vit_architectures()


def load_timm_any(
    name: str, weights: str, seed: int = 0, uri: str | None = None, run_id: str = ""
) -> SourceModel:
    """Any other timm architecture by name (a ResNet, a ConvNeXt, ...), kept as timm builds it.

    ``random``: ``timm.create_model(name, pretrained=False)`` under ``torch.manual_seed(seed)``;
    a path: that model filled strictly from the file. ``hub`` is refused: only the pinned ViT
    checkpoints of ``timm_pins.lock`` can be fetched and verified.
    """
    from workbench.convert.checkpoints import load_state_dict_file

    try:
        cfg = checked(name, {})
    except TimmModelError as err:
        raise SourceError(f"source.model={name!r}: {err}") from err
    if weights == "hub":
        raise SourceError(
            f"source.weights='hub' with source.model={name!r}: only the pinned ViT checkpoints can be "
            "fetched and verified; give random, a local file, runs:/... or protocol:..."
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg).eval()
    norm, norm_from = timm_norm(name, model)
    if weights == "random":
        info = SourceInfo(
            kind="timm-random",
            uri=uri or weights,
            path="",
            run_id=run_id,
            sha256="",
            pretrained=False,
            description=f"timm {name}: seeded random init (seed {seed})",
            architecture=name,
            norm_from=norm_from,
        )
        return SourceModel(model, norm, info)
    try:
        state, sha = load_state_dict_file(weights)
        model.load_state_dict(state, strict=True)
    except (CheckpointError, RuntimeError) as err:
        raise SourceError(
            f"source {name} with weights {uri or weights}: {str(err).splitlines()[0]}"
        ) from err
    info = SourceInfo(
        kind="timm-local",
        uri=uri or weights,
        path=str(Path(weights).resolve()),
        run_id=run_id,
        sha256=sha,
        pretrained=False,
        description=f"timm {name}: local file {weights}",
        architecture=name,
        norm_from=norm_from,
    )
    return SourceModel(model, norm, info)


def find_run_config(checkpoint: Path) -> Path | None:
    """The training run's ``config.json``: beside the checkpoint or one folder up (MLflow's layout)."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def load_workbench_checkpoint(
    path: str | Path, uri: str | None = None, run_id: str = "", trained_on: str | None = None
) -> SourceModel:
    """A checkpoint of this workbench's training loop, loaded directly (no mapping needed).

    The architecture and the normalisation come from the run's ``config.json``
    (``model.name`` + overrides, and the statistics of ``data.name`` the run normalised with).

    Args:
        path: The checkpoint (``checkpoints/best.pt`` of a training run).
        uri: What the user gave, for the provenance (default the path).
        run_id: The MLflow run it came from.
        trained_on: The dataset's display name as the run logged it (e.g. "CIFAR-10 (JPEG
            copy)"); default the registry name from config.json.
    """
    path = Path(path)
    state = load_checkpoint(path)
    config_path = find_run_config(path)
    if config_path is None:
        raise SourceError(
            f"{path}: no config.json beside it or one folder up; use runs:/<run id> "
            "so the run's config is downloaded with the checkpoint"
        )
    config = json.loads(config_path.read_text())
    name, overrides = config["model"]["name"], config["model"].get("overrides", {})
    cfg = model_config(name, **overrides)
    data_name = config["data"]["name"]
    if data_name not in NORM_STATS:
        raise SourceError(
            f"{path}: the source run normalised {data_name!r} with statistics computed at run "
            "time, which this workbench does not record; use a source trained on a registered dataset"
        )
    mapping = ""
    if isinstance(cfg, TimmModelConfig) and _is_glassbox_vit(
        cfg
    ):  # read across to the glass box, exactly
        model, mapping = _glassbox_of_timm_arm(cfg, state["model"], path)
    elif isinstance(cfg, ViTConfig):
        model = VisionTransformer(cfg)
        model.load_state_dict(state["model"], strict=True)
    else:  # a timm model that is not such a ViT, or the study CNN: kept as trained (workbench.transfer.any_model)
        with torch.random.fork_rng(devices=[]):
            model = build_model(cfg)
        model.load_state_dict(state["model"], strict=True)
    epoch = state.get("epoch", "?")
    val = state.get("metrics", {}).get("val_accuracy")
    trained = f"trained by this workbench on {trained_on or data_name}, best epoch {epoch}"
    trained += f", val accuracy {val:.4f}" if val is not None else ""
    info = SourceInfo(
        kind="workbench-checkpoint",
        uri=uri or str(path),
        path=str(path.resolve()),
        run_id=run_id,
        sha256=sha256_file(path),
        pretrained=False,
        description=f"workbench {name} {overrides}: {trained}",
        architecture=name,
        norm_from=f"the source run's normalisation (NORM_STATS[{data_name!r}])",
        mapping=mapping,
    )
    return SourceModel(model.eval(), NORM_STATS[data_name], info)


def _is_glassbox_vit(cfg: TimmModelConfig) -> bool:
    """Whether a timm arm is a ViT the glass box holds (the exact mapping), asked of its meta-device build."""
    from workbench.interventions.read_across import NotGlassBoxViT, glassbox_config

    try:
        glassbox_config(cfg)
    except NotGlassBoxViT:
        return False
    return True


def _glassbox_of_timm_arm(
    cfg: TimmModelConfig, state: dict, path: Path
) -> tuple[VisionTransformer, str]:
    """A trained timm arm's weights in the glass-box ViT (the strict mapping), or a SourceError naming why not.

    The same read-across as ``intervene`` and ``attribute`` (``trained_glassbox``: the timm model
    built on the meta device, so no init and no draw from the RNG, filled strictly, mapped with
    every tensor used once).
    """
    from workbench.interventions.read_across import NotGlassBoxViT, trained_glassbox

    try:
        glass, audit = trained_glassbox(cfg, state)
    except NotGlassBoxViT as err:
        raise SourceError(f"{path}: {err}") from err
    return glass, audit.summary()


def load_local_source(
    path: str | Path,
    model: str | None = None,
    uri: str | None = None,
    run_id: str = "",
    trained_on: str | None = None,
) -> SourceModel:
    """A local file: a workbench training checkpoint, or timm weights (``model`` names the architecture)."""
    path = Path(path)
    if not path.exists():
        raise SourceError(f"source weights not found: {path}")
    if path.is_file() and path.suffix in (".pt", ".pth"):
        try:
            is_workbench = (
                torch.load(path, map_location="cpu", weights_only=True).get("format")
                == TRAIN_FORMAT
            )
        except Exception:  # not a training checkpoint: try it as timm weights below
            is_workbench = False
        if is_workbench:
            return load_workbench_checkpoint(path, uri, run_id, trained_on)
    if not model:
        raise SourceError(
            f"{path}: timm weights need source.model (the timm architecture or pinned name)"
        )
    return load_timm_source(model, str(path), uri=uri, run_id=run_id)


def transfer_model(source: SourceModel, num_classes: int, seed: int) -> VisionTransformer:
    """A copy of the source with a new ``num_classes`` head, initialised from ``seed`` alone.

    The head init depends on the seed only, so every regime of a seed starts from the same
    head (the pairing). trunc-normal(0.02) weights and zero bias, as the model's own init.
    """
    cfg = replace(source.cfg, num_classes=num_classes)
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    state = {
        k: v.detach().clone()
        for k, v in source.model.state_dict().items()
        if not k.startswith("head.")
    }
    state |= new_head(num_classes, cfg.dim, seed)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def new_head(num_classes: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    """The seed's new head (``head.weight``, ``head.bias``): trunc-normal(0.02) from ``derive_seed(seed, "transfer-head")``."""
    weight, bias = torch.empty(num_classes, dim), torch.zeros(num_classes)
    generator = torch.Generator().manual_seed(derive_seed(seed, "transfer-head"))
    nn.init.trunc_normal_(weight, std=0.02, generator=generator)
    return {"head.weight": weight, "head.bias": bias}


SCRATCH_INIT = "the model's own init (trunc-normal 0.02 linears and positions, zero biases)"


def scratch_model(source: SourceModel, num_classes: int, seed: int) -> VisionTransformer:
    """The source's architecture from a seeded random init, with the seed's new head: a from-scratch baseline.

    The body is ``VisionTransformer``'s own init drawn from ``torch.manual_seed(derive_seed(seed,
    "init"))``, the seed an ablation arm's init uses (``workbench.train.loop.Trainer``), inside a
    forked RNG so nothing else moves; no tensor of the source's weights is read. The head is
    ``transfer_model``'s for the seed, so every regime of a seed starts from the same head.
    """
    cfg = replace(source.cfg, num_classes=num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        model = VisionTransformer(cfg)
    with torch.no_grad():
        for name, value in new_head(num_classes, cfg.dim, seed).items():
            model.get_parameter(name).copy_(value)
    return model


def adapt_split(split: PreparedSplit, in_channels: int) -> PreparedSplit:
    """Match the source's channels: RGB -> grey by luma, grey -> RGB by repetition (uint8 kept)."""
    c = split.images.shape[1]
    if c == in_channels:
        return split
    if c == 3 and in_channels == 1:
        weights = torch.tensor(LUMA).view(1, 3, 1, 1)
        # (N, 1, H, W)
        grey = (
            (split.images.float() * weights)
            .sum(1, keepdim=True)
            .round_()
            .clamp_(0, 255)
            .to(torch.uint8)
        )
        return replace(split, images=grey)
    if c == 1 and in_channels == 3:
        # (N, 3, H, W)
        return replace(split, images=split.images.expand(-1, 3, -1, -1).contiguous())
    raise SourceError(f"the source takes {in_channels} channels; the data has {c}")
