"""Protocol files: loading, validation messages, cells and pairing, hashing, freezing."""

from __future__ import annotations

import copy
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from studies.runtime.study_protocol import (
    SPLIT_KEYS,
    ProtocolDirtyError,
    ProtocolError,
    ProtocolFrozenError,
    check_clean,
    check_frozen,
    load_protocol,
    parse_protocol,
    protocol_file_is_dirty,
)
from workbench.models.registry import model_config
from workbench.protocol import load_any
from workbench.train.config import DataSpec

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "protocols"

BASE = {
    "name": "tiny",
    "description": "A test protocol.",
    "dataset": {"name": "fashion_mnist", "train_size": 100, "val_size": 50, "split_seed": 7},
    "model": {"name": "fmnist_vit", "dim": 32},
    "optim": {"lr": 0.001, "weight_decay": 0.0},
    "run": {"epochs": 1, "batch_size": 16, "patience": 2},
    "arms": [
        {"name": "vit", "reference": True},
        {"name": "cnn", "overrides": {"model": {"name": "fmnist_cnn"}}},
        {"name": "vit_p7", "overrides": {"model": {"patch_size": 7}, "optim": {"lr": 0.002}}},
    ],
    "seeds": [0, 1, 2],
}


def write(tmp_path: Path, data: dict | str, name: str = "tiny") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def edited(edit) -> dict:
    data = copy.deepcopy(BASE)
    edit(data)
    return data


def load_error(tmp_path: Path, data: dict | str) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ProtocolError) as info:
        load_protocol(path)
    message = str(info.value)
    assert str(path) in message, f"error does not name the file {path}: {message}"
    return message


# --- shipped protocols ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, n_arms, n_seeds",
    [("fmnist_vit_vs_cnn", 2, 3), ("cifar10_ablations", 11, 3), ("smoke", 2, 2)],
)
def test_shipped_protocols_load(name, n_arms, n_seeds):
    p = load_protocol(PROTOCOLS / f"{name}.yaml")
    assert p.name == name
    assert (len(p.arms), len(p.seeds)) == (n_arms, n_seeds), (
        f"{name}: {len(p.arms)} arms, {len(p.seeds)} seeds"
    )
    assert len(p.cells()) == n_arms * n_seeds
    assert sum(a.reference for a in p.arms) == 1
    for arm in p.arms:  # every arm's model must build from the registry
        model_config(arm.config.model.name, **arm.config.model.overrides)


def test_fmnist_seed_study_settings():
    p = load_protocol(PROTOCOLS / "fmnist_vit_vs_cnn.yaml")
    d = p.dataset
    assert (d.name, d.train_size, d.val_size, d.split_seed) == ("fashion_mnist", 3200, 800, 42)
    assert (d.hflip, d.rotate_degrees, d.translate_fraction) == (True, 5.0, 0.06)
    assert (p.optim.lr, p.optim.weight_decay) == (1e-3, 1e-4)
    assert (p.run.patience, p.run.monitor, p.run.batch_size, p.run.evaluate_test) == (
        5,
        "val_accuracy",
        128,
        True,
    )
    assert p.reference.name == "vit" and p.reference.config.model.name == "fmnist_vit"
    assert {a.name: a.config.model.name for a in p.arms} == {
        "vit": "fmnist_vit",
        "cnn": "fmnist_cnn",
    }
    assert p.seeds == (0, 1, 2)


def test_cifar_ablations_cover_the_grid_once():
    p = load_protocol(PROTOCOLS / "cifar10_ablations.yaml")
    assert not p.run.evaluate_test, "ablations are validation only"
    archs = {a.name: model_config(a.config.model.name, **a.config.model.overrides) for a in p.arms}
    grid = {
        (c.patch_size, c.dim)
        for c in archs.values()
        if c.pos_embed == "learned" and c.pooling == "cls" and c.heads == 4
    }
    assert grid == {(ps, w) for ps in (4, 8, 16) for w in (96, 192)}, grid
    assert {c.heads for c in archs.values() if c.dim == 192 and c.patch_size == 4} == {4, 8, 12, 16}
    assert {c.pos_embed for c in archs.values()} == {"learned", "none"}
    assert {c.pooling for c in archs.values()} == {"cls", "mean"}
    ref = archs[p.reference.name]
    assert (ref.patch_size, ref.dim, ref.pos_embed, ref.pooling, ref.heads) == (
        4,
        192,
        "learned",
        "cls",
        4,
    )


