"""``python -m fedpartial_tools bench``: every method against its FedAvg baselines on real data.

A *suite* names a dataset, a partition scenario, the method job and its baselines. For each seed
the bench makes the split (seeded), runs each job in the FLARE simulator with the same seed and
rounds, evaluates the final global model on the source file's test split, and writes
``results.csv``, ``results.md`` (mean ± std and the share of the lower→upper gap closed) and
PNG plots (per-round validation curves, per-class AUC bars, Dice per completeness setting).

Reports read back from the run folder (also ``python -m fedpartial_tools bench-report``): pseudo-label
quality per round of the method job (``--diagnostics``), prediction overlays of the segmentation
suites, and the results section of a README between ``<!-- bench:results:begin -->`` /
``<!-- bench:results:end -->`` markers, with the bench command that reproduces each table.
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import json
import math
import os
import shlex
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

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
    # profile -> --set items of the method job and its variants only (a setting the baselines lack,
    # e.g. FedIA's warm-up length)
    method_overrides: Dict[str, List[str]] = field(default_factory=dict)
    # Ablations: label -> extra --set items of the method job, run and reported as a job of their own.
    variants: Dict[str, List[str]] = field(default_factory=dict)
    # profile -> another file of the same data (e.g. the GPU profile's larger images)
    datasets: Dict[str, str] = field(default_factory=dict)
    # a function of fedpartial_tools.synthetic that makes ``dataset`` (seed 0) when the data folder
    # lacks it: written once into <out>/_data
    generator: str = ""
    # CPU-profile settings that differ from the method job as shipped, each with the reason (every
    # other CPU-profile setting is already the job's default: the shipped jobs reproduce the tables)
    cpu_departures: Dict[str, str] = field(default_factory=dict)
    # a function of fedpartial_tools.synthetic that turns the test images into a shifted test set
    # (another acquisition); each metric is reported again as "<metric>_shift"
    shifted_test: str = ""
    # leave-one-patient-out: this patient id of the dataset's train split is the test split, the
    # other patients' slices are shared out among the sites (made once into <out>/_data)
    holdout_patient: Optional[int] = None

    def dataset_for(self, profile: str) -> str:
        """The data file the ``profile`` runs on."""
        return self.datasets.get(profile, self.dataset)

    @property
    def jobs(self) -> List[str]:
        return [self.lower, *self.others, self.upper, self.method, *self.variants]

    def job_folder(self, job: str) -> str:
        """The folder under ``jobs/`` that runs ``job`` (a variant runs the method's)."""
        return self.method if job in self.variants else job


_CPU_CLS = ["model.arch=small_cnn", "rule_args.lr=0.001"]
_PREMISE_CPU = ["num_rounds=30", "rule_args.local_epochs=3"]
_PREMISE_DEPARTURES = {"rule_args.local_epochs": "3: the premise is memorised label noise, which needs more "
                                                  "local steps than 30 rounds of one epoch give (control: -e1)"}
# FedMLP's options one at a time (fedpartial.algorithms.fedmlp: paper / released code / ours)
_FEDMLP_FIDELITY = {"fedmlp_paper_thresholds": ["rule_args.t0=0.005", "rule_args.t1=0.01"],
                    "fedmlp_cr_in_warmup": ["rule_args.cr_in_warmup=true"],
                    "fedmlp_la_annotated": ["rule_args.la_prior=annotated_frequency"],
                    "fedmlp_adaptive_warmup": ["rule_args.warmup_end=learning_degree", "rule_args.warmup_rounds=15",
                                               "rule_args.min_warmup_rounds=3"]}
SUITES: Dict[str, Suite] = {
    "fedlsm-ham": Suite("ham10000_28.npz", "label-set-mismatch", {"classes_per_site": 3}, 5, "fedlsm", "fedavg",
                        "fedavg_full", ["fedavg_partial_loss"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=50"],
                                   "gpu": ["model.arch=densenet121", "model.arch_args={}", "num_rounds=50"]},
                        # tau80: thresholds picked by validation AUC (seed 0: 0.95 / 0.9 / 0.8) for the
                        # CPU profile's small model, which is rarely 95 % sure.
                        # the job ships renormalise_missing=true (it won: 74 % vs 65 % of the AUC gap, 3 seeds;
                        # docs/results/results.csv names that row fedlsm_renormalised and the paper rule's
                        # fedlsm); fedlsm_paper = paper rule
                        variants={"fedlsm_paper": ["rule_args.renormalise_missing=false"],
                                  "fedlsm_tau80": ["rule_args.renormalise_missing=false", "rule_args.tau=0.8",
                                                   "rule_args.tau_l=0.7"]},
                        datasets={"gpu": "ham10000_64.npz"},
                        # auc_shift / f1_shift: the same test images through another "camera"
                        metrics=["auc", "f1", "accuracy", "bacc", "map", "auc_shift", "f1_shift"],
                        shifted_test="acquisition_shift"),
    "fedlsm-nih": Suite("nih_chestxray14_64.npz", "label-set-mismatch", {"classes_per_site": 3}, 8,
                        "fedlsm_multilabel", "fedavg", "fedavg_full", ["fedavg_partial_loss"],
                        metrics=["auc", "map", "f1", "bacc"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=20"], "gpu": ["model.arch=densenet121",
                                                                               "model.arch_args={}", "num_rounds=50"]}),
    "fedmlp-ctich": Suite("ct_ich_128.npz", "label-set-mismatch", {"classes_per_site": 1}, 5, "fedmlp_ctich",
                          "fedavg", "fedavg_full", ["fedavg_partial_loss"], metrics=["auc", "map", "bacc", "f1"],
                          # positive tags capped by the class's prevalence at the annotating sites
                          variants={"fedmlp_prevalence_cap": ["rule_args.positive_tag_cap=prevalence"],
                                    # FedLSM's class-wise row averaging (over the annotating sites) for
                                    # FedMLP's classifier
                                    "fedmlp_annotated_rows": ["rule_args.classifier_rows=annotated"],
                                    # untagged missing entries count as negatives (weight 1),
                                    # as FedAvg counts them; right for 94-99 % of them at this prevalence
                                    "fedmlp_assumed_negative": ["rule_args.assumed_negative_weight=1.0"]},
                          overrides={"cpu": _CPU_CLS + ["num_rounds=30", "model.input_size=[64,64]"],
                                     "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    "fedmlp-nih": Suite("nih_chestxray14_64.npz", "missing-classes", {"missing_per_site": 7}, 8, "fedmlp",
                        "fedavg", "fedavg_full", ["fedavg_partial_loss"], metrics=["auc", "map", "bacc", "f1"],
                        variants={"fedmlp_prevalence_cap": ["rule_args.positive_tag_cap=prevalence"]},
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"],
                                   "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    # FedMLP's premise: a site that does not annotate class c trains on c's positives as negatives,
    # label noise that a long training memorises. 5 sites of 600 images, 1 annotated class each,
    # prevalence 0.15-0.45 (the paper's 13-23 % and above), 3 local epochs per round. The data is
    # fixed (synthetic.make_premise_multilabel, written before FedMLP ran on it); when the
    # baselines' gap is too small the setting gets harder (epochs, rounds), never the data easier.
    "fedmlp-premise": Suite("premise_multilabel_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5, "fedmlp",
                            "fedavg", "fedavg_full", ["fedavg_partial_loss"], metrics=["auc", "map", "bacc", "f1"],
                            generator="make_premise_multilabel", variants=_FEDMLP_FIDELITY,
                            cpu_departures=_PREMISE_DEPARTURES,
                            overrides={"cpu": _CPU_CLS + _PREMISE_CPU}),
    # control: prevalence x 0.1 (CT-ICH's 1.5-4.5 %); the mechanism predicts a smaller margin
    "fedmlp-premise-rare": Suite("premise_multilabel_rare_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5,
                                 "fedmlp", "fedavg", "fedavg_full", ["fedavg_partial_loss"],
                                 metrics=["auc", "map", "bacc", "f1"], generator="make_premise_multilabel_rare",
                                 variants=_FEDMLP_FIDELITY, overrides={"cpu": _CPU_CLS + _PREMISE_CPU},
                                 cpu_departures=_PREMISE_DEPARTURES),
    # control: one local epoch per round (less memorising); the mechanism predicts a smaller margin
    "fedmlp-premise-e1": Suite("premise_multilabel_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5,
                               "fedmlp", "fedavg", "fedavg_full", ["fedavg_partial_loss"],
                               metrics=["auc", "map", "bacc", "f1"], generator="make_premise_multilabel",
                               variants=_FEDMLP_FIDELITY,
                               overrides={"cpu": _CPU_CLS + _PREMISE_CPU[:-1] + ["rule_args.local_epochs=1"]}),
    "fedirm-ham": Suite("ham10000_28.npz", "semi-supervised", {"labelled_sites": 2}, 10, "fedirm", "fedavg",
                        "fedavg_full", metrics=["auc", "accuracy", "f1", "bacc"],
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"],
                                   "gpu": ["model.arch=densenet121", "model.arch_args={\"dropout\":0.2}",
                                           "num_rounds=100"]},
                        # the method's own recipe on the labelled sites alone: the like-for-like lower bound
                        variants={"fedirm_labelled_only": ["rule_args.unlabelled_start_round=1000000"],
                                  # the job ships our rule (lowest-entropy half reliable, unlabelled
                                  # sites weigh a quarter; it won AUC on every seed, see docs/RESULTS.md):
                                  # the paper's ln 2 filter and plain sample weighting
                                  "fedirm_paper": ["rule_args.reliable_fraction=0.0", "rule_args.unlabelled_weight=1.0"]},
                        datasets={"gpu": "ham10000_64.npz"}),
}
# The candidate rule for sparse lesions, run on both DSB2018 and the small-lesion suites: whole
# missed lesions at 0.8, warm-up counted from the first lesion the model marks, and a correction
# that changed nothing does not use up the site's one correction.
# whole missed lesions instead of pixels (fedpartial.algorithms.fedia.correct_masks_lesionwise)
_LESIONWISE = ["rule_args.correction_rule=lesions", "rule_args.correction_threshold=0.8"]
# + warm-up counted from the first lesion the model marks (learning starts late)
_LESIONWISE_LATE = _LESIONWISE + ["rule_args.warmup_from_first_lesion=true"]
_LESIONWISE_LATE_RETRY = _LESIONWISE_LATE + ["rule_args.retry_empty_correction=true"]
for _m in range(4):
    # FedIA, paper setting: site k (0..3) keeps (20k - 10m + 40) % of its lesions.
    SUITES[f"fedia-dsb-m{_m}"] = Suite(
        "dsb2018_nuclei_256.npz", "incomplete-masks",
        {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia", "fedavg_seg",
        "fedavg_seg_full", metrics=["dice", "iou"],
        # like with like: fedia switches to plain FedAvg once every site has corrected, which a
        # run without correction never reaches; fedia_keep_weighting is fedia with completeness
        # weighting to the end, the row fedia_no_correction compares with
        variants={"fedia_no_correction": ["rule_args.use_correction=false"],
                  "fedia_keep_weighting": ["rule_args.fedavg_after_all_corrected=false"],
                  # the job ships threshold 0.95 (it won at m = 0..3; docs/results/results.csv names
                  # that row fedia_threshold95 and the paper's 0.8 fedia)
                  "fedia_paper_threshold": ["rule_args.correction_threshold=0.8"],
                  "fedia_lesionwise": _LESIONWISE, "fedia_lesionwise_late_retry": _LESIONWISE_LATE_RETRY},
        overrides={"cpu": ["num_rounds=30", "model.input_size=[64,64]", "rule_args.lr=0.001"],
                   "gpu": ["num_rounds=100", "model.input_size=[256,256]"]})

# Real MS lesions on FLAIR (2 patients, native 182x218, lesion burden 35-fold apart), leave one
# patient out: the other patient's slices go to 4 sites keeping (20k - 10m + 40) % of their
# lesions, the held-out patient is the test set. The jobs run as shipped, fitted to the data's
# classes and size. Metrics of the last aggregate and of best_global_model.pt ("_best").
# fedia_lesions ships completeness weighting without correction (the correction lowered the
# within-patient val Dice here); the variants put the whole-lesion correction back (at 0.8 and
# 0.95), and fedia_lesions_paper adds to the correction the paper's weighting (no clipping, no
# readiness rule, no weight cap).
_FEDIA_PAPER_WEIGHTING = ["rule_args.completeness_cap=null", "rule_args.min_predicted_ratio=0",
                          "rule_args.completeness_max=null", "rule_args.max_weight_ratio=null"]
for _patient in (7, 19):
    for _m in (2, 3):
        SUITES[f"ms-p{_patient}-m{_m}"] = Suite(
            "ms_flair_2patients.npz", "incomplete-masks",
            {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia_lesions",
            "fedavg_seg_lesions", "fedavg_seg_full_lesions", holdout_patient=_patient,
            metrics=["dice_pooled", "dice_per_image", "dice_pooled_best", "dice_per_image_best"],
            variants={"fedia_lesions_correction": ["rule_args.use_correction=true"],
                      "fedia_lesions_t95": ["rule_args.use_correction=true", "rule_args.correction_threshold=0.95"],
                      "fedia_lesions_paper": ["rule_args.use_correction=true"] + _FEDIA_PAPER_WEIGHTING})


# What a baseline takes from its method, so that a row compares rules, not networks or recipes:
# the whole model block but the classes, and the local recipe keys both rules accept. The
# augmentation stays each rule's own (FedLSM's weak / strong views and FedIRM's affine view are
# part of those methods); FedIRM's like-for-like lower bound is its own job with the unlabelled
# sites never joining (the ``fedirm_labelled_only`` row).
SHARED_MODEL_KEYS = ("arch", "arch_args", "in_channels", "input_size", "normalisation", "pretrained")
SHARED_RULE_KEYS = ("lr", "weight_decay", "betas", "batch_size", "local_epochs")


def job_settings(folder: str, sets: Sequence[str] = ()) -> dict:
    """The effective ``model`` block, client ``rule_args`` and ``num_rounds`` of ``jobs/<folder>``
    after ``sets``."""
    from fedpartial_tools.jobtools import _config_paths, apply_overrides

    configs = {side: json.load(open(path)) for side, path in _config_paths(os.path.join(REPO, "jobs", folder)).items()}
    apply_overrides(configs, list(sets))
    executor = configs["client"]["executors"][0]["executor"]["args"]
    return {"model": configs["server"]["model"], "rule_args": executor.get("rule_args", {}),
            "num_rounds": configs["server"].get("num_rounds")}


def profile_departures(suite: "Suite", profile: str = "cpu") -> List[str]:
    """Settings (``model.<key>``, ``rule_args.<key>``, ``num_rounds``) that ``profile`` changes on
    the suite's method job as shipped."""
    shipped = job_settings(suite.method)
    run = job_settings(suite.method, list(suite.overrides.get(profile, [])) + list(suite.method_overrides.get(profile, [])))
    keys = [f"model.{k}" for k in sorted(set(shipped["model"]) | set(run["model"]))
            if shipped["model"].get(k) != run["model"].get(k)]
    keys += [f"rule_args.{k}" for k in sorted(set(shipped["rule_args"]) | set(run["rule_args"]))
             if shipped["rule_args"].get(k) != run["rule_args"].get(k)]
    return keys + (["num_rounds"] if shipped["num_rounds"] != run["num_rounds"] else [])


def matched_sets(suite: "Suite", job: str, sets: Sequence[str] = ()) -> List[str]:
    """``--set`` items giving a baseline ``job`` of ``suite`` its method's model and local recipe
    (:data:`SHARED_MODEL_KEYS`, :data:`SHARED_RULE_KEYS`), after the common ``sets``; ``[]`` for
    the method and its variants. ``local_epochs`` is shared only when both are whole epochs."""
    if suite.job_folder(job) == suite.method:
        return []
    method, base = job_settings(suite.method, sets), job_settings(suite.job_folder(job), sets)
    out = [f"num_rounds={method['num_rounds']}"] if base["num_rounds"] != method["num_rounds"] else []
    for key in SHARED_MODEL_KEYS:
        if key in method["model"] and base["model"].get(key) != method["model"][key]:
            out.append(f"model.{key}={json.dumps(method['model'][key])}")
    for key in SHARED_RULE_KEYS:
        value = method["rule_args"].get(key)
        if key not in base["rule_args"] or value is None or value == base["rule_args"][key]:
            continue
        if key == "local_epochs" and float(value) != int(value):
            continue  # FedLSM's 1.3 epochs are its iteration budget; the FedAvg rules count whole epochs
        out.append(f"rule_args.{key}={json.dumps(value)}")
    return out


# Small sparse lesions: MS-like slices made by fedpartial_tools.synthetic (128 px native,
# lesions 2-12 px across, 0.2 % of the pixels, 6 of 10 slices empty), the FedIA paper's site
# completeness, training at native resolution. lesions-m*: the paper's plain Dice loss and uniform
# batches for every job; lesions-dicece-m*: Dice + cross-entropy and half of each batch from
# slices with a lesion, for every job (a setting of the segmentation path, not of one method).
# lr 1e-2: at 1e-3 the 450 local steps of 30 rounds leave every job predicting no lesion at all
# (pooled Dice 0 for fedavg_seg_full, seed 0); at 1e-2 the full-label model reaches 0.92. Even so
# no job marks a lesion before round ~13, so FedIA's warm-up (paper: 10 MS / 40 lung; a property
# of the learning curve) is 20 of 40 rounds: after 10 the warm-up model predicts no lesion and the
# completeness estimate has nothing to count.
_LESION_CPU = ["num_rounds=40", "model.input_size=[128,128]", "rule_args.lr=0.01"]
_LESION_WARMUP = ["rule_args.warmup_rounds=20"]
_LESION_CE = ["rule_args.loss=dice_ce", "rule_args.lesion_fraction=0.5"]
for _m in (2, 3):
    for _name, _extra in ((f"lesions-m{_m}", []), (f"lesions-dicece-m{_m}", _LESION_CE)):
        SUITES[_name] = Suite(
            "small_lesions_128.npz", "incomplete-masks",
            {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia", "fedavg_seg",
            "fedavg_seg_full", metrics=["dice_pooled", "dice_per_image", "dice", "iou"],
            generator="make_small_lesions",
            cpu_departures={"model.input_size": "the synthetic lesion set's native 128 px (fedia ships DSB2018's 64 px)",
                            "rule_args.loss": "the suite's loss", "rule_args.lesion_fraction": "the suite's batches",
                            "rule_args.lr": "1e-2: at 1e-3 no job learns a lesion in 30 rounds of 15 steps",
                            "rule_args.warmup_rounds": "20: no model marks a lesion before round ~13",
                            "num_rounds": "40: 20 warm-up rounds, then 20 of FedIA proper"},
            method_overrides={"cpu": _LESION_WARMUP, "gpu": ["rule_args.warmup_rounds=40"]},
            variants={"fedia_paper_threshold": ["rule_args.correction_threshold=0.8"],
                      "fedia_lesionwise": _LESIONWISE, "fedia_lesionwise_late": _LESIONWISE_LATE,
                      "fedia_lesionwise_late_retry": _LESIONWISE_LATE_RETRY},
            overrides={"cpu": _LESION_CPU + _extra,
                       "gpu": ["num_rounds=100", "model.input_size=[128,128]", "rule_args.lr=0.01"] + _extra})


def suites_of(rows: Sequence[dict]) -> List[str]:
    """The suites present in ``rows``, in the order of :data:`SUITES` (so that a re-run suite keeps
    its place in the reports)."""
    order = {name: i for i, name in enumerate(SUITES)}
    return sorted(dict.fromkeys(r["suite"] for r in rows), key=lambda name: order.get(name, len(order)))


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
    """Mean over sites of the validation ``key`` of the model each round started from; for a
    Dice key of segmentation sites, the Dice pooled over every site's val pixels."""
    from fedpartial.metrics.segmentation import pooled_validation

    if not os.path.isfile(metrics_file):
        return []
    rounds = json.load(open(metrics_file))["rounds"]
    out = []
    for r in rounds:
        pooled = pooled_validation({k: s.get("val") for k, s in r["sites"].items()}) if key.startswith("dice") else None
        if pooled is not None:
            out.append(float(pooled["dice_pooled"]))
            continue
        vals = [s.get("val", {}).get(key) for s in r["sites"].values()]
        vals = [v for v in vals if v is not None]
        out.append(float(np.mean(vals)) if vals else float("nan"))
    return out


# Only the method job reads the reference copies, and only to log diagnostics (training never
# uses them): the baselines must stay exactly the runs they are without --diagnostics.
REFERENCE_SET = "reference_file=reference/{site}_full.npz"


def run_suite(name: str, out_dir: str, seeds=(0, 1, 2), profile: str = "cpu", data_dir: str = DEFAULT_DATA,
              rounds: Optional[int] = None, jobs: Optional[List[str]] = None, extra: List[str] = (),
              diagnostics: bool = False, overlay_images: int = 4, log=print) -> List[dict]:
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
        diagnostics: the method job (only) logs pseudo-label quality against the hidden complete
            labels (``reference_file``); see :func:`write_pseudo_label_report`.
        overlay_images: segmentation suites: test images in ``<suite>_overlays_seed<k>.png`` after
            each seed (0 = no overlays).
    """
    from fedpartial_tools.partition import split_file
    from fedpartial_tools.jobtools import dataset_overrides, simulate

    suite = SUITES[name]
    source = suite_source(suite, profile, data_dir, out_dir)
    if any(item.split("=", 1)[0].split(".")[-1] == "reference_file" for item in extra):
        raise ValueError("--set reference_file=... would reach the baselines too; use --diagnostics, which sets it "
                         "for the method job only")
    jobs = list(jobs or suite.jobs)
    unknown = [j for j in jobs if j not in suite.jobs]
    if unknown:
        raise ValueError(f"suite '{name}' has no job {unknown}; its jobs: {suite.jobs}")
    # What reproduces these rows (the README shows it as a bench command line).
    bench_args = json.dumps({"profile": profile, "rounds": rounds, "sets": list(extra), "diagnostics": diagnostics})
    rows = []
    for seed in seeds:
        split_dir = os.path.join(out_dir, name, f"seed{seed}", "sites")
        summary_path = os.path.join(split_dir, "split_summary.json")
        if not os.path.isfile(summary_path):
            made = split_file(source, suite.scenario, sites=suite.sites, seed=seed, out=split_dir,
                              **suite.split_options)
            for warning in (made or {}).get("warnings", []):
                print(f"{name} seed {seed}: WARNING: {warning}", flush=True)
        else:
            made_from = os.path.basename(str(json.load(open(summary_path)).get("source", "")))
            if made_from and made_from != os.path.basename(source):
                raise ValueError(f"'{split_dir}' was split from {made_from}, but the {profile} profile of suite "
                                 f"'{name}' runs on {os.path.basename(source)}: give another --out")
        sets = dataset_overrides(split_dir) + list(suite.overrides.get(profile, [])) + [f"seed={seed}"]
        if rounds:
            sets.append(f"num_rounds={rounds}")
        sets += list(extra)
        for job in jobs:
            ws = os.path.join(out_dir, name, f"seed{seed}", job)
            started = time.time()
            folder = suite.job_folder(job)
            job_sets = (sets + matched_sets(suite, job, sets)
                        + (list(suite.method_overrides.get(profile, [])) if folder == suite.method else [])
                        + suite.variants.get(job, [])
                        + ([REFERENCE_SET] if diagnostics and folder == suite.method else []))
            simulate(os.path.join(REPO, "jobs", folder), split_dir, ws, job_sets, log=log)
            row = _evaluate_row(name, suite, job, seed, ws, source, time.time() - started)
            row["bench_args"] = bench_args
            rows.append(row)
            log(f"{name} seed {seed} {job}: " + ", ".join(f"{k}={row.get(k, float('nan')):.4f}"
                                                          for k in suite.metrics))
        if overlay_images and is_segmentation(name):
            try:
                log(f"overlays: {write_overlays(name, out_dir, seed, source, n_images=overlay_images)[0]}")
            except Exception as e:  # a convenience, like the plots: the numbers are in the CSV
                log(f"warning: overlays of {name} seed {seed} failed: {e}")
    return rows


def is_segmentation(name: str) -> bool:
    """Whether suite ``name`` is scored with Dice (segmentation)."""
    return any(k.startswith("dice") for k in SUITES[name].metrics)


def _load_for_eval(ws: str, data, device, cache: Optional[dict] = None):
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


def _evaluate_row(name, suite, job, seed, ws, source, seconds) -> dict:
    from fedpartial.data.npz import load_npz
    from fedpartial.evaluation import evaluate_split
    from fedpartial.training.common import select_device

    device = select_device("auto")
    model, meta, data = _load_for_eval(ws, load_npz(source), device)
    test = data.splits["test"]
    metrics = evaluate_split(model, test, data.task, data.class_names, meta["normalisation"], device)
    if data.task == "segmentation":
        from fedpartial.evaluation import predict_split
        from fedpartial.metrics import segmentation_metrics

        probs = predict_split(model, test, data.task, meta["normalisation"], device)
        # "dice" / "iou" of the DSB2018 tables: per-image means with an empty-both image scoring 1
        metrics.update(segmentation_metrics(probs > 0.5, np.asarray(test.labels) > 0))
    row = {"suite": name, "method": job, "dataset": os.path.basename(source), "scenario": suite.scenario,
           "split_options": json.dumps(suite.split_options), "seed": seed,
           "rounds": len(json.load(open(os.path.join(ws, "metrics.json")))["rounds"]),
           "seconds": round(seconds, 1)}
    if suite.shifted_test:
        from fedpartial_tools import synthetic

        shifted = dataclasses.replace(test, images=getattr(synthetic, suite.shifted_test)(np.asarray(test.images)))
        for k, v in evaluate_split(model, shifted, data.task, data.class_names, meta["normalisation"],
                                   device).items():
            metrics[f"{k}_shift"] = v
    if any(k.endswith("_best") for k in suite.metrics) and os.path.isfile(os.path.join(ws, "best_global_model.pt")):
        from fedpartial.models.io import load_model_file

        best, _ = load_model_file(os.path.join(ws, "best_global_model.pt"), device=device)
        for k, v in evaluate_split(best, test, data.task, data.class_names, meta["normalisation"], device).items():
            metrics[f"{k}_best"] = v
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


def _fmt(values: List[float], digits: int = 3) -> str:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "–"
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}" if len(vals) > 1 else f"{vals[0]:.{digits}f}"


def markdown_table(rows: List[dict]) -> str:
    """Tables of every suite in ``rows`` (results.md)."""
    return "\n".join(suite_table(name, rows) for name in suites_of(rows)) + "\n"


def suite_table(name: str, rows: List[dict]) -> str:
    """Heading line and table of suite ``name``: mean ± std over seeds per job, gap closed."""
    suite = SUITES[name]
    sub = [r for r in rows if r["suite"] == name]
    seeds = sorted({r["seed"] for r in sub})
    lines = [f"\n**{name}** — {sub[0].get('dataset') or suite.dataset}, {suite.scenario} {suite.split_options}, {suite.sites} sites, "
             f"{sub[0]['rounds']} rounds, seeds {seeds} (mean ± std over seeds; gap = share of the "
             f"{suite.lower} → {suite.upper} gap closed)\n"]
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
    return "\n".join(lines)


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


def _seed_dirs(out_dir: str, name: str) -> Dict[int, str]:
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
    for seed, seed_dir in _seed_dirs(out_dir, name).items():
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
        model, meta, resized = _load_for_eval(os.path.join(seed_dir, job), data, torch_device, cache)
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
    rows = _read_rows(csv_path)
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
        suites = list(dict.fromkeys(r["suite"] for r in _read_rows(csv_path)))
        copy_outputs(out_dir, copy_plots, suites)
    section = readme_section(out_dir, readme, plots_dir=copy_plots)
    replace_between_markers(readme, section)
    return section


def _cmd_bench(args):
    rows = []
    csv_path = os.path.join(args.out, "results.csv")
    if args.append and os.path.isfile(csv_path):
        rows = _read_rows(csv_path)
    for name in args.suite:
        seeds = [int(s) for s in args.seeds.split(",")]
        new = run_suite(name, args.out, seeds=seeds, profile=args.profile, data_dir=args.data_dir,
                        rounds=args.rounds, jobs=args.jobs.split(",") if args.jobs else None, extra=args.set,
                        diagnostics=args.diagnostics, overlay_images=args.overlay_images)
        # a re-run (same suite, job, seed) replaces the old row
        redone = {(r["suite"], r["method"], int(r["seed"])) for r in new}
        rows = [r for r in rows if (r["suite"], r["method"], int(r["seed"])) not in redone] + new
        print(write_reports(rows, args.out))
        if args.diagnostics:
            md = write_pseudo_label_report(args.out, name, every=args.every)
            if md:
                print(md)
    _readme_and_copies(args)


def _cmd_bench_report(args):
    """Reports from an existing bench folder: nothing is trained or re-evaluated (overlays
    excepted: they run the saved models on a few test images)."""
    csv_path = os.path.join(args.out, "results.csv")
    names = args.suite or list(dict.fromkeys(
        [r["suite"] for r in (_read_rows(csv_path) if os.path.isfile(csv_path) else [])]
        + [n for n in SUITES if os.path.isdir(os.path.join(args.out, n))]))
    if not names:
        raise FileNotFoundError(f"no results.csv and no suite folder in '{args.out}'")
    if os.path.isfile(csv_path):
        # results.md and the plots again from the CSV, so a report change reaches old runs
        rows = _read_rows(csv_path)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown_table(rows))
        plot_results(rows, args.out)
    for name in names:
        md = write_pseudo_label_report(args.out, name, job=args.job, every=args.every)
        if md:
            print(md)
        if args.overlays and is_segmentation(name):
            for seed in _seed_dirs(args.out, name):
                print(write_overlays(name, args.out, seed, _split_source(args.out, name, seed, args.data_dir),
                                     n_images=args.overlay_images)[0])
    _readme_and_copies(args)


def _split_source(out_dir: str, name: str, seed: int, data_dir: str) -> str:
    """The data file a seed's split was made from (the suite's CPU file when it does not say)."""
    summary = os.path.join(out_dir, name, f"seed{seed}", "sites", "split_summary.json")
    made_from = json.load(open(summary)).get("source") if os.path.isfile(summary) else None
    if made_from and os.path.isfile(made_from):
        return made_from
    return suite_source(SUITES[name], "cpu", data_dir, out_dir)


def leave_patient_out(source: str, patient: int, out: str) -> str:
    """Write ``out``: the slices of ``patient`` (``train_patient_ids``) as the test split, every
    other patient's slices as the train split without patient ids, so that ``split`` shares them
    out among the sites slice by slice (whole patients would fill one site).

    Args:
        source: a segmentation ``.npz`` with ``train_patient_ids`` (e.g. ms_flair_2patients.npz).
        patient: the held-out patient id.
        out: the file to write.
    """
    from fedpartial.data.npz import load_npz, save_npz
    from fedpartial.data.types import DataError, Dataset, Split

    data = load_npz(source)
    train = data.splits["train"]
    if train.groups is None:
        raise DataError(f"'{source}': no train_patient_ids, so no patient can be held out")
    held = np.asarray(train.groups) == patient
    if not held.any() or held.all():
        raise DataError(f"'{source}': patient {patient} is not one of several patients "
                        f"{sorted(set(np.asarray(train.groups).tolist()))}")
    rest, test = train.subset(np.flatnonzero(~held)), train.subset(np.flatnonzero(held))
    rest = Split(rest.images, rest.labels, rest.label_mask, rest.ids, None)
    test = Split(test.images, test.labels, test.label_mask, test.ids, None)
    save_npz(Dataset(data.task, data.class_names, {"train": rest, "test": test}, out), out)
    return out


def suite_source(suite: "Suite", profile: str, data_dir: str, out_dir: str) -> str:
    """The source file a suite runs on: in ``data_dir``, or (a suite with a ``generator``) made
    once into ``<out_dir>/_data``; a suite with ``holdout_patient`` runs on a leave-one-patient-out
    copy in ``<out_dir>/_data``."""
    name = suite.dataset_for(profile)
    source = os.path.join(data_dir, name)
    if os.path.isfile(source) and suite.holdout_patient is not None:
        made = os.path.join(out_dir, "_data", f"{os.path.splitext(name)[0]}_holdout{suite.holdout_patient}.npz")
        if not os.path.isfile(made):
            os.makedirs(os.path.dirname(made), exist_ok=True)
            leave_patient_out(source, suite.holdout_patient, made)
        return made
    if os.path.isfile(source):
        return source
    if not suite.generator:
        raise FileNotFoundError(f"suite needs '{source}' (see ../shared/data/README.md)")
    from fedpartial.data.npz import save_npz
    from fedpartial_tools import synthetic

    made = os.path.join(out_dir, "_data", name)
    if not os.path.isfile(made):
        os.makedirs(os.path.dirname(made), exist_ok=True)
        save_npz(getattr(synthetic, suite.generator)(seed=0), made)
    return made


def _readme_and_copies(args) -> None:
    if args.readme:
        update_readme(args.out, args.readme, args.copy_plots)
        print(f"results written between the bench markers of {args.readme}")
    elif args.copy_plots:
        rows = _read_rows(os.path.join(args.out, "results.csv"))
        copied = copy_outputs(args.out, args.copy_plots, list(dict.fromkeys(r["suite"] for r in rows)))
        print(f"copied to {args.copy_plots}: {', '.join(copied)}")


def _read_rows(path: str) -> List[dict]:
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
    s.add_argument("--suite", action="append", required=True, choices=sorted(SUITES),
                   help="comparison to run (repeatable)")
    s.add_argument("--seeds", default="0,1,2")
    s.add_argument("--profile", choices=["cpu", "gpu"], default="cpu")
    s.add_argument("--rounds", type=int, default=None)
    s.add_argument("--jobs", default="", help="comma list: a subset of the suite's jobs")
    s.add_argument("--out", required=True)
    s.add_argument("--append", action="store_true", help="keep rows already in OUT/results.csv (a re-run job and seed replaces its row)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every job")
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
    s.add_argument("--job", default=None, help="job whose pseudo labels to report (default the suite's method)")
    s.add_argument("--overlays", action="store_true",
                   help="segmentation suites: draw the overlays of every seed folder again (runs the saved models)")
    _add_report_arguments(s)
    s.set_defaults(func=_cmd_bench_report)
