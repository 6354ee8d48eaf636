"""Decision thresholds from the sites' validation histograms: the histograms a site computes, the
site policy's guard on them, and the server's pooled choice, with numbers worked out by hand.
The simulator run that checks the saved model files is in tests/test_model_card.py."""
import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext

from fedpartial.algorithms.thresholds import (DEFAULT_THRESHOLD, HISTOGRAM_KEY, RULE, best_f1_threshold,
                                              check_histograms, choose_thresholds, pool_histograms,
                                              probability_histograms, threshold_meta)
from fedpartial.flare.result_policy import SiteResultPolicy, filter_result


def test_histograms_bin_annotated_entries_only():
    # 20 bins: bin j holds j/20 <= p < (j+1)/20, the last also p = 1
    probs = np.array([[0.0, 0.05], [0.049, 1.0], [0.15, 0.5], [0.97, 0.2]])
    labels = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    mask = np.array([[1, 1], [1, 1], [1, 0], [1, 0]])  # class 1 not annotated in the last two rows
    hist = probability_histograms(probs, labels, mask)
    assert hist["pos"].shape == hist["neg"].shape == (2, 20)
    pos0, neg0 = np.flatnonzero(hist["pos"][0]), np.flatnonzero(hist["neg"][0])
    assert pos0.tolist() == [0, 3] and hist["pos"][0].sum() == 2   # 0.0 -> bin 0, 0.15 -> bin 3
    assert neg0.tolist() == [0, 19] and hist["neg"][0].sum() == 2  # 0.049 -> bin 0, 0.97 -> bin 19
    assert np.flatnonzero(hist["pos"][1]).tolist() == [19] and hist["pos"][1].sum() == 1  # 1.0 -> last bin
    assert np.flatnonzero(hist["neg"][1]).tolist() == [1] and hist["neg"][1].sum() == 1   # 0.05 -> bin 1
    # a class the site does not annotate at all sends two zero rows
    none = probability_histograms(probs, labels, np.c_[mask[:, 0], np.zeros(4)])
    assert none["pos"][1].sum() == none["neg"][1].sum() == 0


