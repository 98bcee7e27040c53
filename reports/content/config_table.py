"""The configuration table, rendered from the hashed protocol itself, not from its description.

Input is the protocol's canonical dict (``Protocol.canonical`` / ``TransferProtocol.canonical``,
or ``protocol/canonical.json`` from a parent run): plain JSON, so this works whichever module
owns the schema. An ablation protocol gives one row per arm with the base and the arm's
overrides merged exactly as the loader merges them; a transfer protocol (``kind: transfer``)
one row per regime. ``description_conflicts`` flags numbers of epochs or seeds in the free
text that the hashed content contradicts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workbench.kinds import DEFAULT_KIND, kind_of
from workbench.bench.cost import model_cost, vit_regime_cost

# side in pixels, before resize_to
NATIVE_IMAGE_SIZE = {
    "fashion_mnist": 28,
    "cifar10": 32,
    "retinamnist": 28,
}
ARM_COLUMNS = (
    "arm",
    "model",
    "parameters",
    "FLOPs / image",
    "optimiser",
    "schedule",
    "epochs",
    "batch size",
    "precision",
    "early stopping",
)
REGIME_COLUMNS = (
    "regime",
    "trains",
    "trained parameters",
    "optimiser",
    "schedule",
    "epochs",
    "early stopping",
)
NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve".split()
    )
}


@dataclass(frozen=True)
class ConfigTable:
    """Settings shared by every arm, then one row per arm (column -> text)."""

    kind: str  # "ablation" or "transfer"
    common: list[tuple[str, str]]
    columns: tuple[str, ...]
    rows: list[dict[str, str]]
    notes: list[str] = field(default_factory=list)


def count_text(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def flops_text(n: int | None) -> str:
    """FLOPs with an SI prefix and 3 significant digits: 11.9 MFLOPs, 35.1 GFLOPs."""
    if n is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}FLOPs"
    return f"{n} FLOPs"


def _g(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _optimiser(o: Mapping[str, Any]) -> str:
    parts = [f"AdamW lr {_g(o['lr'])}", f"weight decay {_g(o['weight_decay'])}"]
    if "betas" in o and list(o["betas"]) != [0.9, 0.999]:
        parts.append(f"betas {tuple(o['betas'])}")
    if o.get("label_smoothing"):
        parts.append(f"label smoothing {_g(o['label_smoothing'])}")
    if o.get("grad_clip") is not None:
        parts.append(f"gradient clipping {_g(o['grad_clip'])}")
    return ", ".join(parts)


def _schedule(o: Mapping[str, Any]) -> str:
    warm = o.get("warmup_epochs") or 0
    end = o.get("min_lr_ratio") or 0
    text = f"{_g(float(warm))} warmup epochs, then cosine" if warm else "cosine"
    return text + (f" to {_g(end)} x lr" if end else " to 0")


def _early_stopping(patience: Any, monitor: str) -> str:
    return (
        "none (fixed budget)"
        if patience is None
        else f"after {patience} epochs without better {monitor}"
    )


def _augmentation(d: Mapping[str, Any]) -> str:
    parts = []
    if d.get("crop_padding"):
        parts.append(f"random crop, {d['crop_padding']} px padding")
    if d.get("hflip"):
        parts.append("horizontal flip")
    if d.get("rotate_degrees"):
        parts.append(f"rotation up to {_g(d['rotate_degrees'])} degrees")
    if d.get("translate_fraction"):
        parts.append(f"translation up to {_g(d['translate_fraction'])} of the side")
    return ", ".join(parts) or "none"


def _split(d: Mapping[str, Any]) -> str:
    sizes = [
        f"{k.split('_')[0]} {count_text(d[k]) if d.get(k) is not None else 'default'}"
        for k in ("train_size", "val_size")
    ]
    extra = f", at most {d['subset']:,} per split (subset)" if d.get("subset") else ""
    return f"{', '.join(sizes)}; split seed {d.get('split_seed')}{extra}"


def arm_config(canonical: Mapping[str, Any], arm: Mapping[str, Any]) -> dict[str, Any]:
    """One arm's merged sections (model as {name, overrides}), as ``studies.runtime.study_protocol`` merges them.

    An arm's model override with another ``name`` starts from that registry model; without
    one (or the same name) its fields are merged over the base model's.
    """
    over = arm.get("overrides") or {}
    base_model = canonical["model"]
    model = {"name": base_model["name"], "overrides": dict(base_model.get("overrides") or {})}
    if over.get("model"):
        fields = {k: v for k, v in over["model"].items() if k != "name"}
        name = over["model"].get("name", base_model["name"])
        model = {
            "name": name,
            "overrides": (model["overrides"] | fields) if name == base_model["name"] else fields,
        }
    # ``recipe`` is in the canonical form only where a part is on (absent: every part off).
    recipe = dict(canonical.get("recipe") or {}) | dict(over.get("recipe") or {})
    return {
        "model": model,
        "recipe": recipe,
        **{s: dict(canonical[s]) | dict(over.get(s) or {}) for s in ("dataset", "optim", "run")},
    }


def recipe_text(recipe: Mapping[str, Any]) -> str:
    """An arm's timm recipe parts in words (``recipe`` of the canonical form: only fields that are on)."""
    parts = []
    mix, cut = recipe.get("mixup_alpha") or 0, recipe.get("cutmix_alpha") or 0
    if mix or cut:
        kinds = " + ".join(
            k for k, on in ((f"mixup alpha {_g(mix)}", mix), (f"CutMix alpha {_g(cut)}", cut)) if on
        )
        details = [f"mode {recipe.get('mixup_mode', 'batch')}"]
        if recipe.get("mixup_prob", 1.0) != 1.0:
            details.append(f"prob {_g(recipe['mixup_prob'])}")
        if mix and cut:
            details.append(f"CutMix share {_g(recipe.get('mixup_switch_prob', 0.5))}")
        parts.append(f"{kinds} ({', '.join(details)}; soft-target loss)")
    if recipe.get("randaugment_ops"):
        parts.append(
            f"RandAugment {recipe['randaugment_ops']} ops, magnitude {recipe.get('randaugment_magnitude', 9)}"
        )
    if recipe.get("ema_decay") is not None:
        parts.append(
            f"weight EMA decay {_g(recipe['ema_decay'])}"
            + (" with warmup" if recipe.get("ema_warmup") else "")
            + " (the EMA model is evaluated and reported)"
        )
    return "; ".join(parts) or "none"


