"""``python -m fedpartial_tools harmonise``: bring a segmentation ``.npz`` of 2D slices (one source,
e.g. ``../shared/data/ms_flair_*.npz``) to the federation's input agreement, as ``import nifti
--agreement`` brings a site's NIfTI volumes.

Such a file has no affine, so its grid is stated: ``--spacing-mm`` (in-plane pixel size) and
``--orientation`` (three axis codes: where the rows, the columns and the slices in slice-id order
run to, e.g. ``LAS``). The slices of each patient (``*_patient_ids``) are stacked in slice-id order
(``*_slice_ids``) into a volume, which :func:`fedpartial.data.grid.to_agreed_grid` brings to the
agreed orientation, in-plane spacing, slice size and intensity scale (one scale per patient
volume); every mask (``*_masks``, ``*_masks_rater2``...) follows by nearest neighbour. The output
has the input's layout and keys (patient and slice ids kept, rows ordered by patient then slice),
and records the agreement in ``info_json`` (:func:`fedpartial.data.npz.load_npz` reads it into
``Dataset.info``).
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, Sequence

import numpy as np

from fedpartial.data.arrays import atomic_savez, info_json, open_npz
from fedpartial.data.grid import (AGREEMENT_KEY, InputAgreement, check_axcodes, mask_to_agreed_grid,
                                  slice_order_flips, stack_affine, to_agreed_grid)
from fedpartial.data.npz import INFO_KEY, SPLITS
from fedpartial.data.types import DataError


def _spacing(text) -> tuple:
    """``0.83`` or ``0.83,0.83`` (rows, columns) in mm."""
    try:
        parts = [float(p) for p in str(text).replace("x", ",").split(",")]
    except ValueError:
        raise DataError(f"--spacing-mm '{text}' is not MM or ROWS,COLS") from None
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise DataError(f"--spacing-mm '{text}' is not MM or ROWS,COLS with positive numbers")
    return (parts[0], parts[0]) if len(parts) == 1 else tuple(parts)


def harmonise_arrays(arrays: Dict[str, np.ndarray], agreement: InputAgreement, spacing_mm: Sequence[float],
                     orientation: str, where: str = "source") -> tuple:
    """The arrays of a segmentation ``.npz`` brought to ``agreement``, per patient volume.

    Args:
        arrays: the file's arrays (``{split}_images`` grey ``(N, H, W)``, ``{split}_masks``,
            ``{split}_patient_ids``, ``{split}_slice_ids``; other ``{split}_masks*`` masks and
            ``{split}_*ids`` ids follow the rows).
        agreement: the input agreement.
        spacing_mm: the source's in-plane pixel size (rows, columns).
        orientation: the source's axis codes: rows, columns, slices in slice-id order.
        where: names the source in error messages.

    Returns:
        ``(arrays, report)``: the new arrays (without ``info_json``) and per split and patient
        ``{"slices", "lesion_pixels_in", "lesion_pixels_out", "lesion_pixels_expected"}``, the
        expectation being the input count times the pixel-area ratio.

    Raises:
        DataError: naming the file and key of a missing id array, a colour or non-uint8 image
            array, an array that is no image, mask or id (per-slice facts such as lesion counts
            would no longer hold), a patient with a slice id twice, or slices in another plane
            than the agreement's.
    """
    orientation = check_axcodes(orientation, "--orientation")
    flips = slice_order_flips(orientation, agreement)
    affine = stack_affine(orientation, spacing_mm)
    area = float(spacing_mm[0] * spacing_mm[1]) / float(agreement.spacing_mm[0] * agreement.spacing_mm[1])
    out: Dict[str, np.ndarray] = {k: v for k, v in arrays.items() if not k.startswith(tuple(f"{s}_" for s in SPLITS))}
    out.pop(INFO_KEY, None)
    report: Dict[str, dict] = {}
    for split in SPLITS:
        if f"{split}_images" not in arrays:
            continue
        images = arrays[f"{split}_images"]
        if images.ndim != 3 or images.dtype != np.uint8:
            raise DataError(f"{where}: '{split}_images' is {images.dtype} {images.shape}; harmonise takes grey uint8 "
                            f"slices (N, H, W)")
        for key in (f"{split}_patient_ids", f"{split}_slice_ids", f"{split}_masks"):
            if key not in arrays:
                raise DataError(f"{where} lacks '{key}': slices are stacked into patient volumes by patient id, in "
                                f"slice-id order, and the masks follow them")
        rows = len(images)
        # the expert mask first, then the others (a second rater's...)
        masks = [f"{split}_masks"] + sorted(k for k in arrays if k.startswith(f"{split}_masks_"))
        ids = sorted(k for k in arrays if k.startswith(f"{split}_") and k.endswith("ids"))
        for key in masks + ids:
            if len(arrays[key]) != rows:
                raise DataError(f"{where}: '{key}' has {len(arrays[key])} rows for {rows} images")
        dropped = sorted(set(k for k in arrays if k.startswith(f"{split}_")) - {f"{split}_images", *masks, *ids})
        if dropped:  # per-slice facts (lesion counts...) no longer hold once the slices are resampled
            raise DataError(f"{where}: '{dropped[0]}' is not an image, mask or id array; harmonise cannot carry it "
                            f"onto the new grid")
        patients, slice_ids = arrays[f"{split}_patient_ids"], arrays[f"{split}_slice_ids"]
        first = {}
        for i, p in enumerate(patients.tolist()):
            first.setdefault(p, i)
        parts: Dict[str, List[np.ndarray]] = {k: [] for k in [f"{split}_images", *masks, *ids]}
        report[split] = {}
        for patient in sorted(first, key=first.get):
            index = np.flatnonzero(patients == patient)
            index = index[np.argsort(slice_ids[index], kind="stable")]
            if len(np.unique(slice_ids[index])) != len(index):
                raise DataError(f"{where}: patient {patient} has a slice id twice in '{split}_slice_ids'")
            stack = lambda key: np.moveaxis(arrays[key][index], 0, -1)  # noqa: E731  (rows, columns, slices)
            slices, lesions, _ = to_agreed_grid(stack(f"{split}_images"), affine, agreement, stack(f"{split}_masks"),
                                                where=f"{where} patient {patient}")
            moved = {f"{split}_images": slices, f"{split}_masks": lesions}
            for key in masks[1:]:
                moved[key] = mask_to_agreed_grid(stack(key), affine, agreement)
            for key, value in moved.items():
                # the agreed orientation reversed the stack: back to ascending slice ids
                parts[key].append((value[::-1] if flips else value).astype(arrays[key].dtype))
            for key in ids:
                parts[key].append(arrays[key][index])
            lesions_in = int((arrays[f"{split}_masks"][index] > 0).sum())
            report[split][str(patient)] = {"slices": int(len(index)), "lesion_pixels_in": lesions_in,
                                           "lesion_pixels_out": int(lesions.sum()),
                                           "lesion_pixels_expected": lesions_in * area}
        for key, chunks in parts.items():
            out[key] = np.ascontiguousarray(np.concatenate(chunks))
    if not report:
        raise DataError(f"{where} has none of {[f'{s}_images' for s in SPLITS]}")
    return out, report


def harmonise_npz(source: str, out: str, agreement: InputAgreement, spacing_mm: Sequence[float],
                  orientation: str) -> dict:
    """Write ``source`` brought to ``agreement`` as ``out`` (same layout, agreement in ``info_json``).

    Args:
        source: a segmentation ``.npz`` of 2D slices with patient and slice ids.
        out: the ``.npz`` to write (atomically).
        agreement: the input agreement.
        spacing_mm: the source's in-plane pixel size (rows, columns).
        orientation: the source's axis codes (rows, columns, slices in slice-id order).

    Returns:
        the per-split, per-patient report of :func:`harmonise_arrays`.
    """
    arrays = open_npz(source)
    harmonised, report = harmonise_arrays(arrays, agreement, spacing_mm, orientation, f"'{source}'")
    info = {AGREEMENT_KEY: agreement.to_dict(), "harmonised_from": os.path.basename(source),
            "source_spacing_mm": [float(s) for s in spacing_mm], "source_orientation": orientation.upper()}
    harmonised[INFO_KEY] = info_json(info)
    atomic_savez(out, harmonised)
    return report


def _cmd_harmonise(args) -> None:
    from fedpartial.data.grid import load_agreement

    agreement = load_agreement(args.agreement)
    report = harmonise_npz(args.data, args.out, agreement, _spacing(args.spacing_mm), args.orientation)
    size = "x".join(str(s) for s in agreement.size)
    print(f"{args.data} -> {args.out}: slices {size} at {agreement.spacing_mm[0]:g} x {agreement.spacing_mm[1]:g} mm, "
          f"{agreement.orientation}, intensity {agreement.intensity.to_dict()}")
    print(f"  {'split':5s} {'patient':>8s} {'slices':>6s} {'lesion px in':>12s} {'out':>8s} {'expected':>9s}")
    for split, patients in report.items():
        for patient, r in patients.items():
            print(f"  {split:5s} {patient:>8s} {r['slices']:6d} {r['lesion_pixels_in']:12d} "
                  f"{r['lesion_pixels_out']:8d} {r['lesion_pixels_expected']:9.0f}")
    print("  (expected = lesion pixels in x the pixel-area ratio; slices are kept one for one)")


def add_harmonise_parser(subparsers) -> None:
    """Register ``harmonise`` on the CLI's sub-parsers.

    Args:
        subparsers: the ``add_subparsers()`` object of ``python -m fedpartial_tools``.
    """
    s = subparsers.add_parser("harmonise", help="bring a segmentation .npz of 2D slices (one source) to the "
                                                "federation's input agreement, patient volume by patient volume",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--data", required=True, help="source .npz with *_patient_ids and *_slice_ids")
    s.add_argument("--spacing-mm", required=True, help="the source's in-plane pixel size: MM or ROWS,COLS")
    s.add_argument("--orientation", required=True,
                   help="where the source's rows, columns and slices (in slice-id order) run to, as axis codes: "
                        "LAS for ms_flair_2patients.npz, PLS for ms_flair_isbi2015_4patients.npz")
    s.add_argument("--agreement", required=True, metavar="FILE.json",
                   help="the input agreement, e.g. provisioning/input_agreement.json")
    s.add_argument("--out", required=True, help="the .npz to write (same layout, agreement in info_json)")
    s.set_defaults(func=_cmd_harmonise)
