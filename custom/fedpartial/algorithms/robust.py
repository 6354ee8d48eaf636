"""Aggregation that does not trust blindly: the server-side checks every method's rule relies on.

* :class:`UpdateScreen` caps a site's reported sample count at the train size the site reported
  with its first update of the job (so one site cannot outweigh the others by claiming more data
  later), and rejects an update whose distance to the current global model is more than
  ``max_norm_ratio`` times the round's median distance.
* :func:`robust_weights` is the coordinate-wise median or trimmed mean of the sites' weights, which
  the methods use instead of the size-weighted mean when the job selects it
  (``fedpartial.algorithms.aggregation.average_weights``).

Plain numpy: the FLARE aggregator (``fedpartial.flare.aggregators.RuleAggregator``) only passes
updates in and the decisions out.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.algorithms.base import SiteUpdate

WEIGHT_RULES = ("mean", "median", "trimmed_mean")


def coordinate_median(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Element-wise median of equally shaped arrays (float64; for an even count, the mean of the
    two middle values).

    Args:
        arrays: one array per site.
    """
    if not len(arrays):
        raise ValueError("coordinate_median needs at least one array")
    return np.median(np.stack([np.asarray(a, dtype=np.float64) for a in arrays]), axis=0)


def trim_count(n: int, trim_fraction: float) -> int:
    """Values dropped at EACH end of every coordinate by :func:`trimmed_mean`: floor(fraction * n)."""
    if not 0.0 <= float(trim_fraction) < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    return int(math.floor(float(trim_fraction) * n + 1e-9))


def trimmed_mean(arrays: Sequence[np.ndarray], trim_fraction: float) -> np.ndarray:
    """Element-wise mean after dropping the :func:`trim_count` smallest and largest values of
    every coordinate (float64; with no value to drop, the plain mean).

    Args:
        arrays: one array per site.
        trim_fraction: share of the sites dropped at each end, in [0, 0.5).
    """
    if not len(arrays):
        raise ValueError("trimmed_mean needs at least one array")
    k = trim_count(len(arrays), trim_fraction)
    stacked = np.sort(np.stack([np.asarray(a, dtype=np.float64) for a in arrays]), axis=0)
    return stacked[k:len(arrays) - k].mean(axis=0)


def robust_weights(weights: Sequence[Dict[str, np.ndarray]], rule: str, trim_fraction: float = 0.2
                   ) -> Dict[str, np.ndarray]:
    """Every parameter combined over the sites with ``rule`` (``median`` or ``trimmed_mean``),
    unweighted: a site's reported size or weight cannot move the result. Integer buffers (e.g.
    BatchNorm's ``num_batches_tracked``) are rounded back to their dtype.

    Args:
        weights: one ``{name: array}`` per site, same names and shapes.
        rule: ``median`` | ``trimmed_mean``.
        trim_fraction: for ``trimmed_mean``, see :func:`trimmed_mean`.
    """
    if rule not in ("median", "trimmed_mean"):
        raise ValueError(f"robust rule '{rule}' unknown; choose 'median' or 'trimmed_mean'")
    if not weights:
        raise ValueError("no site weights to combine")
    out = {}
    for key, first in weights[0].items():
        values = [w[key] for w in weights]
        acc = coordinate_median(values) if rule == "median" else trimmed_mean(values, trim_fraction)
        dtype = np.asarray(first).dtype
        out[key] = np.rint(acc).astype(dtype) if np.issubdtype(dtype, np.integer) else acc.astype(dtype)
    return out


def update_norm(weights: Dict[str, np.ndarray], reference: Dict[str, np.ndarray]) -> float:
    """L2 norm of ``weights - reference`` over the floating-point parameters both hold (integer
    buffers such as step counters are left out: they move by the number of steps, not by learning).

    Args:
        weights: a site's weights.
        reference: the global weights the site started the round from.
    """
    total = 0.0
    for key, value in weights.items():
        arr = np.asarray(value)
        if arr.dtype.kind != "f" or key not in reference:
            continue
        diff = arr.astype(np.float64) - np.asarray(reference[key], dtype=np.float64)
        total += float(np.dot(diff.ravel(), diff.ravel()))
    return math.sqrt(total)


