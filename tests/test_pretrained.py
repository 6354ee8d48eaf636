"""Pretrained starts (``model.pretrained``): torchvision / MONAI / own weights files onto our
networks, the head re-made, grey-from-RGB, clear errors, and the round-0 global model of a job.

Every weights file is written here (no torchvision, no download); expected values come from the
file the test wrote, never from the loader."""
import re
from pathlib import Path

import pytest
import torch

from fedpartial.models import build_model, save_model_file
from fedpartial.models.pretrained import load_pretrained

REPO = Path(__file__).resolve().parents[1]
META = {"class_names": [f"c{i}" for i in range(5)], "task": "single-label", "input_size": [28, 28],
        "normalisation": {"mean": 0.5, "std": 0.5}}


def _bn(prefix, n, counters=True):
    keys = {f"{prefix}.weight": (n,), f"{prefix}.bias": (n,), f"{prefix}.running_mean": (n,),
            f"{prefix}.running_var": (n,)}
    if counters:
        keys[f"{prefix}.num_batches_tracked"] = ()
    return keys


def torchvision_resnet18_shapes(in_channels=3):
    """Key -> shape of ``torchvision.models.resnet18().state_dict()``, written from the architecture."""
    shapes = {"conv1.weight": (64, in_channels, 7, 7), **_bn("bn1", 64)}
    inplanes = 64
    for layer, planes in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{layer}.{block}"
            cin = inplanes if block == 0 else planes
            shapes[f"{p}.conv1.weight"] = (planes, cin, 3, 3)
            shapes.update(_bn(f"{p}.bn1", planes))
            shapes[f"{p}.conv2.weight"] = (planes, planes, 3, 3)
            shapes.update(_bn(f"{p}.bn2", planes))
            if block == 0 and layer > 1:  # stride 2 / wider: 1x1 conv (no bias) + BN shortcut
                shapes[f"{p}.downsample.0.weight"] = (planes, inplanes, 1, 1)
                shapes.update(_bn(f"{p}.downsample.1", planes))
        inplanes = planes
    shapes["fc.weight"], shapes["fc.bias"] = (1000, 512), (1000,)
    return shapes


def torchvision_densenet121_shapes(old_style=False):
    """Key -> shape of ``torchvision.models.densenet121().state_dict()``; ``old_style``: the names
    of old checkpoints (``norm.1`` / ``conv.1``, no BatchNorm counters)."""
    counters = not old_style
    shapes = {"features.conv0.weight": (64, 3, 7, 7), **_bn("features.norm0", 64, counters)}
    channels = 64
    for b, layers in enumerate((6, 12, 24, 16), start=1):
        for i in range(1, layers + 1):
            p = f"features.denseblock{b}.denselayer{i}"
            sep = "." if old_style else ""
            shapes.update(_bn(f"{p}.norm{sep}1", channels, counters))
            shapes[f"{p}.conv{sep}1.weight"] = (128, channels, 1, 1)  # bn_size 4 * growth 32
            shapes.update(_bn(f"{p}.norm{sep}2", 128, counters))
            shapes[f"{p}.conv{sep}2.weight"] = (32, 128, 3, 3)
            channels += 32
        if b < 4:
            shapes.update(_bn(f"features.transition{b}.norm", channels, counters))
            shapes[f"features.transition{b}.conv.weight"] = (channels // 2, channels, 1, 1)
            channels //= 2
    shapes.update(_bn("features.norm5", channels, counters))
    shapes["classifier.weight"], shapes["classifier.bias"] = (1000, 1024), (1000,)
    return shapes


def random_state(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, 1000, s, generator=g) if k.endswith("num_batches_tracked")
            else torch.randn(s, generator=g) for k, s in shapes.items()}


