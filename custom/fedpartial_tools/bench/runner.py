"""Running a bench suite: make each seed's split, run every job in the FLARE simulator with the
same seed and rounds, and evaluate the final global model on the source's test split, or (to choose
a setting) on its val split only.
"""


from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import List, Optional, Sequence

import numpy as np

from fedpartial_tools.bench.native import native_scorer, own_size_metrics
from fedpartial_tools.bench.overlays import load_for_eval, write_overlays
from fedpartial_tools.bench.selection import selection_key
from fedpartial_tools.bench.suites import DEFAULT_DATA, REPO, SUITES, Suite, is_segmentation, matched_sets
from fedpartial_tools.bench.tables import LAST_ROUNDS_KEY, last_rounds_range


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
              diagnostics: bool = False, overlay_images: int = 4, score_on: str = "test", reuse: bool = False,
              log=print) -> List[dict]:
    """Run one suite for ``seeds``; returns the result rows (the caller writes them).

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
        score_on: ``test``, or to choose among settings without reading the test split: ``val``
            (what a federation can compute: each site's own val split with its own labels, as the
            server received it in cross-site evaluation, :mod:`~fedpartial_tools.bench.selection`) or ``val-complete``
            (the source's val split with complete labels, which no site holds: a curated set).
        reuse: keep a job's trained workspace when it was trained with the same settings (e.g. by
            a ``score_on="val"`` run): its saved final model is scored, nothing is trained again.
    """
    from fedpartial_tools.data.partition import split_file
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate

    suite = SUITES[name]
    source = suite_source(suite, profile, data_dir, out_dir)
    if any(item.split("=", 1)[0].split(".")[-1] == "reference_file" for item in extra):
        raise ValueError("--set reference_file=... would reach the baselines too; use --diagnostics, which sets it "
                         "for the method job only")
    jobs = list(jobs or suite.jobs)
    unknown = [j for j in jobs if j not in suite.jobs]
    if unknown:
        raise ValueError(f"suite '{name}' has no job {unknown}; its jobs: {suite.jobs}")
    if score_on not in SCORED_SPLITS:
        raise ValueError(f"score_on must be one of {SCORED_SPLITS}, got '{score_on}'")
    # What reproduces these rows (the README shows it as a bench command line).
    bench_args = json.dumps({"profile": profile, "rounds": rounds, "sets": list(extra), "diagnostics": diagnostics})
    if score_on != "test":
        overlay_images = 0  # overlays draw test images
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
        if suite.rater2_sites and not (os.path.isfile(summary_path)
                                       and "second_rater" in json.load(open(summary_path))):
            use_second_rater(split_dir, source, suite.rater2_sites)
        sets = (dataset_overrides(split_dir) + list(suite.overrides.get(profile, [])) + suite.agreement_sets()
                + [f"seed={seed}"])
        if rounds:
            sets.append(f"num_rounds={rounds}")
        sets += list(extra)
        for job in jobs:
            ws = os.path.join(out_dir, name, f"seed{seed}", job)
            started = time.time()
            folder = suite.job_folder(job)
            is_method = folder == suite.job_folder(suite.method)
            job_sets = (sets + matched_sets(suite, job, sets)
                        + (list(suite.method_overrides.get(profile, [])) if is_method else [])
                        + suite.variants.get(job, [])
                        + ([REFERENCE_SET] if diagnostics and is_method else []))
            seconds = trained_before(ws, folder, job_sets) if reuse else None
            if seconds is None:
                simulate(find_job(folder), split_dir, ws, job_sets, log=log)
                seconds = time.time() - started
                os.makedirs(ws, exist_ok=True)
                with open(os.path.join(ws, TRAINED_FILE), "w") as f:
                    json.dump({"job": folder, "sets": list(job_sets), "seconds": round(seconds, 1)}, f, indent=1)
            else:
                log(f"{name} seed {seed} {job}: trained before with the same settings, scoring its saved model")
            row = _evaluate_row(name, suite, job, seed, ws, source, seconds, score_on)
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


SCORED_SPLITS = ("test", "val", "val-complete")
#: what a bench run trained in a job's workspace (``--reuse`` scores it again only with the same settings)
TRAINED_FILE = "bench_trained.json"


def trained_before(ws: str, job: str, sets: Sequence[str]) -> Optional[float]:
    """Seconds the training of ``ws`` took, when ``ws`` holds a final model that a bench trained
    with exactly ``job`` and ``sets``; else None.

    Args:
        ws: a job's workspace of the bench.
        job: the job that runs the row (:meth:`Suite.job_folder`).
        sets: its ``--set`` items.
    """
    record = os.path.join(ws, TRAINED_FILE)
    if not (os.path.isfile(record) and os.path.isfile(os.path.join(ws, "global_model.pt"))):
        return None
    done = json.load(open(record))
    if done.get("job") != job or list(done.get("sets", [])) != list(sets):
        return None
    return float(done.get("seconds", 0.0))


