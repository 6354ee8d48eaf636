"""Bench tables read back from a run folder: ``results.csv`` / ``results.md`` (mean ± std over
seeds and the share of the lower→upper gap closed), per-seed, per-suite and per-group tables, the
spread of the last rounds, and the table of a setting chosen on the val split (``selection.md``)."""
from __future__ import annotations

import csv
import os
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial_tools.bench.plots import plot_results
from fedpartial_tools.bench.selection import selection_key
from fedpartial_tools.bench.suites import GROUP_METRICS, SUITE_GROUPS, SUITES, suites_of


def gap_closed(value: float, lower: float, upper: float) -> float:
    """Share of the lower→upper gap that ``value`` closes; NaN when there is no gap to close (the
    upper bound at or below the lower one: a ratio of a negative gap reads as a share and is none).

    Args:
        value: the method's metric.
        lower: the lower-bound baseline's metric (FedAvg on partial labels).
        upper: the upper bound's (FedAvg on complete labels).
    """
    gap = upper - lower
    return float("nan") if not np.isfinite(gap) or gap < 1e-9 else (value - lower) / gap


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
        curve: the per-round validation scores (``bench.runner._curve``).
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
        cells += [_share(gap_of_means(jr, lower, upper, k)) for k in suite.metrics[:2]]
        if spread:
            cells.append(_fmt([_value(r, LAST_ROUNDS_KEY) for r in jr]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _share(gap: float) -> str:
    """A gap share as a table cell ("–" where there is none)."""
    return f"{gap:.0%}" if np.isfinite(gap) else "–"


def _mean_cell(mean: float) -> str:
    return f"{mean:.3f}" if np.isfinite(mean) else "–"


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
    means: Dict[str, List[float]] = {}  # job -> its mean over seeds, per suite
    below = []
    pairs = below_pairs = 0  # seed by seed: a fold's mean can hide the seeds where the method is below
    for name in names:
        suite = SUITES[name]
        of_job = {job: [r for r in rows if r["suite"] == name and r["method"] == job]
                  for job in dict.fromkeys([*jobs, suite.method, suite.lower, suite.upper])}
        suite_means = {job: mean_std([_value(r, key) for r in job_rows])[0] for job, job_rows in of_job.items()}
        for job, mean in suite_means.items():
            means.setdefault(job, []).append(mean)
        gap = gap_of_means(of_job[suite.method], of_job[suite.lower], of_job[suite.upper], key)
        seeds = len({int(r["seed"]) for r in rows if r["suite"] == name})
        lines.append("| " + " | ".join([name, str(seeds)] + [_mean_cell(suite_means[j]) for j in jobs]
                                      + [_share(gap)]) + " |")
        if suite_means[suite.method] < suite_means[suite.lower]:  # False where either is NaN
            below.append(name)
        value = {(r["method"], int(r["seed"])): _value(r, key) for r in of_job[suite.method] + of_job[suite.lower]}
        for seed in sorted({s for _, s in value}):
            method, lower = value.get((suite.method, seed)), value.get((suite.lower, seed))
            if method is not None and lower is not None and np.isfinite(method) and np.isfinite(lower):
                pairs += 1
                below_pairs += method < lower
    over = {job: mean_std(values)[0] for job, values in means.items()}
    gap = gap_closed(over[first.method], over[first.lower], over[first.upper])
    lines.append("| " + " | ".join([f"mean of {len(names)} suites", ""] + [_mean_cell(over[j]) for j in jobs]
                                  + [_share(gap)]) + " |")
    devices = Counter(r.get("device") or "?" for r in rows if r["suite"] in names)
    lines += ["", f"{first.method} below {first.lower} (means over seeds): "
                  + (", ".join(below) if below else "on no suite")
                  + (f"; seed by seed in {below_pairs} of {pairs} (fold, seed) pairs" if pairs else "")
                  + "; rows from " + ", ".join(f"{d} ({n})" for d, n in sorted(devices.items()))]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Choosing a setting on the val split (bench --select-on val)
# ---------------------------------------------------------------------------------------------
SELECTION_CSV = "selection.csv"


#: how each kind of selection row was scored (the ``val split`` column of selection.md)
SELECTION_SPLITS = {"val": "sites' own val, their labels (as the server receives it)",
                    "val-complete": "curated complete val (no site holds it)"}


def selection_table(name: str, rows: List[dict]) -> str:
    """Markdown ranking of suite ``name``'s method and its variants by the metric the selection
    ranks on (mean over seeds, best first), the baselines below for reference; one table per kind
    of val split present (``scored_on``: ``val`` = the sites' own val splits with their own labels,
    ``val-complete`` = the curated complete val split), each row marked with it.

    Args:
        name: the suite.
        rows: ``selection.csv`` rows.
    """
    suite = SUITES[name]
    sub = [r for r in rows if r["suite"] == name]
    if not sub:
        return ""
    kinds = list(dict.fromkeys(str(r.get("scored_on") or "val-complete") for r in sub))
    return "\n".join(_selection_table(name, [r for r in sub if str(r.get("scored_on") or "val-complete") == kind],
                                      kind) for kind in kinds)


def _selection_table(name: str, sub: List[dict], kind: str) -> str:
    suite = SUITES[name]
    key = selection_key(name, kind)
    candidates = [suite.method, *suite.variants]
    ranked = []
    for job in dict.fromkeys(r["method"] for r in sub):
        per_seed = {int(r["seed"]): _value(r, key) for r in sub if r["method"] == job}
        mean, std = mean_std(list(per_seed.values()))
        ranked.append((job in candidates, mean, std, job, per_seed))
    ranked.sort(key=lambda t: (not t[0], -(t[1] if np.isfinite(t[1]) else -np.inf)))
    seeds = sorted({int(r["seed"]) for r in sub})
    where = SELECTION_SPLITS.get(kind, kind)
    lines = [f"\n**{name}**: {key} on the {where} (the test split was not read), seeds {seeds}; "
             f"the method's settings ranked first, best first, then the baselines\n",
             "| rank | job | settings | val split | " + key + " (mean ± sample std) | per seed |",
             "|---|---|---|---|---|---|"]
    rank = 0
    for is_candidate, mean, std, job, per_seed in ranked:
        rank += is_candidate
        settings = " ".join(suite.variants.get(job, [])) or ("as shipped" if job == suite.method else "baseline")
        value = f"{mean:.4f} ± {std:.4f}" if np.isfinite(std) else (f"{mean:.4f}" if np.isfinite(mean) else "–")
        lines.append(f"| {rank if is_candidate else ''} | {job} | {settings} | {kind} | {value} | "
                     + " / ".join(f"{v:.4f}" for _, v in sorted(per_seed.items())) + " |")
    chosen = next((t[3] for t in ranked if t[0] and np.isfinite(t[1])), None)
    if chosen:
        lines += ["", f"Chosen on {kind}: **{chosen}**. Its test score, read once: `python -m fedpartial_tools bench "
                      f"--suite {name} --seeds {','.join(map(str, seeds))} --jobs {suite.lower},{suite.upper},{chosen} "
                      f"--reuse --out OUT --append`"]
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
