"""Aggregation that does not trust blindly: the robust functions by hand, a method rule with the
robust rule, and the FLARE aggregator with a site that claims 10^6 samples and sends 100x weights."""
import json
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms.aggregation import average_weights
from fedpartial.algorithms.base import ServerContext, SiteUpdate
from fedpartial.algorithms.fedavg import FedAvgServer
from fedpartial.algorithms.fedlsm import AWPAServer
from fedpartial.algorithms.robust import (UpdateScreen, coordinate_median, norm_outliers, robust_weights, trim_count,
                                          trimmed_mean, update_norm)
from fedpartial.flare.aggregators import RuleAggregator
from fedpartial.flare.common import SITE_STATS, SITE_TRAIN_SIZE
from helpers import aggregator_fl_ctx


# ----------------------------------------------------------------------------- the functions
def test_coordinate_median_of_three_vectors():
    out = coordinate_median([np.array([1.0, 5.0, 3.0]), np.array([2.0, 0.0, 9.0]), np.array([4.0, 4.0, 4.0])])
    np.testing.assert_array_equal(out, [2.0, 4.0, 4.0])


def test_trimmed_mean_drops_one_value_at_each_end_of_five():
    # trim 0.2 of 5 sites = 1 per end. Coordinate 0: sorted [1, 2, 3, 4, 100] -> (2+3+4)/3 = 3;
    # coordinate 1: sorted [-50, 0, 1, 2, 3] -> (0+1+2)/3 = 1
    vectors = [np.array(v, float) for v in ([100, 0], [1, 3], [2, -50], [3, 1], [4, 2])]
    np.testing.assert_allclose(trimmed_mean(vectors, 0.2), [3.0, 1.0])
    # 0.2 of 4 sites trims nothing: the plain mean
    np.testing.assert_allclose(trimmed_mean(vectors[:4], 0.2), [26.5, -11.5])
    assert (trim_count(5, 0.2), trim_count(4, 0.2), trim_count(4, 0.25), trim_count(10, 0.3)) == (1, 0, 1, 3)
    with pytest.raises(ValueError, match="trim_fraction"):
        trim_count(4, 0.5)


def test_robust_weights_round_integer_buffers_and_keep_dtypes():
    sites = [{"w": np.array([1.0, 8.0], np.float32), "n": np.array(10)},
             {"w": np.array([2.0, 6.0], np.float32), "n": np.array(11)},
             {"w": np.array([9.0, 7.0], np.float32), "n": np.array(13)}]
    out = robust_weights(sites, "median")
    np.testing.assert_array_equal(out["w"], [2.0, 7.0])
    assert out["w"].dtype == np.float32 and out["n"] == 11 and out["n"].dtype == np.array(10).dtype
    # trim 0.34 of 3 = 1 per end: the median again
    np.testing.assert_array_equal(robust_weights(sites, "trimmed_mean", 0.34)["w"], [2.0, 7.0])
    with pytest.raises(ValueError, match="'mode'"):
        robust_weights(sites, "mode")


def test_update_norm_over_float_parameters_only():
    ref = {"w": np.array([1.0, 1.0]), "steps": np.array(5)}
    # (4-1, 5-1) = (3, 4) -> 5; the integer counter moved by 1000 and is left out
    assert update_norm({"w": np.array([4.0, 5.0]), "steps": np.array(1005)}, ref) == pytest.approx(5.0)


def test_norm_rejection_with_known_norms():
    # median of [5, 6, 10, 500] = 8; 10 x 8 = 80: only the 500 goes
    median, out = norm_outliers({"a": 5.0, "b": 6.0, "c": 10.0, "d": 500.0}, 10.0)
    assert median == 8.0 and out == {"d": 500.0}
    # two sites: the larger norm is below twice their median, whatever the ratio >= 2
    assert norm_outliers({"a": 1.0, "b": 1000.0}, 2.0)[1] == {}
    # median 0 gives no scale; None turns the check off
    assert norm_outliers({"a": 0.0, "b": 0.0, "c": 3.0}, 10.0) == (0.0, {})
    assert norm_outliers({"a": 5.0, "b": 6.0, "c": 10.0, "d": 500.0}, None)[1] == {}


