"""`python -m fedpartial import`: DICOM (the real files shipped with pydicom), PNG/JPEG + CSV and
NIfTI pairs into site files; blank label cells = not annotated at this site. Every expected number
below is worked out by hand (or from the raw pixels with the formula), not copied from a run."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedpartial_tools.cli import main as cli
from fedpartial.data.sitefile import load_site_file
from fedpartial.data.types import DataError

REPO = Path(__file__).resolve().parents[1]


def _testdata(name, folder, new_name=None):
    from pydicom.data import get_testdata_file

    src = get_testdata_file(name, download=False)
    if not src:
        pytest.skip(f"pydicom test file {name} is not installed")
    return shutil.copy(src, folder / (new_name or name))


# ---- DICOM ----------------------------------------------------------------------------------------
def test_dicom_blank_cells_are_unannotated(tmp_path):
    from fedpartial_tools.data.dicom import load_dicom_folder

    _testdata("CT_small.dcm", tmp_path)
    _testdata("MR_small.dcm", tmp_path)
    # no split column: a site's own data is all train; blank = this site did not annotate it
    (tmp_path / "labels.csv").write_text("file,bleed,fracture,tumour,patient_id\n"
                                         "CT_small.dcm,1,,0,p7\n"
                                         "MR_small.dcm,0.0,,1.0,\n")
    data = load_dicom_folder(str(tmp_path), str(tmp_path / "labels.csv"), size=32, allow_mixed_modality=True)
    train = data.splits["train"]
    assert list(data.splits) == ["train"] and data.task == "single-label"  # no row has two 1s
    assert data.class_names == ["bleed", "fracture", "tumour"]
    assert train.labels.tolist() == [[1, 0, 0], [0, 0, 1]]
    assert train.label_mask.tolist() == [[True, False, True], [True, False, True]]
    assert train.images.shape == (2, 32, 32) and train.images.dtype == np.uint8
    assert train.ids.tolist() == ["CT_small.dcm", "MR_small.dcm"] and train.groups.tolist() == ["p7", "MR_small.dcm"]


def test_dicom_window_presets_by_hand(tmp_path):
    import pydicom

    from fedpartial_tools.data.dicom import WINDOW_PRESETS, dicom_to_uint8, parse_window

    path = _testdata("CT_small.dcm", tmp_path)
    ds = pydicom.dcmread(path)
    assert (float(ds.RescaleSlope), float(ds.RescaleIntercept)) == (1.0, -1024.0) and "WindowCenter" not in ds
    raw = ds.pixel_array
    # pixel (0, 49): raw 1053 -> HU 29. brain (40, 80) -> [0, 80]: 29/80*255 = 92.44 -> 92
    assert int(raw[0, 49]) == 1053
    brain = dicom_to_uint8(path, "brain")
    assert brain[0, 49] == 92
    # pixel (0, 0): raw 175 -> HU -849. lung (-600, 1500) -> [-1350, 150]: 501/1500*255 = 85.17 -> 85
    assert int(raw[0, 0]) == 175 and dicom_to_uint8(path, "lung")[0, 0] == 85
    # bone (400, 1800) -> [-500, 1300]: (-849 + 500) < 0 -> 0; (29 + 500)/1800*255 = 74.94 -> 75
    bone = dicom_to_uint8(path, "bone")
    assert bone[0, 0] == 0 and bone[0, 49] == 75
    assert parse_window("soft-tissue") == parse_window("abdomen") == (40.0, 400.0) == WINDOW_PRESETS["abdomen"]
    assert (dicom_to_uint8(path, "40,80") == brain).all()
    # the whole image against the formula, computed here from the raw pixels
    hu = raw.astype(np.float64) * 1.0 - 1024.0
    expected = np.round(np.clip((hu - 0.0) / 80.0, 0, 1) * 255).astype(np.uint8)
    assert (brain == expected).all()
    with pytest.raises(DataError, match="window 'liver'"):
        parse_window("liver")


def test_dicom_monochrome1_is_inverted(tmp_path):
    import pydicom

    from fedpartial_tools.data.dicom import dicom_to_uint8

    ds = pydicom.dcmread(_testdata("CT_small.dcm", tmp_path))
    ds.PhotometricInterpretation = "MONOCHROME1"
    ds.save_as(str(tmp_path / "m1.dcm"))
    # brain window at pixel (0, 49): 29/80 = 0.3625 -> inverted 0.6375*255 = 162.56 -> 163
    assert dicom_to_uint8(str(tmp_path / "m1.dcm"), "brain")[0, 49] == 163


def test_dicom_multi_frame_gives_one_image_per_frame(tmp_path):
    import pydicom

    from fedpartial_tools.data.dicom import load_dicom_folder

    _testdata("rtdose.dcm", tmp_path)
    _testdata("rtdose.dcm", tmp_path, "rtdose_b.dcm")
    assert int(pydicom.dcmread(tmp_path / "rtdose.dcm").NumberOfFrames) == 15
    (tmp_path / "m.csv").write_text("file,split,dose_high,dose_low\nrtdose.dcm,train,1,\nrtdose_b.dcm,test,0,1\n")
    data = load_dicom_folder(str(tmp_path), str(tmp_path / "m.csv"))
    train, test = data.splits["train"], data.splits["test"]
    assert train.images.shape == (15, 10, 10) and test.images.shape == (15, 10, 10)
    assert train.ids.tolist() == [f"rtdose.dcm:{i}" for i in range(15)]
    assert train.labels.tolist() == [[1, 0]] * 15 and train.label_mask.tolist() == [[True, False]] * 15
    assert test.labels.tolist() == [[0, 1]] * 15 and test.label_mask.all()
    # no window in the file: min-max over the whole series -> the darkest voxel 0, the brightest 255
    assert train.images.min() == 0 and train.images.max() == 255


# ---- PNG / JPEG -----------------------------------------------------------------------------------
def _png(path, array, mode=None):
    from PIL import Image

    Image.fromarray(array, mode).save(path) if mode else Image.fromarray(array).save(path)
    return path


def test_png_rgb_and_blank_cells(tmp_path):
    from fedpartial_tools.data.images import load_image_folder

    a = np.zeros((6, 6, 3), np.uint8)
    a[..., 0] = 200  # red
    b = np.full((6, 6, 3), 10, np.uint8)
    b[0, 0] = (30, 60, 90)
    _png(tmp_path / "ISIC_1.png", a)
    _png(tmp_path / "ISIC_2.jpg", b)  # JPEG is lossy: only its shape is checked
    rgba = np.zeros((6, 6, 4), np.uint8)
    rgba[..., 2], rgba[..., 3] = 77, 128
    _png(tmp_path / "ISIC_3.png", rgba)
    (tmp_path / "gt.csv").write_text("image,MEL,NV,BCC,split\nISIC_1,1.0,0.0,,train\nISIC_2,0,1,,train\n"
                                     "ISIC_3,,,1,val\n")
    data = load_image_folder(str(tmp_path), str(tmp_path / "gt.csv"))
    train, val = data.splits["train"], data.splits["val"]
    assert data.class_names == ["MEL", "NV", "BCC"] and train.images.shape == (2, 6, 6, 3)
    assert train.images[0, 3, 3].tolist() == [200, 0, 0]
    assert val.images[0, 0, 0].tolist() == [0, 0, 77]  # RGBA -> RGB, alpha dropped
    assert train.labels.tolist() == [[1, 0, 0], [0, 1, 0]] and val.labels.tolist() == [[0, 0, 1]]
    assert train.label_mask.tolist() == [[True, True, False], [True, True, False]]
    assert val.label_mask.tolist() == [[False, False, True]]
    assert train.ids.tolist() == ["ISIC_1", "ISIC_2"]


def test_png_grey_nih_labels_16bit_and_resize(tmp_path):
    from fedpartial_tools.data.images import image_to_uint8, load_image_folder

    _png(tmp_path / "x1.png", np.arange(16, dtype=np.uint8).reshape(4, 4) * 10)
    deep = np.array([[1000, 2000], [3000, 5000]], np.uint16)
    _png(tmp_path / "x2.png", deep)  # 16-bit grey
    _png(tmp_path / "x3.png", np.full((4, 4, 3), 50, np.uint8))  # RGB holding grey (NIH's few RGBA files)
    (tmp_path / "Data_Entry.csv").write_text(
        "Image Index,Finding Labels,Patient ID,Patient Age\n"
        "x1.png,Effusion|Mass,11,40\nx2.png,No Finding,11,40\nx3.png,Mass,12,63\n")
    data = load_image_folder(str(tmp_path), str(tmp_path / "Data_Entry.csv"),
                             class_names=["Effusion", "Mass", "Nodule"], size=4, annotated_classes=["Effusion", "Mass"])
    train = data.splits["train"]
    assert data.task == "multi-label" and train.images.shape == (3, 4, 4)  # all grey
    assert train.images[0].tolist() == (np.arange(16).reshape(4, 4) * 10).tolist()
    assert train.images[2].tolist() == [[50] * 4] * 4
    assert train.labels.tolist() == [[1, 1, 0], [0, 0, 0], [0, 1, 0]]
    assert train.label_mask.tolist() == [[True, True, False]] * 3 and train.groups.tolist() == ["11", "11", "12"]
    # 16-bit min-max per image: 1000 -> 0, 2000 -> 1000/4000*255 = 63.75 -> 64, 3000 -> 127.5 -> 128, 5000 -> 255
    assert image_to_uint8(str(tmp_path / "x2.png")).tolist() == [[0, 64], [128, 255]]
    with pytest.raises(DataError, match=r"differ in size: 4x4 \(first on line 2\), 2x2 \(first on line 3\)"):
        load_image_folder(str(tmp_path), str(tmp_path / "Data_Entry.csv"))


def test_png_single_label_column_and_palette(tmp_path):
    from PIL import Image

    from fedpartial_tools.data.images import load_image_folder

    palette = Image.new("P", (3, 3))
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    palette.putpixel((1, 1), 1)
    palette.save(tmp_path / "p.png")
    _png(tmp_path / "q.png", np.zeros((3, 3, 3), np.uint8) + np.array([5, 6, 7], np.uint8))
    (tmp_path / "l.csv").write_text("file,label\np.png,cat\nq.png,\n")
    data = load_image_folder(str(tmp_path), str(tmp_path / "l.csv"), class_names=["cat", "dog"], task="single-label",
                             annotated_classes=["cat"])
    train = data.splits["train"]
    assert train.images[0, 1, 1].tolist() == [10, 20, 30] and train.images[1, 0, 0].tolist() == [5, 6, 7]
    # q: blank label -> "a class this site does not annotate": all-zero labels, 'dog' unannotated
    assert train.labels.tolist() == [[1, 0], [0, 0]] and train.label_mask.tolist() == [[True, False]] * 2


# ---- NIfTI ----------------------------------------------------------------------------------------
def _nifti(path, array):
    import nibabel as nib

    nib.save(nib.Nifti1Image(array, np.eye(4)), str(path))
    return str(path)


def _volumes(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "msk").mkdir()
    rng = np.random.default_rng(0)
    mask1 = np.zeros((8, 8, 5), np.float32)
    mask1[2:4, 2:4, 1] = 1  # 4 voxels on slice 1
    mask1[5, 5, 3] = 2  # 1 voxel on slice 3 (label 2 binarises to 1)
    mask2 = np.zeros((8, 8, 4), np.float32)
    mask2[0:3, 0:2, 0] = 1  # 6 voxels on slice 0
    _nifti(tmp_path / "img" / "p1.nii.gz", rng.random((8, 8, 5)).astype(np.float32))
    _nifti(tmp_path / "img" / "p2.nii.gz", rng.random((8, 8, 4)).astype(np.float32))
    _nifti(tmp_path / "msk" / "p1_seg.nii.gz", mask1)
    _nifti(tmp_path / "msk" / "p2_seg.nii.gz", mask2)


def test_nifti_folders_pairs_csv_and_empty_slices(tmp_path):
    from fedpartial_tools.data.nifti import load_nifti_pairs, pair_nifti_files, read_pairs_csv

    _volumes(tmp_path)
    images, masks, names = pair_nifti_files(str(tmp_path / "img"), str(tmp_path / "msk" / "*_seg.nii.gz"))
    assert [Path(m).name for m in masks] == ["p1_seg.nii.gz", "p2_seg.nii.gz"] and names == ["p1", "p2"]
    data = load_nifti_pairs(images, masks, axis=2, patient_ids=names)
    train = data.splits["train"]
    assert len(train) == 5 + 4 and train.labels.max() == 1
    assert train.labels.sum(axis=(1, 2)).tolist() == [0, 4, 0, 1, 0, 6, 0, 0, 0]
    assert train.ids.tolist()[:2] == ["p1:0", "p1:1"] and train.groups.tolist()[-1] == "p2"
    dropped = load_nifti_pairs(images, masks, axis=2, keep_empty_slices=False, patient_ids=names).splits["train"]
    assert dropped.ids.tolist() == ["p1:1", "p1:3", "p2:0"] and dropped.labels.sum() == 11
    (tmp_path / "pairs.csv").write_text("image,mask,split\nimg/p1.nii.gz,msk/p1_seg.nii.gz,train\n"
                                        "img/p2.nii.gz,msk/p2_seg.nii.gz,test\n")
    images, masks, splits, names = read_pairs_csv(str(tmp_path / "pairs.csv"))
    assert splits == ["train", "test"] and names == ["p1", "p2"]
    along0 = load_nifti_pairs(images, masks, axis=0, splits=splits, patient_ids=names, size=6)
    assert along0.splits["train"].images.shape == (8, 6, 6) and len(along0.splits["test"]) == 8


# ---- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("csv_text, message", [
    ("file,a,b\ngarbage.dcm,1,0\n", r"DICOM file '.*garbage.dcm' is unreadable"),
    ("file,a,b\ngone.dcm,1,0\n", r"line 2, column 'file': DICOM file '.*gone.dcm' not found"),
    ("file,a,b\nCT_small.dcm,1,0\nMR_small.dcm,0,2\n", r"m.csv' line 3, column 'b': '2' is not 1, 0 or blank"),
    ("file,a,b\nCT_small.dcm,1,yes\n", r"line 2, column 'b': 'yes'"),
    ("file,a,b\nCT_small.dcm,1,0\nMR_small.dcm,0,1\nCT_small.dcm,0,0\n",
     "'CT_small.dcm' is listed twice, on lines 2 and 4"),
    ("file,a,b\n", "m.csv' lists no images"),
    ("", "m.csv' is empty"),
    ("name,a,b\nCT_small.dcm,1,0\n", "has no id column"),
    ("file,split,a\nCT_small.dcm,training,1\n", "line 2: split 'training'"),
])
def test_dicom_errors_name_file_row_and_column(tmp_path, csv_text, message):
    from fedpartial_tools.data.dicom import load_dicom_folder

    _testdata("CT_small.dcm", tmp_path)
    _testdata("MR_small.dcm", tmp_path)
    (tmp_path / "garbage.dcm").write_bytes(b"\x00\x01 not a DICOM file at all " * 20)
    (tmp_path / "m.csv").write_text(csv_text)
    with pytest.raises(DataError, match=message):
        load_dicom_folder(str(tmp_path), str(tmp_path / "m.csv"), size=16)


def test_image_and_nifti_errors(tmp_path):
    from fedpartial_tools.data.images import load_image_folder
    from fedpartial_tools.data.nifti import load_nifti_pairs, pair_nifti_files

    _png(tmp_path / "ok.png", np.zeros((4, 4), np.uint8))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "a.csv").write_text("image_id,x\nbroken,1\n")
    with pytest.raises(DataError, match="broken.png' is unreadable"):
        load_image_folder(str(tmp_path), str(tmp_path / "a.csv"))
    (tmp_path / "b.csv").write_text("image_id,x\nmissing,1\n")
    with pytest.raises(DataError, match=r"line 2, column 'image_id': image '.*missing' not found \(also tried"):
        load_image_folder(str(tmp_path), str(tmp_path / "b.csv"))
    (tmp_path / "c.csv").write_text("file,label\nok.png,cat\n")
    with pytest.raises(DataError, match=r"line 2: class 'cat' is not one of \['dog'\] \(column 'label'\)"):
        load_image_folder(str(tmp_path), str(tmp_path / "c.csv"), class_names=["dog"])
    img = _nifti(tmp_path / "vol.nii.gz", np.zeros((4, 5, 3), np.float32))
    msk = _nifti(tmp_path / "vol_mask.nii.gz", np.zeros((4, 5, 2), np.float32))
    with pytest.raises(DataError, match=r"image '.*vol.nii.gz' has shape \(4, 5, 3\) but mask '.*vol_mask.nii.gz'"):
        load_nifti_pairs([img], [msk])
    (tmp_path / "lonely").mkdir()
    _nifti(tmp_path / "lonely" / "q.nii.gz", np.zeros((2, 2, 2), np.float32))
    with pytest.raises(DataError, match=r"images without a mask \['.*q.nii.gz'\]"):
        pair_nifti_files(str(tmp_path / "lonely"), str(tmp_path / "vol_mask.nii.gz"))


# ---- bad inputs: NaN / Inf, windows, modalities, affines, damaged CSVs ------------------------------
def _float_dicom(path, pixels):
    """A single-frame DICOM file with 32-bit float pixel data (Float Pixel Data)."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.BitsAllocated, ds.PhotometricInterpretation = 1, 32, "MONOCHROME2"
    ds.FloatPixelData = pixels.astype("<f4").tobytes()
    ds.save_as(str(path), enforce_file_format=True)
    return str(path)


