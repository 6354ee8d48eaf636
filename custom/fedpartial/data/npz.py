"""Readers and writers for the ``.npz`` layouts: MedMNIST classification (official MedMNIST files
and ``../shared/data``), the segmentation layout, and this project's site files (delegated to
:mod:`fedpartial.data.sitefile`)."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import numpy as np

from fedpartial.data.arrays import atomic_savez, check_images, info_json, open_npz, plain_array, read_info_json
from fedpartial.data.grid import AGREEMENT_KEY
from fedpartial.data.sitefile import dataset_from_site_arrays
from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, DataError, Dataset, Split

SPLITS = ("train", "val", "test")
# Files whose slices are stored upside down (see ../shared/data/README.md).
_FLIPPED_SOURCES = ("covid_semiseg",)
# Written by save_npz once slices are upright, so a re-saved COVID file is not flipped twice.
UPRIGHT_KEY = "slices_upright"
# Optional JSON facts of a source file (e.g. its input agreement), read into Dataset.info.
INFO_KEY = "info_json"
# The facts save_npz carries over: what was done to the images, not where they went.
_KEPT_INFO = (AGREEMENT_KEY,)


def _names(arrays, key: str, count: Optional[int], path: str):
    if key in arrays:
        return [str(x) for x in arrays[key].tolist()]
    if count is None:
        raise DataError(f"'{path}' lacks '{key}'")
    return [f"class_{i}" for i in range(count)]


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
        bad = tuple(int(i) for i in np.argwhere(~np.isin(raw, (0, 1)))[0])
        raise DataError(f"'{path}': '{key}' entry {bad} is {raw[bad]}; multi-label labels must be 0/1")
    return raw.astype(np.float32), MULTI_LABEL


def _optional(arrays, split: str, *names):
    for name in names:
        if f"{split}_{name}" in arrays:
            return arrays[f"{split}_{name}"]
    return None


def load_npz(path: str, require_train: bool = True, default_class_names: Optional[Sequence[str]] = None) -> Dataset:
    """Load a classification (MedMNIST layout) or segmentation ``.npz``, or a site file.

    Args:
        path: the ``.npz`` file.
        require_train: refuse a file without a (non-empty) train split. Training needs one;
            evaluation passes False so that a test-only file (e.g. the official ISIC 2018 test
            set: ``test_images`` + ``test_labels``) or any subset of train/val/test loads.
            Site files always need their train split.
        default_class_names: class names to use when a classification file has no
            ``label_names`` and its labels fit them (class indices below ``len(names)``, or
            exactly ``len(names)`` label columns), e.g. the model's names when evaluating: a
            test-only file may lack a class, so counting the classes from its labels would
            undercount. ``info["class_names_from"]`` then says ``"given"``; names counted from
            the labels (``class_0``...) say ``"labels"``.

    A source file's optional ``info_json`` (a JSON object, e.g. the input agreement ``harmonise``
    brought it to) is read into ``info``; :func:`save_npz` writes its ``input_agreement`` back.

    Raises:
        DataError: naming the file and key for unreadable files, missing keys, wrong shapes,
            labels out of range, a file without any split, or (``require_train``) an empty or
            missing train split.
    """
    arrays = open_npz(path)
    if "task" in arrays and "site" in arrays:
        return dataset_from_site_arrays(arrays, path)
    segmentation = any(k.endswith("_masks") for k in arrays)
    if require_train and "train_images" not in arrays:
        raise DataError(f"'{path}' lacks 'train_images' (keys: {sorted(arrays)})")
    if not any(f"{s}_images" in arrays for s in SPLITS):
        raise DataError(f"'{path}' has none of {[f'{s}_images' for s in SPLITS]} (keys: {sorted(arrays)})")
    label_count, names_from = None, None
    if not segmentation and "label_names" not in arrays:
        # official MedMNIST files carry no names: C = largest class index of any split + 1
        label_count = _count_classes(arrays, path)
        names_from = "labels"
        if default_class_names is not None and _labels_fit(arrays, label_count, len(default_class_names)):
            label_count, names_from = len(default_class_names), "given"
    splits = {}
    class_names = list(default_class_names) if names_from == "given" else None
    task = SEGMENTATION if segmentation else None
    if segmentation:
        names = _names(arrays, "class_names", None, path) if "class_names" in arrays else ["background", "lesion"]
        class_names = names[1:] if names and names[0].lower() == "background" else names
    flip = any(s in os.path.basename(path) for s in _FLIPPED_SOURCES) and UPRIGHT_KEY not in arrays
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
            if raw.dtype.kind not in "biu":
                raise DataError(f"'{path}': '{label_key}' has dtype {raw.dtype}; masks hold integer class or "
                                f"instance ids")
            if raw.min(initial=0) < 0:
                raise DataError(f"'{path}': '{label_key}' has negative ids")
            lesions = _optional(arrays, split, "n_lesions")
            if lesions is not None and len(lesions) != len(raw):
                raise DataError(f"'{path}': '{split}_n_lesions' has {len(lesions)} entries for {len(raw)} masks")
            labels = raw
            if flip:  # COVID-SemiSeg slices are stored upside down: flip rows so the slices stand upright
                images, labels = images[:, ::-1].copy(), labels[:, ::-1].copy()
        else:
            if class_names is None:
                class_names = _names(arrays, "label_names", label_count, path)
            labels, split_task = classification_labels(raw, len(class_names), path, label_key)
            if task is not None and split_task != task:
                raise DataError(f"'{path}': '{label_key}' is {split_task} but earlier splits are {task}")
            task = split_task
        ids = _optional(arrays, split, "image_ids", "ids", "slice_ids")
        groups = _optional(arrays, split, "patient_ids")
        mask = None if segmentation else np.ones_like(labels, dtype=bool)
        splits[split] = Split(images, labels, mask, ids, groups)
    if require_train and len(splits.get("train", [])) == 0:
        raise DataError(f"'{path}': the train split is empty")
    info = {"slices_flipped": True} if flip else {}
    info.update(read_info_json(arrays, f"'{path}'"))  # e.g. the input agreement a harmonised file was brought to
    if names_from:
        info["class_names_from"] = names_from
    return Dataset(task, list(class_names), splits, source=path, info=info)


def _labels_fit(arrays: Dict[str, np.ndarray], counted: int, num_names: int) -> bool:
    """Whether labels counted as ``counted`` classes fit ``num_names`` names: (N, C) columns
    must match exactly, class indices only need to stay below ``num_names``."""
    columns = any(a.ndim == 2 and a.shape[1] > 1 for k, a in arrays.items() if k.endswith("_labels"))
    return counted == num_names if columns else counted <= num_names


def _count_classes(arrays: Dict[str, np.ndarray], path: str) -> int:
    """C of a file without ``label_names``: the column count of (N,C) labels, else max index + 1."""
    counts = []
    for split in SPLITS:
        raw = arrays.get(f"{split}_labels")
        if raw is None or raw.size == 0:
            continue
        if raw.ndim == 2 and raw.shape[1] > 1:
            return raw.shape[1]
        if raw.dtype.kind not in "biu":
            raise DataError(f"'{path}': '{split}_labels' has dtype {raw.dtype}; class indices must be integers")
        counts.append(int(raw.max()) + 1)
    if not counts:
        present = [f"{s}_labels" for s in SPLITS if f"{s}_images" in arrays]
        raise DataError(f"'{path}' lacks {present or ['train_labels']} (or they are empty)")
    return max(counts)


def save_npz(dataset: Dataset, path: str) -> None:
    """Write ``dataset`` in the source layout (MedMNIST or segmentation), atomically.

    Args:
        dataset: what to write.
        path: the ``.npz`` to create.
    """
    arrays = {}
    for name, split in dataset.splits.items():
        arrays[f"{name}_images"] = split.images
        if not dataset.is_segmentation and split.label_mask is not None and not split.label_mask.all():
            # the source layouts have no label mask: partial labels belong in a site file
            raise DataError(f"cannot save {dataset.where()} to '{path}': split '{name}' has unannotated entries; "
                            f"use write_site_file for partially labelled data")
        if dataset.is_segmentation:
            arrays[f"{name}_masks"] = split.labels
        elif dataset.task == SINGLE_LABEL:
            bad = np.flatnonzero(split.labels.sum(axis=1) != 1)
            if len(bad):
                raise DataError(f"cannot save {dataset.where()} to '{path}': '{name}' row {bad[0]} is not one-hot, "
                                f"so it has no single-label class index")
            arrays[f"{name}_labels"] = split.labels.argmax(axis=1)[:, None].astype(np.uint8)
        else:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8)
        if split.ids is not None:
            arrays[f"{name}_image_ids"] = plain_array(split.ids)
        if split.groups is not None:
            arrays[f"{name}_patient_ids"] = plain_array(split.groups)
    kept = {k: dataset.info[k] for k in _KEPT_INFO if k in (dataset.info or {})}
    if kept:
        arrays[INFO_KEY] = info_json(kept)
    if dataset.is_segmentation:
        arrays["class_names"] = np.array(["background", *dataset.class_names])
        arrays[UPRIGHT_KEY] = np.array(1)  # slices in memory are upright (flipped on load if they were not)
    else:
        arrays["label_names"] = np.array(dataset.class_names)
    atomic_savez(path, arrays)
