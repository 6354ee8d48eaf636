"""The server side: one Aggregator for every method. It checks each site's update, then hands the
round's valid updates to the method's ServerRule (the whole server rule lives there)."""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms.base import ServerContext, SiteUpdate
from fedpartial.algorithms.registry import build_rule, rule_class
from fedpartial.algorithms.robust import WEIGHT_RULES, UpdateScreen, trim_count
from fedpartial.algorithms.thresholds import HISTOGRAM_KEY, check_histograms, choose_thresholds, pool_histograms
from fedpartial.flare.common import (GLOBAL_STATS, SITE_METRICS, SITE_STATS, SITE_TRAIN_SIZE, atomic_write_json,
                                     build_model_from_settings, jsonable, model_settings)
from fedpartial.flare.site_config import AGGREGATOR_WEIGHTING, floor, participant_config, site_rules
from fedpartial.metrics.segmentation import pooled_validation

METRICS_FILE = "metrics.json"
#: FLContext property (private, on the workflow's context) holding the round's decision thresholds
#: for the persistor: :func:`fedpartial.algorithms.thresholds.choose_thresholds`' result plus
#: ``model_round`` / ``validated_at`` / ``sites``. Kept off the global model's meta, which goes to the sites.
DECISION_THRESHOLDS = "fedpartial.decision_thresholds"


def payload_bytes(values) -> int:
    """Bytes of the numbers in a weights / statistics dict (what a site sends beside metadata)."""
    if isinstance(values, dict):
        return sum(payload_bytes(v) for v in values.values())
    if isinstance(values, (list, tuple)):
        return sum(payload_bytes(v) for v in values)
    return int(np.asarray(values).nbytes) if isinstance(values, (np.ndarray, np.generic, int, float)) else 0


