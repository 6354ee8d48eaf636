"""Segmentation scored at the images' own size rather than the model's: a held-out patient of
harmonised sources on its native grid (the agreement's inverse, MS), and the images of any other file
at the file's size (the model's probabilities upsampled, DSB2018's 256 px masks never resized).
"""
from __future__ import annotations

from typing import Dict

import numpy as np


def native_scorer(info: dict, scored, where: str):
    """A function of the scored split's lesion probabilities giving the pooled Dice on the held-out
    patient's native grid (:func:`fedpartial_tools.data.combine.dice_pooled_native`), for a file of
    :func:`fedpartial_tools.data.combine.hold_out_patient`; None for any other file.

    Args:
        info: the scored file's info (``native`` and ``input_agreement``).
        scored: its test split (row ids = patient id * ROW_ID_BASE + slice id, slice-id order).
        where: the scored file, for messages.

    Raises:
        DataError: naming the files when the split's rows are not the native file's slices of the
            patient, in slice-id order.
    """
    from fedpartial.data.grid import AGREEMENT_KEY, InputAgreement
    from fedpartial.data.types import DataError
    from fedpartial_tools.data.combine import NATIVE_KEY, ROW_ID_BASE, dice_pooled_native, native_patient

    native = (info or {}).get(NATIVE_KEY)
    if not native:
        return None
    agreement = InputAgreement.from_dict(info.get(AGREEMENT_KEY), f"'{where}' info_json '{AGREEMENT_KEY}'")
    images, masks, slice_ids = native_patient(native["path"], native["patient"])
    expected = (int(native["patient"]) * ROW_ID_BASE + slice_ids).tolist()
    got = [] if scored.ids is None else [int(i) for i in np.asarray(scored.ids).tolist()]
    if got != expected:
        raise DataError(f"'{where}': the test rows (test_image_ids) are not the slices of patient {native['patient']} "
                        f"of '{native['path']}' in slice-id order; the native scores need them one for one")
    return lambda probs: dice_pooled_native(probs, images, masks, native["spacing_mm"], native["orientation"],
                                            agreement)


def own_size_metrics(probs: np.ndarray, split, threshold: float = 0.5) -> Dict[str, float]:
    """``dice_native`` / ``iou_native``: the per-image mean Dice / IoU (an image empty in both truth
    and prediction scores 1, as the bench's ``dice`` / ``iou``) of ``probs`` upsampled (bilinear, the
    probabilities, not thresholded masks) to the size of ``split``'s masks, against those masks as
    the file holds them.

    Args:
        probs: ``(N, h, w)`` foreground probabilities at the model's size.
        split: the scored split at the file's own size (``labels``: ``(N, H, W)`` masks, > 0 = lesion).
        threshold: a pixel is foreground where the upsampled probability is above it.
    """
    import torch
    import torch.nn.functional as F

    from fedpartial.metrics import segmentation_metrics

    masks = np.asarray(split.labels) > 0
    p = torch.as_tensor(np.asarray(probs, dtype=np.float32))[:, None]
    if tuple(p.shape[-2:]) != masks.shape[1:]:
        p = F.interpolate(p, size=masks.shape[1:], mode="bilinear", align_corners=False)
    scores = segmentation_metrics(p[:, 0].numpy() > threshold, masks)
    return {"dice_native": scores["dice"], "iou_native": scores["iou"]}
