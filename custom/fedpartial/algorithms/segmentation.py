"""Plain Dice-loss supervised lesion segmentation: the FedAvg segmentation baselines and FedIA's
warm-up share these pieces.

* :func:`binary_masks` checks a site's masks and hands them out as 0/1 uint8 ``(N, H, W)`` rows
  through a :class:`MaskSource` (read batch by batch, as :class:`ImageSource` reads images);
  :func:`mask_chunks` walks any mask stack block by block for whole-split counts;
* :func:`train_dice_epoch` runs one local epoch with MONAI ``DiceLoss(sigmoid=True)`` and returns
  the sample-weighted mean loss (FedIA's ℓ_k, eq. 5);
* :func:`foreground_batches` and :func:`iou_counts` give the IoU of a model on the site's own
  train masks (FedIA's IoU_k(t)) batch by batch; :func:`iou_score` on whole mask stacks;
* :class:`SegmentationSupervisedClient` is the baseline client rule (jobs ``fedavg_seg`` on the
  incomplete masks and ``fedavg_seg_full`` on the complete reference copies).

Binary segmentation only: the model has one output channel read with a sigmoid.

Departure from the FedIA reference code: ``weight_decay`` defaults to 0 (the paper names none;
the reference code's Adam uses 5e-4). It is a constructor argument, so
``--set rule_args.weight_decay=0.0005`` gives the reference setting.
"""
from __future__ import annotations

from typing import Callable, Iterator, Tuple

import numpy as np
import torch

from fedpartial.algorithms.base import ClientContext, ClientRule, RoundInput, RoundResult
from fedpartial.data.types import DataError
from fedpartial.training.common import (DRAWS, ImageSource, batch_indices, check_lr_schedule, predict_batches,
                                        round_lr, round_seed, seed_everything, take_rows)

#: What :class:`SegmentationSupervisedClient` returns in ``metrics`` (sent as ``site_metrics``) and
#: when a site's result policy releases each key (the rules: ``fedpartial.flare.result_policy.METRIC_RULE_NAMES``).
SENT_METRICS = {"segmentation": {"train_loss": "scope", "train_iou": "scope", "train_steps": "scope"}}


class MaskSource:
    """A split's masks (any id > 0 is foreground) handed out as 0/1 uint8 rows, read only when
    asked for: at 20,000 images of 224 px a whole 0/1 copy is 1 GB, so no client holds one.

    It stands where a uint8 ``(N, H, W)`` array was indexed: ``source[idx]``, ``len``, ``shape``
    and ``np.asarray(source)`` (the whole split at once: for tests and small stacks only).

    Args:
        labels: ``(N, H, W)`` integer array or ``np.memmap`` (a site folder's labels).
    """

    ndim = 3

    def __init__(self, labels: np.ndarray):
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def shape(self) -> tuple:
        return tuple(self.labels.shape)

    def __getitem__(self, idx) -> np.ndarray:
        block = self.labels[idx] if isinstance(idx, (slice, int, np.integer)) else take_rows(self.labels, idx)
        return (np.asarray(block) > 0).astype(np.uint8)

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


def mask_chunks(masks, chunk: int = 256) -> Iterator[Tuple[slice, np.ndarray]]:
    """``(rows, bool block)`` over a mask stack, ``chunk`` images at a time.

    Args:
        masks: a :class:`MaskSource`, array or memory map of ``(N, H, W)`` masks.
        chunk: images per block.
    """
    for start in range(0, len(masks), int(chunk)):
        rows = slice(start, min(start + int(chunk), len(masks)))
        yield rows, np.asarray(masks[rows]) > 0


def lesion_flags(masks, chunk: int = 256) -> np.ndarray:
    """Bool ``(N,)``: which images have any foreground pixel, counted block by block."""
    flags = np.zeros(len(masks), dtype=bool)
    for rows, block in mask_chunks(masks, chunk):
        flags[rows] = block.reshape(len(block), -1).any(axis=1)
    return flags


def binary_masks(ctx: ClientContext, split: str = "train") -> MaskSource:
    """The site's ``split`` masks as a :class:`MaskSource` of 0/1 uint8 ``(N, H, W)`` rows.

    Args:
        ctx: the client context (its ``data`` must be a segmentation dataset).
        split: which split to read.

    Raises:
        DataError: not a segmentation site file, split missing, or mask shape != image shape.
    """
    data = ctx.data
    if not data.is_segmentation:
        raise DataError(f"{data.where()}: task is '{data.task}', a segmentation rule needs task 'segmentation'")
    if split not in data.splits:
        raise DataError(f"{data.where()}: no '{split}' split (have {sorted(data.splits)})")
    part = data.splits[split]
    masks = part.labels
    if masks.ndim != 3 or tuple(masks.shape) != tuple(part.images.shape[:3]):
        raise DataError(f"{data.where()}: key '{split}_labels' has shape {masks.shape}, expected (N, H, W) = "
                        f"{part.images.shape[:3]} to match '{split}_images'")
    return MaskSource(masks)


