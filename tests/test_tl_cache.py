"""The TransformerLens cache methods, each against an independent computation in plain torch.

The independent side never goes through the hook points: it reads the model's submodules with
``register_forward_hook`` / ``register_forward_pre_hook`` on the blocks, attention modules and
norms, and recomputes tails of the forward by calling those submodules. Every comparison
prints its max |difference|; sums of components are float sums in another order than the
forward's, so they are held to 1e-5 (the sizes here are O(1)), everything else to 0.0.
"""

from __future__ import annotations

import pytest
import timm
import torch

from test_interventions import FAMILIES, hooks_of, images, make
from workbench.interventions import HookError, as_glassbox, hook_paths, logit_lens, run_with_cache
from workbench.models.hooks import HookPoint

SUM_TOL = 1e-5
# the families whose head reads the class token through the final norm (logit_attrs applies)
CLS_FAMILIES = ["plain", "layerscale_registers", "clip_like_swiglu", "rmsnorm_glu_no_positions"]
# the families with a final norm (apply_ln_to_stack at the end applies)
NORMED = CLS_FAMILIES + ["qk_norm_inner_norms"]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = SUM_TOL) -> float:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    diff = (actual.double() - expected.double()).abs().max().item()
    print(f"{what}: max |diff| {diff:.3g}")
    assert diff <= tol, f"{what}: max |difference| {diff:.3g} > {tol:g}"
    return diff


def plain_torch(model, x) -> dict:
    """Block inputs and outputs, attention outputs, norm inputs and outputs, by module hooks."""
    seen: dict = {"in": [], "out": [], "attn": [], "ls1": [], "norm_in": None, "norm": None}
    handles = []
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda m, a: seen["in"].append(a[0])))
        handles.append(block.register_forward_hook(lambda m, a, o: seen["out"].append(o)))
        handles.append(block.attn.register_forward_hook(lambda m, a, o: seen["attn"].append(o)))
        handles.append(block.ls1.register_forward_hook(lambda m, a, o: seen["ls1"].append(o)))

    def on_norm(m, a, o):
        seen["norm_in"], seen["norm"] = a[0], o

    handles.append(model.norm.register_forward_hook(on_norm))
    try:
        seen["logits"] = model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decompose_resid_sums_to_the_final_residual_and_accumulated_resid_ends_there(family):
    model, x = make(family), images()
    ref = plain_torch(model, x)
    _, cache = model.run_with_cache(x)
    parts, labels = cache.decompose_resid(return_labels=True)
    depth = model.cfg.depth
    assert labels[-2:] == [f"{depth - 1}_attn_out", f"{depth - 1}_mlp_out"]
    assert len(labels) == len(parts) == 2 * depth + (1 if "pos_embed" not in labels else 2)
    close(
        parts.sum(0), ref["out"][-1], f"{family}: decompose_resid summed vs the last block's output"
    )
    # the comparison sees a missing component: without the embeddings the sum is far off
    gap = (cache.decompose_resid(incl_embeds=False).sum(0) - ref["out"][-1]).abs().max().item()
    assert gap > 10 * SUM_TOL, f"{family}: leaving out the embeddings changed the sum by only {gap}"
    # up to block 1's input, and to its mlp input (resid_mid)
    close(cache.decompose_resid(layer=1).sum(0), ref["in"][1], f"{family}: decompose to block 1")
    mid = cache.decompose_resid(layer=1, mlp_input=True).sum(0)
    close(mid, cache["blocks.1.resid1"], f"{family}: decompose to block 1's mlp input")
    acc, acc_labels = cache.accumulated_resid(return_labels=True, incl_mid=True)
    assert acc_labels == ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"]
    close(acc[-1], ref["out"][-1], f"{family}: accumulated_resid's last entry", tol=0.0)
    close(acc[0], ref["in"][0], f"{family}: accumulated_resid's first entry", tol=0.0)
    close(acc[2], ref["in"][1], f"{family}: accumulated_resid's 1_pre", tol=0.0)


