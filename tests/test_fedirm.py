"""Unit tests of FedIRM (algorithms/fedirm.py). Numbers in comments are worked out by hand."""
import copy
import math
import shutil

import numpy as np
import pytest
import torch

from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext, SiteUpdate
from fedpartial.algorithms.fedirm import (RELATION_COUNTS, RELATION_MATRIX, RELATION_MULTILABEL, RELATION_VALID,
                                          TEACHER_FILE, FedIRMClient, FedIRMServer, average_relation_matrices,
                                          consistency_loss, mc_dropout_probabilities, pseudo_label_loss, ramp_weight,
                                          relation_matrix, reliable_lowest_entropy, reliable_lowest_entropy_per_class,
                                          reliable_mask, symmetric_kl)
from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, Dataset, Split
from fedpartial.models import build_model

torch.set_num_threads(1)


# ---- helpers ------------------------------------------------------------------------------------
def _site_data(labelled: bool, n: int = 16, num_classes: int = 3, task: str = SINGLE_LABEL, site: str = "site-1",
               info=None, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 8, 8), dtype=np.uint8)
    if task == SINGLE_LABEL:
        labels = np.eye(num_classes, dtype=np.float32)[np.arange(n) % num_classes]
    else:
        labels = (rng.random((n, num_classes)) < 0.4).astype(np.float32)
    mask = np.ones_like(labels, dtype=bool)
    if not labelled:
        labels, mask = np.zeros_like(labels), np.zeros_like(mask)
    split = Split(images, labels, mask)
    return Dataset(task, [f"c{i}" for i in range(num_classes)], {"train": split}, source="memory", site=site,
                   info=dict(info or {}))


def _ctx(data: Dataset, state_dir, seed: int = 3) -> ClientContext:
    return ClientContext(site=data.site, data=data, device=torch.device("cpu"), state_dir=str(state_dir), seed=seed,
                         log=lambda msg: None)


def _model(num_classes: int = 3, dropout: float = 0.3, seed: int = 0):
    torch.manual_seed(seed)
    return build_model("small_cnn", num_classes, in_channels=1, width=4, depth=2, dropout=dropout)


def _client(**kw) -> FedIRMClient:
    args = dict(batch_size=8, augmentation="flip", mc_passes=3)
    args.update(kw)
    return FedIRMClient(**args)


# ---- relation matrix ----------------------------------------------------------------------------
def test_relation_matrix_single_label_with_absent_class():
    # class 0: logits [2,0,0] and [4,0,2] -> mean [3,0,1], /T=2 -> [1.5,0,0.5]
    #   softmax: e^1.5=4.48169, e^0=1, e^0.5=1.64872; sum 7.13041 -> [0.628533, 0.140244, 0.231224]
    # class 1: one sample [0,2,0] -> [0,1,0]; e: 1, 2.71828, 1; sum 4.71828 -> [0.211942, 0.576117, 0.211942]
    # class 2: no sample -> uniform placeholder 1/3, count 0
    logits = torch.tensor([[2.0, 0.0, 0.0], [4.0, 0.0, 2.0], [0.0, 2.0, 0.0]])
    labels = torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 1, 0]])
    matrix, counts = relation_matrix(logits, labels, temperature=2.0)
    expected = torch.tensor([[0.628533, 0.140244, 0.231224], [0.211942, 0.576117, 0.211942], [1 / 3, 1 / 3, 1 / 3]])
    assert torch.allclose(matrix, expected, atol=1e-5)
    assert counts.tolist() == [2.0, 1.0, 0.0]


def test_relation_matrix_multilabel_sigmoid_rows():
    # class 0 positives: [2,0,-2] and [0,2,2] -> mean [1,1,0] /2 -> sigmoid [0.622459, 0.622459, 0.5]
    # class 1: none -> 0.5 placeholder; class 2: only [0,2,2] -> [0,1,1] -> [0.5, 0.731059, 0.731059]
    logits = torch.tensor([[2.0, 0.0, -2.0], [0.0, 2.0, 2.0]])
    labels = torch.tensor([[1.0, 0, 0], [1, 0, 1]])
    matrix, counts = relation_matrix(logits, labels, temperature=2.0, multilabel=True)
    expected = torch.tensor([[0.622459, 0.622459, 0.5], [0.5, 0.5, 0.5], [0.5, 0.731059, 0.731059]])
    assert torch.allclose(matrix, expected, atol=1e-5)
    assert counts.tolist() == [2.0, 0.0, 1.0]


