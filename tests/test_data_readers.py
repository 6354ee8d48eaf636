"""Readers: the real ../shared/data files, MedMNIST / segmentation layouts built by hand, corrupt
and inconsistent files, site files, DICOM written with pydicom, NIfTI written with nibabel.
Expected numbers are worked out by hand in the comments."""
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.npz import UPRIGHT_KEY, load_npz, save_npz
from fedpartial.data.sitefile import load_site_file, write_site_file
from fedpartial.data.types import DataError, Dataset, Split

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"real data folder {SHARED} is absent")


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


# ---- real files -------------------------------------------------------------------------------
@needs_shared
def test_ham10000_class_counts_match_the_readme():
    data = load_npz(str(SHARED / "ham10000_28.npz"))
    assert data.task == "single-label"
    assert data.class_names == ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]
    assert {k: len(s) for k, s in data.splits.items()} == {"train": 4189, "val": 597, "test": 1198}
    # README: overall 183/264/583/60/491/4323/80 over the three splits; one-hot rows
    total = sum(s.labels.sum(0) for s in data.splits.values())
    assert total.tolist() == [183, 264, 583, 60, 491, 4323, 80]
    assert data.splits["train"].images.shape[1:] == (28, 28, 3) and data.splits["train"].images.dtype == np.uint8
    assert data.splits["train"].ids[0] == "ISIC_0024306"


@needs_shared
def test_ct_ich_patients_and_positives():
    data = load_npz(str(SHARED / "ct_ich_128.npz"))
    assert data.task == "multi-label" and data.num_classes == 5
    assert data.class_names[0] == "Intraventricular" and data.class_names[4] == "Subdural"
    # README: positives overall 23/66/17/166/56 slices; 82 patients in total, split by patient
    assert sum(s.labels.sum(0) for s in data.splits.values()).tolist() == [23, 66, 17, 166, 56]
    groups = [set(s.groups.tolist()) for s in data.splits.values()]
    assert sum(len(g) for g in groups) == 82 and not (groups[0] & groups[1]) and not (groups[0] & groups[2])
    assert data.splits["train"].groups[0] == 49  # train_patient_ids starts 49, 49, 49


@needs_shared
def test_nih_is_multi_label_with_patient_groups():
    data = load_npz(str(SHARED / "nih_chestxray14_64.npz"))
    assert data.task == "multi-label" and data.num_classes == 14 and data.class_names[-1] == "Hernia"
    train = data.splits["train"]
    assert train.labels.shape == (600, 14) and train.label_mask.all()
    assert train.groups[:3].tolist() == [2, 5, 5] and train.ids[0] == "00000002_000.png"


@needs_shared
def test_dsb_instance_masks():
    data = load_npz(str(SHARED / "dsb2018_nuclei_256.npz"))
    assert data.task == "segmentation" and data.class_names == ["nucleus"]  # "background" dropped
    train = data.splits["train"]
    assert train.images.shape == (464, 256, 256, 3) and train.labels.shape == (464, 256, 256)
    # train_n_lesions starts 27, 36, 86: one instance id per nucleus
    assert [len(np.unique(m)) - 1 for m in train.labels[:3]] == [27, 36, 86]


@needs_shared
def test_covid_is_flipped_upright_and_has_no_val(tmp_path):
    raw = np.load(SHARED / "covid_semiseg_256.npz")
    data = load_npz(str(SHARED / "covid_semiseg_256.npz"))
    assert sorted(data.splits) == ["test", "train"] and data.info["slices_flipped"]
    assert data.class_names == ["ground_glass_opacity", "consolidation"]
    # row r of the loaded slice is row 255 - r of the stored one, for images and masks alike
    np.testing.assert_array_equal(data.splits["train"].images[3, 10], raw["train_images"][3, 245])
    np.testing.assert_array_equal(data.splits["test"].labels[5], raw["test_masks"][5][::-1])
    # a re-saved copy (even under the same kind of name) is not flipped a second time
    copy = tmp_path / "covid_semiseg_256_copy.npz"
    save_npz(data, str(copy))
    assert UPRIGHT_KEY in np.load(copy).files
    np.testing.assert_array_equal(load_npz(str(copy)).splits["train"].images, data.splits["train"].images)


@needs_shared
def test_truncated_real_zip_names_the_file(tmp_path):
    whole = (SHARED / "covid_semiseg_256.npz").read_bytes()
    bad = tmp_path / "half.npz"
    bad.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="half.npz"):
        load_npz(str(bad))


