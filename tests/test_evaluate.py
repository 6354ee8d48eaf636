"""`python -m fedpartial evaluate` on what users have: test-only MedMNIST-layout files, site
files and folders of them (label masks respected), segmentation at native resolution; the
table and JSON outputs; error messages. Numbers are worked out by hand in the comments."""
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
from sklearn.metrics import roc_auc_score

from fedpartial_tools.cli import main as cli
from fedpartial.data.sitefile import write_site_file
from fedpartial.data.types import DataError, Dataset, Split
from fedpartial_tools.evaluate import evaluate_data
from fedpartial.metrics import classification_metrics
from fedpartial.models import build_model
from fedpartial.models.io import save_model_file
from fedpartial.training.common import images_to_tensor

NORM = {"mean": 0.5, "std": 0.5}
NAMES = ["akiec", "bcc", "bkl", "mel"]


def _meta(task, names, size):
    return {"class_names": list(names), "task": task, "input_size": list(size), "normalisation": dict(NORM)}


@pytest.fixture(scope="module")
def test_only(tmp_path_factory):
    """A tiny small_cnn saved to a model file and a test-only MedMNIST-layout file (no train split,
    no label_names; class 'mel' (index 3) never occurs, so the labels alone would give 3 classes)."""
    root = tmp_path_factory.mktemp("test_only")
    torch.manual_seed(0)
    model = build_model("small_cnn", len(NAMES), 1, width=4, depth=2)
    model_path = root / "model.pt"
    save_model_file(model_path, model, _meta("single-label", NAMES, (16, 16)))
    rng = np.random.default_rng(0)
    # brightness varies per image so the model's outputs spread out (a clear ranking for AUC)
    images = (rng.integers(0, 60, (14, 16, 16)) + rng.integers(0, 190, (14, 1, 1))).astype(np.uint8)
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0], np.uint8)[:, None]
    data_path = root / "isic_test.npz"
    np.savez(data_path, test_images=images, test_labels=labels)
    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(images_to_tensor(images, 0.5, 0.5))[1], 1).numpy()
    return model_path, data_path, labels[:, 0], probs


