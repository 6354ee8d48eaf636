"""Unit tests of FedMLP: hand-worked numbers for every helper, the server rule, and the client's
stage switch and persistent tags on a tiny model."""
import math

import numpy as np
import pytest
import torch

from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext, SiteUpdate
from fedpartial.algorithms.fedmlp import (FedMLPClient, FedMLPServer, average_prototypes, class_prototypes,
                                          consistency_loss, global_learning_degree, learning_degree, logit_adjustment,
                                          loss_entries, positive_rates, positive_tag_budget, prototype_scores,
                                          select_tags, wpc_loss, class_prevalence, prior_rates, prototype_sources,
                                          warmup_complete, check_positive_tags, positive_tag_gate, PAPER_CLIENT,
                                          PAPER_SERVER, RELEASED_CODE_CLIENT)
from fedpartial.algorithms import fedmlp
from fedpartial.data.types import DataError, Dataset, Split
from fedpartial.models import build_model
from fedpartial.training.common import predict


# ---------------------------------------------------------------------------------------------
# logit adjustment and WPC
# ---------------------------------------------------------------------------------------------

def test_positive_rates_over_used_entries_only():
    targets = torch.tensor([[1., 0., 0.], [0., 0., 0.], [1., 1., 0.], [0., 0., 0.]])
    mask = torch.tensor([[1., 0., 0.], [1., 0., 0.], [1., 1., 0.], [1., 0., 0.]])
    # class 0: 2 positives of 4 annotated = 0.5; class 1: 1 of 1 = 1.0; class 2: no entry -> 0.5
    assert positive_rates(targets, mask).tolist() == [0.5, 1.0, 0.5]


def test_logit_adjustment_matches_eq3():
    # pi1 = 0.2: offset = log(0.2 / 0.8) = log(0.25) = -1.386294
    off = logit_adjustment(torch.tensor([0.2, 0.5, 1.0]), tau=1.0, eps=1e-3)
    assert off[0].item() == pytest.approx(-1.386294, abs=1e-5)
    assert off[1].item() == pytest.approx(0.0, abs=1e-7)  # balanced class: no adjustment
    assert off[2].item() == pytest.approx(math.log(0.999 / 0.001), abs=1e-4)  # clipped to 1 - eps: 6.9068
    # Eq. 3 in probability form at z = 0: p = 0.5, p' = 0.5*0.2 / (0.5*0.2 + 0.5*0.8) = 0.2
    assert torch.sigmoid(torch.tensor(0.0) + off[0]).item() == pytest.approx(0.2, abs=1e-6)
    # tau scales the offset (Eq. 2): tau = 2 -> 2 * log(0.25)
    assert logit_adjustment(torch.tensor([0.2]), tau=2.0)[0].item() == pytest.approx(-2.772589, abs=1e-5)


def test_wpc_ignores_missing_classes():
    logits = torch.tensor([[0.0, 100.0]], requires_grad=True)
    targets = torch.tensor([[1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])  # class 1 is missing (its 0 label is not a negative)
    loss = wpc_loss(logits, targets, mask)
    assert loss.item() == pytest.approx(math.log(2.0), abs=1e-6)  # -log(sigmoid(0)) = 0.693147
    loss.backward()
    assert logits.grad[0, 1].item() == 0.0  # no gradient reaches the missing class
    assert logits.grad[0, 0].item() == pytest.approx(-0.5, abs=1e-6)  # sigmoid(0) - 1
    # with pi1 = 0.2 on class 0: -log(sigmoid(0 + log 0.25)) = -log(0.2) = 1.609438
    offset = logit_adjustment(torch.tensor([0.2, 0.5]))
    assert wpc_loss(logits, targets, mask, offset).item() == pytest.approx(1.609438, abs=1e-5)


def test_consistency_loss_on_masked_entries():
    student = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0], [0.0, 50.0]])  # probs 0.75 and ~1
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    # only entry (0,0): (0.5 - 0.75)^2 = 0.0625
    assert consistency_loss(student, teacher, mask).item() == pytest.approx(0.0625, abs=1e-6)
    assert consistency_loss(student, teacher, torch.zeros(2, 2)).item() == 0.0


# ---------------------------------------------------------------------------------------------
# prototypes, learning degree, Z, tagging
# ---------------------------------------------------------------------------------------------

def test_class_prototypes_of_known_batch():
    feats = np.array([[1., 0.], [3., 0.], [0., 2.], [0., 4.]])
    labels = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0]], dtype=np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=bool)
    p_neg, p_pos, n_neg, n_pos = class_prototypes(feats, labels, mask)
    # class 0: positives rows 0,1 -> (2,0); negatives rows 2,3 -> (0,3)
    np.testing.assert_allclose(p_pos[0], [2., 0.])
    np.testing.assert_allclose(p_neg[0], [0., 3.])
    # class 1 (row 3 not annotated): positive row 2 -> (0,2); negatives rows 0,1 -> (2,0)
    np.testing.assert_allclose(p_pos[1], [0., 2.])
    np.testing.assert_allclose(p_neg[1], [2., 0.])
    # class 2 annotated nowhere: zero rows, zero counts
    np.testing.assert_allclose(p_pos[2], [0., 0.])
    np.testing.assert_allclose(n_neg, [2., 2., 0.])
    np.testing.assert_allclose(n_pos, [2., 1., 0.])


def test_learning_degree():
    probs = np.array([[0.1, 0.9], [0.5, 0.9], [0.8, 0.9], [0.3, 0.9]])
    # class 0: 0.1 < L and 0.8 > R count; 0.5 and 0.3 (not < 0.3) do not -> 2/4
    # class 1: not annotated -> 0 even though all are confident
    np.testing.assert_allclose(learning_degree(probs, np.array([True, False]), 0.3, 0.7), [0.5, 0.0])


