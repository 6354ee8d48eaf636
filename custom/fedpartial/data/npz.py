"""Readers and writers for the ``.npz`` layouts: MedMNIST classification (official MedMNIST files
and ``../shared/data``), the segmentation layout, and this project's site files (delegated to
:mod:`fedpartial.data.sitefile`)."""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import Dict, Optional

import numpy as np

from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, DataError, Dataset, Split

SPLITS = ("train", "val", "test")
# Files whose slices are stored upside down (see ../shared/data/README.md).
_FLIPPED_SOURCES = ("covid_semiseg",)


def open_npz(path: str) -> Dict[str, np.ndarray]:
    """Read every array of an ``.npz`` into memory; corrupt or truncated files raise DataError
    naming the file (and the key, when one array is damaged)."""
    if not os.path.isfile(path):
        raise DataError(f"data file '{path}' not found")
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {}
            for key in z.files:
                try:
                    out[key] = z[key]
                except Exception as e:
                    raise DataError(f"'{path}': array '{key}' is unreadable ({type(e).__name__}: {e})") from e
            return out
    except DataError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        raise DataError(f"'{path}' is not a readable .npz file ({type(e).__name__}: {e}); "
                        f"it may be truncated or corrupt") from e


def _names(arrays, key: str, count: Optional[int], path: str):
    if key in arrays:
        return [str(x) for x in arrays[key].tolist()]
    if count is None:
        raise DataError(f"'{path}' lacks '{key}'")
    return [f"class_{i}" for i in range(count)]


def check_images(images: np.ndarray, path: str, key: str) -> None:
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
        raise DataError(f"'{path}': '{key}' has shape {images.shape}; expected (N,H,W) or (N,H,W,3)")
    if images.dtype != np.uint8:
        raise DataError(f"'{path}': '{key}' has dtype {images.dtype}; expected uint8")


def classification_labels(raw: np.ndarray, num_classes: int, path: str, key: str):
    """(N,1) class indices -> one-hot single-label; (N,C) 0/1 -> multi-label. Returns (labels, task)."""
    if raw.ndim == 1:
        raw = raw[:, None]
    if raw.ndim != 2:
        raise DataError(f"'{path}': '{key}' has shape {raw.shape}; expected (N,1) or (N,C)")
    if raw.shape[1] == 1 and num_classes > 1:
        idx = raw[:, 0].astype(np.int64)
        bad = np.flatnonzero((idx < 0) | (idx >= num_classes))
        if len(bad):
            raise DataError(f"'{path}': '{key}' row {bad[0]} has class {idx[bad[0]]}, outside 0..{num_classes - 1}")
        labels = np.zeros((len(idx), num_classes), np.float32)
        labels[np.arange(len(idx)), idx] = 1
        return labels, SINGLE_LABEL
    if raw.shape[1] != num_classes:
        raise DataError(f"'{path}': '{key}' has {raw.shape[1]} columns but there are {num_classes} class names")
    if not np.isin(raw, (0, 1)).all():
        bad = np.argwhere(~np.isin(raw, (0, 1)))[0]
        raise DataError(f"'{path}': '{key}' entry {tuple(bad)} is {raw[tuple(bad)]}; multi-label labels must be 0/1")
    return raw.astype(np.float32), MULTI_LABEL


def _optional(arrays, split: str, *names):
    for name in names:
        if f"{split}_{name}" in arrays:
            return arrays[f"{split}_{name}"]
    return None


def load_npz(path: str) -> Dataset:
    """Load a classification (MedMNIST layout) or segmentation ``.npz``, or a site file.

    Args:
        path: the ``.npz`` file.

    Raises:
        DataError: naming the file and key for unreadable files, missing keys, wrong shapes,
            labels out of range or an empty train split.
    """
    arrays = open_npz(path)
    if "task" in arrays and "site" in arrays:
        from fedpartial.data.sitefile import dataset_from_site_arrays

        return dataset_from_site_arrays(arrays, path)
    segmentation = any(k.endswith("_masks") for k in arrays)
    if "train_images" not in arrays:
        raise DataError(f"'{path}' lacks 'train_images' (keys: {sorted(arrays)})")
    splits = {}
    class_names = None
    task = SEGMENTATION if segmentation else None
    if segmentation:
        names = _names(arrays, "class_names", None, path) if "class_names" in arrays else ["background", "lesion"]
        class_names = names[1:] if names and names[0].lower() == "background" else names
    flip = any(s in os.path.basename(path) for s in _FLIPPED_SOURCES)
    for split in SPLITS:
        if f"{split}_images" not in arrays:
            continue
        images = arrays[f"{split}_images"]
        check_images(images, path, f"{split}_images")
        if images.ndim == 4 and images.shape[-1] == 1:
            images = images[..., 0]
        label_key = f"{split}_masks" if segmentation else f"{split}_labels"
        if label_key not in arrays:
            raise DataError(f"'{path}' has '{split}_images' but no '{label_key}'")
        raw = arrays[label_key]
        if len(raw) != len(images):
            raise DataError(f"'{path}': {len(images)} images in '{split}_images' but {len(raw)} rows in '{label_key}'")
        if segmentation:
            if raw.shape != images.shape[:3]:
                raise DataError(f"'{path}': '{label_key}' has shape {raw.shape}, images are {images.shape[:3]}")
            if raw.min(initial=0) < 0:
                raise DataError(f"'{path}': '{label_key}' has negative ids")
            labels = raw
            if flip:  # COVID-SemiSeg slices are stored upside down
                images, labels = images[:, ::-1].copy(), labels[:, ::-1].copy()
        else:
            if class_names is None:
                count = raw.shape[1] if raw.ndim == 2 and raw.shape[1] > 1 else int(raw.max()) + 1
                class_names = _names(arrays, "label_names", count, path)
            labels, split_task = classification_labels(raw, len(class_names), path, label_key)
            if task is not None and split_task != task:
                raise DataError(f"'{path}': '{label_key}' is {split_task} but earlier splits are {task}")
            task = split_task
        ids = _optional(arrays, split, "image_ids", "ids", "slice_ids")
        groups = _optional(arrays, split, "patient_ids")
        mask = None if segmentation else np.ones_like(labels, dtype=bool)
        splits[split] = Split(images, labels, mask, ids, groups)
    if len(splits.get("train", [])) == 0:
        raise DataError(f"'{path}': the train split is empty")
    return Dataset(task, list(class_names), splits, source=path)


def save_npz(dataset: Dataset, path: str) -> None:
    """Write ``dataset`` in the source layout (MedMNIST or segmentation), atomically.

    Args:
        dataset: what to write.
        path: the ``.npz`` to create.
    """
    arrays = {}
    for name, split in dataset.splits.items():
        arrays[f"{name}_images"] = split.images
        if dataset.is_segmentation:
            arrays[f"{name}_masks"] = split.labels
        elif dataset.task == SINGLE_LABEL:
            arrays[f"{name}_labels"] = split.labels.argmax(axis=1)[:, None].astype(np.uint8)
        else:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8)
        if split.ids is not None:
            arrays[f"{name}_image_ids"] = split.ids
        if split.groups is not None:
            arrays[f"{name}_patient_ids"] = split.groups
    if dataset.is_segmentation:
        arrays["class_names"] = np.array(["background", *dataset.class_names])
    else:
        arrays["label_names"] = np.array(dataset.class_names)
    atomic_savez(path, arrays)


def atomic_savez(path: str, arrays: Dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` to a temporary file in the same folder, then rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".npz.tmp", dir=folder)
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def info_json(info: dict) -> np.ndarray:
    return np.array(json.dumps(info, sort_keys=True))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
