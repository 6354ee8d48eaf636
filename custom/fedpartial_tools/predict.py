"""``python -m fedpartial predict {dicom,images,nifti}``: a model file on a site's own images,
without labels.

The inputs are those ``import`` reads (:mod:`fedpartial_tools.dicom`, :mod:`fedpartial_tools.images`,
:mod:`fedpartial_tools.nifti`, whose readers are used here): a DICOM folder, a PNG / JPEG folder, or
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
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from fedpartial.data.types import SEGMENTATION, SINGLE_LABEL, DataError

PREDICTIONS_CSV = "predictions.csv"
LESIONS_CSV = "lesions.csv"
MASKS_DIR = "masks"


# ---- decisions ------------------------------------------------------------------------------------
def decision_thresholds(meta: Mapping, override: Optional[float] = None) -> np.ndarray:
    """The decision threshold of each output class of a model.

    In order: ``override`` for every class; else the model file's ``meta["decision_thresholds"]``
    (``{"thresholds": {class name: value}, "rule", "source"}``) for the classes it lists; else 0.5
    (multi-label, segmentation) or NaN = argmax (single-label).

    Args:
        meta: the model file's meta (``task``, ``class_names``, optionally ``spec`` and
            ``decision_thresholds``).
        override: one threshold in [0, 1] for every class (``--threshold``), or None.

    Returns:
        float ``(C,)``, C = the model's outputs (1 for segmentation); NaN marks a class decided
        by argmax (see :func:`decide`).

    Raises:
        ValueError: ``override`` or a stored threshold outside [0, 1], a malformed
            ``decision_thresholds`` or one naming a class the model does not have.
    """
    names = [str(c) for c in meta["class_names"]]
    segmentation = meta["task"] == SEGMENTATION
    outputs = int((meta.get("spec") or {}).get("num_classes") or (1 if segmentation else len(names)))
    names = names[:outputs]
    if override is not None:
        value = float(override)
        if not 0.0 <= value <= 1.0:  # "not <=": NaN fails too
            raise ValueError(f"--threshold {override} is not a probability in [0, 1]")
        return np.full(outputs, value)
    out = np.full(outputs, np.nan if meta["task"] == SINGLE_LABEL else 0.5)
    stored = meta.get("decision_thresholds")
    if stored is None:
        return out
    if not isinstance(stored, Mapping) or not isinstance(stored.get("thresholds"), Mapping):
        raise ValueError(f"model meta 'decision_thresholds' must be {{'thresholds': {{class: value}}, 'rule', "
                         f"'source'}}, got {stored!r}")
    unknown = sorted(set(stored["thresholds"]) - set(names))
    if unknown:
        raise ValueError(f"model meta 'decision_thresholds' names class(es) {unknown} the model does not have "
                         f"({names})")
    for c, name in enumerate(names):
        value = stored["thresholds"].get(name)
        if value is None:  # a class left uncalibrated keeps the default
            continue
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"model meta 'decision_thresholds' gives class '{name}' threshold {value}, not a "
                             f"probability in [0, 1]")
        out[c] = value
    return out


def threshold_source(meta: Mapping, override: Optional[float] = None) -> str:
    """Where :func:`decision_thresholds` took its values from, in words (for the summary)."""
    if override is not None:
        return f"--threshold {float(override):g} for every class"
    stored = meta.get("decision_thresholds")
    if stored:
        # the source may list every class's counts: its first clause says which validation it is
        source = str(stored.get("source", "?")).split(";")[0]
        return f"the model file's decision_thresholds (rule {stored.get('rule', '?')}; {source})"
    return "argmax (single-label)" if meta["task"] == SINGLE_LABEL else "0.5 (the default)"


def decide(probs: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Per-class decisions: ``probs >= threshold``; a NaN threshold decides by argmax (the class is
    positive where it has the largest probability of the row).

    Args:
        probs: ``(N, C)`` probabilities.
        thresholds: ``(C,)`` from :func:`decision_thresholds`.

    Returns:
        bool ``(N, C)``.
    """
    probs, thresholds = np.asarray(probs, dtype=np.float64), np.asarray(thresholds, dtype=np.float64)
    by_argmax = np.isnan(thresholds)
    out = probs >= np.where(by_argmax, np.inf, thresholds)
    if by_argmax.any() and len(probs):
        top = np.zeros(probs.shape, bool)
        top[np.arange(len(probs)), probs.argmax(axis=1)] = True
        out[:, by_argmax] = top[:, by_argmax]
    return out