def test_split_keys_are_dataspec_fields():
    names = {f.name for f in fields(DataSpec)}
    assert set(SPLIT_KEYS) <= names, f"SPLIT_KEYS not in DataSpec: {set(SPLIT_KEYS) - names}"


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, dotted",
    [
        (lambda d: d.update(epochs=3), "epochs"),
        (lambda d: d["dataset"].update(valsize=3), "dataset.valsize"),
        (lambda d: d["dataset"].update(path="/data"), "dataset.path"),
        (lambda d: d["model"].update(patchsize=8), "model.patchsize"),
        (lambda d: d["optim"].update(momentum=0.9), "optim.momentum"),
        (lambda d: d["run"].update(seed=3), "run.seed"),
        (lambda d: d["run"].update(device="cuda"), "run.device"),
        (lambda d: d["arms"][1].update(weight=2), "arms[1].weight"),
        (
            lambda d: d["arms"][1]["overrides"].update(data={"hflip": True}),
            "arms[1].overrides.data",
        ),
        (
            lambda d: d["arms"][2]["overrides"]["model"].update(patchsize=8),
            "arms[2].overrides.model.patchsize",
        ),
        (
            lambda d: d["arms"][1]["overrides"]["model"].update(patch_size=8),
            "arms[1].overrides.model.patch_size",
        ),
        (
            lambda d: d["arms"][2]["overrides"]["optim"].update(lr_max=1),
            "arms[2].overrides.optim.lr_max",
        ),
        (lambda d: d["arms"][2]["overrides"].update(run={"seed": 5}), "arms[2].overrides.run.seed"),
    ],
)
def test_unknown_key_named_with_dotted_path(tmp_path, edit, dotted):
    message = load_error(tmp_path, edited(edit))
    assert f"unknown key '{dotted}'" in message, f"expected unknown key '{dotted}' in: {message}"
    assert "valid keys" in message, message


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d["optim"].update(lr=-1), ["optim", "lr", "-1"]),
        (lambda d: d["optim"].update(betas=[0.9]), ["optim.betas", "[0.9]"]),
        (lambda d: d["run"].update(amp="fp8"), ["run.amp", "fp8"]),
        (lambda d: d["run"].update(epochs="ten"), ["run.epochs", "ten"]),
        (lambda d: d["run"].update(batch_size=0), ["run", "batch_size", "0"]),
        (lambda d: d["dataset"].update(rotate_degrees=200), ["rotate_degrees", "200"]),
        (lambda d: d["dataset"].update(hflip="yes"), ["dataset.hflip", "yes"]),
        (lambda d: d["dataset"].update(name="fashionmnist"), ["dataset.name", "fashionmnist"]),
        (lambda d: d["model"].update(name="vit_huge"), ["model.name", "vit_huge"]),
        (lambda d: d["model"].update(heads=5), ["bad model in 'model'", "heads", "5"]),
        (
            lambda d: d["arms"][2]["overrides"]["model"].update(patch_size=40),
            ["arms[2]", "patch_size", "40"],
        ),
        (
            lambda d: d["arms"][2]["overrides"]["optim"].update(lr=0),
            ["arms[2].overrides.optim", "lr", "0"],
        ),
        (lambda d: d["arms"][1].update(reference="no"), ["arms[1].reference", "no"]),
        (lambda d: d["arms"][1].update(name="CNN arm"), ["arms[1].name", "CNN arm"]),
        (lambda d: d.update(name="Tiny!"), ["name", "Tiny!"]),
        (lambda d: d.update(seeds=[0, 0]), ["seeds", "distinct"]),
        (lambda d: d.update(seeds=[]), ["seeds", "[]"]),
        (lambda d: d.update(seeds=[-1]), ["seeds", "-1"]),
        (lambda d: d.pop("description"), ["missing required key", "description"]),
        (lambda d: d.update(arms=[]), ["arms", "non-empty"]),
    ],
)
def test_bad_value_named(tmp_path, edit, expected):
    message = load_error(tmp_path, edited(edit))
    for part in expected:
        assert part in message, f"expected {part!r} in: {message}"


