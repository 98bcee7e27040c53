"""Ship rebuilt acted-on weights beside a published acting study's evidence that lacks them.

    MLFLOW_TRACKING_URI=sqlite:///REBUILT.db python scripts/attach_rebuilt_weights.py EVIDENCE \
        --reproduce REPRODUCE.json [--reproduce ...] [--cell ARM/SEED=REBUILT_RUN --proof TEXT]

For the acting studies published before their exports shipped weights (docs/results/README.md
says which): the trained runs they acted on are gone, so each acted-on cell is trained again
with ``workbench reproduce --level bitwise --json REPRODUCE.json`` into the store the tracking URI
names, and this script writes the rebuilt cells' weights into ``EVIDENCE/weights/`` with the
manifest ``--cells-from`` reads, keyed by the acted-on run ids the evidence names
(``tracking.export.acted_weights.attach_rebuilt_weights``). A cell is taken from a reproduce
JSON only where that re-training was equal to the acted-on run bit for bit (every metric, every
history point, both prediction files). A cell whose acted-on run was never published as a
training study has no reproduce record: ``--cell`` names its rebuilt run and ``--proof`` says how
it was shown to be the acted-on cell (a re-run of the study equal to its evidence). Every cell of
the evidence must be covered; nothing else in the evidence is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tracking.export.acted_weights import attach_rebuilt_weights, weights_readme_item
from workbench.protocol import load_any

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "protocols"


def bitwise_cells(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """acted-on (published) run id -> (rebuilt run id, proof), for every cell re-trained bit for bit."""
    found = {}
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for c in doc["cells"]:
            equal = (
                c["metrics_equal"] == c["metrics"]
                and c["history_equal"] == c["history_points"]
                and c["prediction_files_identical"] == c["prediction_files"] > 0
            )
            if equal:
                found[c["published_run"]] = (
                    c["retrained_run"],
                    f"workbench reproduce --level bitwise of {doc['protocol']['name']} "
                    f"{c['arm']}/seed{c['seed']}: {c['metrics_equal']} of {c['metrics']} metrics, "
                    f"{c['history_equal']} of {c['history_points']} history points and "
                    f"{c['prediction_files_identical']} of {c['prediction_files']} prediction files "
                    f"equal to run {c['published_run']}",
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("evidence", type=Path)
    parser.add_argument("--reproduce", type=Path, action="append", default=[])
    parser.add_argument("--cell", action="append", default=[], help="ARM/SEED=REBUILT_RUN")
    parser.add_argument("--proof", default=None, help="How the --cell runs were shown equal.")
    args = parser.parse_args(argv)
    for path in (args.evidence / "runs.json", *args.reproduce):
        if not path.is_file():
            sys.exit(f"{path}: no such file")
    runs = json.loads((args.evidence / "runs.json").read_text(encoding="utf-8"))
    protocol = load_any(PROTOCOLS / f"{runs['protocol']['name']}.yaml")
    if protocol.hash != runs["protocol"]["hash"]:
        sys.exit(f"{args.evidence}: its protocol hash is not {PROTOCOLS}'s file's")
    rebuilt = bitwise_cells(args.reproduce)
    named = {}
    for item in args.cell:
        cell, _, run = item.partition("=")
        if not run or not args.proof:
            sys.exit(f"--cell {item!r}: expected ARM/SEED=REBUILT_RUN, with --proof")
        named[cell] = (run, args.proof)
    cells = []
    for c in runs["cells"]:
        arm, seed, acted = c["tags"]["arm"], int(c["tags"]["seed"]), c["tags"]["source_run_id"]
        match = named.get(f"{arm}/seed{seed}") or rebuilt.get(acted)
        if match is None:
            sys.exit(f"{arm}/seed{seed}: no bitwise rebuild of acted-on run {acted} given")
        cells.append((arm, seed, acted, match[0], match[1]))
    written = attach_rebuilt_weights(args.evidence, protocol.acts_on, cells)
    readme = args.evidence / "README.md"
    text = readme.read_text(encoding="utf-8")
    if "- `weights/`:" not in text:
        rebuilt = (
            "  The trained runs this study acted on were gone when the weights were added: each "
            "cell was\n  trained again and shown to be the acted-on one (the manifest's `rebuilt`: "
            "the rebuilt run\n  and the proof); it is keyed by the acted-on run id the records "
            "name.\n"
        )
        item = weights_readme_item(len(cells)) + rebuilt
        readme.write_text(text.rstrip("\n") + "\n\n" + item, encoding="utf-8")
    print(f"wrote {len(written)} files of {len(cells)} cells under {args.evidence / 'weights'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