def norm_outliers(norms: Dict[str, float], max_ratio: Optional[float]) -> Tuple[float, Dict[str, float]]:
    """The round's median update norm and the sites whose norm exceeds ``max_ratio`` times it.

    With two sites no norm can exceed twice their median, so for ``max_ratio >= 2`` the check
    only acts from three sites on. A median of 0 (most sites did not move the model) gives no
    scale: nothing is rejected.

    Args:
        norms: ``{site: norm}`` of the updates that take part in the average.
        max_ratio: the allowed multiple of the median (None: no check).

    Returns:
        ``(median, {site: norm})`` of the rejected sites.
    """
    if not norms:
        return 0.0, {}
    median = float(np.median(list(norms.values())))
    if max_ratio is None or median <= 0.0:
        return median, {}
    return median, {s: n for s, n in sorted(norms.items()) if n > float(max_ratio) * median}


class UpdateScreen:
    """Caps reported sample counts and rejects outlying updates; keeps the train size each site
    reported first, for the whole job.

    Args:
        cap_samples: cap each update's sample count at the site's pinned train size.
        max_norm_ratio: reject an update whose norm (distance to the global model) exceeds this
            multiple of the round's median norm (None: no check). Must be > 1.
    """

    def __init__(self, cap_samples: bool = True, max_norm_ratio: Optional[float] = 10.0):
        if max_norm_ratio is not None and not float(max_norm_ratio) > 1.0:
            raise ValueError(f"max_norm_ratio must be > 1 or null (no check), got {max_norm_ratio}")
        self.cap_samples = bool(cap_samples)
        self.max_norm_ratio = None if max_norm_ratio is None else float(max_norm_ratio)
        self.train_sizes: Dict[str, int] = {}

    def pin(self, site: str, train_size: Optional[int], num_samples: int) -> Optional[str]:
        """Remember the site's train size from its first update: the size it reports, or, from a
        site that reports none, its first positive sample count. Returns a note when a later
        report differs from the pinned size (the pinned one stays)."""
        reported = train_size if train_size is not None else (num_samples if num_samples > 0 else None)
        if site not in self.train_sizes:
            if reported is not None:
                self.train_sizes[site] = int(reported)
            return None
        if train_size is not None and int(train_size) != self.train_sizes[site]:
            return (f"reported train size {int(train_size)}, but {self.train_sizes[site]} with its first update; "
                    f"the first is kept")
        return None

    def cap(self, update: SiteUpdate) -> Optional[str]:
        """Lower ``update.num_samples`` to the site's pinned train size, in place. Returns why,
        or None when the count was within it."""
        pinned = self.train_sizes.get(update.site)
        if not self.cap_samples or pinned is None or update.num_samples <= pinned:
            return None
        why = f"reported {update.num_samples} samples, above its train size {pinned}; capped to {pinned}"
        update.num_samples = pinned
        return why

    def screen(self, updates: List[SiteUpdate], global_weights: Dict[str, np.ndarray]
               ) -> Tuple[List[SiteUpdate], Dict[str, str], dict]:
        """Split the round's updates into kept and rejected by their norm.

        Only updates with a positive sample count are measured (a site that takes no part in the
        average sends the model back nearly unchanged and would pull the median to 0); they are
        always kept.

        Args:
            updates: the round's accepted updates (sample counts already capped).
            global_weights: the global weights sent out this round.

        Returns:
            ``(kept, {site: why}, report)``; ``report`` holds ``update_norms``, ``median_norm``
            and ``max_norm_ratio`` for metrics.json.
        """
        norms = {u.site: update_norm(u.weights, global_weights) for u in updates if u.num_samples > 0}
        median, outliers = norm_outliers(norms, self.max_norm_ratio)
        rejected = {site: (f"update norm {norm:.6g} is more than {self.max_norm_ratio:g} x the round's median "
                           f"norm {median:.6g}") for site, norm in outliers.items()}
        kept = [u for u in updates if u.site not in rejected]
        report = {"update_norms": norms, "median_norm": median, "max_norm_ratio": self.max_norm_ratio}
        return kept, rejected, report
