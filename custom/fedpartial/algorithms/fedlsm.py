"""FedLSM (Deng et al., MICCAI 2023): federated learning under label set mismatch.

Client (:class:`FedLSMClient`), every round, starting from the received global model:

1. Uncertainty estimation (UE): entropy of the global model's prediction for every local
   training sample (eval mode, no augmentation). Single-label: Shannon entropy of the softmax
   (paper Eq. 3). Multi-label: binary entropy over the site's *missing* classes only, averaged
   and divided by ln 2 so it lies in [0, 1] (the paper's form; the reference code averages
   ``-p log p`` over all classes instead).
2. Split by rank: lowest-entropy ``confident_fraction`` of the site = D_l, highest
   ``uncertain_fraction`` = D_h, the rest D_m (:func:`entropy_split`).
3. Teacher = EMA copy of the student (decay 0.999, updated after every step); both start from
   the global model each round. The teacher sees the weak view (flip), the student the strong view.
4. Each step, ``batch_size - ude_pairs`` samples from D_l ∪ D_m: loss on annotated classes
   (CE / class-weighted BCE) + pseudo-label loss on missing classes where the teacher is
   confident (single tau = 0.95; multi tau_p = 0.85, tau_n = 0.005, paper Table 4).
5. Uncertain Data Enhancing (UDE): ``ude_pairs`` confident samples MixUp-ed with ``ude_pairs``
   uncertain ones, lambda ~ Beta(0.2, 0.2); labels are ground truth on annotated classes and
   teacher pseudo labels elsewhere, with lower thresholds for the uncertain sample (single
   tau_l = 0.85; multi tau_lp = 0.7, tau_ln = 0.01). Weight lambda_UDE = 0.1. (The reference skin
   code never pseudo-labels these pairs because of a bug; this follows the paper.)
6. ``class_counts`` q_c (sent to the server): number of distinct training samples of D_l ∪ D_m
   seen this round that carried class c: a ground-truth positive when c is annotated, a
   confident positive pseudo label (at any visit of the round) when c is missing. This is the
   paper's ``q_c^k = sum_i y_hat_c^i`` over the site's data; the reference code instead adds up
   per-batch counts, which makes every site look the same size (same iterations per round).

Loss normalisation (as in the reference code, whose learning rate goes with it): per-sample
(single-label) or per-entry (multi-label) losses are summed over the selected entries and divided
by the number of samples (single) or samples x classes (multi) in the batch, so unselected
entries count as 0. ``loss_labelled + loss_pseudo`` is the loss of the pseudo-label batch.

Single-label pseudo labels (a design choice the paper leaves open): only samples whose label is
all 0 on the site's annotated classes ("unlabelled": their class is one of the missing classes)
get one; the teacher's full softmax must put its maximum, >= tau, on a *missing* class (paper
Eq. 4 sums the indicator over c in U_k only). A sample whose teacher argmax is an annotated class
contradicts its label ("none of my classes") and gets no pseudo label.

Multi-label class weighting: weight of positives of class c = #neg / #pos over annotated entries
of all sites (``pos_weight`` of BCE), from per-site counts ``label_pos`` / ``label_neg`` that the
server sums (first round: local counts). It applies to the annotated and pseudo-labelled entries
of the main loss, not to UDE (as in the reference code).

Ablations: ``use_ue=False`` puts every sample in D_l ∪ D_m, and UDE then mixes random pairs of the
whole site (first of a pair with the confident thresholds, second with the uncertain ones);
``use_ude=False`` drops the MixUp term (the whole batch is pseudo-label batch).

No per-site state outlives a round: split, teacher and optimiser are rebuilt from the received
global model every round (paper), and rounds are seeded by (seed, round, site), so a restarted
site reproduces the same round.

Server (:class:`AWPAServer`): everything but the classifier ("proxy") parameters by FedAvg over
data size; row c of each classifier parameter (weight row, bias entry) by q_c^k / sum_j q_c^j
(AWPA, paper Eq. 7), falling back to FedAvg for a class with zero count everywhere.
``use_awpa=False`` is the paper's "w/o AWPA" ablation (Table 3, marked *): *masked* aggregation of
the proxies, i.e. row c averaged by data size over the sites that annotate c (FedAvg when none
does). ``without_awpa="fedavg"`` gives plain FedAvg of the rows instead.

Departures from the paper and reference code:
    * The teacher's weak view flips each image on both axes with p = 0.5 (``flip_batch``); the
      paper says "flip" without an axis and the usual weak view of its code base is a horizontal
      flip only. A vertical flip is natural for dermoscopy, less so for chest X-rays.
    * By default each site's result filter withholds a class count below 5
      (``StatisticsPrivacyFilter``, preset ``fedlsm``, ``min_count`` 5 in the jobs): that class then
      takes no part in the site's AWPA row weight, as a class the site never saw.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from fedpartial.algorithms.aggregation import average_classifier_rows, average_weights, capped_counts
from fedpartial.algorithms.base import ClientRule, RoundInput, RoundResult, ServerContext, ServerRule, SiteUpdate
from fedpartial.data.transforms import flip_batch, make_view
from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, DataError
from fedpartial.training.common import (EMATeacher, ImageSource, iteration_batches, probabilities, round_seed,
                                        seed_everything)
from fedpartial.training.losses import class_statistics, pos_weight_from_counts  # noqa: F401 (this module's API)

# Reference defaults (per site): skin 200 / 50 of ~1400 images, chest 2000 / 500 of ~9500.
DEFAULT_CONFIDENT_FRACTION = {SINGLE_LABEL: 200 / 1400, MULTI_LABEL: 2000 / 9500}
DEFAULT_UNCERTAIN_FRACTION = {SINGLE_LABEL: 50 / 1400, MULTI_LABEL: 500 / 9500}
DEFAULT_LOCAL_ITERATIONS = {SINGLE_LABEL: 30, MULTI_LABEL: 200}
STRONG_VIEWS = ("strong", "strong-per-sample", "weak", "flip", "none")

#: What the client rule sends in ``site_stats`` and what a site's privacy filter
#: (``fedpartial.flare.filters.StatisticsPrivacyFilter``) needs to guard it, by preset name.
#: ``keys``: every key sent; ``signature``: the keys that identify the method's statistics;
#: ``guards``: statistic -> the count key saying from how many images each row (or a scalar) was
#: computed; ``fill``: what a withheld row becomes (the value the server rule reads as "absent");
#: ``clip``: allowed range after noise; ``normalise_rows``: keys whose rows sum to 1.
#: Per-class counts of confident positives (AWPA row weights) and annotated positives / negatives;
#: ``annotated_classes`` says which classes the site annotates (no sample value).
SENT_STATISTICS = {
    "fedlsm": {"keys": ["class_counts", "label_pos", "label_neg", "annotated_classes"],
               "signature": ["class_counts", "label_pos", "label_neg"],
               "guards": {"class_counts": "class_counts", "label_pos": "label_pos", "label_neg": "label_neg"},
               "clip": {"class_counts": [0, math.inf], "label_pos": [0, math.inf], "label_neg": [0, math.inf]}},
}
#: What the client rule returns in ``metrics`` (sent as ``site_metrics``) and when a site's result
#: policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
#: Pseudo-label counts are over the (sample, class) entries of this round; the precision / recall
#: diagnostics exist only with reference labels.
SENT_METRICS = {
    "fedlsm": {"loss": "scope", "loss_labelled": "scope", "loss_pseudo": "scope", "loss_ude": "scope",
               "ude_valid_pairs": "scope", "mean_entropy": "scope", "train_steps": "scope",
               "pseudo_labels_per_step": "count", "n_confident": "count", "n_uncertain": "count",
               "num_pseudo_positive": "count", "num_pseudo_negative": "count", "samples_seen": "count",
               "global_stats_received": "value",
               "pseudo_precision": "rate:num_pseudo_positive", "pseudo_neg_precision": "rate:num_pseudo_negative",
               "pseudo_recall": "local"},
}


# ----------------------------------------------------------------------------- pure helpers
def sample_entropy(probs: torch.Tensor, label_mask: torch.Tensor, task: str) -> torch.Tensor:
    """Per-sample uncertainty of the global model's prediction.

    Args:
        probs: ``(N, C)`` softmax (single-label) or sigmoid (multi-label) probabilities.
        label_mask: ``(N, C)`` 1 where the entry is annotated (used for multi-label only).
        task: ``single-label`` or ``multi-label``.

    Returns:
        ``(N,)``: single-label ``-sum_c p_c ln p_c`` (nats); multi-label the mean binary entropy
        over the sample's missing classes divided by ln 2, in [0, 1] (0 when none is missing).
    """
    p = probs.double()
    if task == SINGLE_LABEL:
        return torch.special.entr(p).sum(dim=1).to(probs.dtype)
    missing = (label_mask < 0.5).double()
    binary = (torch.special.entr(p) + torch.special.entr(1.0 - p)) / math.log(2.0)
    n_missing = missing.sum(dim=1)
    return ((binary * missing).sum(dim=1) / n_missing.clamp_min(1.0)).to(probs.dtype)


def split_counts(n: int, confident_fraction: float, uncertain_fraction: float) -> Tuple[int, int]:
    """Sizes of D_l and D_h of :func:`entropy_split` for ``n`` samples: ``round(fraction * n)``
    each, D_h at most what D_l leaves."""
    n_conf = min(n, int(round(confident_fraction * n)))
    return n_conf, min(n - n_conf, int(round(uncertain_fraction * n)))


def round_iterations(pool: int, pool_batch: int, local_epochs: Optional[float], local_iterations: int) -> int:
    """Steps of a FedLSM round: ``local_iterations``, or with ``local_epochs`` as many as that many
    epochs of ``pool_batch`` over the ``pool`` samples of D_l ∪ D_m (at least one); 0 with no pool."""
    if pool <= 0:
        return 0
    if local_epochs is None:
        return int(local_iterations)
    return max(1, math.ceil(local_epochs * pool / pool_batch))


def entropy_split(entropy, confident_fraction: float, uncertain_fraction: float
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split samples by entropy rank into confident (lowest), medium and uncertain (highest).

    Counts are ``round(fraction * N)``; ties are broken by sample index (stable sort), so the
    split is deterministic.

    Args:
        entropy: ``(N,)`` per-sample entropy (tensor or array).
        confident_fraction: share of samples in D_l, in [0, 1].
        uncertain_fraction: share of samples in D_h, in [0, 1]; the two must sum to <= 1.

    Returns:
        ``(confident_idx, medium_idx, uncertain_idx)``, each sorted ascending.
    """
    if not (0.0 <= confident_fraction <= 1.0 and 0.0 <= uncertain_fraction <= 1.0):
        raise ValueError(f"confident_fraction ({confident_fraction}) and uncertain_fraction "
                         f"({uncertain_fraction}) must lie in [0, 1]")
    if confident_fraction + uncertain_fraction > 1.0 + 1e-9:
        raise ValueError(f"confident_fraction + uncertain_fraction = {confident_fraction + uncertain_fraction} > 1")
    values = np.asarray(entropy.detach().cpu() if isinstance(entropy, torch.Tensor) else entropy, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)):
        raise ValueError("entropy must be a finite 1-D array")
    n = values.shape[0]
    n_conf, n_unc = split_counts(n, confident_fraction, uncertain_fraction)
    order = np.argsort(values, kind="stable")
    confident = np.sort(order[:n_conf])
    uncertain = np.sort(order[n - n_unc:]) if n_unc > 0 else np.empty(0, dtype=np.int64)
    medium = np.sort(order[n_conf:n - n_unc])
    return confident, medium, uncertain


