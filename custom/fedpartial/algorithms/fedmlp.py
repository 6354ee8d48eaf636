"""FedMLP (Sun, Wu et al., MICCAI 2024): federated multi-label learning where each site annotates
only some classes.

Client (:class:`FedMLPClient`), two stages:

* **Stage 1, warm-up** (rounds ``0 .. warmup_rounds-1``; paper t1 = 50 of 500): the
  Weighted-Partial-Class loss (paper Eq. 3-4) on two augmented views: BCE over the annotated
  entries only, on logit-adjusted predictions (multi-label logit adjustment, Eq. 3).
* From the end of warm-up on (round ``warmup_rounds-1`` and every round after) the site sends,
  after its local training, per annotated class c: the prototypes P0_c / P1_c (mean pooled
  feature of its annotated negatives / positives, Eq. 5) and the learning degree d_c (fraction
  of local samples whose probability for c is < L or > R, Eq. 10).
* **Stage 2** (round ``>= warmup_rounds``): missing label detection (MLD). For every still
  untagged entry of a missing class c, Z = cos(f, P0_c) - cos(f, P1_c) (Eq. 7) with the *global*
  prototypes and the received global model's features. Of the untagged entries with Z >= 0 the
  top tau0 fraction (largest Z) is tagged negative, of those with Z < 0 the top tau1 fraction
  (smallest Z) positive (Eq. 8-9). Tags are permanent (a file in ``ctx.state_dir``). Training
  then uses WPC on annotated + tagged entries plus consistency regularisation (CR): MSE between
  the student's and the received global model's probabilities on the still-untagged missing
  entries.

"Top tau fraction" -- fraction of what: Eq. 8 ranks the set {Z >= 0} (Eq. 9 the set {Z < 0}) of
the *residual* samples of class c ("in later rounds Z only includes residual samples"), and the
reference code takes ``int(tau * len(residual with Z >= 0))`` resp. ``int(tau * len(residual
with Z < 0))``. So the count is ``floor(tau * number of still-untagged entries of class c on that
side of 0)``, recomputed every round. With the paper's T0 = 0.5 %, a site needs >= 200 residual
samples on one side before it tags anything: small CPU-scale jobs set larger T0/T1 in the config.

Server (:class:`FedMLPServer`): FedAvg of the weights; per class, size-weighted mean of the sites'
prototypes over the sites that annotate it (Eq. 6, size-weighted as in the reference code);
global learning degree d_c^G = size-weighted mean over annotating sites (Eq. 10); thresholds
tau0 = d_c^G * T0, tau1 = d_c^G * T1.

Departures from the reference code (which does not run as released), following the paper:
the logit adjustment, the self-adaptive threshold and the CR term are built (the code comments
them out), each switchable (``use_wpc``, ``use_adaptive_threshold``, ``use_cr``; plus
``use_mld``) for the paper's Table 3 ablation. The reference computes d_c over the site's
*missing* classes and averages over sites missing c; we follow Eq. 10 and Algorithm 1 line 42
(d_c for c in AC_k, averaged over S_c). Prototypes and Z use un-augmented images in eval mode
(the reference uses one augmented view), so that they are repeatable.

Option beyond the paper (``positive_tag_cap="prevalence"``, off in the paper setting): the rank
rule tags a fixed share of the residual entries as positive whatever the class's prevalence, so on
rare classes (CT-ICH subtypes: a few % of the slices) most positive tags are wrong. With the cap a
site never holds more positive tags of a class than the class's prevalence at the annotating sites
(from the positive / negative prototype counts they already send) times its size; the server
sends ``prevalence`` with the global prototypes.

Option beyond the paper (``classifier_rows="annotated"`` on the server, off in the paper setting;
FedLSM's AWPA with FedMLP's prototypes): the classifier row of class c is averaged
over the sites that annotate c only (FedLSM's class-wise proxy averaging, with the annotated
sites' sizes as counts), so that the sites which only tag or regularise c do not dilute the one
whose ground truth trains it; the body stays FedAvg. Each site sends ``annotated_classes`` (0/1
per class) every round for it. And ``assumed_negative_weight`` on the clients: untagged missing
entries count as negatives with that weight in the WPC term, as FedAvg on partial labels counts
them. On CT-ICH both lost AUC to the paper rule on every seed (docs/RESULTS.md); the jobs keep
them off.

Option beyond the paper (``positive_tag_gate`` on the server, 0 = off in the paper setting): the
rank rule tags whatever clears its share, right or not, and tags are permanent. With the gate, each
annotating site runs the same rank rule on its validation entries of the classes it annotates
(:func:`check_positive_tags`: images the model never trained that class on, as a missing site's
are) and sends how many of these check tags are positives; the server pools them per class and
lets the sites tag class c positive in the next round only where they are at least
``positive_tag_gate`` precise (:func:`positive_tag_gate`). Negative tags are not gated.

Departures from the paper:
    * The WPC loss is a mean over the entries used (annotated + tagged) in the batch, not the
      paper's sum / C: its denominator grows as MLD tags entries, so a tag does not raise the loss
      scale (and the step size of Adam's first steps) of every later round.
    * By default each site's result filter withholds a class's prototype computed from fewer
      than 5 samples (``StatisticsPrivacyFilter``, preset ``fedmlp``, ``min_count`` 5 in the jobs;
      a one-sample prototype is that image's feature vector); the paper sends every prototype.
      A class whose prototype some annotating sites withhold is averaged over the sites that sent
      it; the server logs those sites and writes them to the round's ``server`` entry of
      metrics.json (``prototypes_missing_pos`` / ``_neg``), and a class no site sent is reported
      as invalid (``prototype_invalid_classes``) and not tagged.

Whose choice each option is (``PAPER_CLIENT`` / ``PAPER_SERVER`` hold the paper's values):

=================================  ================================  ==================================
option                             paper                             released code / ours
=================================  ================================  ==================================
``warmup_end``                     ``rounds`` (fixed t1)             ours: ``learning_degree``
``cr_in_warmup``                   False (CR in stage 2)             released code: True (missing classes)
``la_prior``                       ``local`` (rates of used entries, ours: ``annotated_frequency``
                                   tags included)
``t0`` / ``t1`` (server)           0.005 / 0.01                      CPU jobs: 0.05 / 0.1 (job meta.json)
``positive_tag_cap``               ``none``                          ours: ``prevalence``
``classifier_rows`` (server)       ``fedavg``                        ours: ``annotated``
``assumed_negative_weight``        0                                 ours: up to 1
``positive_tag_gate`` (server)     0 (no gate)                       ours: 0.7
=================================  ================================  ==================================
"""
from __future__ import annotations

import copy
import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from fedpartial.algorithms.aggregation import average_classifier_rows, average_weights, capped_counts
from fedpartial.algorithms.base import ClientRule, RoundInput, RoundResult, ServerContext, ServerRule, SiteUpdate
from fedpartial.data.transforms import training_view
from fedpartial.data.types import MULTI_LABEL, DataError
from fedpartial.training.common import ImageSource, batch_indices, epoch_steps, round_seed, seed_everything
from fedpartial.training.losses import logit_adjustment, masked_bce_with_logits, positive_rates  # noqa: F401

#: ``positive_tag_cap`` choices: the paper's rank rule alone, or capped by the class's prevalence
POSITIVE_TAG_CAPS = ("none", "prevalence")

#: ``classifier_rows`` choices of the server: FedAvg (paper) or averaged over the annotating sites
CLASSIFIER_ROWS = ("fedavg", "annotated")

#: ``warmup_end`` choices: a fixed number of rounds (paper t1) or when the model has learned the
#: annotated classes (global learning degree, ours)
WARMUP_ENDS = ("rounds", "learning_degree")

#: ``la_prior`` choices: the positive rate of the entries the loss uses (paper Eq. 3, local) or, for
#: a class the site does not annotate, its annotated frequency at the sites that do (ours)
LA_PRIORS = ("local", "annotated_frequency")

#: The paper's choice for every option where this module offers another (Sec. 2-3, Algorithm 1):
#: ``FedMLPClient(**PAPER_CLIENT)``, ``FedMLPServer(**PAPER_SERVER)``; with the paper's schedule
#: (500 rounds, t1 = 50, lr 3e-5, ResNet-18) on top, see docs/METHODS.md "the papers' settings".
PAPER_CLIENT = {"warmup_end": "rounds", "cr_in_warmup": False, "la_prior": "local", "positive_tag_cap": "none",
                "assumed_negative_weight": 0.0}