def test_test_only_file_evaluates_with_model_class_names(test_only, capsys):
    model_path, data_path, labels, probs = test_only
    cli(["evaluate", "--model", str(model_path), "--data", str(data_path), "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["split"] == "test" and out["n"] == 14
    assert list(out["per_class"]) == NAMES  # 4 classes from the model, not 3 counted from the labels
    assert any("no label_names" in n for n in out["notes"])
    # macro AUC over the classes present (one-vs-rest; 'mel' has no positive: undefined, left out)
    expected = np.mean([roc_auc_score(labels == c, probs[:, c]) for c in range(3)])
    assert out["auc"] == pytest.approx(expected, abs=1e-6)
    assert out["per_class"]["mel"]["auc"] is None and out["per_class"]["mel"]["n_pos"] == 0


def test_table_is_the_default_and_compact_is_one_line_json(test_only, capsys):
    model_path, data_path, _, _ = test_only
    cli(["evaluate", "--model", str(model_path), "--data", str(data_path), "--device", "cpu"])
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("model  ") and "single-label, 4 classes, input 16x16" in lines[0]
    assert lines[2] == "split  test" and lines[3] == "n      14"
    assert any(line.split()[:1] == ["auc"] for line in lines)
    header = next(line for line in lines if line.startswith("class"))
    assert header.split() == ["class", "auc", "ap", "f1", "n_pos"]
    assert next(line for line in lines if line.startswith("mel")).split() == ["mel", "-", "-", "-", "0"]
    cli(["evaluate", "--model", str(model_path), "--data", str(data_path), "--device", "cpu", "--compact"])
    compact = capsys.readouterr().out
    assert compact.count("\n") == 1 and json.loads(compact)["n"] == 14


def test_missing_split_names_the_file_and_the_splits(test_only, capsys):
    model_path, data_path, _, _ = test_only
    with pytest.raises(SystemExit) as e:
        cli(["evaluate", "--model", str(model_path), "--data", str(data_path), "--split", "val", "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(data_path) in err and "no 'val' split" in err and "['test']" in err


def test_several_splits_without_test_need_split(tmp_path):
    path = tmp_path / "trval.npz"
    img = np.zeros((2, 8, 8), np.uint8)
    np.savez(path, train_images=img, train_labels=np.array([[0], [1]]), val_images=img, val_labels=np.array([[1], [0]]),
             label_names=np.array(["x", "y"]))
    model = build_model("small_cnn", 2, 1, width=2, depth=1)
    with pytest.raises(DataError, match=r"no 'test' split and several others \(\['train', 'val'\]\)"):
        evaluate_data(model, _meta("single-label", ["x", "y"], (8, 8)), str(path))
    assert evaluate_data(model, _meta("single-label", ["x", "y"], (8, 8)), str(path), split="val")["n"] == 2


def test_class_names_mismatch(test_only, tmp_path, capsys):
    model_path, _, _, _ = test_only
    path = tmp_path / "named.npz"
    np.savez(path, test_images=np.zeros((2, 16, 16), np.uint8), test_labels=np.array([[0], [1]], np.uint8),
             label_names=np.array(["nevus", "melanoma"]))
    with pytest.raises(SystemExit):
        cli(["evaluate", "--model", str(model_path), "--data", str(path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert "class names of" in err and str(path) in err and "['nevus', 'melanoma']" in err and "'akiec'" in err
    # no label_names but more classes in the labels than the model has: named by count, then refused
    many = tmp_path / "many.npz"
    np.savez(many, test_images=np.zeros((2, 16, 16), np.uint8), test_labels=np.array([[0], [6]], np.uint8))
    with pytest.raises(SystemExit):
        cli(["evaluate", "--model", str(model_path), "--data", str(many), "--device", "cpu"])
    assert "no label_names and its labels hold 7 classes" in capsys.readouterr().err


# --- a folder of two site files; site-2 does not annotate class b --------------------------
class Brightness(nn.Module):
    """Stub classifier: both class logits = mean normalised intensity, so probabilities rank the
    images by brightness (a FedModel-like ``x -> (features, logits)``)."""

    def forward(self, x):
        z = x.mean(dim=(1, 2, 3))[:, None].repeat(1, 2)
        return z, z


def _site(path, site, brightness, labels, mask):
    images = np.repeat(np.asarray(brightness, np.uint8)[:, None, None], 8, 1).repeat(8, 2)
    split = Split(images, np.asarray(labels, np.float32), np.asarray(mask, bool))
    write_site_file(str(path), Dataset("multi-label", ["a", "b"], {"train": split, "val": split}, site=site))


@pytest.fixture()
def site_folder(tmp_path):
    # brightness (= rank of the predicted probability) and labels (a, b)
    # site-1: 10 (0,0)  20 (1,0)  30 (0,1)  40 (1,1)         both classes annotated
    # site-2: 15 (0,-)  25 (0,-)  35 (1,-)  45 (1,-)         b not annotated (stored 0, mask False)
    folder = tmp_path / "sites"
    _site(folder / "site-1.npz", "site-1", [10, 20, 30, 40], [[0, 0], [1, 0], [0, 1], [1, 1]], np.ones((4, 2)))
    _site(folder / "site-2.npz", "site-2", [15, 25, 35, 45], [[0, 0], [0, 0], [1, 0], [1, 0]], [[1, 0]] * 4)
    (folder / "reference").mkdir()  # reference copies beside site files are not read
    return folder


def test_folder_of_site_files_scores_annotated_entries_only(site_folder, monkeypatch, capsys):
    meta = _meta("multi-label", ["a", "b"], (8, 8))
    out = evaluate_data(Brightness(), meta, str(site_folder))
    assert out["split"] == "val" and out["n"] == 8 and list(out["sites"]) == ["site-1", "site-2"]
    s1, s2, pooled = out["sites"]["site-1"], out["sites"]["site-2"], out["pooled"]
    # site-1 a: negatives 10, 30; positives 20 (beats 10), 40 (beats both) -> 3/4; b: 30, 40 > 10, 20 -> 1
    assert s1["per_class"]["a"]["auc"] == pytest.approx(0.75) and s1["per_class"]["b"]["auc"] == 1.0
    assert s1["auc"] == pytest.approx(0.875)
    # site-2 a: 35, 45 > 15, 25 -> 1; b annotated nowhere -> undefined, out of the macro
    assert s2["per_class"]["a"]["auc"] == 1.0 and np.isnan(s2["per_class"]["b"]["auc"]) and s2["auc"] == 1.0
    assert s2["per_class"]["b"]["n"] == 0
    # pooled a: negatives 10 30 15 25, positives 20 (2 wins) 40 (4) 35 (4) 45 (4) -> 14/16
    assert pooled["per_class"]["a"]["auc"] == pytest.approx(14 / 16)
    # pooled b: site-1 rows only -> 1.0. Counting site-2's unannotated zeros as negatives would
    # give 30 > 10 20 15 25 (4 of 6), 40 > all but 45 (5 of 6) -> 9/12 = 0.75
    assert pooled["per_class"]["b"]["auc"] == 1.0 and pooled["per_class"]["b"]["n"] == 4
    assert pooled["auc"] == pytest.approx((14 / 16 + 1.0) / 2)
    bright = np.array([10, 20, 30, 40, 15, 25, 35, 45])
    b_labels = np.array([0, 0, 1, 1, 0, 0, 0, 0])
    assert roc_auc_score(b_labels, bright) == pytest.approx(0.75)  # the wrong (unmasked) value differs
    assert roc_auc_score(b_labels[:4], bright[:4]) == pooled["per_class"]["b"]["auc"]

    # the CLI table: one row per site plus the pooled row
    monkeypatch.setattr("fedpartial.models.io.load_model_file", lambda path, device="cpu": (Brightness(), meta))
    cli(["evaluate", "--model", "stub.pt", "--data", str(site_folder), "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("sites (2 sites)") and lines[2] == "split  val"
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["site-1"], ["site-2"], ["pooled"])}
    assert rows["site-1"][:4] == ["site-1", "val", "4", "0.8750"]
    assert rows["pooled"][:3] == ["pooled", "8", "0.9375"]
    assert ["b", "1.0000", "1.0000", "0.0000", "2", "4"] in [line.split() for line in lines]  # no p >= .5: F1 0


def test_site_file_without_val_needs_split_train(tmp_path, monkeypatch, capsys):
    # a site imported without a val split holds only the data a model trained with it has seen
    split = Split(np.repeat(np.array([10, 20, 30, 40], np.uint8)[:, None, None], 8, 1).repeat(8, 2),
                  np.array([[0, 0], [1, 0], [0, 1], [1, 1]], np.float32), np.ones((4, 2), bool))
    path = tmp_path / "site-1.npz"
    write_site_file(str(path), Dataset("multi-label", ["a", "b"], {"train": split}, site="site-1"))
    meta = _meta("multi-label", ["a", "b"], (8, 8))
    with pytest.raises(DataError, match=r"^site file '.*site-1.npz' has no val split, only 'train', the data a model "
                                        r"trained with this site has learnt from; pass --split train to score that "
                                        r"split anyway \(or import the site with --val-fraction\)$"):
        evaluate_data(Brightness(), meta, str(path))
    out = evaluate_data(Brightness(), meta, str(path), split="train")
    assert out["split"] == "train" and out["n"] == 4
    # the table's a: negatives 10, 30; positives 20 (beats 10), 40 (beats both) -> 3/4
    assert out["per_class"]["a"]["auc"] == pytest.approx(0.75)
    monkeypatch.setattr("fedpartial.models.io.load_model_file", lambda p, device="cpu": (Brightness(), meta))
    with pytest.raises(SystemExit):
        cli(["evaluate", "--model", "stub.pt", "--data", str(path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert err.startswith(f"error: site file '{path}' has no val split") and err.count("\n") == 1


def test_label_mask_all_true_changes_nothing():
    rng = np.random.default_rng(1)
    probs, labels = rng.random((12, 3)), (rng.random((12, 3)) > 0.5).astype(float)
    plain = classification_metrics(probs, labels, "multi-label", ["a", "b", "c"])
    masked = classification_metrics(probs, labels, "multi-label", ["a", "b", "c"], label_mask=np.ones((12, 3), bool))
    for k in ("auc", "map", "bacc", "accuracy", "f1", "precision", "recall"):
        assert masked[k] == pytest.approx(plain[k])
    assert masked["per_class"]["a"]["n"] == 12


def test_single_label_with_hidden_class():
    # rows 0-1 class x, row 2 class y, row 3 unknown (its site annotates x only, label 0 there)
    # x: rows 0..3 annotated -> positives .9 .6 vs negatives .2 .7 -> pairs .9>.2 .9>.7 .6>.2 -> 3/4
    # y: rows 0..2 annotated -> positive .7 vs .05 .3 -> 1 ; argmax on known rows 0..2: x x y -> accuracy 1
    probs = np.array([[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.7, 0.2, 0.1]])
    labels = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0]])
    mask = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]], bool)
    m = classification_metrics(probs, labels, "single-label", ["x", "y", "z"], label_mask=mask)
    assert m["per_class"]["x"]["auc"] == pytest.approx(0.75) and m["per_class"]["y"]["auc"] == 1.0
    assert m["accuracy"] == 1.0 and m["per_class"]["z"]["n"] == 3
    with pytest.raises(ValueError, match="label_mask marks entry"):
        classification_metrics(probs, labels, "single-label", ["x", "y", "z"], label_mask=~mask)


# --- segmentation at native resolution: 2 images of 40x40, model input 20x20 ----------------
class Bright(nn.Module):
    """Stub segmenter: foreground logit +20 where the (resized) input is brighter than mid-grey."""

    def forward(self, x):
        z = torch.where(x > 0, 20.0, -20.0)
        return z, z


def _seg_file(path, blocks, truths):
    images, masks = np.zeros((len(blocks), 40, 40), np.uint8), np.zeros((len(blocks), 40, 40), np.uint8)
    for i, ((r0, r1, c0, c1), (t0, t1, u0, u1)) in enumerate(zip(blocks, truths)):
        images[i, r0:r1, c0:c1] = 255
        masks[i, t0:t1, u0:u1] = 1
    np.savez(path, test_images=images, test_masks=masks)


def test_segmentation_scored_at_native_resolution(tmp_path):
    # Bright blocks on even rows/cols survive the 40 -> 20 downsizing as whole 20 px blocks, and the
    # bilinear upsampling of the near-0/1 probabilities puts >= 0.5625 weight on a pixel's own
    # 20 px parent, so the native prediction is exactly the bright block.
    # image 1: predicted rows 10-19 x cols 10-19 (100 px); truth rows 11-20 x cols 10-19 (100 px)
    #          tp 90 fp 10 fn 10: Dice 180/200 = 0.9, IoU 90/110 = 9/11
    # image 2: predicted rows 30-33 x cols 30-33 (16 px); truth rows 30-31 x cols 30-33 (8 px)
    #          tp 8 fp 8 fn 0: Dice 16/24 = 2/3, IoU 8/16 = 1/2
    # per image: Dice (0.9 + 2/3)/2 = 47/60, IoU (9/11 + 1/2)/2 = 29/44
    # pooled: tp 98 fp 18 fn 10: Dice 196/224 = 7/8, IoU 98/126 = 7/9
    path = tmp_path / "seg.npz"
    _seg_file(path, [(10, 20, 10, 20), (30, 34, 30, 34)], [(11, 21, 10, 20), (30, 32, 30, 34)])
    out = evaluate_data(Bright(), _meta("segmentation", ["lesion"], (20, 20)), str(path))
    assert out["n"] == 2 and out["resolution"] == "native 40x40" and out["model_input"] == "20x20"
    assert out["dice_per_image"] == pytest.approx(47 / 60) and out["iou_per_image"] == pytest.approx(29 / 44)
    assert out["dice_pooled"] == pytest.approx(7 / 8) and out["iou_pooled"] == pytest.approx(7 / 9)
    assert out["n_empty_both"] == 0


def test_segmentation_empty_images_and_output(tmp_path, monkeypatch, capsys):
    # image 1 as above (Dice 0.9, IoU 9/11); image 2 dark with an empty mask: empty truth and
    # empty prediction -> left out of the per-image means, counted in n_empty_both;
    # image 3 dark with a 2x2 lesion: missed -> Dice 0, IoU 0 (tp 0 fp 0 fn 4)
    # per image: Dice 0.9/2 = 0.45, IoU (9/11)/2 = 9/22; pooled tp 90 fp 10 fn 14: Dice 180/204
    path = tmp_path / "seg.npz"
    _seg_file(path, [(10, 20, 10, 20), (0, 0, 0, 0), (0, 0, 0, 0)], [(11, 21, 10, 20), (0, 0, 0, 0), (2, 4, 2, 4)])
    meta = _meta("segmentation", ["lesion"], (20, 20))
    out = evaluate_data(Bright(), meta, str(path))
    assert out["n_empty_both"] == 1
    assert out["dice_per_image"] == pytest.approx(0.45) and out["iou_per_image"] == pytest.approx(9 / 22)
    assert out["dice_pooled"] == pytest.approx(180 / 204) and out["iou_pooled"] == pytest.approx(90 / 114)

    monkeypatch.setattr("fedpartial.models.io.load_model_file", lambda p, device="cpu": (Bright(), meta))
    cli(["evaluate", "--model", "stub.pt", "--data", str(path), "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert "resolution  native 40x40 (model input 20x20)" in lines
    assert ["dice_per_image", "0.4500"] in [line.split() for line in lines]
    assert ["n_empty_both", "1"] in [line.split() for line in lines]
    assert any("left out of the per-image means" in line for line in lines)
    cli(["evaluate", "--model", "stub.pt", "--data", str(path), "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["resolution"] == "native 40x40" and out["dice_pooled"] == pytest.approx(180 / 204)


def test_val_scores_a_site_sends_leave_out_classes_under_k():
    """k = 2. Multi-label: class c2 has one positive, so it is scored as unannotated (AUC of c0 and c1
    only); single-label: the row of the 1-image class goes, and the accuracy is over the other 4."""
    from fedpartial.data.types import Split
    from fedpartial.evaluation import describable, split_metrics

    labels = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0]], np.float32)
    rows, mask = describable(labels, None, "multi-label", 2)
    assert rows.all() and mask[:, :2].all() and not mask[:, 2].any()
    probs = np.array([[.9, .2, .1], [.8, .7, .1], [.3, .6, .9], [.1, .1, .2], [.2, .9, .3]])
    split = Split(np.zeros((5, 4, 4), np.uint8), labels)
    scored = split_metrics(probs, split, "multi-label", ["c0", "c1", "c2"], min_class_count=2)
    # c0: positives .9 .8 above negatives .3 .1 .2 -> 1.0; c1: positives .7 .6 .9 vs .2 .1 -> 1.0
    assert scored["auc"] == 1.0
    # with c2: its one positive (.2) above 2 of its 4 negatives (.1 .1; not .9 .3) -> 0.5
    assert split_metrics(probs, split, "multi-label", ["c0", "c1", "c2"])["auc"] == pytest.approx((1 + 1 + 0.5) / 3)
    one_hot = np.eye(3, dtype=np.float32)[[0, 0, 1, 2, 1]]
    rows, mask = describable(one_hot, None, "single-label", 2)
    assert rows.tolist() == [True, True, True, False, True] and not mask[:, 2].any()
    argmax_right = np.eye(3)[[0, 1, 1, 2, 1]] * 0.8 + 0.1  # row 1 wrong; row 3 (the 1-image class) right
    scored = split_metrics(argmax_right, Split(np.zeros((5, 4, 4), np.uint8), one_hot), "single-label",
                           ["c0", "c1", "c2"], min_class_count=2)
    assert scored["accuracy"] == 0.75
    assert split_metrics(argmax_right, Split(np.zeros((5, 4, 4), np.uint8), one_hot), "single-label",
                         ["c0", "c1", "c2"])["accuracy"] == 0.8
    # nothing describable: no score at all
    assert split_metrics(probs, split, "multi-label", ["c0", "c1", "c2"], min_class_count=3) == {}