def _evaluate_row(name, suite, job, seed, ws, source, seconds, score_on: str = "test") -> dict:
    from fedpartial.data.npz import load_npz
    from fedpartial.evaluation import evaluate_split, predict_split
    from fedpartial.training.common import select_device

    if score_on == "val":  # what the sites' validation sent the server: no split is read
        from fedpartial_tools.bench.selection import sites_val_metrics

        row = _row_head(name, suite, job, seed, ws, source, seconds, score_on)
        return _with_curve({**row, **sites_val_metrics(suite, ws, row["selection_metric"], f"{name} {job}")}, suite, ws)
    device = select_device("auto")
    source_data = load_npz(source)
    split_name = "val" if score_on == "val-complete" else score_on
    if split_name not in source_data.splits:
        raise ValueError(f"'{source}' has no {split_name} split to score suite '{name}' on")
    # only the scored split is resized and read
    own = source_data.splits[split_name]  # at the file's own size, before the resizing to the model's
    source_data = dataclasses.replace(source_data, splits={split_name: own})
    model, meta, data = load_for_eval(ws, source_data, device)
    scored = data.splits[split_name]
    metrics = evaluate_split(model, scored, data.task, data.class_names, meta["normalisation"], device)
    # a held-out patient of combined sources is scored on its own grid too (the test split only:
    # the val slices are parts of patients)
    native = native_scorer(source_data.info, scored, source) if score_on == "test" else None
    if data.task == "segmentation":
        from fedpartial.metrics import segmentation_metrics

        probs = predict_split(model, scored, data.task, meta["normalisation"], device)
        # "dice" / "iou" of the DSB2018 tables: per-image means with an empty-both image scoring 1
        metrics.update(segmentation_metrics(probs > 0.5, np.asarray(scored.labels) > 0))
        if native is not None:
            metrics["dice_pooled_native"] = native(probs)
        else:  # each image at the file's own size (DSB2018's: 256 px), not the model's
            metrics.update(own_size_metrics(probs, own))
    row = _row_head(name, suite, job, seed, ws, source, seconds, score_on)
    if suite.shifted_test:
        from fedpartial_tools.data import synthetic

        shifted = dataclasses.replace(scored, images=getattr(synthetic, suite.shifted_test)(np.asarray(scored.images)))
        for k, v in evaluate_split(model, shifted, data.task, data.class_names, meta["normalisation"],
                                   device).items():
            metrics[f"{k}_shift"] = v
    if any(k.endswith("_best") for k in suite.metrics) and os.path.isfile(os.path.join(ws, "best_global_model.pt")):
        from fedpartial.models.io import load_model_file

        best, _ = load_model_file(os.path.join(ws, "best_global_model.pt"), device=device)
        for k, v in evaluate_split(best, scored, data.task, data.class_names, meta["normalisation"], device).items():
            metrics[f"{k}_best"] = v
        if native is not None and data.task == "segmentation":
            metrics["dice_pooled_native_best"] = native(predict_split(best, scored, data.task, meta["normalisation"],
                                                                      device))
    for k in suite.metrics:
        row[k] = float(metrics.get(k, float("nan")))
    per_class = metrics.get("per_class") or {}
    row["per_class_auc"] = json.dumps({c: v.get("auc") for c, v in per_class.items()})
    return _with_curve(row, suite, ws)


def _row_head(name, suite, job, seed, ws, source, seconds, score_on: str) -> dict:
    row = {"suite": name, "method": job, "dataset": os.path.basename(source), "scenario": suite.scenario,
           "split_options": json.dumps(suite.split_options), "seed": seed,
           "rounds": len(json.load(open(os.path.join(ws, "metrics.json")))["rounds"]),
           "seconds": round(seconds, 1), "scored_on": score_on}
    if score_on != "test":
        row["selection_metric"] = selection_key(name, score_on)
    return row


def _with_curve(row: dict, suite, ws: str) -> dict:
    curve = _curve(os.path.join(ws, "metrics.json"), suite.metrics[0])
    row["curve"] = json.dumps(curve)
    row[LAST_ROUNDS_KEY] = last_rounds_range(curve)
    return row


