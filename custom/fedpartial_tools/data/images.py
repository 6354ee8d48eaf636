"""PNG / JPEG folder + CSV reader (ISIC, NIH ChestX-ray14, Kaggle layouts) and the CSV manifest
parsing shared with the DICOM reader (:mod:`fedpartial_tools.data.dicom`).

Manifest (CSV with a header row), one row per image (DICOM: per file / series):

* an id column: ``file``, ``image``, ``image_id`` or ``Image Index`` (NIH); the path relative to
  the folder. An id without an extension is resolved by trying ``.png``, ``.jpg``, ``.jpeg``
  (PNG/JPEG folders only).
* ``split`` (optional): ``train``, ``val`` or ``test``; without it every row is ``train`` (a site's
  own data).
* ``patient_id`` or ``Patient ID`` (optional): keeps a patient's images together (groups).
* the labels, in one of two forms:

  - one column per class (ISIC style): ``1`` / ``0`` (also ``1.0`` / ``0.0``) or a BLANK cell =
    this class is not annotated at this site for this image (label 0, ``label_mask`` False).
    With ``class_names`` given, a class that has no column is not annotated at any image.
  - a ``label`` (or NIH ``Finding Labels``) column: single-label data holds one class per row (a
    name, or an index ``0..C-1``); multi-label data holds the positive classes separated by ``|``
    (an empty cell or ``No Finding`` = no positive class). Every class listed in
    ``annotated_classes`` (default: all) is annotated at every row, the others at none.

The task, unless ``task`` gives it: the column form is single-label when no row holds more than one
1 and no row that annotates every class is all 0 (an all-zero row with blanks is "an image of a
class this site does not annotate"), else multi-label; the label form is multi-label when some
cell holds ``|`` or is empty, else single-label. ``Manifest.task_reason`` says why.

Every row has as many cells as the header has columns (a blank cell is an empty cell, not a
missing one), and no two header columns share a name.
"""
from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, DataError, Dataset, Split

SPLITS = ("train", "val", "test")
ID_COLUMNS = ("file", "image", "image_id", "Image Index")
LABEL_COLUMNS = ("label", "Finding Labels")
PATIENT_COLUMNS = ("patient_id", "Patient ID")
META_COLUMNS = (*ID_COLUMNS, "split", *LABEL_COLUMNS, *PATIENT_COLUMNS)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".PNG", ".JPG", ".JPEG")
# NIH writes "No Finding" where an image has no positive class.
NO_FINDING = ("no finding",)
_ONE, _ZERO = ("1", "1.0"), ("0", "0.0")
# PIL modes of 16-bit and float images (scaled by their own min and max)
_DEEP_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def resize_image(image: np.ndarray, size: Optional[Sequence[int]]) -> np.ndarray:
    """Resize one uint8 image (H, W) or (H, W, 3) to ``size`` (bilinear, anti-aliased).

    Args:
        image: the image.
        size: (H, W), an int for square, or None / empty to keep the image as it is.
    """
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


# ---- manifest -------------------------------------------------------------------------------------
@dataclass
class ManifestRow:
    """One parsed manifest row: ``line`` is the 1-based line of the CSV file (header = line 1)."""

    line: int
    id: str
    split: str
    group: str
    labels: np.ndarray
    mask: np.ndarray


@dataclass
class Manifest:
    path: str
    task: str
    class_names: List[str]
    rows: List[ManifestRow]
    id_column: str
    label_form: str  # "columns" or "label"
    unannotated_columns: List[str]  # classes given by the caller without a column in the CSV
    task_reason: str = "given"  # why the task is what it is: "given", or what in the CSV decided it


def _first_present(columns: Sequence[str], candidates: Sequence[str]) -> Optional[str]:
    return next((c for c in candidates if c in columns), None)


def _class_of(token: str, names: List[str], where: str, column: str = "label") -> int:
    token = token.strip()
    if token.lstrip("-").isdigit():
        index = int(token)
        if not 0 <= index < len(names):
            raise DataError(f"{where}: class {index} outside 0..{len(names) - 1} (column '{column}')")
        return index
    if token not in names:
        raise DataError(f"{where}: class '{token}' is not one of {names} (column '{column}')")
    return names.index(token)


