"""Text fit for a published page: no absolute path of the machine that built it.

Reports and evidence exports name the tracking store, the protocol file and the dataset
source. A user who exported ``MLFLOW_TRACKING_URI=sqlite:///$PWD/stores/x.db`` gave an
absolute path only to say "this folder's ``stores/x.db``"; the page shows it as
``sqlite:///stores/x.db``, relative to the working directory the report was built from,
the way the user could have given it. Paths outside that directory become ``../``
paths, except system-wide ones (``/usr/...``, the same on every machine). Nothing else
in the text changes, so a text with no absolute path is returned as it came (and
rewriting is idempotent).
"""

from __future__ import annotations

import os
import re

# A local store URI with an absolute path: sqlite:////abs/x.db, file:///abs/mlruns.
_STORE_URI = re.compile(r"\b(?P<scheme>sqlite:///|file://)(?P<path>/[^\s\"'`<>|)\],;]+)")
# An absolute path standing alone: at the start or after a space, bracket, quote, = , or ;.
# "a/b", "12/01", "images/s" and the "//host/x" of a URL are never matched.
_ABSOLUTE = re.compile(r"(?<![^\s(\[{\"'=,;`])/(?=[^\s/])[^\s\"'`<>|)\],;]*")


# System-wide locations (a Debian dataset package's /usr/share/datasets/...) name the same
# file on every machine that has the package: kept as they are, not turned into ../../usr.
SYSTEM_PREFIXES = ("/usr/",)


def relative(path: str, base: str | None = None) -> str:
    """``path`` relative to ``base`` (default: the working directory); relative and system-wide paths unchanged."""
    if not os.path.isabs(path) or path.startswith(SYSTEM_PREFIXES):
        return path
    return os.path.relpath(path, base or os.getcwd())


def portable_text(text: str, base: str | None = None) -> str:
    """``text`` with every absolute local path (also inside sqlite:/file: URIs) relative to ``base``."""

    def store(m: re.Match) -> str:
        rel = relative(m["path"], base)
        # MLflow takes a bare path as a file store
        return f"sqlite:///{rel}" if m["scheme"] == "sqlite:///" else rel

    text = _STORE_URI.sub(store, text)
    return _ABSOLUTE.sub(lambda m: relative(m[0], base), text)
