"""Every partition scenario on small hand-built datasets with per-site counts worked out by hand,
refusals, repeatability, patients kept on one site, whole-lesion removal, and atomic output."""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from fedpartial_tools.data import partition as part
from fedpartial_tools.data.partition import completeness_fractions, partition, write_partition
from fedpartial.data.sitefile import load_site_file
from fedpartial.data.types import DataError, Dataset, Split

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CLASSES = ["a", "b", "c", "d"]
# Three patients with four training images each. Multi-label positives per patient (hand table):
#   patient 0: a on all 4, b on 2         -> a 4, b 2
#   patient 1: a on 1, c on all 4         -> a 1, c 4
#   patient 2: b on 1, d on 3             -> b 1, d 3
# Totals: a 5, b 3, c 4, d 3.
POSITIVES = {0: {"a": 4, "b": 2, "c": 0, "d": 0}, 1: {"a": 1, "b": 0, "c": 4, "d": 0},
             2: {"a": 0, "b": 1, "c": 0, "d": 3}}
# Single-label classes per patient: 0 -> [a, a, b, b], 1 -> [c, c, c, d], 2 -> [d, d, a, b]
SINGLE = {0: [0, 0, 1, 1], 1: [2, 2, 2, 3], 2: [3, 3, 0, 1]}


def _multi_labels():
    y = np.zeros((12, 4), np.float32)
    y[0:4, 0] = 1
    y[0:2, 1] = 1
    y[4, 0] = 1
    y[4:8, 2] = 1
    y[8, 1] = 1
    y[9:12, 3] = 1
    return y


def _dataset(task="multi-label"):
    labels = _multi_labels() if task == "multi-label" else np.eye(4, dtype=np.float32)[sum(SINGLE.values(), [])]
    groups = np.repeat([0, 1, 2], 4)
    images = np.arange(12, dtype=np.uint8)[:, None, None].repeat(4, 1).repeat(4, 2)  # image i is filled with i
    train = Split(images, labels, np.ones_like(labels, bool), np.arange(12), groups)
    val_labels = np.tile(np.eye(4, dtype=np.float32)[:1], (6, 1))
    val = Split(np.zeros((6, 4, 4), np.uint8), val_labels, np.ones((6, 4), bool), np.arange(6),
                np.repeat([10, 11, 12], 2))
    test = Split(np.zeros((2, 4, 4), np.uint8), val_labels[:2], np.ones((2, 4), bool))
    return Dataset(task, list(CLASSES), {"train": train, "val": val, "test": test}, source="toy.npz")


def _patient(site):
    groups = np.unique(site.splits["train"].groups)
    assert len(groups) == 1  # 3 patients of 4 images on 3 sites: one whole patient per site
    return int(groups[0])


def test_label_set_mismatch_multi_label_counts():
    sets = [["a", "b"], ["c"], ["d", "a"]]
    sites, refs, summary = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=sets)
    for k, (site, classes) in enumerate(zip(sites, sets)):
        tr, p = site.splits["train"], _patient(site)
        entry = summary["per_site"][f"site-{k + 1}"]
        expected = {c: (POSITIVES[p][c] if c in classes else 0) for c in CLASSES}
        hidden = {c: (0 if c in classes else POSITIVES[p][c]) for c in CLASSES}
        assert entry["annotated_positives"] == expected and entry["hidden_positives"] == hidden
        assert tr.label_mask.sum(0).tolist() == [4 if c in classes else 0 for c in CLASSES]
        assert (tr.labels * ~tr.label_mask).sum() == 0  # missing entries are 0 in labels and mask
        assert refs[k].splits["train"].labels.sum(0).tolist() == [POSITIVES[p][c] for c in CLASSES]
        # the val split is annotated as the train split: the same classes; val labels are all 'a'
        val = site.splits["val"]
        assert entry["n_train"] == 4 and entry["n_val"] == 2 and entry["val_labels"] == "site"
        assert val.label_mask.tolist() == [[c in classes for c in CLASSES]] * 2
        assert val.labels.sum(0).tolist() == [2 if "a" in classes else 0, 0, 0, 0]
        assert refs[k].splits["val"].label_mask.all() and refs[k].splits["val"].labels.sum() == 2
        assert entry["val_annotated_positives"]["a"] == (2 if "a" in classes else 0)
        assert site.info["annotated_classes"] == sorted(classes) and site.info["val_labels"] == "site"
    # annotated + hidden = every positive once: a 5, b 3, c 4, d 3
    totals = summary["totals"]
    assert {c: totals["annotated_positives"][c] + totals["hidden_positives"][c] for c in CLASSES} == \
        {"a": 5, "b": 3, "c": 4, "d": 3}
    assert totals["n_train"] == 12 and totals["n_val"] == 6
    assert "test" not in sites[0].splits  # the test split stays in the source file