@pytest.mark.parametrize("family", ["plain", "layerscale_registers", "no_class_token"])
def test_stack_head_results_summed_over_heads_plus_bias_is_the_attention_output(family):
    model, x = make(family), images()
    ref = plain_torch(model, x)
    _, cache = run_with_cache(model, x, names_filter=lambda n: n.endswith("attn.z"))
    heads, labels = cache.stack_head_results(return_labels=True)
    H, depth = model.cfg.heads, model.cfg.depth
    assert heads.shape == (depth * H, *ref["out"][0].shape) and labels[H + 1] == "L1H1"
    scaled = model.cfg.layer_scale_init is not None
    for i, block in enumerate(model.blocks):
        bias = block.attn.out_proj.bias * (block.ls1.gamma if scaled else 1)
        expected = ref["ls1"][i] if scaled else ref["attn"][i]
        close(
            heads[i * H : (i + 1) * H].sum(0) + bias, expected, f"{family}: block {i} heads + bias"
        )
        gap = (heads[i * H : (i + 1) * H - 1].sum(0) + bias - expected).abs().max().item()
        assert gap > 10 * SUM_TOL, f"{family}: one head fewer changed the sum by only {gap}"
    # up to block 1 only, at the class token / first position
    first = cache.stack_head_results(layer=1, pos_slice=0)
    close(first, heads[:H, :, 0], "layer=1, pos_slice=0", tol=0.0)


def test_stack_head_results_refuses_a_norm_over_all_heads():
    model, x = make("qk_norm_inner_norms"), images()
    _, cache = model.run_with_cache(x)
    with pytest.raises(HookError, match="normalises all heads together"):
        cache.stack_head_results()


@pytest.mark.parametrize("family", NORMED)
def test_apply_ln_to_stack_of_the_residual_is_the_norms_output_with_the_forwards_statistics(family):
    model, x = make(family), images()
    ref = plain_torch(model, x)
    _, cache = model.run_with_cache(x)
    final = cache.accumulated_resid()[-1:]
    bias = model.norm.bias if getattr(model.norm, "bias", None) is not None else 0.0
    close(cache.apply_ln_to_stack(final)[0] + bias, ref["norm"], f"{family}: final norm")
    # linear in the components: the decomposition, normed and summed, is the same output
    normed = cache.decompose_resid(apply_ln=True).sum(0) + bias
    close(normed, ref["norm"], f"{family}: decompose_resid(apply_ln=True) summed + bias")
    # block 1's norm1, with block 1's input statistics; and pos_slice on a sliced stack
    block = model.blocks[1]
    b1 = block.norm1.bias if getattr(block.norm1, "bias", None) is not None else 0.0
    pre = cache.accumulated_resid(layer=1, apply_ln=True)[-1] + b1
    close(
        pre, block.norm1(ref["in"][1]), f"{family}: accumulated_resid(layer=1, apply_ln) vs norm1"
    )
    at0 = cache.apply_ln_to_stack(final[:, :, 0], pos_slice=0)[0] + bias
    close(at0, ref["norm"][:, 0], f"{family}: pos_slice=0")


@pytest.mark.parametrize("family", CLS_FAMILIES)
def test_logit_attrs_of_the_decomposition_plus_the_biases_are_the_logits(family):
    model, x = make(family), images()
    logits, cache = model.run_with_cache(x)
    parts = cache.decompose_resid(pos_slice=0)  # (C, B, D) at the class token
    W, b = model.head.weight, model.head.bias
    norm_bias = model.norm.bias if getattr(model.norm, "bias", None) is not None else 0.0
    classes = torch.tensor([0, 3, 4])
    attrs = cache.logit_attrs(parts, classes, pos_slice=0)
    assert attrs.shape == (parts.shape[0], 3)
    constant = b[classes] + (norm_bias * W[classes]).sum(-1)
    close(
        attrs.sum(0) + constant, logits[torch.arange(3), classes], f"{family}: logit of each label"
    )
    diff = cache.logit_attrs(parts, 2, incorrect_classes=1, pos_slice=0).sum(0)
    const = b[2] - b[1] + (norm_bias * (W[2] - W[1])).sum(-1)
    close(diff + const, logits[:, 2] - logits[:, 1], f"{family}: logit difference 2 - 1")
    # a stack with positions kept: each position scored with its own statistics
    every = cache.logit_attrs(cache.decompose_resid(), classes)
    close(every[:, :, 0], attrs, f"{family}: positions kept, class token column", tol=0.0)


def test_logit_attrs_and_the_final_norm_refuse_models_without_them():
    model, x = make("mean_pooling"), images()
    _, cache = model.run_with_cache(x)
    with pytest.raises(HookError, match="pools 'mean'"):
        cache.logit_attrs(cache.accumulated_resid()[:, :, 0], 0)
    with pytest.raises(HookError, match="no final norm"):
        cache.apply_ln_to_stack(cache.accumulated_resid()[-1:])