def test_relation_matrix_is_differentiable():
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    matrix, _ = relation_matrix(logits, torch.eye(2))
    matrix[0, 0].backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# ---- symmetric KL -------------------------------------------------------------------------------
def test_symmetric_kl_single_label_averages_present_rows():
    # row 0: p=(0.5,0.5), q=(0.25,0.75): (0.25)(ln 2) + (-0.25)(ln(0.5/0.75)) = 0.173287 + 0.101366 = 0.274653
    # row 1: p == q -> 0.  row 2 differs but is not present.  mean over {0,1} = 0.137327
    target = torch.tensor([[0.5, 0.5], [0.3, 0.7], [0.9, 0.1]])
    estimate = torch.tensor([[0.25, 0.75], [0.3, 0.7], [0.1, 0.9]])
    present = torch.tensor([True, True, False])
    assert symmetric_kl(target, estimate, present).item() == pytest.approx(0.137327, abs=1e-5)
    assert symmetric_kl(target, estimate, torch.tensor([True, False, False])).item() == pytest.approx(0.274653, abs=1e-5)
    assert symmetric_kl(target, estimate, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_symmetric_kl_multilabel_binary_entries():
    # entry p=0.5,q=0.25: (0.25)(logit 0.5 - logit 0.25) = 0.25 * (0 + ln 3) = 0.274653; entry 0.8 vs 0.8: 0
    # row mean = 0.137327
    target = torch.tensor([[0.5, 0.8]])
    estimate = torch.tensor([[0.25, 0.8]])
    value = symmetric_kl(target, estimate, torch.tensor([True]), multilabel=True).item()
    assert value == pytest.approx(0.137327, abs=1e-5)


# ---- entropy filter -----------------------------------------------------------------------------
def test_entropy_filter_on_known_mc_samples():
    # sample A: both passes [0.9,0.05,0.05]: H = 0.9*0.105361 + 2*0.05*2.995732 = 0.094825 + 0.299573 = 0.394398 < ln2
    # sample B: passes [0.9,0.05,0.05] and [0.05,0.9,0.05] -> mean [0.475,0.475,0.05]:
    #   H = 2*0.475*0.744440 + 0.05*2.995732 = 0.707218 + 0.149787 = 0.857005 > ln2 (each pass alone is confident)
    # sample C: passes [0.7,0.2,0.1], [0.1,0.2,0.7] -> mean [0.4,0.2,0.4]: H = 2*0.4*0.916291 + 0.2*1.609438 = 1.054920
    mc = torch.tensor([[[0.9, 0.05, 0.05], [0.9, 0.05, 0.05], [0.7, 0.2, 0.1]],
                       [[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.1, 0.2, 0.7]]])
    reliable, entropy = reliable_mask(mc, math.log(2.0))
    assert torch.allclose(entropy, torch.tensor([0.394398, 0.857005, 1.054920]), atol=1e-5)
    assert reliable.tolist() == [True, False, False]
    # the reference code's threshold 2.0 keeps everything (ln 3 = 1.0986 < 2)
    assert reliable_mask(mc, 2.0)[0].all()


def test_entropy_filter_multilabel_per_entry():
    # entry mean 0.9: H = -(0.9 ln 0.9 + 0.1 ln 0.1) = 0.094825 + 0.230259 = 0.325083 < 0.5 -> reliable
    # entry mean 0.7 (passes 0.6, 0.8): H = 0.7*0.356675 + 0.3*1.203973 = 0.249672 + 0.361192 = 0.610864 -> not
    mc = torch.tensor([[[0.9, 0.6]], [[0.9, 0.8]]])
    reliable, entropy = reliable_mask(mc, 0.5, multilabel=True)
    assert torch.allclose(entropy, torch.tensor([[0.325083, 0.610864]]), atol=1e-5)
    assert reliable.tolist() == [[True, False]]


def test_mc_dropout_head_only_matches_full_passes_and_keeps_bn_stats():
    model = _model(dropout=0.5)
    model.train()
    x = torch.randn(4, 1, 8, 8)
    bn_before = copy.deepcopy([b.clone() for b in model.buffers()])
    torch.manual_seed(11)
    fast = mc_dropout_probabilities(model, x, passes=4)

    class Wrapper(torch.nn.Module):  # hides .fc / .dropout: forces 4 full passes
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    torch.manual_seed(11)
    full = mc_dropout_probabilities(Wrapper(model), x, passes=4)
    assert fast.shape == (4, 4, 3)
    assert torch.allclose(fast, full, atol=1e-6)
    assert not torch.allclose(fast[0], fast[1])  # dropout really samples
    assert model.training and model.dropout.training  # modes restored
    assert all(torch.equal(a, b) for a, b in zip(bn_before, model.buffers()))  # BN stats untouched


def test_consistency_loss_hand_value():
    # sample 1: (0.5-0.7)^2 + (0.5-0.3)^2 = 0.08; sample 2: 0 -> mean 0.04
    s = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    t = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    assert consistency_loss(s, t).item() == pytest.approx(0.04, abs=1e-7)


# ---- ramp-up -------------------------------------------------------------------------------------
@pytest.mark.parametrize("round_num, expected", [
    (0, 0.006738),    # exp(-5)
    (15, 0.286505),   # exp(-5 * 0.5^2) = exp(-1.25)
    (24, 0.818731),   # exp(-5 * 0.2^2) = exp(-0.2)
    (30, 1.0),
    (100, 1.0),       # omega capped at 30
])
def test_ramp_weight(round_num, expected):
    assert ramp_weight(round_num, 30) == pytest.approx(expected, abs=1e-6)


def test_ramp_length_configurable():
    assert ramp_weight(5, 10) == pytest.approx(math.exp(-1.25), abs=1e-9)
    assert ramp_weight(0, 0) == 1.0


# ---- server --------------------------------------------------------------------------------------
def _server_ctx(num_classes=3, global_stats=None, round_num=1):
    weights = {"fc.weight": np.zeros((num_classes, 4), np.float32), "fc.bias": np.zeros(num_classes, np.float32)}
    return ServerContext(round=round_num, num_rounds=5, classifier_param_names=["fc.weight", "fc.bias"],
                         global_weights=weights, global_stats=dict(global_stats or {}), log=lambda m: None)


A0, A1 = [0.6, 0.2, 0.2], [0.1, 0.8, 0.1]
B0, B2 = [0.4, 0.4, 0.2], [0.2, 0.2, 0.6]
U = [1 / 3] * 3


def _updates():
    a = SiteUpdate("site-1", {"w": np.array([1.0, 1.0])}, 10,
                   {RELATION_MATRIX: np.array([A0, A1, U]), RELATION_COUNTS: np.array([2.0, 1.0, 0.0]),
                    RELATION_MULTILABEL: 0})
    b = SiteUpdate("site-2", {"w": np.array([3.0, 3.0])}, 10,
                   {RELATION_MATRIX: np.array([B0, U, B2]), RELATION_COUNTS: np.array([6.0, 0.0, 3.0]),
                    RELATION_MULTILABEL: 0})
    c = SiteUpdate("site-3", {"w": np.array([6.0, 6.0])}, 20, {})  # unlabelled: weights only
    return [a, b, c]


def test_unlabelled_weight_scales_the_unlabelled_sites_in_the_weight_average():
    # labelled 10 x 1 and 10 x 3, unlabelled 20 x 6 counted as 20 * 0.25 = 5:
    # (10 + 30 + 5 * 6) / 25 = 70 / 25 = 2.8 (paper, weight 1: 160 / 40 = 4)
    ctx = _server_ctx()
    weights, stats = FedIRMServer(unlabelled_weight=0.25).aggregate(_updates(), ctx)
    assert np.allclose(weights["w"], [2.8, 2.8])
    # metrics.json gets the weights used: 10 / 25, 10 / 25, 5 / 25
    assert ctx.report["weights"] == pytest.approx({"site-1": 0.4, "site-2": 0.4, "site-3": 0.2})
    assert ctx.report["relation_counts"] == {"site-1": [2.0, 1.0, 0.0], "site-2": [6.0, 0.0, 3.0]}
    assert np.allclose(stats[RELATION_COUNTS], [8.0, 1.0, 3.0])  # the matrices are untouched
    # weight 0 = FedAvg of the labelled sites alone: (10 + 30) / 20 = 2
    assert np.allclose(FedIRMServer(unlabelled_weight=0.0).aggregate(_updates(), _server_ctx())[0]["w"], [2.0, 2.0])
    with pytest.raises(ValueError, match="unlabelled_weight"):
        FedIRMServer(unlabelled_weight=2.0)


def test_reliable_lowest_entropy_keeps_a_share_of_each_batch():
    entropy = torch.tensor([0.9, 0.1, 0.5, 0.1, 1.2])
    # ceil(0.4 * 5) = 2 lowest: the two 0.1 (indices 1 and 3)
    assert reliable_lowest_entropy(entropy, 0.4).tolist() == [False, True, False, True, False]
    assert reliable_lowest_entropy(entropy, 1.0).all()
    # multi-label: per class column; ceil(0.5 * 3) = 2 per column
    per_entry = torch.tensor([[0.2, 0.9], [0.1, 0.3], [0.7, 0.4]])
    assert reliable_lowest_entropy(per_entry, 0.5).tolist() == [[True, False], [True, True], [False, True]]


def test_server_averages_relation_over_labelled_sites_only_and_fedavg_weights_over_all():
    server = FedIRMServer()
    ups = _updates()
    for u in ups:
        server.check_stats(u, _server_ctx())
    weights, stats = server.aggregate(ups, _server_ctx())
    # FedAvg over all three: (10*1 + 10*3 + 20*6) / 40 = 160/40 = 4
    assert np.allclose(weights["w"], [4.0, 4.0])
    # row 0 = mean(A0, B0) = [0.5, 0.3, 0.2]; row 1 = A1 (site-2 has no class 1); row 2 = B2
    assert np.allclose(stats[RELATION_MATRIX], [[0.5, 0.3, 0.2], A1, B2])
    assert np.allclose(stats[RELATION_COUNTS], [8.0, 1.0, 3.0])
    assert np.allclose(stats[RELATION_VALID], [1, 1, 1])
    assert stats[RELATION_MULTILABEL] == 0


def test_server_count_weighting():
    weights, stats = FedIRMServer(relation_weighting="counts").aggregate(_updates(), _server_ctx())
    # row 0 = (2*A0 + 6*B0)/8 = ([1.2,0.4,0.4] + [2.4,2.4,1.2]) / 8 = [0.45, 0.35, 0.2]
    assert np.allclose(stats[RELATION_MATRIX][0], [0.45, 0.35, 0.2])


def test_class_absent_everywhere_keeps_previous_row_or_uniform():
    mats = [np.array([A0, U, U])]
    cnts = [np.array([3.0, 0.0, 0.0])]
    matrix, counts, valid = average_relation_matrices(mats, cnts)
    assert np.allclose(matrix, [A0, U, U]) and valid.tolist() == [1.0, 0.0, 0.0]
    previous = np.array([U, [0.2, 0.7, 0.1], U])
    matrix, _, valid = average_relation_matrices(mats, cnts, previous=previous, previous_valid=np.array([1, 1, 0]))
    assert np.allclose(matrix, [A0, [0.2, 0.7, 0.1], U]) and valid.tolist() == [1.0, 1.0, 0.0]
    ml, _, _ = average_relation_matrices([np.full((2, 2), 0.7)], [np.array([1.0, 0.0])], multilabel=True)
    assert np.allclose(ml, [[0.7, 0.7], [0.5, 0.5]])  # multi-label uniform = 0.5
    assert np.all(np.isfinite(matrix))


def test_server_without_labelled_sites_keeps_previous_stats():
    prev = {RELATION_MATRIX: np.array([A0, A1, B2]), RELATION_COUNTS: np.ones(3), RELATION_VALID: np.ones(3),
            RELATION_MULTILABEL: 0}
    weights, stats = FedIRMServer().aggregate([_updates()[2]], _server_ctx(global_stats=prev))
    assert np.allclose(weights["w"], [6.0, 6.0])
    assert np.allclose(stats[RELATION_MATRIX], prev[RELATION_MATRIX])
    _, empty = FedIRMServer().aggregate([_updates()[2]], _server_ctx())
    assert empty == {}


@pytest.mark.parametrize("stats, key", [
    ({RELATION_MATRIX: np.full((2, 2), 0.5), RELATION_COUNTS: np.ones(2)}, RELATION_MATRIX),      # wrong C
    ({RELATION_MATRIX: np.array([A0, A1, [np.nan, 0.5, 0.5]]), RELATION_COUNTS: np.ones(3)}, RELATION_MATRIX),
    ({RELATION_MATRIX: np.array([A0, A1, [0.5, 0.5, 0.5]]), RELATION_COUNTS: np.ones(3)}, RELATION_MATRIX),  # sum 1.5
    ({RELATION_MATRIX: np.array([A0, A1, B2]), RELATION_COUNTS: np.array([1.0, np.inf, 1.0])}, RELATION_COUNTS),
    ({RELATION_MATRIX: np.array([A0, A1, B2]), RELATION_COUNTS: np.ones(4)}, RELATION_COUNTS),
    ({RELATION_MATRIX: np.array([A0, A1, B2])}, RELATION_COUNTS),                                  # missing
])
def test_check_stats_names_bad_key(stats, key):
    with pytest.raises(ValueError, match=key):
        FedIRMServer().check_stats(SiteUpdate("site-9", {}, 5, stats), _server_ctx())


# ---- client --------------------------------------------------------------------------------------
def test_labelled_or_not_comes_from_the_data_not_the_name(tmp_path):
    rule = _client()
    rule.setup(_ctx(_site_data(labelled=False, site="site-1"), tmp_path))  # "site-1" but no annotation
    assert rule.labelled is False
    rule.setup(_ctx(_site_data(labelled=True, site="site-9"), tmp_path))
    assert rule.labelled is True
    with pytest.raises(ValueError, match="labelled"):
        rule.setup(_ctx(_site_data(labelled=False, info={"labelled": True}), tmp_path))


def test_labelled_round_sends_relation_stats(tmp_path):
    data = _site_data(labelled=True, n=16)  # classes 0,1,2 repeated: counts 6, 5, 5
    rule = _client()
    rule.setup(_ctx(data, tmp_path))
    model = _model()
    before = copy.deepcopy(model.state_dict())
    result = rule.train_round(model, RoundInput(0, 3, {}))
    assert result.num_samples == 16
    matrix, counts = result.stats[RELATION_MATRIX], result.stats[RELATION_COUNTS]
    assert matrix.shape == (3, 3) and np.allclose(matrix.sum(axis=1), 1.0)
    assert counts.tolist() == [6.0, 5.0, 5.0]  # 16 = 2 full batches of 8: every sample seen once
    assert result.stats[RELATION_MULTILABEL] == 0
    assert not torch.equal(before["fc.weight"], model.state_dict()["fc.weight"])  # it trained
    FedIRMServer().check_stats(SiteUpdate("site-1", {}, 16, result.stats), _server_ctx())


def test_labelled_multilabel_round(tmp_path):
    data = _site_data(labelled=True, n=16, num_classes=4, task=MULTI_LABEL)
    rule = _client()
    rule.setup(_ctx(data, tmp_path))
    result = rule.train_round(_model(num_classes=4), RoundInput(0, 3, {}))
    labels = data.splits["train"].labels
    rows = np.flatnonzero(data.splits["train"].label_mask.any(axis=1))
    assert np.allclose(result.stats[RELATION_COUNTS], labels[rows].sum(axis=0))
    assert result.stats[RELATION_MULTILABEL] == 1
    assert result.stats[RELATION_MATRIX].shape == (4, 4)


def test_unlabelled_round0_skips_irm_then_uses_matrix(tmp_path):
    rule = _client(entropy_threshold=5.0)  # keep every pseudo label so the IRM term surely acts
    rule.setup(_ctx(_site_data(labelled=False), tmp_path))
    model = _model()
    r0 = rule.train_round(model, RoundInput(0, 3, {}))
    assert r0.num_samples == 16 and r0.stats == {}
    assert r0.metrics["irm_active"] == 0.0 and r0.metrics["irm_loss"] == 0.0
    assert r0.metrics["ramp_weight"] == pytest.approx(math.exp(-5), abs=1e-9)
    target = np.array([[0.98, 0.01, 0.01], [0.01, 0.98, 0.01], [0.01, 0.01, 0.98]])
    r1 = rule.train_round(model, RoundInput(1, 3, {RELATION_MATRIX: target, RELATION_VALID: np.ones(3)}))
    assert r1.metrics["irm_active"] == 1.0 and r1.metrics["irm_loss"] > 0.0
    assert r1.metrics["reliable_fraction"] == 1.0
    with pytest.raises(ValueError, match=RELATION_MATRIX):
        rule.train_round(model, RoundInput(2, 3, {RELATION_MATRIX: np.ones((2, 2)) / 2}))


def test_unlabelled_site_joins_at_configured_round(tmp_path):
    rule = _client(unlabelled_start_round=2)
    rule.setup(_ctx(_site_data(labelled=False), tmp_path))
    model = _model()
    before = copy.deepcopy(model.state_dict())
    result = rule.train_round(model, RoundInput(1, 3, {}))
    assert result.num_samples == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / TEACHER_FILE).exists()
    assert rule.train_round(model, RoundInput(2, 3, {})).num_samples == 16


