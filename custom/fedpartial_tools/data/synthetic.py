"""A small built-in dataset (classification and segmentation), learnable and seeded: the demo's
and the fast tests' default when no real data is given.

Classification: class c is a bright Gaussian blob at a class-specific position (plus noise), so a
small CNN learns it in a few epochs. Segmentation: bright disks ("lesions") on a noisy
background, with instance-id masks; some images are empty and some disks touch.
"""
from __future__ import annotations

import numpy as np

from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, Dataset, Split


def _blob_centres(num_classes: int, size: int) -> np.ndarray:
    angles = np.linspace(0, 2 * np.pi, num_classes, endpoint=False)
    r = size * 0.3
    return np.stack([size / 2 + r * np.sin(angles), size / 2 + r * np.cos(angles)], axis=1)


def make_classification(task: str = MULTI_LABEL, num_classes: int = 5, n_train: int = 400, n_val: int = 100,
                        n_test: int = 100, size: int = 28, channels: int = 1, prevalence: float = 0.3,
                        seed: int = 0) -> Dataset:
    """Synthetic classification data in memory.

    Args:
        task: ``single-label`` or ``multi-label``.
        num_classes: C.
        n_train / n_val / n_test: split sizes.
        size: image side in pixels.
        channels: 1 (grey) or 3 (RGB).
        prevalence: multi-label probability of each class being present.
        seed: random seed (same seed, same data).
    """
    if task not in (SINGLE_LABEL, MULTI_LABEL):
        raise ValueError(f"task must be {SINGLE_LABEL} or {MULTI_LABEL}, got '{task}'")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    rng = np.random.default_rng(seed)
    centres = _blob_centres(num_classes, size)
    yy, xx = np.mgrid[0:size, 0:size]
    sigma = size / 10
    blobs = np.stack([np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma ** 2)) for cy, cx in centres])
    splits = {}
    start = 0
    for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        if task == SINGLE_LABEL:
            idx = rng.integers(0, num_classes, n)
            labels = np.eye(num_classes, dtype=np.float32)[idx]
        else:
            labels = (rng.random((n, num_classes)) < prevalence).astype(np.float32)
        intensity = rng.uniform(0.6, 1.0, (n, num_classes))
        images = np.einsum("nc,chw->nhw", labels * intensity, blobs)
        images = images + rng.normal(0, 0.12, images.shape)
        images = np.clip(images * 200 + 30, 0, 255).astype(np.uint8)
        if channels == 3:
            images = np.repeat(images[..., None], 3, axis=-1)
        groups = np.arange(start, start + n) // 2  # two images per "patient"
        ids = np.array([f"syn{start + i:05d}" for i in range(n)])
        splits[name] = Split(images, labels, np.ones_like(labels, bool), ids, groups)
        start += n
    return Dataset(task, [f"finding_{i}" for i in range(num_classes)], splits, source="synthetic")