# ---- lesions --------------------------------------------------------------------------------------
def voxel_volume(affine: np.ndarray) -> float:
    """mm³ of one voxel: ``|det|`` of the affine's 3x3 part (NIfTI affines are in mm)."""
    return float(abs(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3])))


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


# ---- inputs ---------------------------------------------------------------------------------------
@dataclass
class Case:
    """One input file and its 2D images (one, a DICOM file's frames or a volume's slices).

    Attributes:
        path: the file.
        name: its name in the outputs (relative to the input folder).
        images: uint8 ``(F, H, W)`` grey or ``(F, H, W, 3)`` RGB.
        kind: ``dicom``, ``images`` or ``nifti``.
        patient_id: from the DICOM header or the file list; "" when unknown.
        voxel_mm3: the volume of one voxel in mm³ where the file says it, else None.
        frame_ids: per image, its frame / slice index ("" for a single image).
        affine, shape, axis, header: NIfTI only: the source grid the mask is written back on.
        grid: NIfTI with the model's input agreement: the volume's
            :class:`fedpartial.data.grid.AgreedGrid`, to put the slices' probabilities back on
            the source grid; None when the slices are the stored array's.
        results: per image, its prediction, filled batch by batch.
    """

    path: str
    name: str
    images: np.ndarray
    kind: str
    patient_id: str = ""
    voxel_mm3: Optional[float] = None
    frame_ids: List[str] = field(default_factory=list)
    affine: Optional[np.ndarray] = None
    shape: Optional[Tuple[int, ...]] = None
    axis: int = 2
    header: object = None
    grid: object = None
    results: list = field(default_factory=list)

    def __post_init__(self):
        if not self.frame_ids:
            self.frame_ids = [""] if len(self.images) == 1 else [str(i) for i in range(len(self.images))]
        self.results = [None] * len(self.images)


class InputError(DataError):
    """One input the model cannot serve; the message names the file."""


Input = Union[Case, InputError]


def _walk(folder: str, keep: Callable[[str], bool]) -> List[str]:
    if not os.path.isdir(folder):
        raise DataError(f"input folder '{folder}' not found")
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if not f.startswith(".") and keep(os.path.join(root, f))]
    return sorted(found)


def _file_list(list_csv: str) -> List[Tuple[int, str, str]]:
    """(line, id, patient id) of each row of a CSV with an id column (an import manifest: its
    label columns are ignored)."""
    from fedpartial_tools.images import ID_COLUMNS, PATIENT_COLUMNS, read_csv_table

    columns, rows = read_csv_table(list_csv, "file list")
    id_column = next((c for c in ID_COLUMNS if c in columns), None)
    if id_column is None:
        raise DataError(f"file list '{list_csv}' has no id column (one of {list(ID_COLUMNS)}; has {columns})")
    patient_column = next((c for c in PATIENT_COLUMNS if c in columns), None)
    return [(line, row[id_column], row[patient_column] if patient_column else "") for line, row in rows]


