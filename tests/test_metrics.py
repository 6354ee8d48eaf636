"""Metrics against values counted by hand (and scikit-learn where it applies)."""
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, roc_auc_score

from fedpartial.metrics import classification_metrics, segmentation_metrics, segmentation_scores

# --- multi-label: 4 samples, 3 classes ------------------------------------------------------
# class a: labels 0,0,1,1 ; probs .1 .4 .35 .8
#   AUC: pos-neg pairs (.35>.1 yes, .35>.4 no, .8>.1 yes, .8>.4 yes) = 3/4
#   AP: ranked .8(+) .4(-) .35(+) .1(-): 0.5*1 + 0.5*(2/3) = 5/6
#   preds @0.5: 0,0,0,1 -> tp 1 fp 0 fn 1: P 1, R 1/2, F1 2/3; bacc (1/2 + 2/2)/2 = 3/4
# class b: labels all 0 (AUC, AP undefined); probs .2 .6 .1 .3 -> preds 0,1,0,0: tp 0 fp 1: F1 0
# class c: labels all 0; probs all .1 -> no positive, no predicted positive: F1 undefined (NaN)
ML_LABELS = np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]])
ML_PROBS = np.array([[0.1, 0.2, 0.1], [0.4, 0.6, 0.1], [0.35, 0.1, 0.1], [0.8, 0.3, 0.1]])


def test_multilabel_by_hand():
    m = classification_metrics(ML_PROBS, ML_LABELS, "multi-label", ["a", "b", "c"])
    assert m["auc"] == pytest.approx(0.75)  # only class a is defined
    assert m["map"] == pytest.approx(5 / 6)
    assert m["bacc"] == pytest.approx(0.75)
    # entries right: a 3/4, b 3/4, c 4/4 -> 10/12
    assert m["accuracy"] == pytest.approx(10 / 12)
    # macro over all 3 classes, zero_division=0: F1 (2/3+0+0)/3, P (1+0+0)/3, R (1/2+0+0)/3
    assert m["f1"] == pytest.approx(2 / 9)
    assert m["precision"] == pytest.approx(1 / 3)
    assert m["recall"] == pytest.approx(1 / 6)
    a, b, c = m["per_class"]["a"], m["per_class"]["b"], m["per_class"]["c"]
    assert (a["n_pos"], b["n_pos"], c["n_pos"]) == (2, 0, 0)
    assert a["auc"] == pytest.approx(0.75) and a["ap"] == pytest.approx(5 / 6) and a["f1"] == pytest.approx(2 / 3)
    assert math.isnan(b["auc"]) and math.isnan(b["ap"]) and b["f1"] == 0.0
    assert math.isnan(c["f1"])
    assert m["f1"] == pytest.approx(f1_score(ML_LABELS, ML_PROBS >= 0.5, average="macro", zero_division=0))


def test_multilabel_threshold_changes_decisions():
    m = classification_metrics(ML_PROBS, ML_LABELS, "multi-label", ["a", "b", "c"], threshold=0.3)
    # class a preds at .3: 0,1,1,1 -> TPR 1, TNR 1/2 -> bacc 3/4 ; tp 2 fp 1 -> F1 4/5
    assert m["per_class"]["a"]["f1"] == pytest.approx(0.8)
    assert m["auc"] == pytest.approx(0.75)  # ranking metrics do not depend on the threshold


# --- single-label: 4 samples, 3 classes; true classes 0,1,2,2 -------------------------------
# argmax preds 0,0,2,2 -> accuracy 3/4; recalls 1, 0, 1 -> bacc 2/3
# precision: c0 1/2, c1 0 (none predicted), c2 1 -> 1/2 ; F1: 2/3, 0, 1 -> 5/9
# OvR AUC: c0 1 ; c1 pos .3 vs neg .2,.2,.3 -> (1+1+0.5)/3 = 5/6 ; c2 1 -> mean 17/18
# AP: c0 1 ; c1 tie at .3 between pos and neg -> P 1/2 at R 1 -> 1/2 ; c2 1 -> mean 5/6
SL_LABELS = np.eye(3)[[0, 1, 2, 2]]
SL_PROBS = np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.2, 0.3, 0.5]])


def test_single_label_by_hand():
    m = classification_metrics(SL_PROBS, SL_LABELS, "single-label", ["x", "y", "z"])
    assert m["accuracy"] == pytest.approx(0.75)
    assert m["bacc"] == pytest.approx(2 / 3)
    assert m["precision"] == pytest.approx(0.5)
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx(5 / 9)
    assert m["auc"] == pytest.approx(17 / 18)
    assert m["map"] == pytest.approx(5 / 6)
    assert m["per_class"]["y"] == pytest.approx({"auc": 5 / 6, "ap": 0.5, "f1": 0.0, "n_pos": 1})
    # sklearn's macro one-vs-rest AUC agrees
    assert m["auc"] == pytest.approx(roc_auc_score([0, 1, 2, 2], SL_PROBS, multi_class="ovr", average="macro"))


def test_single_label_accepts_tensors_and_returns_plain_floats():
    m = classification_metrics(torch.tensor(SL_PROBS), torch.tensor(SL_LABELS), "single-label", ["x", "y", "z"])
    assert type(m["auc"]) is float and type(m["per_class"]["x"]["n_pos"]) is int


