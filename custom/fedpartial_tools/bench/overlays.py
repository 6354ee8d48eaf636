"""Segmentation overlays: a result model's prediction against the truth on a few val images
(true positives green, false negatives red, false positives blue), one PNG per suite and seed."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import numpy as np

from fedpartial_tools.bench.suites import SUITES


# ---------------------------------------------------------------------------------------------
# Segmentation overlays
# ---------------------------------------------------------------------------------------------
OVERLAY_COLOURS = {"tp": (0.0, 1.0, 0.0), "fn": (1.0, 0.0, 0.0), "fp": (0.0, 0.0, 1.0)}


def overlay_rgb(image: np.ndarray, truth: np.ndarray, pred: np.ndarray, alpha: float = 0.6) -> np.ndarray:
    """RGB float image in [0, 1]: the image in grey, true positives green, false negatives red,
    false positives blue (blended with weight ``alpha``).

    Args:
        image: ``(H, W)`` or ``(H, W, 3)``, uint8 or float in [0, 1].
        truth: ``(H, W)`` reference mask (non-zero = foreground).
        pred: ``(H, W)`` predicted mask (non-zero = foreground).
        alpha: colour weight (1 = opaque colours).
    """
    img = np.asarray(image, dtype=np.float64)
    if img.ndim == 3:
        img = img.mean(axis=-1)  # grey, so that the colours stand out
    if np.asarray(image).dtype == np.uint8:
        img = img / 255.0
    truth, pred = np.asarray(truth) > 0, np.asarray(pred) > 0
    if truth.shape != img.shape or pred.shape != img.shape:
        raise ValueError(f"overlay: image {img.shape}, truth {truth.shape} and prediction {pred.shape} "
                         f"must have the same (H, W)")
    out = np.repeat(np.clip(img, 0, 1)[..., None], 3, axis=-1)
    for kind, where in (("tp", truth & pred), ("fn", truth & ~pred), ("fp", ~truth & pred)):
        out[where] = (1 - alpha) * out[where] + alpha * np.asarray(OVERLAY_COLOURS[kind])
    return out


def plot_overlays(images: np.ndarray, truth: np.ndarray, preds: Dict[str, np.ndarray], path: str,
                  title: str = "", row_labels: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """PNG grid: one row per image; columns the image, then each prediction's overlay
    (:func:`overlay_rgb`) titled with its per-image Dice.

    Args:
        images: ``(N, H, W[, 3])`` images.
        truth: ``(N, H, W)`` reference masks.
        preds: ``{column name: (N, H, W) binary predictions}``.
        path: PNG to write.
        title: figure title (the colour legend is added below it).
        row_labels: titles of the image column (default ``image i``).

    Returns:
        ``{column name: (N,) per-image Dice}`` (as in the evaluation: empty vs empty scores 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from fedpartial.metrics import segmentation_scores

    truth = np.asarray(truth) > 0
    n = len(images)
    dice = {job: segmentation_scores(np.asarray(p, dtype=bool).astype(np.uint8), truth.astype(np.uint8))["dice"]
            for job, p in preds.items()}
    cols = 1 + len(preds)
    fig, axes = plt.subplots(n, cols, figsize=(2.4 * cols, 2.4 * n + 0.8), squeeze=False)
    for i in range(n):
        img = np.asarray(images[i])
        axes[i, 0].imshow(img, cmap=None if img.ndim == 3 else "gray")
        axes[i, 0].set_title(row_labels[i] if row_labels else f"image {i}", fontsize=8)
        for j, (job, p) in enumerate(preds.items(), start=1):
            axes[i, j].imshow(overlay_rgb(img, truth[i], np.asarray(p)[i]))
            axes[i, j].set_title(f"{job}\nDice {dice[job][i]:.3f}", fontsize=8)
    for ax in axes.ravel():
        ax.axis("off")
    fig.suptitle((title + "\n" if title else "") + "overlay: true positive green, false negative red, "
                 "false positive blue", fontsize=9)
    fig.legend(handles=[Patch(color=OVERLAY_COLOURS["tp"], label="true positive"),
                        Patch(color=OVERLAY_COLOURS["fn"], label="false negative (missed)"),
                        Patch(color=OVERLAY_COLOURS["fp"], label="false positive")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return dice


def overlay_indices(n_total: int, n_images: int) -> np.ndarray:
    """Fixed choice of test images: ``n_images`` evenly spaced indices of ``n_total``."""
    if n_total <= 0:
        return np.zeros(0, dtype=int)
    return np.unique(np.linspace(0, n_total - 1, min(n_images, n_total)).round().astype(int))


def load_for_eval(ws: str, data, device, cache: Optional[dict] = None):
    """The workspace's final global model and ``data`` resized to the model's input size.

    Args:
        ws: job workspace holding ``global_model.pt``.
        data: the source :class:`Dataset`.
        device: torch device.
        cache: ``{input size: resized dataset}`` shared by models of one suite (resizing is slow).

    Returns:
        ``(model, meta, dataset)``.
    """
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.models.io import load_model_file, model_input_size

    model, meta = load_model_file(os.path.join(ws, "global_model.pt"), device=device)
    size = model_input_size(meta)
    cache = {} if cache is None else cache
    if size not in cache:
        cache[size] = resize_dataset(data, size) if size else data
    return model, meta, cache[size]


def write_overlays(name: str, out_dir: str, seed: int, source: str, n_images: int = 4,
                   jobs: Optional[Sequence[str]] = None, device: str = "auto") -> tuple:
    """``out_dir/<suite>_overlays_seed<k>.png`` from the seed's final global models.

    Models are loaded, the test split resized and normalised as in the bench evaluation
    (:func:`_evaluate_row`); a pixel is predicted foreground at probability > 0.5.

    Args:
        name: a segmentation suite.
        out_dir: bench output folder (workspaces ``out_dir/<suite>/seed<k>/<job>/global_model.pt``).
        seed: seed folder to draw.
        source: the suite's source ``.npz`` (its test split).
        n_images: rows (evenly spaced test images).
        jobs: columns (default the suite's jobs that have a global model, in suite order).
        device: torch device name.

    Returns:
        ``(PNG path, {job: per-image Dice of the drawn images})``.
    """
    from fedpartial.data.npz import load_npz
    from fedpartial.evaluation import predict_split
    from fedpartial.training.common import select_device

    suite = SUITES[name]
    seed_dir = os.path.join(out_dir, name, f"seed{seed}")
    jobs = [j for j in (jobs or suite.jobs) if os.path.isfile(os.path.join(seed_dir, j, "global_model.pt"))]
    if not jobs:
        raise FileNotFoundError(f"no global_model.pt under {seed_dir}/<job>/ for jobs {list(suite.jobs)}")
    torch_device = select_device(device)
    data = load_npz(source)
    if "test" not in data.splits:
        raise ValueError(f"{source} has no 'test' split (it has {sorted(data.splits)})")
    if not data.is_segmentation:
        raise ValueError(f"{source} holds {data.task} data; overlays are for segmentation")
    index = overlay_indices(len(data.splits["test"]), n_images)
    cache, preds, shown = {}, {}, None
    for job in jobs:
        model, meta, resized = load_for_eval(os.path.join(seed_dir, job), data, torch_device, cache)
        test = resized.splits["test"].subset(index)
        if shown is None:
            shown = (job, test)
        elif test.images.shape != shown[1].images.shape:
            raise ValueError(f"{name} seed {seed}: {job} predicts at {test.images.shape[1:3]}, {shown[0]} at "
                             f"{shown[1].images.shape[1:3]}; one overlay grid needs one size")
        probs = predict_split(model, test, resized.task, meta["normalisation"], torch_device)
        preds[job] = probs > 0.5
    path = os.path.join(out_dir, f"{name}_overlays_seed{seed}.png")
    test = shown[1]
    dice = plot_overlays(test.images, np.asarray(test.labels) > 0, preds, path,
                         title=f"{name}, seed {seed}: final global models on test images",
                         row_labels=[f"test #{i}" for i in index])
    return path, dice
