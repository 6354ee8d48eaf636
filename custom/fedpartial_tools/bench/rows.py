"""Committed result rows: every training the bench finishes appends its row to a CSV (one file per
suite under ``docs/results/rows/`` by default), keyed by suite, job, seed, the split it was scored
on and a hash of its settings. A bench finds a row already there for the same key and does not
train again, so a measurement longer than one working session goes on where the last one stopped,
and README's tables are computed from these files (:mod:`fedpartial_tools.bench.readme_rows`).
"""
from __future__ import annotations

import csv
import fcntl
import hashlib
import json
import os
import subprocess
from typing import Dict, List, Optional, Sequence

#: columns every row starts with; the metrics follow, then the rest of the bench row
KEY_COLUMNS = ("suite", "method", "seed", "scored_on", "settings_hash")
#: ``commit`` is the code that scored the row (and trained it, unless the bench reused a kept model),
#: ``scored_at`` when (UTC): a test row scored after its val rows were committed shows the order
PROVENANCE_COLUMNS = ("commit", "scored_at", "device", "seconds", "settings")


def settings_hash(job_folder: str, sets: Sequence[str], profile: str) -> str:
    """A short hash of what decides a training: the job, its ``--set`` items (in order), the bench
    profile, and what they come to: the client rule's effective arguments (its constructor defaults
    included) and model, and the server's config with the items applied. So a job whose profile or
    a client rule's default changed since a row was measured hashes differently, and is measured
    again rather than taken from the old row. Paths never enter ``sets`` (the bench's are data
    settings), so the same training hashes alike on every machine. A server rule's constructor
    default is not part of it: changing one needs the rows measured again.

    Args:
        job_folder: the job that runs the row (a folder of jobs/ or ``RECIPE:PROFILE``).
        sets: its ``--set`` items.
        profile: the bench profile.
    """
    text = json.dumps({"job": job_folder, "sets": list(sets), "profile": profile,
                       "effective": effective_settings(job_folder, sets)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def effective_settings(job_folder: str, sets: Sequence[str]) -> dict:
    """The client rule's effective settings (:func:`fedpartial_tools.jobs.settings.job_settings`) and
    the server config with ``sets`` applied."""
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.jobs.settings import _config_paths, apply_overrides, job_settings

    job = find_job(job_folder)
    configs = {side: json.load(open(path)) for side, path in _config_paths(job).items()}
    apply_overrides(configs, list(sets))
    return {"client": job_settings(job, sets), "server": configs["server"]}


def current_commit(repo: str) -> str:
    """``git describe``-like id of the code that trains: ``$FEDPARTIAL_COMMIT`` where the caller says
    which commit a copy is (a device machine's copy may carry a stale .git), else the commit,
    ``+dirty`` with uncommitted changes."""
    if os.environ.get("FEDPARTIAL_COMMIT"):
        return os.environ["FEDPARTIAL_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if not sha:
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def device_name() -> str:
    """The device the bench's trainings ran on, in words (``cpu``, or the GPU's name)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def row_key(row: dict) -> tuple:
    return tuple(str(row.get(k, "")) for k in KEY_COLUMNS)


def read_committed(path: str) -> List[dict]:
    """The rows of a committed CSV (``[]`` when there is none)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def find_row(path: str, key: tuple) -> Optional[dict]:
    """The last row of ``path`` with ``key`` (:data:`KEY_COLUMNS`), or None."""
    hits = [r for r in read_committed(path) if row_key(r) == key]
    return hits[-1] if hits else None


def append_row(path: str, row: dict) -> None:
    """Append ``row`` to ``path``; a row with the same key is replaced. Safe for several threads
    and bench processes writing one file (a lock on its folder); a new column rewrites the file
    with the union of the columns."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    lock = os.open(folder, os.O_RDONLY)  # each call its own descriptor: threads exclude each other too
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _rewrite(path, row)
    finally:
        os.close(lock)  # releases the lock


def _rewrite(path: str, row: dict) -> None:
    rows = [r for r in read_committed(path) if row_key(r) != row_key(row)]
    rows.append({k: _cell(v) for k, v in row.items()})
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _cell(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _columns(rows: List[dict]) -> List[str]:
    seen: Dict[str, None] = {k: None for k in KEY_COLUMNS}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    for k in PROVENANCE_COLUMNS:  # provenance last
        seen.pop(k, None)
        seen[k] = None
    return list(seen)


def as_bench_row(row: dict) -> dict:
    """A committed row as the bench's own rows are (numbers as floats, the seed an int)."""
    out = {}
    for k, v in row.items():
        if k in ("seed",):
            out[k] = int(v)
            continue
        try:
            out[k] = float(v) if k not in ("settings_hash", "commit", "suite", "method") else v
        except (TypeError, ValueError):
            out[k] = v
    return out


def merge(files: Sequence[str], rows_dir: str) -> Dict[str, int]:
    """Every row of ``files`` (e.g. a device run's one CSV) into its suite's file of ``rows_dir``;
    a row with the same key there is replaced. Returns the rows merged per suite."""
    counts: Dict[str, int] = {}
    for path in files:
        for row in read_committed(path):
            append_row(os.path.join(rows_dir, f"{row['suite']}.csv"), row)
            counts[row["suite"]] = counts.get(row["suite"], 0) + 1
    return counts


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="merge row CSVs into the committed rows, one file per suite")
    p.add_argument("files", nargs="+")
    p.add_argument("--into", required=True, help="the committed rows folder (docs/results/rows)")
    a = p.parse_args()
    print(json.dumps(merge(a.files, a.into), indent=1))
