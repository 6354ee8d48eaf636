"""End-to-end: the fedlsm jobs run in the FLARE simulator on a tiny label-set-mismatch split
(3 sites, each annotating 2 of 4 classes), 2 rounds each."""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, Dataset, Split

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
NUM_CLASSES = 4
ANNOTATED = [[0, 1], [1, 2], [2, 3]]  # site k annotates these classes; every class is annotated somewhere


def _learnable(n: int, task: str, channels: int, rng):
    """Class c brightens its own 4x4 tile of a 16x16 image: easy to learn, tiny to train."""
    if task == SINGLE_LABEL:
        labels = np.eye(NUM_CLASSES, dtype=np.float32)[rng.integers(0, NUM_CLASSES, n)]
    else:
        labels = (rng.random((n, NUM_CLASSES)) < 0.35).astype(np.float32)
    images = rng.normal(60, 20, size=(n, 16, 16, channels))
    for c in range(NUM_CLASSES):
        images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
    images = np.clip(images, 0, 255).astype(np.uint8)
    return (images[..., 0] if channels == 1 else images), labels


def _write_split(out: Path, task: str, channels: int):
    """Site files with label-set mismatch; returns (class names, per-site (labels, mask)) for checks."""
    from fedpartial.data import sitefile
    rng = np.random.default_rng(0)
    names = [f"c{i}" for i in range(NUM_CLASSES)]
    written = []
    for k, classes in enumerate(ANNOTATED, start=1):
        images, full = _learnable(48, task, channels, rng)
        mask = np.zeros_like(full, dtype=bool)
        mask[:, classes] = True
        labels = full * mask  # missing classes: 0 in labels and 0 in the mask (single-label: "none of mine")
        val_images, val_labels = _learnable(24, task, channels, rng)
        data = Dataset(task, names, {"train": Split(images, labels, mask),
                                     "val": Split(val_images, val_labels, np.ones_like(val_labels, dtype=bool))},
                       source="synthetic", site=f"site-{k}",
                       info={"scenario": "label-set-mismatch", "annotated_classes": classes})
        sitefile.write_site_file(str(out / f"site-{k}.npz"), data)
        written.append((labels, mask))
    return names, written


@pytest.mark.parametrize("job, task, channels", [
    ("fedlsm", SINGLE_LABEL, 3),
    ("fedlsm:multilabel", MULTI_LABEL, 1),
])
def test_fedlsm_job_runs_and_counts_reach_the_server(tmp_path, job, task, channels):
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate
    from fedpartial.models.io import load_model_file

    data_root = tmp_path / "sites"
    data_root.mkdir()
    names, written = _write_split(data_root, task, channels)
    overrides = ["num_rounds=2", f"model.class_names={json.dumps(names)}", "model.input_size=[16,16]",
                 f"model.in_channels={channels}", "model.arch_args.width=8", "model.arch_args.depth=2",
                 "rule_args.batch_size=16", "rule_args.ude_pairs=4", "rule_args.strong_view=flip",
                 "rule_args.confident_fraction=0.25", "rule_args.uncertain_fraction=0.25", "rule_args.lr=0.001",
                 "device=cpu",
                 # every count must arrive; withholding rare-class rows is tested in test_filters
                 "min_count=0"]
    summary = simulate(find_job(job), str(data_root), str(tmp_path / "ws"), overrides, timeout=240,
                       log=lambda m: None)
    ws = Path(summary["workspace"])
    assert (ws / "global_model.pt").is_file()
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert not rounds[-1]["rejected"]
    for site in ("site-1", "site-2", "site-3"):
        first, second = rounds[0]["sites"][site], rounds[1]["sites"][site]
        assert first["num_samples"] == 48
        assert first["n_confident"] == 12 and first["n_uncertain"] == 12  # 0.25 * 48 each
        # local_epochs 1.3 over D_l ∪ D_m (36 samples), 12 per step: ceil(1.3 * 36 / 12) = 4 steps
        assert first["train_steps"] == 4
        # round 0 has no global statistics yet; round 1 got the server's sums back
        assert first["global_stats_received"] == 0.0 and second["global_stats_received"] == 1.0
        assert np.isfinite(second["loss"])
    _, meta = load_model_file(ws / "global_model.pt")
    stats = meta["global_stats"]
    counts = np.asarray(stats["class_counts"])
    assert counts.shape == (NUM_CLASSES,) and np.all(np.isfinite(counts)) and np.all(counts >= 0)
    # every annotated positive of D_l ∪ D_m is counted, so the sum is at least the annotated positives
    # of the 36 trained samples per site: > 0 for each class here.
    assert np.all(counts > 0)
    # the server summed the sites' annotated positive / negative counts: pos_weight = #neg / #pos
    pos = sum(((lab > 0.5) & m).sum(axis=0) for lab, m in written)
    neg = sum(((lab < 0.5) & m).sum(axis=0) for lab, m in written)
    np.testing.assert_allclose(stats["pos_weight"], neg / pos, rtol=1e-6)


def test_same_seed_gives_the_same_global_model(tmp_path):
    """Seeds make runs repeatable: two simulator runs of fedlsm (3 sites answering in whatever
    order their threads finish) end with bit-identical global weights."""
    import torch

    from fedpartial_tools.run.simulator import simulate

    data_root = tmp_path / "sites"
    data_root.mkdir()
    names, _ = _write_split(data_root, SINGLE_LABEL, 3)
    overrides = ["num_rounds=2", f"model.class_names={json.dumps(names)}", "model.input_size=[16,16]",
                 "model.in_channels=3", "model.arch_args.width=8", "model.arch_args.depth=2",
                 "rule_args.batch_size=16", "rule_args.ude_pairs=4", "rule_args.lr=0.001", "device=cpu", "seed=3"]
    weights = []
    for run in ("a", "b"):
        summary = simulate(str(REPO / "jobs" / "fedlsm"), str(data_root), str(tmp_path / run), overrides,
                           timeout=240, log=lambda m: None)
        assert summary["exit_code"] == 0, summary["errors"]
        saved = torch.load(Path(summary["workspace"]) / "global_model.pt", map_location="cpu", weights_only=False)
        weights.append(saved["state_dict"] if "state_dict" in saved else saved["weights"])
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(torch.as_tensor(weights[0][key]), torch.as_tensor(weights[1][key])), key
