"""Where the protocol goes: the files an `ablate` passes it through, from the command line to
its first finished cell.

    python scripts/protocol_walk.py [PROTOCOL]      (default studies/protocols/smoke.yaml)

Runs `workbench ablate --protocol PROTOCOL --threads 1` in this process, in a throwaway
folder and SQLite store, with a profiler that records every call of a project function
(workbench/, tracking/, studies/, reports/) that receives the protocol: its file path (a
`str` or `Path` naming the file) or a parsed protocol (an object of a class defined in
`workbench.protocol`, a cell of it included). The calls up to the end of the first cell
(`train_one` returning) are folded into stays: consecutive calls in one file are one stay.

Prints the stays in order, then one line: stays, files, and returns (stays in a file that
an earlier stay already left). A protocol parsed once and handed on as one object makes few
stays and few returns; one re-read or re-dispatched in many places makes many of both.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / p) + os.sep for p in ("workbench", "tracking", "studies", "reports"))


def _is_protocol(value: object, path: Path) -> bool:
    if isinstance(value, (str, Path)):
        try:
            return Path(value).resolve() == path
        except (OSError, ValueError):
            return False
    return type(value).__module__.startswith("workbench.protocol")


class Walk:
    """The profiler: (file, function) of each project call that receives the protocol."""

    def __init__(self, path: Path) -> None:
        self.path, self.calls, self.done = path, [], False

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGES):
            return
        if event == "return" and code.co_name == "train_one":
            self.done = True
            return
        if event != "call":
            return
        n = code.co_argcount + code.co_kwonlyargcount
        values = [frame.f_locals.get(name) for name in code.co_varnames[:n]]
        if any(_is_protocol(v, self.path) for v in values):
            self.calls.append((os.path.relpath(code.co_filename, ROOT), code.co_name))


def stays(calls: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    folded: list[tuple[str, list[str]]] = []
    for file, function in calls:
        if folded and folded[-1][0] == file:
            folded[-1][1].append(function)
        else:
            folded.append((file, [function]))
    return folded


def main() -> None:
    protocol = Path(sys.argv[1] if len(sys.argv) > 1 else "studies/protocols/smoke.yaml")
    protocol = (ROOT / protocol).resolve() if not protocol.is_absolute() else protocol
    from studies.cli import main as cli

    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/walk.db"
        os.chdir(tmp)  # the store's artifacts (./mlruns) go to the throwaway folder too
        walk = Walk(protocol)
        sys.setprofile(walk)
        try:
            cli.main(
                ["ablate", "--protocol", str(protocol), "--threads", "1", "--output-dir", tmp],
                standalone_mode=False,
            )
        finally:
            sys.setprofile(None)
            os.chdir(here)
    folded = stays(walk.calls)
    seen, returns = set(), 0
    for file, functions in folded:
        back = file in seen
        returns += back
        seen.add(file)
        print(f"{'<-' if back else '  '} {file}: {', '.join(dict.fromkeys(functions))}")
    print(f"{len(folded)} stays in {len(seen)} files, {returns} returns to a file already left")


if __name__ == "__main__":
    main()