def make_segmentation(n_train: int = 64, n_val: int = 16, n_test: int = 16, size: int = 64, channels: int = 1,
                      max_lesions: int = 6, seed: int = 0) -> Dataset:
    """Synthetic segmentation data with instance-id masks.

    Args:
        n_train / n_val / n_test: split sizes.
        size: image side in pixels.
        channels: 1 or 3.
        max_lesions: up to this many disks per image (0 possible: empty images).
        seed: random seed.
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    splits = {}
    for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        images = np.zeros((n, size, size), np.float64)
        masks = np.zeros((n, size, size), np.uint16)
        for i in range(n):
            count = rng.integers(0, max_lesions + 1)
            for lesion in range(1, count + 1):
                r = rng.uniform(size * 0.05, size * 0.1)
                cy, cx = rng.uniform(r, size - r, 2)
                disk = (yy - cy) ** 2 + (xx - cx) ** 2 <= r ** 2
                masks[i][disk & (masks[i] == 0)] = lesion
                images[i][disk] = rng.uniform(0.6, 1.0)
        images = np.clip((images + rng.normal(0, 0.1, images.shape)) * 200 + 20, 0, 255).astype(np.uint8)
        if channels == 3:
            images = np.repeat(images[..., None], 3, axis=-1)
        splits[name] = Split(images, masks, None, np.arange(n), None)
    return Dataset(SEGMENTATION, ["lesion"], splits, source="synthetic")


def make_small_lesions(n_train: int = 240, n_val: int = 40, n_test: int = 80, size: int = 128,
                       lesion_image_fraction: float = 0.4, max_lesions: int = 4, diameter=(2.0, 12.0),
                       contrast: float = 0.35, seed: int = 0) -> Dataset:
    """MS-like small-lesion slices: a textured oval "brain" on a dark background; a minority of
    slices hold 1..``max_lesions`` small hyperintense blobs (``diameter`` px across, soft edges,
    inside the brain), the rest none. Lesions cover well under 1 % of the pixels, as FLAIR MS
    lesions do; instance-id masks, so ``incomplete-masks`` removes whole lesions.

    Args:
        n_train / n_val / n_test: split sizes.
        size: image side in pixels (native resolution of the set).
        lesion_image_fraction: share of slices with at least one lesion.
        max_lesions: most lesions on a slice.
        diameter: (smallest, largest) lesion diameter in pixels.
        contrast: lesion brightness above the local tissue (image scale 0..1).
        seed: random seed.
    """
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        images = np.zeros((n, size, size), np.uint8)
        masks = np.zeros((n, size, size), np.uint16)
        for i in range(n):
            # brain: an oval of a random size and position, textured by smoothed noise (gyri-like)
            ry, rx = size * rng.uniform(0.36, 0.44), size * rng.uniform(0.28, 0.36)
            cy, cx = size / 2 + rng.uniform(-0.04, 0.04, 2) * size
            inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
            brain = 1.0 / (1.0 + np.exp((inside - 1.0) * 25.0))
            texture = ndimage.gaussian_filter(rng.normal(0, 1, (size, size)), sigma=size / 40)
            texture /= texture.std() + 1e-9
            tissue = brain * (0.42 + 0.06 * texture)
            image = tissue.copy()
            if rng.random() < lesion_image_fraction:
                for lesion in range(1, int(rng.integers(1, max_lesions + 1)) + 1):
                    d = rng.uniform(*diameter)
                    for _ in range(20):  # a centre well inside the brain
                        ly, lx = rng.uniform(0, size, 2)
                        if ((ly - cy) / ry) ** 2 + ((lx - cx) / rx) ** 2 < 0.6:
                            break
                    sy, sx = d / 2 * rng.uniform(0.7, 1.3), d / 2 * rng.uniform(0.7, 1.3)
                    dist = ((yy - ly) / sy) ** 2 + ((xx - lx) / sx) ** 2
                    blob = np.exp(-np.maximum(dist - 0.6, 0) * 3.0)  # flat top, soft rim
                    image += contrast * rng.uniform(0.8, 1.2) * blob
                    masks[i][(dist <= 1.0) & (masks[i] == 0)] = lesion
            image += rng.normal(0, 0.03, image.shape)
            images[i] = np.clip(image * 255, 0, 255).astype(np.uint8)
        splits[name] = Split(images, masks, None, np.arange(n), None)
    return Dataset(SEGMENTATION, ["lesion"], splits, source="synthetic small lesions")


#: 7 x 7 class patterns of :func:`make_premise_multilabel` (1 = stroke): plus, ring, diagonal,
#: X, two bars. Distinct shapes of equal ink, so no class is found by brightness alone.
_PREMISE_SHAPES = (
    ["...#...", "...#...", "...#...", "#######", "...#...", "...#...", "...#..."],
    ["#######", "#.....#", "#.....#", "#.....#", "#.....#", "#.....#", "#######"],
    ["#......", ".#.....", "..#....", "...#...", "....#..", ".....#.", "......#"],
    ["#.....#", ".#...#.", "..#.#..", "...#...", "..#.#..", ".#...#.", "#.....#"],
    [".......", "#######", ".......", ".......", ".......", "#######", "......."],
)
#: class prevalence of the ``fedmlp-premise`` suites: the paper's ICH / ChestX-ray14 range (13-23 %)
#: and above, one value per class
PREMISE_PREVALENCE = (0.15, 0.225, 0.3, 0.375, 0.45)


def make_premise_multilabel(n_train: int = 3000, n_val: int = 500, n_test: int = 3000, size: int = 32,
                            prevalence=PREMISE_PREVALENCE, amplitude: float = 0.35, noise: float = 0.15,
                            distractors: int = 2, seed: int = 0) -> Dataset:
    """Multi-label images where FedMLP's premise holds: each class is a small shape at a random
    position, drawn at an amplitude near the noise, among distractor patches that belong to no
    class; classes are independent with a prevalence per class. Hiding a class from a site then
    turns its positives into negatives that a long training memorises (label noise).

    Args:
        n_train / n_val / n_test: split sizes (the default test set holds >= 375 positives of a
            class at prevalence 0.15).
        size: image side in pixels.
        prevalence: one probability per class (its length is the number of classes, at most 5).
        amplitude: stroke brightness of a shape (image scale 0..1, background 0.5).
        noise: std of the per-pixel Gaussian noise (same scale).
        distractors: random 7 x 7 patches of the same ink per image (no class).
        seed: random seed.
    """
    prevalence = np.asarray(prevalence, dtype=np.float64)
    if prevalence.ndim != 1 or not 1 <= len(prevalence) <= len(_PREMISE_SHAPES):
        raise ValueError(f"prevalence needs 1..{len(_PREMISE_SHAPES)} values, got {prevalence.tolist()}")
    if not ((prevalence > 0) & (prevalence < 1)).all():
        raise ValueError(f"each prevalence must lie in (0, 1), got {prevalence.tolist()}")
    if size < 14:
        raise ValueError(f"size must be >= 14 px for 7 px shapes, got {size}")
    shapes = np.array([[[ch == "#" for ch in row] for row in shape] for shape in _PREMISE_SHAPES[:len(prevalence)]],
                      dtype=np.float32)
    ink = int(shapes[0].sum())
    rng = np.random.default_rng(seed)
    splits, start = {}, 0
    for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        labels = (rng.random((n, len(prevalence))) < prevalence).astype(np.float32)
        images = np.full((n, size, size), 0.5, dtype=np.float32)
        for i in range(n):
            patches = [shapes[c] for c in np.flatnonzero(labels[i])]
            for _ in range(distractors):  # as much ink as a shape, scattered: no class's form
                patch = np.zeros(49, np.float32)
                patch[rng.choice(49, ink, replace=False)] = 1.0
                patches.append(patch.reshape(7, 7))
            for patch in patches:
                y, x = rng.integers(0, size - 7 + 1, 2)
                images[i, y:y + 7, x:x + 7] += amplitude * patch
        images += rng.normal(0.0, noise, images.shape).astype(np.float32)
        ids = np.array([f"premise{start + i:06d}" for i in range(n)])
        splits[name] = Split(np.clip(images * 255, 0, 255).astype(np.uint8), labels, np.ones_like(labels, bool), ids,
                             np.arange(start, start + n))
        start += n
    return Dataset(MULTI_LABEL, [f"shape_{c}" for c in range(len(prevalence))], splits,
                   source=f"synthetic premise multi-label (prevalence {prevalence.tolist()})")


def make_premise_multilabel_rare(seed: int = 0, **kwargs) -> Dataset:
    """:func:`make_premise_multilabel` with every prevalence x 0.1 (1.5-4.5 %, as CT-ICH's subtypes)
    and a test set 10 x larger, so each class still has about as many test positives.

    Args:
        seed: random seed.
        kwargs: other arguments of :func:`make_premise_multilabel`.
    """
    kwargs.setdefault("n_test", 30000)
    return make_premise_multilabel(prevalence=tuple(p * 0.1 for p in PREMISE_PREVALENCE), seed=seed, **kwargs)


def acquisition_shift(images: np.ndarray, channel_gain=(1.12, 0.96, 0.82), gamma: float = 0.8,
                      contrast: float = 0.8, blur_sigma: float = 0.6, noise_std: float = 4.0,
                      seed: int = 0) -> np.ndarray:
    """The same images as another clinic's camera would give them: a colour cast, another gamma
    curve, lower contrast, a softer lens and sensor noise. A shifted test set that the bench can
    build from any file (no second data source needed).

    Args:
        images: ``(N, H, W[, C])`` uint8.
        channel_gain: per-channel gain (colour cast); a grey image gets the mean gain.
        gamma: ``out = in ** gamma`` on [0, 1] (< 1 brightens the mid-tones).
        contrast: scales the deviation from each image's mean.
        blur_sigma: Gaussian blur in pixels (0 = none).
        noise_std: Gaussian noise in grey levels (0-255).
        seed: noise seed (the shift is repeatable).

    Returns:
        uint8 array of the same shape.
    """
    from scipy.ndimage import gaussian_filter

    if images.dtype != np.uint8:
        raise ValueError(f"acquisition_shift expects uint8 images, got {images.dtype}")
    x = images.astype(np.float32) / 255.0
    if x.ndim == 4:
        gain = np.asarray(channel_gain, np.float32)
        x = x * (gain[: x.shape[-1]] if x.shape[-1] <= len(gain) else gain.mean())
    else:
        x = x * float(np.mean(channel_gain))
    x = np.clip(x, 0.0, 1.0) ** float(gamma)
    mean = x.mean(axis=tuple(range(1, x.ndim)), keepdims=True)
    x = mean + float(contrast) * (x - mean)
    if blur_sigma > 0:
        sigma = (0, blur_sigma, blur_sigma) + ((0,) if x.ndim == 4 else ())
        x = gaussian_filter(x, sigma=sigma)
    x = x * 255.0 + np.random.default_rng(seed).normal(0.0, float(noise_std), x.shape)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)
