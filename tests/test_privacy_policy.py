"""What a site's privacy policy (provisioning/privacy.json) enforces, unit level: the ``auto``
statistics filter for every method (fail closed), the local-model gate, the analytics allow-list, and
the server's rule on summed statistics. The deployed version runs in test_site_privacy_deployment.py."""
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.analytix_utils import create_analytic_dxo
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedpartial.flare.common import GLOBAL_STATS, SITE_STATS
from fedpartial.flare.filters import StatisticsPrivacyFilter
from fedpartial.flare.site_policy import WITHHELD, FedEventGuard, LocalModelGate

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "provisioning" / "privacy.json"


def _policy():
    return json.loads(POLICY.read_text())


def _default_scope_component(path_suffix, chain="task_result_filters"):
    policy = _policy()
    scope = next(s for s in policy["scopes"] if s["name"] == policy["default_scope"])
    return next(f for f in scope[chain] if f["path"].endswith(path_suffix))


def _site_filter():
    """The statistics filter exactly as the shipped policy's default scope builds it."""
    spec = _default_scope_component("StatisticsPrivacyFilter")
    return StatisticsPrivacyFilter(**spec["args"])


def _send(stats, f=None):
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, 7)
    dxo.set_meta_prop(SITE_STATS, stats)
    ctx = FLContext()
    out = (f or _site_filter()).process(dxo.to_shareable(), ctx)
    return from_shareable(out).get_meta_prop(SITE_STATS)


def test_shipped_policy_format():
    policy = _policy()
    assert policy["format_version"] == 2 and policy["default_scope"] == "default"
    assert [s["name"] for s in policy["scopes"]] == ["default", "share_local_model"]
    args = _default_scope_component("StatisticsPrivacyFilter")["args"]
    assert args["preset"] == "auto" and args["min_count"] >= 5
    assert _default_scope_component("LocalModelGate")["args"] == {"share_local_model": False}
    guard = next(c for c in policy["components"] if c["path"].endswith("FedEventGuard"))
    assert guard["args"]["allowed_events"] == ["fed.analytix_log_stats"]


def test_auto_withholds_each_methods_rows_below_k():
    # FedLSM: label_pos [3, 6, 0] -> class 0 (3 < 5) withheld; label_neg [9, 4, 20] -> class 1 withheld
    out = _send({"class_counts": np.array([5.0, 2.0, 0.0]), "label_pos": np.array([3.0, 6.0, 0.0]),
                 "label_neg": np.array([9.0, 4.0, 20.0]), "annotated_classes": np.array([1.0, 1.0, 0.0])})
    assert out["class_counts"].tolist() == [5, 0, 0] and out["label_pos"].tolist() == [0, 6, 0]
    assert out["label_neg"].tolist() == [9, 0, 20] and out["annotated_classes"].tolist() == [1, 1, 0]
    # FedMLP: prototype row 1 (count 2) becomes zeros, row 0 (count 8) is kept
    protos = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    out = _send({"prototypes_pos": protos, "prototype_counts_pos": np.array([8.0, 2.0]),
                 "prototypes_neg": protos, "prototype_counts_neg": np.array([1.0, 9.0]),
                 "learning_degree": np.array([0.5, 0.5]), "annotated": np.array([1.0, 1.0])})
    assert out["prototypes_pos"].tolist() == [[1, 2, 3], [0, 0, 0]] and out["prototype_counts_pos"].tolist() == [8, 0]
    assert out["prototypes_neg"].tolist() == [[0, 0, 0], [4, 5, 6]]
    # FedIRM single-label: row 1 (2 images) -> uniform 1/2; multi-label -> 0.5
    m = np.array([[0.9, 0.1], [0.2, 0.8]])
    out = _send({"relation_matrix": m, "relation_counts": np.array([6.0, 2.0]), "relation_multilabel": 0})
    np.testing.assert_allclose(out["relation_matrix"], [[0.9, 0.1], [0.5, 0.5]])
    out = _send({"relation_matrix": np.array([[0.9, 0.3], [0.2, 0.7]]), "relation_counts": np.array([6.0, 2.0]),
                 "relation_multilabel": 1})
    np.testing.assert_allclose(out["relation_matrix"], [[0.9, 0.3], [0.5, 0.5]])


def test_auto_guards_fedia_scalars_by_the_sites_image_count():
    from fedpartial.algorithms.base import ServerContext, SiteUpdate
    from fedpartial.algorithms.fedia import FedIAServer

    stats = {"mean_loss": 0.4, "iou": 0.7, "completeness": 0.6, "completeness_ready": 1, "corrected": 1}
    # 4 images < 5: every scalar becomes what a site without images sends
    out = _send({**stats, "num_images": 4})
    assert out == {"mean_loss": 1.0, "iou": 0.0, "completeness": 1.0, "completeness_ready": 0.0, "corrected": 0.0,
                   "num_images": 0.0}
    FedIAServer().check_stats(SiteUpdate("site-1", {}, 4, out), ServerContext(round=1, num_rounds=3, classifier_param_names=[]))
    out = _send({**stats, "num_images": 5})  # 5 images: released unchanged
    assert out == {**stats, "num_images": 5}


