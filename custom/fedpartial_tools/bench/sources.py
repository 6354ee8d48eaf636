"""Where a bench suite's data comes from: the source file in the data folder, made by a
generator, held out by patient, or several sources brought to one input agreement and combined
(each made once into ``<out>/_data``); and the second rater's masks given to some sites."""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from fedpartial_tools.bench.suites import REPO, SUITES, Suite
from fedpartial_tools.data.partition import SUMMARY_JSON


def split_source(out_dir: str, name: str, seed: int, data_dir: str) -> str:
    """The data file a seed's split was made from (the suite's CPU file when it does not say)."""
    summary = os.path.join(out_dir, name, f"seed{seed}", "sites", SUMMARY_JSON)
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
    (:func:`fedpartial_tools.data.combine.combine_npz`), then, with ``holdout_patient``, the
    held-out copy ``<stem>_holdout<P>_val<percent>.npz``
    (:func:`fedpartial_tools.data.combine.hold_out_patient`).

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
    from fedpartial_tools.data.combine import combine_npz, hold_out_patient

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
        source: the file the split was made from (:func:`fedpartial_tools.data.combine.hold_out_patient`).
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
    from fedpartial_tools.data.combine import HAS_RATER2_KEY, RATER2_KEY

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
    summary_path = os.path.join(split_dir, SUMMARY_JSON)
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    for site in sites:
        path = os.path.join(split_dir, f"{site}.npz")
        if not os.path.isfile(path):
            raise DataError(f"site '{site}': no site file '{path}' in the split")
        data = load_npz(path)
        kept = float(summary.get("per_site", {}).get(site, {}).get("completeness", 1.0))
        if kept < 1.0:
            raise DataError(f"site '{site}' ('{path}') keeps {kept:.0%} of its lesions ('{summary_path}'); the "
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
    summary["second_rater"] = done
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    return done
