"""``python -m fedpartial predict {dicom,images,nifti}``: a model file on a site's own images,
without labels.

The inputs are those ``import`` reads (:mod:`fedpartial_tools.data.dicom`, :mod:`fedpartial_tools.data.images`,
:mod:`fedpartial_tools.data.nifti`, whose readers are used here): a DICOM folder, a PNG / JPEG folder, or
NIfTI volumes sliced along ``--axis``. Every image is resized to the model's ``input_size`` as at
training (``fedpartial.data.transforms.resize_images``; none when the model has no input size) and
normalised with the model's ``normalisation``. A model that records an input agreement
(``meta["input_agreement"]``, :mod:`fedpartial.data.grid`) has each NIfTI volume brought to the
agreed orientation, spacing, size and intensity scale before slicing, as ``import nifti
--agreement`` did at the sites, and its mask resampled back onto the volume's own grid. An image
the model cannot serve (an RGB image for a grey model or the reverse, an unreadable file, a DICOM
of another modality) is reported as a one-line error naming the file; the other images are still
predicted.

Classification writes ``predictions.csv``: one row per image, DICOM frame or NIfTI slice with the
probability and the decision of every class (:func:`decision_thresholds`). Segmentation writes the
masks on the source's grid (PNG at the source size; NIfTI with the source's affine and shape) and
``lesions.csv``: one row per file with the lesion count (connected components) and volume.
"""
from __future__ import annotations

import csv
import os
import sys
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from fedpartial.data.types import SEGMENTATION, SINGLE_LABEL, DataError
from fedpartial_tools.model.cases import Case, Input, InputError, dicom_cases, image_cases, nifti_cases, servable
from fedpartial_tools.model.decisions import decide, decision_thresholds, threshold_source, threshold_words

PREDICTIONS_CSV = "predictions.csv"
LESIONS_CSV = "lesions.csv"
MASKS_DIR = "masks"


# ---- lesions --------------------------------------------------------------------------------------
def lesion_stats(mask: np.ndarray, voxel_mm3: Optional[float] = None, connectivity: int = 1) -> Dict:
    """Lesions of one binary mask (a 2D image or a 3D volume).

    Args:
        mask: ``> 0`` = lesion.
        voxel_mm3: the volume of one voxel (pixel) in mm³, None when unknown.
        connectivity: ``scipy.ndimage.generate_binary_structure`` rank: 1 = face neighbours (4 in
            2D, 6 in 3D; the counts of ``../shared/data/README.md``), ``mask.ndim`` = all.

    Returns:
        ``{"lesion_count", "lesion_voxels", "voxel_volume_mm3", "lesion_volume_mm3"}`` (the mm³
        values None when ``voxel_mm3`` is).
    """
    from scipy import ndimage

    mask = np.asarray(mask) > 0
    _, count = ndimage.label(mask, structure=ndimage.generate_binary_structure(mask.ndim, connectivity))
    voxels = int(mask.sum())
    return {"lesion_count": int(count), "lesion_voxels": voxels, "voxel_volume_mm3": voxel_mm3,
            "lesion_volume_mm3": None if voxel_mm3 is None else voxels * float(voxel_mm3)}


# ---- prediction -----------------------------------------------------------------------------------
def _forward(model, images: List[np.ndarray], meta: Mapping, device, batch_size: int):
    """Probabilities of a batch of uint8 images: classification ``(N, C)``, segmentation a list of
    ``(H, W)`` foreground maps at each image's own size."""
    import torch
    import torch.nn.functional as F

    from fedpartial.data.transforms import resize_images
    from fedpartial.models.io import model_input_size
    from fedpartial.training.common import images_to_tensor, predict, probabilities

    size = model_input_size(meta)
    norm = meta["normalisation"]
    segmentation = meta["task"] == SEGMENTATION
    out: list = [None] * len(images)
    # one forward pass per input shape: a model without input_size sees every image at its own size
    shapes: Dict[tuple, List[int]] = {}
    for i, image in enumerate(images):
        shapes.setdefault(image.shape, []).append(i)
    for shape, rows in shapes.items():
        stack = np.stack([images[i] for i in rows])
        x = images_to_tensor(resize_images(stack, size) if size else stack, norm["mean"], norm["std"])
        logits = predict(model, x, device, batch_size=batch_size)
        if segmentation:
            probs = torch.sigmoid(logits[:, :1])
            if tuple(probs.shape[-2:]) != tuple(shape[:2]):
                # probabilities, not masks, are upsampled so the boundary is placed at native detail (as evaluate)
                probs = F.interpolate(probs, size=tuple(shape[:2]), mode="bilinear", align_corners=False)
            for i, p in zip(rows, probs[:, 0].numpy()):
                out[i] = p
        else:
            for i, p in zip(rows, probabilities(logits, meta["task"]).numpy()):
                out[i] = p
    return out


