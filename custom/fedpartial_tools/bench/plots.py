"""Bench plots: the PNG bar plots of a run's results (AUC per class, Dice, curves) written next to
``results.md``."""
from __future__ import annotations

import json
import os
from typing import List, Sequence

import numpy as np

from fedpartial_tools.bench.suites import SUITES, is_segmentation, suites_of


def auc_axis_floor(values: Sequence[float], default: float = 0.4) -> float:
    """Lower end of an AUC bar plot: ``default``, or lower (to the tenth) when a bar is below it,
    so that a class under 0.4 still shows.

    Args:
        values: the bar heights (NaN ignored).
        default: the usual floor.
    """
    finite = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not finite:
        return default
    return min(default, float(np.floor(min(finite) * 10) / 10))


def plot_results(rows: List[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in suites_of(rows):
        suite = SUITES[name]
        sub = [r for r in rows if r["suite"] == name]
        fig, ax = plt.subplots(figsize=(6, 4))
        for job in suite.jobs:
            curves = [json.loads(r["curve"]) for r in sub if r["method"] == job]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot(range(1, n + 1), np.nanmean([c[:n] for c in curves], axis=0), label=job)
        ax.set_xlabel("round")
        ax.set_ylabel(f"val {suite.metrics[0]} of the global model " + ("(pooled over sites)" if is_segmentation(name) else "(mean of sites)"))
        ax.set_title(name)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}_curves.png"), dpi=100)
        plt.close(fig)
        per_class = {job: [json.loads(r["per_class_auc"]) for r in sub if r["method"] == job] for job in suite.jobs}
        classes = next((list(v[0]) for v in per_class.values() if v and v[0]), [])
        if classes:
            fig, ax = plt.subplots(figsize=(max(6, len(classes) * 0.9), 4))
            width = 0.8 / len(suite.jobs)
            bars = []
            for i, job in enumerate(suite.jobs):
                if not per_class[job]:
                    continue
                vals = [np.nanmean([d.get(c) if d.get(c) is not None else np.nan for d in per_class[job]])
                        for c in classes]
                ax.bar(np.arange(len(classes)) + i * width, vals, width, label=job)
                bars.extend(vals)
            ax.set_xticks(np.arange(len(classes)) + 0.4 - width / 2, classes, rotation=30, ha="right")
            ax.set_ylabel("test AUC")
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")  # chance
            ax.set_ylim(auc_axis_floor(bars), 1.0)
            ax.legend(fontsize=7)
            ax.set_title(f"{name}: per-class AUC")
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, f"{name}_per_class_auc.png"), dpi=100)
            plt.close(fig)
    seg = [r for r in rows if r["suite"].startswith("fedia-dsb")]
    if seg:
        fig, ax = plt.subplots(figsize=(6, 4))
        for job in ("fedavg_seg", "fedia", *SUITES["fedia-dsb-m0"].variants, "fedavg_seg_full"):
            ms = sorted({int(r["suite"][-1]) for r in seg})
            vals = [np.mean([r["dice"] for r in seg if r["method"] == job and r["suite"].endswith(str(m))] or
                            [np.nan]) for m in ms]
            ax.plot(ms, vals, marker="o", label=job)
        ax.set_xlabel("m (site k keeps (20k-10m+40)% of lesions)")
        ax.set_ylabel("test Dice")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "fedia_dice_per_completeness.png"), dpi=100)
        plt.close(fig)