def test_name_must_match_file_stem(tmp_path):
    path = write(tmp_path, BASE, name="other")
    with pytest.raises(ProtocolError, match="must equal the file name stem 'other'"):
        load_protocol(path)


@pytest.mark.parametrize("refs", [[], ["vit", "cnn"]])
def test_exactly_one_reference_arm(tmp_path, refs):
    def edit(d):
        for arm in d["arms"]:
            arm["reference"] = arm["name"] in refs

    message = load_error(tmp_path, edited(edit))
    assert f"exactly one arm must have 'reference: true'; found {len(refs)}" in message, message


def test_duplicate_arm_names(tmp_path):
    message = load_error(tmp_path, edited(lambda d: d["arms"][2].update(name="cnn")))
    assert "duplicate arm name(s) 'cnn'" in message, message


def test_arm_identical_to_another_is_refused(tmp_path):
    # dim 32 restates the base: the arm is the reference again.
    same = {"name": "vit_again", "overrides": {"model": {"dim": 32}}}
    message = load_error(tmp_path, edited(lambda d: d["arms"].append(same)))
    assert "arm 'vit_again' resolves to the same config as arm 'vit'" in message, message


@pytest.mark.parametrize(
    "key, value",
    [("split_seed", 1), ("train_size", 90), ("val_size", 40), ("name", "cifar10"), ("subset", 10)],
)
def test_arm_may_not_change_the_split(tmp_path, key, value):
    message = load_error(
        tmp_path, edited(lambda d: d["arms"][1]["overrides"].update(dataset={key: value}))
    )
    assert f"arms[1].overrides.dataset.{key}: arms may not change the split" in message, message


def test_arm_may_not_set_seed_or_test_evaluation(tmp_path):
    message = load_error(
        tmp_path, edited(lambda d: d["arms"][1]["overrides"].update(run={"seed": 3}))
    )
    assert "seeds come from the protocol's 'seeds' list" in message, message
    message = load_error(
        tmp_path, edited(lambda d: d["arms"][1]["overrides"].update(run={"evaluate_test": True}))
    )
    assert "arms[1].overrides.run.evaluate_test: is protocol-wide" in message, message


def test_arm_may_change_augmentation_and_budget(tmp_path):
    def edit(d):
        d["arms"][1]["overrides"].update(dataset={"hflip": True}, run={"epochs": 3})

    p = load_protocol(write(tmp_path, edited(edit)))
    cnn = next(a for a in p.arms if a.name == "cnn").config
    assert (cnn.data.hflip, cnn.run.epochs, p.reference.config.data.hflip) == (True, 3, False)


def test_yaml_scalars_and_duplicate_keys(tmp_path):
    text = yaml.safe_dump(BASE, sort_keys=False).replace("lr: 0.001", "lr: 1e-3")
    text = text.replace("patience: 2", "patience: 2\n  amp: off")
    p = load_protocol(write(tmp_path, text))
    assert p.optim.lr == 1e-3 and isinstance(p.optim.lr, float), f"1e-3 parsed as {p.optim.lr!r}"
    assert p.run.amp == "off", f"'off' parsed as {p.run.amp!r}"
    message = load_error(tmp_path, text.replace("patience: 2", "patience: 2\n  patience: 3"))
    assert "duplicate key 'patience'" in message, message