class _Writer:
    """Writes each finished case: classification rows, or a segmentation mask and its lesion row."""

    def __init__(self, out_dir: str, meta: Mapping, thresholds: np.ndarray, connectivity: int):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.meta, self.thresholds, self.connectivity = out_dir, meta, thresholds, connectivity
        self.segmentation = meta["task"] == SEGMENTATION
        names = [str(c) for c in meta["class_names"]]
        if self.segmentation:
            self.path = os.path.join(out_dir, LESIONS_CSV)
            header = ["file", "patient_id", "slices", "lesion_count", "lesion_voxels", "voxel_volume_mm3",
                      "lesion_volume_mm3", "mask"]
        else:
            self.path = os.path.join(out_dir, PREDICTIONS_CSV)
            header = (["file", "frame", "patient_id"] + (["predicted"] if meta["task"] == SINGLE_LABEL else [])
                      + [f"prob_{n}" for n in names] + [f"decision_{n}" for n in names])
        self.names = names
        self.handle = open(self.path, "w", newline="")
        self.csv = csv.writer(self.handle)
        self.csv.writerow(header)

    def close(self):
        self.handle.close()

    def write(self, case: Case) -> None:
        if self.segmentation:
            self._write_mask(case)
        else:
            probs = np.stack(case.results)
            decisions = decide(probs, self.thresholds)
            for frame, p, d in zip(case.frame_ids, probs, decisions):
                predicted = [self.names[int(p.argmax())]] if self.meta["task"] == SINGLE_LABEL else []
                self.csv.writerow([case.name, frame, case.patient_id, *predicted, *(f"{v:.6f}" for v in p),
                                   *(int(v) for v in d)])
        self.handle.flush()

    def _write_mask(self, case: Case) -> None:
        if case.grid is not None:
            from fedpartial.data.grid import back_to_source

            # probabilities, not masks, go back through the resampling (as the upsampling of _forward)
            source = back_to_source(np.stack(case.results), case.grid)
            masks = np.moveaxis(source, case.axis, 0) > float(self.thresholds[0])
        else:
            masks = np.stack(case.results) > float(self.thresholds[0])  # the evaluate rule: probability > threshold
        stem = case.name
        for suffix in (".nii.gz", ".nii", ".dcm", ".png", ".jpg", ".jpeg"):
            if stem.lower().endswith(suffix):
                stem = stem[: -len(suffix)]
                break
        target = os.path.join(self.out_dir, MASKS_DIR, stem + "_mask")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if case.kind == "nifti":
            import nibabel as nib

            volume = np.moveaxis(masks, 0, case.axis).astype(np.uint8).reshape(case.shape)  # back on the source grid
            image = nib.Nifti1Image(volume, case.affine, header=case.header)
            image.set_data_dtype(np.uint8)
            image.header.set_slope_inter(1, 0)
            written = target + ".nii.gz"
            nib.save(image, written)
            stats = lesion_stats(volume, case.voxel_mm3, self.connectivity)
        else:
            from PIL import Image

            files = []
            for frame, mask in zip(case.frame_ids, masks):
                files.append(target + (f"_{frame}" if frame else "") + ".png")
                Image.fromarray(mask.astype(np.uint8) * 255).save(files[-1])
            written = files[0] if len(files) == 1 else os.path.dirname(files[0])
            stats = lesion_stats(masks[0] if len(masks) == 1 else masks, case.voxel_mm3, self.connectivity)
        mm = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
        self.csv.writerow([case.name, case.patient_id, len(masks), stats["lesion_count"], stats["lesion_voxels"],
                           mm(stats["voxel_volume_mm3"]), mm(stats["lesion_volume_mm3"]),
                           os.path.relpath(written, self.out_dir)])