def check_finite(values: np.ndarray, what: str, axes: Sequence[str]) -> None:
    """Refuse NaN / Inf values: they have no grey level, and casting them to uint8 gives arbitrary
    values.

    Args:
        values: the pixel or voxel values.
        what: the file, as messages name it (``DICOM file '...'``).
        axes: the names of the axes of ``values``, for the position of the first bad value.

    Raises:
        DataError: naming ``what``, the count and the first position of the NaN / Inf values.
    """
    bad = ~np.isfinite(values)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        where = ", ".join(f"{axis} {i}" for axis, i in zip(axes, first))
        raise DataError(f"{what} holds {int(bad.sum())} NaN / Inf value(s), the first ({values[first]}) at "
                        f"{where}; they map to no grey level")


def read_csv_table(path: str, what: str = "manifest") -> Tuple[List[str], List[Tuple[int, Dict[str, str]]]]:
    """The header and the non-blank rows of a CSV (cells stripped), each row with its 1-based line.

    Args:
        path: the CSV file: UTF-8 (Excel's BOM allowed), a header row, then rows.
        what: how messages name the file (``manifest``, ``pairs CSV``).

    Raises:
        DataError: naming the file (and the line or column) when it is missing, unreadable, not
            UTF-8, not valid CSV or empty, repeats a header column, or has a row whose cell count
            differs from the header's.
    """
    if not os.path.isfile(path):
        raise DataError(f"{what} '{path}' not found")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{what} '{path}' cannot be read ({type(e).__name__}: {e.strerror or e})") from e
    try:
        text = raw.decode("utf-8-sig")  # utf-8-sig: Excel's BOM
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{what} '{path}' line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); save the "
                        f"CSV as UTF-8 (Excel: 'CSV UTF-8')") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: List[Tuple[int, Dict[str, str]]] = []
    try:
        header = next(reader, None)
        if header is None:
            raise DataError(f"{what} '{path}' is empty (no header row)")
        columns = [c.strip() for c in header]
        for i, name in enumerate(columns):
            if name in columns[:i]:
                raise DataError(f"{what} '{path}' line {reader.line_num}: the header names column "
                                f"'{name}' twice (columns {columns.index(name) + 1} and {i + 1})")
        for record in reader:
            if not any(cell.strip() for cell in record):
                continue  # a blank line (often the last one)
            if len(record) > len(columns):
                raise DataError(f"{what} '{path}' line {reader.line_num}: {len(record)} cells but the header has "
                                f"{len(columns)} columns")
            if len(record) < len(columns):
                missing = columns[len(record):]
                raise DataError(f"{what} '{path}' line {reader.line_num}: {len(record)} cells but the header has "
                                f"{len(columns)} columns (no cell for {missing}); a blank cell still needs its "
                                f"comma")
            rows.append((reader.line_num, {c: v.strip() for c, v in zip(columns, record)}))
    except csv.Error as e:
        raise DataError(f"{what} '{path}' line {reader.line_num}: not valid CSV ({e})") from None
    return columns, rows


