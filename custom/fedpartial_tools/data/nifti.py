"""NIfTI volumes + lesion masks (MONAI's NibabelReader), sliced into 2D images (MS lesion data
comes this way).

Pairs come from :func:`pair_nifti_files` (two folders or globs, matched by file name) or
:func:`read_pairs_csv` (``image,mask[,split]`` rows); :func:`load_nifti_pairs` slices them.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.grid import AGREEMENT_KEY, InputAgreement, to_agreed_grid
from fedpartial.data.types import SEGMENTATION, DataError, Dataset, Split
from fedpartial_tools.data.images import check_finite, read_csv_table

# Largest difference of two affines (mm, or direction cosines) still read as one voxel grid: float32
# storage in the NIfTI header rounds at about 1e-5 mm.
AFFINE_TOLERANCE = 1e-3


def _load_volume(path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(float32 voxels, the 4x4 voxel-to-world affine) of one NIfTI file."""
    # the reader itself, not LoadImage: LoadImage builds every reader MONAI has, and the DICOM one
    # warns about nvImageCodec at each call
    from monai.data import NibabelReader

    reader = NibabelReader()
    try:
        image = reader.read(path)
        voxels, meta = reader.get_data(image)
        voxels = np.asarray(voxels, dtype=np.float32)  # the dtype LoadImage gives
    except Exception as e:  # nibabel raises many types for a truncated / non-NIfTI file
        raise DataError(f"NIfTI file '{path}' is unreadable ({type(e).__name__}: {e})") from e
    check_finite(voxels, f"NIfTI file '{path}'", ("i", "j", "k", "t"))
    return voxels, np.asarray(meta["original_affine"], dtype=np.float64)


def _squeeze(volume: np.ndarray) -> np.ndarray:
    """Drop trailing length-1 axes (a 4D (X, Y, Z, 1) volume is a 3D one)."""
    while volume.ndim > 3 and volume.shape[-1] == 1:
        volume = volume[..., 0]
    return volume


def _to_uint8(volume: np.ndarray) -> np.ndarray:
    """Per-volume intensity scaling: the 0.5 and 99.5 percentiles map to 0 and 255 (clipped), so a
    few extreme voxels do not squash the contrast."""
    low, high = np.percentile(volume, [0.5, 99.5])
    return np.round(np.clip((volume - low) / max(high - low, 1e-6), 0, 1) * 255).astype(np.uint8)


NIFTI_SUFFIXES = (".nii.gz", ".nii")
# Endings that tell a mask's file name from its image's (case-insensitive): "p1_mask" pairs with "p1".
_MASK_ENDINGS = re.compile(r"[_\-.](mask|masks|seg|segmentation|label|labels|lesion|lesions|gt|roi)$", re.I)


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in NIFTI_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def nifti_files(spec: str) -> List[str]:
    """The ``.nii`` / ``.nii.gz`` files of a folder, or the files a glob pattern matches, sorted.

    Args:
        spec: a folder or a glob pattern (``masks/*_seg.nii.gz``).
    """
    if os.path.isdir(spec):
        files = [os.path.join(spec, f) for f in os.listdir(spec) if f.lower().endswith(NIFTI_SUFFIXES)]
    else:
        files = [f for f in glob.glob(spec) if os.path.isfile(f)]
    if not files:
        raise DataError(f"no NIfTI file (.nii / .nii.gz) in '{spec}'")
    return sorted(files)


