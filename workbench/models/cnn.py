"""CNN baseline for the small-image studies.

Three Conv3x3-BN-ReLU stages (32 -> 80 -> 128 channels), max-pooling between stages to
halve the resolution, global average pooling, and a linear classifier. On 28x28x1 with
10 classes it has 117,498 parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 1
    num_classes: int = 10
    channels: tuple[int, ...] = (32, 80, 128)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.in_channels, int) or self.in_channels < 1:
            raise ValueError(
                f"CNNConfig.in_channels={self.in_channels!r}: must be a positive integer"
            )
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(
                f"CNNConfig.num_classes={self.num_classes!r}: must be a positive integer"
            )
        channels = tuple(self.channels)
        if not channels or any((not isinstance(c, int)) or c < 1 for c in channels):
            raise ValueError(f"CNNConfig.channels={self.channels!r}: must be positive integers")
        object.__setattr__(self, "channels", channels)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"CNNConfig.dropout={self.dropout!r}: must be in [0, 1)")

    def to_dict(self) -> dict:
        return asdict(self)


def conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)
    )


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        layers: list[nn.Module] = []
        c_in = cfg.in_channels
        for i, c_out in enumerate(cfg.channels):
            layers.append(conv_bn_relu(c_in, c_out))
            if i < len(cfg.channels) - 1:
                layers.append(nn.MaxPool2d(2))  # (B, C, H, W) -> (B, C, H/2, W/2)
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head_drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(c_in, cfg.num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean(dim=(2, 3))  # (B, C): global average pool

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