# ---- layouts built by hand ----------------------------------------------------------------------
def test_official_medmnist_without_label_names(tmp_path):
    # labels 0,2 in train and 3 in val: C = 3 + 1 = 4 names class_0..class_3
    path = _npz(tmp_path / "dermamnist.npz", train_images=np.zeros((2, 4, 4), np.uint8),
                train_labels=np.array([[0], [2]], np.uint8), val_images=np.zeros((1, 4, 4), np.uint8),
                val_labels=np.array([[3]], np.uint8))
    data = load_npz(path)
    assert data.task == "single-label" and data.class_names == ["class_0", "class_1", "class_2", "class_3"]
    assert data.splits["train"].labels.tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]
    assert data.splits["val"].labels.tolist() == [[0, 0, 0, 1]] and "test" not in data.splits


def test_multi_label_ids_and_groups(tmp_path):
    path = _npz(tmp_path / "m.npz", train_images=np.zeros((3, 4, 4, 3), np.uint8),
                train_labels=np.array([[1, 0], [1, 1], [0, 0]], np.uint8), label_names=np.array(["x", "y"]),
                train_patient_ids=np.array([7, 7, 9]), train_image_ids=np.array(["a", "b", "c"]))
    data = load_npz(path)
    assert data.task == "multi-label" and data.splits["train"].labels.sum() == 3
    assert data.splits["train"].groups.tolist() == [7, 7, 9] and data.splits["train"].ids.tolist() == ["a", "b", "c"]


def test_segmentation_layout_grey_class_ids(tmp_path):
    masks = np.zeros((2, 6, 6), np.uint8)
    masks[0, 1:3, 1:3] = 2
    path = _npz(tmp_path / "seg.npz", train_images=np.zeros((2, 6, 6), np.uint8), train_masks=masks,
                class_names=np.array(["background", "ggo", "consolidation"]), train_n_lesions=np.array([1, 0]))
    data = load_npz(path)
    assert data.task == "segmentation" and data.class_names == ["ggo", "consolidation"]
    assert data.splits["train"].labels[0].sum() == 8  # 4 pixels of class 2: stored as they are


def _base(**extra):
    arrays = {"train_images": np.zeros((4, 8, 8), np.uint8), "train_labels": np.array([[0], [1], [1], [0]]),
              "label_names": np.array(["a", "b"])}
    arrays.update(extra)
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize("arrays, message", [
    (_base(train_labels=np.array([[0], [1], [-1], [0]], np.int8)), "row 2 has class -1"),
    (_base(train_labels=np.array([[0], [1], [2], [0]])), "row 2 has class 2, outside 0..1"),
    (_base(train_labels=np.zeros((4, 2)) + np.array([0, 3])), r"entry \(0, 1\) is 3.0"),
    (_base(train_labels=np.zeros((4, 3), np.uint8)), "3 columns but there are 2 class names"),
    (_base(train_images=np.zeros((4, 8, 8), np.float32)), "'train_images' has dtype float32"),
    (_base(train_images=np.zeros((4, 8, 8, 2), np.uint8)), "'train_images' has shape"),
    (_base(train_labels=None), "has 'train_images' but no 'train_labels'"),
    (_base(train_images=None, val_images=np.zeros((1, 8, 8), np.uint8)), "lacks 'train_images'"),
    (_base(train_images=np.zeros((0, 8, 8), np.uint8), train_labels=np.zeros((0, 1), int)), "train split is empty"),
    ({"train_images": np.zeros((2, 8, 8), np.uint8), "train_masks": np.zeros((2, 8, 7), np.uint8)},
     r"'train_masks' has shape \(2, 8, 7\)"),
    ({"train_images": np.zeros((2, 8, 8), np.uint8), "train_masks": np.zeros((2, 8, 8), np.float32)},
     "masks hold integer"),
    ({"train_images": np.zeros((2, 8, 8), np.uint8), "train_masks": np.zeros((2, 8, 8), np.uint8),
      "train_n_lesions": np.array([1, 2, 3])}, "'train_n_lesions' has 3 entries for 2 masks"),
])
def test_bad_arrays_name_file_and_key(tmp_path, arrays, message):
    with pytest.raises(DataError, match=message) as err:
        load_npz(_npz(tmp_path / "bad_input.npz", **arrays))
    assert "bad_input.npz" in str(err.value)