def split_source(out_dir: str, name: str, seed: int, data_dir: str) -> str:
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
    copy in ``<out_dir>/_data``; a suite with ``combine`` on its sources combined there
    (:func:`combined_source`)."""
    name = suite.dataset_for(profile)
    if suite.combine:
        return combined_source(suite, name, data_dir, out_dir)
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
    from fedpartial_tools.data import synthetic

    made = os.path.join(out_dir, "_data", name)
    if not os.path.isfile(made):
        os.makedirs(os.path.dirname(made), exist_ok=True)
        save_npz(getattr(synthetic, suite.generator)(seed=0), made)
    return made


def combined_source(suite: "Suite", name: str, data_dir: str, out_dir: str) -> str:
    """The file a suite with ``combine`` runs on, each made once into ``<out_dir>/_data``: its
    sources (in ``data_dir``) brought to the suite's agreement and combined as ``name``
    (:func:`fedpartial_tools.data.harmonise.combine_npz`), then, with ``holdout_patient``, the
    held-out copy ``<stem>_holdout<P>_val<percent>.npz``
    (:func:`fedpartial_tools.data.harmonise.hold_out_patient`).

    Args:
        suite: the suite.
        name: the combined file's name.
        data_dir: folder of the sources.
        out_dir: the bench's output folder.

    Raises:
        FileNotFoundError: naming a missing source.
        ValueError: when a file made earlier records another agreement than the suite's.
    """
    from fedpartial.data.grid import AGREEMENT_KEY, InputAgreement, agreement_differences, load_agreement
    from fedpartial.data.arrays import read_info_json
    from fedpartial_tools.data.harmonise import combine_npz, hold_out_patient

    agreement = load_agreement(os.path.join(REPO, suite.agreement))
    combined = os.path.join(out_dir, "_data", name)
    if not os.path.isfile(combined):
        for source in suite.combine:
            if not os.path.isfile(source.path(data_dir)):
                raise FileNotFoundError(f"suite needs '{source.path(data_dir)}' (see ../shared/data/README.md)")
        os.makedirs(os.path.dirname(combined), exist_ok=True)
        combine_npz(suite.combine, agreement, combined, data_dir)
    made = combined
    if suite.holdout_patient is not None:
        stem = os.path.splitext(name)[0]
        made = os.path.join(out_dir, "_data", f"{stem}_holdout{suite.holdout_patient}_val"
                                              f"{round(100 * suite.val_fraction)}.npz")
        if not os.path.isfile(made):
            hold_out_patient(combined, suite.holdout_patient, made, val_fraction=suite.val_fraction)
    with np.load(made, allow_pickle=False) as z:  # only the small info array is read
        recorded = read_info_json(z, f"'{made}'").get(AGREEMENT_KEY)
    differences = [] if recorded is None else agreement_differences(
        InputAgreement.from_dict(recorded, f"'{made}' info_json '{AGREEMENT_KEY}'"), agreement)
    if recorded is None or differences:
        raise ValueError(f"'{made}' was made with another input agreement than the suite's '{suite.agreement}' "
                         f"({differences or 'it records none'}): give another --out")
    return made


def use_second_rater(split_dir: str, source: str, sites: Sequence[str]) -> dict:
    """Rewrite the site files of ``sites`` so that each of their train and val slices with a second
    rater's mask in ``source`` (``*_masks_rater2`` where ``*_has_rater2``) carries that mask;
    their reference copies (``reference/<site>_full.npz``) keep the first rater's. Rows are matched
    by id. Records ``second_rater`` in ``split_summary.json``; running it again changes nothing.

    Args:
        split_dir: a split of ``source`` (site files ``<site>.npz``).
        source: the file the split was made from (:func:`fedpartial_tools.data.harmonise.hold_out_patient`).
        sites: site names, e.g. ``("site-1", "site-2")``.

    Returns:
        ``{site: {"train": slices given rater 2's mask, "val": ...}}``.

    Raises:
        DataError: naming the file, site and key of a missing site file, source array or row ids,
            or a site that drops lesions (its masks would be replaced whole).
    """
    from fedpartial.data.arrays import open_npz
    from fedpartial.data.npz import load_npz
    from fedpartial.data.sitefile import write_site_file
    from fedpartial.data.types import DataError, Dataset, Split
    from fedpartial_tools.data.harmonise import HAS_RATER2_KEY, RATER2_KEY

    arrays = open_npz(source)
    second = {}
    for split in ("train", "val"):
        keys = (f"{split}_image_ids", f"{split}_{RATER2_KEY}", f"{split}_{HAS_RATER2_KEY}")
        if f"{split}_images" not in arrays:
            continue
        for key in keys:
            if key not in arrays:
                raise DataError(f"'{source}' lacks '{key}': no second rater's masks to give the sites")
        ids, masks, has = (arrays[k] for k in keys)
        second.update({int(i): m for i, m, h in zip(ids.tolist(), masks, has) if h})
    done = {}
    for site in sites:
        path = os.path.join(split_dir, f"{site}.npz")
        if not os.path.isfile(path):
            raise DataError(f"site '{site}': no site file '{path}' in the split")
        data = load_npz(path)
        if float(data.info.get("completeness", 1.0)) < 1.0:
            raise DataError(f"site '{site}' ('{path}') keeps {data.info['completeness']:.0%} of its lesions; the "
                            f"second rater's masks would replace its masks whole (give it completeness 1)")
        splits, counts = {}, {}
        for split_name, split in data.splits.items():
            if split.ids is None:
                raise DataError(f"site '{site}': '{path}' has no '{split_name}_ids' to match rows of '{source}'")
            labels = np.array(split.labels, copy=True)
            rows = [i for i, row_id in enumerate(np.asarray(split.ids).tolist()) if int(row_id) in second]
            for i in rows:
                labels[i] = (second[int(split.ids[i])] > 0).astype(labels.dtype)
            splits[split_name] = Split(split.images, labels, split.label_mask, split.ids, split.groups)
            counts[split_name] = len(rows)
        info = dict(data.info, masks="second rater's where the source has one", second_rater_slices=counts)
        write_site_file(path, Dataset(data.task, data.class_names, splits, data.source, data.site, info))
        done[site] = counts
    summary_path = os.path.join(split_dir, "split_summary.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    summary["second_rater"] = done
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    return done
