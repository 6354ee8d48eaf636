"""The per-sample MONAI pipelines behind ``make_view("strong-per-sample")``: the reference the
batched views of :mod:`fedpartial.data.transforms` are checked against (imported only when named)."""
from __future__ import annotations

import math

import torch
from monai.transforms import (Compose, OneOf, RandAffine, RandFlip, RandGaussianNoise, RandGaussianSmooth,
                              RandGaussianSharpen, Randomizable)


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
    affine = RandAffine(prob=prob, rotate_range=(math.radians(rotate_deg),), translate_range=None,
                        scale_range=(scale, scale), padding_mode="border")
    return Compose([
        RandFlip(prob=prob, spatial_axis=0), RandFlip(prob=prob, spatial_axis=1),
        _RelativeShift(shift=shift, prob=prob), affine,
        OneOf([RandGaussianSmooth(prob=1.0, sigma_x=(0.25, 1.0), sigma_y=(0.25, 1.0)),
               RandGaussianNoise(prob=1.0, std=noise_std),
               RandGaussianSharpen(prob=1.0)]),
    ])


class _RelativeShift(Randomizable):
    """RandAffine's translate_range is in pixels; this shifts by a fraction of the image size.
    Draws from MONAI's per-transform generator, so ``Compose.set_random_state`` seeds it too."""

    def __init__(self, shift: float, prob: float):
        self.shift, self.prob = shift, prob

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if self.shift <= 0 or self.R.rand() > self.prob:
            return img
        h, w = img.shape[-2:]
        dy = int(round(self.R.uniform(-self.shift, self.shift) * h))
        dx = int(round(self.R.uniform(-self.shift, self.shift) * w))
        return torch.roll(torch.as_tensor(img), shifts=(dy, dx), dims=(-2, -1))
