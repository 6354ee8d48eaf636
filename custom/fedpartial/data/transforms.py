"""Weak and strong augmentation views built from MONAI transforms.

Views work on a batch tensor ``(N, C, H, W)`` (already normalised) and apply the MONAI
pipeline to each sample, so every sample gets its own random draw.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from monai.transforms import (Compose, OneOf, RandAffine, RandFlip, RandGaussianNoise, RandGaussianSmooth,
                              RandGaussianSharpen)

VIEWS = ("none", "weak", "strong")


def weak_pipeline(prob: float = 0.5) -> Compose:
    """Weak view: random horizontal and vertical flips.

    Args:
        prob: probability of each flip.
    """
    return Compose([RandFlip(prob=prob, spatial_axis=0), RandFlip(prob=prob, spatial_axis=1)])


def strong_pipeline(prob: float = 0.5, rotate_deg: float = 15.0, shift: float = 0.1, scale: float = 0.1,
                    noise_std: float = 0.1) -> Compose:
    """Strong view: flips, then rotation / shift / scaling, then one of Gaussian blur, Gaussian
    noise or sharpening (MONAI has no median blur on tensors; sharpening stands in).

    Args:
        prob: probability of each flip and of the affine.
        rotate_deg: max rotation in degrees.
        shift: max translation as a fraction of the image size.
        scale: max relative zoom.
        noise_std: std of the additive Gaussian noise (normalised intensity units).
    """
    import math

    def affine(spatial_size=None):
        return RandAffine(prob=prob, rotate_range=(math.radians(rotate_deg),), translate_range=None,
                          scale_range=(scale, scale), padding_mode="border")

    return Compose([
        RandFlip(prob=prob, spatial_axis=0), RandFlip(prob=prob, spatial_axis=1),
        _RelativeShift(shift=shift, prob=prob), affine(),
        OneOf([RandGaussianSmooth(prob=1.0, sigma_x=(0.25, 1.0), sigma_y=(0.25, 1.0)),
               RandGaussianNoise(prob=1.0, std=noise_std),
               RandGaussianSharpen(prob=1.0)]),
    ])


class _RelativeShift:
    """RandAffine's translate_range is in pixels; this shifts by a fraction of the image size."""

    def __init__(self, shift: float, prob: float):
        self.shift, self.prob = shift, prob

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if self.shift <= 0 or torch.rand(()) > self.prob:
            return img
        h, w = img.shape[-2:]
        dy = int(round(float(torch.empty(()).uniform_(-self.shift, self.shift)) * h))
        dx = int(round(float(torch.empty(()).uniform_(-self.shift, self.shift)) * w))
        return torch.roll(torch.as_tensor(img), shifts=(dy, dx), dims=(-2, -1))


def make_view(kind: str = "weak", **kwargs) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """Return a batch view function, or None for ``none``.

    Args:
        kind: ``none``, ``weak`` or ``strong``.
        **kwargs: passed to :func:`weak_pipeline` / :func:`strong_pipeline`.
    """
    if kind not in VIEWS:
        raise ValueError(f"unknown augmentation view '{kind}'; choose one of {VIEWS}")
    if kind == "none":
        return None
    pipeline = weak_pipeline(**kwargs) if kind == "weak" else strong_pipeline(**kwargs)

    def apply(batch: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.as_tensor(pipeline(sample)).as_subclass(torch.Tensor) for sample in batch])

    return apply


def flip_batch(batch: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Fast weak view for a whole batch at once: each sample flipped on each axis with p=0.5.
    Same distribution as :func:`weak_pipeline`, vectorised (used in hot loops)."""
    n = batch.shape[0]
    flip_h = torch.rand(n, generator=generator) < 0.5
    flip_v = torch.rand(n, generator=generator) < 0.5
    out = batch.clone()
    out[flip_h] = out[flip_h].flip(-1)
    out[flip_v] = out[flip_v].flip(-2)
    return out


def resize_dataset(dataset, size):
    """Resize every split's images (bilinear) and segmentation masks (nearest) to ``size`` (H, W).

    Args:
        dataset: a :class:`fedpartial.data.types.Dataset`.
        size: target (H, W).
    """
    import numpy as np
    import torch.nn.functional as F

    from fedpartial.data.types import Dataset, Split

    size = tuple(int(s) for s in size)
    splits = {}
    for name, split in dataset.splits.items():
        images = split.images
        if tuple(images.shape[1:3]) == size:
            splits[name] = split
            continue
        x = torch.from_numpy(np.ascontiguousarray(images))
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
        x = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
        x = x.round().clamp(0, 255).to(torch.uint8)
        x = x[:, 0] if images.ndim == 3 else x.permute(0, 2, 3, 1)
        labels = split.labels
        if dataset.is_segmentation:
            m = torch.from_numpy(np.ascontiguousarray(labels).astype(np.int64))[:, None].float()
            labels = F.interpolate(m, size=size, mode="nearest")[:, 0].numpy().astype(split.labels.dtype)
        splits[name] = Split(x.numpy(), labels, split.label_mask, split.ids, split.groups)
    return Dataset(dataset.task, list(dataset.class_names), splits, dataset.source, dataset.site, dict(dataset.info))