def test_float_pixels_with_nan_or_inf_are_refused(tmp_path):
    import nibabel as nib
    from PIL import Image

    from fedpartial_tools.data.dicom import dicom_to_uint8
    from fedpartial_tools.data.images import image_to_uint8
    from fedpartial_tools.data.nifti import load_nifti_pairs

    # finite floats are min-max scaled: 0, 1, 2, 3 -> 0, 85, 170, 255
    ok = _float_dicom(tmp_path / "ok.dcm", np.array([[0, 1], [2, 3]]))
    assert dicom_to_uint8(ok).tolist() == [[0, 85], [170, 255]]
    bad = _float_dicom(tmp_path / "bad.dcm", np.array([[0, np.nan], [np.inf, 3]]))
    with pytest.raises(DataError, match=r"^DICOM file '.*bad.dcm' holds 2 NaN / Inf value\(s\), the first \(nan\) at "
                                        r"frame 0, row 0, column 1; they map to no grey level$"):
        dicom_to_uint8(bad)
    Image.fromarray(np.array([[0, 1], [2, 3]], np.float32), "F").save(tmp_path / "ok.tif")
    assert image_to_uint8(str(tmp_path / "ok.tif")).tolist() == [[0, 85], [170, 255]]
    Image.fromarray(np.array([[0, 1], [-np.inf, 3]], np.float32), "F").save(tmp_path / "bad.tif")
    with pytest.raises(DataError, match=r"^image '.*bad.tif' holds 1 NaN / Inf value\(s\), the first \(-inf\) at "
                                        r"row 1, column 0; they map to no grey level$"):
        image_to_uint8(str(tmp_path / "bad.tif"))
    volume = np.zeros((3, 4, 2), np.float32)
    volume[1, 2, 0] = np.nan
    nib.save(nib.Nifti1Image(volume, np.eye(4)), str(tmp_path / "vol.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((3, 4, 2), np.float32), np.eye(4)), str(tmp_path / "vol_mask.nii.gz"))
    with pytest.raises(DataError, match=r"^NIfTI file '.*vol.nii.gz' holds 1 NaN / Inf value\(s\), the first \(nan\) "
                                        r"at i 1, j 2, k 0; they map to no grey level$"):
        load_nifti_pairs([str(tmp_path / "vol.nii.gz")], [str(tmp_path / "vol_mask.nii.gz")])


@pytest.mark.filterwarnings("ignore:Invalid value for VR DS")  # pydicom's own warning about 'NaN'
@pytest.mark.parametrize("width, shown", [("0", "0.0"), ("-80", "-80.0"), ("NaN", "nan")])
def test_dicom_window_width_must_be_a_finite_number_above_0(tmp_path, width, shown):
    import pydicom

    from fedpartial_tools.data.dicom import dicom_to_uint8, parse_window

    ds = pydicom.dcmread(_testdata("CT_small.dcm", tmp_path))
    ds.WindowCenter, ds.WindowWidth = "40", width
    ds.save_as(str(tmp_path / "w.dcm"))
    with pytest.raises(DataError, match=rf"^DICOM file '.*w.dcm': its window \(WindowCenter 40.0, WindowWidth "
                                        rf"{shown}\) needs a finite centre and a finite width > 0; pass --window"):
        dicom_to_uint8(str(tmp_path / "w.dcm"))
    # a window given at import replaces the file's: pixel (0, 49) is HU 29 -> 92 in the brain window
    assert dicom_to_uint8(str(tmp_path / "w.dcm"), "brain")[0, 49] == 92
    with pytest.raises(DataError, match=rf"^window '40,{width}': width must be a finite number > 0$"):
        parse_window(f"40,{width}")


@pytest.mark.filterwarnings("ignore:Invalid value for VR DS")  # pydicom's own warning about 'NaN'
def test_dicom_rescale_must_be_finite(tmp_path):
    import pydicom

    from fedpartial_tools.data.dicom import dicom_to_uint8

    ds = pydicom.dcmread(_testdata("CT_small.dcm", tmp_path))
    ds.RescaleSlope = "NaN"
    ds.save_as(str(tmp_path / "r.dcm"))
    with pytest.raises(DataError, match=r"^DICOM file '.*r.dcm': RescaleSlope nan / RescaleIntercept -1024.0 must be "
                                        r"finite numbers$"):
        dicom_to_uint8(str(tmp_path / "r.dcm"), "brain")


def test_window_centre_must_be_finite():
    from fedpartial_tools.data.dicom import parse_window

    with pytest.raises(DataError, match=r"^window 'nan,80': centre must be a finite number$"):
        parse_window("nan,80")
    with pytest.raises(DataError, match=r"width must be a finite number > 0"):
        parse_window((40.0, float("inf")))


def test_dicom_modalities_do_not_mix_unless_allowed(tmp_path, capsys):
    from fedpartial_tools.data.dicom import load_dicom_folder

    _testdata("CT_small.dcm", tmp_path)
    _testdata("CT_small.dcm", tmp_path, "CT_b.dcm")
    _testdata("MR_small.dcm", tmp_path)
    (tmp_path / "m.csv").write_text("file,a\nCT_small.dcm,1\nCT_b.dcm,0\nMR_small.dcm,1\n")
    with pytest.raises(DataError, match=r"^manifest '.*m.csv' line 4, column 'file': DICOM file '.*MR_small.dcm' is MR "
                                        r"but '.*CT_small.dcm' \(line 2\) is CT; one site's images are expected from "
                                        r"one modality \(pass --allow-mixed-modality to import them together\)$"):
        load_dicom_folder(str(tmp_path), str(tmp_path / "m.csv"), size=16)
    data = load_dicom_folder(str(tmp_path), str(tmp_path / "m.csv"), size=16, allow_mixed_modality=True)
    assert len(data.splits["train"]) == 3 and data.info["modalities"] == ["CT", "MR"]
    # the CLI without the flag: a one-line error, no site file
    with pytest.raises(SystemExit) as e:
        cli(["import", "dicom", "--folder", str(tmp_path), "--labels", str(tmp_path / "m.csv"), "--site", "s",
             "--out", str(tmp_path / "s.npz"), "--size", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "is MR but" in err and not (tmp_path / "s.npz").exists()


def test_nifti_image_and_mask_affines_must_agree(tmp_path):
    import nibabel as nib

    from fedpartial_tools.data.nifti import load_nifti_pairs

    volume = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    nib.save(nib.Nifti1Image(volume, np.eye(4)), str(tmp_path / "p.nii.gz"))
    shifted = np.eye(4)
    shifted[0, 3] = 2.5  # the mask's grid starts 2.5 mm further along x
    nib.save(nib.Nifti1Image(np.zeros_like(volume), shifted), str(tmp_path / "p_mask.nii.gz"))
    with pytest.raises(DataError, match=r"^image '.*p.nii.gz' and mask '.*p_mask.nii.gz' have different affines "
                                        r"\(voxel-to-world; entries differ by up to 2.5\): image \[\[1.0, 0.0, 0.0, "
                                        r"0.0\], .*mask \[\[1.0, 0.0, 0.0, 2.5\], .*does not lie on its image's voxel "
                                        r"grid$"):
        load_nifti_pairs([str(tmp_path / "p.nii.gz")], [str(tmp_path / "p_mask.nii.gz")])
    rounded = np.eye(4)
    rounded[0, 3] = 1e-5  # float32 header rounding: the same grid
    nib.save(nib.Nifti1Image(np.zeros_like(volume), rounded), str(tmp_path / "p_mask.nii.gz"))
    assert len(load_nifti_pairs([str(tmp_path / "p.nii.gz")], [str(tmp_path / "p_mask.nii.gz")]).splits["train"]) == 4


@pytest.mark.parametrize("content, message", [
    (b"file,a,b\nok.png,1,0\nok2.png,1\n",
     r"line 3: 2 cells but the header has 3 columns \(no cell for \['b'\]\); a blank cell still needs its comma$"),
    (b"file,a,b,a\nok.png,1,0,1\n", r"line 1: the header names column 'a' twice \(columns 2 and 4\)$"),
    (b"file,a\nok.png,1\ncaf\xe9.png,0\n", r"line 3 is not UTF-8 text \(byte 0xe9\); save the CSV as UTF-8"),
    (b"file,a\nok.png,1\n" + b"x" * 200_000 + b",0\n",
     r"line 3: not valid CSV \(field larger than field limit \(131072\)\)$"),
])
def test_damaged_csv_names_file_and_line(tmp_path, capsys, content, message):
    from fedpartial_tools.data.images import load_image_folder

    _png(tmp_path / "ok.png", np.zeros((4, 4), np.uint8))
    _png(tmp_path / "ok2.png", np.zeros((4, 4), np.uint8))
    (tmp_path / "m.csv").write_bytes(content)
    with pytest.raises(DataError, match=r"^manifest '.*m.csv' " + message):
        load_image_folder(str(tmp_path), str(tmp_path / "m.csv"))
    # through the CLI: one line on stderr, no traceback
    with pytest.raises(SystemExit):
        cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "m.csv"), "--site", "s",
             "--out", str(tmp_path / "s.npz")])
    err = capsys.readouterr().err
    assert err.startswith(f"error: manifest '{tmp_path / 'm.csv'}' ") and err.count("\n") == 1


def test_pairs_csv_short_row_names_file_and_line(tmp_path):
    from fedpartial_tools.data.nifti import read_pairs_csv

    _volumes(tmp_path)
    (tmp_path / "pairs.csv").write_text("image,mask,split\nimg/p1.nii.gz,msk/p1_seg.nii.gz\n")
    with pytest.raises(DataError, match=r"^pairs CSV '.*pairs.csv' line 2: 2 cells but the header has 3 columns "
                                        r"\(no cell for \['split'\]\)"):
        read_pairs_csv(str(tmp_path / "pairs.csv"))


def test_unreadable_files_and_decompression_bombs_name_the_file(tmp_path, monkeypatch, capsys):
    import PIL.Image

    from fedpartial_tools.data import images
    from fedpartial_tools.data.images import image_to_uint8, read_manifest

    _png(tmp_path / "big.png", np.zeros((6, 6), np.uint8))
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 10)  # PIL refuses images over twice this: 36 > 20
    with pytest.raises(DataError, match=r"^image '.*big.png' is refused by PIL's decompression-bomb guard \(Image "
                                        r"size \(36 pixels\) exceeds limit of 20 pixels"):
        image_to_uint8(str(tmp_path / "big.png"))
    monkeypatch.undo()

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    # running as root ignores file modes, so the refusal is simulated where each reader opens the file
    monkeypatch.setattr(PIL.Image, "open", denied)
    with pytest.raises(DataError, match=r"^image '.*big.png' is unreadable \(PermissionError: \[Errno 13\] Permission "
                                        r"denied: '.*big.png'\)$"):
        image_to_uint8(str(tmp_path / "big.png"))
    (tmp_path / "m.csv").write_text("file,a\nbig.png,1\n")
    monkeypatch.setattr(images, "open", denied, raising=False)
    with pytest.raises(DataError, match=r"^manifest '.*m.csv' cannot be read \(PermissionError: Permission denied\)$"):
        read_manifest(str(tmp_path / "m.csv"))
    monkeypatch.undo()
    # the site file cannot be written: the CLI prints the OSError's one line, which names the file
    monkeypatch.setattr("fedpartial.data.sitefile.write_site_file", lambda path, data: denied(path))
    with pytest.raises(SystemExit) as e:
        cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "m.csv"), "--site", "s",
             "--out", str(tmp_path / "s.npz")])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: [Errno 13] Permission denied: '{tmp_path / 's.npz'}'\n"


