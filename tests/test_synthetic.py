"""Synthetic data: deterministic given the seed, the promised layout, and learnable."""
import numpy as np
import pytest
from scipy import ndimage

from fedpartial_tools.data.synthetic import make_classification, make_segmentation


def _equal(a, b):
    return all(np.array_equal(getattr(a.splits[s], f), getattr(b.splits[s], f))
               for s in a.splits for f in ("images", "labels"))


def test_classification_is_deterministic_given_the_seed():
    assert _equal(make_classification(seed=3), make_classification(seed=3))
    assert not _equal(make_classification(seed=3), make_classification(seed=4))


@pytest.mark.parametrize("task", ["multi-label", "single-label"])
def test_classification_layout(task):
    data = make_classification(task=task, num_classes=4, n_train=40, n_val=10, n_test=6, size=16, channels=3)
    assert data.task == task and data.class_names == ["finding_0", "finding_1", "finding_2", "finding_3"]
    assert {k: len(s) for k, s in data.splits.items()} == {"train": 40, "val": 10, "test": 6}
    train = data.splits["train"]
    assert train.images.shape == (40, 16, 16, 3) and train.images.dtype == np.uint8
    assert train.labels.shape == (40, 4) and train.label_mask.all()
    if task == "single-label":
        assert (train.labels.sum(1) == 1).all()
    # two images per "patient", numbered across splits: train groups 0..19, val 20..24, test 25..27
    assert train.groups.tolist() == sorted(list(range(20)) * 2)
    assert data.splits["val"].groups.tolist() == sorted(list(range(20, 25)) * 2)


def test_multi_label_prevalence():
    labels = make_classification(n_train=400, seed=0).splits["train"].labels
    # each class present with probability 0.3: 400 draws, std sqrt(0.21 / 400) = 0.023
    assert ((labels.mean(0) > 0.2) & (labels.mean(0) < 0.4)).all()
    assert (labels.sum(1) == 0).any() and (labels.sum(1) >= 2).any()  # empty and multi-finding images


