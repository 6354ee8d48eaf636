"""Networks behind one small interface (:class:`FedModel`).

Every model maps ``x (N, C_in, H, W)`` to ``(features, logits)``:

* classification: ``features`` = pooled ``(N, D)`` input of the last linear layer (``fc``,
  whose rows are the class "proxies"), taken *before* the optional dropout so that
  prototypes are deterministic; ``logits`` = ``(N, num_classes)``;
* segmentation: ``features = logits = (N, num_classes, H, W)``.

The classifier parameters are found from the module (:meth:`FedModel.classifier_param_names`),
so callers never hard-code ``fc.weight``.
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSIFICATION = "classification"
SEGMENTATION = "segmentation"


def _plain(value):
    """Tuples -> lists (recursively) so a spec is JSON / weights_only safe and compares equal
    after a round trip."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class FedModel(nn.Module):
    """Base class: ``forward(x) -> (features, logits)`` plus the description needed to rebuild it.

    Subclasses set ``self.arch``, ``self.num_classes``, ``self.in_channels``, ``self.arch_args``
    (resolved, defaults included) and implement :meth:`classifier_module`.
    """

    task_kind: str = CLASSIFICATION
    arch: str = ""

    def _describe(self, num_classes: int, in_channels: int, arch_args: Dict) -> None:
        if int(num_classes) < 1:
            raise ValueError(f"{self.arch}: num_classes must be >= 1, got {num_classes}")
        if int(in_channels) < 1:
            raise ValueError(f"{self.arch}: in_channels must be >= 1, got {in_channels}")
        self.num_classes = int(num_classes)
        self.in_channels = int(in_channels)
        self.arch_args = _plain(dict(arch_args))

    @property
    def spec(self) -> Dict:
        """``{"arch", "num_classes", "in_channels", "arch_args"}``: enough for ``build_model(**spec)``."""
        return {"arch": self.arch, "num_classes": self.num_classes, "in_channels": self.in_channels,
                "arch_args": _plain(dict(self.arch_args))}

    def classifier_module(self) -> nn.Module:
        """The last layer (linear classifier, or the final conv for segmentation)."""
        raise NotImplementedError

    def classifier_param_names(self) -> List[str]:
        """Names in ``state_dict()`` of the classifier's parameters (weight first, then bias)."""
        target = self.classifier_module()
        for prefix, module in self.named_modules():
            if module is target:
                return [f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters()]
        raise RuntimeError(f"{self.arch}: classifier module is not part of the model")  # pragma: no cover

    @property
    def feature_dim(self) -> int:
        """Length of the feature vector (classification) / number of output channels (segmentation)."""
        layer = self.classifier_module()
        return int(layer.in_features) if isinstance(layer, nn.Linear) else self.num_classes


def _head(model: FedModel, feature_dim: int, num_classes: int, dropout: float) -> None:
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"{model.arch}: dropout must be in [0, 1), got {dropout}")
    # Dropout before the classifier is active in train mode only (MC-dropout for FedIRM).
    model.dropout = nn.Dropout(p=float(dropout)) if dropout > 0 else nn.Identity()
    model.fc = nn.Linear(feature_dim, num_classes)


class SmallCNN(FedModel):
    """Small CNN for fast CPU runs at 28-64 px.

    ``depth`` blocks of conv3x3-BN-ReLU + 2x2 max-pool, widths ``width * 2**i``; global
    average pool; optional dropout; linear classifier ``fc``.

    Args:
        num_classes: outputs.
        in_channels: 1 (grey) or 3 (RGB).
        width: channels of the first block.
        depth: number of conv blocks (3 suits 28 px, 4 suits 64 px).
        dropout: dropout probability on the pooled features before ``fc`` (0 = off).
        stem_stride: stride of the first conv; 2 makes 64 px inputs cost about as much as 28 px
            (about 4x faster on CPU) at some accuracy cost.
    """

    arch = "small_cnn"

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32, depth: int = 3, dropout: float = 0.0,
                 stem_stride: int = 1):
        super().__init__()
        self._describe(num_classes, in_channels, {"width": int(width), "depth": int(depth), "dropout": float(dropout),
                                                  "stem_stride": int(stem_stride)})
        if int(width) < 1 or int(depth) < 1 or int(stem_stride) < 1:
            raise ValueError(f"small_cnn: width, depth and stem_stride must be >= 1, got width={width} "
                             f"depth={depth} stem_stride={stem_stride}")
        layers: List[nn.Module] = []
        channels = int(in_channels)
        for i in range(int(depth)):
            out = int(width) * 2 ** i
            stride = int(stem_stride) if i == 0 else 1
            layers += [nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True)]
            # ceil_mode keeps odd sizes (7 -> 4) instead of dropping a row; a 1-px map stays 1 px.
            layers.append(nn.MaxPool2d(2, ceil_mode=True))
            channels = out
        self.body = nn.Sequential(*layers)
        _head(self, channels, self.num_classes, float(dropout))

    def classifier_module(self) -> nn.Module:
        return self.fc

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        features = torch.flatten(F.adaptive_avg_pool2d(self.body(x), 1), 1)
        return features, self.fc(self.dropout(features))


