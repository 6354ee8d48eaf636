"""Command line. ``python -m fedpartial {import,split,simulate,evaluate,predict,export,package-job,pseudo-labels,
synthetic}`` are the user's commands (``import {dicom,images,nifti}``: a site's own data + label CSV -> site
file; ``predict {dicom,images,nifti}``: a model on a site's own images; ``export``: a model as TorchScript or
a MONAI bundle); ``python -m fedpartial_tools`` adds the developer's: ``bench``, ``bench-report``,
``throughput``, ``jobs`` and ``harmonise`` (a slice ``.npz`` brought to the input agreement).
The model user's four (import, evaluate, predict, export) live in :mod:`.model_cli`, which the tools
wheel ships alone."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from fedpartial_tools.model_cli import add_model_commands, format_evaluation, run  # noqa: F401  (run_demo.sh)


def _cmd_split(args):
    from fedpartial_tools.data.partition import split_command

    split_command(args)


def _with_matched(args, fitted):
    """The job's ``--set`` items: the data's, then the matched method's (``--matched-to``), then the
    user's, so that a ``--set`` wins."""
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.jobs.matching import matched_sets

    matched = []
    if args.matched_to:
        matched = matched_sets(find_job(args.matched_to), find_job(args.job, args.profile), fitted + list(args.set))
        print(f"matched to {args.matched_to}: {' '.join(matched) or 'nothing to change'}", file=sys.stderr)
    return fitted + matched + list(args.set)


def _cmd_simulate(args):
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate

    sets = _with_matched(args, dataset_overrides(args.data_root) if args.fit_data else [])
    summary = simulate(find_job(args.job, args.profile), args.data_root, args.workspace, sets, threads=args.threads, timeout=args.timeout)
    if not summary["ok"]:
        # a global model can exist after a failed run (e.g. a site dropped out and min_clients
        # stopped the job after round 1): never report such a run as a success
        print(f"error: the simulation did not complete: simulator exit code {summary['exit_code']}, "
              f"{summary['rounds_completed']} of {summary['num_rounds']} rounds aggregated. First errors:\n"
              f"{summary['errors'] or '(none logged)'}\nlog: {os.path.join(summary['workspace'], 'simulator.log')}",
              file=sys.stderr)
        raise SystemExit(1)


def _cmd_package(args):
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.deploy.provision import site_list
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.jobs.packaging import check_min_clients, package_job

    fitted = []
    if args.fit_data or args.fit_data_from:
        source = args.fit_data_from or args.data_root
        if not source:
            raise ValueError("--fit-data reads the site files in --data-root; give --data-root (or --fit-data-from "
                             "DIR when the sites' folder is not on this machine, as with --dataset)")
        fitted = dataset_overrides(source)
    sets = _with_matched(args, fitted)
    out = package_job(find_job(args.job, args.profile), args.out, sets, data_root=args.data_root, name=args.name,
                      with_code=not args.installed_runtime, dataset=args.dataset)
    if args.sites:
        try:
            check_min_clients(out, site_list(args.sites))
        except ValueError:
            shutil.rmtree(out)
            raise
    print(out)