def _two_sites():
    """4 bins (edges 0.25 / 0.5 / 0.75), 3 classes. c0 at both sites; c1 at site-1 only (site-2 sent
    zero rows); c2 nowhere."""
    s1 = {"pos": np.array([[0, 1, 0, 4], [1, 2, 1, 0], [0, 0, 0, 0]]),
          "neg": np.array([[3, 2, 1, 0], [3, 0, 0, 0], [0, 0, 0, 0]])}
    s2 = {"pos": np.array([[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]),
          "neg": np.array([[3, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]])}
    return {"site-1": s1, "site-2": s2}


def test_pooled_thresholds_by_hand():
    pooled = pool_histograms(_two_sites())
    # c0 pooled: pos [0,1,1,6] (8), neg [6,3,2,1] (12)
    assert pooled["pos"][0].tolist() == [0, 1, 1, 6] and pooled["neg"][0].tolist() == [6, 3, 2, 1]
    assert pooled["sites"].tolist() == [2, 1, 0]
    # c0: t=0.25 TP 8 FP 6 FN 0 -> 16/22 = 0.727; t=0.5 TP 7 FP 3 FN 1 -> 14/18 = 0.778;
    #     t=0.75 TP 6 FP 1 FN 2 -> 12/15 = 0.8  => 0.75
    assert best_f1_threshold(pooled["pos"][0], pooled["neg"][0]) == (0.75, pytest.approx(0.8))
    # c1 (site-1 only): pos [1,2,1,0], neg [3,0,0,0]: t=0.25 TP 3 FP 0 FN 1 -> 6/7; t=0.5 TP 1 FN 3 -> 2/5;
    #     t=0.75 no TP => 0.25
    assert best_f1_threshold(pooled["pos"][1], pooled["neg"][1]) == (0.25, pytest.approx(6 / 7))
    out = choose_thresholds(pooled, ["c0", "c1", "c2"])
    assert out["thresholds"] == {"c0": 0.75, "c1": 0.25, "c2": DEFAULT_THRESHOLD}
    assert out["per_class"]["c0"] == {"threshold": 0.75, "f1": pytest.approx(0.8), "n_pos": 8, "n_neg": 12,
                                      "sites": 2, "default": False}
    assert out["per_class"]["c2"] == {"threshold": 0.5, "f1": None, "n_pos": 0, "n_neg": 0, "sites": 0,
                                      "default": True}
    # no site at all: every class keeps the default
    assert choose_thresholds(None, ["c0"])["thresholds"] == {"c0": 0.5}


def test_a_class_from_fewer_sites_than_the_floor_publishes_its_threshold_only():
    """With one site's n_pos, the F1 at a known threshold solves to that site's true and false
    positives (an outside attempt counted single images below a threshold this way)."""
    pooled = pool_histograms(_two_sites())  # c0 from 2 sites, c1 from site-1 only, c2 from none
    out = choose_thresholds(pooled, ["c0", "c1", "c2"], min_sites=2)
    assert out["thresholds"] == {"c0": 0.75, "c1": 0.25, "c2": DEFAULT_THRESHOLD}
    assert out["per_class"]["c0"]["n_pos"] == 8 and out["per_class"]["c0"]["f1"] == pytest.approx(0.8)
    assert out["per_class"]["c1"] == {"threshold": 0.25, "f1": None, "n_pos": None, "n_neg": None, "sites": 1,
                                      "default": False}
    source = threshold_meta({**out, "model_round": 0, "validated_at": 1, "sites": 2}, 0)["source"]
    assert "c1: 0.25 from 1 site(s); c2: default" in source and "6/7" not in source
    assert source.endswith("its counts and F1 are not published (fewer sites than the server's "
                           "min_sites_for_shared_stats)")
    assert choose_thresholds(pooled, ["c0", "c1", "c2"], min_sites=3)["per_class"]["c0"]["n_pos"] is None


def test_ties_go_to_the_edge_nearest_one_half_and_no_true_positive_is_default():
    # t=0.25 and t=0.5 both give TP 2 FP 0 FN 0 (F1 1); t=0.75 gives 2/3
    assert best_f1_threshold([0, 0, 1, 1], [1, 0, 0, 0]) == (0.5, 1.0)
    # t=0.5 and t=0.75 both give TP 2 FP 0 FN 0 (F1 1), t=0.25 TP 2 FP 1 (4/5): the higher tied edge is
    # not the one nearest 0.5
    assert best_f1_threshold([0, 0, 0, 2], [1, 1, 0, 0]) == (0.5, 1.0)
    # t=0.25 TP 2 FP 2 FN 0 and t=0.75 TP 1 FP 0 FN 1 both give 2/3 (t=0.5: 2/5), equally far from 0.5:
    # the lower edge
    assert best_f1_threshold([0, 1, 0, 1], [0, 0, 2, 0]) == (0.25, pytest.approx(2 / 3))
    # every positive in the first bin: no inner edge finds one
    assert best_f1_threshold([3, 0, 0, 0], [1, 1, 1, 1]) == (None, 0.0)
    out = choose_thresholds({"pos": np.array([[3, 0, 0, 0]]), "neg": np.array([[1, 1, 1, 1]]),
                             "sites": np.array([1])}, ["c0"])
    assert out["per_class"]["c0"]["default"] and out["thresholds"]["c0"] == 0.5


def test_meta_says_which_model_the_thresholds_describe():
    record = choose_thresholds(pool_histograms(_two_sites()), ["c0", "c1", "c2"])
    record.update(model_round=1, validated_at=2, sites=2)
    own = threshold_meta(record, file_round=1)
    assert set(own) == {"thresholds", "rule", "source"} and own["rule"] == RULE
    assert own["thresholds"] == {"c0": 0.75, "c1": 0.25, "c2": 0.5}
    assert own["source"].startswith("this file's model: the global model of round 1, validated on the sites' "
                                    "val splits at round 2; 2 site(s) sent histograms")
    assert "c0: 8 pos / 12 neg from 2 site(s), F1 0.800" in own["source"]
    assert "c2: default 0.5 (no site released both positives and negatives)" in own["source"]
    later = threshold_meta(record, file_round=2)
    assert later["source"].startswith("latest available, NOT this file's model (the global model of round 2)")
    record["model_round"] = -1
    assert "the initial global model" in threshold_meta(record, 0)["source"]


def test_server_check_refuses_malformed_histograms():
    good = _two_sites()["site-1"]
    assert check_histograms(good, 3)["pos"].dtype == np.int64
    for bad, why in (({"pos": good["pos"]}, "exactly"), ({**good, "extra": good["pos"]}, "exactly"),
                     ({"pos": good["pos"], "neg": good["neg"][:2]}, "shape"),
                     ({"pos": good["pos"] - 1, "neg": good["neg"]}, "non-negative"),
                     ({"pos": good["pos"] + 0.5, "neg": good["neg"]}, "whole")):
        with pytest.raises(ValueError, match=why):
            check_histograms(bad, 3)
    with pytest.raises(ValueError, match="shape"):
        check_histograms(good, 4)


# ---- the site policy ------------------------------------------------------------------------
def _result(hist):
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, 40)
    dxo.set_meta_prop(HISTOGRAM_KEY, hist)
    return dxo


