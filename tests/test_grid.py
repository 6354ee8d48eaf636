"""The federation's input agreement (:mod:`fedpartial.data.grid`): resampling, crop / pad and
per-volume intensity worked out by hand; ``import nifti --agreement``; a site file with another
agreement refused at set-up; ``predict nifti`` applying the model's agreement and writing masks
back on the input's grid; ``harmonise`` of a hand-built ``.npz`` and of the two real MS sources.

World coordinates below are the affine's (mm). MONAI's Spacing keeps the world position of the
first voxel's centre, so a 0.5 mm grid starting at 0 becomes a 1 mm grid starting at 0: the
1 mm voxel i sits where the 0.5 mm voxel 2i sat."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpartial.data.grid import (AGREEMENT_KEY, InputAgreement, IntensityRule, agreement_differences,
                                  load_agreement, normalise_intensity, to_agreed_grid)
from fedpartial.data.types import SEGMENTATION, DataError, Dataset, Split

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
NORM = {"mean": 0.5, "std": 0.5}


def _agreement(**changes) -> InputAgreement:
    values = {"spacing_mm": (1.0, 1.0), "size": (20, 20), "orientation": "RAS", "slice_axis": 2,
              "intensity": IntensityRule("median", "above_mean", 128.0)}
    values.update(changes)
    return InputAgreement(**values)


def _cube_volume():
    """0.5 mm isotropic, RAS, 40 x 40 x 8: a 'brain' block at 100 and a 4 x 4 x 4 lesion at 200
    (voxels 16..19 in x and y, slices 2..5)."""
    image = np.zeros((40, 40, 8), np.float32)
    image[4:36, 4:36, :] = 100.0
    image[16:20, 16:20, 2:6] = 200.0
    mask = np.zeros_like(image, np.uint8)
    mask[16:20, 16:20, 2:6] = 1
    return image, mask, np.diag([0.5, 0.5, 0.5, 1.0])


# ---- the agreement ------------------------------------------------------------------------------
def test_shipped_agreement_file_is_the_dataclass_default():
    shipped = load_agreement(str(REPO / "provisioning" / "input_agreement.json"))
    assert shipped == InputAgreement()
    assert shipped.to_dict() == {"spacing_mm": [1.0, 1.0], "size": [192, 224], "orientation": "RAS",
                                 "slice_axis": 2, "intensity": {"rule": "median", "of": "above_mean", "target": 128.0}}


def test_agreement_errors_name_the_key_and_differences_name_the_field():
    with pytest.raises(DataError, match=r"x: unknown key\(s\) \['spacing'\]"):
        InputAgreement.from_dict({"spacing": [1, 1]}, "x")
    with pytest.raises(DataError, match="'size' is \\[192.5, 224\\]"):
        InputAgreement.from_dict({"size": [192.5, 224]})
    with pytest.raises(DataError, match="'orientation' is 'RAR'"):
        InputAgreement.from_dict({"orientation": "RAR"})
    with pytest.raises(DataError, match=r"\['lower'\] do not belong to rule 'median'"):
        InputAgreement.from_dict({"intensity": {"rule": "median", "lower": 1}})
    ours = InputAgreement.from_dict({"spacing_mm": 0.8, "intensity": {"rule": "percentiles"}})
    assert ours.spacing_mm == (0.8, 0.8)
    assert agreement_differences(ours, InputAgreement()) == [
        ("intensity.lower", 0.5, None), ("intensity.rule", "percentiles", "median"),
        ("intensity.target", None, 128.0), ("intensity.upper", 99.5, None), ("spacing_mm", [0.8, 0.8], [1.0, 1.0])]


# ---- geometry -----------------------------------------------------------------------------------
def test_half_mm_cube_lesion_becomes_2x2_at_1_mm_in_the_expected_place():
    image, mask, affine = _cube_volume()
    slices, lesion, grid = to_agreed_grid(image, affine, _agreement(), mask)
    # x, y: 40 voxels of 0.5 mm -> 20 of 1 mm; the slice axis keeps its 8 slices of 0.5 mm
    assert grid.shape == (20, 20, 8) and np.allclose(grid.affine, np.diag([1.0, 1.0, 0.5, 1.0]))
    assert slices.shape == lesion.shape == (8, 20, 20) and slices.dtype == lesion.dtype == np.uint8
    # lesion voxels 16..19 lie at 8.0..9.5 mm; the 1 mm voxels at 8 and 9 mm fall inside: 2 x 2
    expected = np.zeros((8, 20, 20), np.uint8)
    expected[2:6, 8:10, 8:10] = 1
    assert np.array_equal(lesion, expected)
    # intensity: median of the above-mean voxels is the brain's 100 -> 128; the lesion's 200 -> 256 -> 255
    assert slices[3, 8, 8] == 255 and slices[3, 5, 5] == 128 and slices[3, 0, 0] == 0


def test_the_same_volume_stored_lps_gives_the_same_slices():
    image, mask, affine = _cube_volume()
    ras = to_agreed_grid(image, affine, _agreement(), mask)
    # stored with x and y reversed: index i lies at (39 - i) * 0.5 mm
    lps_affine = np.array([[-0.5, 0, 0, 19.5], [0, -0.5, 0, 19.5], [0, 0, 0.5, 0], [0, 0, 0, 1]])
    lps = to_agreed_grid(image[::-1, ::-1].copy(), lps_affine, _agreement(), mask[::-1, ::-1].copy())
    assert np.array_equal(lps[0], ras[0]) and np.array_equal(lps[1], ras[1])


def test_crop_and_pad_about_the_centre():
    image = np.full((10, 30, 2), 100.0, np.float32)
    image[0, 5, :] = 200.0  # first kept column of the first row
    image[9, 24, :] = 200.0  # last kept column of the last row
    image[0, 0, :] = 200.0  # cropped away
    # the median of all voxels is the block's 100 -> 128 (the markers are too few to move it)
    slices, _, grid = to_agreed_grid(image, np.eye(4), _agreement(size=(16, 20), intensity=IntensityRule(of="all")))
    # rows 10 -> 16: 3 rows of 0 on each side; columns 30 -> 20: 5 dropped on each side
    assert slices.shape == (2, 16, 20) and grid.shape == (16, 20, 2)
    assert (slices[:, :3] == 0).all() and (slices[:, 13:] == 0).all()
    bright = [tuple(int(v) for v in p) for p in np.argwhere(slices[0] == 255)]
    assert bright == [(3, 0), (12, 19)]
    assert (slices[0, 3:13] >= 128).all()  # the kept block: 100 -> 128, markers 200 -> 255
    # crop / pad moved the origin: the agreed voxel (3, 0) is the source voxel (0, 5)
    assert np.allclose(grid.affine @ [3, 0, 0, 1], [0, 5, 0, 1])


# ---- intensity ----------------------------------------------------------------------------------
def _ramp():
    """10 x 10 x 10, slice k (axis 2) holding 100 k + 1 .. 100 k + 100: the volume is 1..1000."""
    i, j, k = np.meshgrid(np.arange(10), np.arange(10), np.arange(10), indexing="ij")
    return (100 * k + 10 * i + j + 1).astype(np.float32)


def test_percentiles_of_a_ramp_per_volume():
    ramp = _ramp()
    rule = IntensityRule("percentiles", "all", lower=10, upper=90)
    out = normalise_intensity(ramp, rule)
    # numpy's percentiles of 1..1000: 10 % -> 1 + 0.1 x 999 = 100.9, 90 % -> 900.1
    low, high = 100.9, 900.1
    assert out[0, 0, 5] == pytest.approx((501 - low) / (high - low) * 255, abs=1e-3)
    assert out[9, 9, 0] == 0.0 and out[0, 0, 9] == 255.0  # 100 and 901: clipped
    # one scale for the volume: per slice, slice 0 (1..100) would have spanned 0..255
    assert out[..., 0].max() == 0.0
    slices, _, _ = to_agreed_grid(ramp, np.eye(4), _agreement(size=(10, 10), intensity=rule))
    assert slices[5, 0, 0] == 128  # 501 -> 127.66, rounded


def test_median_and_nonzero_rules_of_a_ramp():
    ramp = _ramp()
    # the mean is 500.5: the above-mean voxels are 501..1000, median 750.5 -> 128
    median = normalise_intensity(ramp, IntensityRule("median", "above_mean", 128.0))
    assert median[9, 9, 9] == pytest.approx(1000 * 128 / 750.5, rel=1e-6)
    assert median[0, 0, 0] == pytest.approx(128 / 750.5, rel=1e-6)
    padded = np.zeros((12, 12, 10), np.float32)
    padded[1:11, 1:11] = ramp  # air of 0 around it: 'nonzero' ignores it, 'all' does not
    nonzero = normalise_intensity(padded, IntensityRule("percentiles", "nonzero", lower=10, upper=90))
    assert nonzero[1, 1, 5] == pytest.approx((501 - 100.9) / 799.2 * 255, abs=1e-3)
    every = normalise_intensity(padded, IntensityRule("percentiles", "all", lower=10, upper=90))
    assert every[1, 1, 5] != pytest.approx(nonzero[1, 1, 5], abs=1)
    with pytest.raises(DataError, match="vol 7: no voxel is above mean"):
        normalise_intensity(np.ones((2, 2, 2)), IntensityRule(), "vol 7")


# ---- import nifti -------------------------------------------------------------------------------
def test_import_nifti_with_an_agreement_resamples_and_records_it(tmp_path):
    import nibabel as nib

    from fedpartial.data.sitefile import load_site_file
    from fedpartial_tools.cli import main

    image, mask, affine = _cube_volume()
    (tmp_path / "img").mkdir()
    (tmp_path / "msk").mkdir()
    nib.save(nib.Nifti1Image(image, affine), str(tmp_path / "img" / "p1.nii.gz"))
    nib.save(nib.Nifti1Image(mask, affine), str(tmp_path / "msk" / "p1_seg.nii.gz"))
    (tmp_path / "agreement.json").write_text(json.dumps(_agreement().to_dict()))
    main(["import", "nifti", "--site", "site-1", "--images", str(tmp_path / "img"), "--masks", str(tmp_path / "msk"),
          "--agreement", str(tmp_path / "agreement.json"), "--out", str(tmp_path / "site-1.npz")])
    data = load_site_file(str(tmp_path / "site-1.npz"))
    train = data.splits["train"]
    assert data.info[AGREEMENT_KEY] == _agreement().to_dict() and data.info["axis"] == 2
    assert train.images.shape == (8, 20, 20)
    assert [int(m.sum()) for m in train.labels] == [0, 0, 4, 4, 4, 4, 0, 0]  # 2 x 2 on slices 2..5
    assert train.labels[2, 8:10, 8:10].all()
    with pytest.raises(SystemExit):  # the agreement sets the size
        main(["import", "nifti", "--site", "site-1", "--images", str(tmp_path / "img"), "--masks",
              str(tmp_path / "msk"), "--agreement", str(tmp_path / "agreement.json"), "--size", "32",
              "--out", str(tmp_path / "x.npz")])


# ---- the job's agreement at set-up -------------------------------------------------------------
def _settings(agreement, input_size=(0, 0)):
    from fedpartial.flare.common import model_settings

    model = {"arch": "small_cnn", "in_channels": 1, "class_names": ["lesion"], "task": SEGMENTATION,
             "input_size": list(input_size)}
    if agreement is not None:
        model[AGREEMENT_KEY] = agreement
    return model_settings(model)


def _site_file(path, info):
    from fedpartial.data.sitefile import write_site_file

    images = np.zeros((2, 20, 20), np.uint8)
    data = Dataset(SEGMENTATION, ["lesion"], {"train": Split(images, np.zeros_like(images))}, site="site-1",
                   info=info)
    write_site_file(str(path), data)
    return str(path)


def test_a_site_file_with_another_agreement_is_refused_at_set_up(tmp_path):
    from fedpartial.flare.executors import load_site_dataset

    job = _agreement().to_dict()
    other = _site_file(tmp_path / "other.npz", {AGREEMENT_KEY: _agreement(spacing_mm=(0.8, 0.8)).to_dict()})
    with pytest.raises(ValueError) as e:
        load_site_dataset(other, "site-1", _settings(job))
    message = str(e.value)
    assert f"site 'site-1': data file '{other}'" in message
    assert "spacing_mm: file [0.8, 0.8], job [1.0, 1.0]" in message
    # the same agreement, a file recording none, or a job without one: loaded
    same = _site_file(tmp_path / "same.npz", {AGREEMENT_KEY: job})
    assert len(load_site_dataset(same, "site-1", _settings(job)).splits["train"]) == 2
    assert len(load_site_dataset(_site_file(tmp_path / "none.npz", {}), "site-1", _settings(job)).splits["train"]) == 2
    assert len(load_site_dataset(other, "site-1", _settings(None)).splits["train"]) == 2


def test_model_block_checks_the_agreement_and_the_model_file_records_it(tmp_path):
    from fedpartial.flare.common import build_model_from_settings, model_file_meta
    from fedpartial.models.io import read_model_file, save_weights_file
    from fedpartial.training.common import state_dict_numpy

    with pytest.raises(ValueError, match=r"model.input_size \[64, 64\] differs from model.input_agreement.size"):
        _settings(_agreement().to_dict(), (64, 64))
    with pytest.raises(ValueError, match="job config model.input_agreement: unknown key"):
        _settings({"spacing": 1})
    settings = _settings({"spacing_mm": [1, 1], "size": [20, 20]}, (20, 20))
    assert settings[AGREEMENT_KEY]["intensity"] == {"rule": "median", "of": "above_mean", "target": 128.0}
    assert AGREEMENT_KEY not in _settings(None) and AGREEMENT_KEY not in model_file_meta(_settings(None))
    model = build_model_from_settings(settings)
    path = save_weights_file(tmp_path / "m.pt", state_dict_numpy(model), model.spec, model_file_meta(settings))
    assert read_model_file(path)["meta"][AGREEMENT_KEY] == settings[AGREEMENT_KEY]


# ---- predict nifti ------------------------------------------------------------------------------
class Threshold200(torch.nn.Module):
    """Foreground where the uint8 input is above about 200 (x = (u / 255 - 0.5) / 0.5 > 0.57)."""

    def forward(self, x):
        return x, 40 * (x[:, :1] - 0.57)


def test_predict_nifti_applies_the_agreement_and_writes_the_mask_on_the_input_grid(tmp_path, monkeypatch, capsys):
    import nibabel as nib

    import fedpartial.models.io as model_io
    from fedpartial_tools.cli import main

    # drawn in RAS at 0.5 mm (48 x 40 x 4 slices of 3 mm), stored LPS: x and y reversed
    ras = np.zeros((48, 40, 4), np.float32)
    ras[4:44, 4:36] = 100.0
    ras[20:28, 12:20, 1:3] = 250.0  # an 8 x 8 lesion at 10..13.5 mm (x), 6..9.5 mm (y)
    affine = np.array([[-0.5, 0, 0, 23.5], [0, -0.5, 0, 19.5], [0, 0, 3.0, 0], [0, 0, 0, 1]])
    (tmp_path / "in").mkdir()
    nib.save(nib.Nifti1Image(ras[::-1, ::-1].copy(), affine), str(tmp_path / "in" / "case1.nii.gz"))
    agreement = _agreement(size=(20, 24))
    meta = {"class_names": ["lesion"], "task": SEGMENTATION, "input_size": [20, 24], "normalisation": NORM,
            "spec": {"num_classes": 1, "in_channels": 1}, AGREEMENT_KEY: agreement.to_dict()}
    monkeypatch.setattr(model_io, "load_model_file", lambda path, device="cpu": (Threshold200(), dict(meta)))
    main(["predict", "nifti", "--model", "stub.pt", "--images", str(tmp_path / "in"), "--out", str(tmp_path / "o")])
    assert "4 image(s) of 1 file(s) predicted" in capsys.readouterr().out
    written = nib.load(str(tmp_path / "o" / "masks" / "case1_mask.nii.gz"))
    mask = np.asarray(written.dataobj)
    assert mask.shape == (48, 40, 4) and np.allclose(written.affine, affine)
    # on the 1 mm grid the lesion is the voxels at 10..13 mm (x) and 6..9 mm (y), i.e. the
    # stretch 9.5..13.5 / 5.5..9.5 mm; back at 0.5 mm a voxel is foreground where the
    # interpolated probability is > 0.5: centres strictly inside, 10..13 mm = RAS x 20..26 and
    # 6..9 mm = RAS y 12..18; the drawn lesion's last 0.5 mm row (13.5 / 9.5 mm) sits on the edge
    expected = np.zeros((48, 40, 4), np.uint8)
    expected[20:27, 12:19, 1:3] = 1
    assert np.array_equal(mask[::-1, ::-1], expected)
    with pytest.raises(SystemExit):  # the agreement slices along axis 2: another axis is refused
        main(["predict", "nifti", "--model", "stub.pt", "--images", str(tmp_path / "in"), "--axis", "0",
              "--out", str(tmp_path / "p")])
    assert "--axis 0 differs from the model's input agreement" in capsys.readouterr().err


# ---- harmonise ----------------------------------------------------------------------------------
def _two_patient_npz(path):
    """Patients 'A' (slice ids 5, 6, 7) and 'B' (1, 2), rows shuffled; 20 x 16 slices of 0.5 mm."""
    rows = [("B", 2), ("A", 7), ("A", 5), ("B", 1), ("A", 6)]
    images = np.zeros((5, 20, 16), np.uint8)
    images[:, 2:18, 2:14] = 100
    masks, rater2 = np.zeros_like(images), np.zeros_like(images)
    for r, (patient, slice_id) in enumerate(rows):
        images[r, 0, 0] = slice_id  # tells the rows apart; far below the brain's 100
    masks[2, 4:8, 2:6] = 1  # A slice 5: rows 2..3.5 mm, columns 1..2.5 mm
    rater2[1, 10:14, 8:12] = 1  # A slice 7: rows 5..6.5 mm, columns 4..5.5 mm
    np.savez(path, train_images=images, train_masks=masks, train_masks_rater2=rater2,
             train_patient_ids=np.array([p for p, _ in rows]), train_slice_ids=np.array([s for _, s in rows]),
             class_names=np.array(["background", "lesion"]))
    return str(path)


def test_harmonise_a_hand_built_npz_keeps_patients_slices_and_rater2(tmp_path):
    from fedpartial.data.npz import load_npz
    from fedpartial_tools.cli import main
    from fedpartial_tools.data.harmonise import harmonise_npz
    from fedpartial_tools.data.partition import split_file

    source = _two_patient_npz(tmp_path / "src.npz")
    agreement = _agreement(size=(12, 10))
    (tmp_path / "agreement.json").write_text(json.dumps(agreement.to_dict()))
    main(["harmonise", "--data", source, "--spacing-mm", "0.5", "--orientation", "RAS", "--agreement",
          str(tmp_path / "agreement.json"), "--out", str(tmp_path / "out.npz")], developer=True)
    out = np.load(tmp_path / "out.npz")
    assert sorted(out.files) == ["class_names", "info_json", "train_images", "train_masks", "train_masks_rater2",
                                 "train_patient_ids", "train_slice_ids"]
    # 20 x 16 at 0.5 mm -> 10 x 8 at 1 mm -> padded to 12 x 10 (one row / column each side)
    assert out["train_images"].shape == out["train_masks_rater2"].shape == (5, 12, 10)
    assert out["train_patient_ids"].tolist() == ["B", "B", "A", "A", "A"]  # first seen first, by slice id
    assert out["train_slice_ids"].tolist() == [1, 2, 5, 6, 7]
    expected = np.zeros((5, 12, 10), np.uint8)
    expected[2, 3:5, 2:4] = 1  # A slice 5: rows 2, 3 mm -> 2, 3 (+1 pad); columns 1, 2 mm -> 1, 2 (+1)
    assert np.array_equal(out["train_masks"], expected)
    expected2 = np.zeros((5, 12, 10), np.uint8)
    expected2[4, 6:8, 5:7] = 1  # A slice 7: rows 5, 6 mm -> 6, 7; columns 4, 5 mm -> 5, 6
    assert np.array_equal(out["train_masks_rater2"], expected2)
    assert out["train_images"][0, 6, 5] == 128  # the brain's 100 at the median rule's 128
    info = json.loads(str(out["info_json"]))
    assert info[AGREEMENT_KEY] == agreement.to_dict() and info["source_spacing_mm"] == [0.5, 0.5]
    # slices running inferior-wards give the same file: the stack is reversed and put back in slice-id order
    harmonise_npz(source, str(tmp_path / "rai.npz"), agreement, (0.5, 0.5), "RAI")
    rai = np.load(tmp_path / "rai.npz")
    for key in ("train_images", "train_masks", "train_masks_rater2", "train_slice_ids"):
        assert np.array_equal(rai[key], out[key]), key
    # loadable, agreement kept, and split by patient
    data = load_npz(str(tmp_path / "out.npz"))
    assert data.info[AGREEMENT_KEY] == agreement.to_dict()
    summary = split_file(str(tmp_path / "out.npz"), "incomplete-masks", 2, 0, str(tmp_path / "split"),
                         completeness=[1.0, 1.0])
    assert summary["totals"]["n_train"] + summary["totals"]["n_val"] == 5
    with pytest.raises(DataError, match="slices run along S but the input agreement slices along R"):
        harmonise_npz(source, str(tmp_path / "x.npz"), _agreement(slice_axis=0), (0.5, 0.5), "RAS")


# ---- the two real MS sources --------------------------------------------------------------------
MS_SOURCES = {"ms_flair_2patients.npz": (1.0, "LAS"), "ms_flair_isbi2015_4patients.npz": (0.83, "PLS")}


@pytest.mark.realdata
@pytest.mark.skipif(not all((SHARED / f).is_file() for f in MS_SOURCES),
                    reason=f"the real MS FLAIR files {sorted(MS_SOURCES)} are not in {SHARED}")
def test_both_real_ms_sources_come_to_one_grid(tmp_path):
    from scipy import ndimage

    from fedpartial_tools.data.harmonise import harmonise_npz

    agreement = InputAgreement()
    medians, lesion_medians = {}, {}
    for name, (spacing, orientation) in MS_SOURCES.items():
        out = tmp_path / name
        report = harmonise_npz(str(SHARED / name), str(out), agreement, (spacing, spacing), orientation)
        data = np.load(out)
        images, masks = data["train_images"], data["train_masks"] > 0
        assert images.shape[1:] == (192, 224) and images.dtype == np.uint8
        assert len(images) == len(np.load(SHARED / name)["train_images"])
        for patient, r in report["train"].items():
            # measured: 1.000 (1 mm source, nothing resampled) and 0.995-1.011 (0.83 mm source)
            assert r["lesion_pixels_out"] == pytest.approx(r["lesion_pixels_expected"], rel=0.03), (name, patient)
        # the brain: 10 mm inside the head's outline (the MNI scans are skull-stripped, the ISBI
        # ones are not, so their nonzero voxels hold skull, scalp and the noise of the air)
        core = np.stack([ndimage.binary_erosion(ndimage.binary_fill_holes(s > 20), iterations=10) for s in images])
        medians[name], lesion_medians[name] = float(np.median(images[core])), float(np.median(images[masks]))
    # measured: brain 127 (MNI) and 120 (ISBI), lesions 171 and 181
    mni, isbi = (medians[n] for n in MS_SOURCES)
    assert 110 <= mni <= 145 and 110 <= isbi <= 145 and abs(mni - isbi) <= 0.10 * mni, medians
    mni, isbi = (lesion_medians[n] for n in MS_SOURCES)
    assert abs(mni - isbi) <= 0.15 * mni, lesion_medians
