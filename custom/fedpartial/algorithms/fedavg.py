"""FedAvg baselines: the supervised client rule for partial labels and size-weighted averaging.

Three baselines share :class:`SupervisedClient`, differing only in ``loss_mode``:

* ``missing-negative`` (job ``fedavg``): an unannotated entry counts as negative.
  Multi-label: BCE over all C entries. Single-label: softmax CE over all C classes on the samples
  whose class the site knows (an unlabelled sample cannot be given a single class, so it is skipped).
* ``partial`` (job ``fedavg_partial_loss``): loss on annotated entries only. Multi-label: BCE where
  ``label_mask`` is 1. Single-label: softmax restricted to the site's annotated classes.
* ``full`` (job ``fedavg_full``): the site file is the complete-label reference copy; same loss as
  ``missing-negative`` (all entries are annotated there).

A site with no annotated sample (an unlabelled site of a semi-supervised split) returns
``num_samples = 0`` and so takes no part in the average: FedAvg on the labelled sites only.

A baseline matched to a method (``--matched-to``) takes the method's whole local recipe: the
augmentation, label smoothing, views per batch, local epochs (fractional ones too), the optimiser's
settings and the multi-label imbalance handling (class-weighted BCE, logit adjustment) are all
constructor arguments here. Matched in compute and weighting, it also makes the method's optimizer
steps per round at each site (``steps_of``: batches drawn from its labelled rows, cycling) and
weights its sites as the method does (``weight_by``).
"""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import torch

from fedpartial.algorithms.aggregation import average_weights
from fedpartial.algorithms.base import ClientRule, RoundInput, RoundResult, ServerContext, ServerRule, SiteUpdate
from fedpartial.data.transforms import training_view
from fedpartial.data.types import SINGLE_LABEL
from fedpartial.training.common import ImageSource, batch_indices, prefetch, round_seed, seed_everything
from fedpartial.training.losses import (class_statistics, logit_adjustment, masked_bce_with_logits,
                                        masked_cross_entropy, pos_weight_from_counts, positive_rates)

LOSS_MODES = ("missing-negative", "partial", "full")
#: what a site's ``num_samples`` (its weight in the average) counts
WEIGHT_BY = ("labelled_rows", "all_rows")

#: What the client rule returns in ``metrics`` (sent as ``site_metrics``) and when a site's result
#: policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
SENT_METRICS = {"fedavg": {"train_loss": "scope", "train_steps": "scope"}}


class FedAvgServer(ServerRule):
    """Plain FedAvg: weights averaged by data size (or ``ctx.weight_rule``), no statistics."""

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext):
        return average_weights(updates, ctx), {}


def labelled_rows(labels: np.ndarray, label_mask: np.ndarray, task: str) -> np.ndarray:
    """Indices of samples that carry any usable supervision for a supervised baseline.

    Single-label: samples with one annotated positive. Multi-label: samples with any annotated entry.
    """
    if task == SINGLE_LABEL:
        return np.flatnonzero(((labels * label_mask) > 0.5).any(axis=1))
    return np.flatnonzero(label_mask.any(axis=1))


