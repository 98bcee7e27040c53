"""Every bad protocol value is refused in one line before any MLflow run opens, for every kind (issue 49).

The table walks each numeric key of every kind's protocol (``workbench protocol keys``, the model's
keys aside: their configs refuse them, ``tests/test_protocol.py``) with a value it must refuse,
runs the kind's command on it, and checks the answer is one ``Error`` line naming the key and the
file, with no run in the store afterwards. Most are refused as the file is loaded; the rows marked
``data`` need the data or the pretrained model (pairs beyond the evaluated images, patches beyond
the model's), and are refused by the kind's ``prepare``, still before its parent opens. Then the
other checks made before a run opens: ``--output-dir`` of every study command, and the store of a
kind that acts on trained cells (never the local fallback store while the server is away).
"""

from __future__ import annotations

import copy
import errno
import socket
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

import acted_kinds as kinds
from cli_errors import one_error_problems
from data_fixtures import make_image_folder
from studies.cli import main
from studies.runtime import preflight
from workbench.protocol import load_protocol
from workbench.protocol.keys import key_rows
from workbench.kinds import BY_NAME

TINY = yaml.safe_load(kinds.TINY_ABLATION.format(kind="input"))
PRETRAINED = yaml.safe_load(kinds.PRETRAINED_SOURCE)["pretrained"]


def base(kind: str, acts_on: dict) -> dict:
    """A valid protocol of ``kind`` (as parsed YAML) on the tiny image-folder protocol."""
    if kind == "ablation":
        return copy.deepcopy(TINY)
    if kind == "transfer":
        return {
            "name": "tiny_transfer",
            "description": "a linear probe of the tiny ViT",
            "source": {"weights": "protocol:tiny/vit/seed0"},
            "dataset": {"name": "image_folder"},
            "regimes": [{"name": "probe", "kind": "linear", "reference": True, "epochs": 1}],
            "seeds": [0],
        }
    head = {"description": f"a tiny {kind} protocol", "acts_on": acts_on}
    if kind == "intervention":
        return {
            "name": "tiny_heads",
            **head,
            "interventions": {"heads": "all", "head_modes": ["zero", "mean"]},
            "evaluation": {"batch_size": 4, "mean_images": 8},
            "patching": {"pairs": 4, "corruption": "class", "seed": 0},
        }
    return {
        "name": "tiny_faithfulness",
        **head,
        "attribution": {"images": 4, "batch_size": 4, "examples": 1},
    }