def test_nifti_import_prints_no_nvimagecodec_warning(tmp_path, caplog):
    import warnings

    from fedpartial_tools.data.nifti import load_nifti_pairs, pair_nifti_files

    _volumes(tmp_path)
    images, masks, names = pair_nifti_files(str(tmp_path / "img"), str(tmp_path / "msk"))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        load_nifti_pairs(images, masks, patient_ids=names)
    assert [str(w.message) for w in caught] == [] and caplog.records == []


# ---- the task a per-class CSV means -----------------------------------------------------------------
@pytest.mark.parametrize("csv_text, task, reason", [
    # dermoscopy: one class per image, each site annotating some classes (blank = not annotated)
    ("image,MEL,NV,BCC,AK\n1,1,0,,\n2,0,1,,\n3,0,0,,\n4,,,1,0\n", "single-label",
     "no row has more than one class at 1 (pass --task multi-label if one image can hold several classes)"),
    ("image,bleed,fracture,tumour\n1,1,0,\n2,1,1,0\n", "multi-label",
     "line 3 has 2 classes at 1 ['bleed', 'fracture']"),
    ("image,bleed,fracture\n1,1,\n2,0,0\n", "multi-label",
     "line 3 annotates every class and none is 1 (an image with no finding)"),
    ("image,label\n1,cat\n2,dog\n", "single-label", "every 'label' cell holds one class"),
    ("image,label\n1,cat\n2,cat|dog\n", "multi-label", "line 3's 'label' cell lists several classes"),
    ("image,label\n1,cat\n2,\n", "multi-label", "line 3's 'label' cell is empty"),
])
def test_task_is_inferred_from_the_csv_with_a_reason(tmp_path, csv_text, task, reason):
    from fedpartial_tools.data.images import read_manifest

    (tmp_path / "m.csv").write_text(csv_text)
    manifest = read_manifest(str(tmp_path / "m.csv"))
    assert (manifest.task, manifest.task_reason) == (task, reason)
    given = read_manifest(str(tmp_path / "m.csv"), task="multi-label")
    assert (given.task, given.task_reason) == ("multi-label", "given")


