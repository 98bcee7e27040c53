"""The TransformerLens guide in docs/interventions.md runs as written: its Python blocks, in order, on tiny models."""

from __future__ import annotations

import re
from pathlib import Path

import timm
import torch

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "interventions.md"
SECTION = "## Coming from TransformerLens"


def guide_blocks() -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def test_the_transformerlens_guide_examples_run_and_mean_what_they_say():
    blocks = guide_blocks()
    assert len(blocks) >= 9, f"expected the guide's Python blocks, found {len(blocks)}"
    namespace: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{GUIDE.name}[python block {i}]", "exec"), namespace)
        except Exception as err:  # name the block that failed
            raise AssertionError(f"docs example {i} failed: {err!r}\n{code}") from err
    model, x = namespace["model"], namespace["x"]
    # the hand patching: the clean block-0 output at the class token restores a finite fraction
    assert (
        isinstance(namespace["restored"], float) and namespace["restored"] == namespace["restored"]
    )
    # the two ablations edited the forward, and nothing stayed attached
    assert not torch.equal(namespace["no_positions"], model(x))
    assert all(not m._forward_hooks for m in model.modules()), "a hook outlived the examples"
    # the first hour: the numbers the blocks computed have the shapes the guide says
    assert namespace["head_attrs"].shape == (2 * 4, 2), "stack_head_results' logit attributions"
    assert namespace["tl_lens"].shape == (3, 2), "0_pre, 1_pre, final_post per image"
    assert namespace["attribution"].shape == (2, 17)
    assert "blocks.1.resid2_grad" in namespace["grads"]
    assert namespace["refused"].count("\n") == 0, "the refusal is one line"
    assert timm.layers.use_fused_attn(), "the guide left timm's fused attention off"
