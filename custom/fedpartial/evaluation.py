"""Evaluation of a model on one split, as a site runs it (validation, cross-site evaluation).
The user-facing ``evaluate`` command builds on it in :mod:`fedpartial_tools.evaluate`."""
from __future__ import annotations

import numpy as np
import torch

from fedpartial.data.types import SEGMENTATION, Split
from fedpartial.training.common import predict_uint8, probabilities


def predict_split(model, split: Split, task: str, normalisation: dict, device, batch_size: int = 128) -> np.ndarray:
    """Probabilities of ``model`` on ``split``: (N, C) for classification, (N, H, W) foreground
    probability for segmentation."""
    # one batch at a time: a (memory-mapped) split never exists whole as floats
    logits = predict_uint8(model, split.images, normalisation, device, batch_size=batch_size)
    if task == SEGMENTATION:
        return torch.sigmoid(logits[:, 0]).numpy()
    return probabilities(logits, task).numpy()


def evaluate_split(model, split: Split, task: str, class_names, normalisation: dict, device,
                   flat: bool = False, threshold: float = 0.5) -> dict:
    """Metrics of ``model`` on ``split`` (:func:`split_metrics` of :func:`predict_split`).

    Args:
        model: a fedpartial model.
        split: images and complete labels (classification multi-hot, segmentation masks).
        task: ``single-label`` | ``multi-label`` | ``segmentation``.
        class_names: class names (classification).
        normalisation: ``{"mean", "std"}`` the model was trained with.
        device: torch device.
        flat: see :func:`split_metrics`.
        threshold: see :func:`split_metrics`.
    """
    probs = predict_split(model, split, task, normalisation, device)
    return split_metrics(probs, split, task, class_names, flat=flat, threshold=threshold)


def describable(labels: np.ndarray, label_mask, task: str, min_class_count: int) -> tuple:
    """The part of a val split whose scores may describe it to others: a class with fewer than
    ``min_class_count`` annotated positives or negatives is scored as if unannotated (a rate over
    it, even averaged with other classes', places those few images), and single-label rows of such
    a class are left out (their argmax hits would count them).

    Args:
        labels: ``(N, C)`` 0/1 labels.
        label_mask: ``(N, C)`` bool annotated entries, or None (all).
        task: ``single-label`` | ``multi-label``.
        min_class_count: k (0 = everything).

    Returns:
        ``(rows, label_mask)``: the kept rows (bool ``(N,)``) and the mask of the kept rows
        (None where nothing was removed and the input had none).
    """
    labels = np.asarray(labels) > 0
    rows = np.ones(len(labels), dtype=bool)
    if min_class_count <= 0:
        return rows, label_mask
    mask = np.ones_like(labels, dtype=bool) if label_mask is None else np.asarray(label_mask, dtype=bool)
    positives, negatives = (labels & mask).sum(axis=0), (~labels & mask).sum(axis=0)
    rare = (positives < min_class_count) | (negatives < min_class_count)
    if not rare.any():
        return rows, label_mask
    if task != "multi-label":
        rows = ~(labels[:, rare] & mask[:, rare]).any(axis=1)
    return rows, mask[rows] & ~rare[None, :]


def split_metrics(probs: np.ndarray, split: Split, task: str, class_names, flat: bool = False,
                  threshold: float = 0.5, min_class_count: int = 0) -> dict:
    """Metrics of the probabilities :func:`predict_split` gave on ``split``: one prediction pass
    can serve the metrics and the val histograms of a round.

    Args:
        probs: (N, C) class or (N, H, W) foreground probabilities.
        split: the split ``probs`` were predicted on.
        task: ``single-label`` | ``multi-label`` | ``segmentation``.
        class_names: class names (classification).
        flat: drop the nested per-class block (for FLARE metric DXOs and TensorBoard).
            Segmentation: :func:`fedpartial.metrics.validation_metrics` (``dice_pooled``,
            ``dice_per_image``, ``predicted_lesion_share``, pixel counts ``tp`` / ``fp`` / ``fn`` ...).
        threshold: probability threshold for multi-label / segmentation predictions.
        min_class_count: classification scored only over what :func:`describable` keeps (what a
            site sends; 0 = the whole split).
    """
    from fedpartial.metrics import classification_metrics, validation_metrics

    if task == SEGMENTATION:
        # the same scores as `evaluate`: pooled and per-image Dice (empty-both images left out),
        # the share of images with a predicted lesion, and the pixel counts the server pools
        return validation_metrics(probs > threshold, np.asarray(split.labels) > 0)
    # a site's val split is partially annotated like its train split: score annotated entries only
    # (an unannotated entry is neither a positive nor a negative)
    mask = None if split.label_mask is None or np.all(split.label_mask) else np.asarray(split.label_mask)
    labels = np.asarray(split.labels)
    rows, mask = describable(labels, mask, task, min_class_count)
    if not rows.any() or (mask is not None and not mask.any()):
        return {}  # nothing the site may describe: no score, not a 0
    labels = labels[rows] if mask is None else np.where(mask, labels[rows], 0)  # left-out entries: unannotated
    metrics = classification_metrics(np.asarray(probs)[rows], labels, task, list(class_names),
                                     threshold=threshold, label_mask=mask)
    if flat:
        metrics = {k: float(v) for k, v in metrics.items() if np.isscalar(v)}
    return metrics
