"""What may leave a site: the site's result policy, the filter its ``local/privacy.json`` puts on
every task result of every job (provisioning/privacy.json), whatever the job's own filters say.

:class:`SiteResultPolicy` checks every key of every task result against allow-lists and minimum
counts, and withholds whatever it does not know (:func:`filter_result`, :func:`release_metrics`,
:func:`guard_site_stats`). The statistics a method may send are each method module's
``SENT_STATISTICS`` (recognised by :func:`fedpartial.flare.filters.auto_preset`), its training
metrics its ``SENT_METRICS``. The minimum count is the larger of the filter's ``min_count`` and the
site's own (``min_count`` in ``local/fedpartial_site.json``).
"""
from __future__ import annotations

import numbers
import re
from typing import Dict, Optional, Tuple

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable, make_reply

from fedpartial.algorithms import fedavg, fedia, fedirm, fedlsm, fedmlp, segmentation
from fedpartial.algorithms.thresholds import HISTOGRAM_KEY, check_histograms
from fedpartial.flare.common import (SITE_IMAGES_SEEN, SITE_METRICS, SITE_OPTIMIZER_STEPS, SITE_STATS,
                                     SITE_TRAIN_SIZE, SITE_VAL_MIN_CLASS_COUNT)
from fedpartial.flare.filters import auto_preset, filter_statistics
from fedpartial.flare.site_config import floor, participant_config

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
#: Classification's validation rates: they leave only when the executor scored no class with fewer
#: than k positives or negatives (``fedpartial.evaluation.describable``): a constant model's accuracy
#: is a class's share, a macro AUC holds one class's ranking of its few positives.
CLASSIFICATION_RATES = ("auc", "map", "bacc", "accuracy", "f1", "precision", "recall")
#: Validation metrics (``fedpartial.evaluation.evaluate_split(..., flat=True)``: the METRICS DXO of
#: the validate task and ``initial_metrics`` of a train result). Classification's rates go as
#: ``value`` (no count travels with them), and only as :data:`CLASSIFICATION_RATES` allows.
#: Segmentation (``fedpartial.metrics.validation_metrics``) describes ``n_images`` val images:
#: nothing of it leaves from fewer than k images. The pixel counts ``tp`` / ``fp`` / ``fn`` leave
#: with ``n_images`` >= k only: the server pools them
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
    a class with a handful of positives would place each of them. Single-label histograms (each
    image one class's positive) withhold more classes when the withheld ones hold 1..k-1 images in
    all, which the released rows' totals would give away.

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
    total = pos_n + neg_n
    if total.size and (total == total[0]).all() and pos_n.sum() == total[0]:
        # single-label: every image is one class's positive, so the withheld classes' images are the
        # total (any released class's pos + neg) less the released positives; under k, withhold the
        # smallest released classes too until they are k or more
        order = [c for c in np.argsort(pos_n, kind="stable") if released[c]]
        while 0 < int(pos_n[~released].sum()) < need and order:
            released[order.pop(0)] = False
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
                  where: str = "", images_seen: Optional[int] = None, optimizer_steps: Optional[int] = None,
                  min_local_steps: int = 0, val_min_class_count: Optional[int] = None) -> tuple:
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
        optimizer_steps: the optimizer steps the round's training made (the executor's count; None =
            unknown).
        min_local_steps: a train result from 1..min_local_steps-1 optimizer steps is withheld whole:
            one Adam step moves each weight by +-lr, so the weights are the batch's gradient signs,
            which the average with other sites' does not hide (0 = off).
        val_min_class_count: the k the executor scored classification's val rates with (classes with
            fewer positives or negatives left out); below k or None (unknown), the
            :data:`CLASSIFICATION_RATES` of ``initial_metrics`` and of a METRICS DXO are withheld.

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
    if (optimizer_steps is not None and min_local_steps > 0 and _is_count(claims) and claims > 0
            and 0 < optimizer_steps < min_local_steps):
        report["kind"] = (f"{getattr(kind, 'value', kind)} of {optimizer_steps} optimizer step(s), fewer than "
                          f"{min_local_steps} ('min_local_steps')")
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
    scored_with = val_min_class_count if _is_count(val_min_class_count) else -1
    rates_unguarded = k > 0 and scored_with < k
    if rates_unguarded and isinstance(meta.get(MetaKey.INITIAL_METRICS), dict):
        meta[MetaKey.INITIAL_METRICS], dropped = _without_rates(meta[MetaKey.INITIAL_METRICS])
        note(MetaKey.INITIAL_METRICS, withheld=dropped)
    data = dict(data or {})
    if kind == DataKind.METRICS:
        data, part_report = release_metrics(data, VALIDATION_RULES, data.get(VALIDATION_SCOPE), k)
        note("metrics", part_report["withheld"], part_report["unknown"])
        if rates_unguarded:
            data, dropped = _without_rates(data)
            note("metrics", withheld=dropped)
    return data, meta, report


def _without_rates(values: dict) -> tuple:
    dropped = sorted(key for key in values if key in CLASSIFICATION_RATES)
    return {key: value for key, value in values.items() if key not in CLASSIFICATION_RATES}, dropped


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
        min_count: k: counts, and values over fewer than k samples / images, are withheld; never
            below the site's own ``min_count`` (``local/fedpartial_site.json``).
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
        config = participant_config(fl_ctx)
        min_count = floor(config, "min_count", self.min_count)  # the site's floor holds
        try:
            data, meta, report = filter_result(dxo.data_kind, dxo.data, dxo.meta, min_count, self.noise_sigma,
                                               self.rng, where=site, images_seen=fl_ctx.get_prop(SITE_IMAGES_SEEN),
                                               optimizer_steps=fl_ctx.get_prop(SITE_OPTIMIZER_STEPS),
                                               min_local_steps=floor(config, "min_local_steps", 0),
                                               val_min_class_count=fl_ctx.get_prop(SITE_VAL_MIN_CLASS_COUNT))
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
        self.log_info(fl_ctx, f"{where}: result filtered (min_count={min_count}"
                              + (f", statistics of {'+'.join(report['methods'])}" if report["methods"] else "")
                              + f"): withheld {withheld or 'nothing'}"
                              + (f"; statistic rows withheld {report['stats_rows']}" if report["stats_rows"] else ""))
        return DXO(dxo.data_kind, data=data, meta=meta).update_shareable(shareable)