def test_import_summary_says_the_task_and_why(tmp_path, capsys):
    for i in range(4):
        _png(tmp_path / f"d{i}.png", np.full((4, 4), 60 * i, np.uint8))
    (tmp_path / "labels.csv").write_text("image_id,MEL,NV,BCC\nd0,1,0,\nd1,0,1,\nd2,0,0,\nd3,1,0,\n")
    cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "labels.csv"), "--site", "h1",
         "--out", str(tmp_path / "h1.npz")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("site 'h1': single-label, 4 images")
    assert lines[1] == ("  task  single-label, inferred: no row has more than one class at 1 (pass --task multi-label "
                        "if one image can hold several classes)")
    data = load_site_file(str(tmp_path / "h1.npz"))
    assert data.task == "single-label" and data.info["task_reason"].startswith("no row has more than one class")
    cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "labels.csv"), "--site", "h1",
         "--out", str(tmp_path / "h1m.npz"), "--task", "multi-label"])
    assert capsys.readouterr().out.splitlines()[1] == "  task  multi-label, given with --task"


# ---- CLI ------------------------------------------------------------------------------------------
def test_cli_import_dicom_writes_site_file_and_summary(tmp_path, capsys):
    _testdata("CT_small.dcm", tmp_path)
    _testdata("MR_small.dcm", tmp_path)
    (tmp_path / "labels.csv").write_text("file,bleed,fracture,tumour\nCT_small.dcm,1,,0\nMR_small.dcm,0,,\n")
    out = tmp_path / "site-3.npz"
    cli(["import", "dicom", "--folder", str(tmp_path), "--labels", str(tmp_path / "labels.csv"), "--site", "site-3",
         "--out", str(out), "--window", "brain", "--size", "16", "--allow-mixed-modality"])
    text = capsys.readouterr().out
    data = load_site_file(str(out), expected_site="site-3")
    assert data.splits["train"].images.shape == (2, 16, 16) and "val" not in data.splits
    assert data.info["kind"] == "dicom" and data.info["window"] == [40.0, 80.0]
    assert data.info["annotated_classes"] == ["bleed", "tumour"]
    assert "train      2 images  16x16  1 channel(s)" in text
    # bleed: annotated 2, positive 1; fracture: annotated nowhere; tumour: annotated 1, positive 0
    assert [line.split() for line in text.splitlines() if line.strip().split()[0] in ("bleed", "fracture", "tumour")] \
        == [["bleed", "2", "1", "0"], ["fracture", "0", "0", "2"], ["tumour", "1", "0", "1"]]
    assert text.splitlines()[1] == ("  task  single-label, inferred: no row has more than one class at 1 (pass --task "
                                    "multi-label if one image can hold several classes)")
    assert ("warning: site 'site-3' does not annotate class(es) ['fracture']: no image of any split has a label "
            "(1 or 0) for them, so the site gives them neither positives nor negatives") in text
    assert data.info["modalities"] == ["CT", "MR"]