def _model_text(model: Mapping[str, Any]) -> str:
    fields = ", ".join(f"{k} {_g(v)}" for k, v in sorted(model["overrides"].items()))
    return f"{model['name']} ({fields})" if fields else model["name"]


def _ablation_table(c: Mapping[str, Any]) -> ConfigTable:
    d, seeds = c["dataset"], c["seeds"]
    common = [
        ("protocol", f"{c['name']} (schema {c.get('schema', '?')})"),
        ("dataset", d["name"]),
        ("split", _split(d)),
        ("augmentation (training only)", _augmentation(d)),
        ("input resize", f"{d['resize_to']} px" if d.get("resize_to") else "none"),
        ("seeds", f"{', '.join(map(str, seeds))} ({len(seeds)} paired seeds)"),
        ("test split", "evaluated once per cell" if c["run"].get("evaluate_test") else "not used"),
    ]
    rows, notes = [], []
    image_size = d.get("resize_to") or NATIVE_IMAGE_SIZE.get(d["name"])
    # A recipe column only where some arm uses a recipe part: a protocol without one renders as before.
    with_recipe = any(arm_config(c, arm)["recipe"] for arm in c["arms"])
    for arm in c["arms"]:
        cfg = arm_config(c, arm)
        r = cfg["run"]
        try:
            cost = model_cost(cfg["model"]["name"], cfg["model"]["overrides"], image_size)
            params, flops = count_text(cost.parameters), flops_text(cost.forward_flops)
        except (
            ValueError,
            TypeError,
            KeyError,
        ) as err:  # an old hash naming a model this code no longer has
            params = flops = "n/a"
            notes.append(f"arm {arm['name']}: no parameter or FLOP count ({err})")
        rows.append(
            {
                "arm": arm["name"] + (" (reference)" if arm.get("reference") else ""),
                "model": _model_text(cfg["model"]),
                "parameters": params,
                "FLOPs / image": flops,
                "optimiser": _optimiser(cfg["optim"]),
                "schedule": _schedule(cfg["optim"]),
                "epochs": str(r["epochs"]),
                "batch size": f"{r['batch_size']} (eval {r.get('eval_batch_size', '?')})",
                "precision": _precision(r.get("amp", "off")),
                "early stopping": _early_stopping(
                    r.get("patience"), r.get("monitor", "val_accuracy")
                ),
                "recipe": recipe_text(cfg["recipe"]),
            }
        )
    columns = ARM_COLUMNS + ("recipe",) if with_recipe else ARM_COLUMNS
    return ConfigTable("ablation", common, columns, rows, notes + description_conflicts(c))