PAPER_SERVER = {"t0": 0.005, "t1": 0.01, "warmup_end": "rounds", "classifier_rows": "fedavg",
                "min_prototype_samples": 1, "positive_tag_gate": 0.0}
#: Where the released code (github.com/szbonaldo/FedMLP) differs from the paper and we offer its choice
RELEASED_CODE_CLIENT = {"cr_in_warmup": True}

#: keys of the per-site statistics (sent from the end of warm-up on)
STAT_KEYS = ("prototypes_neg", "prototypes_pos", "prototype_counts_neg", "prototype_counts_pos", "learning_degree",
             "annotated")
TAGS_FILE = "fedmlp_tags.npz"
UNTAGGED = -1

#: What the client rule sends in ``site_stats`` and what a site's privacy filter
#: (``fedpartial.flare.filters.StatisticsPrivacyFilter``) needs to guard it, by preset name.
#: ``keys``: every key sent; ``signature``: the keys that identify the method's statistics;
#: ``guards``: statistic -> the count key saying from how many images each row (or a scalar) was
#: computed; ``fill``: what a withheld row becomes (the value the server rule reads as "absent");
#: ``clip``: allowed range after noise; ``normalise_rows``: keys whose rows sum to 1.
#: Class prototypes ``(C, D)`` behind their sample counts ``(C,)``; learning degrees in [0, 1].
SENT_STATISTICS = {
    "fedmlp": {"keys": ["prototypes_pos", "prototypes_neg", "prototype_counts_pos", "prototype_counts_neg",
                        "learning_degree", "annotated", "annotated_classes", "tag_check_hits", "tag_check_count"],
               "signature": ["prototypes_pos", "prototypes_neg", "prototype_counts_pos", "prototype_counts_neg"],
               "guards": {"prototypes_pos": "prototype_counts_pos", "prototype_counts_pos": "prototype_counts_pos",
                          "prototypes_neg": "prototype_counts_neg", "prototype_counts_neg": "prototype_counts_neg",
                          "tag_check_hits": "tag_check_count", "tag_check_count": "tag_check_count"},
               "clip": {"prototype_counts_pos": [0, math.inf], "prototype_counts_neg": [0, math.inf],
                        "learning_degree": [0, 1], "tag_check_hits": [0, math.inf],
                        "tag_check_count": [0, math.inf]}},
    # warm-up rounds: which classes the site annotates, alone (``exclusive``: recognised only when
    # the message holds nothing else)
    "fedmlp_warmup": {"keys": ["annotated_classes"], "signature": ["annotated_classes"], "exclusive": True},
}
#: What the client rule returns in ``metrics`` (sent as ``site_metrics``) and when a site's result
#: policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
#: ``{c}`` stands for a class index. Tag counts are over the site's missing (sample, class) entries.
SENT_METRICS = {
    "fedmlp": {"stage": "value", "global_prototypes_valid": "value", "train_loss": "scope", "loss_wpc": "scope",
               "loss_cr": "scope", "train_steps": "scope", "tags_new_neg_c{c}": "count",
               "tags_new_pos_c{c}": "count", "tags_total_neg": "count", "tags_total_pos": "count",
               "tag_precision_pos": "rate:tags_total_pos", "tag_precision_neg": "rate:tags_total_neg",
               "tag_recall_pos": "local", "tag_recall_neg": "local"},
}


# ----------------------------------------------------------------------------------------------
# Pure helpers (torch / numpy, no FLARE)
# ----------------------------------------------------------------------------------------------

def wpc_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, offset: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """Weighted-Partial-Class loss (paper Eq. 4): BCE over the entries where ``mask`` is 1 only
    (missing classes contribute nothing), on logits shifted by the logit-adjustment ``offset``.
    Mean over the used entries: the denominator is the number of annotated + tagged entries of
    the batch, which grows as tags accumulate (the paper divides the sum by C, a constant; a
    departure, listed in the module docstring).

    Args:
        logits: ``(N, C)`` raw logits.
        targets: ``(N, C)`` 0/1 (annotated labels, tags elsewhere).
        mask: ``(N, C)`` 1 = entry used (annotated or tagged).
        offset: ``(C,)`` from :func:`logit_adjustment`; None = plain masked BCE.
    """
    if offset is not None:
        logits = logits + offset.to(logits.device, logits.dtype)
    return masked_bce_with_logits(logits, targets, mask)


def consistency_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Consistency regularisation: mean squared difference of the sigmoid probabilities of
    student and global model over the entries where ``mask`` is 1 (0 when none).

    Args:
        student_logits: ``(N, C)``.
        teacher_logits: ``(N, C)`` of the received global model (no gradient).
        mask: ``(N, C)`` 1 = still-untagged missing entry.
    """
    diff = (torch.sigmoid(student_logits) - torch.sigmoid(teacher_logits.detach())) ** 2
    mask = mask.to(diff.dtype)
    return (diff * mask).sum() / mask.sum().clamp_min(1.0)


def class_prototypes(features: np.ndarray, labels: np.ndarray, label_mask: np.ndarray
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Local class prototypes (paper Eq. 5) over annotated entries.

    Args:
        features: ``(N, D)`` pooled features.
        labels: ``(N, C)`` 0/1.
        label_mask: ``(N, C)`` 1 = annotated.

    Returns:
        ``(proto_neg (C,D), proto_pos (C,D), count_neg (C,), count_pos (C,))``; a prototype
        whose count is 0 is a zero row.
    """
    feats = np.asarray(features, dtype=np.float64)
    known = np.asarray(label_mask).astype(bool)
    pos = known & (np.asarray(labels) > 0.5)
    neg = known & ~(np.asarray(labels) > 0.5)
    count_pos = pos.sum(0).astype(np.float64)
    count_neg = neg.sum(0).astype(np.float64)
    proto_pos = (pos.T.astype(np.float64) @ feats) / np.maximum(count_pos, 1.0)[:, None]
    proto_neg = (neg.T.astype(np.float64) @ feats) / np.maximum(count_neg, 1.0)[:, None]
    return proto_neg, proto_pos, count_neg, count_pos


def learning_degree(probs: np.ndarray, annotated: np.ndarray, low: float = 0.3, high: float = 0.7) -> np.ndarray:
    """Local learning degree d_c (paper Eq. 10): fraction of the site's samples whose
    probability for class c is < ``low`` or > ``high``; 0 for a class the site does not annotate.

    Args:
        probs: ``(N, C)`` sigmoid probabilities of the locally trained model.
        annotated: ``(C,)`` bool, classes the site annotates.
        low: L (paper 0.3).
        high: R (paper 0.7).
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.shape[0] == 0:
        return np.zeros(probs.shape[1])
    confident = ((probs < low) | (probs > high)).mean(axis=0)
    return np.where(np.asarray(annotated, dtype=bool), confident, 0.0)


def prototype_scores(features: torch.Tensor, proto_neg: torch.Tensor, proto_pos: torch.Tensor) -> torch.Tensor:
    """Z = cos(f, P0_c) - cos(f, P1_c) for every sample and class (paper Eq. 7); Z < 0 = more
    like a positive.

    Args:
        features: ``(N, D)``.
        proto_neg: ``(C, D)`` global negative prototypes P0.
        proto_pos: ``(C, D)`` global positive prototypes P1.

    Returns:
        ``(N, C)``.
    """
    f = F.normalize(features.float(), dim=1)
    p0 = F.normalize(proto_neg.float(), dim=1)
    p1 = F.normalize(proto_pos.float(), dim=1)
    return f @ p0.T - f @ p1.T


def select_tags(z: torch.Tensor, candidate: torch.Tensor, tau_neg, tau_pos, max_pos=None, min_pos: int = 0
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank-based tagging of paper Eq. 8-9, per class.

    Among the candidate entries of class c with Z >= 0, the ``floor(tau_neg[c] * count)`` with
    the largest Z become negatives; among those with Z < 0, the ``floor(tau_pos[c] * count)``
    with the smallest Z become positives. Ties are broken by sample order (stable sort).

    Args:
        z: ``(N, C)`` scores from :func:`prototype_scores`.
        candidate: ``(N, C)`` bool, still-untagged missing entries whose class has a valid
            global prototype.
        tau_neg: ``(C,)`` or scalar fraction tau0.
        tau_pos: ``(C,)`` or scalar fraction tau1.
        max_pos: ``(C,)`` most new positives per class this round (None = no cap; see
            :func:`positive_tag_budget`).
        min_pos: least new positives per class, where that many candidates have Z < 0 (the
            positive-tag check's floor, :func:`check_positive_tags`; 0 = Eq. 9 alone).

    Returns:
        ``(new_neg, new_pos)`` bool ``(N, C)``.
    """
    n, c = z.shape
    tau_neg = torch.as_tensor(tau_neg, dtype=torch.float64).expand(c)
    tau_pos = torch.as_tensor(tau_pos, dtype=torch.float64).expand(c)
    new_neg = torch.zeros(n, c, dtype=torch.bool)
    new_pos = torch.zeros(n, c, dtype=torch.bool)
    z = z.detach().cpu().double()
    candidate = candidate.cpu().bool()
    for j in range(c):
        nonneg = torch.nonzero(candidate[:, j] & (z[:, j] >= 0)).flatten()
        negative = torch.nonzero(candidate[:, j] & (z[:, j] < 0)).flatten()
        k0 = int(np.floor(float(tau_neg[j]) * len(nonneg) + 1e-9))
        k1 = max(int(np.floor(float(tau_pos[j]) * len(negative) + 1e-9)), min(int(min_pos), len(negative)))
        if max_pos is not None:
            k1 = min(k1, max(int(max_pos[j]), 0))
        if k0 > 0:
            order = torch.sort(-z[nonneg, j], stable=True).indices  # largest Z first
            new_neg[nonneg[order[:k0]], j] = True
        if k1 > 0:
            order = torch.sort(z[negative, j], stable=True).indices  # smallest Z first
            new_pos[negative[order[:k1]], j] = True
    return new_neg, new_pos


