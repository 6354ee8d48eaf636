"""Models: (features, logits) shapes, classifier names, spec, seeding, dropout, model files."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpartial.models import (FORMAT, ModelFileError, build_model, load_model_file, save_model_file,
                               save_weights_file)
from fedpartial.training.common import state_dict_numpy

FEATURE_DIMS = {"small_cnn": 128, "resnet18": 512, "densenet121": 1024}  # 32*2**2, MONAI resnet18, densenet121
CASES = [(arch, c, s) for arch in ("small_cnn", "resnet18", "unet") for c in (1, 3) for s in (28, 64)]
CASES += [("densenet121", c, 32) for c in (1, 3)]  # densenet is slow: 32 px only


def _meta(**extra):
    return {"class_names": ["a", "b", "c"], "task": "multi-label", "input_size": (28, 28),
            "normalisation": {"mean": 0.5, "std": 0.5}, **extra}


@pytest.mark.parametrize("arch,channels,size", CASES)
def test_forward_shapes(arch, channels, size):
    torch.manual_seed(0)
    num_classes = 1 if arch == "unet" else 3
    model = build_model(arch, num_classes, channels).eval()
    with torch.no_grad():
        features, logits = model(torch.randn(2, channels, size, size))
    if arch == "unet":
        # 28 is not a multiple of 8 (strides 2,2,2): padded inside, cropped back to 28.
        assert model.task_kind == "segmentation"
        assert logits.shape == (2, 1, size, size)
        assert features is logits
    else:
        assert model.task_kind == "classification"
        assert features.shape == (2, FEATURE_DIMS[arch])
        assert logits.shape == (2, 3)
        assert model.feature_dim == FEATURE_DIMS[arch]


@pytest.mark.parametrize("arch", ["small_cnn", "resnet18"])
def test_classifier_names_are_the_last_linear_layer(arch):
    torch.manual_seed(0)
    model = build_model(arch, 4, 1).eval()
    names = model.classifier_param_names()
    state = model.state_dict()
    assert len(names) == 2 and all(n in state for n in names)
    weight, bias = state[names[0]], state[names[1]]
    assert weight.shape == (4, model.feature_dim) and bias.shape == (4,)
    with torch.no_grad():
        features, logits = model(torch.randn(3, 1, 28, 28))
    # logits = features @ W^T + b with exactly these parameters: they are the last layer.
    torch.testing.assert_close(logits, features @ weight.T + bias)


def test_densenet_classifier_and_mc_dropout():
    torch.manual_seed(0)
    model = build_model("densenet121", 2, 3, dropout=0.5)
    names = model.classifier_param_names()
    state = model.state_dict()
    x = torch.randn(4, 3, 32, 32)
    model.train()
    f1, z1 = model(x)
    f2, z2 = model(x)
    # Features are taken before the dropout: same batch, same features; logits differ (MC-dropout).
    torch.testing.assert_close(f1, f2)
    assert not torch.allclose(z1, z2)
    model.eval()
    with torch.no_grad():
        f, z = model(x)
    torch.testing.assert_close(z, f @ state[names[0]].T + state[names[1]])


def test_densenet_upsamples_images_smaller_than_its_five_halvings():
    """HAM10000's 28 px images reach DenseNet-121 as the same images at 32 px (bilinear); 64 px
    images are passed through unchanged."""
    torch.manual_seed(0)
    model = build_model("densenet121", 2, 3).eval()
    small = torch.rand(2, 3, 28, 28)
    with torch.no_grad():
        _, logits = model(small)
        expected = model.fc(model.backbone(F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)))
        torch.testing.assert_close(logits, expected)
        large = torch.rand(1, 3, 64, 64)
        torch.testing.assert_close(model(large)[1], model.fc(model.backbone(large)))


def test_unet_classifier_is_final_conv():
    torch.manual_seed(0)
    model = build_model("unet", 1, 1).eval()
    names = model.classifier_param_names()
    state = model.state_dict()
    assert len(names) == 2 and all(n in state for n in names)
    assert names[0].endswith(".weight") and names[1].endswith(".bias") and state[names[1]].shape == (1,)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        _, before = model(x)
        state[names[1]].add_(1.0)
        _, after = model(x)
    # Adding 1 to this bias adds exactly 1 to every output pixel: nothing (norm, activation)
    # comes after this conv, it is the final layer. (MONAI's last residual unit adds its
    # input back, so zeroing the weight alone would not make the output constant.)
    torch.testing.assert_close(after, before + 1.0)


def test_spec_rebuilds_and_seeding_is_repeatable():
    torch.manual_seed(7)
    a = build_model("small_cnn", 5, 3, width=8, depth=2, dropout=0.1)
    assert a.spec == {"arch": "small_cnn", "num_classes": 5, "in_channels": 3,
                      "arch_args": {"width": 8, "depth": 2, "dropout": 0.1, "stem_stride": 1}}
    torch.manual_seed(7)
    b = build_model(**a.spec)
    torch.manual_seed(8)
    c = build_model("small_cnn", 5, 3, width=8, depth=2, dropout=0.1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])
    unet = build_model("unet", 1, 1)
    assert unet.spec["arch_args"] == {"channels": [16, 32, 64, 128], "strides": [2, 2, 2], "num_res_units": 2}


def test_unet_foreground_prior_sets_the_output_bias():
    # logit(0.01) = ln(0.01 / 0.99) = -4.5951; 0 keeps MONAI's initialisation and stays out of the spec
    unet = build_model("unet", 1, 1, channels=[4, 8], strides=[2], num_res_units=1, foreground_prior=0.01)
    assert unet.classifier_module().bias.detach().item() == pytest.approx(-4.59512, abs=1e-5)
    assert unet.spec["arch_args"]["foreground_prior"] == 0.01
    plain = build_model("unet", 1, 1, channels=[4, 8], strides=[2], num_res_units=1, foreground_prior=0.0)
    assert "foreground_prior" not in plain.spec["arch_args"]
    with pytest.raises(ValueError, match="foreground_prior must be in"):
        build_model("unet", 1, 1, channels=[4, 8], strides=[2], foreground_prior=1.0)


def test_unknown_arch_and_bad_args():
    with pytest.raises(ValueError, match="valid archs: densenet121, resnet18, small_cnn, unet"):
        build_model("vgg", 3, 1)
    with pytest.raises(ValueError, match="small_cnn: bad arch_args"):
        build_model("small_cnn", 3, 1, widht=8)
    with pytest.raises(ValueError, match="dropout"):
        build_model("small_cnn", 3, 1, dropout=1.5)
    with pytest.raises(ValueError, match="strides"):
        build_model("unet", 1, 1, channels=(8, 16), strides=(2, 2))


def test_small_cnn_stem_stride_halves_the_map():
    model = build_model("small_cnn", 2, 1, width=4, depth=1, stem_stride=2).eval()
    # 64 px -> conv stride 2 -> 32 -> max-pool -> 16.
    assert model.body(torch.zeros(1, 1, 64, 64)).shape == (1, 4, 16, 16)


@pytest.mark.parametrize("arch,channels,size", [("small_cnn", 3, 28), ("unet", 1, 28)])
def test_model_file_round_trip(tmp_path, arch, channels, size):
    torch.manual_seed(0)
    model = build_model(arch, 1 if arch == "unet" else 3, channels, **({"width": 8} if arch == "small_cnn" else {}))
    x = torch.randn(2, channels, size, size)
    model.train()
    model(x)  # move BatchNorm running stats off their defaults so buffers are checked too
    model.eval()
    path = save_model_file(tmp_path / "sub" / "best.pt", model,
                           _meta(round=np.int64(4), metrics={"auc": np.float32(0.75)}))
    assert os.listdir(tmp_path / "sub") == ["best.pt"]  # atomic: no temp file left behind
    loaded, meta = load_model_file(path)
    assert not loaded.training
    with torch.no_grad():
        assert torch.equal(model(x)[1], loaded(x)[1])
    assert meta["spec"] == model.spec
    assert meta["round"] == 4 and meta["metrics"] == {"auc": 0.75} and meta["input_size"] == [28, 28]
    assert torch.load(path, weights_only=True)["format"] == FORMAT


def test_weights_file_round_trip_and_mismatch(tmp_path):
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=8).eval()
    weights = state_dict_numpy(model)
    path = save_weights_file(tmp_path / "global.pt", weights, model.spec, _meta())
    loaded, _ = load_model_file(path)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(model(x)[1], loaded(x)[1])
    bad = dict(weights, **{"fc.weight": np.zeros((2, 32), np.float32)})
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(2, 32\)"):
        save_weights_file(tmp_path / "bad.pt", bad, model.spec, _meta())
    with pytest.raises(ValueError, match="lacks"):
        save_weights_file(tmp_path / "bad.pt", weights, model.spec, {"task": "multi-label"})


def test_corrupt_and_foreign_files(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file at all")
    with pytest.raises(ModelFileError, match="garbage.pt is not a readable fedpartial model file"):
        load_model_file(garbage)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ModelFileError, match="foreign.pt is not a fedpartial model file"):
        load_model_file(foreign)
    good = save_model_file(tmp_path / "good.pt", build_model("small_cnn", 3, 1, width=4), _meta())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="truncated.pt"):
        load_model_file(truncated)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_model_file(tmp_path / "missing.pt")


def test_channels_last_trains_the_same_model_and_sends_c_ordered_weights():
    from fedpartial.training.common import load_state_numpy, place_model

    torch.manual_seed(0)
    plain = build_model("small_cnn", 3, 3, width=8, depth=2).eval()
    nhwc = place_model(build_model("small_cnn", 3, 3, width=8, depth=2), torch.device("cpu"), "channels_last").eval()
    conv = nhwc.body[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    load_state_numpy(nhwc, state_dict_numpy(plain))  # copying keeps the layout
    assert nhwc.body[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(plain(x)[1], nhwc(x)[1], atol=1e-5)
    sent = state_dict_numpy(nhwc)
    assert all(v.flags["C_CONTIGUOUS"] for v in sent.values())  # the wire never sees the layout
    np.testing.assert_array_equal(sent["body.0.weight"], state_dict_numpy(plain)["body.0.weight"])
    with pytest.raises(ValueError, match="nhwc"):
        place_model(plain, torch.device("cpu"), "nhwc")


def test_every_job_lets_the_site_pick_the_memory_format():
    import glob
    import json

    from fedpartial.flare.executors import FedPartialExecutor

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(glob.glob(os.path.join(repo, "jobs", "*", "app", "config", "config_fed_client.json")))
    from fedpartial_tools.jobs.recipes import RECIPES

    assert len(paths) == len(RECIPES)
    for path in paths:
        client = json.load(open(path))
        assert client["memory_format"] == "contiguous", path  # default: seeded runs repeat the README's
        assert client["executors"][0]["executor"]["args"]["memory_format"] == "{memory_format}", path
    with pytest.raises(ValueError, match="memory_format.*'nchw'"):
        FedPartialExecutor(memory_format="nchw")
