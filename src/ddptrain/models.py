"""Models, and the two separate steps of making one: `create_model`, then `wrap_ddp`.

Keeping the steps apart means checkpoints always hold the plain module's state (no
`module.` prefix) and loading happens before wrapping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.data import DataBundle, load_ref
from ddptrain.distributed import DistributedContext


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when the shape changes)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class MiniResNet(nn.Module):
    """Three residual stages (w, 2w, 4w channels; 64/128/256 by default), two blocks each,
    global average pooling and a linear head. Works from 8x8 inputs upwards."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages, ch = [], width
        for i, out_ch in enumerate((width, 2 * width, 4 * width)):
            stride = 1 if i == 0 else 2
            stages += [BasicBlock(ch, out_ch, stride), BasicBlock(out_ch, out_ch, 1)]
            ch = out_ch
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class MLP(nn.Module):
    """Two hidden layers for tabular features. No BatchNorm or dropout, so a step on N
    ranks of batch B is exactly a step on one rank of batch N*B."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def create_model(config: TrainingConfig, data: DataBundle, device: torch.device) -> nn.Module:
    """Build the model for the data's shape and move it to `device` (DDP does not move it)."""
    name = config.model
    if name == "auto":
        name = "miniresnet" if data.is_image else "mlp"
    if name == "miniresnet":
        if not data.is_image:
            raise ConfigError(
                f"--model miniresnet needs images (C, H, W) but --dataset {config.dataset!r} "
                f"gives samples of shape {data.input_shape}: use --model mlp"
            )
        channels = data.input_shape[0]
        if config.in_channels is not None and config.in_channels != channels:
            raise ConfigError(
                f"--in_channels {config.in_channels} does not match the data's {channels} "
                "channels: drop the flag or fix the data"
            )
        model: nn.Module = MiniResNet(channels, data.num_classes, config.width)
    elif name == "mlp":
        features = 1
        for dim in data.input_shape:
            features *= dim
        model = MLP(features, data.num_classes, config.width)
    else:
        model = load_ref(name, "model")(config)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"--model {name!r} returned {type(model).__name__}, not nn.Module")
    if config.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(device)


def wrap_ddp(model: nn.Module, ctx: DistributedContext) -> nn.Module:
    """Wrap in DistributedDataParallel when there is more than one rank.

    A single process gets the bare module: DDP over a world of one would only add
    hooks and copies.
    """
    if not ctx.distributed:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Gradients written straight into the all-reduce buckets save a copy per step.
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
