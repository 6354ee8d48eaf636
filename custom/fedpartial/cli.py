"""Command line: ``python -m fedpartial {split,import,simulate,evaluate,package-job,synthetic} ...``
(``import {dicom,images,nifti}``: a site's own data + label CSV -> site file)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_split(args):
    from fedpartial.data.partition import split_command

    split_command(args)


def _cmd_simulate(args):
    from fedpartial.jobtools import dataset_overrides, simulate

    sets = (dataset_overrides(args.data_root) if args.fit_data else []) + list(args.set)
    summary = simulate(args.job, args.data_root, args.workspace, sets, threads=args.threads, timeout=args.timeout)
    if not summary["ok"]:
        # a global model can exist after a failed run (e.g. a site dropped out and min_clients
        # stopped the job after round 1): never report such a run as a success
        print(f"error: the simulation did not complete: simulator exit code {summary['exit_code']}, "
              f"{summary['rounds_completed']} of {summary['num_rounds']} rounds aggregated. First errors:\n"
              f"{summary['errors'] or '(none logged)'}\nlog: {os.path.join(summary['workspace'], 'simulator.log')}",
              file=sys.stderr)
        raise SystemExit(1)


def _cmd_package(args):
    from fedpartial.jobtools import package_job

    out = package_job(args.job, args.out, args.set, data_root=args.data_root, name=args.name)
    print(out)


def _cmd_evaluate(args):
    from fedpartial.data.npz import load_npz
    from fedpartial.evaluation import evaluate_split
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.flare.common import jsonable
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import select_device

    device = select_device(args.device)
    model, meta = load_model_file(args.model, device=device)
    data = load_npz(args.data)
    if args.split not in data.splits:
        raise SystemExit(f"error: '{args.data}' has no '{args.split}' split (it has {sorted(data.splits)})")
    if data.task != meta["task"]:
        raise SystemExit(f"error: model '{args.model}' is a {meta['task']} model; '{args.data}' holds {data.task} data")
    if data.task != "segmentation" and list(data.class_names) != list(meta["class_names"]):
        raise SystemExit(f"error: class names of '{args.data}' {data.class_names} differ from the model's "
                         f"{meta['class_names']}")
    size = tuple(meta.get("input_size") or (0, 0))
    if any(size):
        data = resize_dataset(data, size)
    split = data.splits[args.split]
    metrics = evaluate_split(model.to(device), split, data.task, data.class_names, meta["normalisation"], device)
    out = {"model": os.path.abspath(args.model), "data": os.path.abspath(args.data), "split": args.split,
           "n": len(split), **metrics}
    print(json.dumps(jsonable(out), indent=None if args.compact else 1))


def _cmd_pseudo_labels(args):
    import glob

    from fedpartial.evaluation import pseudo_label_census
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
    from fedpartial.data import synthetic
    from fedpartial.data.npz import save_npz

    if args.task == "segmentation":
        data = synthetic.make_segmentation(size=args.size, seed=args.seed)
    else:
        data = synthetic.make_classification(task=args.task, num_classes=args.classes, size=args.size,
                                             channels=args.channels, seed=args.seed)
    save_npz(data, args.out)
    print(args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedpartial", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("split", help="partition one dataset into K site files with per-site label masks")
    from fedpartial.data.partition import add_split_arguments

    add_split_arguments(s)
    s.set_defaults(func=_cmd_split)

    def add_set(sp):
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job setting, e.g. num_rounds=3, rule_args.lr=0.001, model.arch=resnet18; "
                             "prefix server./client. for one side")

    s = sub.add_parser("simulate", help="run a job in the FLARE simulator, one site per site file")
    s.add_argument("job", help="job folder, e.g. jobs/fedavg")
    s.add_argument("--data-root", required=True, help="folder of site files (site-1.npz ...)")
    s.add_argument("--workspace", required=True, help="output folder")
    s.add_argument("--threads", type=int, default=0, help="client threads (0 = one per site)")
    s.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped")
    s.add_argument("--fit-data", action="store_true",
                   help="set the job's model block (class names, task, channels, image size) from the site files")
    add_set(s)
    s.set_defaults(func=_cmd_simulate)

    s = sub.add_parser("package-job", help="write a submit-ready job folder (code carried in app/custom)")
    s.add_argument("job")
    s.add_argument("--out", required=True)
    s.add_argument("--data-root", default=None, help="absolute folder where every site finds <site>.npz")
    s.add_argument("--name", default=None, help="job name")
    add_set(s)
    s.set_defaults(func=_cmd_package)

    s = sub.add_parser("evaluate", help="metrics of a saved model on a .npz file, as one JSON object")
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--split", default="test")
    s.add_argument("--device", default="auto")
    s.add_argument("--compact", action="store_true", help="one line of JSON")
    s.set_defaults(func=_cmd_evaluate)

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

    from fedpartial.bench import add_bench_parser
    from fedpartial.throughput import add_throughput_parser

    add_bench_parser(sub)
    add_throughput_parser(sub)
    from fedpartial.data.importer import add_import_parser

    add_import_parser(sub)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
