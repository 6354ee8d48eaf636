"""FedAvg baselines: weighted averaging and the three loss modes, on hand-worked numbers."""
import math

import numpy as np
import pytest
import torch

from fedpartial.algorithms.aggregation import fedavg_weights
from fedpartial.algorithms.base import SiteUpdate
from fedpartial.algorithms.fedavg import labelled_rows, supervised_loss


def test_fedavg_weights_by_sample_count():
    # site a: 1 sample, w=0 ; site b: 3 samples, w=4  -> (1*0 + 3*4)/4 = 3
    a = SiteUpdate("a", {"w": np.array([0.0, 2.0], np.float32), "n": np.array(1, np.int64)}, 1)
    b = SiteUpdate("b", {"w": np.array([4.0, 6.0], np.float32), "n": np.array(5, np.int64)}, 3)
    out = fedavg_weights([a, b])
    np.testing.assert_allclose(out["w"], [3.0, 5.0])
    assert out["w"].dtype == np.float32
    # integer buffer: (1*1 + 3*5)/4 = 4, stays integer
    assert out["n"] == 4 and np.issubdtype(out["n"].dtype, np.integer)


def test_fedavg_skips_sites_without_samples_and_refuses_none():
    a = SiteUpdate("a", {"w": np.array([1.0])}, 2)
    unlabelled = SiteUpdate("u", {"w": np.array([100.0])}, 0)
    np.testing.assert_allclose(fedavg_weights([a, unlabelled])["w"], [1.0])
    with pytest.raises(ValueError, match="u"):
        fedavg_weights([unlabelled])


def test_labelled_rows_single_and_multi():
    labels = np.array([[1, 0, 0], [0, 0, 0], [0, 1, 0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]], np.float32)
    # single-label: row 0 has an annotated positive; row 1 is "none of my classes"; row 2 unannotated
    assert labelled_rows(labels, mask, "single-label").tolist() == [0]
    # multi-label: any annotated entry counts
    assert labelled_rows(labels, mask, "multi-label").tolist() == [0, 1]


def test_multilabel_partial_loss_ignores_missing_entries():
    logits = torch.zeros(1, 3)  # sigmoid = 0.5 -> BCE = ln 2 for any target
    labels = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    # changing the logit of an unannotated class must not move the partial loss
    logits2 = torch.tensor([[0.0, 5.0, -5.0]])
    assert math.isclose(float(supervised_loss(logits, labels, mask, "multi-label", "partial")), math.log(2), rel_tol=1e-6)
    assert math.isclose(float(supervised_loss(logits2, labels, mask, "multi-label", "partial")), math.log(2), rel_tol=1e-6)
    # missing-negative counts them: BCE(5, 0) = 5 + ln(1+e^-5); BCE(-5, 0) = ln(1+e^-5)
    expected = (math.log(2) + 5 + 2 * math.log1p(math.exp(-5))) / 3
    assert math.isclose(float(supervised_loss(logits2, labels, mask, "multi-label", "missing-negative")), expected,
                        rel_tol=1e-5)