def read_manifest(manifest_csv: str, class_names: Optional[List[str]] = None, task: Optional[str] = None,
                  annotated_classes: Optional[Sequence[str]] = None, label_column: Optional[str] = None) -> Manifest:
    """Parse a CSV manifest (format in the module docstring) into labels and label masks.

    Args:
        manifest_csv: the CSV file.
        class_names: the C class names; default: the class columns, else ``class_0..`` for index
            labels, else the sorted names found in the label column.
        task: ``single-label`` / ``multi-label``, or None to decide from the manifest.
        annotated_classes: label-column form only: the classes this site annotates (default all).
        label_column: name of the label column (default ``label``, else ``Finding Labels``).

    Raises:
        DataError: naming the manifest, line and column of any bad cell, duplicate id or split.
    """
    if task not in (None, SINGLE_LABEL, MULTI_LABEL):
        raise DataError(f"manifest '{manifest_csv}': task '{task}' is not {SINGLE_LABEL} or {MULTI_LABEL}")
    columns, rows = read_csv_table(manifest_csv)
    id_column = _first_present(columns, ID_COLUMNS)
    if id_column is None:
        raise DataError(f"manifest '{manifest_csv}' has no id column (one of {list(ID_COLUMNS)}; has {columns})")
    if not rows:
        raise DataError(f"manifest '{manifest_csv}' lists no images")
    patient_column = _first_present(columns, PATIENT_COLUMNS)
    if label_column is not None and label_column not in columns:
        raise DataError(f"manifest '{manifest_csv}' has no label column '{label_column}' (has {columns})")
    label_column = label_column or _first_present(columns, LABEL_COLUMNS)

    # ids and splits first: a duplicate row or a bad split is an error whatever the labels hold
    first_line: Dict[str, int] = {}
    for line, row in rows:
        where = f"manifest '{manifest_csv}' line {line}"
        if not row[id_column]:
            raise DataError(f"{where}: empty '{id_column}'")
        if row[id_column] in first_line:
            raise DataError(f"manifest '{manifest_csv}': '{row[id_column]}' is listed twice, on lines "
                            f"{first_line[row[id_column]]} and {line}")
        first_line[row[id_column]] = line
        if "split" in columns and row["split"] not in SPLITS:
            raise DataError(f"{where}: split '{row['split']}' is not one of {SPLITS} (column 'split')")

    unannotated_columns: List[str] = []
    if label_column is None:
        class_columns = [c for c in columns if c not in META_COLUMNS]
        if class_names is None:
            class_names = class_columns
        if not class_names:
            raise DataError(f"manifest '{manifest_csv}' has neither a label column ({list(LABEL_COLUMNS)}) nor "
                            f"one 1/0/blank column per class")
        if annotated_classes is not None:
            raise DataError(f"manifest '{manifest_csv}': annotated classes are given by blank cells in the "
                            f"per-class column form, not by a list")
        # a class of the job without a column here: this site annotates it nowhere
        unannotated_columns = [c for c in class_names if c not in columns]
        reason = "given"
        if task is None:
            task, reason = _column_task(rows, class_names)
        parsed = [_column_row(manifest_csv, line, row, class_names, task) for line, row in rows]
        label_form = "columns"
    else:
        cells = [row[label_column] for _, row in rows]
        reason = "given"
        if task is None:
            first = next(((line, row[label_column]) for line, row in rows
                          if "|" in row[label_column] or not row[label_column]), None)
            task, reason = (SINGLE_LABEL, f"every '{label_column}' cell holds one class") if first is None else (
                MULTI_LABEL, f"line {first[0]}'s '{label_column}' cell "
                             f"{'is empty' if not first[1] else 'lists several classes'}")
        multi = task == MULTI_LABEL
        if class_names is None:
            tokens = [t.strip() for c in cells for t in (c.split("|") if multi else [c]) if t.strip()]
            tokens = [t for t in tokens if t.lower() not in NO_FINDING]
            if tokens and all(t.isdigit() for t in tokens):
                class_names = [f"class_{i}" for i in range(max(int(t) for t in tokens) + 1)]
            else:
                class_names = sorted(set(tokens))
        if not class_names:
            raise DataError(f"manifest '{manifest_csv}' names no class")
        annotated = np.ones(len(class_names), bool)
        if annotated_classes is not None:
            unknown = [c for c in annotated_classes if c not in class_names]
            if unknown:
                raise DataError(f"manifest '{manifest_csv}': annotated class(es) {unknown} not in {list(class_names)}")
            annotated = np.isin(class_names, list(annotated_classes))
        parsed = [_label_row(manifest_csv, line, row[label_column], label_column, list(class_names), multi, annotated)
                  for line, row in rows]
        label_form = "label"
    out = [ManifestRow(line, row[id_column], row.get("split") or "train",
                       (row[patient_column] if patient_column and row[patient_column] else row[id_column]), lab, msk)
           for (line, row), (lab, msk) in zip(rows, parsed)]
    return Manifest(manifest_csv, task, list(class_names), out, id_column, label_form, unannotated_columns, reason)


def _column_task(rows: Sequence[Tuple[int, Dict[str, str]]], class_names: List[str]) -> Tuple[str, str]:
    """The task of a per-class CSV and why: multi-label when a row holds two 1s or annotates every
    class with all 0 (single-label data refuses that row), else single-label."""
    for line, row in rows:
        cells = [row.get(name) for name in class_names]
        ones = [name for name, cell in zip(class_names, cells) if cell in _ONE]
        if len(ones) > 1:
            return MULTI_LABEL, f"line {line} has {len(ones)} classes at 1 {ones}"
        if not ones and all(cell in _ZERO for cell in cells):
            return MULTI_LABEL, f"line {line} annotates every class and none is 1 (an image with no finding)"
    return SINGLE_LABEL, ("no row has more than one class at 1 (pass --task multi-label if one image can hold "
                          "several classes)")