def test_corrupt_member_and_not_a_zip(tmp_path):
    path = Path(_npz(tmp_path / "flip.npz", **_base()))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("train_images.npy")
    # flip a byte inside the stored array data: the CRC check fails when that array is read
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    data[start] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="flip.npz"):
        load_npz(str(path))
    text = tmp_path / "text.npz"
    text.write_text("not a zip at all")
    with pytest.raises(DataError, match="text.npz"):
        load_npz(str(text))
    with pytest.raises(DataError, match="absent.npz' not found"):
        load_npz(str(tmp_path / "absent.npz"))


def test_save_npz_round_trip_and_refusals(tmp_path):
    labels = np.eye(3, dtype=np.float32)[[0, 2, 1, 2]]
    split = Split(np.arange(64, dtype=np.uint8).reshape(4, 4, 4), labels, np.ones_like(labels, bool),
                  np.array(["i0", "i1", "i2", "i3"], dtype=object), np.array([1, 1, 2, 3]))
    data = Dataset("single-label", ["a", "b", "c"], {"train": split}, source="mem")
    save_npz(data, str(tmp_path / "s.npz"))
    back = load_npz(str(tmp_path / "s.npz"))
    assert back.splits["train"].labels.tolist() == labels.tolist()
    assert back.splits["train"].ids.tolist() == ["i0", "i1", "i2", "i3"]  # object ids stored as text
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]  # no temporary file left behind
    partial = Split(split.images, labels * [1, 1, 0], np.tile([True, True, False], (4, 1)))
    with pytest.raises(DataError, match="unannotated entries"):
        save_npz(Dataset("single-label", ["a", "b", "c"], {"train": partial}), str(tmp_path / "p.npz"))


# ---- site files ---------------------------------------------------------------------------------
def _site(site="site-1", task="multi-label", n=3):
    labels = np.array([[1, 0], [0, 0], [1, 1]], np.float32)[:n]
    mask = np.array([[1, 0], [1, 0], [1, 1]], bool)[:n]
    val = Split(np.zeros((1, 4, 4), np.uint8), np.array([[0, 1]], np.float32), np.ones((1, 2), bool))
    return Dataset(task, ["p", "q"], {"train": Split(np.zeros((n, 4, 4), np.uint8), labels, mask,
                                                      np.arange(n), np.array([5, 5, 6])[:n]), "val": val},
                   source="mem", site=site, info={"scenario": "missing-classes", "n": np.int64(3)})


def test_site_file_round_trip(tmp_path):
    write_site_file(str(tmp_path / "site-1.npz"), _site())
    back = load_site_file(str(tmp_path / "site-1.npz"), expected_site="site-1")
    assert back.site == "site-1" and back.info == {"scenario": "missing-classes", "n": 3}
    assert back.splits["train"].label_mask.tolist() == [[True, False], [True, False], [True, True]]
    assert back.splits["train"].groups.tolist() == [5, 5, 6] and back.splits["val"].label_mask.all()
    assert load_npz(str(tmp_path / "site-1.npz")).site == "site-1"  # load_npz delegates to sitefile


def _rewrite(path, **changes):
    arrays = dict(np.load(path))
    arrays.update(changes)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("changes, message", [
    ({"train_label_mask": np.ones((3, 3), np.uint8)}, r"'train_label_mask' has shape \(3, 3\), labels \(3, 2\)"),
    ({"train_label_mask": np.array([[1, 0], [1, 0], [1, 0]], np.uint8)},
     r"marks entry \(2, 1\) \(class 'q'\) unannotated but its label is 1"),
    ({"train_labels": np.array([[1, 0], [0, 0], [2, 1]], np.uint8)}, r"entry \(2, 0\) is 2"),
    ({"train_label_mask": None}, "lacks 'train_label_mask'"),
    ({"task": np.array("regression")}, "task 'regression'"),
])
def test_bad_site_files(tmp_path, changes, message):
    path = tmp_path / "site-1.npz"
    write_site_file(str(path), _site())
    with pytest.raises(DataError, match=message) as err:
        load_site_file(_rewrite(path, **changes))
    assert "site-1.npz" in str(err.value)


