"""notebooks/colab_t4.ipynb executed top to bottom in a real Jupyter kernel against a local basic-auth server.

The remote flow is proven here apart from the GPU itself. The notebook's cells run as the
user sees them (``!`` lines in the shell, as in Colab); what cannot exist on this machine is
adapted in two places only, both in this file:

- ``PREAMBLE``, a cell put before the notebook's first: ``torch.cuda`` reports a CPU
  stand-in, so the GPU check's assert and print run; and a ``!`` line that exits non-zero
  fails its cell (Colab only prints it, which would let a failed worker pass unseen).
- ``substitutions()``, textual replacements, each required to match: ``/content`` is a temp
  folder; REPO_URL is a local clone of this checkout's HEAD plus one commit adding the tiny
  protocols below, so the clone cell really clones; ``pip install -e .`` is skipped (the
  project is already installed, editable, in the venv running the kernel: installing the
  clone would repoint that shared venv to a temp folder); ``--device cuda`` becomes
  ``--device cpu``; 4b runs the tiny protocol ``colab_here`` instead of smoke.yaml, and 4c a
  tiny transfer protocol whose source is a cell the worker trained (the pinned ViT-B/16
  cannot be downloaded here).

Around it: ``google.colab`` is tests/colab_stub (``userdata.get`` reads the secrets the test
wrote: server URL, the notebook's account, a journal queue URL; ``drive.mount`` makes a local
folder); ``nvidia-smi`` is a shim on PATH; CIFAR-10 is a tiny JPEG copy in
``$WORKBENCH_DATA_DIR``. The "main machine" (the test, as alice) queues ``colab_queue`` with
``ablate --storage`` and the admin grants the notebook's account EDIT on it, as docs/server.md
says. The server is stopped before 4b, which therefore logs offline, and started again
before 4c, so the sync cell copies real runs and the Drive copy is made.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from data_fixtures import CIFAR_CLASSES, make_image_folder
from servers import Launcher, free_port, isolated_tracking  # noqa: F401 (fixture)
from studies.ablation.ablate import ablate
from studies.cli import main as workbench
from studies.tools.server import server as server_command
from tracking.server import server_config
from tracking.server.server_process import RUNTIME_ENV

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "colab_t4.ipynb"
ADMIN = ("admin", "notebook-admin-Passw0rd")
COLAB = ("colab", "colab-notebook-Passw0rd")  # the notebook's account, from its secrets
ALICE = ("alice", "alice-main-machine-Passw0rd")  # the main machine that queues the cells

TINY_ABLATION = """\
name: {name}
description: two tiny cells for the Colab notebook's test (tests/test_colab_notebook.py)
dataset: {{name: cifar10, train_size: 30, val_size: 10, split_seed: 0}}
model: {{name: cifar_vit, image_size: 16, patch_size: 8, dim: 16, depth: 1, heads: 2}}
optim: {{lr: 0.003}}
run: {{epochs: 1, batch_size: 8}}
arms:
  - {{name: vit, reference: true}}
seeds: [0, 1]
"""
TINY_TRANSFER = """\
name: colab_transfer
description: a tiny linear probe of a cell the notebook's worker trained (tests/test_colab_notebook.py)
source: {weights: "protocol:colab_queue/vit/seed0"}
dataset: {name: cifar10, train_size: 30, val_size: 10, split_seed: 0}
run: {batch_size: 8, eval_batch_size: 64}
evaluation: {n_resamples: 1000}
regimes:
  - {name: linear_probe, kind: linear, reference: true, epochs: 2, lr: 3.0e-3}
