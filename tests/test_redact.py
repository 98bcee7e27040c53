"""Secrets never reach a record: URLs, command lines and secret environment values are masked in one place."""

from __future__ import annotations

import json
from pathlib import Path

from tracking.record.sink import redacted_copy
from tracking.store.redact import redact_argv, redact_record, redact_text

ENV = {
    "PGPASSWORD": "pg-S3cret",
    "HF_TOKEN": "hf_abcdef",
    "MLFLOW_TRACKING_USERNAME": "bob",
    "MLFLOW_TRACKING_PASSWORD": "bobpw1",
    "TOKENIZERS_PARALLELISM": "false",
    "PWD": "/work/main",
    "SOME_TOKEN_FLAG": "true",
}


def test_urls_options_and_assignments_lose_their_secrets():
    cases = {
        "ablate --storage postgresql://mlflow:PW@db.example:5432/optuna": "ablate --storage postgresql://***@db.example:5432/optuna",
        "postgresql://u:p@ss@h/db": "postgresql://***@h/db",  # an unescaped @ in the password: hidden whole
        "http://h/p?a=b@c": "http://h/p?a=b@c",  # no userinfo: untouched
        "--password 'a b' --db-token=xyz --max-tokens 5": "--password '***' --db-token=*** --max-tokens 5",
        "PGPASSWORD=hunter2 psql": "PGPASSWORD=*** psql",
        "https://h/x?access_token=abc&x=1": "https://h/x?access_token=***&x=1",
        '{"password": "x"}': '{"password": "***"}',
    }
    for text, expected in cases.items():
        assert redact_text(text, {}) == expected, text


def test_secret_environment_values_are_masked_and_harmless_ones_kept():
    text = (
        "argv hf_abcdef pg-S3cret bob:bobpw1 allow_dirty=false parent=true in /work/main/rec.yaml"
    )
    assert (
        redact_text(text, ENV)
        == "argv *** *** *** allow_dirty=false parent=true in /work/main/rec.yaml"
    )


def test_command_lines_records_and_text_files(tmp_path, monkeypatch):
    assert (
        redact_argv(["ablate", "--password", "a b", "--storage", "sqlite:///q.db"])
        == "ablate --password '***' --storage sqlite:///q.db"
    )
    record = {
        "argv": "--storage postgresql://u:pw@h/db",
        "password": "x",
        "n": 3,
        "l": ["https://u:p@h"],
    }
    assert redact_record(record, {}) == {
        "argv": "--storage postgresql://***@h/db",
        "password": "***",
        "n": 3,
        "l": ["https://***@h"],
    }
    monkeypatch.setenv("PGPASSWORD", 'quote"d-secret')
    path = tmp_path / "record.json"
    # escaped in the file: found as data
    path.write_text(json.dumps({"argv": 'x quote"d-secret y'}))
    with redacted_copy(path) as copy:
        assert copy != path and json.loads(copy.read_text()) == {"argv": "x *** y"}
    assert "quote" in path.read_text()  # the local file is left as it was
    clean = tmp_path / "clean.csv"
    clean.write_text("id,label\n0,monkey\n")
    with redacted_copy(clean) as copy:
        assert copy == clean


def test_a_models_tokens_are_not_secrets_but_secret_tokens_still_are():
    """A protocol's ``class_token: false`` and a run's config.json were once masked to ``***``."""
    config = {
        "model": {
            "class_token": False,
            "register_tokens": 4,
            "dist_token": True,
            "pooling": "mean",
        },
        "api_token": "abcd1234",
        "db_password": 123456,
        "auth": {"access_token": "t0ken-value"},
        "SOME_TOKEN_FLAG": True,
        "GITHUB_TOKEN": "false",
    }
    assert redact_record(config, {}) == {
        "model": {
            "class_token": False,
            "register_tokens": 4,
            "dist_token": True,
            "pooling": "mean",
        },
        "api_token": "***",
        "db_password": "***",
        "auth": {"access_token": "***"},
        "SOME_TOKEN_FLAG": True,
        "GITHUB_TOKEN": "false",
    }
    protocol = (
        "arms:\n  - {name: pool_mean, overrides: {model: {class_token: false, pooling: mean}}}\n"
        "model: {cls_token: true, mask-token: none}\n"
    )
    assert redact_text(protocol, {}) == protocol
    as_json = json.dumps(config)
    assert redact_text(as_json, {}) == as_json.replace('"abcd1234"', '"***"').replace(
        '"t0ken-value"', '"***"'
    )
    assert (
        redact_text("--class-token false --api-token s3cr3t access_token: xyz CLS_TOKEN=yes", {})
        == "--class-token false --api-token *** access_token: *** CLS_TOKEN=yes"
    )
    assert (
        redact_argv(["train", "--class-token", "true", "--db-token", "tok1"])
        == "train --class-token true --db-token '***'"
    )


def test_every_shipped_protocol_and_its_canonical_json_go_up_unchanged(tmp_path):
    """The protocol artifacts are the frozen record: masking a value in them breaks their hash."""
    from workbench.protocol import load_any

    protocols = sorted(
        (Path(__file__).resolve().parent.parent / "studies" / "protocols").glob("*.yaml")
    )
    assert protocols
    for path in protocols:
        canonical = tmp_path / "canonical.json"
        canonical.write_text(load_any(path).canonical_json())
        for artifact in (path, canonical):
            with redacted_copy(artifact) as upload:
                assert upload == artifact, f"{path.name}: {artifact.name} would go up changed"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"model": {"name": "cifar_vit", "class_token": False, "pooling": "mean"}})
    )
    with redacted_copy(config) as upload:
        assert upload == config
