"""Site-side FLARE filters for what leaves a site.

* :class:`SiteResultPolicy` (the site policy's result filter, provisioning/privacy.json): every key
  of every task result is checked against allow-lists and minimum counts, and whatever is not
  known is withheld (:func:`filter_result`, :func:`release_metrics`, :func:`guard_site_stats`).
* :class:`StatisticsPrivacyFilter` (a ``DXOFilter`` on WEIGHTS) edits the method statistics in
  ``meta["site_stats"]`` of a train result: a minimum-count rule withholds class-wise statistics
  computed from fewer than ``min_count`` samples, and optional Gaussian noise is added per key
  (counts, prototypes, relation matrices). The weights and every other meta key pass untouched,
  so NVFlare's own weight filters (``PercentilePrivacy``, ``ExcludeVars``) can sit in the same chain.
* :class:`SendWeightDiff` (client) + :class:`RestoreFullWeights` (server) let NVFlare's
  diff-based ``PercentilePrivacy`` and the key-removing ``ExcludeVars`` work with our executor
  (which sends full WEIGHTS) and aggregator (which needs every parameter).
* :class:`MessageRecorder` pickles every outgoing DXO (data + meta) to a folder: the privacy tests
  put it LAST in the client's result filter chains to see exactly what goes on the wire.

Put them in ``task_result_filters`` of ``config_fed_client.json`` (see docs/FAILURE_BEHAVIOUR.md)::

    {"tasks": ["train"], "filters": [{"path": "fedpartial.flare.filters.StatisticsPrivacyFilter",
                                      "args": {"preset": "fedmlp", "min_count": 5,
                                               "noise_sigma": {"prototypes_pos": 0.05}}}]}
"""
from __future__ import annotations

import itertools
import numbers
import os
import pickle
import re
import threading
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable, make_reply
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms import fedavg, fedia, fedirm, fedlsm, fedmlp, segmentation
from fedpartial.algorithms.thresholds import HISTOGRAM_KEY, check_histograms
from fedpartial.flare.common import SITE_IMAGES_SEEN, SITE_METRICS, SITE_STATS, SITE_TRAIN_SIZE

#: Every statistic a method's client rule sends: each method module's ``SENT_STATISTICS`` (keys,
#: the count keys that guard them, fills, clips), gathered here by preset name. The site policy's
#: ``auto`` preset recognises the method from the keys present, so one site policy covers every
#: job; statistics of no known method are withheld.
PRESETS: Dict[str, dict] = {"none": {}, **fedlsm.SENT_STATISTICS, **fedmlp.SENT_STATISTICS,
                            **fedirm.SENT_STATISTICS, **fedia.SENT_STATISTICS}
AUTO = "auto"
PRESET_NAMES = sorted(PRESETS) + [AUTO]


def auto_preset(stats: dict) -> Tuple[List[str], dict]:
    """The method presets whose statistics ``stats`` holds, merged: ``(names, preset)``.

    A preset matches when a key of its ``signature`` is present; an ``exclusive`` one (FedMLP's
    warm-up message, ``annotated_classes`` alone) only when every key present is one of its
    ``keys``. The merged ``keys`` are those of the matched presets only, so a message that matches
    no method has no key that may leave (fail closed)."""
    names = []
    for name, preset in PRESETS.items():
        if not any(k in stats for k in preset.get("signature", [])):
            continue
        if preset.get("exclusive") and not set(stats) <= set(preset.get("keys", [])):
            continue
        flag, variant = preset.get("variant", (None, None))
        if flag is not None and float(np.asarray(stats.get(flag, 0))) > 0:
            name = variant
        names.append(name)
    merged = {"keys": sorted({k for n in names for k in PRESETS[n].get("keys", [])}), "guards": {}, "fill": {},
              "clip": {}, "normalise_rows": []}
    for name in names:
        for part in ("guards", "fill", "clip"):
            merged[part].update(PRESETS[name].get(part, {}))
        merged["normalise_rows"] += PRESETS[name].get("normalise_rows", [])
    return names, merged


def _fill_value(spec, row_length: int) -> float:
    if spec == "uniform":
        return 1.0 / max(row_length, 1)
    return float(spec)


