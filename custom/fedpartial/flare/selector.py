"""Best-global-model selection by Dice pooled over every site's validation pixels.

NVFlare's ``IntimeModelSelector`` averages one number per site. For sparse lesions that number is
noisy (a site's few val slices may hold no lesion) and an average of per-site Dice is not the
Dice of the federation: this selector sums the sites' pixel counts (``tp`` / ``fp`` / ``fn`` of
:func:`fedpartial.metrics.validation_metrics`) and scores the pooled Dice, the metric the
progress lines and ``evaluate`` report. For any other key metric it is ``IntimeModelSelector``.
"""
from __future__ import annotations

from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector

POOLED_METRIC = "dice_pooled"
COUNT_KEYS = ("tp", "fp", "fn")


class PooledModelSelector(IntimeModelSelector):
    """``IntimeModelSelector`` that, for ``key_metric="dice_pooled"``, pools the sites' pixel counts.

    Args:
        key_metric: the validation metric to maximise (``dice_pooled`` = pooled over sites).
        **kwargs: passed to ``IntimeModelSelector``.
    """

    def __init__(self, key_metric: str = POOLED_METRIC, **kwargs):
        super().__init__(key_metric=key_metric, **kwargs)
        self.pooled = key_metric == POOLED_METRIC

    def _reset_stats(self):
        super()._reset_stats()
        self.counts = {k: 0.0 for k in COUNT_KEYS}
        self.pooled_sites = 0

    def _before_accept(self, fl_ctx: FLContext):
        if not self.pooled:
            return super()._before_accept(fl_ctx)
        peer_ctx = fl_ctx.get_peer_context()
        shareable = peer_ctx.get_prop(FLContextKey.SHAREABLE)
        current_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if not current_round or shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND) != current_round:
            return False  # round 0 has no aggregated model; a late update is for another model
        try:
            metrics = from_shareable(shareable).get_meta_prop(MetaKey.INITIAL_METRICS) or {}
        except Exception:
            return False
        if not all(k in metrics for k in COUNT_KEYS):
            return False  # a site without a val split
        for k in COUNT_KEYS:
            self.counts[k] += float(metrics[k])
        self.pooled_sites += 1
        return True

    def _before_aggregate(self, fl_ctx: FLContext):
        if self.pooled:
            tp, fp, fn = (self.counts[k] for k in COUNT_KEYS)
            if not self.pooled_sites or tp + fp + fn == 0:  # no lesion in truth or prediction: no score
                self._reset_stats()
                return False
            dice = 2 * tp / (2 * tp + fp + fn)
            self.validation_metric_weighted_sum = self.raw_validation_metric_weighted_sum = dice
            self.validation_metric_sum_of_weights = 1.0
        return super()._before_aggregate(fl_ctx)
