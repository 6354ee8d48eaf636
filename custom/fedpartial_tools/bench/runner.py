"""Running a bench suite: make each seed's split, run every job in the FLARE simulator with the
same seed and rounds, and evaluate the final global model on the source's test split, or (to choose
a setting) on its val split only.
"""


from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import List, Optional, Sequence

import numpy as np

from fedpartial_tools.bench.kept import TRAINED_FILE, keep_training, kept_training_dir, restore_training
from fedpartial_tools.bench.native import native_scorer, own_size_metrics
from fedpartial_tools.bench.overlays import load_for_eval, write_overlays
from fedpartial_tools.bench.selection import selection_key
from fedpartial_tools.bench.sources import suite_source, use_second_rater
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
        sites = sorted(r["sites"].items())  # site order: a float sum depends on its order
        pooled = pooled_validation({k: s.get("val") for k, s in sites}) if key.startswith("dice") else None
        if pooled is not None:
            out.append(float(pooled["dice_pooled"]))
            continue
        vals = [s.get("val", {}).get(key) for _, s in sites]
        vals = [v for v in vals if v is not None]
        out.append(float(np.mean(vals)) if vals else float("nan"))
    return out


# Only the method job reads the reference copies, and only to log diagnostics (training never
# uses them): the baselines must stay exactly the runs they are without --diagnostics.
REFERENCE_SET = "reference_file=reference/{site}_full.npz"


@dataclasses.dataclass
class Training:
    """One training of a bench run: a job of a suite for one seed on that seed's split."""

    suite: str
    seed: int
    job: str
    folder: str  # the job folder that runs it (Suite.job_folder)
    ws: str
    split_dir: str
    source: str
    sets: List[str]
    bench_args: str = ""  # JSON of what reproduces the row (the README shows it as a bench command line)


