"""FedIRM: federated semi-supervised classification by inter-client relation matching
(Liu et al., MICCAI 2021; paper in shared/papers/fedirm_miccai2021.txt).

Some sites are labelled, the others hold images only. One client rule serves both; which
branch a site runs comes from its data (``label_mask`` has annotated entries <=> labelled),
never from its name.

Labelled site (paper Eq. 2-3, 7):
    cross-entropy (label smoothing 0.1, as in the reference code) on its data, and its disease
    relation matrix ``M^l``: row c = softmax(mean logits of the class-c samples / T), T = 2. The
    logit sums and counts per class are accumulated over the whole round (from the training
    forward passes, detached) and the matrix is formed once at the end; it is sent as stats
    ``relation_matrix`` (C, C) + ``relation_counts`` (C,).

Unlabelled site (paper Eq. 1, 4-7), from ``unlabelled_start_round`` on:
    * a mean teacher (EMA 0.99 of the student) kept across rounds in ``ctx.state_dir``;
    * consistency ``L_c`` = squared difference of student and teacher probabilities, each under
      its own augmentation and dropout draw (sum over classes, mean over the batch);
    * reliable pseudo labels: argmax of the student's prediction, kept where the predictive
      entropy of the mean of T = 8 MC-dropout passes is below h = ln 2 (the reference code's
      threshold 2.0 keeps every sample when C = 5, since ln 5 = 1.61 < 2);
    * per-batch relation matrix ``M^u`` from the reliable samples, grouped by pseudo label;
    * ``L_IRM`` = symmetric KL between the received ``M`` and ``M^u``, averaged over the classes
      present in the batch (Eq. 6 averages over all C; a row with no sample is only a uniform
      placeholder and would pull the model towards nothing in particular);
    * loss = lambda(omega) * (L_c + L_IRM), lambda(omega) = exp(-5 (1 - omega/30)^2), omega = round
      capped at 30. Before the server has a relation matrix (round 0) L_IRM is skipped.

Deviations from the paper / reference code, on purpose:
    * ``M^u`` is built from the student's *logits* (as the reference code does and as ``M^l`` is),
      not from probabilities as Eq. 5 writes; softmax(p / 2) of a probability vector is almost
      uniform and could never match a labelled site's logit-based row.
    * Eq. 6 sums both KL directions (no 1/2; the reference code halves it): we follow the paper.
    * MC-dropout passes run with BatchNorm in eval mode and only the dropout layers sampling, so
      the 8 extra passes do not disturb the running statistics (the reference runs them in train
      mode). When the only dropout is the model's head dropout (``model.dropout`` before
      ``model.fc``, as in every ``fedpartial`` classifier) the backbone runs once and the head 8
      times: the same samples as 8 full passes for the same random stream, at 1/8 of the cost.
    * A fresh Adam per round (the reference keeps each client's optimiser state across rounds).
    * The mean teacher persists across rounds (``ctx.state_dir``): an EMA of the student's steps in
      every round since the site joined, as the reference code keeps it; the paper's Eq. 1 defines
      the teacher as an EMA of the student without saying it outlives the round, which a teacher
      re-made from each received global model would also satisfy.
    * By default each site's result filter withholds a relation row computed from fewer than 5
      images (``StatisticsPrivacyFilter``, preset ``fedirm``, ``min_count`` 5 in the jobs; the
      row becomes the uniform placeholder the server already ignores); the paper sends every row.

Why the jobs let unlabelled sites join at round 20 (``unlabelled_start_round``, as the reference
code does; the constructor default 0 is the paper's text). From round 0, Adam makes every step about
``lr`` long whatever lambda is, so the unlabelled sites (8 of 10 in the paper's setting) move the
model as far as the labelled ones, along the consistency gradient of a still untrained model towards a
mean teacher that is itself still mostly its random start; with no reliable pseudo label yet, L_IRM is
0. Measured (HAM10000 28 px, 10 sites, 2 labelled, small_cnn, 30 rounds, seed 0, test AUC): from round 0
0.515 (collapse; FedAvg on the labelled sites 0.910), with ``ramp_scales_lr`` 0.807, from round 20
0.913 (with ``ramp_scales_lr`` too: 0.911). The teacher is created from the global model of the round
the site joins.

Options beyond the paper (paper values by default): ``reliable_fraction`` keeps the
lowest-entropy share of each batch as reliable instead of the absolute ln 2 threshold, which passed
11 % of the unlabelled images at round 20 and 0.2 % at round 99 on HAM10000, leaving L_IRM with
nothing to match; the server's ``unlabelled_weight`` scales the unlabelled sites' sample counts in
the weight average (eight unlabelled sites of ten otherwise outweigh the labelled ones four to one).
The ``fedirm`` job ships 0.5 / 0.05. On HAM10000 (10 sites, 30 rounds, 3 seeds, test AUC, bench suites
fedirm-ham and fedirm-ham-1l) the weight 0.05 was at or above 0.25 on every seed of both suites (2
labelled sites: 0.921 +- 0.003 against 0.915 +- 0.006; 1 labelled site: 0.896 +- 0.002 against
0.892 +- 0.006), with a higher F1, and the paper rule reached 0.904 +- 0.005 (2 labelled sites). It
is also what the same recipe reaches on the labelled sites alone (0.921 +- 0.002 / 0.892 +- 0.006):
at this scale the weight keeps the unlabelled sites from diluting the labelled ones, and nothing
here makes them add to them (docs/RESULTS.md). At the paper's 100 rounds they hold back the labelled
sites' overfitting (two labelled sites: 0.918 +- 0.007 against 0.913 +- 0.006, above on every seed),
but FedIRM is below its 30-round figure and no better than FedAvg, so the jobs keep 30.
``relation_weight`` (1, the paper) scales L_IRM alone, ``pseudo_label_weight`` (0, the paper) adds
self-training on the reliable pseudo labels (:func:`pseudo_label_loss`), ``reliable_per_class``
takes the reliable share per predicted class: the ablations of "the unlabelled sites do not help"
(docs/RESULTS.md, FedIRM where the labelled sites cannot learn alone); none is on in the jobs.

Multi-label variant (not in the paper nor the reference code, which are single-label):
    relation "rows" are vectors of independent Bernoulli probabilities: row c = sigmoid(mean
    logits of the class-c-positive samples / T) (C, C). Unlabelled: an entry (i, c) is a reliable
    positive pseudo label when the student's sigmoid is > 0.5 and the binary entropy of the MC mean
    is below ``multilabel_entropy_threshold`` (0.5 nats, i.e. MC-mean prob >= ~0.8; ln 2 is the
    *maximum* binary entropy and would filter nothing); row c of ``M^u`` averages the logits of
    the reliable positives of c. KL -> symmetric binary KL of each entry, averaged over the C
    entries of a row, then over the classes present. The consistency loss uses sigmoids.

Server: FedAvg of the weights over all participating sites (unlabelled ones included), and the
average of the labelled sites' relation matrices, sent back in ``global_stats`` for the next round.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fedpartial.algorithms.aggregation import average_weights
from fedpartial.algorithms.base import ClientContext, ClientRule, RoundInput, RoundResult, ServerContext, ServerRule, \
    SiteUpdate
from fedpartial.algorithms.fedavg import labelled_rows
from fedpartial.data.transforms import training_view
from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL
from fedpartial.training.common import (EMATeacher, ImageSource, batch_indices, epoch_steps, probabilities,
                                        round_seed, seed_everything)
from fedpartial.training.losses import masked_bce_with_logits, masked_cross_entropy

TEACHER_FILE = "fedirm_teacher.pt"
AUGMENTATIONS = ("affine", "flip", "weak", "strong", "none")
RELATION_WEIGHTINGS = ("sites", "counts")
# Keys of the statistics on the wire.
RELATION_MATRIX = "relation_matrix"
RELATION_COUNTS = "relation_counts"

#: What the client rule sends in ``site_stats`` and what a site's privacy filter
#: (``fedpartial.flare.filters.StatisticsPrivacyFilter``) needs to guard it, by preset name.
#: ``keys``: every key sent; ``signature``: the keys that identify the method's statistics;
#: ``guards``: statistic -> the count key saying from how many images each row (or a scalar) was
#: computed; ``fill``: what a withheld row becomes (the value the server rule reads as "absent");
#: ``clip``: allowed range after noise; ``normalise_rows``: keys whose rows sum to 1.
#: ``variant``: ``(flag key, preset)``, the preset to use when the flag is set.
#: Relation-matrix rows (softmax, sum 1) behind the class counts (distinct images); an absent row
#: is uniform (1/C). Multi-label: sigmoid rows, an absent row is 0.5, no row sum.
SENT_STATISTICS = {
    "fedirm": {"keys": ["relation_matrix", "relation_counts", "relation_multilabel"],
               "signature": ["relation_matrix", "relation_counts"],
               "variant": ["relation_multilabel", "fedirm_multilabel"],
               "guards": {"relation_matrix": "relation_counts", "relation_counts": "relation_counts"},
               "fill": {"relation_matrix": "uniform"},
               "clip": {"relation_matrix": [0, 1], "relation_counts": [0, math.inf]},
               "normalise_rows": ["relation_matrix"]},
    "fedirm_multilabel": {"keys": ["relation_matrix", "relation_counts", "relation_multilabel"],
                          "guards": {"relation_matrix": "relation_counts", "relation_counts": "relation_counts"},
                          "fill": {"relation_matrix": 0.5},
                          "clip": {"relation_matrix": [0, 1], "relation_counts": [0, math.inf]}},
}
#: What the client rule returns in ``metrics`` (sent as ``site_metrics``) and when a site's result
#: policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
#: Labelled and unlabelled sites together. ``relation_classes_seen`` stays local: it would count
#: the classes whose relation row the minimum-count rule withholds.
SENT_METRICS = {
    "fedirm": {"train_loss": "scope", "train_steps": "scope", "consistency_loss": "scope", "irm_loss": "scope",
               "pseudo_label_loss": "scope", "reliable_fraction": "scope", "labelled": "value",
               "ramp_weight": "value", "irm_active": "value", "joined": "value", "aborted": "value",
               "relation_classes_seen": "local", "pseudo_precision": "local"},
}
RELATION_VALID = "relation_valid"
RELATION_MULTILABEL = "relation_multilabel"
_EPS = 1e-8


# ---------------------------------------------------------------------------------------------
# Pure helpers (torch / numpy, no FLARE)
# ---------------------------------------------------------------------------------------------
def ramp_weight(round_num: int, ramp_rounds: int = 30) -> float:
    """Gaussian warm-up lambda(omega) = exp(-5 (1 - omega / ramp_rounds)^2), omega capped at ramp_rounds.

    Args:
        round_num: 0-based federated round (omega).
        ramp_rounds: Omega (30 in the paper); 0 means no ramp (weight 1).
    """
    if ramp_rounds <= 0:
        return 1.0
    phase = 1.0 - min(max(float(round_num), 0.0), float(ramp_rounds)) / float(ramp_rounds)
    return float(math.exp(-5.0 * phase * phase))


def class_logit_sums(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of logit vectors and per-class counts.

    Args:
        logits: ``(N, C)``.
        labels: ``(N, C)`` 0/1 (one-hot for single-label, multi-hot for multi-label); a sample adds
            its logits to the row of every class it is positive for.

    Returns:
        ``(sums (C, C), counts (C,))``: row c of ``sums`` is the sum of the logits of class-c samples.
    """
    labels = labels.to(logits.dtype)
    return labels.t() @ logits, labels.sum(dim=0)