def test_site_name_and_empty_train(tmp_path):
    write_site_file(str(tmp_path / "a.npz"), _site("site-2"))
    with pytest.raises(DataError, match="belongs to site 'site-2', not 'site-1'"):
        load_site_file(str(tmp_path / "a.npz"), expected_site="site-1")
    write_site_file(str(tmp_path / "b.npz"), _site("site-3", n=0))
    with pytest.raises(DataError, match=r"site 'site-3' has no training images in '.*b.npz'"):
        load_site_file(str(tmp_path / "b.npz"))


def test_segmentation_site_masks_must_be_binary(tmp_path):
    masks = np.zeros((2, 4, 4), np.uint8)
    masks[0, 0, 0] = 3  # an instance id: site files hold 0/1 foreground only
    data = Dataset("segmentation", ["lesion"], {"train": Split(np.zeros((2, 4, 4), np.uint8), masks)}, site="site-1")
    write_site_file(str(tmp_path / "s.npz"), data)
    with pytest.raises(DataError, match="binary 0/1 lesion mask"):
        load_site_file(str(tmp_path / "s.npz"))


# ---- DICOM ----------------------------------------------------------------------------------------
def _dicom(path, pixels, slope=1.0, intercept=0.0, photometric="MONOCHROME2", window=None):
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.BitsAllocated, ds.BitsStored, ds.HighBit = 1, 16, 16, 15
    ds.PixelRepresentation = 0
    ds.PhotometricInterpretation = photometric
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if window:
        ds.WindowCenter, ds.WindowWidth = window
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    ds.save_as(str(path), enforce_file_format=True)


RAW = np.array([[0, 100], [150, 400]], np.uint16)  # slope 2, intercept -100 -> [[-100, 100], [200, 700]]


def test_dicom_pixel_values_by_hand(tmp_path):
    from fedpartial_tools.data.dicom import dicom_to_uint8

    _dicom(tmp_path / "own.dcm", RAW, slope=2, intercept=-100, window=(0, 400))
    # the file's window: centre 0 width 400 -> [-200, 200]; -100 -> 0.25*255 = 63.75 -> 64,
    # 100 -> 0.75*255 = 191.25 -> 191, 200 -> 255, 700 -> 255 (clipped)
    assert dicom_to_uint8(str(tmp_path / "own.dcm")).tolist() == [[64, 191], [255, 255]]
    # window given as argument: centre 150 width 200 -> [50, 250]; -100 -> 0, 100 -> 64, 200 -> 191, 700 -> 255
    assert dicom_to_uint8(str(tmp_path / "own.dcm"), window=(150, 200)).tolist() == [[0, 64], [191, 255]]
    _dicom(tmp_path / "m1.dcm", RAW, slope=2, intercept=-100, photometric="MONOCHROME1")
    # no window in the file: min-max [-100, 700] -> 0, 0.25, 0.375, 1; MONOCHROME1 inverts:
    # 255, 0.75*255 = 191.25 -> 191, 0.625*255 = 159.375 -> 159, 0
    assert dicom_to_uint8(str(tmp_path / "m1.dcm")).tolist() == [[255, 191], [159, 0]]


def test_dicom_manifest_forms(tmp_path):
    from fedpartial_tools.data.dicom import load_dicom_folder

    for name in ("a", "b", "c"):
        _dicom(tmp_path / f"{name}.dcm", RAW, window=(200, 400))
    (tmp_path / "single.csv").write_text("file,split,label,patient_id\na.dcm,train,2,p1\nb.dcm,train,0,p1\n"
                                         "c.dcm,val,1,p2\n")
    single = load_dicom_folder(str(tmp_path), str(tmp_path / "single.csv"), size=(4, 4))
    assert single.task == "single-label" and single.class_names == ["class_0", "class_1", "class_2"]
    assert single.splits["train"].labels.tolist() == [[0, 0, 1], [1, 0, 0]]
    assert single.splits["train"].images.shape == (2, 4, 4) and single.splits["train"].groups.tolist() == ["p1", "p1"]
    (tmp_path / "names.csv").write_text("file,split,label\na.dcm,train,bleed|fracture\nb.dcm,train,\n")
    names = load_dicom_folder(str(tmp_path), str(tmp_path / "names.csv"))
    assert names.task == "multi-label" and names.class_names == ["bleed", "fracture"]
    assert names.splits["train"].labels.tolist() == [[1, 1], [0, 0]]
    (tmp_path / "cols.csv").write_text("file,split,bleed,fracture\na.dcm,train,0,1\nb.dcm,test,1,1\n")
    cols = load_dicom_folder(str(tmp_path), str(tmp_path / "cols.csv"))
    assert cols.task == "multi-label" and cols.splits["train"].labels.tolist() == [[0, 1]]
    assert cols.splits["test"].labels.tolist() == [[1, 1]]