seeds: [0]
"""

PREAMBLE = '''\
# Injected by tests/test_colab_notebook.py (not part of the notebook).
import torch
torch.cuda.is_available = lambda: True  # the GPU check on CPU; the commands run with --device cpu
torch.cuda.get_device_name = lambda device=None: "CPU stand-in (no GPU in this test)"
torch.cuda.is_bf16_supported = lambda *args, **kwargs: False

_shell = get_ipython()
_system = _shell.system


def _checked_system(command):
    """A `!` line that exits non-zero fails its cell (Colab would only print its output)."""
    _system(command)
    if _shell.user_ns.get("_exit_code"):
        raise RuntimeError(f"shell line exited {_shell.user_ns['_exit_code']}")


_shell.system = _checked_system
'''

NVIDIA_SMI = """\
#!/bin/sh
# Stands in for the driver's nvidia-smi on a machine without a GPU (tests/test_colab_notebook.py).
echo "name, memory.total [MiB], driver_version"
echo "CPU stand-in (no GPU in this test), 0 MiB, none"
"""


def substitutions(content: Path, origin: Path) -> list[tuple[str, str]]:
    """Every change to the notebook's text, in one place: (old, new); each old text must occur."""
    return [
        ("/content", str(content)),
        ("https://github.com/YOUR-USER/glassbox-vit-workbench.git", str(origin)),
        (
            "!pip install -q -e .",
            '!echo "(test) pip install -e . skipped: the venv running this kernel holds the project"',
        ),
        ("--device cuda", "--device cpu"),
        (
            'PROTOCOL = "studies/protocols/smoke.yaml"',
            'PROTOCOL = "studies/protocols/colab_here.yaml"',
        ),
        ("studies/protocols/retina_transfer.yaml", "studies/protocols/colab_transfer.yaml"),
    ]


def adapted_notebook(content: Path, origin: Path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for old, new in substitutions(content, origin):
        hits = sum(cell.source.count(old) for cell in nb.cells if cell.cell_type == "code")
        assert hits, f"{old!r} is no longer in the notebook: update substitutions() in this test"
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = cell.source.replace(old, new)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PREAMBLE))
    return nb


def local_origin(tmp_path: Path) -> Path:
    """A clone of this checkout's HEAD with the tiny protocols committed, on branch main (the notebook's REF)."""
    origin = tmp_path / "origin"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(origin)], check=True)
    git = ["git", "-C", str(origin), "-c", "user.name=test", "-c", "user.email=test@example.org"]
    subprocess.run([*git, "checkout", "-q", "-B", "main"], check=True)
    protocols = origin / "studies" / "protocols"
    for name in ("colab_queue", "colab_here"):
        (protocols / f"{name}.yaml").write_text(TINY_ABLATION.format(name=name))
    (protocols / "colab_transfer.yaml").write_text(TINY_TRANSFER)
    subprocess.run([*git, "add", "studies/protocols"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tiny protocols for the notebook test"], check=True)
    return origin


def kernel_environment(tmp_path: Path, secrets: dict) -> dict:
    """What the Colab VM's kernel would see: nothing from the caller's MLflow or workbench settings."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "nvidia-smi").write_text(NVIDIA_SMI)
    (shims / "nvidia-smi").chmod(0o755)
    secrets_file = tmp_path / "colab-secrets.json"
    secrets_file.write_text(json.dumps(secrets))
    secrets_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WORKBENCH_"))}
    venv_bin = str(Path(sys.executable).parent)
    return {
        **env,
        "PATH": os.pathsep.join([str(shims), venv_bin, env.get("PATH", "")]),
        "PYTHONPATH": str(ROOT / "tests" / "colab_stub"),
        "COLAB_STUB_SECRETS": str(secrets_file),
        "WORKBENCH_DATA_DIR": str(tmp_path / "data"),
        "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
    }


def output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join([out.ename, out.evalue, *out.traceback]))
        else:
            parts.extend(str(v) for v in out.get("data", {}).values())
    return "".join(parts)


def run_notebook(nb, cwd: Path, env: dict, before: dict) -> list[tuple[str, float, str]]:
    """Execute every cell in one kernel; ``before[text]`` runs before the cell containing ``text``.

    Returns (source, seconds, output) per code cell; a cell that raises fails the test
    with its output (nbclient's CellExecutionError).
    """
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    done = []
    try:
        with client.setup_kernel(env=env):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                for text, action in before.items():
                    if text in cell.source:
                        action()
                start = time.monotonic()
                client.execute_cell(cell, index)
                done.append((cell.source, time.monotonic() - start, output_text(cell)))
    finally:
        # what each cell printed, to read when the test fails
        nbformat.write(nb, cwd / "executed.ipynb")
    return done


def auth_server(tmp_path: Path) -> Launcher:
    """``workbench server start`` with basic-auth (not started yet); SQLite for runs and users."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WORKBENCH_"))}
    env |= {
        server_config.ADMIN_USER_ENV: ADMIN[0],
        server_config.ADMIN_PASSWORD_ENV: ADMIN[1],
        RUNTIME_ENV: str(tmp_path / "run"),
        "OMP_NUM_THREADS": "1",
    }
    return Launcher(
        [
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/server-runs.db",
            "--auth-db-uri",
            f"sqlite:///{tmp_path}/server-users.db",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--port",
            str(free_port()),
            "--workers",
            "1",
        ],
        env,
        tmp_path / "launcher.log",
    )


