"""``python -m fedpartial evaluate``: any ``.npz`` a user has (a source file with any subset of
train/val/test, a test-only file, a site file) or a folder of site files, classification scored
only on annotated entries, segmentation scored at the images' native resolution; and the
pseudo-label census used by the bench's reports."""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import numpy as np
import torch

from fedpartial.data.types import SEGMENTATION, DataError, Split
from fedpartial.evaluation import predict_split
from fedpartial.models.io import model_input_size
from fedpartial.training.common import images_to_tensor, predict, probabilities


def pseudo_label_census(model, site_files, reference_dir: str, normalisation: dict, device, tau: float = 0.95,
                        renormalise_missing: bool = False) -> dict:
    """Which classes a single-label model would pseudo-label at each site (FedLSM's rule,
    :func:`fedpartial.algorithms.fedlsm.single_label_pseudo_labels`), against the hidden truth.

    A diagnostic for "why does a method not learn class c from the sites that do not annotate
    it": counts, per class, the hidden samples of that class and the confident pseudo labels the
    model gives (and how many of those are right).

    Args:
        model: a single-label classifier ``x -> (features, logits)``.
        site_files: paths of the site ``.npz`` files (partial labels, ``label_mask``).
        reference_dir: folder of ``<site>_full.npz`` copies with the complete labels.
        normalisation: the model's ``{"mean", "std"}``.
        device: torch device.
        tau: confidence threshold.
        renormalise_missing: the FedLSM option of the same name.

    Returns:
        ``{"classes": [...], "sites": {site: {"hidden": [...], "pseudo": [...], "correct": [...]}},
        "total": {...}}`` with one count per class in each list.
    """
    import os

    from fedpartial.algorithms.fedlsm import single_label_pseudo_labels
    from fedpartial.data.npz import load_npz

    out, total, classes = {}, None, None
    for path in site_files:
        site = os.path.splitext(os.path.basename(path))[0]
        data = load_npz(path)
        ref_path = os.path.join(reference_dir, f"{site}_full.npz")
        if not os.path.isfile(ref_path):
            raise FileNotFoundError(f"no reference copy '{ref_path}' for site file '{path}'")
        train, truth = data.splits["train"], np.asarray(load_npz(ref_path).splits["train"].labels) > 0.5
        if truth.shape != np.shape(train.labels):
            raise ValueError(f"'{ref_path}' labels {truth.shape} do not match '{path}' {np.shape(train.labels)}")
        classes = list(data.class_names)
        x = images_to_tensor(train.images, normalisation["mean"], normalisation["std"])
        probs = probabilities(predict(model, x, device), data.task).double().cpu()
        mask = torch.as_tensor(np.asarray(train.label_mask, dtype=np.float64))
        labels = torch.as_tensor(np.asarray(train.labels, dtype=np.float64))
        target, _, is_pseudo = single_label_pseudo_labels(probs, labels, mask, tau, renormalise_missing)
        hidden = truth & ~(np.asarray(labels * mask) > 0.5).any(axis=1, keepdims=True)
        pseudo = np.zeros_like(truth)
        pseudo[np.flatnonzero(is_pseudo.numpy()), target[is_pseudo].numpy()] = True
        row = {"hidden": hidden.sum(0).tolist(), "pseudo": pseudo.sum(0).tolist(),
               "correct": (pseudo & truth).sum(0).tolist()}
        out[site] = row
        total = row if total is None else {k: [a + b for a, b in zip(total[k], row[k])] for k in row}
    return {"classes": classes, "sites": out, "total": total}


def _split_error(path: str, requested: str, present) -> str:
    return f"'{path}' has no '{requested}' split (it has {sorted(present)})"