def filter_statistics(stats: dict, min_count: int = 0, guards: Optional[Dict[str, str]] = None,
                      fill: Optional[Dict[str, Union[float, str]]] = None,
                      noise_sigma: Optional[Dict[str, float]] = None, clip: Optional[Dict[str, list]] = None,
                      normalise_rows: Optional[List[str]] = None, rng: Optional[np.random.Generator] = None,
                      where: str = "", allowed_keys: Optional[List[str]] = None) -> tuple:
    """Apply the minimum-count rule and the noise to one site's statistics (a new dict).

    1. Withhold: for each ``guards`` entry ``stat -> count``, every class ``c`` with
       ``stats[count][c] < min_count`` (or 0) has row ``c`` of ``stats[stat]`` replaced by its
       ``fill`` (0 unless given; ``"uniform"`` = 1/row length). Counts guard themselves, so a
       withheld class is sent as count 0, which the server rules already read as "absent". A
       scalar count (FedIA's ``num_images``) withholds its whole statistic. Fail closed: a guarded
       statistic whose count key is absent is withheld whole (when ``min_count`` >= 1).
       With ``allowed_keys``, any other key is withheld (removed).
    2. Noise: ``noise_sigma[key]`` Gaussian noise on the released entries of ``key`` (all entries
       when the key has no guard); withheld rows stay exact placeholders.
    3. Project: ``clip[key] = [lo, hi]`` then, for ``normalise_rows`` keys, released rows are
       rescaled to sum 1 (softmax rows), so the result still passes the server's ``check_stats``.

    Args:
        stats: ``{key: number | array}`` as a client rule returned it.
        min_count: k; 0 switches the rule off.
        guards: statistic -> guarding count key.
        fill: statistic -> value of a withheld row (number or ``"uniform"``).
        noise_sigma: key -> standard deviation of the added noise.
        clip: key -> ``[lo, hi]`` after the noise.
        normalise_rows: keys whose released rows must sum to 1.
        rng: noise source (seed it only for tests).
        where: site name for error messages.
        allowed_keys: the only keys that may leave (None = every key).

    Returns:
        ``(filtered stats, report)``; report = ``{"withheld": {stat: n_rows}, "noised": [keys],
        "no_count": [stats withheld whole for lack of their count], "removed": [keys not allowed]}``
        (counts of rows only, never values).
    """
    guards, fill, clip = dict(guards or {}), dict(fill or {}), dict(clip or {})
    noise_sigma, normalise_rows = dict(noise_sigma or {}), list(normalise_rows or [])
    rng = rng if rng is not None else np.random.default_rng()
    out = dict(stats)
    report = {"withheld": {}, "noised": [], "no_count": [], "removed": []}
    if allowed_keys is not None:
        report["removed"] = sorted(k for k in stats if k not in set(allowed_keys))
        for key in report["removed"]:
            del out[key]
        stats = dict(out)
    released: Dict[str, np.ndarray] = {}  # stat -> (C,) or 0-d bool: rows that may carry real values
    hidden: Dict[str, int] = {}
    for stat, count_key in guards.items():
        if stat not in stats:
            continue  # e.g. FedMLP warm-up rounds and FedIRM unlabelled sites send no statistics
        value = np.asarray(stats[stat])
        if count_key not in stats:
            if int(min_count) >= 1:  # fail closed: nothing says how many images this came from
                released[stat] = np.zeros(value.shape[:1], dtype=bool)
                hidden[stat] = int(value.shape[0]) if value.ndim else 1
                report["no_count"].append(stat)
            continue
        counts = np.asarray(stats[count_key], dtype=np.float64)
        if counts.ndim == 0:  # one count for the whole statistic
            ok = bool(np.isfinite(counts) and counts >= max(int(min_count), 1))
            released[stat] = np.full(value.shape[:1], ok, dtype=bool)
            hidden[stat] = int(not ok and counts > 0) * (int(value.shape[0]) if value.ndim else 1)
            continue
        if counts.ndim != 1 or value.ndim < 1 or value.shape[0] != counts.shape[0]:
            raise ValueError(f"site '{where}': statistic '{stat}' of shape {value.shape} cannot be guarded by "
                             f"count '{count_key}' of shape {counts.shape} (one count per row needed)")
        released[stat] = (counts >= max(int(min_count), 1)) & np.isfinite(counts)
        hidden[stat] = int(((counts > 0) & ~released[stat]).sum())  # rows that really held something
    for key in sorted(set(stats) & (set(released) | set(noise_sigma) | set(clip) | set(normalise_rows))):
        original = stats[key]
        value = np.array(original, dtype=np.float64, copy=True)
        rows = released.get(key)
        if rows is not None:
            withheld = ~rows
            if withheld.any():
                value[withheld] = _fill_value(fill.get(key, 0.0), value.shape[1] if value.ndim > 1 else 1)
            if hidden[key]:
                report["withheld"][key] = hidden[key]
        sigma = float(noise_sigma.get(key, 0.0))
        if sigma < 0:
            raise ValueError(f"noise_sigma['{key}'] must be >= 0, got {sigma}")
        if sigma > 0:
            noise = rng.normal(0.0, sigma, size=value.shape)
            if rows is not None:
                noise[~rows] = 0.0
            value = np.asarray(value + noise)
            report["noised"].append(key)
        if key in clip:
            lo, hi = (float(b) for b in clip[key])
            keep = value.copy()
            value = np.array(np.clip(value, lo, hi))
            if rows is not None:  # placeholders are exact by construction: never clip them away
                value[~rows] = keep[~rows]
        if key in normalise_rows and value.ndim == 2:
            sums = value.sum(axis=1, keepdims=True)
            norm = np.where(sums > 0, value / np.where(sums > 0, sums, 1.0), 1.0 / value.shape[1])
            value = norm if rows is None else np.where(rows[:, None], norm, value)
        out[key] = _like(original, value)
    return out, report


def _like(original, value: np.ndarray):
    """``value`` in the container / dtype of ``original`` (python scalar stays scalar, float32 stays)."""
    if np.ndim(original) == 0 and not isinstance(original, np.ndarray):
        return float(value)
    dtype = np.asarray(original).dtype
    return value.astype(dtype if dtype.kind == "f" else np.float64)


