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


def pseudo_label_census(model, site_files, reference_dir: str, normalisation: dict, device, tau: float = 0.95,
                        renormalise_missing: bool = False) -> dict:
    """Which classes a single-label model would pseudo-label at each site (FedLSM's rule,
    :func:`fedpartial.algorithms.fedlsm.single_label_pseudo_labels`), against the hidden truth.

    A diagnostic for "why does a method not learn class c from the sites that do not annotate
    it": counts, per class, the hidden samples of that class and the confident pseudo labels the
    model gives (and how many of those are right).

    Args:
        model: a single-label classifier ``x -> (features, logits)``.
        site_files: paths of the site ``.npz`` files (partial labels, ``label_mask``).
        reference_dir: folder of ``<site>_full.npz`` copies with the complete labels.
        normalisation: the model's ``{"mean", "std"}``.
        device: torch device.
        tau: confidence threshold.
        renormalise_missing: the FedLSM option of the same name.

    Returns:
        ``{"classes": [...], "sites": {site: {"hidden": [...], "pseudo": [...], "correct": [...]}},
        "total": {...}}`` with one count per class in each list.
    """
    import os

    from fedpartial.algorithms.fedlsm import single_label_pseudo_labels
    from fedpartial.data.npz import load_npz

    out, total, classes = {}, None, None
    for path in site_files:
        site = os.path.splitext(os.path.basename(path))[0]
        data = load_npz(path)
        ref_path = os.path.join(reference_dir, f"{site}_full.npz")
        if not os.path.isfile(ref_path):
            raise FileNotFoundError(f"no reference copy '{ref_path}' for site file '{path}'")
        train, truth = data.splits["train"], np.asarray(load_npz(ref_path).splits["train"].labels) > 0.5
        if truth.shape != np.shape(train.labels):
            raise ValueError(f"'{ref_path}' labels {truth.shape} do not match '{path}' {np.shape(train.labels)}")
        classes = list(data.class_names)
        x = images_to_tensor(train.images, normalisation["mean"], normalisation["std"])
        probs = probabilities(predict(model, x, device), data.task).double().cpu()
        mask = torch.as_tensor(np.asarray(train.label_mask, dtype=np.float64))
        labels = torch.as_tensor(np.asarray(train.labels, dtype=np.float64))
        target, _, is_pseudo = single_label_pseudo_labels(probs, labels, mask, tau, renormalise_missing)
        hidden = truth & ~(np.asarray(labels * mask) > 0.5).any(axis=1, keepdims=True)
        pseudo = np.zeros_like(truth)
        pseudo[np.flatnonzero(is_pseudo.numpy()), target[is_pseudo].numpy()] = True
        row = {"hidden": hidden.sum(0).tolist(), "pseudo": pseudo.sum(0).tolist(),
               "correct": (pseudo & truth).sum(0).tolist()}
        out[site] = row
        total = row if total is None else {k: [a + b for a, b in zip(total[k], row[k])] for k in row}
    return {"classes": classes, "sites": out, "total": total}