def dicom_cases(folder: str, window=None, modality: Optional[str] = None,
                list_csv: Optional[str] = None) -> Iterator[Input]:
    """The DICOM files of ``folder`` (every file under it that is DICOM or ends in ``.dcm``, or the
    files ``list_csv`` names), read as ``import dicom`` reads them.

    Args:
        folder: the folder.
        window: as ``import dicom --window``: a preset, ``"C,W"`` or None (each file's own window).
        modality: the DICOM Modality every file must have (e.g. ``CT``); None = the first file's.
        list_csv: a CSV with a ``file`` column (and ``patient_id``), e.g. the import manifest.

    Yields:
        a :class:`Case` per file, or an :class:`InputError` for a file that is unreadable or of
        another modality.
    """
    from pydicom.misc import is_dicom

    from fedpartial_tools.dicom import _read_dicom, parse_window

    window = parse_window(window)
    if list_csv:
        listed = [(os.path.join(folder, file), patient) for _, file, patient in _file_list(list_csv)]
    else:
        listed = [(p, "") for p in _walk(folder, lambda p: p.lower().endswith(".dcm") or is_dicom(p))]
        if not listed:
            raise DataError(f"no DICOM file in '{folder}'")
    expected = modality
    for path, patient in listed:
        if not os.path.isfile(path):
            yield InputError(f"DICOM file '{path}' not found")
            continue
        try:
            frames, ds = _read_dicom(path, window)
        except DataError as e:
            yield InputError(str(e))
            continue
        found = str(getattr(ds, "Modality", "") or "").strip()
        if expected and found and found != expected:
            yield InputError(f"DICOM file '{path}' is {found}, not {expected} "
                             f"({'--modality' if modality else 'the modality of the first file'}); "
                             f"predict one modality at a time")
            continue
        expected = expected or found
        spacing = [float(v) for v in getattr(ds, "PixelSpacing", []) or []]
        depth = getattr(ds, "SpacingBetweenSlices", None) or getattr(ds, "SliceThickness", None)
        voxel = spacing[0] * spacing[1] * float(depth) if len(spacing) == 2 and depth else None
        yield Case(path, os.path.relpath(path, folder), frames, "dicom",
                   patient or str(getattr(ds, "PatientID", "") or ""), voxel)


def image_cases(folder: str, list_csv: Optional[str] = None) -> Iterator[Input]:
    """The PNG / JPEG files of ``folder`` (recursively, or those ``list_csv`` names), read as
    ``import images`` reads them (:func:`fedpartial_tools.images.image_to_uint8`).

    Yields:
        a :class:`Case` per image, or an :class:`InputError` for an unreadable or missing one.
    """
    from fedpartial_tools.images import IMAGE_EXTENSIONS, image_to_uint8, resolve_image

    if list_csv:
        listed = []
        for line, image_id, patient in _file_list(list_csv):
            try:
                listed.append((resolve_image(folder, image_id, f"file list '{list_csv}' line {line}"), patient))
            except DataError as e:
                listed.append((e, patient))
    else:
        listed = [(p, "") for p in _walk(folder, lambda p: p.endswith(IMAGE_EXTENSIONS))]
        if not listed:
            raise DataError(f"no PNG / JPEG image in '{folder}'")
    for path, patient in listed:
        if isinstance(path, DataError):
            yield InputError(str(path))
            continue
        try:
            image = image_to_uint8(path)
        except DataError as e:
            yield InputError(str(e))
            continue
        yield Case(path, os.path.relpath(path, folder), image[None], "images", patient)


