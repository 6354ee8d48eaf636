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


def split_metrics(probs: np.ndarray, split: Split, task: str, class_names, flat: bool = False,
                  threshold: float = 0.5) -> dict:
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
    """
    from fedpartial.metrics import classification_metrics, validation_metrics

    if task == SEGMENTATION:
        # the same scores as `evaluate`: pooled and per-image Dice (empty-both images left out),
        # the share of images with a predicted lesion, and the pixel counts the server pools
        return validation_metrics(probs > threshold, np.asarray(split.labels) > 0)
    # a site's val split is partially annotated like its train split: score annotated entries only
    # (an unannotated entry is neither a positive nor a negative)
    mask = None if split.label_mask is None or np.all(split.label_mask) else np.asarray(split.label_mask)
    metrics = classification_metrics(probs, np.asarray(split.labels), task, list(class_names), threshold=threshold,
                                     label_mask=mask)
    if flat:
        metrics = {k: float(v) for k, v in metrics.items() if np.isscalar(v)}
    return metrics
