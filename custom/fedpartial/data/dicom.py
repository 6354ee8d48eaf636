"""DICOM folder + CSV manifest reader (pydicom).

Manifest (CSV with a header row), one row per image, in one of two forms:

* ``file,split,label[,patient_id]``: ``label`` is one class per row for single-label data (a class
  index ``0..C-1`` or a class name), or for multi-label data the positive classes separated by
  ``|`` (names or indices; an empty cell = no finding).
* ``file,split,<class 1>,<class 2>,...[,patient_id]``: one 0/1 column per class (multi-label);
  the column headers are the class names.

``file`` is relative to the folder; ``split`` is ``train``, ``val`` or ``test``; ``patient_id``
(optional) keeps a patient's images on one site. The task is multi-label for the column form,
when ``multi_label=True``, or when some ``label`` cell holds ``|`` or is empty; else single-label.
"""
from __future__ import annotations

import csv
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, DataError, Dataset, Split

SPLITS = ("train", "val", "test")
_META_COLUMNS = ("file", "split", "label", "patient_id")


def dicom_to_uint8(path: str, window: Optional[Tuple[float, float]] = None) -> np.ndarray:
    """Pixel data of one DICOM file as uint8: rescale slope / intercept, window (centre, width)
    from ``window`` or the file's WindowCenter / WindowWidth (else min-max), MONOCHROME1 inverted.
    Window mapping: ``low = centre - width/2``, ``high = centre + width/2``, value ->
    ``round(clip((v - low) / width, 0, 1) * 255)``.

    Args:
        path: the ``.dcm`` file.
        window: (centre, width) in rescaled units, overriding the file's own.
    """
    import pydicom

    try:
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array.astype(np.float64)
    except Exception as e:  # pydicom raises many types (InvalidDicomError, decoder errors, struct errors)
        raise DataError(f"DICOM file '{path}' is unreadable ({type(e).__name__}: {e})") from e
    samples = int(getattr(ds, "SamplesPerPixel", 1) or 1)
    if pixels.ndim != (3 if samples == 3 else 2):
        raise DataError(f"DICOM file '{path}' holds pixel data of shape {pixels.shape}; expected one 2D image "
                        f"(multi-frame volumes: convert to NIfTI and use load_nifti_pairs)")
    if samples == 3:  # colour (e.g. dermoscopy): already display values, no rescale or window
        return np.clip(pixels, 0, 255).round().astype(np.uint8)
    pixels = pixels * float(getattr(ds, "RescaleSlope", 1) or 1) + float(getattr(ds, "RescaleIntercept", 0) or 0)
    if window is None and "WindowCenter" in ds and "WindowWidth" in ds:
        first = lambda v: float(v[0]) if isinstance(v, pydicom.multival.MultiValue) else float(v)  # noqa: E731
        window = (first(ds.WindowCenter), first(ds.WindowWidth))
    if window is not None:
        centre, width = window
        low, high = centre - width / 2.0, centre + width / 2.0
    else:
        low, high = float(pixels.min()), float(pixels.max())
    scaled = np.clip((pixels - low) / max(high - low, 1e-6), 0.0, 1.0)
    if str(getattr(ds, "PhotometricInterpretation", "")).upper() == "MONOCHROME1":
        scaled = 1.0 - scaled  # MONOCHROME1: low values are white
    return np.round(scaled * 255).astype(np.uint8)


def _resize(image: np.ndarray, size: Optional[Sequence[int]]) -> np.ndarray:
    if size is not None and np.isscalar(size):
        size = (int(size), int(size))
    if not size or tuple(image.shape[:2]) == tuple(size):
        return image
    from monai.transforms import Resize

    channel_first = image[None] if image.ndim == 2 else np.moveaxis(image, -1, 0)
    out = np.asarray(Resize(spatial_size=tuple(size), mode="bilinear", anti_aliasing=True)(
        channel_first.astype(np.float32)))
    out = out[0] if image.ndim == 2 else np.moveaxis(out, 0, -1)
    return np.clip(out, 0, 255).round().astype(np.uint8)


def _class_of(token: str, names: List[str], where: str) -> int:
    token = token.strip()
    if token.lstrip("-").isdigit():
        index = int(token)
        if not 0 <= index < len(names):
            raise DataError(f"{where}: class {index} outside 0..{len(names) - 1}")
        return index
    if token not in names:
        raise DataError(f"{where}: class '{token}' is not one of {names}")
    return names.index(token)


