"""Bad input found by trying the workbench as careful users (issue 22): one line each, nothing damaged.

Every case ends with exactly one ``Error`` line naming the file, option or value, a
non-zero exit status and no traceback; the ones that can be checked before any training
are refused before a run exists. Stores that cannot be written and ``--debug``:
tests/test_store_errors.py.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from cli_errors import one_error_problems
from data_fixtures import make_image_folder
from studies.cli import main, one_line

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = ROOT / "studies" / "protocols"
TINY_TRAIN = [
    "train",
    "--model",
    "cifar_cnn",
    "--dataset",
    "image_folder",
    "--set",
    "num_classes=2",
    "--epochs",
    "1",
    "--batch-size",
    "8",
    "--device",
    "cpu",
]


@pytest.fixture
def workdir(tmp_path, mlflow_store, monkeypatch):
    """Bad files in the working directory (mlflow_store moved there), a 2-class and a 1-class folder."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_OFFLINE_DIR", str(tmp_path / "offline"))
    Path("binary.yaml").write_bytes(b"name: x\n\xff\xfe\x00\x01 binary\n")
    Path("notdb.db").write_bytes(b"this is a text file, not SQLite" * 20)
    Path("a_file").write_text("not a folder")
    make_image_folder(
        Path("two"), classes=("cat", "dog"), per_class={"train": 8, "test": 2}, size=8
    )
    make_image_folder(Path("one"), classes=("cat",), per_class={"train": 8, "test": 2}, size=8)
    return tmp_path


CASES = [
    (["ablate", "--protocol", "binary.yaml"], "binary.yaml: not a text (UTF-8) protocol file"),
    (["status", "--protocol", "binary.yaml"], "binary.yaml"),
    (["worker", "--storage", "notascheme://"], "'notascheme'"),
    (["worker", "--storage", "notascheme://"], "--storage"),
    (["worker", "--storage", "sqlite:///notdb.db"], "notdb.db is not an SQLite database"),
    (
        ["benchmark-recipe", "--protocol", str(PROTOCOLS / "smoke.yaml"), "--seeds", "0,x"],
        "'x' is not an integer seed",
    ),
    (
        ["benchmark-recipe", "--protocol", str(PROTOCOLS / "smoke.yaml"), "--seeds", "7"],
        "no seed 7 in smoke",
    ),
    (["benchmark-loader", "--n-images", "0"], "'--n-images'"),
    (["sync", "--from", "missing.db", "--to", "sqlite:///target.db"], "missing.db does not exist"),
    (
        ["sync", "--from", "notdb.db", "--to", "sqlite:///target.db"],
        "notdb.db is not an SQLite database",
    ),
    (["sync", "--from", "two", "--to", "sqlite:///target.db"], "is a folder"),
    (
        ["sync", "--from", "sqlite:///missing.db", "--to", "sqlite:///target.db"],
        "missing.db does not exist",
    ),
    ([*TINY_TRAIN, "--data-path", "two", "--output-dir", "a_file/out"], "'--output-dir'"),
    (
        [*TINY_TRAIN, "--data-path", "two", "--batch-size", "100"],
        "batch_size 100 is larger than the training split",
    ),
    ([*TINY_TRAIN, "--data-path", "one"], "1 class (cat); a classifier needs at least 2"),
    # non-finite numbers, refused by the option before any data or run (issue 31: --lr inf failed at step 1)
    (
        [*TINY_TRAIN, "--data-path", "two", "--lr", "inf"],
        "Invalid value for '--lr': 'inf' is not a finite number",
    ),
    (
        [*TINY_TRAIN, "--data-path", "two", "--grad-clip", "nan"],
        "'--grad-clip': 'nan' is not a finite number",
    ),
    (
        [*TINY_TRAIN, "--data-path", "two", "--set", "dropout=.nan"],
        "'dropout=.nan': '.nan' is not a finite number",
    ),
    # recipe parts on the command line: an unknown key names the keys, a bad value its rule
    (
        [*TINY_TRAIN, "--data-path", "two", "--recipe", "mixup=0.8"],
        "'mixup' is not a recipe key; the keys are mixup_alpha",
    ),
    (
        [*TINY_TRAIN, "--data-path", "two", "--recipe", "ema_decay=1.5"],
        "recipe.ema_decay=1.5: must be in (0, 1)",
    ),
    (
        [*TINY_TRAIN, "--data-path", "two", "--recipe", "mixup_alpha=0.8", "--batch-size", "7"],
        "run.batch_size=7: mixup and CutMix pair each image",
    ),
    (
        ["worker", "--storage", "sqlite:///q.db", "--heartbeat", "inf"],
        "'--heartbeat': 'inf' is not a finite number",
    ),
    (
        [
            "sweep",
            "--protocol",
            str(PROTOCOLS / "smoke.yaml"),
            "--param",
            "optim.lr=float:1e-4:inf",
        ],
        "LOW and HIGH must be finite numbers",
    ),
    # a model that does not fit the data: refused before the run opens, with the --set that fixes it
    (
        [
            *TINY_TRAIN[:3],
            "--dataset",
            "image_folder",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--data-path",
            "two",
        ],
        "num_classes=10: the data has 2 classes; pass --set num_classes=2",
    ),
]


