"""Code identity from the import closure: a change in any module the result code imports moves the
right kinds' fingerprints; a comment or docstring there moves none."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tracking.kinds.attribution_runs import attribution_fingerprint
from tracking.kinds.intervention_runs import intervention_fingerprint
from tracking.kinds.transfer_runs import transfer_fingerprint
from workbench.code_history import (
    SAME_CODE,
    current_name,
    folder_fingerprints,
    older_names,
    same_code,
)
from workbench.train.fingerprint import (
    PROJECT_PACKAGES,
    code_fingerprint,
    import_closure,
    imported_names,
)

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = {"torch": "2.0", "timm": "1.0"}
KINDS = {
    "training": code_fingerprint,
    "transfer": transfer_fingerprint,
    "intervention": intervention_fingerprint,
    "attribution": attribution_fingerprint,
}


def fingerprints(root: Path) -> dict[str, str]:
    return {kind: fingerprint(root, VERSIONS) for kind, fingerprint in KINDS.items()}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the project's packages (the ``.py`` files: all the closure reads)."""
    dst = tmp_path_factory.mktemp("closure") / "repo"
    for package in PROJECT_PACKAGES:
        shutil.copytree(
            ROOT / package,
            dst / package,
            ignore=lambda folder, names: [
                n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()
            ],
        )
    return dst


def edited(root: Path, relative: str, old: str, new: str):
    """Context: ``relative`` under ``root`` with ``old`` (present once) replaced by ``new``."""
    import contextlib

    @contextlib.contextmanager
    def context():
        path = root / relative
        text = path.read_text()
        assert text.count(old) == 1, f"{relative}: {old!r} found {text.count(old)} times"
        path.write_text(text.replace(old, new))
        try:
            yield
        finally:
            path.write_text(text)

    return context()


# The four changes that moved no fingerprint while fingerprints hashed fixed folders (issue 50),
# each with the kinds it must move; every other kind must stay.
CHANGES = [
    (
        "workbench/precision.py",
        '"bf16": torch.bfloat16',
        '"bf16": torch.float16',
        {"training", "transfer", "intervention", "attribution"},
    ),
    ("workbench/stats.py", 'weights="quadratic"', 'weights="linear"', {"transfer"}),
    (
        "workbench/interventions/evaluate.py",
        'dtype = resolve_amp(amp if as_trained else "off", device)',
        "dtype = resolve_amp(amp, device)",
        {"intervention", "attribution"},
    ),
    (
        "workbench/transfer/source_model.py",
        "LUMA = (0.299, 0.587, 0.114)",
        "LUMA = (0.2126, 0.7152, 0.0722)",
        {"transfer", "intervention", "attribution"},
    ),
]


@pytest.mark.parametrize("relative,old,new,moves", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_in_imported_code_moves_the_kinds_that_import_it(
    checkout, relative, old, new, moves
):
    before = fingerprints(checkout)
    assert before == fingerprints(ROOT), "a copy of the checkout is the same code"
    with edited(checkout, relative, old, new):
        after = fingerprints(checkout)
    moved = {kind for kind in KINDS if after[kind] != before[kind]}
    assert moved == moves, f"{relative}: moved {sorted(moved)}, expected {sorted(moves)}"
    assert fingerprints(checkout) == before  # restored: the same code again


@pytest.mark.parametrize("relative", sorted({c[0] for c in CHANGES}))
def test_a_comment_or_docstring_in_imported_code_moves_nothing(checkout, relative):
    before = fingerprints(checkout)
    path = checkout / relative
    text = path.read_text()
    assert text.startswith('"""')
    try:
        path.write_text(text.replace('"""', '"""Reworded. ', 1) + "\n# a comment at the end\n")
        assert fingerprints(checkout) == before
    finally:
        path.write_text(text)


def test_the_closure_follows_function_level_and_relative_imports_into_project_packages(tmp_path):
    lib = tmp_path / "workbench"
    (lib / "pkg").mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "pkg" / "__init__.py").write_text("")
    (lib / "pkg" / "entry.py").write_text(
        "import numpy\nfrom . import sibling\n\n\ndef f():\n    from workbench.late import g\n    return g()\n"
    )
    (lib / "pkg" / "sibling.py").write_text("from ..deep.mod import h\n")
    (lib / "late.py").write_text("def g():\n    return 1\n")
    (lib / "deep").mkdir()
    (lib / "deep" / "__init__.py").write_text("")
    (lib / "deep" / "mod.py").write_text("def h():\n    return 2\n")
    (lib / "unused.py").write_text("X = 1\n")
    got = import_closure(("workbench/pkg/entry.py",), tmp_path)
    # ``from . import sibling`` loads the package (its __init__); ``from ..deep.mod import h`` names
    # the module, not the packages above it.
    assert got == [
        "workbench/deep/mod.py",
        "workbench/late.py",
        "workbench/pkg/__init__.py",
        "workbench/pkg/entry.py",
        "workbench/pkg/sibling.py",
    ], got
    import ast

    names = imported_names(ast.parse("from .x import y\nimport a.b"), "workbench.pkg")
    assert names == {"workbench.pkg.x", "workbench.pkg.x.y", "a.b"}