# (kind, the key the error must name, edits as {dotted key: value}; "pretrained" swaps acts_on for a
# pretrained timm ViT; "data": refused once the data or the model is known, in the kind's prepare).
TABLE = [
    ("ablation", "seeds", {"seeds": [-5]}),
    ("ablation", "dataset.train_size", {"dataset.train_size": 0}),
    ("ablation", "dataset.val_size", {"dataset.val_size": 0}),
    ("ablation", "dataset.split_seed", {"dataset.split_seed": -5}),
    ("ablation", "dataset.subset", {"dataset.subset": 0}),
    ("ablation", "dataset.train_subset", {"dataset.train_subset": 0}),
    ("ablation", "dataset.crop_padding", {"dataset.crop_padding": -5}),
    ("ablation", "dataset.rotate_degrees", {"dataset.rotate_degrees": 181}),
    ("ablation", "dataset.translate_fraction", {"dataset.translate_fraction": 0.5}),
    ("ablation", "dataset.resize_to", {"dataset.resize_to": 0}),
    ("ablation", "optim.lr", {"optim.lr": 0}),
    ("ablation", "optim.weight_decay", {"optim.weight_decay": -5}),
    ("ablation", "optim.betas", {"optim.betas": [1.5, 0.999]}),
    ("ablation", "optim.warmup_epochs", {"optim.warmup_epochs": -5}),
    ("ablation", "optim.min_lr_ratio", {"optim.min_lr_ratio": 2}),
    ("ablation", "optim.label_smoothing", {"optim.label_smoothing": 1}),
    ("ablation", "optim.grad_clip", {"optim.grad_clip": 0}),
    ("ablation", "run.epochs", {"run.epochs": 0}),
    ("ablation", "run.batch_size", {"run.batch_size": 0}),
    ("ablation", "run.batch_size", {"run.batch_size": 100000, "data": True}),
    ("ablation", "run.eval_batch_size", {"run.eval_batch_size": 0}),
    ("ablation", "run.patience", {"run.patience": 0}),
    ("ablation", "run.checkpoint_every_steps", {"run.checkpoint_every_steps": 0}),
    ("ablation", "recipe.mixup_alpha", {"recipe.mixup_alpha": -5}),
    ("ablation", "recipe.cutmix_alpha", {"recipe.cutmix_alpha": -5}),
    ("ablation", "recipe.mixup_prob", {"recipe.mixup_prob": 0}),
    ("ablation", "recipe.mixup_switch_prob", {"recipe.mixup_switch_prob": 2}),
    ("ablation", "recipe.randaugment_ops", {"recipe.randaugment_ops": 17}),
    ("ablation", "recipe.randaugment_magnitude", {"recipe.randaugment_magnitude": 31}),
    ("ablation", "recipe.ema_decay", {"recipe.ema_decay": 1}),
    ("transfer", "seeds", {"seeds": [-5]}),
    ("transfer", "source.seed", {"source.seed": -5}),
    ("transfer", "dataset.size", {"dataset.size": 27}),
    ("transfer", "dataset.split_seed", {"dataset.split_seed": -5}),
    ("transfer", "dataset.subset", {"dataset.subset": 0}),
    ("transfer", "dataset.train_size", {"dataset.train_size": 0}),
    ("transfer", "dataset.val_size", {"dataset.val_size": 0}),
    ("transfer", "run.batch_size", {"run.batch_size": 0}),
    ("transfer", "run.eval_batch_size", {"run.eval_batch_size": 0}),
    ("transfer", "evaluation.n_resamples", {"evaluation.n_resamples": 999}),
    ("transfer", "evaluation.confidence", {"evaluation.confidence": 1}),
    ("transfer", "evaluation.seed", {"evaluation.seed": -5}),
    ("transfer", "regimes[0].epochs", {"regimes[0].epochs": 0}),
    ("transfer", "regimes[0].blocks", {"regimes[0].blocks": 0}),
    ("transfer", "regimes[0].layer_decay", {"regimes[0].layer_decay": 0}),
    ("transfer", "regimes[0].patience", {"regimes[0].patience": 0}),
    ("transfer", "regimes[0].lr", {"regimes[0].lr": 0}),
    ("transfer", "regimes[0].weight_decay", {"regimes[0].weight_decay": -5}),
    ("transfer", "regimes[0].betas", {"regimes[0].betas": [0.9, 1.5]}),
    ("transfer", "regimes[0].warmup_epochs", {"regimes[0].warmup_epochs": -5}),
    ("transfer", "regimes[0].min_lr_ratio", {"regimes[0].min_lr_ratio": 2}),
    ("transfer", "regimes[0].label_smoothing", {"regimes[0].label_smoothing": 1}),
    ("transfer", "regimes[0].grad_clip", {"regimes[0].grad_clip": 0}),
    ("intervention", "evaluation.batch_size", {"evaluation.batch_size": 0}),
    ("intervention", "evaluation.mean_images", {"evaluation.mean_images": 0}),
    ("intervention", "evaluation.mean_images", {"evaluation.mean_images": 19, "data": True}),
    ("intervention", "evaluation.mean_seed", {"evaluation.mean_seed": -5}),
    ("intervention", "evaluation.patch_seed", {"evaluation.patch_seed": -5}),
    ("intervention", "evaluation.confidence", {"evaluation.confidence": 1}),
    ("intervention", "evaluation.seed", {"evaluation.seed": -5}),
    ("intervention", "patching.pairs", {"patching.pairs": 0}),
    ("intervention", "patching.pairs", {"patching.pairs": 100000, "data": True}),
    ("intervention", "patching.pairs", {"patching.pairs": 7, "data": True}),
    (
        "intervention",
        "patching.replaced_patches",
        {"patching.corruption": "patches", "patching.replaced_patches": 999},
    ),
    (
        "intervention",
        "patching.replaced_patches",
        {"patching.corruption": "patches", "patching.replaced_patches": 5},
    ),
    ("intervention", "patching.replaced_patches", {"patching.replaced_patches": -5}),
    ("intervention", "patching.seed", {"patching.seed": -5}),
    ("intervention", "patching.ig_steps", {"patching.ig_steps": 0}),
    ("intervention", "pretrained.seed", {"pretrained": True, "pretrained.seed": -5}),
    ("intervention", "pretrained.split_seed", {"pretrained": True, "pretrained.split_seed": -5}),
    ("intervention", "pretrained.val_size", {"pretrained": True, "pretrained.val_size": 0}),
    ("intervention", "pretrained.subset", {"pretrained": True, "pretrained.subset": 0}),
    (
        "intervention",
        "patching.replaced_patches",
        {
            "pretrained": True,
            "patching.corruption": "patches",
            "patching.replaced_patches": 999,
            "data": True,
        },
    ),
    ("attribution", "attribution.images", {"attribution.images": 0}),
    ("attribution", "attribution.images", {"attribution.images": 100000, "data": True}),
    ("attribution", "attribution.batch_size", {"attribution.batch_size": 0}),
    ("attribution", "attribution.norm_threshold", {"attribution.norm_threshold": 1}),
    ("attribution", "attribution.random_seed", {"attribution.random_seed": -5}),
    ("attribution", "attribution.examples", {"attribution.examples": -5}),
    ("attribution", "attribution.random_draws", {"attribution.random_draws": 1}),
    ("attribution", "attribution.sample_seed", {"attribution.sample_seed": -5}),
    ("attribution", "attribution.indices", {"attribution.indices": [0, 1, 2, -1]}),
    (
        "attribution",
        "attribution.indices",
        {"attribution.indices": [0, 1, 2, 100000], "data": True},
    ),
    ("attribution", "evaluation.confidence", {"evaluation.confidence": 1}),
    ("attribution", "evaluation.seed", {"evaluation.seed": -5}),
    ("attribution", "pretrained.seed", {"pretrained": True, "pretrained.seed": -5}),
    ("attribution", "pretrained.split_seed", {"pretrained": True, "pretrained.split_seed": -5}),
    ("attribution", "pretrained.val_size", {"pretrained": True, "pretrained.val_size": 0}),
    ("attribution", "pretrained.subset", {"pretrained": True, "pretrained.subset": 0}),
]