@pytest.mark.parametrize("rows, message", [
    ("a.dcm,training,0", "line 2: split 'training'"),
    ("gone.dcm,train,0", "gone.dcm' not found"),
    ("bad.dcm,train,0", "DICOM file '.*bad.dcm' is unreadable"),
    ("a.dcm,train,5", "line 2: class 5 outside 0..1"),
])
def test_dicom_errors_name_the_line_or_file(tmp_path, rows, message):
    from fedpartial_tools.data.dicom import load_dicom_folder

    _dicom(tmp_path / "a.dcm", RAW)
    (tmp_path / "bad.dcm").write_bytes(b"DICM but not really")
    (tmp_path / "m.csv").write_text("file,split,label\n" + rows + "\n")
    with pytest.raises(DataError, match=message):
        load_dicom_folder(str(tmp_path), str(tmp_path / "m.csv"), class_names=["no", "yes"])


# ---- NIfTI ----------------------------------------------------------------------------------------
def _nifti(path, array):
    import nibabel as nib

    nib.save(nib.Nifti1Image(array, np.eye(4)), str(path))
    return str(path)


def test_nifti_slices_scaling_and_binarisation(tmp_path):
    from fedpartial_tools.data.nifti import load_nifti_pairs

    volume = np.arange(60, dtype=np.float32).reshape(4, 5, 3)  # voxel (i, j, k) = 15i + 3j + k
    mask = np.zeros((4, 5, 3), np.float32)
    mask[1, 1, 0], mask[2, 2, 0], mask[0, 0, 2] = 2, 5, 1  # labels 2 and 5 binarise to 1
    img, msk = _nifti(tmp_path / "img.nii.gz", volume), _nifti(tmp_path / "msk.nii.gz", mask)
    data = load_nifti_pairs([img], [msk], axis=2)
    train = data.splits["train"]
    assert train.images.shape == (3, 4, 5) and train.labels.shape == (3, 4, 5)
    # percentiles of 0..59: 0.5 % -> 0.295, 99.5 % -> 58.705; voxel 30 = (2, 0, 0) on slice 0:
    # (30 - 0.295) / 58.41 * 255 = 129.68 -> 130; voxel 0 -> 0; voxel 59 = (3, 4, 2) -> 255
    assert train.images[0, 2, 0] == 130 and train.images[0, 0, 0] == 0 and train.images[2, 3, 4] == 255
    assert train.labels.max() == 1 and train.labels.sum(axis=(1, 2)).tolist() == [2, 0, 1]
    assert train.groups.tolist() == [0, 0, 0] and train.ids.tolist() == ["0:0", "0:1", "0:2"]
    along0 = load_nifti_pairs([img], [msk], axis=0, keep_empty_slices=False)
    # along axis 0 the lesion voxels sit on slices i = 0, 1, 2 (slice 3 is empty and dropped)
    assert along0.splits["train"].images.shape == (3, 5, 3)
    two = load_nifti_pairs([img, img], [msk, msk], splits=["train", "val"], size=8)
    assert two.splits["val"].images.shape == (3, 8, 8) and two.splits["val"].groups.tolist() == [1, 1, 1]


def test_nifti_shape_mismatch_names_both_files(tmp_path):
    from fedpartial_tools.data.nifti import load_nifti_pairs

    img = _nifti(tmp_path / "vol.nii.gz", np.zeros((4, 5, 3), np.float32))
    msk = _nifti(tmp_path / "short_mask.nii.gz", np.zeros((4, 5, 2), np.float32))
    with pytest.raises(DataError, match="vol.nii.gz.*short_mask.nii.gz"):
        load_nifti_pairs([img], [msk])
    (tmp_path / "junk.nii.gz").write_bytes(b"junk")
    with pytest.raises(DataError, match="junk.nii.gz"):
        load_nifti_pairs([str(tmp_path / "junk.nii.gz")], [msk])
    with pytest.raises(DataError, match="1 split names for 2 volumes"):
        load_nifti_pairs([img, img], [msk, msk], splits=["train"])