def pick_split(data, requested: Optional[str], path: str) -> str:
    """The split of ``data`` to evaluate.

    Args:
        data: a loaded :class:`fedpartial.data.types.Dataset`.
        requested: the user's ``--split``; None picks the default: ``val`` for a site file
            (site files hold train/val, the site's own held-out data), else ``test`` when
            present, else the only split there is. A site file's train split is never a
            default: it is the data the model trained on.
        path: the file, for error messages.

    Raises:
        DataError: the requested split is absent, or no default applies (the message names
            the file and the splits present).
    """
    present = list(data.splits)
    if requested is not None:
        if requested not in data.splits:
            raise DataError(_split_error(path, requested, present))
        return requested
    preferred = "val" if data.site else "test"
    if preferred in data.splits:
        return preferred
    if data.site and present == ["train"]:
        raise DataError(f"site file '{path}' has no val split, only 'train', the data a model trained with this "
                        f"site has learnt from; pass --split train to score that split anyway (or import the site "
                        f"with --val-fraction)")
    if len(present) == 1:
        return present[0]
    raise DataError(f"'{path}' has no '{preferred}' split and several others ({sorted(present)}): choose one "
                    f"with --split")


def load_for_model(path: str, meta: dict):
    """Load ``path`` for a model with ``meta`` and check that they fit.

    Args:
        path: a source ``.npz`` (any subset of splits), a site file or a site folder.
        meta: the model file's meta (``task``, ``class_names``).

    Returns:
        ``(dataset, notes)``; ``notes`` lists what was assumed (class names taken from the
        model for a file without ``label_names``).

    Raises:
        DataError: task or class names differ from the model's.
    """
    from fedpartial.data.npz import load_npz

    classification = meta["task"] != SEGMENTATION
    model_names = [str(c) for c in meta["class_names"]]
    if os.path.isdir(path):  # a site folder (memory-mapped images)
        from fedpartial.data.sitefile import load_site_file

        data = load_site_file(path)
    else:
        # a test-only file may miss a class entirely, so its own labels can undercount the classes
        data = load_npz(path, require_train=False, default_class_names=model_names if classification else None)
    notes = []
    if data.task != meta["task"]:
        raise DataError(f"the model is a {meta['task']} model; '{path}' holds {data.task} data")
    names_from = data.info.get("class_names_from")
    if names_from == "given":
        notes.append(f"'{os.path.basename(path)}' has no label_names: its labels fit the model's "
                     f"{len(model_names)} classes, so the model's class names are used")
    if classification and list(data.class_names) != model_names:
        why = (f" ('{path}' has no label_names and its labels hold {data.num_classes} classes)"
               if names_from == "labels" else "")
        raise DataError(f"class names of '{path}' {list(data.class_names)} differ from the model's "
                        f"{model_names}{why}")
    return data, notes


def _classification_probs(model, split: Split, meta: dict, device, batch_size: int = 256) -> np.ndarray:
    from fedpartial.data.transforms import resize_images

    size = model_input_size(meta)
    out = []
    # chunk by chunk: images of a site folder are memory-mapped and may not fit in memory at once
    for start in range(0, len(split), batch_size):
        images = np.array(split.images[start:start + batch_size])  # a copy: memory-mapped arrays are read-only
        images = resize_images(images, size) if size else images
        out.append(predict_split(model, Split(images, split.labels[start:start + batch_size]), meta["task"],
                                 meta["normalisation"], device, batch_size=batch_size))
    return np.concatenate(out) if out else np.zeros((0, len(meta["class_names"])), np.float32)


