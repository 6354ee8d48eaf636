"""Readers (real files, NIfTI written with nibabel; DICOM is covered in test_data_readers.py), site
files and every partition scenario against hand-counted expectations."""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.npz import load_npz, save_npz
from fedpartial_tools.data.partition import assign_to_sites, keep_lesions, partition, split_file
from fedpartial.data.sitefile import load_site_file, write_site_file
from fedpartial_tools.data.synthetic import make_classification, make_segmentation
from fedpartial.data.types import DataError, Dataset, Split

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent")


# ---- real files ---------------------------------------------------------------------------
@needs_shared
@pytest.mark.parametrize("name, task, n_train, classes, shape", [
    ("ham10000_28.npz", "single-label", 4189, 7, (28, 28, 3)),
    ("nih_chestxray14_64.npz", "multi-label", 600, 14, (64, 64)),
    ("ct_ich_128.npz", "multi-label", 1714, 5, (128, 128)),
    ("dsb2018_nuclei_256.npz", "segmentation", 464, 1, (256, 256, 3)),
    ("covid_semiseg_256.npz", "segmentation", 50, 2, (256, 256)),
])
def test_real_files(name, task, n_train, classes, shape):
    data = load_npz(str(SHARED / name))
    assert data.task == task and data.num_classes == classes
    train = data.splits["train"]
    assert len(train) == n_train and train.images.shape[1:] == shape
    if task != "segmentation":
        assert train.labels.shape == (n_train, classes) and train.label_mask.all()
    if task == "single-label":
        assert (train.labels.sum(1) == 1).all()
        # overall class counts of HAM10000 (README): akiec 183 ... ; train is a stratified part of them
        assert data.class_names == ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]


@needs_shared
def test_covid_slices_are_flipped_upright():
    raw = np.load(SHARED / "covid_semiseg_256.npz")
    data = load_npz(str(SHARED / "covid_semiseg_256.npz"))
    np.testing.assert_array_equal(data.splits["train"].images[0], raw["train_images"][0][::-1])
    assert "val" not in data.splits


@needs_shared
def test_ct_ich_split_keeps_patients_on_one_site(tmp_path):
    summary = split_file(str(SHARED / "ct_ich_128.npz"), "label-set-mismatch", sites=5, seed=3,
                         out=str(tmp_path / "s"), classes_per_site=1)
    groups = [set(load_site_file(str(tmp_path / "s" / f"site-{k}.npz")).splits["train"].groups.tolist())
              for k in range(1, 6)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert not groups[i] & groups[j]
    assert sum(e["n_train"] for e in summary["per_site"].values()) == 1714


# ---- bad input ----------------------------------------------------------------------------
def _write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_truncated_npz_names_the_file(tmp_path):
    good = tmp_path / "good.npz"
    save_npz(make_classification(n_train=20, n_val=5, n_test=5), str(good))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match="bad.npz"):
        load_npz(str(bad))


@pytest.mark.parametrize("arrays, message", [
    ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.array([[0], [1], [7], [0]]),
      "label_names": np.array(["a", "b", "c"])}, "row 2 has class 7"),
    ({"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.zeros((3, 1), int),
      "label_names": np.array(["a", "b"])}, "4 images .* but 3 rows"),
    ({"train_images": np.zeros((4, 8), np.uint8), "train_labels": np.zeros((4, 1), int),
      "label_names": np.array(["a", "b"])}, "train_images' has shape"),
    ({"train_images": np.zeros((2, 8, 8), np.uint8), "train_labels": np.array([[0, 2], [1, 0]]),
      "label_names": np.array(["a", "b"])}, "must be 0/1"),
])
def test_bad_arrays_are_refused_with_the_key(tmp_path, arrays, message):
    with pytest.raises(DataError, match=message):
        load_npz(_write(tmp_path / "x.npz", **arrays))


def test_site_file_mask_must_match_labels(tmp_path):
    data = make_classification(n_train=6, n_val=2, n_test=2)
    data.site = "site-1"
    data.splits["train"].label_mask[0, :] = False
    data.splits["train"].labels[0, 0] = 1  # annotated "no" but labelled 1
    del data.splits["test"]
    write_site_file(str(tmp_path / "site-1.npz"), data)
    with pytest.raises(DataError, match="finding_0"):
        load_site_file(str(tmp_path / "site-1.npz"))
    with pytest.raises(DataError, match="belongs to site 'site-1'"):
        load_site_file(str(tmp_path / "site-1.npz"), expected_site="site-2")