def relation_from_sums(sums: torch.Tensor, counts: torch.Tensor, temperature: float = 2.0,
                       multilabel: bool = False) -> torch.Tensor:
    """Relation matrix from per-class logit sums: row c = softmax(sums_c / counts_c / T) (sigmoid
    for multi-label). Rows of classes with count 0 are uniform placeholders (1/C, or 0.5 for
    multi-label); callers tell them apart by ``counts``.

    Args:
        sums: ``(C, C)`` per-class logit sums.
        counts: ``(C,)`` samples per class.
        temperature: softening temperature T (2 in the paper).
        multilabel: sigmoid rows instead of softmax rows.
    """
    mean = sums / counts.clamp_min(1.0).unsqueeze(1)
    rows = torch.sigmoid(mean / temperature) if multilabel else torch.softmax(mean / temperature, dim=1)
    fill = 0.5 if multilabel else 1.0 / sums.shape[1]
    return torch.where((counts > 0).unsqueeze(1), rows, torch.full_like(rows, fill))


def relation_matrix(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 2.0,
                    multilabel: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Disease relation matrix of a set of samples (paper Eq. 2-3); differentiable in ``logits``.

    Args:
        logits: ``(N, C)`` pre-softmax outputs.
        labels: ``(N, C)`` 0/1 class membership (true labels or reliable pseudo labels).
        temperature: T.
        multilabel: sigmoid rows (multi-label variant).

    Returns:
        ``(matrix (C, C), counts (C,))``.
    """
    sums, counts = class_logit_sums(logits, labels)
    return relation_from_sums(sums, counts, temperature, multilabel), counts


def symmetric_kl(target: torch.Tensor, estimate: torch.Tensor, present: torch.Tensor,
                 multilabel: bool = False) -> torch.Tensor:
    """L_IRM (paper Eq. 6): KL(M_c || M^u_c) + KL(M^u_c || M_c), averaged over the rows ``present``.

    Uses KL(p||q) + KL(q||p) = sum_j (p_j - q_j)(log p_j - log q_j). Multi-label: each entry is a
    Bernoulli distribution, whose symmetric KL is (p - q)(logit p - logit q); averaged over a row's
    entries. Returns 0 (keeping the graph) when no row is present.

    Args:
        target: ``(C, C)`` received (averaged labelled) matrix.
        estimate: ``(C, C)`` batch matrix of the unlabelled site.
        present: ``(C,)`` bool, rows to include.
        multilabel: Bernoulli entries instead of one distribution per row.
    """
    if multilabel:
        p = target.clamp(_EPS, 1.0 - _EPS)
        q = estimate.clamp(_EPS, 1.0 - _EPS)
        per_row = ((p - q) * (torch.logit(p) - torch.logit(q))).mean(dim=1)
    else:
        p = target.clamp_min(_EPS)
        q = estimate.clamp_min(_EPS)
        per_row = ((p - q) * (p.log() - q.log())).sum(dim=1)
    present = present.to(torch.bool)
    if not bool(present.any()):
        return estimate.sum() * 0.0
    return per_row[present].mean()


def predictive_entropy(mean_probs: torch.Tensor, multilabel: bool = False) -> torch.Tensor:
    """Entropy (nats) of mean MC probabilities (paper Eq. 4): ``(N,)`` for softmax outputs,
    ``(N, C)`` binary entropies for multi-label."""
    p = mean_probs.clamp(_EPS, 1.0)
    if multilabel:
        q = (1.0 - mean_probs).clamp(_EPS, 1.0)
        return -(mean_probs * p.log() + (1.0 - mean_probs) * q.log())
    return -(mean_probs * p.log()).sum(dim=1)


def reliable_mask(mc_probs: torch.Tensor, threshold: float, multilabel: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Uncertainty filter: predictions whose MC-mean predictive entropy is below ``threshold``.

    Args:
        mc_probs: ``(T, N, C)`` probabilities of T stochastic passes.
        threshold: h (ln 2 in the paper for softmax outputs).
        multilabel: per-entry binary entropy; the mask is then ``(N, C)``.

    Returns:
        ``(reliable bool (N,) or (N, C), entropy)``.
    """
    entropy = predictive_entropy(mc_probs.mean(dim=0), multilabel)
    return entropy < threshold, entropy


def reliable_lowest_entropy(entropy: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ``ceil(fraction * n)`` lowest-entropy entries of a batch (per class column for a
    multi-label ``(N, C)`` entropy): a filter relative to the batch, which keeps pseudo labels
    coming whatever the number of classes and the model's calibration (the absolute ln 2 of the
    paper passes fewer and fewer of them as training goes on). Ties keep the earlier sample.

    Args:
        entropy: ``(N,)`` or ``(N, C)`` predictive entropies.
        fraction: share kept, in (0, 1].
    """
    n = entropy.shape[0]
    k = int(np.ceil(float(fraction) * n - 1e-9))
    keep = torch.zeros_like(entropy, dtype=torch.bool)
    if k <= 0:
        return keep
    order = torch.sort(entropy, dim=0, stable=True).indices[:k]
    return keep.scatter_(0, order, True)


def reliable_lowest_entropy_per_class(entropy: torch.Tensor, predicted: torch.Tensor, fraction: float) -> torch.Tensor:
    """:func:`reliable_lowest_entropy` within each predicted class of a single-label batch: the
    ``ceil(fraction * n_c)`` lowest-entropy samples of the ``n_c`` predicted as class c, so that a
    class the model predicts rarely, and less surely, still reaches the relation matrix instead of
    the majority class taking every reliable place.

    Args:
        entropy: ``(N,)`` predictive entropies.
        predicted: ``(N,)`` predicted class indices.
        fraction: share kept of each predicted class, in (0, 1].
    """
    keep = torch.zeros_like(entropy, dtype=torch.bool)
    for c in torch.unique(predicted):
        members = torch.nonzero(predicted == c, as_tuple=True)[0]
        keep[members] = reliable_lowest_entropy(entropy[members], fraction)
    return keep


def _dropout_modules(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]


@torch.no_grad()
def mc_dropout_probabilities(model: nn.Module, x: torch.Tensor, passes: int = 8, multilabel: bool = False
                             ) -> torch.Tensor:
    """``passes`` stochastic forward passes with dropout on and BatchNorm in eval mode.

    When the model's only active dropout is its head (``model.dropout`` feeding ``model.fc``,
    the ``fedpartial.models`` layout), the backbone runs once and the head ``passes`` times
    (same draws as full passes for the same random stream); otherwise full passes.

    Args:
        model: a classifier ``x -> (features, logits)``.
        x: input batch on the model's device.
        passes: T.
        multilabel: sigmoid instead of softmax.

    Returns:
        ``(T, N, C)`` probabilities.
    """
    modes = {m: m.training for m in model.modules()}
    drops = _dropout_modules(model)
    try:
        model.eval()
        act = torch.sigmoid if multilabel else (lambda z: torch.softmax(z, dim=1))
        head = getattr(model, "dropout", None)
        fc = getattr(model, "fc", None)
        if isinstance(fc, nn.Linear) and isinstance(head, nn.Module) and all(m is head for m in drops):
            features, _ = model(x)  # dropout still off here: features come before it anyway
            head.train()
            return torch.stack([act(fc(head(features)).float()) for _ in range(passes)])
        for m in drops:
            m.train()
        return torch.stack([act(model(x)[1].float()) for _ in range(passes)])
    finally:
        for m, mode in modes.items():
            m.training = mode


def consistency_loss(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Paper Eq. 1: squared L2 distance of the two predictions, summed over classes, mean over samples."""
    return ((student_probs - teacher_probs.detach()) ** 2).sum(dim=1).mean()


