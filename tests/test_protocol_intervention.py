"""Intervention protocols: one loader and hash with the other kinds, errors by dotted key, the grid checked on the model."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from protocol_edits import PROTOCOLS, SMOKE_HASH, EditedProtocol, on_smoke
import yaml

from workbench.interventions import (
    HeadAblation,
    InterventionSet,
    PatchStage,
    SkipBranch,
    ZeroPosEmbed,
)
from workbench.protocol import (
    ProtocolError,
    canonical_json,
    load_any,
    load_intervention_protocol,
    load_protocol,
    parse_intervention_protocol,
)

BASE = on_smoke(
    "tiny_heads",
    "heads of the smoke cells, for schema tests",
    interventions={"heads": "all", "branches": "all"},
)


KIND = EditedProtocol(BASE, parse_intervention_protocol)
parsed, error = KIND.parsed, KIND.error


def test_defaults_expand_to_every_head_twice_every_branch_and_the_positions():
    p = parsed()
    # smoke's ViT arm, all its seeds
    assert p.kind == "intervention" and p.arms == ("vit",) and p.seeds == (0, 1)
    assert [c.key for c in p.cells()] == ["vit/seed0", "vit/seed1"]
    grid = p.grid.expand(p.model_config("vit"))  # fmnist_vit: depth 3, 4 heads
    assert len(grid) == 3 * 4 * 2 + 3 * 2 + 1
    assert grid[:3] == [
        HeadAblation(0, 0, "zero"),
        HeadAblation(0, 0, "mean"),
        HeadAblation(0, 1, "zero"),
    ]
    assert (
        grid[8:10] == [SkipBranch(0, "attn"), SkipBranch(0, "mlp")] and grid[-1] == ZeroPosEmbed()
    )
    assert p.evaluation.split == "val" and p.evaluation.mean_images == 1000
    assert p.hash == hashlib.sha256(canonical_json(p.canonical).encode()).hexdigest()


def test_lists_tokens_patches_and_sets_expand_in_order():
    def edit(d):
        d["interventions"] = {
            "heads": ["blocks.2.attn.head1"],
            "head_modes": ["zero"],
            "branches": ["blocks.0.mlp"],
            "position_embedding": False,
            "patches": ["blocks.1.resid2"],
            "sets": [{"name": "b0", "items": ["blocks.0.attn.head0.zero", "blocks.0.mlp.skip"]}],
        }

    grid = parsed(edit)
    items = grid.grid.expand(grid.model_config("vit"))
    assert items == [
        SkipBranch(0, "mlp"),
        HeadAblation(2, 1, "zero"),
        PatchStage("blocks.1.resid2"),
        InterventionSet("b0", (HeadAblation(0, 0, "zero"), SkipBranch(0, "mlp"))),
    ]


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda d: d.update(color="red"),
            "unknown key 'color'; valid keys here: name, description, acts_on, pretrained",
        ),
        (
            lambda d: d["interventions"].update(head="all"),
            "unknown key 'interventions.head'; valid keys here: heads, ",
        ),
        (
            lambda d: d["acts_on"].update(seeds=[0]),
            "unknown key 'acts_on.seeds'; valid keys here: protocol, hash, arms",
        ),
        (
            lambda d: d["acts_on"].update(hash="0" * 64),
            "acts_on.hash='0000.*has hash " + SMOKE_HASH,
        ),
        (
            lambda d: d["acts_on"].update(arms=["cnn"]),
            "'cnn' is not a ViT arm.*ViT arms of smoke: vit",
        ),
        (
            lambda d: d["acts_on"].update(arms=["mlp"]),
            "'mlp' is not an arm of smoke; its arms: vit, cnn",
        ),
        (
            lambda d: d["acts_on"].update(protocol="nosuch"),
            "acts_on.protocol='nosuch': no protocol file",
        ),
        (
            lambda d: d["interventions"].update(heads=["blocks.0.attn.head9"]),
            r"arm vit\): blocks.0.attn.head9.zero: head 9 does not exist; valid heads: 0-3",
        ),
        (
            lambda d: d["interventions"].update(branches=["blocks.3.mlp"]),
            "block 3 does not exist; valid blocks: 0-2",
        ),
        (
            lambda d: d["interventions"].update(heads=["block0.head1"]),
            r"interventions.heads\[0\]='block0.head1'",
        ),
        (
            lambda d: d["interventions"].update(head_modes=["half"]),
            "interventions.head_modes='half': must be one of zero, mean",
        ),
        (lambda d: d["interventions"].update(tokens=["registers"]), "no register tokens"),
        (
            lambda d: d["interventions"].update(patches=["blocks.0.qkv"]),
            "unknown stage 'blocks.0.qkv'; valid stages: ",
        ),
        (
            lambda d: d["interventions"].update(
                sets=[{"name": "s", "items": ["blocks.0.attn.head1.halve"]}]
            ),
            r"interventions.sets\[0\].items\[0\]: intervention 'blocks.0.attn.head1.halve': not a known form",
        ),
        (
            lambda d: d.update(evaluation={"split": "train"}),
            "evaluation.split='train': expected 'val' or 'test'",
        ),
        (
            lambda d: d.update(evaluation={"mean_images": 0}),
            "mean ablation needs at least one reference image",
        ),
        (
            lambda d: d.update(evaluation={"n_resamples": 10}),
            "unknown key 'evaluation.n_resamples'",
        ),
        (
            lambda d: d.update(pretrained={"model": "vit_tiny_patch16_224"}),
            "give exactly one of acts_on",
        ),
    ],
)
def test_bad_protocols_are_one_line_errors_naming_the_dotted_key(edit, message):
    import re

    assert re.search(message, error(edit)), error(edit)


def test_a_pretrained_source_needs_no_acted_on_protocol_and_is_one_cell():
    def edit(d):
        del d["acts_on"]
        d["pretrained"] = {
            "model": "vit_tiny_patch16_224",
            "weights": "random",
            "seed": 3,
            "dataset": "image_folder",
            "class_index": {"cat": 0, "dog": 1},
            "timm_kwargs": {"depth": 2},
        }

    p = parsed(edit)
    assert (
        p.arms == ("pretrained",)
        and p.seeds == (3,)
        and [c.key for c in p.cells()] == ["pretrained/seed3"]
    )
    assert p.canonical["pretrained"]["timm_kwargs"] == {"depth": 2}
    bad = error(lambda d: (edit(d), d["pretrained"].update(class_index={"cat": -1})))
    assert "pretrained.class_index.cat=-1" in bad


def test_the_loader_tells_the_kinds_apart_and_pins_the_acted_on_file_beside_it(tmp_path):
    shutil.copy(PROTOCOLS / "smoke.yaml", tmp_path / "smoke.yaml")
    path = tmp_path / "tiny_heads.yaml"
    path.write_text(yaml.safe_dump(BASE))
    p = load_any(path)
    assert p.kind == "intervention" and p.source.hash == SMOKE_HASH
    with pytest.raises(
        ProtocolError, match="is an intervention protocol, not an ablation protocol"
    ):
        load_protocol(path)
    with pytest.raises(
        ProtocolError, match="is an ablation protocol, not an intervention protocol"
    ):
        load_intervention_protocol(tmp_path / "smoke.yaml")
    (tmp_path / "smoke.yaml").write_text(
        (PROTOCOLS / "smoke.yaml").read_text().replace("epochs: 3", "epochs: 4")
    )
    with pytest.raises(ProtocolError, match="acts_on.hash"):
        load_any(path)  # the acted-on file changed: its cells are not the pinned ones


def test_formatting_does_not_change_the_hash_and_a_value_does():
    a = parsed()
    b = parsed(
        lambda d: d.update(
            interventions={"branches": "all", "heads": "all", "head_modes": ["zero", "mean"]}
        )
    )
    c = parsed(lambda d: d.update(evaluation={"batch_size": 128}))
    assert a.hash == b.hash != c.hash


def test_the_pretrained_example_in_the_docs_is_a_valid_protocol(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "docs" / "interventions.md").read_text()
    block = text[text.index("name: imagenette_vit_b16_heads") :]
    block = block[: block.index("```")]
    p = load_any(write_doc(tmp_path, block))
    assert (
        p.kind == "intervention"
        and p.pretrained.weights == "hub"
        and len(p.pretrained.class_index) == 10
    )
    assert p.pretrained.class_index["n03888605"] == 701 and p.cells()[0].key == "pretrained/seed0"


def write_doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "imagenette_vit_b16_heads.yaml"
    path.write_text(text)
    return path


def test_attribution_patching_is_optional_and_hashed_only_when_on():
    plain = {"pairs": 8, "corruption": "class", "seed": 1}
    before = parsed(lambda d: d.update(patching=dict(plain)))
    assert "attribution_patching" not in before.canonical["patching"]
    assert not before.patching.attribution_patching and before.patching.ig_steps == 5
    off = parsed(
        lambda d: d.update(patching=plain | {"attribution_patching": False, "ig_steps": 5})
    )
    on = parsed(lambda d: d.update(patching=plain | {"attribution_patching": True}))
    more = parsed(
        lambda d: d.update(patching=plain | {"attribution_patching": True, "ig_steps": 9})
    )
    assert off.hash == before.hash != on.hash != more.hash
    assert on.canonical["patching"]["attribution_patching"] is True and on.patching.ig_steps == 5
    bad = error(lambda d: d.update(patching=plain | {"ig_steps": 0}))
    assert "patching.ig_steps=0: must be a positive integer" in bad, bad
