"""What leaves a site: a MessageRecorder, added as the LAST client result filter of every task of
the packaged job, pickles every message a site sends during a full simulator job (2 sites, 2
rounds, train + submit_model + validate) of each method. The messages must hold only model
parameters and aggregate statistics:

* train / submit_model data: exactly the model's state_dict keys with the model's shapes;
* DXO meta: only the sample count, the train split's size, the received model's metrics,
  site_stats and site_metrics;
* every site_stats array has dimensions in {C, D} (classes, feature size) -- site sizes 37 / 29
  and val sizes 11 / 13 are chosen distinct from C = 4 and D so a per-sample array would show;
  metrics are plain numbers;
* no training image (and, for segmentation, no mask) appears byte-for-byte in any message.
"""
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from fedpartial.algorithms.thresholds import HISTOGRAM_KEY, NUM_BINS
from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, Dataset, Split

REPO = Path(__file__).resolve().parents[1]
C = 4
N_TRAIN = {"site-1": 37, "site-2": 29}
N_VAL = {"site-1": 11, "site-2": 13}
CLASS_NAMES = [f"c{i}" for i in range(C)]
SMALL = [f"model.class_names={json.dumps(CLASS_NAMES)}", "model.input_size=[16,16]", "model.in_channels=1",
         "model.arch_args.width=8", "device=cpu"]
SEG = ["model.in_channels=1", 'model.class_names=["lesion"]', "model.input_size=[32,32]",
       "model.arch_args.channels=[4,8]", "model.arch_args.strides=[2]", "model.arch_args.num_res_units=0",
       "device=cpu"]


def _classification(n, task, rng):
    """Class c brightens its own 4x4 tile of a 16x16 grey image (learnable, unique noise)."""
    if task == SINGLE_LABEL:
        labels = np.eye(C, dtype=np.float32)[rng.integers(0, C, n)]
    else:
        labels = (rng.random((n, C)) < 0.35).astype(np.float32)
    images = rng.normal(60, 20, size=(n, 16, 16))
    for c in range(C):
        images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
    return np.clip(images, 0, 255).astype(np.uint8), labels


def _lesions(n, rng, size=32, keep=0.6):
    """Grey images with 2-4 bright 4x4 lesions; train masks keep each lesion with prob. ``keep``."""
    images = rng.integers(0, 60, size=(n, size, size)).astype(np.uint8)
    masks = np.zeros((n, size, size), np.uint8)
    for i in range(n):
        for j, s in enumerate(rng.choice(4, size=rng.integers(2, 5), replace=False)):
            r, c = 4 + 16 * (s // 2) + rng.integers(0, 6), 4 + 16 * (s % 2) + rng.integers(0, 6)
            images[i, r:r + 4, c:c + 4] = 220
            if j == 0 or rng.random() < keep:
                masks[i, r:r + 4, c:c + 4] = 1
    return images, masks


def write_sites(root: Path, kind: str, class_names=None, seed=0) -> dict:
    """Two site files of the given kind; returns {site: train Split} for the leak checks.

    Args:
        root: folder for site-1.npz, site-2.npz.
        kind: ``mismatch`` (single-label, site-1 annotates c0-c2, site-2 c1-c3), ``missing``
            (multi-label, same class sets), ``semi`` (single-label, site-2 unlabelled),
            ``lesions`` (segmentation, incomplete masks).
        class_names: names written in the files (default c0..c3).
    """
    from fedpartial.data import sitefile
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    annotated = {"site-1": [0, 1, 2], "site-2": [1, 2, 3]}
    out = {}
    for site in ("site-1", "site-2"):
        n, n_val = N_TRAIN[site], N_VAL[site]
        if kind == "lesions":
            (x, m), (vx, vm) = _lesions(n, rng), _lesions(n_val, rng, keep=1.0)
            data = Dataset(SEGMENTATION, ["lesion"], {"train": Split(x, m), "val": Split(vx, vm)}, site=site,
                           info={"scenario": "lesion-completeness"})
        else:
            task = MULTI_LABEL if kind == "missing" else SINGLE_LABEL
            x, full = _classification(n, task, rng)
            vx, vy = _classification(n_val, task, rng)
            mask = np.zeros_like(full, dtype=bool)
            if kind == "semi":
                mask[:] = site == "site-1"
            else:
                mask[:, annotated[site]] = True
            data = Dataset(task, list(class_names or CLASS_NAMES),
                           {"train": Split(x, full * mask, mask), "val": Split(vx, vy, np.ones_like(vy, dtype=bool))},
                           site=site, info={"scenario": kind})
        sitefile.write_site_file(str(root / f"{site}.npz"), data)
        out[site] = data.splits["train"]
    return out


METHODS = {  # job, data kind, overrides (2 rounds; statistics sent in at least one of them)
    "fedavg": ("fedavg", "mismatch", SMALL + ["rule_args.batch_size=16"]),
    "fedlsm": ("fedlsm", "mismatch", SMALL + [
        "model.arch_args.depth=2", "rule_args.batch_size=16", "rule_args.ude_pairs=4", "rule_args.strong_view=flip",
        "rule_args.confident_fraction=0.25", "rule_args.uncertain_fraction=0.25"]),
    "fedmlp": ("fedmlp", "missing", SMALL + [
        "model.arch_args.depth=2", "client.rule_args.warmup_rounds=1", "client.rule_args.batch_size=16",
        "client.rule_args.use_adaptive_threshold=false", "server.rule_args.t0=0.25", "server.rule_args.t1=0.25"]),
    "fedirm": ("fedirm", "semi", SMALL + [
        "model.arch_args.depth=2", "rule_args.batch_size=16", "rule_args.mc_passes=2", "rule_args.augmentation=flip",
        "rule_args.ramp_rounds=2", "rule_args.unlabelled_start_round=0"]),
    "fedia": ("fedia", "lesions", SEG + ["rule_args.warmup_rounds=2"]),
}


def run_recorded(tmp_path: Path, method: str, extra=(), data_root=None, kind=None):
    """Run METHODS[method] for 2 rounds with a MessageRecorder last in every client result chain.
    Returns (simulate summary, records, model state shapes, sites' train splits)."""
    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial.flare.recorder import add_result_filter, load_recorded
    from fedpartial_tools.jobs.packaging import package_job
    from fedpartial_tools.run.simulator import simulate

    job, data_kind, sets = METHODS[method]
    data_root = data_root or tmp_path / "sites"
    splits = write_sites(data_root, kind or data_kind) if not (data_root / "site-1.npz").exists() else {}
    # the jobs ask for no local model; this audit asks, to see what a site's local model message holds
    src = Path(package_job(str(REPO / "jobs" / job), str(tmp_path / "job_src"),
                           ["num_rounds=2", "submit_model_task_name=submit_model", *sets, *extra],
                           with_code=False))
    client_path = src / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_path.read_text())
    add_result_filter(client, {"path": "fedpartial.flare.recorder.MessageRecorder",
                               "args": {"folder": str(tmp_path / "wire")}})
    client_path.write_text(json.dumps(client, indent=1))
    summary = simulate(str(src), str(data_root), str(tmp_path / "ws"), timeout=300, log=lambda m: None)
    model = build_model_from_settings(model_settings(client["model"]))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return summary, load_recorded(str(tmp_path / "wire")), shapes, splits


