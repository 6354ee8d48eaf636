"""``python -m fedpartial_tools bench`` / ``bench-report``: the command line of the bench, every
method against its FedAvg baselines on real data (suites: :mod:`fedpartial_tools.bench.suites`,
running: :mod:`fedpartial_tools.bench.runner`, reports: :mod:`~fedpartial_tools.bench.tables`,
:mod:`~fedpartial_tools.bench.plots`, :mod:`~fedpartial_tools.bench.pseudo_labels`,
:mod:`~fedpartial_tools.bench.overlays`, :mod:`~fedpartial_tools.bench.readme`).

A *suite* names a dataset, a partition scenario, the method job and its baselines; ``--suite-group``
runs a group of suites (``suites.SUITE_GROUPS``, e.g. ``ms6``: six MS patients held out in
turn at two completeness settings). For each seed
the bench makes the split (seeded), runs each job in the FLARE simulator with the same seed and
rounds, evaluates the final global model on the source file's test split, and writes
``results.csv``, ``results.md`` (mean ± std and the share of the lower→upper gap closed) and
PNG plots (per-round validation curves, per-class AUC bars, Dice per completeness setting).

To choose a setting without the test split, ``--select-on val`` ranks every job's final model on
what the sites can compute (each site's own val split with its own labels, as the server received it
in cross-site evaluation) and ``--select-on val-complete`` on the source's curated val split with
complete labels; both write ``selection.csv`` / ``selection.md``, each row marked with its val split;
``--reuse`` then scores the chosen job's saved model on the test split, training nothing again.

Reports read back from the run folder (also ``python -m fedpartial_tools bench-report``): pseudo-label
quality per round of the method job (``--diagnostics``), prediction overlays of the segmentation
suites, and the results section of a README between ``<!-- bench:results:begin -->`` /
``<!-- bench:results:end -->`` markers, with the bench command that reproduces each table.
"""


from __future__ import annotations

import os

from fedpartial_tools.bench.overlays import write_overlays
from fedpartial_tools.bench.plots import plot_results
from fedpartial_tools.bench.pseudo_labels import seed_dirs, write_pseudo_label_report
from fedpartial_tools.bench.readme import README_BEGIN, README_END, copy_outputs, update_readme
from fedpartial_tools.bench.runner import plan_suite, run_trainings
from fedpartial_tools.bench.sources import split_source
from fedpartial_tools.bench.suites import DEFAULT_DATA, REPO, SUITE_GROUPS, SUITES, is_segmentation, suite_names
from fedpartial_tools.bench.tables import SELECTION_CSV, markdown_table, read_rows, write_reports, write_selection


def _cmd_bench(args):
    selecting = args.select_on is not None
    csv_path = os.path.join(args.out, SELECTION_CSV if selecting else "results.csv")
    keep_old = args.append or selecting
    names = suite_names(args.suite or [], args.suite_group or [])
    if not names:
        raise ValueError("bench needs --suite NAME or --suite-group GROUP")
    seeds = [int(s) for s in args.seeds.split(",")]
    score_on = args.select_on or "test"
    rows_dir = "" if args.no_rows else args.rows
    # every suite's trainings in one pool, so that --parallel keeps the machine busy across suites
    plans = {name: plan_suite(name, args.out, seeds=seeds, profile=args.profile, data_dir=args.data_dir,
                              rounds=args.rounds, jobs=args.jobs.split(",") if args.jobs else None, extra=args.set,
                              diagnostics=args.diagnostics, score_on=score_on) for name in names}
    trainings = [t for name in names for t in plans[name][0]]
    finished = run_trainings(trainings, score_on=score_on, reuse=args.reuse, parallel=args.parallel, rows_dir=rows_dir,
                             profile=args.profile, log=print)
    for name in names:
        new = [row for t, row in zip(trainings, finished) if t.suite == name]
        # a re-run (same suite, job, seed) replaces the old row; the file is read again first, so
        # that rows another bench wrote into the same folder meanwhile (other seeds) are kept
        rows = read_rows(csv_path) if keep_old and os.path.isfile(csv_path) else []
        redone = {(r["suite"], r["method"], int(r["seed"])) for r in new}
        rows = [r for r in rows if (r["suite"], r["method"], int(r["seed"])) not in redone] + new
        if selecting:
            print(write_selection(rows, args.out))
            continue
        print(write_reports(rows, args.out))
        keep_old = True  # the next suite's rows join this one's
        if args.overlay_images and is_segmentation(name):
            for seed in seeds:
                try:
                    print(f"overlays: {write_overlays(name, args.out, seed, plans[name][0][0].source, n_images=args.overlay_images)[0]}")
                except Exception as e:  # a convenience, like the plots: the numbers are in the CSV
                    print(f"warning: overlays of {name} seed {seed} failed: {e}")
        if args.diagnostics:
            md = write_pseudo_label_report(args.out, name, every=args.every)
            if md:
                print(md)
    if not selecting:
        _readme_and_copies(args)


