"""The HTML report opens in a real browser (headless Chromium): tables render, figures decode."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from test_report import store  # noqa: F401  (fixture)
from test_report_interventions import logged  # noqa: F401  (fixture)
from test_report_transfer import transfer_store  # noqa: F401  (fixture)

from reports.build import build_report

BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="headless Chromium not installed (Debian: apt-get install chromium); CI installs it",
)
# No network, no first-run work, no GPU: a browser that only renders one local file.
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
    "--hide-scrollbars",
]
# Appended to a copy of the report (the report itself carries no script): after load, write
# what the page holds into the DOM, so --dump-dom shows what the browser made of it.
PROBE = """<script>
window.addEventListener("load", () => {
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    images: [...document.images].map(i => [i.naturalWidth, i.naturalHeight, i.complete]),
    tables: document.querySelectorAll("table").length,
    rows: [...document.querySelectorAll("tbody tr")].map(r => r.cells[0].textContent),
    headings: [...document.querySelectorAll("h2")].map(h => h.textContent),
    quotes: [...document.querySelectorAll("blockquote")].map(q => q.textContent),
    links: [...document.querySelectorAll("a")].map(a => a.getAttribute("href")),
    overflow: document.documentElement.scrollWidth > window.innerWidth + 1,
  });
  document.body.appendChild(out);
});
</script>
</body>"""


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    return subprocess.run(
        [BROWSER, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def probe(tmp_path, html: str) -> dict:
    """What Chromium made of the page: images (size, loaded), tables, first cells of rows, h2 headings."""
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(html.replace("</body>", PROBE, 1))
    done = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe_page.as_uri())
    match = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.DOTALL)
    assert match, f"no probe output; chromium exit {done.returncode}:\n{done.stderr[-2000:]}"
    return json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.slow  # moved from the default tier to keep it under 5 min (docs/testing.md)
def test_html_report_renders_tables_and_figures_in_chromium(store, tmp_path):  # noqa: F811 (fixture)
    result = build_report(str(store.protocol_path), tmp_path / "out", log=False)
    page = probe(tmp_path, result.html.read_text())
    assert len(page["images"]) == 7 and all(
        w > 0 and h > 0 and ok for w, h, ok in page["images"]
    ), page["images"]
    # results, configuration x 2, accuracy, comparisons, per-class and predicted-class counts for
    # val and test, calibration x 3 (per cell, per arm, seed-paired differences), cost,
    # convergence, runs
    assert page["tables"] == 18, page
    assert page["headings"] == [
        "Warnings",
        "Results",
        "Configuration",
        "Accuracy",
        "Seed-paired comparisons",
        "Per-class accuracy",
        "Calibration",
        "Compute cost",
        "Training curves",
        "Runs",
    ], page["headings"]
    assert page["rows"].count("vit (reference)") == 3 and page["rows"].count("cnn − vit") == 4, (
        page["rows"]
    )
    assert len(page["quotes"]) == 4 and all(
        "ahead in" in q and "t-interval" in q for q in page["quotes"]
    ), page["quotes"]
    assert not page["overflow"], "the page scrolls sideways: a wide table escaped its scroll box"

    shot = tmp_path / "shot.png"
    done = chromium(
        tmp_path, "--window-size=1200,2400", f"--screenshot={shot}", result.html.as_uri()
    )
    assert shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (2400, 1200), pixels.shape
    dark = (pixels.sum(axis=2) < 300).mean()  # text, table rules, plot lines
    assert 0.005 < dark < 0.5, f"screenshot looks blank or broken: {dark:.4f} of pixels dark"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, (
        "screenshot has almost no colours: figures missing?"
    )
    # The title sits in the top-left corner; without any system font Chromium draws no text
    # at all (figures still show, their text is in the PNG), so check that text was drawn.
    title = (pixels[:150, :800].sum(axis=2) < 300).mean()
    assert title > 0.01, (
        f"no text rendered in the title area ({title:.4f} dark): Chromium found no font; "
        "install one (Debian: fonts-dejavu-core or fonts-liberation)"
    )


@pytest.mark.slow  # a transfer study and Chromium (about 20 s idle); the ablation page stays in the default tier
def test_transfer_html_report_renders_in_chromium(transfer_store, tmp_path):  # noqa: F811 (fixture)
    result = build_report(
        str(transfer_store["path"]), tmp_path / "out", n_resamples=1000, log=False
    )
    page = probe(tmp_path, result.html.read_text())
    assert len(page["images"]) == 3 and all(
        w > 0 and h > 0 and ok for w, h, ok in page["images"]
    ), page["images"]
    # configuration x 2, per cell, per class, predicted-class counts, over seeds, paired differences, cost, runs
    assert page["tables"] == 9, page
    assert page["headings"] == [
        "Warnings",
        "Results",
        "Configuration",
        f"Transfer study tiny_transfer@{transfer_store['protocol'].short_hash}",
        "Compute cost",
        "Confusion matrices",
        "Training curves",
        "Calibration",
        "Runs",
    ], page["headings"]
    assert (
        page["rows"].count("full_ft − linear_probe") == 3
        and page["rows"].count("linear_probe") == 8
    ), page["rows"]
    assert (
        len(page["quotes"]) == 1
        and "t-interval" in page["quotes"][0]
        and "bootstrap" in page["quotes"][0]
    )
    assert not page["overflow"], "the page scrolls sideways: a wide table escaped its scroll box"
    shot = tmp_path / "shot.png"
    done = chromium(
        tmp_path, "--window-size=1200,2400", f"--screenshot={shot}", result.html.as_uri()
    )
    assert shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    dark = (pixels.sum(axis=2) < 300).mean()
    assert 0.005 < dark < 0.5, f"screenshot looks blank or broken: {dark:.4f} of pixels dark"


def test_intervention_html_report_renders_in_chromium(logged, tmp_path):  # noqa: F811 (fixture)
    result = build_report(str(logged["path"]), tmp_path / "out", n_resamples=1000, log=False)
    page = probe(tmp_path, result.html.read_text())
    assert len(page["images"]) == 3 and all(
        w > 0 and h > 0 and ok for w, h, ok in page["images"]
    ), page["images"]
    assert page["tables"] == 4, page  # ranked, seed consistency, runs, acted-on models
    assert page["headings"] == [
        "Results",
        "Heads (vit)",
        "Every intervention, ranked (vit)",
        "Branches, positions and tokens (vit)",
        "Seed consistency (vit)",
        "Attention maps beside the effects (vit)",
        "Runs",
    ], page["headings"]
    assert len(page["quotes"]) == 3 and all(
        "t-interval" in q and "bootstrap" in q for q in page["quotes"]
    )
    assert "`blocks.1.mlp.skip`" not in page["rows"] and page["rows"][:3] == ["1", "2", "3"], page[
        "rows"
    ][:5]
    assert not page["overflow"], "the page scrolls sideways: a wide table escaped its scroll box"
