"""workbench.analysis: rollout math, patch maps, the background-artifact criterion, figure sizes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_close
from workbench.analysis import result_figures
from workbench.analysis.artifacts import background_patches, check_maps
from workbench.analysis.attention_figures import (
    overlay_figure,
    patch_grid_figure,
    position_similarity_figure,
)
from workbench.analysis.common import png_bytes, save_png
from workbench.analysis.embeddings import pooled_features, position_similarity, tsne_2d
from workbench.analysis.panels import attention_figures
from workbench.analysis.rollout import TokenLayout, analyse_attention, attention_rollout, patch_maps
from workbench.data.transforms import NormStats
from workbench.models.vit import ViTConfig, VisionTransformer

TINY = {
    "image_size": 8,
    "patch_size": 4,
    "in_channels": 3,
    "num_classes": 3,
    "dim": 16,
    "depth": 3,
    "heads": 2,
    "mlp_hidden": 32,
}
NORM = NormStats((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(ViTConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # larger weights than the init, so attention is far from uniform
        for p in model.parameters():
            p.mul_(8.0)
    return model


def direct_rollout(attentions: list[torch.Tensor]) -> torch.Tensor:
    """Rollout with explicit loops over batch elements, layers, heads and rows, in float64."""
    batch, heads, n, _ = attentions[0].shape
    out = torch.zeros(batch, n, n, dtype=torch.float64)
    for b in range(batch):
        r = torch.eye(n, dtype=torch.float64)
        for attn in attentions:  # block 1 first; each later block multiplies from the left
            a = torch.zeros(n, n, dtype=torch.float64)
            for h in range(heads):
                a += attn[b, h].double() / heads
            a = 0.5 * a + 0.5 * torch.eye(n, dtype=torch.float64)
            for i in range(n):
                a[i] = a[i] / a[i].sum()
            r = a @ r
        out[b] = r
    return out


def test_rollout_matches_a_direct_float64_computation_on_a_batch_of_three():
    model = tiny_vit()
    x = torch.randn(3, 3, 8, 8)
    attentions = model.forward_analysis(x).attentions
    fast = attention_rollout(attentions)
    slow = direct_rollout(attentions)
    diff = (fast - slow).abs().max().item()
    print(f"rollout vs direct loops: max |difference| {diff:.3g}")
    assert fast.shape == (3, 5, 5) and fast.dtype == torch.float64
    assert diff <= 1e-6, f"max |difference| {diff:.3g}"
    rows = fast.sum(-1)
    assert_close(rows, torch.ones_like(rows), 1e-12, "rollout row sums")
    # order matters: the reversed product is a different matrix for these weights
    reversed_product = direct_rollout(attentions[::-1])
    assert (reversed_product - fast).abs().max().item() > 1e-3


def test_each_batch_element_is_rolled_out_on_its_own():
    model = tiny_vit(1)
    x = torch.randn(3, 3, 8, 8)
    batched = analyse_attention(model, x).rollout
    for b in range(3):
        alone = analyse_attention(model, x[b : b + 1]).rollout[0]
        assert_close(batched[b], alone, 1e-6, f"batch element {b}")


def test_rollout_does_not_depend_on_the_fast_path_and_leaves_it_set():
    model = tiny_vit(2)
    x = torch.randn(2, 3, 8, 8)
    model.set_fast_attention(False)
    written = analyse_attention(model, x)
    model.set_fast_attention(True)
    fused = analyse_attention(model, x)
    assert torch.equal(written.rollout, fused.rollout)
    assert torch.equal(written.last_layer.maps, fused.last_layer.maps)
    assert all(block.attn.fast for block in model.blocks)


def test_cls_maps_read_the_class_row_and_mean_pooling_reads_patch_rows():
    cls_model = tiny_vit(register_tokens=2)
    layout = TokenLayout.from_config(cls_model.cfg)
    assert (layout.prefix, layout.grid, layout.query) == (3, (2, 2), "cls")
    a = analyse_attention(cls_model, torch.randn(2, 3, 8, 8))
    row = a.rollout[:, 0, 3:]
    assert_close(a.rollout_maps.maps.flatten(1), row / row.sum(-1, keepdim=True), 1e-12, "CLS row")
    assert_close(a.rollout_maps.patch_mass, row.sum(-1), 1e-12, "patch mass")
    assert a.head_maps(-1).maps.shape == (2, 2, 2, 2)

    mean_model = tiny_vit(class_token=False, pooling="mean")
    m = analyse_attention(mean_model, torch.randn(2, 3, 8, 8))
    assert m.layout.query == "mean" and "mean over patch-token rows" in m.layout.query_label
    rows = m.rollout.mean(dim=1)  # no prefix tokens: every row is a patch row
    assert_close(m.rollout_maps.maps.flatten(1), rows, 1e-12, "mean over patch rows")
    sums = m.last_layer.maps.sum((-2, -1))
    assert_close(sums, torch.ones_like(sums), 1e-12, "maps sum to 1")
    figs = attention_figures(mean_model, torch.randn(1, 3, 8, 8), NORM, "gap", lambda logits: ["x"])
    assert "mean over patch-token rows" in figs.rollout.get_suptitle().replace("\n", " ")
    with pytest.raises(ValueError, match="tokens"):
        patch_maps(torch.rand(1, 6, 6), layout)  # 3 prefix + 4 patches would be 7


def test_background_artifact_criterion():
    images = torch.zeros(3, 1, 16, 16)
    images[:, :, 8:, 8:] = 0.9  # object in the bottom-right quarter, black background elsewhere
    background = background_patches(images, 4)  # (3, 4, 4)
    assert background[0].sum().item() == 12 and not background[0, 2:, 2:].any()
    maps = torch.full((3, 4, 4), 0.01)
    maps[0, 0, 0] = 0.9  # one background corner holds most of the map: flagged
    maps[1, 3, 3] = 0.9  # the object does: not flagged
    maps[2] = 1 / 16  # uniform: not concentrated
    checks = check_maps(maps, background)
    assert [c.flagged for c in checks] == [True, False, False]
    assert (
        checks[0].topk_share == pytest.approx(0.92 / 1.05)
        and checks[0].topk_background_share > 0.98
    )
    assert checks[2].background_area == pytest.approx(0.75) and checks[
        2
    ].background_mass == pytest.approx(0.75)
    assert "BACKGROUND ARTIFACT" in checks[0].short() and checks[1].short().endswith("ok")
    # three patches are not "a few" of four: tiny grids are never flagged
    small = check_maps(
        torch.tensor([[[0.97, 0.01], [0.01, 0.01]]]), torch.ones(1, 2, 2, dtype=torch.bool)
    )
    assert not small[0].flagged


def test_position_similarity_and_pooled_features():
    model = tiny_vit()
    sim = position_similarity(model)
    assert sim.shape == (2, 2, 2, 2)
    flat = sim.reshape(4, 4)
    assert_close(flat.diagonal(), torch.ones(4), 1e-12, "self-similarity")
    assert_close(flat, flat.T, 1e-12, "symmetry")
    feats = pooled_features(model, torch.randn(5, 3, 8, 8), batch_size=2)
    assert feats.shape == (5, 16)
    assert tsne_2d(np.random.default_rng(0).normal(size=(12, 16))).shape == (12, 2)
    with pytest.raises(ValueError, match="no learned positional embedding"):
        position_similarity(tiny_vit(pos_embed="none"))


def png_size(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def assert_exact_size(fig, expected: tuple[int, int] | None = None) -> None:
    w, h = fig.get_size_inches() * fig.dpi
    size = png_size(png_bytes(fig))
    assert size == (round(w), round(h)), f"PNG {size} vs figsize*dpi {(w, h)}"
    if expected:
        assert size == expected


def test_every_figure_is_a_png_of_figsize_times_dpi(tmp_path):
    model = tiny_vit()
    x = torch.randn(2, 3, 8, 8)
    figs = attention_figures(model, x, NORM, "tiny", lambda logits: ["a", "b"], block=1)
    assert figs.block == 1 and figs.flagged("heads")[1] == 2 * 2
    assert "Diagnostic, not an explanation" in figs.rollout.get_supxlabel()
    assert "CLS token row" in figs.rollout.get_suptitle()
    shown = figs.shown
    cm = result_figures.confusion_matrix(np.array([0, 1, 2, 2]), np.array([0, 2, 2, 2]), 3)
    assert cm.tolist() == [[1, 0, 0], [0, 0, 1], [0, 0, 2]]
    acc = result_figures.per_class_accuracy(np.array([0, 1, 2, 2]), np.array([0, 2, 2, 2]), 3)
    assert acc.tolist() == [1.0, 0.0, 1.0]
    history = {"vit": {0: {"val_accuracy": {1: 0.5, 2: 0.6}}, 1: {"val_accuracy": {1: 0.4}}}}
    names = ("a", "b", "c")
    built = {
        "rollout": figs.rollout,
        "heads": figs.heads,
        "patch_grid": patch_grid_figure(shown[0], 4, 1, "tiny"),
        "positions": position_similarity_figure(position_similarity(model).numpy(), "tiny"),
        "curves": result_figures.curves_figure(history),
        "confusion": result_figures.confusion_figure({"vit": cm, "cnn": cm}, names),
        "per_class": result_figures.per_class_accuracy_figure({"vit": np.stack([acc, acc])}, names),
        "tsne": result_figures.tsne_figure(
            {"vit": (np.random.rand(4, 2), np.array([0, 1, 2, 2]))}, names
        ),
        "summary": result_figures.summary_figure(
            [
                result_figures.ArmHeadline(
                    "vit", "tiny", 123, {"val": {0: 0.5, 1: 0.6}}, {0: 2, 1: 1}
                )
            ],
            "s",
        ),
    }
    for name, fig in built.items():
        assert_exact_size(fig)
        path = save_png(fig, tmp_path / f"{name}.png")
        assert Image.open(path).format == "PNG", name
    assert_exact_size(built["patch_grid"], (1100, 600))
    assert_exact_size(built["curves"], (1100, 750))


def test_flagged_maps_say_so_on_the_figure():
    images = np.zeros((1, 16, 16, 1))
    images[0, 8:, 8:] = 0.9
    maps = np.full((1, 4, 4), 0.01)
    maps[0, 0, 0] = 0.9
    checks = check_maps(
        torch.from_numpy(maps), background_patches(torch.from_numpy(images).permute(0, 3, 1, 2), 4)
    )
    fig = overlay_figure(images, {"rollout": maps}, "t", ["img"], {"rollout": checks})
    assert (
        "1 of 1 maps FLAGGED" in fig.get_supxlabel() and "known ViT artifact" in fig.get_supxlabel()
    )
    assert "BACKGROUND ARTIFACT" in fig.axes[1].get_xlabel()


def _reduced_timm(name: str, seed: int = 0):
    """A timm family model at reduced size, same options (checked by the coverage helper)."""
    import timm

    from workbench.convert.timm_vit import config_from_timm
    from workbench.convert.timm_weights import TimmWeights
    from workbench.equivalence_coverage import reduced_model

    with torch.device("meta"):
        full = config_from_timm(timm.create_model(name))
    model = reduced_model(name, full, seed)
    return TimmWeights(model, name, "random", f"{name} reduced, seeded random init", None, False)


@pytest.mark.parametrize(
    "name, prefix", [("vit_small_patch14_dinov2", 1), ("vit_small_patch14_reg4_dinov2", 5)]
)
def test_dinov2_with_and_without_registers_gets_maps_rollout_and_the_artifact_check(
    tmp_path, name, prefix
):
    from PIL import Image

    from workbench.analysis.timm_inspect import inspect_timm

    weights = _reduced_timm(name)
    image = tmp_path / "img.png"
    Image.fromarray((np.random.default_rng(0).random((80, 80, 3)) * 255).astype("uint8")).save(
        image
    )
    built = inspect_timm(weights, [str(image)])
    assert {"attention_rollout.png", "attention_heads.png"} <= set(built.figures)
    # background check ran on last-layer + rollout maps (1 image each), and on every head of the block
    assert (
        built.flagged["attention_rollout.png"][1] == 2
        and built.flagged["attention_heads.png"][1] == 2
    )
    from workbench.convert.timm_vit import glassbox_from_timm

    glass, _ = glassbox_from_timm(weights.model)
    a = analyse_attention(glass, torch.randn(1, 3, 56, 56))
    assert a.layout.prefix == prefix and a.layout.query == "cls" and a.rollout is not None
    # registers are tokens of every map
    assert a.attentions[0].shape == (
        1,
        2,
        prefix + 16,
        prefix + 16,
    )
    assert a.rollout_maps.maps.shape == (1, 4, 4)


def test_siglip_has_the_pool_map_and_says_why_there_is_no_rollout():
    from workbench.convert.timm_vit import glassbox_from_timm

    glass, _ = glassbox_from_timm(_reduced_timm("vit_base_patch16_siglip_224").model)
    a = analyse_attention(glass, torch.randn(2, 3, 64, 64))
    assert a.rollout is None and a.rollout_maps is None and "rollout is not drawn" in a.statement
    assert a.layout.head == "pool" and "attention-pool" in a.layout.query_label
    assert_close(
        a.last_layer.maps.sum((-2, -1)),
        torch.ones(2, dtype=torch.float64),
        1e-12,
        "pool map sums to 1",
    )
    assert a.head_maps(-1).maps.shape == (2, 2, 4, 4)  # per-block maps: mean over patch rows
    figs = attention_figures(glass, torch.randn(1, 3, 64, 64), NORM, "siglip", lambda logits: ["x"])
    assert "rollout is not drawn" in figs.rollout.get_suptitle().replace("\n", " ")


def test_summary_figure_of_eleven_arms_keeps_its_table_inside_and_names_every_bar():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.table import Table

    rng = np.random.default_rng(0)
    arms = [
        result_figures.ArmHeadline(
            f"arm{i}",
            "cifar_vit",
            1_000_000 + i,
            {"val": {s: 0.3 + 0.01 * rng.random() for s in range(3)}},
            {s: 6 for s in range(3)},
        )
        for i in range(11)
    ]
    fig = result_figures.summary_figure(arms, "eleven arms")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (table,) = fig.findobj(Table)
    box, page = table.get_window_extent(renderer), fig.bbox
    assert box.y0 >= page.y0 and box.y1 <= page.y1 and box.x0 >= page.x0 and box.x1 <= page.x1, (
        box,
        page,
    )
    from matplotlib.axes import Axes

    labels = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.findobj(Axes) if ax.axison]
    assert labels == [[a.arm for a in arms]], labels
    colors = result_figures.arm_colors([a.arm for a in arms])
    assert len(set(colors.values())) == 11, "two arms share a colour"
