"""Colab secrets, read from the JSON file named by ``$COLAB_STUB_SECRETS`` (written by the test).

Like Colab, a secret that is not there raises ``SecretNotFoundError``.
"""

from __future__ import annotations

import json
import os


class SecretNotFoundError(Exception):
    pass


def get(key: str) -> str:
    with open(os.environ["COLAB_STUB_SECRETS"]) as f:
        secrets = json.load(f)
    if key not in secrets:
        raise SecretNotFoundError(f"Secret {key} does not exist.")
    return secrets[key]
