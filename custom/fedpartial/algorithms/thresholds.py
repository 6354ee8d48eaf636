"""Per-class decision thresholds chosen on the sites' validation data, from histograms only.

A classifier's probabilities are turned into decisions with a threshold per class (``p >= t``, as
:func:`fedpartial.metrics.classification_metrics` decides). 0.5 suits a calibrated model of a
balanced class; a rare finding or a model trained on partial labels rarely is one. The sites
therefore score the global model they receive on their val split and send, per class, two
histograms of its predicted probability (annotated positives, annotated negatives; fixed equal
bins on [0, 1]); the server adds them up over the sites and picks each class's threshold.

* Site: :func:`probability_histograms` (what leaves, under the site policy's minimum-count guard,
  ``fedpartial.flare.result_policy.guard_histograms``).
* Server: :func:`pool_histograms`, then :func:`choose_thresholds` (rule: :func:`best_f1_threshold`).
* Model files: :func:`threshold_meta` -> ``meta["decision_thresholds"]`` =
  ``{"thresholds": {class: t}, "rule": RULE, "source": "<which validation, sites, images per class>"}``.

Plain numpy; nothing here knows FLARE.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

#: equal bins on [0, 1]: bin j holds j/B <= p < (j+1)/B (the last one also p = 1)
NUM_BINS = 20
#: the train result's meta key that carries the histograms: {"pos": (C, B), "neg": (C, B)} counts
HISTOGRAM_KEY = "val_histograms"
HISTOGRAM_PARTS = ("pos", "neg")
DEFAULT_THRESHOLD = 0.5
RULE = "max F1 over the inner bin edges k/B of the sites' pooled val histograms (ties: nearest 0.5)"


def bin_edges(bins: int = NUM_BINS) -> np.ndarray:
    """``bins + 1`` equal edges 0, 1/B, ..., 1 (float64)."""
    return np.arange(bins + 1, dtype=np.float64) / bins


def probability_histograms(probs, labels, label_mask=None, bins: int = NUM_BINS) -> Dict[str, np.ndarray]:
    """Per class, the histogram of the predicted probability over the annotated positives and over
    the annotated negatives: the only thing a site sends for thresholds.

    An entry whose class the site does not annotate (``label_mask`` 0) is in neither histogram,
    so a class the site does not annotate has two zero rows.

    Args:
        probs: ``(N, C)`` probabilities in [0, 1] (sigmoid for multi-label, softmax for single-label).
        labels: ``(N, C)`` 0/1 labels (> 0.5 = positive).
        label_mask: ``(N, C)``, nonzero where the entry is annotated; None = every entry.
        bins: number of equal bins on [0, 1].

    Returns:
        ``{"pos": (C, bins) int64, "neg": (C, bins) int64}``.
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    if probs.ndim != 2 or labels.shape != probs.shape:
        raise ValueError(f"probs {probs.shape} and labels {labels.shape} must both be (N, C)")
    mask = np.ones(probs.shape, bool) if label_mask is None else np.asarray(label_mask) > 0
    if mask.shape != probs.shape:
        raise ValueError(f"label_mask {mask.shape} must have the shape of probs {probs.shape}")
    # searchsorted on the float64 edges: bin j <=> edges[j] <= p < edges[j + 1], the same comparison
    # as the decision p >= t at an edge t
    index = np.clip(np.searchsorted(bin_edges(bins), np.clip(probs, 0.0, 1.0), side="right") - 1, 0, bins - 1)
    positive = labels > 0.5
    out = {}
    for part, rows in (("pos", mask & positive), ("neg", mask & ~positive)):
        hist = np.zeros((probs.shape[1], bins), np.int64)
        for c in range(probs.shape[1]):
            hist[c] = np.bincount(index[rows[:, c], c], minlength=bins)
        out[part] = hist
    return out


