"""FedIA (Xiang et al., MICCAI 2024): federated lesion segmentation when sites annotate only
part of their lesions (whole connected components missing, a different fraction per site).

Client (:class:`FedIAClient`), round ``r`` (0-based; the paper's round ``t = r + 1``):

1. warm-up, ``r < warmup_rounds`` (T = 10 MS / 40 lung): plain Dice-loss training; the site
   records its mean training loss ℓ_k and its IoU on its own train masks every round;
2. first round after warm-up (``r == warmup_rounds``): with the received warm-up model θ_T the
   site estimates its annotation completeness (eq. 3)
   ``â_k = Σ_i lesions(annotated mask_i) / Σ_i lesions(predicted mask_i)``, lesions = connected
   components counted **per 2D image** (``scipy.ndimage.label``, 8-connectivity by default; the
   reference code labels a whole shuffled batch as one 3D volume, which merges lesions across
   images), and fits ``IoU_k(t) ≈ l_k·t + b_k`` over the warm-up rounds (eq. 6, ``numpy.polyfit``);
3. after warm-up, when ``fitted IoU(t) - IoU(t) > λ`` (eq. 7, λ = 0.03) the site corrects its
   masks at the start of the next round with the received global model: pixels labelled 0 whose
   foreground probability exceeds 0.8 become 1 (never 1 -> 0; ``correction_rule="lesions"``, not
   in the paper: whole confident predicted lesions that touch no annotated one). Once, permanently, by default
   (the reference code); ``correct_repeatedly=True`` re-checks the trigger after a correction;
   ``retry_empty_correction=True`` (ours) does not count a correction that changed no pixel.
   Corrected masks live in ``ctx.state_dir`` as a memory-mapped ``.npy`` (written batch by batch,
   never held whole in memory); the site file is never modified.

Stats sent every round: ``mean_loss``, ``iou``, ``completeness`` (â_k; 1.0 until estimated),
``completeness_ready`` (0/1), ``corrected`` (0/1).

Server (:class:`FedIAServer`): data-size FedAvg during warm-up; afterwards completeness-aware
weights ``w_k = softmax_k(â_k / ℓ_k)`` (eq. 4), back to FedAvg once every site has corrected its
masks (the "last stage" of the paper's Fig. 2 and its reference code; switch
``fedavg_after_all_corrected``).

Guards (ours; each one is a constructor argument, and ``completeness_cap=None``,
``min_predicted_ratio=0``, ``max_weight_ratio=None`` give the paper's rule):

* the estimate waits for a model that finds lesions: â_k is taken only from a global model whose
  prediction holds at least ``min_predicted_ratio`` (0.5) times as many lesions as the site
  annotated. A model that has just marked its first few lesions would otherwise give â_k =
  annotated / (a handful), e.g. 77 on real MS lesions, and eq. 4's softmax hands that site all
  the weight;
* â_k is a fraction: it is kept in ``[completeness_floor, completeness_cap]`` = [1e-3, 1] (a model
  that under-segments or merges lesions predicts fewer lesions than are annotated, which says
  "complete", not "more than complete"); the server clips what it receives to the same range;
* no site's weight exceeds ``max_weight_ratio`` (2) times its share of the training images
  (:func:`cap_weights`); the excess goes to the other sites in proportion to their weights.

The weights, estimates and the rule used are logged per round in the server's metrics.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np
from scipy import ndimage

from fedpartial.algorithms.aggregation import average_weights
from fedpartial.algorithms.base import ClientContext, RoundInput, RoundResult, ServerContext, ServerRule, SiteUpdate
from fedpartial.algorithms.segmentation import MaskSource, SegmentationSupervisedClient, mask_chunks
from fedpartial.data.types import DataError

STATE_FILE = "fedia_state.json"
MASKS_FILE = "fedia_corrected_masks.npy"
#: where a correction pass writes before the new masks are adopted
NEXT_MASKS_FILE = "fedia_corrected_masks.next.npy"
STAT_KEYS = ("mean_loss", "iou", "completeness", "completeness_ready", "corrected")
#: the paper's rule without our guards (``--set`` these for the paper's weighting)
PAPER_CLIENT_GUARDS = {"completeness_cap": None, "min_predicted_ratio": 0.0}
PAPER_SERVER_GUARDS = {"completeness_max": None, "max_weight_ratio": None}
#: What the client rule sends in ``site_stats`` and what a site's privacy filter
#: (``fedpartial.flare.filters.StatisticsPrivacyFilter``) needs to guard it, by preset name
#: (the fields are described in ``fedpartial.algorithms.fedlsm.SENT_STATISTICS``). Site-level
#: scalars over the site's ``num_images`` training images; withheld = the values a site without
#: training images sends (neutral loss, completeness 1, not ready).
SENT_STATISTICS = {
    "fedia": {"keys": ["mean_loss", "iou", "completeness", "completeness_ready", "corrected", "num_images"],
              "signature": ["mean_loss", "iou", "completeness", "num_images"],
              "guards": {k: "num_images" for k in ("mean_loss", "iou", "completeness", "completeness_ready",
                                                   "corrected", "num_images")},
              "fill": {"mean_loss": 1.0, "iou": 0.0, "completeness": 1.0, "completeness_ready": 0.0,
                       "corrected": 0.0},
              "clip": {"mean_loss": [0, math.inf], "iou": [0, 1], "completeness": [1e-6, math.inf]}},
}
#: What the client rule returns in ``metrics`` (sent as ``site_metrics``) and when a site's result
#: policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
#: The completeness estimate, IoU trend and correction flags describe the site's training images
#: (as ``site_stats`` does, behind ``num_images``); pixel counts are counts.
SENT_METRICS = {
    "fedia": {"train_loss": "scope", "train_iou": "scope", "train_steps": "scope", "iou_trend": "scope",
              "correction_triggered": "scope", "corrected": "scope", "completeness": "scope",
              "corrected_pixels": "count", "corrected_pixels_total": "count",
              "corrected_precision": "rate:corrected_pixels_total", "corrected_recall_missing": "local",
              "true_completeness": "local"},
}


# ----------------------------------------------------------------------------- pure helpers
def connectivity_structure(connectivity: int) -> np.ndarray:
    """3x3 structuring element for ``scipy.ndimage.label``: 8 (diagonal neighbours join) or 4.

    Args:
        connectivity: 4 or 8.
    """
    if connectivity == 8:
        return np.ones((3, 3), dtype=bool)
    if connectivity == 4:
        return ndimage.generate_binary_structure(2, 1)
    raise ValueError(f"connectivity must be 4 or 8, got {connectivity}")


def count_lesions(masks: np.ndarray, connectivity: int = 8) -> np.ndarray:
    """Number of lesions (connected foreground components) in each 2D image.

    Args:
        masks: ``(H, W)`` or ``(N, H, W)``; any value > 0 is foreground.
        connectivity: 8 (default) or 4.

    Returns:
        int64 ``(N,)`` counts (``(1,)`` for one image). Images are labelled one by one, so a
        lesion never continues into the next image of the stack.
    """
    masks = np.asarray(masks)
    if masks.ndim == 2:
        masks = masks[None]
    if masks.ndim != 3:
        raise ValueError(f"count_lesions expects (H, W) or (N, H, W) masks, got shape {masks.shape}")
    structure = connectivity_structure(connectivity)
    return np.array([ndimage.label(m > 0, structure=structure)[1] for m in masks], dtype=np.int64)


def estimate_completeness(annotated: np.ndarray, predicted: np.ndarray, connectivity: int = 8
                          ) -> Tuple[Optional[float], int, int]:
    """FedIA eq. 3: â = Σ_i lesions(annotated_i) / Σ_i lesions(predicted_i), per-image counts.

    Args:
        annotated: ``(N, H, W)`` the site's (incomplete) masks.
        predicted: ``(N, H, W)`` binary predictions of the warm-up model.
        connectivity: 8 or 4.

    Returns:
        ``(completeness, annotated_lesions, predicted_lesions)``; completeness is None when the
        model predicts no lesion at all (no evidence either way).
    """
    if np.shape(annotated) != np.shape(predicted):
        raise ValueError(f"annotated shape {np.shape(annotated)} != predicted shape {np.shape(predicted)}")
    n_annotated = int(count_lesions(annotated, connectivity).sum())
    n_predicted = int(count_lesions(predicted, connectivity).sum())
    return completeness_ratio(n_annotated, n_predicted), n_annotated, n_predicted


def completeness_ratio(n_annotated: int, n_predicted: int) -> Optional[float]:
    """FedIA eq. 3 from lesion counts: ``n_annotated / n_predicted``; None when the model predicts
    no lesion at all (no evidence either way).

    Args:
        n_annotated: lesions in the site's masks.
        n_predicted: lesions in the model's binary predictions of the same images.
    """
    return None if n_predicted == 0 else n_annotated / n_predicted


def fit_iou_trend(rounds, ious) -> Tuple[float, float]:
    """Least-squares line ``IoU(t) ≈ slope * t + intercept`` (FedIA eq. 6).

    Args:
        rounds: round numbers t (the paper counts from 1).
        ious: IoU at those rounds.

    Raises:
        ValueError: fewer than 2 points, or lengths differ.
    """
    t, y = np.asarray(rounds, dtype=np.float64), np.asarray(ious, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"fit_iou_trend: rounds {t.shape} and ious {y.shape} must be 1-D of equal length")
    if len(np.unique(t)) < 2:
        raise ValueError(f"fit_iou_trend needs IoU at >= 2 distinct rounds, got {len(np.unique(t))}")
    slope, intercept = np.polyfit(t, y, 1)
    return float(slope), float(intercept)


def correction_triggered(slope: float, intercept: float, t: float, iou: float, margin: float = 0.03) -> bool:
    """FedIA eq. 7: correct when the fitted IoU at round ``t`` exceeds the actual IoU by more than ``margin``."""
    return (slope * t + intercept) - iou > margin


def correct_masks(masks: np.ndarray, foreground_prob: np.ndarray, threshold: float = 0.8) -> Tuple[np.ndarray, int]:
    """Turn background pixels the model is confident about into lesion: 0 -> 1 where
    ``prob > threshold``; a pixel labelled 1 always stays 1 (missing lesions are the only noise).

    Args:
        masks: uint8 0/1 ``(N, H, W)``.
        foreground_prob: ``(N, H, W)`` sigmoid probabilities.
        threshold: confidence above which a background pixel is flipped (paper: 0.8).

    Returns:
        ``(new_masks, pixels_changed)``; ``masks`` itself is not modified.
    """
    masks = np.asarray(masks)
    if masks.shape != np.shape(foreground_prob):
        raise ValueError(f"masks shape {masks.shape} != probability shape {np.shape(foreground_prob)}")
    flip = (masks == 0) & (np.asarray(foreground_prob) > threshold)
    new = masks.astype(np.uint8, copy=True)
    new[flip] = 1
    return new, int(flip.sum())


#: ``correction_rule`` choices: the paper's pixel rule, or whole missing lesions
CORRECTION_RULES = ("pixels", "lesions")


def correct_masks_lesionwise(masks: np.ndarray, foreground_prob: np.ndarray, threshold: float = 0.8,
                             prob_threshold: float = 0.5, connectivity: int = 8) -> Tuple[np.ndarray, int]:
    """Add whole lesions the annotator missed: each predicted lesion (a connected component of
    ``prob > prob_threshold`` in one 2D image) whose peak probability exceeds ``threshold`` and
    which touches no annotated lesion (not even diagonally) becomes lesion. Annotated lesions are
    never grown, so no rim is painted around them, and a confident lesion is added whole rather
    than as its most confident core. Labels 1 stay 1.

    Args:
        masks: uint8 0/1 ``(N, H, W)``.
        foreground_prob: ``(N, H, W)`` sigmoid probabilities.
        threshold: peak probability a predicted lesion needs to be added.
        prob_threshold: probability above which a pixel belongs to a predicted lesion.
        connectivity: 8 or 4, neighbourhood of a lesion.

    Returns:
        ``(new_masks, pixels_changed)``; ``masks`` itself is not modified.
    """
    masks = np.asarray(masks)
    prob = np.asarray(foreground_prob)
    if masks.shape != prob.shape:
        raise ValueError(f"masks shape {masks.shape} != probability shape {prob.shape}")
    if masks.ndim != 3:
        raise ValueError(f"correct_masks_lesionwise expects (N, H, W) masks, got shape {masks.shape}")
    structure = np.zeros((3, 3, 3), dtype=bool)
    structure[1] = connectivity_structure(connectivity)  # components never cross to the next image
    labels, n = ndimage.label(prob > prob_threshold, structure=structure)
    new = masks.astype(np.uint8, copy=True)
    if n == 0:
        return new, 0
    ids = np.arange(1, n + 1)
    peaks = ndimage.maximum(prob, labels, index=ids)
    touching = np.zeros(n + 1, dtype=bool)
    touching[np.unique(labels[ndimage.binary_dilation(masks > 0, structure=structure)])] = True
    add = np.zeros(n + 1, dtype=bool)
    add[1:] = (np.asarray(peaks) > threshold) & ~touching[1:]
    flip = add[labels] & (new == 0)
    new[flip] = 1
    return new, int(flip.sum())


def completeness_aware_weights(completeness, losses, loss_floor: float = 1e-6) -> np.ndarray:
    """FedIA eq. 4: ``w_k = softmax_k(â_k / ℓ_k)``.

    Args:
        completeness: â_k per site (> 0).
        losses: ℓ_k, each site's mean training loss this round (>= 0; raised to ``loss_floor``).
        loss_floor: smallest loss used, so a perfect fit does not divide by 0.

    Example: â = (0.5, 1.0), ℓ = (0.5, 0.5) -> softmax(1, 2) = (0.2689, 0.7311).
    """
    a = np.asarray(completeness, dtype=np.float64)
    loss = np.maximum(np.asarray(losses, dtype=np.float64), loss_floor)
    if a.shape != loss.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"completeness {a.shape} and losses {loss.shape} must be 1-D of equal, non-zero length")
    z = a / loss
    z = np.exp(z - z.max())  # shift for stability: softmax is unchanged
    return z / z.sum()


def cap_weights(weights, shares, max_ratio: Optional[float]) -> np.ndarray:
    """Cap each weight at ``max_ratio`` times its site's data share, handing the excess to the
    uncapped sites in proportion to their weights (repeated until no weight exceeds its cap).

    Args:
        weights: aggregation weights (>= 0, summing to 1).
        shares: each site's share of the training images (> 0, summing to 1).
        max_ratio: the cap as a multiple of the share (>= 1); None = no cap.

    Example: weights (0.97, 0.01, 0.01, 0.01), shares 0.25 each, ratio 2 -> the first site is
    capped at 0.5 and the other three share 0.5 equally: (0.5, 1/6, 1/6, 1/6).
    """
    w = np.asarray(weights, dtype=np.float64).copy()
    share = np.asarray(shares, dtype=np.float64)
    if w.shape != share.shape or w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights {w.shape} and shares {share.shape} must be 1-D of equal, non-zero length")
    if max_ratio is None:
        return w
    if float(max_ratio) < 1.0:
        raise ValueError(f"max_ratio must be >= 1 (a cap below the data share cannot sum to 1), got {max_ratio}")
    cap = float(max_ratio) * share / share.sum()
    capped = np.zeros(w.shape, dtype=bool)
    for _ in range(w.size):
        over = (w > cap + 1e-12) & ~capped
        if not over.any():
            break
        capped |= over
        w[capped] = cap[capped]
        free = ~capped
        left = 1.0 - w[capped].sum()
        if not free.any() or w[free].sum() <= 0:
            break
        w[free] = w[free] / w[free].sum() * left
    return w


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ----------------------------------------------------------------------------- client
class FedIAClient(SegmentationSupervisedClient):
    """FedIA local rule (see the module docstring).

    Args:
        warmup_rounds: T, rounds of plain training before completeness estimation (paper: 10 MS, 40 lung).
        iou_margin: λ of eq. 7 (paper: 0.03).
        correction_threshold: foreground probability above which a 0 pixel becomes 1 (paper: 0.8);
            with ``correction_rule="lesions"`` the peak probability a missed lesion needs.
        correction_rule: ``pixels`` (paper: every 0 pixel above the threshold, :func:`correct_masks`)
            or ``lesions`` (ours: whole predicted lesions that touch no annotated one,
            :func:`correct_masks_lesionwise`; for sparse lesions, where a partially trained model
            is rarely sure of a missed lesion's every pixel).
        warmup_from_first_lesion: False (paper) = the warm-up is the first ``warmup_rounds`` rounds:
            a warm-up model that predicts no lesion gives completeness 1.0 for good, and the IoU
            trend is fitted over all of them. True (ours, for data where learning starts late, e.g.
            sparse lesions) = completeness is estimated at the first round from ``warmup_rounds`` on
            whose global model marks a lesion at the site, and the IoU trend is fitted over the
            rounds after the site's last round of train IoU 0 (a trend through rounds of IoU 0
            is too flat for the IoU ever to fall below it). The server stays on size-weighted
            FedAvg until every site has its estimate.
        retry_empty_correction: False (reference code) = the first triggered correction ends the
            site's correction even when no pixel passed the threshold (the site then counts as
            corrected, and once all have, the server returns to FedAvg). True (ours) = a correction
            that changed no pixel does not count: the trigger stays armed and the site is not
            reported as corrected (an early, unsure model must not use up the one correction).
        use_correction: False = ablation without client-wise adaptive correction.
        correct_repeatedly: False = correct once, permanently (reference code); True = keep checking
            the trigger after a correction and correct again.
        connectivity: 8 or 4, neighbourhood for counting lesions.
        completeness_floor: lower bound of â_k (keeps it > 0 for a site without annotated lesions).
        completeness_cap: upper bound of â_k (1.0: completeness is a fraction; None = no clipping,
            the paper).
        min_predicted_ratio: â_k is estimated only from a global model that predicts at least this
            many times as many lesions as the site annotated (0.5; 0 = any model, the paper); until
            then the estimate is deferred to the next round and the server stays on FedAvg.
        lr, betas, weight_decay, batch_size, local_epochs, prob_threshold, dice_batch,
        predict_batch_size, loss, lesion_fraction, lr_schedule, final_lr_fraction: as in
            :class:`SegmentationSupervisedClient`
            (paper: Adam 1e-4, (0.9, 0.99), batch 4, one epoch, Dice loss, uniform batches; with
            another loss the site's mean loss ℓ_k of eq. 5 is that loss).
    """

    CONTRIBUTION = frozenset({
        "warmup_rounds", "iou_margin", "correction_threshold", "use_correction", "correct_repeatedly", "connectivity",
        "completeness_floor", "completeness_cap", "min_predicted_ratio", "correction_rule", "warmup_from_first_lesion",
        "retry_empty_correction"})

    task_kind = "segmentation"

    def __init__(self, warmup_rounds: int = 10, iou_margin: float = 0.03, correction_threshold: float = 0.8,
                 use_correction: bool = True, correct_repeatedly: bool = False, connectivity: int = 8,
                 completeness_floor: float = 1e-3, completeness_cap: Optional[float] = 1.0,
                 min_predicted_ratio: float = 0.5,
                 lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, batch_size: int = 4,
                 local_epochs: int = 1, prob_threshold: float = 0.5, dice_batch: bool = False,
                 predict_batch_size: int = 16, loss: str = "dice", lesion_fraction: float = 0.0,
                 correction_rule: str = "pixels", warmup_from_first_lesion: bool = False,
                 retry_empty_correction: bool = False, lr_schedule: str = "constant",
                 final_lr_fraction: float = 0.1):
        super().__init__(lr=lr, betas=betas, weight_decay=weight_decay, batch_size=batch_size,
                         local_epochs=local_epochs, prob_threshold=prob_threshold, dice_batch=dice_batch,
                         predict_batch_size=predict_batch_size, loss=loss, lesion_fraction=lesion_fraction,
                         lr_schedule=lr_schedule, final_lr_fraction=final_lr_fraction)
        if int(warmup_rounds) < 2:
            raise ValueError(f"warmup_rounds must be >= 2 (the IoU trend needs two points), got {warmup_rounds}")
        if not 0.0 < float(correction_threshold) < 1.0:
            raise ValueError(f"correction_threshold must be in (0, 1), got {correction_threshold}")
        connectivity_structure(int(connectivity))  # validates 4 / 8
        if not float(completeness_floor) > 0:
            raise ValueError(f"completeness_floor must be > 0, got {completeness_floor}")
        if completeness_cap is not None and float(completeness_cap) < float(completeness_floor):
            raise ValueError(f"completeness_cap {completeness_cap} is below completeness_floor {completeness_floor}")
        self.warmup_rounds, self.iou_margin = int(warmup_rounds), float(iou_margin)
        self.correction_threshold = float(correction_threshold)
        if correction_rule not in CORRECTION_RULES:
            raise ValueError(f"correction_rule '{correction_rule}' unknown; choose one of {CORRECTION_RULES}")
        self.correction_rule = correction_rule
        self.warmup_from_first_lesion = bool(warmup_from_first_lesion)
        self.retry_empty_correction = bool(retry_empty_correction)
        self.use_correction, self.correct_repeatedly = bool(use_correction), bool(correct_repeatedly)
        self.connectivity = int(connectivity)
        self.completeness_floor = float(completeness_floor)
        self.completeness_cap = None if completeness_cap is None else float(completeness_cap)
        if float(min_predicted_ratio) < 0:
            raise ValueError(f"min_predicted_ratio must be >= 0, got {min_predicted_ratio}")
        self.min_predicted_ratio = float(min_predicted_ratio)

    # -- state --------------------------------------------------------------------------
    @staticmethod
    def fresh_state() -> Dict:
        return {"iou_history": {}, "loss_history": {}, "completeness": None, "annotated_lesions": None,
                "predicted_lesions": None, "trend": None, "correction_pending": False, "corrected": False,
                "correction_rounds": [], "corrected_pixels_total": 0, "mask_shape": None}

    def setup(self, ctx: ClientContext) -> None:
        super().setup(ctx)
        self.original_masks = self.masks  # what the site file holds; never written back
        self.reference_masks = self._reference_masks(ctx)
        self._true_completeness = None
        self.state_path = os.path.join(ctx.state_dir, STATE_FILE)
        self.masks_path = os.path.join(ctx.state_dir, MASKS_FILE)
        self.state = self.fresh_state()
        if os.path.exists(self.state_path):
            with open(self.state_path, "r", encoding="utf-8") as handle:
                self.state.update(json.load(handle))
            shape = self.state.get("mask_shape")
            if shape is not None and tuple(shape) != self.original_masks.shape:
                raise DataError(f"site '{ctx.site}': FedIA state {self.state_path} is for train masks of shape "
                                f"{tuple(shape)}, the site file has {self.original_masks.shape}; remove the stale "
                                f"state folder or point the job at the right data")
            if self.state["corrected"]:
                self.masks = self._load_corrected(ctx)
            ctx.log(f"site '{ctx.site}': FedIA state restored from {ctx.state_dir} "
                    f"({len(self.state['iou_history'])} rounds of IoU, completeness={self.state['completeness']}, "
                    f"corrected={self.state['corrected']})")
        self.state["mask_shape"] = list(self.original_masks.shape)

    def _load_corrected(self, ctx: ClientContext) -> np.ndarray:
        """The corrected masks of an earlier run, memory-mapped read-only from the state folder."""
        if not os.path.exists(self.masks_path):
            raise DataError(f"site '{ctx.site}': FedIA state says the masks were corrected but "
                            f"{self.masks_path} is missing")
        try:
            masks = np.load(self.masks_path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise DataError(f"site '{ctx.site}': corrected masks {self.masks_path} cannot be read ({e}); remove "
                            f"the state folder {ctx.state_dir} to start the site's FedIA state afresh") from e
        if masks.shape != self.original_masks.shape or masks.dtype != np.uint8:
            raise DataError(f"site '{ctx.site}': corrected masks {self.masks_path} are {masks.dtype} "
                            f"{masks.shape}, the site's train masks are uint8 {self.original_masks.shape}")
        return masks

    @staticmethod
    def _reference_masks(ctx: ClientContext) -> Optional[MaskSource]:
        """Complete masks for the correction diagnostics only (None unless the job enables them)."""
        if ctx.reference is None or "train" not in ctx.reference.splits:
            return None
        ref = ctx.reference.splits["train"].labels
        if ref.shape != ctx.data.splits["train"].labels.shape:
            raise DataError(f"site '{ctx.site}': reference train masks have shape {ref.shape}, the site file "
                            f"has {ctx.data.splits['train'].labels.shape}")
        return MaskSource(ref)

    def save_state(self) -> None:
        """Write the state atomically under ``ctx.state_dir`` (corrected masks are already there:
        :meth:`correct` moved them in place)."""
        text = json.dumps(self.state, indent=1, sort_keys=True).encode("utf-8")
        _atomic_write(self.state_path, lambda h: h.write(text))

    # -- FedIA steps ------------------------------------------------------------------------
    def scan(self, model, count: bool, correct: bool) -> Tuple[int, Optional[np.ndarray], int]:
        """One batch-by-batch pass of ``model`` over the train images for the FedIA steps that need
        its prediction, so the probabilities of the whole split never exist at once.

        Args:
            model: the received global model.
            count: count the lesions it predicts (probability > ``prob_threshold``; eq. 3).
            correct: apply the correction rule to the current masks (see :meth:`correct`).

        Returns:
            ``(predicted_lesions, corrected_masks or None, pixels_changed)``.
        """
        n_predicted, changed = 0, 0
        new = None
        if correct:  # written to disk as it goes: a whole split of masks is never held in memory
            os.makedirs(self.ctx.state_dir, exist_ok=True)
            new = np.lib.format.open_memmap(os.path.join(self.ctx.state_dir, NEXT_MASKS_FILE), mode="w+",
                                            dtype=np.uint8, shape=tuple(self.original_masks.shape))
        for rows, probs in self.predict_batches(model):
            if count:
                n_predicted += int(count_lesions(probs > self.prob_threshold, self.connectivity).sum())
            if correct:  # both rules act image by image, so batches give the whole split's result
                if self.correction_rule == "lesions":
                    new[rows], c = correct_masks_lesionwise(self.masks[rows], probs, self.correction_threshold,
                                                            self.prob_threshold, self.connectivity)
                else:
                    new[rows], c = correct_masks(self.masks[rows], probs, self.correction_threshold)
                changed += c
        if new is not None:
            new.flush()
        return n_predicted, new, changed

    def estimate(self, n_predicted: int, round_index: Optional[int] = None) -> None:
        """Completeness (eq. 3) from the lesions the warm-up model predicts (:meth:`scan`), and the
        IoU trend (eq. 6) over the rounds before ``round_index`` (default: the warm-up rounds)."""
        n_annotated = sum(int(count_lesions(block, self.connectivity).sum())
                          for _, block in mask_chunks(self.original_masks))
        a_k = completeness_ratio(n_annotated, n_predicted)
        if a_k is None and self.warmup_from_first_lesion:
            self.ctx.log(f"site '{self.ctx.site}': the global model predicts no lesion yet; completeness "
                         f"estimate deferred to the next round")
            return
        if n_predicted < self.min_predicted_ratio * n_annotated:
            # a model that finds few lesions says nothing about the missing ones (annotated / few = huge)
            self.ctx.log(f"site '{self.ctx.site}': the global model predicts {n_predicted} lesions, fewer than "
                         f"{self.min_predicted_ratio:g} x the {n_annotated} annotated; completeness estimate "
                         f"deferred to the next round")
            return
        if a_k is None:
            self.ctx.log(f"site '{self.ctx.site}': the warm-up model predicts no lesion; completeness set to 1.0")
            a_k = 1.0
        a_k = max(a_k, self.completeness_floor)
        if self.completeness_cap is not None:
            a_k = min(a_k, self.completeness_cap)
        self.state.update(completeness=float(a_k), annotated_lesions=n_annotated, predicted_lesions=n_predicted)
        last = self.warmup_rounds if round_index is None else max(int(round_index), self.warmup_rounds)
        warm = sorted((int(r), v) for r, v in self.state["iou_history"].items() if int(r) < last)
        if self.warmup_from_first_lesion:
            # the current rise starts after the last round of IoU 0 (an untrained model's scattered
            # guesses can give round 0 a small IoU before the long flat stretch)
            last_zero = max((i for i, (_, v) in enumerate(warm) if v <= 0), default=-1)
            warm = warm[last_zero + 1:]
        if len(warm) >= 2:
            self.state["trend"] = list(fit_iou_trend([r + 1 for r, _ in warm], [v for _, v in warm]))
        else:
            self.ctx.log(f"site '{self.ctx.site}': only {len(warm)} warm-up IoU value(s); no trend, no correction")
        self.ctx.log(f"site '{self.ctx.site}': completeness {a_k:.4f} ({n_annotated} annotated / {n_predicted} "
                     f"predicted lesions), IoU trend {self.state['trend']}")

    def correct(self, corrected: np.ndarray, changed: int, round_index: int) -> int:
        """Adopt the masks the correction rule gave (:meth:`scan`, a memory map in the state
        folder): they replace the site's corrected-masks file; returns the pixels changed."""
        corrected.flush()
        os.replace(corrected.filename, self.masks_path)
        self.masks = self._load_corrected(self.ctx)
        self.state["correction_pending"] = False
        if changed == 0 and self.retry_empty_correction and not self.state["corrected"]:
            self.ctx.log(f"site '{self.ctx.site}': no pixel passed the correction threshold at round {round_index}; "
                         f"the trigger stays armed")
            return 0
        self.state["corrected"] = True
        self.state["correction_rounds"].append(int(round_index))
        self.state["corrected_pixels_total"] = sum(
            int((np.asarray(self.masks[rows]) > block).sum()) for rows, block in mask_chunks(self.original_masks))
        self.ctx.log(f"site '{self.ctx.site}': corrected {changed} pixels at round {round_index}")
        return changed

    def diagnostics(self) -> Dict[str, float]:
        """Correction quality against the hidden complete masks (only with ``ctx.reference``)."""
        out: Dict[str, float] = {}
        if self.reference_masks is None:
            return out
        annotated = complete = added = right = missing = 0
        count_lesions_now = self._true_completeness is None  # fixed for the run: count once
        for rows, orig in mask_chunks(self.original_masks):
            ref = np.asarray(self.reference_masks[rows]) > 0
            if count_lesions_now:
                annotated += int(count_lesions(orig, self.connectivity).sum())
                complete += int(count_lesions(ref, self.connectivity).sum())
            new = (np.asarray(self.masks[rows]) > 0) & ~orig
            added, right, missing = added + int(new.sum()), right + int((new & ref).sum()), missing + int(
                (ref & ~orig).sum())
        if count_lesions_now:
            self._true_completeness = float(annotated / max(complete, 1))
        out["true_completeness"] = self._true_completeness
        if added:
            out["corrected_precision"] = float(right / added)
        if missing:
            out["corrected_recall_missing"] = float(right / missing)
        return out

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        r, state = int(inp.round), self.state
        n = len(self.masks)
        if n == 0:
            self.ctx.log(f"site '{self.ctx.site}' has no training image: it takes no part in the average")
            return RoundResult(num_samples=0, stats={"mean_loss": 1.0, "iou": 0.0, "completeness": 1.0,
                                                     "completeness_ready": 0, "corrected": 0, "num_images": 0})
        # one pass of the received global model serves both steps
        count = r >= self.warmup_rounds and state["completeness"] is None
        correct = self.use_correction and state["correction_pending"]
        changed = 0
        if count or correct:
            model.to(self.ctx.device)
            n_predicted, corrected, changed = self.scan(model, count, correct)
            if count:
                self.estimate(n_predicted, r)
            if correct:
                changed = self.correct(corrected, changed, r)
        mean_loss, iou, steps = self.train_on(model, self.masks, r, inp.num_rounds)
        state["iou_history"][str(r)] = iou
        state["loss_history"][str(r)] = mean_loss
        metrics = {"train_loss": mean_loss, "train_iou": iou, "train_steps": steps, "corrected_pixels": changed}
        triggered = False
        if (self.use_correction and r >= self.warmup_rounds and state["trend"] is not None
                and (not state["corrected"] or self.correct_repeatedly)):
            slope, intercept = state["trend"]
            metrics["iou_trend"] = slope * (r + 1) + intercept
            triggered = correction_triggered(slope, intercept, r + 1, iou, self.iou_margin)
            if triggered:
                state["correction_pending"] = True
                self.ctx.log(f"site '{self.ctx.site}': IoU {iou:.4f} fell more than {self.iou_margin} below its "
                             f"trend {metrics['iou_trend']:.4f} at round {r}; correcting next round")
        metrics.update(correction_triggered=int(triggered), corrected=int(state["corrected"]),
                       corrected_pixels_total=state["corrected_pixels_total"])
        ready = state["completeness"] is not None
        if ready:
            metrics["completeness"] = state["completeness"]
        metrics.update(self.diagnostics())
        self.save_state()
        stats = {"mean_loss": float(mean_loss), "iou": float(iou),
                 "completeness": float(state["completeness"]) if ready else 1.0,
                 "completeness_ready": int(ready), "corrected": int(state["corrected"]),
                 # how many images the scalars above describe: the site's minimum-count rule reads it
                 "num_images": int(n)}
        return RoundResult(num_samples=n, stats=stats, metrics=metrics)


# ----------------------------------------------------------------------------- server
class FedIAServer(ServerRule):
    """FedIA aggregation (eq. 4), with guards on the completeness statistics.

    Args:
        warmup_rounds: T; rounds ``< T`` are plain size-weighted FedAvg.
        use_completeness_weighting: False = ablation without completeness-aware aggregation
            (size-weighted FedAvg throughout).
        fedavg_after_all_corrected: True = return to size-weighted FedAvg once every site reports
            corrected masks (paper Fig. 2 "last stage"; reference code).
        loss_floor: smallest ℓ_k used in â_k / ℓ_k.
        completeness_max: a received â_k above this is clipped to it, with a log line naming the
            site (1.0: completeness is a fraction; None = taken as sent, the paper).
        max_weight_ratio: no site's weight exceeds this multiple of its share of the training
            images (:func:`cap_weights`; 2.0; None = the softmax weights as they are, the paper).
    """

    def __init__(self, warmup_rounds: int = 10, use_completeness_weighting: bool = True,
                 fedavg_after_all_corrected: bool = True, loss_floor: float = 1e-6,
                 completeness_max: Optional[float] = 1.0, max_weight_ratio: Optional[float] = 2.0):
        if int(warmup_rounds) < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
        if completeness_max is not None and not float(completeness_max) > 0:
            raise ValueError(f"completeness_max must be > 0 or null, got {completeness_max}")
        if max_weight_ratio is not None and float(max_weight_ratio) < 1.0:
            raise ValueError(f"max_weight_ratio must be >= 1 or null (a cap below a site's data share cannot "
                             f"sum to 1), got {max_weight_ratio}")
        self.warmup_rounds = int(warmup_rounds)
        self.use_completeness_weighting = bool(use_completeness_weighting)
        self.fedavg_after_all_corrected = bool(fedavg_after_all_corrected)
        self.loss_floor = float(loss_floor)
        self.completeness_max = None if completeness_max is None else float(completeness_max)
        self.max_weight_ratio = None if max_weight_ratio is None else float(max_weight_ratio)

    def check_stats(self, update: SiteUpdate, ctx: ServerContext) -> None:
        stats = update.stats
        for key in STAT_KEYS:
            if key not in stats:
                raise ValueError(f"site '{update.site}': FedIA stat '{key}' is missing")
            value = np.asarray(stats[key], dtype=np.float64)
            if value.size != 1:
                raise ValueError(f"site '{update.site}': FedIA stat '{key}' must be one number, "
                                 f"got shape {value.shape}")
            if not np.isfinite(value).all():
                raise ValueError(f"site '{update.site}': FedIA stat '{key}' is not finite ({float(value)})")
        if float(stats["mean_loss"]) < 0:
            raise ValueError(f"site '{update.site}': FedIA stat 'mean_loss' is negative ({stats['mean_loss']})")
        if not 0.0 <= float(stats["iou"]) <= 1.0:
            raise ValueError(f"site '{update.site}': FedIA stat 'iou' must be in [0, 1], got {stats['iou']}")
        if not float(stats["completeness"]) > 0:
            raise ValueError(f"site '{update.site}': FedIA stat 'completeness' must be in (0, inf), "
                             f"got {stats['completeness']}")
        for key in ("completeness_ready", "corrected"):
            if float(stats[key]) not in (0.0, 1.0):
                raise ValueError(f"site '{update.site}': FedIA stat '{key}' must be 0 or 1, got {stats[key]}")

    def completeness_of(self, update: SiteUpdate, ctx: ServerContext) -> float:
        """The site's â_k as used: clipped to ``completeness_max`` (logged when it was above)."""
        value = float(update.stats["completeness"])
        if self.completeness_max is not None and value > self.completeness_max:
            ctx.log(f"FedIA round {ctx.round}: site '{update.site}' reported completeness {value:.4g}, "
                    f"above {self.completeness_max:g}; clipped to {self.completeness_max:g}")
            return self.completeness_max
        return value

    def site_weights(self, updates: List[SiteUpdate], ctx: ServerContext) -> Optional[np.ndarray]:
        """Completeness-aware weights of the updates with samples, or None for size-weighted FedAvg."""
        used = [u for u in updates if u.num_samples > 0]
        if not self.use_completeness_weighting or ctx.round < self.warmup_rounds or not used:
            return None
        if not all(float(u.stats.get("completeness_ready", 0)) == 1.0 for u in used):
            waiting = [u.site for u in used if float(u.stats.get("completeness_ready", 0)) != 1.0]
            ctx.log(f"FedIA round {ctx.round}: completeness not yet estimated at {waiting}; size-weighted FedAvg")
            return None
        if self.fedavg_after_all_corrected and all(float(u.stats.get("corrected", 0)) == 1.0 for u in used):
            return None
        weights = completeness_aware_weights([self.completeness_of(u, ctx) for u in used],
                                             [float(u.stats["mean_loss"]) for u in used], self.loss_floor)
        sizes = np.array([u.num_samples for u in used], dtype=np.float64)
        return cap_weights(weights, sizes / sizes.sum(), self.max_weight_ratio)

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext):
        weights = self.site_weights(updates, ctx)
        used = [u for u in updates if u.num_samples > 0]
        ctx.report["completeness"] = {u.site: float(u.stats["completeness"]) for u in used}
        ctx.report["completeness_ready"] = {u.site: int(float(u.stats["completeness_ready"])) for u in used}
        if weights is None:
            total = float(sum(u.num_samples for u in used)) or 1.0
            ctx.report.update(rule="fedavg", weights={u.site: u.num_samples / total for u in used})
            return average_weights(updates, ctx), {"completeness_aware": 0}
        ctx.report.update(rule="completeness_aware", weights={u.site: float(w) for u, w in zip(used, weights)})
        ctx.log(f"FedIA round {ctx.round}: completeness-aware weights "
                + ", ".join(f"{u.site}={w:.4f}" for u, w in zip(used, weights)))
        # average_weights averages by num_samples / total: give it the weights instead.
        reweighted = [dataclasses.replace(u, num_samples=float(w)) for u, w in zip(used, weights) if w > 0]
        if not reweighted:  # every weight underflowed: cannot happen after the max-shift, but never NaN
            return average_weights(updates, ctx), {"completeness_aware": 0}
        return average_weights(reweighted, ctx), {"completeness_aware": 1}
