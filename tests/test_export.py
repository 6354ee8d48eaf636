"""``python -m fedpartial export``: the TorchScript network gives the PyTorch model's probabilities,
and the MONAI bundle runs under MONAI's own runner (``python -m monai.bundle run``) with fedpartial
made unimportable, giving the probabilities and masks ``predict`` gives."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpartial.models import build_model, save_model_file
from fedpartial_tools.cli import main

NORM = {"mean": 0.4, "std": 0.3}
# torch 2.9+ marks torch.jit deprecated; TorchScript is what MONAI bundles and MONAI Deploy load
pytestmark = pytest.mark.filterwarnings(r"ignore:.*torch\.jit.*deprecated:DeprecationWarning")


def _model_file(path, arch="small_cnn", task="multi-label", names=("a", "b", "c"), channels=1, size=(16, 16),
                bias=None, **extra):
    torch.manual_seed(0)
    if arch == "unet":
        model = build_model("unet", 1, channels, channels=[4, 8], strides=[2], num_res_units=0)
    else:
        model = build_model(arch, len(names), channels, width=4, depth=2)
    model.train()  # moves the BatchNorm statistics away from 0 / 1, so eval mode is really exercised
    with torch.no_grad():
        model(torch.rand(8, channels, *(size if all(size) else (16, 16))) * 3)
    model.eval()
    if bias is not None:  # fixes the classes' probabilities on either side of 0.5
        with torch.no_grad():
            model.fc.bias.copy_(torch.tensor(bias))
    meta = {"class_names": list(names), "task": task, "input_size": list(size), "normalisation": NORM, **extra}
    save_model_file(path, model, meta)
    return str(path)


def _test_images(n=4, channels=1, size=(16, 16)):
    """Normalised test images as the model sees them."""
    from fedpartial.training.common import images_to_tensor
    from fedpartial_tools.data.synthetic import make_classification

    data = make_classification(task="multi-label", num_classes=3, size=size[0], channels=channels, seed=0)
    return images_to_tensor(data.splits["test"].images[:n], NORM["mean"], NORM["std"])


@pytest.mark.parametrize("arch,task,names", [("small_cnn", "multi-label", ("a", "b", "c")),
                                             ("small_cnn", "single-label", ("a", "b", "c")),
                                             ("unet", "segmentation", ("lesion",))])
def test_torchscript_gives_the_models_probabilities(tmp_path, arch, task, names):
    from monai.data import load_net_with_metadata

    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import probabilities

    model_path = _model_file(tmp_path / "m.pt", arch, task, names, round=7, job_id="job-1")
    main(["export", "--model", model_path, "--format", "torchscript", "--out", str(tmp_path / "ts")])
    net, meta, _ = load_net_with_metadata(str(tmp_path / "ts" / "model.ts"))
    model, _ = load_model_file(model_path)
    x = _test_images(5)  # a batch size other than the traced one
    with torch.no_grad():
        expected = probabilities(model(x)[1], task) if task != "segmentation" else torch.sigmoid(model(x)[1])
        got = net(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    if task == "single-label":
        assert torch.allclose(got.sum(1), torch.ones(5), atol=1e-5)
    assert meta["class_names"] == list(names) and meta["normalisation"] == NORM and meta["input_size"] == [16, 16]
    assert meta["provenance"]["round"] == 7 and meta["provenance"]["job_id"] == "job-1"


def test_a_model_without_input_size_needs_size(tmp_path, capsys):
    model_path = _model_file(tmp_path / "m.pt", size=(0, 0))
    with pytest.raises(SystemExit):
        main(["export", "--model", model_path, "--format", "torchscript", "--out", str(tmp_path / "ts")])
    assert "has no input_size" in capsys.readouterr().err
    main(["export", "--model", model_path, "--format", "torchscript", "--out", str(tmp_path / "ts"), "--size", "20,24"])
    net = torch.jit.load(str(tmp_path / "ts" / "model.ts"))
    assert net(torch.zeros(2, 1, 20, 24)).shape == (2, 3)


def _monai_run(bundle: Path, images: Path, out: Path, tmp_path: Path):
    """``python -m monai.bundle run`` with fedpartial and fedpartial_tools unimportable: the bundle
    must need nothing of ours."""
    blocker = tmp_path / "blocker"
    for name in ("fedpartial", "fedpartial_tools"):
        (blocker / name).mkdir(parents=True, exist_ok=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('the bundle imported {name}')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    command = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(bundle / "configs" / "inference.json"),
               "--dataset_dir", str(images), "--output_dir", str(out)]
    run = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def _pngs(folder: Path, shapes, channels=1, seed=0):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, shape in enumerate(shapes):
        pixels = rng.integers(0, 256, shape + ((3,) if channels == 3 else ()), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i}.png")


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_monai_bundle_classifies_pngs_as_predict_does(tmp_path):
    stored = {"thresholds": {"a": 0.0, "b": 1.0}, "rule": "test", "source": "hand"}  # a always 1, b always 0
    # a is about 0.007 and b about 0.993 (biases -5, +5): 0.5 would decide the other way for both
    model_path = _model_file(tmp_path / "m.pt", channels=3, bias=[-5.0, 5.0, 0.0], round=4, job_id="job-9",
                             method="fedmlp", decision_thresholds=stored)
    main(["export", "--model", model_path, "--format", "monai-bundle", "--out", str(tmp_path / "bundle")])
    bundle = tmp_path / "bundle"
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    assert files == ["configs/inference.json", "configs/logging.conf", "configs/metadata.json", "docs/README.md",
                     "models/model.pt", "models/model.ts"]
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert metadata["version"] and metadata["monai_version"] and metadata["network_data_format"]["inputs"]["image"][
        "spatial_shape"] == [16, 16]
    assert metadata["network_data_format"]["outputs"]["pred"]["channel_def"] == {"0": "a", "1": "b", "2": "c"}
    ours = metadata["fedpartial"]
    assert ours["task"] == "multi-label" and ours["normalisation"] == NORM
    assert ours["decision_thresholds"] == [0, 1, 0.5]  # c is not in the file: the default
    assert {k: ours["provenance"][k] for k in ("round", "job_id", "method")} == {"round": 4, "job_id": "job-9",
                                                                                "method": "fedmlp"}
    # model.pt is the state dict of model.ts's module
    net = torch.jit.load(str(bundle / "models" / "model.ts"))
    net.load_state_dict(torch.load(str(bundle / "models" / "model.pt")))

    _pngs(tmp_path / "png", [(16, 16), (24, 20), (9, 13)], channels=3)  # two are resized
    _monai_run(bundle, tmp_path / "png", tmp_path / "results", tmp_path)
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "png"), "--out", str(tmp_path / "p")])
    bundle_rows = _rows(tmp_path / "results" / "predictions.csv")
    predict_rows = _rows(tmp_path / "p" / "predictions.csv")
    assert [Path(r["file"]).name for r in bundle_rows] == [r["file"] for r in predict_rows] == [
        "img0.png", "img1.png", "img2.png"]
    for b, p in zip(bundle_rows, predict_rows):
        assert [float(b[f"prob_{c}"]) for c in "abc"] == pytest.approx([float(p[f"prob_{c}"]) for c in "abc"],
                                                                        abs=2e-6)
        assert [int(float(b[f"decision_{c}"])) for c in "abc"] == [int(p[f"decision_{c}"]) for c in "abc"]
        assert (b["decision_a"], b["decision_b"]) == ("1.0", "0.0")


def test_monai_bundle_writes_the_masks_predict_writes(tmp_path):
    from PIL import Image

    model_path = _model_file(tmp_path / "m.pt", "unet", "segmentation", ("lesion",))
    main(["export", "--model", model_path, "--format", "monai-bundle", "--out", str(tmp_path / "bundle")])
    _pngs(tmp_path / "png", [(16, 16), (20, 24)], seed=1)
    _monai_run(tmp_path / "bundle", tmp_path / "png", tmp_path / "results", tmp_path)
    main(["predict", "images", "--model", model_path, "--folder", str(tmp_path / "png"), "--out", str(tmp_path / "p")])
    for i, shape in enumerate([(16, 16), (20, 24)]):
        bundle_mask = np.asarray(Image.open(tmp_path / "results" / f"img{i}_mask.png"))
        predict_mask = np.asarray(Image.open(tmp_path / "p" / "masks" / f"img{i}_mask.png"))
        assert bundle_mask.shape == shape  # the image's own size, (H, W) not (W, H)
        assert 0 < (bundle_mask > 0).mean() < 1  # neither empty nor full: the comparison says something
        assert np.array_equal(bundle_mask, predict_mask)
