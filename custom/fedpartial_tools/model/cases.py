"""The inputs of ``predict``: a DICOM folder, a PNG / JPEG folder or file list, or NIfTI volumes read
into cases (a file and its 2D images) with the readers ``import`` uses, and whether the model can
serve each."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple, Union

import numpy as np

from fedpartial.data.types import DataError


def voxel_volume(affine: np.ndarray) -> float:
    """mm³ of one voxel: ``|det|`` of the affine's 3x3 part (NIfTI affines are in mm)."""
    return float(abs(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3])))


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
    from fedpartial_tools.data.images import ID_COLUMNS, PATIENT_COLUMNS, read_csv_table

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

    from fedpartial_tools.data.dicom import _read_dicom, parse_window

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
    ``import images`` reads them (:func:`fedpartial_tools.data.images.image_to_uint8`).

    Yields:
        a :class:`Case` per image, or an :class:`InputError` for an unreadable or missing one.
    """
    from fedpartial_tools.data.images import IMAGE_EXTENSIONS, image_to_uint8, resolve_image

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
    from fedpartial_tools.data.nifti import _load_volume, _squeeze, _stem, _to_uint8, nifti_files

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
