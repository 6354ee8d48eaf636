"""What a site's privacy policy (provisioning/privacy.json) enforces, unit level: the statistics rules
of the site's result policy (and of the ``auto`` statistics filter) for every method (fail closed), the
local-model gate run through FLARE's own privacy-scope parser and filter chains, the analytics
allow-list, and the server's rule on summed statistics. The deployed version runs in
test_site_privacy_deployment.py; every key of a result: test_result_policy.py."""
import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.utils.analytix_utils import create_analytic_dxo
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedpartial.flare.common import GLOBAL_STATS, SITE_METRICS, SITE_STATS, SITE_VAL_MIN_CLASS_COUNT
from fedpartial.flare.filters import StatisticsPrivacyFilter
from fedpartial.flare.result_policy import SiteResultPolicy
from fedpartial.flare.site_policy import TASK_RECEIVED_MODEL, WITHHELD, FedEventGuard, LocalModelGate

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "provisioning" / "privacy.json"


def _policy():
    return json.loads(POLICY.read_text())


def _default_scope_component(path_suffix, chain="task_result_filters"):
    policy = _policy()
    scope = next(s for s in policy["scopes"] if s["name"] == policy["default_scope"])
    return next(f for f in scope[chain] if f["path"].endswith(path_suffix))


def _site_filter():
    """The result policy exactly as the shipped policy's default scope builds it."""
    spec = _default_scope_component("SiteResultPolicy")
    return SiteResultPolicy(**spec["args"])


#: the site statistics rules run in the shipped result policy and in StatisticsPrivacyFilter's ``auto``
STATS_FILTERS = {"site_policy": _site_filter,
                 "auto": lambda: StatisticsPrivacyFilter(preset="auto", min_count=5)}


@pytest.fixture(params=sorted(STATS_FILTERS))
def send(request):
    """``send(stats)`` -> the site statistics as they leave through one of :data:`STATS_FILTERS`."""
    return lambda stats: _send(stats, STATS_FILTERS[request.param]())


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
    assert [s["name"] for s in policy["scopes"]] == ["default"]  # a site adds other scopes itself
    scope = policy["scopes"][0]
    gate = {"path": "fedpartial.flare.site_policy.LocalModelGate", "args": {"share_local_model": False}}
    assert scope["task_data_filters"] == [gate]  # the gate's half that sees what a task brought
    assert scope["task_result_filters"][0] == gate
    assert scope["task_result_filters"][1]["path"] == "fedpartial.flare.result_policy.SiteResultPolicy"
    assert scope["task_result_filters"][1]["args"]["min_count"] >= 5 and len(scope["task_result_filters"]) == 2
    guard = next(c for c in policy["components"] if c["path"].endswith("FedEventGuard"))
    assert guard["args"]["allowed_events"] == ["fed.analytix_log_stats"]


def test_auto_withholds_each_methods_rows_below_k(send):
    # FedLSM: label_pos [3, 6, 0] -> class 0 (3 < 5) withheld; label_neg [9, 4, 20] -> class 1 withheld
    out = send({"class_counts": np.array([5.0, 2.0, 0.0]), "label_pos": np.array([3.0, 6.0, 0.0]),
                "label_neg": np.array([9.0, 4.0, 20.0]), "annotated_classes": np.array([1.0, 1.0, 0.0])})
    assert out["class_counts"].tolist() == [5, 0, 0] and out["label_pos"].tolist() == [0, 6, 0]
    assert out["label_neg"].tolist() == [9, 0, 20] and out["annotated_classes"].tolist() == [1, 1, 0]
    # FedMLP: prototype row 1 (count 2) becomes zeros, row 0 (count 8) is kept
    protos = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    out = send({"prototypes_pos": protos, "prototype_counts_pos": np.array([8.0, 2.0]),
                "prototypes_neg": protos, "prototype_counts_neg": np.array([1.0, 9.0]),
                "learning_degree": np.array([0.5, 0.5]), "annotated": np.array([1.0, 1.0])})
    assert out["prototypes_pos"].tolist() == [[1, 2, 3], [0, 0, 0]] and out["prototype_counts_pos"].tolist() == [8, 0]
    assert out["prototypes_neg"].tolist() == [[0, 0, 0], [4, 5, 6]]
    # FedIRM single-label: row 1 (2 images) -> uniform 1/2; multi-label -> 0.5
    m = np.array([[0.9, 0.1], [0.2, 0.8]])
    out = send({"relation_matrix": m, "relation_counts": np.array([6.0, 2.0]), "relation_multilabel": 0})
    np.testing.assert_allclose(out["relation_matrix"], [[0.9, 0.1], [0.5, 0.5]])
    out = send({"relation_matrix": np.array([[0.9, 0.3], [0.2, 0.7]]), "relation_counts": np.array([6.0, 2.0]),
                "relation_multilabel": 1})
    np.testing.assert_allclose(out["relation_matrix"], [[0.9, 0.3], [0.5, 0.5]])


