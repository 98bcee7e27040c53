"""The layers of the glass-box ViT: norms, activations, MLPs, LayerScale, attention.

Each layer runs the operations timm runs, in timm's order (``timm.layers``); that is what
makes the difference to timm exactly 0.0 rather than merely small. Parameter names match
timm's, so a weight mapping is (almost) the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.hooks import HookPoint
from workbench.models.vit_config import ViTConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight.

    Computed by torch's ``F.rms_norm`` kernel, like ``nn.LayerNorm`` uses ``F.layer_norm``:
    timm's ``RmsNorm`` calls the same kernel, and writing the formula out in separate ops
    rounds differently (about 5e-7), which would end exactness.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def make_norm(cfg: ViTConfig, dim: int | None = None) -> nn.Module:
    dim = cfg.dim if dim is None else dim
    if cfg.norm_layer == "rmsnorm":
        return RMSNorm(dim, cfg.layer_norm_eps)
    return nn.LayerNorm(dim, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): OpenAI CLIP's approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def make_act(name: str) -> nn.Module:
    return {
        "gelu": lambda: nn.GELU(),
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "quick_gelu": QuickGELU,
        "silu": nn.SiLU,
        "sigmoid": nn.Sigmoid,
    }[name]()


class LayerScale(nn.Module):
    """Per-channel gain on a residual branch (DeiT III, DINOv2)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def make_drop_path(rate: float) -> nn.Module:
    """timm's stochastic depth on a residual branch: ``DropPath(rate)``, or ``nn.Identity`` at 0 (as timm)."""
    if rate <= 0.0:
        return nn.Identity()
    from timm.layers import DropPath  # only when on: a plain model never imports timm

    return DropPath(rate)


class MLP(nn.Module):
    """fc1 -> act -> [norm] -> fc2 (timm ``Mlp``)."""

    def __init__(
        self,
        cfg: ViTConfig,
        hidden: int | None = None,
        act: str | None = None,
        bias: bool | None = None,
        inner_norm: bool | None = None,
    ) -> None:
        super().__init__()
        hidden = cfg.hidden_dim if hidden is None else hidden
        bias = cfg.mlp_bias if bias is None else bias
        inner_norm = cfg.scale_mlp_norm if inner_norm is None else inner_norm
        self.fc1 = nn.Linear(cfg.dim, hidden, bias=bias)
        self.act = make_act(cfg.act if act is None else act)
        self.norm = make_norm(cfg, hidden) if inner_norm else None
        self.hook_norm = HookPoint("norm") if inner_norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, cfg.dim, bias=bias)
        self.drop = nn.Dropout(cfg.dropout)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(x)
        if self.norm is not None:
            h = self.hook_norm(self.norm(h))
        return self.drop(self.fc2(h))


class GluMLP(MLP):
    """One packed projection split into value and gate halves (timm ``GluMlp``).

    ``gate_last`` says which half goes through the activation: timm's ``GluMlp`` gates
    with the second half, its ``SwiGLUPacked`` with the first.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__(cfg)
        self.gate_last = cfg.glu_gate_last
        half = cfg.hidden_dim // 2
        self.norm = make_norm(cfg, half) if cfg.scale_mlp_norm else None
        self.fc2 = nn.Linear(half, cfg.dim, bias=cfg.mlp_bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.fc1(x).chunk(2, dim=-1)  # (B, N, 2H) -> 2 x (B, N, H)
        return self.drop(x1 * self.act(x2) if self.gate_last else self.act(x1) * x2)


class SwiGLU(MLP):
    """Separate gate and value projections: act(fc1_g(x)) * fc1_x(x) (timm ``SwiGLU``)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__(cfg)
        del self.fc1
        self.fc1_g = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.mlp_bias)
        self.fc1_x = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.mlp_bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.fc1_g(x)
        return self.drop(self.act(gate) * self.fc1_x(x))


def make_mlp(cfg: ViTConfig) -> MLP:
    return {"mlp": MLP, "glu": GluMLP, "swiglu": SwiGLU}[cfg.mlp_layer](cfg)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)). Scaling q before the product (not the scores after it)
    is what timm does; the same rounding gives bit-identical outputs."""
    q = q * scale
    return (q @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, Nq, Nk)


class Attention(nn.Module):
    """Multi-head self-attention from one packed QKV projection."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.qkv_bias)
        self.hook_qkv = HookPoint("qkv")
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else None
        if cfg.qk_norm:
            self.hook_q_norm, self.hook_k_norm = HookPoint("q_norm"), HookPoint("k_norm")
        self.hook_probs = HookPoint("probs")  # the attention map: on the written-out path only
        # each head's output before the output projection, on both paths (TransformerLens's hook_z)
        self.hook_z = HookPoint("z", stage=False)
        self.attn_drop = nn.Dropout(cfg.attn_dropout)
        self.norm = make_norm(cfg) if cfg.scale_attn_norm else None
        self.hook_norm = HookPoint("norm") if cfg.scale_attn_norm else nn.Identity()
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.proj_bias)
        self.out_drop = nn.Dropout(cfg.dropout)
        self.fast = False  # use scaled_dot_product_attention instead of the written-out form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.hook_qkv(self.qkv(x))  # (B, N, 3C)
        # (3, B, H, N, d)
        qkv = qkv.reshape(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, d)
        if self.q_norm is not None:
            q, k = self.hook_q_norm(self.q_norm(q)), self.hook_k_norm(self.k_norm(k))
        if self.fast:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0
            )
        else:
            probs = self.hook_probs(attention_probs(q, k, self.scale))  # (B, H, N, N)
            out = self.attn_drop(probs) @ v  # (B, H, N, d)
        out = self.hook_z(out.transpose(1, 2))  # (B, N, H, d): each head's output
        out = out.reshape(B, N, C)  # (B, N, C): heads concatenated, out_proj's input
        if self.norm is not None:
            out = self.hook_norm(self.norm(out))
        return self.out_drop(self.out_proj(out))


class AttentionPool(nn.Module):
    """Attention pooling with one learned latent query (timm ``AttentionPoolLatent``).

    The latent attends over the tokens; the result goes through a projection and a
    residual MLP. Stages: ``attn_pool.kv``, ``attn_pool.probs`` (the pooling attention map,
    (B, heads, 1, N)), ``attn_pool.attn``, ``attn_pool.norm``, ``attn_pool.mlp``.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.scale = self.head_dim**-0.5
        self.latent = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.hook_kv, self.hook_probs = HookPoint("kv"), HookPoint("probs")
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.proj_drop = nn.Dropout(0.0)  # timm's ViT builds its pool with drop=0
        self.hook_attn = HookPoint("attn")
        self.norm = make_norm(cfg)
        self.hook_norm = HookPoint("norm")
        self.mlp = MLP(cfg, hidden=cfg.pool_hidden_dim, bias=True, inner_norm=False)
        self.hook_mlp = HookPoint("mlp")
        self.fast = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        # (B, H, 1, d)
        q = (
            self.q(self.latent.expand(B, -1, -1))
            .reshape(B, 1, self.heads, self.head_dim)
            .transpose(1, 2)
        )
        kv = self.hook_kv(self.kv(x))  # (B, N, 2C)
        # each (B, H, N, d)
        k, v = kv.reshape(B, N, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fast:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = self.hook_probs(attention_probs(q, k, self.scale)) @ v  # probs (B, H, 1, N)
        # (B, 1, C)
        out = self.hook_attn(self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, 1, C))))
        h = self.hook_mlp(self.mlp(self.hook_norm(self.norm(out))))
        return (out + h)[:, 0]  # (B, C): the one latent token
