"""README's Results, computed from the committed rows (``docs/results/rows/<suite>.csv``,
:mod:`fedpartial_tools.bench.rows`) by one command, which also fails when README's numbers differ
from them::

    python -m fedpartial_tools bench-summary --readme README.md           # write the block
    python -m fedpartial_tools bench-summary --readme README.md --check   # exit 1 where it differs

One line per suite, numbers only, each from the rows scored on the **test** split: FedAvg on partial
labels, FedAvg matched to the method in compute (where the suite runs one), FedAvg on complete
labels, the method, the share of the gap it closes and the seeds where it is below, each over FedAvg
and over FedAvg given the method's compute (gap = (method − baseline) / (full − baseline)); then a
table per leave-one-patient-out group (per fold means over seeds, the mean over folds, the folds
where the method is below FedAvg). A suite with no committed test row is not shown.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Sequence

import numpy as np

from fedpartial_tools.bench.rows import read_committed
from fedpartial_tools.bench.suites import GROUP_METRICS, REPO, SUITE_GROUPS, SUITES
from fedpartial_tools.bench.tables import _value, gap_of_means, group_table, mean_std

BEGIN, END = "<!-- results:rows -->", "<!-- results:rows:end -->"
ROWS_DIR = os.path.join(REPO, "docs", "results", "rows")
#: the FedAvg matched to its method in optimizer steps and site weights, where a suite runs it
COMPUTE_MATCHED = "fedavg_compute"


def committed_test_rows(rows_dir: str = ROWS_DIR) -> List[dict]:
    """Every committed row scored on the test split, of every suite file in ``rows_dir``."""
    rows = []
    if os.path.isdir(rows_dir):
        for name in sorted(os.listdir(rows_dir)):
            if name.endswith(".csv"):
                rows += [r for r in read_committed(os.path.join(rows_dir, name)) if r.get("scored_on") == "test"]
    return rows


def _cell(rows: List[dict], key: str) -> str:
    mean, std = mean_std([_value(r, key) for r in rows])
    if not np.isfinite(mean):
        return "–"
    return f"{mean:.3f} ± {std:.3f}" if np.isfinite(std) else f"{mean:.3f}"


def suite_line(name: str, rows: List[dict]) -> str:
    """One README line of suite ``name`` from its test rows (``rows`` of that suite)."""
    suite = SUITES[name]
    key = suite.metrics[0]
    of = {job: [r for r in rows if r["method"] == job] for job in (suite.lower, COMPUTE_MATCHED, suite.upper,
                                                                    suite.method)}
    by_seed = {job: {int(r["seed"]): _value(r, key) for r in of[job]} for job in of}
    seeds = sorted({int(r["seed"]) for r in rows})
    gaps, belows = [], []
    for baseline in (suite.lower, COMPUTE_MATCHED):  # FedAvg as it is, and FedAvg given the method's compute
        if not of[baseline]:
            gaps.append("–")
            belows.append("–")
            continue
        gap = gap_of_means(of[suite.method], of[baseline], of[suite.upper], key)
        gaps.append(f"{100 * gap:.0f} %" if np.isfinite(gap) else "–")
        common = sorted(set(by_seed[suite.method]) & set(by_seed[baseline]))
        below = [s for s in common if by_seed[suite.method][s] < by_seed[baseline][s]]
        belows.append(f"{len(below)} of {len(common)}" + (f" ({', '.join(map(str, below))})" if below else ""))
    return "| " + " | ".join([name, key, str(len(seeds))] + [_cell(of[j], key) for j in
                                                            (suite.lower, COMPUTE_MATCHED, suite.upper, suite.method)]
                             + [" / ".join(gaps), " / ".join(belows)]) + " |"


def complete_seeds(rows: Sequence[dict]) -> List[dict]:
    """The rows of the seeds where a suite has its method and both bounds: a seed that some job has
    not reached yet (a measurement under way) would compare unlike with like."""
    kept = []
    for name in dict.fromkeys(r["suite"] for r in rows):
        suite = SUITES[name]
        mine = [r for r in rows if r["suite"] == name]
        needed = {suite.method, suite.lower, suite.upper}
        seeds = {int(r["seed"]) for r in mine}
        done = {s for s in seeds if needed <= {r["method"] for r in mine if int(r["seed"]) == s}}
        kept += [r for r in mine if int(r["seed"]) in done]
    return kept


def summary(rows: Sequence[dict]) -> str:
    """The README block: one line per suite outside a group, then each group's fold table (only
    the seeds where a suite has its method and both bounds)."""
    rows = complete_seeds([r for r in rows if r["suite"] in SUITES])
    grouped = {n for names in SUITE_GROUPS.values() for n in names}
    present = list(dict.fromkeys(r["suite"] for r in rows if r["suite"] in SUITES))
    lines = ["| suite | metric | seeds | FedAvg (partial) | FedAvg (method's compute) | FedAvg (full labels) | method "
             "| gap closed over FedAvg / its compute | seeds below FedAvg / its compute |",
             "|---|---|---|---|---|---|---|---|---|"]
    singles = [n for n in SUITES if n in present and n not in grouped]
    for name in singles:
        lines.append(suite_line(name, [r for r in rows if r["suite"] == name]))
    parts = ["\n".join(lines)] if singles else []
    for group in SUITE_GROUPS:
        table = group_table(group, [r for r in rows if r["suite"] in SUITE_GROUPS[group]],
                            GROUP_METRICS.get(group, "dice_pooled"))
        if table:
            parts.append(table)
    return "\n\n".join(parts) if parts else "No committed test rows yet."


def replace_block(text: str, block: str, where: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"'{where}' has no '{BEGIN}' ... '{END}' block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def add_summary_parser(sub) -> None:
    s = sub.add_parser("bench-summary", help="README's results block from the committed rows (--check: fail where it "
                                             "differs)")
    s.add_argument("--rows", default=ROWS_DIR, help="the committed rows folder")
    s.add_argument("--readme", default="", help="the README whose results block is written (or checked)")
    s.add_argument("--check", action="store_true", help="write nothing; exit 1 where the README differs")
    s.set_defaults(func=lambda args: sys.exit(run(args)))


def run(args) -> int:
    block = summary(committed_test_rows(args.rows))
    if not args.readme:
        print(block)
        return 0
    text = open(args.readme).read()
    new = replace_block(text, block, args.readme)
    if args.check:
        if new != text:
            old = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
            differing = [ln for ln in block.splitlines() if ln not in old] + [ln for ln in old if ln not in block]
            print(f"{args.readme}: the results block differs from the committed rows in {args.rows}:\n"
                  + "\n".join(differing), file=sys.stderr)
            return 1
        print(f"{args.readme}: the results block matches the committed rows")
        return 0
    with open(args.readme, "w") as f:
        f.write(new)
    print(f"{args.readme}: results block written from {args.rows}")
    return 0