def class_prevalence(pos_counts: List[np.ndarray], neg_counts: List[np.ndarray], annotated: List[np.ndarray]
                     ) -> np.ndarray:
    """Per class, the share of positives among the annotated samples of the sites that annotate
    it: ``sum_k pos_k[c] / sum_k (pos_k[c] + neg_k[c])`` over k with ``annotated_k[c]``; -1 for a
    class no site reports (0 samples; a number, since global statistics travel as message meta).

    Args:
        pos_counts / neg_counts: per site ``(C,)`` annotated positive / negative counts (the
            prototype counts a site sends; withheld rows count 0).
        annotated: per site ``(C,)`` bool.
    """
    pos = sum(np.where(a, np.asarray(p, np.float64), 0.0) for p, a in zip(pos_counts, annotated))
    total = pos + sum(np.where(a, np.asarray(n, np.float64), 0.0) for n, a in zip(neg_counts, annotated))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, pos / np.maximum(total, 1e-12), -1.0)


def positive_tag_budget(prevalence: np.ndarray, num_samples: int, tagged_pos: np.ndarray, scale: float = 1.0
                        ) -> np.ndarray:
    """How many more positive tags each class may get at a site: the positives its size and the
    class's prevalence at the annotating sites lead one to expect, ``round(scale * prevalence_c *
    N)``, minus the positive tags it already has (never below 0; no cap where the prevalence is
    unknown).

    Args:
        prevalence: ``(C,)`` from :func:`class_prevalence` (< 0 = unknown).
        num_samples: N, the site's training samples.
        tagged_pos: ``(C,)`` positive tags the site holds.
        scale: expected positives x ``scale`` (1 = as many as the prevalence predicts).
    """
    prevalence = np.asarray(prevalence, dtype=np.float64)
    known = np.isfinite(prevalence) & (prevalence >= 0)
    expected = np.rint(float(scale) * np.where(known, prevalence, 0.0) * int(num_samples))
    budget = np.maximum(expected - np.asarray(tagged_pos, dtype=np.float64), 0)
    return np.where(known, budget, np.iinfo(np.int32).max).astype(np.int64)


