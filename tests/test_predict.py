"""``python -m fedpartial predict``: decision thresholds (shared with evaluate), PNG / DICOM / NIfTI
inputs written in tmp_path, masks back on the source grid, lesion counts and volumes worked out by
hand, and one-line errors naming the file an input the model cannot serve."""
import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpartial.models import build_model, save_model_file
from fedpartial_tools.cli import main
from fedpartial_tools.model.cases import Case, image_cases, nifti_cases
from fedpartial_tools.model.decisions import decide, decision_thresholds
from fedpartial_tools.model.predict import lesion_stats, predict_inputs

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
NORM = {"mean": 0.5, "std": 0.5}


def _meta(task="multi-label", names=("a", "b", "c"), size=(16, 16), **extra):
    return {"class_names": list(names), "task": task, "input_size": list(size), "normalisation": NORM, **extra}


def _model_file(path, task="multi-label", channels=1, names=("a", "b", "c"), size=(16, 16), bias=None, **extra):
    torch.manual_seed(0)
    model = build_model("small_cnn", len(names), channels, width=4, depth=2).eval()
    if bias is not None:  # fixes the classes' probabilities on either side of 0.5
        with torch.no_grad():
            model.fc.bias.copy_(torch.tensor(bias))
    save_model_file(path, model, _meta(task, names, size, **extra))
    return str(path)


def _png(path, array):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, np.uint8)).save(path)
    return path


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Brightness(torch.nn.Module):
    """A segmentation "model" whose foreground is where the image is bright: logit = 20 x, so with
    mean = std = 0.5 a pixel is foreground (probability > 0.5) where its uint8 value is > 127.5."""

    def forward(self, x):
        return x, 20 * x[:, :1]


# ---- thresholds -----------------------------------------------------------------------------------
def test_decision_thresholds_from_the_model_file_else_defaults_and_override():
    assert decision_thresholds(_meta("multi-label")).tolist() == [0.5, 0.5, 0.5]
    assert np.isnan(decision_thresholds(_meta("single-label"))).all()  # argmax
    assert decision_thresholds(_meta("segmentation", ["lesion"])).tolist() == [0.5]
    stored = {"thresholds": {"a": 0.2, "c": 0.9}, "rule": "youden", "source": "site-1 val"}
    # "b" is not calibrated: it keeps the task's default
    assert decision_thresholds(_meta(decision_thresholds=stored)).tolist() == [0.2, 0.5, 0.9]
    single = decision_thresholds(_meta("single-label", decision_thresholds=stored))
    assert single[0] == 0.2 and np.isnan(single[1]) and single[2] == 0.9
    assert decision_thresholds(_meta(decision_thresholds=stored), override=0.3).tolist() == [0.3, 0.3, 0.3]
    with pytest.raises(ValueError, match=r"\['z'\]"):
        decision_thresholds(_meta(decision_thresholds={"thresholds": {"z": 0.5}, "rule": "r", "source": "s"}))
    with pytest.raises(ValueError, match="'a' threshold 1.5"):
        decision_thresholds(_meta(decision_thresholds={"thresholds": {"a": 1.5}, "rule": "r", "source": "s"}))
    with pytest.raises(ValueError, match="--threshold"):
        decision_thresholds(_meta(), override=-0.1)


def test_decide_thresholds_per_class_and_argmax_where_none():
    probs = np.array([[0.30, 0.60, 0.10],
                      [0.25, 0.20, 0.55]])
    # a: >= 0.3 (row 0 exactly at it); b: argmax (row 0 only); c: >= 0.5 (row 1)
    assert decide(probs, np.array([0.3, np.nan, 0.5])).astype(int).tolist() == [[1, 1, 0], [0, 0, 1]]
    assert decide(probs, np.full(3, np.nan)).astype(int).tolist() == [[0, 1, 0], [0, 0, 1]]


def test_evaluate_scores_with_the_model_files_thresholds(tmp_path):
    from fedpartial.data.npz import save_npz
    from fedpartial.data.types import Dataset, Split
    from fedpartial.models.io import load_model_file
    from fedpartial_tools.evaluate import _classification_probs, evaluate_data

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 16, 16), dtype=np.uint8)
    labels = (rng.random((12, 3)) < 0.5).astype(np.float32)
    save_npz(Dataset("multi-label", ["a", "b", "c"], {"test": Split(images, labels)}), str(tmp_path / "t.npz"))
    model, meta = load_model_file(_model_file(tmp_path / "m.pt"))
    probs = _classification_probs(model, Split(images, labels), meta, "cpu")
    # thresholds at each class's median probability: half the images positive, unlike 0.5
    medians = np.median(probs, axis=0)
    meta["decision_thresholds"] = {"thresholds": dict(zip("abc", medians.tolist())), "rule": "median", "source": "t"}
    by_model = evaluate_data(model, meta, str(tmp_path / "t.npz"))
    assert by_model["accuracy"] == pytest.approx(float(np.mean((probs >= medians) == (labels > 0))))
    by_override = evaluate_data(model, meta, str(tmp_path / "t.npz"), threshold=0.5)
    assert by_override["accuracy"] == pytest.approx(float(np.mean((probs >= 0.5) == (labels > 0))))
    assert by_model["accuracy"] != by_override["accuracy"]


