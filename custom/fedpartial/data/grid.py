"""The federation's agreed input grid: one voxel spacing, slice size, orientation and intensity
scale that every site brings its volumes to before slicing, so that a model trained on several
scanners sees one kind of input.

The agreement is a small JSON (``provisioning/input_agreement.json``; :class:`InputAgreement`):

    {"spacing_mm": [1.0, 1.0], "size": [192, 224], "orientation": "RAS", "slice_axis": 2,
     "intensity": {"rule": "median", "of": "above_mean", "target": 128.0}}

It is recorded where it was applied (a site file's ``info["input_agreement"]``, a model file's
``meta["input_agreement"]``), and :func:`agreement_differences` names what two records disagree on.

The transforms are plain functions on numpy arrays with MONAI's spatial transforms (Orientation,
Spacing, ResizeWithPadOrCrop, SpatialResample) underneath; MONAI's Orientation needs nibabel,
which the tooling that reads NIfTI has. Parsing and comparing agreements needs neither.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.types import DataError

#: where an agreement is recorded: a site file's info, a source file's info_json, a model file's meta
AGREEMENT_KEY = "input_agreement"
INTENSITY_RULES = ("median", "percentiles")
#: which voxels of a volume set its intensity scale
INTENSITY_VOXELS = ("above_mean", "nonzero", "all")
_WORLD_AXIS = {"R": 0, "L": 0, "A": 1, "P": 1, "S": 2, "I": 2}  # which world axis an axis code runs along
_LABELS = (("L", "R"), ("P", "A"), ("I", "S"))  # nibabel's axis codes: a code names where an index increases to
_RULE_KEYS = {"median": ("rule", "of", "target"), "percentiles": ("rule", "of", "lower", "upper")}


@dataclass(frozen=True)
class IntensityRule:
    """How one volume's intensities become 0..255 (per volume, never per slice).

    Attributes:
        rule: ``median``: scale so that the median of the chosen voxels lands on ``target``
            (MRI magnitude has no offset: 0 stays 0, and a lesion's ratio to the tissue is kept);
            ``percentiles``: the ``lower`` / ``upper`` percentiles of the chosen voxels become 0 / 255.
            Both clip to 0..255.
        of: the voxels that set the scale: ``above_mean`` (those brighter than the volume's mean:
            the head or brain without the air around it, with or without skull stripping),
            ``nonzero`` (skull-stripped data whose background is exactly 0) or ``all``.
        target: ``median`` rule: the grey level of the median. 128 leaves FLAIR lesions, 1.3-1.5
            times as bright as the tissue in both MS sources, room below 255.
        lower, upper: ``percentiles`` rule: percentiles (0..100) mapped to 0 and 255.
    """

    rule: str = "median"
    of: str = "above_mean"
    target: float = 128.0
    lower: float = 0.5
    upper: float = 99.5

    def to_dict(self) -> Dict[str, Any]:
        """The fields of this rule only (the other rule's fields mean nothing here)."""
        return {k: getattr(self, k) for k in _RULE_KEYS[self.rule]}


@dataclass(frozen=True)
class InputAgreement:
    """What every site's input looks like before the model sees it.

    Attributes:
        spacing_mm: in-plane pixel size (rows, columns) of the slices in mm. Default 1 x 1: the
            coarser of the two MS sources (1 mm MNI; ISBI is 0.83 mm), so no source is upsampled
            into detail it never had, and the grid of MNI space.
        size: slice size (rows, columns) in pixels after cropping / padding about the centre.
            Default 192 x 224 (192 x 224 mm at 1 mm): holds the whole MNI field (182 x 218 mm)
            and the ISBI head (about 160 x 205 mm of its 212 x 212 mm field), and both sides
            divide by 32, so a UNet's five halvings stay whole.
        orientation: axis codes of the volume before slicing (nibabel's: the direction each
            index increases to). Default ``RAS``, the NIfTI world convention MONAI uses.
        slice_axis: the axis of ``orientation`` the slices are cut along. Default 2 (S: axial
            slices, how both MS sources were acquired). The slice thickness is kept as acquired:
            interpolating across 3-4.4 mm slices would draw lesions no scanner saw.
        intensity: the per-volume intensity rule (:class:`IntensityRule`). Default the median of
            the above-mean voxels at grey level 128: measured on the two MS sources, the 0.5 / 99.5
            percentiles of the nonzero voxels put the brain of the skull-on ISBI scans at 84 and
            that of the skull-stripped MNI ones at 175; the median rule puts them at 120 and 127
            (docs/SMALL_LESIONS.md, "A common input for the federation").
    """

    spacing_mm: Tuple[float, float] = (1.0, 1.0)
    size: Tuple[int, int] = (192, 224)
    orientation: str = "RAS"
    slice_axis: int = 2
    intensity: IntensityRule = field(default_factory=IntensityRule)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (what is recorded and compared)."""
        return {"spacing_mm": [float(s) for s in self.spacing_mm], "size": [int(s) for s in self.size],
                "orientation": self.orientation, "slice_axis": int(self.slice_axis),
                "intensity": self.intensity.to_dict()}

    @property
    def in_plane_axes(self) -> Tuple[int, int]:
        """The two axes of ``orientation`` that are a slice's rows and columns."""
        rows, cols = (a for a in range(3) if a != self.slice_axis)
        return rows, cols

    @classmethod
    def from_dict(cls, value: Mapping, where: str = "input agreement") -> "InputAgreement":
        """Check and read an agreement; a missing field takes its default.

        Args:
            value: the JSON object.
            where: names the file or setting in error messages.

        Raises:
            DataError: naming ``where`` and the key of an unknown field or a bad value.
        """
        if isinstance(value, InputAgreement):
            return value
        if not isinstance(value, Mapping):
            raise DataError(f"{where}: an input agreement is a JSON object, got {type(value).__name__} {value!r}")
        known = ("spacing_mm", "size", "orientation", "slice_axis", "intensity")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise DataError(f"{where}: unknown key(s) {unknown}; an input agreement has {list(known)}")
        default = cls()
        spacing = _pair(value.get("spacing_mm", default.spacing_mm), float, f"{where}: 'spacing_mm'")
        size = _pair(value.get("size", default.size), int, f"{where}: 'size'")
        orientation = check_axcodes(value.get("orientation", default.orientation), f"{where}: 'orientation'")
        axis = value.get("slice_axis", default.slice_axis)
        if isinstance(axis, bool) or axis not in (0, 1, 2):
            raise DataError(f"{where}: 'slice_axis' {axis!r} is not 0, 1 or 2 (an axis of the orientation)")
        intensity = _intensity(value.get("intensity", {}), f"{where}: 'intensity'")
        return cls(spacing, size, orientation, int(axis), intensity)


def _pair(value, kind, where: str) -> tuple:
    values = [value, value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        out = tuple(kind(v) for v in values)
        ok = len(out) == 2 and all(v > 0 for v in out) and all(kind(v) == v for v in values)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        what = "mm" if kind is float else "whole pixels"
        raise DataError(f"{where} is {value!r}; expected [rows, columns], two positive numbers ({what})")
    return out


def _intensity(value, where: str) -> IntensityRule:
    if not isinstance(value, Mapping):
        raise DataError(f"{where} is {value!r}; expected an object such as {IntensityRule().to_dict()}")
    rule = value.get("rule", IntensityRule.rule)
    if rule not in INTENSITY_RULES:
        raise DataError(f"{where}: 'rule' {rule!r} is not one of {list(INTENSITY_RULES)}")
    unknown = sorted(set(value) - set(_RULE_KEYS[rule]))
    if unknown:
        raise DataError(f"{where}: key(s) {unknown} do not belong to rule '{rule}' (it has {list(_RULE_KEYS[rule])})")
    of = value.get("of", IntensityRule.of)
    if of not in INTENSITY_VOXELS:
        raise DataError(f"{where}: 'of' {of!r} is not one of {list(INTENSITY_VOXELS)}")
    numbers = {}
    for key in _RULE_KEYS[rule][2:]:
        raw = value.get(key, getattr(IntensityRule, key))
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise DataError(f"{where}: '{key}' {raw!r} is not a number")
        numbers[key] = float(raw)
    if rule == "median" and not 0 < numbers["target"] <= 255:
        raise DataError(f"{where}: 'target' {numbers['target']} is not a grey level in (0, 255]")
    if rule == "percentiles" and not 0 <= numbers["lower"] < numbers["upper"] <= 100:
        raise DataError(f"{where}: percentiles 'lower' {numbers['lower']} and 'upper' {numbers['upper']} must "
                        f"satisfy 0 <= lower < upper <= 100")
    return IntensityRule(rule, of, **numbers)


def check_axcodes(codes, where: str) -> str:
    """``codes`` upper-cased when it names each of the x (R/L), y (A/P) and z (S/I) axes once.

    Raises:
        DataError: naming ``where`` otherwise.
    """
    text = str(codes).upper() if isinstance(codes, str) else ""
    if len(text) != 3 or any(c not in _WORLD_AXIS for c in text) or len({_WORLD_AXIS[c] for c in text}) != 3:
        raise DataError(f"{where} is {codes!r}; expected three axis codes naming R/L, A/P and S/I once each "
                        f"(the direction each index increases to), e.g. 'RAS' or 'LPS'")
    return text


def load_agreement(path: str) -> InputAgreement:
    """Read an agreement JSON file.

    Args:
        path: the ``.json``.

    Raises:
        DataError: naming the file when it is missing, not JSON or not an agreement.
    """
    if not os.path.isfile(path):
        raise DataError(f"input agreement file '{path}' not found")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"input agreement file '{path}' is not readable JSON ({e})") from e
    return InputAgreement.from_dict(value, f"input agreement file '{path}'")


def agreement_from(value, where: str) -> Optional[InputAgreement]:
    """None for None; an :class:`InputAgreement` for an agreement or its JSON object.

    Args:
        value: None, a dict or an :class:`InputAgreement`.
        where: names the setting or file in error messages.
    """
    return None if value is None else InputAgreement.from_dict(value, where)


def _flat(value, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def agreement_differences(ours: InputAgreement, theirs: InputAgreement) -> List[Tuple[str, Any, Any]]:
    """The fields two agreements set differently, as ``(field, ours, theirs)``; nested fields are
    dotted (``intensity.rule``); a field only one side's rule has counts as different."""
    a, b = _flat(ours.to_dict()), _flat(theirs.to_dict())
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# ---- intensity --------------------------------------------------------------------------------
def normalise_intensity(volume: np.ndarray, rule: IntensityRule, where: str = "volume") -> np.ndarray:
    """One volume's intensities on 0..255 (float32, clipped), by one scale for the whole volume.

    MONAI's ScaleIntensityRangePercentiles takes its percentiles over every voxel; the rule's
    ``of`` chooses the voxels here, so a background of air does not set the scale.

    Args:
        volume: a whole volume (any shape; a patient's slices stacked).
        rule: the agreement's intensity rule.
        where: names the volume in error messages.

    Raises:
        DataError: naming ``where`` when no voxel is chosen, or the median rule meets a median <= 0.
    """
    v = np.asarray(volume, dtype=np.float32)
    if rule.of == "above_mean":
        chosen = v[v > v.mean(dtype=np.float64)]
    elif rule.of == "nonzero":
        chosen = v[v != 0]
    else:
        chosen = v.ravel()
    if chosen.size == 0:
        raise DataError(f"{where}: no voxel is {rule.of.replace('_', ' ')} (a constant volume?), so the intensity "
                        f"rule has nothing to scale by")
    if rule.rule == "median":
        median = float(np.median(chosen))
        if median <= 0:
            raise DataError(f"{where}: the median of the {rule.of.replace('_', ' ')} voxels is {median:g}; the "
                            f"'median' rule needs positive intensities (use the 'percentiles' rule)")
        out = v * np.float32(rule.target / median)
    else:
        low, high = np.percentile(chosen, [rule.lower, rule.upper])
        out = (v - np.float32(low)) * np.float32(255.0 / max(float(high - low), 1e-6))
    return np.clip(out, 0, 255, out=out)


# ---- geometry ---------------------------------------------------------------------------------
@dataclass
class AgreedGrid:
    """Where a volume came from and where it went: enough to put a result back on the source grid.

    Attributes:
        source_affine: 4x4 voxel-to-world affine of the source volume (mm).
        source_shape: its 3D shape.
        affine: the agreed grid's affine (after orientation, spacing and crop / pad).
        shape: the agreed grid's 3D shape.
        slice_axis: the agreed grid's slicing axis.
    """

    source_affine: np.ndarray
    source_shape: Tuple[int, int, int]
    affine: np.ndarray
    shape: Tuple[int, int, int]
    slice_axis: int


def stack_affine(axcodes: str, spacing_mm: Sequence[float], slice_mm: float = 1.0) -> np.ndarray:
    """A voxel-to-world affine for a stack without one: rows, columns, slices along ``axcodes``.

    Args:
        axcodes: the directions rows, columns and slices (in slice order) increase to, e.g. ``LAS``.
        spacing_mm: in-plane pixel size (rows, columns).
        slice_mm: distance of the slices (kept as it is by the agreement, so only its sign matters).
    """
    codes = check_axcodes(axcodes, "source orientation")
    affine = np.eye(4)
    affine[:3, :3] = 0
    for axis, (code, step) in enumerate(zip(codes, (*spacing_mm, slice_mm))):
        affine[_WORLD_AXIS[code], axis] = step if code in "RAS" else -step
    return affine


def _resample(volume: np.ndarray, affine: np.ndarray, agreement: InputAgreement, mode: str):
    """Orientation, then in-plane spacing (slice thickness kept), then centre crop / pad."""
    import torch
    from monai.data import MetaTensor
    from monai.transforms import Orientation, ResizeWithPadOrCrop, Spacing

    pixdim = [-1.0] * 3  # MONAI keeps the spacing of an axis given as <= 0
    size = [-1] * 3  # and the length of an axis given as -1
    for axis, mm, n in zip(agreement.in_plane_axes, agreement.spacing_mm, agreement.size):
        pixdim[axis], size[axis] = float(mm), int(n)
    x = MetaTensor(torch.as_tensor(np.ascontiguousarray(volume, dtype=np.float32))[None],
                   affine=torch.as_tensor(np.asarray(affine, dtype=np.float64)))
    x = Orientation(axcodes=agreement.orientation, labels=_LABELS)(x)
    x = Spacing(pixdim=pixdim, mode=mode, padding_mode="zeros")(x)
    x = ResizeWithPadOrCrop(spatial_size=size, mode="constant")(x)
    return x[0].numpy(), np.asarray(x.affine, dtype=np.float64)


def to_agreed_grid(image: np.ndarray, affine: np.ndarray, agreement: InputAgreement,
                   mask: Optional[np.ndarray] = None, where: str = "volume"):
    """Bring one 3D volume (and its lesion mask) onto the agreed grid and cut it into slices.

    Steps: intensity per volume on the native voxels (:func:`normalise_intensity`); MONAI
    Orientation to ``agreement.orientation``; Spacing to ``agreement.spacing_mm`` in-plane
    (bilinear for the image, nearest for the mask; the slice axis keeps its thickness);
    ResizeWithPadOrCrop to ``agreement.size`` about the centre (padding 0); slices along
    ``agreement.slice_axis``.

    Args:
        image: 3D volume.
        affine: its 4x4 voxel-to-world affine (mm).
        agreement: the agreement.
        mask: optional lesion mask on the image's grid (> 0 = lesion).
        where: names the volume in error messages.

    Returns:
        ``(uint8 slices (S, H, W), uint8 0/1 mask slices or None, AgreedGrid)`` with
        ``(H, W) == agreement.size``.
    """
    image = np.asarray(image)
    if image.ndim != 3:
        raise DataError(f"{where} has shape {image.shape}; the agreed grid needs a 3D volume")
    if mask is not None and np.shape(mask) != image.shape:
        raise DataError(f"{where}: mask shape {np.shape(mask)} differs from the image's {image.shape}")
    scaled = normalise_intensity(image, agreement.intensity, where)
    grid_image, grid_affine = _resample(scaled, affine, agreement, "bilinear")
    slices = np.moveaxis(np.clip(np.rint(grid_image), 0, 255).astype(np.uint8), agreement.slice_axis, 0)
    grid = AgreedGrid(np.asarray(affine, dtype=np.float64), tuple(int(s) for s in image.shape), grid_affine,
                      tuple(int(s) for s in grid_image.shape), agreement.slice_axis)
    mask_slices = None if mask is None else mask_to_agreed_grid(mask, affine, agreement)
    return np.ascontiguousarray(slices), mask_slices, grid


def mask_to_agreed_grid(mask: np.ndarray, affine: np.ndarray, agreement: InputAgreement) -> np.ndarray:
    """A lesion mask's slices on the agreed grid (nearest neighbour, so no lesion is half a lesion).

    Args:
        mask: 3D mask (> 0 = lesion) on the grid of ``affine``.
        affine: its 4x4 voxel-to-world affine (mm).
        agreement: the agreement.

    Returns:
        uint8 0/1 ``(S, H, W)``, the slices :func:`to_agreed_grid` cuts from the image.
    """
    grid_mask, _ = _resample((np.asarray(mask) > 0).astype(np.float32), affine, agreement, "nearest")
    return np.ascontiguousarray(np.moveaxis((grid_mask > 0.5).astype(np.uint8), agreement.slice_axis, 0))


def slice_order_flips(source_axcodes: str, agreement: InputAgreement) -> bool:
    """Whether the agreed orientation reverses the slice order of a stack whose slices run along
    ``source_axcodes[2]`` (e.g. ``I`` against an agreement's ``S``).

    Raises:
        DataError: the stack's slices run along another world axis than the agreement's slice axis
            (axial slices cannot become sagittal ones).
    """
    code = check_axcodes(source_axcodes, "source orientation")[2]
    agreed = agreement.orientation[agreement.slice_axis]
    if _WORLD_AXIS[code] != _WORLD_AXIS[agreed]:
        raise DataError(f"the source's slices run along {code} but the input agreement slices along {agreed} (axis "
                        f"{agreement.slice_axis} of {agreement.orientation}); 2D slices cannot be cut in another plane")
    return code != agreed


def back_to_source(slices: np.ndarray, grid: AgreedGrid) -> np.ndarray:
    """Put per-slice results on the agreed grid (e.g. lesion probabilities) back on the source
    volume's grid: the inverse of resampling, orientation and crop / pad, by MONAI's
    SpatialResample (bilinear) from the agreed grid's affine to the source's. Source voxels
    outside the agreed field of view (cropped away) get 0.

    Args:
        slices: ``(S, H, W)`` float values on the agreed grid (as :func:`to_agreed_grid` cut them).
        grid: the :class:`AgreedGrid` of that volume.

    Returns:
        float32 volume of ``grid.source_shape``.
    """
    import torch
    from monai.data import MetaTensor
    from monai.transforms import SpatialResample

    volume = np.moveaxis(np.asarray(slices, dtype=np.float32), 0, grid.slice_axis)
    if volume.shape != tuple(grid.shape):
        raise DataError(f"results of shape {volume.shape} do not fit the agreed grid {tuple(grid.shape)}")
    x = MetaTensor(torch.as_tensor(np.ascontiguousarray(volume))[None], affine=torch.as_tensor(grid.affine))
    out = SpatialResample(mode="bilinear", padding_mode="zeros")(
        x, dst_affine=torch.as_tensor(grid.source_affine), spatial_size=tuple(grid.source_shape))
    return np.asarray(out[0].numpy(), dtype=np.float32)