def test_warns_about_a_class_whose_annotating_sites_hold_none_of_its_positives():
    sites, _, summary = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=[CLASSES] * 3)
    patients = [_patient(s) for s in sites]
    training = [w for w in summary["warnings"] if "positive training images" in w]
    assert training == []  # every class annotated everywhere
    # c's 4 positives all belong to patient 1: annotate c only at a site holding another patient,
    # and b (patient 0: 2 positives, patient 2: 1) only where patient 1 is (no b there)
    at_patient = {p: k for k, p in enumerate(patients)}
    sets = [[] for _ in range(3)]
    sets[at_patient[0]] = ["a", "c"]
    sets[at_patient[1]] = ["b"]
    sets[at_patient[2]] = ["d"]
    _, _, summary = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=sets)
    assert summary["totals"]["annotated_positives"] == {"a": 4, "b": 0, "c": 0, "d": 3}
    training = [w for w in summary["warnings"] if "positive training images" in w]
    assert len(training) == 2
    assert "class 'b' has 3 positive training images, none at a site that annotates it" in training[0]
    assert "class 'c' has 4 positive training images" in training[1]
    assert "WARNING: class 'c'" in part.summary_markdown(summary)


def test_curated_val_sites_keep_complete_val_labels_and_say_so(tmp_path):
    sets = [["a", "b"], ["c"], ["d", "a"]]
    sites, refs, summary = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=sets,
                                     curated_val=["site-2"])
    assert summary["curated_val"] == ["site-2"]
    assert sites[1].splits["val"].label_mask.all() and sites[1].splits["val"].labels.sum() == 2
    assert sites[1].info["val_labels"] == "curated" and summary["per_site"]["site-2"]["val_labels"] == "curated"
    assert sites[1].splits["train"].label_mask.sum(0).tolist() == [0, 0, 4, 0]  # the train split stays partial
    assert not sites[0].splits["val"].label_mask.all() and sites[0].info["val_labels"] == "site"
    assert "complete labels (curated) at site-2" in part.summary_markdown(summary)
    # val positives of 'a' only: the other classes cannot be scored at any site, and the summary says so
    unscored = [w for w in summary["warnings"] if "no annotated positive in any site's val split" in w]
    assert [w.split("'")[1] for w in unscored] == ["b", "c", "d"]
    every, _, _ = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=sets, curated_val=["all"])
    assert all(s.splits["val"].label_mask.all() for s in every)
    with pytest.raises(DataError, match=r"--curated-val names \['site-9'\], which are not sites of this split"):
        partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=sets, curated_val=["site-9"])


def test_semi_supervised_unlabelled_sites_hold_no_val_label():
    sites, refs, summary = partition(_dataset(), "semi-supervised", sites=3, seed=0, labelled_sites=1)
    assert sites[0].splits["val"].label_mask.all()
    for site, ref in zip(sites[1:], refs[1:]):
        assert not site.splits["val"].label_mask.any() and site.splits["val"].labels.sum() == 0
        assert ref.splits["val"].label_mask.all() and ref.splits["val"].labels.sum() == 2


def test_label_set_mismatch_single_label_zero_rows():
    sets = [[0, 1], [2, 3], [1, 3]]
    sites, _, summary = partition(_dataset("single-label"), "label-set-mismatch", sites=3, seed=4, class_sets=sets)
    for k, (site, classes) in enumerate(zip(sites, sets)):
        tr, p = site.splits["train"], _patient(site)
        known = [c for c in SINGLE[p] if c in classes]
        # rows of an annotated class stay one-hot, the others become all-zero ("none of my classes")
        assert tr.labels.sum() == len(known) and (tr.labels.sum(1) <= 1).all()
        assert (tr.label_mask == np.isin(np.arange(4), classes)).all()
        hidden = summary["per_site"][f"site-{k + 1}"]["hidden_positives"]
        assert sum(hidden.values()) == 4 - len(known)


