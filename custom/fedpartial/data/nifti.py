"""NIfTI volumes + lesion masks (MONAI's LoadImage, nibabel backend), sliced into 2D images
(MS lesion data comes this way)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from fedpartial.data.types import SEGMENTATION, DataError, Dataset, Split


def _load_volume(path: str) -> np.ndarray:
    from monai.transforms import LoadImage

    try:
        return np.asarray(LoadImage(image_only=True, reader="NibabelReader")(path))
    except Exception as e:  # nibabel raises many types for a truncated / non-NIfTI file
        raise DataError(f"NIfTI file '{path}' is unreadable ({type(e).__name__}: {e})") from e


def _to_uint8(volume: np.ndarray) -> np.ndarray:
    """Per-volume intensity scaling: the 0.5 and 99.5 percentiles map to 0 and 255 (clipped), so a
    few extreme voxels do not squash the contrast."""
    low, high = np.percentile(volume, [0.5, 99.5])
    return np.round(np.clip((volume - low) / max(high - low, 1e-6), 0, 1) * 255).astype(np.uint8)


def load_nifti_pairs(image_paths: Sequence[str], mask_paths: Sequence[str], axis: int = 2,
                     size: Optional[Sequence[int]] = None, keep_empty_slices: bool = True,
                     splits: Optional[Sequence[str]] = None) -> Dataset:
    """Slice NIfTI volumes and their masks into a 2D segmentation dataset.

    Args:
        image_paths: one volume per patient.
        mask_paths: the matching lesion masks (> 0 = lesion).
        axis: slicing axis.
        size: resize slices to (H, W) (bilinear images, nearest masks).
        keep_empty_slices: keep slices without lesions.
        splits: per volume, the split it belongs to (default: all ``train``).
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
    if size is not None and np.isscalar(size):
        size = (int(size), int(size))
    parts: Dict[str, Dict[str, list]] = {}
    for patient, (img_path, mask_path, split) in enumerate(zip(image_paths, mask_paths, splits)):
        image, mask = _load_volume(img_path), _load_volume(mask_path)
        if image.shape != mask.shape:
            raise DataError(f"image '{img_path}' has shape {image.shape} but mask '{mask_path}' has {mask.shape}")
        if image.ndim != 3 or not -3 <= axis < 3:
            raise DataError(f"image '{img_path}' has shape {image.shape}; expected a 3D volume sliced along axis "
                            f"0, 1 or 2 (got axis={axis})")
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
            entry["ids"].append(f"{patient}:{index}")
            entry["groups"].append(patient)
    out = {}
    shapes = {im.shape for e in parts.values() for im in e["images"]}
    if len(shapes) > 1:
        raise DataError(f"slices of {image_paths} differ in size {sorted(shapes)}; pass size=(H, W)")
    for name, e in parts.items():
        images, masks = np.stack(e["images"]), np.stack(e["masks"])
        out[name] = Split(images, masks, None, np.array(e["ids"]), np.array(e["groups"]))
    if "train" not in out:
        raise DataError("no training slices (check 'splits' and keep_empty_slices)")
    return Dataset(SEGMENTATION, ["lesion"], out, source=",".join(image_paths))
