"""Site folders (memory-mapped .npy per array), the chunked writer, the cached resize, folder
resolution, the lazy image source and every client's batches through it, predict_uint8 and the
streaming benchmark."""
import os
import time

import numpy as np
import pytest
import torch

from fedpartial.data.sitefile import SiteFolderWriter, load_site_file, write_site_file
from fedpartial_tools.data.synthetic import make_classification, make_segmentation
from fedpartial.data.transforms import resize_dataset
from fedpartial.data.types import DataError, Dataset
from fedpartial.flare.executors import load_site_dataset, resolve_data_file


def _site(seed=0, n_train=24, size=16, task="multi-label"):
    """A small site with a partial label mask (class 2 unannotated on odd rows), ids and groups."""
    data = make_classification(task, num_classes=3, n_train=n_train, n_val=8, n_test=4, size=size, seed=seed)
    for split in data.splits.values():
        split.label_mask[1::2, 2] = False
        split.labels[~split.label_mask] = 0
    data.site, data.info = "site-1", {"scenario": "test", "annotated": [0, 1]}
    return data


def _seg_site(size=16):
    data = make_segmentation(n_train=6, n_val=2, n_test=2, size=size, seed=0)
    for split in data.splits.values():
        split.labels = (split.labels > 0).astype(np.uint8)
    data.site = "site-1"
    return data


def _assert_same(a: Dataset, b: Dataset):
    assert (a.task, a.class_names, a.site, a.info) == (b.task, b.class_names, b.site, b.info)
    assert sorted(a.splits) == sorted(b.splits)
    for name in a.splits:
        for key in ("images", "labels", "label_mask", "ids", "groups"):
            x, y = getattr(a.splits[name], key), getattr(b.splits[name], key)
            assert (x is None) == (y is None), (name, key)
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape, (name, key)
                np.testing.assert_array_equal(x, y)


def test_folder_round_trip_equals_npz(tmp_path):
    data = _site()
    write_site_file(str(tmp_path / "site-1.npz"), data)
    write_site_file(str(tmp_path / "site-1"), data)
    assert sorted(os.listdir(tmp_path / "site-1")) == sorted(
        ["meta.json"] + [f"{s}_{k}.npy" for s in ("train", "val", "test")
                         for k in ("images", "labels", "label_mask", "ids", "groups")])
    from_npz, from_folder = load_site_file(str(tmp_path / "site-1.npz")), load_site_file(str(tmp_path / "site-1"))
    _assert_same(from_npz, from_folder)
    assert isinstance(from_folder.splits["train"].images, np.memmap)  # nothing read until used
    assert not isinstance(from_npz.splits["train"].images, np.memmap)
    # layout="folder" with a .npz-looking name, layout="npz" with a plain name
    write_site_file(str(tmp_path / "x.npz"), data, layout="folder")
    assert (tmp_path / "x.npz" / "meta.json").is_file()
    write_site_file(str(tmp_path / "y"), data, layout="npz")
    _assert_same(load_site_file(str(tmp_path / "y")), from_npz)
    with pytest.raises(ValueError, match="layout"):
        write_site_file(str(tmp_path / "z"), data, layout="zip")
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]


def test_segmentation_folder_round_trip_keeps_masks_mapped(tmp_path):
    data = _seg_site()
    write_site_file(str(tmp_path / "seg.npz"), data)
    write_site_file(str(tmp_path / "seg"), data)
    folder = load_site_file(str(tmp_path / "seg"))
    _assert_same(load_site_file(str(tmp_path / "seg.npz")), folder)
    assert isinstance(folder.splits["train"].labels, np.memmap)