def _arrays(value, path=""):
    """Every (path, np.ndarray) leaf of a nested dict / list / scalar."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _arrays(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        yield path, np.asarray(value)
    else:
        yield path, np.asarray(value)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_sites_send_only_parameters_and_aggregate_statistics(tmp_path, method):
    from nvflare.apis.dxo import DataKind, MetaKey
    from fedpartial.flare.common import SITE_METRICS, SITE_STATS, SITE_TRAIN_SIZE

    summary, records, shapes, splits = run_recorded(tmp_path, method)
    assert summary["exit_code"] == 0, summary["errors"]
    d = shapes["fc.weight"][1] if "fc.weight" in shapes else None
    allowed_dims = {1, C} | ({d} if d else set())
    sample_counts = set(N_TRAIN.values()) | set(N_VAL.values())
    assert not allowed_dims & sample_counts  # the dimension rule can bite
    tasks = {}
    for rec in records:
        tasks.setdefault((rec["site"], rec["task"]), 0)
        tasks[(rec["site"], rec["task"])] += 1
        dxo = rec["dxo"]
        assert dxo is not None, f"{rec['site']} sent a message without DXO on {rec['task']}: {rec}"
        where = f"{method}: {rec['site']} {rec['task']} round {rec['round']}"
        if dxo["kind"] == DataKind.WEIGHTS:
            assert {k: tuple(np.shape(v)) for k, v in dxo["data"].items()} == shapes, where
        else:
            assert dxo["kind"] == DataKind.METRICS and rec["task"] == "validate", where
            assert all(np.ndim(v) == 0 for v in dxo["data"].values()), where
        meta = dxo["meta"]
        # filter_history: FLARE's own record of which filters ran (class names only)
        assert set(meta) <= {MetaKey.NUM_STEPS_CURRENT_ROUND, MetaKey.INITIAL_METRICS, SITE_STATS, SITE_METRICS,
                             SITE_TRAIN_SIZE, HISTOGRAM_KEY, MetaKey.FILTER_HISTORY}, where
        for part, counts in (meta.get(HISTOGRAM_KEY) or {}).items():  # per-class counts of binned scores
            assert part in ("pos", "neg") and np.shape(counts) == (C, NUM_BINS), (where, part, np.shape(counts))
        assert isinstance(meta.get(SITE_TRAIN_SIZE, 0), int), where  # one count, as the sample count
        assert all(isinstance(name, str) for name in meta.get(MetaKey.FILTER_HISTORY, [])), where
        for key in (SITE_METRICS, MetaKey.INITIAL_METRICS):  # flat dicts of numbers
            for name, value in (meta.get(key) or {}).items():
                assert np.ndim(value) == 0, f"{where}: {key}.{name} is not a number: {value!r}"
        for name, value in _arrays(meta.get(SITE_STATS) or {}):
            assert set(value.shape) <= allowed_dims, f"{where}: site_stats{name} has shape {value.shape}"
            assert value.size <= C * max(C, d or C), where
        blob = pickle.dumps(rec)
        for i, image in enumerate(splits[rec["site"]].images):
            assert image.tobytes() not in blob, f"{where}: training image {i} is in the message"
        if method == "fedia":
            for i, mask in enumerate(splits[rec["site"]].labels):
                assert mask.astype(np.uint8).tobytes() not in blob, f"{where}: mask {i} is in the message"
    for site in N_TRAIN:
        assert tasks.get((site, "train")) == 2, tasks
        assert tasks.get((site, "submit_model")) == 1 and tasks.get((site, "validate")), tasks
    if method != "fedavg":  # the statistics really travelled at least once
        assert any(r["dxo"]["meta"].get(SITE_STATS) for r in records if r["task"] == "train"), method