# ---- classification -------------------------------------------------------------------------------
def test_predict_png_folder_writes_probabilities_and_decisions(tmp_path, capsys):
    from fedpartial.data.transforms import resize_images
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import images_to_tensor

    stored = {"thresholds": {"a": 0.0, "b": 1.0}, "rule": "test", "source": "hand"}  # a always, b never
    # biases -5 / +5: a about 0.007, b about 0.993, so 0.5 would decide the other way for both
    model_path = _model_file(tmp_path / "m.pt", bias=[-5.0, 5.0, 0.0], decision_thresholds=stored)
    rng = np.random.default_rng(1)
    same = _png(tmp_path / "in" / "x.png", rng.integers(0, 256, (16, 16)))
    other = _png(tmp_path / "in" / "sub" / "y.png", rng.integers(0, 256, (24, 20)))  # resized to 16x16
    (tmp_path / "in" / "notes.txt").write_text("not an image")
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out",
          str(tmp_path / "out"), "--batch-size", "1"])
    err = capsys.readouterr().err
    assert "batch 1: 1 image(s)" in err and "batch 2: 2 image(s) of 2 file(s)" in err
    rows = _rows(tmp_path / "out" / "predictions.csv")
    assert [r["file"] for r in rows] == ["sub/y.png", "x.png"]
    # the probabilities are the model's on the image resized as at training
    model, meta = load_model_file(model_path)
    for row, path in zip(rows, (other, same)):
        from PIL import Image

        image = np.array(Image.open(path))[None]
        with torch.no_grad():
            expected = torch.sigmoid(model(images_to_tensor(resize_images(image, (16, 16)), 0.5, 0.5))[1])[0]
        assert [float(row[f"prob_{c}"]) for c in "abc"] == pytest.approx(expected.tolist(), abs=1e-6)
        # a: threshold 0 -> 1; b: threshold 1 -> 0; c: not in the file -> 0.5
        assert (row["decision_a"], row["decision_b"]) == ("1", "0")
        assert row["decision_c"] == str(int(float(row["prob_c"]) >= 0.5))


def test_the_predictions_readme_says_the_thresholds_in_plain_words(tmp_path, capsys):
    from fedpartial.algorithms.thresholds import threshold_meta

    # thresholds the server chose at round 3 for the model of round 2, in a file of round 3's model
    record = {"thresholds": {"a": 0.31, "b": 0.7}, "per_class": {}, "model_round": 2, "validated_at": 3, "sites": 2}
    model_path = _model_file(tmp_path / "m.pt", decision_thresholds=threshold_meta(record, 3))
    _png(tmp_path / "in" / "x.png", np.full((16, 16), 90))
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out", str(tmp_path / "o")])
    readme = (tmp_path / "o" / "README.txt").read_text()
    assert ("A class is reported present when its probability is at least its threshold: a 0.31, b 0.70, c 0.50. "
            "The thresholds were chosen on the participating hospitals' validation images with an earlier model of "
            "the same training (round 2); this file holds round 3") in readme
    assert "NOT this file's model" not in readme and "not a diagnosis" in readme
    assert "decision_<class> is 1 when the class is reported present" in readme
    assert "a 0.31, b 0.70, c 0.50" in capsys.readouterr().out
    stored = threshold_meta(record, 2)  # the file of the model they were chosen with
    model_path = _model_file(tmp_path / "m2.pt", decision_thresholds=stored)
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out", str(tmp_path / "o2")])
    assert "validation images with this model (round 2)" in (tmp_path / "o2" / "README.txt").read_text()


def test_single_label_rows_name_the_predicted_class(tmp_path):
    model_path = _model_file(tmp_path / "m.pt", task="single-label")
    _png(tmp_path / "in" / "x.png", np.full((16, 16), 200))
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out", str(tmp_path / "o")])
    row = _rows(tmp_path / "o" / "predictions.csv")[0]
    probs = [float(row[f"prob_{c}"]) for c in "abc"]
    assert sum(probs) == pytest.approx(1.0, abs=1e-5)  # softmax
    top = "abc"[int(np.argmax(probs))]
    assert row["predicted"] == top and [row[f"decision_{c}"] for c in "abc"] == [str(int(c == top)) for c in "abc"]