def _precision(amp: str) -> str:
    """The protocol's ``amp`` in words: where it applies (workbench.precision)."""
    if amp == "off":
        return "fp32"
    return (
        "bf16 autocast (GPU, or CPU with AVX512-BF16/AMX)"
        if amp == "bf16"
        else f"{amp} autocast on GPU"
    )


# A scratch regime reads none of the source's weights: the table says so where the regime is described.
SCRATCH_TRAINS = "every parameter, trained from scratch (the source's architecture, seeded random init; NOT PRETRAINED)"


def _transfer_table(c: Mapping[str, Any], source_cfg: Any = None) -> ConfigTable:
    d, s, run, ev, seeds = c["dataset"], c["source"], c["run"], c["evaluation"], c["seeds"]
    sizes = (
        "official split" if d.get("train_size") is None and d.get("val_size") is None else _split(d)
    )
    common = [
        ("protocol", f"{c['name']} (transfer, schema {c.get('schema', '?')})"),
        (
            "source",
            f"{s.get('model') or 'from checkpoint'}, weights {s['weights']}"
            + (f" (seed {s['seed']})" if s["weights"] == "random" else "")
            + (f", pinned sha256 {s['sha256']}" if s.get("sha256") else ""),
        ),
        ("dataset", f"{d['name']}, image size {d['size']}"),
        (
            "split",
            f"{sizes}; split seed {d['split_seed']}"
            + (f", subset {d['subset']}" if d.get("subset") else ""),
        ),
        ("augmentation (training only)", "none"),
        ("batch size", f"{run['batch_size']} (eval {run['eval_batch_size']})"),
        ("precision", _precision(run["amp"])),
        (
            "intervals",
            f"{ev['confidence']:.0%} bootstrap, {ev['n_resamples']:,} resamples, seed {ev['seed']}",
        ),
        ("seeds", f"{', '.join(map(str, seeds))} ({len(seeds)} paired seeds)"),
    ]
    rows = []
    for r in c["regimes"]:
        trains = {"linear": "head only", "full": "every parameter", "scratch": SCRATCH_TRAINS}.get(
            r["kind"], f"last {r.get('blocks')} blocks, norm, head"
        )
        if r.get("layer_decay") is not None:
            trains += f"; layer-wise lr decay {_g(r['layer_decay'])}"
        trained = "n/a"
        if source_cfg is not None:
            cost = vit_regime_cost(source_cfg, r["kind"], r.get("blocks"))
            trained = f"{count_text(cost.trainable_parameters)} of {count_text(cost.parameters)}"
        optim = r.get("optim", r)  # canonical form nests the optimiser; tolerate a flat regime too
        rows.append(
            {
                "regime": r["name"] + (" (reference)" if r.get("reference") else ""),
                "trains": trains,
                "trained parameters": trained,
                "optimiser": _optimiser(optim),
                "schedule": _schedule(optim),
                "epochs": str(r["epochs"]),
                "early stopping": _early_stopping(r.get("patience"), "validation QWK"),
            }
        )
    return ConfigTable("transfer", common, REGIME_COLUMNS, rows, description_conflicts(c))