def test_prototype_scores():
    feats = torch.tensor([[1., 0.], [0., 1.], [1., 1.], [2., 1.], [1., 3.]])
    z = prototype_scores(feats, torch.tensor([[1., 0.]]), torch.tensor([[0., 5.]]))  # P1 length does not matter
    # Z = cos(f,P0) - cos(f,P1): 1-0, 0-1, 0.7071-0.7071, 2/sqrt5 - 1/sqrt5, 1/sqrt10 - 3/sqrt10
    np.testing.assert_allclose(z[:, 0].numpy(), [1.0, -1.0, 0.0, 0.447214, -0.632456], atol=1e-5)


def test_rank_based_tagging_and_residuals():
    z = torch.tensor([0.9, 0.5, 0.0, 0.1, -0.2, -0.8, -0.5, 0.3, 0.7, -0.1, 0.95]).unsqueeze(1)
    candidate = torch.ones_like(z, dtype=torch.bool)
    candidate[10, 0] = False  # e.g. annotated or already tagged: never re-ranked
    # Z >= 0 among candidates: 0.9,0.5,0.0,0.1,0.3,0.7 (6) -> floor(0.5*6) = 3 largest: idx 0, 8, 1
    # Z <  0: -0.2,-0.8,-0.5,-0.1 (4) -> floor(0.5*4) = 2 smallest: idx 5, 6
    neg, pos = select_tags(z, candidate, [0.5], [0.5])
    assert torch.nonzero(neg[:, 0]).flatten().tolist() == [0, 1, 8]
    assert torch.nonzero(pos[:, 0]).flatten().tolist() == [5, 6]
    # next round ranks only the residual: Z>=0 left 0.0,0.1,0.3 -> floor(0.4*3)=1: idx 7 (0.3)
    # Z<0 left -0.2,-0.1 -> floor(0.4*2) = 0: none
    candidate2 = candidate & ~neg & ~pos
    neg2, pos2 = select_tags(z, candidate2, [0.4], [0.4])
    assert torch.nonzero(neg2[:, 0]).flatten().tolist() == [7]
    assert pos2.sum().item() == 0
    # paper default T0 = 0.5 %: floor(0.005 * 6) = 0 -> nothing on a tiny site
    assert select_tags(z, candidate, [0.005], [0.01])[0].sum().item() == 0
    # a cap of 1 new positive keeps only the smallest Z (idx 5, -0.8) of the 2 the rank rule picks
    _, capped = select_tags(z, candidate, [0.5], [0.5], max_pos=[1])
    assert torch.nonzero(capped[:, 0]).flatten().tolist() == [5]
    assert select_tags(z, candidate, [0.5], [0.5], max_pos=[0])[1].sum().item() == 0


def test_prevalence_from_annotating_sites_and_the_positive_tag_budget():
    # class 0: site A 3 pos / 27 neg, site B 1 pos / 9 neg -> 4 / 40 = 0.1
    # class 1: only site B annotates it (A's counts are ignored): 5 / (5 + 15) = 0.25
    # class 2: annotated nowhere -> unknown (-1)
    prevalence = class_prevalence([np.array([3, 7, 0]), np.array([1, 5, 0])], [np.array([27, 1, 0]), np.array([9, 15, 0])],
                                  [np.array([True, False, False]), np.array([True, True, False])])
    np.testing.assert_allclose(prevalence, [0.1, 0.25, -1.0])
    # a site of 50 samples expects 5 positives of class 0 and 12.5 -> 12 (round half to even) of class 1;
    # it holds 2 and 12 positive tags: 3 and 0 more; class 2 unknown: no cap
    budget = positive_tag_budget(prevalence, 50, np.array([2, 12, 40]))
    assert budget[:2].tolist() == [3, 0] and budget[2] > 10**6
    assert positive_tag_budget(prevalence, 50, np.array([0, 0, 0]), scale=2.0)[:2].tolist() == [10, 25]


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------

def _site_stats(p_neg, p_pos, n_neg, n_pos, degree, annotated):
    return {"prototypes_neg": np.array(p_neg, dtype=np.float32), "prototypes_pos": np.array(p_pos, dtype=np.float32),
            "prototype_counts_neg": np.array(n_neg, dtype=np.float64),
            "prototype_counts_pos": np.array(n_pos, dtype=np.float64),
            "learning_degree": np.array(degree, dtype=np.float64), "annotated": np.array(annotated, dtype=bool)}


def _three_sites():
    z = [0., 0.]
    # site A (10 samples) annotates class 0; B (30) classes 0 and 1; C (20) class 1 from 1 positive only
    a = SiteUpdate("site-A", {"w": np.array([1.0])}, 10, _site_stats(
        [[1, 0], z, z], [[0, 1], z, z], [5, 0, 0], [5, 0, 0], [0.8, 0, 0], [1, 0, 0]))
    b = SiteUpdate("site-B", {"w": np.array([2.0])}, 30, _site_stats(
        [[3, 0], [1, 1], z], [[0, 3], [0, 2], z], [9, 9, 0], [9, 5, 0], [0.4, 0.6, 0], [1, 1, 0]))
    c = SiteUpdate("site-C", {"w": np.array([4.0])}, 20, _site_stats(
        [z, [3, 3], z], [z, [0, 8], z], [0, 7, 0], [0, 1, 0], [0, 0.9, 0], [0, 1, 0]))
    return [a, b, c]


def _server_ctx(c=3, d=2):
    return ServerContext(round=5, num_rounds=10, classifier_param_names=["fc.weight", "fc.bias"],
                         global_weights={"fc.weight": np.zeros((c, d)), "fc.bias": np.zeros(c)}, log=lambda m: None)