def pair_nifti_files(images: str, masks: str) -> Tuple[List[str], List[str], List[str]]:
    """Match image volumes with their masks by file name: the same name, or the mask's name ending
    in ``_mask``, ``_seg``, ``_label``, ``_lesion``, ``_gt``... (``p1.nii.gz`` <-> ``p1_seg.nii.gz``).

    Args:
        images: folder or glob of the image volumes.
        masks: folder or glob of the masks.

    Returns:
        (image paths, mask paths, patient names = the image file names without extension).

    Raises:
        DataError: naming every image without a mask, mask without an image, or ambiguous name.
    """
    image_files, mask_files = nifti_files(images), nifti_files(masks)
    if os.path.abspath(images) == os.path.abspath(masks):
        # one folder holding both: the masks are the files whose name carries a mask ending
        mask_files = [f for f in image_files if _MASK_ENDINGS.search(_stem(f))]
        image_files = [f for f in image_files if f not in mask_files]
    by_name: Dict[str, str] = {}
    for f in mask_files:
        key = _MASK_ENDINGS.sub("", _stem(f))
        if key in by_name:
            raise DataError(f"masks '{by_name[key]}' and '{f}' both match image name '{key}'")
        by_name[key] = f
    pairs, lonely = [], []
    for f in image_files:
        key = _stem(f) if _stem(f) in by_name else _MASK_ENDINGS.sub("", _stem(f))
        if key in by_name:
            pairs.append((f, by_name.pop(key), _stem(f)))
        else:
            lonely.append(f)
    if lonely or by_name:
        raise DataError(f"cannot pair NIfTI images '{images}' with masks '{masks}': images without a mask "
                        f"{lonely}, masks without an image {sorted(by_name.values())} (a mask is named like its "
                        f"image, optionally ending in _mask / _seg / _label / _lesion / _gt)")
    return [p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]


def read_pairs_csv(pairs_csv: str) -> Tuple[List[str], List[str], List[str], List[str]]:
    """Read ``image,mask[,split]`` rows (paths relative to the CSV's folder).

    Args:
        pairs_csv: the CSV (header row ``image,mask`` and optionally ``split``).

    Returns:
        (image paths, mask paths, splits, patient names).

    Raises:
        DataError: naming the CSV, line and column of a missing file, bad split or repeated image,
            and the CSV for what :func:`fedpartial_tools.data.images.read_csv_table` refuses.
    """
    root = os.path.dirname(os.path.abspath(pairs_csv))
    columns, rows = read_csv_table(pairs_csv, "pairs CSV")
    if not {"image", "mask"} <= set(columns):
        raise DataError(f"pairs CSV '{pairs_csv}' needs columns 'image' and 'mask' (has {columns})")
    if not rows:
        raise DataError(f"pairs CSV '{pairs_csv}' lists no volumes")
    images, masks, splits, names, seen = [], [], [], [], {}
    for line, row in rows:
        where = f"pairs CSV '{pairs_csv}' line {line}"
        for column in ("image", "mask"):
            path = os.path.join(root, row[column])
            if not row[column] or not os.path.isfile(path):
                raise DataError(f"{where}, column '{column}': file '{path}' not found")
        if row["image"] in seen:
            raise DataError(f"pairs CSV '{pairs_csv}': image '{row['image']}' is listed twice, on lines "
                            f"{seen[row['image']]} and {line}")
        seen[row["image"]] = line
        split = row.get("split") or "train"
        if split not in ("train", "val", "test"):
            raise DataError(f"{where}, column 'split': '{split}' is not train, val or test")
        images.append(os.path.join(root, row["image"]))
        masks.append(os.path.join(root, row["mask"]))
        splits.append(split)
        names.append(_stem(row["image"]))
    return images, masks, splits, names