def test_teacher_persists_across_site_restart(tmp_path):
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    dir_a.mkdir(), dir_b.mkdir()
    data = _site_data(labelled=False)
    rule_a = _client()
    rule_a.setup(_ctx(data, dir_a))
    model = _model()
    rule_a.train_round(model, RoundInput(0, 3, {}))
    shutil.copy(dir_a / TEACHER_FILE, dir_b / TEACHER_FILE)  # the state a restarted site finds
    saved = torch.load(dir_a / TEACHER_FILE, weights_only=True)
    global_model = _model(seed=5)  # round 1's global model: different from the teacher

    # the restarted rule rebuilds the teacher from the file, not from the received model
    rule_b = _client()
    rule_b.setup(_ctx(data, dir_b))
    teacher = rule_b.teacher_for(copy.deepcopy(global_model))
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in teacher.model.state_dict().items())
    assert not torch.equal(teacher.model.state_dict()["fc.weight"], global_model.state_dict()["fc.weight"])

    # and round 1 continues exactly as if the site had never stopped
    rule_b = _client()
    rule_b.setup(_ctx(data, dir_b))
    rule_a.train_round(copy.deepcopy(global_model), RoundInput(1, 3, {}))
    rule_b.train_round(copy.deepcopy(global_model), RoundInput(1, 3, {}))
    ta, tb = rule_a.teacher_for(global_model).model.state_dict(), rule_b.teacher_for(global_model).model.state_dict()
    assert all(torch.allclose(ta[k].float(), tb[k].float(), atol=1e-6) for k in ta)


