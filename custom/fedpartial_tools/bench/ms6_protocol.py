"""FedIA on six MS patients from two sources, measured as one protocol that fits the time a
machine is lent for (``python -m fedpartial_tools.bench.ms6_protocol``; on a GPU machine
``scripts/device_bench.sh`` runs it):

1. **The recipe, chosen on the sites' own val masks, before any held-out patient is scored.** On
   two folds, the first patient of each source (7 and 2), m = 3, every job, the candidates of
   :data:`CANDIDATES` (lr schedule, lr, lesion-slice sampling). The federation's view of a training
   is ``site_val_last5``: the Dice pooled over the sites' own (incomplete) val masks, mean of the
   last 5 rounds. The candidate with the higher mean over the FedIA and FedAvg rows (not the
   complete-mask bound: its sites hold masks no site has) wins; within 0.005 of each other the one
   with the smaller last-rounds range (``val_range_last5``), then the shipped one. Only the val
   split is scored here.
2. **The fold table**: every patient held out in turn (m = 3), FedAvg on incomplete masks, FedAvg
   on complete masks, FedIA as shipped, with the chosen recipe, seed by seed (all folds of seed 0
   first, so a cut-off run still covers every fold), scored on the held-out patient.
3. **The second rater** as a real incomplete annotation: every fold, seed 0.

Every finished training appends its row to the committed rows (:mod:`fedpartial_tools.bench.rows`):
a run cut off by its deadline loses nothing it finished, and the next run with the same rows
skips what is there.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List, Sequence

import numpy as np

from fedpartial_tools.bench.runner import SITE_VAL_KEY, plan_suite, run_trainings
from fedpartial_tools.bench.suites import DEFAULT_DATA, MS6_PATIENTS
from fedpartial_tools.bench.tables import LAST_ROUNDS_KEY

JOBS = ["fedia_lesions", "fedavg_seg_lesions", "fedavg_seg_full_lesions"]
#: the jobs whose sites hold what a federation has (the bound's sites hold complete masks)
CHOOSING_JOBS = ("fedia_lesions", "fedavg_seg_lesions")
SELECTION_PATIENTS = (7, 2)  # the first patient of each source
# every setting explicit: a profile's default may change (the lesions profile now ships the chosen
# cosine). lr 1e-4 and no lesion-slice sampling are the paper's; lr 1e-3 the segmentation recipe's.
_COSINE = ["rule_args.lr_schedule=cosine"]
CANDIDATES: Dict[str, List[str]] = {"constant": ["rule_args.lr_schedule=constant"],
                                    "cosine": _COSINE,
                                    "cosine-lr1e-3": [*_COSINE, "rule_args.lr=0.001"],
                                    "cosine-lr1e-4": [*_COSINE, "rule_args.lr=0.0001"],
                                    "cosine-no-lesion-sampling": [*_COSINE, "rule_args.lesion_fraction=0"],
                                    "cosine-lr1e-3-no-lesion-sampling": [*_COSINE, "rule_args.lr=0.001",
                                                                         "rule_args.lesion_fraction=0"]}
TIE = 0.005


def choose(rows: Sequence[dict]) -> tuple:
    """The candidate the protocol's rule picks from phase 1's rows (each with ``candidate``).

    Returns:
        ``(name, {candidate: (mean site_val_last5, mean val_range_last5, rows)})``.
    """
    summary = {}
    for name in CANDIDATES:
        mine = [r for r in rows if r["candidate"] == name and r["method"] in CHOOSING_JOBS]
        vals = [float(r[SITE_VAL_KEY]) for r in mine if np.isfinite(float(r[SITE_VAL_KEY]))]
        ranges = [float(r[LAST_ROUNDS_KEY]) for r in mine if np.isfinite(float(r[LAST_ROUNDS_KEY]))]
        summary[name] = (float(np.mean(vals)) if vals else float("nan"),
                         float(np.mean(ranges)) if ranges else float("nan"), len(mine))
    names = [n for n in CANDIDATES if np.isfinite(summary[n][0])]
    if not names:
        return "constant", summary
    best = max(names, key=lambda n: summary[n][0])
    close = [n for n in names if summary[best][0] - summary[n][0] <= TIE]
    if len(close) > 1:
        best = min(close, key=lambda n: (summary[n][1], list(CANDIDATES).index(n)))
    return best, summary


def candidate_of(row: dict) -> str:
    """The phase-1 candidate a committed row ran (read from its recorded ``--set`` items): the one
    with the most settings that are all there (``cosine`` is part of ``cosine-lr1e-3``), or ""."""
    sets = json.loads(row.get("settings") or "{}").get("sets", [])
    matches = [name for name, extra in CANDIDATES.items() if all(x in sets for x in extra)]
    return max(matches, key=lambda name: len(CANDIDATES[name]), default="")


def selection_table(rows_dir: str) -> str:
    """Phase 1 from the committed rows (a folder, one CSV per suite, or one .csv): each candidate's val rows (the sites' own val masks, last 5
    rounds; the source's val split with complete masks beside it, not used for the choice) and the
    choice the rule makes from them."""
    from fedpartial_tools.bench.rows import read_committed

    rows = []
    suites = [f"ms6-p{p}-m3" for p in SELECTION_PATIENTS]
    files = [rows_dir] if rows_dir.endswith(".csv") else [os.path.join(rows_dir, f"{s}.csv") for s in suites]
    for path in files:
        for r in read_committed(path):
            if r["suite"] in suites and r["scored_on"] in ("val", "val-complete") and candidate_of(r):
                rows.append({**r, "candidate": candidate_of(r)})
    chosen, summary = choose(rows)
    lines = ["| candidate | fold | job | seed | sites' own val, last 5 rounds | range, last 5 rounds | final model's "
             "val score (column scored_on; not used) |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (list(CANDIDATES).index(r["candidate"]), r["suite"], JOBS.index(r["method"]))):
        lines.append(f"| {r['candidate']} | {r['suite']} | {r['method']} | {r['seed']} | {float(r[SITE_VAL_KEY]):.3f} "
                     f"| {float(r[LAST_ROUNDS_KEY]):.3f} | {float(r['dice_pooled']):.3f} ({r['scored_on']}) |")
    unmeasured = [n for n, v in summary.items() if v[2] == 0]
    # a choice among part of the candidates is none: --chosen then refuses, and phase 1 runs them
    verdict = (f"Chosen: **{chosen}**." if not unmeasured else
               f"Nothing chosen: no rows yet for {', '.join(unmeasured)} (phase 1 runs them).")
    lines += ["", "Mean over the FedIA and FedAvg rows: " + "; ".join(
        f"{n} {v[0]:.4f} (range {v[1]:.4f}, {v[2]} rows)" for n, v in summary.items()) + f". {verdict}"]
    return "\n".join(lines)


def run(out: str, rows_dir: str, data_dir: str, deadline: float, parallel: int, seeds=(0, 1, 2),
        rater2_seeds=(0,), selection_seeds=(0,), patients: Sequence[int] = MS6_PATIENTS,
        jobs: Sequence[str] = JOBS, rounds=None, chosen: str = "", log=print) -> dict:
    """The three phases, each training started only while ``time.time() < deadline``.

    Args:
        out: the bench's working folder (splits, workspaces).
        rows_dir: committed rows (one CSV per suite).
        data_dir: the two MS source files.
        deadline: wall-clock time after which no training starts.
        parallel: trainings at once.
        seeds / rater2_seeds / selection_seeds: of the fold table, the second rater and phase 1.
        patients / jobs / rounds: fewer for a smoke test (default: every patient and job, the
            suites' rounds).
        chosen: the candidate phase 1 chose in an earlier run: phase 1 is not run again; the
            committed rows in ``rows_dir`` (a folder) must give that choice.
        log: progress printer.
    """
    report = {"started": time.time()}
    if chosen:
        if chosen not in CANDIDATES:
            raise ValueError(f"--chosen {chosen!r} is not one of {sorted(CANDIDATES)}")
        made = selection_table(rows_dir)
        if f"Chosen: **{chosen}**." not in made:
            raise ValueError(f"the committed rows in {rows_dir} do not choose {chosen!r}:\n{made}")
        report.update(chosen=chosen, selection="committed rows")
        return _phase2(out, rows_dir, data_dir, deadline, parallel, seeds, rater2_seeds, patients, jobs, rounds,
                       chosen, report, log)
    phase1 = []
    trainings = []
    for name, sets in CANDIDATES.items():
        for p in SELECTION_PATIENTS:
            planned, _ = plan_suite(f"ms6-p{p}-m3", os.path.join(out, name), seeds=selection_seeds, data_dir=data_dir,
                                    rounds=rounds, jobs=list(jobs), extra=sets, score_on="val")
            trainings += [(name, t) for t in planned]
    rows = run_trainings([t for _, t in trainings], score_on="val", parallel=parallel, rows_dir=rows_dir,
                         deadline=deadline, raise_errors=False, log=log)
    for (name, _), row in zip(trainings, rows):
        if row is not None:
            phase1.append({**row, "candidate": name})
    if len(phase1) < len(trainings):  # a choice on part of the candidates would favour the ones run first
        report.update(selection_rows=len(phase1), planned_selection=len(trainings), chosen=None)
        log(f"phase 1 unfinished ({len(phase1)} of {len(trainings)} trainings): no recipe chosen, nothing scored on test")
        return report
    chosen, summary = choose(phase1)
    report.update(selection=summary, chosen=chosen, selection_rows=len(phase1))
    log(f"recipe chosen on the sites' own val masks: {chosen} ({json.dumps(summary)})")
    if time.time() >= deadline:
        return report
    return _phase2(out, rows_dir, data_dir, deadline, parallel, seeds, rater2_seeds, patients, jobs, rounds, chosen,
                   report, log)


def _phase2(out, rows_dir, data_dir, deadline, parallel, seeds, rater2_seeds, patients, jobs, rounds, chosen, report,
            log) -> dict:
    sets = CANDIDATES[chosen]
    folder = os.path.join(out, chosen)

    def plan_patient(p: int) -> Dict[tuple, list]:
        # one thread per patient: a patient's suites share its held-out file, made once
        made = {}
        for seed in seeds:
            made[("m3", seed, p)] = plan_suite(f"ms6-p{p}-m3", folder, seeds=[seed], data_dir=data_dir,
                                               rounds=rounds, jobs=list(jobs), extra=sets)[0]
        for seed in rater2_seeds:
            made[("r2", seed, p)] = plan_suite(f"ms6-p{p}-r2", folder, seeds=[seed], data_dir=data_dir,
                                               rounds=rounds, jobs=list(jobs), extra=sets)[0]
        return made

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(patients)) as pool:  # the splits are made side by side
        made = {k: v for part in pool.map(plan_patient, patients) for k, v in part.items()}
    # seed-major: all folds of a seed before the next seed, the second rater last
    planned = [t for seed in seeds for p in patients for t in made[("m3", seed, p)]]
    planned += [t for seed in rater2_seeds for p in patients for t in made[("r2", seed, p)]]
    rows = run_trainings(planned, score_on="test", reuse=True, parallel=parallel, rows_dir=rows_dir,
                         deadline=deadline, raise_errors=False, log=log)
    report.update(test_rows=sum(r is not None for r in rows), planned=len(planned), finished=time.time())
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="working folder (splits, workspaces)")
    p.add_argument("--rows", required=True, help="committed rows folder (one CSV per suite), or one .csv")
    p.add_argument("--show-selection", action="store_true",
                   help="print phase 1's table and choice from the committed rows in --rows; train nothing")
    p.add_argument("--data-dir", default=DEFAULT_DATA)
    p.add_argument("--minutes", type=float, default=7.0, help="no training starts after this many minutes")
    p.add_argument("--parallel", type=int, default=0, help="trainings at once (0 = from the machine)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--report", default="", help="write the phases' report (JSON) here")
    p.add_argument("--patients", default=",".join(map(str, MS6_PATIENTS)), help="fewer folds (a smoke test)")
    p.add_argument("--jobs", default=",".join(JOBS), help="fewer jobs (a smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="fewer rounds (a smoke test)")
    p.add_argument("--chosen", default="", choices=["", *CANDIDATES],
                   help="the recipe an earlier run chose (its committed rows must give it): phase 1 is not run again")
    args = p.parse_args(argv)
    if args.show_selection:
        print(selection_table(args.rows))
        return
    if not args.out:
        p.error("--out is needed to run the protocol")
    report = run(args.out, args.rows, args.data_dir, time.time() + 60 * args.minutes, args.parallel,
                 seeds=[int(s) for s in args.seeds.split(",")], patients=[int(x) for x in args.patients.split(",")],
                 jobs=args.jobs.split(","), rounds=args.rounds, chosen=args.chosen)
    print(json.dumps(report, indent=1))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
