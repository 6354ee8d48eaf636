"""Bench reports read back from a run folder: ``results.csv`` / ``results.md`` (mean ± std and
the share of the lower→upper gap closed), plots, pseudo-label quality per round (``--diagnostics``),
segmentation overlays, and the results section of a README with the command that reproduces
each table.
"""


from __future__ import annotations

import csv
import glob
import json
import math
import os
import shlex
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial_tools.bench_suites import GROUP_METRICS, REPO, SUITE_GROUPS, SUITES, is_segmentation, suites_of


def gap_closed(value: float, lower: float, upper: float) -> float:
    """Share of the lower→upper gap that ``value`` closes (NaN when the gap is ~0).

    Args:
        value: the method's metric.
        lower: the lower-bound baseline's metric (FedAvg on partial labels).
        upper: the upper bound's (FedAvg on complete labels).
    """
    gap = upper - lower
    return float("nan") if not np.isfinite(gap) or abs(gap) < 1e-9 else (value - lower) / gap


def add_gap_columns(rows: List[dict]) -> None:
    """Fill ``gap_<metric>`` per row: share of the (lower, upper) gap of the same suite and seed."""
    for row in rows:
        suite = SUITES[row["suite"]]
        same = {r["method"]: r for r in rows if r["suite"] == row["suite"] and r["seed"] == row["seed"]}
        lo, up = same.get(suite.lower), same.get(suite.upper)
        for k in suite.metrics:
            row[f"gap_{k}"] = (gap_closed(_value(row, k), _value(lo, k), _value(up, k)) if lo and up
                               else float("nan"))


#: how many of the last rounds' validation scores show how much the kept model depends on the round
LAST_ROUNDS = 5
LAST_ROUNDS_KEY = f"val_range_last{LAST_ROUNDS}"


def last_rounds_range(curve: List[float], rounds: int = LAST_ROUNDS) -> float:
    """Highest minus lowest validation score of the last ``rounds`` rounds (NaN with fewer than 2):
    how far apart methods' scores can be by keeping one round rather than another.

    Args:
        curve: the per-round validation scores (:func:`_curve`).
        rounds: how many of the last rounds.
    """
    last = [v for v in curve[-int(rounds):] if np.isfinite(v)]
    return float(max(last) - min(last)) if len(last) >= 2 else float("nan")


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


def _value(row: dict, key: str) -> float:
    """A row's metric, NaN where the row lacks it (a row measured before the suite scored it)."""
    value = row.get(key)
    return float("nan") if value is None or value == "" else float(value)


