"""The equivalence check is only as strong as its inputs: planted bugs must fail it.

Each test plants a bug the 0.0 comparison has to catch: a weight mapping that swaps
tensors (in a test-only wrapper around ``map_timm_state_dict``), a one-ulp nudge of one
tensor, a bug on the plain ``forward()`` path, and the refusal of an unsupported model
before any full-size build. Reduced size (2 blocks, width 64, 4x4 patches) with the same
options as the full models keeps each test to seconds.
"""

from __future__ import annotations

import time

import pytest
import timm
import torch
from click.testing import CliRunner

from workbench.convert import timm_vit
from workbench.equivalence import randomize_every_tensor, run_equivalence

# LayerScale and a register token switched on, so gammas and tokens are tensors to get wrong.
SMALL = dict(
    embed_dim=64,
    depth=2,
    num_heads=2,
    img_size=64,
    patch_size=16,
    num_classes=10,
    init_values=1e-5,
    reg_tokens=1,
)


def small_vit(randomize: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **SMALL).eval()
    if randomize:
        randomize_every_tensor(model, seed)
    return model


def plant_in_mapping(monkeypatch, change) -> None:
    """Wrap the real weight mapping so that ``change(state)`` edits the mapped glass-box state."""
    real = timm_vit.map_timm_state_dict

    def mapped_with_bug(source, cfg):
        state, audit = real(source, cfg)
        state = dict(state)
        change(state)
        return state, audit

    monkeypatch.setattr(timm_vit, "map_timm_state_dict", mapped_with_bug)


def swap_ls_and_norms(state: dict) -> None:
    """The planted mapping bug: ls1 <-> ls2 and norm1 <-> norm2 in every block."""
    for key in [k for k in state if ".ls1." in k or ".norm1." in k]:
        other = key.replace(".ls1.", ".ls2.").replace(".norm1.", ".norm2.")
        state[key], state[other] = state[other], state[key]


def failures(report) -> str:
    bad = [s for s in report.stages + report.forward if not s.passed][:5]
    return report.summary() + "".join(
        f"\n  {s.stage}: max |diff| {s.max_abs_diff:.3g}" for s in bad
    )


def test_randomize_gives_every_tensor_its_own_non_constant_values():
    model = small_vit(randomize=True)
    state = model.state_dict()
    assert all(t.numel() < 2 or t.std() > 0 for t in state.values()), "a constant tensor is left"
    by_shape: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        for other in by_shape.setdefault(tuple(tensor.shape), []):
            assert not torch.equal(tensor, state[other]), f"{name} equals {other}"
        by_shape[tuple(tensor.shape)].append(name)
    again = small_vit(randomize=True).state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state), "not reproducible from the seed"


def test_swapped_layerscale_and_norms_pass_with_timm_init_and_fail_randomised(monkeypatch):
    plant_in_mapping(monkeypatch, swap_ls_and_norms)
    blind = run_equivalence(
        small_vit(randomize=False), "swap, timm init", batch=2, seed=0, gradients=False
    )
    # timm's constant norms and gammas make the swapped mapping the same function:
    # why --weights random randomises every tensor.
    assert blind.passed, failures(blind)
    report = run_equivalence(
        small_vit(randomize=True), "swap, randomised", batch=2, seed=0, gradients=False
    )
    assert not report.passed
    first_bad = next(s for s in report.stages if not s.passed)
    assert first_bad.stage == "blocks.0.norm1", failures(report)
    assert not any(row.passed for row in report.forward), failures(report)


# The slow test below nudges every tensor; these are ones timm's init would hide (zero
# biases, near-zero tokens) plus a gamma.
ONE_ULP_TENSORS = ["reg_token", "blocks.0.norm1.bias", "blocks.1.ls2.gamma"]


def nudge_one_ulp(timm_key: str):
    """Every element of one tensor moved by one ulp (towards +inf) in the mapped state."""

    def change(state: dict) -> None:
        (key,) = [k for k in state if timm_vit.timm_key_for(k) == timm_key]
        state[key] = torch.nextafter(state[key], torch.full_like(state[key], float("inf")))

    return change


@pytest.mark.parametrize("timm_key", ONE_ULP_TENSORS)
def test_one_ulp_in_one_tensor_is_caught(monkeypatch, timm_key):
    model = small_vit(randomize=True)
    plant_in_mapping(monkeypatch, nudge_one_ulp(timm_key))
    report = run_equivalence(model, f"one ulp in {timm_key}", batch=1, seed=0, gradients=False)
    assert not report.passed, f"one ulp in {timm_key} not caught: {report.summary()}"


@pytest.mark.slow
def test_one_ulp_in_any_tensor_is_caught_only_with_randomised_weights(monkeypatch):
    missed = {}
    for randomize in (True, False):
        model = small_vit(randomize)
        missed[randomize] = []
        for key in model.state_dict():
            with monkeypatch.context() as patch:
                plant_in_mapping(patch, nudge_one_ulp(key))
                if run_equivalence(model, key, batch=2, seed=0, gradients=False).passed:
                    missed[randomize].append(key)
    assert missed[True] == [], f"randomised weights: one ulp not caught in {missed[True]}"
    # timm's zero biases and tiny tokens absorb a one-ulp change: the reason to randomise.
    assert "head.bias" in missed[False] and "cls_token" in missed[False], missed[False]


def test_a_bug_in_the_one_forward_fails_stages_and_logits_without_gradients(monkeypatch):
    from workbench.models.vit import Block

    def forward_with_bug(self, x):
        x = self.hook_resid1(
            x + self.hook_ls1(self.ls1(self.hook_attn(self.attn(self.hook_norm1(self.norm1(x))))))
        )
        # the bug: norm1 where norm2 belongs
        h = self.hook_mlp(self.mlp(self.hook_norm2(self.norm1(x))))
        return self.hook_resid2(x + self.hook_ls2(self.ls2(h)))

    monkeypatch.setattr(Block, "forward", forward_with_bug)
    report = run_equivalence(
        small_vit(randomize=True), "forward bug", batch=2, seed=0, gradients=False
    )
    # One body: the recorded stages are the forward's own, so the bug shows in both.
    failed = [row.stage for row in report.stages if not row.passed]
    assert failed and failed[0] == "blocks.0.norm2", failures(report)
    assert [row.stage for row in report.forward] == ["forward()", "forward() fast attention"]
    assert not any(row.passed for row in report.forward), failures(report)
    assert not report.passed


@pytest.mark.parametrize(
    "model, option",
    [
        ("vit_base_r50_s16_384", "HybridEmbed patch embedding"),
        ("deit_base_distilled_patch16_384", "distillation token"),
    ],
)
def test_unsupported_model_is_refused_in_one_line_without_a_full_build(
    mlflow_store, monkeypatch, model, option
):
    from studies.cli import main

    real = timm.create_model

    def meta_only(*args, **kwargs):
        assert torch.get_default_device().type == "meta", (
            "a full model was built before the refusal"
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(timm, "create_model", meta_only)
    start = time.process_time()
    result = CliRunner().invoke(main, ["equivalence", "--model", model])
    seconds = time.process_time() - start
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and model in lines[0], result.output
    assert seconds < 2.0, f"refusal took {seconds:.2f} s of CPU"