def test_arm_model_fields_are_checked_merged_with_the_base(tmp_path):
    # heads 12 alone does not divide the registry's dim 64, but with the base's dim 96 it does.
    def edit(d):
        d["model"]["dim"] = 96
        d["arms"][2]["overrides"]["model"] = {"heads": 12}

    p = load_protocol(write(tmp_path, edited(edit)))
    assert p.arms[2].config.model.overrides == {"dim": 96, "heads": 12}
    message = load_error(
        tmp_path, edited(lambda d: d["arms"][2]["overrides"]["model"].update(heads=3))
    )
    assert "arms[2].overrides.model" in message and "heads=3" in message, message


def test_model_switch_drops_base_model_overrides(tmp_path):
    p = load_protocol(write(tmp_path, BASE))
    arms = {a.name: a.config.model for a in p.arms}
    assert (arms["vit"].name, arms["vit"].overrides) == ("fmnist_vit", {"dim": 32})
    assert (arms["cnn"].name, arms["cnn"].overrides) == ("fmnist_cnn", {}), arms["cnn"]
    assert (arms["vit_p7"].name, arms["vit_p7"].overrides) == (
        "fmnist_vit",
        {"dim": 32, "patch_size": 7},
    )


# --- cells and pairing -------------------------------------------------------------------


def test_cells_are_seed_major_and_paired(tmp_path):
    p = load_protocol(write(tmp_path, BASE))
    cells = p.cells()
    assert [(c.seed, c.arm) for c in cells] == [
        (s, a) for s in (0, 1, 2) for a in ("vit", "cnn", "vit_p7")
    ]
    assert len({c.key for c in cells}) == len(cells), "cell keys must be unique"
    for seed in p.seeds:
        group = [c for c in cells if c.seed == seed]
        assert sum(c.is_reference for c in group) == 1, f"seed {seed}: one reference cell"
        configs = [c.train_config() for c in group]
        splits = {tuple(getattr(cfg.data, k) for k in SPLIT_KEYS) for cfg in configs}
        assert len(splits) == 1, f"seed {seed}: arms see different splits {splits}"
        assert {cfg.run.seed for cfg in configs} == {seed}, (
            f"seed {seed}: run seeds {[c.run.seed for c in configs]}"
        )
    assert all(c.protocol_name == "tiny" and c.protocol_hash == p.hash for c in cells)
    vit_p7 = next(c for c in cells if c.arm == "vit_p7").train_config()
    assert vit_p7.optim.lr == 0.002 and vit_p7.run.patience == 2, vit_p7


def test_train_config_runtime_settings(tmp_path):
    cell = load_protocol(write(tmp_path, BASE)).cells()[0]
    cfg = cell.train_config(device="cpu", deterministic=False, data_path="/data/fmnist")
    assert (cfg.run.device, cfg.run.deterministic, cfg.data.path) == ("cpu", False, "/data/fmnist")
    assert cell.train_config().run.device == "auto"


# --- hashing -----------------------------------------------------------------------------


def test_hash_ignores_formatting_and_key_order(tmp_path):
    h = load_protocol(write(tmp_path, BASE)).hash
    reordered = {k: BASE[k] for k in reversed(list(BASE))}
    reordered["dataset"] = dict(reversed(list(BASE["dataset"].items())))
    text = "# a comment\n\n" + yaml.safe_dump(reordered, default_flow_style=True, width=60).replace(
        "0.001", "1.0e-3"
    )
    h2 = load_protocol(write(tmp_path, text)).hash
    assert h2 == h, "hash changed with key order, comments, flow style or number spelling"
    as_int = load_protocol(
        write(tmp_path, edited(lambda d: d["dataset"].update(rotate_degrees=5)))
    ).hash
    as_float = load_protocol(
        write(tmp_path, edited(lambda d: d["dataset"].update(rotate_degrees=5.0)))
    ).hash
    assert as_int == as_float, "5 and 5.0 for a float field must hash the same"
    default_filled = load_protocol(
        write(tmp_path, edited(lambda d: d["optim"].update(label_smoothing=0.0)))
    ).hash
    assert default_filled == h, "stating a default explicitly must not change the hash"


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["optim"].update(lr=0.002),
        lambda d: d["dataset"].update(split_seed=8),
        lambda d: d["arms"][2]["overrides"]["model"].update(patch_size=14),
        lambda d: d.update(seeds=[0, 1, 3]),
        lambda d: d.update(description="Another text."),
    ],
)
def test_hash_changes_with_any_value(tmp_path, edit):
    h = load_protocol(write(tmp_path, BASE))
    h2 = load_protocol(write(tmp_path, edited(edit)))
    assert h2.hash != h.hash, f"hash unchanged after edit: {h2.canonical_json()}"
    assert len(h.hash) == 64 and h.short_hash == h.hash[:12]