def numeric_keys(kind: str) -> set[str]:
    """Every key of ``kind`` that takes a number (the model's aside), as the table names it."""
    out = set()
    for row in key_rows(kind):
        section = row.section.split(" ")[0]
        if section.startswith("model") or not any(t in row.type for t in ("int", "float")):
            continue
        out.add(row.key if section == "(top)" else f"{section}.{row.key}")
    return out


def edited(data: dict, edits: dict) -> dict:
    data = copy.deepcopy(data)
    if edits.get("pretrained"):
        data.pop("acts_on")
        data["pretrained"] = dict(PRETRAINED)
    for dotted, value in edits.items():
        if dotted in ("pretrained", "data"):
            continue
        *path, leaf = dotted.split(".")
        node = data
        for part in path:
            name, _, index = part.partition("[")
            node = node.setdefault(name, {})
            if index:
                node = node[int(index.rstrip("]"))]
        node[leaf] = value
    return data


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Three classes of 8 training images: 18 train and 6 validation images once carved."""
    folder = tmp_path_factory.mktemp("images") / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    return folder


def no_runs_in(uri: str) -> list[str]:
    """The ids of every run the store holds (none: no run opened)."""
    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_id for r in client.search_runs(ids)] if ids else []


def names(error: str, key: str) -> bool:
    """Whether ``error`` names the dotted ``key``: each of its parts (``regimes[0]`` and ``lr``:
    a section's config may say ``optim.lr`` inside ``'regimes[0]'``)."""
    return all(part in error for part in key.split("."))


def run_command(kind: str, path: Path, folder: Path, *extra: str):
    arguments = ["--protocol", str(path), "--allow-dirty", "--device", "cpu"]
    arguments += ["--data-path", str(folder), *extra]
    return CliRunner().invoke(main, [BY_NAME[kind].command, *arguments])


def test_the_table_walks_every_numeric_key_of_every_kind():
    for kind in ("ablation", "transfer", "intervention", "attribution"):
        walked = {
            edits_key
            for k, _, edits in TABLE
            if k == kind
            for edits_key in edits
            if edits_key not in ("pretrained", "data")
        }
        walked = {key.replace("[0]", "[]") for key in walked}
        missing = numeric_keys(kind) - walked
        assert not missing, f"{kind}: no bad value walked for {sorted(missing)}"


@pytest.mark.parametrize(
    "kind, named, edits", TABLE, ids=[f"{k}-{'-'.join(map(str, e.values()))}" for k, _, e in TABLE]
)
def test_a_bad_value_is_one_line_naming_key_and_file_and_no_run_opens(
    kind, named, edits, images, tmp_path, mlflow_store, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    acts_on = {"protocol": "tiny", "hash": load_protocol(tmp_path / "tiny.yaml").hash}
    data = edited(base(kind, acts_on), edits)
    name = data["name"] if kind != "ablation" else "tiny_bad"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**data, "name": name}))
    result = run_command(kind, path, images, "--output-dir", str(tmp_path / "out"))
    problems = one_error_problems(result, "")
    assert not problems, f"{problems}:\n{result.output[-2000:]}"
    error = next(line for line in result.output.splitlines() if line.startswith("Error"))
    assert names(error, named) and path.name in error, error
    assert no_runs_in(mlflow_store) == [], result.output[-2000:]
    assert not (tmp_path / "offline" / "mlflow.db").exists()