def run_suite(name: str, out_dir: str, seeds=(0, 1, 2), profile: str = "cpu", data_dir: str = DEFAULT_DATA,
              rounds: Optional[int] = None, jobs: Optional[List[str]] = None, extra: List[str] = (),
              diagnostics: bool = False, overlay_images: int = 4, score_on: str = "test", reuse: bool = False,
              parallel: int = 1, rows_dir: str = "", log=print) -> List[dict]:
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
        parallel: trainings at once (:func:`run_trainings`).
        rows_dir: committed rows (:mod:`fedpartial_tools.bench.rows`), one ``<suite>.csv`` each: a
            row already there for the same settings is taken, not trained again; each new row is
            appended as soon as it is scored. ``""``: none.
    """
    trainings, bench_args = plan_suite(name, out_dir, seeds, profile, data_dir, rounds, jobs, extra, diagnostics,
                                       score_on)
    rows = run_trainings(trainings, score_on=score_on, reuse=reuse, parallel=parallel, rows_dir=rows_dir,
                         profile=profile, log=log)
    if score_on == "test" and overlay_images and is_segmentation(name):
        for seed in seeds:
            try:
                log(f"overlays: {write_overlays(name, out_dir, seed, trainings[0].source, n_images=overlay_images)[0]}")
            except Exception as e:  # a convenience, like the plots: the numbers are in the CSV
                log(f"warning: overlays of {name} seed {seed} failed: {e}")
    return rows


def plan_suite(name: str, out_dir: str, seeds=(0, 1, 2), profile: str = "cpu", data_dir: str = DEFAULT_DATA,
               rounds: Optional[int] = None, jobs: Optional[List[str]] = None, extra: Sequence[str] = (),
               diagnostics: bool = False, score_on: str = "test") -> tuple:
    """Each seed's split made (once), and the trainings of ``name`` (arguments as :func:`run_suite`).

    Returns:
        ``(trainings, bench_args)``: the :class:`Training` list in seed, job order, and the JSON of
        what reproduces the rows (the README shows it as a bench command line).
    """
    from fedpartial_tools.data.partition import split_file
    from fedpartial_tools.data.sites import dataset_overrides

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
    bench_args = json.dumps({"profile": profile, "rounds": rounds, "sets": list(extra), "diagnostics": diagnostics})
    trainings = []
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
            folder = suite.job_folder(job)
            is_method = folder == suite.job_folder(suite.method)
            job_sets = (sets + matched_sets(suite, job, sets)
                        + (list(suite.method_overrides.get(profile, [])) if is_method else [])
                        + suite.variants.get(job, [])
                        + ([REFERENCE_SET] if diagnostics and is_method else []))
            trainings.append(Training(name, seed, job, folder, os.path.join(out_dir, name, f"seed{seed}", job),
                                      split_dir, source, job_sets, bench_args))
    return trainings, bench_args


def default_parallel() -> int:
    """Trainings at once on this machine: with a GPU, three for every four cores (a training's
    site processes mostly wait on FLARE and share the card); on CPUs alone, one for every four
    cores (each training keeps about four site processes busy)."""
    import torch

    cores = os.cpu_count() or 1
    return max(1, cores * 3 // 4) if torch.cuda.is_available() else max(1, cores // 4)


def run_trainings(trainings: Sequence[Training], score_on: str = "test", reuse: bool = False, parallel: int = 1,
                  rows_dir: str = "", profile: str = "cpu", deadline: Optional[float] = None,
                  raise_errors: bool = True, log=print) -> List[Optional[dict]]:
    """Train and score ``trainings``, ``parallel`` at once (each its own simulator process and
    workspace; the cores divided among them), rows in the order of ``trainings``.

    Args:
        trainings: from :func:`plan_suite` (of one suite or several).
        score_on / reuse: as :func:`run_suite`.
        parallel: trainings at once (0 = :func:`default_parallel`).
        rows_dir: committed rows (as :func:`run_suite`).
        profile: the bench profile (part of a committed row's settings).
        deadline: wall-clock time (``time.time()``) after which no training starts; its row is None
            (committed rows still count: they cost nothing).
        raise_errors: after every training ran, raise one error naming each that failed (else
            their rows are None).
        log: progress printer.
    """
    from concurrent.futures import ThreadPoolExecutor

    parallel = parallel or default_parallel()
    sites = max(len(_site_files(t.split_dir)) for t in trainings) if trainings else 1
    threads = max(1, (os.cpu_count() or 1) // (parallel * sites)) if parallel > 1 else None

    failed = []
    printing = threading.Lock()
    plain_log = log

    def log(*parts):  # one whole line at a time from trainings side by side
        with printing:
            plain_log(*parts)

    def one(t: Training) -> Optional[dict]:
        late = deadline is not None and time.time() >= deadline
        try:
            return run_training(t, score_on, reuse, rows_dir, profile, threads, log, committed_only=late)
        except Exception as e:  # the others go on: a long run keeps every row it can finish
            failed.append(f"{t.suite} seed {t.seed} {t.job}: {type(e).__name__}: {e}")
            log(f"FAILED {failed[-1]}")
            return None

    import torch

    # the rows' scores come from this process: one torch thread, so that a score does not depend on
    # how many trainings are scored side by side (float sums split over threads round differently)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if parallel <= 1:
            rows = [one(t) for t in trainings]
        else:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                rows = list(pool.map(one, trainings))
    finally:
        torch.set_num_threads(threads_before)
    if failed and raise_errors:
        raise RuntimeError(f"{len(failed)} of {len(trainings)} trainings failed:\n" + "\n".join(failed))
    return rows


def _site_files(split_dir: str) -> List[str]:
    return [f for f in os.listdir(split_dir) if f.startswith("site-")] if os.path.isdir(split_dir) else []


def run_training(t: Training, score_on: str = "test", reuse: bool = False, rows_dir: str = "",
                 profile: str = "cpu", torch_threads: Optional[int] = None, log=print,
                 committed_only: bool = False) -> Optional[dict]:
    """One training and its row: a committed row with the same settings is taken as it is; else a
    saved model of the same settings is scored again (``reuse``); else the job is trained in the
    simulator. A new row is appended to the committed rows at once. ``committed_only``: None
    instead of training or scoring (a deadline passed)."""
    from fedpartial_tools.bench import rows as committed
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate

    key_hash = committed.settings_hash(t.folder, t.sets, profile)
    # a folder holds one CSV per suite; a .csv path takes every suite's rows (a device run's one file)
    rows_file = (rows_dir if rows_dir.endswith(".csv") else os.path.join(rows_dir, f"{t.suite}.csv")) if rows_dir else ""
    if rows_file:
        done = committed.find_row(rows_file, (t.suite, t.job, str(t.seed), score_on, key_hash))
        if done is not None:
            log(f"{t.suite} seed {t.seed} {t.job}: committed row for these settings in {rows_file}, not trained again")
            return committed.as_bench_row(done)
    if committed_only:
        return None
    suite = SUITES[t.suite]
    started = time.time()
    kept = kept_training_dir(rows_dir, t.suite, t.job, t.seed, key_hash) if rows_dir else ""
    seconds = trained_before(t.ws, t.folder, t.sets) if reuse else None
    if reuse and seconds is None and kept and restore_training(kept, t.ws):
        log(f"{t.suite} seed {t.seed} {t.job}: its model kept in {kept} (trained in an earlier run)")
        seconds = trained_before(t.ws, t.folder, t.sets)
    trained_now = seconds is None
    if seconds is None:
        threads = {"torch_threads": torch_threads} if torch_threads else {}
        simulate(find_job(t.folder), t.split_dir, t.ws, t.sets, log=log, **threads)
        seconds = time.time() - started
        os.makedirs(t.ws, exist_ok=True)
        with open(os.path.join(t.ws, TRAINED_FILE), "w") as f:
            json.dump({"job": t.folder, "sets": list(t.sets), "seconds": round(seconds, 1)}, f, indent=1)
    else:
        log(f"{t.suite} seed {t.seed} {t.job}: trained before with the same settings, scoring its saved model")
    row = _evaluate_row(t.suite, suite, t.job, t.seed, t.ws, t.source, seconds, score_on)
    row["bench_args"] = t.bench_args
    curve = json.loads(row.get("curve") or "[]")
    # what the federation itself sees: the sites' own val splits, pooled, over the last 5 rounds
    last = [v for v in curve[-5:] if v is not None and np.isfinite(v)]
    row[SITE_VAL_KEY] = float(np.mean(last)) if last else float("nan")
    if kept and trained_now and score_on != "test":
        # the test split is read later (bench --reuse), maybe in another session: keep what scores it
        log(keep_training(t.ws, kept, with_best=any(k.endswith("_best") for k in suite.metrics)))
    if rows_file:
        committed.append_row(rows_file, {**row, "settings_hash": key_hash,
                                         "commit": committed.current_commit(REPO),
                                         "scored_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "device": committed.device_name(),
                                         "settings": json.dumps({"job": t.folder, "sets": list(t.sets),
                                                                 "profile": profile})})
    log(f"{t.suite} seed {t.seed} {t.job}: " + ", ".join(f"{k}={row.get(k, float('nan')):.4f}"
                                                        for k in suite.metrics))
    return row


#: a row's mean over the last 5 rounds of the sites' own validation (pooled Dice, or mean AUC)
SITE_VAL_KEY = "site_val_last5"


SCORED_SPLITS = ("test", "val", "val-complete")


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

