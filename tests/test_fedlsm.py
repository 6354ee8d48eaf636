"""FedLSM unit tests: hand-worked numbers for AWPA, the entropy split, pseudo labels, MixUp and q_c."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from fedpartial.algorithms.aggregation import awpa_rows
from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext, SiteUpdate
from fedpartial.algorithms.fedlsm import (AWPAServer, FedLSMClient, entropy_split, mixup,
                                          multilabel_pseudo_labels, pos_weight_from_counts, sample_entropy,
                                          single_label_pseudo_labels)
from fedpartial.data.types import Dataset, Split

CLS = ["fc.weight", "fc.bias"]


# ----------------------------------------------------------------------------- server
def _site(name, scale, counts, n, annotated, pos=None, neg=None):
    """Rows of class c hold scale + 2c (so the rows differ per site); one feature param = 10*scale."""
    w = np.array([[scale + 2 * c] * 2 for c in range(3)], dtype=np.float32)
    b = np.array([scale + 2 * c for c in range(3)], dtype=np.float32)
    stats = {"class_counts": np.array(counts, float), "annotated_classes": np.array(annotated, float)}
    if pos is not None:
        stats["label_pos"], stats["label_neg"] = np.array(pos, float), np.array(neg, float)
    return SiteUpdate(site=name, weights={"body.w": np.full((2,), 10.0 * scale, np.float32), "fc.weight": w,
                                          "fc.bias": b}, num_samples=n, stats=stats)


def _three_sites():
    # Rows: A = [1, 3, 5], B = [3, 5, 7], C = [5, 7, 9] (class 0, 1, 2); sizes 100 / 300 / 100.
    return [_site("A", 1, [30, 0, 0], 100, [1, 0, 0], [10, 0, 0], [90, 0, 0]),
            _site("B", 3, [30, 5, 0], 300, [1, 1, 0], [20, 5, 0], [280, 295, 0]),
            _site("C", 5, [0, 15, 0], 100, [0, 1, 0], [0, 15, 0], [0, 85, 0])]


def _ctx():
    return ServerContext(round=0, num_rounds=2, classifier_param_names=CLS)


def test_awpa_rows_hand_worked_with_zero_count_class():
    rows = [np.array([1.0, 3.0, 5.0]), np.array([3.0, 5.0, 7.0]), np.array([5.0, 7.0, 9.0])]
    counts = [[30, 0, 0], [30, 5, 0], [0, 15, 0]]
    out = awpa_rows(rows, counts, fallback_weights=[100, 300, 100])
    # class 0: 30/60*1 + 30/60*3 = 2.0 ; class 1: 5/20*5 + 15/20*7 = 6.5
    # class 2: zero count everywhere -> FedAvg 0.2*5 + 0.6*7 + 0.2*9 = 7.0
    np.testing.assert_allclose(out, [2.0, 6.5, 7.0])


def test_awpa_server_aggregate_and_global_stats():
    weights, stats = AWPAServer().aggregate(_three_sites(), _ctx())
    # feature extractor by data size: 0.2*10 + 0.6*30 + 0.2*50 = 30
    np.testing.assert_allclose(weights["body.w"], [30.0, 30.0])
    np.testing.assert_allclose(weights["fc.bias"], [2.0, 6.5, 7.0])
    np.testing.assert_allclose(weights["fc.weight"], [[2.0, 2.0], [6.5, 6.5], [7.0, 7.0]])
    assert weights["fc.weight"].dtype == np.float32
    # pos = [30, 20, 0], neg = [370, 380, 0] -> pos_weight [370/30, 19, 1 (no positive anywhere)]
    np.testing.assert_allclose(stats["pos_weight"], [370 / 30, 19.0, 1.0])
    np.testing.assert_allclose(stats["class_counts"], [60, 20, 0])


def test_awpa_caps_a_class_count_above_the_site_size_and_logs_row_weights():
    # site C claims 10^6 samples of class 1 with 100 images: capped at 100, so class 1's row is
    # 5/105 * 5 + 100/105 * 7 = 6.9048 (not 5/(10^6 + 5) * 5 + ... = 7.0000); class 0 as before
    sites = _three_sites()
    sites[2].stats["class_counts"] = np.array([0, 1e6, 0])
    logged = []
    ctx = ServerContext(round=3, num_rounds=5, classifier_param_names=CLS, log=logged.append)
    weights, _ = AWPAServer().aggregate(sites, ctx)
    np.testing.assert_allclose(weights["fc.bias"], [2.0, 5 / 105 * 5 + 100 / 105 * 7, 7.0], rtol=1e-6)
    assert any("site 'C'" in m and "capped" in m for m in logged)
    # metrics.json gets each site's share of each class row (0 where the class has no count at all)
    shares = ctx.report["class_row_weights"]
    np.testing.assert_allclose([shares["A"][0], shares["B"][0], shares["C"][1]], [0.5, 0.5, 100 / 105])
    assert shares["A"][2] == shares["B"][2] == shares["C"][2] == 0.0


def test_without_awpa_masked_and_fedavg():
    w_masked, _ = AWPAServer(use_awpa=False).aggregate(_three_sites(), _ctx())
    # class 0 over A, B (annotate it): (100*1 + 300*3)/400 = 2.5 ; class 1 over B, C: (300*5 + 100*7)/400 = 5.5
    # class 2: no site annotates it -> FedAvg 7.0
    np.testing.assert_allclose(w_masked["fc.bias"], [2.5, 5.5, 7.0])
    w_avg, _ = AWPAServer(use_awpa=False, without_awpa="fedavg").aggregate(_three_sites(), _ctx())
    # plain FedAvg: 0.2*1 + 0.6*3 + 0.2*5 = 3.0, then +2 per class
    np.testing.assert_allclose(w_avg["fc.bias"], [3.0, 5.0, 7.0])


def test_awpa_all_zero_counts_no_nan_and_zero_sample_site_skipped():
    sites = _three_sites()
    for s in sites:
        s.stats["class_counts"] = np.zeros(3)
    sites[2].num_samples = 0  # takes no part: FedAvg over A, B = 0.25*1 + 0.75*3 = 2.5
    weights, _ = AWPAServer().aggregate(sites, _ctx())
    assert np.all(np.isfinite(weights["fc.weight"]))
    np.testing.assert_allclose(weights["fc.bias"], [2.5, 4.5, 6.5])


@pytest.mark.parametrize("key,value,match", [
    ("class_counts", np.zeros(4), "shape"),
    ("class_counts", np.array([1.0, np.nan, 0.0]), "NaN"),
    ("class_counts", np.array([1.0, -1.0, 0.0]), "negative"),
    ("label_pos", np.array([1.0, np.inf, 0.0]), "NaN or Inf"),
])
def test_check_stats_rejects_bad_values(key, value, match):
    update = _three_sites()[0]
    update.stats[key] = value
    with pytest.raises(ValueError, match=f"'{key}'.*{match}"):
        AWPAServer().check_stats(update, _ctx())


def test_check_stats_missing_counts_and_good_update():
    update = _three_sites()[0]
    AWPAServer().check_stats(update, _ctx())  # well-formed: no error
    del update.stats["class_counts"]
    with pytest.raises(ValueError, match="class_counts"):
        AWPAServer().check_stats(update, _ctx())


def test_pos_weight_from_counts():
    # pos [2, 0, 5], neg [8, 4, 0] -> [8/2, 1 (no positive), 1 (no negative)]
    np.testing.assert_allclose(pos_weight_from_counts([2, 0, 5], [8, 4, 0]), [4.0, 1.0, 1.0])
    np.testing.assert_allclose(pos_weight_from_counts([1, 0], [9, 4], max_pos_weight=5.0), [5.0, 1.0])


# ----------------------------------------------------------------------------- uncertainty
def test_entropy_split_by_rank():
    entropy = np.array([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.0])
    conf, med, unc = entropy_split(entropy, confident_fraction=0.2, uncertain_fraction=0.3)
    # 2 lowest: idx 9 (0.0), 1 (0.1); 3 highest: idx 2 (0.9), 6 (0.8), 4 (0.7)
    assert conf.tolist() == [1, 9]
    assert unc.tolist() == [2, 4, 6]
    assert med.tolist() == [0, 3, 5, 7, 8]
    with pytest.raises(ValueError, match="> 1"):
        entropy_split(entropy, 0.8, 0.3)


def test_sample_entropy_single_and_multi():
    single = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    # [ln 2, 0]
    np.testing.assert_allclose(sample_entropy(single, torch.ones(2, 3), "single-label"), [math.log(2), 0.0], atol=1e-12)
    probs = torch.tensor([[0.5, 0.9, 0.1], [0.5, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 0], [1, 1, 1]], dtype=torch.float64)
    # row 0: missing classes 0, 2: Hb(0.5) = 1 bit, Hb(0.1) = 0.4690 bit -> mean 0.7345; class 1 annotated, ignored
    # row 1: nothing missing -> 0
    hb01 = -(0.1 * math.log2(0.1) + 0.9 * math.log2(0.9))
    np.testing.assert_allclose(sample_entropy(probs, mask, "multi-label"), [(1 + hb01) / 2, 0.0], atol=1e-12)


# ----------------------------------------------------------------------------- pseudo labels, MixUp
def test_single_label_pseudo_labels_at_threshold():
    mask = torch.tensor([[1.0, 0.0, 0.0]]).repeat(6, 1)  # site annotates class 0 only
    labels = torch.zeros(6, 3, dtype=torch.float64)
    labels[0, 0] = 1.0  # sample 0 labelled class 0
    probs = torch.tensor([[0.01, 0.01, 0.98],   # labelled: keeps its true class 0
                          [0.02, 0.96, 0.02],   # pseudo 1
                          [0.05, 0.95, 0.00],   # exactly tau -> pseudo 1
                          [0.97, 0.02, 0.01],   # argmax is an annotated class -> contradicts, none
                          [0.10, 0.50, 0.40],   # not confident
                          [0.00, 0.06, 0.94]], dtype=torch.float64)  # 0.94 < 0.95
    target, has, is_pseudo = single_label_pseudo_labels(probs, labels, mask.double(), tau=0.95)
    assert has.tolist() == [True, True, True, False, False, False]
    assert is_pseudo.tolist() == [False, True, True, False, False, False]
    assert target[:3].tolist() == [0, 1, 1]


def test_single_label_pseudo_labels_renormalised_over_missing_classes():
    mask = torch.tensor([[1.0, 0.0, 0.0]]).repeat(3, 1)  # class 0 annotated, 1 and 2 missing
    labels = torch.zeros(3, 3, dtype=torch.float64)
    probs = torch.tensor([[0.60, 0.38, 0.02],   # given "not class 0": 0.38 / 0.40 = 0.95 -> pseudo 1
                          [0.97, 0.02, 0.01],   # 0.02 / 0.03 = 0.667 -> none
                          [0.50, 0.02, 0.48]], dtype=torch.float64)  # 0.48 / 0.50 = 0.96 -> pseudo 2
    plain = single_label_pseudo_labels(probs, labels, mask.double(), tau=0.95)[2]
    target, has, is_pseudo = single_label_pseudo_labels(probs, labels, mask.double(), tau=0.95,
                                                        renormalise_missing=True)
    assert plain.tolist() == [False, False, False]  # the paper's rule: no full-softmax max >= 0.95
    assert is_pseudo.tolist() == [True, False, True]
    assert target[is_pseudo].tolist() == [1, 2]


def test_multilabel_pseudo_labels_at_thresholds():
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2, dtype=torch.float64)
    probs = torch.tensor([[0.99, 0.85, 0.005, 0.5],
                          [0.001, 0.84, 0.0051, 0.9]], dtype=torch.float64)
    targets, sel = multilabel_pseudo_labels(probs, mask, tau_p=0.85, tau_n=0.005)
    # row 0: class 1 == tau_p -> positive, class 2 == tau_n -> negative, class 0 annotated -> never
    # row 1: 0.84 and 0.0051 fall between the thresholds; 0.9 -> positive
    assert targets.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    assert sel.tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]


def test_mixup_two_known_samples():
    x, y = mixup(torch.tensor([[2.0, 4.0]]), torch.tensor([[1.0, 0.0]]),
                 torch.tensor([[6.0, 0.0]]), torch.tensor([[0.0, 1.0]]), lam=0.25)
    # 0.25*[2, 4] + 0.75*[6, 0] = [5, 1]; labels 0.25*[1, 0] + 0.75*[0, 1]
    assert x.tolist() == [[5.0, 1.0]]
    assert y.tolist() == [[0.25, 0.75]]


# ----------------------------------------------------------------------------- client rounds
class ChannelModel(nn.Module):
    """logits = 10 * (channel means of the normalised image): a 255-valued channel gives logit +10,
    a 0-valued one -10, 128 about 0. Flips do not change it (constant images)."""

    def __init__(self, c=3):
        super().__init__()
        self.fc = nn.Linear(c, c)
        with torch.no_grad():
            self.fc.weight.copy_(10.0 * torch.eye(c))
            self.fc.bias.zero_()

    def forward(self, x):
        f = x.mean(dim=(2, 3))
        return f, self.fc(f)

    def classifier_param_names(self):
        return list(CLS)


def _constant_images(channel_values):
    v = np.asarray(channel_values, dtype=np.uint8)
    return np.broadcast_to(v[:, None, None, :], (len(v), 4, 4, v.shape[1])).copy()


def _client_ctx(tmp_path, task, images, labels, mask, reference=None, seed=0):
    split = Split(images=images, labels=labels.astype(np.float32), label_mask=mask.astype(bool))
    data = Dataset(task=task, class_names=["a", "b", "c"], splits={"train": split}, site="site-1")
    ref = None
    if reference is not None:
        ref = Dataset(task=task, class_names=["a", "b", "c"],
                      splits={"train": Split(images=images, labels=reference.astype(np.float32))})
    return ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=str(tmp_path), seed=seed,
                         reference=ref)


def _frozen_client(**kw):
    # lr = 0 keeps student and teacher equal to the global model, so pseudo labels are known in advance.
    return FedLSMClient(lr=0.0, weight_decay=0.0, batch_size=8, local_iterations=2, use_ue=False, use_ude=False,
                        strong_view="flip", **kw)


def test_single_label_class_counts_and_diagnostics(tmp_path):
    images = _constant_images([[255, 0, 0], [255, 0, 0],          # labelled class 0
                               [0, 255, 0], [0, 255, 0], [0, 255, 0],  # pseudo 1 (true 1, 1, 2)
                               [0, 0, 255],                        # pseudo 2 (true 2)
                               [128, 128, 128],                    # uniform: no pseudo label (true 1)
                               [255, 0, 0]])                       # says class 0 but unlabelled: none (true 2)
    labels = np.zeros((8, 3))
    labels[:2, 0] = 1
    mask = np.tile([1, 0, 0], (8, 1))
    truth = np.eye(3)[[0, 0, 1, 1, 2, 2, 1, 2]]
    rule = _frozen_client()
    rule.setup(_client_ctx(tmp_path, "single-label", images, labels, mask, reference=truth))
    result = rule.train_round(ChannelModel(), RoundInput(round=0, num_rounds=1))
    # q = [2 true positives of class 0, 3 pseudo class 1, 1 pseudo class 2]
    np.testing.assert_allclose(result.stats["class_counts"], [2, 3, 1])
    assert result.num_samples == 8
    assert result.metrics["num_pseudo_positive"] == 4
    # correct pseudo labels: samples 2, 3 (class 1) and 5 (class 2) = 3 of 4; true missing positives: 6
    assert result.metrics["pseudo_precision"] == pytest.approx(0.75)
    assert result.metrics["pseudo_recall"] == pytest.approx(0.5)
    np.testing.assert_allclose(result.stats["label_pos"], [2, 0, 0])
    np.testing.assert_allclose(result.stats["label_neg"], [6, 0, 0])


def test_multilabel_class_counts(tmp_path):
    images = _constant_images([[255, 255, 0],    # GT class 0; pseudo +1, -2
                               [0, 255, 255],    # pseudo +1, +2
                               [0, 128, 128],    # GT class 0; nothing confident on 1, 2
                               [255, 0, 0]])     # annotated 0 negative (model's + ignored); pseudo -1, -2
    labels = np.array([[1, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]])
    mask = np.tile([1, 0, 0], (4, 1))
    rule = _frozen_client()
    rule.setup(_client_ctx(tmp_path, "multi-label", images, labels, mask))
    result = rule.train_round(ChannelModel(), RoundInput(round=0, num_rounds=1))
    np.testing.assert_allclose(result.stats["class_counts"], [2, 2, 1])
    assert result.metrics["num_pseudo_positive"] == 3
    assert result.metrics["num_pseudo_negative"] == 3
    assert "pseudo_precision" not in result.metrics  # no reference given: no diagnostics


def _synthetic_site(n=48, c=3, task="single-label", seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, c, n)
    images = rng.integers(0, 60, (n, 16, 16, 3)).astype(np.uint8)
    for i in range(n):
        images[i, :, :, y[i]] += 150  # learnable: the class's channel is bright
    mask = np.tile([1, 1, 0], (n, 1)) if task == "single-label" else np.tile([1, 0, 1], (n, 1))
    if task == "single-label":
        labels = np.eye(c)[y] * mask
    else:
        labels = (np.eye(c)[y] + (rng.random((n, c)) < 0.2) > 0).astype(float) * mask
    return images, labels, mask


@pytest.mark.parametrize("task", ["single-label", "multi-label"])
def test_round_runs_with_ude_and_restart_reproduces(tmp_path, task):
    from fedpartial.models import build_model

    torch.manual_seed(0)
    images, labels, mask = _synthetic_site(task=task)
    model = build_model("small_cnn", num_classes=3, in_channels=3, width=4, depth=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(batch_size=16, ude_pairs=4, local_iterations=3, confident_fraction=0.25, uncertain_fraction=0.25,
              lr=1e-3, strong_view="strong")
    results = []
    for _ in range(2):  # second pass = a fresh rule after a site restart, same state_dir
        rule = FedLSMClient(**kw)
        rule.setup(_client_ctx(tmp_path, task, images, labels, mask, seed=3))
        model.load_state_dict(start)
        result = rule.train_round(model, RoundInput(round=1, num_rounds=2))
        results.append((result, {k: v.clone() for k, v in model.state_dict().items()}))
    (r1, w1), (r2, w2) = results
    assert r1.metrics["train_steps"] == 3
    assert r1.metrics["n_confident"] == 12 and r1.metrics["n_uncertain"] == 12  # 0.25 * 48
    assert r1.metrics["loss_ude"] > 0  # the MixUp pairs carry labels (class-0/1 ground truth at least)
    assert r1.stats["class_counts"].shape == (3,)
    assert not torch.equal(w1["fc.weight"], start["fc.weight"])  # it trained
    for key in w1:  # FedLSM keeps no state across rounds: a restarted site reproduces the round exactly
        assert torch.equal(w1[key], w2[key]), key
    assert r1.metrics == r2.metrics


def test_ude_off_gives_zero_ude_loss(tmp_path):
    from fedpartial.models import build_model

    images, labels, mask = _synthetic_site()
    rule = FedLSMClient(batch_size=16, local_iterations=2, use_ude=False, strong_view="flip")
    rule.setup(_client_ctx(tmp_path, "single-label", images, labels, mask))
    result = rule.train_round(build_model("small_cnn", num_classes=3, in_channels=3, width=4, depth=2),
                              RoundInput(round=0, num_rounds=1))
    assert result.metrics["loss_ude"] == 0.0
    assert result.metrics["loss"] == pytest.approx(result.metrics["loss_labelled"] + result.metrics["loss_pseudo"])


def test_bad_data_and_arguments_raise(tmp_path):
    images, labels, mask = _synthetic_site()
    labels[0, 2] = 1  # a positive on an unannotated entry
    with pytest.raises(ValueError, match="unannotated"):
        FedLSMClient().setup(_client_ctx(tmp_path, "single-label", images, labels, mask))
    with pytest.raises(ValueError, match="tau_n"):
        FedLSMClient(tau_n=0.9, tau_p=0.85)
    with pytest.raises(ValueError, match="strong_view"):
        FedLSMClient(strong_view="huge")


def test_first_round_uses_local_pos_weight_then_global(tmp_path):
    images, labels, mask = _synthetic_site(task="multi-label")
    rule = FedLSMClient()
    rule.setup(_client_ctx(tmp_path, "multi-label", images, labels, mask))
    local = rule._pos_weight({})
    pos, neg = labels[:, 0].sum(), 48 - labels[:, 0].sum()
    # class 0 annotated: neg/pos from the local counts; class 1 missing everywhere here -> 1
    assert local[0].item() == pytest.approx(neg / pos)
    assert local[1].item() == 1.0
    given = rule._pos_weight({"pos_weight": np.array([2.0, 3.0, 4.0])})
    assert given.tolist() == [2.0, 3.0, 4.0]


def test_local_epochs_sets_the_step_count(tmp_path):
    from fedpartial.models import build_model

    images, labels, mask = _synthetic_site()
    rule = FedLSMClient(batch_size=16, local_epochs=1.5, use_ue=False, use_ude=False, strong_view="flip")
    rule.setup(_client_ctx(tmp_path, "single-label", images, labels, mask))
    result = rule.train_round(build_model("small_cnn", num_classes=3, in_channels=3, width=4, depth=2),
                              RoundInput(round=0, num_rounds=1))
    # pool = all 48 samples, 16 per step: ceil(1.5 * 48 / 16) = ceil(4.5) = 5 steps, every sample seen
    assert result.metrics["train_steps"] == 5
    assert result.metrics["samples_seen"] == 48
    with pytest.raises(ValueError, match="local_epochs"):
        FedLSMClient(local_epochs=1.0, local_iterations=5)


def test_pseudo_label_census_counts_per_class(tmp_path):
    """A model whose softmax is the image's pixels / 255: the census counts what FedLSM's rule
    would pseudo-label at the site, per class, against the reference copy."""
    import os

    from fedpartial.data.sitefile import write_site_file
    from fedpartial.data.types import Dataset, Split
    from fedpartial_tools.evaluate import pseudo_label_census

    class PixelSoftmax(torch.nn.Module):
        def forward(self, x):
            logits = torch.log(x.flatten(1).clamp_min(1e-9))
            return logits, logits

    images = np.array([[[153, 97, 5]], [[5, 245, 5]], [[255, 0, 0]]], dtype=np.uint8)  # (3, 1, 3) grey
    truth = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=np.float32)  # sample 1 is of c, not b
    mask = np.array([[1, 0, 0]] * 3, dtype=bool)  # the site annotates class a only
    names = ["a", "b", "c"]
    write_site_file(str(tmp_path / "site-1.npz"), Dataset("single-label", names, {"train": Split(images, truth * mask, mask)},
                                                          site="site-1"))
    os.makedirs(tmp_path / "reference")
    write_site_file(str(tmp_path / "reference" / "site-1_full.npz"),
                    Dataset("single-label", names, {"train": Split(images, truth, np.ones_like(mask))}, site="site-1"))
    norm = {"mean": 0.0, "std": 1.0}
    plain = pseudo_label_census(PixelSoftmax(), [str(tmp_path / "site-1.npz")], str(tmp_path / "reference"), norm,
                                "cpu")
    # hidden: sample 0 (b), sample 1 (c); only sample 1 has a full-softmax max >= 0.95 (245/255 on b): wrong
    assert plain["total"] == {"hidden": [0, 1, 1], "pseudo": [0, 1, 0], "correct": [0, 0, 0]}
    renorm = pseudo_label_census(PixelSoftmax(), [str(tmp_path / "site-1.npz")], str(tmp_path / "reference"), norm,
                                 "cpu", renormalise_missing=True)
    # sample 0 given "not a": 97 / 102 = 0.951 on b -> pseudo b, right
    assert renorm["total"] == {"hidden": [0, 1, 1], "pseudo": [0, 2, 0], "correct": [0, 1, 0]}
    assert renorm["classes"] == names


# ----------------------------------------------------------------------------- real data
_SHARED = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not (_SHARED / "ct_ich_128.npz").is_file(), reason=f"real data file {_SHARED}/ct_ich_128.npz is absent")
def test_fedlsm_multilabel_round_on_real_ct_ich(tmp_path):
    """CT-ICH as FedLSM's second multi-label set: 5 sites x 2 of the 5 haemorrhage subtypes (some
    sites annotate a subtype they have no positive of), one round at every site, then AWPA. The
    counts the server sums are the sites' own annotated positives / negatives, by hand."""
    from fedpartial.data.npz import load_npz
    from fedpartial_tools.data.partition import partition
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.models import build_model
    from fedpartial.training.common import state_dict_numpy

    sites, _, _ = partition(load_npz(str(_SHARED / "ct_ich_128.npz")), "label-set-mismatch", 5, seed=0,
                            classes_per_site=2)
    torch.manual_seed(0)
    model = build_model("small_cnn", 5, 1, width=8, depth=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    updates, pos_sum, neg_sum, empty_annotated = [], np.zeros(5), np.zeros(5), 0
    for data in sites:
        data = resize_dataset(data, (32, 32))
        train = data.splits["train"]
        annotated = train.label_mask.astype(bool)
        pos = ((train.labels > 0.5) & annotated).sum(axis=0)
        neg = ((train.labels < 0.5) & annotated).sum(axis=0)
        pos_sum, neg_sum = pos_sum + pos, neg_sum + neg
        empty_annotated += int(np.sum(pos[annotated.any(axis=0)] == 0))
        rule = FedLSMClient(lr=1e-3, batch_size=32, local_iterations=2)
        rule.setup(ClientContext(site=data.site, data=data, device=torch.device("cpu"),
                                 state_dir=str(tmp_path / data.site), seed=0))
        model.load_state_dict(start)
        result = rule.train_round(model, RoundInput(round=0, num_rounds=1))
        np.testing.assert_array_equal(result.stats["label_pos"], pos)
        np.testing.assert_array_equal(result.stats["label_neg"], neg)
        counts = np.asarray(result.stats["class_counts"])
        assert counts.shape == (5,) and np.all(counts[annotated.any(axis=0)] <= pos[annotated.any(axis=0)])
        updates.append(SiteUpdate(data.site, state_dict_numpy(model), result.num_samples, result.stats))
    assert empty_annotated > 0  # the edge this data brings: subtypes annotated where none occurs
    server = AWPAServer()
    ctx = ServerContext(round=0, num_rounds=1, classifier_param_names=model.classifier_param_names())
    for u in updates:
        server.check_stats(u, ctx)
    weights, stats = server.aggregate(updates, ctx)
    assert all(np.all(np.isfinite(w)) for w in weights.values())
    np.testing.assert_array_equal(stats["label_pos"], pos_sum)
    np.testing.assert_allclose(stats["pos_weight"], np.where(pos_sum > 0, neg_sum / np.maximum(pos_sum, 1), 1.0))