def mean_std(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; NaN for one value) of the finite ``values``.

    Args:
        values: per-seed values (None / NaN are left out).
    """
    vals = [float(v) for v in values if v is not None and np.isfinite(float(v))]
    if not vals:
        return float("nan"), float("nan")
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan"))


def _fmt(values: List[float], digits: int = 3) -> str:
    mean, std = mean_std(values)
    if not np.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if np.isfinite(std) else f"{mean:.{digits}f}"


#: How every table states its spread and its gap share.
TABLE_DEFINITIONS = ("mean ± sample std (ddof 1) over seeds; gap = (mean(job) − mean({lower})) / "
                     "(mean({upper}) − mean({lower})), from the means over seeds")


def gap_of_means(job_rows: List[dict], lower_rows: List[dict], upper_rows: List[dict], key: str) -> float:
    """The share of the lower → upper gap a job closes, from the means over seeds (one definition
    for every table: per-seed ratios explode where a seed's gap is near 0).

    Args:
        job_rows / lower_rows / upper_rows: the rows of the job and of the two bounds.
        key: the metric.
    """
    means = [mean_std([_value(r, key) for r in rows])[0] for rows in (job_rows, lower_rows, upper_rows)]
    return gap_closed(*means)


def markdown_table(rows: List[dict]) -> str:
    """Tables of every suite in ``rows`` (results.md): mean ± std, then the per-seed values; then a
    table of each suite group with a suite in ``rows`` (:func:`group_table`)."""
    tables = [suite_table(name, rows) + "\n\n" + per_seed_table(name, rows) for name in suites_of(rows)]
    groups = [group_table(g, rows, GROUP_METRICS.get(g, SUITES[names[0]].metrics[0]))
              for g, names in SUITE_GROUPS.items()]
    return "\n".join(tables + [t for t in groups if t]) + "\n"


def per_seed_table(name: str, rows: List[dict], keys: Optional[Sequence[str]] = None) -> str:
    """Markdown: each job's value of ``keys`` (default the suite's first two metrics) per seed.

    Args:
        name: the suite.
        rows: result rows.
        keys: metrics to show.
    """
    suite = SUITES[name]
    sub = [r for r in rows if r["suite"] == name]
    seeds = sorted({int(r["seed"]) for r in sub})
    keys = list(keys or suite.metrics[:2])
    head = ["job"] + [f"{k} seed {s}" for k in keys for s in seeds]
    lines = [f"Per seed ({', '.join(keys)}):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for job in dict.fromkeys([*suite.jobs, *(r["method"] for r in sub)]):
        by_seed = {int(r["seed"]): r for r in sub if r["method"] == job}
        if not by_seed:
            continue
        cells = [job] + [(f"{_value(by_seed[s], k):.3f}" if s in by_seed and np.isfinite(_value(by_seed[s], k))
                          else "–") for k in keys for s in seeds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def suite_table(name: str, rows: List[dict]) -> str:
    """Heading line and table of suite ``name``: mean ± std over seeds per job, gap closed."""
    suite = SUITES[name]
    sub = [r for r in rows if r["suite"] == name]
    seeds = sorted({r["seed"] for r in sub})
    definitions = TABLE_DEFINITIONS.format(lower=suite.lower, upper=suite.upper)
    lines = [f"\n**{name}** — {sub[0].get('dataset') or suite.dataset}, {suite.scenario} {suite.split_options}, {suite.sites} sites, "
             f"{sub[0]['rounds']} rounds, seeds {seeds} ({definitions})\n"]
    # rows measured before the bench recorded it have no last-rounds range: no column then
    spread = any(np.isfinite(_value(r, LAST_ROUNDS_KEY)) for r in sub)
    head = (["job"] + suite.metrics + [f"gap {k}" for k in suite.metrics[:2]]
            + ([f"val {suite.metrics[0]} range, last {LAST_ROUNDS} rounds"] if spread else []))
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    lower = [r for r in sub if r["method"] == suite.lower]
    upper = [r for r in sub if r["method"] == suite.upper]
    for job in dict.fromkeys([*suite.jobs, *(r["method"] for r in sub)]):
        jr = [r for r in sub if r["method"] == job]
        if not jr:
            continue
        cells = [job] + [_fmt([_value(r, k) for r in jr]) for k in suite.metrics]
        for k in suite.metrics[:2]:
            gap = gap_of_means(jr, lower, upper, k)
            cells.append(f"{gap:.0%}" if np.isfinite(gap) else "–")
        if spread:
            cells.append(_fmt([_value(r, LAST_ROUNDS_KEY) for r in jr]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def group_table(group: str, rows: List[dict], key: str) -> str:
    """Markdown: one line per suite of ``group`` found in ``rows`` (a fold of a leave-one-out
    group) with each job's mean ``key`` over seeds and the method's gap share, then the mean over
    those suites with the gap from those means, and the suites where the method's mean is below
    the lower bound's. Empty when no suite of the group is in ``rows``.

    Args:
        group: a name of :data:`SUITE_GROUPS`.
        rows: result rows.
        key: the metric (e.g. ``dice_pooled_native``).
    """
    names = [n for n in SUITE_GROUPS[group] if any(r["suite"] == n for r in rows)]
    if not names:
        return ""
    first = SUITES[names[0]]
    present = {r["method"] for r in rows if r["suite"] in names}
    jobs = [job for job in dict.fromkeys([*first.jobs, *sorted(present)]) if job in present]
    head = ["suite", "seeds"] + jobs + [f"gap {first.method}"]
    lines = [f"**{group}**: {key}, each job's mean over seeds per suite "
             f"({TABLE_DEFINITIONS.format(lower=first.lower, upper=first.upper)})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    means: Dict[str, List[float]] = {job: [] for job in jobs}
    below = []
    for name in names:
        sub = [r for r in rows if r["suite"] == name]
        suite = SUITES[name]
        by_job = {job: [r for r in sub if r["method"] == job] for job in jobs}
        cells = [name, str(len({int(r["seed"]) for r in sub}))]
        for job in jobs:
            mean = mean_std([_value(r, key) for r in by_job[job]])[0]
            means[job].append(mean)
            cells.append(f"{mean:.3f}" if np.isfinite(mean) else "–")
        gap = gap_of_means(by_job[suite.method], by_job[suite.lower], by_job[suite.upper], key)
        cells.append(f"{gap:.0%}" if np.isfinite(gap) else "–")
        lines.append("| " + " | ".join(cells) + " |")
        job_mean, lower_mean = means[suite.method][-1], means[suite.lower][-1]
        if np.isfinite(job_mean) and np.isfinite(lower_mean) and job_mean < lower_mean:
            below.append(name)
    over = {job: float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
            for job, v in ((j, np.asarray(m, dtype=float)) for j, m in means.items())}
    gap = gap_closed(over[first.method], over[first.lower], over[first.upper])
    lines.append("| " + " | ".join([f"mean of {len(names)} suites", ""]
                                  + [f"{over[j]:.3f}" if np.isfinite(over[j]) else "–" for j in jobs]
                                  + [f"{gap:.0%}" if np.isfinite(gap) else "–"]) + " |")
    lines += ["", f"{first.method} below {first.lower} (means over seeds): "
                  + (", ".join(below) if below else "on no suite")]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Choosing a setting on the val split (bench --select-on val)
# ---------------------------------------------------------------------------------------------
SELECTION_CSV = "selection.csv"


def selection_table(name: str, rows: List[dict]) -> str:
    """Markdown ranking of suite ``name``'s method and its variants by the suite's first metric on
    the source's val split (mean over seeds, best first), the baselines below for reference.

    Args:
        name: the suite.
        rows: ``selection.csv`` rows (``scored_on`` = ``val``).
    """
    suite = SUITES[name]
    key = suite.metrics[0]
    sub = [r for r in rows if r["suite"] == name]
    if not sub:
        return ""
    candidates = [suite.method, *suite.variants]
    ranked = []
    for job in dict.fromkeys(r["method"] for r in sub):
        per_seed = {int(r["seed"]): _value(r, key) for r in sub if r["method"] == job}
        mean, std = mean_std(list(per_seed.values()))
        ranked.append((job in candidates, mean, std, job, per_seed))
    ranked.sort(key=lambda t: (not t[0], -(t[1] if np.isfinite(t[1]) else -np.inf)))
    seeds = sorted({int(r["seed"]) for r in sub})
    lines = [f"\n**{name}**: {key} on the source's **val** split (the test split was not read), seeds {seeds}; "
             f"the method's settings ranked first, best first, then the baselines\n",
             "| rank | job | settings | " + key + " (mean ± sample std) | per seed |", "|---|---|---|---|---|"]
    rank = 0
    for is_candidate, mean, std, job, per_seed in ranked:
        rank += is_candidate
        settings = " ".join(suite.variants.get(job, [])) or ("as shipped" if job == suite.method else "baseline")
        value = f"{mean:.4f} ± {std:.4f}" if np.isfinite(std) else (f"{mean:.4f}" if np.isfinite(mean) else "–")
        lines.append(f"| {rank if is_candidate else ''} | {job} | {settings} | {value} | "
                     + " / ".join(f"{v:.4f}" for _, v in sorted(per_seed.items())) + " |")
    chosen = next((t[3] for t in ranked if t[0] and np.isfinite(t[1])), None)
    if chosen:
        lines += ["", f"Chosen: **{chosen}**. Its test score, read once: `python -m fedpartial_tools bench --suite "
                      f"{name} --seeds {','.join(map(str, seeds))} --jobs {suite.lower},{suite.upper},{chosen} --reuse "
                      f"--out OUT --append`"]
    return "\n".join(lines)


def write_selection(rows: List[dict], out_dir: str) -> str:
    """``selection.csv`` and ``selection.md`` (:func:`selection_table` of every suite); returns the markdown.

    Args:
        rows: rows scored on the val split.
        out_dir: the bench folder.
    """
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("suite", "method", "seed"), k))
    with open(os.path.join(out_dir, SELECTION_CSV), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    md = "\n".join(selection_table(name, rows) for name in suites_of(rows)) + "\n"
    with open(os.path.join(out_dir, "selection.md"), "w") as f:
        f.write(md)
    return md


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


# ---------------------------------------------------------------------------------------------
# Pseudo-label quality (method job run with --diagnostics)
# ---------------------------------------------------------------------------------------------
# Per-site keys the method rules log when the job sets reference_file: FedLSM / FedIRM
# pseudo_*, FedIA corrected_*; FedMLP tag_precision_<x> / tag_recall_<x> (x = a class, or
# pos / neg for the positive / negative tags).
DIAGNOSTIC_KEYS = ("pseudo_precision", "pseudo_recall", "pseudo_neg_precision", "corrected_precision",
                   "corrected_recall_missing", "reliable_fraction")
DIAGNOSTIC_PREFIXES = ("tag_precision_", "tag_recall_")
WITHOUT_REFERENCE = ("reliable_fraction",)  # logged whether or not the job has reference labels
TAG_KINDS = ("pos", "neg")  # FedMLP suffixes that are tag kinds, not classes: no macro over them
# How many pseudo labels a key is about (the count column of <suite>_pseudo_labels.csv).
COUNT_KEYS = {"pseudo_precision": "num_pseudo_positive", "pseudo_recall": "num_pseudo_positive",
              "pseudo_neg_precision": "num_pseudo_negative", "tag_precision_pos": "tags_total_pos",
              "tag_recall_pos": "tags_total_pos", "tag_precision_neg": "tags_total_neg",
              "tag_recall_neg": "tags_total_neg"}
# The rules log precision 0 when they made no pseudo label (FedLSM, FedIRM): that is undefined,
# not wrong, so it is left out of the means (an empty value in the CSV).
UNDEFINED_IF_ZERO = {"pseudo_precision": ("num_pseudo_positive", "reliable_fraction"),
                     "pseudo_neg_precision": ("num_pseudo_negative",)}
PSEUDO_FIELDS = ["suite", "job", "seed", "round", "site", "key", "value", "count_key", "count"]


def _is_diagnostic(key: str) -> bool:
    return key in DIAGNOSTIC_KEYS or key.startswith(DIAGNOSTIC_PREFIXES)


def _number(value) -> Optional[float]:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _load_metrics(path: str) -> List[dict]:
    """The ``rounds`` list of a workspace's metrics.json; errors name the file and key."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("rounds"), list):
        raise ValueError(f"{path} has no 'rounds' list (not a metrics.json written by the bench / simulate)")
    return data["rounds"]


