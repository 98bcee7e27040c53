"""Transfer study library: protocol schema, cached features, freezing, pairing, guard, QWK, bootstrap.

No MLflow here (see test_transfer_study.py). Models are tiny glass-box ViTs; data are small
npz files in the MedMNIST format built in tmp_path, never the real RetinaMNIST.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import cohen_kappa_score

from conftest import assert_close
from data_fixtures import make_retinamnist
from workbench.data import NORM_STATS, PreparedSplit, TensorLoader, derive_seed, prepare
from workbench.models.registry import model_config
from workbench.models.vit import VisionTransformer
from workbench.protocol import TransferProtocolError, parse_transfer_protocol
from workbench.stats import paired_bootstrap_difference
from workbench.train.checkpoint import FORMAT, atomic_torch_save, load_checkpoint
from workbench.transfer.evaluate import metric_cis
from workbench.transfer.features import compute_features
from workbench.transfer.cached_training import epoch_order
from workbench.transfer.regimes import freeze, param_groups
from workbench.transfer.report import CellPredictions, build_section
from workbench.transfer.runner import (
    Selection,
    TestSplitLocked,
    TransferContext,
    select_cell,
    split_off_test,
    evaluate_on_test,
)
from workbench.transfer.source_model import (
    adapt_split,
    load_workbench_checkpoint,
    new_head,
    scratch_model,
    transfer_model,
)

# A tiny source: cifar_vit at 16 px, patch 8 (4 patches + CLS), width 16, 2 blocks.
SOURCE_OVERRIDES = {
    "image_size": 16,
    "patch_size": 8,
    "dim": 16,
    "depth": 2,
    "heads": 2,
    "mlp_ratio": 2.0,
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread; on a busy 2-core machine OpenMP barriers
    between two threads made each training step about 30 times slower (measured: 216 vs 7 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def learnable_retina(path: Path, counts=(80, 30, 40), seed: int = 0) -> dict:
    """A MedMNIST-format npz whose grade sets the brightness of a band, so QWK is learnable."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in zip(("train", "val", "test"), counts):
        labels = (np.arange(n) % 5).astype(np.uint8)
        rng.shuffle(labels)
        images = rng.integers(0, 60, (n, 28, 28, 3), dtype=np.uint8)
        for k in range(5):
            images[labels == k, 4 * k : 4 * k + 8, :, :] += 150
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels[:, None]
    return make_retinamnist(path, counts=counts, **arrays)


