"""``python -m fedpartial import {dicom,images,nifti}``: turn what a hospital site really has
(a DICOM folder, a PNG/JPEG folder or NIfTI volumes, with a CSV of its own labels) into a site
file, and print what the site annotates.

A blank label cell means "not annotated at this site" (``label_mask`` False): sites annotate only
part of the classes. No val split is made unless the CSV has ``split`` values ``val`` or
``--val-fraction`` is given: the executor runs without one (it then reports no validation
metrics), and a val split carved from partially annotated data would score unannotated
entries as negatives. The task (single- or multi-label) is inferred from the CSV unless ``--task``
gives it; the summary says which and why. ``import nifti --agreement FILE.json`` brings every
volume and its mask to the federation's input agreement (:mod:`fedpartial.data.grid`) before
slicing and records it in the site file.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import numpy as np

from fedpartial.data.types import DataError, Dataset

SPLIT_ORDER = ("train", "val", "test")


def _classes(text: Optional[str]) -> Optional[List[str]]:
    return [c.strip() for c in text.split(",") if c.strip()] if text else None


def _size(text: Optional[str]):
    """``224`` or ``224,192`` (H, W)."""
    if not text:
        return None
    try:
        parts = [int(p) for p in str(text).replace("x", ",").split(",")]
    except ValueError:
        raise DataError(f"--size '{text}' is not N or H,W") from None
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise DataError(f"--size '{text}' is not N or H,W with positive numbers")
    return (parts[0], parts[0]) if len(parts) == 1 else tuple(parts)


def carve_val(data: Dataset, fraction: float, seed: int = 0) -> Dataset:
    """Move about ``fraction`` of the train images to a new val split, whole patients at a time.

    Args:
        data: the imported dataset (must not have a val split already).
        fraction: share of the train patients (groups) moved, 0 < fraction < 1.
        seed: seed of the patient draw.
    """
    if not 0 < fraction < 1:
        raise DataError(f"--val-fraction {fraction} must be between 0 and 1")
    if "val" in data.splits:
        raise DataError(f"'{data.source}' already has a val split; --val-fraction would make a second one")
    train = data.splits["train"]
    groups = train.groups if train.groups is not None else np.arange(len(train))
    patients = np.unique(groups.astype(str))
    n_val = int(round(fraction * len(patients)))
    if n_val == 0 or n_val == len(patients):
        raise DataError(f"--val-fraction {fraction} of {len(patients)} patient(s) leaves train or val empty")
    chosen = np.random.default_rng(seed).choice(patients, n_val, replace=False)
    in_val = np.isin(groups.astype(str), chosen)
    splits = dict(data.splits)
    splits["train"], splits["val"] = train.subset(np.flatnonzero(~in_val)), train.subset(np.flatnonzero(in_val))
    info = dict(data.info, val_fraction=fraction, val_seed=seed)
    return Dataset(data.task, data.class_names, splits, data.source, data.site, info)


def summary_lines(data: Dataset, out: str) -> List[str]:
    """The printed summary: the task and why (given or what in the CSV decided it), images per
    split, sizes and channels, per-class annotation counts (segmentation: slices, slices with
    lesions, lesion pixel fraction), and a warning naming the classes this site does not annotate
    at any image.

    Args:
        data: the imported dataset (``info["task_reason"]`` from the manifest, when there is one).
        out: the file written.
    """
    lines = [f"site '{data.site}': {data.task}, {sum(len(s) for s in data.splits.values())} images from "
             f"{data.info.get('kind', '?')} '{data.source}' -> {out}"]
    reason = data.info.get("task_reason")
    if reason:
        lines.append(f"  task  {data.task}, " + ("given with --task" if reason == "given" else f"inferred: {reason}"))
    names = [n for n in SPLIT_ORDER if n in data.splits]
    for name in names:
        split = data.splits[name]
        channels = 1 if split.images.ndim == 3 else split.images.shape[-1]
        rows, cols = split.images.shape[1:3]
        line = f"  {name:5s} {len(split):6d} images  {rows}x{cols}  {channels} channel(s)"
        if data.is_segmentation:
            masks = np.asarray(split.labels) > 0
            with_lesion = int(masks.reshape(len(masks), -1).any(1).sum())
            line += f"  slices with lesions {with_lesion}  lesion pixel fraction {masks.mean():.5f}"
        lines.append(line)
    if data.is_segmentation:
        return lines
    labels = np.concatenate([data.splits[n].labels for n in names]) > 0
    mask = np.concatenate([data.splits[n].label_mask for n in names]).astype(bool)
    width = max(12, *(len(c) for c in data.class_names))
    lines.append(f"  {'class':{width}s} {'annotated':>10s} {'positive':>9s} {'not-annotated':>14s}")
    for c, name in enumerate(data.class_names):
        lines.append(f"  {name:{width}s} {int(mask[:, c].sum()):10d} {int((labels[:, c] & mask[:, c]).sum()):9d} "
                     f"{int((~mask[:, c]).sum()):14d}")
    lines.append("  (images of all splits; not-annotated = blank cells / classes without a column)")
    nowhere = [n for c, n in enumerate(data.class_names) if not mask[:, c].any()]
    if nowhere:
        lines.append(f"warning: site '{data.site}' does not annotate class(es) {nowhere}: no image of any split "
                     f"has a label (1 or 0) for them, so the site gives them neither positives nor negatives")
    return lines


def write_imported(data: Dataset, args) -> Dataset:
    """Set the site and the info block, carve a val split if asked, write the site file, print
    the summary."""
    from fedpartial.data.sitefile import write_site_file

    if sum(len(s) for s in data.splits.values()) == 0:
        raise DataError(f"'{data.source}' gives site '{args.site}' no images")
    data.site = args.site
    data.info.update(imported_with=f"python -m fedpartial import {args.kind}", size=list(args.size or []) or None)
    if args.val_fraction:
        data = carve_val(data, args.val_fraction, args.seed)
    if "train" not in data.splits:
        # a test set (e.g. the rows marked 'test'): not a site's training data but what `evaluate`
        # reads, so it is written in the source layout, which has no label mask
        write_test_file(data, args.out)
        print("no 'train' rows: wrote a test file in the source layout (for 'python -m fedpartial evaluate')")
    else:
        if data.info.get("kind") != "nifti":
            data.info["annotated_classes"] = [n for c, n in enumerate(data.class_names)
                                              if any(s.label_mask[:, c].any() for s in data.splits.values())]
        write_site_file(args.out, data)
    for line in summary_lines(data, args.out):
        print(line)
    return data


def write_test_file(data: Dataset, out: str) -> None:
    """Write an imported set without a train split in the source layout (MedMNIST / segmentation
    ``.npz``). Every entry must be annotated: a test label left blank cannot be scored.

    Args:
        data: the imported dataset (val / test splits only).
        out: the ``.npz`` to write.
    """
    from fedpartial.data.npz import save_npz

    for name, split in data.splits.items():
        if split.label_mask is not None and not split.label_mask.all():
            row, col = (int(i) for i in np.argwhere(~split.label_mask)[0])
            raise DataError(f"'{data.source}': {name} image '{split.ids[row] if split.ids is not None else row}' "
                            f"leaves class '{data.class_names[col]}' blank; a test set needs every class annotated")
    save_npz(data, out)


def _cmd_import(args):
    args.size = _size(args.size)
    if args.kind == "dicom":
        from fedpartial_tools.data.dicom import load_dicom_folder

        data = load_dicom_folder(args.folder, args.labels, class_names=_classes(args.classes), window=args.window,
                                 size=args.size, task=args.task, annotated_classes=_classes(args.annotated),
                                 allow_mixed_modality=args.allow_mixed_modality)
    elif args.kind == "images":
        from fedpartial_tools.data.images import load_image_folder

        data = load_image_folder(args.folder, args.labels, class_names=_classes(args.classes), task=args.task,
                                 size=args.size, channels=args.channels, annotated_classes=_classes(args.annotated),
                                 label_column=args.label_column)
    else:
        from fedpartial_tools.data.nifti import load_nifti_pairs, pair_nifti_files, read_pairs_csv

        if args.pairs:
            if args.images or args.masks:
                raise DataError("give either --pairs CSV or --images and --masks, not both")
            images, masks, splits, names = read_pairs_csv(args.pairs)
            source = {"pairs": os.path.abspath(args.pairs)}
        elif args.images and args.masks:
            images, masks, names = pair_nifti_files(args.images, args.masks)
            splits = None
            source = {"images": args.images, "masks": args.masks}
        else:
            raise DataError("import nifti needs --pairs CSV, or --images and --masks")
        agreement = None
        if args.agreement:
            from fedpartial.data.grid import load_agreement

            agreement = load_agreement(args.agreement)
            source["agreement_file"] = os.path.abspath(args.agreement)
        axis = args.axis if args.axis is not None else agreement.slice_axis if agreement else 2
        data = load_nifti_pairs(images, masks, axis=axis, size=args.size, keep_empty_slices=args.keep_empty_slices,
                                splits=splits, patient_ids=names, agreement=agreement)
        data.info.update(kind="nifti", axis=axis, keep_empty_slices=args.keep_empty_slices,
                         volumes=len(images), **source)
    write_imported(data, args)


def add_import_parser(subparsers) -> None:
    """Register ``import`` with its three sources on the CLI's sub-parsers.

    Args:
        subparsers: the ``add_subparsers()`` object of ``python -m fedpartial``.
    """
    s = subparsers.add_parser("import", help="turn a site's own DICOM / PNG-JPEG / NIfTI data and label CSV into a "
                                             "site file (blank label cell = not annotated at this site)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = s.add_subparsers(dest="kind", required=True)

    def common(p, classification=True):
        p.add_argument("--site", required=True, help="the site's name, e.g. site-1")
        p.add_argument("--out", required=True, help="the site file to write, e.g. site-1.npz")
        p.add_argument("--size", default=None, help="resize to N x N (or H,W); required when image sizes differ")
        p.add_argument("--val-fraction", type=float, default=0.0,
                       help="move this share of the train patients (patient_id) to a val split (default 0: none)")
        p.add_argument("--seed", type=int, default=0, help="seed of --val-fraction")
        if classification:
            p.add_argument("--folder", required=True, help="folder of the files named in the CSV")
            p.add_argument("--labels", required=True, help="the label CSV (file/image id, [split], [patient_id], "
                                                           "per-class 1/0/blank columns or a label column)")
            p.add_argument("--classes", default=None, help="comma list: the job's class names in order; a class "
                                                           "without a column is not annotated at this site")
            p.add_argument("--task", choices=["single-label", "multi-label"], default=None,
                           help="default: inferred from the CSV, and the summary says why (class columns: "
                                "single-label when no row has more than one 1)")
            p.add_argument("--annotated", default=None,
                           help="label-column CSVs: comma list of the classes this site annotates (default all)")
        p.set_defaults(func=_cmd_import)

    p = kinds.add_parser("dicom", help="a folder of DICOM files + CSV (one row per file; multi-frame: one image "
                                       "per frame)")
    common(p)
    p.add_argument("--window", default=None, help="brain | lung | soft-tissue | abdomen | bone | CENTRE,WIDTH "
                                                  "(default: each file's own window, else min-max)")
    p.add_argument("--allow-mixed-modality", action="store_true",
                   help="import files of different DICOM Modality (e.g. CT and MR) into one site (default: an error)")

    p = kinds.add_parser("images", help="a folder of PNG / JPEG images + CSV (ISIC, NIH, Kaggle layouts)")
    common(p)
    p.add_argument("--channels", type=int, choices=[1, 3], default=None,
                   help="1 grey or 3 RGB (default: RGB when some image is in colour)")
    p.add_argument("--label-column", default=None, help="default 'label', else 'Finding Labels'")

    p = kinds.add_parser("nifti", help="NIfTI volumes + lesion masks, sliced into 2D segmentation images")
    common(p, classification=False)
    p.add_argument("--images", default=None, help="folder or glob of the image volumes")
    p.add_argument("--masks", default=None, help="folder or glob of the masks (named like their image, "
                                                 "optionally ending in _mask / _seg / _label ...)")
    p.add_argument("--pairs", default=None, help="CSV with columns image,mask[,split] instead of --images/--masks")
    p.add_argument("--axis", type=int, default=None, choices=[0, 1, 2],
                   help="slicing axis (default 2; with --agreement, its slice_axis)")
    p.add_argument("--agreement", default=None, metavar="FILE.json",
                   help="the federation's input agreement (e.g. provisioning/input_agreement.json): each volume and "
                        "its mask are brought to its orientation, spacing, slice size and intensity scale before "
                        "slicing, and the site file records it (info['input_agreement']); not with --size")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--keep-empty-slices", dest="keep_empty_slices", action="store_true", default=True,
                   help="keep slices without lesions (default)")
    g.add_argument("--drop-empty-slices", dest="keep_empty_slices", action="store_false",
                   help="drop slices without lesions")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m fedpartial import ...")
