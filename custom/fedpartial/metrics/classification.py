"""Classification metrics for single-label and multi-label tasks (scikit-learn underneath).

Inputs are ``probs (N, C)`` (softmax for single-label, sigmoid for multi-label) and multi-hot
``labels (N, C)`` (one-hot for single-label), the layout every fedpartial reader produces.
Per-class values that are undefined on the given data (AUC of a class whose labels are all
0 or all 1, AP of a class with no positive, balanced accuracy likewise) are NaN, and the macro
averages ``auc``, ``map`` and (multi-label) ``bacc`` run over the defined classes only.

Partially annotated data (site files) pass ``label_mask (N, C)``: an entry that is not
annotated is neither a positive nor a negative, so every per-class value of class c uses only
the samples where c is annotated (see :func:`classification_metrics`).
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


def _check(probs, labels, task: str, class_names: Sequence[str], label_mask=None):
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
    if label_mask is None:
        mask = np.ones(labels.shape, bool)
    else:
        mask = np.asarray(label_mask.detach().cpu().numpy() if hasattr(label_mask, "detach") else label_mask)
        if mask.shape != labels.shape:
            raise ValueError(f"label_mask shape {mask.shape} and labels shape {labels.shape} must be the same (N, C)")
        mask = mask.astype(bool)
        bad = np.argwhere((labels == 1) & ~mask)
        if len(bad):
            raise ValueError(f"label_mask marks entry {tuple(int(i) for i in bad[0])} unannotated but its label is 1")
    if task == "single-label":
        sums = labels.sum(axis=1)
        # a row whose positive is hidden (all annotated entries 0, some entry unannotated) is allowed
        # with a mask; its true class is unknown, so argmax metrics skip it
        bad = np.flatnonzero((sums > 1) | ((sums == 0) & mask.all(axis=1)))
        if bad.size:
            raise ValueError(f"single-label metrics need one-hot labels; {bad.size} rows are not (first: row "
                             f"{bad[0]}). Evaluate on completely labelled data.")
    return probs, labels.astype(np.int64), mask


def _binary_balanced_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """(TPR + TNR) / 2 of one class; NaN unless both label values occur."""
    pos, neg = y_true == 1, y_true == 0
    if not pos.any() or not neg.any():
        return float("nan")
    return 0.5 * (float(np.mean(y_pred[pos] == 1)) + float(np.mean(y_pred[neg] == 0)))


def _binary_counts(y_true: np.ndarray, y_pred: np.ndarray):
    tp = int(np.sum((y_true == 1) & (y_pred == 1)))
    return tp, int(np.sum((y_true == 0) & (y_pred == 1))), int(np.sum((y_true == 1) & (y_pred == 0)))


def _ratio(num: int, den: int, empty: float) -> float:
    return num / den if den else empty


def classification_metrics(probs, labels, task: str, class_names: Sequence[str],
                           threshold: float = 0.5, label_mask=None) -> Dict:
    """AUC, mAP, balanced accuracy, accuracy, macro F1 / precision / recall, per-class values.

    Args:
        probs: ``(N, C)`` class probabilities (numpy or torch).
        labels: ``(N, C)`` multi-hot 0/1 labels (one-hot for single-label).
        task: ``single-label`` (prediction = argmax) or ``multi-label`` (prediction =
            ``probs >= threshold`` per class).
        class_names: C names, the keys of ``per_class``.
        threshold: decision threshold of the multi-label predictions.
        label_mask: optional ``(N, C)`` bool, True where the entry is annotated (site files).
            None = every entry annotated; a mask that is all True gives the same values (plus
            ``per_class[...]['n']``).
            With a mask, class c is scored only on the samples where c is annotated: its AUC,
            AP, ``n_pos``, F1 / precision / recall and (multi-label) balanced accuracy use those
            rows, and ``per_class`` gains ``n`` (annotated samples). Multi-label ``accuracy``
            is the mean over annotated entries; the macro F1 / precision / recall run over the
            classes with at least one annotated entry. Single-label argmax metrics
            (``accuracy``, ``bacc``, F1 / precision / recall) use the rows whose true class is
            known, i.e. whose positive entry is annotated; a row with all its annotated entries
            0 still counts as a negative in the AUC / AP of those annotated classes.

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
            non-binary labels, single-label rows that are not one-hot, or a label 1 on an
            entry the mask marks unannotated.
    """
    masked = label_mask is not None
    probs, labels, mask = _check(probs, labels, task, class_names, label_mask)
    if masked and mask.all():
        masked = False  # a complete mask: exactly the unmasked computation (per_class keeps its keys)
    n_classes = probs.shape[1]
    per_class: Dict[str, Dict] = {}
    aucs, aps = [], []
    for c, name in enumerate(class_names):
        rows = mask[:, c]
        y, p = labels[rows, c], probs[rows, c]
        n_pos = int(y.sum())
        auc = float(roc_auc_score(y, p)) if 0 < n_pos < len(y) else float("nan")
        ap = float(average_precision_score(y, p)) if n_pos > 0 else float("nan")
        aucs.append(auc)
        aps.append(ap)
        per_class[str(name)] = {"auc": auc, "ap": ap, "n_pos": n_pos}
        if label_mask is not None:
            per_class[str(name)]["n"] = int(rows.sum())
    if masked:
        out = _masked_decision_metrics(probs, labels, mask, task, class_names, threshold, per_class)
        return {"auc": _nanmean(aucs), "map": _nanmean(aps), **out, "per_class": per_class}

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


def _masked_decision_metrics(probs, labels, mask, task, class_names, threshold, per_class) -> Dict:
    """Threshold / argmax metrics of partially annotated data (see :func:`classification_metrics`);
    fills ``per_class[name]["f1"]``."""
    nan = float("nan")
    if task == "single-label":
        known = labels.sum(axis=1) == 1  # the positive entry is annotated: the true class is known
        y_true, y_pred = labels[known].argmax(axis=1), probs[known].argmax(axis=1)
        n_classes = labels.shape[1]
        precisions, recalls, f1s = [], [], []
        for c, name in enumerate(class_names):
            tp, fp, fn = _binary_counts((y_true == c).astype(int), (y_pred == c).astype(int))
            precisions.append(_ratio(tp, tp + fp, 0.0))
            recalls.append(_ratio(tp, tp + fn, 0.0))
            f1s.append(_ratio(2 * tp, 2 * tp + fp + fn, 0.0))
            per_class[str(name)]["f1"] = _ratio(2 * tp, 2 * tp + fp + fn, nan)
        if known.any():
            accuracy = float(accuracy_score(y_true, y_pred))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bacc = float(balanced_accuracy_score(y_true, y_pred))
        else:
            accuracy = bacc = nan
        # macro over all C classes with zero_division=0, as without a mask
        return {"bacc": bacc, "accuracy": accuracy, "f1": float(np.mean(f1s)) if n_classes else nan,
                "precision": float(np.mean(precisions)), "recall": float(np.mean(recalls))}
    y_pred_all = (probs >= threshold).astype(np.int64)
    baccs, precisions, recalls, f1s = [], [], [], []
    for c, name in enumerate(class_names):
        rows = mask[:, c]
        y, yp = labels[rows, c], y_pred_all[rows, c]
        tp, fp, fn = _binary_counts(y, yp)
        per_class[str(name)]["f1"] = _ratio(2 * tp, 2 * tp + fp + fn, nan)
        baccs.append(_binary_balanced_accuracy(y, yp))
        if rows.any():  # a class annotated nowhere has nothing to score: left out of the macro
            precisions.append(_ratio(tp, tp + fp, 0.0))
            recalls.append(_ratio(tp, tp + fn, 0.0))
            f1s.append(_ratio(2 * tp, 2 * tp + fp + fn, 0.0))
    accuracy = float(np.mean(labels[mask] == y_pred_all[mask])) if mask.any() else nan
    return {"bacc": _nanmean(baccs), "accuracy": accuracy, "f1": _nanmean(f1s), "precision": _nanmean(precisions),
            "recall": _nanmean(recalls)}
