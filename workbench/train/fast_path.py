"""The fast training path: torch.compile of the step, fused attention, fused AdamW.

Each part is chosen by ``FastPathConfig`` (``fast_path`` in a protocol, ``--fast`` on
``workbench train``) and is off by default, so a cell without it trains exactly as before.
Only the training step and the run's own evaluations take it: a trained model is always
rebuilt on the written-out attention for analysis, interventions and attribution.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.train.config import FastPathConfig


def attention_is_fused(setting: str, device_type: str) -> bool:
    """Whether ``fused_attention`` (off / on / auto) runs scaled_dot_product_attention on ``device_type``.

    auto: fused on CUDA only. On CPU, torch's fused kernel measured no faster than the
    written-out attention at the project's token counts (17 to 65 tokens), in fp32 here and
    in bf16 on an AMX CPU (1.4x to 3.7x slower): docs/training.md, "Fast path".
    """
    if setting == "auto":
        return device_type == "cuda"
    return setting == "on"


def set_attention(model: nn.Module, fused: bool) -> bool:
    """Put a glass-box ViT on the fused (or written-out) attention; False for a model without that switch."""
    switch = getattr(model, "set_fast_attention", None)
    if switch is None:
        return False
    switch(fused)
    return True


class TrainingForward:
    """The forward the training step calls: the model itself, or its torch.compile'd version.

    The compiled module shares the model's parameters (the optimizer, checkpoints and
    evaluation use the eager model). The first compiled call compiles; if it raises, one
    line says why, the RNG state from before the attempt is restored (so dropout draws what
    an eager run draws) and every later call is eager.
    """

    def __init__(self, model: nn.Module, config: FastPathConfig) -> None:
        self.model = model
        self.compiled = None
        self.status = "off"  # off, pending (first call not yet made), on, failed
        self.compile_seconds: float | None = None
        if config.compile:
            try:
                self.compiled = torch.compile(model)
                self.status = "pending"
            except Exception as err:  # noqa: BLE001 (any failure means: train eagerly)
                self._fail(err)

    def _fail(self, err: BaseException) -> None:
        self.compiled, self.status = None, "failed"
        first = (str(err).strip().splitlines() or [""])[0][:200]
        tqdm.write(
            f"fast_path.compile: torch.compile is unavailable here ({type(err).__name__}: "
            f"{first}); training on the eager path"
        )

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            return self.model(images)
        if self.status != "pending":
            return self.compiled(images)
        rng = torch.get_rng_state()
        try:
            out = self.compiled(images)
        except Exception as err:  # noqa: BLE001 (the compiler failed: the eager model still works)
            torch.set_rng_state(rng)
            self._fail(err)
            return self.model(images)
        self.status = "on"
        return out

    def timed_first_step(self, started: float) -> None:
        """After a step: if it was the first compiled one, keep its time (compile included)."""
        if self.status == "on" and self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - started

    def tags(self) -> dict[str, str]:
        """What the cell records about its compiled step (``fast_path.compiled``)."""
        return {} if self.status == "off" else {"compiled": self.status}


def adamw(params, config: FastPathConfig, **kwargs) -> torch.optim.AdamW:
    """AdamW with its fused kernel when ``fused_adamw`` is on, else its default implementation."""
    if config.fused_adamw:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