def test_scanner_like_ct_slices_round_trip_through_the_brain_window(tmp_path, capsys):
    """The walk-through's DICOM files (int16 stored values, slope 80/255, intercept -1024) give back
    the exact uint8 slices under the brain window (HU = v * 80/255 maps to v); the test rows become
    a test file in the source layout."""
    from fedpartial.data.npz import open_npz
    from fedpartial_tools.data.dicom_example import write_hospital

    images = np.array([np.full((8, 8), v, np.uint8) for v in (0, 1, 128, 255)])
    images[2, 3, 4] = 77
    labels = np.array([[1, 0, 1], [0, 1, 1], [0, 0, 0], [1, 1, 0]])
    write_hospital(str(tmp_path / "h1"), images, labels, [5, 5, 6, 6], ["a", "b", "c"], annotated=[0, 2])
    cli(["import", "dicom", "--folder", str(tmp_path / "h1"), "--labels", str(tmp_path / "h1" / "labels.csv"),
         "--window", "brain", "--site", "site-1", "--out", str(tmp_path / "site-1.npz")])
    site = load_site_file(str(tmp_path / "site-1.npz"))
    train = site.splits["train"]
    np.testing.assert_array_equal(train.images, images)
    np.testing.assert_array_equal(train.label_mask, [[1, 0, 1]] * 4)  # 'b' is blank in the CSV
    np.testing.assert_array_equal(train.labels, [[1, 0, 1], [0, 0, 1], [0, 0, 0], [1, 0, 0]])
    assert train.groups.tolist() == ["P5", "P5", "P6", "P6"]

    write_hospital(str(tmp_path / "test"), images, labels, [1, 2, 3, 4], ["a", "b", "c"], annotated=[0, 1, 2],
                   split="test")
    capsys.readouterr()
    cli(["import", "dicom", "--folder", str(tmp_path / "test"), "--labels", str(tmp_path / "test" / "labels.csv"),
         "--window", "brain", "--site", "test", "--out", str(tmp_path / "test.npz")])
    assert "wrote a test file in the source layout" in capsys.readouterr().out
    arrays = open_npz(str(tmp_path / "test.npz"))
    assert "train_images" not in arrays and "test_label_mask" not in arrays
    np.testing.assert_array_equal(arrays["test_images"], images)
    np.testing.assert_array_equal(arrays["test_labels"], labels)
    assert arrays["label_names"].tolist() == ["a", "b", "c"]


