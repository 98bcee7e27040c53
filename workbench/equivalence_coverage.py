"""Coverage: every architecture of timm's ViT modules either matches at 0.0 or is refused by name.

Each architecture is first built on the meta device at full size (no memory, no init) and
its options derived by ``config_from_timm``; a refusal is recorded with its reason. An
accepted one is rebuilt at a reduced width, depth and image size with the same options,
and the reduced model must derive the same config apart from sizes (``option_signature``)
before its stages and gradients are compared. That keeps the whole sweep to minutes on a
CPU while proving the same op sequence as the full model; the full-size check stays
available per model (``workbench equivalence --model NAME``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pandas as pd
import torch

from workbench.convert.timm_vit import UnsupportedTimmModel, WeightMappingError, config_from_timm
from workbench.equivalence import randomize_every_tensor, run_equivalence
from workbench.models.registry import TIMM_VIT_MODULES
from workbench.models.vit_config import ViTConfig

# Fields that say how big a model is, not which operations it runs.
SIZE_FIELDS = (
    "image_size",
    "dim",
    "depth",
    "heads",
    "mlp_ratio",
    "mlp_hidden",
    "pool_mlp_hidden",
    "num_classes",
)
REDUCED_DEPTH = 2
REDUCED_HEADS = 2
# the first whose MLP width keeps every option (a packed GLU needs it even)
REDUCED_WIDTHS = (
    64,
    96,
    128,
)
REDUCED_GRID = 4  # patches per side
REDUCED_CLASSES = 10


def option_signature(cfg: ViTConfig) -> dict:
    """The config without its sizes; ``num_classes`` only as "has a classifier"."""
    options = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in SIZE_FIELDS}
    options["classifier"] = cfg.num_classes > 0
    return options


def family_options(cfg: ViTConfig) -> str:
    """The options that differ from a plain ViT, e.g. "norm_pre, act=quick_gelu, patch_bias=False"."""
    plain = option_signature(ViTConfig())
    parts = []
    for key, value in option_signature(cfg).items():
        if key in ("patch_size", "in_channels") or value == plain[key]:
            continue
        parts.append(key if value is True else f"{key}={value}")
    return ", ".join(parts) or "plain"


@dataclass
class CoverageRow:
    architecture: str
    module: str
    verdict: str  # "match", "differs", "refused", "error"
    family_options: str = ""
    max_stage_diff: float = float("nan")
    max_gradient_diff: float = float("nan")
    stages: int = 0
    gradients: int = 0
    reduced: bool = True
    reason: str = ""


def _create(name: str, **kwargs) -> torch.nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


def config_from_name(name: str, **kwargs) -> ViTConfig:
    """The glass-box config of timm architecture ``name``, read off a model built on the
    meta device: no memory, no init, well under a second even for a hybrid or ViT-g.

    Raises:
        UnsupportedTimmModel: naming every option the glass-box ViT does not implement.
    """
    with torch.device("meta"):
        return config_from_timm(_create(name, **kwargs))


def reduced_model(name: str, full: ViTConfig, seed: int = 0) -> torch.nn.Module:
    """``name`` rebuilt small with every option of ``full`` (checked, not assumed).

    Raises:
        ValueError: when no reduced size keeps the options (names the fields that changed).
    """
    want = option_signature(full)
    grid = tuple(REDUCED_GRID * p for p in (full.patch_hw))
    changed: list[str] = []
    for width in REDUCED_WIDTHS:
        kwargs = dict(
            embed_dim=width,
            depth=REDUCED_DEPTH,
            num_heads=REDUCED_HEADS,
            img_size=grid,
            num_classes=REDUCED_CLASSES if full.num_classes else 0,
        )
        torch.manual_seed(seed)
        try:
            model = _create(name, **kwargs).eval()
        except AssertionError:  # timm's own size checks (e.g. an odd packed-GLU width): next width
            changed = [f"no valid width among {REDUCED_WIDTHS}"]
            continue
        got = option_signature(config_from_timm(model))
        changed = sorted(k for k in want if k not in ("image_size",) and got[k] != want[k])
        if not changed:
            return model
    raise ValueError(f"a reduced {name} loses options: {', '.join(changed)}")


def check_architecture(
    name: str,
    module: str = "",
    batch: int = 2,
    seed: int = 0,
    tolerance: float = 0.0,
    reduced: bool = True,
    input_kind: str = "gaussian",
    device: str = "cpu",
    randomize: bool = True,
) -> CoverageRow:
    """Match or refusal of one architecture; never raises for a model it cannot handle.

    ``randomize`` (the default) gives every tensor its own random values first
    (``randomize_every_tensor``); False keeps timm's init, whose constant norms, biases
    and gammas cannot tell swapped tensors apart.
    """
    row = CoverageRow(name, module, "error", reduced=reduced)
    try:
        full = config_from_name(name)
        row.family_options = family_options(full)
        if reduced:
            model = reduced_model(name, full, seed)
        else:
            torch.manual_seed(seed)
            model = _create(name).eval()
        if randomize:
            randomize_every_tensor(model, seed)
        report = run_equivalence(
            model,
            name,
            batch=batch,
            seed=seed,
            tolerance=tolerance,
            input_kind=input_kind,
            device=device,
        )
    except UnsupportedTimmModel as err:
        row.verdict, row.reason = "refused", str(err).removeprefix("unsupported timm ViT options: ")
        return row
    except (
        WeightMappingError,
        ValueError,
        RuntimeError,
        AssertionError,
        TypeError,
        AttributeError,
    ) as err:
        row.reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        return row
    row.verdict = "match" if report.passed else "differs"
    row.max_stage_diff = report.max_abs_diff
    row.max_gradient_diff = (
        float(report.gradients["max_abs_diff"].max()) if len(report.gradients) else float("nan")
    )
    row.stages, row.gradients = len(report.stages), len(report.gradients)
    return row


def coverage_architectures(modules: tuple[str, ...] = TIMM_VIT_MODULES) -> list[tuple[str, str]]:
    """(architecture, module) for every architecture of the given timm modules."""
    import timm

    return [
        (name, module) for module in modules for name in sorted(timm.list_models(module=module))
    ]


def coverage_table(rows: list[CoverageRow]) -> pd.DataFrame:
    return pd.DataFrame([vars(r) for r in rows])


def coverage_summary(table: pd.DataFrame) -> dict[str, int]:
    """Counts per module and verdict, e.g. {"vision_transformer.match": 148, ...}."""
    counts = table.groupby(["module", "verdict"]).size()
    summary = {f"{module}.{verdict}": int(n) for (module, verdict), n in counts.items()}
    summary.update(
        {f"total.{verdict}": int(n) for verdict, n in table.verdict.value_counts().items()}
    )
    summary["total"] = len(table)
    return summary
