"""Aggregation shared by the server rules: size-weighted (or robust) averaging of the weights,
per-class counts capped at a site's size, and row-by-row averaging of the classifier
(FedLSM's adaptive weighted proxy aggregation, also used by FedMLP's ``classifier_rows`` option).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from fedpartial.algorithms.base import ServerContext, SiteUpdate
from fedpartial.algorithms.robust import robust_weights, trim_count


def _with_samples(updates: List[SiteUpdate], action: str) -> List[SiteUpdate]:
    """The updates with a positive ``num_samples``; an error naming the sites when there is none."""
    used = [u for u in updates if u.num_samples > 0]
    if not used:
        raise ValueError(f"no site update with a positive sample count to {action} "
                         f"(sites: {', '.join(u.site for u in updates) or 'none'})")
    return used


def fedavg_weights(updates: List[SiteUpdate]) -> Dict[str, np.ndarray]:
    """Average ``updates``' weights, each weighted by its ``num_samples``; sites with 0 samples
    are skipped. Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) keep their dtype.

    Args:
        updates: the round's accepted site updates.

    Raises:
        ValueError: when no update has a positive ``num_samples``.
    """
    used = _with_samples(updates, "average")
    total = float(sum(u.num_samples for u in used))
    out = {}
    for key, first in used[0].weights.items():
        acc = np.zeros(np.shape(first), dtype=np.float64)
        for u in used:
            acc += np.asarray(u.weights[key], dtype=np.float64) * (u.num_samples / total)
        dtype = np.asarray(first).dtype
        out[key] = np.rint(acc).astype(dtype) if np.issubdtype(dtype, np.integer) else acc.astype(dtype)
    return out


def average_weights(updates: List[SiteUpdate], ctx: ServerContext) -> Dict[str, np.ndarray]:
    """The parameters a method averages by weights, combined with ``ctx.weight_rule``: ``mean``
    is :func:`fedavg_weights` (weighted by ``num_samples``); ``median`` / ``trimmed_mean``
    (:func:`fedpartial.algorithms.robust.robust_weights`) take every update with a positive
    ``num_samples`` once, whatever its weight, and say so in ``ctx.report["weight_rule"]``.

    Args:
        updates: the round's accepted site updates, ``num_samples`` holding the method's weights.
        ctx: the server context (rule, trim fraction, report).

    Raises:
        ValueError: when no update has a positive ``num_samples``, or the rule is unknown.
    """
    if ctx.weight_rule == "mean":
        return fedavg_weights(updates)
    used = _with_samples(updates, "combine")
    report = {"rule": ctx.weight_rule, "sites": [u.site for u in used]}
    if ctx.weight_rule == "trimmed_mean":
        report.update(trim_fraction=ctx.trim_fraction, trimmed_per_end=trim_count(len(used), ctx.trim_fraction))
    ctx.report["weight_rule"] = report
    return robust_weights([u.weights for u in used], ctx.weight_rule, ctx.trim_fraction)


def capped_counts(update: SiteUpdate, key: str, ctx: ServerContext) -> np.ndarray:
    """``update.stats[key]`` (per-class sample counts) capped at the site's sample count, with a
    log line naming the site when a cap applies (a site cannot outweigh the others by reporting
    more samples than it trained on). The sample count itself is capped by the aggregator at the
    site's first reported train size (:class:`fedpartial.algorithms.robust.UpdateScreen`).

    Args:
        update: the site's update.
        key: the count statistic.
        ctx: the server context (round, log).
    """
    counts = np.asarray(update.stats[key], dtype=np.float64)
    over = counts > update.num_samples
    if over.any():
        ctx.log(f"round {ctx.round}: site '{update.site}' reported {key} above its {update.num_samples} samples "
                f"for class index(es) {np.flatnonzero(over).tolist()}; capped")
    return np.minimum(counts, float(update.num_samples))


def awpa_rows(rows_per_site: Sequence[np.ndarray], counts_per_site, fallback_weights) -> np.ndarray:
    """Adaptive weighted proxy aggregation of classifier rows (paper Eq. 7).

    Args:
        rows_per_site: K arrays of shape ``(C, ...)`` (a weight matrix or a bias vector).
        counts_per_site: ``(K, C)`` q_c^k >= 0.
        fallback_weights: ``(K,)`` weights (e.g. data sizes) used for a class whose count is 0
            at every site; normalised here.

    Returns:
        ``(C, ...)``: row c = sum_k q_c^k / sum_j q_c^j * row_c^k.
    """
    rows = np.stack([np.asarray(r, dtype=np.float64) for r in rows_per_site])  # (K, C, ...)
    counts = np.asarray(counts_per_site, dtype=np.float64)
    fallback = np.asarray(fallback_weights, dtype=np.float64)
    k, c = rows.shape[:2]
    if counts.shape != (k, c):
        raise ValueError(f"class counts have shape {counts.shape}, expected {(k, c)} (sites x classes)")
    if fallback.shape != (k,) or fallback.sum() <= 0:
        raise ValueError(f"fallback weights must be {k} values with a positive sum, got {fallback}")
    totals = counts.sum(axis=0)  # (C,)
    weights = np.where(totals > 0, counts / np.where(totals > 0, totals, 1.0), (fallback / fallback.sum())[:, None])
    return np.einsum("kc,kc...->c...", weights, rows)


def average_classifier_rows(used: Sequence[SiteUpdate], row_weights: np.ndarray, classifier_names: Sequence[str]
                            ) -> Dict[str, np.ndarray]:
    """Every classifier parameter of ``used`` averaged row by row with :func:`awpa_rows` (a class
    whose weights are all 0 falls back to the sites' sizes), in the first site's dtype.

    Args:
        used: site updates with a positive ``num_samples``.
        row_weights: ``(K, C)`` weight of each site's row of each class.
        classifier_names: the classifier parameters (first dimension = classes).
    """
    sizes = np.array([u.num_samples for u in used], dtype=np.float64)
    num_classes = np.shape(row_weights)[1]
    out = {}
    for name in classifier_names:
        first = np.asarray(used[0].weights[name])
        if first.shape[0] != num_classes:
            raise ValueError(f"classifier parameter '{name}' has {first.shape[0]} rows, expected {num_classes} classes")
        out[name] = awpa_rows([u.weights[name] for u in used], row_weights, sizes).astype(first.dtype)
    return out
