"""The FLARE adapters without a running system: the aggregator on a bare FLContext (as NVFlare's own
aggregator tests do), update checks, and job-config overrides."""
import json
import os
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.shareable import Shareable
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants

from fedpartial.flare.aggregators import RuleAggregator, check_weights
from fedpartial.flare.common import GLOBAL_STATS, SITE_STATS
from fedpartial_tools.jobs.settings import apply_overrides
from helpers import aggregator_fl_ctx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ctx(tmp_path, round_num=0, global_weights=None):
    return aggregator_fl_ctx(tmp_path, round_num, global_weights)


def _update(site, w, n, stats=None, round_num=0):
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.asarray(w, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(SITE_STATS, stats or {})
    s = dxo.to_shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_num)
    return s


@pytest.fixture
def aggregator():
    agg = RuleAggregator()
    with mock.patch.object(FLContext, "get_engine", lambda self: self.get_prop("__engine__")):
        yield agg


def test_aggregator_weighted_average_and_metrics_file(aggregator, tmp_path):
    ctx = _ctx(tmp_path, global_weights={"w": np.zeros(2, np.float32)})
    assert aggregator.accept(_update("site-1", [0, 2], 1), ctx)
    assert aggregator.accept(_update("site-2", [4, 6], 3), ctx)
    out = from_shareable(aggregator.aggregate(ctx))
    np.testing.assert_allclose(out.data["w"], [3.0, 5.0])  # (1*[0,2] + 3*[4,6]) / 4
    assert out.get_meta_prop(GLOBAL_STATS) == {}
    history = json.load(open(tmp_path / "metrics.json"))["rounds"]
    assert history[0]["sites"]["site-2"]["num_samples"] == 3


def test_aggregator_logs_weights_and_warns_when_the_received_model_predicts_no_lesion(aggregator, tmp_path):
    ctx = _ctx(tmp_path, round_num=4, global_weights={"w": np.zeros(2, np.float32)})
    blank = {"tp": 0, "fp": 0, "fn": 7, "n_images": 4, "predicted_lesion_share": 0.0}
    for site, n in (("site-1", 1), ("site-2", 3)):
        update = _update(site, [1, 1], n, round_num=4)
        dxo = from_shareable(update)
        dxo.set_meta_prop(MetaKey.INITIAL_METRICS, blank)
        update = dxo.to_shareable()
        update.set_peer_props({ReservedKey.IDENTITY_NAME: site})
        update.add_cookie(AppConstants.CONTRIBUTION_ROUND, 4)
        assert aggregator.accept(update, ctx)
    with mock.patch.object(aggregator, "log_warning") as warn:
        aggregator.aggregate(ctx)
    assert "round 4: the global model the sites received predicts no lesion" in warn.call_args[0][1]
    server = json.load(open(tmp_path / "metrics.json"))["rounds"][0]["server"]
    assert server["weights"] == {"site-1": 0.25, "site-2": 0.75}
    assert server["val_received_model"] == {"dice_pooled": 0.0, "predicted_lesion_share": 0.0, "n_images": 8,
                                            "sites": 2}


@pytest.mark.parametrize("bad, why", [
    ([np.nan, 1.0], "NaN"),
    ([1.0, 2.0, 3.0], "shape"),
])
def test_aggregator_rejects_bad_update_and_keeps_the_rest(aggregator, tmp_path, bad, why):
    ctx = _ctx(tmp_path, global_weights={"w": np.zeros(2, np.float32)})
    assert aggregator.accept(_update("site-1", [1, 1], 2), ctx)
    assert not aggregator.accept(_update("site-bad", bad, 2), ctx)
    assert why in aggregator.rejected["site-bad"]
    np.testing.assert_allclose(from_shareable(aggregator.aggregate(ctx)).data["w"], [1.0, 1.0])


def test_aggregator_rejects_wrong_round_duplicates_and_errors(aggregator, tmp_path):
    ctx = _ctx(tmp_path, round_num=2, global_weights={"w": np.zeros(2, np.float32)})
    assert not aggregator.accept(_update("site-1", [1, 1], 2, round_num=1), ctx)
    assert "round 1" in aggregator.rejected["site-1"]
    assert aggregator.accept(_update("site-2", [1, 1], 2, round_num=2), ctx)
    assert not aggregator.accept(_update("site-2", [1, 1], 2, round_num=2), ctx)
    err = Shareable()
    err.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    err.set_peer_props({ReservedKey.IDENTITY_NAME: "site-3"})
    assert not aggregator.accept(err, ctx)