def test_global_prototypes_only_from_annotating_sites():
    updates = _three_sites()
    weights, gs = FedMLPServer(t0=0.005, t1=0.01, min_prototype_samples=1).aggregate(updates, _server_ctx())
    assert weights["w"][0] == pytest.approx((10 * 1 + 30 * 2 + 20 * 4) / 60)  # FedAvg: 2.5
    # class 0 negatives: A (1,0) w10 and B (3,0) w30 -> (10 + 90)/40 = 2.5; C's zero row is not averaged in
    np.testing.assert_allclose(gs["prototypes_neg"][0], [2.5, 0.0])
    # class 1 positives: B (0,2) w30, C (0,8) w20 -> (60 + 160)/50 = 4.4
    np.testing.assert_allclose(gs["prototypes_pos"][1], [0.0, 4.4], rtol=1e-6)
    # class 1 negatives: B (1,1) w30, C (3,3) w20 -> (30+60)/50 = 1.8
    np.testing.assert_allclose(gs["prototypes_neg"][1], [1.8, 1.8], rtol=1e-6)
    # class 2 annotated nowhere: invalid, zero rows, no NaN
    assert gs["prototype_valid"].tolist() == [True, True, False]
    np.testing.assert_array_equal(gs["prototypes_pos"][2], [0.0, 0.0])
    # d^G: class 0 (10*0.8 + 30*0.4)/40 = 0.5 ; class 1 (30*0.6 + 20*0.9)/50 = 0.72 ; class 2: 0
    np.testing.assert_allclose(gs["learning_degree"], [0.5, 0.72, 0.0])
    np.testing.assert_allclose(gs["tau0"], [0.0025, 0.0036, 0.0])
    np.testing.assert_allclose(gs["tau1"], [0.005, 0.0072, 0.0])
    assert gs["stage"] == 2 and gs["t0"] == 0.005 and gs["t1"] == 0.01
    for v in gs.values():
        assert np.isfinite(np.asarray(v, dtype=np.float64)).all()


def test_min_prototype_samples_drops_small_prototypes():
    updates = _three_sites()
    _, gs = FedMLPServer(min_prototype_samples=2).aggregate(updates, _server_ctx())
    # C's class-1 positive prototype comes from 1 sample -> absent: B alone -> (0, 2)
    np.testing.assert_allclose(gs["prototypes_pos"][1], [0.0, 2.0])
    # with min 6: class 0 positives from A (5) dropped -> B (0,3); class 1 positives: B 5, C 1 -> none valid
    _, gs = FedMLPServer(min_prototype_samples=6).aggregate(updates, _server_ctx())
    np.testing.assert_allclose(gs["prototypes_pos"][0], [0.0, 3.0])
    assert gs["prototype_valid"].tolist() == [True, False, False]


def test_classifier_rows_annotated_averages_each_row_over_its_annotating_sites():
    # site A (10 samples) annotates class 0, B (30) classes 0 and 1; class 2 is annotated nowhere
    a = SiteUpdate("site-A", {"fc.weight": np.array([[1.0, 1.0], [5.0, 5.0], [1.0, 1.0]]),
                              "fc.bias": np.array([1.0, 5.0, 1.0]), "w": np.array([1.0])}, 10,
                   {"annotated_classes": np.array([1.0, 0.0, 0.0])})
    b = SiteUpdate("site-B", {"fc.weight": np.array([[3.0, 3.0], [2.0, 2.0], [3.0, 3.0]]),
                              "fc.bias": np.array([3.0, 2.0, 3.0]), "w": np.array([3.0])}, 30,
                   {"annotated_classes": np.array([1.0, 1.0, 0.0])})
    ctx = _server_ctx()
    server = FedMLPServer(classifier_rows="annotated")
    for u in (a, b):
        server.check_stats(u, ctx)
    weights, gs = server.aggregate([a, b], ctx)
    # row 0: A and B by size (10*1 + 30*3)/40 = 2.5; row 1: B alone = 2 (FedAvg would give 2.75);
    # row 2: nowhere annotated -> FedAvg 2.5; the body stays FedAvg: (10*1 + 30*3)/40 = 2.5
    np.testing.assert_allclose(weights["fc.weight"][:, 0], [2.5, 2.0, 2.5])
    np.testing.assert_allclose(weights["fc.bias"], [2.5, 2.0, 2.5])
    assert weights["w"][0] == pytest.approx(2.5) and gs["stage"] == 1
    plain, _ = FedMLPServer().aggregate([a, b], ctx)
    np.testing.assert_allclose(plain["fc.bias"], [2.5, 2.75, 2.5])  # the paper's rule: FedAvg
    with pytest.raises(ValueError, match="annotated_classes.*site-C"):
        server.check_stats(SiteUpdate("site-C", a.weights, 10, {}), ctx)
    with pytest.raises(ValueError, match="annotated_classes.*site-C"):
        server.check_stats(SiteUpdate("site-C", a.weights, 10, {"annotated_classes": np.array([1.0, 0.5])}), ctx)
    with pytest.raises(ValueError, match="classifier_rows 'masked' unknown"):
        FedMLPServer(classifier_rows="masked")