def check_histograms(value, num_classes: Optional[int] = None) -> Dict[str, np.ndarray]:
    """The histograms of one site as int64 arrays, or ValueError naming what is wrong.

    Args:
        value: what arrived under :data:`HISTOGRAM_KEY`.
        num_classes: C of the job's model (None = any).
    """
    if not isinstance(value, Mapping) or set(value) != set(HISTOGRAM_PARTS):
        keys = sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(f"'{HISTOGRAM_KEY}' must be a dict with exactly {list(HISTOGRAM_PARTS)}, got {keys}")
    out = {}
    for part in HISTOGRAM_PARTS:
        arr = np.asarray(value[part])
        if arr.ndim != 2 or (num_classes is not None and arr.shape[0] != num_classes) or arr.shape[1] < 2:
            raise ValueError(f"'{HISTOGRAM_KEY}.{part}' has shape {arr.shape}, expected "
                             f"({num_classes or 'C'}, bins >= 2)")
        if arr.dtype.kind not in "iuf" or not np.all(np.isfinite(arr)) or np.any(arr < 0) \
                or np.any(arr != np.round(arr)):
            raise ValueError(f"'{HISTOGRAM_KEY}.{part}' must hold non-negative whole counts")
        out[part] = arr.astype(np.int64)
    if out["pos"].shape != out["neg"].shape:
        raise ValueError(f"'{HISTOGRAM_KEY}' pos {out['pos'].shape} and neg {out['neg'].shape} differ in shape")
    return out


def pool_histograms(per_site: Mapping[str, Mapping[str, np.ndarray]]) -> Optional[Dict[str, np.ndarray]]:
    """The sites' histograms added up, and per class how many sites sent a non-empty row.

    Args:
        per_site: ``{site: {"pos": (C, B), "neg": (C, B)}}`` (checked, same shapes).

    Returns:
        ``{"pos", "neg": (C, B) int64, "sites": (C,) int64}``, or None without any site.
    """
    if not per_site:
        return None
    shapes = {np.shape(h["pos"]) for h in per_site.values()} | {np.shape(h["neg"]) for h in per_site.values()}
    if len(shapes) != 1:
        raise ValueError(f"site histograms differ in shape: {sorted(shapes)}")
    pos = sum(np.asarray(h["pos"], np.int64) for h in per_site.values())
    neg = sum(np.asarray(h["neg"], np.int64) for h in per_site.values())
    sites = sum(((np.asarray(h["pos"]).sum(1) + np.asarray(h["neg"]).sum(1)) > 0).astype(np.int64)
                for h in per_site.values())
    return {"pos": pos, "neg": neg, "sites": sites}


