"""Small models shared by the tests."""

import torch
import torch.nn as nn


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn(self.conv1(x)))))


class ResNetish(nn.Module):
    """A stem, ``blocks`` residual blocks and a linear head."""

    def __init__(self, c=8, blocks=3, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Residual(c) for _ in range(blocks)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(x.mean((2, 3)))