def seed_dirs(out_dir: str, name: str) -> Dict[int, str]:
    """``{seed: DIR/<suite>/seed<k>}`` of the seed folders present."""
    found = {}
    for path in glob.glob(os.path.join(out_dir, name, "seed*")):
        tail = os.path.basename(path)[4:]
        if tail.isdigit() and os.path.isdir(path):
            found[int(tail)] = path
    return dict(sorted(found.items()))


def pseudo_label_records(out_dir: str, name: str, job: Optional[str] = None) -> List[dict]:
    """Diagnostic values of the method job, one record per seed, round, site and key.

    Args:
        out_dir: bench output folder (workspaces in ``out_dir/<suite>/seed<k>/<job>/``).
        name: suite name (a key of :data:`SUITES`).
        job: job whose workspaces to read (default: the suite's method).

    Returns:
        dicts with the :data:`PSEUDO_FIELDS`; ``value`` is None where the key is undefined that
        round (no pseudo label made), ``count`` None where the rule logs no count for the key.
        Seeds without a metrics.json and sites without the keys (yet) are simply absent.
    """
    job = job or SUITES[name].method
    records = []
    for seed, seed_dir in seed_dirs(out_dir, name).items():
        path = os.path.join(seed_dir, job, "metrics.json")
        if not os.path.isfile(path):
            continue
        for i, rnd in enumerate(_load_metrics(path)):
            round_index = int(rnd.get("round", i))
            sites = rnd.get("sites")
            if not isinstance(sites, dict):
                raise ValueError(f"{path}: round {round_index} has no 'sites' dict")
            for site, values in sites.items():
                for key in sorted(k for k in values if _is_diagnostic(k)):
                    value = _number(values[key])
                    if any(_number(values.get(c)) == 0.0 for c in UNDEFINED_IF_ZERO.get(key, ())):
                        value = None
                    count_key = COUNT_KEYS.get(key) if COUNT_KEYS.get(key) in values else None
                    records.append({"suite": name, "job": job, "seed": seed, "round": round_index, "site": site,
                                    "key": key, "value": value, "count_key": count_key or "",
                                    "count": _number(values[count_key]) if count_key else None})
    return records