def test_auto_guards_fedia_scalars_by_the_sites_image_count(send):
    from fedpartial.algorithms.base import ServerContext, SiteUpdate
    from fedpartial.algorithms.fedia import FedIAServer

    stats = {"mean_loss": 0.4, "iou": 0.7, "completeness": 0.6, "completeness_ready": 1, "corrected": 1}
    # 4 images < 5: every scalar becomes what a site without images sends
    out = send({**stats, "num_images": 4})
    assert out == {"mean_loss": 1.0, "iou": 0.0, "completeness": 1.0, "completeness_ready": 0.0, "corrected": 0.0,
                   "num_images": 0.0}
    FedIAServer().check_stats(SiteUpdate("site-1", {}, 4, out), ServerContext(round=1, num_rounds=3, classifier_param_names=[]))
    out = send({**stats, "num_images": 5})  # 5 images: released unchanged
    assert out == {**stats, "num_images": 5}


def test_auto_fails_closed_on_a_missing_count_and_on_unknown_keys(send):
    # a guarded statistic without its count key is withheld whole, never passed
    out = send({"prototypes_pos": np.ones((2, 3), np.float32), "prototype_counts_neg": np.array([9.0, 9.0]),
                "prototypes_neg": np.ones((2, 3), np.float32)})
    assert out["prototypes_pos"].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert out["prototypes_neg"].tolist() == [[1, 1, 1], [1, 1, 1]]
    out = send({"mean_loss": 0.2, "iou": 0.9, "completeness": 0.5, "completeness_ready": 1, "corrected": 0})
    assert out["iou"] == 0.0 and out["mean_loss"] == 1.0 and out["completeness_ready"] == 0.0
    # a key the recognised method does not send does not leave
    out = send({"class_counts": np.array([9.0]), "per_image_losses": np.arange(40.0)})
    assert sorted(out) == ["class_counts"]
    # statistics that match no method leave with nothing: here FedMLP's tag check counts of 3 of 4
    # images (3 < 5) would otherwise pass unguarded, as would FedLSM's label flags next to them
    assert send({"tag_check_hits": np.array([3.0, 9.0]), "tag_check_count": np.array([4.0, 9.0]),
                 "annotated_classes": np.array([1.0, 1.0])}) == {}
    assert send({"learning_degree": np.array([0.5, 0.9])}) == {}
    # FedMLP's warm-up message (annotated_classes alone) is a method's: it leaves
    assert send({"annotated_classes": np.array([1.0, 0.0])})["annotated_classes"].tolist() == [1, 0]


def _shipped_scope(tmp_path, name=None):
    """The shipped privacy.json as FLARE builds it for a site (its own parser): a privacy Scope."""
    from nvflare.apis.workspace import Workspace
    from nvflare.private.fed.app.fl_conf import create_privacy_manager

    for folder in ("local", "startup"):
        (tmp_path / folder).mkdir(exist_ok=True)
    shutil.copyfile(POLICY, tmp_path / "local" / "privacy.json")
    return create_privacy_manager(Workspace(str(tmp_path), "site-1"), names_only=False).get_scope(name)


def _run_task(scope, task, data, result, task_id="t-1", ctx=None):
    """One task as FLARE's ClientRunner runs it: one FLContext for the task data filters (in), the
    executor and the result filters (out); the scope's filters first (``apply_filters``)."""
    from nvflare.apis.utils.task_utils import apply_filters
    from nvflare.private.privacy_manager import Scope

    ctx = ctx or FLContext()
    ctx.set_prop(FLContextKey.SCOPE_OBJECT, scope, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_ID, task_id, private=True, sticky=False)
    apply_filters(Scope.TASK_DATA_FILTERS_NAME, data, ctx, {}, task, "in")
    return apply_filters(Scope.TASK_RESULT_FILTERS_NAME, result, ctx, {}, task, "out")


