"""Choosing a setting as a federation could (``bench --select-on val``): what the sites' validation
of the server's final and best models returned in FLARE's cross-site evaluation, each site scoring its
own val split with the labels it holds, pooled as the server receives it; and the metric a selection
ranks a suite by."""
from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import numpy as np

from fedpartial_tools.bench.suites import SUITES, is_segmentation

#: what ``bench --select-on val`` ranks a segmentation suite by: the Dice every site's validation
#: returns and the server pools over the sites' val pixels (a per-image Dice is not pooled)
SITES_VAL_SEGMENTATION_KEY = "dice_pooled"


def selection_key(name: str, scored_on: str) -> str:
    """The metric ``bench --select-on`` ranks suite ``name``'s settings by: its first metric, or on the
    sites' own val splits (``val``) of a segmentation suite the pooled Dice the server receives."""
    if scored_on == "val" and is_segmentation(name):
        return SITES_VAL_SEGMENTATION_KEY
    return SUITES[name].metrics[0]


def site_val_sizes(split_dir: str) -> Dict[str, int]:
    """``{site: images in its val split}`` of the site files in ``split_dir`` (what each site would
    report beside its score)."""
    from fedpartial.data.sitefile import load_site_file
    from fedpartial_tools.data.sites import site_paths

    sizes = {}
    for site, path in site_paths(split_dir).items():
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:  # only the val labels are read
                sizes[site] = int(z["val_labels"].shape[0]) if "val_labels" in z.files else 0
        else:
            val = load_site_file(path).splits.get("val")
            sizes[site] = 0 if val is None else len(val)
    return sizes


def sites_val_scores(ws: str, split_dir: str, what: str = "") -> Tuple[dict, dict]:
    """``(final, best)``: the scores of the server's final and best model on the sites' own val
    splits (labelled as each site holds them), from the job's cross-site evaluation
    (``cross_site_val.json``), pooled as the server receives them: classification the mean over the
    sites with a score, weighted by their val images; segmentation the Dice over every site's val
    pixels (:func:`fedpartial_tools.run.results.server_model_validation`).

    Args:
        ws: the job's workspace.
        split_dir: the site files the job ran on (their val sizes).
        what: the row, for the error.

    Raises:
        FileNotFoundError: naming the file, when the job left no cross-site evaluation.
    """
    from fedpartial_tools.run.results import server_model_validation

    path = os.path.join(ws, "cross_site_val.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: '{path}' is missing (no cross-site evaluation): the sites' val scores "
                                f"are read from it; train again")
    with open(path) as f:
        scores = server_model_validation(json.load(f), site_val_sizes(split_dir))
    return scores.get("global_model.pt", {}), scores.get("best_global_model.pt", {})


def sites_val_metrics(suite, ws: str, key: str, what: str = "") -> Dict[str, float]:
    """``suite``'s metrics (``<metric>_best`` of the best model) and the selection's ``key`` from
    :func:`sites_val_scores` of the job in ``ws`` (its site files beside it, in ``../sites``); NaN
    where the sites sent none.

    Args:
        suite: the bench suite.
        ws: the job's workspace.
        key: the metric the selection ranks on (:func:`selection_key`).
        what: the row, for errors.
    """
    final, best = sites_val_scores(ws, os.path.join(os.path.dirname(ws), "sites"), what)
    out = {}
    for k in dict.fromkeys([*suite.metrics, key]):
        value = best.get(k[:-len("_best")]) if k.endswith("_best") else final.get(k)
        out[k] = float("nan") if value is None else float(value)
    return out