def test_chunked_writer_and_atomic_replace(tmp_path):
    data = _site(n_train=25)
    train, val = data.splits["train"], data.splits["val"]
    path = str(tmp_path / "site-1")
    with SiteFolderWriter(path, data.task, data.class_names, "site-1", {"train": 25, "val": 8}, (16, 16),
                          info=data.info) as w:
        for s in range(0, 25, 10):  # chunks of 10, 10, 5
            part = slice(s, s + 10)
            w.append("train", train.images[part], train.labels[part], train.label_mask[part], train.ids[part],
                     train.groups[part])
        w.append("val", val.images, val.labels, val.label_mask, val.ids, val.groups)
        assert not os.path.exists(path)  # nothing visible until close
    whole = Dataset(data.task, data.class_names, {"train": train, "val": val}, site="site-1", info=data.info)
    _assert_same(load_site_file(path), whole)
    # a second write replaces the folder atomically and leaves no temporary folder behind
    write_site_file(path, _site(seed=1))
    _assert_same(load_site_file(path), _site(seed=1))
    # a short split, or an error inside the with block, leaves the old folder and no tmp folder
    with pytest.raises(DataError, match="'train' got 10 rows, 25 declared"):
        with SiteFolderWriter(path, data.task, data.class_names, "site-1", {"train": 25}, (16, 16)) as w:
            w.append("train", train.images[:10], train.labels[:10], train.label_mask[:10])
    with pytest.raises(DataError, match=r"'train_images' chunk has shape \(3, 8, 8\)"):
        with SiteFolderWriter(path, data.task, data.class_names, "site-1", {"train": 25}, (16, 16)) as w:
            w.append("train", np.zeros((3, 8, 8), np.uint8), train.labels[:3])
    _assert_same(load_site_file(path), _site(seed=1))
    assert sorted(os.listdir(tmp_path)) == ["site-1"]


def _settings(size, task="multi-label", class_names=("finding_0", "finding_1", "finding_2")):
    from fedpartial.flare.common import model_settings

    return model_settings({"arch": "small_cnn", "in_channels": 1, "class_names": list(class_names), "task": task,
                           "input_size": list(size)})


def test_resize_cache_made_once_reused_and_rebuilt(tmp_path):
    folder = str(tmp_path / "site-1")
    write_site_file(folder, _site(size=16))
    cache = tmp_path / "site-1" / "cache" / "train_images_8x8.npy"
    first = load_site_dataset(folder, "site-1", _settings((8, 8)))
    expected = resize_dataset(load_site_file(folder), (8, 8))  # the in-memory resize, whole
    for name in expected.splits:
        np.testing.assert_array_equal(first.splits[name].images, expected.splits[name].images)
    assert isinstance(first.splits["train"].images, np.memmap) and first.splits["train"].images.shape == (24, 8, 8)
    assert (tmp_path / "site-1" / "cache" / "train_images_8x8.json").is_file()
    made = cache.stat().st_mtime_ns
    time.sleep(0.01)
    again = load_site_dataset(folder, "site-1", _settings((8, 8)))
    assert cache.stat().st_mtime_ns == made  # reused, not rebuilt
    np.testing.assert_array_equal(again.splits["train"].images, first.splits["train"].images)
    # the site is rewritten: the cache follows the new source
    write_site_file(folder, _site(seed=3, size=16))
    rebuilt = load_site_dataset(folder, "site-1", _settings((8, 8)))
    assert cache.stat().st_mtime_ns != made
    np.testing.assert_array_equal(rebuilt.splits["train"].images,
                                  resize_dataset(load_site_file(folder), (8, 8)).splits["train"].images)
    # a job at the stored size uses the folder's own arrays, no cache
    same = load_site_dataset(folder, "site-1", _settings((16, 16)))
    assert os.path.basename(same.splits["train"].images.filename) == "train_images.npy"


def test_resize_cache_segmentation_masks_nearest(tmp_path):
    folder = str(tmp_path / "seg")
    write_site_file(folder, _seg_site(size=16))
    got = load_site_dataset(folder, "site-1", _settings((8, 8), "segmentation", ["lesion"]))
    want = resize_dataset(load_site_file(folder), (8, 8))
    for name in want.splits:
        np.testing.assert_array_equal(got.splits[name].images, want.splits[name].images)
        np.testing.assert_array_equal(got.splits[name].labels, want.splits[name].labels)
    assert (tmp_path / "seg" / "cache" / "train_labels_8x8.npy").is_file()


