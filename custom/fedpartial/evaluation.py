"""Evaluation of a model on one split: shared by the executor (validation), the CLI
(`evaluate`) and the benchmark."""
from __future__ import annotations

import numpy as np
import torch

from fedpartial.data.types import SEGMENTATION, Split
from fedpartial.training.common import images_to_tensor, predict, probabilities


def predict_split(model, split: Split, task: str, normalisation: dict, device, batch_size: int = 128) -> np.ndarray:
    """Probabilities of ``model`` on ``split``: (N, C) for classification, (N, H, W) foreground
    probability for segmentation."""
    x = images_to_tensor(split.images, normalisation["mean"], normalisation["std"])
    logits = predict(model, x, device, batch_size=batch_size)
    if task == SEGMENTATION:
        return torch.sigmoid(logits[:, 0]).numpy()
    return probabilities(logits, task).numpy()


def evaluate_split(model, split: Split, task: str, class_names, normalisation: dict, device,
                   flat: bool = False, threshold: float = 0.5) -> dict:
    """Metrics of ``model`` on ``split``.

    Args:
        model: a fedpartial model.
        split: images and complete labels (classification multi-hot, segmentation masks).
        task: ``single-label`` | ``multi-label`` | ``segmentation``.
        class_names: class names (classification).
        normalisation: ``{"mean", "std"}`` the model was trained with.
        device: torch device.
        flat: drop the nested per-class block (for FLARE metric DXOs and TensorBoard).
        threshold: probability threshold for multi-label / segmentation predictions.
    """
    from fedpartial.metrics import classification_metrics, segmentation_metrics

    probs = predict_split(model, split, task, normalisation, device)
    if task == SEGMENTATION:
        return segmentation_metrics(probs > threshold, np.asarray(split.labels) > 0)
    metrics = classification_metrics(probs, np.asarray(split.labels), task, list(class_names), threshold=threshold)
    if flat:
        metrics = {k: float(v) for k, v in metrics.items() if np.isscalar(v)}
    return metrics