def _site_hist():
    """20 bins, 4 classes: c0 6 pos / 10 neg, c1 3 pos / 10 neg, c2 6 pos / 3 neg, c3 not annotated."""
    pos, neg = np.zeros((4, 20), np.int64), np.zeros((4, 20), np.int64)
    pos[0, [12, 15, 19]] = 2
    pos[1, 18] = 3
    pos[2, [10, 11]] = 3
    neg[0, [1, 2]] = 5
    neg[1, 3] = 10
    neg[2, 0] = 3
    return {"pos": pos, "neg": neg}


def test_policy_withholds_a_class_with_3_positives_and_releases_one_with_6():
    hist = _site_hist()
    _, meta, report = filter_result(DataKind.WEIGHTS, {}, _result(hist).meta, min_count=5)
    out = meta[HISTOGRAM_KEY]
    np.testing.assert_array_equal(out["pos"][0], hist["pos"][0])  # 6 pos, 10 neg: released as sent
    np.testing.assert_array_equal(out["neg"][0], hist["neg"][0])
    for c in (1, 2, 3):  # 3 positives; 3 negatives; nothing: zero rows, the "absent" placeholder
        assert out["pos"][c].sum() == out["neg"][c].sum() == 0, c
    assert report["stats_rows"] == {HISTOGRAM_KEY: 2}  # classes zeroed that held something
    # k = 3: c1 (3 pos) and c2 (3 neg) are released too
    _, meta, _ = filter_result(DataKind.WEIGHTS, {}, _result(hist).meta, min_count=3)
    assert meta[HISTOGRAM_KEY]["pos"].sum(axis=1).tolist() == [6, 3, 6, 0]
    # through the FLARE filter as a site runs it
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    ctx.set_prop(FLContextKey.FILTER_DIRECTION, "out", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=True)
    sent = from_shareable(SiteResultPolicy(min_count=5).process(_result(hist).to_shareable(), ctx))
    assert sent.get_meta_prop(HISTOGRAM_KEY)["pos"].sum(axis=1).tolist() == [6, 0, 0, 0]


def test_single_label_histograms_do_not_give_away_the_withheld_classes_total():
    """Single-label, 30 val images: classes of 12, 10, 6 and 2 images. The 2-image class is withheld,
    and then any released row's pos + neg (30) less the released positives (28) would be 2: the
    smallest released class (6) goes too, so what is hidden is 8 images. Multi-label counts with
    the same per-class positives have no such sum and lose only the 2-image class."""
    counts = [12, 10, 6, 2]
    pos = np.zeros((4, 20), np.int64)
    neg = np.zeros((4, 20), np.int64)
    for c, n in enumerate(counts):
        pos[c, 15] = n
        neg[c, 3] = 30 - n
    _, meta, report = filter_result(DataKind.WEIGHTS, {}, _result({"pos": pos, "neg": neg}).meta, min_count=5)
    assert meta[HISTOGRAM_KEY]["pos"].sum(axis=1).tolist() == [12, 10, 0, 0]
    assert report["stats_rows"] == {HISTOGRAM_KEY: 2}
    multi_neg = neg.copy()
    multi_neg[:, 3] = [20, 25, 24, 28]  # each class over its own annotated images: no common total
    _, meta, _ = filter_result(DataKind.WEIGHTS, {}, _result({"pos": pos, "neg": multi_neg}).meta, min_count=5)
    assert meta[HISTOGRAM_KEY]["pos"].sum(axis=1).tolist() == [12, 10, 6, 0]


def test_policy_withholds_malformed_histograms_whole():
    hist = _site_hist()
    for bad in ({"pos": hist["pos"]}, {**hist, "per_image": np.arange(4)},
                {"pos": hist["pos"] * 0.5, "neg": hist["neg"]},
                {"pos": hist["pos"], "neg": hist["neg"][:, :10]}, [hist["pos"], hist["neg"]]):
        _, meta, report = filter_result(DataKind.WEIGHTS, {}, _result(bad).meta, min_count=5)
        assert HISTOGRAM_KEY not in meta and report["withheld"]["meta"] == [HISTOGRAM_KEY]
    # a validation result (METRICS) carries no histograms
    _, meta, report = filter_result(DataKind.METRICS, {}, {HISTOGRAM_KEY: hist}, min_count=5)
    assert meta == {} and report["unknown"]["meta"] == [HISTOGRAM_KEY]
