"""The study as a user meets it: a real `mlflow server`, the experiment page in headless Chromium, no password printed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import ServerProcess, free_port, mlflow_server
from test_ablate_record import PROTOCOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real server and Chromium, 30 s
ROOT = Path(__file__).resolve().parent.parent
BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-extensions",
]
PASSWORD = "pw-7Hq2-never-printed"
# seconds for a page or the UI's start: about 30 on 2 idle cores, minutes under load
PAGE_TIMEOUT = 600


def test_experiment_page_lists_the_parent_and_its_cells_and_no_password_is_printed(tmp_path):
    if BROWSER is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "rec.yaml"
    path.write_text(PROTOCOL.format(name="rec", epochs=1, seeds="[0, 1]"))
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        # A server without auth ignores the credentials; what matters is that they never get printed.
        secret_uri = url.replace("http://", f"http://user:{PASSWORD}@")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": secret_uri,
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        }
        env.pop("MLFLOW_RUN_ID", None)
        env.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "studies.cli",
                "ablate",
                "--protocol",
                str(path),
                "--allow-dirty",
                "--data-path",
                str(folder),
                "--device",
                "cpu",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert PASSWORD not in output, [line for line in output.splitlines() if PASSWORD in line][
            :3
        ]
        status = subprocess.run(
            [sys.executable, "-m", "studies.cli", "status", "--protocol", str(path)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert status.returncode == 0 and PASSWORD not in status.stdout + status.stderr, (
            status.stdout + status.stderr
        )

        client = MlflowClient(url)
        exp = client.get_experiment_by_name("rec")
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
        (parent,) = client.search_runs([exp.experiment_id], "tags.parent = 'true'")
        # The address ablate prints opens on the runs list, not on MLflow 3.17's GenAI overview
        # (whose choice follows the workflowType parameter, not the experiment's kind tag).
        printed = re.search(r"^MLflow UI \(runs of this study\): (\S+)$", output, re.M)
        assert printed, output[-3000:]
        assert (
            printed.group(1)
            == f"{url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        )
        dom = text_of(open_page(tmp_path, printed.group(1)))
        assert parent.info.run_name in dom, (
            f"parent {parent.info.run_name} not on the experiment page:\n{dom[:3000]}"
        )
        # The runs page of the model-training views ("Runs - Experiment N"), not "Overview" or "Traces".
        assert (
            dom.strip().startswith(f"Runs - Experiment {exp.experiment_id}")
            and "3 matching runs" in dom
        ), dom[:3000]
        assert (
            "(" + printed.group(1).replace("/runs?", f"/runs/{parent.info.run_id}?") + ")"
            in status.stdout
        )
        # The cells sit under their parent (collapsed in the list); the parent's page names them, and its description.
        page = text_of(
            open_page(
                tmp_path, f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
            )
        )
        children = re.search(r"Child runs (.*?) Source", page)
        assert children and sorted(children.group(1).split(" , ")) == ["vit-seed0", "vit-seed1"], (
            page[:3000]
        )
        assert "one-arm protocol for record tests" in page and "cells 2" in page, page[:3000]
        assert re.search(r"Created by \S+", page) and "Created by —" not in page, page[:3000]


TWO_ARMS = PROTOCOL.replace(
    "description: one-arm protocol for record tests", "description: two-arm protocol for the UI"
).replace(
    "  - {{name: vit, reference: true}}\n",
    "  - {{name: vit, reference: true}}\n  - {{name: wide, overrides: {{model: {{dim: 32}}}}}}\n",
)


def test_the_parent_run_page_shows_the_reports_comparison(tmp_path):
    """After `workbench report`, the parent's page in the UI shows the stated result and the cmp.* metrics."""
    if BROWSER is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "ui2.yaml"
    path.write_text(TWO_ARMS.format(name="ui2", epochs=1, seeds="[0, 1]"))
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": url,
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        }
        env.pop("MLFLOW_RUN_ID", None)
        for args in (
            [
                "ablate",
                "--protocol",
                str(path),
                "--allow-dirty",
                "--data-path",
                str(folder),
                "--device",
                "cpu",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            [
                "report",
                "--protocol",
                str(path),
                "--out-dir",
                str(tmp_path / "reports"),
                "--resamples",
                "200",
            ],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "studies.cli", *args],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "the report's 2 comparisons as metrics (cmp.*)" in done.stdout, done.stdout
        client = MlflowClient(url)
        exp = client.get_experiment_by_name("ui2")
        (parent,) = client.search_runs([exp.experiment_id], "tags.parent = 'true'")
        md = (tmp_path / "reports" / "ui2" / "report.md").read_text()
        stated = next(
            line[2:]
            for line in md.splitlines()
            if line.startswith("> On validation, wide minus vit")
        )
        address = f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning"
        # report prints the parent's page
        assert f"in the MLflow UI: {address}" in done.stdout, done.stdout
        page = text_of(open_page(tmp_path, address))
        assert "Description Results of the report: ui2@" in page, page[:3000]
        # The page shows the description's first result (collapsed after it) and every cmp.* metric of the run.
        assert " ".join(stated.split())[:60] in page, (stated, page[:3000])
        # as JavaScript prints it
        shown = repr(parent.data.metrics["cmp.wide_vs_vit.val.mean_diff"]).removesuffix(".0")
        assert f"cmp.wide_vs_vit.val.mean_diff {shown}" in page, page[:4000]


def test_make_ui_opens_on_each_arms_mean_interval_and_difference(tmp_path):
    """`make run`, `workbench report`, `make ui` on the embedded store: the printed address shows the answer, one row per arm.

    The screenshot is left at ``<tmp_path>/ui_runs_page.png`` (docs/figures/mlflow_runs_answer.png is one).
    """
    if BROWSER is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "answer.yaml"
    path.write_text(TWO_ARMS.format(name="answer", epochs=1, seeds="[0, 1, 2]"))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": store,
        "OMP_NUM_THREADS": "1",
        "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("MLFLOW_RUN_ID", None)
    for args in (
        ["ablate", "--protocol", str(path), "--allow-dirty", "--data-path", str(folder)]
        + ["--device", "cpu", "--output-dir", str(tmp_path / "out")],
        ["report", "--protocol", str(path), "--out-dir", str(tmp_path / "reports")]
        + ["--resamples", "200"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "studies.cli", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "one summary run per arm (2: mean, 95% interval, difference to vit)" in done.stdout, (
        done.stdout
    )
    answer_page_checks(tmp_path, store, env)


def answer_page_checks(tmp_path: Path, store: str, env: dict) -> None:
    """`make ui` on the store of the study `answer` after its report: the page its address opens, and the bare runs page."""
    # What `make ui` prints before it starts the UI (the Makefile's command, on this store and port).
    ui = f"http://127.0.0.1:{free_port()}"
    printed = subprocess.run(
        [sys.executable, "-m", "tracking.store.ui_links", store, ui],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    found = re.search(r"^runs of answer \(the answer: one row per arm\): (\S+)$", printed, re.M)
    assert found, printed
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("answer")
    rows = {
        r.info.run_id: r.data.tags["summary_arm"]
        for r in client.search_runs([exp.experiment_id], "tags.summary_of != ''")
    }
    assert sorted(rows.values()) == ["vit", "wide"], rows
    report = report_numbers((tmp_path / "reports" / "answer" / "report.md").read_text())
    server = ServerProcess(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store]
        + ["--host", "127.0.0.1", "--port", ui.rsplit(":", 1)[1], "--workers", "1"],
        {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        int(ui.rsplit(":", 1)[1]),
        tmp_path / "mlflow-ui.log",
    )
    server.start(timeout=PAGE_TIMEOUT)
    try:
        shot = tmp_path / "ui_runs_page.png"
        dom = open_page(tmp_path, found.group(1), screenshot=shot)
        (tmp_path / "fresh").mkdir()
        bare = open_page(
            tmp_path / "fresh",
            f"{ui}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning",
        )
    finally:
        server.stop()
    assert shot.stat().st_size > 20_000, shot.stat()
    grid = grid_rows(dom)
    shown = {rows[i]: cells for i, cells in grid.items() if i in rows}
    assert sorted(shown) == ["vit", "wide"], (grid, text_of(dom)[:3000])
    # Best mean first, as the address sorts them.
    order = [rows[i] for i in grid if i in rows]
    means = [float(shown[a]["metrics.`val.acc`"]) for a in order]
    assert means == sorted(means, reverse=True), (order, means)
    # Each number on the page equals the report's (2 decimals): the Accuracy table and the Results table.
    worst, pairs = 0.0, []
    for arm, cells in shown.items():
        expected = report[arm]
        for key, value in expected.items():
            on_page = cells.get(f"metrics.`val.{key}`", "missing")
            pairs.append((arm, key, on_page, value))
            worst = max(
                worst, abs(float(on_page) - value) if on_page not in ("missing", "-") else 1e9
            )
        if arm == "vit":  # the reference: no difference to itself
            assert all(cells[f"metrics.`val.diff{k}`"] == "-" for k in ("", ".low", ".high")), cells
    assert worst <= 1e-9, f"page and report differ by up to {worst}: {pairs}"
    text = text_of(dom)
    assert "lease." not in text and not any("lease." in c for r in grid.values() for c in r), text[
        :3000
    ]
    assert "Created" in text and "val.diff.high" in text and "2 matching runs" in text, text[:3000]
    # The bare runs address shows no answer: the checks above fail on it (rows, but none of the columns).
    plain = grid_rows(bare)
    assert plain and not any("val." in c for r in plain.values() for c in r), plain


def report_numbers(md: str) -> dict[str, dict[str, float]]:
    """Each arm's validation numbers as report.md states them: n, mean and t-interval, difference and t-interval."""
    section = md.split("\n## Accuracy\n", 1)[1].split("\n### Validation\n", 1)[1].split("\n#", 1)[0]
    out: dict[str, dict[str, float]] = {}
    for cells in table_rows(section):
        if cells[1].endswith(" of 3"):
            low, high = cells[3].removesuffix(" ⚠").strip("[]").split(", ")  # ⚠: zero width
            out[cells[0].removesuffix(" (reference)")] = {
                "n": float(cells[1].split(" of ")[0]),
                "acc": float(cells[2]),
                "acc.low": float(low),
                "acc.high": float(high),
            }
    results = md.split("\n## Results\n", 1)[1].split("\n### Validation\n", 1)[1].split("\n#", 1)[0]
    for cells in table_rows(results):
        a, _, b = cells[0].partition(" − ")
        if b == "vit":
            low, high = cells[2].strip("[]").split(", ")
            out[a] |= {"diff": float(cells[1]), "diff.low": float(low), "diff.high": float(high)}
    return out


def table_rows(markdown: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("|") and not set(line) <= set("|-: ")
    ]


def grid_rows(dom: str) -> dict[str, dict[str, str]]:
    """The runs table as the page shows it: run id -> column id -> text, in the order of the rows on screen."""
    rows: dict[str, dict[str, str]] = {}
    found = re.finditer(
        r'<div[^>]*role="row"[^>]*row-index="(\d+)"[^>]*row-id="([^"]+)"[^>]*>(.*?)(?=<div[^>]*role="row"|$)',
        dom,
        re.S,
    )
    for m in sorted(found, key=lambda m: int(m.group(1))):
        cells = rows.setdefault(m.group(2), {})
        for c in re.finditer(
            r'<div[^>]*role="gridcell"[^>]*col-id="([^"]+)"[^>]*>(.*?)(?=<div[^>]*role="gridcell"|$)',
            m.group(3),
            re.S,
        ):
            cells[c.group(1)] = text_of(c.group(2)).strip()
    return rows


def text_of(dom: str) -> str:
    text = re.sub(r"<style.*?</style>|<script.*?</script>", "", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))


def open_page(tmp_path: Path, page: str, screenshot: Path | None = None) -> str:
    """The DOM after the single-page app has loaded its data (virtual time lets its requests finish).

    With ``screenshot``, a 1920 x 1000 picture of the page is written there too.
    """
    shot = [f"--screenshot={screenshot}", "--window-size=1920,1000"] if screenshot else []
    return subprocess.run(
        [
            BROWSER,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=30000",
            *shot,
            "--dump-dom",
            page,
        ],
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT,
    ).stdout
