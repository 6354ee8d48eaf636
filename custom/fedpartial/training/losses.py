"""Losses shared by the methods, each as a function and as a ``torch.nn.Module`` (as MONAI's
losses are): the masked binary cross-entropy of partial multi-label annotations and the
softmax cross-entropy restricted to a site's annotated classes (the partial-class loss); and the
multi-label imbalance handling that methods and baselines share: class-weighted BCE from annotated
counts (FedLSM) and logit adjustment by positive rates (FedMLP).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

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


# ---- multi-label imbalance handling (class weights, logit adjustment) ----------------------------
def class_statistics(labels: np.ndarray, label_mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Annotated positive and negative counts per class (``label_pos``, ``label_neg``)."""
    annotated = label_mask > 0.5
    positive = labels > 0.5
    return (annotated & positive).sum(axis=0).astype(np.float64), (annotated & ~positive).sum(axis=0).astype(np.float64)


def pos_weight_from_counts(label_pos, label_neg, max_pos_weight: Optional[float] = None) -> np.ndarray:
    """BCE positive weight #neg / #pos per class; 1 where a class has no annotated positive.

    Args:
        label_pos: ``(C,)`` annotated positives.
        label_neg: ``(C,)`` annotated negatives.
        max_pos_weight: optional cap (None = no cap, the paper's setting).
    """
    pos = np.asarray(label_pos, dtype=np.float64)
    neg = np.asarray(label_neg, dtype=np.float64)
    weight = np.where(pos > 0, neg / np.where(pos > 0, pos, 1.0), 1.0)
    weight = np.where(weight > 0, weight, 1.0)  # a class with no negative: no re-weighting
    return np.minimum(weight, max_pos_weight) if max_pos_weight else weight


def positive_rates(targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-class positive rate pi_c,1 among the entries where ``mask`` is 1 (0.5 = no
    adjustment for a class without any such entry).

    Args:
        targets: ``(N, C)`` 0/1.
        mask: ``(N, C)`` 0/1, the entries the loss uses (annotated + tagged).
    """
    mask = mask.float()
    count = mask.sum(0)
    pos = (targets.float() * mask).sum(0)
    return torch.where(count > 0, pos / count.clamp_min(1.0), torch.full_like(count, 0.5))


def logit_adjustment(pi_pos: torch.Tensor, tau: float = 1.0, eps: float = 1e-3) -> torch.Tensor:
    """Additive logit offset of the multi-label logit adjustment (paper Eq. 3).

    Eq. 3, p' = p*pi1 / (p*pi1 + (1-p)*pi0) with p = sigmoid(z), equals sigmoid(z + log(pi1/pi0));
    we use the logit form (numerically stable) and, as Eq. 2, a temperature ``tau`` (1 = Eq. 3).

    Args:
        pi_pos: ``(C,)`` positive rates pi_c,1 (pi_c,0 = 1 - pi_c,1).
        tau: strength of the adjustment (paper: 1).
        eps: rates are clipped to ``[eps, 1-eps]`` so a class with no local positive stays finite.
    """
    pi = pi_pos.clamp(eps, 1.0 - eps)
    return tau * (torch.log(pi) - torch.log1p(-pi))


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
