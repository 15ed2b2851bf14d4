"""A plain MLP chain: ``depth`` Linear+ReLU blocks of ``width``, then a linear head.

``layers`` holds ``Linear(in_features, width), ReLU, Linear(width, width), ReLU,
...`` (``depth`` Linear+ReLU pairs); ``head`` is ``Linear(width, num_classes)``.
Parameter count: ``(in_features+1)*width + (depth-1)*(width+1)*width
+ (width+1)*num_classes``.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

__all__ = ["MLPChain", "mlp"]


class MLPChain(nn.Module):
    def __init__(self, in_features: int = 784, width: int = 1024, depth: int = 8,
                 num_classes: int = 10):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.in_features = in_features
        self.width = width
        self.depth = depth
        layers: List[nn.Module] = []
        d_in = in_features
        for _ in range(depth):
            layers.append(nn.Linear(d_in, width))
            layers.append(nn.ReLU(inplace=False))
            d_in = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def mlp(in_features: int = 784, width: int = 1024, depth: int = 8, num_classes: int = 10) -> MLPChain:
    return MLPChain(in_features=in_features, width=width, depth=depth, num_classes=num_classes)
