"""Cell identity by the code that computes results: docs, tests and CLI text leave it alone."""

from __future__ import annotations

import shutil
from pathlib import Path

from workbench.train.fingerprint import RESULT_PACKAGES, code_fingerprint, current_code_fingerprint, result_source_files

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = {"torch": "2.0", "timm": "1.0"}


def copy_checkout(tmp_path: Path) -> Path:
    """A copy of the parts of the checkout a commit might touch: library, CLI, docs, tests."""
    dst = tmp_path / "repo"
    shutil.copytree(ROOT / "workbench", dst / "workbench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "studies", dst / "studies", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", dst / "README.md")
    (dst / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_ablate.py", dst / "tests" / "test_ablate.py")
    return dst


def test_the_fingerprint_covers_data_model_and_training_code_in_a_fixed_order():
    files = [p.relative_to(ROOT / "workbench").as_posix() for p in result_source_files()]
    assert files == sorted(files) and {"models/vit.py", "train/loop.py", "data/prepare.py"} <= set(files)
    assert all(f.split("/")[0] in RESULT_PACKAGES for f in files)
    assert current_code_fingerprint() == code_fingerprint()  # cached value is the real one


def test_docs_tests_and_cli_text_leave_it_unchanged_model_and_training_code_change_it(tmp_path):
    repo = copy_checkout(tmp_path)
    lib = repo / "workbench"
    before = code_fingerprint(lib, versions=VERSIONS)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA typo fixed.\n")
    cli = repo / "studies" / "ablation" / "ablate.py"
    cli.write_text(cli.read_text().replace("Run (or resume) a frozen protocol", "Run or resume a frozen protocol"))
    (repo / "tests" / "test_ablate.py").write_text("# a new test\n")
    (lib / "stats.py").write_text((lib / "stats.py").read_text() + "\n# statistics are read-side\n")
    assert code_fingerprint(lib, versions=VERSIONS) == before

    vit = lib / "models" / "vit.py"
    vit.write_text(vit.read_text() + "\n# any change to the model\n")
    after_model = code_fingerprint(lib, versions=VERSIONS)
    assert after_model != before
    loop = lib / "train" / "loop.py"
    loop.write_text(loop.read_text().replace("min_ratio + (1 - min_ratio)", "min_ratio + (1.0 - min_ratio)"))
    assert code_fingerprint(lib, versions=VERSIONS) not in (before, after_model)
    assert code_fingerprint(lib, versions={**VERSIONS, "torch": "2.1"}) != code_fingerprint(lib, versions=VERSIONS)


# The training code fingerprint of this checkout's files (at fixed library versions: the
# installed torch and timm enter it too, and differ between machines). Every stored training
# cell is keyed by it: a change sends every cell of every study in every store back to train,
# so it must be a deliberate change of data, model or training code, stated in the commit
# (update the pin then). Code that only acts on trained cells belongs outside
# workbench/{data,models,train,convert} (e.g. workbench/interventions/read_across.py).
# With torch 2.14.1 and timm 1.0.31 this code is f2c09a41af712f3e.
TRAINING_FILES_FINGERPRINT = "5dd1467fbe668274"


def test_the_training_fingerprint_changes_only_on_purpose():
    got = code_fingerprint(versions=VERSIONS)
    assert got == TRAINING_FILES_FINGERPRINT, (
        f"training code fingerprint {got} != pinned {TRAINING_FILES_FINGERPRINT}: stored cells would train again; "
        "if data, model or training code changed on purpose, update the pin and say so in the commit")