def test_a_test_set_with_a_blank_label_is_refused_naming_image_and_class(tmp_path, capsys):
    from fedpartial_tools.data.dicom_example import write_hospital

    images = np.zeros((2, 8, 8), np.uint8)
    write_hospital(str(tmp_path / "t"), images, np.array([[1, 0], [0, 1]]), [1, 2], ["a", "b"], annotated=[0],
                   split="test")
    with pytest.raises(SystemExit):
        cli(["import", "dicom", "--folder", str(tmp_path / "t"), "--labels", str(tmp_path / "t" / "labels.csv"),
             "--site", "test", "--out", str(tmp_path / "test.npz")])
    assert "image 'patient1/slice00000.dcm' leaves class 'b' blank" in capsys.readouterr().err
    assert not (tmp_path / "test.npz").exists()


def test_cli_import_images_and_nifti(tmp_path, capsys):
    for i in range(6):
        _png(tmp_path / f"im{i}.png", np.full((5, 5), i * 40, np.uint8))
    rows = "".join(f"im{i},{i % 2},{'' if i < 3 else 1 - i % 2},pt{i // 2}\n" for i in range(6))
    (tmp_path / "labels.csv").write_text("image_id,a,b,patient_id\n" + rows)
    cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "labels.csv"),
         "--site", "site-1", "--out", str(tmp_path / "site-1.npz"), "--val-fraction", "0.34", "--seed", "1"])
    text = capsys.readouterr().out
    data = load_site_file(str(tmp_path / "site-1.npz"))
    # 3 patients of 2 images each: round(0.34 * 3) = 1 patient -> 2 images in val, 4 in train
    assert len(data.splits["train"]) == 4 and len(data.splits["val"]) == 2
    assert len(set(data.splits["val"].groups.tolist())) == 1
    assert not set(data.splits["val"].groups.tolist()) & set(data.splits["train"].groups.tolist())
    # a: 6 annotated, positives im1, im3, im5 = 3; b: annotated im3..im5, positive where i even = im4 -> 1
    assert [line.split() for line in text.splitlines() if line.strip().split()[0] in ("a", "b")] \
        == [["a", "6", "3", "0"], ["b", "3", "1", "3"]]
    _volumes(tmp_path)
    cli(["import", "nifti", "--images", str(tmp_path / "img"), "--masks", str(tmp_path / "msk"), "--site", "site-2",
         "--out", str(tmp_path / "seg.npz"), "--drop-empty-slices"])
    text = capsys.readouterr().out
    seg = load_site_file(str(tmp_path / "seg.npz"))
    assert seg.task == "segmentation" and seg.splits["train"].images.shape == (3, 8, 8)
    # slices p1:1 (4 voxels), p1:3 (1), p2:0 (6): 11 lesion pixels of 3 * 64 = 0.05729
    assert "train      3 images  8x8  1 channel(s)  slices with lesions 3  lesion pixel fraction 0.05729" in text
    assert seg.splits["train"].labels.sum() == 11
    with pytest.raises(SystemExit):
        cli(["import", "images", "--folder", str(tmp_path), "--labels", str(tmp_path / "nothing.csv"),
             "--site", "site-1", "--out", str(tmp_path / "x.npz")])
    assert "nothing.csv' not found" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


