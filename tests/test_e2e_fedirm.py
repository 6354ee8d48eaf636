"""End-to-end: the fedirm jobs run in the FLARE simulator on a tiny semi-supervised split
(2 labelled sites + 1 unlabelled site), 2 rounds each."""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, Dataset, Split

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _learnable(n: int, num_classes: int, channels: int, task: str, rng) -> Split:
    """Class c brightens its own 4x4 tile of a 16x16 image: easy to learn, tiny to train."""
    if task == SINGLE_LABEL:
        labels = np.eye(num_classes, dtype=np.float32)[rng.integers(0, num_classes, n)]
    else:
        labels = (rng.random((n, num_classes)) < 0.35).astype(np.float32)
    images = rng.normal(60, 20, size=(n, 16, 16, channels))
    for c in range(num_classes):
        r, q = divmod(c, 4)
        images[labels[:, c] > 0, 4 * r:4 * r + 4, 4 * q:4 * q + 4] += 150
    images = np.clip(images, 0, 255).astype(np.uint8)
    if channels == 1:
        images = images[..., 0]
    return Split(images, labels, np.ones_like(labels, dtype=bool))


def _write_split(out: Path, task: str, num_classes: int, channels: int) -> list:
    from fedpartial.data import sitefile
    rng = np.random.default_rng(0)
    names = [f"c{i}" for i in range(num_classes)]
    for k, labelled in enumerate([True, True, False], start=1):
        train, val = _learnable(48, num_classes, channels, task, rng), _learnable(24, num_classes, channels, task, rng)
        if not labelled:  # semi-supervised: an unlabelled site has labels all 0 and mask all 0
            train = Split(train.images, np.zeros_like(train.labels), np.zeros_like(train.label_mask))
        data = Dataset(task, names, {"train": train, "val": val}, source="synthetic", site=f"site-{k}",
                       info={"scenario": "semi-supervised", "labelled": labelled})
        sitefile.write_site_file(str(out / f"site-{k}.npz"), data)
    return names


@pytest.mark.parametrize("job, task, num_classes, channels", [
    ("fedirm", SINGLE_LABEL, 4, 3),
    ("fedirm:multilabel", MULTI_LABEL, 5, 1),
])
def test_fedirm_job_runs_and_relation_matrix_reaches_unlabelled_site(tmp_path, job, task, num_classes, channels):
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate
    from fedpartial.models.io import load_model_file

    data_root = tmp_path / "sites"
    data_root.mkdir()
    names = _write_split(data_root, task, num_classes, channels)
    overrides = ["num_rounds=2", f"model.class_names={json.dumps(names)}", "model.input_size=[16,16]",
                 "model.arch_args.width=8", "model.arch_args.depth=2", "rule_args.batch_size=16",
                 "rule_args.mc_passes=2", "rule_args.augmentation=flip", "rule_args.ramp_rounds=2",
                 "rule_args.unlabelled_start_round=0",
                 "device=cpu"]
    if job == "fedirm:multilabel":  # the executor's other memory layout, end to end
        overrides.append("memory_format=channels_last")
    summary = simulate(find_job(job), str(data_root), str(tmp_path / "ws"), overrides, timeout=240,
                       log=lambda m: None)
    ws = Path(summary["workspace"])
    assert (ws / "global_model.pt").is_file()
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    # labelled sites are told apart by their data (site-1, site-2); site-3 is unlabelled
    assert all(rounds[0]["sites"][s]["labelled"] == 1.0 for s in ("site-1", "site-2"))
    unlabelled = [r["sites"]["site-3"] for r in rounds]
    assert unlabelled[0]["labelled"] == 0.0 and unlabelled[0]["num_samples"] == 48
    # round 0: no relation matrix yet, IRM off; round 1: the labelled sites' averaged matrix arrived
    assert unlabelled[0]["irm_active"] == 0.0
    assert unlabelled[1]["irm_active"] == 1.0
    # the averaged matrix lives in the global model's metadata
    _, meta = load_model_file(ws / "global_model.pt")
    matrix = np.asarray(meta["global_stats"]["relation_matrix"])
    assert matrix.shape == (num_classes, num_classes) and np.all(np.isfinite(matrix))
    if task == SINGLE_LABEL:
        assert np.allclose(matrix.sum(axis=1), 1.0, atol=1e-5)
    assert meta["global_stats"]["relation_multilabel"] == int(task == MULTI_LABEL)
    assert not rounds[-1]["rejected"]