@pytest.mark.parametrize("family", CLS_FAMILIES + ["mean_pooling"])
def test_the_logit_lens_of_each_block_is_its_output_through_the_final_norm_and_head(family):
    model, x = make(family), images()
    ref = plain_torch(model, x)
    lens = logit_lens(model, x)
    assert lens.shape == (model.cfg.depth, x.shape[0], model.cfg.num_classes)
    close(lens[-1], ref["logits"], f"{family}: lens of the last block vs the logits", tol=0.0)
    if model.cfg.pooling == "cls":  # by hand: the class token of block 0, normed, classified
        by_hand = model.head(model.norm(ref["out"][0])[:, 0])
        close(lens[0], by_hand, f"{family}: lens of block 0 vs head(norm(class token))", tol=0.0)


def _tail_from(model, i: int, tokens: torch.Tensor) -> torch.Tensor:
    """The forward after block ``i``'s output, calling the submodules directly."""
    for block in model.blocks[i + 1 :]:
        tokens = block(tokens)
    return model.forward_head(model.norm(tokens))


@pytest.mark.parametrize("family", ["plain", "layerscale_registers", "mean_pooling"])
def test_incl_bwd_caches_the_gradient_at_every_point_equal_to_autograd(family):
    model, x = make(family), images()
    metric = lambda logits: logits[:, 2].sum() - logits[:, 0].logsumexp(0)  # noqa: E731
    logits, cache = model.run_with_cache(x, incl_bwd=True, metric=metric)
    names = list(hook_paths(model))
    assert [n for n in cache if n.endswith("_grad")] == [f"{n}_grad" for n in names]
    ref = plain_torch(model, x)
    for i in range(model.cfg.depth):
        leaf = ref["out"][i].detach().requires_grad_(True)
        (expected,) = torch.autograd.grad(metric(_tail_from(model, i, leaf)), leaf)
        close(cache[f"blocks.{i}.resid2_grad"], expected, f"{family}: grad at block {i} output")
    (g_logits,) = torch.autograd.grad(metric(ref["logits"]), ref["logits"])
    close(cache["head_grad"], g_logits, f"{family}: grad at the logits", tol=0.0)
    assert all(p.grad is None for p in model.parameters()), "incl_bwd touched .grad"
    with pytest.raises(HookError, match="incl_bwd=True needs metric"):
        model.run_with_cache(x, incl_bwd=True)
    with pytest.raises(HookError, match="must be a scalar"):
        model.run_with_cache(x, incl_bwd=True, metric=lambda logits: logits)


def test_a_hook_returning_another_shape_or_dtype_is_refused_in_one_line_naming_the_point():
    model, x = make("plain"), images()
    for bad, what in [
        (lambda a, hook: a[:, 1:], r"shape \(3, 16, 16\) torch.float32; the activation is \(3, 17"),
        (lambda a, hook: a.double(), r"shape \(3, 17, 16\) torch.float64; the activation is"),
        (lambda a, hook: 0.0, "float, not a tensor"),
    ]:
        with pytest.raises(HookError, match=f"hook on 'blocks.0.resid1' returned {what}") as err:
            model.run_with_hooks(x, fwd_hooks=[("blocks.0.resid1", bad)])
        assert "\n" not in str(err.value)
        assert hooks_of(model) == 0, "a hook outlived the refusal"
    # the same shape and dtype passes, and edits the forward
    doubled = model.run_with_hooks(x, fwd_hooks=[("blocks.0.resid1", lambda a, hook: 2 * a)])
    assert not torch.equal(doubled, model(x))
    with pytest.raises(HookError, match="hook on 'blocks.1.resid2' returned shape .* the gradient"):
        model.run_with_hooks(
            x,
            bwd_hooks=[("blocks.1.resid2", lambda g, hook: g[:, :1])],
            metric=lambda logits: logits.sum(),
        )


def test_a_names_filter_that_matches_nothing_is_refused_naming_it():
    model, x = make("plain"), images()
    with pytest.raises(
        HookError, match=r"names_filter .*<lambda> .* matches no hook point; model.hook_dict"
    ):
        model.run_with_cache(x, names_filter=lambda n: n.endswith("resid_post"))
    with pytest.raises(HookError, match=r"names_filter \[\] matches no hook point"):
        run_with_cache(model, x, names_filter=[])


