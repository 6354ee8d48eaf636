"""Binary (lesion) segmentation metrics with MONAI.

Choice: the foreground is passed to MONAI as the only channel, ``(N, 1, H, W)`` with
``include_background=True`` (that one channel IS the foreground; there is no background
channel), i.e. foreground-only Dice / IoU. Scores are computed per image and averaged over
images. ``ignore_empty=False``: an image where prediction and target are both empty scores
1 (a correct "no lesion"), an image with an empty target but a non-empty prediction scores 0.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch
from monai.metrics import DiceMetric, MeanIoU


def _as_mask(x, name: str) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.ndim == 4 and t.shape[1] == 1:
        t = t[:, 0]
    if t.ndim != 3:
        raise ValueError(f"{name} must be binary masks (N, H, W) or (N, 1, H, W), got shape {tuple(t.shape)}")
    t = t.float()
    if not bool(((t == 0) | (t == 1)).all()):
        raise ValueError(f"{name} must hold only 0/1 (threshold probabilities / logits first)")
    return t.unsqueeze(1)


def segmentation_scores(pred, target) -> Dict[str, np.ndarray]:
    """Per-image foreground Dice and IoU (``(N,)`` arrays); see the module docstring for the
    empty-image rule."""
    p, t = _as_mask(pred, "pred"), _as_mask(target, "target")
    if p.shape != t.shape:
        raise ValueError(f"pred shape {tuple(p.shape[:1] + p.shape[2:])} and target shape "
                         f"{tuple(t.shape[:1] + t.shape[2:])} must be the same (N, H, W)")
    dice = DiceMetric(include_background=True, reduction="none", ignore_empty=False)(p, t)
    iou = MeanIoU(include_background=True, reduction="none", ignore_empty=False)(p, t)
    return {"dice": dice[:, 0].numpy().astype(np.float64), "iou": iou[:, 0].numpy().astype(np.float64)}


def segmentation_metrics(pred, target) -> Dict[str, float]:
    """Mean over images of the foreground Dice and IoU.

    Args:
        pred: binary predicted masks ``(N, H, W)`` (or ``(N, 1, H, W)``), numpy or torch.
        target: binary reference masks of the same shape.

    Returns:
        ``{"dice": float, "iou": float}``.

    Raises:
        ValueError: shapes differ (the message gives both) or values are not 0/1.
    """
    scores = segmentation_scores(pred, target)
    if scores["dice"].size == 0:
        raise ValueError("segmentation metrics need at least one image")
    return {"dice": float(scores["dice"].mean()), "iou": float(scores["iou"].mean())}
