"""Protocol files on the orchestration side: the one schema, plus the git check before a run.

The schema itself (keys, types, cells, the canonical hash) is library code in
``workbench.protocol``, shared with ``reports`` and the transfer library; it is re-exported
here for the entry points. What lives here is what a study needs and the library must not
do: asking git whether the protocol file is committed, so every run traces to its content.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from workbench.protocol import (  # noqa: F401  (re-exported for the entry points)
    SCHEMA_VERSION,
    SHORT_HASH_LEN,
    SPLIT_KEYS,
    Arm,
    Cell,
    Protocol,
    ProtocolError,
    ProtocolFrozenError,
    TransferProtocol,
    check_frozen,
    load_any,
    load_protocol,
    load_transfer_protocol,
    parse_protocol,
)


class ProtocolDirtyError(ProtocolError):
    """A protocol file is not committed, so runs could not be traced to its content."""


def protocol_file_is_dirty(path: str | Path) -> bool:
    """Whether the file differs from its committed version (untracked, modified, staged, ignored).

    Outside a git repository, or without git, a file counts as dirty: nothing could tie a
    run to its content. ``check_clean`` says which case it was.
    """
    return _dirty_reason(Path(path)) is not None


def check_clean(path: str | Path, allow_dirty: bool = False) -> None:
    """Raise ``ProtocolDirtyError`` naming the file unless it is committed or ``allow_dirty``."""
    reason = None if allow_dirty else _dirty_reason(Path(path))
    if reason:
        raise ProtocolDirtyError(
            f"{path}: {reason}; commit it first so runs can be traced to its content (or pass --allow-dirty to run it anyway; "
            "mlflow run: -P allow_dirty=true)"
        )


def _dirty_reason(path: Path) -> str | None:
    if not path.is_file():
        return "protocol file does not exist"
    try:  # run git in the file's folder, so the file's own repository answers
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--", path.name],
            cwd=path.resolve().parent,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot ask git about the protocol file ({e}); treated as uncommitted"
    if out.returncode != 0:
        return f"not inside a git repository (git: {out.stderr.strip()}); treated as uncommitted"
    if not out.stdout.strip():
        return None
    status = out.stdout[:2]
    what = {"??": "untracked", "!!": "ignored by git"}.get(
        status, f"has uncommitted changes (git status {status.strip()!r})"
    )
    return f"protocol file is {what}"