def test_the_method_forms_are_the_functions_and_hooks_is_a_context_for_forward_and_backward():
    model, x = make("layerscale_registers"), images()
    assert list(model.hook_dict) == list(hook_paths(model))
    assert all(isinstance(p, HookPoint) for p in model.hook_dict.values())
    logits, cache = model.run_with_cache(x, names_filter="blocks.1.resid2")
    f_logits, f_cache = run_with_cache(model, x, names_filter="blocks.1.resid2")
    close(logits, f_logits, "method vs function logits", tol=0.0)
    close(cache["resid_post", 1], f_cache["blocks.1.resid2"], "cache['resid_post', 1]", tol=0.0)
    close(cache["resid2", -1], cache["blocks.1.hook_resid2"], "tuple and module path", tol=0.0)
    # forward hook inside the block only; a backward inside the block meets the backward hook
    seen = []

    def zero_grad(g, hook):
        seen.append(hook.name)
        return torch.zeros_like(g)

    with model.hooks(
        fwd_hooks=[("blocks.0.mlp", lambda a, hook: torch.zeros_like(a))],
        bwd_hooks=[("blocks.1.resid1", zero_grad)],
    ) as hooked:
        assert hooked is model
        edited = model(x)
        edited.sum().backward()
    assert seen == ["blocks.1.resid1"]
    # every gradient upstream of block 1's resid1 went through it, now zero
    assert model.patch_proj.weight.grad.abs().max().item() == 0.0
    assert model.head.weight.grad.abs().max().item() > 0.0
    model.zero_grad(set_to_none=True)
    close(
        edited,
        model.run_with_hooks(x, [("blocks.0.mlp", lambda a, h: 0 * a)]),
        "hooks() vs run_with_hooks",
        0.0,
    )
    assert hooks_of(model) == 0 and not torch.equal(edited, model(x))


def test_remove_batch_dim_and_to_keep_the_methods_working():
    model, x = make("plain"), images(n=1)
    _, cache = model.run_with_cache(x)
    full = cache.decompose_resid().sum(0)[0]
    single = cache.remove_batch_dim().to("cpu")
    assert single["blocks.1.resid2"].shape == (17, 16) and not single.has_batch_dim
    close(single.decompose_resid().sum(0), full, "decompose after remove_batch_dim", tol=0.0)
    close(single.decompose_resid().sum(0), single["blocks.1.resid2"], "its sum")
    _, wide = model.run_with_cache(images())
    with pytest.raises(HookError, match="remove_batch_dim needs a batch of 1"):
        wide.remove_batch_dim()


def _timm_vit(fused: bool):
    prior = timm.layers.use_fused_attn()
    timm.layers.set_fused_attn(fused)
    try:
        torch.manual_seed(0)
        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=3
        ).eval()
    finally:
        timm.layers.set_fused_attn(prior)


def test_a_timm_vit_built_without_fused_attention_caches_exactly_its_forward_intermediates():
    """The guide's note: timm's default fused attention is a different kernel, so ~1e-6 off."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    diffs = {}
    for fused in (True, False):
        tm = _timm_vit(fused)
        assert all(getattr(m, "fused_attn", fused) == fused for m in tm.modules())
        with torch.no_grad():
            logits, cache = run_with_cache(tm, x, names_filter=lambda n: n.endswith("resid2"))
            pairs = tm.forward_intermediates(
                x, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True
            )
            timm_stack = torch.stack([torch.cat([p, s], dim=1) for s, p in pairs])
            diffs[fused] = max(
                (cache.stack("resid2") - timm_stack).abs().max().item(),
                (logits - tm(x)).abs().max().item(),
            )
    print(f"cache vs timm: fused_attn=True {diffs[True]:.3g}, fused_attn=False {diffs[False]:.3g}")
    assert diffs[False] == 0.0, f"set_fused_attn(False): {diffs[False]}"
    assert diffs[True] <= 1e-5, f"fused attention: {diffs[True]}"
    # or keep timm fused and run the glass-box copy fused too (the project's switch)
    tm = _timm_vit(True)
    glass = as_glassbox(tm).set_fast_attention(True)
    with torch.no_grad():
        logits, cache = glass.run_with_cache(x, names_filter=lambda n: n.endswith("resid2"))
        close(logits, tm(x), "set_fast_attention(True) copy vs fused timm", tol=0.0)
        # a cached attention map needs the written-out path: that block leaves the fused kernel
        every, _ = glass.run_with_cache(x)
        close(every, tm(x), "with attn.probs cached vs fused timm", tol=1e-5)
