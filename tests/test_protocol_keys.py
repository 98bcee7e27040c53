"""The protocol key reference (docs/protocols.md) is generated from the schema and stays true.

- the committed page holds exactly what ``workbench protocol keys`` generates;
- every key the parser accepts has a row, and every row's default is what the parser fills
  in for a protocol that leaves the key out (checked on the canonical content it hashes);
- a field without a meaning fails the generator, naming the field;
- the worked example in docs/protocols.md is the shipped example file, verbatim, and loads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from studies.cli import main
from workbench.protocol import (
    load_protocol,
    parse_intervention_protocol,
    parse_protocol,
    parse_transfer_protocol,
)
from workbench.protocol.keys import (
    BEGIN,
    END,
    KINDS,
    MissingMeaning,
    attribute_docs,
    field_rows,
    key_rows,
    reference_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "protocols.md"
EXAMPLE = ROOT / "studies" / "protocols" / "examples" / "shapes_vit_vs_cnn.yaml"


def test_the_committed_reference_is_the_generated_one():
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    committed, generated = text[start:end], reference_markdown()
    if committed != generated:
        diff = [
            f"- {a}\n+ {b}"
            for a, b in zip(committed.splitlines(), generated.splitlines())
            if a != b
        ][:3]
        pytest.fail(
            "docs/protocols.md is stale: run `workbench protocol keys --write docs/protocols.md`\n"
            + "\n".join(diff)
        )


def rows_by_section(kind: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for row in key_rows(kind):
        out.setdefault(row.section, {})[row.key] = row.default
    return out


def check_defaults(
    documented: dict[str, str], filled: dict, where: str, given: tuple[str, ...] = ()
) -> None:
    """Every documented default that is a value (not 'required', not given) equals the canonical value filled in."""
    for key, default in documented.items():
        if default == "required" or default.startswith("one of") or key in given:
            continue
        assert key in filled, (
            f"{where}.{key}: documented but not in the parsed content {sorted(filled)}"
        )
        assert json.loads(default) == filled[key], (
            f"{where}.{key}: documented {default}, parser fills {filled[key]!r}"
        )
    assert set(filled) <= set(documented), (
        f"{where}: keys without a row: {set(filled) - set(documented)}"
    )


def test_ablation_rows_are_the_parser_keys_with_its_defaults():
    p = parse_protocol(
        {
            "name": "t",
            "description": "d",
            "dataset": {"name": "image_folder"},
            "model": {"name": "cifar_vit"},
            "arms": [{"name": "a", "reference": True}],
            "seeds": [0],
        }
    )
    rows = rows_by_section("ablation")
    for section in ("dataset", "optim", "run"):
        # `dataset.train_subset` enters the canonical content only when set (the old hashes stay).
        skip = ("train_subset",) if section == "dataset" else ()
        check_defaults(rows[section], p.canonical[section], section, given=skip)
    assert "train_subset" not in p.canonical["dataset"]
    # `recipe` and `fast_path` enter the canonical content only with a part switched on (the old
    # hashes stay).
    assert "recipe" not in p.canonical and "fast_path" not in p.canonical
    assert set(rows["(top)"]) == {k for k in p.canonical if k != "schema"} | {
        "recipe",
        "fast_path",
    }
    check_defaults(rows["recipe"], dataclasses.asdict(p.recipe), "recipe")
    check_defaults(rows["fast_path"], dataclasses.asdict(p.fast_path), "fast_path")
    vit = {k: v for k, v in rows["model (fmnist_vit, cifar_vit)"].items()}
    from workbench.models.registry import model_config

    cfg = model_config("cifar_vit")
    for key, default in vit.items():
        value = (
            json.loads(default.split(" (")[0])
            if "(fmnist_vit)" not in default
            else json.loads(default.split(", ")[-1].removesuffix(" (cifar_vit)"))
        )
        assert value == (
            list(getattr(cfg, key)) if isinstance(getattr(cfg, key), tuple) else getattr(cfg, key)
        ), key


def test_transfer_and_intervention_rows_are_the_parser_keys_with_its_defaults():
    t = parse_transfer_protocol(
        {
            "name": "t",
            "description": "d",
            "source": {"weights": "random", "model": "m"},
            "dataset": {},
            "seeds": [0],
            "regimes": [
                {"name": "p", "kind": "linear", "epochs": 1, "reference": True},
                {"name": "f", "kind": "full", "epochs": 1},
            ],
        }
    )
    rows = rows_by_section("transfer")
    # `source.sha256` enters the canonical content only when a pin is given (the old hashes stay).
    assert (
        "sha256" not in t.canonical["source"]
        and t.source.sha256 is None
        and rows["source"]["sha256"] == "null"
    )
    check_defaults(rows["source"], t.canonical["source"], "source", given=("model", "sha256"))
    for section in ("dataset", "run", "evaluation"):
        check_defaults(rows[section], t.canonical[section], section)
    # the one that leaves out reference
    regime = {k: v for k, v in t.canonical["regimes"][1].items() if k != "optim"}
    check_defaults(rows["regimes[]"], regime, "regimes[1]")
    check_defaults(
        rows["regimes[] (optimiser, written flat)"],
        t.canonical["regimes"][1]["optim"],
        "regimes[1]",
    )
    i = parse_intervention_protocol(
        {
            "name": "i",
            "description": "d",
            "interventions": {},
            "pretrained": {"model": "vit_tiny_patch16_224", "weights": "random"},
        }
    )
    rows = rows_by_section("intervention")
    check_defaults(rows["pretrained"], i.canonical["pretrained"], "pretrained", given=("weights",))
    check_defaults(rows["interventions"], i.canonical["interventions"], "interventions")
    check_defaults(rows["evaluation"], i.canonical["evaluation"], "evaluation")


def test_every_row_has_a_meaning_and_an_undocumented_field_is_named():
    for kind in KINDS:
        empty = [f"{r.section}.{r.key}" for r in key_rows(kind) if not r.meaning.strip()]
        assert not empty, f"{kind}: keys without a meaning: {empty}"

    @dataclass(frozen=True)
    class Section:
        """A section.

        Attributes:
            documented: Has a meaning,
                over two lines.
        """

        documented: int = 1
        forgotten: float = 0.5

    assert attribute_docs(Section) == {"documented": "Has a meaning, over two lines."}
    with pytest.raises(
        MissingMeaning, match=r"Section.forgotten: no meaning .* protocol key things.forgotten"
    ):
        field_rows("things", Section, ("documented", "forgotten"))


def test_protocol_keys_command_prints_and_rewrites_the_page(tmp_path):
    out = CliRunner().invoke(main, ["protocol", "keys", "--kind", "transfer"])
    assert out.exit_code == 0 and "| regimes[] | `kind` | str | required |" in out.output, (
        out.output[:500]
    )
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{BEGIN}\nstale\n{END}\n\nafter\n")
    out = CliRunner().invoke(main, ["protocol", "keys", "--write", str(page)])
    assert out.exit_code == 0 and "key reference rewritten" in out.output, out.output
    assert page.read_text() == f"# Page\n\n{reference_markdown()}\n\nafter\n"
    again = CliRunner().invoke(main, ["protocol", "keys", "--write", str(page)])
    assert "up to date" in again.output, again.output
    (tmp_path / "bare.md").write_text("# no markers\n")
    bare = CliRunner().invoke(main, ["protocol", "keys", "--write", str(tmp_path / "bare.md")])
    assert bare.exit_code == 1 and "no generated key reference in the page" in bare.output, (
        bare.output
    )


def test_the_worked_example_is_the_shipped_file_and_loads():
    text = PAGE.read_text(encoding="utf-8")
    assert f"```yaml\n{EXAMPLE.read_text().rstrip()}\n```" in text, (
        "docs/protocols.md does not quote the example file"
    )
    protocol = load_protocol(EXAMPLE)
    assert protocol.name == EXAMPLE.stem and [a.name for a in protocol.arms] == ["vit", "cnn"]
    for cell in protocol.cells():
        model = cell.config.model
        assert model.overrides["num_classes"] == 3, cell.key  # the shapes folder's 3 classes
