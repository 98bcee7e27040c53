"""The `workbench` command: lazy help, one-line errors for bad input, a pure library.

Most cases run in process through click's CliRunner (cheap); two run as real processes
(`python -m studies.cli`, each imports torch: ~5 s) to prove that nothing a library logs
or prints brings a traceback back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli_errors import one_error_problems
from data_fixtures import make_image_folder
from studies.cli import LAZY_COMMANDS, main
from workbench.convert.checkpoints import CheckpointError, load_state_dict_file

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = ROOT / "studies" / "protocols"
CUDA = torch.cuda.is_available()


def run_python(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_DEBUG": ""}
    return subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_imports_no_torch_and_no_workbench_module_imports_mlflow_click_or_optuna():
    # one interpreter for both checks (each start costs seconds): help first, then the walk
    code = """
import importlib, pkgutil, sys
from studies.cli import main
for args in (["--help"], ["sync", "--help"]):
    try:
        main(args)
    except SystemExit as e:
        assert e.code == 0, (args, e.code)
print("HEAVY", sorted(m for m in ("torch", "torchvision", "timm", "optuna") if m in sys.modules))
for name in [m for m in sys.modules if m.split(".")[0] in ("mlflow", "click", "optuna", "studies", "tracking")]:
    del sys.modules[name]  # forget what the CLI imported, so the walk below starts clean
import workbench
names = [m.name for m in pkgutil.walk_packages(workbench.__path__, "workbench.")]
for name in names:
    importlib.import_module(name)
print("MODULES", len(names))
print("FORBIDDEN", sorted(m for m in ("mlflow", "click", "optuna") if m in sys.modules))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout, proc.stdout[-500:]
    listing = proc.stdout.split("Commands:")[1].split("--from")[0]
    for name, (_, _, short) in LAZY_COMMANDS.items():
        assert f"  {name} " in listing and short.split()[0] in listing, (
            f"{name} missing from `workbench --help`"
        )
    assert "--recheck" in proc.stdout  # sync's own options were shown
    assert "FORBIDDEN []" in proc.stdout, proc.stdout[-500:]
    # the walk really covered the library
    assert int(proc.stdout.split("MODULES ")[1].split()[0]) > 40


def test_declared_short_help_is_each_commands_own():
    from click import Context

    for name, (_, _, short) in LAZY_COMMANDS.items():
        command = main.get_command(Context(main), name)
        assert command.get_short_help_str(limit=1000) == short, (
            f"LAZY_COMMANDS[{name!r}] drifted from its docstring"
        )