@pytest.mark.parametrize(
    "args, named", CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(CASES)]
)
def test_bad_input_is_one_line_naming_it(workdir, mlflow_store, args, named):
    result = CliRunner().invoke(main, args)
    problems = one_error_problems(result, named)
    assert not problems, f"workbench {' '.join(args)}: {problems}\n{result.output[-1500:]}"
    assert not MlflowClient(mlflow_store).search_runs(
        [e.experiment_id for e in MlflowClient(mlflow_store).search_experiments()]
    ), "a run was opened"
    assert not Path("target.db").exists(), "sync created its target"


def test_status_against_a_dead_server_says_so_and_creates_nothing(workdir, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("WORKBENCH_HEALTH_TIMEOUT", "2")
    result = CliRunner().invoke(main, ["status", "--protocol", str(PROTOCOLS / "smoke.yaml")])
    problems = one_error_problems(result, "127.0.0.1:9 unreachable")
    assert not problems, f"{problems}\n{result.output[-1500:]}"
    assert not (workdir / "offline").exists(), "status created the local fallback store"


def test_sync_takes_a_path_to_an_sqlite_file(workdir, mlflow_store):
    result = CliRunner().invoke(
        main, ["sync", "--from", "mlflow.db", "--to", "sqlite:///target.db", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert (
        f"sync sqlite:///{workdir / 'mlflow.db'} -> sqlite:///target.db (dry run" in result.output
    ), result.output


def test_a_full_disk_names_the_file_and_keeps_the_previous_one(tmp_path, monkeypatch):
    from workbench import atomic

    target = tmp_path / "last.pt"
    target.write_bytes(b"previous checkpoint")

    def short_write(f):  # what torch.save says when the disk fills under it
        f.write(b"partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 16064 vs 15960"
        )

    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 4096})())
    with pytest.raises(OSError) as err:
        atomic.atomic_write(target, short_write)
    assert (
        err.value.errno == errno.ENOSPC
        and one_line(err.value) == f"no space left on device writing {target}"
    )
    assert target.read_bytes() == b"previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"], "a temp file was left"

    def enospc(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.undo()
    with pytest.raises(OSError, match=f"no space left on device writing {target}"):
        atomic.atomic_write(target, enospc)
    assert target.read_bytes() == b"previous checkpoint"


def test_a_full_checkpoint_folder_ends_training_in_one_line(workdir, monkeypatch):
    from workbench import atomic

    real = atomic.atomic_write

    def disk_full_for_checkpoints(path, write, mode=None):
        if Path(path).suffix == ".pt":
            raise atomic.WriteFailed(errno.ENOSPC, f"no space left on device writing {path}")
        return real(path, write, mode)

    monkeypatch.setattr("workbench.train.checkpoint.atomic_write", disk_full_for_checkpoints)
    result = CliRunner().invoke(main, [*TINY_TRAIN, "--data-path", "two", "--output-dir", "out"])
    problems = one_error_problems(result, "no space left on device writing")
    assert not problems and "out/" in result.output and ".pt" in result.output, (
        f"{problems}\n{result.output[-1500:]}"
    )


def test_console_says_where_the_data_came_from_and_the_run_once(workdir):
    first = CliRunner().invoke(main, [*TINY_TRAIN, "--data-path", "two", "--output-dir", "out"])
    assert first.exit_code == 0, first.output
    (data_line,) = [line for line in first.output.splitlines() if line.startswith("data: ")]
    assert data_line.count(" from ") == 1, data_line
    # the defaults, stated
    (split,) = [line for line in first.output.splitlines() if line.startswith("split: ")]
    assert split.startswith(
        "split: 14 train / 2 val, carved from the official training split with split seed 42 "
        "(the default sizes of image_folder; --train-size/--val-size change them); test 4"
    ), split
    again = CliRunner().invoke(main, [*TINY_TRAIN, "--data-path", "two", "--output-dir", "out"])
    (last,) = again.output.strip().splitlines()[-1:]
    assert last.count("skipped") == 1 and last.count("(run ") + last.count("in run ") == 1, last


def test_train_help_states_the_data_defaults():
    from workbench.data import DEFAULT_SIZES

    text = " ".join(CliRunner().invoke(main, ["train", "--help"]).output.split())
    (train_n, val_n) = DEFAULT_SIZES["fashion_mnist"]
    for part in (
        f"fashion_mnist {train_n:,} / {val_n:,}",
        "the seed study's subset, not all 60,000",
        "an image folder without val/: 10% of train/ for validation",
        "[default: fashion_mnist]",
    ):
        assert part in text, f"{part!r} not in train --help: {text}"


def test_figures_block_out_of_range_is_refused_with_the_range(workdir):
    from PIL import Image

    Image.new("RGB", (32, 32), (120, 30, 200)).save("img.png")
    result = CliRunner().invoke(
        main,
        [
            "figures",
            "--timm-model",
            "vit_tiny_patch16_224",
            "--image",
            "img.png",
            "--block",
            "99",
            "--no-log",
            "--output-dir",
            "figs",
        ],
    )
    problems = one_error_problems(
        result, "block 99 does not exist: the model has 12 blocks (give 0 to 11, or -12 to -1"
    )
    assert not problems, f"{problems}\n{result.output[-1500:]}"
    assert not Path("figs").exists()


def test_rows_of_a_model_without_classifier_say_features(tmp_path):
    from workbench.analysis.timm_inspect import _row_labels

    assert _row_labels(torch.randn(2, 384), ["a.png", "b.png"], 0) == [
        "a.png\nfeatures (no classifier)",
        "b.png\nfeatures (no classifier)",
    ]
    assert _row_labels(torch.tensor([[0.0, 5.0]]), ["a.png"], 2)[0].startswith(
        "a.png\npred class 1"
    )


def test_figure_files_are_readable_like_reports(tmp_path):
    from workbench.analysis.common import new_figure, save_png
    from workbench.atomic import current_umask

    save_png(new_figure((1, 1)), tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_mode & 0o777 == 0o666 & ~current_umask()


def test_a_protocol_whose_batch_exceeds_its_training_split_is_refused_at_load():
    from workbench.protocol import ProtocolError, parse_protocol, read_yaml

    raw = read_yaml(PROTOCOLS / "smoke.yaml")
    raw["run"]["batch_size"] = 4000  # train_size is 3200
    with pytest.raises(
        ProtocolError,
        match=r"run\.batch_size=4000: larger than the training split "
        r"\(dataset\.train_size=3200\)",
    ):
        parse_protocol(raw, "smoke.yaml")
    raw["run"]["batch_size"], raw["dataset"]["subset"] = 128, 100
    with pytest.raises(ProtocolError, match=r"run\.batch_size=128: .*\(dataset\.subset=100\)"):
        parse_protocol(raw, "smoke.yaml")