# ---- NIfTI --------------------------------------------------------------------------------
def test_nifti_volumes_slice_to_2d(tmp_path):
    import nibabel as nib

    from fedpartial_tools.data.nifti import load_nifti_pairs

    vol = np.random.default_rng(0).random((8, 8, 5)).astype(np.float32)
    mask = np.zeros((8, 8, 5), np.float32)
    mask[2:4, 2:4, 1] = 2.0  # lesion on slice 1 only, label value 2 -> binarised to 1
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(tmp_path / "img.nii.gz"))
    nib.save(nib.Nifti1Image(mask, np.eye(4)), str(tmp_path / "msk.nii.gz"))
    data = load_nifti_pairs([str(tmp_path / "img.nii.gz")], [str(tmp_path / "msk.nii.gz")], axis=2)
    train = data.splits["train"]
    assert train.images.shape == (5, 8, 8) and train.images.dtype == np.uint8
    assert train.labels.max() == 1 and train.labels[1].sum() == 4 and train.labels.sum() == 4
    only = load_nifti_pairs([str(tmp_path / "img.nii.gz")], [str(tmp_path / "msk.nii.gz")], keep_empty_slices=False)
    assert len(only.splits["train"]) == 1
    nib.save(nib.Nifti1Image(mask[:, :, :3], np.eye(4)), str(tmp_path / "short.nii.gz"))
    with pytest.raises(DataError, match="short.nii.gz"):
        load_nifti_pairs([str(tmp_path / "img.nii.gz")], [str(tmp_path / "short.nii.gz")])


# ---- partition scenarios on a hand-built dataset -------------------------------------------
def _toy(task="multi-label"):
    # 12 samples, 4 classes; labels chosen so counts are easy to check by hand
    labels = np.zeros((12, 4), np.float32)
    if task == "single-label":
        labels[np.arange(12), np.arange(12) % 4] = 1  # 3 samples per class
    else:
        labels[:, 0] = 1          # class 0 everywhere
        labels[::2, 1] = 1        # class 1 on even rows
    images = np.zeros((12, 4, 4), np.uint8)
    val = Split(images[:4], labels[:4], np.ones((4, 4), bool))
    return Dataset(task, ["a", "b", "c", "d"], {"train": Split(images, labels, np.ones((12, 4), bool)), "val": val},
                   source="toy.npz")


def test_label_set_mismatch_masks_and_counts():
    sites, refs, summary = partition(_toy(), "label-set-mismatch", sites=2, seed=0, class_sets=[["a"], ["b", "c", "d"]])
    s1, s2 = sites
    # site-1 annotates only class a: 6 samples, all positive for a; b is hidden (3 even rows of 6)
    assert s1.splits["train"].label_mask.sum(0).tolist() == [6, 0, 0, 0]
    assert summary["per_site"]["site-1"]["annotated_positives"] == {"a": 6, "b": 0, "c": 0, "d": 0}
    assert summary["per_site"]["site-2"]["annotated_positives"]["a"] == 0
    assert s1.splits["train"].labels[:, 1:].sum() == 0
    # the reference copy keeps every label
    assert refs[0].splits["train"].labels.sum() == s1.splits["train"].labels.sum() + \
        summary["per_site"]["site-1"]["hidden_positives"]["b"]
    # the val split is annotated as the train split: site-1 holds class a only there too
    assert len(s1.splits["val"]) + len(s2.splits["val"]) == 4
    assert s1.splits["val"].label_mask.tolist() == [[True, False, False, False]] * len(s1.splits["val"])
    assert s2.splits["val"].label_mask.tolist() == [[False, True, True, True]] * len(s2.splits["val"])
    assert refs[0].splits["val"].label_mask.all()


def test_single_label_mismatch_zeroes_samples_of_missing_classes():
    sites, _, summary = partition(_toy("single-label"), "label-set-mismatch", sites=2, seed=0,
                                  class_sets=[[0, 1], [2, 3]])
    tr = sites[0].splits["train"]
    # site-1 knows a, b: its samples of c, d are "none of my classes": all-zero labels, mask on a, b only
    assert (tr.label_mask == np.array([1, 1, 0, 0], bool)).all()
    known = tr.labels.sum(1)
    assert known.sum() == summary["per_site"]["site-1"]["annotated_positives"]["a"] + \
        summary["per_site"]["site-1"]["annotated_positives"]["b"]


def test_refuses_a_class_annotated_nowhere():
    with pytest.raises(DataError, match="class 'd' would be annotated at no site"):
        partition(_toy(), "label-set-mismatch", sites=2, seed=0, class_sets=[["a"], ["b", "c"]])
    with pytest.raises(DataError, match="annotated at no site"):
        partition(_toy(), "label-set-mismatch", sites=1, seed=0, classes_per_site=3)