def test_parse_protocol_matches_file(tmp_path):
    assert parse_protocol(copy.deepcopy(BASE)).hash == load_protocol(write(tmp_path, BASE)).hash


# --- freezing ----------------------------------------------------------------------------


def test_check_frozen(tmp_path):
    p = load_protocol(write(tmp_path, BASE))
    check_frozen(p, set())
    check_frozen(p, {p.hash})
    old = "ab" * 32
    with pytest.raises(ProtocolFrozenError) as info:
        check_frozen(p, {old, p.hash})
    message = str(info.value)
    for part in (
        "protocol 'tiny' was already run with hash abababababab",
        f"this file has hash {p.short_hash}",
        "make a new protocol file with a new name",
    ):
        assert part in message, f"expected {part!r} in: {message}"


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def test_dirty_detection(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # never find a repo above tmp_path
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    path = write(repo, BASE)
    assert protocol_file_is_dirty(path), "an untracked file must be dirty"
    with pytest.raises(ProtocolDirtyError, match="untracked"):
        check_clean(path)
    git(repo, "add", path.name)
    git(repo, "commit", "-q", "-m", "protocol")
    assert not protocol_file_is_dirty(path), "a committed, unchanged file must be clean"
    check_clean(path)

    path.write_text(path.read_text() + "# edited\n")
    assert protocol_file_is_dirty(path), "a modified file must be dirty"
    with pytest.raises(ProtocolDirtyError) as info:
        check_clean(path)
    assert str(path) in str(info.value) and "uncommitted changes" in str(info.value), str(
        info.value
    )
    check_clean(path, allow_dirty=True)

    (tmp_path / "norepo").mkdir()
    outside = write(tmp_path / "norepo", BASE)
    assert protocol_file_is_dirty(outside), "a file outside a git repository counts as dirty"
    with pytest.raises(ProtocolDirtyError, match="not inside a git repository"):
        check_clean(outside)


# --- shipped hashes ------------------------------------------------------------------------

# sha256 of each shipped protocol's canonical JSON, computed at commit 94bc460 (before the
# protocol parsers were merged into one schema). Runs in MLflow are keyed by these hashes:
# a change here orphans every recorded run of the protocol, so it must be deliberate and
# stated in the README with the reason.
SHIPPED_HASHES = {
    "cifar10_ablations": "00deb7362acc5379fa7120cacce82695e27d0793c0a9f269286592ac5472bfd0",
    "cifar10_ablations_cpu": "627f2463f03c8d0ec8841ddc2876b28875ce12fbe2727a057705e4c80f8323ce",
    "cifar10_seed_table": "ec562143531713b50340b51dd32be795b382b695e6dd05bcb35ae47651b0d5af",
    "cifar10_recipe_and_baselines": "ae5dd14973153bcb77947a556141ee2b03f0478294b52cad55d4d968da117d10",
    "cifar10_registers": "f8f9e0f892ffce0a8bfc46b158eb1e247fe4b876f619cb4d8d9343112ce40501",
    "cifar10_recipe_20ep": "49fcd8a774511a0fb7bcb99fc46f07abfb078e34540f237092b339c066580548",
    "cifar10_fast_path_check": "85eb1dff3458728b1218563c6a4fac5a867db866d48c3a29310c342459b7ca90",
    "cifar10_registers_fp32": "33b55a7634de8cf7aeb4624e8506b20d6ed9499d0a559eb6844ef178b5261d85",
    "cifar10_seed_table_20ep_fp32": "94f5267073fc7a300753cecdff7d41532b1d9ff3ab108fb403fb78fa4dc64c82",
    "cifar10_seed_table_20ep_bf16": "18ebff707ec4b2e21b430aef06b181626499f26c3732ae12de7f9b73cbe7c1e2",
    "cifar10_data_size": "762b3f4c2f527cc7deb1a04b0e32f953f3a0b7ee0b0551252f59ba484fef9d65",
    "fmnist_seed_recipe": "a9df7b8b7b9c2bb7f1f2e1a6f9eb5063367da4767d80b8de94faa276468f1b49",
    "fmnist_seed_recipe_heads": "180efd1f7005ba3afcff6d964786444ec033187b1e661f34a1695019942f5184",
    "fmnist_seed_recipe_patching": "380b069b9ab44e8e274fc5ff9f5ad0110edec3e7201ff7cdf164af2c8666757e",
    "fmnist_seed_recipe_atp": "bb149e44a993a761eb03c37c81d3810ec437bc4db48e41e38a93317c313d96bd",
    "fmnist_seed_recipe_patching_patches": "81bdb3dfc493a1c1dd19b72700b21dccd3a3391a372c59ddc6129859846a71aa",
    "fmnist_seed_recipe_edges": "7409d636fb06eec53510d2c856d1baa5f1fe26fad63ac7029ba3cfb8bc1b85a9",
    "fmnist_seed_recipe_faithfulness": "4a2a91bf9a58ec659371cf6fa242245f8977b30e41adaa8381434b6ad8a018dc",
    "fmnist_seed_recipe_faithfulness_controls": "a7bbe9742053ecbd14be4016541e8c37aede5d22a4440a0dfdbaa9fdb8dc398b",
    "cifar10_registers_fp32_faithfulness": "9f45c526b16548fd32ee2b9f5470369d77627c5b4cebbb5e5d24e857a436272f",
    "cifar10_registers_faithfulness": "228f8251ae37462c648f6dc65f7bde064b662e2cf70dd7095b23c183e3a8d38b",
    "cifar10_registers_faithfulness_stratified": "ffb9de75b77204e9d1b66a8335de06a3ac75d2ce182535d978cbdfb9b21fa864",
    "fmnist_vit_vs_cnn": "941bf144832b055f1796a83557c9fd9770fa78b1013b990868902bd882eb218b",
    "retina_transfer": "8082116498e236e110f1e2f8f7104d3e7ad637fef4a4ad85b85de78428229bbc",
    "retina_transfer_local": "a77177dcb2c9a5524b71b4ff774f56989bdbce459b71c95f454a61a9e556498f",
    "retina_transfer_smoke": "d8d9cd44976fbaadf9c21310cc7fd8393712ccdab37792ebc98a7784ec47f916",
    "retina_transfer_smoke_source": "53ee7a266838a5dd07fc899532c4b590dd383a059729fcac7c0f1d21b02cdf40",
    "smoke": "7aa839f2e3e1c3262923563911987f48cb841f03918a397baf66a35756f6ed59",
    "smoke_faithfulness": "1d328be6c95a5a4ed876b8b4f1eb6ebc0cb474f9d3e7c15257a6694a5428f73e",
    "smoke_faithfulness_controls": "b6fc5222981d88a6d2b9a91e1b1a5d49c3ebe9f48ab874c96e965ef97e3a019f",
    "smoke_heads": "2945147cc8fdd1dfe7fc56da1fb29d0f3b9c14d35a18c505ea37dcf482cf7aa6",
    "smoke_patching": "ea79dd36bb488539bc48e8deda486b12cb9fddc644167e68662abee71282d312",
    "smoke_atp": "2112a5f59b46a1e6252e93b86e9ed02561b84090f7cc7242a4a08fce3d9eefa1",
    "smoke_timm_arms": "5ec86d08fc219163dc65220c03a199d052f026fb66005237acc356688bf6b7c5",
    "smoke_timm_faithfulness": "9e2ed197c3d57e8e20769c4597594d0246965f130dd91a75b3986d6bed409925",
    "smoke_timm_heads": "5a4569f430f5980ba2b5096eb47de007704d660b913bb92a7bad748bf6f048b8",
}


def test_every_shipped_protocol_is_pinned():
    shipped = sorted(p.stem for p in PROTOCOLS.glob("*.yaml"))
    assert shipped == sorted(SHIPPED_HASHES), (
        f"pin the hash of new protocol files: {set(shipped) ^ set(SHIPPED_HASHES)}"
    )


@pytest.mark.parametrize("name", sorted(SHIPPED_HASHES))
def test_shipped_protocol_hash_is_unchanged(name):
    p = load_any(PROTOCOLS / f"{name}.yaml")
    assert p.hash == SHIPPED_HASHES[name], (
        f"{name}: hash {p.hash} != pinned {SHIPPED_HASHES[name]}; "
        f"canonical JSON now: {p.canonical_json()}"
    )


# --- non-finite numbers (issue 31: `lr: .inf` reached the JSON encoder) ------------------------

NON_FINITE = [  # (YAML text replaced in BASE's dump, the key the error must name)
    ("lr: 0.001", "lr: .inf", "optim.lr=inf"),
    ("lr: 0.001", "lr: .nan", "optim.lr=nan"),
    ("lr: 0.001", "lr: -.Inf", "optim.lr=-inf"),
    ("lr: 0.002", "lr: .inf", "arms[2].overrides.optim.lr=inf"),
    ("split_seed: 7", "split_seed: 7\n  rotate_degrees: .nan", "dataset.rotate_degrees=nan"),
]


@pytest.mark.parametrize("old, new, key", NON_FINITE, ids=[k for *_, k in NON_FINITE])
def test_a_non_finite_number_in_a_protocol_is_refused_naming_the_key(tmp_path, old, new, key):
    text = yaml.safe_dump(BASE, sort_keys=False)
    assert old in text, text
    message = load_error(tmp_path, text.replace(old, new, 1))
    assert f"{key}: must be a finite number (not inf or nan)" in message, message


def test_a_non_finite_number_in_a_transfer_or_intervention_protocol_is_refused():
    message = transfer_error(lambda d: d["regimes"][1].update(lr=float("inf")))
    assert "regimes[1].lr=inf: must be a finite number" in message, message
    message = transfer_error(lambda d: d.update(evaluation={"confidence": float("nan")}))
    assert "evaluation.confidence=nan: must be a finite number" in message, message
    from workbench.protocol import parse_intervention_protocol

    with pytest.raises(
        ProtocolError, match=r"i.yaml: pretrained.timm_kwargs.drop_rate=inf: must be a finite"
    ):
        parse_intervention_protocol(
            {
                "name": "i",
                "description": "d",
                "interventions": {},
                "pretrained": {
                    "model": "vit_tiny_patch16_224",
                    "weights": "random",
                    "timm_kwargs": {"drop_rate": float("inf")},
                },
            },
            source="i.yaml",
        )


def test_the_library_configs_refuse_non_finite_numbers_too():
    from workbench.train.config import OptimConfig

    for kwargs, key in (
        ({"lr": float("inf")}, "optim.lr=inf"),
        ({"grad_clip": float("nan")}, "optim.grad_clip=nan"),
        ({"betas": (0.9, float("inf"))}, "optim.betas=(0.9, inf)"),
    ):
        with pytest.raises(ValueError, match=re.escape(f"{key}: must be a finite number")):
            OptimConfig(**kwargs)
    with pytest.raises(ValueError, match=r"data.translate_fraction=inf: must be a finite number"):
        DataSpec("image_folder", translate_fraction=float("inf"))


# --- one schema for both kinds -------------------------------------------------------------

TRANSFER = {
    "name": "tiny_transfer",
    "description": "a transfer protocol for schema tests",
    "source": {"weights": "random", "model": "vit_tiny_patch16_224"},
    "dataset": {"name": "retinamnist"},
    "regimes": [
        {"name": "probe", "kind": "linear", "reference": True, "epochs": 2, "lr": 1e-3},
        {"name": "full", "kind": "full", "epochs": 2, "lr": 1e-4},
    ],
    "seeds": [0, 1],
}


def transfer_error(edit) -> str:
    from workbench.protocol import parse_transfer_protocol

    data = copy.deepcopy(TRANSFER)
    edit(data)
    with pytest.raises(ProtocolError) as info:  # a TransferProtocolError is a ProtocolError
        parse_transfer_protocol(data, source="t.yaml")
    message = str(info.value)
    assert message.startswith("t.yaml: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda d: d["regimes"][1].update(momentum=0.9),
            ["unknown key 'regimes[1].momentum'", "label_smoothing"],
        ),
        (
            lambda d: d["regimes"][0].update(betas=[0.9]),
            ["regimes[0].betas=[0.9]", "a list of 2 numbers"],
        ),
        (lambda d: d["regimes"][0].update(grad_clip="big"), ["regimes[0].grad_clip='big'"]),
        (lambda d: d["regimes"][1].update(lr=0), ["regimes[1]", "lr", "0"]),
        (lambda d: d["regimes"][1].pop("epochs"), ["regimes[1].epochs: required"]),
        (lambda d: d["source"].pop("weights"), ["source.weights: required"]),
        (lambda d: d["dataset"].update(size=100), ["dataset.size=100"]),
        (lambda d: d.update(run={"amp": "fp8"}), ["run.amp='fp8'"]),
        (
            lambda d: d.update(evaluation={"confidence": "high"}),
            ["evaluation.confidence='high'", "expected float"],
        ),
        (lambda d: d["regimes"][1].update(name="probe"), ["duplicate regime name(s) 'probe'"]),
        (
            lambda d: d["dataset"].update(name="imagefolder"),
            ["dataset.name='imagefolder'", "image_folder"],
        ),
    ],
)
def test_transfer_errors_name_the_dotted_key(edit, expected):
    message = transfer_error(edit)
    for part in expected:
        assert part in message, f"expected {part!r} in: {message}"


