"""Classification metrics for single-label and multi-label tasks (scikit-learn underneath).

Inputs are ``probs (N, C)`` (softmax for single-label, sigmoid for multi-label) and multi-hot
``labels (N, C)`` (one-hot for single-label), the layout every fedpartial reader produces.
Per-class values that are undefined on the given data (AUC of a class whose labels are all
0 or all 1, AP of a class with no positive, balanced accuracy likewise) are NaN, and the macro
averages ``auc``, ``map`` and (multi-label) ``bacc`` run over the defined classes only.
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, Sequence

import numpy as np
from sklearn.metrics import (accuracy_score, average_precision_score, balanced_accuracy_score,
                             precision_recall_fscore_support, roc_auc_score)

TASKS = ("single-label", "multi-label")


def _as_numpy(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array: {exc}") from exc


def _nanmean(values) -> float:
    """Mean over the finite values; NaN (without a warning) when there is none."""
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return float(np.mean(values)) if values else float("nan")


def _check(probs, labels, task: str, class_names: Sequence[str]):
    probs, labels = _as_numpy(probs, "probs"), _as_numpy(labels, "labels")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS} for classification metrics, got '{task}'")
    if probs.ndim != 2 or probs.shape != labels.shape:
        raise ValueError(f"probs shape {probs.shape} and labels shape {labels.shape} must be the same (N, C)")
    if probs.shape[0] == 0:
        raise ValueError("classification metrics need at least one sample (got probs of shape "
                         f"{probs.shape})")
    if len(class_names) != probs.shape[1]:
        raise ValueError(f"{len(class_names)} class_names for {probs.shape[1]} columns of probs {probs.shape}")
    if not np.all(np.isfinite(probs)) or probs.min() < -1e-6 or probs.max() > 1 + 1e-6:
        raise ValueError(f"probs must be probabilities in [0, 1] (got min {np.nanmin(probs):.3g}, max "
                         f"{np.nanmax(probs):.3g}); apply softmax / sigmoid to logits first")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError("labels must be multi-hot 0/1 (one-hot for single-label)")
    if task == "single-label":
        bad = np.flatnonzero(labels.sum(axis=1) != 1)
        if bad.size:
            raise ValueError(f"single-label metrics need one-hot labels; {bad.size} rows are not (first: row "
                             f"{bad[0]}). Evaluate on completely labelled data.")
    return probs, labels.astype(np.int64)


def _binary_balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """(TPR + TNR) / 2 of one class; NaN unless both label values occur."""
    pos, neg = y_true == 1, y_true == 0
    if not pos.any() or not neg.any():
        return float("nan")
    return 0.5 * (float(np.mean(y_pred[pos] == 1)) + float(np.mean(y_pred[neg] == 0)))


def classification_metrics(probs, labels, task: str, class_names: Sequence[str],
                           threshold: float = 0.5) -> Dict:
    """AUC, mAP, balanced accuracy, accuracy, macro F1 / precision / recall, per-class values.

    Args:
        probs: ``(N, C)`` class probabilities (numpy or torch).
        labels: ``(N, C)`` multi-hot 0/1 labels (one-hot for single-label).
        task: ``single-label`` (prediction = argmax) or ``multi-label`` (prediction =
            ``probs >= threshold`` per class).
        class_names: C names, the keys of ``per_class``.
        threshold: decision threshold of the multi-label predictions.

    Returns:
        ``{"auc", "map", "bacc", "accuracy", "f1", "precision", "recall", "per_class":
        {name: {"auc", "ap", "f1", "n_pos"}}}`` as Python floats / ints.

        * ``auc``: macro one-vs-rest ROC AUC over classes with both label values;
        * ``map``: macro average precision over classes with at least one positive;
        * single-label: ``accuracy`` = fraction of argmax hits, ``bacc`` =
          ``balanced_accuracy_score`` (mean recall over the classes present), ``f1`` /
          ``precision`` / ``recall`` macro over all C classes with ``zero_division=0``;
        * multi-label: ``accuracy`` = mean entry-wise accuracy of the N x C decisions, ``bacc``
          = mean over defined classes of (TPR + TNR) / 2, ``f1`` / ``precision`` / ``recall``
          macro over all C classes with ``zero_division=0``.
        Per-class ``f1`` is NaN for a class with no positive and no predicted positive.

    Raises:
        ValueError: shapes differ (the message gives both), wrong task, probs outside [0, 1],
            non-binary labels, or single-label rows that are not one-hot.
    """
    probs, labels = _check(probs, labels, task, class_names)
    n_classes = probs.shape[1]
    per_class: Dict[str, Dict] = {}
    aucs, aps = [], []
    for c, name in enumerate(class_names):
        y, p = labels[:, c], probs[:, c]
        n_pos = int(y.sum())
        auc = float(roc_auc_score(y, p)) if 0 < n_pos < len(y) else float("nan")
        ap = float(average_precision_score(y, p)) if n_pos > 0 else float("nan")
        aucs.append(auc)
        aps.append(ap)
        per_class[str(name)] = {"auc": auc, "ap": ap, "n_pos": n_pos}

    if task == "single-label":
        y_true, y_pred = labels.argmax(axis=1), probs.argmax(axis=1)
        accuracy = float(accuracy_score(y_true, y_pred))
        with warnings.catch_warnings():  # "y_pred contains classes not in y_true" is expected on small sets
            warnings.simplefilter("ignore")
            bacc = float(balanced_accuracy_score(y_true, y_pred))
    else:
        y_true, y_pred = labels, (probs >= threshold).astype(np.int64)
        accuracy = float(np.mean(y_true == y_pred))
        bacc = _nanmean(_binary_balanced_accuracy(y_true[:, c], y_pred[:, c]) for c in range(n_classes))

    class_ids = list(range(n_classes))
    precision, recall, f1, _ = precision_recall_fscore_support(y_true, y_pred, labels=class_ids, average="macro",
                                                               zero_division=0)
    _, _, f1_each, _ = precision_recall_fscore_support(y_true, y_pred, labels=class_ids, average=None,
                                                       zero_division=np.nan)
    for c, name in enumerate(class_names):
        per_class[str(name)]["f1"] = float(f1_each[c])

    return {"auc": _nanmean(aucs), "map": _nanmean(aps), "bacc": bacc, "accuracy": accuracy, "f1": float(f1),
            "precision": float(precision), "recall": float(recall), "per_class": per_class}