def _cmd_bench_report(args):
    """Reports from an existing bench folder: nothing is trained or re-evaluated (overlays
    excepted: they run the saved models on a few test images)."""
    csv_path = os.path.join(args.out, "results.csv")
    names = suite_names(args.suite or [], args.suite_group or []) or list(dict.fromkeys(
        [r["suite"] for r in (read_rows(csv_path) if os.path.isfile(csv_path) else [])]
        + [n for n in SUITES if os.path.isdir(os.path.join(args.out, n))]))
    if not names:
        raise FileNotFoundError(f"no results.csv and no suite folder in '{args.out}'")
    if os.path.isfile(csv_path):
        # results.md and the plots again from the CSV, so a report change reaches old runs
        rows = read_rows(csv_path)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown_table(rows))
        plot_results(rows, args.out)
    for name in names:
        md = write_pseudo_label_report(args.out, name, job=args.job, every=args.every)
        if md:
            print(md)
        if args.overlays and is_segmentation(name):
            for seed in seed_dirs(args.out, name):
                print(write_overlays(name, args.out, seed, split_source(args.out, name, seed, args.data_dir),
                                     n_images=args.overlay_images)[0])
    _readme_and_copies(args)


def _readme_and_copies(args) -> None:
    if args.readme:
        update_readme(args.out, args.readme, args.copy_plots)
        print(f"results written between the bench markers of {args.readme}")
    elif args.copy_plots:
        rows = read_rows(os.path.join(args.out, "results.csv"))
        copied = copy_outputs(args.out, args.copy_plots, list(dict.fromkeys(r["suite"] for r in rows)))
        print(f"copied to {args.copy_plots}: {', '.join(copied)}")


def _add_report_arguments(s) -> None:
    s.add_argument("--every", type=int, default=None, metavar="K",
                   help="pseudo-label table: every K-th round (always the last; default about 12 rows)")
    s.add_argument("--overlay-images", type=int, default=4, metavar="N",
                   help="segmentation suites: test images per overlay grid (evenly spaced over the test split)")
    s.add_argument("--readme", default=None, metavar="PATH",
                   help=f"write the results between '{README_BEGIN}' and '{README_END}' in PATH")
    s.add_argument("--copy-plots", default=None, metavar="DIR",
                   help="copy results.csv/.md, plots and pseudo-label tables to DIR (e.g. docs/results); with "
                        "--readme, the README links to the copies")
    s.add_argument("--data-dir", default=DEFAULT_DATA)


def add_bench_parser(sub) -> None:
    s = sub.add_parser("bench", help="methods x baselines x seeds on real data -> results.csv, results.md, plots")
    s.add_argument("--suite", action="append", default=None, choices=sorted(SUITES),
                   help="comparison to run (repeatable; this or --suite-group is needed)")
    s.add_argument("--suite-group", action="append", default=None, choices=sorted(SUITE_GROUPS),
                   help="run every suite of a group (repeatable): " + "; ".join(
                       f"{g}: {len(n)} suites {n[0]} ... {n[-1]}" for g, n in SUITE_GROUPS.items()))
    s.add_argument("--seeds", default="0,1,2")
    s.add_argument("--profile", choices=["cpu", "gpu"], default="cpu")
    s.add_argument("--rounds", type=int, default=None)
    s.add_argument("--jobs", default="", help="comma list: a subset of the suite's jobs")
    s.add_argument("--out", required=True)
    s.add_argument("--append", action="store_true", help="keep rows already in OUT/results.csv (a re-run job and seed replaces its row)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every job")
    s.add_argument("--select-on", choices=["val", "val-complete"], default=None,
                   help="choose a setting without the test split: rank the jobs in OUT/selection.csv and "
                        "OUT/selection.md (results.csv is not touched) on 'val': what the sites can compute, each "
                        "site's own val split with its own labels as the server received it in cross-site "
                        "evaluation (pooled over sites), or 'val-complete': the source's curated val split with "
                        "complete labels, which no site holds (marked in every row)")
    s.add_argument("--reuse", action="store_true",
                   help="score a job's saved model again where the bench trained it with the same settings "
                        "(after --select-on val: the chosen job's test score without training it again)")
    s.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="trainings at once, each its own simulator process (0 = from the machine: with a GPU three "
                        "for every four cores, on CPUs one for every four cores)")
    s.add_argument("--rows", default=os.path.join(REPO, "docs", "results", "rows"), metavar="DIR",
                   help="committed rows, one <suite>.csv each: a training already there with the same settings is "
                        "not run again, and each finished one is appended at once (default: docs/results/rows)")
    s.add_argument("--no-rows", action="store_true", help="neither read nor write committed rows")
    s.add_argument("--diagnostics", action="store_true",
                   help="the method job (never the baselines) logs pseudo-label quality against the hidden labels "
                        "(reference_file); writes OUT/<suite>_pseudo_labels.csv and .md")
    _add_report_arguments(s)
    s.set_defaults(func=_cmd_bench)

    s = sub.add_parser("bench-report", help="reports from an existing bench folder: pseudo-label tables, "
                                            "segmentation overlays, README results section")
    s.add_argument("--out", required=True, help="the bench output folder")
    s.add_argument("--suite", action="append", default=None, choices=sorted(SUITES),
                   help="suite to report (repeatable; default those in results.csv or with a folder in OUT)")
    s.add_argument("--suite-group", action="append", default=None, choices=sorted(SUITE_GROUPS),
                   help="report every suite of a group (repeatable)")
    s.add_argument("--job", default=None, help="job whose pseudo labels to report (default the suite's method)")
    s.add_argument("--overlays", action="store_true",
                   help="segmentation suites: draw the overlays of every seed folder again (runs the saved models)")
    _add_report_arguments(s)
    s.set_defaults(func=_cmd_bench_report)