def test_the_training_closure_holds_the_training_loops_imports_but_not_the_read_side():
    closure = set(import_closure(("workbench/train",)))
    assert {"workbench/precision.py", "workbench/train/loop.py"} <= closure
    assert not closure & {"workbench/stats.py", "workbench/code_history.py"}
    assert all(p.startswith("workbench/") for p in closure)  # the library imports no other layer


def test_the_re_pin_maps_each_kinds_old_fingerprint_to_the_new_one_of_the_same_code():
    # the move to the import closure maps the kinds whose results it did not change (training,
    # transfer); intervention and attribution changed results with it and their folder values
    # (main at 9e95af9) are not mapped; the train_subset re-pin maps all four closure values
    assert [kind for kind, _, _ in SAME_CODE[1:3]] == ["training", "transfer"]
    assert not {"c7f4a644f31320eb", "af8145884ad9f5a4"} & {old for _, old, _ in SAME_CODE}
    assert [kind for kind, _, _ in SAME_CODE[3:7]] == [
        "training",
        "transfer",
        "intervention",
        "attribution",
    ]
    # the table of kinds' re-pin: transfer only, whose closure holds the protocol parsers
    assert [kind for kind, _, _ in SAME_CODE[7:8]] == ["transfer"]
    # the one-loop / report-content / config_from_timm refactors: all four kinds
    assert [kind for kind, _, _ in SAME_CODE[8:12]] == [
        "training",
        "transfer",
        "intervention",
        "attribution",
    ]
    assert current_name(SAME_CODE[1][1]) == SAME_CODE[8][2]  # three moves chain to today's name
    for _, old, new in SAME_CODE:
        assert (
            same_code(old, new) and same_code(new, old) and current_name(old) == current_name(new)
        )
        assert old in older_names(new) and not same_code(old, "0123456789abcdef")
    assert (
        not same_code(None, SAME_CODE[0][2])
        and current_name("0123456789abcdef") == "0123456789abcdef"
    )
    olds = [old for _, old, _ in SAME_CODE]
    assert len(set(olds)) == len(olds)  # one old value never names two codes


def test_the_folder_algorithm_reproduces_the_fingerprints_stores_hold(tmp_path):
    """``folder_fingerprints`` (the old side of a re-pin) gives main at 9e95af9 its pinned value."""
    commit = "9e95af9"
    if subprocess.run(["git", "cat-file", "-e", commit], cwd=ROOT).returncode != 0:
        pytest.skip(f"{commit} is not in this clone's history")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "workbench"], cwd=ROOT, capture_output=True
    )
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path, filter="data")
    got = folder_fingerprints(tmp_path / "workbench", VERSIONS)
    # The training value pinned at 9e95af9 in tests/test_train_fingerprint.py (same versions).
    assert got["training"] == "f21508dc0b966d22", got
    assert len(set(got.values())) == 4


@pytest.mark.parametrize("mapped", [True, False], ids=["re-pinned", "other code"])
def test_a_report_takes_cells_of_an_older_fingerprint_of_the_same_code(monkeypatch, mapped):
    """The intervention and attribution reports' choice (``choose_cells``): the newest finished run's
    code, and the cells stored under a fingerprint ``SAME_CODE`` maps to it; never other code."""
    from tracking.kinds.intervention_runs import choose_cells
    from tracking.record.queries import CellRecord
    from workbench import code_history

    old, new = "0123456789abcdef", "fedcba9876543210"
    if mapped:
        monkeypatch.setitem(code_history._NEWER, old, new)

    def record(run_id: str, arm: str, code: str, end: int) -> CellRecord:
        params = {"code_fingerprint": code}
        return CellRecord(run_id, arm, 0, "FINISHED", "c", "false", end, end, "", params, {})

    chosen = choose_cells([record("r1", "a", old, 1), record("r2", "b", new, 2)])
    assert sorted(chosen) == ([("a", 0), ("b", 0)] if mapped else [("b", 0)]), chosen


def test_the_transfer_identity_holds_no_other_kinds_parser():
    """A change to the ablation, intervention or attribution parser (or the table of kinds) does
    not re-train transfer cells: transfer's closure reaches workbench/protocol/transfer.py and the
    shared checks only, not the package that gathers every kind."""
    from tracking.kinds.transfer_runs import TRANSFER_ROOTS

    closure = set(import_closure(TRANSFER_ROOTS))
    protocol_files = sorted(p for p in closure if p.startswith("workbench/protocol/"))
    assert protocol_files == ["workbench/protocol/common.py", "workbench/protocol/transfer.py"], (
        protocol_files
    )
    assert "workbench/kinds.py" not in closure
