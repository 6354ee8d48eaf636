"""End-to-end: the FedIA and segmentation-FedAvg jobs in the FLARE simulator on tiny synthetic
lesion data (3 sites, 32 px, a 2-level U-Net)."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

# A 2-level U-Net on 32 px grey images; everything else as in the job folders.
TINY = ["model.in_channels=1", 'model.class_names=["lesion"]', "model.input_size=[32, 32]",
        "model.arch_args.channels=[4, 8]", "model.arch_args.strides=[2]", "model.arch_args.num_res_units=0",
        "rule_args.lr=0.01", "device=cpu"]


def blob_split(rng, n, size=32, keep=1.0):
    """Grey images with 2-4 bright 4x4 squares (the lesions). Returns images, complete masks and
    masks keeping each lesion with probability ``keep`` (at least one per image)."""
    images = rng.integers(0, 60, size=(n, size, size)).astype(np.uint8)
    full = np.zeros((n, size, size), np.uint8)
    kept = np.zeros_like(full)
    for i in range(n):
        spots = rng.choice(np.arange(4), size=rng.integers(2, 5), replace=False)
        for j, s in enumerate(spots):  # one square per quadrant: lesions never touch
            r, c = 4 + 16 * (s // 2) + rng.integers(0, 6), 4 + 16 * (s % 2) + rng.integers(0, 6)
            images[i, r:r + 4, c:c + 4] = 220
            full[i, r:r + 4, c:c + 4] = 1
            if j == 0 or rng.random() < keep:
                kept[i, r:r + 4, c:c + 4] = 1
    return images, full, kept


def write_sites(root: Path, keeps=(0.4, 0.7, 1.0), n_train=8, n_val=4):
    """site-k.npz with incomplete train masks; reference/site-k_full.npz with the complete ones."""
    from fedpartial.data import sitefile
    from fedpartial.data.types import SEGMENTATION, Dataset, Split

    write_site_file = sitefile.write_site_file

    rng = np.random.default_rng(0)
    (root / "reference").mkdir(parents=True)
    for k, keep in enumerate(keeps, start=1):
        site = f"site-{k}"
        x, full, kept = blob_split(rng, n_train, keep=keep)
        vx, vfull, _ = blob_split(rng, n_val)
        val = Split(vx, vfull)
        info = {"scenario": "lesion-completeness", "completeness": keep}
        write_site_file(str(root / f"{site}.npz"),
                        Dataset(SEGMENTATION, ["lesion"], {"train": Split(x, kept), "val": val}, site=site, info=info))
        write_site_file(str(root / "reference" / f"{site}_full.npz"),
                        Dataset(SEGMENTATION, ["lesion"], {"train": Split(x, full), "val": val}, site=site, info=info))


def run(job, data_root, workspace, sets):
    from fedpartial_tools.run.simulator import simulate

    summary = simulate(str(REPO / "jobs" / job), str(data_root), str(workspace), sets, timeout=240, log=lambda m: None)
    assert summary["exit_code"] == 0, summary["errors"]
    assert (workspace / "global_model.pt").is_file()
    return json.loads((workspace / "metrics.json").read_text())["rounds"]


def logged(workspace, text):
    files = [workspace / "simulator.log", *map(Path, glob.glob(str(workspace / "simulator" / "**" / "log.txt"),
                                                            recursive=True))]
    return any(text in f.read_text(errors="replace") for f in files if f.is_file())


def test_fedia_job_estimates_reweights_and_corrects(tmp_path):
    data_root = tmp_path / "sites"
    write_sites(data_root)
    ws = tmp_path / "run"
    # warm-up rounds 0-1; round 2 estimates completeness and (λ = -1: always) triggers; round 3
    # corrects with the received model (threshold 0.3 so a 1-round model flips some pixels).
    rounds = run("fedia", data_root, ws, TINY + [
        "num_rounds=4", "rule_args.warmup_rounds=2", "rule_args.iou_margin=-1.0",
        "rule_args.correction_threshold=0.3", "client.reference_file=reference/{site}_full.npz",
        # estimate from whatever the 2-round model predicts: this test is about the mechanism
        "rule_args.min_predicted_ratio=0"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    sites = ["site-1", "site-2", "site-3"]
    for name in sites:
        warm, estimate, corrected = rounds[1]["sites"][name], rounds[2]["sites"][name], rounds[3]["sites"][name]
        assert "completeness" not in warm and 0.0 <= warm["train_iou"] <= 1.0
        assert estimate["completeness"] > 0 and estimate["correction_triggered"] == 1
        assert corrected["corrected"] == 1
        # diagnostics against the reference copy: the kept share of lesions, by construction <= 1
        assert 0 < estimate["true_completeness"] <= 1.0
    assert rounds[2]["sites"]["site-3"]["true_completeness"] == pytest.approx(1.0)
    assert not any(r["rejected"] for r in rounds)  # every site's stats passed check_stats
    # round 2 aggregated with the completeness-aware weights; round 3 (all corrected) is FedAvg again
    assert logged(ws, "FedIA round 2: completeness-aware weights")
    assert not logged(ws, "FedIA round 3: completeness-aware weights")
    # metrics.json logs each round's rule and weights: size weights in warm-up, completeness-aware
    # weights (each within 2x its data share, summing to 1) at round 2, FedAvg once all corrected
    server = [r["server"] for r in rounds]
    assert [s["rule"] for s in server] == ["fedavg", "fedavg", "completeness_aware", "fedavg"]
    for s in server:
        assert sorted(s["weights"]) == sites and sum(s["weights"].values()) == pytest.approx(1.0)
        assert all(0.0 < a <= 1.0 for a in s["completeness"].values())
    shares = {name: rounds[2]["sites"][name]["num_samples"] / sum(rounds[2]["sites"][n]["num_samples"] for n in sites)
              for name in sites}
    assert all(w <= 2 * shares[name] + 1e-9 for name, w in server[2]["weights"].items())
    states = glob.glob(str(ws / "simulator" / "**" / "fedia_state.json"), recursive=True)
    assert len(states) == 3
    state = json.loads(Path(states[0]).read_text())
    assert state["corrected"] and state["correction_rounds"] == [3] and len(state["iou_history"]) == 4
    # at threshold 0.3 the 3-round model adds lesion pixels at the sites that miss lesions (and the
    # count is the change in the site's mask, so a correction that changed nothing would give 0)
    assert sum(rounds[3]["sites"][name]["corrected_pixels"] for name in ("site-1", "site-2")) > 0


def test_fedavg_seg_full_job_reads_the_reference_copies(tmp_path):
    from fedpartial.data import sitefile

    data_root = tmp_path / "sites"
    write_sites(data_root)
    # The site files hold no lesion at all: a job that read them would see empty train masks
    # (train_iou of an all-empty truth); the reference copies hold every lesion.
    for k in (1, 2, 3):
        path = data_root / f"site-{k}.npz"
        data = sitefile.load_site_file(str(path))
        train = data.splits["train"]
        data.splits["train"] = type(train)(train.images, np.zeros_like(train.labels))
        sitefile.write_site_file(str(path), data)
    ws = tmp_path / "run"
    rounds = run("fedavg_seg_full", data_root, ws, TINY + ["num_rounds=2"])
    assert len(rounds) == 2
    for k in (1, 2, 3):
        assert logged(ws, f"site 'site-{k}': 8 training images from {data_root / 'reference' / f'site-{k}_full.npz'}")
    for name, site in rounds[1]["sites"].items():
        assert {"tp", "fp", "fn", "predicted_lesion_share", "n_images"} <= set(site["val"])
        # IoU against an all-empty truth is 0 or 1: strictly between, the masks it trained on held lesions
        assert 0.0 < site["train_iou"] < 1.0, (name, site["train_iou"])


def test_segmentation_result_scores_what_the_progress_lines_promised(tmp_path):
    """Site validation and `evaluate` score alike: the best model's pooled val Dice in the run
    (what the progress line showed for the round it was sent out) is what `evaluate` of the
    downloaded best_global_model.pt on the site folder's val splits prints; a round whose model
    predicts no lesion anywhere is flagged in the progress line."""
    from fedpartial.metrics.segmentation import pooled_validation
    from fedpartial.models.io import load_model_file
    from fedpartial_tools.evaluate import evaluate_data
    from fedpartial_tools.run.progress import RoundProgress

    data_root = tmp_path / "sites"
    write_sites(data_root)
    ws = tmp_path / "run"
    rounds = run("fedavg_seg", data_root, ws, TINY + ["num_rounds=4", "model.arch_args.foreground_prior=0.05"])
    pooled = [pooled_validation({k: s["val"] for k, s in r["sites"].items()}) for r in rounds]
    assert all(p is not None and p["n_images"] == 12 for p in pooled)
    # the selector skips round 0 (no aggregate yet); a later round's model is best if strictly better
    scores = [p["dice_pooled"] for p in pooled[1:]]
    best_round = 1 + int(np.argmax(scores))
    model, meta = load_model_file(str(ws / "best_global_model.pt"))
    assert meta["round"] == best_round - 1  # the aggregate of the round before, sent out at best_round
    result = evaluate_data(model, meta, str(data_root), split="val")
    assert result["pooled"]["dice_pooled"] == pytest.approx(max(scores), abs=1e-9)
    line = RoundProgress(4, "dice_pooled").line(rounds[best_round], best_round + 1, 10.0)
    assert f"val pooled dice {max(scores):.3f}" in line and "of 12 val images (3 sites)" in line
    # a model that marks nothing is called out
    blank = {k: dict(s, val=dict(s["val"], tp=0, fp=0, predicted_lesion_share=0.0))
             for k, s in rounds[1]["sites"].items()}
    assert "WARNING: the global model predicts no lesion" in RoundProgress(4, "dice_pooled").line(
        dict(rounds[1], sites=blank), 2, 10.0)
