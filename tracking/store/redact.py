"""Secrets never reach a record: the one redaction of command lines, URLs and environments.

Everything the workbench writes into MLflow (tags, params, text artifacts such as the
``executions/*.json`` records) passes through ``redact_text`` or ``redact_record`` in
``tracking.record.sink``; console lines that show a URL use ``redact_url``. What is replaced by
``***``:

- the userinfo of any URL (``postgresql://mlflow:PW@db/optuna`` -> ``postgresql://***@db/optuna``);
- the value of an option or assignment whose name says it is secret (``--password X``,
  ``--db-token=X``, ``PGPASSWORD=X``, ``?access_token=X``, ``"password": "X"``);
- the value of every environment variable whose name says it is secret (``*_PASSWORD``,
  ``*_TOKEN``, ``*_SECRET``, ``*_API_KEY``, ...) wherever it appears, and the
  ``MLFLOW_TRACKING_USERNAME:MLFLOW_TRACKING_PASSWORD`` pair.
"""

from __future__ import annotations

import os
import re
import shlex

MASK = "***"
# A name is secret when one of these words ends it or a part of it (split at _ or -):
# PGPASSWORD, GITHUB_TOKEN, --db-password, access_token; not TOKENIZERS_PARALLELISM, and
# not PWD (the shell's current directory).
_SECRET_WORDS = r"(?:password|passwd|passphrase|token|secret|api[_-]?key|apikey|access[_-]?key|private[_-]?key|credentials?)"
_SECRET_NAME = re.compile(rf"{_SECRET_WORDS}(?:$|[_-])", re.IGNORECASE)
# ...but a model's tokens are not secrets: ``class_token: false`` in a protocol or a run's
# config.json was once masked to ``***``, and `figures` could not rebuild the model from it.
_MODEL_TOKEN = re.compile(
    r"(?:^|[^a-z])(?:class|cls|dist|distill|distillation|mask|register|reg|prefix|pad|bos|eos"
    r"|unk|sep|special)[_-]?tokens?$",
    re.IGNORECASE,
)
# One of these is in every secret word: a text without any skips the patterns (a fast path for big files).
_HINTS = (
    "passw",
    "passphrase",
    "token",
    "secret",
    "apikey",
    "credential",
    *(f"{word}{sep}key" for word in ("api", "access", "private") for sep in ("_", "-", "")),
)
# Greedy up to the last @ of the authority: a password holding an unescaped @ is hidden whole.
# (the look-behind starts a scheme only where a word starts: linear time on long runs of letters)
_USERINFO = re.compile(r"(?<![a-zA-Z0-9+.-])(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s]*@")
_NAME = rf"[\w-]*?{_SECRET_WORDS}(?![\w-])"
_VALUE = r"""(?:'[^']*'|"[^"]*"|[^\s&;,'"]+)"""
# --password X / --password=X (a shell-quoted value counts as one)
_OPTION = re.compile(rf"(?P<name>--{_NAME})(?P<sep>=|\s+)(?P<value>{_VALUE})", re.IGNORECASE)
# PGPASSWORD=X, ?access_token=X&..., password: X
_ASSIGNMENT = re.compile(
    rf"(?P<name>\b{_NAME})(?P<sep>=|:[ \t]*)(?P<value>{_VALUE})", re.IGNORECASE
)
# "password": "X" in JSON text
_JSON_FIELD = re.compile(
    rf'(?P<name>"{_NAME}")(?P<sep>\s*:\s*)(?P<value>"(?:[^"\\]|\\.)*")', re.IGNORECASE
)
# Values too common to hide everywhere they occur (a *_TOKEN=true flag would mask every "true").
_NOT_SECRETS = {"", "true", "false", "yes", "no", "on", "off", "none", "null"}
MIN_SECRET_CHARS = 4


def is_secret_name(name: str) -> bool:
    """``PGPASSWORD``, ``--db-token``, ``access_token``: yes; ``class_token``, ``TOKENIZERS_PARALLELISM``: no."""
    name = name.strip("'\"-")
    return bool(_SECRET_NAME.search(name)) and not _MODEL_TOKEN.search(name)


def secret_env_values(environ=None) -> list[str]:
    """Values of the environment variables whose names say they are secret, longest first."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if is_secret_name(k) and _worth_hiding(v)}
    user, password = (
        environ.get("MLFLOW_TRACKING_USERNAME"),
        environ.get("MLFLOW_TRACKING_PASSWORD"),
    )
    if user and password:
        values.add(f"{user}:{password}")
    return sorted(values, key=len, reverse=True)


def _worth_hiding(value: str) -> bool:
    return (
        len(value) >= MIN_SECRET_CHARS and value.lower() not in _NOT_SECRETS and not value.isdigit()
    )


def redact_url(text: str) -> str:
    """Every URL userinfo in ``text`` replaced: ``https://user:pw@host/x`` -> ``https://***@host/x``."""
    return _USERINFO.sub(rf"\g<scheme>{MASK}@", text)


def _mask_value(match: re.Match) -> str:
    value = match.group("value")
    bare = value[1:-1] if value.startswith(('"', "'")) else value
    if bare == MASK or bare.lower() in _NOT_SECRETS or not is_secret_name(match.group("name")):
        return match.group(0)
    quote = value[0] if value[:1] in ('"', "'") else ""
    return f"{match.group('name')}{match.group('sep')}{quote}{MASK}{quote}"


def redact_text(text, environ=None) -> str:
    """``text`` (any value, made a string) with URLs' userinfo, secret options and secret env values masked."""
    text = str(text)
    if "://" in text:
        text = redact_url(text)
    for secret in secret_env_values(environ):
        text = text.replace(secret, MASK)
    lowered = text.lower()
    if any(
        hint in lowered for hint in _HINTS
    ):  # each pattern needs a secret word: most texts skip them
        text = _JSON_FIELD.sub(_mask_value, text)
        text = _OPTION.sub(_mask_value, text)
        text = _ASSIGNMENT.sub(_mask_value, text)
    return text


def redact_record(value, environ=None):
    """A JSON-like record (dicts, lists, strings) with every string redacted; keys naming a secret masked whole.

    A flag under such a key (``true``/``false``/``null``) is no secret and stays as it is.
    """
    if isinstance(value, dict):
        return {
            k: (
                MASK
                if isinstance(k, str) and is_secret_name(k) and _maskable(v)
                else redact_record(v, environ)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact_record(v, environ) for v in value]
    if isinstance(value, str):
        return redact_text(value, environ)
    return value


def _maskable(value) -> bool:
    if isinstance(value, str):
        return value.lower() not in _NOT_SECRETS
    return isinstance(value, (int, float, list, dict)) and not isinstance(value, bool)


def redact_argv(argv: list[str]) -> str:
    """A command line as one shell-quoted string, safe to record (the value after ``--password`` too)."""
    words, hide_next = [], False
    for word in argv:
        if hide_next:
            words.append(MASK)
            hide_next = False
            continue
        if word.startswith("--") and "=" not in word and is_secret_name(word[2:]):
            hide_next = True
        words.append(word)
    return redact_text(shlex.join(words))