def test_the_data_rows_are_the_ones_refused_only_once_the_data_is_known(tmp_path):
    """The rows marked ``data`` load (so their check is the kind's prepare); every other row is
    refused at load: the table says where each check runs, and a test fails when that changes."""
    from workbench.protocol import ProtocolError, load_any

    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    acts_on = {"protocol": "tiny", "hash": load_protocol(tmp_path / "tiny.yaml").hash}
    for kind, named, edits in TABLE:
        data = edited(base(kind, acts_on), edits)
        name = data["name"] if kind != "ablation" else "tiny_bad"
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**data, "name": name}))
        try:
            load_any(path)
        except ProtocolError as err:
            assert not edits.get("data"), f"{kind} {edits}: refused at load already: {err}"
            assert names(str(err), named) and "\n" not in str(err), str(err)
        else:
            assert edits.get("data"), f"{kind} {edits}: loads, but the row is not marked data"


STUDY_COMMANDS = ("ablation", "transfer", "intervention", "attribution")


@pytest.mark.parametrize("kind", STUDY_COMMANDS)
def test_an_output_dir_that_cannot_be_written_is_refused_before_any_run(
    kind, images, tmp_path, mlflow_store, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    acts_on = {"protocol": "tiny", "hash": load_protocol(tmp_path / "tiny.yaml").hash}
    data = base(kind, acts_on)
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    readonly = tmp_path / "mounted"
    readonly.mkdir()
    real = tempfile.NamedTemporaryFile

    def read_only_mount(*args, dir=None, **kwargs):  # noqa: A002 (tempfile's own name)
        # the tests run as root, whom chmod does not stop: the mount's answer is simulated
        if dir is not None and Path(dir).resolve().is_relative_to(readonly):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(preflight.tempfile, "NamedTemporaryFile", read_only_mount)
    result = run_command(kind, path, images, "--output-dir", str(readonly / "out"))
    problems = one_error_problems(result, "--output-dir")
    assert not problems, f"{problems}:\n{result.output[-2000:]}"
    assert "Read-only file system" in result.output
    assert no_runs_in(mlflow_store) == []
    # a file where the folder should be: refused the same way (what `train` refused already)
    (tmp_path / "a_file").write_text("not a folder")
    result = run_command(kind, path, images, "--output-dir", str(tmp_path / "a_file" / "out"))
    assert not one_error_problems(result, "--output-dir"), result.output[-2000:]
    assert no_runs_in(mlflow_store) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ("intervention", "attribution"))
def test_an_acting_kind_refuses_the_fallback_store_while_the_server_is_away(
    kind, images, tmp_path, monkeypatch
):
    """Before: the local fallback store (which holds no trained cell) got a parent and every cell
    failed. Now: one line naming the server and why, and no store is created."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    acts_on = {"protocol": "tiny", "hash": load_protocol(tmp_path / "tiny.yaml").hash}
    data = base(kind, acts_on)
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run_command(kind, path, images, "--output-dir", str(tmp_path / "out"))
    problems = one_error_problems(result, "no local fallback store holds")
    assert not problems, f"{problems}:\n{result.output[-2000:]}"
    assert "127.0.0.1" in result.output and "unreachable" in result.output
    assert not (tmp_path / "offline" / "mlflow.db").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_a_pretrained_source_or_published_cells_may_still_use_the_fallback_store(
    tmp_path, monkeypatch
):
    """No trained cell is needed in the store there: their runs go to the fallback store as
    ablate's do."""
    from studies.interventions.intervene import InterventionStudy
    from studies.runtime.options import StudyOptions
    from tracking.store import offline_store
    from tracking.store.session import StoreUnavailableError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    offline_store.forget_health()

    class Protocol:
        name, acts_on = "p", None

    study = InterventionStudy(StudyOptions())
    assert study.store_for(Protocol()) == offline_store.fallback_uri()
    Protocol.acts_on = type("ActsOn", (), {"protocol": "tiny"})()
    with pytest.raises(StoreUnavailableError, match="no local fallback store holds"):
        study.store_for(Protocol())
    study.published = "docs/results/tiny/evidence"  # --cells-from: the cells come from there
    assert study.store_for(Protocol()) == offline_store.fallback_uri()