def test_classes_per_site_cyclic_cover():
    # C = 4, 2 sites x 2 classes: the cyclic blocks of one permutation are disjoint and cover all 4
    sites, _, _ = partition(_dataset(), "label-set-mismatch", sites=2, seed=3, classes_per_site=2)
    masks = [s.splits["train"].label_mask.any(0) for s in sites]
    assert [m.sum() for m in masks] == [2, 2] and not (masks[0] & masks[1]).any() and (masks[0] | masks[1]).all()


def test_refusal_names_the_uncovered_class():
    with pytest.raises(DataError, match="class 'c' would be annotated at no site"):
        partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=[["a"], ["b"], ["d", "b"]])
    with pytest.raises(DataError, match="class '[abcd]' would be annotated at no site"):
        partition(_dataset(), "label-set-mismatch", sites=3, seed=0, classes_per_site=1)  # 3 x 1 < 4
    with pytest.raises(DataError, match="class 'e' is not one of"):
        partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=[["a"], ["b", "c"], ["e", "d"]])
    with pytest.raises(DataError, match="site 'site-2' no annotated class"):
        partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=[["a", "b"], [], ["c", "d"]])


def test_missing_classes():
    sites, _, summary = partition(_dataset(), "missing-classes", sites=3, seed=2, missing_per_site=1)
    missing = [set(np.flatnonzero(~s.splits["train"].label_mask.any(0))) for s in sites]
    # each site loses exactly one class; cyclic blocks of one permutation: three different classes
    assert [len(m) for m in missing] == [1, 1, 1] and len(set.union(*missing)) == 3
    for k, s in enumerate(sites):
        (c,) = missing[k]
        hidden = summary["per_site"][f"site-{k + 1}"]["hidden_positives"]
        assert hidden == {n: (POSITIVES[_patient(s)][n] if i == c else 0) for i, n in enumerate(CLASSES)}
    with pytest.raises(DataError, match="annotated at no site"):  # one site missing one class covers 3 of 4
        partition(_dataset(), "missing-classes", sites=1, seed=0, missing_per_site=1)
    with pytest.raises(DataError, match="missing-per-site must be in 0..3"):
        partition(_dataset(), "missing-classes", sites=3, seed=0, missing_per_site=4)


def test_semi_supervised():
    sites, refs, summary = partition(_dataset(), "semi-supervised", sites=3, seed=1, labelled_sites=1)
    assert [s.info["labelled"] for s in sites] == [True, False, False]
    p = _patient(sites[0])
    assert summary["per_site"]["site-1"]["annotated_positives"] == POSITIVES[p]
    for k in (1, 2):
        tr = sites[k].splits["train"]
        assert tr.labels.sum() == 0 and tr.label_mask.sum() == 0
        assert summary["per_site"][f"site-{k + 1}"]["hidden_positives"] == POSITIVES[_patient(sites[k])]
        assert refs[k].splits["train"].label_mask.all()
    for bad in (0, 4):
        with pytest.raises(DataError, match="labelled-sites must be in 1..3"):
            partition(_dataset(), "semi-supervised", sites=3, seed=1, labelled_sites=bad)


def test_same_seed_same_split_other_seed_other_split():
    data = _dataset()
    data.splits["train"].groups = None  # per-sample assignment: 12 images over 3 sites, 4 each
    one = partition(data, "label-set-mismatch", sites=3, seed=7, classes_per_site=2)
    two = partition(data, "label-set-mismatch", sites=3, seed=7, classes_per_site=2)
    for a, b in zip(one[0], two[0]):
        np.testing.assert_array_equal(a.splits["train"].ids, b.splits["train"].ids)
        np.testing.assert_array_equal(a.splits["train"].label_mask, b.splits["train"].label_mask)
    assert [len(s.splits["train"]) for s in one[0]] == [4, 4, 4]
    others = [partition(data, "label-set-mismatch", sites=3, seed=s, classes_per_site=2)[0] for s in (8, 9)]
    assert any(not np.array_equal(o[0].splits["train"].ids, one[0][0].splits["train"].ids) for o in others)