def fresh(arch, num_classes, in_channels, seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(arch, num_classes, in_channels, **kw)


def test_torchvision_resnet18_body_loaded_head_fresh(tmp_path):
    state = random_state(torchvision_resnet18_shapes())
    assert len(state) == 122
    path = tmp_path / "resnet18.pth"
    torch.save(state, path)
    model, init = fresh("resnet18", 7, 3), fresh("resnet18", 7, 3)
    report = load_pretrained(model, str(path))
    got = model.state_dict()
    for key in ("conv1.weight", "bn1.running_mean", "layer3.1.conv2.weight", "layer2.0.downsample.0.weight",
                "layer4.0.downsample.1.running_var"):
        assert torch.equal(got[f"backbone.{key}"], state[key]), key
    # torchvision's shortcut conv has no bias, MONAI's has: zero is the same function
    assert torch.equal(got["backbone.layer2.0.downsample.0.bias"], torch.zeros(128))
    assert got["fc.weight"].shape == (7, 512)
    assert torch.equal(got["fc.weight"], init.state_dict()["fc.weight"])
    assert report["source_format"].startswith("resnet18") and "fc.weight" in report["skipped_head"]
    assert report["head_fresh"] == ["fc.weight", "fc.bias"] and len(report["zero_filled"]) == 3
    assert len(report["loaded"]) == 120 and not report["channel_sum"]


def test_torchvision_resnet18_rgb_into_grey_sums_channels(tmp_path):
    state = random_state(torchvision_resnet18_shapes(), seed=1)
    path = tmp_path / "resnet18.pth"
    torch.save({"epoch": 90, "state_dict": state}, path)  # a training checkpoint wrapping the weights
    model = fresh("resnet18", 7, 1)
    report = load_pretrained(model, str(path))
    got = model.state_dict()
    assert got["backbone.conv1.weight"].shape == (64, 1, 7, 7)
    assert torch.allclose(got["backbone.conv1.weight"][:, 0], state["conv1.weight"][:, 0] + state["conv1.weight"][:, 1]
                          + state["conv1.weight"][:, 2])
    assert torch.equal(got["backbone.layer1.0.conv1.weight"], state["layer1.0.conv1.weight"])
    assert report["channel_sum"] == ["backbone.conv1.weight"]
    # a grey image fed as three equal channels gives the same first-layer response
    x = torch.rand(2, 1, 16, 16)
    rgb = torch.nn.functional.conv2d(x.repeat(1, 3, 1, 1), state["conv1.weight"], padding=3)
    assert torch.allclose(model.backbone.conv1(x), rgb, atol=1e-4)


@pytest.mark.parametrize("old_style", [False, True], ids=["torchvision-new", "torchvision-old-norm.1"])
def test_torchvision_densenet121(tmp_path, old_style):
    shapes = torchvision_densenet121_shapes(old_style)
    # the literal torchvision names and shapes
    assert shapes["features.conv0.weight"] == (64, 3, 7, 7) and shapes["features.norm5.weight"] == (1024,)
    conv1 = "features.denseblock1.denselayer1.conv.1.weight" if old_style else \
        "features.denseblock1.denselayer1.conv1.weight"
    assert shapes[conv1] == (128, 64, 1, 1)
    state = random_state(shapes, seed=2)
    path = tmp_path / "densenet121.pth"
    torch.save(state, path)
    model, init = fresh("densenet121", 7, 1), fresh("densenet121", 7, 1)
    report = load_pretrained(model, str(path))
    got = model.state_dict()
    assert torch.allclose(got["backbone.features.conv0.weight"], state["features.conv0.weight"].sum(1, keepdim=True))
    assert torch.equal(got["backbone.features.denseblock1.denselayer1.layers.conv1.weight"], state[conv1])
    norm2 = "features.denseblock3.denselayer24.norm.2.running_var" if old_style else \
        "features.denseblock3.denselayer24.norm2.running_var"
    assert torch.equal(got["backbone.features.denseblock3.denselayer24.layers.norm2.running_var"], state[norm2])
    assert torch.equal(got["backbone.features.transition2.conv.weight"], state["features.transition2.conv.weight"])
    assert torch.equal(got["backbone.features.norm5.weight"], state["features.norm5.weight"])
    assert got["fc.weight"].shape == (7, 1024) and torch.equal(got["fc.weight"], init.state_dict()["fc.weight"])
    assert {"classifier.weight", "classifier.bias"} <= set(report["skipped_head"])
    assert report["channel_sum"] == ["backbone.features.conv0.weight"]
    if old_style:  # BatchNorm counters absent from old files keep their init
        assert report["kept_init"] and all(k.endswith("num_batches_tracked") for k in report["kept_init"])


def test_monai_unet_state_dict(tmp_path):
    from monai.networks.nets import UNet

    torch.manual_seed(3)
    src = UNet(spatial_dims=2, in_channels=3, out_channels=2, channels=(16, 32, 64, 128), strides=(2, 2, 2),
               num_res_units=2).state_dict()
    path = tmp_path / "unet.pt"
    torch.save(src, path)
    model, init = fresh("unet", 1, 1), fresh("unet", 1, 1)
    report = load_pretrained(model, str(path))
    got = model.state_dict()
    key = "model.1.submodule.1.submodule.0.conv.unit1.conv.weight"
    assert torch.equal(got[f"net.{key}"], src[key])
    # both convs that read the input (main path and residual) are summed RGB -> grey
    for key in ("model.0.conv.unit0.conv.weight", "model.0.residual.weight"):
        assert torch.allclose(got[f"net.{key}"], src[key].sum(1, keepdim=True)), key
    assert sorted(report["channel_sum"]) == ["net.model.0.conv.unit0.conv.weight", "net.model.0.residual.weight"]
    # the output block follows the job's classes (2 in the file, 1 here): fresh
    head = "net.model.2.1.conv.unit0.conv.weight"
    assert head in model.classifier_param_names() and torch.equal(got[head], init.state_dict()[head])
    assert torch.equal(got["net.model.2.0.conv.weight"], init.state_dict()["net.model.2.0.conv.weight"])


def test_own_model_file_for_other_classes_body_loaded_head_fresh(tmp_path):
    other = fresh("small_cnn", 5, 3, seed=4, width=8, depth=2)
    path = tmp_path / "other.pt"
    save_model_file(path, other, META)
    model, init = fresh("small_cnn", 7, 3, width=8, depth=2), fresh("small_cnn", 7, 3, width=8, depth=2)
    report = load_pretrained(model, str(path), class_names=[f"k{i}" for i in range(7)], task="single-label")
    saved = torch.load(path, weights_only=True)["state_dict"]
    got = model.state_dict()
    for key in ("body.0.weight", "body.1.running_mean", "body.4.weight"):
        assert torch.equal(got[key], saved[key]), key
    assert torch.equal(got["fc.weight"], init.state_dict()["fc.weight"])
    assert report["source_format"] == "fedpartial-model" and report["head_fresh"] == ["fc.weight", "fc.bias"]


def test_own_file_same_task_keeps_head_plain_state_dict_does_not(tmp_path):
    src = fresh("small_cnn", 5, 3, seed=5, width=8, depth=2)
    save_model_file(tmp_path / "same.pt", src, META)
    model = fresh("small_cnn", 5, 3, width=8, depth=2)
    load_pretrained(model, str(tmp_path / "same.pt"), class_names=META["class_names"], task="single-label")
    assert torch.equal(model.state_dict()["fc.weight"], src.state_dict()["fc.weight"])
    torch.save(src.state_dict(), tmp_path / "plain.pt")  # no task recorded: head re-made
    model, init = fresh("small_cnn", 5, 3, width=8, depth=2), fresh("small_cnn", 5, 3, width=8, depth=2)
    report = load_pretrained(model, str(tmp_path / "plain.pt"), class_names=META["class_names"], task="single-label")
    assert report["source_format"] == "fedpartial-state-dict"
    assert torch.equal(model.state_dict()["fc.weight"], init.state_dict()["fc.weight"])
    assert torch.equal(model.state_dict()["body.4.weight"], src.state_dict()["body.4.weight"])


def test_shape_mismatch_names_parameter_and_shapes(tmp_path):
    torch.save(fresh("small_cnn", 5, 3, width=8, depth=2).state_dict(), tmp_path / "w8.pt")
    with pytest.raises(ValueError, match=re.escape("'body.0.weight' has shape (8, 3, 3, 3) in the file but "
                                                   "(16, 3, 3, 3)")):
        load_pretrained(fresh("small_cnn", 5, 3, width=16, depth=2), str(tmp_path / "w8.pt"))
    # grey file into an RGB model: only 3 -> 1 is converted
    torch.save(fresh("small_cnn", 5, 1, width=8, depth=2).state_dict(), tmp_path / "grey.pt")
    with pytest.raises(ValueError, match=re.escape("'body.0.weight' has shape (8, 1, 3, 3) in the file but "
                                                   "(8, 3, 3, 3)")):
        load_pretrained(fresh("small_cnn", 5, 3, width=8, depth=2), str(tmp_path / "grey.pt"))


def test_missing_file_corrupt_file_wrong_arch_and_partial_file(tmp_path):
    missing = tmp_path / "nowhere" / "densenet121.pth"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_pretrained(fresh("small_cnn", 5, 3, width=8, depth=2), str(missing))
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        load_pretrained(fresh("small_cnn", 5, 3, width=8, depth=2), str(bad))
    resnet = tmp_path / "resnet18.pth"
    state = random_state(torchvision_resnet18_shapes())
    torch.save(state, resnet)
    with pytest.raises(ValueError, match="job's model is 'small_cnn'"):
        load_pretrained(fresh("small_cnn", 5, 3, width=8, depth=2), str(resnet))
    del state["layer3.1.conv2.weight"]
    torch.save(state, resnet)
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layer3\.1\.conv2\.weight"):
        load_pretrained(fresh("resnet18", 7, 3), str(resnet))
    state = random_state(torchvision_resnet18_shapes())
    state["layer1.2.conv1.weight"] = torch.zeros(64, 64, 3, 3)  # a deeper ResNet's block
    torch.save(state, resnet)
    with pytest.raises(ValueError, match=r"no place for.*layer1\.2\.conv1\.weight"):
        load_pretrained(fresh("resnet18", 7, 3), str(resnet))


def _server_ctx(tmp_path):
    from unittest import mock

    from nvflare.apis.fl_context import FLContext

    fl_ctx = FLContext()
    engine = mock.MagicMock()
    ws = engine.get_workspace.return_value
    ws.get_run_dir.return_value = str(tmp_path / "run")
    ws.get_app_dir.return_value = str(tmp_path / "run" / "app_server")
    ws.get_root_dir.return_value = str(tmp_path / "server")
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    return fl_ctx


def test_persistor_round0_model_from_pretrained_and_missing_file(tmp_path):
    from nvflare.app_common.abstract.model import ModelLearnableKey

    from fedpartial.flare.persistor import FedPartialPersistor

    block = {"arch": "small_cnn", "arch_args": {"width": 8, "depth": 2}, "in_channels": 3,
             "class_names": ["a", "b"], "task": "single-label"}
    weights = fresh("small_cnn", 9, 3, seed=8, width=8, depth=2).state_dict()
    (tmp_path / "server" / "weights").mkdir(parents=True)
    torch.save(weights, tmp_path / "server" / "weights" / "cnn.pt")
    # relative: looked up in the app folder, then in the server's workspace root
    persistor = FedPartialPersistor(model={**block, "pretrained": "weights/cnn.pt"})
    sent = persistor.load_model(_server_ctx(tmp_path))[ModelLearnableKey.WEIGHTS]
    assert torch.equal(torch.as_tensor(sent["body.4.weight"]), weights["body.4.weight"])
    assert sent["fc.weight"].shape == (2, 16)

    persistor = FedPartialPersistor(model={**block, "pretrained": str(tmp_path / "gone.pth")})
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "gone.pth"))):
        persistor.load_model(_server_ctx(tmp_path))
    assert FedPartialPersistor(model=block).settings["pretrained"] == ""