def test_classification_errors():
    with pytest.raises(ValueError, match=r"probs shape \(4, 3\) and labels shape \(4, 2\)"):
        classification_metrics(ML_PROBS, ML_LABELS[:, :2], "multi-label", ["a", "b", "c"])
    with pytest.raises(ValueError, match="2 class_names for 3 columns"):
        classification_metrics(ML_PROBS, ML_LABELS, "multi-label", ["a", "b"])
    with pytest.raises(ValueError, match="apply softmax / sigmoid"):
        classification_metrics(ML_PROBS * 5 - 1, ML_LABELS, "multi-label", ["a", "b", "c"])
    with pytest.raises(ValueError, match="one-hot"):  # multi-label rows fed as single-label
        classification_metrics(ML_PROBS, ML_LABELS, "single-label", ["a", "b", "c"])
    with pytest.raises(ValueError, match="task must be one of"):
        classification_metrics(ML_PROBS, ML_LABELS, "segmentation", ["a", "b", "c"])


# --- segmentation ---------------------------------------------------------------------------
def _drawn_masks():
    # pred 3 px, target 4 px, overlap 2 px -> dice 2*2/(3+4) = 4/7 ; iou 2/(3+4-2) = 2/5
    pred = np.zeros((4, 4), np.uint8)
    pred[0, 0:3] = 1                    # (0,0) (0,1) (0,2)
    target = np.zeros((4, 4), np.uint8)
    target[0, 1:3] = 1                  # (0,1) (0,2)  overlap 2
    target[1, 1:3] = 1                  # (1,1) (1,2)
    return pred, target


def test_dice_iou_by_hand():
    pred, target = _drawn_masks()
    m = segmentation_metrics(pred[None], target[None])
    assert m["dice"] == pytest.approx(4 / 7)
    assert m["iou"] == pytest.approx(2 / 5)


def test_empty_images_and_mean_over_images():
    pred, target = _drawn_masks()
    empty = np.zeros((4, 4), np.uint8)
    spot = empty.copy()
    spot[3, 3] = 1
    # image 2: both empty -> 1 (ignore_empty=False) ; image 3: empty target, 1 false px -> 0
    preds = np.stack([pred, empty, spot])
    targets = np.stack([target, empty, empty])
    scores = segmentation_scores(preds, targets)
    np.testing.assert_allclose(scores["dice"], [4 / 7, 1.0, 0.0])
    np.testing.assert_allclose(scores["iou"], [2 / 5, 1.0, 0.0])
    m = segmentation_metrics(torch.from_numpy(preds)[:, None], torch.from_numpy(targets))  # (N,1,H,W) works too
    assert m["dice"] == pytest.approx((4 / 7 + 1) / 3)
    assert m["iou"] == pytest.approx((2 / 5 + 1) / 3)


def test_segmentation_errors():
    pred, target = _drawn_masks()
    with pytest.raises(ValueError, match=r"pred shape \(1, 4, 4\) and target shape \(1, 3, 4\)"):
        segmentation_metrics(pred[None], target[None, :3])
    with pytest.raises(ValueError, match="only 0/1"):
        segmentation_metrics(pred[None] * 0.7, target[None])
    with pytest.raises(ValueError, match=r"got shape \(4, 4\)"):
        segmentation_metrics(pred, target)


def test_validation_metrics_and_pooled_validation_by_hand():
    from fedpartial.metrics import pooled_validation, validation_metrics

    # image 0: truth 4 px, prediction 2 of them + 2 outside (tp 2, fp 2, fn 2); image 1: empty both;
    # image 2: truth 1 px, nothing predicted (fn 1)
    truth = np.zeros((3, 4, 4), bool)
    pred = np.zeros_like(truth)
    truth[0, 0, :4] = True
    pred[0, 0, :2] = pred[0, 1, :2] = True
    truth[2, 3, 3] = True
    m = validation_metrics(pred, truth)
    assert (m["tp"], m["fp"], m["fn"], m["n_images"], m["n_empty_both"]) == (2, 2, 3, 3, 1)
    assert m["dice_pooled"] == pytest.approx(4 / 9)  # 2*2 / (2*2 + 2 + 3)
    assert m["dice_per_image"] == pytest.approx((0.5 + 0.0) / 2)  # the empty-both image left out
    assert m["predicted_lesion_share"] == pytest.approx(1 / 3)
    # a second site predicting nothing on 2 lesion-free images: pooled over 5 images, Dice unchanged
    other = validation_metrics(np.zeros((2, 4, 4), bool), np.zeros((2, 4, 4), bool))
    assert "dice_pooled" not in other  # undefined (no lesion anywhere): left out, not NaN
    pooled = pooled_validation({"a": m, "b": other, "c": {}})
    assert pooled == {"dice_pooled": pytest.approx(4 / 9), "predicted_lesion_share": pytest.approx(1 / 5),
                      "n_images": 5, "sites": 2}
    assert pooled_validation({"a": {"auc": 0.7}}) is None  # classification: nothing to pool