def supervised_loss(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, task: str,
                    loss_mode: str, label_smoothing: float = 0.0, pos_weight: Optional[torch.Tensor] = None,
                    offset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Loss of one batch for a FedAvg baseline (see module docstring).

    Args:
        logits: ``(N, C)``.
        labels: ``(N, C)`` multi-hot.
        label_mask: ``(N, C)`` 1 where annotated.
        task: ``single-label`` or ``multi-label``.
        loss_mode: one of ``missing-negative``, ``partial``, ``full``.
        label_smoothing: cross-entropy label smoothing (single-label only).
        pos_weight: multi-label only: ``(C,)`` BCE weight of positives (class-weighted BCE).
        offset: multi-label only: ``(C,)`` logit adjustment added to the logits.
    """
    if task == SINGLE_LABEL:
        target = labels.argmax(dim=1)
        known = ((labels * label_mask) > 0.5).any(dim=1).float()
        class_mask = label_mask if loss_mode == "partial" else None
        return masked_cross_entropy(logits, target, class_mask=class_mask, sample_weight=known,
                                    label_smoothing=label_smoothing)
    if offset is not None:
        logits = logits + offset.to(logits.device, logits.dtype)
    return masked_bce_with_logits(logits, labels, loss_mask(label_mask, loss_mode), pos_weight)


def loss_mask(label_mask: torch.Tensor, loss_mode: str) -> torch.Tensor:
    """Multi-label: the entries the loss of ``loss_mode`` uses (annotated ones for ``partial``, all
    otherwise: an unannotated entry then counts as negative)."""
    return label_mask if loss_mode == "partial" else torch.ones_like(label_mask)


class SupervisedClient(ClientRule):
    """Local supervised training for the FedAvg baselines.

    The train split stays as it was loaded (uint8, in memory or memory-mapped from a site
    folder); each batch is read and converted to floats on its own
    (:class:`fedpartial.training.common.ImageSource`), so the whole split never exists as a float
    tensor. Batches and the order of samples within them are those of a whole-split float
    tensor: same seed, same weights.

    Args:
        loss_mode: ``missing-negative`` | ``partial`` | ``full``.
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
        betas: Adam betas.
        batch_size: samples per step.
        local_epochs: epochs over the site's labelled samples per round; a fraction gives
            ``ceil(local_epochs * n / batch_size)`` steps.
        local_iterations: if set (> 0), a fixed number of steps per round instead of epochs.
        augmentation: view of the training images, one of
            :data:`fedpartial.data.transforms.TRAINING_VIEWS` (``affine`` takes ``rotate_deg`` / ``translate``).
        rotate_deg / translate: of the ``affine`` augmentation.
        label_smoothing: cross-entropy label smoothing (single-label).
        num_views: augmented views of each batch whose losses are averaged in one step.
        loader_workers: batches prepared ahead by a background thread (0 = read each batch when
            it is needed; results do not depend on it). Off by default: on CPU, reading and
            converting a batch from a memory-mapped folder cost about 1-4% of a step, and the
            extra thread competes with torch for the cores
            (``python -m fedpartial_tools.bench.streaming --loader-workers 0,2``).
        steps_of: ``{"rule": <registered client rule>, "rule_args": {...}}``: make, every round, as
            many optimizer steps as that rule states for this site's data
            (:meth:`~fedpartial.algorithms.base.ClientRule.round_steps`), drawing batches from the
            labelled rows and cycling through epochs of them (the compute-matched baseline of a
            method whose epoch covers rows this baseline cannot use). None = its own epochs;
            ``local_epochs`` / ``local_iterations`` are then unused.
        weight_by: what ``num_samples`` (the site's weight in the average) counts: ``labelled_rows``
            (the rows it trains on) or ``all_rows`` (every train row, as FedLSM and FedMLP count).
        class_weighted_bce: multi-label: BCE positives of class c weighted by #negatives / #positives of
            this site's annotated entries of c (FedLSM's weighting, from the site's own counts:
            a FedAvg site sends no statistics). Single-label: no effect.
        max_pos_weight: optional cap on those weights (None: none).
        logit_adjustment: multi-label: logits shifted by ``la_tau * log(pi_c / (1 - pi_c))``, pi_c =
            the positive rate of class c over the entries the loss uses at this site (FedMLP's
            Eq. 3 with local rates). Single-label: no effect.
        la_tau: strength of the logit adjustment.
        la_eps: positive rates are clipped to ``[la_eps, 1 - la_eps]``.
    """

    def __init__(self, loss_mode: str = "missing-negative", lr: float = 1e-4, weight_decay: float = 5e-4,
                 betas=(0.9, 0.99), batch_size: int = 64, local_epochs: float = 1, local_iterations=None,
                 augmentation: str = "weak", rotate_deg: float = 10.0, translate: float = 0.02,
                 label_smoothing: float = 0.0, num_views: int = 1, loader_workers: int = 0,
                 steps_of: Optional[dict] = None, weight_by: str = "labelled_rows", class_weighted_bce: bool = False,
                 max_pos_weight: Optional[float] = None, logit_adjustment: bool = False, la_tau: float = 1.0,
                 la_eps: float = 1e-3):
        if loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode '{loss_mode}' unknown; choose one of {LOSS_MODES}")
        if weight_by not in WEIGHT_BY:
            raise ValueError(f"weight_by '{weight_by}' unknown; choose one of {WEIGHT_BY}")
        if not 0.0 < float(la_eps) < 0.5:
            raise ValueError(f"la_eps must be in (0, 0.5), got {la_eps}")
        self.steps_rule = _steps_rule(steps_of)
        self.steps_of, self.weight_by = steps_of, weight_by
        self.class_weighted_bce, self.max_pos_weight = bool(class_weighted_bce), max_pos_weight
        self.logit_adjustment, self.la_tau, self.la_eps = bool(logit_adjustment), float(la_tau), float(la_eps)
        if int(loader_workers) < 0:
            raise ValueError(f"loader_workers must be >= 0, got {loader_workers}")
        if not float(local_epochs) > 0 or int(num_views) < 1 or not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"local_epochs must be > 0, num_views >= 1 and label_smoothing in [0, 1); got "
                             f"{local_epochs}, {num_views}, {label_smoothing}")
        self.loss_mode, self.lr, self.weight_decay, self.betas = loss_mode, lr, weight_decay, tuple(betas)
        self.batch_size, self.local_epochs = batch_size, float(local_epochs)
        self.local_iterations = int(local_iterations or 0)
        self.augmentation, self.label_smoothing, self.num_views = augmentation, float(label_smoothing), int(num_views)
        self.loader_workers = int(loader_workers)
        self.view = training_view(augmentation, rotate_deg=rotate_deg, translate=translate)

    def setup(self, ctx):
        super().setup(ctx)
        train = ctx.data.splits["train"]
        self.task = ctx.data.task
        self.rows = labelled_rows(train.labels, train.label_mask, self.task)
        self.images = ImageSource(train.images, ctx.normalisation, self.rows)
        self.labels = torch.as_tensor(train.labels[self.rows], dtype=torch.float32)
        self.label_mask = torch.as_tensor(train.label_mask[self.rows], dtype=torch.float32)
        self.weight = (len(self.rows) if self.weight_by == "labelled_rows" else len(train)) if len(self.rows) else 0
        self.matched_steps = None
        if self.steps_rule is not None:
            self.matched_steps = int(self.steps_rule.round_steps(ctx.data))
            ctx.log(f"site '{ctx.site}': {self.matched_steps} steps per round, as the client rule "
                    f"'{self.steps_of['rule']}' makes here ({len(self.rows)} labelled of {len(train)} rows)")
        self.pos_weight = self.offset = None
        if self.task != SINGLE_LABEL and self.class_weighted_bce:
            counts = class_statistics(train.labels[self.rows], train.label_mask[self.rows])
            self.pos_weight = torch.as_tensor(pos_weight_from_counts(*counts, self.max_pos_weight),
                                              dtype=torch.float32, device=ctx.device)
        if self.task != SINGLE_LABEL and self.logit_adjustment:
            rates = positive_rates(self.labels, loss_mask(self.label_mask, self.loss_mode))
            self.offset = logit_adjustment(rates, self.la_tau, self.la_eps).to(ctx.device)
        if len(self.rows) == 0:
            ctx.log(f"site '{ctx.site}' has no annotated sample: it trains nothing and takes no part in FedAvg")

    def batch_images(self, idx: np.ndarray) -> torch.Tensor:
        """Normalised float images of the labelled samples ``idx`` (positions in ``self.rows``), in that order."""
        return self.images.batch(idx)

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.view is None else self.view(x)

    def _batches(self, n: int, rng: np.random.Generator, epochs: int):
        # only index draws and image reads here: augmentation stays in the training loop, so the
        # torch RNG is used in the same order whether batches are prefetched or not
        for _ in range(epochs):
            for idx in batch_indices(n, self.batch_size, rng, drop_last=True):
                yield idx, self.batch_images(idx)

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        n = len(self.rows)
        if n == 0:
            return RoundResult(num_samples=0, metrics={"train_loss": 0.0})
        if self.matched_steps == 0:  # the matched rule makes no step here either
            return RoundResult(num_samples=self.weight, metrics={"train_loss": 0.0, "train_steps": 0})
        seed = round_seed(self.ctx.seed, self.ctx.site, inp.round)
        seed_everything(seed)
        rng = np.random.default_rng(seed)
        device = self.ctx.device
        optimizer = torch.optim.Adam(model.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        model.train()
        losses, steps = [], 0
        max_steps = self.local_iterations if self.local_iterations > 0 else None
        if max_steps is None and self.local_epochs != int(self.local_epochs):
            max_steps = max(1, math.ceil(self.local_epochs * n / self.batch_size))
        if self.matched_steps is not None:
            max_steps = self.matched_steps
        epochs = int(self.local_epochs) if max_steps is None else 10**9
        batches = prefetch(self._batches(n, rng, epochs), self.loader_workers)
        try:
            for idx, images in batches:
                if self.ctx.abort():
                    return RoundResult(num_samples=self.weight, metrics={"train_loss": float(np.mean(losses or [0.0]))})
                labels, label_mask = self.labels[idx].to(device), self.label_mask[idx].to(device)
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for _view in range(self.num_views):  # one backward per view: one view's activations at a time
                    x = self._augment(images).to(device, non_blocking=True)
                    _, logits = model(x)
                    view_loss = supervised_loss(logits, labels, label_mask, self.task, self.loss_mode,
                                                self.label_smoothing, self.pos_weight, self.offset) / self.num_views
                    view_loss.backward()
                    loss += float(view_loss.detach())
                optimizer.step()
                losses.append(loss)
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops a prefetch thread at once when the round ends early
        return RoundResult(num_samples=self.weight,
                           metrics={"train_loss": float(np.mean(losses)), "train_steps": steps})


def _steps_rule(steps_of: Optional[dict]):
    """The client rule named by ``steps_of`` (registered name and arguments), built to state its
    steps per round; None for None.

    Raises:
        ValueError: naming the key, for a malformed value or a rule that states no steps.
    """
    if steps_of is None:
        return None
    if not isinstance(steps_of, dict) or not isinstance(steps_of.get("rule"), str) or \
            set(steps_of) - {"rule", "rule_args"} or not isinstance(steps_of.get("rule_args", {}), dict):
        raise ValueError(f"steps_of must be {{'rule': <registered client rule>, 'rule_args': {{...}}}}, "
                         f"got {steps_of!r}")
    from fedpartial.algorithms.registry import build_rule  # the registry imports this module

    rule = build_rule("client", steps_of["rule"], steps_of.get("rule_args", {}))
    if type(rule).round_steps is ClientRule.round_steps:
        raise ValueError(f"steps_of: the client rule '{steps_of['rule']}' states no steps per round (round_steps)")
    return rule