def _auc(scores, labels):
    """Mann-Whitney AUC: share of (positive, negative) pairs ranked the right way."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float((pos[:, None] > neg[None, :]).mean())


def test_classification_is_learnable():
    data = make_classification(num_classes=3, n_train=200, n_val=100, seed=1)
    x = data.splits["train"].images.reshape(200, -1) / 255.0
    xv = data.splits["val"].images.reshape(100, -1) / 255.0
    y, yv = data.splits["train"].labels, data.splits["val"].labels
    for c in range(3):
        # the simplest linear filter (mean positive image - mean negative image) already
        # separates each class on held-out data: a small CNN has it easy
        w = x[y[:, c] == 1].mean(0) - x[y[:, c] == 0].mean(0)
        assert _auc(xv @ w, yv[:, c]) > 0.95


def test_segmentation_instances_empty_and_touching():
    data = make_segmentation(n_train=64, n_val=4, n_test=4, size=64, max_lesions=6, seed=0)
    assert _equal(data, make_segmentation(n_train=64, n_val=4, n_test=4, size=64, max_lesions=6, seed=0))
    train = data.splits["train"]
    assert data.task == "segmentation" and data.class_names == ["lesion"]
    assert train.images.shape == (64, 64, 64) and train.labels.shape == (64, 64, 64)
    ids = [len(np.unique(m)) - 1 for m in train.labels]
    components = [ndimage.label(m > 0, structure=np.ones((3, 3)))[1] for m in train.labels]
    assert max(ids) <= 6 and train.labels.max() <= 6
    assert sum(n == 0 for n in ids) > 0  # some images have no lesion
    assert any(c < n for c, n in zip(components, ids))  # some lesions touch: fewer components than ids
    lesion = train.labels > 0
    assert train.images[lesion].mean() > train.images[~lesion].mean() + 80  # lesions are bright


def test_small_lesions_are_sparse_small_and_whole_lesions_can_be_dropped():
    from scipy import ndimage

    from fedpartial_tools.data.partition import partition
    from fedpartial_tools.data.synthetic import make_small_lesions

    data = make_small_lesions(n_train=60, n_val=4, n_test=4, size=96, seed=1)
    masks = np.asarray(data.splits["train"].labels)
    assert masks.shape == (60, 96, 96) and data.task == "segmentation"
    assert (masks > 0).mean() < 0.01  # well under 1 % of the pixels
    with_lesion = (masks > 0).reshape(60, -1).any(axis=1)
    assert 0.2 < with_lesion.mean() < 0.6  # most slices empty
    sizes = [int((lab == j).sum()) for m in masks for lab, k in [ndimage.label(m > 0, np.ones((3, 3)))]
             for j in range(1, k + 1)]
    assert 2 <= min(sizes) and np.median(sizes) < 80  # a few to a hundred pixels
    sites, refs, _ = partition(data, "incomplete-masks", sites=2, seed=0, completeness=[0.5, 1.0])
    kept = sum(int(np.asarray(s.splits["train"].labels).astype(bool).sum()) for s in sites)
    full = sum(int(np.asarray(r.splits["train"].labels).astype(bool).sum()) for r in refs)
    assert 0 < kept < full


def test_acquisition_shift_numbers_worked_by_hand():
    from fedpartial_tools.data.synthetic import acquisition_shift

    # grey 128, mean gain (1.12 + 0.96 + 0.82) / 3: (128 / 255 * 0.96667) ** 0.8 * 255 = 142.99;
    # a constant image keeps its value under the contrast step
    grey = acquisition_shift(np.full((1, 4, 4), 128, np.uint8), blur_sigma=0, noise_std=0)
    assert np.all(grey == 143)
    # RGB 100: gains -> 0.51779 / 0.45771 / 0.40346 after gamma; mean 0.45965; contrast 0.8 pulls
    # each channel toward it: 0.50616 / 0.45810 / 0.41470 -> 129 / 117 / 106
    rgb = acquisition_shift(np.full((1, 4, 4, 3), 100, np.uint8), blur_sigma=0, noise_std=0)
    assert rgb[0, 0, 0].tolist() == [129, 117, 106]
    # blur sigma 0.6 of one white pixel (scipy truncates at radius 2): kernel 1, 0.24935, 0.003866 over
    # 1.50643 -> centre 255 * 0.66382^2 = 112.4, 4-neighbour 255 * 0.66382 * 0.16553 = 28.0
    dot = np.zeros((1, 5, 5), np.uint8)
    dot[0, 2, 2] = 255
    out = acquisition_shift(dot, channel_gain=(1, 1, 1), gamma=1, contrast=1, noise_std=0, blur_sigma=0.6)
    assert out[0, 2, 1:4].tolist() == [28, 112, 28]
    # repeatable noise; floats refused
    x = np.full((2, 6, 6, 3), 90, np.uint8)
    assert np.array_equal(acquisition_shift(x, seed=3), acquisition_shift(x, seed=3))
    assert not np.array_equal(acquisition_shift(x, seed=3), acquisition_shift(x, seed=4))
    with pytest.raises(ValueError, match="uint8"):
        acquisition_shift(x.astype(np.float32))


def test_premise_multilabel_draws_each_class_at_its_prevalence_with_shapes_near_the_noise():
    from fedpartial_tools.data.synthetic import PREMISE_PREVALENCE, make_premise_multilabel, make_premise_multilabel_rare

    data = make_premise_multilabel(n_train=4000, n_val=10, n_test=10, seed=1)
    train = data.splits["train"]
    assert data.task == "multi-label" and train.images.shape == (4000, 32, 32) and train.images.dtype == np.uint8
    # binomial std at p = 0.45, n = 4000 is 0.008: 0.03 is > 3 std
    np.testing.assert_allclose(train.labels.mean(0), PREMISE_PREVALENCE, atol=0.03)
    # an image with no class holds only background (0.5 -> 127.5), noise and distractors: its mean
    # brightness sits within the distractors' ink (2 x 13 px x 0.35 / 1024 px x 255 = 2.2 grey levels)
    empty = train.images[train.labels.sum(1) == 0].astype(np.float64)
    assert abs(empty.mean() - 127.5 - 2.2) < 1.0
    # the noise std (0.15 x 255 = 38) dominates the shapes' amplitude (0.35 x 255 = 89) per pixel
    # only by 2.3x: amplitude near the noise
    assert 36 < float(np.median(empty.std(axis=(1, 2)))) < 44
    rare = make_premise_multilabel_rare(n_train=4000, n_val=10, n_test=10, seed=1)
    np.testing.assert_allclose(rare.splits["train"].labels.mean(0), np.array(PREMISE_PREVALENCE) * 0.1, atol=0.01)
    with pytest.raises(ValueError, match="prevalence"):
        make_premise_multilabel(prevalence=[0.2, 1.2])
