"""Weak and strong augmentation views built from MONAI layers, on a batch tensor ``(N, C, H, W)``
(already normalised); every sample gets its own random draw. MONAI is imported where a view
needs it: importing it costs seconds of a site's start-up, and flips and segmentation need none.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

VIEWS = ("none", "weak", "strong")


#: Every augmentation a classification rule's ``augmentation`` may name (:func:`training_view`).
TRAINING_VIEWS = ("none", "weak", "flip", "strong", "strong-per-sample", "affine")


def affine_flip_batch(batch: torch.Tensor, rotate_deg: float = 10.0, translate: float = 0.02) -> torch.Tensor:
    """A horizontal flip (p = 0.5) and a random rotation / shift per image, on the whole batch
    with MONAI's affine layer (FedIRM's reference perturbation: RandomAffine(10 deg, 2 %) + flip).

    Args:
        batch: ``(N, C, H, W)`` float images.
        rotate_deg: largest rotation in degrees.
        translate: largest shift as a fraction of the size.
    """
    flip = torch.rand(batch.shape[0]) < 0.5
    batch = batch.clone()
    batch[flip] = batch[flip].flip(-1)
    return affine_batch(batch, rotate_deg=rotate_deg, shift=translate, scale=0.0)


def training_view(kind: str, seed: Optional[int] = None, rotate_deg: float = 10.0,
                  translate: float = 0.02) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The batch augmentation a classification rule names (None for ``none``): ``weak`` / ``flip``
    (horizontal flips), ``strong`` / ``strong-per-sample`` (:func:`make_view`), ``affine``
    (:func:`affine_flip_batch`). One table for the methods and the baselines matched to them.

    Args:
        kind: one of :data:`TRAINING_VIEWS`.
        seed: seeds ``strong`` views (None draws from torch's generator).
        rotate_deg / translate: of the ``affine`` view.
    """
    if kind not in TRAINING_VIEWS:
        raise ValueError(f"unknown augmentation '{kind}'; choose one of {TRAINING_VIEWS}")
    if kind in ("weak", "flip"):
        return flip_batch
    if kind == "affine":
        return lambda batch: affine_flip_batch(batch, rotate_deg, translate)
    return make_view(kind, seed=seed)


def make_view(kind: str = "weak", seed: Optional[int] = None, **kwargs) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """Return a batch view function, or None for ``none``. ``weak`` and ``strong`` are the
    vectorised versions of :func:`weak_pipeline` / :func:`strong_pipeline` (same operations,
    applied to the whole batch at once with MONAI's batched layers: the per-sample pipelines
    cost most of a CPU round).

    Args:
        kind: ``none``, ``weak``, ``strong``, or ``strong-per-sample`` (the MONAI Compose pipeline
            sample by sample; slower, kept as the reference).
        seed: seeds the view's own generator (repeatable rounds); None draws from torch's.
        **kwargs: passed to :func:`strong_batch` / :func:`strong_pipeline`.
    """
    kinds = VIEWS + ("strong-per-sample",)
    if kind not in kinds:
        raise ValueError(f"unknown augmentation view '{kind}'; choose one of {kinds}")
    if kind == "none":
        return None
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
    if kind == "weak":
        return lambda batch: flip_batch(batch, generator)
    if kind == "strong":
        return lambda batch: strong_batch(batch, generator=generator, **kwargs)
    from fedpartial.data.sample_views import strong_pipeline

    pipeline = strong_pipeline(**kwargs)
    if seed is not None:
        pipeline.set_random_state(seed=int(seed))

    def apply(batch: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.as_tensor(pipeline(sample)).as_subclass(torch.Tensor) for sample in batch])

    return apply


def _uniform(n: int, low: float, high: float, generator) -> torch.Tensor:
    return torch.rand(n, generator=generator) * (high - low) + low