def _cmd_pseudo_labels(args):
    import glob

    from fedpartial_tools.evaluate import pseudo_label_census
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import select_device

    device = select_device(args.device)
    model, meta = load_model_file(args.model, device=device)
    if meta["task"] != "single-label":
        raise SystemExit(f"error: pseudo-labels is for single-label models; '{args.model}' is {meta['task']}")
    files = sorted(glob.glob(os.path.join(args.sites, "*.npz")))
    if not files:
        raise SystemExit(f"error: no site file (*.npz) in '{args.sites}'")
    census = pseudo_label_census(model, files, os.path.join(args.sites, "reference"), meta["normalisation"], device,
                                 args.tau, args.renormalise_missing)
    names = census["classes"]
    print("| site | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for site, row in [*census["sites"].items(), ("all", census["total"])]:
        cells = [f"{p} ({c} right) / {h}" for h, p, c in zip(row["hidden"], row["pseudo"], row["correct"])]
        print(f"| {site} | " + " | ".join(cells) + " |")
    print("\ncell: pseudo labels of the class (right ones) / hidden samples of the class")


def _cmd_synthetic(args):
    from fedpartial_tools.data import synthetic
    from fedpartial.data.npz import save_npz

    if args.task == "segmentation":
        data = synthetic.make_segmentation(size=args.size, seed=args.seed)
    else:
        data = synthetic.make_classification(task=args.task, num_classes=args.classes, size=args.size,
                                             channels=args.channels, seed=args.seed)
    save_npz(data, args.out)
    print(args.out)


def build_parser(developer: bool = False) -> argparse.ArgumentParser:
    """The command-line parser.

    Args:
        developer: also the developer commands (benchmarks, job-folder generation), as
            ``python -m fedpartial_tools`` has them.
    """
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools" if developer else "python -m fedpartial",
                                description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("split", help="partition one dataset into K site files with per-site label masks")
    from fedpartial_tools.data.partition import add_split_arguments

    add_split_arguments(s)
    s.set_defaults(func=_cmd_split)

    def add_set(sp):
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job setting, e.g. num_rounds=3, rule_args.lr=0.001, model.arch=resnet18; "
                             "prefix server./client. for one side")
        sp.add_argument("--matched-to", default=None, metavar="METHOD_JOB",
                        help="run this baseline with a method job's model, local recipe (lr, weight decay, betas, "
                             "batch size, local epochs, augmentation, imbalance handling), rounds, optimizer steps "
                             "per round and site weights, to compare rules like for like: a job folder or a name "
                             "of jobs/ (e.g. fedlsm, or fedmlp:ctich for a profile); a --set still wins")
        sp.add_argument("--profile", default=None,
                        help="a named profile of the job's recipe instead of the shipped (cpu) one, e.g. paper, "
                             "lesions, ctich (python -m fedpartial_tools jobs --list)")

    s = sub.add_parser("simulate", help="run a job in the FLARE simulator, one site per site file")
    s.add_argument("job", help="job folder, e.g. jobs/fedavg, or a name of jobs/ (fedavg)")
    s.add_argument("--data-root", required=True, help="folder of site files (site-1.npz ...)")
    s.add_argument("--workspace", required=True, help="output folder")
    s.add_argument("--threads", type=int, default=0, help="client threads (0 = one per site)")
    s.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped")
    s.add_argument("--fit-data", action="store_true",
                   help="set the job's model block (class names, task, channels, image size) from the site files")
    add_set(s)
    s.set_defaults(func=_cmd_simulate)

    s = sub.add_parser("package-job", help="write a submit-ready job folder (code carried in app/custom, or none "
                                           "with --installed-runtime)")
    s.add_argument("job")
    s.add_argument("--installed-runtime", action="store_true",
                   help="no code in the job (no app/custom): for sites with the fedpartial runtime wheel installed "
                        "and no byoc right; the job names the runtime version it needs")
    s.add_argument("--out", required=True)
    data = s.add_mutually_exclusive_group()
    data.add_argument("--dataset", default=None, metavar="NAME",
                      help="provisioned sites: the dataset name every site offers for this federation in its "
                           "kit's local/fedpartial_site.json (docs/DEPLOYMENT.md, 'Which data a job reads')")
    data.add_argument("--data-root", default=None,
                      help="development sites (POC): absolute folder where every site finds <site>.npz; a "
                           "provisioned site refuses a job that names a path")
    s.add_argument("--name", default=None, help="job name")
    s.add_argument("--sites", type=int, default=0,
                   help="number of sites of the deployment: refuse a job whose min_clients is larger (it would "
                        "wait in SUBMITTED forever); fix with --set min_clients=N")
    s.add_argument("--fit-data", action="store_true",
                   help="set the job's model block (class names, task, channels, image size) from the site files "
                        "in --data-root, as simulate --fit-data does")
    s.add_argument("--fit-data-from", default=None, metavar="DIR",
                   help="like --fit-data, reading a local folder of site files (when --data-root is the sites' "
                        "path on other machines)")
    add_set(s)
    s.set_defaults(func=_cmd_package)

    s = sub.add_parser("pseudo-labels", help="per site and class: the confident pseudo labels a single-label model "
                                             "gives to samples of missing classes, against the hidden truth")
    s.add_argument("--model", required=True)
    s.add_argument("--sites", required=True, help="folder of site files with reference/<site>_full.npz beside them")
    s.add_argument("--tau", type=float, default=0.95)
    s.add_argument("--renormalise-missing", action="store_true", help="FedLSM's renormalise_missing rule")
    s.add_argument("--device", default="auto")
    s.set_defaults(func=_cmd_pseudo_labels)

    s = sub.add_parser("synthetic", help="write the built-in synthetic dataset as a source .npz")
    s.add_argument("--task", choices=["single-label", "multi-label", "segmentation"], default="multi-label")
    s.add_argument("--classes", type=int, default=5)
    s.add_argument("--channels", type=int, default=1)
    s.add_argument("--size", type=int, default=28)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.set_defaults(func=_cmd_synthetic)

    add_model_commands(sub)
    if developer:
        from fedpartial_tools.bench.cli import add_bench_parser
        from fedpartial_tools.bench.throughput import add_throughput_parser
        from fedpartial_tools.bench.summary import add_summary_parser
        from fedpartial_tools.bench.timing import add_timing_parser
        from fedpartial_tools.data.harmonise import add_harmonise_parser
        from fedpartial_tools.jobs.folders import add_jobs_parser

        add_bench_parser(sub)
        add_throughput_parser(sub)
        add_timing_parser(sub)
        add_summary_parser(sub)
        add_jobs_parser(sub)
        add_harmonise_parser(sub)
    return p


def main(argv=None, developer: bool = False):
    """Parse ``argv`` and run the command; a user error prints one line and exits 2.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        developer: offer the developer commands too (``python -m fedpartial_tools``).
    """
    run(build_parser(developer), argv)


if __name__ == "__main__":
    main()
