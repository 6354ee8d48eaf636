"""Several sources in one federation (the bench's ``ms6`` suites): slice files brought to one input
agreement (:mod:`fedpartial_tools.data.harmonise`) and combined with row ids that stay unique, a
patient held out as the test split with each other patient's val slices, the held-out patient's
scores on its own native grid, and the agreement of two raters.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fedpartial.data.arrays import atomic_savez, info_json, open_npz, read_info_json
from fedpartial.data.grid import (AGREEMENT_KEY, InputAgreement, check_axcodes, slice_order_flips, stack_affine,
                                  to_agreed_grid)
from fedpartial.data.npz import INFO_KEY
from fedpartial.data.types import DataError
from fedpartial_tools.data.harmonise import harmonise_arrays

#: a row of a combined file is ``patient id * ROW_ID_BASE + slice id`` (unique over sources whose
#: patient ids differ; slice ids stay below it)
ROW_ID_BASE = 1000
#: the second rater's masks where a source has them (ISBI 2015); other rows repeat the first rater's
RATER2_KEY = "masks_rater2"
#: per row 1 where ``{split}_masks_rater2`` is a second rater's mask, 0 where it repeats the first's
HAS_RATER2_KEY = "has_rater2"
#: what a held-out file records of its test patient's native grid (``info_json``)
NATIVE_KEY = "native"
_COMBINED_KEYS = ("train_images", "train_masks", f"train_{RATER2_KEY}", "train_patient_ids", "train_slice_ids")


@dataclass(frozen=True)
class StatedSource:
    """A sliced source without an affine, with the grid stated for it (as ``harmonise`` takes it).

    Attributes:
        file: the ``.npz``: a name in the data folder, or a path.
        spacing_mm: in-plane pixel size (rows, columns) in mm.
        orientation: axis codes of the rows, columns and slices in slice-id order (e.g. ``LAS``).
    """

    file: str
    spacing_mm: Tuple[float, float]
    orientation: str

    def path(self, data_dir: str = "") -> str:
        """The file: ``file`` itself when absolute or no ``data_dir`` is given, else in ``data_dir``."""
        return self.file if os.path.isabs(self.file) or not data_dir else os.path.join(data_dir, self.file)


def combine_sources(sources: Sequence[StatedSource], agreement: InputAgreement, data_dir: str = "") -> tuple:
    """The train splits of several sliced sources, each brought to ``agreement`` (per patient
    volume, :func:`harmonise_arrays`), as one segmentation file's arrays.

    Args:
        sources: the sources and their stated grids; patient ids must differ between them.
        agreement: the input agreement.
        data_dir: folder of sources named without a path.

    Returns:
        ``(arrays, report)``: ``train_images``, ``train_masks``, ``train_masks_rater2`` (the
        second rater's mask where the source has one, else the first rater's),
        ``train_has_rater2`` (1 where it is a second rater's), ``train_patient_ids``,
        ``train_slice_ids``, ``class_names`` and ``info_json`` (the agreement and, per source,
        file, path, stated grid and patients); the report is :func:`harmonise_arrays`' per file.

    Raises:
        DataError: naming the file and key of a source with a val / test split or an array the
            combined file has no place for, a patient id found in two files, a slice id outside
            ``0..ROW_ID_BASE-1``, or class names that differ.
    """
    if not sources:
        raise DataError("combine_sources needs at least one source")
    parts: Dict[str, List[np.ndarray]] = {k: [] for k in (*_COMBINED_KEYS, f"train_{HAS_RATER2_KEY}")}
    owner: Dict[int, str] = {}
    described, report, class_names = [], {}, None
    for source in sources:
        path = source.path(data_dir)
        arrays = open_npz(path)
        other = sorted(k for k in arrays if k.startswith(("val_", "test_")))
        if other:  # the bench holds patients out itself; a split made upstream would be mixed in
            raise DataError(f"'{path}': '{other[0]}': sources are combined from their train split only")
        harmonised, rep = harmonise_arrays(arrays, agreement, source.spacing_mm, source.orientation, f"'{path}'")
        extra = sorted(k for k in harmonised if k.startswith("train_") and k not in _COMBINED_KEYS)
        if extra:
            raise DataError(f"'{path}': '{extra[0]}' has no place in the combined file (it holds "
                            f"{list(_COMBINED_KEYS)})")
        names = [str(c) for c in harmonised.get("class_names", np.array(["background", "lesion"])).tolist()]
        if class_names is not None and names != class_names:
            raise DataError(f"'{path}': 'class_names' {names} differ from the earlier sources' {class_names}")
        class_names = names
        patients = harmonised["train_patient_ids"].astype(np.int64)
        slices = harmonised["train_slice_ids"].astype(np.int64)
        for p in np.unique(patients).tolist():
            if p in owner:
                raise DataError(f"patient id {p} is in both '{owner[p]}' and '{path}' ('train_patient_ids'); "
                                f"combined sources need distinct patient ids")
            owner[p] = path
        if slices.min(initial=0) < 0 or slices.max(initial=0) >= ROW_ID_BASE:
            raise DataError(f"'{path}': 'train_slice_ids' run {slices.min()}..{slices.max()}; row ids need "
                            f"0..{ROW_ID_BASE - 1}")
        second = f"train_{RATER2_KEY}" in harmonised
        parts["train_images"].append(harmonised["train_images"])
        parts["train_masks"].append((harmonised["train_masks"] > 0).astype(np.uint8))
        parts[f"train_{RATER2_KEY}"].append(
            (harmonised[f"train_{RATER2_KEY}" if second else "train_masks"] > 0).astype(np.uint8))
        parts[f"train_{HAS_RATER2_KEY}"].append(np.full(len(patients), int(second), np.uint8))
        parts["train_patient_ids"].append(patients)
        parts["train_slice_ids"].append(slices)
        described.append({"file": os.path.basename(path), "path": os.path.abspath(path),
                          "spacing_mm": [float(s) for s in source.spacing_mm],
                          "orientation": source.orientation.upper(), "patients": sorted(np.unique(patients).tolist()),
                          "second_rater": second})
        report[os.path.basename(path)] = rep["train"]
    out = {k: np.ascontiguousarray(np.concatenate(v)) for k, v in parts.items()}
    out["class_names"] = np.array(class_names)
    out[INFO_KEY] = info_json({AGREEMENT_KEY: agreement.to_dict(), "combined_from": described})
    return out, report


def combine_npz(sources: Sequence[StatedSource], agreement: InputAgreement, out: str, data_dir: str = "") -> dict:
    """Write :func:`combine_sources` as ``out`` (atomically); returns its report.

    Args:
        sources: the sources and their stated grids.
        agreement: the input agreement.
        out: the ``.npz`` to write.
        data_dir: folder of sources named without a path.
    """
    arrays, report = combine_sources(sources, agreement, data_dir)
    atomic_savez(out, arrays)
    return report


def hold_out_patient(combined: str, patient: int, out: str, val_fraction: float = 0.15, val_seed: int = 0) -> dict:
    """Write ``out`` from a combined file: ``patient``'s slices as the test split, a share of every
    other patient's slices as the val split, the rest as the train split.

    The val split: of each training patient, ``round(val_fraction * n)`` of its n slices (at
    least 1 when ``val_fraction`` > 0), drawn with ``numpy.random.default_rng([val_seed, patient
    id])``, so a patient's val slices are the same whichever patient is held out and whatever the
    bench seed. Train and val carry no patient ids (``split`` then shares them out slice by slice,
    as :func:`fedpartial_tools.bench.sources.leave_patient_out` does); every split has row ids
    (``{split}_image_ids`` = patient id * :data:`ROW_ID_BASE` + slice id); train and val keep
    ``*_masks_rater2`` / ``*_has_rater2``; the test split keeps ``test_patient_ids`` and is in
    slice-id order. ``info_json`` records the agreement, the val rule and the test patient's native
    grid (:data:`NATIVE_KEY`: file, path, stated grid, patient) for scoring at native resolution.

    Args:
        combined: a file of :func:`combine_npz`.
        patient: the held-out patient id.
        out: the ``.npz`` to write.
        val_fraction: share of each training patient's slices in the val split; 0 = no val split.
        val_seed: seed of the val draw.

    Returns:
        ``{"train": {patient: slices}, "val": {...}, "test": {...}}``.

    Raises:
        DataError: naming the file when ``patient`` is not one of several patients, a patient id
            is negative, or ``val_fraction`` is outside [0, 1).
    """
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction} is not in [0, 1)")
    arrays = open_npz(combined)
    for key in (*_COMBINED_KEYS, f"train_{HAS_RATER2_KEY}", INFO_KEY):
        if key not in arrays:
            raise DataError(f"'{combined}' lacks '{key}'; it is not a file of combine_npz")
    patients = arrays["train_patient_ids"].astype(np.int64)
    slices = arrays["train_slice_ids"].astype(np.int64)
    present = sorted(np.unique(patients).tolist())
    if patient not in present or len(present) < 2:
        raise DataError(f"'{combined}': patient {patient} is not one of several patients {present}")
    if present[0] < 0:
        raise DataError(f"'{combined}': patient id {present[0]} is negative; the val draw is seeded by patient id")
    info = read_info_json(arrays, f"'{combined}'")
    origin = next((s for s in info.get("combined_from", []) if patient in s.get("patients", [])), None)
    if origin is None:
        raise DataError(f"'{combined}': info_json 'combined_from' names no source of patient {patient}")
    test, val, train = [], [], []
    for p in present:
        rows = np.flatnonzero(patients == p)
        rows = rows[np.argsort(slices[rows], kind="stable")]
        if p == patient:
            test.append(rows)
            continue
        n_val = 0 if val_fraction == 0 else max(1, int(round(val_fraction * len(rows))))
        chosen = np.zeros(len(rows), bool)
        chosen[np.random.default_rng([val_seed, p]).choice(len(rows), size=min(n_val, len(rows) - 1),
                                                            replace=False)] = True
        val.append(rows[chosen])
        train.append(rows[~chosen])
    row_ids = patients * ROW_ID_BASE + slices
    out_arrays = {"class_names": arrays["class_names"]}
    summary = {}
    for split, rows in (("train", train), ("val", val), ("test", test)):
        rows = np.concatenate(rows)
        if split == "val" and val_fraction == 0:
            continue
        out_arrays[f"{split}_images"] = arrays["train_images"][rows]
        out_arrays[f"{split}_masks"] = arrays["train_masks"][rows]
        out_arrays[f"{split}_image_ids"] = row_ids[rows]
        if split == "test":
            out_arrays["test_patient_ids"] = patients[rows]
        else:
            out_arrays[f"{split}_{RATER2_KEY}"] = arrays[f"train_{RATER2_KEY}"][rows]
            out_arrays[f"{split}_{HAS_RATER2_KEY}"] = arrays[f"train_{HAS_RATER2_KEY}"][rows]
        summary[split] = {int(p): int((patients[rows] == p).sum()) for p in np.unique(patients[rows]).tolist()}
    info.update({"held_out_patient": int(patient),
                 "val_split": {"fraction": float(val_fraction), "seed": int(val_seed),
                               "rule": "round(fraction * n) of each training patient's n slices, "
                                       "numpy default_rng([seed, patient id]); never the held-out patient"},
                 NATIVE_KEY: {"patient": int(patient), "file": origin["file"], "path": origin["path"],
                              "spacing_mm": origin["spacing_mm"], "orientation": origin["orientation"]}})
    out_arrays[INFO_KEY] = info_json(info)
    atomic_savez(out, out_arrays)
    return summary


def native_patient(path: str, patient: int, key: str = "train_masks") -> tuple:
    """One patient's slices of a sliced source as stored, in slice-id order.

    Args:
        path: the source ``.npz`` (e.g. ``ms_flair_isbi2015_4patients.npz``).
        patient: the patient id (``train_patient_ids``).
        key: the mask to read (``train_masks``, ``train_masks_rater2``).

    Returns:
        ``(images (S, H, W), masks (S, H, W) bool, slice ids (S,))``.

    Raises:
        DataError: naming the file and key when the key or the patient is missing.
    """
    arrays = open_npz(path)
    for needed in ("train_images", "train_patient_ids", "train_slice_ids", key):
        if needed not in arrays:
            raise DataError(f"'{path}' lacks '{needed}'")
    rows = np.flatnonzero(arrays["train_patient_ids"] == patient)
    if not len(rows):
        raise DataError(f"'{path}': patient {patient} is not in 'train_patient_ids'")
    rows = rows[np.argsort(arrays["train_slice_ids"][rows], kind="stable")]
    return arrays["train_images"][rows], arrays[key][rows] > 0, arrays["train_slice_ids"][rows].astype(np.int64)


def back_to_native(probs: np.ndarray, native_images: np.ndarray, spacing_mm: Sequence[float], orientation: str,
                   agreement: InputAgreement) -> np.ndarray:
    """Per-slice results on the agreed grid (e.g. lesion probabilities of one patient's slices as
    ``harmonise`` wrote them, in slice-id order) put back on the patient's native slices, by the
    agreement's own inverse (:func:`fedpartial.data.grid.back_to_source`, bilinear).

    Args:
        probs: ``(S, H, W)`` values on the agreed grid, in slice-id order.
        native_images: the patient's native slices ``(S, h, w)`` in slice-id order; they give the
            native grid (:func:`fedpartial.data.grid.to_agreed_grid` is run on them).
        spacing_mm: the source's stated in-plane pixel size (rows, columns).
        orientation: the source's stated axis codes (rows, columns, slices in slice-id order).
        agreement: the agreement the slices were brought to.

    Returns:
        float32 ``(S, h, w)`` in slice-id order; pixels the crop cut away are 0.
    """
    from fedpartial.data.grid import back_to_source

    orientation = check_axcodes(orientation, "orientation")
    probs = np.asarray(probs, dtype=np.float32)
    if len(probs) != len(native_images):
        raise DataError(f"{len(probs)} slices of results for {len(native_images)} native slices")
    _, _, grid = to_agreed_grid(np.moveaxis(np.asarray(native_images), 0, -1), stack_affine(orientation, spacing_mm),
                                agreement, where="native slices")
    # harmonise wrote the slices back in ascending slice-id order where the agreed orientation reversed them
    on_grid = probs[::-1] if slice_order_flips(orientation, agreement) else probs
    return np.ascontiguousarray(np.moveaxis(back_to_source(on_grid, grid), -1, 0))


def dice_pooled_native(probs: np.ndarray, native_images: np.ndarray, native_masks: np.ndarray,
                       spacing_mm: Sequence[float], orientation: str, agreement: InputAgreement,
                       threshold: float = 0.5) -> float:
    """Pooled Dice at the patient's own resolution: the probabilities on the agreed grid taken back
    to the native slices (:func:`back_to_native`), thresholded there, scored against the native mask
    (2 TP / (2 TP + FP + FN) over every pixel of every slice; NaN when both are empty).

    Args:
        probs: ``(S, H, W)`` lesion probabilities on the agreed grid, in slice-id order.
        native_images: the patient's native slices ``(S, h, w)``, slice-id order.
        native_masks: the native reference masks ``(S, h, w)`` (> 0 = lesion).
        spacing_mm: the source's stated in-plane pixel size.
        orientation: the source's stated axis codes.
        agreement: the agreement the slices were brought to.
        threshold: a native pixel is a lesion where the resampled probability exceeds it.
    """
    from fedpartial.metrics.segmentation import overlap_counts, overlap_summary

    native = back_to_native(probs, native_images, spacing_mm, orientation, agreement)
    truth = np.asarray(native_masks) > 0
    if truth.shape != native.shape:
        raise DataError(f"native masks {truth.shape} do not match the native slices {native.shape}")
    counts = overlap_counts(native > threshold, truth)
    return float(overlap_summary(counts["tp"], counts["fp"], counts["fn"])["dice_pooled"])


def rater_agreement(masks_a: np.ndarray, masks_b: np.ndarray, patient_ids: np.ndarray) -> dict:
    """How far apart two raters are: Dice of their masks per patient (pixels of all its slices
    pooled) and over every patient.

    Args:
        masks_a: the first rater's masks ``(N, H, W)`` (> 0 = lesion).
        masks_b: the second rater's, same shape.
        patient_ids: ``(N,)`` patient of each slice.

    Returns:
        ``{"per_patient": {patient: {"dice", "pixels_a", "pixels_b"}}, "pooled": {...}}``; a Dice
        is NaN where neither rater marked a pixel.
    """
    from fedpartial.metrics.segmentation import overlap_counts

    a, b = np.asarray(masks_a) > 0, np.asarray(masks_b) > 0
    patient_ids = np.asarray(patient_ids)
    if a.shape != b.shape or a.ndim != 3 or len(patient_ids) != len(a):
        raise DataError(f"rater masks {a.shape} / {b.shape} and {len(patient_ids)} patient ids do not match")
    counts = overlap_counts(a, b)  # a as the prediction: fp = a only, fn = b only

    def summary(rows) -> dict:
        tp, fp, fn = (int(counts[k][rows].sum()) for k in ("tp", "fp", "fn"))
        return {"dice": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else float("nan"),
                "pixels_a": tp + fp, "pixels_b": tp + fn}

    return {"per_patient": {int(p): summary(patient_ids == p) for p in np.unique(patient_ids).tolist()},
            "pooled": summary(np.ones(len(a), bool))}


def rater_agreement_file(path: str, first: str = "train_masks", second: str = f"train_{RATER2_KEY}") -> dict:
    """:func:`rater_agreement` of a file's two raters (``ms_flair_isbi2015_4patients.npz``).

    Args:
        path: the ``.npz``.
        first: the first rater's mask key.
        second: the second rater's mask key.

    Raises:
        DataError: naming the file and key when one is missing.
    """
    arrays = open_npz(path)
    for key in (first, second, "train_patient_ids"):
        if key not in arrays:
            raise DataError(f"'{path}' lacks '{key}'")
    return rater_agreement(arrays[first], arrays[second], arrays["train_patient_ids"])