def test_more_sites_than_patients_is_refused():
    with pytest.raises(DataError, match="site 'site-4' would get no training images"):
        partition(_dataset(), "semi-supervised", sites=4, seed=0, labelled_sites=1)
    with pytest.raises(DataError, match="does not fit multi-label data"):
        partition(_dataset(), "incomplete-masks", sites=3, seed=0, completeness=[1, 1, 1])


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent")
def test_ct_ich_no_patient_on_two_sites():
    from fedpartial.data.npz import load_npz

    data = load_npz(str(SHARED / "ct_ich_128.npz"))
    sites, _, summary = partition(data, "missing-classes", sites=4, seed=0, missing_per_site=2)
    for split in ("train", "val"):
        groups = [set(s.splits[split].groups.tolist()) for s in sites]
        assert sum(len(g) for g in groups) == len(set.union(*groups))  # disjoint
        assert set.union(*groups) == set(data.splits[split].groups.tolist())
    assert summary["totals"]["n_train"] == 1714 and summary["totals"]["n_val"] == 236


# ---- incomplete masks ------------------------------------------------------------------------------
def _squares(n_images=6, touching=False, instance_ids=False):
    """16x16 masks with four 3x3 squares in the corners (separate lesions). With ``touching`` the
    fourth square sits right beside the third (8-connected: one component for class-id masks)."""
    masks = np.zeros((n_images, 16, 16), np.uint16)
    corners = [(1, 1), (1, 12), (12, 1), (12, 12)]
    if touching:
        corners[3] = (12, 4)  # columns 4-6 touch the third square's columns 1-3
    for k, (r, c) in enumerate(corners, start=1):
        masks[:, r:r + 3, c:c + 3] = k if instance_ids else 1
    images = (masks > 0).astype(np.uint8) * 200
    names = ["nucleus"] if instance_ids else ["lesion"]
    train = Split(images, masks, None, np.arange(n_images), None)
    val = Split(images[:3], masks[:3], None, np.arange(3), None)
    return Dataset("segmentation", names, {"train": train, "val": val}, source="squares.npz")


def test_incomplete_masks_keep_whole_components():
    # completeness 25 %, 50 %, 100 % of 4 lesions per image: round(1) = 1, round(2) = 2, 4 kept
    sites, refs, summary = partition(_squares(), "incomplete-masks", sites=3, seed=0, completeness=[25, 50, 100])
    for k, kept in enumerate([1, 2, 4]):
        masks = sites[k].splits["train"].labels
        assert set(np.unique(masks)) <= {0, 1}
        assert [ndimage.label(m)[1] for m in masks] == [kept, kept]  # 6 images / 3 sites = 2 each
        assert (masks.sum(axis=(1, 2)) == 9 * kept).all()  # whole 3x3 squares only
        assert summary["per_site"][f"site-{k + 1}"]["lesions_kept"] == 2 * kept
        assert summary["per_site"][f"site-{k + 1}"]["lesions_total"] == 8
        assert [ndimage.label(m)[1] for m in refs[k].splits["train"].labels] == [4, 4]
        # one val image per site, 4 lesions of 9 px: its val mask keeps round(a_k * 4) whole lesions too
        val = sites[k].splits["val"].labels
        assert val.sum() == 9 * kept and [ndimage.label(m)[1] for m in val] == [kept]
        assert refs[k].splits["train"].labels.max() == 1 and refs[k].splits["val"].labels.sum() == 36
    assert summary["totals"]["lesions_kept"] == 14 and summary["totals"]["lesions_total"] == 24
    # the input agreement a source was brought to is recorded in every site file made from it
    agreed = _squares()
    agreed.info = {"input_agreement": {"spacing_mm": [1.0, 1.0]}}
    made, _, _ = partition(agreed, "incomplete-masks", sites=3, seed=0, completeness=[25, 50, 100])
    assert all(s.info["input_agreement"] == {"spacing_mm": [1.0, 1.0]} for s in made)
    assert "input_agreement" not in sites[0].info
    # curated val masks (complete) leave the train masks as they are: the val lesions draw from their own stream
    curated, _, _ = partition(_squares(), "incomplete-masks", sites=3, seed=0, completeness=[25, 50, 100],
                              curated_val=["all"])
    for site, other in zip(sites, curated):
        assert (site.splits["train"].labels == other.splits["train"].labels).all()
        assert other.splits["val"].labels.sum() == 36


def test_incomplete_masks_instance_ids_and_touching_class_ids():
    data = _squares(n_images=2, touching=True, instance_ids=True)
    sites, _, summary = partition(data, "incomplete-masks", sites=1, seed=3, completeness=[0.5])
    source = data.splits["train"].labels
    for src, kept in zip(source[np.argsort(data.splits["train"].ids)], sites[0].splits["train"].labels):
        ids = set(np.unique(src[kept > 0]).tolist())
        assert len(ids) == 2  # instance ids: 4 lesions (two of them touching), round(0.5 * 4) = 2
        for i in ids:
            assert kept[src == i].all()  # each kept lesion whole
    # class-id masks: the touching squares form one 8-connected component, so 3 lesions per image
    data = _squares(n_images=2, touching=True)
    _, _, summary = partition(data, "incomplete-masks", sites=1, seed=3, completeness=[1.0])
    assert summary["per_site"]["site-1"]["lesions_total"] == 6


