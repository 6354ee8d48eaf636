"""End-to-end: the fedmlp job runs in the FLARE simulator on a tiny missing-class split (3 sites,
each annotating 2 of 4 classes) for 3 rounds with 1 warm-up round: prototypes and learning
degrees reach the server, the global prototypes come back, stage 2 tags missing entries, and the
tags are kept in each site's state folder."""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.types import MULTI_LABEL, Dataset, Split

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
NUM_CLASSES = 4
ANNOTATED = [[0, 1], [1, 2], [2, 3]]  # every class is annotated at some site
N_TRAIN = 48


def _learnable(n: int, rng):
    """Class c brightens its own 4x4 tile of a 16x16 grey image."""
    labels = (rng.random((n, NUM_CLASSES)) < 0.35).astype(np.float32)
    images = rng.normal(60, 20, size=(n, 16, 16))
    for c in range(NUM_CLASSES):
        images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
    return np.clip(images, 0, 255).astype(np.uint8), labels


def _write_split(out: Path):
    from fedpartial.data import sitefile
    rng = np.random.default_rng(0)
    names = [f"c{i}" for i in range(NUM_CLASSES)]
    (out / "reference").mkdir()
    for k, classes in enumerate(ANNOTATED, start=1):
        images, full = _learnable(N_TRAIN, rng)
        mask = np.zeros_like(full, dtype=bool)
        mask[:, classes] = True
        val_images, val_labels = _learnable(24, rng)
        val = Split(val_images, val_labels, np.ones_like(val_labels, dtype=bool))
        info = {"scenario": "missing-classes", "annotated_classes": classes}
        site = Dataset(MULTI_LABEL, names, {"train": Split(images, full * mask, mask), "val": val},
                       source="synthetic", site=f"site-{k}", info=info)
        sitefile.write_site_file(str(out / f"site-{k}.npz"), site)
        ref = Dataset(MULTI_LABEL, names, {"train": Split(images, full, np.ones_like(mask)), "val": val},
                      source="synthetic", site=f"site-{k}", info=info)
        sitefile.write_site_file(str(out / "reference" / f"site-{k}_full.npz"), ref)
    return names


def test_fedmlp_job_tags_missing_classes(tmp_path):
    from fedpartial_tools.run.simulator import simulate
    from fedpartial.models.io import load_model_file

    data_root = tmp_path / "sites"
    data_root.mkdir()
    names = _write_split(data_root)
    overrides = ["num_rounds=3", f"model.class_names={json.dumps(names)}", "model.input_size=[16,16]",
                 "model.arch_args.width=8", "model.arch_args.depth=2", "device=cpu",
                 "client.rule_args.warmup_rounds=1", "client.rule_args.batch_size=16",
                 "client.rule_args.use_adaptive_threshold=false",  # fixed T: a 1-round warm-up has d_c ~ 0
                 "server.rule_args.t0=0.25", "server.rule_args.t1=0.25",
                 'client.reference_file="reference/{site}_full.npz"']
    summary = simulate(str(REPO / "jobs" / "fedmlp"), str(data_root), str(tmp_path / "ws"), overrides, timeout=240,
                       log=lambda m: None)
    ws = Path(summary["workspace"])
    assert (ws / "global_model.pt").is_file()
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(not r["rejected"] for r in rounds)  # every site's statistics passed check_stats
    for k, classes in enumerate(ANNOTATED, start=1):
        missing = [c for c in range(NUM_CLASSES) if c not in classes]
        per_round = [r["sites"][f"site-{k}"] for r in rounds]
        assert [m["stage"] for m in per_round] == [1, 2, 2]  # switch at warmup_rounds = 1
        assert per_round[0]["loss_cr"] == 0.0 and per_round[1]["loss_cr"] > 0.0
        # the server's prototypes came back: every class is annotated somewhere -> 4 valid pairs
        assert per_round[1]["global_prototypes_valid"] == NUM_CLASSES
        for c in missing:
            new = per_round[1][f"tags_new_neg_c{c}"] + per_round[1][f"tags_new_pos_c{c}"]
            # floor(0.25 * #Z>=0) + floor(0.25 * #Z<0) of 48 untagged entries: at least 10
            assert new >= 10
        assert 0.0 <= per_round[2]["tag_precision_neg"] <= 1.0  # diagnostics from the reference file
        total = per_round[2]["tags_total_neg"] + per_round[2]["tags_total_pos"]
        tag_files = list((tmp_path / "ws").rglob(f"site-{k}/fedmlp_tags.npz"))
        assert len(tag_files) == 1
        with np.load(tag_files[0]) as f:
            tags = f["tags"]
            assert int(f["last_round"]) == 2
        assert (tags >= 0).sum() == total
        assert (tags[:, classes] == -1).all()  # annotated classes are never tagged
    _, meta = load_model_file(ws / "global_model.pt")
    stats = meta["global_stats"]
    assert stats["stage"] == 2
    assert np.asarray(stats["prototypes_neg"]).shape[0] == NUM_CLASSES
    assert np.asarray(stats["prototype_valid"]).all()
    np.testing.assert_allclose(stats["tau0"], np.asarray(stats["learning_degree"]) * 0.25)
