"""Compact ResNet-18/50/101 (He et al. 2015), standard torchvision shapes and names.

Forward: images FloatTensor[B, 3, H, W] -> logits FloatTensor[B, num_classes].
No in-place ops (a stage input must not be modified in place under autograd).
"""

from __future__ import annotations

import torch
from torch import nn

IMAGENET_CLASSES = 1000
IMAGE_SIZE = 224  # pixels per side of the default input


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.downsample = _downsample(in_ch, ch * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.conv3 = nn.Conv2d(ch, ch * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(ch * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _downsample(in_ch, ch * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _downsample(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


class ResNet(nn.Module):
    """`num_classes` and `image_size` describe it to `model_info`."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int = IMAGENET_CLASSES,
        image_size: int = IMAGE_SIZE,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.image_size = image_size
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        in_ch = 64
        for i, (ch, n) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            blocks = []
            for j in range(n):
                blocks.append(block(in_ch, ch, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = ch * block.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


VARIANTS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, int, int, int]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
}


def build(name: str, *, num_classes: int | None = None, image_size: int | None = None) -> ResNet:
    block, layers = VARIANTS[name]
    return ResNet(
        block,
        layers,
        num_classes=IMAGENET_CLASSES if num_classes is None else num_classes,
        image_size=IMAGE_SIZE if image_size is None else image_size,
    )