def single_label_pseudo_labels(probs: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, tau: float,
                               renormalise_missing: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets for single-label samples: the true class of labelled samples, the teacher's
    pseudo label for unlabelled ones (class max-prob >= ``tau`` and a missing class).

    Args:
        probs: ``(N, C)`` teacher softmax.
        labels: ``(N, C)`` one-hot on the annotated classes, all 0 for an unlabelled sample.
        label_mask: ``(N, C)`` 1 on the site's annotated classes.
        tau: confidence threshold on the teacher's max probability.
        renormalise_missing: compare ``tau`` with the teacher's probability *given* that the sample
            is of a missing class (softmax mass of the annotated classes removed, the rest rescaled
            to 1), which is what the site's label ("none of my classes") says. False = paper: the
            full softmax.

    Returns:
        ``(target_index (N,), has_target (N,) bool, is_pseudo (N,) bool)``; ``target_index`` is
        meaningful only where ``has_target``.
    """
    known = labels * label_mask
    labelled = (known > 0.5).any(dim=1)
    if renormalise_missing:
        missing_mass = probs * (1.0 - label_mask)
        probs = missing_mass / missing_mass.sum(dim=1, keepdim=True).clamp_min(1e-12)
    max_prob, arg = probs.max(dim=1)
    arg_is_missing = label_mask.gather(1, arg[:, None])[:, 0] < 0.5
    is_pseudo = (~labelled) & (max_prob >= tau) & arg_is_missing
    target = torch.where(labelled, known.argmax(dim=1), arg)
    return target, labelled | is_pseudo, is_pseudo


def multilabel_pseudo_labels(probs: torch.Tensor, label_mask: torch.Tensor, tau_p: float, tau_n: float
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pseudo labels on the missing entries of multi-label samples.

    Args:
        probs: ``(N, C)`` teacher sigmoid probabilities.
        label_mask: ``(N, C)`` 1 where annotated (those entries never get a pseudo label).
        tau_p: positive if prob >= tau_p.
        tau_n: negative if prob <= tau_n.

    Returns:
        ``(targets, mask)``, both float ``(N, C)``: targets 1 / 0 where ``mask`` is 1.
    """
    if tau_n >= tau_p:
        raise ValueError(f"tau_n ({tau_n}) must be below tau_p ({tau_p})")
    missing = label_mask < 0.5
    pos = missing & (probs >= tau_p)
    neg = missing & (probs <= tau_n)
    return pos.to(probs.dtype), (pos | neg).to(probs.dtype)


def mixup(x_a: torch.Tensor, y_a: torch.Tensor, x_b: torch.Tensor, y_b: torch.Tensor, lam: float
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MixUp (paper Eq. 6): ``lam * a + (1 - lam) * b`` for inputs and (soft) labels.

    Args:
        x_a, y_a: confident samples and their labels.
        x_b, y_b: uncertain samples and their labels (same shapes).
        lam: mixing weight in [0, 1].
    """
    if x_a.shape != x_b.shape or y_a.shape != y_b.shape:
        raise ValueError(f"mixup needs equal shapes, got {tuple(x_a.shape)}/{tuple(x_b.shape)} and "
                         f"{tuple(y_a.shape)}/{tuple(y_b.shape)}")
    return lam * x_a + (1.0 - lam) * x_b, lam * y_a + (1.0 - lam) * y_b


# ----------------------------------------------------------------------------- client
class FedLSMClient(ClientRule):
    """FedLSM local training (see the module docstring).

    Args:
        lr: Adam learning rate.
        betas: Adam betas.
        weight_decay: Adam weight decay.
        batch_size: total samples per step, UDE pairs included (64).
        ude_pairs: MixUp pairs per step (4).
        local_iterations: steps per round; None = 30 (single-label) / 200 (multi-label), the
            paper's values (about 1.3 passes over a reference site's D_l ∪ D_m).
        local_epochs: alternative to ``local_iterations`` for sites much smaller than the paper's:
            steps = ceil(local_epochs * |D_l ∪ D_m| / (batch_size - ude_pairs)). Set at most one.
        confident_fraction: share of the site in D_l; None = 200/1400 (single) / 2000/9500 (multi).
        uncertain_fraction: share of the site in D_h; None = 50/1400 (single) / 500/9500 (multi).
        ema_decay: teacher EMA decay.
        tau: single-label pseudo-label threshold (D_l ∪ D_m and the confident UDE sample).
        tau_l: single-label threshold for the uncertain UDE sample.
        tau_p, tau_n: multi-label positive / negative thresholds (D_l ∪ D_m, confident UDE sample).
        tau_lp, tau_ln: multi-label thresholds for the uncertain UDE sample.
        lambda_ude: weight of the UDE loss.
        mixup_alpha: Beta(alpha, alpha) for the MixUp weight.
        use_ue: uncertainty split on (off: all samples in D_l ∪ D_m).
        use_ude: UDE MixUp term on.
        class_weighted_bce: multi-label: #neg/#pos positive weights.
        max_pos_weight: optional cap on those weights (None: no cap).
        strong_view: student view: ``strong`` (batched MONAI affine + blur/noise/sharpen), ``strong-per-sample`` (the MONAI Compose pipeline per sample, slower), ``weak``, ``flip``, ``none``.
        eval_batch_size: batch size of the uncertainty pass.
        renormalise_missing: single-label: threshold the teacher's probability conditioned on the
            sample being of a missing class (see :func:`single_label_pseudo_labels`); False = paper.
    """

    # class_weighted_bce / max_pos_weight are imbalance handling any FedAvg site can have: recipe (the
    # baseline weights by its own counts; FedLSM by the server's sums from the second round)
    CONTRIBUTION = frozenset({
        "ude_pairs", "confident_fraction", "uncertain_fraction", "ema_decay", "tau", "tau_l", "tau_p", "tau_n", "tau_lp",
        "tau_ln", "lambda_ude", "mixup_alpha", "use_ue", "use_ude", "eval_batch_size", "renormalise_missing"})
    # the student's view is what the labelled loss sees: the baselines' augmentation
    RECIPE_NAMES = {"strong_view": "augmentation"}
    # every row is a sample (num_samples = the site's train size)
    WEIGHT_BY = "all_rows"

    def __init__(self, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 5e-4, batch_size: int = 64,
                 ude_pairs: int = 4, local_iterations: Optional[int] = None, local_epochs: Optional[float] = None,
                 confident_fraction: Optional[float] = None, uncertain_fraction: Optional[float] = None,
                 ema_decay: float = 0.999, tau: float = 0.95, tau_l: float = 0.85, tau_p: float = 0.85,
                 tau_n: float = 0.005, tau_lp: float = 0.7, tau_ln: float = 0.01, lambda_ude: float = 0.1,
                 mixup_alpha: float = 0.2, use_ue: bool = True, use_ude: bool = True,
                 class_weighted_bce: bool = True, max_pos_weight: Optional[float] = None,
                 strong_view: str = "strong", eval_batch_size: int = 256, renormalise_missing: bool = False):
        if strong_view not in STRONG_VIEWS:
            raise ValueError(f"strong_view '{strong_view}' unknown; choose one of {STRONG_VIEWS}")
        if batch_size < 1 or ude_pairs < 0 or (use_ude and ude_pairs >= batch_size):
            raise ValueError(f"need batch_size >= 1 and 0 <= ude_pairs < batch_size, got {batch_size} / {ude_pairs}")
        if local_iterations is not None and local_iterations < 1:
            raise ValueError(f"local_iterations must be >= 1, got {local_iterations}")
        if local_epochs is not None and (local_epochs <= 0 or local_iterations is not None):
            raise ValueError(f"local_epochs must be > 0 and excludes local_iterations, got local_epochs={local_epochs}"
                             f" local_iterations={local_iterations}")
        for name, value in (("tau", tau), ("tau_l", tau_l), ("tau_p", tau_p), ("tau_n", tau_n),
                            ("tau_lp", tau_lp), ("tau_ln", tau_ln)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        if tau_n >= tau_p or tau_ln >= tau_lp:
            raise ValueError(f"negative thresholds must be below positive ones: tau_n={tau_n} tau_p={tau_p} "
                             f"tau_ln={tau_ln} tau_lp={tau_lp}")
        if mixup_alpha <= 0:
            raise ValueError(f"mixup_alpha must be > 0, got {mixup_alpha}")
        self.lr, self.betas, self.weight_decay = float(lr), tuple(betas), float(weight_decay)
        self.batch_size, self.ude_pairs = int(batch_size), int(ude_pairs)
        self.local_iterations, self.local_epochs = local_iterations, local_epochs
        self.confident_fraction, self.uncertain_fraction = confident_fraction, uncertain_fraction
        self.ema_decay = float(ema_decay)
        self.tau, self.tau_l = tau, tau_l
        self.tau_p, self.tau_n, self.tau_lp, self.tau_ln = tau_p, tau_n, tau_lp, tau_ln
        self.lambda_ude, self.mixup_alpha = float(lambda_ude), float(mixup_alpha)
        self.use_ue, self.use_ude = bool(use_ue), bool(use_ude)
        self.class_weighted_bce, self.max_pos_weight = bool(class_weighted_bce), max_pos_weight
        self.strong_view = strong_view
        self.eval_batch_size = int(eval_batch_size)
        self.renormalise_missing = bool(renormalise_missing)

    # -- setup -------------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        super().setup(ctx)
        data = ctx.data
        if data.task not in (SINGLE_LABEL, MULTI_LABEL):
            raise DataError(f"FedLSM needs single-label or multi-label data; {data.where()} is '{data.task}'")
        train = data.splits.get("train")
        if train is None or len(train) == 0:
            raise DataError(f"{data.where()} has no training samples")
        c = data.num_classes
        labels = np.asarray(train.labels, dtype=np.float32)
        if labels.shape != (len(train), c):
            raise DataError(f"{data.where()}: train_labels shape {labels.shape}, expected {(len(train), c)}")
        if train.label_mask is None:
            raise DataError(f"{data.where()}: train_label_mask is missing (FedLSM needs to know the annotated classes)")
        mask = np.asarray(train.label_mask).astype(bool)
        if mask.shape != labels.shape:
            raise DataError(f"{data.where()}: train_label_mask shape {mask.shape} differs from "
                            f"train_labels {labels.shape}")
        if np.any(labels[~mask] > 0.5):
            raise DataError(f"{data.where()}: train_labels has positives on unannotated entries (label_mask 0)")
        self.task = data.task
        self.num_classes = c
        self.images = ImageSource(train.images, ctx.normalisation)  # uint8, read batch by batch
        self.labels = torch.from_numpy(labels)
        self.label_mask = torch.from_numpy(mask.astype(np.float32))
        self.label_pos, self.label_neg = class_statistics(labels, mask)
        self.annotated_classes = mask.any(axis=0).astype(np.float64)
        self.conf_frac, self.unc_frac, self.iterations = self._task_settings(self.task)
        self._pipeline = None
        self.reference_labels = None
        if ctx.reference is not None:
            ref = np.asarray(ctx.reference.splits["train"].labels, dtype=np.float32)
            if ref.shape != labels.shape:
                raise DataError(f"reference labels of site '{ctx.site}' have shape {ref.shape}, "
                                f"the site's train labels {labels.shape}")
            self.reference_labels = torch.from_numpy(ref)

    def _task_settings(self, task: str) -> Tuple[float, float, int]:
        """(confident fraction, uncertain fraction, local iterations) for ``task``: the constructor's,
        or the paper's per-task defaults."""
        conf = DEFAULT_CONFIDENT_FRACTION[task] if self.confident_fraction is None else float(self.confident_fraction)
        unc = DEFAULT_UNCERTAIN_FRACTION[task] if self.uncertain_fraction is None else float(self.uncertain_fraction)
        entropy_split(np.zeros(1), conf, unc)  # validates the fractions
        iterations = DEFAULT_LOCAL_ITERATIONS[task] if self.local_iterations is None else int(self.local_iterations)
        return conf, unc, iterations

    def _pool(self, n: int, conf_frac: float, unc_frac: float) -> Tuple[int, int]:
        """(samples of D_l ∪ D_m, pool samples per step) at a site of ``n`` samples."""
        if not self.use_ue:
            return n, self.batch_size - (self.ude_pairs if self.use_ude and self.ude_pairs > 0 and n > 0 else 0)
        n_conf, n_unc = split_counts(n, conf_frac, unc_frac)
        do_ude = self.use_ude and self.ude_pairs > 0 and n_conf > 0 and n_unc > 0
        return n - n_unc, self.batch_size - (self.ude_pairs if do_ude else 0)

    def round_steps(self, data) -> int:
        n = len(data.splits["train"])
        conf_frac, unc_frac, iterations = self._task_settings(data.task)
        return round_iterations(*self._pool(n, conf_frac, unc_frac), self.local_epochs, iterations)

    def _reset_view(self, seed: int) -> None:
        """(Re)build the student's view with a per-round seed (repeatable rounds)."""
        if self.strong_view in ("strong", "weak", "strong-per-sample"):
            self._pipeline = make_view(self.strong_view, seed=seed)

    def _student_view(self, x: torch.Tensor) -> torch.Tensor:
        if self.strong_view == "flip":
            return flip_batch(x)
        return x if self._pipeline is None else self._pipeline(x)

    def _pos_weight(self, global_stats) -> Optional[torch.Tensor]:
        if self.task != MULTI_LABEL or not self.class_weighted_bce:
            return None
        if "pos_weight" in global_stats:
            weight = np.asarray(global_stats["pos_weight"], dtype=np.float64)
            if weight.shape != (self.num_classes,) or not np.all(np.isfinite(weight)) or np.any(weight <= 0):
                raise ValueError(f"site '{self.ctx.site}': global stat 'pos_weight' must be {self.num_classes} "
                                 f"positive finite values, got {weight}")
            if self.max_pos_weight:
                weight = np.minimum(weight, self.max_pos_weight)
        else:  # first round: only the local counts are known
            weight = pos_weight_from_counts(self.label_pos, self.label_neg, self.max_pos_weight)
        return torch.as_tensor(weight, dtype=torch.float32, device=self.ctx.device)

    # -- targets ---------------------------------------------------------------------------
    def _targets(self, probs, labels, mask, tau_pos, tau_neg):
        """(targets (N,C) float, entry/sample selection, pseudo-positive (N,C) bool, pseudo-neg (N,C) bool)."""
        if self.task == SINGLE_LABEL:
            target, has_target, is_pseudo = single_label_pseudo_labels(probs, labels, mask, tau_pos,
                                                                       self.renormalise_missing)
            onehot = F.one_hot(target, self.num_classes).to(probs.dtype)
            pseudo_pos = onehot.bool() & is_pseudo[:, None]
            return onehot, has_target, pseudo_pos, torch.zeros_like(pseudo_pos)
        pseudo, pmask = multilabel_pseudo_labels(probs, mask, tau_pos, tau_neg)
        targets = torch.where(mask > 0.5, labels, pseudo)
        selected = (mask > 0.5) | (pmask > 0.5)
        pseudo_pos = (pmask > 0.5) & (pseudo > 0.5)
        return targets, selected, pseudo_pos, (pmask > 0.5) & (pseudo < 0.5)

    # -- one round -------------------------------------------------------------------------
    def train_round(self, model, inp: RoundInput) -> RoundResult:
        ctx, device = self.ctx, self.ctx.device
        n, c = len(self.images), self.num_classes
        seed = round_seed(ctx.seed, ctx.site, inp.round)
        seed_everything(seed)
        rng = np.random.default_rng(seed)
        self._reset_view(seed)

        # 1-2. Uncertainty of the received global model, split by rank.
        logits = self.images.predict(model, device, batch_size=self.eval_batch_size)
        entropy = sample_entropy(probabilities(logits, self.task), self.label_mask, self.task)
        if self.use_ue:
            confident, medium, uncertain = entropy_split(entropy, self.conf_frac, self.unc_frac)
            pool = np.union1d(confident, medium)
        else:
            pool = confident = uncertain = np.arange(n)
        do_ude = self.use_ude and self.ude_pairs > 0 and len(confident) > 0 and len(uncertain) > 0
        pool_batch = self.batch_size - (self.ude_pairs if do_ude else 0)
        # the count round_steps states (what a compute-matched baseline makes)
        iterations = round_iterations(len(pool), pool_batch, self.local_epochs, self.iterations)

        # 3. Teacher and student both start from the global model.
        teacher = EMATeacher(model, self.ema_decay)
        teacher.model.eval()
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        pos_weight = self._pos_weight(inp.global_stats)

        seen = torch.zeros(n, dtype=torch.bool)
        ever_pos = torch.zeros(n, c, dtype=torch.bool)      # ground-truth or pseudo positive this round
        ever_pseudo_pos = torch.zeros(n, c, dtype=torch.bool)
        ever_pseudo_neg = torch.zeros(n, c, dtype=torch.bool)
        sums = {"loss": 0.0, "loss_labelled": 0.0, "loss_pseudo": 0.0, "loss_ude": 0.0,
                "pseudo_labels_per_step": 0.0, "ude_valid_pairs": 0.0}
        steps = 0
        pool_iter = iteration_batches(len(pool), pool_batch, iterations, rng) if len(pool) else iter(())
        conf_iter = iteration_batches(len(confident), self.ude_pairs, iterations, rng) if do_ude else None
        unc_iter = iteration_batches(len(uncertain), self.ude_pairs, iterations, rng) if do_ude else None
        for batch in pool_iter:
            if ctx.abort():
                break
            idx = torch.as_tensor(pool[batch], dtype=torch.long)
            x = self.images.batch(idx)
            labels, mask = self.labels[idx].to(device), self.label_mask[idx].to(device)
            teacher_in = [flip_batch(x)]  # teacher: weak view of the pool batch
            if do_ude:
                ci = torch.as_tensor(confident[next(conf_iter)], dtype=torch.long)
                ui = torch.as_tensor(uncertain[next(unc_iter)], dtype=torch.long)
                m = min(len(ci), len(ui))
                ci, ui = ci[:m], ui[:m]
                # reference code: the MixUp pair is taken without augmentation
                xc_cpu, xu_cpu = self.images.batch(ci), self.images.batch(ui)
                xc, xu = xc_cpu.to(device), xu_cpu.to(device)
                teacher_in += [xc_cpu, xu_cpu]
            with torch.no_grad():  # one eval-mode teacher pass for the pool batch and the pairs
                t_all = probabilities(teacher.model(torch.cat(teacher_in).to(device))[1].float(), self.task)
            b = len(idx)
            targets, selected, p_pos, p_neg = self._targets(t_all[:b], labels, mask, *self._thresholds(uncertain=False))
            inputs = [self._student_view(x).to(device)]

            mix = None
            if do_ude:
                tc, tu = t_all[b:b + m], t_all[b + m:]
                yc, sel_c, _, _ = self._targets(tc, self.labels[ci].to(device), self.label_mask[ci].to(device),
                                                *self._thresholds(uncertain=False))
                yu, sel_u, _, _ = self._targets(tu, self.labels[ui].to(device), self.label_mask[ui].to(device),
                                                *self._thresholds(uncertain=True))
                lam = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
                x_mix, y_mix = mixup(xc, yc, xu, yu, lam)
                mix = (y_mix, sel_c & sel_u, m)
                inputs.append(x_mix)

            out = model(torch.cat(inputs))[1]
            logits_pool = out[:len(idx)]
            if self.task == SINGLE_LABEL:
                ce = F.cross_entropy(logits_pool, targets.argmax(dim=1), reduction="none")
                is_pseudo = p_pos.any(dim=1)
                loss_lab = (ce * (selected & ~is_pseudo)).sum() / len(idx)
                loss_pse = (ce * is_pseudo).sum() / len(idx)
            else:
                bce = F.binary_cross_entropy_with_logits(logits_pool, targets, reduction="none", pos_weight=pos_weight)
                loss_lab = (bce * mask).sum() / (len(idx) * c)
                loss_pse = (bce * (selected & (mask < 0.5))).sum() / (len(idx) * c)
            loss_ude = logits_pool.new_zeros(())
            if mix is not None:
                y_mix, valid, m = mix
                logits_mix = out[len(idx):]
                if self.task == SINGLE_LABEL:
                    soft_ce = -(y_mix * F.log_softmax(logits_mix, dim=1)).sum(dim=1)
                    loss_ude = (soft_ce * valid).sum() / m
                else:
                    bce_mix = F.binary_cross_entropy_with_logits(logits_mix, y_mix, reduction="none")
                    loss_ude = (bce_mix * valid).sum() / (m * c)
                sums["ude_valid_pairs"] += float(valid.float().mean())  # share of pairs / entries with a label
            loss = loss_lab + loss_pse + self.lambda_ude * loss_ude

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            teacher.update(model)

            # q_c bookkeeping on distinct samples.
            gt_pos = ((labels > 0.5) & (mask > 0.5)).cpu()
            seen[idx] = True
            ever_pos[idx] |= gt_pos | p_pos.cpu()
            ever_pseudo_pos[idx] |= p_pos.cpu()
            ever_pseudo_neg[idx] |= p_neg.cpu()
            steps += 1
            for key, value in (("loss", loss), ("loss_labelled", loss_lab), ("loss_pseudo", loss_pse),
                               ("loss_ude", loss_ude)):
                sums[key] += float(value.detach())
            sums["pseudo_labels_per_step"] += float(p_pos.sum() + p_neg.sum())

        class_counts = ever_pos[seen].sum(dim=0).double().numpy()
        metrics = {k: v / max(steps, 1) for k, v in sums.items()}
        metrics.update({
            "train_steps": float(steps), "n_confident": float(len(confident) if self.use_ue else 0),
            "n_uncertain": float(len(uncertain) if self.use_ue else 0), "mean_entropy": float(entropy.mean()),
            "num_pseudo_positive": float(ever_pseudo_pos.sum()), "num_pseudo_negative": float(ever_pseudo_neg.sum()),
            "samples_seen": float(seen.sum()),
            # 1 once the server's statistics came back (round >= 1): the stats made the round trip.
            "global_stats_received": float("pos_weight" in inp.global_stats),
        })
        if self.reference_labels is not None:
            metrics.update(pseudo_label_quality(ever_pseudo_pos, ever_pseudo_neg, self.reference_labels,
                                                self.label_mask, seen))
        stats = {"class_counts": class_counts, "label_pos": self.label_pos.copy(), "label_neg": self.label_neg.copy(),
                 "annotated_classes": self.annotated_classes.copy()}
        return RoundResult(num_samples=int(n), stats=stats, metrics=metrics)

    def _thresholds(self, uncertain: bool) -> Tuple[float, float]:
        if self.task == SINGLE_LABEL:
            return (self.tau_l if uncertain else self.tau), 0.0
        return (self.tau_lp, self.tau_ln) if uncertain else (self.tau_p, self.tau_n)


def pseudo_label_quality(pseudo_pos: torch.Tensor, pseudo_neg: torch.Tensor, true_labels: torch.Tensor,
                         label_mask: torch.Tensor, seen: torch.Tensor) -> Dict[str, float]:
    """Diagnostics against the hidden complete labels (only when the job enables them).

    Args:
        pseudo_pos: ``(N, C)`` bool, entries given a positive pseudo label this round.
        pseudo_neg: ``(N, C)`` bool, entries given a negative pseudo label (multi-label).
        true_labels: ``(N, C)`` complete labels.
        label_mask: ``(N, C)`` 1 where annotated.
        seen: ``(N,)`` samples trained on this round.

    Returns:
        ``pseudo_precision`` (correct positive pseudo labels / positive pseudo labels),
        ``pseudo_recall`` (correct / true positives on missing entries of the seen samples) and,
        when negatives were given, ``pseudo_neg_precision``.
    """
    truth = true_labels > 0.5
    missing = (label_mask < 0.5) & seen[:, None]
    n_pos = int(pseudo_pos.sum())
    correct = int((pseudo_pos & truth).sum())
    out = {"pseudo_precision": correct / n_pos if n_pos else 0.0,
           "pseudo_recall": correct / max(int((truth & missing).sum()), 1)}
    n_neg = int(pseudo_neg.sum())
    if n_neg:
        out["pseudo_neg_precision"] = int((pseudo_neg & ~truth).sum()) / n_neg
    return out


# ----------------------------------------------------------------------------- server
class AWPAServer(ServerRule):
    """FedAvg for the feature extractor, AWPA for the classifier rows (paper Sec. 2.4).

    Args:
        use_awpa: rows weighted by the sites' ``class_counts``; False = the paper's "w/o AWPA" ablation.
        without_awpa: what ``use_awpa=False`` does with the rows: ``masked`` (paper Table 3:
            average over the sites annotating the class) or ``fedavg``.
        max_pos_weight: optional cap on the global multi-label positive weights (None: none).
    """

    needs_classifier_names = True
    # sums over sites; pos_weight (their ratio, which the sites train with) stays
    summed_stats = ("class_counts", "label_pos", "label_neg")

    def __init__(self, use_awpa: bool = True, without_awpa: str = "masked", max_pos_weight: Optional[float] = None):
        if without_awpa not in ("masked", "fedavg"):
            raise ValueError(f"without_awpa '{without_awpa}' unknown; choose 'masked' or 'fedavg'")
        self.use_awpa, self.without_awpa, self.max_pos_weight = bool(use_awpa), without_awpa, max_pos_weight

    @staticmethod
    def _num_classes(update: SiteUpdate, ctx: ServerContext) -> int:
        if not ctx.classifier_param_names:
            raise ValueError("server context names no classifier parameters (classifier_param_names is empty)")
        name = ctx.classifier_param_names[0]
        source = update.weights if name in update.weights else ctx.global_weights
        if name not in source:
            raise ValueError(f"site '{update.site}' sent no classifier parameter '{name}'")
        return int(np.shape(source[name])[0])

    def check_stats(self, update: SiteUpdate, ctx: ServerContext) -> None:
        c = self._num_classes(update, ctx)
        required = ["class_counts"] if self.use_awpa else []
        if not self.use_awpa and self.without_awpa == "masked":
            required.append("annotated_classes")
        for key in ("class_counts", "label_pos", "label_neg", "annotated_classes"):
            if key not in update.stats:
                if key in required:
                    raise ValueError(f"site '{update.site}': statistic '{key}' is missing")
                continue
            value = np.asarray(update.stats[key], dtype=np.float64)
            if value.shape != (c,):
                raise ValueError(f"site '{update.site}': statistic '{key}' has shape {value.shape}, expected ({c},)")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"site '{update.site}': statistic '{key}' has NaN or Inf")
            if np.any(value < 0):
                raise ValueError(f"site '{update.site}': statistic '{key}' has negative values")

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext):
        weights = average_weights(updates, ctx)  # feature extractor, BN buffers, and the fallback rows
        used = [u for u in updates if u.num_samples > 0]
        sizes = np.array([u.num_samples for u in used], dtype=np.float64)
        self._num_classes(used[0], ctx)  # raises when the context names no classifier parameter
        if self.use_awpa:
            row_weights = np.stack([capped_counts(u, "class_counts", ctx) for u in used])
        elif self.without_awpa == "masked":
            row_weights = np.stack([np.asarray(u.stats["annotated_classes"], dtype=np.float64) > 0.5
                                    for u in used]) * sizes[:, None]
        else:
            row_weights = None
        if row_weights is not None:
            weights.update(average_classifier_rows(used, row_weights, ctx.classifier_param_names))
            totals = row_weights.sum(axis=0)
            shares = np.divide(row_weights, totals, out=np.zeros_like(row_weights), where=totals > 0)
            ctx.report["class_row_weights"] = {u.site: shares[i].tolist() for i, u in enumerate(used)}
        stats = {}
        # annotated counts cannot exceed the site's samples: capped like the class counts
        pos = [capped_counts(u, "label_pos", ctx) for u in updates if "label_pos" in u.stats]
        neg = [capped_counts(u, "label_neg", ctx) for u in updates if "label_neg" in u.stats]
        if pos and neg and len(pos) == len(neg):
            stats["label_pos"], stats["label_neg"] = np.sum(pos, axis=0), np.sum(neg, axis=0)
            stats["pos_weight"] = pos_weight_from_counts(stats["label_pos"], stats["label_neg"], self.max_pos_weight)
        counts = [np.asarray(u.stats["class_counts"], dtype=np.float64) for u in used if "class_counts" in u.stats]
        if counts:
            stats["class_counts"] = np.sum(counts, axis=0)
        return weights, stats