def segmentation_overlaps_native(model, split: Split, normalisation: dict, device, input_size=None,
                                 threshold: float = 0.5, batch_size: int = 32) -> Dict[str, np.ndarray]:
    """Per-image overlap counts at the images' native resolution.

    The model sees each image resized to ``input_size`` (what it was trained on); its
    foreground probability map is upsampled back to the native size (bilinear) and thresholded
    there, and the counts are taken against the original, never resized masks.

    Args:
        model: a segmentation model ``x -> (features, logits (N, 1, h, w))``.
        split: native-size images and masks (``> 0`` = foreground).
        normalisation: the model's ``{"mean", "std"}``.
        device: torch device.
        input_size: the model's (H, W); None = feed the native images.
        threshold: a pixel is foreground where the upsampled probability is above it.
        batch_size: images per forward pass (counts are kept, not maps, so memory stays flat).

    Returns:
        ``{"tp", "fp", "fn"}`` int64 ``(N,)`` arrays (see :func:`fedpartial.metrics.overlap_counts`).
    """
    import torch.nn.functional as F

    from fedpartial.data.transforms import resize_images
    from fedpartial.metrics import overlap_counts

    native = tuple(split.images.shape[1:3])
    parts: List[Dict[str, np.ndarray]] = []
    for start in range(0, len(split), batch_size):
        images = np.array(split.images[start:start + batch_size])  # a copy: memory-mapped arrays are read-only
        if input_size is not None:
            images = resize_images(images, input_size)
        x = images_to_tensor(images, normalisation["mean"], normalisation["std"])
        probs = torch.sigmoid(predict(model, x, device, batch_size=batch_size)[:, :1])
        if tuple(probs.shape[-2:]) != native:
            # upsample probabilities (not thresholded masks) so the boundary is placed at native detail
            probs = F.interpolate(probs, size=native, mode="bilinear", align_corners=False)
        target = np.asarray(split.labels[start:start + batch_size]) > 0  # the original masks, never resized
        parts.append(overlap_counts(probs[:, 0].numpy() > threshold, target))
    if not parts:
        return {k: np.zeros(0, np.int64) for k in ("tp", "fp", "fn")}
    return {k: np.concatenate([p[k] for p in parts]) for k in ("tp", "fp", "fn")}


def _segmentation_result(counts: Dict[str, np.ndarray], resolutions, model_size) -> dict:
    from fedpartial.metrics.segmentation import EMPTY_RULE, overlap_summary

    summary = overlap_summary(counts["tp"], counts["fp"], counts["fn"])
    summary.pop("n_images")
    return {"resolution": "native " + ", ".join(sorted(resolutions)), **summary,
            "model_input": f"{model_size[0]}x{model_size[1]}" if model_size else "native", "empty_rule": EMPTY_RULE}