class ResNet18(FedModel):
    """MONAI ``resnet18(spatial_dims=2)`` whose ``fc`` is the classifier.

    Args:
        num_classes: outputs.
        in_channels: input channels.
        dropout: dropout on the pooled features before ``fc`` (0 = off).
        **monai_args: passed to ``monai.networks.nets.resnet18`` (e.g. ``conv1_t_size``,
            ``conv1_t_stride``, ``no_max_pool``, ``widen_factor``).
    """

    arch = "resnet18"

    def __init__(self, num_classes: int, in_channels: int = 3, dropout: float = 0.0, **monai_args):
        super().__init__()
        from monai.networks.nets import resnet18

        self._describe(num_classes, in_channels, {"dropout": float(dropout), **monai_args})
        try:
            self.backbone = resnet18(spatial_dims=2, n_input_channels=self.in_channels,
                                     num_classes=self.num_classes, **monai_args)
        except TypeError as exc:
            raise ValueError(f"resnet18: bad arch_args {sorted(monai_args)}: {exc}") from exc
        # Move MONAI's fc up so its state_dict name is "fc.*" and the backbone ends at the pool.
        feature_dim = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        _head(self, feature_dim, self.num_classes, float(dropout))

    def classifier_module(self) -> nn.Module:
        return self.fc

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)  # MONAI ResNet: ... avgpool -> flatten -> fc (Identity here)
        return features, self.fc(self.dropout(features))


class DenseNet121(FedModel):
    """MONAI ``DenseNet121(spatial_dims=2)``; features = output of ``class_layers`` before the
    final linear (MONAI's ``class_layers.out``, moved to ``fc``).

    Args:
        num_classes: outputs.
        in_channels: input channels.
        dropout: dropout on the pooled features before ``fc``; active in train mode (MC-dropout,
            FedIRM uses 0.2-0.5).
        **monai_args: passed to ``monai.networks.nets.DenseNet121`` (e.g. ``dropout_prob`` inside
            dense layers, ``init_features``, ``growth_rate``, ``block_config``).
    """

    arch = "densenet121"

    def __init__(self, num_classes: int, in_channels: int = 3, dropout: float = 0.0, **monai_args):
        super().__init__()
        from monai.networks.nets import DenseNet121 as MonaiDenseNet121

        self._describe(num_classes, in_channels, {"dropout": float(dropout), **monai_args})
        if "block_config" in monai_args:
            monai_args["block_config"] = tuple(monai_args["block_config"])
        try:
            self.backbone = MonaiDenseNet121(spatial_dims=2, in_channels=self.in_channels,
                                             out_channels=self.num_classes, **monai_args)
        except TypeError as exc:
            raise ValueError(f"densenet121: bad arch_args {sorted(monai_args)}: {exc}") from exc
        feature_dim = self.backbone.class_layers.out.in_features
        self.backbone.class_layers.out = nn.Identity()
        _head(self, feature_dim, self.num_classes, float(dropout))

    def classifier_module(self) -> nn.Module:
        return self.fc

    # DenseNet-121 halves its input five times: smaller images are upsampled to this side first
    # (HAM10000's 28 px file would leave nothing to pool).
    MIN_SIDE = 32

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h, w = x.shape[-2:]
        if min(h, w) < self.MIN_SIDE:
            x = F.interpolate(x, size=(max(h, self.MIN_SIDE), max(w, self.MIN_SIDE)), mode="bilinear",
                              align_corners=False)
        features = self.backbone(x)  # features -> relu -> pool -> flatten -> (Identity)
        return features, self.fc(self.dropout(features))


