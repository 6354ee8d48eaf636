"""Binary (lesion) segmentation metrics with MONAI.

Choice: the foreground is passed to MONAI as the only channel, ``(N, 1, H, W)`` with
``include_background=True`` (that one channel IS the foreground; there is no background
channel), i.e. foreground-only Dice / IoU. Scores are computed per image and averaged over
images. ``ignore_empty=False``: an image where prediction and target are both empty scores
1 (a correct "no lesion"), an image with an empty target but a non-empty prediction scores 0.

:func:`overlap_summary` is what site validation, the progress lines, model selection and
``python -m fedpartial evaluate`` report: it leaves empty-truth-and-empty-prediction images out of
its per-image means (counting them separately), adds pooled Dice / IoU over all pixels and the
share of images in which the model predicts any lesion. :func:`segmentation_metrics` (per-image
means, empty = 1) stays for the DSB2018 tables, where nearly every image holds nuclei.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch


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
    from monai.metrics import DiceMetric, MeanIoU  # here: a classification site never pays MONAI's import

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


# Rule of the per-image means in overlap_summary (printed by `evaluate`).
EMPTY_RULE = ("an image with empty truth and empty prediction is left out of the per-image means "
              "and counted in n_empty_both; empty truth with a non-empty prediction scores 0")


def overlap_counts(pred, target) -> Dict[str, np.ndarray]:
    """Per-image pixel counts of binary masks: true positives, false positives, false negatives.

    Args:
        pred: predicted masks ``(N, H, W)``, bool or 0/1 (numpy or torch).
        target: reference masks of the same shape.

    Returns:
        ``{"tp", "fp", "fn"}``, each an int64 ``(N,)`` array. Counts (not scores) so that images
        of different sizes and sites can be pooled afterwards.
    """
    p = (pred.detach().cpu().numpy() if isinstance(pred, torch.Tensor) else np.asarray(pred)).astype(bool)
    t = (target.detach().cpu().numpy() if isinstance(target, torch.Tensor) else np.asarray(target)).astype(bool)
    if p.shape != t.shape or p.ndim != 3:
        raise ValueError(f"pred shape {p.shape} and target shape {t.shape} must be the same (N, H, W)")
    flat_p, flat_t = p.reshape(len(p), -1), t.reshape(len(t), -1)
    return {"tp": (flat_p & flat_t).sum(1).astype(np.int64), "fp": (flat_p & ~flat_t).sum(1).astype(np.int64),
            "fn": (~flat_p & flat_t).sum(1).astype(np.int64)}


def overlap_summary(tp, fp, fn) -> Dict[str, float]:
    """Per-image and pooled foreground Dice / IoU from per-image counts.

    Per image: Dice = 2 TP / (2 TP + FP + FN), IoU = TP / (TP + FP + FN); an image with empty
    truth and empty prediction (TP + FP + FN = 0) has no defined score: it is left out of the
    per-image means and counted in ``n_empty_both`` (counting it as 1 would let lesion-free
    slices inflate the mean). Pooled: the same formulas on the counts summed over all images
    (every pixel of the split together). NaN where nothing is left to score.

    Args:
        tp: per-image true-positive pixel counts ``(N,)``.
        fp: per-image false-positive counts.
        fn: per-image false-negative counts.

    Returns:
        ``{"dice_per_image", "iou_per_image", "dice_pooled", "iou_pooled", "n_images",
        "n_empty_both", "predicted_lesion_share"}``; ``predicted_lesion_share`` is the share of
        images with any predicted foreground pixel (0 = the model predicts no lesion at all).
    """
    tp, fp, fn = (np.asarray(a, dtype=np.float64) for a in (tp, fp, fn))
    scored = (tp + fp + fn) > 0
    nan = float("nan")
    dice = 2 * tp[scored] / (2 * tp[scored] + fp[scored] + fn[scored])
    iou = tp[scored] / (tp[scored] + fp[scored] + fn[scored])
    T, P, N = tp.sum(), fp.sum(), fn.sum()
    return {"dice_per_image": float(dice.mean()) if dice.size else nan,
            "iou_per_image": float(iou.mean()) if iou.size else nan,
            "dice_pooled": float(2 * T / (2 * T + P + N)) if T + P + N else nan,
            "iou_pooled": float(T / (T + P + N)) if T + P + N else nan,
            "n_images": int(tp.size), "n_empty_both": int((~scored).sum()),
            "predicted_lesion_share": float(((tp + fp) > 0).mean()) if tp.size else nan}


def validation_metrics(pred, target) -> Dict[str, float]:
    """What a site reports for its val split: :func:`overlap_summary` plus the summed pixel counts
    ``tp`` / ``fp`` / ``fn``, so that the server can pool Dice over every site's pixels
    (:func:`pooled_validation`). Undefined (NaN) scores are left out.

    Args:
        pred: predicted masks ``(N, H, W)``.
        target: reference masks of the same shape.
    """
    counts = overlap_counts(pred, target)
    out = overlap_summary(counts["tp"], counts["fp"], counts["fn"])
    out.update({k: int(v.sum()) for k, v in counts.items()})
    return {k: v for k, v in out.items() if not (isinstance(v, float) and np.isnan(v))}


POOLED_KEYS = ("tp", "fp", "fn", "n_images", "predicted_lesion_share")


def pooled_validation(site_metrics: Dict[str, dict]):
    """Pooled Dice over every site's val pixels, and the share of val images with a predicted
    lesion, from the sites' :func:`validation_metrics`.

    Args:
        site_metrics: ``{site: metrics}``; sites without the pixel counts are skipped.

    Returns:
        ``{"dice_pooled", "predicted_lesion_share", "n_images", "sites"}`` or None when no site
        sent pixel counts (classification, or no val split). ``dice_pooled`` is NaN when no site
        has a lesion pixel in truth or prediction.
    """
    used = {s: m for s, m in site_metrics.items() if m and all(k in m for k in POOLED_KEYS)}
    if not used:
        return None
    tp, fp, fn = (float(sum(m[k] for m in used.values())) for k in ("tp", "fp", "fn"))
    n = float(sum(m["n_images"] for m in used.values()))
    with_lesion = sum(m["predicted_lesion_share"] * m["n_images"] for m in used.values())
    return {"dice_pooled": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else float("nan"),
            "predicted_lesion_share": with_lesion / n if n else float("nan"), "n_images": int(n),
            "sites": len(used)}