def test_auto_fails_closed_on_a_missing_count_and_on_unknown_keys():
    # a guarded statistic without its count key is withheld whole, never passed
    out = _send({"prototypes_pos": np.ones((2, 3), np.float32), "prototype_counts_neg": np.array([9.0, 9.0]),
                 "prototypes_neg": np.ones((2, 3), np.float32)})
    assert out["prototypes_pos"].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert out["prototypes_neg"].tolist() == [[1, 1, 1], [1, 1, 1]]
    out = _send({"mean_loss": 0.2, "iou": 0.9, "completeness": 0.5, "completeness_ready": 1, "corrected": 0})
    assert out["iou"] == 0.0 and out["mean_loss"] == 1.0 and out["completeness_ready"] == 0.0
    # a key of no known method does not leave; a warm-up message (annotated_classes only) does
    out = _send({"class_counts": np.array([9.0]), "per_image_losses": np.arange(40.0)})
    assert sorted(out) == ["class_counts"]
    assert _send({"annotated_classes": np.array([1.0, 0.0])})["annotated_classes"].tolist() == [1, 0]


def _task_ctx(task):
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    return ctx


def test_local_model_gate():
    local = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()
    out = LocalModelGate().process(local, _task_ctx("submit_model"))
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "w" not in str(dict(out))
    assert LocalModelGate().process(local, _task_ctx("train")) is local  # train / validate pass
    assert LocalModelGate(share_local_model=True).process(local, _task_ctx("submit_model")) is local
    with pytest.raises(ValueError, match="share_local_model"):
        LocalModelGate(share_local_model="no")


def _fed_event(guard, event_type, tag=None, kind=AnalyticsDataType.SCALAR, direction=None):
    data = (create_analytic_dxo(tag, 0.5 if kind == AnalyticsDataType.SCALAR else "text", kind).to_shareable()
            if tag is not None else DXO(DataKind.METRICS, data={"x": 1.0}).to_shareable())
    if direction:
        data.set_header(FedEventHeader.DIRECTION, direction)
    ctx = FLContext()
    ctx.set_prop(FLContextKey.EVENT_DATA, data, private=True, sticky=False)
    ctx.set_prop(FLContextKey.EVENT_SCOPE, EventScope.FEDERATION, private=True, sticky=False)
    guard.handle_event(event_type, ctx)
    return data.get_header(FedEventHeader.DIRECTION, "out")


def test_fed_event_guard_lets_out_only_listed_scalar_tags():
    guard = FedEventGuard(**next(c for c in _policy()["components"] if c["path"].endswith("FedEventGuard"))["args"])
    ev = "fed.analytix_log_stats"
    assert _fed_event(guard, ev, "val/auc") == "out"
    assert _fed_event(guard, ev, "train/train_loss") == "out"
    assert _fed_event(guard, ev, "train/num_pseudo_positive") == WITHHELD  # a count: not on the list
    assert _fed_event(guard, ev, "val/auc", kind=AnalyticsDataType.TEXT) == WITHHELD  # scalars only
    assert _fed_event(guard, "fed.custom_event") == WITHHELD  # other federated events
    assert _fed_event(guard, "fed.custom_event", direction="in") == "in"  # incoming ones are not touched
    with pytest.raises(ValueError, match="allowed_tags"):
        FedEventGuard(allowed_tags="val/*")


class _SumRule:
    """Sums each site's class_counts and sends their ratio too (as AWPA's pos_weight)."""
    summed_stats = ("class_counts",)

    def check_stats(self, update, ctx):
        pass

    def aggregate(self, updates, ctx):
        total = np.sum([u.stats["class_counts"] for u in updates], axis=0)
        return {"w": np.mean([u.weights["w"] for u in updates], axis=0)}, {"class_counts": total,
                                                                           "share": total / total.sum()}


def _update(site, counts):
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, 10)
    dxo.set_meta_prop(SITE_STATS, {"class_counts": np.asarray(counts, float)})
    s = dxo.to_shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, 0)
    return s


@pytest.mark.parametrize("sites,sent", [(2, False), (3, True)])
def test_summed_statistics_go_back_only_from_three_sites(tmp_path, sites, sent):
    from fedpartial.algorithms.fedirm import FedIRMServer
    from fedpartial.algorithms.fedlsm import AWPAServer
    from fedpartial.flare.aggregators import RuleAggregator

    assert AWPAServer.summed_stats == ("class_counts", "label_pos", "label_neg")
    assert FedIRMServer.summed_stats == ("relation_counts",)
    agg = RuleAggregator()
    agg.rule = _SumRule()
    fl_ctx = FLContext()
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable({"w": np.zeros(2, np.float32)}, {}),
                    private=True, sticky=False)
    engine = mock.MagicMock()
    engine.get_workspace.return_value.get_run_dir.return_value = str(tmp_path)
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    with mock.patch.object(FLContext, "get_engine", lambda self: self.get_prop("__engine__")):
        for k in range(sites):
            assert agg.accept(_update(f"site-{k + 1}", [6.0, 2.0 * k]), fl_ctx)
        stats = from_shareable(agg.aggregate(fl_ctx)).get_meta_prop(GLOBAL_STATS)
    if sent:  # [6, 0] + [6, 2] + [6, 4]
        assert stats["class_counts"].tolist() == [18.0, 6.0]
    else:  # site-1 [6, 0] would read site-2's [6, 2] as sum - own
        assert "class_counts" not in stats
    np.testing.assert_allclose(stats["share"], [0.75, 0.25] if sent else [12 / 14, 2 / 14])  # the ratio stays
    report = json.loads((tmp_path / "metrics.json").read_text())["rounds"][0]["server"]
    assert report.get("withheld_from_sites", []) == ([] if sent else ["class_counts"])