def test_grey_model_given_rgb_images_names_the_file(tmp_path, capsys):
    model_path = _model_file(tmp_path / "m.pt", channels=1)
    grey = np.full((16, 16), 90, np.uint8)
    _png(tmp_path / "in" / "grey.png", grey)
    colour = np.stack([grey, grey // 2, 255 - grey], axis=-1)
    bad = _png(tmp_path / "in" / "colour.png", colour)
    _png(tmp_path / "in" / "grey_as_rgb.png", np.stack([grey] * 3, axis=-1))  # R = G = B: a grey image
    (tmp_path / "in" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out",
              str(tmp_path / "o")])
    assert exit_.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2
    assert any(f"'{bad}' is RGB (3 channels) but the model takes grey (1 channel)" in e for e in errors)
    assert any("broken.png" in e and "unreadable" in e for e in errors)
    assert sorted(r["file"] for r in _rows(tmp_path / "o" / "predictions.csv")) == ["grey.png", "grey_as_rgb.png"]


def test_rgb_model_given_grey_images_fails_when_nothing_is_left(tmp_path, capsys):
    model_path = _model_file(tmp_path / "m.pt", channels=3)
    grey = _png(tmp_path / "in" / "g.png", np.zeros((16, 16)))
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "in"), "--out",
              str(tmp_path / "o")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: image '{grey}' is grey (1 channel) but the model takes RGB (3 channels) images" in err
    assert "no input could be predicted" in err
    assert not (tmp_path / "o" / "predictions.csv").exists()


# ---- DICOM ----------------------------------------------------------------------------------------
def test_predict_dicom_folder_windows_as_import_and_names_bad_files(tmp_path, capsys):
    from fedpartial_tools.data.dicom_example import write_ct_slice

    rng = np.random.default_rng(2)
    slices = rng.integers(0, 256, (3, 16, 16), dtype=np.uint8)
    folder = tmp_path / "dicom"
    for i, image in enumerate(slices):
        write_ct_slice(str(folder / f"patient{i}" / f"s{i}.dcm"), image, f"P{i}", i + 1)
    (folder / "labels.csv").write_text("file\n")  # not DICOM: skipped
    (folder / "junk.dcm").write_bytes(b"not dicom")
    write_ct_slice(str(folder / "zz_mr.dcm"), slices[0], "P9", 9)
    import pydicom

    for path in folder.rglob("*.dcm"):
        if path.name != "junk.dcm":
            ds = pydicom.dcmread(str(path))
            ds.WindowCenter, ds.WindowWidth = "0", "400"  # a file window other than the one of training
            ds.Modality = "MR" if path.name == "zz_mr.dcm" else ds.Modality
            ds.save_as(str(path))
    # the same uint8 slices as PNGs: the example's brain window (--window brain) gives back exactly these
    for i, image in enumerate(slices):
        _png(tmp_path / "png" / f"patient{i}" / f"s{i}.png", image)
    model_path = _model_file(tmp_path / "m.pt")
    with pytest.raises(SystemExit):
        main(["predict", "dicom", "--model", model_path, "--folder", str(folder), "--window", "brain", "--out",
              str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert f"DICOM file '{folder / 'junk.dcm'}' is unreadable" in err
    assert f"DICOM file '{folder / 'zz_mr.dcm'}' is MR, not CT" in err
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "png"), "--out", str(tmp_path / "p")])
    dicom_rows, png_rows = _rows(tmp_path / "d" / "predictions.csv"), _rows(tmp_path / "p" / "predictions.csv")
    assert [r["patient_id"] for r in dicom_rows] == ["P0", "P1", "P2"]  # from the DICOM header
    assert [r["file"] for r in dicom_rows] == [f"patient{i}/s{i}.dcm" for i in range(3)]
    for d, p in zip(dicom_rows, png_rows):
        assert [d[f"prob_{c}"] for c in "abc"] == [p[f"prob_{c}"] for c in "abc"]


