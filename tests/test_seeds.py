"""Every site draws its own shuffles and augmentations (the site's name is mixed into the round
seed), and the same seed repeats a site's round exactly: for every method's client rule."""
import dataclasses

import numpy as np
import pytest
import torch

from fedpartial.algorithms.base import ClientContext, RoundInput
from fedpartial.data.types import Split
from fedpartial.models import build_model
from fedpartial.training.common import round_seed, state_dict_numpy
from fedpartial_tools.data.synthetic import make_classification, make_segmentation


def test_round_seed_mixes_run_seed_site_and_round():
    seeds = {(s, site, r): round_seed(s, site, r) for s in (0, 1) for site in ("site-1", "site-2") for r in (0, 1)}
    assert len(set(seeds.values())) == len(seeds)  # all eight differ
    assert round_seed(3, "hospital-a", 7) == round_seed(3, "hospital-a", 7)
    assert 0 <= round_seed(2**40, "x" * 100, 10**6) < 2**31  # any input -> a valid torch / numpy seed


def _classification(task, labelled=True):
    data = make_classification(task, num_classes=3, n_train=48, n_val=8, n_test=4, size=16, seed=0)
    train = data.splits["train"]
    mask = np.ones_like(train.labels, dtype=bool) if labelled else np.zeros_like(train.labels, dtype=bool)
    return dataclasses.replace(data, splits={**data.splits, "train": Split(train.images, train.labels * mask, mask)})


def _rules():
    from fedpartial.algorithms.fedavg import SupervisedClient
    from fedpartial.algorithms.fedia import FedIAClient
    from fedpartial.algorithms.fedirm import FedIRMClient
    from fedpartial.algorithms.fedlsm import FedLSMClient
    from fedpartial.algorithms.fedmlp import FedMLPClient
    from fedpartial.algorithms.segmentation import SegmentationSupervisedClient

    seg = make_segmentation(n_train=8, n_val=2, n_test=2, size=32, seed=0)
    return {
        "fedavg": (lambda: SupervisedClient(lr=1e-2, batch_size=8), _classification("single-label")),
        "fedlsm": (lambda: FedLSMClient(lr=1e-2, batch_size=8, local_epochs=1), _classification("single-label")),
        "fedmlp": (lambda: FedMLPClient(lr=1e-2, batch_size=8, warmup_rounds=5), _classification("multi-label")),
        "fedirm": (lambda: FedIRMClient(lr=1e-2, batch_size=8), _classification("single-label")),
        "segmentation": (lambda: SegmentationSupervisedClient(lr=1e-2, batch_size=2), seg),
        "fedia": (lambda: FedIAClient(lr=1e-2, batch_size=2, warmup_rounds=5), seg),
    }


@pytest.mark.parametrize("method", ["fedavg", "fedlsm", "fedmlp", "fedirm", "segmentation", "fedia"])
def test_equal_sites_train_differently_and_a_rerun_repeats(method, tmp_path):
    make_rule, data = _rules()[method]
    segmentation = method in ("segmentation", "fedia")
    torch.manual_seed(0)
    model = (build_model("unet", 1, 1, channels=[4, 8], strides=[2]) if segmentation
             else build_model("small_cnn", 3, 1, width=8, depth=2))
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def one_round(site):
        # the same images and labels under two names: only the seed can tell them apart
        rule = make_rule()
        rule.setup(ClientContext(site=site, data=dataclasses.replace(data, site=site), device=torch.device("cpu"),
                                 state_dir=str(tmp_path / site), seed=0))
        model.load_state_dict(start)
        rule.train_round(model, RoundInput(0, 3, {}))
        return {k: np.array(v, copy=True) for k, v in state_dict_numpy(model).items()}

    first, again, other = one_round("site-1"), one_round("site-1"), one_round("site-2")
    assert all(np.array_equal(first[k], again[k]) for k in first), "same site, seed and round must repeat"
    assert any(not np.allclose(first[k], other[k]) for k in first), "equal sites drew identical batches"
