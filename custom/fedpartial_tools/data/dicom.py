"""DICOM folder + CSV manifest reader (pydicom).

The manifest is the CSV described in :mod:`fedpartial_tools.data.images` (shared with PNG / JPEG
folders), one row per DICOM file (an image or a multi-frame series):

* ``file[,split],label[,patient_id]``: ``label`` is one class per row for single-label data (a
  class index ``0..C-1`` or a class name), or for multi-label data the positive classes separated
  by ``|`` (names or indices; an empty cell = no finding).
* ``file[,split],<class 1>,<class 2>,...[,patient_id]``: one column per class holding ``1``, ``0``
  or a BLANK cell = this class is not annotated at this site for this file (label 0,
  ``label_mask`` False); the column headers are the class names.

``file`` is relative to the folder; ``split`` (optional; absent = every row is ``train``) is
``train``, ``val`` or ``test``; ``patient_id`` (optional) keeps a patient's images on one site.
The task is ``multi_label`` / ``task`` when given, else inferred from the CSV as
:mod:`fedpartial_tools.data.images` describes. A multi-frame file gives one image per frame (id
``file:frame``), each with the labels of its row. The files of one folder share one Modality
(CT, MR...) unless ``allow_mixed_modality``.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from fedpartial_tools.data.images import assemble, check_finite, read_manifest, resize_image
from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, DataError, Dataset

SPLITS = ("train", "val", "test")
# (centre, width) in Hounsfield units for CT.
WINDOW_PRESETS = {"brain": (40.0, 80.0), "lung": (-600.0, 1500.0), "soft-tissue": (40.0, 400.0),
                  "abdomen": (40.0, 400.0), "bone": (400.0, 1800.0)}
Window = Union[None, str, Tuple[float, float]]
_resize = resize_image  # the old private name


def parse_window(window: Window) -> Optional[Tuple[float, float]]:
    """A window as (centre, width).

    Args:
        window: None / "" (the file's own window), a preset name from ``WINDOW_PRESETS``, the text
            ``"C,W"`` or a (centre, width) pair.
    """
    if window is None or (isinstance(window, str) and not window.strip()):
        return None
    if isinstance(window, str):
        text = window.strip().lower()
        if text in WINDOW_PRESETS:
            return WINDOW_PRESETS[text]
        parts = text.split(",")
        try:
            if len(parts) != 2:
                raise ValueError(text)
            centre, width = float(parts[0]), float(parts[1])
        except ValueError:
            raise DataError(f"window '{window}' is neither a preset {sorted(WINDOW_PRESETS)} nor 'centre,width'") \
                from None
    else:
        centre, width = (float(v) for v in window)
    if not width > 0 or not np.isfinite(width):  # "not >": NaN fails every comparison
        raise DataError(f"window '{window}': width must be a finite number > 0")
    if not np.isfinite(centre):
        raise DataError(f"window '{window}': centre must be a finite number")
    return centre, width


def dicom_frames(path: str, window: Window = None) -> np.ndarray:
    """Every frame of one DICOM file as uint8 ``(F, H, W)`` grey or ``(F, H, W, 3)`` colour (F = 1
    for a single-frame file).

    Grey: rescale slope / intercept, window (centre, width) from ``window`` or the file's
    WindowCenter / WindowWidth (else min-max over the whole file, so the frames of a series keep
    one intensity scale), MONOCHROME1 inverted. Window mapping: ``low = centre - width/2``,
    ``high = centre + width/2``, value -> ``round(clip((v - low) / width, 0, 1) * 255)``.
    Colour: display values; more than 8 bits are scaled by the largest storable value.

    Args:
        path: the ``.dcm`` file.
        window: see :func:`parse_window`; overrides the file's own window.

    Raises:
        DataError: naming the file when it is unreadable, holds NaN / Inf pixel values, a
            non-finite rescale slope / intercept, or (used without ``window``) a window whose width
            is not a finite number > 0.
    """
    return _read_dicom(path, parse_window(window))[0]


def _read_dicom(path: str, window: Optional[Tuple[float, float]]):
    """(the frames as :func:`dicom_frames` gives them, the pydicom dataset for its header)."""
    import pydicom

    try:
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array.astype(np.float64)
    except Exception as e:  # pydicom raises many types (InvalidDicomError, decoder errors, struct errors)
        raise DataError(f"DICOM file '{path}' is unreadable ({type(e).__name__}: {e})") from e
    samples = int(getattr(ds, "SamplesPerPixel", 1) or 1)
    frames = int(getattr(ds, "NumberOfFrames", 1) or 1)
    single_ndim = 3 if samples == 3 else 2
    if pixels.ndim == single_ndim:
        pixels = pixels[None]
    if pixels.ndim != single_ndim + 1 or (frames > 1 and pixels.shape[0] != frames):
        raise DataError(f"DICOM file '{path}' holds pixel data of shape {pixels.shape} ({samples} sample(s) per "
                        f"pixel, {frames} frame(s)); expected 2D frames")
    check_finite(pixels, f"DICOM file '{path}'", ("frame", "row", "column", "sample"))
    if samples == 3:  # colour (e.g. dermoscopy): already display values, no rescale or window
        # (pydicom 3's pixel_array already converts YBR colour to RGB)
        bits = int(getattr(ds, "BitsStored", 8) or 8)
        if bits > 8:
            pixels = pixels * (255.0 / (2 ** bits - 1))
        return np.clip(pixels, 0, 255).round().astype(np.uint8), ds
    slope, intercept = float(getattr(ds, "RescaleSlope", 1) or 1), float(getattr(ds, "RescaleIntercept", 0) or 0)
    if not (np.isfinite(slope) and np.isfinite(intercept)):
        raise DataError(f"DICOM file '{path}': RescaleSlope {slope} / RescaleIntercept {intercept} must be finite "
                        f"numbers")
    pixels = pixels * slope + intercept
    if window is None and "WindowCenter" in ds and "WindowWidth" in ds:
        first = lambda v: float(v[0]) if isinstance(v, pydicom.multival.MultiValue) else float(v)  # noqa: E731
        window = (first(ds.WindowCenter), first(ds.WindowWidth))
        if not window[1] > 0 or not np.isfinite(window).all():  # "not >": NaN fails every comparison
            raise DataError(f"DICOM file '{path}': its window (WindowCenter {window[0]}, WindowWidth {window[1]}) "
                            f"needs a finite centre and a finite width > 0; pass --window (a preset or "
                            f"CENTRE,WIDTH) to use another")
    if window is not None:
        centre, width = window
        low, high = centre - width / 2.0, centre + width / 2.0
    else:
        low, high = float(pixels.min()), float(pixels.max())
    scaled = np.clip((pixels - low) / max(high - low, 1e-6), 0.0, 1.0)
    if str(getattr(ds, "PhotometricInterpretation", "")).upper() == "MONOCHROME1":
        scaled = 1.0 - scaled  # MONOCHROME1: low values are white
    return np.round(scaled * 255).astype(np.uint8), ds


def dicom_to_uint8(path: str, window: Window = None) -> np.ndarray:
    """Pixel data of one single-frame DICOM file as uint8 (H, W) or (H, W, 3); see
    :func:`dicom_frames` for the mapping (multi-frame files: use ``dicom_frames``).

    Args:
        path: the ``.dcm`` file.
        window: (centre, width) in rescaled units, a preset name or ``"C,W"``, overriding the
            file's own window.
    """
    frames = dicom_frames(path, window)
    if len(frames) != 1:
        raise DataError(f"DICOM file '{path}' holds {len(frames)} frames; read it with dicom_frames")
    return frames[0]


def load_dicom_folder(folder: str, manifest_csv: str, class_names: Optional[List[str]] = None,
                      multi_label: Optional[bool] = None, window: Window = None,
                      size: Optional[Sequence[int]] = None, task: Optional[str] = None,
                      annotated_classes: Optional[Sequence[str]] = None,
                      allow_mixed_modality: bool = False) -> Dataset:
    """Read the DICOM files listed in a CSV manifest (format in the module docstring).

    Args:
        folder: root folder of the files named in the manifest.
        manifest_csv: the CSV manifest.
        class_names: the C class names; default: the class columns, else ``class_0..`` for
            index labels, else the sorted names found in ``label``.
        multi_label: force the task (None = decide from the manifest, see the module docstring).
        window: preset name (``brain``, ``lung``, ``soft-tissue``/``abdomen``, ``bone``),
            ``"C,W"`` or (centre, width) applied to every image; default: each file's own window.
        size: resize every image to (H, W) (or an int for square); required when sizes differ.
        task: ``single-label`` / ``multi-label``; the same as ``multi_label`` (which wins if both given).
        annotated_classes: label-column form: the classes this site annotates (default all).
        allow_mixed_modality: accept files of different Modality (CT and MR...) in one folder.

    Raises:
        DataError: naming the manifest line / column / file for unreadable or missing files,
            NaN / Inf pixels, a bad window, duplicate rows, bad label cells, unknown classes or
            splits, and for files of two modalities without ``allow_mixed_modality``.
    """
    if multi_label is not None:
        task = MULTI_LABEL if multi_label else SINGLE_LABEL
    window = parse_window(window)
    manifest = read_manifest(manifest_csv, class_names, task, annotated_classes)
    stacks, ids, modalities = [], [], {}
    for row in manifest.rows:
        path = os.path.join(folder, row.id)
        where = f"manifest '{manifest_csv}' line {row.line}, column '{manifest.id_column}'"
        if not os.path.isfile(path):
            raise DataError(f"{where}: DICOM file '{path}' not found")
        frames, ds = _read_dicom(path, window)
        modality = str(getattr(ds, "Modality", "") or "").strip()
        if modality and modality not in modalities:
            if modalities and not allow_mixed_modality:
                other, (line, other_path) = next(iter(modalities.items()))
                raise DataError(f"{where}: DICOM file '{path}' is {modality} but '{other_path}' (line {line}) is "
                                f"{other}; one site's images are expected from one modality (pass "
                                f"--allow-mixed-modality to import them together)")
            modalities[modality] = (row.line, path)
        stacks.append(np.stack([resize_image(f, size) for f in frames]))
        ids.append([row.id] if len(frames) == 1 else [f"{row.id}:{i}" for i in range(len(frames))])
    data = assemble(manifest, stacks, ids, source=manifest_csv)
    data.info.update(kind="dicom", folder=os.path.abspath(folder), window=None if window is None else list(window),
                     modalities=sorted(modalities))
    return data