def test_resolve_data_file_prefers_npz_then_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        resolve_data_file(str(tmp_path), "{site}.npz", "site-1")
    assert str(tmp_path / "site-1.npz") in str(e.value) and str(tmp_path / "site-1") + os.sep in str(e.value)
    write_site_file(str(tmp_path / "site-1"), _site())
    assert resolve_data_file(str(tmp_path), "{site}.npz", "site-1") == str(tmp_path / "site-1")
    assert resolve_data_file(str(tmp_path), "{site}", "site-1") == str(tmp_path / "site-1")
    write_site_file(str(tmp_path / "site-1.npz"), _site())
    assert resolve_data_file(str(tmp_path), "{site}.npz", "site-1") == str(tmp_path / "site-1.npz")


def test_bad_folder_names_the_folder_and_key(tmp_path):
    folder = tmp_path / "site-1"
    write_site_file(str(folder), _site())
    np.save(folder / "train_labels.npy", np.zeros((24, 4), np.uint8))
    with pytest.raises(DataError, match=r"'train_labels' has shape \(24, 4\)") as e:
        load_site_file(str(folder))
    assert str(folder) in str(e.value)
    np.save(folder / "train_labels.npy", np.full((24, 3), 2, np.uint8))
    with pytest.raises(DataError, match="'train_labels' entry .* labels must be 0/1"):
        load_site_file(str(folder))
    write_site_file(str(folder), _site())
    os.remove(folder / "train_label_mask.npy")
    with pytest.raises(DataError, match=f"'{folder}' lacks 'train_label_mask'"):
        load_site_file(str(folder))
    write_site_file(str(folder), _site())
    with open(folder / "train_images.npy", "r+b") as f:
        f.truncate(300)  # a copy cut short
    with pytest.raises(DataError, match=r"array 'train_images' \(train_images.npy\) is unreadable"):
        load_site_file(str(folder))
    os.remove(folder / "meta.json")
    with pytest.raises(DataError, match="lacks 'meta.json'"):
        load_site_file(str(folder))


def _one_round(data, loader_workers=0, local_iterations=0):
    from fedpartial.algorithms.base import ClientContext, RoundInput
    from fedpartial.algorithms.fedavg import SupervisedClient
    from fedpartial.models import build_model
    from fedpartial.training.common import state_dict_numpy

    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2)
    rule = SupervisedClient(loss_mode="partial", lr=1e-2, batch_size=5, local_epochs=2,
                            local_iterations=local_iterations, loader_workers=loader_workers)
    rule.setup(ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir="unused", seed=3))
    result = rule.train_round(model, RoundInput(1, 2))
    return state_dict_numpy(model), result


def _old_round(data):
    """The client as it was before streaming: whole labelled split as one float tensor."""
    from fedpartial.algorithms.fedavg import labelled_rows, supervised_loss
    from fedpartial.data.transforms import flip_batch
    from fedpartial.models import build_model
    from fedpartial.training.common import (batch_indices, images_to_tensor, round_seed, seed_everything,
                                            state_dict_numpy)

    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2)
    train = data.splits["train"]
    rows = labelled_rows(train.labels, train.label_mask, data.task)
    images = images_to_tensor(np.asarray(train.images)[rows])
    labels = torch.as_tensor(train.labels[rows], dtype=torch.float32)
    mask = torch.as_tensor(train.label_mask[rows], dtype=torch.float32)
    seed = round_seed(3, "site-1", 1)
    seed_everything(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=5e-4)
    model.train()
    for _ in range(2):
        for idx in batch_indices(len(rows), 5, rng, drop_last=True):
            _, logits = model(flip_batch(images[idx]))
            loss = supervised_loss(logits, labels[idx], mask[idx], data.task, "partial")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return state_dict_numpy(model)


