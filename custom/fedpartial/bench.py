"""``python -m fedpartial bench``: every method against its FedAvg baselines on real data.

A *suite* names a dataset, a partition scenario, the method job and its baselines. For each seed
the bench makes the split (seeded), runs each job in the FLARE simulator with the same seed and
rounds, evaluates the final global model on the source file's test split, and writes
``results.csv``, ``results.md`` (mean ± std and the share of the lower→upper gap closed) and
PNG plots (per-round validation curves, per-class AUC bars, Dice per completeness setting).
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_DATA = os.path.abspath(os.path.join(REPO, "..", "shared", "data"))


@dataclass
class Suite:
    """One comparison: a dataset + scenario, the method job, its lower / upper bound baselines."""

    dataset: str
    scenario: str
    split_options: Dict[str, object]
    sites: int
    method: str
    lower: str
    upper: str
    others: List[str] = field(default_factory=list)
    metrics: List[str] = field(default_factory=lambda: ["auc", "f1", "accuracy", "bacc", "map"])
    overrides: Dict[str, List[str]] = field(default_factory=dict)  # profile -> --set items

    @property
    def jobs(self) -> List[str]:
        return [self.lower, *self.others, self.upper, self.method]


_CPU_CLS = ["model.arch=small_cnn", "rule_args.lr=0.001"]
SUITES: Dict[str, Suite] = {
    "fedlsm-ham": Suite("ham10000_28.npz", "label-set-mismatch", {"classes_per_site": 3}, 5, "fedlsm", "fedavg",
                        "fedavg_full", ["fedavg_partial_loss"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=20"],
                                   "gpu": ["model.arch=densenet121", "model.arch_args={}", "num_rounds=50"]}),
    "fedlsm-nih": Suite("nih_chestxray14_64.npz", "label-set-mismatch", {"classes_per_site": 3}, 8,
                        "fedlsm_multilabel", "fedavg", "fedavg_full", ["fedavg_partial_loss"],
                        metrics=["auc", "map", "f1", "bacc"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=20"], "gpu": ["model.arch=densenet121",
                                                                               "model.arch_args={}", "num_rounds=50"]}),
    "fedmlp-ctich": Suite("ct_ich_128.npz", "label-set-mismatch", {"classes_per_site": 1}, 5, "fedmlp_ctich",
                          "fedavg", "fedavg_full", ["fedavg_partial_loss"], metrics=["auc", "map", "bacc", "f1"],
                          overrides={"cpu": _CPU_CLS + ["num_rounds=30", "model.input_size=[64,64]"],
                                     "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    "fedmlp-nih": Suite("nih_chestxray14_64.npz", "missing-classes", {"missing_per_site": 7}, 8, "fedmlp",
                        "fedavg", "fedavg_full", ["fedavg_partial_loss"], metrics=["auc", "map", "bacc", "f1"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"],
                                   "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    "fedirm-ham": Suite("ham10000_28.npz", "semi-supervised", {"labelled_sites": 2}, 10, "fedirm", "fedavg",
                        "fedavg_full", metrics=["auc", "accuracy", "f1", "bacc"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"],
                                   "gpu": ["model.arch=densenet121", "model.arch_args={\"dropout\":0.2}",
                                           "num_rounds=100"]}),
}
for _m in range(4):
    # FedIA, paper setting: site k (0..3) keeps (20k - 10m + 40) % of its lesions.
    SUITES[f"fedia-dsb-m{_m}"] = Suite(
        "dsb2018_nuclei_256.npz", "incomplete-masks",
        {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia", "fedavg_seg",
        "fedavg_seg_full", metrics=["dice", "iou"],
        overrides={"cpu": ["num_rounds=30", "model.input_size=[64,64]"], "gpu": ["num_rounds=100",
                                                                            "model.input_size=[256,256]"]})


def gap_closed(value: float, lower: float, upper: float) -> float:
    """Share of the lower→upper gap that ``value`` closes (NaN when the gap is ~0).

    Args:
        value: the method's metric.
        lower: the lower-bound baseline's metric (FedAvg on partial labels).
        upper: the upper bound's (FedAvg on complete labels).
    """
    gap = upper - lower
    return float("nan") if not np.isfinite(gap) or abs(gap) < 1e-9 else (value - lower) / gap


def _curve(metrics_file: str, key: str) -> List[float]:
    """Mean over sites of the validation ``key`` of the model each round started from."""
    if not os.path.isfile(metrics_file):
        return []
    rounds = json.load(open(metrics_file))["rounds"]
    out = []
    for r in rounds:
        vals = [s.get("val", {}).get(key) for s in r["sites"].values()]
        vals = [v for v in vals if v is not None]
        out.append(float(np.mean(vals)) if vals else float("nan"))
    return out


def run_suite(name: str, out_dir: str, seeds=(0, 1, 2), profile: str = "cpu", data_dir: str = DEFAULT_DATA,
              rounds: Optional[int] = None, jobs: Optional[List[str]] = None, extra: List[str] = (),
              log=print) -> List[dict]:
    """Run one suite for ``seeds``; returns the result rows (also appended to results.csv).

    Args:
        name: a key of :data:`SUITES`.
        out_dir: output folder.
        seeds: seeds (each gives its own split and runs).
        profile: ``cpu`` or ``gpu`` overrides.
        data_dir: folder of the source ``.npz`` files.
        rounds: overrides the profile's round count.
        jobs: subset of the suite's jobs to run (default all).
        extra: more ``--set`` items for every job.
    """
    from fedpartial.data.partition import split_file
    from fedpartial.jobtools import dataset_overrides, simulate

    suite = SUITES[name]
    source = os.path.join(data_dir, suite.dataset)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"suite '{name}' needs '{source}' (see ../shared/data/README.md)")
    rows = []
    for seed in seeds:
        split_dir = os.path.join(out_dir, name, f"seed{seed}", "sites")
        if not os.path.isfile(os.path.join(split_dir, "split_summary.json")):
            split_file(source, suite.scenario, sites=suite.sites, seed=seed, out=split_dir, **suite.split_options)
        sets = dataset_overrides(split_dir) + list(suite.overrides.get(profile, [])) + [f"seed={seed}"]
        if rounds:
            sets.append(f"num_rounds={rounds}")
        sets += list(extra)
        for job in jobs or suite.jobs:
            ws = os.path.join(out_dir, name, f"seed{seed}", job)
            started = time.time()
            simulate(os.path.join(REPO, "jobs", job), split_dir, ws, sets, log=log)
            row = _evaluate_row(name, suite, job, seed, ws, source, time.time() - started)
            rows.append(row)
            log(f"{name} seed {seed} {job}: " + ", ".join(f"{k}={row.get(k, float('nan')):.4f}"
                                                          for k in suite.metrics))
    return rows


def _evaluate_row(name, suite, job, seed, ws, source, seconds) -> dict:
    from fedpartial.data.npz import load_npz
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.evaluation import evaluate_split
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import select_device

    device = select_device("auto")
    model, meta = load_model_file(os.path.join(ws, "global_model.pt"), device=device)
    data = load_npz(source)
    if any(meta.get("input_size") or (0, 0)):
        data = resize_dataset(data, meta["input_size"])
    test = data.splits["test"]
    metrics = evaluate_split(model, test, data.task, data.class_names, meta["normalisation"], device)
    row = {"suite": name, "method": job, "dataset": suite.dataset, "scenario": suite.scenario,
           "split_options": json.dumps(suite.split_options), "seed": seed,
           "rounds": len(json.load(open(os.path.join(ws, "metrics.json")))["rounds"]),
           "seconds": round(seconds, 1)}
    for k in suite.metrics:
        row[k] = float(metrics.get(k, float("nan")))
    per_class = metrics.get("per_class") or {}
    row["per_class_auc"] = json.dumps({c: v.get("auc") for c, v in per_class.items()})
    row["curve"] = json.dumps(_curve(os.path.join(ws, "metrics.json"), suite.metrics[0]))
    return row


def add_gap_columns(rows: List[dict]) -> None:
    """Fill ``gap_<metric>`` per row: share of the (lower, upper) gap of the same suite and seed."""
    for row in rows:
        suite = SUITES[row["suite"]]
        same = {r["method"]: r for r in rows if r["suite"] == row["suite"] and r["seed"] == row["seed"]}
        lo, up = same.get(suite.lower), same.get(suite.upper)
        for k in suite.metrics:
            row[f"gap_{k}"] = gap_closed(row[k], lo[k], up[k]) if lo and up else float("nan")


def write_reports(rows: List[dict], out_dir: str) -> str:
    """results.csv, results.md and PNG plots; returns the markdown table."""
    add_gap_columns(rows)
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("suite", "method", "seed"), k))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    md = markdown_table(rows)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    try:
        plot_results(rows, out_dir)
    except Exception as e:  # plots are a convenience; the numbers are in the CSV
        print(f"warning: plotting failed: {e}")
    return md


def _fmt(values: List[float]) -> str:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "–"
    return f"{np.mean(vals):.3f} ± {np.std(vals):.3f}" if len(vals) > 1 else f"{vals[0]:.3f}"


def markdown_table(rows: List[dict]) -> str:
    lines = []
    for name in dict.fromkeys(r["suite"] for r in rows):
        suite = SUITES[name]
        sub = [r for r in rows if r["suite"] == name]
        seeds = sorted({r["seed"] for r in sub})
        lines.append(f"\n**{name}** — {suite.dataset}, {suite.scenario} {suite.split_options}, {suite.sites} sites, "
                     f"{sub[0]['rounds']} rounds, seeds {seeds} (mean ± std over seeds; gap = share of the "
                     f"{suite.lower} → {suite.upper} gap closed)\n")
        head = ["job"] + suite.metrics + [f"gap {k}" for k in suite.metrics[:2]]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for job in suite.jobs:
            jr = [r for r in sub if r["method"] == job]
            if not jr:
                continue
            cells = [job] + [_fmt([r[k] for r in jr]) for k in suite.metrics]
            cells += [_fmt([r.get(f"gap_{k}") for r in jr]) for k in suite.metrics[:2]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_results(rows: List[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in dict.fromkeys(r["suite"] for r in rows):
        suite = SUITES[name]
        sub = [r for r in rows if r["suite"] == name]
        fig, ax = plt.subplots(figsize=(6, 4))
        for job in suite.jobs:
            curves = [json.loads(r["curve"]) for r in sub if r["method"] == job]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot(range(1, n + 1), np.nanmean([c[:n] for c in curves], axis=0), label=job)
        ax.set_xlabel("round")
        ax.set_ylabel(f"val {suite.metrics[0]} of the global model (mean of sites)")
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
            for i, job in enumerate(suite.jobs):
                if not per_class[job]:
                    continue
                vals = [np.nanmean([d.get(c) if d.get(c) is not None else np.nan for d in per_class[job]])
                        for c in classes]
                ax.bar(np.arange(len(classes)) + i * width, vals, width, label=job)
            ax.set_xticks(np.arange(len(classes)) + 0.4 - width / 2, classes, rotation=30, ha="right")
            ax.set_ylabel("test AUC")
            ax.set_ylim(0.4, 1.0)
            ax.legend(fontsize=7)
            ax.set_title(f"{name}: per-class AUC")
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, f"{name}_per_class_auc.png"), dpi=100)
            plt.close(fig)
    seg = [r for r in rows if r["suite"].startswith("fedia-dsb")]
    if seg:
        fig, ax = plt.subplots(figsize=(6, 4))
        for job in ("fedavg_seg", "fedia", "fedavg_seg_full"):
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


def _cmd_bench(args):
    rows = []
    csv_path = os.path.join(args.out, "results.csv")
    if args.append and os.path.isfile(csv_path):
        rows = _read_rows(csv_path)
    for name in args.suite:
        done = {(r["suite"], r["method"], int(r["seed"])) for r in rows}
        seeds = [int(s) for s in args.seeds.split(",")]
        new = run_suite(name, args.out, seeds=seeds, profile=args.profile, data_dir=args.data_dir,
                        rounds=args.rounds, jobs=args.jobs.split(",") if args.jobs else None, extra=args.set)
        rows += [r for r in new if (r["suite"], r["method"], r["seed"]) not in done]
        print(write_reports(rows, args.out))


def _read_rows(path: str) -> List[dict]:
    rows = []
    for r in csv.DictReader(open(path)):
        out = {}
        for k, v in r.items():
            try:
                out[k] = float(v) if k not in ("suite", "method", "dataset", "scenario", "split_options",
                                               "per_class_auc", "curve") else v
            except ValueError:
                out[k] = v
        out["seed"] = int(out["seed"])
        rows.append(out)
    return rows


def add_bench_parser(sub) -> None:
    s = sub.add_parser("bench", help="methods x baselines x seeds on real data -> results.csv, results.md, plots")
    s.add_argument("--suite", action="append", required=True, choices=sorted(SUITES),
                   help="comparison to run (repeatable)")
    s.add_argument("--seeds", default="0,1,2")
    s.add_argument("--profile", choices=["cpu", "gpu"], default="cpu")
    s.add_argument("--rounds", type=int, default=None)
    s.add_argument("--jobs", default="", help="comma list: a subset of the suite's jobs")
    s.add_argument("--data-dir", default=DEFAULT_DATA)
    s.add_argument("--out", required=True)
    s.add_argument("--append", action="store_true", help="keep rows already in OUT/results.csv")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every job")
    s.set_defaults(func=_cmd_bench)
