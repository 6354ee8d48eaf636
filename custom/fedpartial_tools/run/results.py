"""Results of a finished run: the server's models, metrics and TensorBoard folders copied out of a
simulator workspace, and what the server's models scored on the sites' val splits."""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
from typing import Dict, List, Optional

from fedpartial_tools.run.progress import pooled_text


RESULT_FILES = ("global_model.pt", "best_global_model.pt", "metrics.json", "model_card.md", "model_card.json")


def _server_run_dir(sim_ws: str) -> Optional[str]:
    hits = glob.glob(os.path.join(sim_ws, "server", "*", "metrics.json")) or glob.glob(
        os.path.join(sim_ws, "server", "*", "global_model.pt"))
    return os.path.dirname(hits[0]) if hits else None


def collect_results(sim_ws: str, workspace: str, rc: int, seconds: float, log=print) -> dict:
    """Copy the server's results and every TensorBoard folder from a simulator workspace."""
    run_dir = _server_run_dir(sim_ws)
    errors = _log_errors(sim_ws)
    if run_dir is None or not os.path.isfile(os.path.join(run_dir, "global_model.pt")):
        raise RuntimeError(f"simulation failed (exit {rc}); no global model was written. "
                           f"First errors:\n{errors or '(none logged)'}\nlog: {workspace}/simulator.log")
    for name in RESULT_FILES:
        src = os.path.join(run_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(workspace, name))
    cross = glob.glob(os.path.join(run_dir, "cross_site_val", "cross_val_results.json"))
    if cross:
        shutil.copyfile(cross[0], os.path.join(workspace, "cross_site_val.json"))
    tb_out = os.path.join(workspace, "tb")
    shutil.rmtree(tb_out, ignore_errors=True)
    for tb in glob.glob(os.path.join(sim_ws, "*", "*", "tb")):
        shutil.copytree(tb, tb_out, dirs_exist_ok=True)
    # what the sites streamed to the server (TBAnalyticsReceiver): one folder per site
    streamed = os.path.join(run_dir, "tb_events")
    if os.path.isdir(streamed):
        shutil.copytree(streamed, os.path.join(workspace, "tb_server"), dirs_exist_ok=True)
    summary = {"exit_code": rc, "seconds": round(seconds, 1), "workspace": workspace, "errors": errors}
    log(f"simulation finished in {seconds:.0f} s (exit {rc}); results in {workspace}")
    if cross:
        with open(cross[0]) as f:
            for line in result_model_lines(json.load(f)):
                log(line)
    return summary


# cross-site evaluation names the server's models "SRV_<locator name>" (the locator's names
# already start with "SRV_"): matched by their end
SERVER_MODEL_FILES = {"best_global_model": "best_global_model.pt", "global_model": "global_model.pt"}


def server_model_validation(cross_site: dict, sizes: Optional[Dict[str, float]] = None) -> Dict[str, dict]:
    """What the server's models scored on the sites' val splits in cross-site evaluation:
    ``{file name: pooled}`` for segmentation (:func:`fedpartial.metrics.pooled_validation`: Dice
    over every site's val pixels, what ``evaluate --split val`` of the model on the site folder
    prints), ``{file name: {metric: mean over sites}}`` otherwise (over the sites that sent the
    metric: an unlabelled site's val split has no score).

    Args:
        cross_site: ``cross_site_val.json``: ``{site: {model name: metrics}}``.
        sizes: classification: ``{site: val images}`` to weight each site's score by (None: equal
            weights); a site without a size weighs 0. A metric no site defines is NaN.
    """
    from fedpartial.metrics.segmentation import pooled_validation

    def model_of(models: dict, name: str):
        hits = [m for k, m in models.items() if k.startswith("SRV_") and k.endswith(name)
                and (name == "best_global_model" or not k.endswith("best_global_model"))]
        return hits[0] if hits else None

    out = {}
    for name, file in SERVER_MODEL_FILES.items():
        # in site order, not the order the sites answered in: a float sum depends on its order
        per_site = {site: model_of(models, name) for site, models in sorted(cross_site.items())
                    if isinstance(models, dict)}
        per_site = {site: m for site, m in per_site.items() if isinstance(m, dict) and m}
        if not per_site:
            continue
        pooled = pooled_validation(per_site)
        if pooled is None:
            keys = dict.fromkeys(k for m in per_site.values() for k, v in m.items() if isinstance(v, (int, float)))
            pooled = {}
            for k in keys:
                # a site whose score is undefined (NaN: no positive of a class) says nothing
                scored = {site: float(m[k]) for site, m in per_site.items()
                          if isinstance(m.get(k), (int, float)) and math.isfinite(m[k])}
                weight = {site: 1.0 if sizes is None else float(sizes.get(site, 0.0)) for site in scored}
                total = sum(weight.values())
                pooled[k] = sum(weight[site] * v for site, v in scored.items()) / total if total else float("nan")
        out[file] = pooled
    return out


def result_model_lines(cross_site: dict) -> List[str]:
    """One line per server model: its validation scores (:func:`server_model_validation`).

    Args:
        cross_site: ``cross_site_val.json``: ``{site: {model name: metrics}}``.
    """
    lines = []
    for file, scores in server_model_validation(cross_site).items():
        if "dice_pooled" in scores and "predicted_lesion_share" in scores:
            lines.append(f"{file}: {pooled_text(scores)}")
        elif scores:
            key = next(iter(scores))
            lines.append(f"{file}: val {key} {scores[key]:.3f} (mean over sites)")
    return lines


def _log_errors(sim_ws: str, limit: int = 5) -> str:
    lines = []
    for path in sorted(glob.glob(os.path.join(sim_ws, "**", "log.txt"), recursive=True)):
        with open(path, errors="replace") as f:
            lines += [ln.rstrip() for ln in f if " ERROR " in ln or "Traceback" in ln]
    return "\n".join(lines[:limit])
