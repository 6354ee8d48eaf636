"""Augmentation views and resizing: exact flips, identity affine, repeatable seeded views."""
import numpy as np
import pytest
import torch

from fedpartial.data.sample_views import strong_pipeline, weak_pipeline
from fedpartial.data.transforms import affine_batch, flip_batch, make_view, resize_dataset, strong_batch
from fedpartial.data.types import Dataset, Split


def _batch(n=6):
    return torch.arange(n * 2 * 5 * 7, dtype=torch.float32).reshape(n, 2, 5, 7)  # no symmetry: flips show


def test_flip_batch_exact_flips():
    x = _batch()
    out = flip_batch(x, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # the same draws, in the same order: horizontal, then vertical
    flip_h, flip_v = torch.rand(6, generator=g) < 0.5, torch.rand(6, generator=g) < 0.5
    for i in range(6):
        expected = x[i].flip(-1) if flip_h[i] else x[i]
        expected = expected.flip(-2) if flip_v[i] else expected
        assert torch.equal(out[i], expected)
    assert torch.equal(x, _batch())  # the input is left alone


def test_views_and_their_names():
    assert make_view("none") is None
    with pytest.raises(ValueError, match="unknown augmentation view 'medium'"):
        make_view("medium")
    x = _batch()
    weak = make_view("weak", seed=1)(x)
    four = lambda s: [s, s.flip(-1), s.flip(-2), s.flip(-1).flip(-2)]  # noqa: E731
    assert all(any(torch.equal(weak[i], f) for f in four(x[i])) for i in range(6))
    for kind in ("weak", "strong", "strong-per-sample"):
        a, b = make_view(kind, seed=5)(x), make_view(kind, seed=5)(x)
        assert a.shape == x.shape and torch.equal(a, b), kind  # seeded views repeat exactly
    assert not torch.equal(make_view("strong", seed=5)(x), make_view("strong", seed=6)(x))
    assert len(weak_pipeline().transforms) == 2 and len(strong_pipeline().transforms) == 5


def test_affine_with_zero_ranges_is_identity():
    x = torch.rand(3, 1, 8, 8)
    out = affine_batch(x, rotate_deg=0.0, shift=0.0, scale=0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x, atol=1e-5, rtol=0)


def test_strong_batch_changes_every_sample_but_keeps_the_shape():
    x = torch.rand(8, 3, 16, 16)
    out = strong_batch(x, generator=torch.Generator().manual_seed(2))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert all(not torch.allclose(out[i], x[i]) for i in range(8))


def test_resize_dataset_images_bilinear_masks_nearest():
    masks = np.zeros((2, 4, 4), np.uint16)
    masks[0, :2, :2] = 7  # instance id 7 in the top-left quarter
    images = np.full((2, 4, 4, 3), 100, np.uint8)
    data = Dataset("segmentation", ["nucleus"], {"train": Split(images, masks)})
    out = resize_dataset(data, (8, 8)).splits["train"]
    assert out.images.shape == (2, 8, 8, 3) and (out.images == 100).all()  # a flat image stays flat
    assert out.labels.dtype == np.uint16 and set(np.unique(out.labels)) == {0, 7}
    assert (out.labels[0, :4, :4] == 7).all() and out.labels[0].sum() == 7 * 16  # quarter of 8x8 = 16 pixels
    labels = np.eye(2, dtype=np.float32)
    cls = Dataset("single-label", ["a", "b"], {"train": Split(np.zeros((2, 6, 6), np.uint8), labels)})
    assert resize_dataset(cls, (3, 3)).splits["train"].labels is labels  # labels are left as they are
