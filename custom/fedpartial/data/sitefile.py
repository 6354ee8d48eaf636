"""Site files: what one site really has (see docs/ARCHITECTURE.md, "Site files").

Keys: ``train_images``, ``train_labels``, ``train_label_mask`` (classification), ``val_*``,
``class_names``, ``task``, ``site``, ``info_json``; optional ``train_ids``, ``train_groups``.
"""
from __future__ import annotations

import json
from typing import Dict, Optional

import numpy as np

from fedpartial.data.npz import atomic_savez, check_images, info_json, open_npz, plain_array
from fedpartial.data.types import SEGMENTATION, TASKS, DataError, Dataset, Split

SITE_SPLITS = ("train", "val", "test")


def write_site_file(path: str, dataset: Dataset) -> None:
    """Write one site's data atomically.

    Args:
        path: the ``.npz`` to create.
        dataset: the site's data; ``dataset.site`` names the site.
    """
    if not dataset.site:
        raise DataError(f"cannot write '{path}': the dataset has no site name")
    arrays = {"class_names": np.array(dataset.class_names), "task": np.array(dataset.task),
              "site": np.array(dataset.site), "info_json": info_json(dataset.info)}
    for name, split in dataset.splits.items():
        arrays[f"{name}_images"] = split.images
        if dataset.is_segmentation:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8 if split.labels.max(initial=0) < 256 else np.uint16)
        else:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8)
            mask = split.label_mask if split.label_mask is not None else np.ones_like(split.labels, bool)
            arrays[f"{name}_label_mask"] = mask.astype(np.uint8)
        if split.ids is not None:
            arrays[f"{name}_ids"] = plain_array(split.ids)
        if split.groups is not None:
            arrays[f"{name}_groups"] = plain_array(split.groups)
    atomic_savez(path, arrays)


def dataset_from_site_arrays(arrays: Dict[str, np.ndarray], path: str, expected_site: Optional[str] = None) -> Dataset:
    """Check and wrap the arrays of a site file."""
    for key in ("task", "site", "class_names", "train_images", "train_labels"):
        if key not in arrays:
            raise DataError(f"site file '{path}' lacks '{key}'")
    task, site = str(arrays["task"]), str(arrays["site"])
    if task not in TASKS:
        raise DataError(f"site file '{path}': task '{task}' is not one of {TASKS}")
    if expected_site is not None and site != expected_site:
        raise DataError(f"site file '{path}' belongs to site '{site}', not '{expected_site}'")
    class_names = [str(c) for c in arrays["class_names"].tolist()]
    try:
        info = json.loads(str(arrays["info_json"])) if "info_json" in arrays else {}
    except json.JSONDecodeError as e:
        raise DataError(f"site file '{path}': 'info_json' is not JSON ({e})") from e
    splits = {}
    for name in SITE_SPLITS:
        if f"{name}_images" not in arrays:
            continue
        images, labels = arrays[f"{name}_images"], arrays.get(f"{name}_labels")
        check_images(images, path, f"{name}_images")
        if labels is None:
            raise DataError(f"site file '{path}' has '{name}_images' but no '{name}_labels'")
        if len(labels) != len(images):
            raise DataError(f"site file '{path}': {len(images)} images but {len(labels)} rows in '{name}_labels'")
        mask = None
        if task == SEGMENTATION:
            if labels.shape != images.shape[:3]:
                raise DataError(f"site file '{path}': '{name}_labels' has shape {labels.shape}, "
                                f"images are {images.shape[:3]}")
            if labels.dtype.kind not in "biu" or not np.isin(labels, (0, 1)).all():
                raise DataError(f"site file '{path}': '{name}_labels' must be a binary 0/1 lesion mask "
                                f"(dtype {labels.dtype}, values {np.unique(labels)[:5].tolist()}...)")
        else:
            if labels.ndim != 2 or labels.shape[1] != len(class_names):
                raise DataError(f"site file '{path}': '{name}_labels' has shape {labels.shape}; expected "
                                f"(N, {len(class_names)}) for classes {class_names}")
            if not np.isin(labels, (0, 1)).all():
                bad = tuple(int(i) for i in np.argwhere(~np.isin(labels, (0, 1)))[0])
                raise DataError(f"site file '{path}': '{name}_labels' entry {bad} is {labels[bad]}; labels must be 0/1")
            mask_key = f"{name}_label_mask"
            mask = arrays.get(mask_key)
            if mask is None:
                raise DataError(f"site file '{path}' lacks '{mask_key}'")
            if mask.shape != labels.shape:
                raise DataError(f"site file '{path}': '{mask_key}' has shape {mask.shape}, labels {labels.shape}")
            mask = mask.astype(bool)
            bad = np.argwhere((labels > 0) & ~mask)
            if len(bad):
                raise DataError(f"site file '{path}': '{mask_key}' marks entry {tuple(int(i) for i in bad[0])} (class "
                                f"'{class_names[bad[0][1]]}') unannotated but its label is 1")
            labels = labels.astype(np.float32)
        splits[name] = Split(images, labels, mask, arrays.get(f"{name}_ids"), arrays.get(f"{name}_groups"))
    if len(splits.get("train", [])) == 0:
        raise DataError(f"site '{site}' has no training images in '{path}'")
    return Dataset(task, class_names, splits, source=path, site=site, info=info)


def load_site_file(path: str, expected_site: Optional[str] = None) -> Dataset:
    """Load and check one site file.

    Args:
        path: the site's ``.npz``.
        expected_site: when given, the file must belong to this site.

    Raises:
        DataError: naming the file / key / class for any inconsistency.
    """
    return dataset_from_site_arrays(open_npz(path), path, expected_site)