def _column_row(path: str, line: int, row: Dict[str, str], class_names: List[str], task: str):
    labels, mask = np.zeros(len(class_names), np.float32), np.zeros(len(class_names), bool)
    for c, name in enumerate(class_names):
        if name not in row:
            continue  # no column for this class: not annotated (see read_manifest)
        cell = row[name]
        if cell in _ONE:
            labels[c], mask[c] = 1, True
        elif cell in _ZERO:
            mask[c] = True
        elif cell != "":
            raise DataError(f"manifest '{path}' line {line}, column '{name}': '{cell}' is not 1, 0 or blank "
                            f"(blank = not annotated at this site)")
    if task == SINGLE_LABEL:
        where = f"manifest '{path}' line {line}"
        if labels.sum() > 1:
            raise DataError(f"{where}: classes {[n for n, v in zip(class_names, labels) if v]} are all 1 in "
                            f"single-label data")
        if labels.sum() == 0 and mask.all():
            raise DataError(f"{where}: every class column is 0 in single-label data (leave the cells of classes "
                            f"this site does not annotate blank)")
    return labels, mask


def _label_row(path: str, line: int, cell: str, column: str, class_names: List[str], multi: bool,
               annotated: np.ndarray):
    where = f"manifest '{path}' line {line}"
    labels = np.zeros(len(class_names), np.float32)
    if multi:
        tokens = [t.strip() for t in cell.split("|") if t.strip()]
        if not (len(tokens) == 1 and tokens[0].lower() in NO_FINDING and tokens[0] not in class_names):
            for token in tokens:
                labels[_class_of(token, class_names, where, column)] = 1
    elif cell:
        labels[_class_of(cell, class_names, where, column)] = 1
    elif annotated.all():
        raise DataError(f"{where}: empty label in single-label data (column '{column}')")
    # else: an image of a class this site does not annotate ("none of my classes")
    bad = np.flatnonzero((labels > 0) & ~annotated)
    if len(bad):
        raise DataError(f"{where}, column '{column}': class '{class_names[bad[0]]}' is not among the classes "
                        f"this site annotates "
                        f"{[n for n, a in zip(class_names, annotated) if a]}")
    return labels, annotated.copy()


def assemble(manifest: Manifest, per_row_images: Sequence[np.ndarray], per_row_ids: Sequence[Sequence[str]],
             source: str) -> Dataset:
    """Build a Dataset from the manifest rows and their images.

    Args:
        manifest: the parsed manifest.
        per_row_images: per row, a stack (F, H, W[, 3]) of its F images (F > 1: DICOM frames).
        per_row_ids: per row, the F image ids.
        source: the ``Dataset.source`` text.
    """
    shapes: Dict[tuple, int] = {}
    for row, frames in zip(manifest.rows, per_row_images):
        shapes.setdefault(tuple(frames.shape[1:]), row.line)
    if len(shapes) > 1:
        listed = ", ".join(f"{'x'.join(map(str, s))} (first on line {line})" for s, line in shapes.items())
        raise DataError(f"images listed in '{manifest.path}' differ in size: {listed}; pass a size (--size) "
                        f"to resize them to one")
    parts: Dict[str, Dict[str, list]] = {}
    for row, frames, ids in zip(manifest.rows, per_row_images, per_row_ids):
        entry = parts.setdefault(row.split, {"images": [], "labels": [], "mask": [], "ids": [], "groups": []})
        entry["images"].extend(frames)
        entry["labels"].extend([row.labels] * len(frames))  # every frame of a series shares the row's labels
        entry["mask"].extend([row.mask] * len(frames))
        entry["ids"].extend(ids)
        entry["groups"].extend([row.group] * len(frames))
    splits = {name: Split(np.stack(e["images"]), np.stack(e["labels"]).astype(np.float32), np.stack(e["mask"]),
                          np.array(e["ids"]), np.array(e["groups"]))
              for name, e in parts.items()}
    info = {"manifest": os.path.abspath(manifest.path), "label_form": manifest.label_form,
            "task_reason": manifest.task_reason}
    if manifest.unannotated_columns:
        info["classes_without_column"] = list(manifest.unannotated_columns)
    return Dataset(manifest.task, list(manifest.class_names), splits, source=source, info=info)


# ---- PNG / JPEG -----------------------------------------------------------------------------------
def resolve_image(folder: str, image_id: str, where: str) -> str:
    """The file of ``image_id`` under ``folder``; an id without extension tries .png/.jpg/.jpeg."""
    path = os.path.join(folder, image_id)
    if os.path.isfile(path):
        return path
    if not os.path.splitext(image_id)[1].lower() in (".png", ".jpg", ".jpeg"):
        for ext in IMAGE_EXTENSIONS:
            if os.path.isfile(path + ext):
                return path + ext
        raise DataError(f"{where}: image '{path}' not found (also tried .png, .jpg, .jpeg)")
    raise DataError(f"{where}: image '{path}' not found")