def pseudo_label_loss(logits: torch.Tensor, targets: torch.Tensor, reliable: torch.Tensor,
                      multilabel: bool = False, balanced: bool = False) -> torch.Tensor:
    """Self-training on the reliable pseudo labels: cross-entropy of the student's logits against
    its reliable predictions (binary cross-entropy on the reliable entries for multi-label); 0 when
    none is reliable.

    Args:
        logits: ``(N, C)`` student logits.
        targets: ``(N, C)`` 0/1 predicted labels (one-hot of the argmax for single-label).
        reliable: ``(N,)`` (single-label) or ``(N, C)`` (multi-label) bool mask of the kept predictions.
        multilabel: binary cross-entropy per entry.
        balanced: single-label: every pseudo class present weighs the same in the batch (each sample
            ``1 / n_c`` of its class), so that the majority class does not make the whole loss.
    """
    if multilabel:
        return masked_bce_with_logits(logits, targets.to(logits.dtype), reliable.to(logits.dtype))
    kept = reliable.to(logits.dtype)
    index = targets.argmax(dim=1)
    if balanced:
        per_class = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device).index_add_(0, index, kept)
        kept = kept / per_class[index].clamp_min(1.0)
    return masked_cross_entropy(logits, index, sample_weight=kept)


def average_relation_matrices(matrices: List[np.ndarray], counts: List[np.ndarray], weighting: str = "sites",
                              previous: Optional[np.ndarray] = None, previous_valid: Optional[np.ndarray] = None,
                              multilabel: bool = False) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Server average of the labelled sites' relation matrices (M = mean_l M^l), row by row.

    A site that saw no sample of class c (count 0) sent a placeholder row c and is left out of
    that row. ``weighting="sites"`` gives every site that saw the class the same weight (the
    paper's plain mean); ``"counts"`` weights by the class count. A class seen nowhere keeps its
    ``previous`` global row (and validity), else a uniform row marked invalid.

    Args:
        matrices: per-site ``(C, C)``.
        counts: per-site ``(C,)`` class counts.
        weighting: ``sites`` or ``counts``.
        previous: last round's global matrix, or None.
        previous_valid: last round's ``(C,)`` validity, or None (all valid when ``previous`` is given).
        multilabel: uniform fallback 0.5 instead of 1/C.

    Returns:
        ``(matrix (C, C), total counts (C,), valid (C,) float 0/1)``.
    """
    if weighting not in RELATION_WEIGHTINGS:
        raise ValueError(f"relation weighting '{weighting}' unknown; choose one of {RELATION_WEIGHTINGS}")
    if not matrices:
        raise ValueError("no relation matrix to average")
    num_classes = np.shape(matrices[0])[0]
    stack = np.stack([np.asarray(m, dtype=np.float64) for m in matrices])          # (K, C, C)
    cnt = np.stack([np.asarray(c, dtype=np.float64) for c in counts])              # (K, C)
    w = cnt if weighting == "counts" else (cnt > 0).astype(np.float64)
    total_w = w.sum(axis=0)                                                        # (C,)
    avg = np.einsum("kc,kcj->cj", w, stack) / np.maximum(total_w, _EPS)[:, None]
    seen = total_w > 0
    if previous is not None:
        fallback = np.asarray(previous, dtype=np.float64)
        fallback_valid = (np.ones(num_classes) if previous_valid is None
                          else np.asarray(previous_valid, dtype=np.float64))
    else:
        fallback = np.full((num_classes, num_classes), 0.5 if multilabel else 1.0 / num_classes)
        fallback_valid = np.zeros(num_classes)
    matrix = np.where(seen[:, None], avg, fallback)
    valid = np.where(seen, 1.0, fallback_valid)
    return matrix, cnt.sum(axis=0), valid


# ---------------------------------------------------------------------------------------------
# Client rule
# ---------------------------------------------------------------------------------------------
class FedIRMClient(ClientRule):
    """FedIRM local training; the labelled or unlabelled branch is chosen from the site's data.

    Args:
        temperature: T of the relation matrices (2.0).
        label_smoothing: CE label smoothing at labelled sites (0.1, reference code); single-label only.
        ema_decay: mean-teacher EMA decay (0.99).
        mc_passes: MC-dropout passes for the uncertainty (8).
        entropy_threshold: h for softmax outputs (ln 2).
        multilabel_entropy_threshold: h for the per-entry binary entropy (multi-label variant, 0.5).
        min_confidence: extra filter on the student's max probability (0 = off; the reference code
            uses 0.3, the paper none).
        reliable_fraction: 0 = the paper's absolute entropy threshold; in (0, 1] = keep that share of
            each batch with the lowest entropy instead (:func:`reliable_lowest_entropy`).
        reliable_per_class: single-label, with ``reliable_fraction``: keep that share of each
            predicted class instead of the batch (:func:`reliable_lowest_entropy_per_class`).
        ramp_rounds: Omega of the Gaussian warm-up (30).
        max_unsupervised_weight: scale of lambda(omega) (1.0 in the paper; the reference code uses 15).
        relation_weight: weight of the relation-matching loss against the consistency loss within
            lambda(omega) (1.0, the paper: L_c + L_IRM); 0 leaves the mean teacher alone.
        pseudo_label_weight: weight of :func:`pseudo_label_loss` on the reliable pseudo labels,
            within lambda(omega) beside L_c and L_IRM (0, the paper: its pseudo labels only build
            ``M^u``).
        pseudo_label_balance: every pseudo class weighs the same in that loss (single-label).
        unlabelled_start_round: first round an unlabelled site trains (0, the paper; the jobs use 20,
            as the reference code does: see the module docstring).
            Before it, the site returns ``num_samples = 0``.
        ramp_scales_lr: also multiply the unlabelled site's Adam learning rate by lambda(omega)
            (False = paper). Adam is invariant to the scale of the loss, so lambda on the loss alone
            barely slows the early unlabelled updates (see the module docstring).
        lr: Adam learning rate (2e-4, reference code; the paper gives none).
        weight_decay: Adam weight decay (5e-4, reference code).
        betas: Adam betas ((0.9, 0.99), paper).
        batch_size: 48 (paper), labelled and unlabelled.
        local_epochs: epochs per round (1).
        augmentation: ``affine`` (the reference code's rotation + translation + flip, MONAI),
            ``flip`` (fast vectorised flips), ``weak`` / ``strong`` (``data.transforms.training_view``)
            or ``none``.
        rotate_deg: max rotation of the ``affine`` augmentation (10, reference code).
        translate: max shift of the ``affine`` augmentation as a fraction of the size (0.02).
    """

    CONTRIBUTION = frozenset({
        "temperature", "ema_decay", "mc_passes", "entropy_threshold", "multilabel_entropy_threshold", "min_confidence",
        "ramp_rounds", "reliable_fraction", "reliable_per_class", "max_unsupervised_weight", "relation_weight",
        "pseudo_label_weight", "pseudo_label_balance", "unlabelled_start_round", "ramp_scales_lr"})
    # a labelled site's rows with a usable label (an unlabelled site's weight is the server's rule)
    WEIGHT_BY = "labelled_rows"

    def __init__(self, temperature: float = 2.0, label_smoothing: float = 0.1, ema_decay: float = 0.99,
                 mc_passes: int = 8, entropy_threshold: float = math.log(2.0),
                 multilabel_entropy_threshold: float = 0.5, min_confidence: float = 0.0, ramp_rounds: int = 30,
                 reliable_fraction: float = 0.0, reliable_per_class: bool = False,
                 max_unsupervised_weight: float = 1.0, relation_weight: float = 1.0, pseudo_label_weight: float = 0.0,
                 pseudo_label_balance: bool = False, unlabelled_start_round: int = 0,
                 ramp_scales_lr: bool = False, lr: float = 2e-4,
                 weight_decay: float = 5e-4, betas=(0.9, 0.99), batch_size: int = 48, local_epochs: int = 1,
                 augmentation: str = "affine", rotate_deg: float = 10.0, translate: float = 0.02):
        if temperature <= 0:
            raise ValueError(f"FedIRM temperature must be > 0, got {temperature}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"FedIRM label_smoothing must be in [0, 1), got {label_smoothing}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"FedIRM ema_decay must be in [0, 1), got {ema_decay}")
        if int(mc_passes) < 1:
            raise ValueError(f"FedIRM mc_passes must be >= 1, got {mc_passes}")
        if entropy_threshold <= 0 or multilabel_entropy_threshold <= 0:
            raise ValueError("FedIRM entropy thresholds must be > 0, got "
                             f"{entropy_threshold} / {multilabel_entropy_threshold}")
        if int(ramp_rounds) < 0 or int(unlabelled_start_round) < 0:
            raise ValueError(f"FedIRM ramp_rounds and unlabelled_start_round must be >= 0, got "
                             f"{ramp_rounds} / {unlabelled_start_round}")
        if int(batch_size) < 2 or int(local_epochs) < 1:
            raise ValueError(f"FedIRM needs batch_size >= 2 and local_epochs >= 1, got {batch_size} / {local_epochs}")
        if augmentation not in AUGMENTATIONS:
            raise ValueError(f"FedIRM augmentation '{augmentation}' unknown; choose one of {AUGMENTATIONS}")
        self.temperature, self.label_smoothing, self.ema_decay = float(temperature), float(label_smoothing), ema_decay
        self.mc_passes = int(mc_passes)
        self.entropy_threshold = float(entropy_threshold)
        if not 0.0 <= float(reliable_fraction) <= 1.0:
            raise ValueError(f"FedIRM reliable_fraction must be in [0, 1], got {reliable_fraction}")
        self.reliable_fraction = float(reliable_fraction)
        self.reliable_per_class = bool(reliable_per_class)
        self.multilabel_entropy_threshold = float(multilabel_entropy_threshold)
        self.min_confidence = float(min_confidence)
        self.ramp_rounds, self.max_unsupervised_weight = int(ramp_rounds), float(max_unsupervised_weight)
        if float(relation_weight) < 0:
            raise ValueError(f"FedIRM relation_weight must be >= 0, got {relation_weight}")
        self.relation_weight = float(relation_weight)
        if float(pseudo_label_weight) < 0:
            raise ValueError(f"FedIRM pseudo_label_weight must be >= 0, got {pseudo_label_weight}")
        self.pseudo_label_weight, self.pseudo_label_balance = float(pseudo_label_weight), bool(pseudo_label_balance)
        self.unlabelled_start_round = int(unlabelled_start_round)
        self.ramp_scales_lr = bool(ramp_scales_lr)
        self.lr, self.weight_decay, self.betas = float(lr), float(weight_decay), tuple(betas)
        self.batch_size, self.local_epochs = int(batch_size), int(local_epochs)
        self.augmentation = augmentation
        self._view = training_view(augmentation, rotate_deg=rotate_deg, translate=translate)
        self._teacher: Optional[EMATeacher] = None
        self._teacher_state: Optional[dict] = None
        self._warned_no_dropout = False

    def round_steps(self, data) -> int:
        train = data.splits["train"]
        labelled = train.label_mask is not None and bool(np.asarray(train.label_mask).any())
        n = len(labelled_rows(train.labels, train.label_mask, data.task)) if labelled else len(train)
        return self.local_epochs * epoch_steps(n, self.batch_size, drop_last=True)

    # ---- set-up ------------------------------------------------------------------------------
    def setup(self, ctx: ClientContext) -> None:
        super().setup(ctx)
        data = ctx.data
        if data.task not in (SINGLE_LABEL, MULTI_LABEL):
            raise ValueError(f"FedIRM: {data.where()} holds {data.task} data; FedIRM needs classification")
        train = data.splits.get("train")
        if train is None or train.label_mask is None:
            raise ValueError(f"FedIRM: {data.where()} has no train split with a label_mask")
        self.multilabel = data.task == MULTI_LABEL
        self.labelled = bool(np.asarray(train.label_mask).any())
        declared = data.info.get("labelled") if isinstance(data.info, dict) else None
        if declared is not None and bool(declared) != self.labelled:
            raise ValueError(f"FedIRM: {data.where()} info_json says labelled={declared} but its train_label_mask "
                             f"has {'some' if self.labelled else 'no'} annotated entries")
        if self.labelled:
            self.rows = labelled_rows(train.labels, train.label_mask, data.task)
            if len(self.rows) == 0:
                raise ValueError(f"FedIRM: labelled {data.where()} has annotated entries but no usable "
                                 f"(positively labelled) training sample")
            self.labels = torch.as_tensor(train.labels[self.rows], dtype=torch.float32)
            self.label_mask = torch.as_tensor(train.label_mask[self.rows], dtype=torch.float32)
        else:
            self.rows = np.arange(len(train))
        self.images = ImageSource(train.images, ctx.normalisation, self.rows)  # uint8, read batch by batch
        self.teacher_path = os.path.join(ctx.state_dir, TEACHER_FILE)
        self._teacher = None
        self._teacher_state = None
        if not self.labelled and os.path.isfile(self.teacher_path):
            try:
                self._teacher_state = torch.load(self.teacher_path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise ValueError(f"FedIRM: site '{ctx.site}': cannot read the saved teacher "
                                 f"'{self.teacher_path}': {exc}") from exc
            ctx.log(f"FedIRM: site '{ctx.site}' restored its mean teacher from '{self.teacher_path}' "
                    f"(saved after round {self._teacher_state.get('round')})")
        ctx.log(f"FedIRM: site '{ctx.site}' is {'labelled' if self.labelled else 'unlabelled'} "
                f"({len(self.rows)} training images)")

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._view is None else self._view(x)

    def _optimizer(self, model: nn.Module, lr_scale: float = 1.0) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.lr * lr_scale, betas=self.betas,
                                weight_decay=self.weight_decay)

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        seed = round_seed(self.ctx.seed, self.ctx.site, inp.round)
        seed_everything(seed)
        rng = np.random.default_rng(seed)
        if self.labelled:
            return self._train_labelled(model, inp, rng)
        return self._train_unlabelled(model, inp, rng)

    # ---- labelled site -----------------------------------------------------------------------
    def _targets(self, idx: np.ndarray) -> torch.Tensor:
        """Class membership used for the relation matrix: annotated positives."""
        return self.labels[idx] * self.label_mask[idx]

    def _supervised_loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.multilabel:
            return masked_bce_with_logits(logits, labels, mask)
        known = ((labels * mask) > 0.5).any(dim=1).float()
        return masked_cross_entropy(logits, labels.argmax(dim=1), sample_weight=known,
                                    label_smoothing=self.label_smoothing)

    def _train_labelled(self, model, inp: RoundInput, rng: np.random.Generator) -> RoundResult:
        device = self.ctx.device
        n, num_classes = len(self.rows), self.labels.shape[1]
        optimizer = self._optimizer(model)
        model.train()
        sums = torch.zeros(num_classes, num_classes, dtype=torch.float64)
        counts = torch.zeros(num_classes, dtype=torch.float64)
        seen = np.zeros(n, dtype=bool)
        losses: List[float] = []
        for _ in range(self.local_epochs):
            for idx in batch_indices(n, self.batch_size, rng, drop_last=True):
                if self.ctx.abort():
                    return RoundResult(num_samples=0, metrics={"aborted": 1.0})
                x = self._augment(self.images.batch(idx)).to(device, non_blocking=True)
                labels, mask = self.labels[idx].to(device), self.label_mask[idx].to(device)
                _, logits = model(x)
                loss = self._supervised_loss(logits, labels, mask)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
                batch_sums, batch_counts = class_logit_sums(logits.detach().double().cpu(), self._targets(idx).double())
                sums += batch_sums
                counts += batch_counts
                seen[idx] = True
        matrix = relation_from_sums(sums, counts, self.temperature, self.multilabel)
        # The released count is of distinct images: the minimum-count rule (k) and the server's count
        # weighting are about how many images a row describes, not how often they were visited.
        distinct = self._targets(np.flatnonzero(seen)).double().sum(dim=0)
        stats = {RELATION_MATRIX: matrix.numpy().astype(np.float64), RELATION_COUNTS: distinct.numpy(),
                 RELATION_MULTILABEL: int(self.multilabel)}
        metrics = {"train_loss": float(np.mean(losses)) if losses else 0.0, "train_steps": float(len(losses)),
                   "labelled": 1.0, "relation_classes_seen": float((counts > 0).sum())}
        return RoundResult(num_samples=n, stats=stats, metrics=metrics)

    # ---- unlabelled site ---------------------------------------------------------------------
    def teacher_for(self, model: nn.Module) -> EMATeacher:
        """The site's mean teacher: kept in memory across rounds, restored from ``state_dir`` after a
        restart, created from the received global model the first time the site trains."""
        if self._teacher is None:
            teacher = EMATeacher(model, self.ema_decay)
            if self._teacher_state is not None:
                try:
                    teacher.model.load_state_dict(self._teacher_state["state_dict"])
                except (RuntimeError, KeyError) as exc:
                    raise ValueError(f"FedIRM: site '{self.ctx.site}': saved teacher '{self.teacher_path}' does not "
                                     f"fit the job's model: {exc}") from exc
            self._teacher = teacher
        return self._teacher

    def _save_teacher(self, round_num: int) -> None:
        state = {"state_dict": {k: v.detach().cpu() for k, v in self._teacher.model.state_dict().items()},
                 "round": int(round_num)}
        tmp = f"{self.teacher_path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, self.teacher_path)  # atomic: a crash never leaves half a teacher
        self._teacher_state = state

    def _received_relation(self, global_stats: dict, num_classes: int, device) -> Tuple[Optional[torch.Tensor],
                                                                                         Optional[torch.Tensor]]:
        if not global_stats or global_stats.get(RELATION_MATRIX) is None:
            return None, None
        matrix = np.asarray(global_stats[RELATION_MATRIX], dtype=np.float32)
        if matrix.shape != (num_classes, num_classes) or not np.all(np.isfinite(matrix)):
            raise ValueError(f"FedIRM: site '{self.ctx.site}': global_stats['{RELATION_MATRIX}'] has shape "
                             f"{matrix.shape} (or non-finite values); expected ({num_classes}, {num_classes})")
        valid = np.asarray(global_stats.get(RELATION_VALID, np.ones(num_classes)), dtype=np.float32).reshape(-1)
        if valid.shape != (num_classes,):
            raise ValueError(f"FedIRM: site '{self.ctx.site}': global_stats['{RELATION_VALID}'] has shape "
                             f"{valid.shape}; expected ({num_classes},)")
        return torch.as_tensor(matrix, device=device), torch.as_tensor(valid > 0.5, device=device)

    def _pseudo_labels(self, student_probs: torch.Tensor, reliable: torch.Tensor) -> torch.Tensor:
        """Reliable pseudo labels as 0/1 ``(N, C)``."""
        if self.multilabel:
            return ((student_probs > 0.5) & reliable & (student_probs >= self.min_confidence)).float()
        confidence, top = student_probs.max(dim=1)
        keep = reliable & (confidence >= self.min_confidence)
        return F.one_hot(top, student_probs.shape[1]).float() * keep.unsqueeze(1).float()

    def _train_unlabelled(self, model, inp: RoundInput, rng: np.random.Generator) -> RoundResult:
        if inp.round < self.unlabelled_start_round:
            return RoundResult(num_samples=0, metrics={"joined": 0.0})
        device = self.ctx.device
        task = MULTI_LABEL if self.multilabel else SINGLE_LABEL
        n = len(self.rows)
        num_classes = int(model.num_classes) if hasattr(model, "num_classes") else self.ctx.data.num_classes
        target, target_valid = self._received_relation(inp.global_stats, num_classes, device)
        if target is not None and not _dropout_modules(model) and not self._warned_no_dropout:
            self._warned_no_dropout = True
            self.ctx.log(f"FedIRM: site '{self.ctx.site}': the model has no dropout, so the MC-dropout "
                         "uncertainty is that of a single prediction (set the model's dropout > 0)")
        teacher = self.teacher_for(model)
        weight = self.max_unsupervised_weight * ramp_weight(inp.round, self.ramp_rounds)
        threshold = self.multilabel_entropy_threshold if self.multilabel else self.entropy_threshold
        reference = self.ctx.reference.splits["train"].labels if self.ctx.reference is not None else None
        optimizer = self._optimizer(model, ramp_weight(inp.round, self.ramp_rounds) if self.ramp_scales_lr else 1.0)
        model.train()
        teacher.model.train()  # dropout is the teacher's own perturbation, as in the mean teacher
        totals = {"loss": 0.0, "consistency": 0.0, "irm": 0.0, "pseudo": 0.0}
        steps, kept, seen, correct = 0, 0.0, 0.0, 0.0
        for _ in range(self.local_epochs):
            for idx in batch_indices(n, self.batch_size, rng, drop_last=True):
                if self.ctx.abort():
                    return RoundResult(num_samples=0, metrics={"aborted": 1.0})
                x = self.images.batch(idx)
                x_student = self._augment(x).to(device, non_blocking=True)
                x_teacher = self._augment(x).to(device, non_blocking=True)
                _, logits = model(x_student)
                with torch.no_grad():
                    _, teacher_logits = teacher.model(x_teacher)
                student_probs = probabilities(logits, task)
                loss_c = consistency_loss(student_probs, probabilities(teacher_logits, task))
                loss_irm = logits.sum() * 0.0
                loss_pseudo = logits.sum() * 0.0
                if target is not None:
                    mc = mc_dropout_probabilities(model, x_student, self.mc_passes, self.multilabel)
                    reliable, entropy = reliable_mask(mc, threshold, self.multilabel)
                    if self.reliable_fraction > 0 and self.reliable_per_class and not self.multilabel:
                        reliable = reliable_lowest_entropy_per_class(entropy, student_probs.detach().argmax(dim=1),
                                                                     self.reliable_fraction)
                    elif self.reliable_fraction > 0:
                        reliable = reliable_lowest_entropy(entropy, self.reliable_fraction)
                    pseudo = self._pseudo_labels(student_probs.detach(), reliable)
                    batch_matrix, batch_counts = relation_matrix(logits, pseudo, self.temperature, self.multilabel)
                    loss_irm = symmetric_kl(target, batch_matrix, (batch_counts > 0) & target_valid, self.multilabel)
                    if self.pseudo_label_weight > 0:
                        if self.multilabel:  # reliable entries, positive and negative
                            predicted, kept_entries = (student_probs.detach() > 0.5).float(), reliable
                        else:
                            predicted, kept_entries = pseudo, pseudo.sum(dim=1) > 0
                        loss_pseudo = pseudo_label_loss(logits, predicted, kept_entries, self.multilabel,
                                                        self.pseudo_label_balance)
                    kept += float(pseudo.sum())
                    seen += float(pseudo.shape[0] if not self.multilabel else pseudo.numel())
                    if reference is not None:  # diagnostics only: precision of the kept pseudo labels
                        truth = torch.as_tensor(reference[self.rows[idx]], dtype=torch.float32, device=device)
                        correct += float((pseudo * truth).sum())
                loss = weight * (loss_c + self.relation_weight * loss_irm + self.pseudo_label_weight * loss_pseudo)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                teacher.update(model)
                steps += 1
                totals["loss"] += float(loss.detach())
                totals["consistency"] += float(loss_c.detach())
                totals["irm"] += float(loss_irm.detach())
                totals["pseudo"] += float(loss_pseudo.detach())
        self._save_teacher(inp.round)
        metrics = {"train_loss": totals["loss"] / max(steps, 1),
                   "consistency_loss": totals["consistency"] / max(steps, 1),
                   "irm_loss": totals["irm"] / max(steps, 1), "pseudo_label_loss": totals["pseudo"] / max(steps, 1)}
        metrics.update({"train_steps": float(steps), "labelled": 0.0, "ramp_weight": weight,
                        "irm_active": float(target is not None)})
        if target is not None:
            metrics["reliable_fraction"] = kept / max(seen, 1.0)
            if reference is not None:
                metrics["pseudo_precision"] = correct / max(kept, 1.0)
        return RoundResult(num_samples=n, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# Server rule
# ---------------------------------------------------------------------------------------------
def weighted_by_label_status(updates: List[SiteUpdate], unlabelled_weight: float) -> List[SiteUpdate]:
    """``updates`` with each unlabelled site's (no relation matrix) sample count scaled by
    ``unlabelled_weight`` for the weight average; labelled sites keep theirs. With every labelled
    site gone (or weight 0 and no labelled site), the plain counts."""
    if unlabelled_weight == 1.0:
        return list(updates)
    scaled = [SiteUpdate(u.site, u.weights, u.num_samples if (u.stats or {}).get(RELATION_MATRIX) is not None
                         else u.num_samples * unlabelled_weight, u.stats, u.metrics) for u in updates]
    return scaled if any(u.num_samples > 0 for u in scaled) else list(updates)


class FedIRMServer(ServerRule):
    """FedAvg of the weights over all participating sites + average of the labelled sites'
    relation matrices, returned as ``global_stats`` (``relation_matrix``, ``relation_counts``,
    ``relation_valid``, ``relation_multilabel``) and so sent to every site with the next model.

    Why here and not in a FLARE Filter or shareable generator: the averaged matrix must come from
    exactly the updates the aggregator accepted this round (a filter sees each site's message
    alone, before acceptance, and cannot know which of them survive ``check_stats``), and it must
    travel as part of the global model's metadata so that the persistor's snapshots and a resumed
    run carry it together with the weights it belongs to. The server rule is the one place that
    sees both.

    Args:
        relation_weighting: ``sites`` (paper: plain mean over the labelled sites that saw the
            class) or ``counts`` (weighted by each site's class count).
        unlabelled_weight: factor on an unlabelled site's sample count in the weight average
            (1 = paper, plain FedAvg over all sites; with 8 unlabelled sites of 10 their consistency
            updates outweigh the labelled ones four to one, and 0.25 makes them even).
    """

    needs_classifier_names = True
    # the summed class counts; the averaged matrix (which the sites train with) stays
    summed_stats = (RELATION_COUNTS,)

    def __init__(self, relation_weighting: str = "sites", unlabelled_weight: float = 1.0):
        if not 0.0 <= float(unlabelled_weight) <= 1.0:
            raise ValueError(f"FedIRMServer unlabelled_weight must be in [0, 1], got {unlabelled_weight}")
        self.unlabelled_weight = float(unlabelled_weight)
        if relation_weighting not in RELATION_WEIGHTINGS:
            raise ValueError(f"FedIRMServer relation_weighting '{relation_weighting}' unknown; "
                             f"choose one of {RELATION_WEIGHTINGS}")
        self.relation_weighting = relation_weighting

    @staticmethod
    def _num_classes(ctx: ServerContext) -> Optional[int]:
        names = list(ctx.classifier_param_names or [])
        if names and names[0] in (ctx.global_weights or {}):
            return int(np.shape(ctx.global_weights[names[0]])[0])
        return None

    def check_stats(self, update: SiteUpdate, ctx: ServerContext) -> None:
        stats = update.stats or {}
        has_matrix, has_counts = RELATION_MATRIX in stats, RELATION_COUNTS in stats
        if not has_matrix and not has_counts:
            return  # an unlabelled site sends no statistics
        if not has_matrix or not has_counts:
            missing = RELATION_MATRIX if not has_matrix else RELATION_COUNTS
            raise ValueError(f"site '{update.site}': stats lack '{missing}' (a labelled site sends both "
                             f"'{RELATION_MATRIX}' and '{RELATION_COUNTS}')")
        matrix = np.asarray(stats[RELATION_MATRIX], dtype=np.float64)
        counts = np.asarray(stats[RELATION_COUNTS], dtype=np.float64)
        expected = self._num_classes(ctx) or (matrix.shape[0] if matrix.ndim == 2 else None)
        if matrix.ndim != 2 or matrix.shape != (expected, expected):
            raise ValueError(f"site '{update.site}': '{RELATION_MATRIX}' has shape {matrix.shape}, expected "
                             f"({expected}, {expected})")
        if not np.all(np.isfinite(matrix)) or matrix.min() < 0.0 or matrix.max() > 1.0:
            raise ValueError(f"site '{update.site}': '{RELATION_MATRIX}' has NaN/Inf or values outside [0, 1]")
        if counts.shape != (expected,):
            raise ValueError(f"site '{update.site}': '{RELATION_COUNTS}' has shape {counts.shape}, expected "
                             f"({expected},)")
        if not np.all(np.isfinite(counts)) or counts.min() < 0:
            raise ValueError(f"site '{update.site}': '{RELATION_COUNTS}' has NaN/Inf or negative values")
        multilabel = bool(stats.get(RELATION_MULTILABEL, 0))
        if not multilabel:
            row_sums = matrix.sum(axis=1)
            if not np.allclose(row_sums, 1.0, atol=1e-3):
                bad = int(np.argmax(np.abs(row_sums - 1.0)))
                raise ValueError(f"site '{update.site}': '{RELATION_MATRIX}' row {bad} sums to {row_sums[bad]:.4f}, "
                                 "not 1 (single-label rows are softmax distributions)")

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext) -> Tuple[Dict[str, np.ndarray], dict]:
        weighted = weighted_by_label_status(updates, self.unlabelled_weight)
        weights = average_weights(weighted, ctx)  # raises, naming the sites, when none has samples
        total = float(sum(u.num_samples for u in weighted if u.num_samples > 0))
        ctx.report["weights"] = {u.site: u.num_samples / total for u in weighted if u.num_samples > 0}
        labelled = [u for u in updates if (u.stats or {}).get(RELATION_MATRIX) is not None]
        if labelled:
            ctx.report["relation_counts"] = {u.site: np.asarray(u.stats.get(RELATION_COUNTS, [])).tolist()
                                             for u in labelled}
        previous = dict(ctx.global_stats or {})
        if not labelled:  # no labelled site this round: keep last round's matrix, if any
            kept = {k: previous[k] for k in (RELATION_MATRIX, RELATION_COUNTS, RELATION_VALID, RELATION_MULTILABEL)
                    if k in previous}
            return weights, kept
        flags = {bool(u.stats.get(RELATION_MULTILABEL, 0)) for u in labelled}
        if len(flags) > 1:
            raise ValueError("labelled sites disagree on single- vs multi-label relation matrices: "
                             + ", ".join(f"{u.site}={int(bool(u.stats.get(RELATION_MULTILABEL, 0)))}" for u in labelled))
        multilabel = flags.pop()
        num_classes = np.shape(labelled[0].stats[RELATION_MATRIX])[0]
        prev_matrix = previous.get(RELATION_MATRIX)
        if prev_matrix is not None and np.shape(prev_matrix) != (num_classes, num_classes):
            prev_matrix = None
        matrix, counts, valid = average_relation_matrices(
            [u.stats[RELATION_MATRIX] for u in labelled], [u.stats[RELATION_COUNTS] for u in labelled],
            self.relation_weighting, previous=prev_matrix,
            previous_valid=previous.get(RELATION_VALID) if prev_matrix is not None else None, multilabel=multilabel)
        ctx.log(f"FedIRM: relation matrix averaged over {len(labelled)} labelled site(s) "
                f"({', '.join(u.site for u in labelled)}); {int(valid.sum())}/{num_classes} classes valid")
        return weights, {RELATION_MATRIX: matrix, RELATION_COUNTS: counts, RELATION_VALID: valid,
                         RELATION_MULTILABEL: int(multilabel)}
