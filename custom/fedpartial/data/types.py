"""In-memory data containers shared by readers, partitioners, executors and tests.

Every reader returns a :class:`Dataset`; every site file loads back into one. Labels are
always stored multi-hot ``(N, C)`` for classification (single-label data becomes one-hot), so
that one ``label_mask`` of the same shape says which (sample, class) entries a site has
annotated. A 0 in ``labels`` never means "missing" by itself: only ``label_mask`` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

SINGLE_LABEL = "single-label"
MULTI_LABEL = "multi-label"
SEGMENTATION = "segmentation"
TASKS = (SINGLE_LABEL, MULTI_LABEL, SEGMENTATION)


class DataError(ValueError):
    """Bad input data. The message names the file, site, key or class at fault."""


@dataclass
class Split:
    """One split (train / val / test) of a dataset.

    Attributes:
        images: uint8 ``(N, H, W)`` grey or ``(N, H, W, 3)`` RGB.
        labels: classification: float32 multi-hot ``(N, C)``; segmentation: int ``(N, H, W)``
            masks (0 = background; class ids or instance ids).
        label_mask: classification only: bool ``(N, C)``, True where the entry is annotated.
            Segmentation masks are always "annotated" pixel-wise (missing lesions are simply 0).
        ids: optional per-sample ids (image ids); ``groups`` optional patient / lesion ids used
            to keep a patient on one site.
    """

    images: np.ndarray
    labels: np.ndarray
    label_mask: Optional[np.ndarray] = None
    ids: Optional[np.ndarray] = None
    groups: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, index: np.ndarray) -> "Split":
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        return Split(self.images[index], self.labels[index], pick(self.label_mask), pick(self.ids), pick(self.groups))


@dataclass
class Dataset:
    """A dataset (whole source file, or one site's file).

    Attributes:
        task: one of ``single-label``, ``multi-label``, ``segmentation``.
        class_names: C names (classification) or foreground class names (segmentation).
        splits: ``{"train": Split, "val": Split, "test": Split}`` as present.
        source: the file it came from (used in error messages).
        site: site name when this is a site file, else None.
        info: extra JSON-able facts (scenario, annotated classes, labelled flag, completeness...).
    """

    task: str
    class_names: List[str]
    splits: Dict[str, Split]
    source: str = ""
    site: Optional[str] = None
    info: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def is_segmentation(self) -> bool:
        return self.task == SEGMENTATION

    def where(self) -> str:
        return f"site '{self.site}' ({self.source})" if self.site else f"'{self.source}'"