def test_constructor_rejects_bad_values():
    with pytest.raises(ValueError, match="augmentation"):
        FedIRMClient(augmentation="rotate")
    with pytest.raises(ValueError, match="temperature"):
        FedIRMClient(temperature=0)
    with pytest.raises(ValueError, match="relation_weighting"):
        FedIRMServer(relation_weighting="median")


def test_affine_augmentation_changes_images_keeps_shape(tmp_path):
    rule = FedIRMClient(augmentation="affine")
    x = torch.randn(3, 1, 16, 16)
    y = rule._augment(x)
    assert y.shape == x.shape and not torch.allclose(x, y)


def test_unlabelled_multilabel_round_and_diagnostics(tmp_path):
    data = _site_data(labelled=False, task=MULTI_LABEL, num_classes=4)
    reference = _site_data(labelled=True, task=MULTI_LABEL, num_classes=4)  # same seed: the true labels
    ctx = _ctx(data, tmp_path)
    ctx.reference = reference
    rule = _client(multilabel_entropy_threshold=0.7)  # > ln 2: every entry reliable, positives = sigmoid > 0.5
    rule.setup(ctx)
    target = np.full((4, 4), 0.3)
    result = rule.train_round(_model(num_classes=4), RoundInput(1, 3, {RELATION_MATRIX: target}))
    assert result.metrics["irm_active"] == 1.0
    assert 0.0 <= result.metrics["pseudo_precision"] <= 1.0
    assert 0.0 < result.metrics["reliable_fraction"] < 1.0  # a positive needs sigmoid > 0.5: not every entry