def data_sources(path: str):
    """What ``--data`` names: ``([path], False)`` for one file or one site folder (a folder with
    ``meta.json``, the streaming layout); ``(sites, True)`` for a folder of site files / site
    folders (:func:`fedpartial_tools.data.sites.site_paths`: ``*.npz`` and ``*/meta.json`` directly
    inside; sub-folders such as ``reference/`` are not read)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "meta.json")):
            return [path], False
        from fedpartial_tools.data.sites import site_paths

        try:
            return list(site_paths(path).values()), True
        except FileNotFoundError as e:
            raise DataError(str(e)) from e
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file '{path}' not found")
    return [path], False


def evaluate_data(model, meta: dict, path: str, split: Optional[str] = None, device="cpu",
                  threshold: Optional[float] = None) -> dict:
    """Metrics of a model on a ``.npz`` file or a folder of site files (``evaluate``).

    Classification: images are resized to the model's ``input_size``; site files are scored
    with their ``label_mask`` (per class, only the samples where the class is annotated; see
    :func:`fedpartial.metrics.classification_metrics`). Segmentation: predictions are made at
    the model's size and scored at the native size (:func:`segmentation_overlaps_native`,
    :func:`fedpartial.metrics.overlap_summary`).

    Args:
        model: the model (on ``device``), ``x -> (features, logits)``.
        meta: its meta (``task``, ``class_names``, ``input_size``, ``normalisation``).
        path: a ``.npz`` (source layout with any subset of splits, test-only file, site file),
            a site folder, or a folder of site files / site folders.
        split: split to score in every file; None = each file's default (:func:`pick_split`).
        device: torch device.
        threshold: one multi-label / segmentation probability threshold for every class; None = the
            model file's ``decision_thresholds``, else 0.5
            (:func:`fedpartial_tools.model.decisions.decision_thresholds`).

    Returns:
        for a file ``{"data", "split", "n", **metrics}``; for a folder ``{"data", "split", "n",
        "sites": {site: {"file", "split", "n", **metrics}}, "pooled": {**metrics}}`` (pooled =
        every site's samples together). Plus ``notes`` when something was assumed.

    Raises:
        DataError: a missing split, a task or class-name mismatch (messages name the file).
    """
    from fedpartial_tools.model.decisions import decision_thresholds

    files, is_folder = data_sources(path)
    task = meta["task"]
    thresholds = decision_thresholds(meta, threshold)  # per class; single-label metrics use argmax
    model_size = model_input_size(meta)
    rows, pool, notes = {}, [], []
    for file in files:
        data, file_notes = load_for_model(file, meta)
        notes += file_notes
        name = pick_split(data, split, file)
        part = data.splits[name]
        if len(part) == 0:
            raise DataError(f"'{file}': the '{name}' split is empty")
        key = data.site or os.path.splitext(os.path.basename(file))[0]
        if key in rows:
            key = os.path.basename(file)
        row = {"file": os.path.abspath(file), "split": name, "n": len(part)}
        if task == SEGMENTATION:
            counts = segmentation_overlaps_native(model, part, meta["normalisation"], device, model_size,
                                                  float(thresholds[0]))
            native = f"{part.images.shape[1]}x{part.images.shape[2]}"
            row.update(_segmentation_result(counts, {native}, model_size))
            pool.append((counts, native))
        else:
            from fedpartial.metrics import classification_metrics

            probs = _classification_probs(model, part, meta, device)
            mask = part.label_mask if data.site else None  # a source file's labels are complete
            row.update(classification_metrics(probs, part.labels, task, list(data.class_names), threshold=thresholds,
                                              label_mask=mask))
            pool.append((probs, part.labels, part.label_mask if part.label_mask is not None
                         else np.ones(part.labels.shape, bool), mask is not None))
        rows[key] = row
    names = sorted({r["split"] for r in rows.values()})
    out = {"data": os.path.abspath(path), "split": ", ".join(names), "n": sum(r["n"] for r in rows.values())}
    if not is_folder:
        only = next(iter(rows.values()))
        out.update({k: v for k, v in only.items() if k not in ("file", "split", "n")})
    else:
        if task == SEGMENTATION:
            counts = {k: np.concatenate([c[k] for c, _ in pool]) for k in ("tp", "fp", "fn")}
            pooled = _segmentation_result(counts, {r for _, r in pool}, model_size)
        else:
            from fedpartial.metrics import classification_metrics

            masked = any(m for *_, m in pool)
            pooled = classification_metrics(np.concatenate([p[0] for p in pool]), np.concatenate([p[1] for p in pool]),
                                            task, list(meta["class_names"]), threshold=thresholds,
                                            label_mask=np.concatenate([p[2] for p in pool]) if masked else None)
        out.update({"sites": rows, "pooled": pooled})
    if notes:
        out["notes"] = sorted(set(notes))
    return out


def record_in_model_card(model_file: str, result: dict, threshold: Optional[float] = None) -> Optional[str]:
    """Append an ``evaluate`` result to the model card beside ``model_file`` (``model_card.json`` /
    ``.md`` written by the server at the end of the job, :mod:`fedpartial.flare.model_card`), when
    there is one: the data, split, image count, date, threshold and the scalar metrics (pooled
    over the sites for a folder).

    Args:
        model_file: the evaluated model file.
        result: :func:`evaluate_data`'s result.
        threshold: the ``--threshold`` given (None: the model file's decision thresholds, else 0.5).

    Returns:
        the card's ``.md`` path, or None when no card is beside the file.
    """
    import datetime

    from fedpartial.flare.model_card import append_evaluation

    scores = result.get("pooled") if "sites" in result else result
    metrics = {k: v for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and k != "n"}
    entry = {"model": os.path.basename(model_file), "data": result["data"], "split": result["split"],
             "n": result["n"], "threshold": "the file's decision_thresholds" if threshold is None else threshold,
             "metrics": metrics,
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return append_evaluation(model_file, entry)