def make_adam(model: torch.nn.Module, lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    """A fresh Adam optimizer for one round (FedIA: lr 1e-4, betas (0.9, 0.99))."""
    return torch.optim.Adam(model.parameters(), lr=float(lr), betas=tuple(betas), weight_decay=float(weight_decay))


#: ``loss`` choices of the segmentation rules (MONAI losses on one sigmoid channel)
SEG_LOSSES = ("dice", "dice_ce", "dice_focal")


def make_dice_loss(batch: bool = False, kind: str = "dice"):
    """MONAI segmentation loss on one sigmoid output channel.

    ``dice`` (the FedIA paper): per-image soft Dice, which gives an empty image's prediction
    almost no gradient, so a model of sparse small lesions may drift to marking much of every
    image. ``dice_ce`` adds the pixel-wise binary cross-entropy (``DiceCELoss``), ``dice_focal``
    the focal loss (``DiceFocalLoss``): both penalise every false-positive pixel, on empty images too.

    Args:
        batch: False = Dice per image then mean over the batch (MONAI's default); True = one Dice
            over the whole batch.
        kind: one of :data:`SEG_LOSSES`.
    """
    from monai.losses import DiceCELoss, DiceFocalLoss, DiceLoss

    if kind == "dice":
        return DiceLoss(sigmoid=True, batch=bool(batch))
    if kind == "dice_ce":
        return DiceCELoss(sigmoid=True, batch=bool(batch))
    if kind == "dice_focal":
        return DiceFocalLoss(sigmoid=True, batch=bool(batch))
    raise ValueError(f"segmentation loss '{kind}' unknown; choose one of {SEG_LOSSES}")


def lesion_batches(has_lesion: np.ndarray, batch_size: int, rng: np.random.Generator, lesion_fraction: float = 0.0):
    """Index batches of one epoch (``ceil(N / batch_size)`` steps, the last smaller), with at least
    ``ceil(lesion_fraction * size)`` images of each batch drawn (with replacement) from the images
    that hold a lesion; the rest follows a shuffle of all images. ``lesion_fraction`` 0 (or a site
    without lesions) = a plain shuffle.

    Args:
        has_lesion: ``(N,)`` bool, the image's mask holds foreground.
        batch_size: images per step.
        rng: numpy generator.
        lesion_fraction: share of each batch taken from the lesion images (0..1).
    """
    n = len(has_lesion)
    lesion_rows = np.flatnonzero(has_lesion)
    order = rng.permutation(n)
    for start in range(0, n, int(batch_size)):
        idx = order[start:start + int(batch_size)]
        k = int(np.ceil(float(lesion_fraction) * len(idx) - 1e-9)) if len(lesion_rows) else 0
        short = k - int(has_lesion[idx].sum())
        if short > 0:  # replace non-lesion images of this batch by lesion images
            others = np.flatnonzero(~has_lesion[idx])[:short]
            idx = idx.copy()
            idx[others] = rng.choice(lesion_rows, size=len(others), replace=True)
        DRAWS.record(n, idx)
        yield idx


def train_dice_epoch(model: torch.nn.Module, images, masks: np.ndarray, optimizer: torch.optim.Optimizer,
                     loss_fn: Callable, device: torch.device, batch_size: int, rng: np.random.Generator,
                     abort: Callable[[], bool] = lambda: False, lesion_fraction: float = 0.0) -> Tuple[float, int]:
    """One local epoch of Dice-loss training on ``images`` / ``masks``.

    Args:
        model: a segmentation model, ``model(x) -> (features, logits (N, 1, H, W))``; trained in place.
        images: normalised ``(N, C, H, W)`` CPU tensor, or an :class:`ImageSource` (read batch by batch).
        masks: 0/1 ``(N, H, W)`` targets (the masks the site trains on this round): an array,
            memory map or :class:`MaskSource`.
        optimizer: optimizer over ``model``'s parameters.
        loss_fn: e.g. :func:`make_dice_loss`; called as ``loss_fn(logits, target)``.
        device: where to train.
        batch_size: images per step (the last, smaller batch is kept).
        rng: numpy generator for the shuffle.
        abort: returns True when the round must stop.
        lesion_fraction: share of each batch drawn from images with a lesion (:func:`lesion_batches`;
            0 = a plain shuffle, the paper).

    Returns:
        ``(mean_loss, steps)``: the per-image mean training loss (each batch loss weighted by its
        size, FedIA eq. 5) and the number of optimizer steps. ``mean_loss`` is NaN when no step ran.
    """
    n = len(images)
    model.train()
    total, seen, steps = 0.0, 0, 0
    batches = (lesion_batches(lesion_flags(masks), batch_size, rng, lesion_fraction)
               if lesion_fraction > 0 else batch_indices(n, int(batch_size), rng, shuffle=True))
    for idx in batches:
        if abort():
            break
        x = images[idx].to(device, non_blocking=True)
        y = torch.from_numpy(masks[idx]).to(device=device, dtype=torch.float32).unsqueeze(1)
        _, logits = model(x)
        loss = loss_fn(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += float(loss.detach()) * len(idx)
        seen += len(idx)
        steps += 1
    return (total / seen if seen else float("nan")), steps


def foreground_batches(model: torch.nn.Module, images, device: torch.device, batch_size: int = 16
                       ) -> Iterator[Tuple[slice, np.ndarray]]:
    """Sigmoid foreground probabilities of ``model`` in eval mode, one batch at a time, so a
    whole split's probabilities never exist at once. Yields ``(rows, probs)``: the slice of the
    images and their ``(B, H, W)`` float32 probabilities, in order.

    Args:
        model: segmentation model with one output channel.
        images: normalised ``(N, C, H, W)`` CPU tensor or an :class:`ImageSource`.
        device: where to run.
        batch_size: images per forward pass.
    """
    for start, logits in predict_batches(model, images, device, batch_size=batch_size):
        if logits.ndim != 4 or logits.shape[1] != 1:
            raise ValueError(f"segmentation model must output (N, 1, H, W) logits, got {tuple(logits.shape)}")
        yield slice(start, start + logits.shape[0]), torch.sigmoid(logits[:, 0]).numpy().astype(np.float32)


def iou_counts(predicted: np.ndarray, target: np.ndarray) -> Tuple[int, int]:
    """Pixels in the intersection and in the union of two binary mask stacks (summed over a
    split batch by batch, they give :func:`iou_score` of the whole split).

    Args:
        predicted: bool / 0-1 array.
        target: bool / 0-1 array of the same shape.
    """
    predicted, target = np.asarray(predicted) > 0, np.asarray(target) > 0
    if predicted.shape != target.shape:
        raise ValueError(f"IoU: predicted shape {predicted.shape} != target shape {target.shape}")
    return int(np.logical_and(predicted, target).sum()), int(np.logical_or(predicted, target).sum())


def iou_from_counts(intersection: int, union: int) -> float:
    """``intersection / union``; 1.0 when the union is empty (both masks empty everywhere)."""
    return 1.0 if union == 0 else intersection / union


def iou_score(predicted: np.ndarray, target: np.ndarray) -> float:
    """IoU of two binary mask stacks pooled over all pixels of all images
    (sum of intersections / sum of unions); 1.0 when both are empty everywhere.

    Args:
        predicted: bool / 0-1 array.
        target: bool / 0-1 array of the same shape.
    """
    return iou_from_counts(*iou_counts(predicted, target))


class SegmentationSupervisedClient(ClientRule):
    """Local Dice-loss training of a binary lesion segmentation model (FedAvg baselines).

    Every round: one (or ``local_epochs``) epoch(s) of Adam on the site's train masks, then the
    IoU of the trained model on those same masks. Metrics: ``train_loss``, ``train_iou``.

    Args:
        lr: Adam learning rate (FedIA paper: 1e-4).
        betas: Adam betas (paper: (0.9, 0.99)).
        weight_decay: Adam weight decay (the paper names none; its code uses 5e-4).
        batch_size: images per step (paper: 4).
        local_epochs: epochs per round (paper: 1).
        prob_threshold: foreground probability above which a pixel is predicted lesion (IoU).
        dice_batch: MONAI ``DiceLoss(batch=...)``: False = per-image Dice averaged.
        predict_batch_size: images per forward pass when predicting.
        loss: ``dice`` (paper), ``dice_ce`` or ``dice_focal`` (:func:`make_dice_loss`).
        lesion_fraction: share of each training batch drawn from images with a lesion (0 = paper:
            uniform; for sparse lesions where most images are empty).
        lr_schedule: ``constant`` (paper) or ``cosine`` over the job's rounds (:func:`round_lr`).
        final_lr_fraction: the last round's lr as a share of ``lr`` under ``cosine``.
    """

    task_kind = "segmentation"

    def __init__(self, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, batch_size: int = 4,
                 local_epochs: int = 1, prob_threshold: float = 0.5, dice_batch: bool = False,
                 predict_batch_size: int = 16, loss: str = "dice", lesion_fraction: float = 0.0,
                 lr_schedule: str = "constant", final_lr_fraction: float = 0.1):
        if loss not in SEG_LOSSES:
            raise ValueError(f"segmentation loss '{loss}' unknown; choose one of {SEG_LOSSES}")
        if not 0.0 <= float(lesion_fraction) <= 1.0:
            raise ValueError(f"lesion_fraction must be in [0, 1], got {lesion_fraction}")
        self.loss, self.lesion_fraction = loss, float(lesion_fraction)
        if int(batch_size) < 1 or int(local_epochs) < 1:
            raise ValueError(f"batch_size and local_epochs must be >= 1, got {batch_size} and {local_epochs}")
        if not 0.0 < float(prob_threshold) < 1.0:
            raise ValueError(f"prob_threshold must be in (0, 1), got {prob_threshold}")
        self.lr, self.betas, self.weight_decay = float(lr), tuple(betas), float(weight_decay)
        self.batch_size, self.local_epochs = int(batch_size), int(local_epochs)
        self.prob_threshold, self.dice_batch = float(prob_threshold), bool(dice_batch)
        self.predict_batch_size = int(predict_batch_size)
        check_lr_schedule(lr_schedule, final_lr_fraction)
        self.lr_schedule, self.final_lr_fraction = lr_schedule, float(final_lr_fraction)

    def setup(self, ctx: ClientContext) -> None:
        super().setup(ctx)
        self.masks = binary_masks(ctx, "train")  # read batch by batch, as the images
        self.images = ImageSource(ctx.data.splits["train"].images, ctx.normalisation)  # uint8, read batch by batch
        self.loss_fn = make_dice_loss(self.dice_batch, self.loss)

    def round_rng(self, round_index: int) -> np.random.Generator:
        """Seed torch and return the shuffle generator of ``round_index`` (repeatable rounds)."""
        seed = round_seed(self.ctx.seed, self.ctx.site, round_index)
        seed_everything(seed)
        return np.random.default_rng(seed)

    def train_on(self, model, masks: np.ndarray, round_index: int, num_rounds: int) -> Tuple[float, float, int]:
        """Train ``model`` in place on ``masks`` for ``local_epochs`` epochs at the round's lr, then
        measure its IoU on the same masks. Returns ``(mean_loss, iou, steps)`` (mean loss of the last epoch)."""
        rng = self.round_rng(round_index)
        device = self.ctx.device
        model.to(device)
        lr = round_lr(self.lr, round_index, num_rounds, self.lr_schedule, self.final_lr_fraction)
        optimizer = make_adam(model, lr, self.betas, self.weight_decay)
        mean_loss, steps = float("nan"), 0
        for _ in range(self.local_epochs):
            mean_loss, epoch_steps = train_dice_epoch(model, self.images, masks, optimizer, self.loss_fn, device,
                                                      self.batch_size, rng, self.ctx.abort, self.lesion_fraction)
            steps += epoch_steps
        return mean_loss, self.iou(model, masks), steps

    def predict_batches(self, model) -> Iterator[Tuple[slice, np.ndarray]]:
        """Foreground probabilities of ``model`` on the site's train images, batch by batch
        (:func:`foreground_batches`)."""
        return foreground_batches(model, self.images, self.ctx.device, self.predict_batch_size)

    def iou(self, model, masks: np.ndarray) -> float:
        """Pooled IoU of ``model``'s prediction (probability > ``prob_threshold``) on ``masks``."""
        intersection = union = 0
        for rows, probs in self.predict_batches(model):
            i, u = iou_counts(probs > self.prob_threshold, masks[rows])
            intersection, union = intersection + i, union + u
        return iou_from_counts(intersection, union)

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        n = len(self.masks)
        if n == 0:
            self.ctx.log(f"site '{self.ctx.site}' has no training image: it takes no part in FedAvg")
            return RoundResult(num_samples=0, metrics={"train_loss": 0.0, "train_iou": 0.0})
        mean_loss, iou, steps = self.train_on(model, self.masks, inp.round, inp.num_rounds)
        return RoundResult(num_samples=n, metrics={"train_loss": mean_loss, "train_iou": iou, "train_steps": steps})

