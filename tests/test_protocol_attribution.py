"""Attribution protocols: the same loader, sections and hash as the other kinds; errors by dotted key."""

from __future__ import annotations

import copy
import hashlib

import pytest
from protocol_edits import PROTOCOLS, EditedProtocol, on_smoke

from workbench.protocol import (
    ProtocolError,
    canonical_json,
    kind_of,
    load_any,
    load_attribution_protocol,
    load_protocol,
    parse_attribution_protocol,
)
from workbench.protocol.keys import key_rows

DEFAULT_METHODS = ("cls_attention", "rollout", "chefer", "grad_x_input", "random")
BASE = on_smoke(
    "tiny_faith", "attribution on the smoke cells, for schema tests", attribution={"images": 16}
)


KIND = EditedProtocol(BASE, parse_attribution_protocol)
parsed, error = KIND.parsed, KIND.error


def test_defaults_act_on_every_vit_cell_with_every_method():
    p = parsed()
    assert p.kind == "attribution" and p.arms == ("vit",) and p.seeds == (0, 1)
    assert [c.key for c in p.cells()] == ["vit/seed0", "vit/seed1"]
    assert p.settings.methods == DEFAULT_METHODS
    assert (
        p.settings.images == 16 and p.settings.norm_threshold == 10.0 and p.settings.split == "val"
    )
    assert p.hash == hashlib.sha256(canonical_json(p.canonical).encode()).hexdigest()
    assert p.model_config("vit").patch_size == 4


def test_methods_are_kept_in_report_order_so_the_order_written_does_not_change_the_hash():
    a = parsed(lambda d: d["attribution"].update(methods=["random", "rollout"]))
    b = parsed(lambda d: d["attribution"].update(methods=["rollout", "random"]))
    assert a.settings.methods == ("rollout", "random") and a.hash == b.hash


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            lambda d: d["attribution"].update(methods=["saliency"]),
            "attribution.methods: 'saliency' is not a method",
        ),
        (
            lambda d: d["attribution"].update(methods=[]),
            "attribution.methods=[]: must be a non-empty list",
        ),
        (lambda d: d["attribution"].update(methods=["rollout", "rollout"]), "lists a method twice"),
        (
            lambda d: d["attribution"].update(images=0),
            "attribution.images=0: must be a positive integer",
        ),
        (lambda d: d["attribution"].update(split="train"), "attribution.split='train'"),
        (
            lambda d: d["attribution"].update(norm_threshold=1.0),
            "attribution.norm_threshold=1.0: must be above 1",
        ),
        (
            lambda d: d["attribution"].update(examples=17),
            "attribution.examples=17: must be between 0 and",
        ),
        (lambda d: d["attribution"].update(colour="red"), "colour"),
        (lambda d: d["acts_on"].update(hash="0" * 64), "acts_on.hash="),
        (
            lambda d: d["acts_on"].update(arms=["cnn"]),
            "'cnn' is not a ViT arm (attribution maps are read off ViT",
        ),
        (lambda d: d.update(evaluation={"confidence": 1.5}), "evaluation.confidence=1.5"),
        (lambda d: d.pop("acts_on"), "give exactly one of acts_on"),
    ],
)
def test_bad_input_names_the_key(edit, says):
    assert says in error(edit)


def test_a_mean_pooling_vit_arm_is_refused_at_load_in_one_line(tmp_path):
    """Attribution reads the class token's row: a mean-pooling ViT arm is refused as a CNN arm is,
    at load (before any run opens), not by a failing cell."""
    text = (PROTOCOLS / "smoke.yaml").read_text()
    text = text.replace(
        "overrides:\n      model: {name: fmnist_cnn}",
        "overrides:\n      model: {name: fmnist_vit, pooling: mean}",
    ).replace("name: cnn", "name: vit_mean")
    (tmp_path / "smoke.yaml").write_text(text)
    acted = load_protocol(tmp_path / "smoke.yaml")
    assert acted.arms[1].config.model.overrides == {"pooling": "mean"}, acted.arms[1]
    data = copy.deepcopy(BASE)
    data["acts_on"] = {"protocol": "smoke", "hash": acted.hash, "arms": ["vit_mean"]}
    with pytest.raises(ProtocolError) as info:
        parse_attribution_protocol(data, source=str(tmp_path / "tiny_faith.yaml"))
    message = str(info.value)
    assert "\n" not in message and "'vit_mean' is not a ViT arm" not in message, message
    assert "acts_on.arms: 'vit_mean'" in message and "pooling='mean'" in message, message
    data["acts_on"].pop("arms")  # by default: the arms it can act on
    assert parse_attribution_protocol(data, source=str(tmp_path / "tiny_faith.yaml")).arms == (
        "vit",
    )


def test_shipped_attribution_protocols_load_as_their_kind():
    for name in (
        "smoke_faithfulness",
        "fmnist_seed_recipe_faithfulness",
        "smoke_faithfulness_controls",
        "fmnist_seed_recipe_faithfulness_controls",
    ):
        p = load_attribution_protocol(PROTOCOLS / f"{name}.yaml")
        assert p.kind == "attribution" and load_any(PROTOCOLS / f"{name}.yaml").hash == p.hash
    assert (
        kind_of({"attribution": {}}) == "attribution"
        and kind_of({"interventions": {}}) == "intervention"
    )


def test_an_ablation_file_is_refused_as_an_attribution_protocol():
    with pytest.raises(ProtocolError, match="is an ablation protocol, not an attribution protocol"):
        load_attribution_protocol(PROTOCOLS / "smoke.yaml")


def test_every_key_has_a_row_in_the_key_reference():
    keys = {(r.section, r.key) for r in key_rows("attribution")}
    assert {
        ("attribution", "methods"),
        ("attribution", "norm_threshold"),
        ("acts_on", "hash"),
    } <= keys