def check_weights(weights, reference: Dict[str, np.ndarray]) -> None:
    """Raise ValueError naming the first key that is missing, unexpected, misshapen or not finite."""
    if not isinstance(weights, dict) or not weights:
        raise ValueError("update holds no weights")
    if reference:
        missing = sorted(set(reference) - set(weights))
        extra = sorted(set(weights) - set(reference))
        if missing:
            raise ValueError(f"update lacks parameter '{missing[0]}' ({len(missing)} missing)")
        if extra:
            raise ValueError(f"update has unexpected parameter '{extra[0]}' ({len(extra)} unexpected)")
    for key, value in weights.items():
        arr = np.asarray(value)
        if reference and arr.shape != np.shape(reference[key]):
            raise ValueError(f"parameter '{key}' has shape {arr.shape}, expected {np.shape(reference[key])}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"parameter '{key}' holds NaN or Inf")


def server_min_sites(fl_ctx: FLContext) -> int:
    """The fewest sites an aggregate may come from: the server kit's ``min_sites_per_round``
    (:data:`fedpartial.flare.site_config.FLOORS`, default 2) at a provisioned server, 1 elsewhere.
    The server decides it, not the job: a job's ``deploy_map`` or ``min_clients`` could otherwise
    make the downloaded global model one hospital's local model."""
    config = participant_config(fl_ctx)
    return 1 if config is None else max(1, site_rules(config)["min_sites_per_round"])


def classifier_names(model: dict, rule: str) -> List[str]:
    """Names of the classifier parameters of the job's model block (built on the meta device:
    no weights are allocated). ``[]`` without a block, unless the rule needs them."""
    if not model:
        if getattr(rule_class("server", rule), "needs_classifier_names", False):
            raise ValueError(f"the aggregator's rule '{rule}' averages or checks the classifier parameters: "
                             f"give the aggregator the job's model block (\"model\": \"{{model}}\" in its args)")
        return []
    with torch.device("meta"):
        return list(build_model_from_settings(model_settings(model)).classifier_param_names())


class RuleAggregator(Aggregator):
    """Collects site updates, rejects malformed ones (logged with the site's name), caps sample
    counts and rejects outlying updates (:class:`fedpartial.algorithms.robust.UpdateScreen`), and
    aggregates the rest with the method's server rule.

    Args:
        rule: the registered name of the method's server rule (``fedavg``, ``fedlsm``, ``fedmlp``,
            ``fedirm``, ``fedia``: :mod:`fedpartial.algorithms.registry`).
        rule_args: its hyperparameters.
        model: the job's ``model`` block (``"{model}"``); it names the classifier parameters
            that class-wise rules (FedLSM, FedMLP, FedIRM) average and check. Required by those
            rules: the aggregator refuses to start without it.
        min_valid_updates: a round with fewer valid updates (after the norm check) fails with a
            clear message.
        min_sites_for_shared_stats: a summed statistic (the rule's ``summed_stats``: per-class
            counts added over sites) goes back to the sites only when at least this many sites
            contributed to it; with fewer (two), each site could subtract its own counts from the
            sum and read the other's. Default 3; 0 or 1 = always send.
        cap_samples: cap a site's sample count at the train size it reported with its first
            update of the job (honest sites never report more: no effect on them).
        max_norm_ratio: reject an update whose distance to the global model is more than this
            multiple of the round's median distance, with its statistics (None: no check).
        weight_rule: ``mean`` (the method's weighted average), ``median`` or ``trimmed_mean``
            (coordinate-wise, unweighted) for the parameters each method averages by weights.
        trim_fraction: for ``trimmed_mean``: floor(fraction x sites) values dropped at each end.
    """

    def __init__(self, rule: str = "fedavg", rule_args: dict = None,
                 model: dict = None, min_valid_updates: int = 1, min_sites_for_shared_stats: int = 3,
                 cap_samples: bool = AGGREGATOR_WEIGHTING["cap_samples"],
                 max_norm_ratio: float = AGGREGATOR_WEIGHTING["max_norm_ratio"],
                 weight_rule: str = AGGREGATOR_WEIGHTING["weight_rule"],
                 trim_fraction: float = AGGREGATOR_WEIGHTING["trim_fraction"]):
        super().__init__()
        if int(min_sites_for_shared_stats) < 0:
            raise ValueError(f"RuleAggregator min_sites_for_shared_stats must be >= 0, got {min_sites_for_shared_stats}")
        self.min_sites_for_shared_stats = int(min_sites_for_shared_stats)
        self._warned_withheld = set()
        if weight_rule not in WEIGHT_RULES:
            raise ValueError(f"aggregator weight_rule '{weight_rule}' unknown; choose one of {WEIGHT_RULES}")
        trim_count(1, trim_fraction)  # raises for a fraction outside [0, 0.5)
        self.rule_path = rule
        self.rule = build_rule("server", rule, rule_args)
        self.settings = model_settings(model) if model else None
        self.classifier_names = classifier_names(model, rule)
        self.min_valid_updates = int(min_valid_updates)
        self.screen = UpdateScreen(cap_samples=cap_samples, max_norm_ratio=max_norm_ratio)
        self.weight_rule, self.trim_fraction = weight_rule, float(trim_fraction)
        self.updates: List[SiteUpdate] = []
        self.rejected: Dict[str, str] = {}
        self.capped: Dict[str, str] = {}
        self.history: List[dict] = []
        self.histograms: Dict[str, dict] = {}  # site -> its validation histograms of this round
        self._restored = False

    def _global(self, fl_ctx: FLContext):
        learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if not learnable:
            return {}, {}
        return learnable.get(ModelLearnableKey.WEIGHTS) or {}, (learnable.get(ModelLearnableKey.META) or {}).get(
            GLOBAL_STATS, {}) or {}

    def _context(self, fl_ctx: FLContext) -> ServerContext:
        weights, stats = self._global(fl_ctx)
        return ServerContext(round=int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND, 0) or 0),
                             num_rounds=int(fl_ctx.get_prop(AppConstants.NUM_ROUNDS, 1) or 1),
                             classifier_param_names=list(self.classifier_names), global_weights=weights,
                             global_stats=stats, log=lambda m: self.log_info(fl_ctx, m),
                             weight_rule=self.weight_rule, trim_fraction=self.trim_fraction)

    def _reject(self, fl_ctx, site, why) -> bool:
        self.rejected[site] = why
        self.log_error(fl_ctx, f"rejected the update of site '{site}': {why}")
        return False

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        self._restore(fl_ctx)
        site = shareable.get_peer_prop(key=ReservedKey.IDENTITY_NAME, default="?")
        rc = shareable.get_return_code()
        if rc and rc != ReturnCode.OK:
            return self._reject(fl_ctx, site, f"the site returned {rc}")
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        contribution = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        if contribution is not None and current is not None and contribution != current:
            return self._reject(fl_ctx, site, f"update is for round {contribution}, current round is {current}")
        if any(u.site == site for u in self.updates):
            return self._reject(fl_ctx, site, "a second update in the same round")
        try:
            dxo = from_shareable(shareable)
            if dxo.data_kind != DataKind.WEIGHTS:
                raise ValueError(f"data kind {dxo.data_kind}, expected {DataKind.WEIGHTS}")
            reference, _ = self._global(fl_ctx)
            check_weights(dxo.data, reference)
            num_samples = dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND)
            if not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
                raise ValueError(f"sample count {num_samples!r} is not a non-negative integer")
            train_size = dxo.get_meta_prop(SITE_TRAIN_SIZE)
            if train_size is not None and (not isinstance(train_size, (int, np.integer)) or train_size < 0):
                raise ValueError(f"train size {train_size!r} is not a non-negative integer")
            update = SiteUpdate(site=site, weights=dxo.data, num_samples=int(num_samples),
                                stats=dxo.get_meta_prop(SITE_STATS) or {},
                                metrics=dxo.get_meta_prop(SITE_METRICS) or {})
            update.metrics["val"] = dxo.get_meta_prop(MetaKey.INITIAL_METRICS) or {}
            self.rule.check_stats(update, self._context(fl_ctx))
        except Exception as e:
            return self._reject(fl_ctx, site, str(e))
        changed = self.screen.pin(site, None if train_size is None else int(train_size), update.num_samples)
        if changed:
            self.log_warning(fl_ctx, f"site '{site}' {changed}")
        capped = self.screen.cap(update)  # before the rule sees it: every count-based weight uses the cap
        if capped:
            self.capped[site] = capped
            self.log_warning(fl_ctx, f"site '{site}' {capped}")
        self.updates.append(update)
        self._take_histograms(fl_ctx, site, dxo.get_meta_prop(HISTOGRAM_KEY))
        self.log_info(fl_ctx, f"accepted the update of site '{site}' ({update.num_samples} samples)")
        return True

    def _threshold_classes(self) -> List[str]:
        """The classes decision thresholds are chosen for: a classification job's (needs the model block)."""
        from fedpartial.data.types import SEGMENTATION

        if not self.settings or self.settings["task"] == SEGMENTATION:
            return []
        return [str(c) for c in self.settings["class_names"]]

    def _take_histograms(self, fl_ctx: FLContext, site: str, value) -> None:
        """Keep a site's validation histograms for this round's thresholds. Malformed ones are dropped
        with a warning, not the update: they do not touch the model."""
        if value is None or not self._threshold_classes():
            return
        try:
            self.histograms[site] = check_histograms(value, len(self._threshold_classes()))
        except ValueError as e:
            self.log_warning(fl_ctx, f"site '{site}': validation histograms ignored: {e}")

    def _decision_thresholds(self, fl_ctx: FLContext, ctx: ServerContext) -> None:
        """Pick each class's threshold from the histograms of the sites whose update was kept; they
        describe the global model the sites received, i.e. the model of the round before. Recorded
        in the round's report and handed to the persistor (:data:`DECISION_THRESHOLDS`)."""
        classes = self._threshold_classes()
        if not classes:
            return
        kept = {u.site for u in self.updates}
        per_site = {s: h for s, h in sorted(self.histograms.items()) if s in kept}
        try:
            record = choose_thresholds(pool_histograms(per_site), classes, min_sites=self._shared_stats_floor(fl_ctx))
        except ValueError as e:  # sites sent different bin counts: no thresholds this round
            self.log_warning(fl_ctx, f"round {ctx.round}: no decision thresholds: {e}")
            return
        record.update(model_round=ctx.round - 1, validated_at=ctx.round, sites=len(per_site))
        ctx.report["decision_thresholds"] = record
        fl_ctx.set_prop(DECISION_THRESHOLDS, record, private=True, sticky=False)

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        self._restore(fl_ctx)
        ctx = self._context(fl_ctx)
        # a rejected update goes with its statistics: both come from the same local training
        self.updates, outliers, trust = self.screen.screen(self.updates, ctx.global_weights)
        for site, why in outliers.items():
            self._reject(fl_ctx, site, why)
        ctx.report["trust"] = {**trust, "capped": dict(self.capped), "rejected": dict(self.rejected),
                               "train_sizes": dict(self.screen.train_sizes)}
        valid = [u for u in self.updates if u.num_samples > 0]
        needed = max(self.min_valid_updates, server_min_sites(fl_ctx))
        if len(valid) < needed:
            rejected = "; ".join(f"{s}: {w}" for s, w in self.rejected.items()) or "none"
            raise RuntimeError(f"round {ctx.round}: only {len(valid)} valid update(s) with samples, "
                               f"{needed} needed (rejected: {rejected}); a provisioned server never publishes "
                               f"an aggregate of fewer than its min_sites_per_round sites")
        # by site name, not arrival order: float sums depend on order, and a seeded job must
        # give the same model whichever site answers first
        weights, global_stats = self.rule.aggregate(sorted(self.updates, key=lambda u: u.site), ctx)
        check_weights(weights, ctx.global_weights)
        if "weights" not in ctx.report:  # the rule averaged by sample counts
            total = float(sum(u.num_samples for u in valid))
            ctx.report["weights"] = {u.site: u.num_samples / total for u in sorted(valid, key=lambda u: u.site)}
        pooled = pooled_validation({u.site: u.metrics.get("val") for u in self.updates})
        if pooled is not None:
            ctx.report["val_received_model"] = pooled
            if pooled["n_images"] and pooled["predicted_lesion_share"] == 0:
                self.log_warning(fl_ctx, f"round {ctx.round}: the global model the sites received predicts no lesion "
                                         f"on any of the {pooled['n_images']} validation images of "
                                         f"{pooled['sites']} site(s)")
        global_stats = self._withhold_small_sums(fl_ctx, global_stats, ctx)
        self._decision_thresholds(fl_ctx, ctx)
        self._record(fl_ctx, ctx.round, ctx.report)
        self.log_info(fl_ctx, f"round {ctx.round}: aggregated {len(self.updates)} update(s) with {self.rule_path}")
        return DXO(DataKind.WEIGHTS, data=weights, meta={GLOBAL_STATS: global_stats}).to_shareable()

    def _shared_stats_floor(self, fl_ctx: FLContext) -> int:
        # the server's floor holds whatever the job asks: a job may only raise it
        return floor(participant_config(fl_ctx), "min_sites_for_shared_stats", self.min_sites_for_shared_stats)

    def _withhold_small_sums(self, fl_ctx: FLContext, global_stats: dict, ctx: ServerContext) -> dict:
        """``global_stats`` without the summed statistics fewer than ``min_sites_for_shared_stats``
        sites contributed to (recorded in the round's report, logged once per key)."""
        summed = [k for k in getattr(self.rule, "summed_stats", ()) if k in (global_stats or {})]
        needed = self._shared_stats_floor(fl_ctx)
        if needed != self.min_sites_for_shared_stats and "floor" not in self._warned_withheld:
            self._warned_withheld.add("floor")
            self.log_info(fl_ctx, f"aggregator: the job's min_sites_for_shared_stats={self.min_sites_for_shared_stats} "
                                  f"is below this server's floor: {needed} applies ('min_sites_for_shared_stats' in "
                                  f"its local/fedpartial_site.json)")
        if not summed or needed <= 1:
            return global_stats
        out = dict(global_stats)
        for key in summed:
            sites = sorted(u.site for u in self.updates if u.num_samples > 0 and key in (u.stats or {}))
            if len(sites) >= needed:
                continue
            del out[key]
            ctx.report.setdefault("withheld_from_sites", []).append(key)
            if key not in self._warned_withheld:
                self._warned_withheld.add(key)
                self.log_warning(fl_ctx, f"round {ctx.round}: summed statistic '{key}' is not sent back to the sites: "
                                         f"only {len(sites)} site(s) contributed ({', '.join(sites) or 'none'}), "
                                         f"min_sites_for_shared_stats={needed}; with two, "
                                         "each site could subtract its own counts and read the other's")
        return out

    def _metrics_path(self, fl_ctx: FLContext) -> str:
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        return os.path.join(run_dir, METRICS_FILE)

    def _restore(self, fl_ctx: FLContext) -> None:
        """Once per server start: a server resumed from a snapshot keeps the earlier rounds of
        metrics.json and the train sizes the sites reported first (so the cap survives a restart)."""
        if self._restored:
            return
        self._restored = True
        path = self._metrics_path(fl_ctx)
        if self.history or not os.path.isfile(path):
            return
        round_num = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND, 0) or 0)
        with open(path) as f:
            self.history = [r for r in json.load(f).get("rounds", []) if r.get("round", -1) < round_num]
        for entry in self.history:
            for site, size in ((entry.get("server") or {}).get("trust") or {}).get("train_sizes", {}).items():
                self.screen.train_sizes.setdefault(site, int(size))

    def _record(self, fl_ctx: FLContext, round_num: int, report: dict = None) -> None:
        """Append this round's per-site metrics, and what the server decided (``server``: per-site
        weights and the statistics behind them; ``trust``: capped and rejected sites and why, update
        norms), to metrics.json in the server's run folder."""
        path = self._metrics_path(fl_ctx)
        self.history = [r for r in self.history if r.get("round", -1) < round_num]
        self.history.append({"round": round_num, "aggregated_at": time.time(),
                             "sites": {u.site: {"num_samples": u.num_samples, **u.metrics,
                                                "bytes_weights": payload_bytes(u.weights),
                                                "bytes_stats": payload_bytes(u.stats),
                                                **self._val_counts(u.site)} for u in self.updates},
                             "server": jsonable(report or {}),
                             "rejected": dict(self.rejected)})
        atomic_write_json(path, {"rounds": self.history})

    def _val_counts(self, site: str) -> dict:
        """``{"val_counts": {"pos": [C], "neg": [C]}}``: the site's validation images per class behind its
        histograms (0 = withheld by its policy or not annotated); {} without histograms."""
        hist = self.histograms.get(site)
        if hist is None:
            return {}
        return {"val_counts": {part: hist[part].sum(axis=1).tolist() for part in ("pos", "neg")}}

    def reset(self, fl_ctx: FLContext):
        self.updates = []
        self.histograms = {}
        self.rejected = {}
        self.capped = {}