def test_completeness_parsing():
    assert completeness_fractions([0.2, 1, 0.5]) == [0.2, 1.0, 0.5]
    assert completeness_fractions([30, 50, 1]) == [0.3, 0.5, 0.01]  # one value > 1: all percentages
    for bad in ([120, 50], [-0.1, 0.5]):
        with pytest.raises(DataError, match="completeness"):
            completeness_fractions(bad)
    with pytest.raises(DataError, match="needs 3 values"):
        partition(_squares(), "incomplete-masks", sites=3, seed=0, completeness=[0.5, 0.5])


# ---- writing -----------------------------------------------------------------------------------------
def test_write_partition_files_and_summary(tmp_path):
    result = partition(_dataset(), "label-set-mismatch", sites=3, seed=0, class_sets=[["a", "b"], ["c"], ["d"]])
    out = tmp_path / "split"
    write_partition(str(out), *result)
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == ["reference/site-1_full.npz", "reference/site-2_full.npz", "reference/site-3_full.npz",
                     "site-1.npz", "site-2.npz", "site-3.npz", "split_summary.json", "split_summary.md"]
    site2 = load_site_file(str(out / "site-2.npz"), expected_site="site-2")
    assert site2.splits["train"].label_mask.sum(0).tolist() == [0, 0, 4, 0]
    full = load_site_file(str(out / "reference" / "site-2_full.npz"))
    assert full.info["reference"] and full.splits["train"].label_mask.all()
    summary = json.loads((out / "split_summary.json").read_text())
    assert summary["totals"]["annotated_positives"]["d"] + summary["totals"]["hidden_positives"]["d"] == 3
    md = (out / "split_summary.md").read_text()
    assert "| site-1 | 4 |" in md and "| total | 12 |" in md


def test_failed_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    import fedpartial.data.sitefile as sitefile

    result = partition(_dataset(), "semi-supervised", sites=3, seed=0, labelled_sites=2)
    out = tmp_path / "split"
    write_partition(str(out), *result)  # an earlier, complete split
    before = {p.name: p.read_bytes() for p in out.glob("*.npz")}
    real, calls = sitefile.write_site_file, []

    def failing(path, dataset):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(path, dataset)

    monkeypatch.setattr(sitefile, "write_site_file", failing)
    with pytest.raises(OSError, match="disk full"):
        write_partition(str(out), *partition(_dataset(), "semi-supervised", sites=3, seed=5, labelled_sites=1))
    assert sorted(os.listdir(tmp_path)) == ["split"]  # no temporary folder left beside it
    assert {p.name: p.read_bytes() for p in out.glob("*.npz")} == before  # the earlier split is untouched
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    monkeypatch.setattr(sitefile, "write_site_file", real)
    with pytest.raises(DataError, match="does not hold an earlier split"):
        write_partition(str(tmp_path / "other"), *result)


def test_split_command_cli(tmp_path, capsys):
    from fedpartial.data.npz import save_npz

    src = tmp_path / "src.npz"
    save_npz(_dataset(), str(src))
    parser = argparse.ArgumentParser()
    part.add_split_arguments(parser)
    args = parser.parse_args(["--data", str(src), "--scenario", "label-set-mismatch", "--sites", "3", "--seed", "0",
                              "--out", str(tmp_path / "out"), "--class-sets", "a,b;c;3"])
    part.split_command(args)
    printed = capsys.readouterr().out
    assert "| site-3 | 4 |" in printed and "| total | 12 |" in printed
    site3 = load_site_file(str(tmp_path / "out" / "site-3.npz"))
    assert site3.info["annotated_classes"] == ["d"]  # "3" is the index of class d
    args = parser.parse_args(["--data", str(src), "--scenario", "incomplete-masks", "--sites", "2",
                              "--out", str(tmp_path / "out2"), "--completeness", "0.5,x"])
    with pytest.raises(DataError, match="not a comma list"):
        part.split_command(args)
    assert not (tmp_path / "out2").exists()
