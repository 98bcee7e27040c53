"""Secrets never reach a record: URLs, command lines and secret environment values are masked in one place."""

from __future__ import annotations

import json

from tracking.redact import redact_argv, redact_record, redact_text
from tracking.sink import redacted_copy

ENV = {"PGPASSWORD": "pg-S3cret", "HF_TOKEN": "hf_abcdef", "MLFLOW_TRACKING_USERNAME": "bob",
       "MLFLOW_TRACKING_PASSWORD": "bobpw1", "TOKENIZERS_PARALLELISM": "false", "PWD": "/work/main",
       "SOME_TOKEN_FLAG": "true"}


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
    text = "argv hf_abcdef pg-S3cret bob:bobpw1 allow_dirty=false parent=true in /work/main/rec.yaml"
    assert redact_text(text, ENV) == "argv *** *** *** allow_dirty=false parent=true in /work/main/rec.yaml"


def test_command_lines_records_and_text_files(tmp_path, monkeypatch):
    assert redact_argv(["ablate", "--password", "a b", "--storage", "sqlite:///q.db"]) == \
        "ablate --password '***' --storage sqlite:///q.db"
    record = {"argv": "--storage postgresql://u:pw@h/db", "password": "x", "n": 3, "l": ["https://u:p@h"]}
    assert redact_record(record, {}) == {"argv": "--storage postgresql://***@h/db", "password": "***", "n": 3,
                                         "l": ["https://***@h"]}
    monkeypatch.setenv("PGPASSWORD", 'quote"d-secret')
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"argv": 'x quote"d-secret y'}))  # escaped in the file: found as data
    with redacted_copy(path) as copy:
        assert copy != path and json.loads(copy.read_text()) == {"argv": "x *** y"}
    assert "quote" in path.read_text()  # the local file is left as it was
    clean = tmp_path / "clean.csv"
    clean.write_text("id,label\n0,monkey\n")
    with redacted_copy(clean) as copy:
        assert copy == clean