def nifti_cases(images: str, axis: Optional[int] = None, agreement=None) -> Iterator[Input]:
    """The NIfTI volumes of a folder or glob, sliced as ``import nifti`` slices them.

    Args:
        images: folder or glob of the volumes.
        axis: slicing axis (default 2; with ``agreement`` its ``slice_axis``, and no other).
        agreement: the model's input agreement (its meta's ``input_agreement``, a dict or a
            :class:`fedpartial.data.grid.InputAgreement`): each volume is brought to the agreed
            grid before slicing, and its case keeps the grid so its mask goes back to the source
            grid. None: the stored array's slices with the 0.5 / 99.5 percentile scaling.

    Yields:
        a :class:`Case` per volume (with its affine, shape and header), or an
        :class:`InputError` for an unreadable file or one that is not a 3D volume.

    Raises:
        DataError: an ``axis`` other than the agreement's slice axis.
    """
    import nibabel as nib

    from fedpartial.data.grid import agreement_from, to_agreed_grid
    from fedpartial_tools.nifti import _load_volume, _squeeze, _stem, _to_uint8, nifti_files

    agreement = agreement_from(agreement, "the model's input_agreement")
    if agreement is not None and axis is not None and axis % 3 != agreement.slice_axis:
        raise DataError(f"--axis {axis} differs from the model's input agreement, which slices along axis "
                        f"{agreement.slice_axis} of {agreement.orientation}; leave --axis out")
    axis = (agreement.slice_axis if agreement is not None else 2) if axis is None else axis
    for path in nifti_files(images):
        try:
            voxels, affine = _load_volume(path)
        except DataError as e:
            yield InputError(str(e))
            continue
        header = nib.load(path).header
        volume = _squeeze(voxels)
        if volume.ndim != 3:
            yield InputError(f"NIfTI file '{path}' has shape {tuple(voxels.shape)}; expected a 3D volume")
            continue
        grid = None
        if agreement is not None:
            try:
                slices, _, grid = to_agreed_grid(volume, affine, agreement, where=f"NIfTI file '{path}'")
            except DataError as e:
                yield InputError(str(e))
                continue
        else:
            slices = np.moveaxis(_to_uint8(volume), axis, 0)
        yield Case(path, os.path.basename(path), slices, "nifti", _stem(path), voxel_volume(affine),
                   [str(i) for i in range(len(slices))], affine, tuple(header.get_data_shape()), axis, header, grid)


def servable(case: Case, in_channels: int) -> Optional[str]:
    """Why the model cannot serve ``case`` (None if it can). An RGB image whose three channels are
    equal is a grey image (import reads it so), and is turned into one here.

    Args:
        case: the input (``images`` may be replaced by their grey copy).
        in_channels: the model's input channels (1 grey, 3 RGB).
    """
    channels = 1 if case.images.ndim == 3 else case.images.shape[-1]
    if channels == 3 and in_channels == 1:
        rgb = case.images
        if (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all():
            case.images = np.ascontiguousarray(rgb[..., 0])
            return None
    if channels != in_channels:
        what = {1: "grey (1 channel)", 3: "RGB (3 channels)"}
        return (f"{'DICOM file' if case.kind == 'dicom' else 'NIfTI file' if case.kind == 'nifti' else 'image'} "
                f"'{case.path}' is {what.get(channels, f'{channels} channels')} but the model takes "
                f"{what.get(in_channels, f'{in_channels} channels')} images")
    return None


# ---- prediction -----------------------------------------------------------------------------------
def _model_size(meta: Mapping) -> Optional[Tuple[int, int]]:
    size = tuple(int(s) for s in (meta.get("input_size") or (0, 0)))
    return size if len(size) == 2 and all(size) else None


def _forward(model, images: List[np.ndarray], meta: Mapping, device, batch_size: int):
    """Probabilities of a batch of uint8 images: classification ``(N, C)``, segmentation a list of
    ``(H, W)`` foreground maps at each image's own size."""
    import torch
    import torch.nn.functional as F

    from fedpartial.data.transforms import resize_images
    from fedpartial.training.common import images_to_tensor, predict, probabilities

    size = _model_size(meta)
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
        ``{"output", "files", "images", "errors": [messages], "thresholds", "threshold_source"}``.
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
            "errors": errors, "thresholds": thresholds.tolist(), "threshold_source": threshold_source(meta, threshold)}


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
    print(f"{result['images']} image(s) of {result['files']} file(s) predicted -> {result['output']} ({what}); "
          f"decision thresholds: {result['threshold_source']}")
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
