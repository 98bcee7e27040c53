"""Attribution methods, exact causal effects, curves, AUC and token norms (workbench/attribution/).

Tiny random models (8 x 8 px, patch 2 = 16 patch tokens, dim 16, depth 2, 2 heads) with every
tensor randomised, so no default-init constant hides a mistake. Each check compares values at
a stated tolerance and prints the largest difference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_vits import random_vit, tiny_config
from scipy.stats import spearmanr

from workbench.analysis.rollout import attention_rollout
from workbench.attribution import (
    METHODS,
    AttributionError,
    attention_mass_on,
    attribute,
    auc,
    chefer,
    cls_attention,
    grad_x_input,
    logits_keeping,
    concentration,
    order_of,
    perturbation_curves,
    random_order,
    rollout,
    score_cell,
    single_token_effects,
    spearman_per_image,
    token_norms,
    top_count,
    top_mask,
)
from workbench.models.hooks import attached
from workbench.models.vit import ViTConfig, VisionTransformer

P = 16  # patch tokens of BASE: 8 x 8 px in 2 x 2 patches
BASE = tiny_config(image_size=8, patch_size=2, in_channels=1, num_classes=3, heads=2)
FAMILIES = {
    "plain": {},
    "registers": dict(register_tokens=2),
    "layerscale_registers": dict(layer_scale_init=0.5, register_tokens=1),
    # DINOv2-reg's layout
    "registers_positions_on_patches_only": dict(register_tokens=1, no_embed_class=True),
}


def make(family: str = "registers", seed: int = 0, **extra) -> VisionTransformer:
    return random_vit({**BASE, **FAMILIES[family], **extra}, seed, floor=0.3)


def batch(n: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def hooks_of(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ------------------------------------------------------------------------------ methods


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_method_scores_each_patch_in_eval_mode_and_leaves_the_model_as_it_was(family):
    model, (x, y) = make(family), batch()
    plain = model(x)
    model.train()
    scores = attribute(model, x, y, list(METHODS), seed=3, batch_size=3)  # 2 batches: 3 + 1 images
    assert model.training and hooks_of(model) == 0
    model.eval()
    assert torch.equal(model(x), plain)
    for name, s in scores.items():
        assert s.shape == (4, P) and s.dtype == torch.float64 and torch.isfinite(s).all(), name
    # batching does not change a method's scores (eval mode: images do not interact)
    for name in ("cls_attention", "rollout", "chefer", "grad_x_input"):
        one = torch.cat([METHODS[name](model, x[i : i + 1], y[i : i + 1]) for i in range(4)])
        assert max_diff(one, scores[name]) <= 1e-6, (
            f"{name}: per image vs batched: {max_diff(one, scores[name]):.3g}"
        )


def test_cls_attention_and_rollout_are_the_class_rows_of_the_maps():
    model, (x, y) = make("registers"), batch()
    with torch.no_grad():
        maps = model.forward_analysis(x).attentions
    p = model.cfg.num_prefix_tokens
    want = maps[-1].double().mean(dim=1)[:, 0, p:]
    assert torch.equal(cls_attention(model, x, y), want)
    # rollout by hand, without any renormalisation: 0.5 A + 0.5 I rows already sum to 1
    eye = torch.eye(maps[0].shape[-1], dtype=torch.float64)
    by_hand = eye
    for a in maps:
        by_hand = (0.5 * a.double().mean(dim=1) + 0.5 * eye) @ by_hand
    full = attention_rollout(maps)
    row_error = (full.sum(dim=-1) - 1).abs().max().item()
    assert row_error <= 1e-12, f"rollout rows sum to 1 +- {row_error:.3g}"
    # attention_rollout renormalises rows after adding I: a no-op but for the float32 maps' row sums (1 +- 1e-7)
    diff = max_diff(rollout(model, x, y), by_hand[:, 0, p:])
    assert diff <= 1e-6, f"rollout vs prod(0.5 A + 0.5 I) by hand: max |difference| {diff:.3g}"


def _gradients_by_patching(model: VisionTransformer, x: torch.Tensor, y: torch.Tensor):
    """dz_y/dA_l the other way: block l's map replaced by a leaf tensor equal to it, the gradient w.r.t. the leaf.

    Only block l's map is replaced, so the later maps still depend on it: the total derivative, as the
    gradient read off the map in the graph is (Chefer et al.'s hook on the attention tensor).
    """
    with torch.no_grad():
        maps = [a.detach() for a in model.forward_analysis(x).attentions]
    grads = []
    for i, a in enumerate(maps):
        leaf = a.clone().requires_grad_(True)
        with attached(model, [(f"blocks.{i}.attn.probs", lambda _a, leaf=leaf: leaf)]):
            z = model(x).gather(1, y.view(-1, 1)).sum()
        grads.append(torch.autograd.grad(z, [leaf])[0])
    return maps, grads


def test_chefer_is_the_generic_rule_on_independently_taken_gradients():
    model, (x, y) = make("registers"), batch()
    model.double()
    x = x.double()
    maps, grads = _gradients_by_patching(model, x, y)
    # one gradient entry of block 0 against a central finite difference (block 1's map recomputed)
    eps, (b, h, q, k) = 1e-6, (1, 0, 0, 5)
    values = []
    for sign in (1, -1):
        bumped = maps[0].clone()
        bumped[b, h, q, k] += sign * eps
        with (
            torch.no_grad(),
            attached(model, [("blocks.0.attn.probs", lambda _a, bumped=bumped: bumped)]),
        ):
            values.append(model(x)[b, y[b]].item())
    fd = (values[0] - values[1]) / (2 * eps)
    got = grads[0][b, h, q, k].item()
    assert abs(fd - got) <= 1e-6, f"dz/dA: autograd {got:.8g} vs finite difference {fd:.8g}"
    # R = I; R <- R + E_h[(grad * A)^+] R, in numpy
    n = maps[0].shape[-1]
    relevance = np.stack([np.eye(n)] * x.shape[0])
    for a, g in zip(maps, grads):
        cam = np.clip(g.numpy() * a.numpy(), 0, None).mean(axis=1)
        relevance = relevance + cam @ relevance
    p = model.cfg.num_prefix_tokens
    got = chefer(model, x, y)
    diff = max_diff(got, relevance[:, 0, p:])
    assert diff <= 1e-12, f"chefer vs the rule by hand: max |difference| {diff:.3g}"
    # a model run on the fused kernel: the hooks on the maps switch it to the written-out path for the call
    model.set_fast_attention(True)
    assert torch.equal(chefer(model, x, y), got)
    assert all(block.attn.fast for block in model.blocks)


def test_grad_x_input_matches_a_finite_difference_on_one_patch():
    model, (x, y) = make("plain"), batch(2)
    model.double()
    x = x.double()
    scores = grad_x_input(model, x, y)
    patch, (row, col) = 6, divmod(6, 4)
    mask = torch.zeros_like(x)
    mask[:, :, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2] = 1.0
    eps = 1e-6  # d/de z_y(x + e * mask * x) at 0 = sum over the patch of x * dz/dx
    with torch.no_grad():
        up = model(x + eps * mask * x).gather(1, y.view(-1, 1))[:, 0]
        down = model(x - eps * mask * x).gather(1, y.view(-1, 1))[:, 0]
    fd = (up - down) / (2 * eps)
    diff = max_diff(scores[:, patch], fd)
    assert diff <= 1e-6, (
        f"grad x input on patch {patch} vs finite difference: max |difference| {diff:.3g}"
    )


def test_random_order_is_seeded_and_never_runs_the_model():
    model, (x, y) = make(), batch()
    a, b = random_order(model, x, y, seed=7), random_order(model, x, y, seed=7)
    assert torch.equal(a, b) and a.shape == (4, P)
    assert not torch.equal(a, random_order(model, x, y, seed=8))
    assert torch.equal(attribute(model, x, y, ["random"], seed=7, batch_size=1)["random"], a)


def test_refusals_name_what_is_wrong():
    x, y = batch()
    mean_model = VisionTransformer(ViTConfig(**BASE, pooling="mean")).eval()
    with pytest.raises(AttributionError, match="pooling='mean'"):
        cls_attention(mean_model, x, y)
    with pytest.raises(
        AttributionError, match="unknown attribution method 'lime'; valid methods: cls_attention"
    ):
        attribute(make(), x, y, ["lime"])
    with pytest.raises(AttributionError, match="not Linear"):
        rollout(torch.nn.Linear(2, 2), x, y)
    with pytest.raises(AttributionError, match="labels must lie in 0..2"):
        rollout(make(), x, y + 5)


# ------------------------------------------------------------------------------ causal effects


def _tokens_by_hand(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """The sequence entering block 0, rebuilt from the parameters (no hook point involved)."""
    patches = torch.nn.functional.conv2d(
        x, model.patch_proj.weight, model.patch_proj.bias, stride=2
    )
    patches = patches.flatten(2).transpose(1, 2)
    prefix = [model.cls_token.expand(x.shape[0], -1, -1)]
    if model.register_tokens is not None:
        prefix.append(model.register_tokens.expand(x.shape[0], -1, -1))
    if model.cfg.no_embed_class:  # positions on the patches only, the prefix tokens without
        return torch.cat(prefix + [patches + model.pos_embed], dim=1)
    return torch.cat(prefix + [patches], dim=1) + model.pos_embed


@pytest.mark.parametrize("family", ["plain", "registers", "registers_positions_on_patches_only"])
def test_each_single_drop_is_the_model_run_on_the_sequence_without_that_token(family):
    model, (x, y) = make(family), batch(3)
    got = single_token_effects(model, x, y, max_sequences=20)  # chunks of one image: 16 drops each
    p = model.cfg.num_prefix_tokens
    with torch.no_grad():
        seq = _tokens_by_hand(model, x)
        full = torch.log_softmax(model.forward_head(model.forward_blocks(seq)).double(), -1)
        want = np.empty((3, P))
        for i in range(P):
            keep = [t for t in range(seq.shape[1]) if t != p + i]
            dropped = torch.log_softmax(
                model.forward_head(model.forward_blocks(seq[:, keep])).double(), -1
            )
            want[:, i] = (full - dropped).gather(1, y.view(-1, 1))[:, 0].numpy()
    diff = max_diff(got.effects, want)
    assert diff <= 1e-5, (
        f"{family}: effects vs the hand-built shorter sequences: max |difference| {diff:.3g}"
    )
    assert got.forwards == 3 + 3 * P and np.abs(got.effects).max() > 1e-3
    # and by a third route: for a CLS-pooling model, removing a token = masking its key column in every map
    i = 9
    with torch.no_grad():

        def mask(a: torch.Tensor) -> torch.Tensor:
            a = a.clone()
            a[..., p + i] = 0.0
            return a / a.sum(dim=-1, keepdim=True)

        with attached(model, [(f"blocks.{b}.attn.probs", mask) for b in range(model.cfg.depth)]):
            masked = torch.log_softmax(model(x).double(), -1)
    via_mask = (full - masked).gather(1, y.view(-1, 1))[:, 0].numpy()
    diff = max_diff(got.effects[:, i], via_mask)
    assert diff <= 1e-5, (
        f"{family}: effect of patch {i} vs masking its key column: max |difference| {diff:.3g}"
    )


def planted_model(patch: int = 5) -> VisionTransformer:
    """One block whose class token attends (almost) only to ``patch``; the head reads the class token directly.

    The planted patch's position carries a spike on channel 0, which no pixel and no other token
    has; keys read channel 0 and every query asks for it, so the class token's attention on that
    patch is 1 to within e^-80. The MLP adds nothing and there is no final norm.
    """
    cfg = ViTConfig(**{**BASE, "depth": 1, "heads": 1}, final_norm=False)
    model = VisionTransformer(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    d = cfg.dim
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
        model.patch_proj.weight.copy_(torch.randn(model.patch_proj.weight.shape, generator=gen))
        model.patch_proj.weight[0] = 0.0
        model.pos_embed[0, 1 + patch, 0] = 50.0
        model.cls_token[0, 0, 1:] = torch.randn(d - 1, generator=gen) * 0.1
        block = model.blocks[0]
        block.norm1.weight.fill_(1.0)
        block.norm2.weight.fill_(1.0)
        block.attn.qkv.bias[0] = 10.0  # q = 10 e_0 for every query
        block.attn.qkv.weight[d, 0] = 10.0  # k_0 = 10 x_0 (normalised)
        block.attn.qkv.weight[2 * d :] = torch.eye(d)  # v = normalised token
        block.attn.out_proj.weight.copy_(torch.eye(d))
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=gen))
        model.head.weight[0, 0] = 5.0  # class 0 rises with the planted token's value on channel 0
    return model


def test_a_planted_patch_has_all_the_effect_and_the_methods_that_should_find_it_do():
    model, planted = planted_model(5), 5
    x, _ = batch(6)
    y = torch.zeros(6, dtype=torch.long)
    effects = single_token_effects(model, x, y).effects
    others = np.delete(np.abs(effects), planted, axis=1).max()
    assert (np.abs(effects[:, planted]) > 1e3 * max(others, 1e-12)).all(), (
        f"planted effect {np.abs(effects[:, planted]).min():.3g} vs the largest other {others:.3g}"
    )
    scores = attribute(model, x, y, ["cls_attention", "rollout", "chefer", "grad_x_input"])
    for name in ("cls_attention", "rollout", "chefer"):
        top = order_of(scores[name])[:, 0]
        assert (top == planted).all(), f"{name} ranks patches {top.tolist()} first, not {planted}"
    # gradient x input puts all its magnitude there (its sign follows the pixels' content)
    top = scores["grad_x_input"].abs().argmax(dim=1)
    assert (top == planted).all(), f"|grad x input| peaks at {top.tolist()}, not {planted}"


# ------------------------------------------------------------------------------ curves, AUC, rho


def test_auc_is_the_trapezoid_over_fractions_with_both_ends():
    fractions, values = [0.0, 0.25, 0.5, 1.0], [1.0, 0.5, 0.5, 0.0]
    # by hand: 0.25 * 0.75 + 0.25 * 0.5 + 0.5 * 0.25 = 0.1875 + 0.125 + 0.125
    assert abs(auc(fractions, values) - 0.4375) <= 1e-15
    assert np.allclose(auc(fractions, [values, [1.0] * 4]), [0.4375, 1.0], atol=1e-15, rtol=0)
    with pytest.raises(AttributionError, match="from 0 to 1 inclusive"):
        # a grid without the 0 point is refused, never rescaled
        auc([0.25, 0.5, 1.0], [1.0, 0.5, 0.0])


def test_curves_start_and_end_where_they_must_and_the_first_deletion_is_the_single_drop():
    model, (x, y) = make("registers"), batch(3)
    scores = attribute(model, x, y, ["cls_attention", "grad_x_input", "random"], seed=1)
    curves = perturbation_curves(model, x, y, scores, max_sequences=6)  # chunks of 2 images
    effects = single_token_effects(model, x, y)
    full = np.exp(effects.full_log_prob)
    with torch.no_grad():
        alone = torch.softmax(
            logits_keeping(model, x, torch.zeros(3, 1, 0, dtype=torch.long))[:, 0].double(), -1
        )
    alone = alone.gather(1, y.view(-1, 1))[:, 0].numpy()
    assert np.array_equal(curves.fractions, np.arange(P + 1) / P)
    for m in scores:
        d, i = curves.deletion_prob[m], curves.insertion_prob[m]
        assert max_diff(d[:, 0], full) <= 1e-6 and max_diff(i[:, -1], full) <= 1e-6, m
        assert max_diff(d[:, -1], alone) <= 1e-6 and max_diff(i[:, 0], alone) <= 1e-6, m
        top = order_of(scores[m])[:, 0].numpy()
        one_drop = np.exp(effects.full_log_prob - effects.effects[np.arange(3), top])
        diff = max_diff(d[:, 1], one_drop)
        assert diff <= 1e-5, f"{m}: deletion at 1/P vs the single drop of its top patch: {diff:.3g}"
        assert np.allclose(curves.deletion_auc(m), auc(curves.fractions, d), atol=0, rtol=0)
    # a coarser grid keeps both ends
    coarse = perturbation_curves(model, x, y, scores, counts=[0, 4, 8, 16])
    assert np.array_equal(coarse.fractions, [0, 0.25, 0.5, 1])
    assert (
        max_diff(coarse.deletion_prob["random"], curves.deletion_prob["random"][:, [0, 4, 8, 16]])
        <= 1e-6
    )
    with pytest.raises(AttributionError, match="must include 0 and 16"):
        perturbation_curves(model, x, y, scores, counts=[1, 16])


def test_spearman_per_image_is_scipys_with_ties_and_nan_for_a_constant_vector():
    rng = np.random.default_rng(0)
    s, e = rng.normal(size=(3, 10)), rng.normal(size=(3, 10))
    s[1, :4] = 1.0  # ties get their average rank
    e[2] = 0.5  # no drop changes anything: undefined
    rho = spearman_per_image(s, e)
    for b in range(2):
        assert abs(rho[b] - spearmanr(s[b], e[b]).statistic) <= 1e-12
    assert np.isnan(rho[2])
    assert abs(spearman_per_image([[1, 2, 3]], [[10, 30, 20]])[0] - 0.5) <= 1e-12


def test_cls_attention_on_the_tokens_that_matter_by_hand():
    attention = np.array([[0.1, 0.4, 0.2, 0.3]])
    effects = np.array([[5.0, -1.0, 5.0, 0.0]])  # a tie at the top: the lower index first
    assert top_mask(effects, 2).tolist() == [[True, False, True, False]]
    assert abs(attention_mass_on(attention, top_mask(effects, 2))[0] - 0.3) <= 1e-15
    # a share, any scale
    assert abs(attention_mass_on(attention * 2, top_mask(attention, 1))[0] - 0.4) <= 1e-15
    with pytest.raises(ValueError, match="must be in 1..4"):
        top_mask(effects, 5)


# ------------------------------------------------------------------------------ token norms


def test_token_norms_find_a_planted_high_norm_token_and_its_cls_attention():
    model, (x, _) = make("registers"), batch(4)
    x = x.clone()
    x[1, :, 4:6, 2:4] *= 1e4  # image 1, patch row 2, col 1 = index 9
    norms = token_norms(model, x, k=10.0, batch_size=3)
    with torch.no_grad():
        analysis = model.forward_analysis(x)
    p = model.cfg.num_prefix_tokens
    for b in range(model.cfg.depth):
        want = analysis.hidden_states[f"blocks.{b}.resid2"].double().norm(dim=-1)[:, p:]
        # float32 tokens, batches of 3 vs 4
        relative = max_diff(norms.norms[:, b] / want.numpy(), 1.0)
        assert relative <= 1e-6, (
            f"block {b}: norms vs forward_analysis: max relative difference {relative:.3g}"
        )
        assert norms.outlier[:, b].sum() == 1 and norms.outlier[1, b, 9], (
            f"block {b}: {np.argwhere(norms.outlier[:, b])}"
        )
        assert norms.outlier_positions(b).tolist() == [[1, 2, 1]]
    assert np.allclose(norms.outlier_fraction, 1 / (4 * P), atol=1e-15, rtol=0)
    assert norms.outlier_grid()[:, 2, 1].tolist() == [1, 1]
    attn = analysis.attentions[-1].double().mean(dim=1)[:, 0, p:]
    share, tokens = norms.attention_share()
    want_share = (attn[1, 9] / attn[1].sum()).item()
    assert abs(share[1, -1] - want_share) <= 1e-12 and abs(tokens[1, -1] - 1 / P) <= 1e-15
    assert np.isnan(share[0]).all()
    effects = np.arange(4 * P, dtype=np.float64).reshape(4, P)
    inside, outside = norms.effect_of_outliers(effects)
    assert inside.tolist() == [effects[1, 9]] * 2
    assert np.allclose(outside, np.delete(effects.ravel(), P + 9).mean(), atol=1e-12, rtol=0)


def test_concentration_of_a_hand_made_cls_row_is_what_the_definitions_give():
    # one block, two heads, 7 tokens: CLS, 2 registers, 4 patches (prefix 3)
    head0 = [0.1, 0.2, 0.1, 0.3, 0.1, 0.1, 0.1]  # over the patches: 1/2, 1/6, 1/6, 1/6
    head1 = [0.2, 0.0, 0.0, 0.8, 0.0, 0.0, 0.0]  # all patch attention on patch 0
    uniform = [0.2, 0.0, 0.0, 0.2, 0.2, 0.2, 0.2]
    rows = np.array([[[head0, head1]], [[uniform, uniform]]])  # (B=2, L=1, H=2, N=7)
    c = concentration(rows, prefix=3, top_k=2)
    # the heads' mean row: 0.55, 0.05, 0.05, 0.05 on the patches (0.7 in all)
    mean = (
        11 / 14,
        1 / 14,
    )
    want = {
        "top1": [[11 / 14], [0.25]],
        "topk": [[12 / 14], [0.5]],
        "entropy": [
            [-(mean[0] * np.log(mean[0]) + 3 * mean[1] * np.log(mean[1])) / np.log(4)],
            [1.0],
        ],
        "registers": [[0.15], [0.0]],
        "self_share": [[0.15], [0.2]],
        "top1_heads": [[[0.5, 1.0]], [[0.25, 0.25]]],
        "topk_heads": [[[2 / 3, 1.0]], [[0.5, 0.5]]],
        "entropy_heads": [[[0.5 * np.log(12) / np.log(4), 0.0]], [[1.0, 1.0]]],
        "registers_heads": [[[0.3, 0.0]], [[0.0, 0.0]]],
    }
    for name, expected in want.items():
        diff = max_diff(getattr(c, name), expected)
        assert diff <= 1e-12, (
            f"{name}: {getattr(c, name).tolist()} vs {expected}: max |difference| {diff:.3g}"
        )
    assert c.top_k == 2 and concentration(rows, prefix=3).top_k == 1 == top_count(4)
    # ceil(P / 10), no float rounding
    assert [top_count(n) for n in (1, 16, 30, 49, 64)] == [
        1,
        2,
        3,
        5,
        7,
    ]
    assert np.isnan(
        concentration(rows[..., :4], prefix=3).entropy
    ).all()  # one patch: no entropy to normalise
    with pytest.raises(ValueError, match="must be in 1..4"):
        concentration(rows, prefix=3, top_k=5)


def test_a_model_with_four_registers_goes_through_every_method_the_drops_and_the_norms():
    model, (x, y) = make("plain", seed=4, register_tokens=4), batch(3)
    p = model.cfg.num_prefix_tokens
    assert p == 5
    done: list[int] = []
    cell = score_cell(
        model,
        x,
        y,
        list(METHODS),
        seed=1,
        k=3.0,
        counts=[0, 8, 16],
        batch_size=2,
        progress=done.append,
    )
    assert done == [2, 1]  # one call per image batch, with its size
    for m in METHODS:
        s = cell.scores[m]
        # patch tokens only: no register is scored
        assert s.shape == (3, P) and np.isfinite(s).all(), m
    # batching does not change the cell: one batch of 3 gives the same scores and effects
    whole = score_cell(model, x, y, list(METHODS), seed=1, k=3.0, counts=[0, 8, 16], batch_size=3)
    for m in METHODS:
        diff = max_diff(whole.scores[m], cell.scores[m])
        assert diff <= 1e-6, f"{m}: batches of 2 vs 3: max |difference| {diff:.3g}"
    assert max_diff(whole.causal.effects, cell.causal.effects) <= 1e-5
    with torch.no_grad():
        seq = _tokens_by_hand(model, x)  # CLS, 4 registers, 16 patches
        full = torch.log_softmax(model.forward_head(model.forward_blocks(seq)).double(), -1)
        i = 6
        keep = [t for t in range(seq.shape[1]) if t != p + i]  # the registers stay, like CLS
        dropped = torch.log_softmax(
            model.forward_head(model.forward_blocks(seq[:, keep])).double(), -1
        )
        alone = torch.softmax(model.forward_head(model.forward_blocks(seq[:, :p])).double(), -1)
        analysis = model.forward_analysis(x)
    effect = (full - dropped).gather(1, y.view(-1, 1))[:, 0].numpy()
    diff = max_diff(cell.causal.effects[:, i], effect)
    assert diff <= 1e-5, (
        f"effect of patch {i} vs the hand-built sequence with the 4 registers: {diff:.3g}"
    )
    prefix_only = alone.gather(1, y.view(-1, 1))[
        :, 0
    ].numpy()  # every patch deleted: CLS and registers alone
    for m in METHODS:
        diff = max_diff(cell.curves.deletion_prob[m][:, -1], prefix_only)
        assert diff <= 1e-6, (
            f"{m}: deletion of every patch vs CLS and 4 registers alone: {diff:.3g}"
        )
    norms = cell.norms
    assert norms.norms.shape == (3, 2, P) and norms.prefix_norms.shape == (3, 2, p)
    for b in range(2):
        tokens = analysis.hidden_states[f"blocks.{b}.resid2"].double().norm(dim=-1).numpy()
        assert max_diff(norms.prefix_norms[:, b] / tokens[:, :p], 1.0) <= 1e-6, (
            f"block {b}: register norms"
        )
        assert max_diff(norms.median[b], np.median(tokens[:, p:])) <= 1e-5 * np.median(
            tokens[:, p:]
        ), b
        row = analysis.attentions[b].double().mean(dim=1)[:, 0].numpy()  # (3, 21) heads averaged
        c = norms.concentration
        assert max_diff(c.registers[:, b], row[:, 1:p].sum(axis=1)) <= 1e-6, (
            f"block {b}: CLS attention on registers"
        )
        assert max_diff(c.self_share[:, b], row[:, 0]) <= 1e-6, (
            f"block {b}: CLS attention on itself"
        )
        q = row[:, p:] / row[:, p:].sum(axis=1, keepdims=True)
        assert max_diff(c.top1[:, b], q.max(axis=1)) <= 1e-6, f"block {b}: top-1 share"
        assert (
            c.top_k == 2 and max_diff(c.topk[:, b], np.sort(q, axis=1)[:, -2:].sum(axis=1)) <= 1e-6
        ), b
    assert (
        max_diff(norms.cls_attention, analysis.attentions[-1].double().mean(dim=1)[:, 0, p:])
        <= 1e-7
    )
    assert (c.entropy > 0).all() and (c.entropy <= 1 + 1e-12).all() and (c.registers > 0).all()


# ------------------------------------------------------------------------------ the cell, timm


def test_score_cell_gives_every_array_per_image_and_a_summary_per_method():
    model, (x, y) = make("registers"), batch(3)
    plain = model(x)
    cell = score_cell(
        model, x, y, list(METHODS), seed=2, k=5.0, image_index=[10, 11, 12], counts=[0, 8, 16]
    )
    assert torch.equal(model(x), plain) and hooks_of(model) == 0
    # the drops' fused kernel was for their calls only
    assert not any(block.attn.fast for block in model.blocks)
    assert cell.image_index.tolist() == [10, 11, 12] and cell.norms.k == 5.0
    rows = {r.method: r for r in cell.summary()}
    assert list(rows) == list(METHODS)
    for m in METHODS:
        assert cell.rho[m].shape == (3,) and cell.deletion_auc[m].shape == (3,)
        assert abs(rows[m].mean_rho - np.nanmean(cell.rho[m])) <= 1e-12
        assert abs(rows[m].insertion_auc - cell.insertion_auc[m].mean()) <= 1e-12
    assert cell.forwards == cell.causal.forwards + cell.curves.forwards > 0
    on_top = cell.cls_attention_on_top_effects(top=3)
    attn = cell.norms.cls_attention
    for b in range(3):
        top = np.argsort(-cell.causal.effects[b], kind="stable")[:3]
        assert abs(on_top[b] - attn[b, top].sum() / attn[b].sum()) <= 1e-12
    assert (
        cell.cls_attention_concentration(top=3) >= on_top - 1e-12
    ).all()  # no 3 tokens get more than its own top 3


def test_a_timm_vit_converted_exactly_gives_the_same_logits_and_runs_every_method():
    timm = pytest.importorskip("timm")
    from workbench.convert.timm_vit import glassbox_from_timm
    from workbench.equivalence import set_timm_fused

    torch.manual_seed(0)
    source = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=3,
        embed_dim=16,
        depth=2,
        num_heads=2,
        reg_tokens=2,
    ).eval()
    # timm's written-out attention: the glass box's default path, so 0.0 is possible
    set_timm_fused(source, False)
    glass, _ = glassbox_from_timm(source)
    x, y = batch(2)
    with torch.no_grad():
        diff = (glass(x) - source(x)).abs().max().item()
    assert diff == 0.0, f"converted glass box vs timm: max |logit difference| {diff:.3g}"
    assert glass.cfg.register_tokens == 2
    # a timm model is converted
    cell = score_cell(source, x, y, list(METHODS), seed=0, counts=[0, 8, 16])
    same = score_cell(glass, x, y, list(METHODS), seed=0, counts=[0, 8, 16])
    for m in METHODS:
        assert np.array_equal(cell.scores[m], same.scores[m]), m
    assert np.array_equal(cell.causal.effects, same.causal.effects)