def _weights(kind=DataKind.WEIGHTS, n=40):
    dxo = DXO(kind, data={"w": np.full(3, 0.25, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(SITE_METRICS, {"train_loss": 0.5})
    return dxo.to_shareable()


def test_local_model_gate_acts_on_content_not_task_names(tmp_path):
    scope = _shipped_scope(tmp_path)
    assert [type(f).__name__ for f in scope.task_data_filters["in"]] == ["LocalModelGate"]
    assert [type(f).__name__ for f in scope.task_result_filters["out"]] == ["LocalModelGate", "SiteResultPolicy"]
    # a training round: the global model came in, the trained weights go out (meta filtered)
    out = _run_task(scope, "train", _weights(n=0), _weights())
    assert out.get_return_code() == ReturnCode.OK
    assert from_shareable(out).data["w"].tolist() == [0.25] * 3
    assert from_shareable(out).get_meta_prop(SITE_METRICS) == {"train_loss": 0.5}
    # the local-model request (no model in its data) under the names a job may give it: withheld
    for task in ("submit_model", "get_weights", "train"):
        out = _run_task(scope, task, Shareable(), _weights())
        assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "DXO" not in out, task
    # validating a received model: the metrics leave (scored without classes under the site's k, as
    # the executor says on the task's context)
    ctx = FLContext()
    ctx.set_prop(SITE_VAL_MIN_CLASS_COUNT, 5, private=True, sticky=False)
    out = _run_task(scope, "validate", _weights(), DXO(DataKind.METRICS, data={"auc": 0.75}).to_shareable(), ctx=ctx)
    assert from_shareable(out).data == {"auc": 0.75}
    # weights in other clothes, for a task that brought none: a collection, arrays in a metrics DXO
    collection = DXO(DataKind.COLLECTION, data={"m": DXO(DataKind.WEIGHTS, data={"w": np.ones(3)})})
    metrics_with_arrays = DXO(DataKind.METRICS, data={"w": np.ones(3)})
    task_data = DXO(DataKind.METRICS, data={"x": 1.0}).to_shareable()
    for result in (collection, metrics_with_arrays, DXO(DataKind.WEIGHT_DIFF, data={"w": np.ones(3)})):
        out = _run_task(scope, "validate", task_data, result.to_shareable())
        assert out.get_return_code() == ReturnCode.EMPTY_RESULT, result.data_kind
    # a job's scope name the site does not define: FLARE refuses the job (no share_local_model scope)
    assert _shipped_scope(tmp_path, "share_local_model") is None


def test_local_model_gate_fails_closed_and_a_site_may_share():
    local = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()

    def ctx(direction, task_id="t-1", received=None):
        c = FLContext()
        c.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
        c.set_prop(FLContextKey.TASK_ID, task_id, private=True, sticky=False)
        c.set_prop(FLContextKey.FILTER_DIRECTION, direction, private=True, sticky=False)
        if received is not None:
            c.set_prop(TASK_RECEIVED_MODEL, received, private=True, sticky=False)
        return c

    # no task-data half in the scope: nothing says a model came, so weights stay
    assert LocalModelGate().process(local, ctx("out")).get_return_code() == ReturnCode.EMPTY_RESULT
    # a model that came with ANOTHER task does not count
    trained = {"task_id": "t-1", "model": True, "validation": False}
    out = LocalModelGate().process(local, ctx("out", received=dict(trained, task_id="t-0")))
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT
    assert LocalModelGate().process(local, ctx("out", received=trained)) is local
    # a model sent for cross-site validation (MODEL_OWNER header), whatever the task is called:
    # its answer is never weights
    out = LocalModelGate().process(local, ctx("out", received=dict(trained, validation=True)))
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT
    # the task-data half: a model in, or not, and for validation or not
    c = ctx("in")
    LocalModelGate().process(DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable(), c)
    assert c.get_prop(TASK_RECEIVED_MODEL) == trained
    c = ctx("in")
    to_validate = DXO(DataKind.WEIGHTS, data={"w": np.ones(2)}).to_shareable()
    to_validate.set_header(AppConstants.MODEL_OWNER, "SRV_global_model")
    LocalModelGate().process(to_validate, c)
    assert c.get_prop(TASK_RECEIVED_MODEL) == dict(trained, validation=True)
    c = ctx("in")
    LocalModelGate().process(Shareable(), c)
    assert c.get_prop(TASK_RECEIVED_MODEL) == {"task_id": "t-1", "model": False, "validation": False}
    # weights outside a DXO are weights too (the gate alone, without the result policy behind it)
    raw = Shareable({"weights": np.ones(3)})
    out = LocalModelGate().process(raw, ctx("out", received={"task_id": "t-1", "model": False, "validation": False}))
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "weights" not in out
    # a site that shares its local model lets weights out for any task; errors and metrics always pass
    assert LocalModelGate(share_local_model=True).process(local, ctx("out")) is local
    metrics = DXO(DataKind.METRICS, data={"auc": 0.7}).to_shareable()
    assert LocalModelGate().process(metrics, ctx("out")) is metrics
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
