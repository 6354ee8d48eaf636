"""DICOM folder + CSV manifest reader (pydicom).

Manifest columns: ``file`` (path relative to the folder), ``split`` (train / val / test),
``label`` and optionally ``patient_id``. ``label`` is a class index for single-label data, or
``|``-separated class names for multi-label data (empty = no finding); ``class_names`` says which.
"""
from __future__ import annotations

import csv
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, DataError, Dataset, Split


def dicom_to_uint8(path: str, window: Optional[Tuple[float, float]] = None) -> np.ndarray:
    """Pixel data of one DICOM file as uint8: rescale slope / intercept, window (centre, width)
    from ``window`` or the file's WindowCenter / WindowWidth (else min-max), MONOCHROME1 inverted.

    Args:
        path: the ``.dcm`` file.
        window: (centre, width) in rescaled units, overriding the file's own.
    """
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array.astype(np.float64)
    except (InvalidDicomError, AttributeError, ValueError, OSError, EOFError) as e:
        raise DataError(f"DICOM file '{path}' is unreadable ({type(e).__name__}: {e})") from e
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
    if not size or tuple(image.shape[:2]) == tuple(size):
        return image
    from monai.transforms import Resize

    out = Resize(spatial_size=tuple(size), mode="bilinear", anti_aliasing=True)(image[None].astype(np.float32))
    return np.clip(np.asarray(out)[0], 0, 255).round().astype(np.uint8)


def load_dicom_folder(folder: str, manifest_csv: str, class_names: List[str], multi_label: bool = False,
                      window: Optional[Tuple[float, float]] = None, size: Optional[Sequence[int]] = None) -> Dataset:
    """Read the DICOM images listed in a CSV manifest.

    Args:
        folder: root folder of the files named in the manifest.
        manifest_csv: CSV with ``file,split,label[,patient_id]``.
        class_names: the C class names.
        multi_label: labels are ``|``-separated names (else a class index).
        window: (centre, width) applied to every image; default: each file's own window.
        size: resize every image to (H, W); required when sizes differ.
    """
    if not os.path.isfile(manifest_csv):
        raise DataError(f"manifest '{manifest_csv}' not found")
    with open(manifest_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"file", "split", "label"} - set(rows[0] if rows else {})
    if missing:
        raise DataError(f"manifest '{manifest_csv}' lacks column(s) {sorted(missing)}")
    per_split = {}
    for line, row in enumerate(rows, start=2):
        path = os.path.join(folder, row["file"])
        image = _resize(dicom_to_uint8(path, window), size)
        labels = np.zeros(len(class_names), np.float32)
        if multi_label:
            for name in filter(None, (x.strip() for x in row["label"].split("|"))):
                if name not in class_names:
                    raise DataError(f"manifest '{manifest_csv}' line {line}: class '{name}' is not one of {class_names}")
                labels[class_names.index(name)] = 1
        else:
            try:
                index = int(row["label"])
            except ValueError as e:
                raise DataError(f"manifest '{manifest_csv}' line {line}: label '{row['label']}' is not a class index") from e
            if not 0 <= index < len(class_names):
                raise DataError(f"manifest '{manifest_csv}' line {line}: class {index} outside 0..{len(class_names) - 1}")
            labels[index] = 1
        entry = per_split.setdefault(row["split"], {"images": [], "labels": [], "ids": [], "groups": []})
        entry["images"].append(image)
        entry["labels"].append(labels)
        entry["ids"].append(row["file"])
        entry["groups"].append(row.get("patient_id") or row["file"])
    splits = {}
    for name, e in per_split.items():
        shapes = {im.shape for im in e["images"]}
        if len(shapes) > 1:
            raise DataError(f"DICOM images of split '{name}' in '{manifest_csv}' differ in size {sorted(shapes)}; "
                            f"pass size=(H, W)")
        labels = np.stack(e["labels"])
        splits[name] = Split(np.stack(e["images"]), labels, np.ones_like(labels, bool), np.array(e["ids"]),
                             np.array(e["groups"]))
    if "train" not in splits:
        raise DataError(f"manifest '{manifest_csv}' lists no 'train' images")
    return Dataset(MULTI_LABEL if multi_label else SINGLE_LABEL, list(class_names), splits, source=manifest_csv)