def test_loss_entries_weights_untagged_missing_entries_as_assumed_negatives():
    labels = np.array([[1, 0, 0], [0, 1, 1]], dtype=np.float32)
    label_mask = np.array([[True, False, False], [True, False, False]])  # class 0 annotated only
    tags = np.array([[-1, 1, -1], [-1, -1, 0]], dtype=np.int8)  # (0,1) tagged positive, (1,2) negative
    targets, weights, cr = loss_entries(labels, label_mask, tags)
    # the hidden labels of the missing classes (row 1: 1, 1) are never read; untagged -> 0
    np.testing.assert_array_equal(targets, [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(weights, [[1, 1, 0], [1, 0, 1]])  # paper: untagged missing left out
    np.testing.assert_array_equal(cr, [[0, 0, 1], [0, 1, 0]])
    _, weights, cr2 = loss_entries(labels, label_mask, tags, assumed_negative_weight=0.25)
    np.testing.assert_array_equal(weights, [[1, 1, 0.25], [1, 0.25, 1]])
    np.testing.assert_array_equal(cr2, cr)
    # the WPC term with these weights on logits 0: every entry costs ln 2, so the weighted mean
    # is ln 2 whatever the weights
    loss = wpc_loss(torch.zeros(2, 3), torch.from_numpy(targets), torch.from_numpy(weights))
    assert float(loss) == pytest.approx(np.log(2.0), rel=1e-6)
    # logits +1 on the assumed negatives only: their BCE is ln(1 + e) = 1.3133, weight 0.25 each;
    # 4 entries at ln 2 -> (4 ln 2 + 0.5 * 1.3133) / 4.5
    logits = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    loss = wpc_loss(logits, torch.from_numpy(targets), torch.from_numpy(weights))
    assert float(loss) == pytest.approx((4 * np.log(2.0) + 0.5 * np.log1p(np.e)) / 4.5, rel=1e-6)
    with pytest.raises(ValueError, match="assumed_negative_weight"):
        FedMLPClient(assumed_negative_weight=2.0)


def test_average_helpers_directly():
    protos, valid = average_prototypes([np.array([[2.0]]), np.array([[4.0]])], [np.array([1.0]), np.array([1.0])],
                                       [np.array([True]), np.array([True])], [1.0, 3.0])
    assert protos[0, 0] == pytest.approx(3.5) and valid.tolist() == [True]  # (2 + 12) / 4
    d = global_learning_degree([np.array([0.2]), np.array([1.0])], [np.array([False]), np.array([True])], [5, 5])
    assert d.tolist() == [1.0]


def test_server_warmup_rounds_and_check_stats():
    server = FedMLPServer()
    ctx = _server_ctx()
    plain = [SiteUpdate("site-1", {"w": np.array([1.0])}, 5), SiteUpdate("site-2", {"w": np.array([3.0])}, 15)]
    for u in plain:
        server.check_stats(u, ctx)  # warm-up: no stats is fine
    weights, gs = server.aggregate(plain, ctx)
    assert weights["w"][0] == pytest.approx(2.5) and gs["stage"] == 1 and "prototypes_neg" not in gs

    good = _three_sites()[0]
    server.check_stats(good, ctx)
    bad = SiteUpdate("site-X", good.weights, 10, dict(good.stats))
    bad.stats["learning_degree"] = np.array([0.5, np.nan, 0.0])
    with pytest.raises(ValueError, match="learning_degree.*site-X"):
        server.check_stats(bad, ctx)
    bad.stats = dict(good.stats, prototypes_pos=np.zeros((3, 4), dtype=np.float32))  # D=4, model says 2
    with pytest.raises(ValueError, match="prototypes_pos"):
        server.check_stats(bad, ctx)
    bad.stats = dict(good.stats, prototype_counts_neg=np.zeros(2))
    with pytest.raises(ValueError, match="prototype_counts_neg"):
        server.check_stats(bad, ctx)
    bad.stats = {k: v for k, v in good.stats.items() if k != "annotated"}
    with pytest.raises(ValueError, match="annotated"):
        server.check_stats(bad, ctx)
    bad.stats = dict(good.stats, prototypes_neg=np.full((3, 2), np.inf, dtype=np.float32))
    with pytest.raises(ValueError, match="prototypes_neg"):
        server.check_stats(bad, ctx)


# ---------------------------------------------------------------------------------------------
# client: stage switch, stats, persistent tags
# ---------------------------------------------------------------------------------------------

N, C = 40, 3


def _site_data(annotated=(0,)):
    rng = np.random.default_rng(0)
    labels = (rng.random((N, C)) < 0.4).astype(np.float32)
    images = rng.integers(0, 60, size=(N, 8, 8), dtype=np.uint8)
    images[labels[:, 1] > 0, :4, :] += 150  # make class 1 visible
    mask = np.zeros((N, C), dtype=bool)
    mask[:, list(annotated)] = True
    site_labels = labels * mask
    data = Dataset("multi-label", ["a", "b", "c"], {"train": Split(images, site_labels, mask)}, source="mem",
                   site="site-1")
    reference = Dataset("multi-label", ["a", "b", "c"], {"train": Split(images, labels, np.ones_like(mask))})
    return data, reference


def _ctx(tmp_path, data, reference=None):
    return ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=str(tmp_path / "state"),
                         seed=3, log=lambda m: None, reference=reference)


def _model():
    torch.manual_seed(0)
    return build_model("small_cnn", C, 1, width=4, depth=1)


def _client(**kw):
    args = dict(warmup_rounds=2, lr=1e-3, batch_size=16, num_views=2)
    args.update(kw)
    return FedMLPClient(**args)


def _handmade_global_stats(model, client):
    """Global stats whose prototypes are the site's own class-0 prototypes for every class."""
    stats = client.local_stats(model)
    p_neg = np.repeat(stats["prototypes_neg"][:1], C, axis=0)
    p_pos = np.repeat(stats["prototypes_pos"][:1], C, axis=0)
    return {"stage": 2, "prototypes_neg": p_neg, "prototypes_pos": p_pos, "prototype_valid": np.ones(C, bool),
            "learning_degree": np.ones(C), "tau0": np.full(C, 0.5), "tau1": np.full(C, 0.5), "t0": 0.25, "t1": 0.25}


def test_stage_switch_at_warmup_rounds(tmp_path):
    data, _ = _site_data()
    client = _client(warmup_rounds=2)
    client.setup(_ctx(tmp_path, data))
    model = _model()
    r0 = client.train_round(model, RoundInput(round=0, num_rounds=4))
    # warm-up sends only which classes the site's ground truth trains (classifier_rows="annotated")
    assert r0.metrics["stage"] == 1 and set(r0.stats) == {"annotated_classes"} and r0.num_samples == N
    assert r0.stats["annotated_classes"].tolist() == [1.0, 0.0, 0.0]
    assert r0.metrics["loss_cr"] == 0.0 and r0.metrics["train_steps"] == 2  # 40 samples, batch 16, drop last
    r1 = client.train_round(model, RoundInput(round=1, num_rounds=4))
    # last warm-up round: still stage 1 but stats are sent (Algorithm 1, t = t1)
    assert r1.metrics["stage"] == 1 and set(r1.stats) == {"prototypes_neg", "prototypes_pos", "prototype_counts_neg",
                                                          "prototype_counts_pos", "learning_degree", "annotated",
                                                          "annotated_classes"}
    assert r1.stats["annotated"].tolist() == [True, False, False]
    assert r1.stats["prototype_counts_neg"][1:].tolist() == [0, 0]
    assert r1.stats["learning_degree"][1:].tolist() == [0, 0]
    assert r1.stats["prototype_counts_neg"][0] + r1.stats["prototype_counts_pos"][0] == N
    FedMLPServer().check_stats(SiteUpdate("site-1", {}, N, r1.stats), ServerContext(1, 4, ["fc.weight", "fc.bias"]))
    gs = _handmade_global_stats(model, client)
    r2 = client.train_round(model, RoundInput(round=2, num_rounds=4, global_stats=gs))
    assert r2.metrics["stage"] == 2 and r2.metrics["loss_cr"] > 0.0  # untagged missing entries are regularised
    assert r2.metrics["global_prototypes_valid"] == C


def test_tags_persist_across_restart(tmp_path):
    data, reference = _site_data()
    ctx = _ctx(tmp_path, data, reference)
    client = _client(warmup_rounds=1)
    client.setup(ctx)
    model = _model()
    gs = _handmade_global_stats(model, client)
    # expected tags from the received model's features: per missing class floor(0.5 * #Z>=0) + floor(0.5 * #Z<0)
    _, feats = predict(model, client.images, torch.device("cpu"), with_features=True)
    z = prototype_scores(feats, torch.as_tensor(gs["prototypes_neg"]), torch.as_tensor(gs["prototypes_pos"]))
    n_nonneg = int((z[:, 1] >= 0).sum())
    r1 = client.train_round(model, RoundInput(round=1, num_rounds=3, global_stats=gs))
    assert r1.metrics["tags_new_neg_c1"] == n_nonneg // 2
    assert r1.metrics["tags_new_pos_c1"] == (N - n_nonneg) // 2
    assert "tags_new_neg_c0" not in r1.metrics  # class 0 is annotated: never tagged
    assert (client.tags[:, 0] == -1).all()
    assert r1.metrics["tags_total_neg"] + r1.metrics["tags_total_pos"] == (client.tags >= 0).sum()
    assert 0.0 <= r1.metrics["tag_precision_neg"] <= 1.0 and 0.0 <= r1.metrics["tag_recall_pos"] <= 1.0
    saved = client.tags.copy()

    restarted = _client(warmup_rounds=1)
    restarted.setup(_ctx(tmp_path, data))
    np.testing.assert_array_equal(restarted.tags, saved)
    assert restarted.last_tag_round == 1
    # the same round re-run after the restart draws no new tags
    again = restarted.train_round(_model(), RoundInput(round=1, num_rounds=3, global_stats=gs))
    assert again.metrics["tags_new_neg_c1"] == 0 and again.metrics["tags_new_pos_c1"] == 0
    assert "tag_precision_neg" not in again.metrics  # no reference given: no diagnostics
    # a later round adds tags and keeps the old ones (permanent)
    restarted.train_round(_model(), RoundInput(round=2, num_rounds=3, global_stats=gs))
    kept = saved >= 0
    np.testing.assert_array_equal(restarted.tags[kept], saved[kept])
    assert (restarted.tags >= 0).sum() > kept.sum()


def test_tag_diagnostics_hand_worked(tmp_path):
    data, reference = _site_data()
    client = _client()
    client.setup(_ctx(tmp_path, data, reference))
    true = reference.splits["train"].labels
    client.tags[:] = -1
    pos_rows = np.flatnonzero(true[:, 1] > 0.5)[:3]
    neg_rows = np.flatnonzero(true[:, 1] < 0.5)[:2]
    client.tags[pos_rows, 1] = 1      # 3 right positives
    client.tags[neg_rows[0], 1] = 1   # 1 wrong positive
    client.tags[neg_rows[1], 1] = 0   # 1 right negative
    q = client._tag_quality()
    assert q["tag_precision_pos"] == pytest.approx(3 / 4)
    assert q["tag_recall_pos"] == pytest.approx(3 / float((true[:, 1:] > 0.5).sum()))
    assert q["tag_precision_neg"] == pytest.approx(1.0)


def test_fixed_threshold_and_switches(tmp_path):
    data, _ = _site_data()
    client = _client(warmup_rounds=1, use_adaptive_threshold=False, use_cr=False, use_wpc=False)
    client.setup(_ctx(tmp_path, data))
    model = _model()
    gs = _handmade_global_stats(model, client)  # tau 0.5 would be used if adaptive; fixed t0 = t1 = 0.25
    _, feats = predict(model, client.images, torch.device("cpu"), with_features=True)
    z = prototype_scores(feats, torch.as_tensor(gs["prototypes_neg"]), torch.as_tensor(gs["prototypes_pos"]))
    n_nonneg = int((z[:, 2] >= 0).sum())
    r = client.train_round(model, RoundInput(round=1, num_rounds=2, global_stats=gs))
    assert r.metrics["tags_new_neg_c2"] == int(0.25 * n_nonneg)
    assert r.metrics["tags_new_pos_c2"] == int(0.25 * (N - n_nonneg))
    assert r.metrics["loss_cr"] == 0.0


def test_client_rejects_wrong_data_and_foreign_tags(tmp_path):
    data, _ = _site_data()
    single = Dataset("single-label", ["a", "b", "c"], data.splits, source="x.npz", site="site-1")
    with pytest.raises(DataError, match="multi-label"):
        _client().setup(_ctx(tmp_path, single))
    client = _client(warmup_rounds=1)
    client.setup(_ctx(tmp_path, data))
    model = _model()
    client.train_round(model, RoundInput(round=1, num_rounds=2, global_stats=_handmade_global_stats(model, client)))
    other, _ = _site_data(annotated=(1,))
    with pytest.raises(DataError, match="fedmlp_tags.npz"):
        _client().setup(_ctx(tmp_path, other))
    with pytest.raises(ValueError, match="warmup_rounds"):
        FedMLPClient(warmup_rounds=0)


# ---------------------------------------------------------------------------------------------
# options where the paper, the released code and ours differ
# ---------------------------------------------------------------------------------------------

def test_warmup_complete_is_decided_by_the_least_learned_annotated_class():
    degree = np.array([0.95, 0.6, 0.99])
    # classes 0, 1 annotated somewhere: the least degree is 0.6 < 0.9
    assert warmup_complete(degree, np.array([True, True, False]), 0.9) == (False, 0.6)
    # class 1 annotated nowhere: 0.95 is the least, warm-up may end
    assert warmup_complete(degree, np.array([True, False, True]), 0.9) == (True, 0.95)
    assert warmup_complete(degree, np.zeros(3, bool), 0.9) == (False, 0.0)


def test_prior_rates_take_the_annotated_frequency_for_classes_the_site_does_not_annotate():
    local = np.array([0.5, 0.2, 0.5, 0.45])  # class 0: tags only (rank rule), class 1 annotated here
    annotated = np.array([False, True, False, False])
    prevalence = np.array([0.03, 0.4, -1.0, 0.1])  # class 2 unknown at the server
    np.testing.assert_allclose(prior_rates(local, annotated, prevalence), [0.03, 0.2, 0.5, 0.1])
    np.testing.assert_allclose(prior_rates(local, annotated, None), local)
    # the logit offset of class 0 moves from log(0.5/0.5) = 0 to log(0.03/0.97) = -3.476
    offset = logit_adjustment(torch.tensor(prior_rates(local, annotated, prevalence)))
    assert float(offset[0]) == pytest.approx(math.log(0.03 / 0.97), abs=1e-5)


def test_prototype_sources_name_the_sites_whose_prototype_is_missing():
    counts = [np.array([3, 10]), np.array([0, 7]), np.array([8, 0])]
    annotated = [np.array([True, True]), np.array([True, True]), np.array([True, False])]
    # class 0: site-c's 8 samples pass k = 5, site-a's 3 do not, site-b withheld (0); class 1: all sent
    assert prototype_sources(counts, annotated, ["site-a", "site-b", "site-c"], 5) == {
        0: {"used": ["site-c"], "missing": ["site-a", "site-b"]}}
    assert prototype_sources(counts, annotated, ["site-a", "site-b", "site-c"], 1) == {
        0: {"used": ["site-a", "site-c"], "missing": ["site-b"]}}


def test_server_averages_over_the_sites_that_sent_a_prototype_and_reports_the_others():
    updates = _three_sites()
    # as the privacy filter leaves it: site-B withheld its class-0 positive prototype (row and count 0)
    updates[1].stats["prototypes_pos"][0] = 0.0
    updates[1].stats["prototype_counts_pos"][0] = 0.0
    logs = []
    ctx = _server_ctx()
    ctx.log = logs.append
    _, gs = FedMLPServer().aggregate(updates, ctx)
    np.testing.assert_allclose(gs["prototypes_pos"][0], [0.0, 1.0])  # site-A's (0, 1) alone, not (0,1)*10/40
    assert gs["prototype_valid"][0]
    assert ctx.report["prototypes_missing_pos"] == {"0": ["site-B"]}
    assert ctx.report["prototype_invalid_classes"] == [2]
    assert any("class 0 pos prototype averaged over sites ['site-A'] only" in m and "site-B" in m for m in logs)


def test_server_announces_stage_2_once_every_annotated_class_is_learned():
    updates = _three_sites()  # d^G = [0.5, 0.72, 0]; class 2 annotated nowhere
    ctx = _server_ctx()
    _, gs = FedMLPServer(warmup_end="learning_degree", warmup_degree=0.7).aggregate(updates, ctx)
    assert gs["stage"] == 1 and ctx.report["warmup_least_degree"] == pytest.approx(0.5)
    assert "prototypes_neg" in gs  # sent anyway: a client past warmup_rounds tags with them
    _, gs = FedMLPServer(warmup_end="learning_degree", warmup_degree=0.5).aggregate(updates, _server_ctx())
    assert gs["stage"] == 2
    ctx = _server_ctx()
    ctx.global_stats = {"stage": 2}  # once announced, stage 2 stays
    _, gs = FedMLPServer(warmup_end="learning_degree", warmup_degree=0.99).aggregate(updates, ctx)
    assert gs["stage"] == 2 and "warmup_least_degree" not in ctx.report
    _, gs = FedMLPServer(warmup_degree=0.99).aggregate(updates, _server_ctx())  # paper: rounds decide
    assert gs["stage"] == 2


def test_client_stage_follows_the_server_only_with_the_learning_degree_end():
    adaptive = FedMLPClient(warmup_rounds=5, warmup_end="learning_degree", min_warmup_rounds=2)
    assert [adaptive.sends_stats(r) for r in range(3)] == [False, True, True]
    assert adaptive.stage(1, {"stage": 2}) == 2 and adaptive.stage(1, {"stage": 1}) == 1
    assert adaptive.stage(5, {}) == 2  # warmup_rounds is the latest end
    fixed = FedMLPClient(warmup_rounds=5)
    assert fixed.stage(1, {"stage": 2}) == 1 and fixed.stage(5) == 2
    assert [fixed.sends_stats(r) for r in (3, 4)] == [False, True]
    with pytest.raises(ValueError, match="min_warmup_rounds"):
        FedMLPClient(warmup_rounds=5, min_warmup_rounds=6)
    with pytest.raises(ValueError, match="warmup_end"):
        FedMLPClient(warmup_end="loss")
    with pytest.raises(ValueError, match="la_prior"):
        FedMLPClient(la_prior="global")


def test_consistency_in_warmup_as_the_released_code(tmp_path):
    data, _ = _site_data()
    paper = _client(**PAPER_CLIENT)
    paper.setup(_ctx(tmp_path / "paper", data))
    released = _client(**{**PAPER_CLIENT, **RELEASED_CODE_CLIENT})
    released.setup(_ctx(tmp_path / "released", data))
    model = _model()
    r_paper = paper.train_round(model, RoundInput(round=0, num_rounds=4))
    r_released = released.train_round(_model(), RoundInput(round=0, num_rounds=4))
    assert r_paper.metrics["stage"] == r_released.metrics["stage"] == 1
    assert r_paper.metrics["loss_cr"] == 0.0 and r_released.metrics["loss_cr"] > 0.0


def test_la_prior_reaches_the_wpc_offset(tmp_path, monkeypatch):
    data, _ = _site_data(annotated=(0,))
    seen = []
    real = fedmlp.logit_adjustment
    monkeypatch.setattr(fedmlp, "logit_adjustment", lambda rates, *a: seen.append(rates.tolist()) or real(rates, *a))
    client = _client(la_prior="annotated_frequency", use_mld=False)
    client.setup(_ctx(tmp_path, data))
    prevalence = np.array([0.9, 0.05, -1.0])
    client.train_round(_model(), RoundInput(round=2, num_rounds=4, global_stats={"stage": 2, "prevalence": prevalence}))
    local = float(data.splits["train"].labels[:, 0].mean())  # class 0 annotated here: its own rate
    assert seen[0] == pytest.approx([local, 0.05, 0.5])


def test_paper_profile_holds_the_paper_values():
    assert PAPER_SERVER["t0"] == 0.005 and PAPER_SERVER["t1"] == 0.01
    server, client = FedMLPServer(**PAPER_SERVER), FedMLPClient(**PAPER_CLIENT)
    assert (server.warmup_end, client.warmup_end, client.la_prior, client.cr_in_warmup) == (
        "rounds", "rounds", "local", False)


def test_one_backward_per_view_gives_the_gradient_of_the_views_mean_loss(tmp_path, monkeypatch):
    """The client back-propagates each augmented view on its own (one view's activations alive at
    a time); the step must be the one of a single backward through the mean of the views' losses."""
    import copy

    # plain SGD with lr 1, so the step is the gradient itself (Adam's first step is about lr * sign)
    monkeypatch.setattr(torch.optim, "Adam", lambda params, lr, betas, weight_decay: torch.optim.SGD(params, lr=lr))
    data, _ = _site_data()
    client = _client(batch_size=N, num_views=2, use_cr=False, lr=1.0)  # one step over all 40 images
    client.setup(_ctx(tmp_path, data))
    views = [lambda x: x, lambda x: x.flip(-1)]  # deterministic views instead of random flips
    calls = []

    def augment(x):
        calls.append(1)
        return views[(len(calls) - 1) % 2](x)

    client._augment = augment
    model = _model()
    expected = copy.deepcopy(model)
    client.train_round(model, RoundInput(round=0, num_rounds=4))
    assert len(calls) == 2

    # by hand: the same batch (its order does not change a mean), one backward through the mean loss
    targets, weights, cr = (torch.from_numpy(a) for a in loss_entries(client.labels_np, client.mask_np, client.tags))
    offset = logit_adjustment(positive_rates(targets, 1.0 - cr), client.la_tau, client.la_eps)
    x = client.images.batch(np.arange(N))
    optimizer = torch.optim.SGD(expected.parameters(), lr=1.0)
    expected.train()
    loss = sum(wpc_loss(expected(view(x))[1], targets, weights, offset) for view in views) / 2
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for (name, got), want in zip(model.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_check_tags_run_the_rank_rule_on_held_out_annotated_entries_hand_worked():
    # class 0 annotated on rows 0-4 (row 5 not annotated: never checked); class 1 has no valid prototype
    z = np.array([[-0.5, -1.0], [-0.2, -1.0], [0.3, -1.0], [-0.1, -1.0], [-0.4, -1.0], [-0.9, -1.0]])
    labels = np.array([[1, 1], [0, 1], [0, 1], [1, 1], [0, 1], [1, 1]], dtype=np.float32)
    mask = np.array([[1, 1]] * 5 + [[0, 1]], dtype=bool)
    valid = np.array([True, False])
    # Z < 0 among rows 0-4: rows 0 (-0.5), 4 (-0.4), 1 (-0.2), 3 (-0.1); floor(0.5 * 4) = 2 -> rows 0, 4: 1 positive
    hits, count = check_positive_tags(z, labels, mask, [0.5, 0.5], valid, min_samples=1)
    assert hits.tolist() == [1.0, 0.0] and count.tolist() == [2.0, 0.0]
    # at least 3 check tags: rows 0, 4, 1 -> still 1 positive of 3
    hits, count = check_positive_tags(z, labels, mask, [0.5, 0.5], valid, min_samples=3)
    assert hits.tolist() == [1.0, 0.0] and count.tolist() == [3.0, 0.0]
    # at least 10, but only 4 entries have Z < 0: all 4, 2 positives; tau 0 still checks min_samples
    hits, count = check_positive_tags(z, labels, mask, 0.0, valid, min_samples=10)
    assert hits.tolist() == [2.0, 0.0] and count.tolist() == [4.0, 0.0]


def test_positive_tag_gate_pools_the_sites_checks():
    # class 0: (3 + 1) / (4 + 1) = 0.8 >= 0.7 open; class 1: 2 / 5 = 0.4 closed; class 2: no check tag, closed
    open_pos, precision = positive_tag_gate([np.array([3, 0, 0]), np.array([1, 2, 0])],
                                            [np.array([4, 0, 0]), np.array([1, 5, 0])], 0.7)
    assert open_pos.tolist() == [True, False, False]
    np.testing.assert_allclose(precision, [0.8, 0.4, -1.0])
    assert positive_tag_gate([np.array([2.0])], [np.array([5.0])], 0.4)[0].tolist() == [True]  # 0.4 >= 0.4


def test_server_gate_opens_classes_whose_check_tags_are_precise():
    updates = _three_sites()
    ctx = _server_ctx()
    _, gs = FedMLPServer(positive_tag_gate=0.7).aggregate(updates, ctx)
    # no site checked yet (the round before stage 2): every class closed
    assert gs["positive_tag_gate"] == 0.7 and gs["positive_tag_open"].tolist() == [False, False, False]
    updates[0].stats.update(tag_check_hits=np.array([3.0, 0, 0]), tag_check_count=np.array([4.0, 0, 0]))
    updates[1].stats.update(tag_check_hits=np.array([1.0, 2, 0]), tag_check_count=np.array([1.0, 5, 0]))
    ctx = _server_ctx()
    server = FedMLPServer(positive_tag_gate=0.7)
    for u in updates:
        server.check_stats(u, ctx)
    _, gs = server.aggregate(updates, ctx)
    assert gs["positive_tag_open"].tolist() == [True, False, False]
    assert ctx.report["tag_check_precision"] == [0.8, 0.4, -1.0] and ctx.report["positive_tag_open"] == [1, 0, 0]
    _, gs = FedMLPServer().aggregate(updates, _server_ctx())  # paper: no gate, nothing sent
    assert "positive_tag_open" not in gs and "positive_tag_gate" not in gs
    bad = SiteUpdate("site-A", {}, 10, {"tag_check_hits": np.array([2.0, 0, 0]),
                                        "tag_check_count": np.array([1.0, 0, 0])})
    with pytest.raises(ValueError, match="site-A.*exceeds"):
        server.check_stats(bad, _server_ctx())
    bad.stats = {"tag_check_hits": np.array([1.0, 0, 0])}
    with pytest.raises(ValueError, match="without 'tag_check_count'"):
        server.check_stats(bad, _server_ctx())
    with pytest.raises(ValueError, match="positive_tag_gate"):
        FedMLPServer(positive_tag_gate=1.5)


def test_client_tags_positives_only_for_open_classes_and_checks_on_its_validation_split(tmp_path):
    data, reference = _site_data(annotated=(0,))
    train = data.splits["train"]
    # validation: the first 20 training images, class 0 annotated (the check reads it), 1-2 not
    val_mask = np.zeros((20, C), dtype=bool)
    val_mask[:, 0] = True
    data.splits["val"] = Split(train.images[:20], reference.splits["train"].labels[:20] * val_mask, val_mask)
    client = _client(warmup_rounds=1, tag_check_samples=4)
    client.setup(_ctx(tmp_path, data, reference))
    model = _model()
    gs = _handmade_global_stats(model, client)
    gs.update(positive_tag_gate=0.7, positive_tag_open=np.array([True, True, False]))
    _, feats = predict(model, client.images, torch.device("cpu"), with_features=True)
    z = prototype_scores(feats, torch.as_tensor(gs["prototypes_neg"]), torch.as_tensor(gs["prototypes_pos"]))
    hits, count = check_positive_tags(z.numpy()[:20], data.splits["val"].labels, val_mask, gs["tau1"],
                                      gs["prototype_valid"], 4)
    r = client.train_round(model, RoundInput(round=1, num_rounds=3, global_stats=gs))
    n_neg_z = int((z[:, 1] < 0).sum())
    assert r.metrics["tags_new_pos_c1"] == n_neg_z // 2  # open: floor(0.5 * #Z<0)
    assert r.metrics["tags_new_pos_c2"] == 0 and r.metrics["tags_new_neg_c2"] > 0  # closed: negatives only
    n_val = int((z[:20, 0] < 0).sum())
    assert count.tolist() == [max(n_val // 2, min(4, n_val)), 0, 0] and count[0] > 0  # only class 0 is checked
    np.testing.assert_array_equal(r.stats["tag_check_hits"], hits)
    np.testing.assert_array_equal(r.stats["tag_check_count"], count)
    FedMLPServer(positive_tag_gate=0.7).check_stats(SiteUpdate("site-1", {}, N, r.stats),
                                                    ServerContext(1, 3, ["fc.weight", "fc.bias"]))
    del gs["positive_tag_gate"], gs["positive_tag_open"]  # no gate: no check sent, every class tagged
    ungated = _client(warmup_rounds=1)
    ungated.setup(_ctx(tmp_path / "ungated", data))
    r = ungated.train_round(_model(), RoundInput(round=1, num_rounds=3, global_stats=gs))
    assert "tag_check_count" not in r.stats and r.metrics["tags_new_pos_c2"] == n_neg_z // 2
    with pytest.raises(ValueError, match="tag_check_samples"):
        _client(tag_check_samples=0)