# ---- end to end -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_imported_sites_train_one_fedavg_round(tmp_path):
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.run.simulator import simulate

    rng = np.random.default_rng(0)
    sites = tmp_path / "sites"
    for k, blank in ((1, "b"), (2, "a")):  # site 1 does not annotate b, site 2 does not annotate a
        folder = tmp_path / f"raw{k}"
        folder.mkdir()
        rows = []
        for i in range(24):
            a, b = i % 2, (i // 2) % 2
            image = (rng.random((32, 32)) * 60).astype(np.uint8)
            image[:16] += np.uint8(120 * a)
            image[:, :16] += np.uint8(60 * b)
            _png(folder / f"{i}.png", image)
            rows.append(f"{i},{'' if blank == 'a' else a},{'' if blank == 'b' else b}\n")
        (folder / "labels.csv").write_text("image_id,a,b\n" + "".join(rows))
        # one class column per site cannot show two 1s in a row, so the task is given
        cli(["import", "images", "--folder", str(folder), "--labels", str(folder / "labels.csv"),
             "--site", f"site-{k}", "--out", str(sites / f"site-{k}.npz"), "--task", "multi-label"])
    summary = simulate(str(REPO / "jobs" / "fedavg"), str(sites), str(tmp_path / "ws"),
                       ["num_rounds=1", "model.arch_args={\"width\": 8, \"depth\": 2}",
                        *dataset_overrides(str(sites))], timeout=240)
    assert summary["exit_code"] == 0 and (tmp_path / "ws" / "global_model.pt").is_file()


@pytest.mark.slow
def test_imported_nifti_sites_train_one_segmentation_round(tmp_path, capsys):
    """NIfTI volumes + lesion masks -> `import nifti` at two sites -> one FedAvg-seg round, then
    `evaluate` on one imported site at its native resolution."""
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.run.simulator import simulate

    rng = np.random.default_rng(1)
    sites = tmp_path / "sites"
    for k in (1, 2):
        raw = tmp_path / f"raw{k}"
        (raw / "img").mkdir(parents=True)
        (raw / "msk").mkdir()
        for p in range(2):
            volume = rng.normal(100, 10, (24, 24, 6)).astype(np.float32)
            mask = np.zeros(volume.shape, np.uint8)
            mask[5 + 3 * p:9 + 3 * p, 6:10, 1:4] = 1  # a bright lesion on 3 of the 6 slices
            volume[mask > 0] += 80
            _nifti(raw / "img" / f"p{p}.nii.gz", volume)
            _nifti(raw / "msk" / f"p{p}_mask.nii.gz", mask.astype(np.float32))
        cli(["import", "nifti", "--images", str(raw / "img"), "--masks", str(raw / "msk"), "--axis", "2",
             "--site", f"site-{k}", "--out", str(sites / f"site-{k}.npz"), "--val-fraction", "0.5"])
    data = load_site_file(str(sites / "site-1.npz"))
    assert data.task == "segmentation" and data.splits["train"].images.shape == (6, 24, 24)
    assert int(data.splits["train"].labels.sum()) == 3 * 16  # 4x4 lesion on 3 slices of the train volume
    summary = simulate(str(REPO / "jobs" / "fedavg_seg"), str(sites), str(tmp_path / "ws"),
                       ["num_rounds=1", *dataset_overrides(str(sites)), "model.input_size=[16,16]"], timeout=240)
    assert summary["ok"], summary["errors"]
    capsys.readouterr()
    cli(["evaluate", "--model", str(tmp_path / "ws" / "global_model.pt"), "--data", str(sites / "site-1.npz"),
         "--json", "--compact"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["split"] == "val" and result["n"] == 6
    assert "24x24" in json.dumps(result) and {"dice_pooled", "dice_per_image"} <= set(result)