@pytest.mark.slow
def test_job_round0_global_model_is_the_pretrained_file(tmp_path):
    from fedpartial.data.npz import save_npz
    from fedpartial_tools.data.partition import split_file
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.data.synthetic import make_classification
    from fedpartial_tools.run.simulator import simulate

    src = tmp_path / "src.npz"
    save_npz(make_classification("multi-label", num_classes=4, n_train=60, n_val=20, n_test=20, seed=1), str(src))
    split_file(str(src), "label-set-mismatch", sites=2, seed=0, out=str(tmp_path / "sites"), classes_per_site=2)
    # RGB weights for a grey job: the server also applies the channel sum
    weights = fresh("small_cnn", 10, 3, seed=7, width=8, depth=2).state_dict()
    pretrained = tmp_path / "pretrained.pt"
    torch.save(weights, pretrained)
    ws = tmp_path / "ws"
    summary = simulate(str(REPO / "jobs" / "fedavg"), str(tmp_path / "sites"), str(ws),
                       ["num_rounds=1", "rule_args.lr=0", "model.arch=small_cnn",
                        "model.arch_args={\"width\": 8, \"depth\": 2}", f"server.model.pretrained={pretrained}",
                        *dataset_overrides(str(tmp_path / "sites"))], timeout=240, log=lambda *_: None)
    assert summary["ok"], summary
    saved = torch.load(ws / "global_model.pt", weights_only=True)["state_dict"]
    # lr 0: one round leaves the weights as sent at round 0 (BatchNorm statistics still move)
    assert torch.allclose(saved["body.0.weight"], weights["body.0.weight"].sum(1, keepdim=True), atol=1e-6)
    assert torch.allclose(saved["body.4.weight"], weights["body.4.weight"], atol=1e-6)
    seeded = fresh("small_cnn", 4, 1, width=8, depth=2).state_dict()
    assert not torch.allclose(saved["body.4.weight"], seeded["body.4.weight"])
    assert torch.allclose(saved["fc.weight"], seeded["fc.weight"], atol=1e-6)  # head: the job's seeded init
    log = (ws / "simulator.log").read_text()
    assert f"initial global model from pretrained weights: loaded 12 of 14 weights from '{pretrained}'" in log