def _macro_records(records: List[dict]) -> List[dict]:
    """FedMLP: per seed, round and site, ``tag_precision`` / ``tag_recall`` = mean over the
    classes whose per-class value is defined (tag kinds pos / neg are not classes)."""
    groups: Dict[tuple, List[float]] = {}
    for r in records:
        for prefix in DIAGNOSTIC_PREFIXES:
            suffix = r["key"][len(prefix):]
            if r["key"].startswith(prefix) and suffix not in TAG_KINDS:
                groups.setdefault((r["seed"], r["round"], r["site"], prefix[:-1]), [])
                if r["value"] is not None:
                    groups[(r["seed"], r["round"], r["site"], prefix[:-1])].append(r["value"])
    return [{"seed": s, "round": rd, "site": site, "key": key, "value": float(np.mean(v)) if v else None,
             "count_key": "", "count": None} for (s, rd, site, key), v in groups.items()]


def _table_keys(records: List[dict]) -> List[str]:
    present = {r["key"] for r in records}
    order = list(DIAGNOSTIC_KEYS) + ["tag_precision", "tag_recall"]
    order += [f"{p}{k}" for k in TAG_KINDS for p in DIAGNOSTIC_PREFIXES]
    return [k for k in order if k in present]


def shown_rounds(rounds: Sequence[int], every: Optional[int] = None, max_rows: int = 12) -> List[int]:
    """Rounds of the table: every ``every``-th (default: so that at most about ``max_rows``
    remain), always the first and the last.

    Args:
        rounds: round indices present.
        every: show every k-th round.
        max_rows: target row count when ``every`` is not given.
    """
    rounds = sorted(set(rounds))
    if not rounds:
        return []
    every = every or max(1, math.ceil(len(rounds) / max_rows))
    return sorted(set(rounds[::every]) | {rounds[-1]})