def as_account(monkeypatch, account: tuple[str, str]) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", account[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", account[1])


def prepare_server_and_queue(url: str, origin: Path, queue: str, monkeypatch) -> str:
    """The README's "before you start" and docs/server.md's workers section; returns the queue's parent run id.

    The admin adds the notebook's account and alice; alice (the main machine, in a checkout of
    the same commit) queues colab_queue's cells; the notebook's account may not work on them
    yet; the admin grants it EDIT on alice's experiment.
    """
    runner = CliRunner()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv(server_config.ADMIN_USER_ENV, ADMIN[0])
    monkeypatch.setenv(server_config.ADMIN_PASSWORD_ENV, ADMIN[1])
    for account in (COLAB, ALICE):
        monkeypatch.setenv("WORKBENCH_NEW_USER_PASSWORD", account[1])
        added = runner.invoke(server_command, ["add-user", account[0]])
        assert added.exit_code == 0, added.output
    as_account(monkeypatch, ALICE)
    monkeypatch.chdir(origin)
    queued = runner.invoke(
        ablate, ["--protocol", "studies/protocols/colab_queue.yaml", "--storage", queue]
    )
    assert queued.exit_code == 0 and "queued 2 cells" in queued.output, queued.output
    # Without the grant the notebook's worker is refused in one line that says what to do.
    as_account(monkeypatch, COLAB)
    # through `workbench` itself: tracking/ raises plain errors, the CLI says them in one line
    refused = runner.invoke(
        workbench,
        [
            "worker",
            "--storage",
            queue,
            "--device",
            "cpu",
            "--data-path",
            str(origin.parent / "data"),
            "--output-dir",
            str(origin.parent / "refused"),
        ],
    )
    assert refused.exit_code == 1 and refused.output.strip().splitlines() == [
        f"Error: MLflow tracking server {url} does not let account 'colab' write to experiment 'colab_queue' (id 1), "
        "which another account created (HTTP 403). If it is your team's study, the account that created it "
        "has it shared with you (docs/server.md, section 2); otherwise give your protocol another name: an "
        "experiment another account holds is not yours to use"
    ], refused.output
    as_account(monkeypatch, ADMIN)
    granted = runner.invoke(
        server_command, ["grant", COLAB[0], "colab_queue", "--permission", "EDIT"]
    )
    assert granted.exit_code == 0, granted.output
    return re.search(r"queued 2 cells in .*; parent run ([0-9a-f]{32})\.", queued.output).group(1)


def output_of(cells: list[tuple[str, float, str]], text: str) -> str:
    (out,) = [out for source, _, out in cells if text in source]
    return out


def check_study(client: MlflowClient, protocol: str, creator: str) -> str:
    """Both cells FINISHED, logged by the notebook's account, under one FINISHED parent made by ``creator``."""
    exp = client.get_experiment_by_name(protocol)
    assert exp is not None, f"no experiment {protocol} on the server"
    runs = client.search_runs([exp.experiment_id], filter_string="tags.cell = 'true'")
    assert sorted(r.data.tags["seed"] for r in runs) == ["0", "1"], (
        protocol,
        [r.data.tags for r in runs],
    )
    assert {r.info.status for r in runs} == {"FINISHED"}, (protocol, [r.info.status for r in runs])
    assert {r.data.tags["mlflow.user"] for r in runs} == {COLAB[0]}, protocol
    (parent_id,) = {r.data.tags["mlflow.parentRunId"] for r in runs}
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED", (protocol, parent.info.status)
    assert parent.data.tags["mlflow.user"] == creator, (protocol, parent.data.tags["mlflow.user"])
    return parent_id


