"""A large synthetic site for the streaming experiment (:mod:`fedpartial_tools.bench.streaming`):
written chunk by chunk into a site folder (never whole in memory), multi-label images or grey
slices with disc-shaped lesions; its size on disk, and its files dropped from the page cache so
that a timed read comes from disk.
"""
from __future__ import annotations

import json
import os

import numpy as np

SITE = "site-1"


def synthetic_chunk(rng: np.random.Generator, n: int, size: int, num_classes: int, channels: int = 1):
    """``n`` grey random-texture images with multi-label 0/1 labels: class c brightens band c
    (content hardly matters for speed; it keeps the labels learnable).

    Args:
        rng: numpy generator.
        n: images.
        size: side in pixels.
        num_classes: C.
        channels: 1 (grey ``(n, H, W)``) or 3 (the grey image repeated, ``(n, H, W, 3)``).
    """
    labels = (rng.random((n, num_classes)) < 0.3).astype(np.uint8)
    images = rng.integers(0, 160, (n, size, size), dtype=np.uint8)
    band = max(1, size // num_classes)
    for c in range(num_classes):
        images[labels[:, c] == 1, c * band:(c + 1) * band] += 80
    return _with_channels(images, channels), labels


def synthetic_seg_chunk(rng: np.random.Generator, n: int, size: int, channels: int = 1, max_lesions: int = 3):
    """``n`` noisy grey images with up to ``max_lesions`` bright discs each, and their 0/1 masks.

    Args:
        rng: numpy generator.
        n: images.
        size: side in pixels.
        channels: 1 or 3 (as :func:`synthetic_chunk`).
        max_lesions: discs per image at most (0 possible: empty images).
    """
    yy, xx = np.mgrid[0:size, 0:size]
    images = rng.integers(0, 120, (n, size, size), dtype=np.uint8)
    masks = np.zeros((n, size, size), np.uint8)
    for i in range(n):
        for _ in range(int(rng.integers(0, max_lesions + 1))):
            r = rng.uniform(size * 0.04, size * 0.1)
            cy, cx = rng.uniform(r, size - r, 2)
            masks[i][(yy - cy) ** 2 + (xx - cx) ** 2 <= r ** 2] = 1
    images[masks == 1] += 120
    return _with_channels(images, channels), masks


def _with_channels(images: np.ndarray, channels: int) -> np.ndarray:
    if channels == 1:
        return images
    if channels != 3:
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    return np.repeat(images[..., None], 3, axis=-1)


def write_synthetic_site(folder: str, images: int, size: int, num_classes: int = 5, val: int = 256,
                         chunk: int = 1000, seed: int = 0, channels: int = 1, segmentation: bool = False) -> bool:
    """Write the benchmark's site folder chunk by chunk; an existing folder made with the same
    settings is kept (returns False then, True when written).

    Args:
        folder: the site folder.
        images: train images.
        size: side in pixels.
        num_classes: C (classification).
        val: val images.
        chunk: images generated and appended at a time.
        seed: data seed.
        channels: 1 (grey) or 3 (RGB).
        segmentation: a segmentation site (:func:`synthetic_seg_chunk`) instead of a multi-label one.
    """
    from fedpartial.data.sitefile import META_FILE, SiteFolderWriter

    settings = {"benchmark": "streaming", "images": images, "size": size, "classes": num_classes, "val": val,
                "seed": seed}
    if channels != 1:  # only when set, so folders written before the option are still reused
        settings["channels"] = channels
    if segmentation:
        settings.update(classes=1, task="segmentation")
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            if json.load(f).get("info") == settings:
                return False
    except (OSError, ValueError):
        pass
    rng = np.random.default_rng(seed)
    task, names = ("segmentation", ["lesion"]) if segmentation else ("multi-label",
                                                                      [f"finding_{c}" for c in range(num_classes)])
    shape = (size, size) if channels == 1 else (size, size, channels)
    with SiteFolderWriter(folder, task, names, SITE, {"train": images, "val": val}, shape, info=settings) as writer:
        for split, n in (("train", images), ("val", val)):
            for start in range(0, n, chunk):
                if segmentation:
                    writer.append(split, *synthetic_seg_chunk(rng, min(chunk, n - start), size, channels))
                else:
                    x, y = synthetic_chunk(rng, min(chunk, n - start), size, num_classes, channels)
                    writer.append(split, x, y, np.ones_like(y))
    return True


def folder_bytes(folder: str) -> int:
    """Bytes of a site folder's own files (its cache/ left out)."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, f)))


def drop_page_cache(folder: str) -> None:
    """Ask the kernel to drop the folder's files from the page cache (no root needed: the pages
    are clean once written), so the next reads come from disk."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