def pseudo_label_table(records: List[dict], every: Optional[int] = None, max_rows: int = 12) -> str:
    """Markdown: per round, mean ± std over seeds of the mean over sites of each key.

    Args:
        records: from :func:`pseudo_label_records` (one suite, one job).
        every: show every k-th round (always the last); default about ``max_rows`` rows.
        max_rows: see :func:`shown_rounds`.
    """
    if not records:
        return ""
    all_records = records + _macro_records(records)
    keys = _table_keys(all_records)
    count_keys = list(dict.fromkeys(r["count_key"] for r in records if r["count_key"]))
    seeds = sorted({r["seed"] for r in records})
    head = ["round"] + keys + [f"{c}: sum of sites (sites > 0)" for c in count_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rnd in shown_rounds([r["round"] for r in records], every, max_rows):
        cells = [str(rnd)]
        at = [r for r in all_records if r["round"] == rnd]
        for key in keys:
            per_seed = []
            for seed in seeds:
                vals = [r["value"] for r in at if r["seed"] == seed and r["key"] == key and r["value"] is not None]
                per_seed.append(float(np.mean(vals)) if vals else None)
            cells.append(_fmt(per_seed))
        for ck in count_keys:
            sums, active, n_sites = [], [], 0
            for seed in seeds:
                # one count per site (several keys share it)
                counts = {r["site"]: r["count"] for r in at if r["seed"] == seed and r["count_key"] == ck
                          and r["count"] is not None}
                if counts:
                    sums.append(float(sum(counts.values())))
                    active.append(sum(c > 0 for c in counts.values()))
                    n_sites = max(n_sites, len(counts))
            cells.append(f"{_fmt(sums, digits=0)} ({np.mean(active):g}/{n_sites})" if sums else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_pseudo_label_report(out_dir: str, name: str, job: Optional[str] = None, every: Optional[int] = None,
                              log=print) -> Optional[str]:
    """Write ``out_dir/<suite>_pseudo_labels.csv`` and ``.md`` from the method's workspaces.

    Args:
        out_dir: bench output folder.
        name: suite name.
        job: job to read (default the suite's method).
        every: table shows every k-th round (always the last).
        log: printer for the "nothing found" note.

    Returns:
        the markdown written, or None when no workspace logged diagnostics (nothing written).
    """
    suite = SUITES[name]
    job = job or suite.method
    records = pseudo_label_records(out_dir, name, job)
    if not records:
        log(f"no pseudo-label diagnostics in {os.path.join(out_dir, name, 'seed*', job, 'metrics.json')} "
            f"(run the bench with --diagnostics)")
        return None
    with open(os.path.join(out_dir, f"{name}_pseudo_labels.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=PSEUDO_FIELDS)
        w.writeheader()
        for r in records:
            w.writerow({k: ("" if r[k] is None else r[k]) for k in PSEUDO_FIELDS})
    seeds = sorted({r["seed"] for r in records})
    sites = sorted({r["site"] for r in records}, key=lambda s: (len(s), s))
    # reliable_fraction is logged without reference labels: a run without --diagnostics has only it
    if {r["key"] for r in records} <= set(WITHOUT_REFERENCE):
        about = f"pseudo-label diagnostics of `{job}` (no hidden labels: the run had no `--diagnostics`)"
    else:
        about = f"pseudo-label quality of `{job}` against the hidden complete labels (`--diagnostics`)"
    md = (f"\n**{name}**: {about}, {len(sites)} sites, seeds {seeds}. Per round (as numbered in metrics.json, "
          f"from 0): mean over sites, then mean ± std over seeds. A precision is left out at a site and "
          f"round where it made no pseudo label.\n\n" + pseudo_label_table(records, every))
    with open(os.path.join(out_dir, f"{name}_pseudo_labels.md"), "w") as f:
        f.write(md)
    return md


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
    from fedpartial.models.io import load_model_file

    model, meta = load_model_file(os.path.join(ws, "global_model.pt"), device=device)
    size = tuple(int(s) for s in (meta.get("input_size") or (0, 0)))
    cache = {} if cache is None else cache
    if size not in cache:
        cache[size] = resize_dataset(data, size) if any(size) else data
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


# ---------------------------------------------------------------------------------------------
# README section
# ---------------------------------------------------------------------------------------------
README_BEGIN = "<!-- bench:results:begin -->"
README_END = "<!-- bench:results:end -->"


def _bench_args(row: dict) -> tuple:
    """``(args dict, inferred)`` of a row: what bench recorded, or for rows written before it
    recorded them, the profile whose round count matches the row (else ``--rounds``)."""
    raw = row.get("bench_args")
    if isinstance(raw, str) and raw.strip():
        try:
            return json.loads(raw), False
        except json.JSONDecodeError as e:
            raise ValueError(f"results.csv row {row['suite']}/{row['method']}/seed {row['seed']}: bad bench_args "
                             f"{raw!r}: {e}") from e
    suite = SUITES[row["suite"]]
    rounds = int(float(row.get("rounds") or 0)) or None
    for profile, items in suite.overrides.items():
        if f"num_rounds={rounds}" in items:
            return {"profile": profile, "rounds": None, "sets": [], "diagnostics": False}, True
    return {"profile": "cpu", "rounds": rounds, "sets": [], "diagnostics": False}, True


def _out_for_command(out_dir: str) -> str:
    """``--out`` as written in the README: relative to the repository when inside it."""
    path = os.path.abspath(out_dir)
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def bench_commands(rows: List[dict], out_dir: str) -> Dict[str, List[str]]:
    """The bench command lines that reproduce ``rows``, per suite, in the order to run them.

    Rows of a suite run with the same settings merge into one command (their seeds and jobs);
    every command after the first writes with ``--append``. Rows from before bench recorded its
    arguments get a command reconstructed from the suite's profiles, marked with a comment.

    Args:
        rows: results.csv rows.
        out_dir: the bench output folder (``--out``).
    """
    out, first, commands = _out_for_command(out_dir), True, {}
    for name in suites_of(rows):
        suite, groups = SUITES[name], {}
        for r in rows:
            if r["suite"] != name:
                continue
            args, inferred = _bench_args(r)
            g = groups.setdefault(json.dumps(args, sort_keys=True), {"args": args, "seeds": set(), "jobs": set(),
                                                                     "inferred": False})
            g["seeds"].add(int(r["seed"]))
            g["jobs"].add(r["method"])
            g["inferred"] |= inferred
        lines = []
        for g in groups.values():
            a = g["args"]
            parts = ["python -m fedpartial_tools bench", f"--suite {name}",
                     f"--seeds {','.join(str(s) for s in sorted(g['seeds']))}", f"--profile {a.get('profile', 'cpu')}"]
            if a.get("rounds"):
                parts.append(f"--rounds {int(a['rounds'])}")
            if g["jobs"] != set(suite.jobs):
                ordered = dict.fromkeys([*suite.jobs, *sorted(g["jobs"])])  # suite order, then any other job
                parts.append(f"--jobs {','.join(j for j in ordered if j in g['jobs'])}")
            if a.get("diagnostics"):
                parts.append("--diagnostics")
            parts += [f"--set {shlex.quote(s)}" for s in a.get("sets") or []]
            parts.append(f"--out {shlex.quote(out)}")
            if not first:
                parts.append("--append")
            first = False
            cmd = " ".join(parts)
            if g["inferred"]:
                cmd = "# reconstructed (these rows predate the recorded command)\n" + cmd
            lines.append(cmd)
        commands[name] = lines
    return commands


def _plots_of(name: str, folder: str) -> List[tuple]:
    """``(file name, alt text)`` of the suite's plots present in ``folder``."""
    found = [(f"{name}_curves.png", f"{name}: validation {SUITES[name].metrics[0]} per round"),
             (f"{name}_per_class_auc.png", f"{name}: per-class test AUC")]
    overlays = sorted(glob.glob(os.path.join(folder, f"{name}_overlays_seed*.png")))
    found += [(os.path.basename(p), f"{name}: test overlays, {os.path.basename(p)[len(name) + 10:-4]}")
              for p in overlays[:1]]  # one seed is enough in a README
    return [(f, alt) for f, alt in found if os.path.isfile(os.path.join(folder, f))]


def copy_outputs(out_dir: str, dest: str, suites: Sequence[str]) -> List[str]:
    """Copy results.csv / results.md and the suites' plots and pseudo-label tables to ``dest``.

    Args:
        out_dir: bench output folder.
        dest: folder to copy to (created), e.g. ``docs/results``.
        suites: suites whose files to copy.

    Returns:
        the copied file names.
    """
    os.makedirs(dest, exist_ok=True)
    names = ["results.csv", "results.md", "fedia_dice_per_completeness.png"]
    for name in suites:
        names += [os.path.basename(p) for p in glob.glob(os.path.join(out_dir, f"{name}_*"))
                  if p.endswith((".png", "_pseudo_labels.csv", "_pseudo_labels.md"))]
    copied = []
    for fname in sorted(set(names)):
        src = os.path.join(out_dir, fname)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(dest, fname)):
            shutil.copyfile(src, os.path.join(dest, fname))
            copied.append(fname)
    return copied


def readme_section(out_dir: str, readme: str, plots_dir: Optional[str] = None) -> str:
    """Markdown for the README: per suite of results.csv its table, the bench command that
    produced it, the plots and (when present) the pseudo-label table.

    Args:
        out_dir: bench output folder (results.csv, ``<suite>_pseudo_labels.md``).
        readme: the README the section goes into (image links are relative to it).
        plots_dir: where the plots are (default ``out_dir``), e.g. a ``copy_outputs`` folder.
    """
    csv_path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"{csv_path} does not exist (run python -m fedpartial_tools bench --out {out_dir} first)")
    rows = read_rows(csv_path)
    add_gap_columns(rows)
    plots_dir = plots_dir or out_dir
    base = os.path.dirname(os.path.abspath(readme))
    link = lambda f: os.path.relpath(os.path.join(os.path.abspath(plots_dir), f), base).replace(os.sep, "/")  # noqa
    commands = bench_commands(rows, out_dir)
    parts = [f"<!-- generated by python -m fedpartial_tools bench-report --out {_out_for_command(out_dir)}: "
             f"edits between these markers are overwritten -->"]
    for name in suites_of(rows):
        parts.append(suite_table(name, rows).strip("\n"))
        parts.append("```bash\n" + "\n".join(commands[name]) + "\n```")
        images = [f"![{alt}]({link(f)})" for f, alt in _plots_of(name, plots_dir)]
        if images:
            parts.append("\n".join(images))
        pseudo = os.path.join(out_dir, f"{name}_pseudo_labels.md")
        if os.path.isfile(pseudo):
            parts.append(open(pseudo).read().strip("\n"))
    if os.path.isfile(os.path.join(plots_dir, "fedia_dice_per_completeness.png")):
        parts.append(f"![FedIA: test Dice per completeness setting]({link('fedia_dice_per_completeness.png')})")
    parts.append(f"All rows: [{os.path.basename(csv_path)}]({link('results.csv')})"
                 if os.path.isfile(os.path.join(plots_dir, "results.csv")) else "")
    return "\n\n".join(p for p in parts if p) + "\n"


def replace_between_markers(path: str, text: str, begin: str = README_BEGIN, end: str = README_END) -> None:
    """Replace what lies between the ``begin`` and ``end`` marker lines of ``path`` by ``text``
    (the markers stay; the file is written atomically).

    Raises:
        ValueError: a marker is missing, repeated, or the end comes before the begin.
    """
    with open(path) as f:
        content = f.read()
    for marker in (begin, end):
        count = content.count(marker)
        if count != 1:
            raise ValueError(f"{path}: needs exactly one '{marker}' marker, found {count}")
    i, j = content.index(begin) + len(begin), content.index(end)
    if j < i:
        raise ValueError(f"{path}: '{end}' comes before '{begin}'")
    new = content[:i] + "\n" + text.strip("\n") + "\n" + content[j:]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def update_readme(out_dir: str, readme: str, copy_plots: Optional[str] = None) -> str:
    """Write the results of ``out_dir`` between the bench markers of ``readme``.

    Args:
        out_dir: bench output folder.
        readme: markdown file holding the :data:`README_BEGIN` / :data:`README_END` markers.
        copy_plots: copy results and plots there first and link to the copies.

    Returns:
        the section written.
    """
    if not os.path.isfile(readme):
        raise FileNotFoundError(f"README '{readme}' does not exist")
    csv_path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"{csv_path} does not exist (run python -m fedpartial_tools bench --out {out_dir} first)")
    if copy_plots:
        suites = list(dict.fromkeys(r["suite"] for r in read_rows(csv_path)))
        copy_outputs(out_dir, copy_plots, suites)
    section = readme_section(out_dir, readme, plots_dir=copy_plots)
    replace_between_markers(readme, section)
    return section


def read_rows(path: str) -> List[dict]:
    rows = []
    for r in csv.DictReader(open(path)):
        out = {}
        for k, v in r.items():
            try:
                out[k] = float(v) if k not in ("suite", "method", "dataset", "scenario", "split_options",
                                               "per_class_auc", "curve", "bench_args") else v
            except ValueError:
                out[k] = v
        out["seed"] = int(out["seed"])
        if isinstance(out.get("rounds"), float) and out["rounds"].is_integer():
            out["rounds"] = int(out["rounds"])  # "20 rounds" in the tables, not "20.0"
        rows.append(out)
    return rows
