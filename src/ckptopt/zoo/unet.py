"""U-Net (Ronneberger et al. 2015) in the common milesial/Pytorch-UNet layout.

Four down and four up levels of double 3x3 conv blocks (Conv-BN-ReLU twice,
convs without bias), 2x2 max pooling on the way down, and on the way up either
a 2x2 stride-2 ``ConvTranspose2d`` (``bilinear=False``, the default, as in the
paper) or bilinear upsampling (``bilinear=True``, halving the bottom width).
Skip connections concatenate ``[skip, upsampled]`` on channels; a 1x1 conv
maps to ``num_classes`` logits per pixel.

Parameter count at ``base=64, in_channels=3, num_classes=2, bilinear=False``:
31,037,698 (see ``tests/test_zoo.py`` for the layout formula).

Inputs whose side is a multiple of 16 need no padding; other sizes are padded
after upsampling as in milesial's code. The model is traceable by
:func:`torch.fx.symbolic_trace` (the pad amounts become graph nodes).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["UNet", "unet", "DoubleConv", "Down", "Up", "OutConv"]


class DoubleConv(nn.Module):
    """(Conv3x3 -> BN -> ReLU) x 2."""

    def __init__(self, in_channels: int, out_channels: int, mid_channels: Optional[int] = None):
        super().__init__()
        if not mid_channels:
            mid_channels = out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class Down(nn.Module):
    """2x2 max pool, then a double conv."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Upsample, pad to the skip's size, concatenate, double conv."""

    def __init__(self, in_channels: int, out_channels: int, bilinear: bool = False):
        super().__init__()
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        x1 = self.up(x1)
        diff_y = x2.size(2) - x1.size(2)
        diff_x = x2.size(3) - x1.size(3)
        x1 = F.pad(x1, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class OutConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 64,
                 bilinear: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.bilinear = bilinear
        b = base
        factor = 2 if bilinear else 1
        self.inc = DoubleConv(in_channels, b)
        self.down1 = Down(b, 2 * b)
        self.down2 = Down(2 * b, 4 * b)
        self.down3 = Down(4 * b, 8 * b)
        self.down4 = Down(8 * b, 16 * b // factor)
        self.up1 = Up(16 * b, 8 * b // factor, bilinear)
        self.up2 = Up(8 * b, 4 * b // factor, bilinear)
        self.up3 = Up(4 * b, 2 * b // factor, bilinear)
        self.up4 = Up(2 * b, b, bilinear)
        self.outc = OutConv(b, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        return self.outc(x)


def unet(in_channels: int = 3, num_classes: int = 2, base: int = 64, bilinear: bool = False) -> UNet:
    """U-Net; 31,037,698 parameters at the defaults."""
    return UNet(in_channels=in_channels, num_classes=num_classes, base=base, bilinear=bilinear)
