"""Cell identity by the code that computes results: docs, tests and CLI text leave it alone."""

from __future__ import annotations

import shutil
from pathlib import Path

from workbench.code_history import SAME_CODE, same_code
from workbench.train.fingerprint import (
    TRAINING_ROOTS,
    code_fingerprint,
    current_code_fingerprint,
    import_closure,
    source_meaning,
)

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = {"torch": "2.0", "timm": "1.0"}


def copy_checkout(tmp_path: Path) -> Path:
    """A copy of the parts of the checkout a commit might touch: library, CLI, docs, tests."""
    dst = tmp_path / "repo"
    shutil.copytree(
        ROOT / "workbench", dst / "workbench", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(ROOT / "studies", dst / "studies", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", dst / "README.md")
    (dst / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_ablate.py", dst / "tests" / "test_ablate.py")
    return dst


def test_the_fingerprint_covers_data_model_and_training_code_in_a_fixed_order():
    files = import_closure(TRAINING_ROOTS)
    assert files == sorted(files) and {
        "workbench/models/vit.py",
        "workbench/train/loop.py",
        "workbench/data/prepare.py",
        "workbench/precision.py",  # imported by the training loop, outside the root folders
    } <= set(files)
    assert all(f.startswith("workbench/") for f in files)
    assert current_code_fingerprint() == code_fingerprint()  # cached value is the real one


def test_docs_tests_and_cli_text_leave_it_unchanged_model_and_training_code_change_it(tmp_path):
    repo = copy_checkout(tmp_path)
    lib = repo / "workbench"
    before = code_fingerprint(repo, versions=VERSIONS)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA typo fixed.\n")
    cli = repo / "studies" / "ablation" / "ablate.py"
    cli.write_text(
        cli.read_text().replace(
            "Run (or resume) a frozen protocol", "Run or resume a frozen protocol"
        )
    )
    (repo / "tests" / "test_ablate.py").write_text("# a new test\n")
    (lib / "stats.py").write_text((lib / "stats.py").read_text() + "\n# statistics are read-side\n")
    assert code_fingerprint(repo, versions=VERSIONS) == before

    vit = lib / "models" / "vit.py"
    vit.write_text(vit.read_text() + "\n# a comment in the model is not a change of the model\n")
    assert code_fingerprint(repo, versions=VERSIONS) == before
    vit.write_text(vit.read_text() + "\nMODEL_CONSTANT = 1\n")
    after_model = code_fingerprint(repo, versions=VERSIONS)
    assert after_model != before
    loop = lib / "train" / "loop.py"
    loop.write_text(
        loop.read_text().replace("min_ratio + (1 - min_ratio)", "min_ratio + (1.0 - min_ratio)")
    )
    assert code_fingerprint(repo, versions=VERSIONS) not in (before, after_model)
    assert code_fingerprint(repo, versions={**VERSIONS, "torch": "2.1"}) != code_fingerprint(
        repo, versions=VERSIONS
    )


# The training code fingerprint of this checkout's files (at fixed library versions: the
# installed torch and timm enter it too, and differ between machines). Every stored training
# cell is keyed by it: a change sends every cell of every study in every store back to train,
# so it must be a deliberate change of data, model or training code, stated in the commit
# (update the pin then). Code that only acts on trained cells belongs outside
# workbench/{data,models,train,convert} (e.g. workbench/interventions/read_across.py).
# With torch 2.14.1 and timm 1.0.31 this code is 85e570854701b488: the import closure of the
# training roots. Re-pinned when the fingerprint moved from folders to the closure (with the
# TransformerLens methods and hook-return checks added to the model, which change no forward; the
# folder fingerprint of the code before was cd75a476b2728c95), and when dataset.train_subset was
# added (1fdbd2ef63e1f7ae before: a branch no earlier protocol takes), and when config_from_timm
# was split into the parts it reads and two unused data helpers removed (28158c5e1d44db97 before: the same configs and refusals for
# all 163 timm ViT architectures); all mapped in workbench/code_history.py.
TRAINING_FILES_FINGERPRINT = "f8f48beb809e0fac"


def test_the_training_fingerprint_changes_only_on_purpose():
    got = code_fingerprint(versions=VERSIONS)
    assert got == TRAINING_FILES_FINGERPRINT, (
        f"training code fingerprint {got} != pinned {TRAINING_FILES_FINGERPRINT}: stored cells would train again; "
        "if data, model or training code changed on purpose, update the pin and say so in the commit"
    )


# A block of model-like code and four rewrites of it that mean the same.
ORIGINAL = '''"""Module docstring."""
import torch


class Block(torch.nn.Module):
    """A block."""

    def forward(self, x, scale=0.5):
        """Docstring that changes nothing."""
        y = x * scale  # a comment
        return torch.cat([x, y], dim=-1)
'''
SAME_MEANING = {
    "comments": ORIGINAL.replace("# a comment", "# another comment, longer")
    + "\n# trailing comment\n",
    "docstrings": ORIGINAL.replace(
        "Docstring that changes nothing.", "Reworded.\n\n        Args:\n            x: input.\n"
    ),
    "reformat": ORIGINAL.replace(
        "return torch.cat([x, y], dim=-1)",
        "return torch.cat(\n            [\n                x,\n                y,\n            ],\n            dim=-1,\n        )",
    )
    .replace('"""A block."""', "'A block.'")
    .replace("y = x * scale", "y = (x * scale)"),
    "no docstrings": ORIGINAL.replace(
        '        """Docstring that changes nothing."""\n', ""
    ).replace('"""Module docstring."""\n', ""),
}
CHANGED_MEANING = {
    "constant": ORIGINAL.replace("scale=0.5", "scale=0.25"),
    "name": ORIGINAL.replace("dim=-1", "dim=1"),
    "statement": ORIGINAL.replace("return torch.cat", "y = y + 0\n        return torch.cat"),
    "string that is not a docstring": ORIGINAL.replace(
        "y = x * scale", "y = x * scale\n        'text'"
    ),
}


def test_comments_docstrings_and_reformatting_leave_the_meaning_unchanged():
    reference = source_meaning(ORIGINAL)
    for what, source in SAME_MEANING.items():
        assert source != ORIGINAL
        assert source_meaning(source) == reference, f"{what} changed the code's meaning"


def test_changed_constants_names_and_statements_change_the_meaning():
    reference = source_meaning(ORIGINAL)
    for what, source in CHANGED_MEANING.items():
        assert source_meaning(source) != reference, f"a changed {what} left the meaning unchanged"


def test_a_reformat_of_every_result_file_changes_no_fingerprint(tmp_path):
    """Every result file rewritten by ``ast.unparse``: no comment left, quotes, parentheses, line
    breaks and indentation all redone; the meaning is the same, so is the fingerprint."""
    import ast

    repo = copy_checkout(tmp_path)
    before = code_fingerprint(repo, versions=VERSIONS)
    for relative in import_closure(TRAINING_ROOTS, repo):
        path = repo / relative
        text = path.read_text()
        rewritten = ast.unparse(ast.parse(text))
        assert rewritten != text or not text.strip()
        path.write_text(rewritten + "\n")
    assert code_fingerprint(repo, versions=VERSIONS) == before


def test_ruff_format_changes_no_fingerprint(tmp_path):
    """The project's formatter (ruff, configured in pyproject.toml) moves no identity."""
    import shutil as sh
    import subprocess
    import sys

    ruff = sh.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        import pytest

        pytest.skip("ruff is not installed (it comes with the dev extra)")
    repo = copy_checkout(tmp_path)
    sh.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    lib = repo / "workbench"
    before = code_fingerprint(repo, versions=VERSIONS)
    # A narrower line than the project's forces the formatter to move nearly every long line.
    subprocess.run(
        [ruff, "format", "--line-length", "60", "--quiet", str(lib)], check=True, cwd=repo
    )
    assert code_fingerprint(repo, versions=VERSIONS) == before


def test_cells_under_the_last_text_fingerprint_count_as_the_same_code():
    _, text_fp, tree_fp = SAME_CODE[0]
    assert same_code(tree_fp, tree_fp) and same_code(text_fp, tree_fp)
    assert not same_code(text_fp, "0123456789abcdef") and not same_code(None, tree_fp)
    assert not same_code("0123456789abcdef", tree_fp)
