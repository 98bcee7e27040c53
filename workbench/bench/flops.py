"""Analytic FLOP counts of the glass-box models, written from their configs.

Only multiply-accumulate work is counted (2 FLOPs per MAC): the patch projection, the
QKV projection, the attention scores (Q Kᵀ) and the attention-weighted values (A V), the
output projection, the two MLP layers and the head; for the CNN, the convolutions and the
head. LayerNorm, softmax, GELU, bias adds, residual adds and pooling are left out: they are
a few percent of the work, they are memory-bound rather than compute-bound, and leaving
them out makes the count the one ``torch.utils.flop_counter.FlopCounterMode`` reports,
which the tests check it against. Achieved GFLOP/s from this count, divided by the
machine's matmul throughput, is how close a model runs to the physical limit.
"""

from __future__ import annotations

from workbench.models.cnn import CNNConfig
from workbench.models.vit import ViTConfig


def vit_forward_flops(cfg: ViTConfig) -> dict[str, int]:
    """FLOPs of one image's forward pass, by component.

    Args:
        cfg: The ViT architecture.

    Returns:
        Component name -> FLOPs per image (``total`` is their sum).
    """
    n = cfg.num_patches + cfg.num_prefix_tokens  # tokens per image
    d, depth, hidden = cfg.dim, cfg.depth, cfg.hidden_dim
    patch_in = cfg.in_channels * cfg.patch_hw[0] * cfg.patch_hw[1]  # one patch, flattened
    # MLP matrices: fc1 and fc2; SwiGLU has two first projections; a packed GLU's fc2
    # reads half of fc1's width.
    mlp_macs = {
        "mlp": 2 * d * hidden,
        "swiglu": 3 * d * hidden,
        "glu": d * hidden + d * hidden // 2,
    }[cfg.mlp_layer]
    macs = {
        "patch_embed": cfg.num_patches * patch_in * d,
        "qkv": depth * n * d * 3 * d,
        # Scores and A V are n x n x head_dim per head; over all heads that is n x n x d.
        "attn_scores": depth * n * n * d,
        "attn_values": depth * n * n * d,
        "attn_proj": depth * n * d * d,
        "mlp": depth * n * mlp_macs,
        "head": d * cfg.num_classes,
    }
    if cfg.pooling == "map":  # one latent query attends over the pooled tokens
        pooled = cfg.num_patches + (cfg.num_prefix_tokens if cfg.pool_include_prefix else 0)
        macs["attn_pool"] = (
            d * d + pooled * d * 2 * d + 2 * pooled * d + d * d + 2 * d * cfg.pool_hidden_dim
        )
    flops = {k: 2 * v for k, v in macs.items()}
    flops["total"] = sum(flops.values())
    return flops


def vit_train_flops(cfg: ViTConfig) -> int:
    """FLOPs of one image's forward + backward pass (the optimizer step is not counted).

    The backward pass of every product computes two gradients (input and weight), twice
    the forward work, except the patch projection: the images need no gradient, so only
    its weight gradient is computed.
    """
    fwd = vit_forward_flops(cfg)
    return 3 * fwd["total"] - fwd["patch_embed"]


def cnn_forward_flops(cfg: CNNConfig, image_size: int) -> dict[str, int]:
    """FLOPs of one image's forward pass through the CNN baseline, by layer.

    Args:
        cfg: The CNN architecture.
        image_size: Input side in pixels; max-pooling halves it between stages.
    """
    flops: dict[str, int] = {}
    side, c_in = image_size, cfg.in_channels
    for i, c_out in enumerate(cfg.channels):
        flops[f"conv{i}"] = 2 * side * side * c_out * c_in * 9  # 3x3, padding 1: same size out
        if i < len(cfg.channels) - 1:
            side //= 2
        c_in = c_out
    flops["head"] = 2 * c_in * cfg.num_classes
    flops["total"] = sum(flops.values())
    return flops


def cnn_train_flops(cfg: CNNConfig, image_size: int) -> int:
    """Forward + backward FLOPs per image; the first convolution needs no input gradient."""
    fwd = cnn_forward_flops(cfg, image_size)
    return 3 * fwd["total"] - fwd["conv0"]