def predict_inputs(model, meta: Mapping, inputs: Iterable[Input], out_dir: str, device="cpu",
                   batch_size: int = 64, threshold: Optional[float] = None, connectivity: int = 1,
                   progress: Optional[Callable[[str], None]] = None,
                   on_error: Optional[Callable[[str], None]] = None) -> Dict:
    """Predict every input, batch by batch, and write the outputs into ``out_dir``.

    Args:
        model: the model (``x -> (features, logits)``) on ``device``, in eval mode.
        meta: its model file meta (``task``, ``class_names``, ``input_size``, ``normalisation``,
            ``spec``).
        inputs: :class:`Case` / :class:`InputError` items (:func:`dicom_cases`,
            :func:`image_cases`, :func:`nifti_cases`).
        out_dir: output folder: ``predictions.csv`` (classification) or ``lesions.csv`` and
            ``masks/`` (segmentation).
        device: torch device.
        batch_size: images per forward pass.
        threshold: one decision threshold for every class (None: :func:`decision_thresholds`).
        connectivity: lesion connectivity of :func:`lesion_stats`.
        progress: called with a line after each batch.
        on_error: called with the one-line message of each input that cannot be served.

    Returns:
        ``{"output", "files", "images", "errors": [messages], "thresholds", "threshold_source",
        "decision_rule"}`` (``decision_rule``: the thresholds in plain words).
    """
    thresholds = decision_thresholds(meta, threshold)
    in_channels = int((meta.get("spec") or {}).get("in_channels") or 1)
    writer: Optional[_Writer] = None  # opened at the first batch: a run that predicts nothing writes nothing
    errors: List[str] = []
    done = {"files": 0, "images": 0, "batches": 0}
    pending: List[Tuple[Case, int]] = []

    def fail(message: str) -> None:
        message = " ".join(str(message).split())  # one line, whatever the reader's message held
        errors.append(message)
        if on_error:
            on_error(message)

    def flush() -> None:
        nonlocal writer
        if not pending:
            return
        writer = writer or _Writer(out_dir, meta, thresholds, connectivity)
        probs = _forward(model, [case.images[i] for case, i in pending], meta, device, batch_size)
        finished = []
        for (case, i), p in zip(pending, probs):
            case.results[i] = p
            if i == len(case.images) - 1:
                finished.append(case)
        for case in finished:
            writer.write(case)
            case.images, case.results = None, []  # free the volume once written
        done["files"] += len(finished)
        done["images"] += len(pending)
        done["batches"] += 1
        pending.clear()
        if progress:
            progress(f"batch {done['batches']}: {done['images']} image(s) of {done['files']} file(s) predicted, "
                     f"{len(errors)} error(s)")

    try:
        for item in inputs:
            if isinstance(item, InputError):
                fail(str(item))
                continue
            reason = servable(item, in_channels)
            if reason:
                fail(reason)
                continue
            for i in range(len(item.images)):
                pending.append((item, i))
                if len(pending) >= batch_size:
                    flush()
        flush()
    finally:
        if writer is not None:
            writer.close()
    return {"output": writer.path if writer else None, "files": done["files"], "images": done["images"],
            "errors": errors, "thresholds": thresholds.tolist(), "threshold_source": threshold_source(meta, threshold),
            "decision_rule": threshold_words(meta, thresholds, threshold)}


def readme_text(model_path: str, meta: Mapping, result: Mapping) -> str:
    """``README.txt`` beside the predictions: what the file holds and how each decision was made, in
    words a clinician reads without the model card."""
    import datetime

    names = ", ".join(str(c) for c in meta["class_names"])
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    if meta["task"] == SEGMENTATION:
        files = (f"{LESIONS_CSV}: one row per input file: the number of lesions (connected regions the model "
                 f"marks) and their volume; masks/: each file's lesion mask on its own grid.")
    else:
        files = (f"{PREDICTIONS_CSV}: one row per image (a DICOM frame or NIfTI slice per row): prob_<class> is the "
                 f"model's probability (0 to 1), decision_<class> is 1 when the class is reported present"
                 + (", predicted the class with the highest probability" if meta["task"] == SINGLE_LABEL else "")
                 + ".")
    return (f"Predictions of {os.path.abspath(model_path)} ({meta['task']}: {names}), written {when} by "
            f"python -m fedpartial predict.\n\n{files}\n\n{result['decision_rule']}\n\n"
            f"These are a model's outputs for review by a clinician, not a diagnosis.\n")


