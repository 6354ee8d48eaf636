"""Losses shared by the methods, each as a function and as a ``torch.nn.Module`` (as MONAI's
losses are): the masked binary cross-entropy of partial multi-label annotations and the
softmax cross-entropy restricted to a site's annotated classes (the partial-class loss).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _check_same_shape(name: str, logits: torch.Tensor, other: torch.Tensor, what: str) -> None:
    if tuple(other.shape) != tuple(logits.shape):
        raise ValueError(f"{name}: {what} has shape {tuple(other.shape)}, the logits {tuple(logits.shape)}")


def masked_bce_with_logits(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                           pos_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean binary cross-entropy over the entries where ``mask`` is 1 (0 when none).

    Args:
        logits: ``(N, C)``.
        targets: ``(N, C)`` in [0, 1].
        mask: ``(N, C)`` 0/1 (or weights).
        pos_weight: optional ``(C,)`` weight of positives (class-weighted BCE).

    Raises:
        ValueError: when ``targets`` or ``mask`` is not the logits' shape, or ``pos_weight`` is
            not one value per class.
    """
    _check_same_shape("masked_bce_with_logits", logits, targets, "targets")
    _check_same_shape("masked_bce_with_logits", logits, mask, "mask")
    if pos_weight is not None and tuple(pos_weight.shape) != tuple(logits.shape[-1:]):
        raise ValueError(f"masked_bce_with_logits: pos_weight has shape {tuple(pos_weight.shape)}, expected "
                         f"{tuple(logits.shape[-1:])} (one per class)")
    loss = F.binary_cross_entropy_with_logits(logits, targets, reduction="none", pos_weight=pos_weight)
    mask = mask.to(loss.dtype)
    denom = mask.sum()
    return (loss * mask).sum() / denom.clamp_min(1.0)


def masked_cross_entropy(logits: torch.Tensor, target_index: torch.Tensor, class_mask: Optional[torch.Tensor] = None,
                         sample_weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """Softmax cross-entropy, optionally restricted to the classes where ``class_mask`` is 1
    (the others get -inf logits: the partial-class loss for single-label data).

    Args:
        logits: ``(N, C)``.
        target_index: ``(N,)`` class indices.
        class_mask: optional ``(N, C)`` or ``(C,)`` 0/1 of the classes the softmax runs over.
        sample_weight: optional ``(N,)`` weights (0 drops a sample); mean over weighted samples.
        label_smoothing: in [0, 1), as in ``torch.nn.functional.cross_entropy``.

    Raises:
        ValueError: on a ``target_index`` / ``sample_weight`` that is not one value per sample, or
            a ``label_smoothing`` outside [0, 1).
    """
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"masked_cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}")
    if tuple(target_index.shape) != tuple(logits.shape[:1]):
        raise ValueError(f"masked_cross_entropy: target_index has shape {tuple(target_index.shape)}, expected "
                         f"{tuple(logits.shape[:1])} (one class per sample)")
    if sample_weight is not None and tuple(sample_weight.shape) != tuple(logits.shape[:1]):
        raise ValueError(f"masked_cross_entropy: sample_weight has shape {tuple(sample_weight.shape)}, expected "
                         f"{tuple(logits.shape[:1])}")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    if class_mask is not None:
        logits = logits.masked_fill(class_mask.expand_as(logits) < 0.5, float("-inf"))
    loss = F.cross_entropy(logits, target_index, reduction="none", label_smoothing=label_smoothing)
    if sample_weight is None:
        return loss.mean()
    loss = torch.where(sample_weight > 0, loss, torch.zeros_like(loss))
    return (loss * sample_weight).sum() / sample_weight.sum().clamp_min(1e-8)


class MaskedBCEWithLogitsLoss(torch.nn.Module):
    """:func:`masked_bce_with_logits` as a module.

    Args:
        pos_weight: optional ``(C,)`` weight of positives.
    """

    def __init__(self, pos_weight: Optional[torch.Tensor] = None):
        super().__init__()
        self.pos_weight = pos_weight

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_bce_with_logits(logits, targets, mask, self.pos_weight)


class MaskedCrossEntropyLoss(torch.nn.Module):
    """:func:`masked_cross_entropy` as a module.

    Args:
        label_smoothing: in [0, 1).
    """

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"MaskedCrossEntropyLoss: label_smoothing must be in [0, 1), got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)

    def forward(self, logits: torch.Tensor, target_index: torch.Tensor, class_mask: Optional[torch.Tensor] = None,
                sample_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        return masked_cross_entropy(logits, target_index, class_mask, sample_weight, self.label_smoothing)