@pytest.mark.parametrize("scales_lr, step", [(False, 1e-2), (True, 1e-2 * math.exp(-5))])
def test_ramp_scales_lr_shortens_adam_step(tmp_path, scales_lr, step):
    # one batch (8 samples, batch 8) = one Adam step; Adam's first step moves every parameter with a
    # non-zero gradient by exactly lr (m/sqrt(v) = sign(g)); with ramp_scales_lr lr is 1e-2 * exp(-5) at round 0
    rule = _client(lr=1e-2, ramp_scales_lr=scales_lr, weight_decay=0.0)
    rule.setup(_ctx(_site_data(labelled=False, n=8), tmp_path))
    model = _model()
    before = model.fc.bias.detach().clone()
    rule.train_round(model, RoundInput(0, 3, {}))
    assert torch.allclose((model.fc.bias.detach() - before).abs(), torch.full((3,), step), rtol=1e-3)


def test_relation_counts_count_distinct_images_not_visits(tmp_path):
    # 8 images, classes [0,0,0,1,1,1,2,2]; 5 local epochs of one batch of 8 each: class 2's two images
    # are visited 10 times, but the count released (and compared with k) is 2 images.
    data = _site_data(labelled=True, n=8)
    labels = np.eye(3, dtype=np.float32)[[0, 0, 0, 1, 1, 1, 2, 2]]
    data.splits["train"] = Split(data.splits["train"].images, labels, np.ones_like(labels, dtype=bool))
    rule = _client(local_epochs=5, batch_size=8)
    rule.setup(_ctx(data, tmp_path))
    result = rule.train_round(_model(), RoundInput(0, 3, {}))
    assert result.metrics["train_steps"] == 5.0  # 5 epochs x 1 batch: every image visited 5 times
    assert result.stats[RELATION_COUNTS].tolist() == [3.0, 3.0, 2.0]  # not [15, 15, 10]