def test_screen_rejects_by_norm_and_keeps_sites_without_samples():
    zero = {"w": np.zeros(2)}
    ups = [SiteUpdate("a", {"w": np.array([3.0, 4.0])}, 10), SiteUpdate("b", {"w": np.array([0.0, 6.0])}, 10),
           SiteUpdate("c", {"w": np.array([6.0, 8.0])}, 10), SiteUpdate("d", {"w": np.array([300.0, 400.0])}, 10),
           SiteUpdate("idle", {"w": np.zeros(2)}, 0)]  # not measured: it would pull the median to 0
    kept, rejected, report = UpdateScreen(max_norm_ratio=10.0).screen(ups, zero)
    assert [u.site for u in kept] == ["a", "b", "c", "idle"]
    assert list(rejected) == ["d"] and "500" in rejected["d"] and "median norm 8" in rejected["d"]
    assert report["median_norm"] == 8.0 and set(report["update_norms"]) == {"a", "b", "c", "d"}
    with pytest.raises(ValueError, match="max_norm_ratio"):
        UpdateScreen(max_norm_ratio=1.0)


def test_capped_counts_at_the_first_reported_train_size():
    screen = UpdateScreen()
    assert screen.pin("s1", 120, 100) is None
    up = SiteUpdate("s1", {}, 10 ** 6)
    assert "capped to 120" in screen.cap(up) and up.num_samples == 120
    honest = SiteUpdate("s1", {}, 120)
    assert screen.cap(honest) is None and honest.num_samples == 120
    # a later, larger train size does not lift the cap
    assert "first is kept" in screen.pin("s1", 5000, 10)
    assert screen.train_sizes["s1"] == 120
    # a site that reports no train size: its first positive sample count is the cap
    assert screen.pin("s2", None, 0) is None and "s2" not in screen.train_sizes
    screen.pin("s2", None, 50)
    up = SiteUpdate("s2", {}, 80)
    screen.cap(up)
    assert up.num_samples == 50
    # off: counts as sent
    off = UpdateScreen(cap_samples=False)
    off.pin("s1", 120, 100)
    up = SiteUpdate("s1", {}, 10 ** 6)
    assert off.cap(up) is None and up.num_samples == 10 ** 6


# ----------------------------------------------------------------------------- in the method rules
def test_average_weights_median_ignores_counts_and_sites_without_samples():
    ups = [SiteUpdate("a", {"w": np.array([1.0])}, 1), SiteUpdate("b", {"w": np.array([2.0])}, 1),
           SiteUpdate("c", {"w": np.array([30.0])}, 1000), SiteUpdate("z", {"w": np.array([99.0])}, 0)]
    ctx = ServerContext(0, 1, [], weight_rule="median")
    np.testing.assert_array_equal(average_weights(ups, ctx)["w"], [2.0])  # median of 1, 2, 30
    assert ctx.report["weight_rule"] == {"rule": "median", "sites": ["a", "b", "c"]}
    # the default: weighted by count, (1 + 2 + 30000) / 1002
    plain = ServerContext(0, 1, [])
    np.testing.assert_allclose(FedAvgServer().aggregate(ups, plain)[0]["w"], [30003 / 1002])
    assert "weight_rule" not in plain.report


def test_fedlsm_median_covers_the_body_and_awpa_keeps_the_classifier_rows():
    def site(name, scale, counts, n):
        rows = np.array([scale + 2 * c for c in range(3)], np.float32)
        return SiteUpdate(name, {"body.w": np.full(2, 10.0 * scale, np.float32), "fc.bias": rows}, n,
                          {"class_counts": np.array(counts, float)})
    ups = [site("A", 1, [30, 0, 0], 100), site("B", 3, [30, 5, 0], 300), site("C", 5, [0, 15, 0], 1000)]
    ctx = ServerContext(0, 2, ["fc.bias"], weight_rule="median")
    weights, _ = AWPAServer().aggregate(ups, ctx)
    # body: median of 10, 30, 50 = 30 (weighted it would be (1000 + 9000 + 50000) / 1400 = 42.86)
    np.testing.assert_allclose(weights["body.w"], [30.0, 30.0])
    # rows by AWPA: class 0 30/60*1 + 30/60*3 = 2; class 1 5/20*5 + 15/20*7 = 6.5;
    # class 2 (no counts) falls back to sizes: (100*5 + 300*7 + 1000*9) / 1400
    np.testing.assert_allclose(weights["fc.bias"], [2.0, 6.5, 11600 / 1400], rtol=1e-6)


# ----------------------------------------------------------------------------- the FLARE aggregator
def _ctx(tmp_path, round_num=0, global_weights=None):
    return aggregator_fl_ctx(tmp_path, round_num, global_weights)


def _update(site, w, n, train_size, round_num=0):
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.asarray(w, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(SITE_STATS, {})
    if train_size is not None:
        dxo.set_meta_prop(SITE_TRAIN_SIZE, train_size)
    s = dxo.to_shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_num)
    return s