class StatisticsPrivacyFilter(DXOFilter):
    """Minimum-count rule + Gaussian noise on the statistics a site sends (``meta["site_stats"]`` of
    WEIGHTS DXOs). The model weights and the other meta keys pass unchanged.

    Args:
        preset: method defaults for ``guards`` / ``fill`` / ``clip`` / ``normalise_rows``: one of
            ``none, fedlsm, fedmlp, fedmlp_warmup, fedirm, fedirm_multilabel, fedia``, or ``auto`` (the
            method's defaults chosen per message from the keys present; a message that matches no
            method has every statistic withheld). Explicit arguments win.
        min_count: k: a class-wise statistic from fewer than k samples is withheld (0 = off).
        guards: ``{statistic: count key}``; which count guards which statistic.
        fill: ``{statistic: value}`` of a withheld row (number or ``"uniform"``; default 0).
        noise_sigma: ``{key: sigma}`` Gaussian noise per key (default none).
        clip: ``{key: [lo, hi]}`` applied after the noise.
        normalise_rows: keys whose rows must sum to 1 after the noise.
        seed: noise seed; leave None outside tests (predictable noise protects nothing).
        data_kinds: DXO kinds to filter (default WEIGHTS and WEIGHT_DIFF).
        unknown_keys: ``withhold`` (remove any key no method preset lists; the default of ``auto``)
            or ``pass`` (the default of the named presets).
    """

    def __init__(self, preset: str = "none", min_count: int = 0, guards: Optional[dict] = None,
                 fill: Optional[dict] = None, noise_sigma: Optional[dict] = None, clip: Optional[dict] = None,
                 normalise_rows: Optional[list] = None, seed: Optional[int] = None, data_kinds: List[str] = None,
                 unknown_keys: Optional[str] = None):
        kinds = [DataKind.WEIGHTS, DataKind.WEIGHT_DIFF]
        super().__init__(supported_data_kinds=kinds, data_kinds_to_filter=data_kinds or kinds)
        if preset not in PRESET_NAMES:
            raise ValueError(f"StatisticsPrivacyFilter preset '{preset}' unknown; choose one of {PRESET_NAMES}")
        if int(min_count) < 0:
            raise ValueError(f"StatisticsPrivacyFilter min_count must be >= 0, got {min_count}")
        self.unknown_keys = unknown_keys or ("withhold" if preset == AUTO else "pass")
        if self.unknown_keys not in ("withhold", "pass"):
            raise ValueError(f"StatisticsPrivacyFilter unknown_keys must be 'withhold' or 'pass', got '{unknown_keys}'")
        self.preset = preset
        base = {} if preset == AUTO else PRESETS[preset]
        self.min_count = int(min_count)
        self.guards = {**base.get("guards", {}), **(guards or {})}
        self.fill = {**base.get("fill", {}), **(fill or {})}
        self.clip = {**base.get("clip", {}), **(clip or {})}
        self.normalise_rows = list(normalise_rows if normalise_rows is not None else base.get("normalise_rows", []))
        self.noise_sigma = {k: float(v) for k, v in (noise_sigma or {}).items()}
        for key, sigma in self.noise_sigma.items():
            if sigma < 0:
                raise ValueError(f"StatisticsPrivacyFilter noise_sigma['{key}'] must be >= 0, got {sigma}")
        for key, bounds in self.clip.items():
            if len(bounds) != 2 or float(bounds[0]) > float(bounds[1]):
                raise ValueError(f"StatisticsPrivacyFilter clip['{key}'] must be [lo, hi] with lo <= hi, got {bounds}")
        self.rng = np.random.default_rng(seed)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> Optional[DXO]:
        stats = dxo.get_meta_prop(SITE_STATS)
        if not stats:
            return None
        site = fl_ctx.get_identity_name() if fl_ctx is not None else "?"
        guards, fill, clip, rows, allowed, methods = self.guards, self.fill, self.clip, self.normalise_rows, None, ""
        label = f"preset {self.preset}"
        if self.preset == AUTO:  # the method's table from the keys present; explicit arguments still win
            names, auto = auto_preset(stats)
            guards, fill = {**auto["guards"], **self.guards}, {**auto["fill"], **self.fill}
            clip, rows = {**auto["clip"], **self.clip}, list(dict.fromkeys(auto["normalise_rows"] + rows))
            label = '+'.join(names) or 'no method'
            allowed, methods = auto["keys"], f" as {label}"
        if self.unknown_keys == "withhold":
            known = set(allowed) if allowed is not None else set().union(*(p.get("keys", []) for p in PRESETS.values()))
            allowed = sorted(known | set(guards) | set(guards.values()))
        filtered, report = filter_statistics(stats, self.min_count, guards, fill, self.noise_sigma, clip, rows,
                                             self.rng, where=site, allowed_keys=allowed)
        dxo.set_meta_prop(SITE_STATS, filtered)
        self.log_info(fl_ctx, f"site statistics filtered{methods} (min_count={self.min_count}): withheld rows "
                              f"{report['withheld'] or 'none'}; noise on {report['noised'] or 'nothing'}")
        if report["no_count"] or report["removed"]:
            self.log_warning(fl_ctx, f"site '{site}': withheld whole: {report['no_count']} (their count key is "
                                     f"missing), {report['removed']} (not statistics of {label})")
        return dxo


# ---------------------------------------------------------------------------------------------
# The site's result policy: every key of every result (plain functions, then the FLARE filter)
# ---------------------------------------------------------------------------------------------

