"""Shared losses (fedpartial.training.losses) against values worked out by hand."""
import math

import pytest
import torch

from fedpartial.training.losses import (MaskedBCEWithLogitsLoss, MaskedCrossEntropyLoss, masked_bce_with_logits,
                                        masked_cross_entropy)


def test_masked_bce_averages_only_the_annotated_entries():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    targets = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # entries used: sigmoid(0) = 1/2 -> ln 2; sigmoid(ln 3) = 3/4 -> ln 4/3
    want = (math.log(2.0) + math.log(4.0 / 3.0)) / 2
    assert masked_bce_with_logits(logits, targets, mask).item() == pytest.approx(want)
    # pos_weight 2 doubles both (positive) terms
    assert masked_bce_with_logits(logits, targets, mask, torch.tensor([2.0, 1.0])).item() == pytest.approx(2 * want)
    assert masked_bce_with_logits(logits, targets, torch.zeros(2, 2)).item() == 0.0  # nothing annotated
    assert MaskedBCEWithLogitsLoss()(logits, targets, mask).item() == pytest.approx(want)


def test_masked_cross_entropy_restricts_the_softmax_and_drops_zero_weight_samples():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [5.0, 0.0, 0.0]])
    target = torch.tensor([0, 1])
    # sample 0: over all classes p = 1 / (1 + 1 + 2) -> ln 4; over classes {0, 1}: p = 1/2 -> ln 2
    one = masked_cross_entropy(logits[:1], target[:1])
    assert one.item() == pytest.approx(math.log(4.0))
    restricted = masked_cross_entropy(logits, target, class_mask=torch.tensor([1.0, 1.0, 0.0]),
                                      sample_weight=torch.tensor([1.0, 0.0]))
    assert restricted.item() == pytest.approx(math.log(2.0))
    assert MaskedCrossEntropyLoss()(logits[:1], target[:1]).item() == pytest.approx(math.log(4.0))
    assert masked_cross_entropy(logits[:0], target[:0]).item() == 0.0


def test_losses_name_the_argument_with_the_wrong_shape_or_value():
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\)"):
        masked_bce_with_logits(logits, torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="pos_weight"):
        masked_bce_with_logits(logits, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="target_index"):
        masked_cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        MaskedCrossEntropyLoss(label_smoothing=1.0)
