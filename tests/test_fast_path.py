"""The fast training path: off by default and then absent from every hash, validated as protocol
keys, recorded on the cell, and a failed compile falls back to the eager step unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from synthetic import synthetic_data, tiny_config
from workbench.models.registry import build_model, model_config
from workbench.protocol import ProtocolError
from workbench.protocol.ablation import parse_protocol
from workbench.train import fast_path
from workbench.train.config import FastPathConfig
from workbench.train.evaluate import read_predictions
from workbench.train.loop import Trainer, config_hash

# The hash of tiny_config(epochs=1) before the recipe and the fast path existed (as in
# tests/test_recipe_parts.py): a config with every fast-path part off keeps it.
MAIN_TINY_CONFIG_HASH = "5e8153d290fd646dbc48660991d456e0a1ba34e5faf41da4018dad883411c82b"


def test_a_config_with_the_fast_path_off_keeps_its_dict_and_hash():
    cfg = tiny_config(epochs=1)
    assert "fast_path" not in cfg.to_dict()
    assert config_hash(cfg) == MAIN_TINY_CONFIG_HASH
    written_off = replace(
        cfg, fast_path=FastPathConfig(compile=False, fused_attention="off", fused_adamw=False)
    )
    assert config_hash(written_off) == MAIN_TINY_CONFIG_HASH
    on = replace(cfg, fast_path=FastPathConfig(compile=True))
    assert on.to_dict()["fast_path"] == {"compile": True}
    assert config_hash(on) != MAIN_TINY_CONFIG_HASH


def protocol(fast=None, arms=None):
    content = {
        "name": "t",
        "description": "d",
        "dataset": {"name": "fashion_mnist", "train_size": 64, "val_size": 32},
        "model": {"name": "fmnist_vit"},
        "run": {"batch_size": 32},
        "arms": arms or [{"name": "a", "reference": True}],
        "seeds": [0],
    }
    if fast is not None:
        content["fast_path"] = fast
    return parse_protocol(content, "t.yaml")


def test_fast_path_keys_are_hashed_only_when_a_part_is_on_and_arms_may_differ_by_path():
    bare = protocol()
    assert "fast_path" not in bare.canonical
    off = protocol({"compile": False, "fused_attention": "off", "fused_adamw": False})
    assert off.hash == bare.hash
    on = protocol({"fused_attention": "auto"})
    assert on.canonical["fast_path"] == {"fused_attention": "auto"} and on.hash != bare.hash
    assert on.cells()[0].config.fast_path.fused_attention == "auto"
    arms = [
        {"name": "today", "reference": True},
        {"name": "fast", "overrides": {"fast_path": {"compile": True, "fused_adamw": True}}},
    ]
    configs = {c.arm: c.config for c in protocol(arms=arms).cells()}
    assert configs["today"].fast_path == FastPathConfig()
    assert configs["fast"].fast_path == FastPathConfig(compile=True, fused_adamw=True)


@pytest.mark.parametrize(
    "fast, message",
    [
        ({"compiled": True}, r"t.yaml: unknown key 'fast_path.compiled'; valid keys here: compile"),
        ({"compile": "yes"}, r"t.yaml: fast_path.compile='yes': expected bool"),
        ({"fused_attention": "fast"}, r"t.yaml: fast_path.fused_attention='fast': expected 'off'"),
    ],
)
def test_bad_fast_path_values_are_refused_naming_file_and_key(fast, message):
    with pytest.raises(ProtocolError, match=message):
        protocol(fast)


def test_config_refuses_bad_values_naming_the_key():
    with pytest.raises(ValueError, match=r"fast_path.fused_attention='yes': must be 'off', 'on'"):
        FastPathConfig(fused_attention="yes")
    with pytest.raises(ValueError, match=r"fast_path.compile=1: must be true or false"):
        FastPathConfig(compile=1)


def test_train_fast_option_builds_the_section_and_names_a_bad_key():
    import click

    from studies.ablation.train import parse_fast_path

    got = parse_fast_path(("compile=true", "fused_attention=auto", "fused_adamw=true"))
    assert got == FastPathConfig(compile=True, fused_attention="auto", fused_adamw=True), got
    assert parse_fast_path(()) == FastPathConfig()
    with pytest.raises(click.BadParameter, match="'compiled' is not a fast_path key"):
        parse_fast_path(("compiled=true",))


@pytest.mark.parametrize("value", ["off", "on", "auto"])
def test_train_fast_takes_every_fused_attention_value_a_protocol_takes(value, tmp_path):
    """``--fast fused_attention=on`` was refused: YAML 1.1 read on/off as booleans, while ``--help``
    and protocol files (YAML 1.2 booleans) take them. Now the option reads values as a file does."""
    from click.testing import CliRunner

    from studies.ablation.train import parse_fast_path, parse_overrides
    from studies.cli import main
    from workbench.protocol.common import read_yaml

    assert parse_fast_path((f"fused_attention={value}",)) == FastPathConfig(fused_attention=value)
    (tmp_path / "section.yaml").write_text(f"fused_attention: {value}\n")
    assert FastPathConfig(**read_yaml(tmp_path / "section.yaml")).fused_attention == value
    # the other override options read values the same way (1e-3 a number, yes a word, true a bool)
    assert parse_overrides(("lr=1e-3", "mode=yes", "flag=true")) == {
        "lr": 1e-3,
        "mode": "yes",
        "flag": True,
    }
    # on the command line: the option is taken, and the command goes on to the next check
    missing = tmp_path / "missing"
    result = CliRunner().invoke(
        main,
        ["train", "--fast", f"fused_attention={value}", "--dataset", "image_folder"]
        + ["--data-path", str(missing), "--device", "cpu", "--output-dir", str(tmp_path / "o")],
    )
    assert result.exit_code != 0 and "--fast" not in result.output, result.output
    assert "missing" in result.output, result.output


def test_auto_attention_is_fused_on_cuda_only():
    assert fast_path.attention_is_fused("auto", "cuda")
    assert not fast_path.attention_is_fused("auto", "cpu")
    assert fast_path.attention_is_fused("on", "cpu")
    assert not fast_path.attention_is_fused("off", "cuda")


def tiny_model():
    torch.manual_seed(0)
    return build_model(
        model_config("fmnist_vit", dim=32, depth=2, heads=2, mlp_hidden=64, dropout=0.1)
    ).train()


def test_a_compile_that_fails_at_its_first_call_falls_back_to_the_eager_step(monkeypatch, capsys):
    model = tiny_model()
    x = torch.randn(4, 1, 28, 28)

    def broken_compile(module, **_):
        def call(_images):
            torch.rand(1000)  # the failed attempt drew random numbers: they must be given back
            raise RuntimeError("no C++ compiler found\nsecond line")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    forward = fast_path.TrainingForward(model, FastPathConfig(compile=True))
    assert forward.status == "pending"
    torch.manual_seed(1)
    got = forward(x)  # dropout draws: the fallback must draw what an eager call draws
    torch.manual_seed(1)
    want = model(x)
    diff = (got - want).abs().max().item()
    assert torch.equal(got, want), f"fallback differs from the eager forward by {diff:.3g}"
    assert forward.status == "failed" and forward.tags() == {"compiled": "failed"}
    line = capsys.readouterr()
    text = line.out + line.err
    assert (
        "fast_path.compile: torch.compile is unavailable here (RuntimeError: no C++ compiler"
        in (text)
    ), text
    assert "second line" not in text
    forward.timed_first_step(0.0)
    assert forward.compile_seconds is None


def test_a_compile_refused_at_once_trains_eagerly(monkeypatch):
    def refused(module, **_):
        raise RuntimeError("torch.compile is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refused)
    model = tiny_model()
    forward = fast_path.TrainingForward(model, FastPathConfig(compile=True))
    x = torch.randn(2, 1, 28, 28)
    torch.manual_seed(3)
    got = forward(x)
    torch.manual_seed(3)
    assert torch.equal(got, model(x)) and forward.status == "failed"


def test_one_line_says_the_first_step_compiles_before_the_compile_starts(
    tmp_path, mlflow_store, monkeypatch
):
    """A cold torch.compile (68 s, 127 s measured) ran without a word; now one line comes first.
    The compiler is a stand-in that prints when its first call (the compile) starts."""
    from click.testing import CliRunner

    from data_fixtures import make_image_folder
    from studies.cli import main

    def stand_in(module, **_):
        calls = []

        def call(images):
            if not calls:
                print("STAND-IN COMPILE STARTS")
            calls.append(1)
            return module(images)

        return call

    monkeypatch.setattr(torch, "compile", stand_in)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    make_image_folder(tmp_path / "two", classes=("cat", "dog"), per_class={"train": 8, "test": 2})
    command = ["train", "--model", "cifar_cnn", "--dataset", "image_folder", "--set"]
    command += ["num_classes=2", "--epochs", "1", "--batch-size", "8", "--device", "cpu"]
    command += ["--data-path", str(tmp_path / "two"), "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(main, [*command, "--fast", "compile=true"])
    assert result.exit_code == 0, result.output
    notice = "fast_path.compile: the first training step compiles the model (torch.compile); a cold compile takes about 1 to 2 minutes"
    assert result.output.count(notice) == 1, result.output
    assert result.output.index(notice) < result.output.index("STAND-IN COMPILE STARTS")
    eager = CliRunner().invoke(main, [*command, "--output-dir", str(tmp_path / "eager")])
    assert eager.exit_code == 0 and "fast_path.compile" not in eager.output, eager.output


def test_off_is_the_model_itself_and_fused_adamw_is_torchs_fused_kernel():
    model = tiny_model()
    forward = fast_path.TrainingForward(model, FastPathConfig())
    assert forward.compiled is None and forward.tags() == {}
    params = list(model.parameters())
    assert fast_path.adamw(params, FastPathConfig(fused_adamw=True), lr=1e-3).defaults["fused"]
    assert not fast_path.adamw(params, FastPathConfig(), lr=1e-3).defaults["fused"]


@pytest.mark.slow  # trains a tiny ViT for one epoch
def test_a_cell_trained_with_fused_attention_records_it_and_is_reload_proven(tmp_path):
    data = synthetic_data(n_train=64, n_val=32, n_test=8)
    cfg = replace(tiny_config(epochs=1), fast_path=FastPathConfig(fused_attention="on"))
    trainer = Trainer(cfg, data, tmp_path / "run")
    assert all(m.fast for m in trainer.model.modules() if hasattr(m, "fast"))
    result = trainer.fit()
    assert result.fast_path == {"attention": "fused"}, result.fast_path
    # The reload proof rebuilds the model on the path that made the saved predictions: bitwise.
    assert result.reload_proof.passed, result.reload_proof.summary()
    assert len(read_predictions(tmp_path / "run" / "predictions" / "val.csv")) == 32


def test_analysis_proves_a_fused_attention_cell_on_its_path_and_acts_on_the_written_out_one():
    from workbench.interventions.sources import saved_through_fused_attention

    glass = {"model": {"name": "fmnist_vit", "overrides": {}}}
    assert not saved_through_fused_attention(glass)
    assert saved_through_fused_attention({**glass, "fast_path": {"fused_attention": "on"}})
    auto = {**glass, "fast_path": {"fused_attention": "auto", "compile": True}}
    assert not saved_through_fused_attention(auto, "cpu")
    assert saved_through_fused_attention(auto, "cuda")
    # A trained model is rebuilt for analysis with the written-out attention (the stage probs exist).
    model = tiny_model()
    assert not any(getattr(m, "fast", False) for m in model.modules())