def test_one_round_same_weights_from_npz_folder_and_before(tmp_path):
    data = _site(n_train=23)
    data.splits["train"].label_mask[[2, 7, 11]] = False  # unlabelled rows: batches index a subset
    data.splits["train"].labels[[2, 7, 11]] = 0
    write_site_file(str(tmp_path / "site-1.npz"), data)
    write_site_file(str(tmp_path / "site-1"), data)
    from_npz = load_site_file(str(tmp_path / "site-1.npz"))
    from_folder = load_site_file(str(tmp_path / "site-1"))
    w_npz, r_npz = _one_round(from_npz)
    w_folder, r_folder = _one_round(from_folder)
    w_prefetch, _ = _one_round(from_folder, loader_workers=2)
    w_before = _old_round(from_npz)
    assert r_npz.num_samples == 20 and r_npz.metrics == r_folder.metrics
    for k in w_npz:
        np.testing.assert_array_equal(w_npz[k], w_folder[k], err_msg=k)
        np.testing.assert_array_equal(w_npz[k], w_prefetch[k], err_msg=k)
        np.testing.assert_array_equal(w_npz[k], w_before[k], err_msg=k)
    # a round cut short by local_iterations stops the prefetch thread and gives the same weights
    w_cut, r_cut = _one_round(from_folder, loader_workers=2, local_iterations=3)
    w_cut0, _ = _one_round(from_folder, local_iterations=3)
    assert r_cut.metrics["train_steps"] == 3
    assert all(np.array_equal(w_cut[k], w_cut0[k]) for k in w_cut)


def test_take_rows_memmap_keeps_order(tmp_path):
    from fedpartial.training.common import take_rows

    a = np.arange(40, dtype=np.uint8).reshape(10, 2, 2)
    np.save(tmp_path / "a.npy", a)
    m = np.load(tmp_path / "a.npy", mmap_mode="r")
    rows = np.array([7, 2, 9, 0])
    np.testing.assert_array_equal(take_rows(m, rows), a[rows])
    np.testing.assert_array_equal(take_rows(a, rows), a[rows])


def test_predict_uint8_equals_predict_of_whole_tensor(tmp_path):
    from fedpartial.models import build_model
    from fedpartial.training.common import images_to_tensor, predict, predict_uint8

    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2)
    images = np.random.default_rng(0).integers(0, 256, (11, 12, 12), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    norm = {"mean": 0.4, "std": 0.3}
    want, want_f = predict(model, images_to_tensor(images, 0.4, 0.3), torch.device("cpu"), 4, with_features=True)
    got, got_f = predict_uint8(model, mapped, norm, torch.device("cpu"), 4, with_features=True)
    assert torch.equal(got, want) and torch.equal(got_f, want_f)
    assert torch.equal(predict_uint8(model, images, norm, torch.device("cpu"), 4), want)


def test_predict_fills_the_whole_split_in_order_and_handles_an_empty_source():
    from fedpartial.models import build_model
    from fedpartial.training.common import images_to_tensor, predict

    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2).eval()
    x = images_to_tensor(np.random.default_rng(2).integers(0, 256, (11, 12, 12), dtype=np.uint8))
    with torch.no_grad():  # by hand: batches of 4, 4 and 3, in order
        parts = [model(x[s:s + 4]) for s in (0, 4, 8)]
    logits, feats = predict(model.train(), x, torch.device("cpu"), 4, with_features=True)
    assert logits.shape == (11, 3) and feats.shape[0] == 11
    assert torch.equal(logits, torch.cat([z for _, z in parts])) and torch.equal(feats, torch.cat([f for f, _ in parts]))
    assert model.training  # the caller's mode comes back
    empty = predict(model, x[:0], torch.device("cpu"), 4, with_features=True)
    assert [t.numel() for t in empty] == [0, 0] and predict(model, x[:0], torch.device("cpu"), 4).numel() == 0


def test_streaming_benchmark_tiny(tmp_path, capsys):
    from fedpartial_tools.bench.streaming import main

    report = main(["--images", "64", "--size", "32", "--out", str(tmp_path), "--steps", "2", "--batch-size", "16",
                   "--timeout", "300"])
    out = capsys.readouterr().out
    assert report in out
    assert "cut to --steps 2 batches of 16" in report
    assert "| streaming (site folder, memmap) | 0 |" in report and "| in-memory (arrays read whole) | 0 |" in report
    assert "ratio streaming / in-memory" in report
    assert (tmp_path / "site-1" / "meta.json").is_file()


