"""Partitioning one dataset into K site datasets with explicit per-site label masks.

Scenarios:

* ``label-set-mismatch`` (FedLSM): site k annotates ``classes_per_site`` of the C classes (or the
  explicit ``class_sets``); the union covers all C.
* ``missing-classes`` (FedMLP): each site loses the annotation of ``missing_per_site`` classes.
* ``semi-supervised`` (FedIRM): sites 1..L keep their labels, the others have none.
* ``incomplete-masks`` (FedIA): site k keeps a fraction a_k of the lesions (connected components,
  or instance ids) of each training mask; whole lesions are removed, never parts of one.

Samples go to sites by patient id where the file has one (no patient on two sites), else one by
one; everything is seeded. Each site file holds only what the site would have; complete labels go
to ``OUT/reference/`` for the upper-bound jobs and diagnostics. The val split is shared out among
the sites with complete labels; the test split stays in the source file.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.grid import AGREEMENT_KEY
from fedpartial.data.types import SEGMENTATION, DataError, Dataset, Split

SCENARIOS = ("label-set-mismatch", "missing-classes", "semi-supervised", "incomplete-masks")
SUMMARY_JSON = "split_summary.json"


# ---- assignment of samples to sites ---------------------------------------------------------
def assign_to_sites(n: int, sites: int, rng: np.random.Generator, groups: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """Indices of each site. With ``groups`` (patient ids) whole groups go to one site, the largest
    first to the emptiest site, so sizes stay close.

    Args:
        n: number of samples.
        sites: K.
        rng: seeded generator.
        groups: optional per-sample group ids.
    """
    if groups is None:
        order = rng.permutation(n)
        return [np.sort(part) for part in np.array_split(order, sites)]
    unique, inverse = np.unique(groups, return_inverse=True)
    members = [[] for _ in unique]
    for i, g in enumerate(inverse):
        members[g].append(i)
    order = rng.permutation(len(unique))
    order = sorted(order, key=lambda g: -len(members[g]))  # stable: ties keep the random order
    parts, sizes = [[] for _ in range(sites)], np.zeros(sites, int)
    for g in order:
        k = int(np.argmin(sizes))
        parts[k] += members[g]
        sizes[k] += len(members[g])
    return [np.sort(np.array(p, dtype=int)) for p in parts]


def _class_index(dataset: Dataset, item) -> int:
    if isinstance(item, (int, np.integer)):
        if not 0 <= item < dataset.num_classes:
            raise DataError(f"class index {item} is outside 0..{dataset.num_classes - 1}")
        return int(item)
    if item not in dataset.class_names:
        raise DataError(f"class '{item}' is not one of {dataset.class_names}")
    return dataset.class_names.index(item)


def annotated_class_sets(dataset: Dataset, scenario: str, sites: int, rng: np.random.Generator,
                         classes_per_site: Optional[int] = None, missing_per_site: Optional[int] = None,
                         class_sets: Optional[Sequence[Sequence]] = None) -> List[List[int]]:
    """Which classes each site annotates; refuses a split leaving a class annotated nowhere."""
    C = dataset.num_classes
    if class_sets is not None:
        if len(class_sets) != sites:
            raise DataError(f"class_sets has {len(class_sets)} entries for {sites} sites")
        sets = [sorted({_class_index(dataset, c) for c in s}) for s in class_sets]
        for k, s in enumerate(sets):
            if not s:
                raise DataError(f"class_sets gives site 'site-{k + 1}' no annotated class")
    elif scenario == "label-set-mismatch":
        if not classes_per_site or not 0 < classes_per_site <= C:
            raise DataError(f"--classes-per-site must be in 1..{C}, got {classes_per_site}")
        perm = rng.permutation(C)
        sets = [sorted(int(perm[(k * classes_per_site + j) % C]) for j in range(classes_per_site))
                for k in range(sites)]
    else:
        if missing_per_site is None or not 0 <= missing_per_site < C:
            raise DataError(f"--missing-per-site must be in 0..{C - 1}, got {missing_per_site}")
        perm = rng.permutation(C)
        sets = [sorted(set(range(C)) - {int(perm[(k * missing_per_site + j) % C]) for j in range(missing_per_site)})
                for k in range(sites)]
    covered = set().union(*map(set, sets))
    for c in range(C):
        if c not in covered:
            raise DataError(f"class '{dataset.class_names[c]}' would be annotated at no site "
                            f"({sites} sites, annotated sets {[[dataset.class_names[i] for i in s] for s in sets]})")
    return sets


# ---- lesions --------------------------------------------------------------------------------
def lesion_components(mask: np.ndarray, instance_ids: bool) -> Tuple[np.ndarray, int]:
    """Label image of lesions: instance ids as they are, else 8-connected components of the
    foreground. Returns (labels, count)."""
    if instance_ids:
        ids = np.unique(mask)
        ids = ids[ids > 0]
        relabel = np.zeros(int(mask.max()) + 1, np.int32)
        relabel[ids] = np.arange(1, len(ids) + 1)
        return relabel[mask], len(ids)
    from scipy import ndimage

    labels, count = ndimage.label(mask > 0, structure=np.ones((3, 3), int))
    return labels, int(count)


def keep_lesions(mask: np.ndarray, fraction: float, rng: np.random.Generator, instance_ids: bool) -> Tuple[np.ndarray, int, int]:
    """Binary mask keeping round(fraction * n) whole lesions chosen at random.

    Returns (binary mask uint8, lesions kept, lesions in the image)."""
    labels, count = lesion_components(mask, instance_ids)
    keep = int(round(fraction * count))
    chosen = rng.choice(np.arange(1, count + 1), size=keep, replace=False) if keep else np.array([], int)
    return np.isin(labels, chosen).astype(np.uint8), keep, count


def _is_instance_layout(dataset: Dataset) -> bool:
    # one foreground class but more ids than that: one id per lesion
    train = dataset.splits["train"].labels
    return dataset.num_classes == 1 and int(train.max(initial=0)) > 1


def completeness_fractions(values: Sequence[float]) -> List[float]:
    """Per-site completeness as fractions. All values are fractions in [0, 1], unless one of them
    exceeds 1: then all are percentages (``30,50,100`` -> 0.3, 0.5, 1.0), so that ``1,50`` cannot
    silently mean 100 % and 50 %.

    Args:
        values: a_1..a_K as fractions or percentages.
    """
    values = [float(v) for v in values]
    if any(not np.isfinite(v) or v < 0 for v in values):
        raise DataError(f"completeness values must be fractions in [0,1] or percentages in [0,100], got {values}")
    if any(v > 1 for v in values):
        if any(v > 100 for v in values):
            raise DataError(f"completeness percentages must be in [0,100], got {values}")
        return [v / 100.0 for v in values]
    return values


# ---- the partition itself -------------------------------------------------------------------
def partition(dataset: Dataset, scenario: str, sites: int, seed: int = 0, classes_per_site: Optional[int] = None,
              missing_per_site: Optional[int] = None, labelled_sites: Optional[int] = None,
              completeness: Optional[Sequence[float]] = None, class_sets=None,
              val_fraction_if_missing: float = 0.15, curated_val: Sequence[str] = ()):
    """Split ``dataset`` into ``sites`` site datasets.

    Args:
        dataset: the whole source dataset.
        scenario: one of :data:`SCENARIOS`.
        sites: K.
        seed: seed of every random choice.
        classes_per_site: label-set-mismatch: classes each site annotates.
        missing_per_site: missing-classes: classes each site loses.
        labelled_sites: semi-supervised: the first L sites keep labels.
        completeness: incomplete-masks: per-site fraction of lesions kept (fractions, or all percentages
            when any value exceeds 1); per image Python's ``round(a_k * n)`` whole lesions are kept.
        class_sets: explicit per-site annotated classes (names or indices).
        val_fraction_if_missing: share of each site's train data held out as val when the source has no val split.
        curated_val: sites (``site-k``, or ``all``) whose val split keeps complete labels: a curated,
            fully annotated validation set the site really holds. Every other site's val split
            is annotated as its train split.

    Returns:
        (site datasets, reference datasets with complete labels, summary dict)
    """
    if scenario not in SCENARIOS:
        raise DataError(f"unknown scenario '{scenario}'; choose one of {SCENARIOS}")
    if sites < 1:
        raise DataError(f"--sites must be >= 1, got {sites}")
    segmentation = dataset.task == SEGMENTATION
    if (scenario == "incomplete-masks") != segmentation:
        raise DataError(f"scenario '{scenario}' does not fit {dataset.task} data in {dataset.where()}")
    curated = _curated_sites(curated_val, sites)
    rng = np.random.default_rng(seed)
    train = dataset.splits["train"]
    parts = assign_to_sites(len(train), sites, rng, train.groups)
    val = dataset.splits.get("val")
    val_parts = assign_to_sites(len(val), sites, rng, val.groups) if val is not None and len(val) else None
    for k, p in enumerate(parts):
        if len(p) == 0:
            raise DataError(f"site 'site-{k + 1}' would get no training images ({len(train)} images for {sites} sites)")
    summary = {"source": dataset.source, "scenario": scenario, "sites": sites, "seed": seed,
               "class_names": dataset.class_names, "task": dataset.task, "curated_val": sorted(curated),
               "per_site": {}}
    class_sets_out = None
    if scenario in ("label-set-mismatch", "missing-classes"):
        class_sets_out = annotated_class_sets(dataset, scenario, sites, rng, classes_per_site, missing_per_site,
                                              class_sets)
    if scenario == "semi-supervised":
        if labelled_sites is None or not 0 < labelled_sites <= sites:
            raise DataError(f"--labelled-sites must be in 1..{sites}, got {labelled_sites}")
    if scenario == "incomplete-masks":
        if completeness is None or len(completeness) != sites:
            raise DataError(f"--completeness needs {sites} values (one per site), got {completeness}")
        completeness = completeness_fractions(completeness)
        instance_ids = _is_instance_layout(dataset)
    site_sets, refs = [], []
    for k in range(sites):
        name = f"site-{k + 1}"
        tr = train.subset(parts[k])
        if val_parts is not None:
            va = val.subset(val_parts[k])
        else:  # no val split in the source (COVID-SemiSeg): hold out part of the site's train data
            n_val = max(1, int(round(len(tr) * val_fraction_if_missing))) if len(tr) > 1 else 0
            order = rng.permutation(len(tr))
            va, tr = tr.subset(np.sort(order[:n_val])), tr.subset(np.sort(order[n_val:]))
        val_labels = "curated" if name in curated else "site"
        info = {"scenario": scenario, "seed": seed, "source": os.path.basename(dataset.source), "val_labels": val_labels}
        if AGREEMENT_KEY in (dataset.info or {}):  # the input grid the source was brought to travels with its sites
            info[AGREEMENT_KEY] = dataset.info[AGREEMENT_KEY]
        entry = {"n_train": len(tr), "n_val": len(va), "val_labels": val_labels}
        if segmentation:
            binary = lambda s: Split(s.images, (s.labels > 0).astype(np.uint8), None, s.ids, s.groups)  # noqa: E731
            kept_masks, kept, total = [], 0, 0
            for m in tr.labels:
                b, kk, n = keep_lesions(m, completeness[k], rng, instance_ids)
                kept_masks.append(b)
                kept, total = kept + kk, total + n
            site_train = Split(tr.images, np.stack(kept_masks) if kept_masks else tr.labels[:0].astype(np.uint8),
                               None, tr.ids, tr.groups)
            ref_train = binary(tr)
            ref_val = binary(va)
            if val_labels == "site":
                # the val masks miss lesions as the train masks do; an rng of their own keeps the
                # train masks those of a split without this step
                val_rng = np.random.default_rng([seed, VAL_STREAM, k])
                kept_val = [keep_lesions(m, completeness[k], val_rng, instance_ids)[0] for m in va.labels]
                va = Split(va.images, np.stack(kept_val) if kept_val else ref_val.labels, None, va.ids, va.groups)
            else:
                va = ref_val
            # how complete a site's masks are is the benchmark's truth, kept in the split summary:
            # a site file holds what a hospital would, its masks, and FedIA has to estimate the rest
            entry.update(completeness=completeness[k], lesions_kept=kept, lesions_total=total)
            class_names = dataset.class_names if dataset.num_classes == 1 else ["lesion"]
        else:
            class_names = dataset.class_names
            labels = tr.labels.copy()
            mask = np.ones_like(labels, dtype=bool)
            if class_sets_out is not None:
                annotated = np.zeros(dataset.num_classes, bool)
                annotated[class_sets_out[k]] = True
                mask[:, ~annotated] = False
                labels[:, ~annotated] = 0
                info["annotated_classes"] = [dataset.class_names[c] for c in class_sets_out[k]]
            if scenario == "semi-supervised":
                labelled = k < labelled_sites
                if not labelled:
                    mask[:] = False
                    labels[:] = 0
                info["labelled"] = labelled
                entry["labelled"] = labelled
            site_train = Split(tr.images, labels, mask, tr.ids, tr.groups)
            ref_train = Split(tr.images, tr.labels, np.ones_like(tr.labels, bool), tr.ids, tr.groups)
            ref_val = va
            if val_labels == "site":  # the val split annotated as the train split: the same classes, or none
                annotated_val = np.broadcast_to(mask.any(axis=0) if len(mask) else np.zeros(mask.shape[1], bool),
                                                va.labels.shape).copy()
                va = Split(va.images, np.where(annotated_val, va.labels, 0).astype(va.labels.dtype), annotated_val,
                           va.ids, va.groups)
            entry["annotated_positives"] = {c: int(v) for c, v in zip(class_names, (labels * mask).sum(0))}
            entry["hidden_positives"] = {c: int(v) for c, v in zip(class_names, (tr.labels * ~mask).sum(0))}
            entry["annotated_classes"] = [c for c, a in zip(class_names, mask.any(0)) if a]
            val_mask = np.ones_like(va.labels, bool) if va.label_mask is None else va.label_mask
            entry["val_annotated_positives"] = {c: int(v) for c, v in zip(class_names, (va.labels * val_mask).sum(0))}
        summary["class_names"] = class_names
        summary["per_site"][name] = entry
        totals = summary.setdefault("totals", {"n_train": 0, "n_val": 0})
        totals["n_train"] += entry["n_train"]
        totals["n_val"] += entry["n_val"]
        for key in ("annotated_positives", "hidden_positives", "val_annotated_positives"):
            if key in entry:
                into = totals.setdefault(key, {c: 0 for c in class_names})
                for c, v in entry[key].items():
                    into[c] += v
        for key in ("lesions_kept", "lesions_total"):
            if key in entry:
                totals[key] = totals.get(key, 0) + entry[key]
        site_sets.append(Dataset(dataset.task, class_names, {"train": site_train, "val": va}, dataset.source, name,
                                 info))
        refs.append(Dataset(dataset.task, class_names, {"train": ref_train, "val": ref_val}, dataset.source, name,
                            dict(info, reference=True, val_labels="complete")))
    summary["warnings"] = unlearnable_class_warnings(summary) + unscored_class_warnings(summary)
    return site_sets, refs, summary


#: the val masks' lesions are drawn from a stream of their own (``[seed, VAL_STREAM, site index]``)
VAL_STREAM = 2


def _curated_sites(curated_val, sites: int) -> set:
    """Site names of ``curated_val`` (``site-k`` names or ``all``), checked against ``sites``."""
    names = {f"site-{k + 1}" for k in range(sites)}
    chosen = {str(c).strip() for c in (curated_val or ()) if str(c).strip()}
    if "all" in chosen:
        return names
    unknown = sorted(chosen - names)
    if unknown:
        raise DataError(f"--curated-val names {unknown}, which are not sites of this split ({sorted(names)})")
    return chosen


def unlearnable_class_warnings(summary: dict) -> List[str]:
    """A line per class that has training positives, but none at a site that annotates it: no
    partial-label method sees one of its positives as such (CT-ICH, 5 sites x 1 subtype, seed 0:
    Intraventricular and Subarachnoid).

    Args:
        summary: :func:`partition`'s summary (``totals`` with ``annotated_positives`` and
            ``hidden_positives``).
    """
    totals = summary.get("totals", {})
    annotated, hidden = totals.get("annotated_positives"), totals.get("hidden_positives")
    if not annotated or not hidden:
        return []
    return [f"class '{c}' has {hidden[c]} positive training images, none at a site that annotates it: only the "
            f"full-label baseline learns it from its positives (give --class-sets, or another --seed)"
            for c in summary["class_names"] if annotated[c] == 0 and hidden[c] > 0]


def unscored_class_warnings(summary: dict) -> List[str]:
    """A line per class with no annotated positive in any site's val split: the sites' validation
    (and the best-model selection over it) cannot score that class, so the macro metrics they
    report average over the other classes only.

    Args:
        summary: :func:`partition`'s summary (``totals`` with ``val_annotated_positives``).
    """
    val = summary.get("totals", {}).get("val_annotated_positives")
    if not val or not summary.get("totals", {}).get("n_val"):
        return []
    return [f"class '{c}' has no annotated positive in any site's val split: site validation and the best-model "
            f"selection score the other classes only (--curated-val names sites with complete val labels)"
            for c in summary["class_names"] if val[c] == 0]


def summary_markdown(summary: dict) -> str:
    """Per-site table of annotated positives per class (like FedLSM's supplementary Tables 5-6)."""
    curated = summary.get("curated_val") or []
    lines = [f"# Split of {os.path.basename(summary['source'])}: {summary['scenario']}, {summary['sites']} sites, "
             f"seed {summary['seed']}", "",
             "Val splits: " + (f"complete labels (curated) at {', '.join(curated)}; every other site's " if curated
                               else "every site's ") + "val split is annotated as its train split", ""]
    sites = summary["per_site"]
    if summary["task"] == SEGMENTATION:
        lines += ["| site | train | val | completeness | lesions kept / total |", "|---|---|---|---|---|"]
        for name, e in sites.items():
            lines.append(f"| {name} | {e['n_train']} | {e['n_val']} | {e['completeness']:.2f} | "
                         f"{e['lesions_kept']} / {e['lesions_total']} |")
        t = summary.get("totals")
        if t:
            lines.append(f"| total | {t['n_train']} | {t['n_val']} | | {t['lesions_kept']} / {t['lesions_total']} |")
        return "\n".join(lines) + "\n"
    classes = summary["class_names"]
    lines += ["Annotated positives per class (– = class not annotated at the site; hidden positives in brackets)", "",
              "| site | train | " + " | ".join(classes) + " |", "|---|---|" + "---|" * len(classes)]
    for name, e in sites.items():
        cells = [f"{e['annotated_positives'][c]}" if c in e["annotated_classes"] else f"– ({e['hidden_positives'][c]})"
                 for c in classes]
        lines.append(f"| {name} | {e['n_train']} | " + " | ".join(cells) + " |")
    t = summary.get("totals")
    if t:
        lines.append(f"| total | {t['n_train']} | " + " | ".join(
            f"{t['annotated_positives'][c]} ({t['hidden_positives'][c]})" for c in classes) + " |")
        lines += ["", "Total row: annotated positives (hidden positives) over all sites."]
    if summary.get("warnings"):
        lines += [""] + [f"WARNING: {w}" for w in summary["warnings"]]
    return "\n".join(lines) + "\n"


def write_partition(out_dir: str, site_sets: List[Dataset], refs: List[Dataset], summary: dict) -> str:
    """Write site files, reference copies and the summary into ``out_dir``; built in a temporary
    folder beside it and renamed at the end, so a failure leaves nothing half-written.
    An existing ``out_dir`` is replaced only if it holds an earlier split."""
    from fedpartial.data.sitefile import write_site_file

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, SUMMARY_JSON)):
        raise DataError(f"output folder '{out_dir}' exists and does not hold an earlier split; choose another")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".split-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        os.makedirs(os.path.join(tmp, "reference"))
        for site, ref in zip(site_sets, refs):
            write_site_file(os.path.join(tmp, f"{site.site}.npz"), site)
            write_site_file(os.path.join(tmp, "reference", f"{site.site}_full.npz"), ref)
        with open(os.path.join(tmp, SUMMARY_JSON), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(tmp, "split_summary.md"), "w") as f:
            f.write(summary_markdown(summary))
        old = None
        if os.path.exists(out_dir):  # move the earlier split aside first: never a moment with half of each
            old = tempfile.mkdtemp(prefix=".split-old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "split"))
        os.replace(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def split_file(source: str, scenario: str, sites: int, seed: int, out: str, **options) -> dict:
    """Load ``source``, partition it and write the result into ``out``; returns the summary."""
    from fedpartial.data.npz import load_npz

    dataset = load_npz(source)
    site_sets, refs, summary = partition(dataset, scenario, sites, seed, **options)
    write_partition(out, site_sets, refs, summary)
    return summary


def add_split_arguments(parser) -> None:
    """Add the ``split`` options to an argparse (sub)parser.

    Args:
        parser: the parser.
    """
    parser.add_argument("--data", required=True, help="source .npz (MedMNIST or segmentation layout)")
    parser.add_argument("--scenario", required=True, choices=SCENARIOS)
    parser.add_argument("--sites", type=int, required=True, help="number of sites K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder (site-k.npz, reference/, split_summary.*)")
    parser.add_argument("--classes-per-site", type=int, default=None, help="label-set-mismatch: S of C classes")
    parser.add_argument("--missing-per-site", type=int, default=None, help="missing-classes: N classes lost per site")
    parser.add_argument("--labelled-sites", type=int, default=None, help="semi-supervised: the first L sites")
    parser.add_argument("--completeness", default=None,
                        help="incomplete-masks: a1,a2,... fraction (or %%) of lesions each site keeps")
    parser.add_argument("--curated-val", default="",
                        help="sites whose val split keeps complete labels (a curated, fully annotated validation "
                             "set they really hold): 'site-1,site-3' or 'all'; default none: each val split is "
                             "annotated as its site's train split")
    parser.add_argument("--class-sets", default=None,
                        help="label-set-mismatch / missing-classes: explicit annotated classes per site, "
                             "sites separated by ';', classes (names or indices) by ',', e.g. 'a,b;c;a,d'")


def parse_class_sets(text: Optional[str]):
    """``'a,b;c;0,3'`` -> ``[['a', 'b'], ['c'], [0, 3]]`` (digits become class indices)."""
    if not text:
        return None
    return [[int(c) if c.strip().isdigit() else c.strip() for c in site.split(",") if c.strip()]
            for site in text.split(";")]


def split_command(args) -> None:
    """``python -m fedpartial split``: partition ``args.data`` and write ``args.out``; prints the
    per-site table.

    Args:
        args: argparse namespace from :func:`add_split_arguments`.
    """
    completeness = None
    if args.completeness:
        try:
            completeness = [float(x) for x in args.completeness.split(",")]
        except ValueError as e:
            raise DataError(f"--completeness '{args.completeness}' is not a comma list of numbers") from e
    class_sets = parse_class_sets(getattr(args, "class_sets", None))
    summary = split_file(args.data, args.scenario, args.sites, args.seed, args.out,
                         classes_per_site=args.classes_per_site, missing_per_site=args.missing_per_site,
                         labelled_sites=args.labelled_sites, completeness=completeness, class_sets=class_sets,
                         curated_val=[c for c in getattr(args, "curated_val", "").split(",") if c.strip()])
    print(summary_markdown(summary))
    print(f"wrote {args.sites} site files to {os.path.abspath(args.out)}")