def image_to_uint8(path: str) -> np.ndarray:
    """One PNG / JPEG as uint8 (H, W) grey or (H, W, 3) RGB.

    RGBA / palette / CMYK images become RGB (alpha dropped), grey+alpha becomes grey, 16-bit and
    float images are scaled to 0..255 by their own min and max (per image).

    Args:
        path: the image file.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            if mode in _DEEP_MODES:  # scaled below, once NaN / Inf are ruled out
                pixels = np.asarray(im, dtype=np.float64)
            else:
                if mode in ("1", "LA", "L"):
                    im = im.convert("L")
                elif mode == "P":
                    im = im.convert("RGBA").convert("RGB")  # via RGBA: palettes with transparency
                elif mode != "RGB":
                    im = im.convert("RGB")
                return np.asarray(im, dtype=np.uint8).copy()
    except Image.DecompressionBombError as e:
        raise DataError(f"image '{path}' is refused by PIL's decompression-bomb guard ({e})") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # PIL's kinds of damaged file
        raise DataError(f"image '{path}' is unreadable ({type(e).__name__}: {e})") from e
    check_finite(pixels, f"image '{path}'", ("row", "column"))
    low, high = float(pixels.min()), float(pixels.max())
    return np.round((pixels - low) / max(high - low, 1e-6) * 255).astype(np.uint8)


def to_channels(image: np.ndarray, channels: int) -> np.ndarray:
    """Grey (H, W) <-> RGB (H, W, 3): grey repeats, RGB -> ITU-R 601 luma (as PIL's 'L')."""
    if channels == 1 and image.ndim == 3:
        luma = image[..., 0] * 0.299 + image[..., 1] * 0.587 + image[..., 2] * 0.114
        return np.clip(np.round(luma), 0, 255).astype(np.uint8)
    if channels == 3 and image.ndim == 2:
        return np.repeat(image[..., None], 3, axis=-1)
    return image


def common_channels(images: Sequence[np.ndarray]) -> int:
    """1 or 3 for a mix of grey and RGB images: grey when every RGB image is grey in fact (R = G = B,
    as NIH's few RGBA files are), else RGB."""
    rgb = [im for im in images if im.ndim == 3]
    if not rgb:
        return 1
    if len(rgb) == len(images):
        return 3
    grey_in_fact = all((im[..., 0] == im[..., 1]).all() and (im[..., 1] == im[..., 2]).all() for im in rgb)
    return 1 if grey_in_fact else 3


def load_image_folder(folder: str, manifest_csv: str, class_names: Optional[List[str]] = None,
                      task: Optional[str] = None, size: Optional[Sequence[int]] = None, channels: Optional[int] = None,
                      annotated_classes: Optional[Sequence[str]] = None,
                      label_column: Optional[str] = None) -> Dataset:
    """Read the PNG / JPEG images listed in a CSV manifest (format in the module docstring).

    Args:
        folder: root folder of the images named in the manifest.
        manifest_csv: the CSV manifest.
        class_names: the C class names (default: from the manifest).
        task: ``single-label`` / ``multi-label`` (default: from the manifest).
        size: resize every image to (H, W) (or an int for square); required when sizes differ.
        channels: 1 (grey) or 3 (RGB); default: RGB when some image is really in colour, else grey.
        annotated_classes: label-column form: the classes this site annotates (default all).
        label_column: the label column (default ``label``, else ``Finding Labels``).

    Raises:
        DataError: naming the manifest line / column / file for missing or unreadable images and
            bad labels, and listing the sizes when images differ in size without ``size``.
    """
    if channels not in (None, 1, 3):
        raise DataError(f"channels must be 1 or 3, not {channels}")
    manifest = read_manifest(manifest_csv, class_names, task, annotated_classes, label_column)
    images = []
    for row in manifest.rows:
        where = f"manifest '{manifest_csv}' line {row.line}, column '{manifest.id_column}'"
        images.append(resize_image(image_to_uint8(resolve_image(folder, row.id, where)), size))
    target = channels or common_channels(images)
    stacks = [to_channels(im, target)[None] for im in images]
    data = assemble(manifest, stacks, [[row.id] for row in manifest.rows], source=manifest_csv)
    data.info.update(kind="images", folder=os.path.abspath(folder))
    return data