#: Release rules of a metric key (each method module's ``SENT_METRICS``), plus ``rate:<key>``. Every
#: value must be a finite number; then ``value`` (not computed from the site's data: a stage, a
#: schedule) = released; ``scope`` (a value over the samples) = when the scope count (a train
#: result's sample count; a validation's ``n_images``) is >= k; ``count`` (a number of images /
#: entries / pixels / labels) = when the value and the scope count are >= k; ``rate:<key>`` (a share
#: of that count) = when the count ``<key>`` of the same dict is released; ``local`` (e.g. a rate
#: over a count that is not sent) = never leaves the site.
METRIC_RULE_NAMES = ("value", "scope", "count", "local")
RATE = "rate:"
#: ``site_metrics`` keys the executor adds to every method's (``FedPartialExecutor._train``)
EXECUTOR_METRICS = {"executor": {"train_seconds": "scope"}}
#: Every method's ``site_metrics`` table by method name, from the method modules.
SENT_METRICS: Dict[str, Dict[str, str]] = {**fedavg.SENT_METRICS, **segmentation.SENT_METRICS,
                                           **fedlsm.SENT_METRICS, **fedmlp.SENT_METRICS, **fedirm.SENT_METRICS,
                                           **fedia.SENT_METRICS, **EXECUTOR_METRICS}
#: Validation metrics (``fedpartial.evaluation.evaluate_split(..., flat=True)``: the METRICS DXO of
#: the validate task and ``initial_metrics`` of a train result). Classification's rates go as
#: ``value``: no count travels with them (the val split's size is not sent). Segmentation (``fedpartial.metrics.validation_metrics``)
#: describes ``n_images`` val images: nothing of it leaves from fewer than k images. The pixel
#: counts ``tp`` / ``fp`` / ``fn`` leave with ``n_images`` >= k only: the server pools them
#: (``fedpartial.flare.selector.PooledModelSelector`` for the best model, the aggregator's and
#: the simulator's progress lines in ``fedpartial_tools.run.progress``), which skip a site without them.
VALIDATION_METRICS: Dict[str, str] = {
    "auc": "value", "map": "value", "bacc": "value", "accuracy": "value", "f1": "value", "precision": "value",
    "recall": "value",
    "n_images": "count", "n_empty_both": "count", "dice_per_image": "scope", "iou_per_image": "scope",
    "dice_pooled": "scope", "iou_pooled": "scope", "predicted_lesion_share": "scope",
    "tp": "scope", "fp": "scope", "fn": "scope",
    # 1 where the val split is a curated, completely annotated one (a property of the split file)
    "val_curated": "value",
}
VALIDATION_SCOPE = "n_images"


def merge_metric_rules(tables: Dict[str, Dict[str, str]]) -> Dict[str, Tuple[str, ...]]:
    """``{key: rules}`` over every method's table. A site cannot tell from a message which method
    sent it (FedAvg sends no statistics), so one table serves all; a key two methods list under
    different rules must pass every one of them.

    Args:
        tables: ``{method: {key: rule}}`` (``SENT_METRICS``); ``{c}`` in a key is a class index.

    Raises:
        ValueError: naming the method and key of an unknown rule, or of a rate whose count key
            is not a ``count`` of the same table.
    """
    merged: Dict[str, Tuple[str, ...]] = {}
    for method, table in tables.items():
        for key, rule in table.items():
            if rule.startswith(RATE):
                if table.get(rule[len(RATE):]) != "count":
                    raise ValueError(f"metric table '{method}': '{key}' is a rate of '{rule[len(RATE):]}', "
                                     f"which is not a count of the same table")
            elif rule not in METRIC_RULE_NAMES:
                raise ValueError(f"metric table '{method}': '{key}' has unknown rule '{rule}'")
            merged[key] = tuple(dict.fromkeys(merged.get(key, ()) + (rule,)))
    for key, rules in merged.items():  # one level only: the count behind a rate is never a rate
        for rule in rules:
            if rule.startswith(RATE) and any(r.startswith(RATE) for r in merged[rule[len(RATE):]]):
                raise ValueError(f"metric '{key}' is a rate of '{rule[len(RATE):]}', which some table makes a rate")
    return merged


METRIC_RULES = merge_metric_rules(SENT_METRICS)
VALIDATION_RULES = merge_metric_rules({"validation": VALIDATION_METRICS})