# ---- command line ---------------------------------------------------------------------------------
def _cmd_predict(args) -> None:
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import select_device

    device = select_device(args.device)
    model, meta = load_model_file(args.model, device=device)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.kind == "dicom":
        window = args.window
        if window is None:
            say("note: the model file does not record the DICOM window of its training data; each file's own "
                "window is used: pass --window as given to 'import dicom' if it was given there")
        inputs = dicom_cases(args.folder, window, args.modality, args.files)
    elif args.kind == "images":
        inputs = image_cases(args.folder, args.files)
    else:
        inputs = nifti_cases(args.images, args.axis, meta.get("input_agreement"))
    if args.kind != "nifti" and meta.get("input_agreement"):
        say("note: the model records an input agreement (orientation, spacing, intensity of NIfTI volumes); "
            f"{args.kind} inputs are only resized to its input_size")
    result = predict_inputs(model, meta, inputs, args.out, device, args.batch_size, args.threshold,
                            progress=say, on_error=lambda line: say(f"error: {line}"))
    if not result["images"]:
        raise DataError(f"no input could be predicted ({len(result['errors'])} error(s), listed above)")
    what = "lesions per file and masks" if meta["task"] == SEGMENTATION else "probabilities and decisions"
    readme = os.path.join(os.path.dirname(result["output"]), "README.txt")
    with open(readme, "w") as f:
        f.write(readme_text(args.model, meta, result))
    print(f"{result['images']} image(s) of {result['files']} file(s) predicted -> {result['output']} ({what}); "
          f"{readme} says how to read it. {result['decision_rule']}")
    if result["errors"]:
        say(f"{len(result['errors'])} input(s) could not be predicted (listed above)")
        raise SystemExit(1)


def add_predict_parser(subparsers) -> None:
    """Register ``predict {dicom,images,nifti}`` on the CLI's sub-parsers.

    Args:
        subparsers: the ``add_subparsers()`` object of ``python -m fedpartial``.
    """
    import argparse

    s = subparsers.add_parser("predict", help="a model file on a site's own DICOM / PNG-JPEG / NIfTI images: a CSV "
                                              "of probabilities and decisions, or masks and lesion counts",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = s.add_subparsers(dest="kind", required=True)

    def common(p):
        p.add_argument("--model", required=True, help="a fedpartial model file (global_model.pt)")
        p.add_argument("--out", required=True, help="output folder")
        p.add_argument("--threshold", type=float, default=None,
                       help="decision threshold for every class (default: the model file's decision_thresholds, "
                            "else 0.5 multi-label and segmentation, argmax single-label)")
        p.add_argument("--batch-size", type=int, default=64)
        p.add_argument("--device", default="auto")
        p.set_defaults(func=_cmd_predict)

    p = kinds.add_parser("dicom", help="every DICOM file under a folder (multi-frame: one row per frame)")
    common(p)
    p.add_argument("--folder", required=True)
    p.add_argument("--files", default=None, help="CSV naming the files to predict (a 'file' column, optional "
                                                 "'patient_id'; e.g. the import manifest, labels ignored)")
    p.add_argument("--window", default=None, help="the window given to 'import dicom': brain | lung | soft-tissue | "
                                                  "abdomen | bone | CENTRE,WIDTH (default: each file's own window)")
    p.add_argument("--modality", default=None, help="the DICOM Modality every file must have, e.g. CT (default: "
                                                    "the first file's)")

    p = kinds.add_parser("images", help="every PNG / JPEG image under a folder")
    common(p)
    p.add_argument("--folder", required=True)
    p.add_argument("--files", default=None, help="CSV naming the images to predict (an id column as for import, "
                                                 "optional 'patient_id')")

    p = kinds.add_parser("nifti", help="NIfTI volumes, sliced as at import; segmentation masks come back as NIfTI")
    common(p)
    p.add_argument("--images", required=True, help="folder or glob of the volumes")
    p.add_argument("--axis", type=int, default=None, choices=[0, 1, 2],
                   help="slicing axis (as given to import; default 2, or the slice_axis of the model's input "
                        "agreement, which is then applied to each volume and undone for its mask)")
