"""The fast token-drop path gives the reference numbers, and `workbench benchmark-attribute` runs.

The drops and curves run the fused attention kernel, one flat gather of the kept tokens and
only the class token after the last block's attention (``token_drop.class_token_only``). The
reference here is the plain computation: the shorter sequence built from the parameters, run
through the written-out attention with every token to the end. Tiny random models with every
tensor randomised (as in test_attribution.py); each check prints its largest difference.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from click.testing import CliRunner

from studies.cli import main as cli
from workbench.attribution import order_of, perturbation_curves, single_token_effects
from workbench.models.vit import ViTConfig, VisionTransformer

TOLERANCE = 1e-5  # float32 rounding of a depth-2 model with O(1) weights; the measured differences are ~1e-7


@torch.no_grad()
def _random_model(seed: int, **extra) -> VisionTransformer:
    cfg = ViTConfig(
        image_size=8,
        patch_size=2,
        in_channels=1,
        num_classes=3,
        dim=16,
        depth=2,
        heads=2,
        mlp_hidden=32,
        **extra,
    )
    model = VisionTransformer(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    for tensor in model.state_dict().values():
        scale = max(tensor.double().pow(2).mean().sqrt().item(), 0.3)
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    return model


@torch.no_grad()
def _reference_log_probs(
    model: VisionTransformer, x: torch.Tensor, variants: list[tuple[int, list[int]]]
) -> np.ndarray:
    """``(V, classes)`` float64 log-probabilities of each ``(image, kept patches)`` variant, written out.

    Each variant is its own sequence, cut from the intact tokens entering block 0 (no hook attached)
    and run to the end with every token; variants of equal length share a batch (rows are independent).
    """
    model.set_fast_attention(False)
    tokens = model.embed(x)
    p = model.cfg.num_prefix_tokens
    out = np.empty((len(variants), model.cfg.num_classes))
    for length in sorted({len(kept) for _, kept in variants}):
        which = [v for v, (_, kept) in enumerate(variants) if len(kept) == length]
        seq = torch.stack(
            [
                tokens[variants[v][0], list(range(p)) + [p + i for i in variants[v][1]]]
                for v in which
            ]
        )
        out[which] = torch.log_softmax(
            model.forward_head(model.forward_blocks(seq)).double(), -1
        ).numpy()
    return out


def test_fast_drops_and_curves_match_the_written_out_reference():
    model = _random_model(3, register_tokens=2, layer_scale_init=0.5)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(3, 1, 8, 8, generator=gen), torch.randint(0, 3, (3,), generator=gen)
    P = model.cfg.num_patches
    got = single_token_effects(model, x, y, max_sequences=40)
    variants = [(b, [j for j in range(P) if j != i]) for b in range(3) for i in [None, *range(P)]]
    ref = _reference_log_probs(model, x, variants)[
        np.arange(len(variants)), np.repeat(y.numpy(), P + 1)
    ]
    ref = ref.reshape(3, P + 1)  # per image: intact, then patch i dropped
    want = ref[:, :1] - ref[:, 1:]
    diff = float(np.abs(got.effects - want).max())
    print(f"single-token effects: max |fast - reference| {diff:.3g}")
    assert diff <= TOLERANCE, f"single-token effects differ from the reference by {diff:.3g}"
    assert np.abs(want).max() > 1e-2  # the effects are not all ~0, so the comparison can fail

    scores = {"a": torch.randn(3, P, generator=gen), "b": torch.randn(3, P, generator=gen)}
    counts = [0, 1, 5, 11, P]
    curves = perturbation_curves(model, x, y, scores, counts=counts, max_sequences=4)
    got, variants = [], []
    for m, s in scores.items():
        order = order_of(s)
        for j, k in enumerate(counts):
            for b in range(3):
                got += [curves.deletion_prob[m][b, j], curves.insertion_prob[m][b, j]]
                variants += [(b, sorted(order[b, k:].tolist())), (b, sorted(order[b, :k].tolist()))]
    labels = y.numpy()[[b for b, _ in variants]]
    want = np.exp(_reference_log_probs(model, x, variants)[np.arange(len(variants)), labels])
    worst = float(np.abs(np.asarray(got) - want).max())
    print(f"curves: max |fast - reference| probability {worst:.3g}")
    assert worst <= TOLERANCE, f"curve probabilities differ from the reference by {worst:.3g}"


def test_benchmark_attribute_runs_on_a_tiny_setting_and_counts_its_sequences(tmp_path):
    before = torch.get_num_threads()
    try:
        result = CliRunner().invoke(
            cli,
            [
                "benchmark-attribute",
                "--protocol",
                "studies/protocols/smoke_faithfulness.yaml",
                "--cells",
                "1",
                "--images",
                "1",
                "--threads",
                "1",
                "--output-dir",
                str(tmp_path),
            ],
        )
    finally:
        torch.set_num_threads(before)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "smoke_faithfulness.json").read_text())
    (timing,) = record["timings"]
    P, S = 49, len(record["methods"])  # the smoke cells' 28 px, patch 4 ViT; five methods
    # one intact + P single drops, the curves' two shared ends, (P - 1) inner points x 2 kinds x S methods
    assert timing["forwards"] == 1 + P + 2 + 2 * (P - 1) * S, timing
    assert timing["threads"] == 1 and timing["images"] == 1 and timing["cpu_seconds"] > 0
    assert abs(timing["goal_ratio"] - timing["wall_seconds"] / 300.0) <= 1e-12
    assert "1 thread(s):" in result.output and "x the 300-s goal" in result.output
    assert (
        "at the start" in result.output
        and "threads: use: 1 thread(s) (the only option timed)" in (result.output)
    ), result.output
    assert record["use"] == "use: 1 thread(s) (the only option timed)" and record["load_end"] >= 0


def test_benchmark_attribute_times_the_controls_the_study_runs(tmp_path):
    # smoke_faithfulness_controls: 8 methods, 10 random draws per image, the randomisation check.
    # Before, the benchmark left the controls out and sized cifar10_registers_faithfulness at
    # about 40 minutes on one core; its patch-4 cells took about 33 minutes each.
    before = torch.get_num_threads()
    try:
        result = CliRunner().invoke(
            cli,
            [
                "benchmark-attribute",
                "--protocol",
                "studies/protocols/smoke_faithfulness_controls.yaml",
                "--cells",
                "1",
                "--images",
                "1",
                "--threads",
                "1",
                "--output-dir",
                str(tmp_path),
            ],
        )
    finally:
        torch.set_num_threads(before)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "smoke_faithfulness_controls.json").read_text())
    (timing,) = record["timings"]
    P, S, D = 49, len(record["methods"]), 10
    assert S == 8, record["methods"]
    # the methods' curves as above, then each draw's order: two shared ends, (P - 1) x 2 kinds each
    methods = 1 + P + 2 + 2 * (P - 1) * S
    assert timing["forwards"] == methods + 2 + 2 * (P - 1) * D, (timing["forwards"], methods)


def test_benchmark_attribute_refuses_a_bad_thread_list_in_one_line(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "benchmark-attribute",
            "--protocol",
            "studies/protocols/smoke_faithfulness.yaml",
            "--threads",
            "1,zero",
            "--output-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2 and "'1,zero': give thread counts >= 1" in result.output, (
        result.output
    )
    assert not list(tmp_path.iterdir())
