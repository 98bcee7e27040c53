"""The record's tag and filter schema: filters built by it find exactly the runs its tags wrote, quotes included."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tracking.record import schema
from tracking.record.schema import (
    FINISHED,
    TRANSFER,
    TRUE,
    cell_filter,
    cell_tags,
    parent_filter,
    quoted,
    tag_is,
)


@pytest.fixture
def store(mlflow_store):
    client = MlflowClient()
    exp = client.create_experiment("schema")
    made = {}
    for name, digest in (("plain", "h1"), ("it's", "h2")):
        for arm in ("vit", "cnn"):
            for seed in (0, 1):
                tags = cell_tags(
                    protocol_name=name,
                    protocol_hash=digest,
                    arm=arm,
                    seed=seed,
                    allow_dirty=False,
                    is_reference=arm == "cnn",
                )
                made[(name, arm, seed)] = client.create_run(exp, tags=tags).info.run_id
        made[(name, "parent")] = client.create_run(
            exp,
            tags={schema.PARENT: TRUE, schema.PROTOCOL_NAME: name, schema.PROTOCOL_HASH: digest},
        ).info.run_id
    made["transfer"] = client.create_run(
        exp,
        tags=cell_tags(
            protocol_name="it's",
            protocol_hash="h2",
            arm="linear",
            seed=0,
            allow_dirty=True,
            kind=TRANSFER,
            source_identity='say "hi"',
        ),
    ).info.run_id
    made["transfer parent"] = client.create_run(
        exp, tags={schema.PARENT: TRUE, TRANSFER: TRUE, schema.PROTOCOL_NAME: "it's"}
    ).info.run_id
    client.set_terminated(made[("it's", "vit", 1)], FINISHED)
    return client, exp, made


def found(client, exp, where: str) -> set[str]:
    return {r.info.run_id for r in client.search_runs([exp], where)}


def test_filters_built_by_the_schema_find_the_runs_its_tags_wrote(store):
    client, exp, made = store
    quoted_cells = {made[("it's", a, s)] for a in ("vit", "cnn") for s in (0, 1)} | {
        made["transfer"]
    }
    assert found(client, exp, cell_filter(protocol_name="it's")) == quoted_cells
    assert found(client, exp, cell_filter("h1")) == {
        made[("plain", a, s)] for a in ("vit", "cnn") for s in (0, 1)
    }
    assert found(client, exp, cell_filter("h2", arm="vit", seed=1, status=FINISHED)) == {
        made[("it's", "vit", 1)]
    }
    assert found(client, exp, cell_filter("h2", **{schema.SOURCE_IDENTITY: 'say "hi"'})) == {
        made["transfer"]
    }
    assert found(client, exp, parent_filter("it's")) == {
        made[("it's", "parent")],
        made["transfer parent"],
    }
    assert found(client, exp, parent_filter("it's", kind=TRANSFER)) == {made["transfer parent"]}
    assert found(client, exp, parent_filter(protocol_hash="h1")) == {made[("plain", "parent")]}
    assert found(client, exp, tag_is(schema.IS_REFERENCE, TRUE)) == {
        made[(n, "cnn", s)] for n in ("plain", "it's") for s in (0, 1)
    }


def test_a_cells_tags_and_the_quoting_rule():
    assert cell_tags(
        protocol_name="p",
        protocol_hash="h",
        arm="vit",
        seed=3,
        allow_dirty=True,
        is_reference=False,
    ) == {
        "cell": "true",
        "protocol_name": "p",
        "protocol_hash": "h",
        "arm": "vit",
        "seed": "3",
        "is_reference": "false",
        "allow_dirty": "true",
    }
    assert (
        quoted("it's") == '"it\'s"' and quoted('say "hi"') == "'say \"hi\"'" and quoted(7) == "'7'"
    )
    with pytest.raises(ValueError, match="holds both quote characters"):
        quoted('it\'s "both"')