@pytest.fixture
def bad_inputs(tmp_path, mlflow_store, monkeypatch):
    """Bad files of every kind, in the working directory (mlflow_store moved there)."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    Path("random.bin").write_bytes(rng.bytes(3000))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1000)}, "good.safetensors")
    Path("cut.safetensors").write_bytes(Path("good.safetensors").read_bytes()[:2000])
    Path("bad.npz").write_bytes(b"PK\x03\x04 not really a zip")
    make_image_folder(Path("corrupt"), per_class={"train": 3, "test": 1})
    Path("corrupt/train/dog/1.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    make_image_folder(Path("empty_class"), per_class={"train": 3, "test": 1})
    Path("empty_class/train/zebra").mkdir()
    Path("mlflow.db").touch()
    Path("bad_protocol.yaml").write_text("name: x\nseeds: [0]\nnot_a_key: 1\n")
    return tmp_path


DEVICE = (
    []
    if CUDA
    else [
        (["equivalence", "--model", "vit_tiny_patch16_224", "--device", "cuda"], "'cuda'"),
        (["train", "--device", "cuda:0"], "'cuda:0'"),
        (["ablate", "--protocol", str(PROTOCOLS / "smoke.yaml"), "--device", "cuda"], "'cuda'"),
        (
            [
                "transfer",
                "--protocol",
                str(PROTOCOLS / "retina_transfer_smoke.yaml"),
                "--device",
                "cuda",
            ],
            "'cuda'",
        ),
        (
            ["intervene", "--protocol", str(PROTOCOLS / "smoke_heads.yaml"), "--device", "cuda"],
            "'cuda'",
        ),
        (
            [
                "attribute",
                "--protocol",
                str(PROTOCOLS / "smoke_faithfulness.yaml"),
                "--device",
                "cuda",
            ],
            "'cuda'",
        ),
        (["benchmark", "--device", "cuda"], "'cuda'"),
        (["benchmark-loader", "--device", "cuda"], "'cuda'"),
        (["worker", "--storage", "sqlite:///q.db", "--device", "cuda"], "'cuda'"),
    ]
)
CASES = DEVICE + [
    (["equivalence", "--model", "no_such_model"], "no_such_model"),
    (
        ["equivalence", "--model", "vit_tiny_patch16_224", "--weights", "random.bin"],
        "random.bin is not a safetensors file or a torch checkpoint",
    ),
    (
        ["equivalence", "--model", "vit_tiny_patch16_224", "--weights", "cut.safetensors"],
        "cut.safetensors",
    ),
    (
        ["equivalence", "--model", "vit_tiny_patch16_224", "--weights", "missing.safetensors"],
        "missing.safetensors",
    ),
    (["train", "--model", "no_such_model"], "no_such_model"),
    (["train", "--set", "no_such_field=3"], "no_such_field"),
    (["train", "--dataset", "no_such_data"], "no_such_data"),
    (["train", "--dataset", "retinamnist", "--data-path", "bad.npz"], "bad.npz"),
    (["train", "--dataset", "image_folder", "--data-path", "corrupt"], "1.png"),
    (["train", "--dataset", "image_folder", "--data-path", "empty_class"], "train/zebra/"),
    (["train", "--dataset", "image_folder", "--data-path", "no_such_folder"], "no_such_folder"),
    (["ablate", "--protocol", "missing.yaml"], "missing.yaml"),
    (["ablate", "--protocol", "bad_protocol.yaml"], "not_a_key"),
    (["ablate", "--protocol", "bad.npz"], "bad.npz"),
    (["transfer", "--protocol", "missing.yaml"], "missing.yaml"),
    (
        ["intervene", "--protocol", str(PROTOCOLS / "smoke.yaml")],
        "is an ablation protocol, not an intervention protocol",
    ),
    (["intervene", "--protocol", "bad_protocol.yaml"], "not_a_key"),
    (
        ["attribute", "--protocol", str(PROTOCOLS / "smoke.yaml")],
        "is an ablation protocol, not an attribution protocol",
    ),
    (["attribute", "--protocol", "bad_protocol.yaml"], "not_a_key"),
    (
        ["benchmark-intervene", "--protocol", str(PROTOCOLS / "smoke.yaml")],
        "not an intervention protocol",
    ),
    (["report", "--protocol", "missing.yaml"], "missing.yaml"),
    (["figures", "--protocol", "missing.yaml", "--no-log"], "missing.yaml"),
    (
        [
            "figures",
            "--timm-model",
            "vit_tiny_patch16_224",
            "--weights",
            "random.bin",
            "--image",
            "corrupt/train/cat/0.png",
            "--no-log",
        ],
        "random.bin",
    ),
    (["benchmark", "--batch-size", "x"], "'x'"),
    (
        ["sweep", "--protocol", "missing.yaml", "--param", "optim.lr=float:1e-4:1e-2"],
        "missing.yaml",
    ),
    (["sweep", "--protocol", str(PROTOCOLS / "smoke.yaml"), "--param", "lr"], "'lr'"),
    (["worker", "--storage", "no_such_scheme://x"], "no_such_scheme"),
    (["sync", "--from", "sqlite:///mlflow.db", "--to", "http://127.0.0.1:9"], "127.0.0.1:9"),
    (
        [
            "server",
            "start",
            "--backend-store-uri",
            "sqlite:///x.db",
            "--no-auth",
            "--host",
            "0.0.0.0",
        ],
        "--no-auth",
    ),
    (["pin", "no_such_checkpoint"], "no_such_checkpoint"),
]


def test_every_command_answers_bad_input_with_one_line(bad_inputs):
    failures = []
    for args, named in CASES:
        result = CliRunner().invoke(main, args)
        problems = one_error_problems(result, named)
        if problems:
            failures.append(f"workbench {' '.join(args)}: {problems}\n{result.output[-800:]}")
    assert not failures, "\n\n".join(failures)


def test_debug_shows_the_traceback(bad_inputs, monkeypatch):
    result = CliRunner().invoke(
        main, ["--debug", "train", "--dataset", "retinamnist", "--data-path", "bad.npz"]
    )
    assert isinstance(result.exception, ValueError) and "bad.npz" in str(result.exception)
    monkeypatch.setenv("WORKBENCH_DEBUG", "1")
    result = CliRunner().invoke(
        main, ["train", "--dataset", "retinamnist", "--data-path", "bad.npz"]
    )
    assert isinstance(result.exception, ValueError)


@pytest.mark.slow  # 5 to 7 s: the default tier reached 4 min 59 s on a fresh clone (docs/testing.md)
def test_a_real_process_prints_one_line_and_no_traceback(bad_inputs):
    proc = run_python(
        "",
        "-m",
        "studies.cli",
        "equivalence",
        "--model",
        "vit_tiny_patch16_224",
        "--weights",
        "random.bin",
        cwd=bad_inputs,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in output, output[-2000:]
    assert [line for line in output.splitlines() if line.startswith("Error")] == [
        f"Error: random.bin is not a safetensors file or a torch checkpoint "
        f"(its first bytes are {Path(bad_inputs / 'random.bin').read_bytes()[:16].hex(' ')})"
    ], output[-2000:]


def test_weight_files_are_called_what_they_are(tmp_path):
    (tmp_path / "random.pt").write_bytes(np.random.default_rng(1).bytes(500))
    with pytest.raises(
        CheckpointError, match=r"random\.pt is not a safetensors file or a torch checkpoint"
    ):
        load_state_dict_file(tmp_path / "random.pt")
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "good.pt")
    state, _ = load_state_dict_file(tmp_path / "good.pt")
    assert torch.equal(state["w"], torch.arange(1000.0))
    (tmp_path / "cut.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:1500])
    with pytest.raises(CheckpointError, match=r"corrupted or truncated torch file .*cut\.pt"):
        load_state_dict_file(tmp_path / "cut.pt")


def test_readers_of_a_store_that_does_not_exist_say_so_and_create_none(tmp_path, monkeypatch):
    """report, figures and status in a folder where nothing ran: one line each, and no empty mlflow.db left behind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for args in (
        ["report", "--protocol", "nosuch"],
        ["report", "--all"],
        ["figures", "--protocol", "nosuch", "--no-log"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and result.output.count("Error") == 1, result.output
        assert "no MLflow store at sqlite:///mlflow.db" in result.output, result.output
    shown = CliRunner().invoke(main, ["status", "--protocol", str(PROTOCOLS / "smoke.yaml")])
    assert (
        shown.exit_code == 0
        and "never run here (no MLflow store at sqlite:///mlflow.db)" in shown.output
    ), shown.output
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow  # a fresh interpreter and a report: 8-16 s; keeps the default tier under 5 minutes (docs/testing.md)
def test_report_by_name_in_a_fresh_process_creates_no_store(tmp_path):
    """As a user runs it: a fresh process (no MLflow URI left set by another test) in an empty folder.

    A report by protocol name first asks whether the store holds an intervention or attribution
    study of that name; that question once opened (and so created) an empty mlflow.db here.
    """
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run(
        [sys.executable, "-m", "studies.cli", "report", "--protocol", "nosuch"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 1
        and "no MLflow store at sqlite:///mlflow.db" in done.stderr + done.stdout
    ), done
    assert sorted(p.name for p in tmp_path.iterdir()) == [], sorted(
        p.name for p in tmp_path.iterdir()
    )


@pytest.mark.slow  # a fresh interpreter that imports timm: seconds idle, 28 s under a loaded machine
def test_a_closed_pipe_ends_the_listing_quietly():
    # `workbench models --timm '*' | head -1` printed "Error: [Errno 32] Broken pipe" after the line
    proc = subprocess.Popen(
        [sys.executable, "-m", "studies.cli", "models", "--timm", "*"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and first.strip(), (proc.returncode, first)
    assert err == "", f"stderr after the reader left: {err!r}"