def test_missing_classes_each_site_loses_n():
    sites, _, _ = partition(_toy(), "missing-classes", sites=3, seed=1, missing_per_site=1)
    for s in sites:
        assert (~s.splits["train"].label_mask.any(0)).sum() == 1  # exactly one class missing
    covered = np.any([s.splits["train"].label_mask.any(0) for s in sites], axis=0)
    assert covered.all()


def test_semi_supervised_labelled_sites():
    sites, _, summary = partition(_toy(), "semi-supervised", sites=3, seed=0, labelled_sites=1)
    assert sites[0].info["labelled"] and not sites[1].info["labelled"]
    assert sites[1].splits["train"].label_mask.sum() == 0 and sites[1].splits["train"].labels.sum() == 0
    assert summary["per_site"]["site-1"]["annotated_positives"]["a"] == 4  # 12 samples / 3 sites, all have a


def test_split_is_repeatable_and_seed_dependent():
    a = assign_to_sites(20, 3, np.random.default_rng(5))
    b = assign_to_sites(20, 3, np.random.default_rng(5))
    c = assign_to_sites(20, 3, np.random.default_rng(6))
    assert all((x == y).all() for x, y in zip(a, b)) and any((x != y).any() for x, y in zip(a, c))
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    parts = assign_to_sites(10, 2, np.random.default_rng(0), groups)
    assert sorted(len(p) for p in parts) == [5, 5]  # {3,1,1} + ... greedy by size: 4+1 / 3+2
    for p in parts:
        assert len(set(groups[p]) & set(groups[np.setdiff1d(np.arange(10), p)])) == 0


def test_keep_lesions_removes_whole_components():
    from scipy import ndimage

    mask = np.zeros((10, 10), np.uint16)
    mask[0:2, 0:2] = 1
    mask[5:7, 5:7] = 2
    mask[8:10, 0:3] = 3
    mask[2, 2] = 4  # touches lesion 1 diagonally: still its own instance
    kept, k, n = keep_lesions(mask, 0.5, np.random.default_rng(0), instance_ids=True)
    assert (n, k) == (4, 2)
    ids_kept = set(np.unique(mask[kept > 0]))
    for lesion in ids_kept:  # every kept lesion is complete
        assert (kept[mask == lesion] == 1).all()
    assert ids_kept.isdisjoint({0}) and len(ids_kept) == 2
    # class-id masks: 8-connected components; the diagonal pixel joins the first blob -> 3 lesions
    _, k2, n2 = keep_lesions((mask > 0).astype(np.uint8), 1.0, np.random.default_rng(0), instance_ids=False)
    assert (n2, k2) == (3, 3)
    assert ndimage.label(kept)[1] <= 2


def test_incomplete_masks_scenario(tmp_path):
    data = make_segmentation(n_train=20, n_val=4, n_test=4, size=32, seed=1)
    summary = split_file_from(data, tmp_path, "incomplete-masks", sites=2, completeness=[50, 100])
    full = summary["per_site"]["site-2"]
    assert full["lesions_kept"] == full["lesions_total"]
    half = summary["per_site"]["site-1"]
    assert half["lesions_kept"] < half["lesions_total"]
    site1 = load_site_file(str(tmp_path / "out" / "site-1.npz"))
    assert set(np.unique(site1.splits["train"].labels)) <= {0, 1} and site1.class_names == ["lesion"]
    # the site holds its masks, not the benchmark's truth of how complete they are
    assert not {"completeness", "lesions_kept", "lesions_total"} & set(site1.info), site1.info


def split_file_from(data, tmp_path, scenario, sites, **options):
    src = tmp_path / "src.npz"
    save_npz(data, str(src))
    return split_file(str(src), scenario, sites=sites, seed=0, out=str(tmp_path / "out"), **options)


def test_failed_split_leaves_nothing(tmp_path):
    with pytest.raises(DataError):
        split_file_from(make_classification(n_train=20, n_val=4, n_test=4), tmp_path, "label-set-mismatch", sites=2,
                        classes_per_site=1)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src.npz"]


def test_cli_split_writes_summary(tmp_path):
    from fedpartial_tools.cli import main

    src = tmp_path / "src.npz"
    save_npz(make_classification(n_train=40, n_val=10, n_test=10), str(src))
    main(["split", "--data", str(src), "--scenario", "missing-classes", "--missing-per-site", "2", "--sites", "3",
          "--seed", "0", "--out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "split_summary.json").read_text())
    assert sorted(summary["per_site"]) == ["site-1", "site-2", "site-3"]
    assert (tmp_path / "out" / "reference" / "site-1_full.npz").is_file()
    assert "| site-1 |" in (tmp_path / "out" / "split_summary.md").read_text()