def config_table(canonical: Mapping[str, Any], source_cfg: Any = None) -> ConfigTable:
    """The configuration table of a protocol from its canonical (hashed) dict.

    Args:
        canonical: ``Protocol.canonical`` or ``TransferProtocol.canonical`` (or the JSON logged
            as ``protocol/canonical.json``).
        source_cfg: Transfer only: the source's ``ViTConfig`` (with the target's classes), for
            the trained-parameter counts; without it they are "n/a".
    """
    try:
        if kind_of(canonical) == DEFAULT_KIND:  # arms; the other kind with a table has regimes
            return _ablation_table(canonical)
        return _transfer_table(canonical, source_cfg)
    except KeyError as err:
        raise ValueError(
            f"protocol {canonical.get('name', '?')!r}: canonical form lacks key {err}"
        ) from err


def _number(word: str) -> int | None:
    return int(word) if word.isdigit() else NUMBER_WORDS.get(word.lower())


def description_conflicts(canonical: Mapping[str, Any]) -> list[str]:
    """Numbers of epochs or seeds in the description that the hashed protocol contradicts.

    "N seeds" must equal the number of seeds; "N epochs" must equal some epoch count of the
    protocol (any arm's or regime's epochs, patience or warmup). The adjective "N-epoch" is
    checked only where it qualifies the protocol's own training ("a 20-epoch budget", "3-epoch
    runs"): a description may well mention "a one-epoch calibration cell" measured to size it.
    """
    text = canonical.get("description", "")
    arms = [arm_config(canonical, a) for a in canonical.get("arms", [])]
    epoch_values = (
        {a["run"]["epochs"] for a in arms}
        | {a["run"].get("patience") for a in arms}
        | {a["optim"].get("warmup_epochs") for a in arms}
    )
    for r in canonical.get("regimes", []):
        epoch_values |= {r.get("epochs"), r.get("patience"), r.get("optim", r).get("warmup_epochs")}
    epoch_values = {float(v) for v in epoch_values if v is not None}
    n_seeds = len(canonical.get("seeds", []))
    problems = []
    word = r"\b(\d+|" + "|".join(NUMBER_WORDS) + r")"
    about_source = _source_sentences(text) if canonical.get("regimes") else []

    def own(m: re.Match) -> bool:  # not in a sentence on how a transfer's source was trained
        return not any(a <= m.start() < b for a, b in about_source)

    for m in re.finditer(word + r"(?:\s+\w+)?[\s-]+seeds?\b", text, flags=re.IGNORECASE):
        n = _number(m.group(1))
        if n is not None and n != n_seeds and own(m):
            problems.append(
                f"the description says {m.group(0)!r} but the protocol has {n_seeds} seeds"
            )
    counts = word + r"\s+(?:warmup[\s-]+)?epochs?\b"
    adjectives = word + r"-epochs?\s+(?:budget|protocol|schedule|training|runs?|study)\b"
    for m in re.finditer(f"{counts}|{adjectives}", text, flags=re.IGNORECASE):
        n = _number(m.group(1) or m.group(2))
        if n is not None and float(n) not in epoch_values and own(m):
            shown = ", ".join(_g(v) for v in sorted(epoch_values))
            problems.append(
                f"the description says {m.group(0)!r} but no epoch setting of the protocol is {n} "
                f"(its epoch values: {shown})"
            )
    return problems


def _source_sentences(text: str) -> list[tuple[int, int]]:
    """Spans of the sentences that say how a transfer's source was trained ("a source ViT trained
    for 20 epochs"): their epochs and seeds are the source's, not settings of this protocol."""
    spans = []
    for m in re.finditer(r"[^.;]+", text):
        sentence = m.group(0)
        if re.search(r"\b(source|pre-?trained)\b", sentence, flags=re.IGNORECASE) and re.search(
            r"\b(trained|pre-?trained)\b", sentence, flags=re.IGNORECASE
        ):
            spans.append(m.span())
    return spans