def test_round_with_too_few_valid_updates_fails_clearly(aggregator, tmp_path):
    ctx = _ctx(tmp_path, global_weights={"w": np.zeros(2, np.float32)})
    aggregator.accept(_update("site-1", [np.inf, 0], 2), ctx)
    with pytest.raises(RuntimeError, match="only 0 valid update.*site-1"):
        aggregator.aggregate(ctx)


def test_a_provisioned_server_publishes_no_aggregate_of_one_site(aggregator, tmp_path):
    """A job may deploy to one site (deploy_map, min_clients=1); its "global" model would be that
    hospital's local model. The server kit's min_sites_per_round (default 2) refuses it."""
    kit = tmp_path / "server_kit"
    (kit / "local").mkdir(parents=True)
    config = kit / "local" / "fedpartial_site.json"
    config.write_text('{"format_version": 1, "datasets": {}}')
    ctx = _ctx(tmp_path, global_weights={"w": np.zeros(2, np.float32)})
    ctx.get_engine().get_workspace.return_value.get_root_dir.return_value = str(kit)
    aggregator.accept(_update("site-2", [1, 1], 10), ctx)
    with pytest.raises(RuntimeError, match="only 1 valid update.*2 needed.*min_sites_per_round"):
        aggregator.aggregate(ctx)
    config.write_text('{"format_version": 1, "datasets": {}, "min_sites_per_round": 1}')  # the server's choice
    assert aggregator.aggregate(ctx) is not None
    config.write_text('{"format_version": 1, "datasets": {}, "min_sites_per_round": 0}')
    with pytest.raises(ValueError, match="min_sites_per_round must be an integer >= 1"):
        aggregator.aggregate(ctx)


def test_check_weights_names_the_key():
    ref = {"a": np.zeros(2), "b": np.zeros(1)}
    with pytest.raises(ValueError, match="'b'"):
        check_weights({"a": np.zeros(2)}, ref)
    with pytest.raises(ValueError, match="unexpected parameter 'c'"):
        check_weights({"a": np.zeros(2), "b": np.zeros(1), "c": np.zeros(1)}, ref)


def test_overrides_touch_existing_settings_only():
    server = json.load(open(os.path.join(REPO, "jobs/fedavg/app/config/config_fed_server.json")))
    client = json.load(open(os.path.join(REPO, "jobs/fedavg/app/config/config_fed_client.json")))
    configs = {"server": server, "client": client}
    apply_overrides(configs, ["num_rounds=3", "rule_args.lr=0.01", "model.arch=resnet18", "client.data_root=/d"])
    assert server["num_rounds"] == 3
    assert client["executors"][0]["executor"]["args"]["rule_args"]["lr"] == 0.01
    assert server["model"]["arch"] == client["model"]["arch"] == "resnet18"
    assert client["data_root"] == "/d"
    with pytest.raises(ValueError, match="rule_args.lrr"):
        apply_overrides(configs, ["rule_args.lrr=1"])


def test_site_validation_scores_only_the_val_labels_the_site_holds(tmp_path):
    """An unlabelled site's val split annotates nothing: it reports no score (not an F1 of 0) and
    no histograms; a curated val split says so with ``val_curated``."""
    import dataclasses

    from test_reliability import _ready_executor

    from fedpartial.algorithms.fedavg import SupervisedClient
    from fedpartial.data.types import Split

    ex = _ready_executor(SupervisedClient(batch_size=16, augmentation="none"), tmp_path)
    assert ex.evaluate(ex.model) == {}  # 8 val images of 3 classes: no class seen 5 times, nothing to send
    # 48 val images: every class at least 5 times
    ex.data = dataclasses.replace(ex.data, splits={**ex.data.splits,
                                                   "val": ex.data.splits["train"].subset(np.arange(48))})
    scored = ex.evaluate(ex.model)
    assert {"auc", "f1"} <= set(scored) and "val_curated" not in scored
    val = ex.data.splits["val"]
    ex.data.splits["val"] = Split(val.images, np.zeros_like(val.labels), np.zeros_like(val.label_mask))
    assert ex.evaluate(ex.model) == {} and ex.evaluate(ex.model, with_histograms=True) == ({}, None)
    ex.data.splits["val"] = val
    ex.data = dataclasses.replace(ex.data, info={"val_labels": "curated"})
    assert ex.evaluate(ex.model)["val_curated"] == 1.0
