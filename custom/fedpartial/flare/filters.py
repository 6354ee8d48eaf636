"""The filters a job may put in its own chains (``task_data_filters`` / ``task_result_filters``).

* :class:`StatisticsPrivacyFilter` (a ``DXOFilter`` on WEIGHTS) edits the method statistics in
  ``meta["site_stats"]`` of a train result: a minimum-count rule withholds class-wise statistics
  computed from fewer than ``min_count`` samples (at a provisioned site, never fewer than the
  site's own ``min_count``), and optional Gaussian noise is added per key (counts, prototypes,
  relation matrices). The weights and every other meta key pass untouched, so NVFlare's own weight
  filters (``PercentilePrivacy``, ``ExcludeVars``) can sit in the same chain.
* :class:`SendWeightDiff` (client) + :class:`RestoreFullWeights` (server) let NVFlare's
  diff-based ``PercentilePrivacy`` and the key-removing ``ExcludeVars`` work with our executor
  (which sends full WEIGHTS) and aggregator (which needs every parameter).

What may leave a site whatever a job's filters say is the site's result policy
(:mod:`fedpartial.flare.result_policy`). Put these in ``task_result_filters`` of
``config_fed_client.json`` (see docs/FAILURE_BEHAVIOUR.md)::

    {"tasks": ["train"], "filters": [{"path": "fedpartial.flare.filters.StatisticsPrivacyFilter",
                                      "args": {"preset": "fedmlp", "min_count": 5,
                                               "noise_sigma": {"prototypes_pos": 0.05}}}]}
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms import fedia, fedirm, fedlsm, fedmlp
from fedpartial.flare.common import SITE_STATS
from fedpartial.flare.site_config import floor, participant_config

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
        min_count: k: a class-wise statistic from fewer than k samples is withheld (0 = off); at a
            provisioned site never below its own ``min_count`` (``local/fedpartial_site.json``).
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
        min_count = floor(participant_config(fl_ctx), "min_count", self.min_count)  # the site's floor holds
        filtered, report = filter_statistics(stats, min_count, guards, fill, self.noise_sigma, clip, rows,
                                             self.rng, where=site, allowed_keys=allowed)
        dxo.set_meta_prop(SITE_STATS, filtered)
        self.log_info(fl_ctx, f"site statistics filtered{methods} (min_count={min_count}): withheld rows "
                              f"{report['withheld'] or 'none'}; noise on {report['noised'] or 'nothing'}")
        if report["no_count"] or report["removed"]:
            self.log_warning(fl_ctx, f"site '{site}': withheld whole: {report['no_count']} (their count key is "
                                     f"missing), {report['removed']} (not statistics of {label})")
        return dxo




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