def test_reliable_lowest_entropy_per_class_keeps_a_share_of_each_predicted_class():
    # 3 predicted as class 0 (entropies 0.1, 0.2, 0.3), 2 as class 1 (0.9, 0.8); 40 % of the batch keeps
    # the two surest class-0 samples only; 40 % of each class keeps ceil(1.2) = 2 of class 0 and
    # ceil(0.8) = 1 of class 1, its surer one (0.8)
    entropy = torch.tensor([0.1, 0.2, 0.3, 0.9, 0.8])
    predicted = torch.tensor([0, 0, 0, 1, 1])
    assert reliable_lowest_entropy(entropy, 0.4).tolist() == [True, True, False, False, False]
    assert reliable_lowest_entropy_per_class(entropy, predicted, 0.4).tolist() == [True, True, False, False, True]
    assert reliable_lowest_entropy_per_class(entropy, predicted, 1.0).all()


@pytest.mark.parametrize("relation_weight, pseudo_label_weight", [(1.0, 0.0), (0.0, 0.0), (2.0, 0.0), (1.0, 0.5)])
def test_unlabelled_loss_weighs_each_part(tmp_path, monkeypatch, relation_weight, pseudo_label_weight):
    # per step: loss = lambda * (L_c + relation_weight * L_IRM + pseudo_label_weight * L_pseudo); the paper's
    # rule is (1, 0) and has no L_pseudo. The three parts are pinned to 1, 10 and 100 (each still
    # differentiable), so the step's loss is lambda * (1 + 10 w_r + 100 w_p), worked out by hand.
    from fedpartial.algorithms import fedirm

    def pinned(value):
        return lambda first, *args, **kwargs: first.sum() * 0.0 + value

    monkeypatch.setattr(fedirm, "consistency_loss", pinned(1.0))
    monkeypatch.setattr(fedirm, "symmetric_kl", lambda target, estimate, *a, **k: estimate.sum() * 0.0 + 10.0)
    monkeypatch.setattr(fedirm, "pseudo_label_loss", pinned(100.0))
    rule = _client(entropy_threshold=5.0, relation_weight=relation_weight, pseudo_label_weight=pseudo_label_weight)
    rule.setup(_ctx(_site_data(labelled=False), tmp_path))
    target = np.array([[0.98, 0.01, 0.01], [0.01, 0.98, 0.01], [0.01, 0.01, 0.98]])
    m = rule.train_round(_model(), RoundInput(1, 3, {RELATION_MATRIX: target, RELATION_VALID: np.ones(3)})).metrics
    lam = m["ramp_weight"]
    assert lam == pytest.approx(fedirm.ramp_weight(1, 30))  # max_unsupervised_weight 1
    expected_pseudo = 100.0 if pseudo_label_weight > 0 else 0.0  # not computed when its weight is 0
    assert m["pseudo_label_loss"] == pytest.approx(expected_pseudo)
    assert m["train_loss"] == pytest.approx(lam * (1.0 + 10.0 * relation_weight + 100.0 * pseudo_label_weight), rel=1e-6)
    with pytest.raises(ValueError, match="relation_weight"):
        _client(relation_weight=-1.0)
    with pytest.raises(ValueError, match="pseudo_label_weight"):
        _client(pseudo_label_weight=-1.0)