def _number(value) -> Optional[float]:
    """``value`` as a finite float, or None (NaN, infinite, not a real number)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if np.isfinite(value) else None


def _rules_of(key: str, rules: Dict[str, Tuple[str, ...]]) -> Optional[Tuple[str, ...]]:
    if key in rules:
        return rules[key]
    for pattern, rule in rules.items():
        if "{c}" in pattern and re.fullmatch(re.escape(pattern).replace(re.escape("{c}"), r"\d+"), key):
            return rule
    return None


def release_metrics(metrics: dict, rules: Dict[str, Tuple[str, ...]], scope_count, min_count: int) -> tuple:
    """The keys of ``metrics`` that may leave the site (a new dict; values unchanged).

    A withheld key is removed, not set to 0: the server and the tools read a missing key as "not
    reported" (``pooled_validation`` and ``PooledModelSelector`` skip the site), whereas a 0 would
    be read as a measurement (no pseudo label, no lesion pixel) and bias pooled scores.

    Args:
        metrics: ``{key: number}`` as the executor sent it.
        rules: ``{key: rules}`` (:data:`METRIC_RULES`, :data:`VALIDATION_RULES`).
        scope_count: how many samples the metrics describe (None = not known: ``scope``,
            ``count`` and ``rate`` keys are withheld).
        min_count: k; 0 switches the count rules off (unknown and ``local`` keys still stay).

    Returns:
        ``(released, report)``; report = ``{"withheld": [keys], "unknown": [keys]}`` (names only).
    """
    k = int(min_count)
    values = {key: _number(v) for key, v in metrics.items()}

    def enough(x) -> bool:
        return x is not None and (k <= 0 or x >= k)

    scope_ok = enough(_number(scope_count) if scope_count is not None else None)

    def passes(key: str, key_rules: Tuple[str, ...]) -> bool:
        value = values.get(key)
        if value is None:
            return False
        for rule in key_rules:
            if rule == "value":
                continue
            if rule == "local" or not scope_ok:
                return False
            if rule == "count" and not enough(value):
                return False
            if rule.startswith(RATE):  # merge_metric_rules checked: the count's rules hold no rate
                count_key = rule[len(RATE):]
                if count_key not in values or not passes(count_key, rules[count_key]):
                    return False
        return True

    released, report = {}, {"withheld": [], "unknown": []}
    for key, value in metrics.items():
        key_rules = _rules_of(str(key), rules)
        if key_rules is None:
            report["unknown"].append(str(key))
        elif passes(key, key_rules):
            released[key] = value
        else:
            report["withheld"].append(str(key))
    return released, report


def guard_site_stats(stats: dict, min_count: int, noise_sigma: Optional[Dict[str, float]] = None,
                     rng: Optional[np.random.Generator] = None, where: str = "") -> tuple:
    """``site_stats`` under the ``auto`` preset: the recognised methods' minimum-count guards,
    fills and clips (:func:`filter_statistics`); keys the recognised methods do not send are
    removed, so a message that matches no method leaves with no statistic at all.

    Args:
        stats: ``{key: number | array}`` as the client rule returned it.
        min_count: k.
        noise_sigma: key -> standard deviation of Gaussian noise (default none).
        rng: noise source.
        where: site name for error messages.

    Returns:
        ``(filtered, report)``: :func:`filter_statistics`' report plus ``"methods"`` (names).
    """
    names, preset = auto_preset(stats)
    allowed = sorted(set(preset["keys"]) | set(preset["guards"]) | set(preset["guards"].values()))
    filtered, report = filter_statistics(stats, min_count, preset["guards"], preset["fill"], noise_sigma,
                                         preset["clip"], preset["normalise_rows"], rng, where=where,
                                         allowed_keys=allowed)
    report["methods"] = names
    return filtered, report


def guard_histograms(value, min_count: int) -> tuple:
    """The validation histograms of a train result (:data:`HISTOGRAM_KEY`: ``{"pos", "neg"}``, each
    ``(C, bins)`` counts, :func:`fedpartial.algorithms.thresholds.probability_histograms`) that may
    leave the site.

    Class ``c``'s two rows leave only when they hold at least ``max(k, 1)`` positives AND at least
    ``max(k, 1)`` negatives; otherwise both are sent as zero rows, which the server reads as
    "absent" (as a class the site does not annotate). A histogram is a count of images per bin, so
    a class with a handful of positives would place each of them.

    Args:
        value: what the executor put under :data:`HISTOGRAM_KEY`.
        min_count: k.

    Returns:
        ``(released or None, withheld_classes)``: None (withhold the key whole) when ``value`` is not
        two equally shaped arrays of non-negative whole counts; ``withheld_classes`` counts the
        classes zeroed that held something.
    """
    try:
        hist = check_histograms(value)
    except ValueError:
        return None, 0
    need = max(int(min_count), 1)
    pos_n, neg_n = hist["pos"].sum(axis=1), hist["neg"].sum(axis=1)
    released = (pos_n >= need) & (neg_n >= need)
    out = {part: np.where(released[:, None], rows, 0) for part, rows in hist.items()}
    return out, int(((pos_n + neg_n > 0) & ~released).sum())


#: Meta keys a train result may carry: what ``FedPartialExecutor._train`` sets, and FLARE's own
#: ``filter_history`` (``DXOFilter`` appends the class name of each filter that changed the DXO;
#: ``DXO.to_shareable`` adds no meta). FLARE's headers live on the Shareable, not in the meta.
TRAIN_RESULT_META = (MetaKey.NUM_STEPS_CURRENT_ROUND, MetaKey.INITIAL_METRICS, SITE_STATS, SITE_METRICS,
                     SITE_TRAIN_SIZE, HISTOGRAM_KEY, MetaKey.FILTER_HISTORY)
#: DXO kind -> the meta keys it may carry; any other kind is withheld whole.
RESULT_META: Dict[str, Tuple[str, ...]] = {DataKind.WEIGHTS: TRAIN_RESULT_META,
                                           DataKind.WEIGHT_DIFF: TRAIN_RESULT_META,
                                           DataKind.METRICS: (MetaKey.FILTER_HISTORY,)}


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= 0


def filter_result(kind: str, data: dict, meta: dict, min_count: int = 5,
                  noise_sigma: Optional[Dict[str, float]] = None, rng: Optional[np.random.Generator] = None,
                  where: str = "", images_seen: Optional[int] = None) -> tuple:
    """What of one task result (a DXO's kind, data and meta) may leave the site.

    * kind: WEIGHTS / WEIGHT_DIFF (train results, local models) and METRICS (validation) only;
      any other kind is withheld whole.
    * meta: the keys of :data:`RESULT_META` for the kind; any other key is removed.
      ``NUM_STEPS_CURRENT_ROUND`` (the sample count) below k is sent as 0, which the aggregator
      reads as "takes no part" (a missing count would get the update rejected);
      ``site_train_size`` below k is removed (the aggregator takes it as optional);
      ``site_stats``: :func:`guard_site_stats`; ``site_metrics``: :data:`METRIC_RULES` with the
      released sample count as scope; ``initial_metrics``: :data:`VALIDATION_RULES`;
      ``val_histograms``: :func:`guard_histograms` (a class's rows need k positives and k negatives);
      ``filter_history``: kept when it is a list of names.
    * data: a METRICS DXO's data is released by :data:`VALIDATION_RULES`; weights are the gate's
      business (``fedpartial.flare.site_policy.LocalModelGate``) and pass.

    Args:
        kind: the DXO's data kind.
        data: the DXO's data.
        meta: the DXO's meta.
        min_count: k (0 = count rules off; allow-lists stay).
        noise_sigma: for ``site_stats``: key -> sigma of Gaussian noise.
        rng: noise source.
        where: site name for error messages.
        images_seen: the distinct images the round's training drew (the executor's count; None =
            unknown): a train result from 1..k-1 images is withheld whole, and training metrics
            count at most these images.

    Returns:
        ``(data, meta, report)`` as new dicts, or ``(None, None, report)`` when the result is withheld
        whole; report = ``{"kind": withheld kind or None, "withheld": {part: [keys]},
        "unknown": {part: [keys]}, "stats_rows": {stat: rows}, "methods": [names]}`` (names only).
    """
    report = {"kind": None, "withheld": {}, "unknown": {}, "stats_rows": {}, "methods": []}
    if kind not in RESULT_META:
        report["kind"] = str(kind)
        return None, None, report

    def note(part: str, withheld=(), unknown=()):
        if withheld:
            report["withheld"].setdefault(part, []).extend(withheld)
        if unknown:
            report["unknown"].setdefault(part, []).extend(unknown)

    meta = dict(meta or {})
    note("meta", unknown=sorted(str(key) for key in meta if key not in RESULT_META[kind]))
    meta = {key: value for key, value in meta.items() if key in RESULT_META[kind]}
    k = int(min_count)

    # a result that trained on 1..k-1 images (one iteration of batch size 1, whatever sample count
    # the rule reports) carries those images in its weights and metrics: withheld whole
    seen = images_seen
    if seen is not None and not _is_count(seen):
        seen = 0
    claims = meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND)
    if seen is not None and k > 0 and seen < k and _is_count(claims) and claims > 0:
        report["kind"] = f"{getattr(kind, 'value', kind)} trained on {seen} image(s), fewer than {k}"
        return None, None, report
    samples = meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND)
    if MetaKey.NUM_STEPS_CURRENT_ROUND in meta:
        if not _is_count(samples):
            del meta[MetaKey.NUM_STEPS_CURRENT_ROUND]
            samples = None
            note("meta", withheld=[MetaKey.NUM_STEPS_CURRENT_ROUND])
        elif 0 < samples < k:
            meta[MetaKey.NUM_STEPS_CURRENT_ROUND] = samples = 0
            note("meta", withheld=[MetaKey.NUM_STEPS_CURRENT_ROUND])
    if SITE_TRAIN_SIZE in meta:
        size = meta[SITE_TRAIN_SIZE]
        if not _is_count(size) or (k > 0 and size < k):
            del meta[SITE_TRAIN_SIZE]
            note("meta", withheld=[SITE_TRAIN_SIZE])
    if MetaKey.FILTER_HISTORY in meta:
        history = meta[MetaKey.FILTER_HISTORY]
        if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
            del meta[MetaKey.FILTER_HISTORY]
            note("meta", withheld=[MetaKey.FILTER_HISTORY])
    if SITE_STATS in meta:
        stats = meta[SITE_STATS]
        if not isinstance(stats, dict):
            del meta[SITE_STATS]
            note("meta", withheld=[SITE_STATS])
        elif stats:
            meta[SITE_STATS], stats_report = guard_site_stats(stats, k, noise_sigma, rng, where)
            note(SITE_STATS, withheld=stats_report["no_count"], unknown=stats_report["removed"])
            report["stats_rows"], report["methods"] = stats_report["withheld"], stats_report["methods"]
    if HISTOGRAM_KEY in meta:
        hist, withheld_classes = guard_histograms(meta[HISTOGRAM_KEY], k)
        if hist is None:
            del meta[HISTOGRAM_KEY]
            note("meta", withheld=[HISTOGRAM_KEY])
        else:
            meta[HISTOGRAM_KEY] = hist
            if withheld_classes:
                report["stats_rows"][HISTOGRAM_KEY] = withheld_classes
    for part, rules in ((SITE_METRICS, METRIC_RULES), (MetaKey.INITIAL_METRICS, VALIDATION_RULES)):
        if part not in meta:
            continue
        values = meta[part]
        if not isinstance(values, dict):
            del meta[part]
            note("meta", withheld=[part])
            continue
        # training metrics describe the round's samples; validation metrics their val images
        scope = samples if part == SITE_METRICS else values.get(VALIDATION_SCOPE)
        if part == SITE_METRICS and seen is not None and _is_count(scope):
            scope = min(scope, seen)
        meta[part], part_report = release_metrics(values, rules, scope, k)
        note(part, part_report["withheld"], part_report["unknown"])
    data = dict(data or {})
    if kind == DataKind.METRICS:
        data, part_report = release_metrics(data, VALIDATION_RULES, data.get(VALIDATION_SCOPE), k)
        note("metrics", part_report["withheld"], part_report["unknown"])
    return data, meta, report


class SiteResultPolicy(Filter):
    """The site's result filter (provisioning/privacy.json, default scope): checks every key of
    every task result and fails closed (:func:`filter_result`).

    A class of its own rather than an ``auto`` mode of :class:`StatisticsPrivacyFilter`: that one
    is a ``DXOFilter`` on WEIGHTS, and FLARE's ``DXOFilter`` passes results of any other kind and
    non-DXO results untouched, the opposite of failing closed; and jobs use it with a named preset
    to guard the statistics alone while their other meta (e.g. diagnostics for the benchmarks)
    passes, which this policy would remove.

    * A result of an unknown DXO kind, or an OK result that is no DXO, is replaced by EMPTY_RESULT.
    * An error reply keeps its return code and headers only.
    * Log lines name the site, task, keys and kinds withheld, never a value.

    Args:
        min_count: k: counts, and values over fewer than k samples / images, are withheld.
        noise_sigma: ``{site_stats key: sigma}`` Gaussian noise on released statistics (default none).
        seed: noise seed; leave None outside tests.
    """

    def __init__(self, min_count: int = 5, noise_sigma: Optional[Dict[str, float]] = None, seed: Optional[int] = None):
        super().__init__()
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 0:
            raise ValueError(f"SiteResultPolicy min_count must be an integer >= 0, got {min_count!r}")
        self.min_count = min_count
        self.noise_sigma = {k: float(v) for k, v in (noise_sigma or {}).items()}
        for key, sigma in self.noise_sigma.items():
            if sigma < 0:
                raise ValueError(f"SiteResultPolicy noise_sigma['{key}'] must be >= 0, got {sigma}")
        self.rng = np.random.default_rng(seed)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if str(fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "out")).lower() == "in":
            return shareable  # task data coming in is not what this policy guards
        site = fl_ctx.get_identity_name() or "?"
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        where = f"site '{site}', task '{task}'"
        # a Shareable holds its headers and, for a DXO, the key "DXO": anything else is payload
        payload = [k for k in shareable if k not in (ReservedHeaderKey.HEADERS, "DXO")]
        if shareable.get_return_code() != ReturnCode.OK:
            dropped = [k for k in shareable if k != ReservedHeaderKey.HEADERS]
            for key in dropped:
                del shareable[key]
            if dropped:
                self.log_warning(fl_ctx, f"{where}: error reply content {sorted(map(str, dropped))} withheld")
            return shareable
        try:
            dxo = from_shareable(shareable)
        except Exception:
            self.log_warning(fl_ctx, f"{where}: result withheld: it is not a DXO")
            return make_reply(ReturnCode.EMPTY_RESULT)
        try:
            data, meta, report = filter_result(dxo.data_kind, dxo.data, dxo.meta, self.min_count, self.noise_sigma,
                                               self.rng, where=site, images_seen=fl_ctx.get_prop(SITE_IMAGES_SEEN))
        except ValueError as e:  # a malformed statistic: FLARE answers TASK_RESULT_FILTER_ERROR, nothing leaves
            raise ValueError(f"task '{task}': {e}") from e
        if data is None:
            why = (report["kind"] if " " in report["kind"] else
                   f"DXO kind '{report['kind']}' is not one a site sends")
            self.log_warning(fl_ctx, f"{where}: result withheld: {why}")
            return make_reply(ReturnCode.EMPTY_RESULT)
        for key in payload:
            del shareable[key]
        if payload:
            report["unknown"]["shareable"] = [str(k) for k in payload]
        for part, keys in report["unknown"].items():
            self.log_warning(fl_ctx, f"{where}: unknown {part} keys withheld: {sorted(keys)}")
        withheld = {part: sorted(keys) for part, keys in report["withheld"].items()}
        self.log_info(fl_ctx, f"{where}: result filtered (min_count={self.min_count}"
                              + (f", statistics of {'+'.join(report['methods'])}" if report["methods"] else "")
                              + f"): withheld {withheld or 'nothing'}"
                              + (f"; statistic rows withheld {report['stats_rows']}" if report["stats_rows"] else ""))
        return DXO(dxo.data_kind, data=data, meta=meta).update_shareable(shareable)


RECEIVED_WEIGHTS = "fedpartial.received_global_weights"


class SendWeightDiff(Filter):
    """Client side: lets NVFlare's diff-based filters (``PercentilePrivacy``) work with our executor,
    which sends full WEIGHTS. Put the SAME class in two chains of the train task:

    * ``task_data_filters`` (in): remembers the received global weights for this task;
    * ``task_result_filters`` (out, before ``PercentilePrivacy``): WEIGHTS -> WEIGHT_DIFF
      (local - received). Meta (site_stats, sample count...) is kept.

    The server needs :class:`RestoreFullWeights` as a result filter to turn the diff back into
    weights before the aggregator checks it.
    """

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        direction = str(fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "")).lower()
        try:
            dxo = from_shareable(shareable)
        except Exception:
            return shareable
        if direction == "in":
            if dxo.data_kind == DataKind.WEIGHTS:
                fl_ctx.set_prop(RECEIVED_WEIGHTS, dxo.data, private=True, sticky=False)
            return shareable
        if dxo.data_kind != DataKind.WEIGHTS or shareable.get_return_code() != ReturnCode.OK:
            return shareable
        received = fl_ctx.get_prop(RECEIVED_WEIGHTS)
        if not received:
            raise RuntimeError("SendWeightDiff: no received global weights: add it to the task_data_filters "
                               "of the same task too")
        missing = sorted(set(dxo.data) - set(received))
        if missing:
            raise ValueError(f"SendWeightDiff: parameter '{missing[0]}' was not in the received model")
        diff = {k: np.asarray(v) - np.asarray(received[k]) for k, v in dxo.data.items()}
        return DXO(DataKind.WEIGHT_DIFF, data=diff, meta=dict(dxo.meta or {})).update_shareable(shareable)


class RestoreFullWeights(Filter):
    """Server side result filter: makes a site's update a complete WEIGHTS DXO again before the
    aggregator sees it. A WEIGHT_DIFF (from :class:`SendWeightDiff`) is added to the global model
    of the round; parameters a site left out (``ExcludeVars``) are taken from the global model, so
    they count as "unchanged" in the average. Meta passes unchanged. Without it, the aggregator
    rejects such updates ("update lacks parameter ...", "data kind WEIGHT_DIFF").
    """

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        from nvflare.app_common.abstract.model import ModelLearnableKey

        try:
            dxo = from_shareable(shareable)
        except Exception:
            return shareable
        if dxo.data_kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            return shareable
        learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        reference = (learnable or {}).get(ModelLearnableKey.WEIGHTS) if learnable else None
        if not reference:
            raise RuntimeError("RestoreFullWeights: the round's global model is not known on the server")
        data = dict(dxo.data or {})
        unknown = sorted(set(data) - set(reference))
        if unknown:
            raise ValueError(f"RestoreFullWeights: parameter '{unknown[0]}' is not in the global model")
        full = {}
        for key, ref in reference.items():
            ref = np.asarray(ref)
            if key not in data:
                full[key] = ref.copy()
            elif dxo.data_kind == DataKind.WEIGHT_DIFF:
                full[key] = (ref + np.asarray(data[key])).astype(ref.dtype)
            else:
                full[key] = np.asarray(data[key])
        left_out = len(reference) - len(data)
        if left_out or dxo.data_kind == DataKind.WEIGHT_DIFF:
            kind = "weight diff" if dxo.data_kind == DataKind.WEIGHT_DIFF else "weights"
            self.log_info(fl_ctx, f"restored full weights (from {kind}; {left_out} parameter(s) taken from "
                                  f"the global model)")
        return DXO(DataKind.WEIGHTS, data=full, meta=dict(dxo.meta or {})).update_shareable(shareable)


class MessageRecorder(Filter):
    """Pickles every message passing through it to ``folder`` (one file per message): the site,
    task, direction, round, return code, shareable header keys, and the DXO kind, data and meta.
    Put it LAST in a result chain to audit what a site really sends. For tests and audits only:
    the files hold model weights.

    Args:
        folder: where to write ``<site>_<task>_<n>.pkl`` (created).
    """

    _counter = itertools.count()
    _lock = threading.Lock()

    def __init__(self, folder: str):
        super().__init__()
        if not folder:
            raise ValueError("MessageRecorder needs a folder")
        self.folder = folder

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        site = fl_ctx.get_identity_name() or shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        record = {"site": site, "task": task, "direction": fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "?"),
                  "round": shareable.get_header(AppConstants.CURRENT_ROUND),
                  "return_code": shareable.get_return_code(), "headers": sorted(map(str, shareable.keys())),
                  "dxo": None}
        try:
            dxo = from_shareable(shareable)
            record["dxo"] = {"kind": dxo.data_kind, "data": dxo.data, "meta": dict(dxo.meta or {})}
        except Exception as e:  # error replies carry no DXO: record that, never fail the task
            record["error"] = str(e)
        os.makedirs(self.folder, exist_ok=True)
        with self._lock:
            n = next(self._counter)
        path = os.path.join(self.folder, f"{site}_{task}_{os.getpid()}_{n:05d}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(record, f)
        os.replace(path + ".tmp", path)
        return shareable


def load_recorded(folder: str) -> List[dict]:
    """All messages a :class:`MessageRecorder` wrote to ``folder``, in file-name order."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".pkl"):
            with open(os.path.join(folder, name), "rb") as f:
                out.append(pickle.load(f))
    return out


def add_result_filter(client_config: dict, filter_spec: dict, tasks=("train", "submit_model", "validate"),
                      last: bool = True) -> dict:
    """Put ``filter_spec`` ({"path", "args"}) in the client's result chain of each task, appended
    to the chain that already covers the task (FLARE allows one chain per task) or in a new one.

    Args:
        client_config: a loaded ``config_fed_client.json`` (edited in place and returned).
        filter_spec: ``{"path": ..., "args": {...}}``.
        tasks: task names.
        last: append (True) or prepend to an existing chain.
    """
    chains = client_config.setdefault("task_result_filters", [])
    left = list(tasks)
    for chain in chains:
        if chain.get("direction", "out").lower() not in ("out", "inout"):
            continue
        covered = [t for t in chain.get("tasks", []) if t in left]
        if covered:
            filters = chain.setdefault("filters", [])
            filters.append(dict(filter_spec)) if last else filters.insert(0, dict(filter_spec))
            left = [t for t in left if t not in covered]
    if left:
        chains.append({"tasks": left, "filters": [dict(filter_spec)]})
    return client_config
