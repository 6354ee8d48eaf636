"""Writes what a group of hospitals would hold, for README's "Your own data" walk-through: per
hospital a folder of CT DICOM files (one per slice, 16-bit stored values with rescale slope /
intercept and a brain window, as a scanner writes them) and a ``labels.csv`` with one column per
haemorrhage type where each hospital fills in only the types it annotates (blank = not annotated
there); plus a fully labelled test folder.

The slices come from ``ct_ich_128.npz`` (PhysioNet CT-ICH, brain window) when it is there, else
from the built-in synthetic multi-label dataset, so the walk-through runs without the internet.

    python -m fedpartial_tools.data.dicom_example --out runs/own_data [--source ../shared/data/ct_ich_128.npz]
"""
from __future__ import annotations

import argparse
import csv
import os
from typing import List, Sequence

import numpy as np

# Brain window (centre 40, width 80): stored value s -> HU = s * 80/255 - 1024, so a uint8 slice v
# stored as v + 3264 reads back as HU = v * 80/255 and the brain window returns exactly v.
SLOPE, INTERCEPT, OFFSET = 80.0 / 255.0, -1024.0, 3264


def write_ct_slice(path: str, image: np.ndarray, patient_id: str, instance: int) -> None:
    """One uint8 slice as a CT DICOM file (int16 stored values, rescale slope / intercept,
    brain window), the way a scanner export looks.

    Args:
        path: the ``.dcm`` to write.
        image: uint8 ``(H, W)`` slice in the brain window.
        patient_id: DICOM PatientID.
        instance: InstanceNumber.
    """
    from pydicom.dataset import FileMetaDataset
    from pydicom.dataset import Dataset as DicomDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = DicomDataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PatientID, ds.InstanceNumber = "CT", patient_id, instance
    ds.Rows, ds.Columns = int(image.shape[0]), int(image.shape[1])
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleSlope, ds.RescaleIntercept = f"{SLOPE:.10f}", f"{INTERCEPT:.1f}"
    ds.WindowCenter, ds.WindowWidth = "40", "80"
    ds.PixelData = (image.astype(np.int16) + OFFSET).astype("<i2").tobytes()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def _source(path: str):
    from fedpartial.data.npz import load_npz
    from fedpartial_tools.data.synthetic import make_classification

    if path and os.path.isfile(path):
        return load_npz(path)
    return make_classification(task="multi-label", num_classes=5, size=64, channels=1, seed=0)


def write_hospital(folder: str, images: np.ndarray, labels: np.ndarray, patients: Sequence, class_names: List[str],
                   annotated: Sequence[int], split: str = "") -> int:
    """Write one hospital's DICOM folder and ``labels.csv``; classes outside ``annotated`` are blank.

    Args:
        folder: the hospital's folder (created).
        images: uint8 ``(N, H, W)`` slices.
        labels: ``(N, C)`` 0/1 complete labels.
        patients: per slice, its patient id.
        class_names: the C class names (CSV column headers).
        annotated: indices of the classes this hospital annotates.
        split: value of a ``split`` column (omitted when empty: all the hospital's own training data).
    """
    rows = []
    for i, (image, label, patient) in enumerate(zip(images, labels, patients)):
        name = os.path.join(f"patient{patient}", f"slice{i:05d}.dcm")
        write_ct_slice(os.path.join(folder, name), image, f"P{patient}", i + 1)
        cells = [str(int(label[c])) if c in annotated else "" for c in range(len(class_names))]
        rows.append([name, f"P{patient}", *([split] if split else []), *cells])
    with open(os.path.join(folder, "labels.csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["file", "patient_id", *(["split"] if split else []), *class_names])
        out.writerows(rows)
    return len(rows)


def make_example(out: str, source: str = "", hospitals: int = 3, per_hospital: int = 400, test_images: int = 0,
                 classes_per_hospital: int = 2, seed: int = 0) -> dict:
    """Hospitals ``hospital-1..K`` (each annotating ``classes_per_hospital`` classes, every class
    annotated somewhere) and a fully labelled ``test`` folder, all as DICOM + CSV under ``out``.

    Args:
        out: output folder.
        source: a multi-label ``.npz`` (default: synthetic data).
        hospitals: number of hospitals.
        per_hospital: slices per hospital (whole patients, so about this many).
        test_images: slices of the test folder (0 = the source's whole test split).
        classes_per_hospital: classes each hospital annotates.
        seed: seed of the draw.
    """
    data = _source(source)
    names = list(data.class_names)
    rng = np.random.default_rng(seed)
    train = data.splits["train"]
    groups = train.groups if train.groups is not None else np.arange(len(train))
    patients = rng.permutation(np.unique(groups))
    summary = {"out": os.path.abspath(out), "classes": names, "hospitals": {}}
    cursor = 0
    for k in range(hospitals):
        chosen = []
        while sum(len(c) for c in chosen) < per_hospital and cursor < len(patients):
            chosen.append(np.flatnonzero(groups == patients[cursor]))
            cursor += 1
        index = np.concatenate(chosen)[:per_hospital]
        annotated = [(k * classes_per_hospital + j) % len(names) for j in range(classes_per_hospital)]
        n = write_hospital(os.path.join(out, f"hospital-{k + 1}"), train.images[index], train.labels[index],
                           groups[index], names, annotated)
        summary["hospitals"][f"hospital-{k + 1}"] = {"slices": n, "annotates": [names[c] for c in annotated]}
    test = data.splits["test"]
    index = np.sort(rng.permutation(len(test))[:test_images or len(test)])
    test_groups = test.groups if test.groups is not None else np.arange(len(test))
    write_hospital(os.path.join(out, "test"), test.images[index], test.labels[index], test_groups[index], names,
                   range(len(names)), split="test")
    summary["test"] = {"slices": int(len(index))}
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.data.dicom_example",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--source", default=os.path.join("..", "shared", "data", "ct_ich_128.npz"),
                   help="multi-label .npz to take slices from (synthetic data when absent)")
    p.add_argument("--hospitals", type=int, default=3)
    p.add_argument("--per-hospital", type=int, default=400)
    p.add_argument("--test-images", type=int, default=0, help="0 = the whole test split")
    p.add_argument("--classes-per-hospital", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = make_example(args.out, args.source, args.hospitals, args.per_hospital, args.test_images,
                           args.classes_per_hospital, args.seed)
    for name, h in summary["hospitals"].items():
        print(f"{name}: {h['slices']} DICOM slices, annotates {', '.join(h['annotates'])}")
    print(f"test: {summary['test']['slices']} DICOM slices, every class annotated")
    print(f"written under {summary['out']}")


if __name__ == "__main__":
    main()