def average_prototypes(prototypes: List[np.ndarray], counts: List[np.ndarray], annotated: List[np.ndarray],
                       sizes: List[float], min_samples: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """Global prototype of each class (paper Eq. 6, size-weighted as in the reference code):
    mean of the sites' prototypes weighted by site size, over the sites that annotate the class
    and computed it from at least ``min_samples`` samples.

    Args:
        prototypes: per site ``(C, D)``.
        counts: per site ``(C,)`` samples behind each prototype.
        annotated: per site ``(C,)`` bool.
        sizes: per site weight (number of training samples).
        min_samples: a prototype from fewer samples is treated as absent.

    Returns:
        ``(global (C, D), valid (C,) bool)``; rows without any valid site are zeros / False.
    """
    protos = np.stack([np.asarray(p, dtype=np.float64) for p in prototypes])  # (K, C, D)
    usable = np.stack([np.asarray(a, dtype=bool) & (np.asarray(n, dtype=np.float64) >= max(min_samples, 1))
                       for a, n in zip(annotated, counts)])  # (K, C)
    w = usable * np.asarray(sizes, dtype=np.float64)[:, None]  # (K, C)
    total = w.sum(0)
    valid = total > 0
    out = np.einsum("kc,kcd->cd", w, protos) / np.where(valid, total, 1.0)[:, None]
    return np.where(valid[:, None], out, 0.0), valid


def global_learning_degree(degrees: List[np.ndarray], annotated: List[np.ndarray], sizes: List[float]) -> np.ndarray:
    """d_c^G = sum_{k in S_c} |D_k| / sum_{i in S_c} |D_i| * d_c^k (paper Eq. 10); 0 where no site
    annotates c.

    Args:
        degrees: per site ``(C,)`` d_c^k.
        annotated: per site ``(C,)`` bool.
        sizes: per site |D_k|.
    """
    w = np.stack([np.asarray(a, dtype=bool) for a in annotated]) * np.asarray(sizes, dtype=np.float64)[:, None]
    d = np.stack([np.asarray(x, dtype=np.float64) for x in degrees])
    total = w.sum(0)
    return np.where(total > 0, (w * d).sum(0) / np.where(total > 0, total, 1.0), 0.0)


def warmup_complete(global_degree: np.ndarray, annotated_somewhere: np.ndarray, threshold: float
                    ) -> Tuple[bool, float]:
    """Whether warm-up may end: every class that some site annotates has a global learning
    degree d_c^G of at least ``threshold`` (the least-learned class decides, so a rare class whose
    degree is near 1 from the start cannot end warm-up for a common class still being learned).

    Args:
        global_degree: ``(C,)`` d_c^G from :func:`global_learning_degree`.
        annotated_somewhere: ``(C,)`` bool, classes with at least one annotating site.
        threshold: the degree every such class must reach (0..1).

    Returns:
        ``(complete, least degree)``; ``(False, 0.0)`` when no class is annotated anywhere.
    """
    known = np.asarray(annotated_somewhere, dtype=bool)
    if not known.any():
        return False, 0.0
    least = float(np.min(np.asarray(global_degree, dtype=np.float64)[known]))
    return least >= float(threshold), least


def prior_rates(local_rates: np.ndarray, annotated: np.ndarray, prevalence: Optional[np.ndarray]) -> np.ndarray:
    """Positive rates pi_c,1 for the logit adjustment with ``la_prior="annotated_frequency"``: a
    class the site annotates keeps its local rate; a class it does not annotate takes its
    annotated frequency at the sites that do (the server's ``prevalence``), not the rate of its
    tags, which the rank rule sets rather than the data. Unknown prevalence (< 0 or absent) keeps
    the local rate.

    Args:
        local_rates: ``(C,)`` from :func:`positive_rates` over the annotated + tagged entries.
        annotated: ``(C,)`` bool, classes this site annotates.
        prevalence: ``(C,)`` from :func:`class_prevalence`, or None.
    """
    rates = np.asarray(local_rates, dtype=np.float64).copy()
    if prevalence is None:
        return rates
    prevalence = np.asarray(prevalence, dtype=np.float64)
    use = ~np.asarray(annotated, dtype=bool) & np.isfinite(prevalence) & (prevalence >= 0)
    rates[use] = prevalence[use]
    return rates


def prototype_sources(counts: List[np.ndarray], annotated: List[np.ndarray], sites: List[str], min_samples: int = 1
                      ) -> Dict[int, Dict[str, List[str]]]:
    """Per class, which annotating sites' prototypes enter the global one and which do not (a
    count below ``min_samples``: too few samples, or a row the site's privacy filter withheld).

    Args:
        counts: per site ``(C,)`` samples behind each prototype (0 where withheld).
        annotated: per site ``(C,)`` bool.
        sites: the sites' names, in the same order.
        min_samples: the server's ``min_prototype_samples``.

    Returns:
        ``{class index: {"used": [...], "missing": [...]}}`` for the classes with at least one
        annotating site whose prototype is missing.
    """
    out: Dict[int, Dict[str, List[str]]] = {}
    num_classes = len(np.asarray(counts[0])) if counts else 0
    for c in range(num_classes):
        used = [s for s, n, a in zip(sites, counts, annotated) if a[c] and float(n[c]) >= max(min_samples, 1)]
        missing = [s for s, n, a in zip(sites, counts, annotated) if a[c] and float(n[c]) < max(min_samples, 1)]
        if missing:
            out[c] = {"used": used, "missing": missing}
    return out


def annotated_rows(updates: List[SiteUpdate], classifier_names: List[str]) -> Dict[str, np.ndarray]:
    """Classifier parameters averaged row by row over the sites that annotate each class, each
    weighted by its size (FedLSM's AWPA with the annotated entries as counts); a class annotated
    at no site is averaged over every site.

    Args:
        updates: the round's site updates; each with ``stats["annotated_classes"]`` (C,) 0/1.
        classifier_names: the classifier parameters (first dimension = classes).
    """
    used = [u for u in updates if u.num_samples > 0]
    flags = np.stack([np.asarray(u.stats["annotated_classes"], dtype=np.float64) > 0.5 for u in used])
    sizes = np.array([u.num_samples for u in used], dtype=np.float64)
    return average_classifier_rows(used, flags * sizes[:, None], classifier_names)


def loss_entries(labels: np.ndarray, label_mask: np.ndarray, tags: np.ndarray, assumed_negative_weight: float = 0.0
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Targets and per-entry weights of the WPC term, and the consistency mask.

    Args:
        labels: ``(N, C)`` 0/1 ground truth (read where ``label_mask`` is 1).
        label_mask: ``(N, C)`` bool, annotated entries.
        tags: ``(N, C)`` int8: 0 / 1 tagged negative / positive, ``UNTAGGED`` (-1) otherwise.
        assumed_negative_weight: weight of an untagged missing entry as a negative (0 = paper).

    Returns:
        ``(targets, weights, cr_mask)``, float32 ``(N, C)`` each: targets are the labels where
        annotated and the tags elsewhere (0 when untagged); weights are 1 on annotated and tagged
        entries and ``assumed_negative_weight`` on untagged missing ones (where ``cr_mask`` is 1).
    """
    label_mask = np.asarray(label_mask).astype(bool)
    untagged_missing = ~label_mask & (tags == UNTAGGED)
    targets = np.where(label_mask, labels, tags == 1).astype(np.float32)
    weights = np.where(untagged_missing, float(assumed_negative_weight), 1.0).astype(np.float32)
    return targets, weights, untagged_missing.astype(np.float32)


def check_positive_tags(z: np.ndarray, labels: np.ndarray, label_mask: np.ndarray, tau_pos, valid: np.ndarray,
                        min_samples: int = 10) -> Tuple[np.ndarray, np.ndarray]:
    """The positive-tag check of an annotating site: Eq. 9's rank rule run on its held-out
    (validation) entries of the classes it annotates, scored against their labels.

    Among the entries of class c with Z < 0, the ``max(floor(tau_pos[c] * count), min(min_samples,
    count))`` with the smallest Z are the check tags: as many as a site missing c would tag, and at
    least ``min_samples`` so that a precision can be read from them (deeper in the ranking, where
    tags are no more precise than at its top).

    Args:
        z: ``(N, C)`` scores from :func:`prototype_scores` of the validation images.
        labels: ``(N, C)`` 0/1.
        label_mask: ``(N, C)`` bool, the annotated entries of the classes the site annotates.
        tau_pos: ``(C,)`` or scalar fraction tau1.
        valid: ``(C,)`` bool, classes with a valid global prototype pair.
        min_samples: least number of check tags per class (where that many entries have Z < 0).

    Returns:
        ``(hits (C,), count (C,))``: how many check tags are positives, how many there are.
    """
    candidate = np.asarray(label_mask, dtype=bool) & np.asarray(valid, dtype=bool)[None, :]
    _, chosen = select_tags(torch.as_tensor(np.asarray(z, dtype=np.float64)), torch.from_numpy(candidate), 0.0,
                            tau_pos, min_pos=min_samples)
    chosen = chosen.numpy()
    hits = (chosen & (np.asarray(labels) > 0.5)).sum(axis=0).astype(np.float64)
    return hits, chosen.sum(axis=0).astype(np.float64)


def positive_tag_gate(hits: List[np.ndarray], counts: List[np.ndarray], gate: float
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """Which classes the sites may tag positive next round: those whose check tags at the
    annotating sites (:func:`check_positive_tags`, pooled over sites) are at least ``gate``
    precise. A class without any check tag stays closed: nothing shows its tags would be right.

    Args:
        hits: per site ``(C,)`` check tags that are positives (0 where the site sent none).
        counts: per site ``(C,)`` check tags.
        gate: least pooled precision (0..1).

    Returns:
        ``(open (C,) bool, precision (C,))``; precision is -1 where no site made a check tag.
    """
    total_hits = np.sum([np.asarray(h, dtype=np.float64) for h in hits], axis=0)
    total = np.sum([np.asarray(n, dtype=np.float64) for n in counts], axis=0)
    precision = np.where(total > 0, total_hits / np.maximum(total, 1.0), -1.0)
    return (total > 0) & (precision >= float(gate)), precision


# ----------------------------------------------------------------------------------------------
# Persistent tags
# ----------------------------------------------------------------------------------------------

def _mask_fingerprint(label_mask: np.ndarray) -> int:
    """Cheap checksum of the label mask, so tags saved for other data are not reused."""
    m = np.asarray(label_mask, dtype=np.int64)
    return int((m * (np.arange(m.size, dtype=np.int64).reshape(m.shape) % 9973 + 1)).sum())


def save_tags(path: str, tags: np.ndarray, last_round: int, label_mask: np.ndarray) -> None:
    """Write the tag matrix (-1 untagged, 0 / 1 tagged) atomically."""
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, tags=tags.astype(np.int8), last_round=np.int64(last_round),
             fingerprint=np.int64(_mask_fingerprint(label_mask)))
    os.replace(tmp, path)


def load_tags(path: str, label_mask: np.ndarray) -> Tuple[np.ndarray, int]:
    """Read tags written by :func:`save_tags`; raise naming the file when they belong to other data."""
    with np.load(path) as f:
        tags, last_round, fp = f["tags"].astype(np.int8), int(f["last_round"]), int(f["fingerprint"])
    if tags.shape != np.shape(label_mask) or fp != _mask_fingerprint(label_mask):
        raise DataError(f"FedMLP tag file '{path}' holds tags of shape {tags.shape} for other data than this "
                        f"site's train split {np.shape(label_mask)}; delete it to start tagging afresh")
    return tags, last_round


# ----------------------------------------------------------------------------------------------
# Client rule
# ----------------------------------------------------------------------------------------------

class FedMLPClient(ClientRule):
    """FedMLP local training (see module docstring).

    Args:
        warmup_rounds: rounds of stage 1 (paper t1 = 50 of 500 rounds).
        lr: Adam learning rate (paper 3e-5).
        weight_decay: Adam weight decay (L2, 5e-4 as in the reference code).
        betas: Adam betas (reference: (0.9, 0.999)).
        batch_size: samples per step (paper 32).
        local_epochs: epochs per round (paper 1).
        num_views: augmented views of each batch whose losses are averaged (paper 2).
        augmentation: one of :data:`fedpartial.data.transforms.TRAINING_VIEWS` (``weak``: flips).
        low: L of the learning degree (paper 0.3).
        high: R of the learning degree (paper 0.7).
        la_tau: logit-adjustment strength (1 = paper Eq. 3).
        la_eps: positive rates are clipped to ``[la_eps, 1-la_eps]``.
        cr_weight: weight of the consistency term (reference: 1).
        use_mld: missing label detection / tagging (off = no tags).
        use_wpc: logit-adjusted WPC loss (off = plain BCE on annotated + tagged entries).
        use_cr: consistency regularisation with the global model.
        use_adaptive_threshold: tau = d_c^G * T (off = fixed T0 / T1 from the server).
        positive_tag_cap: ``none`` (paper: the rank rule alone) or ``prevalence``: a site never
            holds more positive tags of a class than ``positive_tag_scale`` x the class's
            prevalence at the annotating sites x its size (see :func:`positive_tag_budget`).
        positive_tag_scale: the cap's factor (1 = as many as the prevalence predicts).
        prediction_batch_size: batch size of the no-gradient passes (features, probabilities).
        assumed_negative_weight: weight of the still-untagged missing entries as negatives in the
            WPC term (0 = the paper: they are left out; 1 = as FedAvg on partial labels counts
            them). The logit adjustment keeps its rates from the annotated + tagged entries.
        warmup_end: ``rounds`` (paper: stage 2 from round ``warmup_rounds``) or ``learning_degree``
            (ours: stage 2 from the round after the server finds every annotated class learned,
            see :func:`warmup_complete`, and at ``warmup_rounds`` at the latest).
        min_warmup_rounds: with ``warmup_end="learning_degree"``, the first round whose
            statistics may end warm-up is ``min_warmup_rounds - 1`` (sites send prototypes and
            learning degrees from then on, one extra no-gradient pass per round).
        cr_in_warmup: consistency with the received global model on the missing entries during
            warm-up too (the released code does; the paper's Algorithm 1 only in stage 2).
        la_prior: ``local`` (paper Eq. 3: positive rate of the entries the loss uses, tags
            included) or ``annotated_frequency`` (a class the site does not annotate takes its
            annotated frequency at the annotating sites, see :func:`prior_rates`).
        tag_check_samples: when the server gates positive tags (its ``positive_tag_gate``), the
            least number of validation entries per annotated class this site's check ranks
            (:func:`check_positive_tags`); a site's privacy filter withholds a check from fewer
            than its ``min_count`` entries.
    """

    # the logit adjustment by local positive rates (use_wpc, la_tau, la_eps) is imbalance handling any
    # FedAvg site can have: recipe; from the server's prevalence (la_prior) it is FedMLP's own
    CONTRIBUTION = frozenset({
        "warmup_rounds", "low", "high", "cr_weight", "use_mld", "use_cr",
        "use_adaptive_threshold", "prediction_batch_size", "positive_tag_cap", "positive_tag_scale",
        "assumed_negative_weight", "warmup_end", "min_warmup_rounds", "cr_in_warmup", "la_prior", "tag_check_samples"})
    RECIPE_NAMES = {"use_wpc": "logit_adjustment"}
    # every train row is a sample
    WEIGHT_BY = "all_rows"

    task_kind = "classification"

    def __init__(self, warmup_rounds: int = 50, lr: float = 3e-5, weight_decay: float = 5e-4,
                 betas=(0.9, 0.999), batch_size: int = 32, local_epochs: int = 1, num_views: int = 2,
                 augmentation: str = "weak", low: float = 0.3, high: float = 0.7, la_tau: float = 1.0,
                 la_eps: float = 1e-3, cr_weight: float = 1.0, use_mld: bool = True, use_wpc: bool = True,
                 use_cr: bool = True, use_adaptive_threshold: bool = True, prediction_batch_size: int = 256,
                 positive_tag_cap: str = "none", positive_tag_scale: float = 1.0,
                 assumed_negative_weight: float = 0.0, warmup_end: str = "rounds", min_warmup_rounds: int = 1,
                 cr_in_warmup: bool = False, la_prior: str = "local", tag_check_samples: int = 10):
        if int(warmup_rounds) < 1:
            raise ValueError(f"FedMLP warmup_rounds must be >= 1 (prototypes come from a warmed-up model), "
                             f"got {warmup_rounds}")
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"FedMLP needs 0 <= low < high <= 1 for the learning degree, got low={low} high={high}")
        if int(num_views) < 1 or int(batch_size) < 1 or int(local_epochs) < 1:
            raise ValueError(f"FedMLP num_views, batch_size, local_epochs must be >= 1, got {num_views}, "
                             f"{batch_size}, {local_epochs}")
        if not 0.0 < la_eps < 0.5:
            raise ValueError(f"FedMLP la_eps must be in (0, 0.5), got {la_eps}")
        self.warmup_rounds, self.lr, self.weight_decay, self.betas = int(warmup_rounds), lr, weight_decay, tuple(betas)
        self.batch_size, self.local_epochs, self.num_views = int(batch_size), int(local_epochs), int(num_views)
        self.augmentation = augmentation
        self.view = training_view(augmentation)  # validates the name; the table the matched baselines use
        self.low, self.high, self.la_tau, self.la_eps, self.cr_weight = low, high, la_tau, la_eps, cr_weight
        self.use_mld, self.use_wpc, self.use_cr = bool(use_mld), bool(use_wpc), bool(use_cr)
        self.use_adaptive_threshold = bool(use_adaptive_threshold)
        self.prediction_batch_size = int(prediction_batch_size)
        if positive_tag_cap not in POSITIVE_TAG_CAPS:
            raise ValueError(f"FedMLP positive_tag_cap '{positive_tag_cap}' unknown; choose one of {POSITIVE_TAG_CAPS}")
        if float(positive_tag_scale) <= 0:
            raise ValueError(f"FedMLP positive_tag_scale must be > 0, got {positive_tag_scale}")
        self.positive_tag_cap, self.positive_tag_scale = positive_tag_cap, float(positive_tag_scale)
        if not 0.0 <= float(assumed_negative_weight) <= 1.0:
            raise ValueError(f"FedMLP assumed_negative_weight must lie in [0, 1], got {assumed_negative_weight}")
        self.assumed_negative_weight = float(assumed_negative_weight)
        if warmup_end not in WARMUP_ENDS:
            raise ValueError(f"FedMLP warmup_end '{warmup_end}' unknown; choose one of {WARMUP_ENDS}")
        if not 1 <= int(min_warmup_rounds) <= self.warmup_rounds:
            raise ValueError(f"FedMLP min_warmup_rounds must lie in [1, warmup_rounds={self.warmup_rounds}], "
                             f"got {min_warmup_rounds}")
        if la_prior not in LA_PRIORS:
            raise ValueError(f"FedMLP la_prior '{la_prior}' unknown; choose one of {LA_PRIORS}")
        self.warmup_end, self.min_warmup_rounds = warmup_end, int(min_warmup_rounds)
        self.cr_in_warmup, self.la_prior = bool(cr_in_warmup), la_prior
        if int(tag_check_samples) < 1:
            raise ValueError(f"FedMLP tag_check_samples must be >= 1, got {tag_check_samples}")
        self.tag_check_samples = int(tag_check_samples)

    def round_steps(self, data) -> int:
        return self.local_epochs * epoch_steps(len(data.splits["train"]), self.batch_size, drop_last=True)

    # -- set-up and persistent state -------------------------------------------------------------
    def setup(self, ctx) -> None:
        super().setup(ctx)
        data = ctx.data
        if data.task != MULTI_LABEL:
            raise DataError(f"FedMLP is a multi-label method; {data.where()} has task '{data.task}'")
        train = data.splits.get("train")
        if train is None or train.label_mask is None:
            raise DataError(f"{data.where()} has no train split with a label mask (train_label_mask)")
        self.labels_np = np.asarray(train.labels, dtype=np.float32)
        self.mask_np = np.asarray(train.label_mask).astype(bool)
        self.annotated = self.mask_np.any(axis=0)
        self.images = ImageSource(train.images, ctx.normalisation)  # uint8, read batch by batch
        self.class_names = list(data.class_names)
        self.tags_path = os.path.join(ctx.state_dir, TAGS_FILE)
        os.makedirs(ctx.state_dir, exist_ok=True)
        if os.path.exists(self.tags_path):
            self.tags, self.last_tag_round = load_tags(self.tags_path, self.mask_np)
            ctx.log(f"FedMLP: site '{ctx.site}' reloaded {int((self.tags >= 0).sum())} tags "
                    f"(last tagged in round {self.last_tag_round}) from {self.tags_path}")
        else:
            self.tags = np.full(self.mask_np.shape, UNTAGGED, dtype=np.int8)
            self.last_tag_round = -1
        self.tag_check: Dict[str, np.ndarray] = {}
        val = data.splits.get("val")
        self.val_images, self.val_labels, self.val_mask = None, None, None
        if val is not None and len(val.labels) > 0:  # the positive-tag check's held-out entries
            self.val_images = ImageSource(val.images, ctx.normalisation)
            self.val_labels = np.asarray(val.labels, dtype=np.float32)
            known = np.ones(self.val_labels.shape, bool) if val.label_mask is None else np.asarray(val.label_mask, bool)
            self.val_mask = known & self.annotated[None, :]
        if not self.annotated.any():
            ctx.log(f"FedMLP: site '{ctx.site}' annotates no class; it trains with consistency only")

    def stage(self, round_index: int, global_stats: Optional[Dict] = None) -> int:
        """2 from round ``warmup_rounds`` on, and with ``warmup_end="learning_degree"`` also once
        the server's statistics say stage 2; 1 before."""
        if round_index >= self.warmup_rounds:
            return 2
        if self.warmup_end == "learning_degree" and int((global_stats or {}).get("stage", 1)) == 2:
            return 2
        return 1

    def sends_stats(self, round_index: int) -> bool:
        """Prototypes / learning degrees are sent from the last warm-up round on (Algorithm 1), or
        from round ``min_warmup_rounds - 1`` on when the learning degree may end warm-up."""
        first = self.min_warmup_rounds if self.warmup_end == "learning_degree" else self.warmup_rounds
        return round_index >= first - 1

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.view is None else self.view(x)

    # -- missing label detection ------------------------------------------------------------------
    def _thresholds(self, gs: Dict, c: int) -> Tuple[np.ndarray, np.ndarray]:
        if self.use_adaptive_threshold:
            return np.asarray(gs["tau0"], dtype=np.float64), np.asarray(gs["tau1"], dtype=np.float64)
        return np.full(c, float(gs["t0"])), np.full(c, float(gs["t1"]))

    def _tag(self, model, inp: RoundInput) -> Tuple[np.ndarray, np.ndarray]:
        """Tag new entries for this round (once per round, also across restarts). Returns per-class
        counts of new negative and positive tags. When the server gates positive tags
        (``positive_tag_gate`` in its statistics), also runs :func:`check_positive_tags` on the
        annotated classes of its validation split and keeps its counts in ``self.tag_check`` for
        this round's statistics."""
        c = self.mask_np.shape[1]
        zeros = (np.zeros(c, dtype=np.int64), np.zeros(c, dtype=np.int64))
        gs = inp.global_stats or {}
        if inp.round <= self.last_tag_round:
            return zeros  # this round's tags were already drawn before a restart
        if "prototypes_neg" not in gs:
            self.ctx.log(f"FedMLP: round {inp.round} is in stage 2 but the server sent no prototypes; no tagging")
            return zeros
        valid = np.asarray(gs["prototype_valid"], dtype=bool)
        candidate = ~self.mask_np & (self.tags == UNTAGGED) & valid[None, :]
        gated = float(gs.get("positive_tag_gate", 0.0)) > 0
        open_pos = np.asarray(gs.get("positive_tag_open", np.ones(c, dtype=bool)), dtype=bool)
        tau0, tau1 = self._thresholds(gs, c)
        if gated:
            self._check(model, gs, tau1, valid)
            tau1 = np.where(open_pos, tau1, 0.0)
        if candidate.any():
            _, feats = self.images.predict(model, self.ctx.device, self.prediction_batch_size, with_features=True)
            z = prototype_scores(feats, torch.as_tensor(np.asarray(gs["prototypes_neg"])),
                                 torch.as_tensor(np.asarray(gs["prototypes_pos"])))
            max_pos = None
            if self.positive_tag_cap == "prevalence" and "prevalence" in gs:
                max_pos = positive_tag_budget(np.asarray(gs["prevalence"], dtype=np.float64), self.mask_np.shape[0],
                                              (self.tags == 1).sum(axis=0), self.positive_tag_scale)
            new_neg, new_pos = select_tags(z, torch.from_numpy(candidate), tau0, tau1, max_pos)
            new_neg, new_pos = new_neg.numpy(), new_pos.numpy()
            self.tags[new_neg] = 0
            self.tags[new_pos] = 1
        else:
            new_neg = new_pos = np.zeros_like(candidate)
        self.last_tag_round = inp.round
        save_tags(self.tags_path, self.tags, self.last_tag_round, self.mask_np)
        return new_neg.sum(0), new_pos.sum(0)

    def _check(self, model, gs: Dict, tau1: np.ndarray, valid: np.ndarray) -> None:
        """This round's positive-tag check on the validation split (:func:`check_positive_tags`),
        kept in ``self.tag_check`` for the round's statistics."""
        if self.val_images is None or not self.val_mask.any():
            return  # nothing held out to check on: the server counts no check tag from this site
        _, feats = self.val_images.predict(model, self.ctx.device, self.prediction_batch_size, with_features=True)
        z = prototype_scores(feats, torch.as_tensor(np.asarray(gs["prototypes_neg"])),
                             torch.as_tensor(np.asarray(gs["prototypes_pos"])))
        hits, count = check_positive_tags(z.numpy(), self.val_labels, self.val_mask, tau1, valid,
                                          self.tag_check_samples)
        self.tag_check = {"tag_check_hits": hits, "tag_check_count": count}

    def _tag_quality(self) -> Dict[str, float]:
        """Precision / recall of all tags so far against the hidden complete labels (diagnostics
        only: ``ctx.reference`` is None unless the job enables them)."""
        ref = self.ctx.reference
        if ref is None:
            return {}
        true = np.asarray(ref.splits["train"].labels)
        if true.shape != self.tags.shape:
            self.ctx.log(f"FedMLP: reference labels {true.shape} do not match the train split {self.tags.shape}; "
                         "no tag diagnostics")
            return {}
        missing = ~self.mask_np
        true_pos = (true > 0.5) & missing
        true_neg = (true <= 0.5) & missing
        out = {}
        for name, tagged, truth in (("pos", self.tags == 1, true_pos), ("neg", self.tags == 0, true_neg)):
            hits = float((tagged & truth).sum())
            if tagged.sum() > 0:
                out[f"tag_precision_{name}"] = hits / float(tagged.sum())
            if truth.sum() > 0:
                out[f"tag_recall_{name}"] = hits / float(truth.sum())
        return out

    # -- one round --------------------------------------------------------------------------------
    def train_round(self, model, inp: RoundInput) -> RoundResult:
        n, c = self.mask_np.shape
        stage = self.stage(inp.round, inp.global_stats)
        if n == 0:
            self.ctx.log(f"FedMLP: site '{self.ctx.site}' has no training image; it takes no part in the round")
            return RoundResult(num_samples=0, metrics={"stage": float(stage)})
        seed = round_seed(self.ctx.seed, self.ctx.site, inp.round)
        seed_everything(seed)
        rng = np.random.default_rng(seed)
        device = self.ctx.device
        metrics: Dict[str, float] = {"stage": float(stage)}

        new_neg = new_pos = np.zeros(c, dtype=np.int64)
        self.tag_check = {}
        if stage == 2:  # shows that the server's prototypes came back (0 = none received)
            valid = (inp.global_stats or {}).get("prototype_valid")
            metrics["global_prototypes_valid"] = 0.0 if valid is None else float(np.asarray(valid, dtype=bool).sum())
        if stage == 2 and self.use_mld:
            new_neg, new_pos = self._tag(model, inp)
        teacher = None
        if self.use_cr and (stage == 2 or self.cr_in_warmup):
            teacher = copy.deepcopy(model).eval()  # the received global model
            for p in teacher.parameters():
                p.requires_grad_(False)

        tags = self.tags if self.use_mld else np.full_like(self.tags, UNTAGGED)
        tagged = ~self.mask_np & (tags >= 0)
        targets_np, weights_np, cr_np = loss_entries(self.labels_np, self.mask_np, tags, self.assumed_negative_weight)
        targets, loss_weights, cr_mask = (torch.from_numpy(a) for a in (targets_np, weights_np, cr_np))
        offset = None
        if self.use_wpc:  # rates from the annotated + tagged entries only, never the assumed negatives
            rates = positive_rates(targets, 1.0 - cr_mask)
            if self.la_prior == "annotated_frequency":
                prevalence = (inp.global_stats or {}).get("prevalence")
                rates = torch.from_numpy(prior_rates(rates.numpy(), self.annotated, prevalence)).float()
            offset = logit_adjustment(rates, self.la_tau, self.la_eps)

        optimizer = torch.optim.Adam(model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        model.train()
        sup_losses, cr_losses, steps = [], [], 0
        for _ in range(self.local_epochs):
            for idx in batch_indices(n, self.batch_size, rng, drop_last=True):
                if self.ctx.abort():
                    return RoundResult(num_samples=n, metrics=metrics)
                y, m = targets[idx].to(device), loss_weights[idx].to(device)
                loss_sup = loss_cr = 0.0
                images = self.images.batch(idx)  # read once, augmented once per view
                optimizer.zero_grad(set_to_none=True)
                # one backward per view: the gradient of the views' mean loss, with one view's
                # activations alive at a time (at 224 px that halves the peak memory)
                for _v in range(self.num_views):
                    x = self._augment(images).to(device, non_blocking=True)
                    _, logits = model(x)
                    view_sup = wpc_loss(logits, y, m, offset) / self.num_views
                    view_cr = torch.zeros((), device=device)
                    if teacher is not None:
                        with torch.no_grad():
                            _, t_logits = teacher(x)
                        view_cr = consistency_loss(logits, t_logits, cr_mask[idx].to(device)) / self.num_views
                    (view_sup + self.cr_weight * view_cr).backward()
                    loss_sup += float(view_sup.detach())
                    loss_cr += float(view_cr.detach())
                optimizer.step()
                sup_losses.append(loss_sup)
                cr_losses.append(loss_cr)
                steps += 1

        mean_sup = float(np.mean(sup_losses)) if steps else 0.0
        mean_cr = float(np.mean(cr_losses)) if steps else 0.0
        metrics.update({"train_loss": mean_sup + self.cr_weight * mean_cr, "loss_wpc": mean_sup, "loss_cr": mean_cr,
                        "train_steps": float(steps)})
        if stage == 2 and self.use_mld:
            for j in range(c):
                if not self.annotated[j]:
                    metrics[f"tags_new_neg_c{j}"] = float(new_neg[j])
                    metrics[f"tags_new_pos_c{j}"] = float(new_pos[j])
            metrics["tags_total_neg"] = float((tagged & (tags == 0)).sum())
            metrics["tags_total_pos"] = float((tagged & (tags == 1)).sum())
            metrics.update(self._tag_quality())

        stats = self.local_stats(model) if self.sends_stats(inp.round) else {}
        if self.tag_check:
            stats.update(self.tag_check)
        # every round (warm-up too): which classes this site's ground truth trains, for the
        # server's ``classifier_rows="annotated"``
        stats["annotated_classes"] = self.annotated.astype(np.float64)
        return RoundResult(num_samples=n, stats=stats, metrics=metrics)

    def local_stats(self, model) -> Dict[str, np.ndarray]:
        """Prototypes and learning degrees of the locally trained model (Algorithm 1, Local
        Calculation), for the annotated classes; zeros (and ``annotated`` False) elsewhere."""
        logits, feats = self.images.predict(model, self.ctx.device, self.prediction_batch_size, with_features=True)
        p_neg, p_pos, n_neg, n_pos = class_prototypes(feats.numpy(), self.labels_np, self.mask_np)
        degree = learning_degree(torch.sigmoid(logits).numpy(), self.annotated, self.low, self.high)
        return {"prototypes_neg": p_neg.astype(np.float32), "prototypes_pos": p_pos.astype(np.float32),
                "prototype_counts_neg": n_neg, "prototype_counts_pos": n_pos,
                "learning_degree": degree, "annotated": self.annotated.copy()}


# ----------------------------------------------------------------------------------------------
# Server rule
# ----------------------------------------------------------------------------------------------

class FedMLPServer(ServerRule):
    """FedAvg of the weights plus global prototypes, learning degrees and tagging thresholds.

    Args:
        t0: T0, base fraction of negatives tagged per round (paper 0.5 % = 0.005).
        t1: T1, base fraction of positives tagged per round (paper 1 % = 0.01).
        min_prototype_samples: a site prototype from fewer samples counts as absent (1 = use
            every non-empty prototype, as the paper).
        classifier_rows: ``fedavg`` (paper: the classifier is averaged like every other layer) or
            ``annotated`` (FedLSM's class-wise row averaging, :func:`fedpartial.algorithms.fedlsm.awpa_rows`,
            over the sites whose ground truth trains the class, weighted by their size; a class
            annotated nowhere keeps FedAvg). Needs the sites' ``annotated_classes``.
        warmup_end: ``rounds`` (paper: the statistics always announce stage 2; the clients'
            ``warmup_rounds`` decides) or ``learning_degree`` (stage 2 is announced from the first
            round whose statistics pass :func:`warmup_complete`, and kept). Set it as the clients'.
        warmup_degree: with ``learning_degree``, the global learning degree every annotated class
            must reach.
        positive_tag_gate: 0 = off (paper). Otherwise the least precision the annotating sites'
            check tags (:func:`check_positive_tags`) must show before any site tags that class
            positive in the next round (:func:`positive_tag_gate`); checked every round, so a
            class whose check falls below it stops getting positive tags.
    """

    needs_classifier_names = True

    def __init__(self, t0: float = 0.005, t1: float = 0.01, min_prototype_samples: int = 1,
                 classifier_rows: str = "fedavg", warmup_end: str = "rounds", warmup_degree: float = 0.9,
                 positive_tag_gate: float = 0.0):
        for name, v in (("t0", t0), ("t1", t1)):
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"FedMLP {name} must be a fraction in [0, 1], got {v}")
        if int(min_prototype_samples) < 1:
            raise ValueError(f"FedMLP min_prototype_samples must be >= 1, got {min_prototype_samples}")
        if classifier_rows not in CLASSIFIER_ROWS:
            raise ValueError(f"FedMLP classifier_rows '{classifier_rows}' unknown; choose one of {CLASSIFIER_ROWS}")
        self.t0, self.t1, self.min_prototype_samples = float(t0), float(t1), int(min_prototype_samples)
        self.classifier_rows = classifier_rows
        if warmup_end not in WARMUP_ENDS:
            raise ValueError(f"FedMLP warmup_end '{warmup_end}' unknown; choose one of {WARMUP_ENDS}")
        if not 0.0 <= float(warmup_degree) <= 1.0:
            raise ValueError(f"FedMLP warmup_degree must lie in [0, 1], got {warmup_degree}")
        self.warmup_end, self.warmup_degree = warmup_end, float(warmup_degree)
        if not 0.0 <= float(positive_tag_gate) <= 1.0:
            raise ValueError(f"FedMLP positive_tag_gate must lie in [0, 1], got {positive_tag_gate}")
        self.positive_tag_gate = float(positive_tag_gate)

    @staticmethod
    def _expected_shape(ctx: ServerContext) -> Tuple[Optional[int], Optional[int]]:
        """(C, D) from the classifier weight in the global model, when known."""
        for name in ctx.classifier_param_names or []:
            w = ctx.global_weights.get(name) if ctx.global_weights else None
            if w is not None and np.ndim(w) == 2:
                return int(np.shape(w)[0]), int(np.shape(w)[1])
        return None, None

    def check_stats(self, update: SiteUpdate, ctx: ServerContext) -> None:
        stats = update.stats or {}
        if self.classifier_rows == "annotated" and update.num_samples > 0:
            exp_c = self._expected_shape(ctx)[0]
            if "annotated_classes" not in stats:
                raise ValueError(f"FedMLP classifier_rows='annotated' needs statistic 'annotated_classes' from "
                                 f"site '{update.site}', which sent none")
            flags = np.asarray(stats["annotated_classes"], dtype=np.float64)
            if flags.ndim != 1 or (exp_c is not None and flags.shape != (exp_c,)) or \
                    not np.isin(flags, (0.0, 1.0)).all():
                raise ValueError(f"FedMLP stat 'annotated_classes' from site '{update.site}' must hold one 0/1 "
                                 f"value per class ({exp_c}), got shape {flags.shape}")
        self._check_tag_check(update, ctx)
        present = [k for k in STAT_KEYS if k in stats]
        if not present:
            return  # warm-up rounds send no statistics
        missing = [k for k in STAT_KEYS if k not in stats]
        if missing:
            raise ValueError(f"FedMLP stats from site '{update.site}' lack key '{missing[0]}'")
        exp_c, exp_d = self._expected_shape(ctx)
        p_neg = np.asarray(stats["prototypes_neg"])
        if p_neg.ndim != 2:
            raise ValueError(f"FedMLP stat 'prototypes_neg' from site '{update.site}' must be (C, D), "
                             f"got {p_neg.shape}")
        c, d = exp_c if exp_c is not None else p_neg.shape[0], exp_d if exp_d is not None else p_neg.shape[1]
        for key in STAT_KEYS:
            value = np.asarray(stats[key])
            shape = (c, d) if key.startswith("prototypes_") else (c,)
            if value.shape != shape:
                raise ValueError(f"FedMLP stat '{key}' from site '{update.site}' has shape {value.shape}, "
                                 f"expected {shape}")
            if key == "annotated":
                if not np.isin(value.astype(np.float64), (0.0, 1.0)).all():
                    raise ValueError(f"FedMLP stat 'annotated' from site '{update.site}' must be 0/1")
                continue
            if not np.isfinite(value.astype(np.float64)).all():
                raise ValueError(f"FedMLP stat '{key}' from site '{update.site}' holds NaN or Inf")
        for key in ("prototype_counts_neg", "prototype_counts_pos"):
            if (np.asarray(stats[key]) < 0).any():
                raise ValueError(f"FedMLP stat '{key}' from site '{update.site}' is negative")
        deg = np.asarray(stats["learning_degree"], dtype=np.float64)
        if (deg < 0).any() or (deg > 1).any():
            raise ValueError(f"FedMLP stat 'learning_degree' from site '{update.site}' must lie in [0, 1]")

    def _check_tag_check(self, update: SiteUpdate, ctx: ServerContext) -> None:
        """The positive-tag check's counts (sent in stage 2 when the gate is on): both or neither,
        one finite non-negative value per class, hits <= count."""
        stats = update.stats or {}
        keys = [k for k in ("tag_check_hits", "tag_check_count") if k in stats]
        if not keys:
            return
        if len(keys) == 1:
            other = "tag_check_count" if keys[0] == "tag_check_hits" else "tag_check_hits"
            raise ValueError(f"FedMLP stats from site '{update.site}' hold '{keys[0]}' without '{other}'")
        exp_c = self._expected_shape(ctx)[0]
        hits = np.asarray(stats["tag_check_hits"], dtype=np.float64)
        count = np.asarray(stats["tag_check_count"], dtype=np.float64)
        for key, value in (("tag_check_hits", hits), ("tag_check_count", count)):
            if value.ndim != 1 or (exp_c is not None and value.shape != (exp_c,)):
                raise ValueError(f"FedMLP stat '{key}' from site '{update.site}' must hold one value per class "
                                 f"({exp_c}), got shape {value.shape}")
            if not np.isfinite(value).all() or (value < 0).any():
                raise ValueError(f"FedMLP stat '{key}' from site '{update.site}' must be finite and >= 0")
        if hits.shape != count.shape or (hits > count + 1e-9).any():
            raise ValueError(f"FedMLP stat 'tag_check_hits' from site '{update.site}' exceeds 'tag_check_count'")

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext):
        weights = average_weights(updates, ctx)
        if self.classifier_rows == "annotated":
            weights.update(annotated_rows(updates, ctx.classifier_param_names))
        with_stats = [u for u in updates if u.num_samples > 0 and u.stats and "prototypes_neg" in u.stats]
        if not with_stats:
            return weights, {"stage": 1, "t0": self.t0, "t1": self.t1}
        sizes = [float(u.num_samples) for u in with_stats]
        annotated = [np.asarray(u.stats["annotated"]).astype(bool) for u in with_stats]
        # a prototype's weight is its sample count, which cannot exceed the site's samples: capped
        counts_neg = [capped_counts(u, "prototype_counts_neg", ctx) for u in with_stats]
        counts_pos = [capped_counts(u, "prototype_counts_pos", ctx) for u in with_stats]
        ctx.report["prototype_counts_pos"] = {u.site: c.tolist() for u, c in zip(with_stats, counts_pos)}
        ctx.report["prototype_counts_neg"] = {u.site: c.tolist() for u, c in zip(with_stats, counts_neg)}
        p_neg, valid_neg = average_prototypes([u.stats["prototypes_neg"] for u in with_stats], counts_neg,
                                              annotated, sizes, self.min_prototype_samples)
        p_pos, valid_pos = average_prototypes([u.stats["prototypes_pos"] for u in with_stats], counts_pos,
                                              annotated, sizes, self.min_prototype_samples)
        valid = valid_neg & valid_pos  # Z needs both prototypes
        degree = global_learning_degree([u.stats["learning_degree"] for u in with_stats], annotated, sizes)
        prevalence = class_prevalence([u.stats["prototype_counts_pos"] for u in with_stats],
                                      [u.stats["prototype_counts_neg"] for u in with_stats], annotated)
        sites = [u.site for u in with_stats]
        partial = {side: prototype_sources(counts, annotated, sites, self.min_prototype_samples)
                   for side, counts in (("pos", counts_pos), ("neg", counts_neg))}
        for side, classes in partial.items():
            for c, where in classes.items():
                ctx.log(f"FedMLP round {ctx.round}: class {c} {side} prototype averaged over sites {where['used']} "
                        f"only; sites {where['missing']} annotate it but sent none from >= "
                        f"{self.min_prototype_samples} samples (too few, or withheld by their privacy filter)")
            if classes:
                ctx.report[f"prototypes_missing_{side}"] = {str(c): w["missing"] for c, w in classes.items()}
        invalid = [int(j) for j in np.flatnonzero(~valid)]
        if invalid:
            ctx.log(f"FedMLP round {ctx.round}: no valid global prototype pair for classes {invalid}; "
                    "sites skip tagging them")
            ctx.report["prototype_invalid_classes"] = invalid
        stage = 2
        if self.warmup_end == "learning_degree" and int((ctx.global_stats or {}).get("stage", 1)) != 2:
            annotated_somewhere = np.any(np.stack(annotated), axis=0)
            complete, least = warmup_complete(degree, annotated_somewhere, self.warmup_degree)
            ctx.report["warmup_least_degree"] = least
            stage = 2 if complete else 1
            ctx.log(f"FedMLP round {ctx.round}: least global learning degree {least:.3f} "
                    f"({'>=' if complete else '<'} {self.warmup_degree}): "
                    + ("stage 2 from the next round" if complete else "warm-up goes on"))
        global_stats = {
            "stage": stage, "prototypes_neg": p_neg.astype(np.float32), "prototypes_pos": p_pos.astype(np.float32),
            "prototype_valid": valid, "learning_degree": degree,
            "tau0": degree * self.t0, "tau1": degree * self.t1, "t0": self.t0, "t1": self.t1,
            "prototype_sites": len(with_stats), "prevalence": prevalence,
        }
        if self.positive_tag_gate > 0:
            global_stats.update(self._gate(with_stats, len(valid), ctx))
        return weights, global_stats

    def _gate(self, with_stats: List[SiteUpdate], num_classes: int, ctx: ServerContext) -> Dict:
        """Next round's ``positive_tag_open`` from this round's check tags (closed before any)."""
        checked = [u for u in with_stats if "tag_check_count" in u.stats]
        hits = [np.asarray(u.stats["tag_check_hits"], dtype=np.float64) for u in checked] or [np.zeros(num_classes)]
        counts = [np.asarray(u.stats["tag_check_count"], dtype=np.float64) for u in checked] or [np.zeros(num_classes)]
        open_pos, precision = positive_tag_gate(hits, counts, self.positive_tag_gate)
        ctx.report["tag_check_precision"] = [round(float(p), 4) for p in precision]
        ctx.report["tag_check_count"] = [float(n) for n in np.sum(counts, axis=0)]
        ctx.report["positive_tag_open"] = [int(o) for o in open_pos]
        closed = [int(j) for j in np.flatnonzero(~open_pos)]
        if closed:
            ctx.log(f"FedMLP round {ctx.round}: positive tags closed next round for classes {closed} (check-tag "
                    f"precision {[round(float(precision[j]), 3) for j in closed]} < {self.positive_tag_gate}, "
                    "-1 = no check tag)")
        return {"positive_tag_gate": self.positive_tag_gate, "positive_tag_open": open_pos}
