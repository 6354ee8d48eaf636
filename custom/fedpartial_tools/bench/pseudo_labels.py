"""Pseudo-label quality per round of a method job run with ``--diagnostics``: the records read from
each seed's metrics, ``<suite>_pseudo_labels.csv`` and its markdown table."""
from __future__ import annotations

import csv
import glob
import json
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from fedpartial_tools.bench.suites import SUITES
from fedpartial_tools.bench.tables import _fmt


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