@pytest.mark.slow
@pytest.mark.integration
def test_the_colab_notebook_runs_top_to_bottom_against_a_basic_auth_server(
    tmp_path, isolated_tracking, monkeypatch
):
    origin, content, queue = (
        local_origin(tmp_path),
        tmp_path / "content",
        f"journal:{tmp_path / 'queue.log'}",
    )
    content.mkdir()
    make_image_folder(
        tmp_path / "data" / "cifar10-jpg",
        classes=CIFAR_CLASSES,
        per_class={"train": 4, "test": 2},
        fmt="jpg",
        size=16,
    )
    server = auth_server(tmp_path)
    kernel_env = kernel_environment(
        tmp_path,
        {
            "MLFLOW_TRACKING_URI": server.url,
            "MLFLOW_TRACKING_USERNAME": COLAB[0],
            "MLFLOW_TRACKING_PASSWORD": COLAB[1],
            "WORKBENCH_QUEUE_URL": queue,
        },
    )
    nb = adapted_notebook(content, origin)
    server.start()
    try:
        queue_parent = prepare_server_and_queue(server.url, origin, queue, monkeypatch)
        started = time.monotonic()
        # The server goes away for 4b (which then logs offline) and is back for 4c and the sync.
        cells = run_notebook(
            nb,
            content,
            kernel_env,
            {"workbench ablate": server.stop, "workbench transfer": server.start},
        )
        timing = ", ".join(
            f"{source.splitlines()[0][:24]!r} {seconds:.0f} s" for source, seconds, _ in cells
        )
        print(f"notebook: {time.monotonic() - started:.0f} s ({timing})")

        every_output = "".join(out for _, _, out in cells)
        for secret in (COLAB[1], ALICE[1], ADMIN[1]):
            assert secret not in every_output, "a password in a cell's output"
        head = subprocess.run(
            ["git", "-C", str(origin), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert head in output_of(cells, "git clone"), (
            "the clone cell did not check out the local origin's HEAD"
        )
        assert "CPU stand-in" in output_of(cells, "nvidia-smi")
        assert "reachable, credentials accepted" in output_of(cells, "server check")
        assert "worker ran 2 cells (0 already finished, 0 failed, 0 lost" in output_of(
            cells, "workbench worker"
        )
        assert output_of(cells, "workbench ablate").count("[logged locally") == 2, (
            "4b did not log offline"
        )
        synced = output_of(cells, "workbench sync")
        assert "runs: 3 created" in synced and "; 0 errors" in synced and "ERROR" not in synced, (
            synced
        )
        drive_copy = content / "drive" / "MyDrive" / "workbench" / "mlflow-offline" / "mlflow.db"
        assert drive_copy.is_file(), "the last cell kept no copy of the offline store on Drive"

        client = MlflowClient(server.url)
        # 4a: alice's queue, drained
        assert check_study(client, "colab_queue", creator=ALICE[0]) == queue_parent
        check_study(client, "colab_here", creator=COLAB[0])  # 4b: run offline here, then synced
        transfer = client.search_runs(
            [client.get_experiment_by_name("colab_transfer").experiment_id]
        )
        # parent + 1 cell
        assert len(transfer) == 2 and {r.info.status for r in transfer} == {"FINISHED"}, transfer
        assert {r.data.tags["mlflow.user"] for r in transfer} == {COLAB[0]}
        for exp in client.search_experiments():  # no credential recorded on any run
            for run in client.search_runs([exp.experiment_id]):
                for value in [*run.data.params.values(), *run.data.tags.values()]:
                    assert not any(secret in value for secret in (COLAB[1], ALICE[1], ADMIN[1])), (
                        run.info.run_id
                    )
    finally:
        server.stop()