def test_single_label_partial_softmax_over_annotated_classes():
    logits = torch.tensor([[2.0, 0.0, 5.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # site annotates classes 0 and 1
    # partial: softmax over {0,1}: -log(e^2/(e^2+1))
    partial = float(supervised_loss(logits, labels, mask, "single-label", "partial"))
    assert math.isclose(partial, -math.log(math.exp(2) / (math.exp(2) + 1)), rel_tol=1e-6)
    # missing-negative: softmax over all three classes
    full = float(supervised_loss(logits, labels, mask, "single-label", "missing-negative"))
    assert math.isclose(full, -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(5))), rel_tol=1e-6)


def test_single_label_unlabelled_sample_contributes_nothing():
    logits = torch.tensor([[2.0, 0.0, 5.0], [9.0, -9.0, 0.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    one = float(supervised_loss(logits[:1], labels[:1], mask[:1], "single-label", "missing-negative"))
    both = float(supervised_loss(logits, labels, mask, "single-label", "missing-negative"))
    assert math.isclose(one, both, rel_tol=1e-6)


def test_semi_supervised_split_fedavg_is_the_labelled_sites_and_fedavg_full_all(tmp_path):
    """FedIRM's bounds on a semi-supervised split (3 sites, the first labelled): ``fedavg`` lets the
    unlabelled sites take no part (0 samples, model untouched), so the global model IS the labelled
    site's; ``fedavg_full`` trains every site on its complete reference labels."""
    from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext
    from fedpartial.algorithms.fedavg import FedAvgServer, SupervisedClient
    from fedpartial_tools.data.partition import partition
    from fedpartial_tools.data.synthetic import make_classification
    from fedpartial.models import build_model
    from fedpartial.training.common import state_dict_numpy

    data = make_classification("single-label", num_classes=3, n_train=60, n_val=12, n_test=6, size=16, seed=0)
    sites, refs, _ = partition(data, "semi-supervised", sites=3, seed=0, labelled_sites=1)
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=8, depth=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def one_round(site_data, loss_mode):
        rule = SupervisedClient(loss_mode=loss_mode, lr=1e-2, batch_size=8)
        rule.setup(ClientContext(site=site_data.site, data=site_data, device=torch.device("cpu"),
                                 state_dir=str(tmp_path), seed=0))
        model.load_state_dict(start)
        result = rule.train_round(model, RoundInput(0, 1))
        return SiteUpdate(site_data.site, state_dict_numpy(model), result.num_samples)

    partial = [one_round(s, "missing-negative") for s in sites]
    sizes = [len(s.splits["train"]) for s in sites]
    assert [u.num_samples for u in partial] == [sizes[0], 0, 0]
    for u in partial[1:]:  # an unlabelled site does not train
        assert all(np.array_equal(u.weights[k], start[k].numpy()) for k in u.weights)
    ctx = ServerContext(round=0, num_rounds=1, classifier_param_names=model.classifier_param_names())
    weights, _ = FedAvgServer().aggregate(partial, ctx)
    assert all(np.array_equal(weights[k], partial[0].weights[k]) for k in weights)
    full = [one_round(r, "full") for r in refs]
    assert [u.num_samples for u in full] == sizes


# ---- the recipe a baseline takes from its method (--matched-to) ----------------------------------
def test_label_smoothing_of_the_single_label_loss_hand_value():
    # softmax([ln 4, 0, 0]) = [2/3, 1/6, 1/6]; target class 0
    logits = torch.tensor([[math.log(4.0), 0.0, 0.0]])
    labels, mask = torch.tensor([[1.0, 0.0, 0.0]]), torch.ones(1, 3)
    assert float(supervised_loss(logits, labels, mask, "single-label", "missing-negative")) == pytest.approx(
        math.log(1.5), rel=1e-6)
    # smoothing 0.3: target (0.7 + 0.1, 0.1, 0.1) -> 0.8 ln 1.5 + 0.2 ln 6
    assert float(supervised_loss(logits, labels, mask, "single-label", "missing-negative", 0.3)) == pytest.approx(
        0.8 * math.log(1.5) + 0.2 * math.log(6.0), rel=1e-6)


class _CountingNet(torch.nn.Module):
    """A linear classifier on 4x4 grey images that counts its forward passes."""

    def __init__(self):
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(16, 3), 0

    def forward(self, x):
        self.calls += 1
        return None, self.fc(x.flatten(1))


def _rule_round(tmp_path, **rule_args):
    from fedpartial.algorithms.base import ClientContext, RoundInput
    from fedpartial.algorithms.fedavg import SupervisedClient
    from fedpartial.data.types import Dataset, Split

    labels = np.eye(3, dtype=np.float32)[np.arange(10) % 3]
    images = np.arange(10 * 16, dtype=np.uint8).reshape(10, 4, 4)
    data = Dataset("single-label", ["a", "b", "c"], {"train": Split(images, labels, np.ones_like(labels, bool))},
                   site="site-1")
    rule = SupervisedClient(lr=1e-3, batch_size=4, **rule_args)
    rule.setup(ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=str(tmp_path),
                             normalisation={"mean": 0.0, "std": 1.0}))
    net = _CountingNet()
    result = rule.train_round(net, RoundInput(0, 1, {}))
    return result.metrics["train_steps"], net.calls


def test_fractional_local_epochs_and_views_per_batch(tmp_path):
    # 10 labelled images, batch 4 (last partial batch dropped): one epoch = 10 // 4 = 2 steps;
    # 1.3 epochs = ceil(1.3 * 10 / 4) = 4 steps; two views = two forward passes per step
    assert _rule_round(tmp_path, augmentation="none") == (2, 2)
    assert _rule_round(tmp_path, augmentation="none", local_epochs=1.3) == (4, 4)
    assert _rule_round(tmp_path, augmentation="none", local_epochs=1.3, num_views=2) == (4, 8)
    with pytest.raises(ValueError, match="num_views"):
        _rule_round(tmp_path, num_views=0)


def test_affine_view_moves_pixels_keeps_shape():
    from fedpartial.data.transforms import TRAINING_VIEWS, training_view

    torch.manual_seed(0)
    batch = torch.rand(6, 1, 16, 16)
    moved = training_view("affine", rotate_deg=30.0, translate=0.1)(batch)
    assert moved.shape == batch.shape and not torch.allclose(moved, batch)
    assert training_view("none") is None and "affine" in TRAINING_VIEWS
    with pytest.raises(ValueError, match="unknown augmentation 'rotate'"):
        training_view("rotate")
