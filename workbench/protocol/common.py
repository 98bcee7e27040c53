"""What every protocol kind shares: the YAML reader, the one validator, the canonical hash.

Both kinds (``ablation``: arms train a registry model from scratch; ``transfer``: regimes
adapt one source checkpoint) are frozen dataclasses checked by the same rules:

- a section is a mapping whose keys are the fields of a config dataclass (so the valid keys
  come from the dataclass itself, never from a copied list), and an unknown key is an error
  naming its dotted path and the valid keys;
- each value is checked against the field's type hint (``_coerce``); an int where a float is
  expected becomes a float, so ``lr: 1`` and ``lr: 1.0`` hash the same;
- every error is one ``ProtocolError`` line starting with the file, then the dotted key and value.

The hash is sha256 of ``canonical_json`` of the validated content with defaults filled:
formatting, comments and key order do not change it; any value does.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import types
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

import yaml

SCHEMA_VERSION = 1  # bump when the canonical form changes, so old and new hashes never collide
SHORT_HASH_LEN = 12
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")

Fail = Callable[[str], Exception]


class ProtocolError(ValueError):
    """A protocol file is invalid; the message names the file, the key path and the value."""


class ProtocolFrozenError(ProtocolError):
    """A protocol name was already run with different content."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 numbers and booleans, refusing duplicate keys.

    PyYAML follows YAML 1.1, where ``1e-3`` is a string and ``off`` is false: ``lr: 1e-3``
    and ``amp: off`` would fail confusingly. A repeated key would silently keep the last value.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", node.value[i][0].start_mark
                )
        return super().construct_mapping(node, deep=deep)


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag != _BOOL]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | Path) -> Any:
    """A protocol file's parsed content; ``ProtocolError`` naming the file (and line) otherwise."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:  # a stream, so YAML errors name the file and line
            return yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ProtocolError(f"{path}: cannot read protocol file: {e}") from e
    except UnicodeDecodeError as e:  # a binary file given for a protocol
        raise ProtocolError(
            f"{path}: not a text (UTF-8) protocol file: byte 0x{e.object[e.start]:02x} at "
            f"position {e.start}"
        ) from e
    except yaml.YAMLError as e:
        raise ProtocolError(f"{path}: invalid YAML: {e}") from e


def check_batch_fits(
    batch_size: int, where: str, train_size: int | None, subset: int | None, fail
) -> None:
    """Refuse a batch larger than the training split, when the protocol fixes that split's size.

    ``subset`` keeps at most that many images per split. Otherwise the size is known only
    once the data is loaded, and the training entry point checks it then.
    """
    sizes = {k: v for k, v in (("dataset.train_size", train_size), ("dataset.subset", subset)) if v}
    if not sizes:
        return
    key, n_train = min(sizes.items(), key=lambda kv: kv[1])
    if batch_size > n_train:
        raise fail(
            f"{where}={batch_size}: larger than the training split ({key}={n_train}); every epoch would be "
            f"one short batch"
        )


def check_finite(value: Any, fail: Fail, where: str = "") -> None:
    """Refuse ``inf`` and ``nan`` anywhere in a protocol's content (YAML's ``.inf``, ``.nan``), naming the key.

    Checked on the raw content before any section is validated, so a non-finite value in a
    free-form mapping (``timm_kwargs``) is named too, not reported later by the JSON encoder.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise fail(f"{where or 'protocol'}={value!r}: must be a finite number (not inf or nan)")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, fail, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(item, fail, f"{where}[{i}]")


def canonical_json(obj: Any) -> str:
    """The exact text that is hashed: sorted keys, no spaces, no NaN."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def canonical_and_hash(content: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``content`` as it round-trips through canonical JSON (tuples as lists) and its sha256."""
    text = canonical_json(content)
    return json.loads(text), hashlib.sha256(text.encode()).hexdigest()


def check_frozen(protocol: Any, previous_hashes: set[str]) -> None:
    """Refuse a protocol whose name was already run with other content.

    Args:
        protocol: A loaded protocol of any kind (``name``, ``hash``, ``short_hash``).
        previous_hashes: Full hashes of this protocol name that froze it: the hashes with a
            cell that started training (``tracking.record.protocol_runs.frozen_hashes``), not a parent
            that failed before any cell trained.

    Raises:
        ProtocolFrozenError: ``previous_hashes`` holds a hash other than ``protocol.hash``.
    """
    others = sorted(h for h in previous_hashes if h and h != protocol.hash)
    if others:
        raise ProtocolFrozenError(
            f"protocol {protocol.name!r} was already run with hash {', '.join(h[:SHORT_HASH_LEN] for h in others)}; "
            f"this file has hash {protocol.short_hash}: a protocol name is frozen once a cell of it has started "
            "training — make a new protocol file with a new name"
        )


# --- the validator ---------------------------------------------------------------------------