# ---- segmentation ---------------------------------------------------------------------------------
def test_nifti_mask_has_the_source_affine_shape_and_hand_counted_lesions(tmp_path):
    import nibabel as nib

    volume = np.zeros((10, 12, 6), np.float32)
    volume[1:3, 1:3, 1:3] = 100.0  # lesion 1: 2 x 2 x 2 = 8 voxels
    volume[6:9, 8, 3:5] = 100.0  # lesion 2: 3 x 1 x 2 = 6 voxels, far from lesion 1
    affine = np.array([[0.5, 0, 0, -10], [0, 0.8, 0, 4], [0, 0, 2.0, 30], [0, 0, 0, 1]])
    (tmp_path / "in").mkdir()
    nib.save(nib.Nifti1Image(volume, affine), str(tmp_path / "in" / "case1.nii.gz"))
    meta = {**_meta("segmentation", ["lesion"], (0, 0)), "spec": {"num_classes": 1, "in_channels": 1}}
    result = predict_inputs(Brightness(), meta, nifti_cases(str(tmp_path / "in"), axis=1), str(tmp_path / "o"),
                            batch_size=5)  # 12 slices along axis 1: 3 batches, the case spans them
    assert result["images"] == 12 and result["files"] == 1 and not result["errors"]
    row = _rows(tmp_path / "o" / "lesions.csv")[0]
    # voxel = 0.5 x 0.8 x 2.0 = 0.8 mm3; 14 voxels = 11.2 mm3
    assert (row["file"], row["patient_id"], row["slices"]) == ("case1.nii.gz", "case1", "12")
    assert (row["lesion_count"], row["lesion_voxels"]) == ("2", "14")
    assert float(row["voxel_volume_mm3"]) == pytest.approx(0.8)
    assert float(row["lesion_volume_mm3"]) == pytest.approx(11.2)
    mask = nib.load(str(tmp_path / "o" / row["mask"]))
    assert mask.shape == volume.shape and np.allclose(mask.affine, affine)
    assert np.array_equal(np.asarray(mask.dataobj), (volume > 0).astype(np.uint8))


def test_png_masks_come_back_at_the_source_size(tmp_path):
    image = np.zeros((40, 60), np.uint8)
    image[4:14, 5:15] = 255  # two 10 x 10 squares far apart
    image[25:35, 40:50] = 255
    _png(tmp_path / "in" / "scan.png", image)
    meta = {**_meta("segmentation", ["lesion"], (20, 30)), "spec": {"num_classes": 1, "in_channels": 1}}
    predict_inputs(Brightness(), meta, image_cases(str(tmp_path / "in")), str(tmp_path / "o"))
    row = _rows(tmp_path / "o" / "lesions.csv")[0]
    from PIL import Image

    mask = np.asarray(Image.open(tmp_path / "o" / row["mask"]))
    assert mask.shape == (40, 60) and set(np.unique(mask)) == {0, 255}
    assert row["lesion_count"] == "2" and row["voxel_volume_mm3"] == "" and row["lesion_volume_mm3"] == ""
    # halved and upsampled back: each square stays about 10 x 10
    assert abs(int(row["lesion_voxels"]) - 200) <= 40


def test_lesion_stats_face_connectivity():
    mask = np.zeros((5, 5), bool)
    mask[0, 0] = mask[1, 1] = True  # touching at a corner only
    mask[3:5, 3:5] = True
    assert lesion_stats(mask)["lesion_count"] == 3
    assert lesion_stats(mask, connectivity=2)["lesion_count"] == 2
    assert lesion_stats(mask, voxel_mm3=0.25)["lesion_volume_mm3"] == pytest.approx(6 * 0.25)


@pytest.mark.realdata
@pytest.mark.skipif(not (SHARED / "ms_flair_2patients.npz").is_file(),
                    reason=f"real MS FLAIR data {SHARED / 'ms_flair_2patients.npz'} is absent")
def test_ms_lesion_count_matches_the_data_readme():
    data = np.load(SHARED / "ms_flair_2patients.npz")
    masks = data["train_masks"][data["train_patient_ids"] == 7]
    # ../shared/data/README.md: patient 7 has 171 2D lesion components over its slices
    assert sum(lesion_stats(m)["lesion_count"] for m in masks) == 171


def test_a_case_with_frames_gets_one_row_per_frame(tmp_path):
    frames = np.random.default_rng(3).integers(0, 256, (3, 16, 16), dtype=np.uint8)
    case = Case(str(tmp_path / "multi.dcm"), "multi.dcm", frames, "dicom", "P1")
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2).eval()
    meta = {**_meta(), "spec": model.spec}
    predict_inputs(model, meta, [case], str(tmp_path / "o"), batch_size=2)
    rows = _rows(tmp_path / "o" / "predictions.csv")
    assert [(r["file"], r["frame"], r["patient_id"]) for r in rows] == [("multi.dcm", str(i), "P1") for i in range(3)]