def affine_batch(batch: torch.Tensor, rotate_deg: float = 15.0, shift: float = 0.1, scale: float = 0.1,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Random rotation / translation / zoom of each sample of ``(N, C, H, W)``, one MONAI
    ``AffineTransform`` call for the batch (border padding, bilinear).

    Args:
        batch: images.
        rotate_deg: max rotation (degrees).
        shift: max translation as a fraction of the image size.
        scale: max relative zoom.
        generator: torch generator for the draws.
    """
    import math

    from monai.networks.layers import AffineTransform

    n = batch.shape[0]
    angle = _uniform(n, -math.radians(rotate_deg), math.radians(rotate_deg), generator)
    zoom = _uniform(n, 1.0 - scale, 1.0 + scale, generator)
    tx, ty = (_uniform(n, -2 * shift, 2 * shift, generator) for _ in range(2))  # normalised coords span 2
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = zoom * torch.cos(angle)
    theta[:, 0, 1] = -zoom * torch.sin(angle)
    theta[:, 1, 0] = zoom * torch.sin(angle)
    theta[:, 1, 1] = zoom * torch.cos(angle)
    theta[:, 0, 2], theta[:, 1, 2] = tx, ty
    warp = AffineTransform(normalized=True, mode="bilinear", padding_mode="border", align_corners=False)
    return warp(batch.float(), theta.to(batch.device))


def strong_batch(batch: torch.Tensor, rotate_deg: float = 15.0, shift: float = 0.1, scale: float = 0.1,
                 noise_std: float = 0.1, blur_sigma=(0.25, 1.0), generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Strong view of a batch: flips, random affine, then per sample one of Gaussian blur,
    Gaussian noise or sharpening (as :func:`strong_pipeline`, vectorised).

    Args:
        batch: ``(N, C, H, W)`` images.
        rotate_deg / shift / scale: see :func:`affine_batch`.
        noise_std: std of the additive noise (normalised intensity units).
        blur_sigma: (min, max) sigma of the Gaussian blur, in pixels.
        generator: torch generator for the draws.
    """
    from monai.networks.layers import GaussianFilter

    out = affine_batch(flip_batch(batch, generator), rotate_deg, shift, scale, generator)
    # draws come from a CPU generator; masks and noise then move to the batch's device (CUDA)
    choice = torch.randint(0, 3, (out.shape[0],), generator=generator).to(out.device)
    sigma = float(_uniform(1, blur_sigma[0], blur_sigma[1], generator))
    blur = GaussianFilter(spatial_dims=2, sigma=sigma)
    if (choice == 0).any():
        out[choice == 0] = blur(out[choice == 0])
    if (choice == 1).any():
        picked = out[choice == 1]
        noise = torch.randn(picked.shape, generator=generator).to(device=picked.device, dtype=picked.dtype)
        out[choice == 1] = picked + noise_std * noise
    if (choice == 2).any():
        picked = out[choice == 2]
        out[choice == 2] = picked + (picked - blur(picked))  # unsharp mask
    return out


def flip_batch(batch: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Fast weak view for a whole batch at once: each sample flipped on each axis with p=0.5.
    Same distribution as :func:`weak_pipeline`, vectorised (used in hot loops)."""
    n = batch.shape[0]
    flip_h = (torch.rand(n, generator=generator) < 0.5).to(batch.device)
    flip_v = (torch.rand(n, generator=generator) < 0.5).to(batch.device)
    out = batch.clone()
    out[flip_h] = out[flip_h].flip(-1)
    out[flip_v] = out[flip_v].flip(-2)
    return out


def resize_images(images, size):
    """Resize uint8 images ``(N, H, W)`` / ``(N, H, W, 3)`` to ``size`` (H, W): bilinear with
    antialiasing (so downsizing averages rather than skips pixels), rounded back to uint8.

    Args:
        images: uint8 numpy array.
        size: target (H, W).
    """
    import numpy as np
    import torch.nn.functional as F

    size = tuple(int(s) for s in size)
    if tuple(images.shape[1:3]) == size:
        return images
    x = torch.from_numpy(np.ascontiguousarray(images))
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    x = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
    x = x.round().clamp(0, 255).to(torch.uint8)
    return (x[:, 0] if images.ndim == 3 else x.permute(0, 2, 3, 1)).numpy()


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
        resized = resize_images(images, size)
        labels = split.labels
        if dataset.is_segmentation:
            m = torch.from_numpy(np.ascontiguousarray(labels).astype(np.int64))[:, None].float()
            labels = F.interpolate(m, size=size, mode="nearest")[:, 0].numpy().astype(split.labels.dtype)
        splits[name] = Split(resized, labels, split.label_mask, split.ids, split.groups)
    return Dataset(dataset.task, list(dataset.class_names), splits, dataset.source, dataset.site, dict(dataset.info))