def test_regime_keys_come_from_optim_config():
    """Every optimiser field is a regime key (no copied list), typed by OptimConfig's hints."""
    from workbench.protocol import parse_transfer_protocol
    from workbench.protocol.transfer import REGIME_KEYS
    from workbench.train.config import OptimConfig

    assert {f.name for f in fields(OptimConfig)} <= set(REGIME_KEYS)
    data = copy.deepcopy(TRANSFER)
    data["regimes"][1].update(
        weight_decay=0,
        betas=[0, 0.98],
        warmup_epochs=1,
        min_lr_ratio=0.1,
        label_smoothing=0.1,
        grad_clip=1,
    )
    optim = parse_transfer_protocol(data).regimes[1].optim
    assert optim == OptimConfig(
        lr=1e-4,
        weight_decay=0.0,
        betas=(0.0, 0.98),
        warmup_epochs=1.0,
        min_lr_ratio=0.1,
        label_smoothing=0.1,
        grad_clip=1.0,
    ), optim
    assert isinstance(optim.grad_clip, float) and isinstance(optim.betas[0], float), (
        "ints must become floats"
    )


def test_kinds_share_one_loader_and_one_hash(tmp_path):
    import hashlib

    from workbench.protocol import canonical_json, load_transfer_protocol

    ablation = write(tmp_path, BASE)
    transfer = write(tmp_path, TRANSFER, name="tiny_transfer")
    a, t = load_any(ablation), load_any(transfer)
    assert (a.kind, t.kind) == ("ablation", "transfer")
    for p in (a, t):
        assert p.hash == hashlib.sha256(canonical_json(p.canonical).encode()).hexdigest()
    with pytest.raises(ProtocolError, match="is a transfer protocol, not an ablation protocol"):
        load_protocol(transfer)
    with pytest.raises(ProtocolError, match="is an ablation protocol, not a transfer protocol"):
        load_transfer_protocol(ablation)
    text = yaml.safe_dump(TRANSFER).replace("seeds:", "seeds: [0]\nseeds:")
    with pytest.raises(ProtocolError, match="duplicate key 'seeds'"):
        load_any(write(tmp_path, text, name="tiny_transfer"))