def test_image_source_batches_equal_the_whole_float_split(tmp_path):
    from fedpartial.training.common import ImageSource, images_to_tensor

    rgb = np.random.default_rng(1).integers(0, 256, (9, 5, 6, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", rgb)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    rows = np.array([8, 1, 4, 6, 0])
    norm = {"mean": 0.4, "std": 0.3}
    whole = images_to_tensor(rgb, 0.4, 0.3)
    for images in (rgb, mapped):
        source = ImageSource(images, norm)
        assert len(source) == 9 and source.shape == tuple(whole.shape) == (9, 3, 5, 6)
        assert torch.equal(source.batch(np.array([7, 2, 2, 0])), whole[[7, 2, 2, 0]])  # order kept, repeats too
        assert torch.equal(source[torch.tensor([3, 1])], whole[[3, 1]])
        assert torch.equal(source[2:7], whole[2:7])
        subset = ImageSource(images, norm, rows)
        assert len(subset) == 5 and subset.shape == (5, 3, 5, 6)
        assert torch.equal(subset.batch(np.array([4, 0, 2])), whole[rows[[4, 0, 2]]])
        assert torch.equal(subset[1:4], whole[rows[1:4]])
    grey = ImageSource(rgb[..., 0])
    assert grey.shape == (9, 1, 5, 6) and torch.equal(grey[0:9], images_to_tensor(rgb[..., 0]))


def _method_site(method):
    """A small partially annotated site for ``method`` (segmentation: binary masks)."""
    if method in ("segmentation", "fedia", "fedia_pixels"):
        return _seg_site(size=16)
    data = _site(n_train=30, task="single-label" if method in ("fedlsm", "fedirm") else "multi-label")
    if method == "fedirm_unlabelled":
        data.splits["train"].label_mask[:] = False
        data.splits["train"].labels[:] = 0
    return data


def _method_rounds(method, data, state_dir, rounds=2):
    """``rounds`` rounds of ``method``'s client on ``data``; the weights after each round, the
    results and the client. The round inputs exercise every whole-site pass: FedMLP's tagging and
    prototypes, FedIRM's relation loss, FedIA's completeness estimate and correction."""
    from fedpartial.algorithms.base import ClientContext, RoundInput
    from fedpartial.algorithms.fedavg import SupervisedClient
    from fedpartial.algorithms.fedia import FedIAClient
    from fedpartial.algorithms.fedirm import FedIRMClient
    from fedpartial.algorithms.fedlsm import FedLSMClient
    from fedpartial.algorithms.fedmlp import FedMLPClient
    from fedpartial.algorithms.segmentation import SegmentationSupervisedClient
    from fedpartial.models import build_model
    from fedpartial.training.common import state_dict_numpy

    rules = {
        "fedavg": lambda: SupervisedClient(loss_mode="partial", lr=1e-2, batch_size=8),
        "fedlsm": lambda: FedLSMClient(lr=1e-2, batch_size=8, ude_pairs=2, local_epochs=1, confident_fraction=0.3,
                                       uncertain_fraction=0.2, eval_batch_size=7),
        "fedmlp": lambda: FedMLPClient(lr=1e-2, batch_size=8, warmup_rounds=1, prediction_batch_size=7),
        "fedirm": lambda: FedIRMClient(lr=1e-2, batch_size=8),
        "fedirm_unlabelled": lambda: FedIRMClient(lr=1e-2, batch_size=8),
        "segmentation": lambda: SegmentationSupervisedClient(lr=1e-2, batch_size=4, predict_batch_size=4),
        "fedia": lambda: FedIAClient(lr=1e-2, batch_size=4, warmup_rounds=2, predict_batch_size=4,
                                     min_predicted_ratio=0.0),
        "fedia_pixels": lambda: FedIAClient(lr=1e-2, batch_size=4, warmup_rounds=2, predict_batch_size=4,
                                            min_predicted_ratio=0.0, correction_rule="pixels",
                                            correction_threshold=0.3),
    }
    torch.manual_seed(0)
    if method in ("segmentation", "fedia", "fedia_pixels"):
        model = build_model("unet", 1, 1, channels=[4, 8], strides=[2])
    else:
        model = build_model("small_cnn", 3, 1, width=4, depth=2, dropout=0.3 if method == "fedirm_unlabelled" else 0.0)
    rule = rules[method]()
    os.makedirs(state_dir, exist_ok=True)
    rule.setup(ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=state_dir, seed=3))
    weights, results, stats = [], [], {}
    for r in range(rounds):
        if method == "fedirm_unlabelled":
            stats = {"relation_matrix": np.full((3, 3), 1 / 3), "relation_valid": np.ones(3)}
        elif method == "fedmlp" and r > 0:
            stats = {"prototypes_neg": results[-1].stats["prototypes_neg"],
                     "prototypes_pos": results[-1].stats["prototypes_pos"], "prototype_valid": np.ones(3),
                     "tau0": np.full(3, 0.5), "tau1": np.full(3, 0.5)}
        elif method.startswith("fedia") and r == rounds - 1:
            rule.state["correction_pending"] = True  # the pass that corrects, whatever the IoU trend says
        results.append(rule.train_round(model, RoundInput(r, rounds, stats)))
        weights.append(state_dict_numpy(model))
    return weights, results, rule


@pytest.mark.parametrize("method", ["fedavg", "fedlsm", "fedmlp", "fedirm", "fedirm_unlabelled", "segmentation",
                                    "fedia", "fedia_pixels"])
def test_every_client_same_rounds_from_npz_and_folder(method, tmp_path):
    """Each client reads its images batch by batch (no whole float split) and trains to the
    same bits from an in-memory .npz as from a memory-mapped site folder: the batches hold the
    same values in the same order, so every float operation is the same and the weights are
    compared exactly, not within a tolerance."""
    from fedpartial.training.common import ImageSource

    data = _method_site(method)
    write_site_file(str(tmp_path / "site-1.npz"), data)
    write_site_file(str(tmp_path / "site-1"), data)
    from_npz, from_folder = load_site_file(str(tmp_path / "site-1.npz")), load_site_file(str(tmp_path / "site-1"))
    assert isinstance(from_folder.splits["train"].images, np.memmap)
    rounds = 4 if method.startswith("fedia") else 2
    w_npz, r_npz, rule_npz = _method_rounds(method, from_npz, str(tmp_path / "state-npz"), rounds)
    w_folder, r_folder, rule_folder = _method_rounds(method, from_folder, str(tmp_path / "state-folder"), rounds)
    assert isinstance(rule_npz.images, ImageSource) and isinstance(rule_folder.images, ImageSource)
    assert rule_folder.images.images is from_folder.splits["train"].images  # still the memory map
    for r in range(rounds):
        assert r_npz[r].num_samples == r_folder[r].num_samples > 0
        assert r_npz[r].metrics == r_folder[r].metrics, r
        assert sorted(r_npz[r].stats) == sorted(r_folder[r].stats)
        for k in r_npz[r].stats:
            np.testing.assert_array_equal(r_npz[r].stats[k], r_folder[r].stats[k], err_msg=f"round {r} {k}")
        for k in w_npz[r]:
            np.testing.assert_array_equal(w_npz[r][k], w_folder[r][k], err_msg=f"round {r} {k}")
    if method == "fedmlp":
        assert (rule_npz.tags >= 0).any()  # tagging ran
        np.testing.assert_array_equal(rule_npz.tags, rule_folder.tags)
    if method.startswith("fedia"):
        assert rule_npz.state["completeness"] is not None and rule_npz.state["corrected"]
        np.testing.assert_array_equal(rule_npz.masks, rule_folder.masks)


def test_streaming_benchmark_method_clients_tiny(tmp_path):
    from fedpartial_tools.bench.streaming import main

    report = main(["--images", "32", "--size", "16", "--out", str(tmp_path), "--steps", "1", "--batch-size", "8",
                   "--clients", "fedlsm,fedia", "--modes", "streaming", "--timeout", "300"])
    assert "| streaming (site folder, memmap) | 0 | fedlsm |" in report
    assert "| streaming (site folder, memmap) | 0 | fedia |" in report
    assert (tmp_path / "segmentation" / "site-1" / "meta.json").is_file()