def load_nifti_pairs(image_paths: Sequence[str], mask_paths: Sequence[str], axis: int = 2,
                     size: Optional[Sequence[int]] = None, keep_empty_slices: bool = True,
                     splits: Optional[Sequence[str]] = None, patient_ids: Optional[Sequence[str]] = None,
                     agreement: Optional[InputAgreement] = None) -> Dataset:
    """Slice NIfTI volumes and their masks into a 2D segmentation dataset.

    Args:
        image_paths: one volume per patient.
        mask_paths: the matching lesion masks (> 0 = lesion).
        axis: slicing axis (of the stored array; with ``agreement``, of the agreed orientation,
            and it must be the agreement's ``slice_axis``).
        size: resize slices to (H, W) (bilinear images, nearest masks); not with ``agreement``,
            which sets the size.
        keep_empty_slices: keep slices without lesions.
        splits: per volume, the split it belongs to (default: all ``train``).
        patient_ids: per volume, a name used in the slice ids (``name:slice``) and as the group;
            default the volume's index.
        agreement: the federation's input agreement (:mod:`fedpartial.data.grid`): each volume
            and its mask are brought to the agreed orientation, spacing, size and intensity scale
            before slicing, and ``info["input_agreement"]`` records it. None: slices at the stored
            grid, intensities by the volume's 0.5 / 99.5 percentiles.

    Raises:
        DataError: naming both files when an image and its mask differ in shape or affine, or
            the file that is unreadable or holds NaN / Inf voxels; ``size`` or another ``axis``
            given with an agreement.
    """
    image_paths, mask_paths = [str(p) for p in image_paths], [str(p) for p in mask_paths]
    if len(image_paths) != len(mask_paths):
        raise DataError(f"{len(image_paths)} image volumes but {len(mask_paths)} masks")
    splits = list(splits or ["train"] * len(image_paths))
    if len(splits) != len(image_paths):
        raise DataError(f"{len(splits)} split names for {len(image_paths)} volumes")
    for path, split in zip(image_paths, splits):
        if split not in ("train", "val", "test"):
            raise DataError(f"volume '{path}': split '{split}' is not train, val or test")
    names = list(patient_ids) if patient_ids is not None else list(range(len(image_paths)))
    if len(names) != len(image_paths):
        raise DataError(f"{len(names)} patient ids for {len(image_paths)} volumes")
    if size is not None and np.isscalar(size):
        size = (int(size), int(size))
    if agreement is not None:
        if size:
            raise DataError(f"size {tuple(size)} and an input agreement both set the slice size; the agreement's is "
                            f"{list(agreement.size)}: leave size out")
        if axis % 3 != agreement.slice_axis:
            raise DataError(f"slicing axis {axis} differs from the input agreement's slice_axis "
                            f"{agreement.slice_axis} (an axis of its orientation {agreement.orientation})")
    parts: Dict[str, Dict[str, list]] = {}
    for patient, (img_path, mask_path, split) in enumerate(zip(image_paths, mask_paths, splits)):
        (image, image_affine), (mask, mask_affine) = _load_volume(img_path), _load_volume(mask_path)
        image, mask = _squeeze(image), _squeeze(mask)
        if image.shape != mask.shape:
            raise DataError(f"image '{img_path}' has shape {image.shape} but mask '{mask_path}' has {mask.shape}")
        gap = float(np.abs(image_affine - mask_affine).max())
        if gap > AFFINE_TOLERANCE:
            raise DataError(f"image '{img_path}' and mask '{mask_path}' have different affines (voxel-to-world; "
                            f"entries differ by up to {gap:.4g}): image {np.round(image_affine, 4).tolist()}, mask "
                            f"{np.round(mask_affine, 4).tolist()}; the mask does not lie on its image's voxel grid")
        if image.ndim != 3 or not -3 <= axis < 3:
            raise DataError(f"image '{img_path}' has shape {image.shape}; expected a 3D volume sliced along axis "
                            f"0, 1 or 2 (got axis={axis})")
        if agreement is not None:
            image, mask, _ = to_agreed_grid(image, image_affine, agreement, mask, where=f"NIfTI file '{img_path}'")
        else:
            image = np.moveaxis(_to_uint8(image), axis, 0)
            mask = np.moveaxis((mask > 0).astype(np.uint8), axis, 0)
        if size and tuple(image.shape[1:3]) != tuple(size):  # per volume, so volumes of any size mix
            from fedpartial.data.transforms import resize_dataset

            resized = resize_dataset(Dataset(SEGMENTATION, ["lesion"], {"v": Split(image, mask)}), size).splits["v"]
            image, mask = resized.images, resized.labels
        for index, (im, m) in enumerate(zip(image, mask)):
            if not keep_empty_slices and not m.any():
                continue
            entry = parts.setdefault(split, {"images": [], "masks": [], "ids": [], "groups": []})
            entry["images"].append(im)
            entry["masks"].append(m)
            entry["ids"].append(f"{names[patient]}:{index}")
            entry["groups"].append(names[patient])
    out = {}
    shapes = {im.shape for e in parts.values() for im in e["images"]}
    if len(shapes) > 1:
        raise DataError(f"slices of {image_paths} differ in size {sorted(shapes)}; pass size=(H, W)")
    for name, e in parts.items():
        images, masks = np.stack(e["images"]), np.stack(e["masks"])
        out[name] = Split(images, masks, None, np.array(e["ids"]), np.array(e["groups"]))
    if not out:
        raise DataError(f"no slices in {image_paths} (check 'splits' and keep_empty_slices)")
    info = {} if agreement is None else {AGREEMENT_KEY: agreement.to_dict()}
    return Dataset(SEGMENTATION, ["lesion"], out, source=",".join(image_paths), info=info)