def test_pseudo_label_loss_is_the_cross_entropy_of_the_reliable_predictions():
    # logits [0,0,0] -> class 0: ln 3; [ln 4, 0, 0] -> class 0: -ln(4/6) = ln 1.5; [0,0,0] -> class 1: ln 3
    logits = torch.tensor([[0.0, 0.0, 0.0], [math.log(4.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    targets = torch.eye(3)[[0, 0, 1]]
    reliable = torch.tensor([True, True, False])
    assert float(pseudo_label_loss(logits, targets, reliable)) == pytest.approx((math.log(3) + math.log(1.5)) / 2)
    # balanced, all three kept: class 0's two samples weigh 1/2 each, class 1's one sample 1
    every = torch.ones(3, dtype=torch.bool)
    assert float(pseudo_label_loss(logits, targets, every)) == pytest.approx((2 * math.log(3) + math.log(1.5)) / 3)
    assert float(pseudo_label_loss(logits, targets, every, balanced=True)) == pytest.approx(
        (0.5 * math.log(3) + 0.5 * math.log(1.5) + math.log(3)) / 2)
    assert float(pseudo_label_loss(logits, targets, torch.zeros(3, dtype=torch.bool))) == 0.0
    # multi-label: the reliable entry alone, BCE(sigmoid(ln 3) = 3/4, 1) = ln(4/3)
    assert float(pseudo_label_loss(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[1.0, 1.0]]),
                                   torch.tensor([[False, True]]), multilabel=True)) == pytest.approx(math.log(4 / 3))
