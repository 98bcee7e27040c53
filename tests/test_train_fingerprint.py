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