def field_names(cls: type, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The dataclass's field names in declaration order: the valid keys of its section."""
    return tuple(f.name for f in fields(cls) if f.name not in exclude)


def identifier(value: Any, where: str, fail: Fail) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise fail(
            f"{where}={value!r}: must be a safe identifier of lowercase letters, digits, '_' and '-'"
        )
    return value


def description(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(f"description={value!r}: must be a non-empty string")
    return value


def mapping(
    value: Any,
    where: str,
    valid: tuple[str, ...],
    fail: Fail,
    label: str = "here",
    hints: dict[tuple[str, str], str] | None = None,
) -> dict:
    """``value`` (``None`` = empty) as a dict with only ``valid`` keys; errors name the dotted path.

    Args:
        hints: ``(section, key) -> text`` added after an unknown key people often reach for.
    """
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise fail(f"{where or 'protocol'}={value!r}: must be a mapping")
    for key in value:
        if key not in valid:
            hint = (hints or {}).get((where.rsplit(".", 1)[-1], key), "")
            raise fail(
                f"unknown key {f'{where}.{key}' if where else key!r}{hint}; valid keys {label}: {', '.join(valid)}"
            )
    return value


def required(values: dict, keys: tuple[str, ...], where: str, fail: Fail) -> None:
    missing = [k for k in keys if k not in values]
    if missing and not where:
        raise fail(f"missing required key(s) {', '.join(missing)}")
    if missing:
        raise fail(f"{where}.{missing[0]}: required")


def section(
    value: Any,
    where: str,
    cls: type | dict[str, Any],
    valid: tuple[str, ...],
    fail: Fail,
    hints: dict[tuple[str, str], str] | None = None,
) -> dict[str, Any]:
    """A config section: keys checked against ``valid``, values against ``cls``'s type hints.

    Args:
        cls: A config dataclass, or ``{key: type hint}`` for a section spanning several.
    """
    types_ = cls if isinstance(cls, dict) else get_type_hints(cls)
    values = {
        k: coerce(v, types_[k], f"{where}.{k}", fail)
        for k, v in mapping(value, where, valid, fail, hints=hints).items()
    }
    for key, v in values.items():
        check_seed(v, f"{where}.{key}", fail)
    return values


def check_seed(value: Any, where: str, fail: Fail) -> None:
    """Refuse a negative seed at load: numpy's generators raise a bare ValueError for one, after
    the study's runs are open (a key named ``seed`` or ``*_seed``, in every section of every kind)."""
    key = where.rsplit(".", 1)[-1]
    if (key == "seed" or key.endswith("_seed")) and isinstance(value, int) and value < 0:
        raise fail(f"{where}={value!r}: must be an integer >= 0")


def yaml_value(text: str) -> Any:
    """One value written as in a protocol file (``KEY=VALUE`` on the command line): YAML 1.2's
    numbers and booleans, so ``on``, ``off``, ``yes`` and ``no`` stay strings as they do in a file."""
    return yaml.load(text, Loader=_Loader)


def build(cls: type, kwargs: dict[str, Any], where: str, fail: Fail) -> Any:
    """Construct a config dataclass, turning its ValueError into a one-line protocol error."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise fail(f"bad value in {where!r}: {e}") from e


def coerce(value: Any, hint: Any, where: str, fail: Fail) -> Any:
    """``value`` checked against a type hint; an int becomes a float where a float is expected."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return coerce(value, arg, where, fail)
            except ProtocolError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is tuple and isinstance(value, (list, tuple)):
        item_hints = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_hints) == len(value):
            return tuple(
                coerce(v, h, f"{where}[{i}]", fail)
                for i, (v, h) in enumerate(zip(value, item_hints))
            )
    elif (
        hint is Any
        or (hint is type(None) and value is None)
        or (origin is dict and isinstance(value, dict))
    ):
        return value
    elif hint in (bool, str) and isinstance(value, hint):
        return value
    elif hint in (int, float) and isinstance(value, (int, hint)) and not isinstance(value, bool):
        return hint(value)
    raise fail(f"{where}={value!r}: expected {_describe(hint)}")


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType, Literal):
        return " or ".join(repr(a) if origin is Literal else _describe(a) for a in args)
    if origin is tuple:
        return (
            f"a list of {_describe(args[0])}"
            if args[-1] is Ellipsis
            else f"a list of {len(args)} numbers"
        )
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def seeds(value: Any, fail: Fail) -> tuple[int, ...]:
    if not (isinstance(value, list) and value and all(type(s) is int and s >= 0 for s in value)):
        raise fail(f"seeds={value!r}: must be a non-empty list of integers >= 0")
    if len(set(value)) != len(value):
        raise fail(f"seeds={value!r}: seeds must be distinct")
    return tuple(value)


def unique_names(names: list[str], what: str, fail: Fail) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fail(
            f"duplicate {what} name(s) {', '.join(map(repr, dupes))}; {what} names must be unique"
        )


def one_reference(refs: list[str], what: str, fail: Fail) -> None:
    if len(refs) != 1:
        raise fail(
            f"exactly one {what} must have 'reference: true'; found {len(refs)}"
            + (f" ({', '.join(refs)})" if refs else "")
        )