@pytest.fixture
def patched_engine():
    with mock.patch.object(FLContext, "get_engine", lambda self: self.get_prop("__engine__")):
        yield


HONEST = [("site-1", [1.0, 2.0], 10), ("site-2", [2.0, 1.0], 20), ("site-3", [1.5, 1.5], 30)]


def test_attacker_with_a_million_samples_and_100x_weights_is_capped_and_rejected(patched_engine, tmp_path):
    agg = RuleAggregator()  # the defaults: cap on, max_norm_ratio 10, weighted mean
    glob = {"w": np.zeros(2, np.float32)}
    for round_num in (0, 1):
        ctx = _ctx(tmp_path, round_num, glob)
        for site, w, n in HONEST:
            assert agg.accept(_update(site, w, n, n, round_num), ctx)
        # round 0 it reports its true train size (40) with the lie; round 1 it claims 10^6 images too
        attacker_size = 40 if round_num == 0 else 10 ** 6
        with mock.patch.object(agg, "log_error") as err:
            assert agg.accept(_update("site-4", [100.0, 200.0], 10 ** 6, attacker_size, round_num), ctx)
            out = from_shareable(agg.aggregate(ctx)).data["w"]
        agg.reset(ctx)
        # honest aggregate: (10*[1, 2] + 20*[2, 1] + 30*[1.5, 1.5]) / 60 = [1.5833, 1.4167]
        np.testing.assert_allclose(out, [95 / 60, 85 / 60], atol=1e-6)
        logged = " ".join(c[0][1] for c in err.call_args_list)
        # norms: site-1..3 sqrt(5), sqrt(5), sqrt(4.5); site-4 sqrt(100^2 + 200^2) = 223.6; median sqrt(5)
        assert "site 'site-4'" in logged and "223.607" in logged and "2.23607" in logged
    rounds = json.load(open(tmp_path / "metrics.json"))["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    for r in rounds:
        trust = r["server"]["trust"]
        assert set(trust["rejected"]) == {"site-4"} and "update norm 223.607" in trust["rejected"]["site-4"]
        assert "capped to 40" in trust["capped"]["site-4"]
        assert trust["train_sizes"] == {"site-1": 10, "site-2": 20, "site-3": 30, "site-4": 40}
        assert trust["update_norms"]["site-4"] == pytest.approx(223.6068, rel=1e-6)
        assert "site-4" not in r["sites"] and r["rejected"] == trust["rejected"]
        assert r["server"]["weights"] == pytest.approx({"site-1": 1 / 6, "site-2": 1 / 3, "site-3": 0.5})


def test_a_round_left_with_too_few_updates_fails_naming_the_rejected_site(patched_engine, tmp_path):
    agg = RuleAggregator(min_valid_updates=4)
    ctx = _ctx(tmp_path, 0, {"w": np.zeros(2, np.float32)})
    for site, w, n in HONEST:
        agg.accept(_update(site, w, n, n), ctx)
    agg.accept(_update("site-4", [100.0, 200.0], 40, 40), ctx)
    with pytest.raises(RuntimeError, match=r"only 3 valid update.*4 needed.*site-4: update norm 223.607"):
        agg.aggregate(ctx)


def test_aggregator_median_rule_and_cap_survive_a_server_restart(patched_engine, tmp_path):
    glob = {"w": np.zeros(2, np.float32)}
    agg = RuleAggregator(max_norm_ratio=None, weight_rule="median")
    ctx = _ctx(tmp_path, 0, glob)
    for site, w, n in HONEST:
        agg.accept(_update(site, w, n, n), ctx)
    out = from_shareable(agg.aggregate(ctx)).data["w"]
    np.testing.assert_allclose(out, [1.5, 1.5])  # medians of (1, 2, 1.5) and (2, 1, 1.5)
    assert json.load(open(tmp_path / "metrics.json"))["rounds"][0]["server"]["weight_rule"]["rule"] == "median"
    # a new aggregator (server resumed at round 1) reads the pinned sizes back from metrics.json
    resumed = RuleAggregator()
    ctx = _ctx(tmp_path, 1, glob)
    assert resumed.accept(_update("site-1", [1.0, 2.0], 500, 500, round_num=1), ctx)
    assert resumed.updates[0].num_samples == 10 and "capped to 10" in resumed.capped["site-1"]


def test_aggregator_refuses_unknown_rule_or_trim():
    with pytest.raises(ValueError, match="weight_rule 'mode'"):
        RuleAggregator(weight_rule="mode")
    with pytest.raises(ValueError, match="trim_fraction"):
        RuleAggregator(weight_rule="trimmed_mean", trim_fraction=0.5)