def make_source_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A workbench training checkpoint plus the run's config.json, as MLflow downloads them."""
    torch.manual_seed(seed)
    model = VisionTransformer(model_config("cifar_vit", **SOURCE_OVERRIDES))
    path = folder / "checkpoints" / "best.pt"
    atomic_torch_save(
        {
            "format": FORMAT,
            "config_hash": "test",
            "model": model.state_dict(),
            "epoch": 1,
            "metrics": {"val_accuracy": 0.5},
        },
        path,
    )
    config = {
        "model": {"name": "cifar_vit", "overrides": SOURCE_OVERRIDES},
        "data": {"name": "cifar10"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return path


def regime(kind: str, **kw) -> dict:
    base = {
        "name": kw.pop("name", kind),
        "kind": kind,
        "epochs": kw.pop("epochs", 3),
        "lr": kw.pop("lr", 3e-3),
    }
    return base | kw


def protocol_dict(**over) -> dict:
    data = {
        "name": "tiny_transfer",
        "description": "tiny transfer protocol for tests",
        "source": {"weights": "runs:/abc"},
        "dataset": {"name": "retinamnist"},
        "run": {"batch_size": 16, "eval_batch_size": 64},
        "evaluation": {"n_resamples": 1000},
        "regimes": [
            regime("linear", name="linear_probe", reference=True, epochs=8),
            regime("partial", name="partial_ft", blocks=1),
            regime("full", name="full_ft", epochs=2, layer_decay=0.8),
        ],
        "seeds": [0, 1],
    }
    return data | over


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """Tiny source, prepared data (test split guarded) and a shared context."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    learnable_retina(tmp_path / "retinamnist.npz")
    data = prepare("retinamnist", path=tmp_path / "retinamnist.npz", verify=False)
    source = load_workbench_checkpoint(make_source_checkpoint(tmp_path / "source"))
    protocol = parse_transfer_protocol(protocol_dict())
    ctx = TransferContext(torch.device("cpu"), None, 16, 64, source.norm, 16, 5)
    selection_data, guard = split_off_test(data, 3)
    return tmp_path, source, protocol, ctx, selection_data, guard


def cell_of(protocol, name: str, seed: int = 0):
    return next(c for c in protocol.cells() if c.regime.name == name and c.seed == seed)


# ------------------------------------------------------------------------------ protocol


def test_protocol_errors_name_the_key():
    cases = [
        (protocol_dict(colour="red"), "unknown key 'colour'"),
        (protocol_dict(run={"batch_sise": 8}), "unknown key 'run.batch_sise'"),
        (protocol_dict(regimes=[regime("partial", reference=True)]), "regimes[0].blocks: required"),
        (protocol_dict(regimes=[regime("linear", blocks=2, reference=True)]), "regimes[0].blocks"),
        (protocol_dict(regimes=[regime("linear"), regime("full")]), "exactly one regime"),
        (protocol_dict(regimes=[regime("linear", layer_decay=0.7, reference=True)]), "layer_decay"),
        (protocol_dict(evaluation={"n_resamples": 999}), "n_resamples=999: must be >= 1000"),
        (protocol_dict(regimes=[regime("full", reference=True, lr=-1)]), "optim.lr=-1.0"),
        (protocol_dict(source={"weights": "hub"}), "source.model: required"),
        (protocol_dict(seeds=[0, 0]), "seeds=[0, 0]"),
    ]
    for data, message in cases:
        with pytest.raises(TransferProtocolError) as err:
            parse_transfer_protocol(data, source="p.yaml")
        assert message in str(err.value) and str(err.value).startswith("p.yaml: "), str(err.value)


def test_protocol_hash_ignores_formatting_and_shipped_protocols_load():
    a = parse_transfer_protocol(protocol_dict())
    b = parse_transfer_protocol(json.loads(json.dumps(protocol_dict())))
    c = parse_transfer_protocol(protocol_dict(seeds=[0, 2]))
    assert a.hash == b.hash != c.hash
    assert [cell.key for cell in a.cells()][:3] == [
        "linear_probe/seed0",
        "partial_ft/seed0",
        "full_ft/seed0",
    ]
    from studies.transfer.transfer_study import load_transfer_protocol

    for name in ("retina_transfer", "retina_transfer_smoke"):
        p = load_transfer_protocol(
            Path(__file__).parent.parent / "studies" / "protocols" / f"{name}.yaml"
        )
        assert p.reference.kind == "linear" and {r.kind for r in p.regimes} == {
            "linear",
            "partial",
            "full",
        }


def test_scratch_kind_and_the_sha256_pin_are_validated_and_hashed():
    scratch = regime("scratch", name="scratch", epochs=2)
    p = parse_transfer_protocol(protocol_dict(regimes=protocol_dict()["regimes"] + [scratch]))
    assert [r.kind for r in p.regimes][-1] == "scratch" and p.regimes[-1].blocks is None
    cases = [
        (
            protocol_dict(regimes=[regime("scratch", reference=True, blocks=1)]),
            "regimes[0].blocks=1: not for kind 'scratch'",
        ),
        (
            protocol_dict(regimes=[regime("scratch", reference=True, layer_decay=0.75)]),
            "regimes[0].layer_decay=0.75: not for kind 'scratch'",
        ),
        (
            protocol_dict(source={"weights": "runs:/abc", "sha256": "abc123"}),
            "source.sha256='abc123': must be 64 lowercase hex digits",
        ),
        (
            protocol_dict(source={"weights": "runs:/abc", "sha256": "A" * 64}),
            "must be 64 lowercase hex digits",
        ),
        (
            protocol_dict(
                source={"weights": "random", "model": "vit_tiny_patch16_224", "sha256": "a" * 64}
            ),
            "source.sha256: a random init has no checkpoint file to pin",
        ),
    ]
    for data, message in cases:
        with pytest.raises(TransferProtocolError) as err:
            parse_transfer_protocol(data, source="p.yaml")
        assert message in str(err.value) and str(err.value).startswith("p.yaml: "), str(err.value)
    # The pin is optional: absent, the hashed form has no sha256 key (shipped hashes stay, test_protocol.py
    # pins them); given, it is hashed.
    bare, pinned = (
        parse_transfer_protocol(protocol_dict(source=s))
        for s in ({"weights": "runs:/abc"}, {"weights": "runs:/abc", "sha256": "0" * 64})
    )
    assert (
        "sha256" not in bare.canonical["source"]
        and pinned.canonical["source"]["sha256"] == "0" * 64
    )
    assert bare.hash != pinned.hash and pinned.source.sha256 == "0" * 64


def test_scratch_model_is_the_seeded_init_of_the_source_architecture(setup):
    _, source, _, _, _, _ = setup
    rng = torch.random.get_rng_state()
    a, b, c = (scratch_model(source, 5, s) for s in (3, 3, 4))
    assert torch.equal(torch.random.get_rng_state(), rng), (
        "building a scratch model moved the global RNG"
    )
    # the documented init: an ablation arm's, seeded by the cell's seed
    torch.manual_seed(derive_seed(3, "init"))
    expected = VisionTransformer(replace(source.cfg, num_classes=5)).state_dict()
    sa, sb, sc, src = a.state_dict(), b.state_dict(), c.state_dict(), source.model.state_dict()
    # transfer_model's head for seed 3 (the pairing test below checks it there)
    head = new_head(5, source.cfg.dim, 3)
    for key, value in sa.items():
        # the seed's head, as every regime's
        want = head[key] if key.startswith("head.") else expected[key]
        assert torch.equal(value, want) and torch.equal(value, sb[key]), (
            f"{key}: max |diff| {(value - want).abs().max():.3g}"
        )
        if value.ndim >= 2:  # weight matrices: drawn anew, none read from the source
            assert not torch.equal(value, sc[key]), f"{key}: seeds 3 and 4 give the same init"
            if not key.startswith("head."):
                assert not torch.equal(value, src[key]), (
                    f"{key}: a scratch model read the source's weights"
                )
    assert a.cfg == replace(source.cfg, num_classes=5)


# ------------------------------------------------------------------------------ features


def test_cached_features_equal_a_direct_forward_pass(setup):
    _, source, _, ctx, data, _ = setup
    model = source.model
    cache = compute_features(
        model,
        {"train": data.train},
        ctx.norm,
        ctx.resize_to,
        ctx.device,
        batch_size=32,
        token_starts=[1, 2],
    )
    # Direct pass: other batch sizes (7), so agreement is not an artefact of identical batching.
    loader = TensorLoader(
        data.train.images,
        data.train.labels,
        batch_size=7,
        norm=ctx.norm,
        shuffle=False,
        resize_to=ctx.resize_to,
        device="cpu",
    )
    with torch.no_grad():
        direct = torch.cat(
            [model.forward_head(model.forward_features(x), pre_logits=True) for x, _, _ in loader]
        )
        tokens = []
        for x, _, _ in loader:
            h = model.embed(x)
            tokens.append(model.blocks[0](h))
        tokens = torch.cat(tokens)
    diff = (cache.pooled["train"].inputs - direct).abs().max().item()
    print(f"cached vs direct pooled features: max |difference| {diff:.3g} (tolerance 1e-5)")
    assert_close(
        cache.pooled["train"].inputs, direct, 1e-5, "cached pooled features vs direct forward"
    )
    assert_close(
        cache.tokens[1]["train"].inputs, tokens, 1e-5, "cached tokens before block 1 vs direct"
    )
    assert torch.equal(cache.pooled["train"].labels, data.train.labels)


# ------------------------------------------------------------------------------ regimes


def test_partial_and_linear_leave_frozen_weights_bit_identical(setup):
    tmp_path, source, protocol, ctx, data, _ = setup
    cache = compute_features(
        source.model,
        {"train": data.train, "val": data.val},
        ctx.norm,
        ctx.resize_to,
        ctx.device,
        64,
        token_starts=[1],
    )
    before = {k: v.clone() for k, v in source.model.state_dict().items()}
    for name, trained in (
        ("partial_ft", ("blocks.1.", "norm.", "head.")),
        ("linear_probe", ("head.",)),
    ):
        selection = select_cell(cell_of(protocol, name), source, data, cache, ctx, tmp_path / name)
        assert selection.proof["passed"], selection.proof
        after = load_checkpoint(selection.checkpoint)["model"]
        for key, value in after.items():
            if key.startswith(trained):
                continue
            assert torch.equal(value, before[key]), (
                f"{name}: frozen {key} changed (max |diff| {(value - before[key]).abs().max():.3g})"
            )
        changed = [
            k
            for k in after
            if k.startswith(trained)
            and not k.startswith("head.")
            and not torch.equal(after[k], before[k])
        ]
        assert name == "linear_probe" or changed, "partial fine-tuning trained nothing but the head"
        assert Selection.load(tmp_path / name).best_epoch == selection.best_epoch
    assert all(torch.equal(v, before[k]) for k, v in source.model.state_dict().items()), (
        "the source was modified"
    )


def _reference_cached_fit(model, regime, forward, train, seed, batch_size) -> None:
    """A plain loop written out here, as the cached regimes trained before they went through the
    Trainer: AdamW on the regime's groups, cosine with warmup, clipping, the TensorLoader order."""
    import math

    import torch.nn.functional as F

    from workbench.train.loop import cosine_with_warmup

    opt = regime.optim
    groups = param_groups(model, opt.lr, opt.weight_decay, regime.layer_decay)
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
    n_batches = math.ceil(len(train) / batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        cosine_with_warmup(
            regime.epochs * n_batches, round(opt.warmup_epochs * n_batches), opt.min_lr_ratio
        ),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for epoch in range(regime.epochs):
        order = epoch_order(seed, epoch, len(train))
        for k in range(n_batches):
            pos = order[k * batch_size : (k + 1) * batch_size]
            x, y = train.inputs.index_select(0, pos), train.labels.index_select(0, pos)
            loss = F.cross_entropy(forward(x).float(), y, label_smoothing=opt.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if opt.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(trainable, opt.grad_clip)
            optimizer.step()
            scheduler.step()


def test_cached_regimes_train_in_the_trainer_as_a_plain_loop_would(setup):
    """One loop: the Trainer on cached inputs updates the weights bit for bit as a plain loop
    over the same batches; positive control: the same loop one batch order off differs."""
    from workbench.transfer.features import tail_forward

    tmp_path, source, protocol, ctx, data, _ = setup
    cache = compute_features(
        source.model,
        {"train": data.train, "val": data.val},
        ctx.norm,
        ctx.resize_to,
        ctx.device,
        64,
        token_starts=[1],
    )
    cell = cell_of(protocol, "partial_ft")
    selection = select_cell(cell, source, data, cache, ctx, tmp_path / "partial")
    assert selection.proof["passed"] and "assembly proof" in selection.proof["what"]
    # the state after the last epoch (the selected one may be earlier)
    last = load_checkpoint(tmp_path / "partial" / "checkpoints" / "last.pt")["model"]

    def plain(order_seed: int) -> dict[str, torch.Tensor]:
        model = transfer_model(source, ctx.num_classes, cell.seed)
        freeze(model, cell.regime)
        train = cache.tokens[1]["train"]
        _reference_cached_fit(
            model, cell.regime, tail_forward(model, 1), train, order_seed, ctx.batch_size
        )
        return model.state_dict()

    def max_diff(x: dict, y: dict) -> float:
        return max((x[k] - y[k]).abs().max().item() for k in x)

    diff = max_diff(last, plain(cell.seed))
    print(
        f"Trainer on cached tokens vs a plain loop: max |weight difference| {diff:.3g} (tolerance 0)"
    )
    assert diff == 0.0, f"max |weight difference| {diff:.3g}"
    moved = max_diff(last, plain(cell.seed + 1))
    assert moved > 0.0, "another batch order gave the same weights: the check cannot fail"


def test_a_cached_regime_resumes_where_it_was_stopped(setup):
    from workbench.train.loop import Observers, TrainingObserver

    tmp_path, source, protocol, ctx, data, _ = setup
    cache = compute_features(
        source.model,
        {"train": data.train, "val": data.val},
        ctx.norm,
        ctx.resize_to,
        ctx.device,
        64,
        token_starts=[1],
    )
    cell = cell_of(protocol, "linear_probe")
    straight = select_cell(cell, source, data, cache, ctx, tmp_path / "straight")

    class Killed(RuntimeError):
        pass

    class KillAfter(TrainingObserver):
        def on_epoch(self, metrics):
            if metrics["epoch"] == 3:
                raise Killed

    with pytest.raises(Killed):
        select_cell(cell, source, data, cache, ctx, tmp_path / "resumed", Observers(KillAfter()))
    resumed = select_cell(cell, source, data, cache, ctx, tmp_path / "resumed")
    timing = ("epoch_seconds", "images_per_second")
    strip = lambda h: [{k: v for k, v in row.items() if k not in timing} for row in h]  # noqa: E731
    assert strip(resumed.history) == strip(straight.history)
    assert (resumed.best_epoch, resumed.best_val) == (straight.best_epoch, straight.best_val)
    a, b = (load_checkpoint(s.checkpoint)["model"] for s in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed cell's weights differ"


def test_full_regime_runs_through_the_trainer_with_layer_decay(setup):
    tmp_path, source, protocol, ctx, data, _ = setup
    cell = cell_of(protocol, "full_ft")
    selection = select_cell(cell, source, data, None, ctx, tmp_path / "full")
    assert selection.proof["passed"] and "reload proof" in selection.proof["what"]
    assert len(selection.history) == 2 and "val_qwk" in selection.history[0]
    best = max(h["val_qwk"] for h in selection.history)
    assert selection.best_val["val_qwk"] == best
    model = transfer_model(source, 5, 0)
    freeze(model, cell.regime)
    groups = param_groups(model, 1e-3, 0.05, 0.8)
    scales = {g["layer"]: g["lr_scale"] for g in groups}
    assert scales == {3: 1.0, 2: 0.8, 1: pytest.approx(0.64), 0: pytest.approx(0.512)}, scales
    assert groups[0]["layer"] == 3 and all(
        g["weight_decay"] == 0.0 for g in groups if g["params"][0].ndim <= 1
    )


def test_scratch_regime_trains_every_parameter_from_its_seeded_init_and_resumes(setup):
    tmp_path, source, _, ctx, data, _ = setup
    protocol = parse_transfer_protocol(
        protocol_dict(
            regimes=[
                regime("linear", reference=True, epochs=1),
                regime("scratch", name="scratch", epochs=2),
            ]
        )
    )
    cell = cell_of(protocol, "scratch")
    selection = select_cell(cell, source, data, None, ctx, tmp_path / "scratch")
    total = (
        sum(p.numel() for p in source.model.parameters())
        - 10 * source.cfg.dim
        - 10
        + 5 * source.cfg.dim
        + 5
    )
    assert selection.kind == "scratch" and selection.trainable_parameters == total, (
        selection.trainable_parameters,
        total,
    )
    assert selection.proof["passed"] and "reload proof" in selection.proof["what"], selection.proof
    assert len(selection.history) == 2 and selection.best_val["val_qwk"] == max(
        h["val_qwk"] for h in selection.history
    )
    init = scratch_model(source, 5, cell.seed)
    groups = param_groups(init, 1e-3, 0.05, cell.regime.layer_decay)
    assert {g["lr_scale"] for g in groups} == {1.0}, "a scratch regime has no layer-wise decay"
    trained = load_checkpoint(selection.checkpoint)["model"]
    moved = [k for k, v in init.state_dict().items() if not torch.equal(v, trained[k])]
    assert "patch_proj.weight" in moved and "blocks.0.attn.qkv.weight" in moved, moved
    # A rerun in the same folder resumes the Trainer's finished state: nothing retrains, the same selection.
    again = select_cell(cell, source, data, None, ctx, tmp_path / "scratch")
    assert (again.best_epoch, again.best_val) == (selection.best_epoch, selection.best_val)
    assert again.history == selection.history


def test_channels_follow_the_source():
    # (2, 3, 1, 1)
    rgb = torch.tensor([[[[255]], [[0]], [[0]]], [[[10]], [[20]], [[30]]]], dtype=torch.uint8)
    split = PreparedSplit(rgb, torch.tensor([0, 1]), torch.tensor([0, 1]), "test")
    grey = adapt_split(split, 1).images
    assert grey.shape == (2, 1, 1, 1) and grey.flatten().tolist() == [
        round(0.299 * 255),
        round(0.299 * 10 + 0.587 * 20 + 0.114 * 30),
    ]
    assert torch.equal(
        adapt_split(replace(split, images=grey), 3).images, grey.expand(-1, 3, -1, -1)
    )
    assert adapt_split(split, 3) is split


def test_every_regime_of_a_seed_sees_the_same_order_and_head(setup):
    _, source, _, _, data, _ = setup
    loader = TensorLoader(
        data.train.images, data.train.labels, batch_size=16, norm=NORM_STATS["retinamnist"], seed=3
    )
    for epoch in range(3):
        assert torch.equal(epoch_order(3, epoch, len(data.train)), loader.order(epoch))
    a, b, c = (transfer_model(source, 5, s).head.weight for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, new_head(5, source.cfg.dim, 1)["head.weight"]) and torch.equal(
        a, scratch_model(source, 5, 1).head.weight
    )


# ------------------------------------------------------------------------------ test split


class RecordingSplit:
    """Wraps a split; records every read of its tensors (the test's detector)."""

    def __init__(self, split, log: list):
        self._split, self._log = split, log

    def __getattr__(self, name):
        if name in ("images", "labels", "indices"):
            self._log.append(("test split read", name))
        return getattr(self._split, name)

    def __len__(self):
        self._log.append(("test split read", "len"))
        return len(self._split)


def test_guard_locks_the_test_split_until_release(setup):
    tmp_path, source, protocol, ctx, data, guard = setup
    assert data.test is None
    with pytest.raises(TestSplitLocked):
        guard.split()
    selection = select_cell(
        cell_of(protocol, "linear_probe"),
        source,
        data,
        compute_features(
            source.model,
            {"train": data.train, "val": data.val},
            ctx.norm,
            ctx.resize_to,
            ctx.device,
            64,
        ),
        ctx,
        tmp_path / "lin",
    )
    with pytest.raises(TestSplitLocked):
        evaluate_on_test(selection, source, guard, ctx, tmp_path / "lin", protocol.evaluation)
    with pytest.raises(ValueError, match="must not receive a test split"):
        select_cell(
            cell_of(protocol, "linear_probe"),
            source,
            replace(data, test=data.val),
            None,
            ctx,
            tmp_path / "x",
        )
    log = []
    _ = RecordingSplit(data.val, log).images  # the detector sees a read
    assert log == [("test split read", "images")]
    guard.release()
    result = evaluate_on_test(selection, source, guard, ctx, tmp_path / "lin", protocol.evaluation)
    table = pd.read_csv(result.predictions)
    sk = cohen_kappa_score(table["label"], table["predicted"], weights="quadratic")
    assert abs(result.metrics["qwk"] - sk) <= 1e-12, f"QWK {result.metrics['qwk']} vs sklearn {sk}"
    assert result.agree and result.metrics == result.metrics_from_file
    assert (
        result.cis["qwk"].n_resamples == 1000
        and result.cis["qwk"].low <= result.metrics["qwk"] <= result.cis["qwk"].high
    )


# ------------------------------------------------------------------------------ bootstrap


def test_bootstrap_intervals_have_the_known_answers():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 400)
    perfect = metric_cis(y, y, 5, 1000, 0.95, 0)
    assert (perfect["qwk"].low, perfect["qwk"].high, perfect["accuracy"].low) == (1.0, 1.0, 1.0)
    # Coverage on a population with a known QWK and accuracy: draw test sets of 400, count hits.
    pop_y = rng.integers(0, 5, 200_000)
    pop_p = np.where(
        rng.random(pop_y.size) < 0.6,
        pop_y,
        np.clip(pop_y + rng.choice([-1, 1, 2], pop_y.size), 0, 4),
    )
    true_qwk = cohen_kappa_score(pop_y, pop_p, weights="quadratic")
    true_acc = float((pop_y == pop_p).mean())
    hits, widths = {"qwk": 0, "accuracy": 0}, []
    for rep in range(150):
        idx = rng.integers(0, pop_y.size, 400)
        cis = metric_cis(pop_y[idx], pop_p[idx], 5, 1000, 0.95, rep, metrics=("qwk", "accuracy"))
        hits["qwk"] += cis["qwk"].low <= true_qwk <= cis["qwk"].high
        hits["accuracy"] += cis["accuracy"].low <= true_acc <= cis["accuracy"].high
        widths.append(cis["accuracy"].high - cis["accuracy"].low)
    expected_width = 2 * 1.96 * np.sqrt(true_acc * (1 - true_acc) / 400)
    print(
        f"coverage over 150 test sets: QWK {hits['qwk'] / 150:.3f}, accuracy {hits['accuracy'] / 150:.3f}; "
        f"accuracy CI width {np.mean(widths):.4f} vs normal theory {expected_width:.4f}"
    )
    assert all(0.88 <= h / 150 <= 1.0 for h in hits.values()), hits
    assert abs(np.mean(widths) - expected_width) <= 0.1 * expected_width
    # Paired differences: identical arms give exactly 0; fixing 40 of 400 errors gives +0.1 accuracy.
    p = np.where(rng.random(400) < 0.7, y, (y + 1) % 5)
    same = paired_bootstrap_difference(y, p, p, "qwk", 1000, seed=0, num_classes=5)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    better = p.copy()
    better[np.flatnonzero(p != y)[:40]] = y[np.flatnonzero(p != y)[:40]]
    diff = paired_bootstrap_difference(y, better, p, "accuracy", 1000, seed=0, num_classes=5)
    assert abs(diff.estimate - 0.1) < 1e-12 and 0.0 < diff.low < 0.1 < diff.high


def test_report_section_tables_and_confusion():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 5, 120)
    cells = []
    for regime_name, acc in (("linear_probe", 0.6), ("partial_ft", 0.7), ("full_ft", 0.8)):
        for s in (0, 1):
            pred = np.where(rng.random(120) < acc, y, rng.integers(0, 5, 120))
            table = pd.DataFrame(
                {"index": np.arange(120), "label": y, "predicted": pred, "loss": 0.0}
            )
            qwk = cohen_kappa_score(y, pred, weights="quadratic")
            cells.append(
                CellPredictions(
                    regime_name, s, table, {"qwk": qwk}, 3, 0.5, f"run-{regime_name}-{s}"
                )
            )
    section = build_section(
        cells,
        5,
        ["linear_probe", "partial_ft", "full_ft"],
        "linear_probe",
        1000,
        source={"source.label": "tiny", "source.pretrained": "True"},
    )
    k = section.kappa_table
    assert len(k) == 6 and {
        "qwk",
        "qwk_low",
        "qwk_high",
        "accuracy_low",
        "macro_f1_high",
        "recall_4_low",
    } <= set(k.columns)
    assert (
        k["logged_equals_file"].all()
        and (k["qwk_low"] <= k["qwk"]).all()
        and (k["qwk"] <= k["qwk_high"]).all()
    )
    comps = section.comparisons
    assert set(zip(comps["a"], comps["b"])) == {
        ("partial_ft", "linear_probe"),
        ("full_ft", "linear_probe"),
        ("full_ft", "partial_ft"),
    }
    assert (comps["seed"] == "all").sum() == 3 and len(comps) == 9
    for regime_name in (
        "linear_probe",
        "partial_ft",
        "full_ft",
    ):  # test counts summed over the two seeds
        cm = section.confusion[regime_name]
        preds = [c.table["predicted"].to_numpy() for c in cells if c.regime == regime_name]
        assert (
            cm.shape == (5, 5)
            and cm.sum() == 240
            and np.trace(cm) == sum(int((p == y).sum()) for p in preds)
        ), cm
    # rendering lives in reports/, not in the library
    from reports.transfer.transfer_blocks import (
        transfer_markdown,
    )

    markdown = transfer_markdown(section)
    assert "| regime       | seed |" in markdown and "full_ft − linear_probe" in markdown, markdown
    assert not hasattr(section, "markdown"), "the library section computes; reports/ renders"
    bad = CellPredictions("x", 0, cells[0].table.assign(index=np.arange(1, 121)))
    with pytest.raises(ValueError, match="other test images"):
        build_section(cells + [bad], 5, ["linear_probe", "x"], "linear_probe", 1000)


def test_the_transfer_library_never_imports_mlflow():
    from workbench import transfer

    for path in Path(transfer.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "import mlflow" not in text and "from mlflow" not in text, (
            f"{path.name} imports mlflow"
        )