def best_f1_threshold(pos, neg) -> Tuple[Optional[float], float]:
    """The inner bin edge t = k/B (k = 1 .. B-1) with the highest F1 of the decision ``p >= t`` on
    one class's histograms.

    At edge k: TP = positives in bins >= k, FP = negatives in bins >= k, FN = positives in bins < k;
    F1 = 2 TP / (2 TP + FP + FN). Ties go to the edge nearest 0.5, then to the lower edge.

    Why F1 rather than Youden's J (sensitivity + specificity - 1): J weighs a missed positive and a
    false alarm alike whatever the prevalence, so for a rare finding (most of ChestX-ray14's) it
    picks a low threshold that flags many negatives for each positive found. F1 counts the false
    alarms against the positives found, so it keeps the flagged cases mostly right; it is also the
    ``f1`` that ``evaluate`` reports at a threshold. Its cost: F1's optimum depends on the
    prevalence in the pooled val splits, so the thresholds fit the consortium's case mix.
    Only inner edges are candidates: t = 0 (flag every image) is no decision.

    Args:
        pos: ``(B,)`` counts of the annotated positives per bin.
        neg: ``(B,)`` counts of the annotated negatives per bin.

    Returns:
        ``(threshold, f1)``; ``(None, 0.0)`` when no edge gives a true positive (no positive, or
        every positive in the first bin).
    """
    pos, neg = np.asarray(pos, np.float64), np.asarray(neg, np.float64)
    bins = pos.shape[0]
    # counts at or above each edge k = 1 .. B-1
    tp = np.cumsum(pos[::-1])[::-1][1:]
    fp = np.cumsum(neg[::-1])[::-1][1:]
    fn = pos.sum() - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(tp > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
    if f1.size == 0 or f1.max() <= 0:
        return None, 0.0
    edges = bin_edges(bins)[1:-1]
    best = np.flatnonzero(f1 == f1.max())
    k = min(best, key=lambda i: (abs(edges[i] - DEFAULT_THRESHOLD), edges[i]))
    return float(edges[k]), float(f1[k])


def choose_thresholds(pooled: Optional[Mapping[str, np.ndarray]], class_names: Sequence[str],
                      min_sites: int = 0) -> Dict:
    """Each class's threshold from the pooled histograms (:func:`best_f1_threshold`).

    A class without both positives and negatives in the pooled histograms (no site released its
    rows), or whose best F1 is 0, keeps :data:`DEFAULT_THRESHOLD` and is marked ``default``.
    A class pooled from fewer than ``min_sites`` sites publishes no F1 and no counts: with one
    site's n_pos, the F1 at a known threshold solves to that site's true and false positives, so
    repeated rounds count its images on either side of the threshold.

    Args:
        pooled: :func:`pool_histograms`' result (None = no site sent histograms).
        class_names: the job's C class names.
        min_sites: the server's ``min_sites_for_shared_stats`` (0 = publish every class's).

    Returns:
        ``{"thresholds": {class: t}, "per_class": {class: {"threshold", "f1", "n_pos", "n_neg",
        "sites", "default"}}}`` (``f1`` None for a default; ``f1``, ``n_pos``, ``n_neg`` None
        for a class from fewer than ``min_sites`` sites).
    """
    out = {"thresholds": {}, "per_class": {}}
    for c, name in enumerate(class_names):
        n_pos = n_neg = sites = 0
        t, f1 = None, 0.0
        if pooled is not None:
            n_pos, n_neg = int(pooled["pos"][c].sum()), int(pooled["neg"][c].sum())
            sites = int(pooled["sites"][c])
            if n_pos and n_neg:
                t, f1 = best_f1_threshold(pooled["pos"][c], pooled["neg"][c])
        default = t is None
        t = DEFAULT_THRESHOLD if default else t
        out["thresholds"][str(name)] = t
        record = {"threshold": t, "f1": None if default else f1, "n_pos": n_pos, "n_neg": n_neg, "sites": sites,
                  "default": default}
        if 0 < sites < min_sites:
            record.update(f1=None, n_pos=None, n_neg=None)
        out["per_class"][str(name)] = record
    return out


def _class_source(name: str, v: Mapping) -> str:
    if v["n_pos"] is None:
        return f"{name}: {'default ' if v['default'] else ''}{v['threshold']} from {v['sites']} site(s)"
    if not v["default"]:
        return f"{name}: {v['n_pos']} pos / {v['n_neg']} neg from {v['sites']} site(s), F1 {v['f1']:.3f}"
    if v["n_pos"] and v["n_neg"]:
        return (f"{name}: default {DEFAULT_THRESHOLD} (no threshold gives a true positive; {v['n_pos']} pos / "
                f"{v['n_neg']} neg)")
    return f"{name}: default {DEFAULT_THRESHOLD} (no site released both positives and negatives)"


def _model_name(model_round: int) -> str:
    return "the initial global model" if model_round < 0 else f"the global model of round {model_round}"


def threshold_meta(record: Mapping, file_round: Optional[int]) -> Dict:
    """``meta["decision_thresholds"]`` of a model file: ``{"thresholds", "rule", "source"}``.

    Args:
        record: what the server computed at one round: :func:`choose_thresholds`' result plus
            ``model_round`` (the round whose global model the sites validated; -1 = the initial
            model), ``validated_at`` (the round in which they validated it) and ``sites`` (how
            many sites sent histograms).
        file_round: the ``round`` of the file's own model (0-based, as in the file's meta).

    Returns:
        the meta value; ``source`` says which validation the thresholds come from, whether that is
        this file's model, how many sites, and per class the pooled positives / negatives (or
        ``default``).
    """
    model_round = int(record["model_round"])
    counts = "; ".join(_class_source(name, v) for name, v in record["per_class"].items())
    if any(v["n_pos"] is None for v in record["per_class"].values()):
        counts += ("; where a class names its sites only, its counts and F1 are not published (fewer sites than "
                   "the server's min_sites_for_shared_stats)")
    validated = f"{_model_name(model_round)}, validated on the sites' val splits at round {int(record['validated_at'])}"
    if file_round is not None and int(file_round) == model_round:
        whose = f"this file's model: {validated}"
    else:
        this = _model_name(int(file_round)) if file_round is not None else "a model of unknown round"
        whose = (f"latest available, NOT this file's model ({this}): {validated}; a global model is validated "
                 f"when it reaches the sites at the next round, the last one only in cross-site evaluation, "
                 f"which sends no histograms")
    source = f"{whose}; {int(record['sites'])} site(s) sent histograms; {counts}"
    return {"thresholds": {str(k): float(v) for k, v in record["thresholds"].items()}, "rule": RULE,
            "source": source}