class UNet2D(FedModel):
    """MONAI ``UNet(spatial_dims=2)`` for lesion segmentation; ``forward`` returns ``(logits, logits)``.

    Inputs whose size is not a multiple of the total stride are zero-padded and the output is
    cropped back, so 28 px images work with strides (2, 2, 2).

    Args:
        num_classes: output channels (1 for a binary lesion mask, read with a sigmoid).
        in_channels: input channels.
        channels: feature channels per level.
        strides: downsampling per level (``len(channels) - 1`` entries).
        num_res_units: residual units per block.
        foreground_prior: the foreground probability the untrained model predicts everywhere: the
            output bias starts at ``log(p / (1 - p))`` (0 = MONAI's initialisation). For sparse
            lesions (e.g. 0.01): a model that starts at 50 % foreground is driven to all-background
            by the first steps and can stay there for most of a run; one that starts at the lesions'
            share of the pixels learns them from the first rounds.
        **monai_args: passed to ``monai.networks.nets.UNet`` (e.g. ``dropout``, ``norm``).
    """

    arch = "unet"
    task_kind = SEGMENTATION

    def __init__(self, num_classes: int, in_channels: int = 1, channels=(16, 32, 64, 128), strides=(2, 2, 2),
                 num_res_units: int = 2, foreground_prior: float = 0.0, **monai_args):
        super().__init__()
        from monai.networks.nets import UNet

        channels, strides = tuple(int(c) for c in channels), tuple(int(s) for s in strides)
        if len(strides) != len(channels) - 1:
            raise ValueError(f"unet: need len(strides) == len(channels) - 1, got channels={channels} strides={strides}")
        if not 0.0 <= float(foreground_prior) < 1.0:
            raise ValueError(f"unet: foreground_prior must be in [0, 1), got {foreground_prior}")
        described = {"channels": channels, "strides": strides, "num_res_units": int(num_res_units), **monai_args}
        if foreground_prior:
            described["foreground_prior"] = float(foreground_prior)
        self._describe(num_classes, in_channels, described)
        try:
            self.net = UNet(spatial_dims=2, in_channels=self.in_channels, out_channels=self.num_classes,
                            channels=channels, strides=strides, num_res_units=int(num_res_units), **monai_args)
        except TypeError as exc:
            raise ValueError(f"unet: bad arch_args {sorted(monai_args)}: {exc}") from exc
        self.size_multiple = int(math.prod(strides))
        # The final conv (the "classifier" of segmentation): the last conv module in the net.
        convs = [m for m in self.net.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
        self._final_conv_index = len(convs) - 1
        if foreground_prior:
            p = float(foreground_prior)
            with torch.no_grad():
                self.classifier_module().bias.fill_(math.log(p / (1.0 - p)))

    def classifier_module(self) -> nn.Module:
        convs = [m for m in self.net.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
        return convs[self._final_conv_index]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h, w = x.shape[-2:]
        m = self.size_multiple
        pad_h, pad_w = (-h) % m, (-w) % m
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        logits = self.net(x)[..., :h, :w]
        return logits, logits


ARCHS = {"small_cnn": SmallCNN, "resnet18": ResNet18, "densenet121": DenseNet121, "unet": UNet2D}
#: the MONAI network arguments a job may pass through ``arch_args``: shape options only. MONAI's
#: ``pretrained`` / ``progress`` / ``pretrained_path`` would load (or download) a weights file from
#: a path the job names; a server starts from weights through ``model.pretrained`` only
#: (:mod:`fedpartial.models.pretrained`, a path the server confines).
MONAI_ARGS = {
    "resnet18": {"conv1_t_size", "conv1_t_stride", "no_max_pool", "shortcut_type", "widen_factor", "norm", "act",
                 "bias_downsample"},
    "densenet121": {"init_features", "growth_rate", "block_config", "bn_size", "norm", "act", "dropout_prob"},
    "unet": {"kernel_size", "up_kernel_size", "act", "norm", "dropout", "bias", "adn_ordering"},
}


def build_model(arch: str, num_classes: int, in_channels: int = 3, **arch_args) -> FedModel:
    """Build a model by name. Seed torch before calling for a repeatable initialisation.

    Args:
        arch: one of ``small_cnn``, ``resnet18``, ``densenet121``, ``unet``.
        num_classes: classes (classification) or output channels (segmentation; 1 = binary).
        in_channels: 1 (grey) or 3 (RGB).
        **arch_args: architecture options (see each class), e.g. ``width``, ``dropout``. A nested
            ``arch_args={...}`` dict is merged in, so ``build_model(**model.spec)`` works.

    Raises:
        ValueError: unknown arch (the message lists the valid ones) or bad arch_args.
    """
    nested = arch_args.pop("arch_args", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"{arch}: arch_args must be a dict, got {type(nested).__name__}")
        arch_args = {**nested, **arch_args}
    if arch not in ARCHS:
        raise ValueError(f"unknown model arch '{arch}'; valid archs: {', '.join(sorted(ARCHS))}")
    if arch in MONAI_ARGS:
        own = set(inspect.signature(ARCHS[arch].__init__).parameters) - {"self", "monai_args"}
        refused = sorted(set(arch_args) - own - MONAI_ARGS[arch])
        if refused:
            raise ValueError(f"{arch}: arch_args {refused} not allowed; it takes {sorted(own - {'num_classes', 'in_channels'})} "
                             f"and MONAI's {sorted(MONAI_ARGS[arch])}")
    try:
        return ARCHS[arch](int(num_classes), int(in_channels), **arch_args)
    except TypeError as exc:  # unknown keyword for a local class
        raise ValueError(f"{arch}: bad arch_args {sorted(arch_args)}: {exc}") from exc
