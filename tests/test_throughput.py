"""The throughput benchmark's machinery on tiny data: every method's rule is timed on the task it
runs on, the images counted are those through the student in training mode, and FedIRM's
unlabelled branch is timed with the labels really hidden."""
import numpy as np
import pytest
import torch

from fedpartial_tools.data.synthetic import make_classification, make_segmentation
from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, Dataset
from fedpartial_tools.bench.throughput import RULES, hide_labels, methods_for, plain_loop, rule_throughput

N_TRAIN = 32
BATCH = 8


def _site(task: str) -> Dataset:
    if task == SEGMENTATION:
        data = make_segmentation(n_train=N_TRAIN, n_val=4, n_test=4, size=32, seed=0)
    else:
        data = make_classification(task, num_classes=4, n_train=N_TRAIN, n_val=8, n_test=8, size=16, seed=0)
    data.site = "site-1"
    return data


def test_methods_per_task():
    assert methods_for(SINGLE_LABEL) == ["fedavg", "fedlsm", "fedirm", "fedirm_unlabelled"]
    assert methods_for(MULTI_LABEL) == ["fedavg", "fedlsm", "fedmlp", "fedirm", "fedirm_unlabelled"]
    assert methods_for(SEGMENTATION) == ["fedavg_seg", "fedia"]
    assert set(RULES) == set(methods_for(SINGLE_LABEL) + methods_for(MULTI_LABEL) + methods_for(SEGMENTATION))


def test_hide_labels_leaves_images_and_val_alone():
    data = _site(SINGLE_LABEL)
    hidden = hide_labels(data)
    train = hidden.splits["train"]
    assert not train.labels.any() and not train.label_mask.any()
    assert train.images is data.splits["train"].images
    assert hidden.splits["val"] is data.splits["val"]
    assert data.splits["train"].labels.any()  # the original is untouched


# (method, task, images through the student per timed round): every rule here passes each of the
# 32 training images through the student once per round (the supervised rules, FedIRM's
# unlabelled branch whose MC-dropout passes run in eval mode, FedIA after warm-up whose IoU pass
# runs in eval mode); None = depends on the method's own sampling, only checked > 0.
CASES = [("fedavg", SINGLE_LABEL, N_TRAIN), ("fedirm", SINGLE_LABEL, N_TRAIN),
         ("fedirm_unlabelled", SINGLE_LABEL, N_TRAIN), ("fedlsm", SINGLE_LABEL, None),
         ("fedmlp", MULTI_LABEL, None), ("fedirm_unlabelled", MULTI_LABEL, N_TRAIN),
         ("fedavg_seg", SEGMENTATION, N_TRAIN), ("fedia", SEGMENTATION, N_TRAIN)]


@pytest.mark.parametrize("name, task, expected_images", CASES)
def test_rule_throughput_counts_student_images(name, task, expected_images):
    torch.set_num_threads(1)
    arch = "unet" if task == SEGMENTATION else "small_cnn"
    arch_args = {"channels": [4, 8], "strides": [2], "num_res_units": 0} if task == SEGMENTATION else \
        {"width": 8, "depth": 2}
    r = rule_throughput(name, _site(task), arch, BATCH, rounds=1, device=torch.device("cpu"), arch_args=arch_args)
    assert r["images_per_s"] > 0 and r["seconds_per_round"] > 0
    if expected_images is None:
        assert r["train_images_per_round"] > 0
    else:
        assert r["train_images_per_round"] == expected_images
    if name == "fedirm":
        assert r["stats_keys"] == ["relation_counts", "relation_matrix", "relation_multilabel"]
    if name == "fedirm_unlabelled":
        assert r["stats_keys"] == []  # an unlabelled site sends no statistics


def test_rule_throughput_in_channels_last():
    r = rule_throughput("fedirm", _site(SINGLE_LABEL), "small_cnn", BATCH, rounds=1, device=torch.device("cpu"),
                        arch_args={"width": 8, "depth": 2}, memory_format="channels_last")
    assert r["train_images_per_round"] == N_TRAIN
    with pytest.raises(ValueError, match="memory_format 'nhwc'"):
        rule_throughput("fedavg", _site(SINGLE_LABEL), "small_cnn", BATCH, 1, torch.device("cpu"), memory_format="nhwc")


def test_a_method_on_the_wrong_task_is_refused():
    with pytest.raises(ValueError, match="fedmlp.*multi-label.*single-label"):
        rule_throughput("fedmlp", _site(SINGLE_LABEL), "small_cnn", BATCH, 1, torch.device("cpu"))


@pytest.mark.parametrize("task", [SINGLE_LABEL, MULTI_LABEL, SEGMENTATION])
def test_plain_loop_runs_each_task(task):
    from fedpartial.models import build_model
    from fedpartial_tools.bench.throughput import _plain_targets
    from fedpartial.training.common import images_to_tensor

    data = _site(task)
    x = images_to_tensor(data.splits["train"].images)
    arch = "unet" if task == SEGMENTATION else "small_cnn"
    model = build_model(arch, data.num_classes, x.shape[1])
    assert plain_loop(model, x, _plain_targets(data), BATCH, 2, torch.device("cpu"), task) > 0
    if task == SEGMENTATION:
        assert set(np.unique(_plain_targets(data).numpy())) <= {0.0, 1.0}  # instance ids -> foreground


def test_flare_overhead_from_a_drawn_metrics_file(tmp_path):
    """Round r's FLARE time = time between aggregations minus the slowest site's local time:
    (25 - 10) - 12 = 3 s and (45 - 25) - 15 = 5 s -> median 4 s."""
    import json

    from fedpartial_tools.bench.throughput import flare_overhead

    site = lambda seconds, stats: {"train_seconds": seconds, "bytes_weights": 1000, "bytes_stats": stats}  # noqa
    rounds = [{"round": 0, "aggregated_at": 10.0, "sites": {"a": site(9.0, 0), "b": site(8.0, 0)}},
              {"round": 1, "aggregated_at": 25.0, "sites": {"a": site(12.0, 200), "b": site(10.0, 0)}},
              {"round": 2, "aggregated_at": 45.0, "sites": {"a": site(15.0, 200), "b": site(11.0, 400)}}]
    (tmp_path / "metrics.json").write_text(json.dumps({"rounds": rounds}))
    o = flare_overhead(str(tmp_path))
    assert o["flare_seconds_per_round"] == pytest.approx(4.0)
    assert o["bytes_weights_per_site_round"] == 1000
    assert o["bytes_stats_per_site_round"] == pytest.approx(800 / 6)
    assert o["bytes_stats_max"] == 400


def test_throughput_command_compares_memory_formats_in_one_run(tmp_path, capsys):
    import json

    from fedpartial_tools.cli import main
    from fedpartial.data.sitefile import write_site_file

    site = str(tmp_path / "site-1.npz")
    write_site_file(site, _site(SINGLE_LABEL))
    out = str(tmp_path / "tp.json")
    main(["throughput", "--site-file", site, "--methods", "fedavg", "--batch-size", str(BATCH), "--steps", "2",
          "--arch-args", '{"width": 8, "depth": 2}', "--memory-format", "contiguous,channels_last", "--json", out],
         developer=True)
    table = capsys.readouterr().out
    assert "| plain PyTorch loop | contiguous |" in table and "| fedavg rule | channels_last |" in table
    results = json.load(open(out))
    assert list(results) == ["contiguous", "channels_last"]
    assert results["channels_last"]["fedavg"]["train_images_per_round"] == N_TRAIN