def load_dicom_folder(folder: str, manifest_csv: str, class_names: Optional[List[str]] = None,
                      multi_label: Optional[bool] = None, window: Optional[Tuple[float, float]] = None,
                      size: Optional[Sequence[int]] = None) -> Dataset:
    """Read the DICOM images listed in a CSV manifest (format in the module docstring).

    Args:
        folder: root folder of the files named in the manifest.
        manifest_csv: the CSV manifest.
        class_names: the C class names; default: the class columns, else ``class_0..`` for
            index labels, else the sorted names found in ``label``.
        multi_label: force the task (None = decide from the manifest, see the module docstring).
        window: (centre, width) applied to every image; default: each file's own window.
        size: resize every image to (H, W) (or an int for square); required when sizes differ.

    Raises:
        DataError: naming the manifest line / file for unreadable files, unknown classes or splits.
    """
    if not os.path.isfile(manifest_csv):
        raise DataError(f"manifest '{manifest_csv}' not found")
    with open(manifest_csv, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    missing = {"file", "split"} - set(columns)
    if missing:
        raise DataError(f"manifest '{manifest_csv}' lacks column(s) {sorted(missing)} (has {columns})")
    if not rows:
        raise DataError(f"manifest '{manifest_csv}' lists no images")
    class_columns = [c for c in columns if c not in _META_COLUMNS]
    if "label" not in columns and not class_columns:
        raise DataError(f"manifest '{manifest_csv}' has neither a 'label' column nor one 0/1 column per class")
    column_form = "label" not in columns
    if column_form:
        multi_label = True if multi_label is None else multi_label
        if not multi_label:
            raise DataError(f"manifest '{manifest_csv}': 0/1 class columns are a multi-label layout")
        class_names = list(class_names or class_columns)
        absent = [c for c in class_names if c not in class_columns]
        if absent:
            raise DataError(f"manifest '{manifest_csv}' has no column for class(es) {absent}")
    else:
        cells = [r["label"] for r in rows]
        if multi_label is None:
            multi_label = any("|" in c or c == "" for c in cells)
        if class_names is None:
            tokens = [t.strip() for c in cells for t in (c.split("|") if multi_label else [c]) if t.strip()]
            if tokens and all(t.isdigit() for t in tokens):
                class_names = [f"class_{i}" for i in range(max(int(t) for t in tokens) + 1)]
            else:
                class_names = sorted(set(tokens))
        class_names = list(class_names)
    if not class_names:
        raise DataError(f"manifest '{manifest_csv}' names no class")
    per_split = {}
    for line, row in enumerate(rows, start=2):
        where = f"manifest '{manifest_csv}' line {line}"
        if row["split"] not in SPLITS:
            raise DataError(f"{where}: split '{row['split']}' is not one of {SPLITS}")
        if not row["file"]:
            raise DataError(f"{where}: empty 'file'")
        path = os.path.join(folder, row["file"])
        if not os.path.isfile(path):
            raise DataError(f"{where}: DICOM file '{path}' not found")
        image = _resize(dicom_to_uint8(path, window), size)
        labels = np.zeros(len(class_names), np.float32)
        if column_form:
            for c, name in enumerate(class_names):
                if row[name] not in ("0", "1"):
                    raise DataError(f"{where}: column '{name}' is '{row[name]}'; expected 0 or 1")
                labels[c] = float(row[name])
        elif multi_label:
            for token in filter(None, (x.strip() for x in row["label"].split("|"))):
                labels[_class_of(token, class_names, where)] = 1
        else:
            if not row["label"]:
                raise DataError(f"{where}: empty label in single-label data")
            labels[_class_of(row["label"], class_names, where)] = 1
        entry = per_split.setdefault(row["split"], {"images": [], "labels": [], "ids": [], "groups": []})
        entry["images"].append(image)
        entry["labels"].append(labels)
        entry["ids"].append(row["file"])
        entry["groups"].append(row.get("patient_id") or row["file"])
    shapes = {im.shape for e in per_split.values() for im in e["images"]}
    if len(shapes) > 1:
        raise DataError(f"DICOM images listed in '{manifest_csv}' differ in size {sorted(shapes)}; pass size=(H, W)")
    splits = {}
    for name, e in per_split.items():
        labels = np.stack(e["labels"])
        splits[name] = Split(np.stack(e["images"]), labels, np.ones_like(labels, bool), np.array(e["ids"]),
                             np.array(e["groups"]))
    if "train" not in splits:
        raise DataError(f"manifest '{manifest_csv}' lists no 'train' images")
    return Dataset(MULTI_LABEL if multi_label else SINGLE_LABEL, list(class_names), splits, source=manifest_csv)
