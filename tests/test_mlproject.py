"""Every MLproject entry point's command parses against the CLI command it runs.

The command is built by MLflow itself (its quoting included) and run by bash, as
`mlflow run` does, with `python` replaced by a function that prints its arguments; those
arguments are then parsed by the real click command. No training, no MLflow run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import click
import pytest
from mlflow.projects._project_spec import load_project

from studies.cli import main

ROOT = Path(__file__).resolve().parents[1]
PROJECT = load_project(str(ROOT))
BOOLEANS = {
    name
    for ep in PROJECT._entry_points.values()
    for name, p in ep.parameters.items()
    if str(p.default).lower() in ("true", "false")
}
# Parameters MLflow requires (no default): a value that parses.
REQUIRED = {
    "storage": "sqlite:///queue.db",
    "protocol": "studies/protocols/smoke.yaml",
    "param": "optim.lr=float:1e-4:1e-2",
}
# Where the MLproject default differs from the CLI default on purpose.
DEFAULTS_DIFFER = {
    ("train", "subset"): "MLproject's 0 means all images, as the CLI's None does",
    (
        "report",
        "protocol",
    ): "MLproject reports the quick-start study; the CLI needs --protocol or --all",
    (
        "figures",
        "protocol",
    ): "MLproject picks the shipped study; the CLI needs one of --protocol/--run-id/--timm-model",
}


def cli_args(entry: str, params: dict[str, str]) -> list[str]:
    """The argv that `mlflow run . -e ENTRY -P k=v ...` would give `python -m studies.cli`."""
    command = PROJECT.get_entry_point(entry).compute_command(params, None)
    script = 'python() { printf "%s\\0" "$@"; }\n' + command
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    args = out.split("\0")[:-1]
    assert args[:2] == ["-m", "studies.cli"], args
    return args[2:]


def parse(args: list[str]) -> tuple[click.Command, dict]:
    name, rest = args[0], args[1:]
    command = main.get_command(click.Context(main), name)
    while isinstance(command, click.Group):  # `benchmark vit ...`: the group's command
        name, rest = rest[0], rest[1:]
        command = command.get_command(click.Context(command), name)
    assert command is not None, f"MLproject runs unknown subcommand {name!r}"
    ctx = command.make_context(name, list(rest))
    return command, ctx.params


def _text(value) -> str:
    return value[0] if isinstance(value, tuple) else str(value)


def required_params(entry: str) -> dict[str, str]:
    ep = PROJECT.get_entry_point(entry)
    return {k: REQUIRED[k] for k, p in ep.parameters.items() if p.default is None}


@pytest.mark.parametrize("entry", sorted(PROJECT._entry_points))
def test_entry_point_parameters_are_cli_options_and_defaults_agree(entry):
    ep = PROJECT.get_entry_point(entry)
    args = cli_args(entry, required_params(entry))
    command, parsed = parse(args)
    options = {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    # the CLI's own defaults: only what it requires is given, taken from the MLproject run
    needed = [a for p in command.params if p.required for a in (p.opts[0], _text(parsed[p.name]))]
    defaults = command.make_context(args[0], needed).params
    for name, spec in ep.parameters.items():
        option = f"--{name.replace('_', '-')}"
        assert option in options, (
            f"MLproject {entry}: parameter {name} has no CLI option {option} on `workbench {args[0]}`"
        )
        dest = options[option].name
        if (entry, name) in DEFAULTS_DIFFER or spec.default is None:
            continue
        assert parsed[dest] == defaults[dest], (
            f"MLproject {entry}: parameter {name} default {spec.default!r} gives {parsed[dest]!r}, "
            f"the CLI default is {defaults[dest]!r}"
        )


@pytest.mark.parametrize(
    "entry,name",
    sorted(
        (e, n) for e, ep in PROJECT._entry_points.items() for n in ep.parameters if n in BOOLEANS
    ),
)
def test_boolean_parameters_accept_true_and_1_and_refuse_others_by_name(entry, name):
    base = required_params(entry)
    command, _ = parse(cli_args(entry, base))
    dest = next(p.name for p in command.params if f"--{name.replace('_', '-')}" in p.opts)
    for text, expected in [
        ("true", True),
        ("True", True),
        ("1", True),
        ("false", False),
        ("False", False),
        ("0", False),
    ]:
        _, parsed = parse(cli_args(entry, {**base, name: text}))
        assert parsed[dest] is expected, f"{entry} -P {name}={text} gave {parsed[dest]!r}"
    with pytest.raises(click.UsageError, match=f"{name}.*yes"):
        parse(cli_args(entry, {**base, name: "yes"}))


@pytest.mark.parametrize(
    "entry,name,value,extra",
    [
        ("sweep", "storage", "sqlite:///a b.db", {}),
        ("worker", "storage", "sqlite:///a b.db", {}),
        ("worker", "storage_env", "MY_QUEUE", {}),
        ("transfer", "source", "runs:/abc/model", {}),
        ("transfer", "data_path", "/data/my retina", {}),
        ("figures", "data_path", "/data/x y", {}),
        ("figures", "timm_model", "vit_tiny_patch16_224", {"image": "README.md"}),
    ],
)
def test_optional_strings_pass_through_exactly_or_not_at_all(entry, name, value, extra):
    base = {**required_params(entry), **extra}
    command, parsed = parse(cli_args(entry, {**base, name: value}))
    dest = next(p.name for p in command.params if f"--{name.replace('_', '-')}" in p.opts)
    assert parsed[dest] == value
    _, parsed = parse(cli_args(entry, {**base, name: ""}))
    assert parsed[dest] is None


def test_conda_yaml_installs_pyprojects_dependencies():
    """`mlflow run .` without --env-manager builds conda.yaml's environment: the same dependencies as pyproject.toml."""
    import tomllib

    import yaml
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    conda = yaml.safe_load((ROOT / "conda.yaml").read_text())
    # MLproject's conda_env
    assert Path(PROJECT.env_config_path).name == "conda.yaml", PROJECT.env_config_path
    pip = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = [d for d in pip if d != "-e ."]
    missing = sorted(set(project["dependencies"]) - set(listed))
    extra = sorted(set(listed) - set(project["dependencies"]))
    assert not missing and not extra, (
        f"conda.yaml lacks {missing}, has beyond pyproject.toml {extra}"
    )
    assert listed == project["dependencies"], (
        "conda.yaml lists them in another order than pyproject.toml"
    )
    assert "-e ." in pip, "conda.yaml must install the project itself"
    python = next(
        d for d in conda["dependencies"] if isinstance(d, str) and d.startswith("python=")
    )
    version = python.split("=", 1)[1]
    assert version in SpecifierSet(project["requires-python"]), (python, project["requires-python"])
