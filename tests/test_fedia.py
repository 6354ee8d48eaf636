"""FedIA and the shared Dice-loss segmentation pieces: numbers worked out by hand in comments."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext, SiteUpdate
from fedpartial.algorithms.fedia import (MASKS_FILE, PAPER_CLIENT_GUARDS, PAPER_SERVER_GUARDS, STATE_FILE, FedIAClient,
                                         FedIAServer, cap_weights, completeness_aware_weights,
                                         correct_masks, correct_masks_lesionwise, correction_triggered, count_lesions,
                                         estimate_completeness,
                                         fit_iou_trend)
from fedpartial.algorithms.fedia import NEXT_MASKS_FILE
from fedpartial.algorithms.segmentation import (MaskSource, SegmentationSupervisedClient, binary_masks, iou_score,
                                                lesion_flags, mask_chunks, train_dice_epoch)
from fedpartial.data.types import DataError, Dataset, Split

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- fixtures
def lesion_masks():
    """Two 8x8 images. Complete masks: 2x2 lesions at rows/cols 1-2 and 5-6 in both images.
    The site annotates only the first lesion of each image (completeness 2/4 = 0.5)."""
    full = np.zeros((2, 8, 8), dtype=np.uint8)
    full[:, 1:3, 1:3] = 1
    full[:, 5:7, 5:7] = 1
    site = np.zeros_like(full)
    site[:, 1:3, 1:3] = 1
    return site, full


def make_ctx(tmp_path, masks, reference=None, site="site-1"):
    images = (masks * 200 + 20).astype(np.uint8)
    data = Dataset(task="segmentation", class_names=["lesion"], splits={"train": Split(images, masks.copy())},
                   source="test.npz", site=site)
    ref = None
    if reference is not None:
        ref = Dataset(task="segmentation", class_names=["lesion"], splits={"train": Split(images, reference)},
                      source="ref.npz", site=site)
    return ClientContext(site=site, data=data, device=torch.device("cpu"), state_dir=str(tmp_path / "state"),
                         seed=3, reference=ref, log=lambda m: None)


class FixedMapModel(nn.Module):
    """Predicts the same logit map for every image (logits = map * scale); ``scale`` is trainable."""

    def __init__(self, logit_map: np.ndarray):
        super().__init__()
        self.register_buffer("logit_map", torch.as_tensor(logit_map, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        logits = (self.logit_map * self.scale).expand(x.shape[0], 1, *self.logit_map.shape)
        return logits, logits


def predicted_map():
    """Logit +3 (sigmoid 0.953 > 0.8) on both true lesions and on a false 1x2 strip at row 0,
    cols 6-7; -3 elsewhere. Per image: 3 predicted lesions."""
    m = np.full((8, 8), -3.0, dtype=np.float32)
    m[1:3, 1:3] = 3.0
    m[5:7, 5:7] = 3.0
    m[0, 6:8] = 3.0
    return m


def scripted(client, ious, loss=0.4):
    """Replace real training by scripted IoU values (round -> IoU); records the masks trained on."""
    client.seen_masks = {}

    def fake_train_on(model, masks, round_index, num_rounds):
        client.seen_masks[round_index] = np.array(masks)
        return loss, ious[round_index], 1

    client.train_on = fake_train_on
    return client


def run_round(client, model, r, num_rounds=10):
    return client.train_round(model, RoundInput(round=r, num_rounds=num_rounds))


def run_with_late_model(client, ctx, first_map, rounds=6, switch_round=4):
    """Rounds 0..rounds-1 of ``client`` on ``ctx``; the global model predicts ``first_map`` until
    ``switch_round``, then :func:`predicted_map` (3 lesions per image, sigmoid 0.953)."""
    model = FixedMapModel(first_map.copy())  # the buffer shares memory with its array
    client.setup(ctx)
    outs = []
    for r in range(rounds):
        if r == switch_round:
            model.logit_map.copy_(torch.as_tensor(predicted_map()))
        outs.append(run_round(client, model, r))
    return outs


# ----------------------------------------------------------------------------- masks read lazily
def test_mask_source_reads_rows_as_binary_from_a_memory_map(tmp_path):
    labels = np.zeros((5, 4, 4), dtype=np.uint8)
    labels[1, 0, 0] = 2  # any id > 0 is foreground
    labels[3, 2:4, 2:4] = 7
    labels[4, 1, 1] = 1
    np.save(tmp_path / "labels.npy", labels)
    source = MaskSource(np.load(tmp_path / "labels.npy", mmap_mode="r"))
    assert len(source) == 5 and source.shape == (5, 4, 4)
    rows = source[np.array([4, 1, 3])]  # asked order kept although the map is read sorted
    assert rows.dtype == np.uint8 and rows.tolist() == (labels[[4, 1, 3]] > 0).astype(np.uint8).tolist()
    assert int(source[3].sum()) == 4 and int(source[1:3].sum()) == 1
    # images 1, 3, 4 have a lesion; blocks of 2 images: rows 0-1, 2-3, 4
    assert lesion_flags(source, chunk=2).tolist() == [False, True, False, True, True]
    assert [(r.start, r.stop, len(b)) for r, b in mask_chunks(source, chunk=2)] == [(0, 2, 2), (2, 4, 2), (4, 5, 1)]
    assert np.array_equal(np.asarray(source), labels > 0)


# ----------------------------------------------------------------------------- lesion counting
def test_count_lesions_touching_diagonal_and_empty():
    img = np.zeros((3, 6, 6), dtype=np.uint8)
    # image 0: two 2x2 squares sharing an edge (cols 0-1 and 2-3) -> one lesion under both rules
    img[0, 0:2, 0:2] = 1
    img[0, 0:2, 2:4] = 1
    # image 1: two pixels touching only at a corner -> 1 lesion (8-conn), 2 lesions (4-conn);
    # plus an isolated pixel -> totals 2 (8-conn) and 3 (4-conn)
    img[1, 0, 0] = 1
    img[1, 1, 1] = 1
    img[1, 4, 4] = 1
    # image 2 empty -> 0
    assert count_lesions(img, 8).tolist() == [1, 2, 0]
    assert count_lesions(img, 4).tolist() == [1, 3, 0]
    assert count_lesions(np.zeros((5, 5)), 8).tolist() == [0]
    with pytest.raises(ValueError, match="connectivity"):
        count_lesions(img, 6)


def test_count_lesions_is_per_image_not_per_volume():
    # The same square in two stacked images: 3D labelling of the stack would give 1 lesion;
    # per-2D-image counting gives 1 + 1 = 2.
    stack = np.zeros((2, 5, 5), dtype=np.uint8)
    stack[:, 1:3, 1:3] = 1
    assert count_lesions(stack).tolist() == [1, 1]
    assert int(count_lesions(stack).sum()) == 2


def test_estimate_completeness():
    site, _ = lesion_masks()
    predicted = 1 / (1 + np.exp(-predicted_map())) > 0.5
    predicted = np.repeat(predicted[None], 2, axis=0)
    # annotated 1 + 1 = 2 lesions; predicted 3 + 3 = 6 -> 2 / 6 = 0.3333
    a, n_annotated, n_predicted = estimate_completeness(site, predicted)
    assert (n_annotated, n_predicted) == (2, 6)
    assert a == pytest.approx(1 / 3)
    # an under-segmenting model (only 1 of the 2 images predicted, 1 lesion) -> 2 / 1 = 2.0 (> 1)
    under = np.zeros_like(site)
    under[0, 1:3, 1:3] = 1
    assert estimate_completeness(site, under)[0] == pytest.approx(2.0)
    # no predicted lesion: undefined
    assert estimate_completeness(site, np.zeros_like(site)) == (None, 2, 0)


# ----------------------------------------------------------------------------- trend + trigger
def test_fit_iou_trend_hand_numbers():
    # exact line: t=1,2,3 and IoU 0.1,0.2,0.3 -> slope 0.1, intercept 0
    slope, intercept = fit_iou_trend([1, 2, 3], [0.1, 0.2, 0.3])
    assert slope == pytest.approx(0.1) and intercept == pytest.approx(0.0, abs=1e-12)
    # t=1..4, IoU (0.1, 0.3, 0.2, 0.4): mean t 2.5, mean IoU 0.25,
    # Sxy = (-1.5)(-0.15)+(-0.5)(0.05)+(0.5)(-0.05)+(1.5)(0.15) = 0.4, Sxx = 5 -> slope 0.08,
    # intercept 0.25 - 0.08 * 2.5 = 0.05
    slope, intercept = fit_iou_trend([1, 2, 3, 4], [0.1, 0.3, 0.2, 0.4])
    assert slope == pytest.approx(0.08) and intercept == pytest.approx(0.05)
    # fitted at t=5: 0.45. Actual 0.41 -> gap 0.04 > 0.03: correct. Actual 0.425 -> 0.025: no.
    assert correction_triggered(slope, intercept, 5, 0.41, 0.03)
    assert not correction_triggered(slope, intercept, 5, 0.425, 0.03)
    assert not correction_triggered(slope, intercept, 5, 0.50, 0.03)  # above the trend
    with pytest.raises(ValueError, match=">= 2"):
        fit_iou_trend([1], [0.5])


# ----------------------------------------------------------------------------- correction rule
def test_correct_masks_only_flips_zero_to_one():
    masks = np.array([[[1, 0], [0, 0]]], dtype=np.uint8)
    prob = np.array([[[0.1, 0.9], [0.8, 0.85]]])
    new, changed = correct_masks(masks, prob, 0.8)
    # (0,0) labelled 1 with prob 0.1 stays 1 (never 1 -> 0); (0,1) 0.9 > 0.8 -> 1;
    # (1,0) 0.8 is not > 0.8 -> stays 0; (1,1) 0.85 -> 1. Two pixels changed.
    assert new.tolist() == [[[1, 1], [0, 1]]]
    assert changed == 2
    assert masks.tolist() == [[[1, 0], [0, 0]]]  # input untouched
    all_low = correct_masks(np.ones((1, 2, 2), np.uint8), np.zeros((1, 2, 2)), 0.8)
    assert all_low[0].tolist() == [[[1, 1], [1, 1]]] and all_low[1] == 0


def test_correct_masks_lesionwise_adds_whole_missed_lesions_and_no_rims():
    # one 6 x 8 image: an annotated lesion at (1,1)-(1,2); the model also marks
    #   A: its rim (1,3), touching it          -> never added (no rim)
    #   B: a 2 x 2 lesion at (3..4, 5..6), peak 0.9, pixels 0.6 / 0.7 / 0.9 / 0.55 -> added whole (4 px)
    #   C: a 1-pixel lesion at (4,1), peak 0.7 < 0.8 -> not confident enough
    #   D: (5,7) diagonal to B's (4,6): same lesion under 8-connectivity (peak 0.9), alone under 4
    masks = np.zeros((1, 6, 8), np.uint8)
    masks[0, 1, 1:3] = 1
    prob = np.full((1, 6, 8), 0.1)
    prob[0, 1, 1:3] = 0.3            # the annotated lesion itself (labels 1 stay 1 whatever the model says)
    prob[0, 1, 3] = 0.95             # A
    prob[0, 3:5, 5:7] = [[0.6, 0.7], [0.9, 0.55]]  # B
    prob[0, 4, 1] = 0.7              # C
    prob[0, 5, 7] = 0.52             # D
    new, changed = correct_masks_lesionwise(masks, prob, threshold=0.8, prob_threshold=0.5, connectivity=8)
    expected = masks.copy()
    expected[0, 3:5, 5:7] = 1
    expected[0, 5, 7] = 1
    assert new.tolist() == expected.tolist() and changed == 5
    assert masks.sum() == 2  # input untouched
    # 4-connectivity: D is a lesion of its own with peak 0.52 < 0.8 -> stays 0; B still added
    new4, changed4 = correct_masks_lesionwise(masks, prob, threshold=0.8, prob_threshold=0.5, connectivity=4)
    assert changed4 == 4 and new4[0, 5, 7] == 0 and new4[0, 3:5, 5:7].all()
    # the paper's pixel rule at the same 0.8 paints the rim A and only B's 0.9 core
    pixel_new, pixel_changed = correct_masks(masks, prob, 0.8)
    assert pixel_changed == 2 and pixel_new[0, 1, 3] == 1 and pixel_new[0, 3:5, 5:7].sum() == 1
    # lesions never join across images of the stack: the same B on the next image touches nothing there
    two = np.concatenate([masks, np.zeros_like(masks)])
    two_prob = np.concatenate([prob, prob])
    assert correct_masks_lesionwise(two, two_prob, 0.8)[1] == 5 + 6  # image 2 also gains A (no annotated lesion)
    with pytest.raises(ValueError, match="shape"):
        correct_masks_lesionwise(masks, prob[:, :5], 0.8)


def test_fedia_client_rejects_an_unknown_correction_rule():
    with pytest.raises(ValueError, match="correction_rule 'blobs' unknown"):
        FedIAClient(correction_rule="blobs")


# ----------------------------------------------------------------------------- softmax weights
def test_completeness_aware_weights():
    # a/l = (1, 2): softmax = (e / (e + e^2), e^2 / (e + e^2)) = (0.2689, 0.7311)
    w = completeness_aware_weights([0.5, 1.0], [0.5, 0.5])
    assert w == pytest.approx([0.26894142, 0.73105858])
    # equal a/l -> equal weights; a zero loss is floored, no inf / NaN
    assert completeness_aware_weights([0.3, 0.6], [0.2, 0.4]) == pytest.approx([0.5, 0.5])
    w0 = completeness_aware_weights([1.0, 1.0], [0.0, 0.5])
    assert np.isfinite(w0).all() and w0 == pytest.approx([1.0, 0.0])


# ----------------------------------------------------------------------------- server
def update(site, value, n, a=1.0, loss=0.5, ready=1, corrected=0, iou=0.5):
    return SiteUpdate(site=site, weights={"w": np.array([value], np.float32), "steps": np.array([2 * n], np.int64)},
                      num_samples=n, stats={"mean_loss": loss, "iou": iou, "completeness": a,
                                            "completeness_ready": ready, "corrected": corrected})


def sctx(r):
    return ServerContext(round=r, num_rounds=10, classifier_param_names=[], log=lambda m: None)


def test_server_weights_by_stage():
    server = FedIAServer(warmup_rounds=2)
    ups = [update("site-1", 0.0, 1, a=0.5), update("site-2", 1.0, 3, a=1.0)]
    # warm-up round 1: size weights 1/4, 3/4 -> 0.75
    w, g = server.aggregate(ups, sctx(1))
    assert w["w"][0] == pytest.approx(0.75) and g == {"completeness_aware": 0}
    # round 2: softmax(0.5/0.5, 1.0/0.5) = (0.2689, 0.7311) -> 0.7311 regardless of sizes
    w, g = server.aggregate(ups, sctx(2))
    assert w["w"][0] == pytest.approx(0.7310586, abs=1e-6) and g == {"completeness_aware": 1}
    assert w["steps"].dtype == np.int64  # integer buffers keep their dtype
    # ablation: switch off -> size weights
    w, _ = FedIAServer(warmup_rounds=2, use_completeness_weighting=False).aggregate(ups, sctx(5))
    assert w["w"][0] == pytest.approx(0.75)
    # one site not ready -> size weights this round
    late = [ups[0], update("site-2", 1.0, 3, ready=0)]
    assert server.aggregate(late, sctx(3))[0]["w"][0] == pytest.approx(0.75)
    # every site corrected -> last stage is FedAvg again (unless the switch says otherwise)
    done = [update("site-1", 0.0, 1, a=0.5, corrected=1), update("site-2", 1.0, 3, corrected=1)]
    assert server.aggregate(done, sctx(4))[0]["w"][0] == pytest.approx(0.75)
    keep = FedIAServer(warmup_rounds=2, fedavg_after_all_corrected=False)
    assert keep.aggregate(done, sctx(4))[0]["w"][0] == pytest.approx(0.7310586, abs=1e-6)
    # a site with 0 samples takes no part
    zero = ups + [update("site-3", 100.0, 0)]
    assert server.aggregate(zero, sctx(2))[0]["w"][0] == pytest.approx(0.7310586, abs=1e-6)


def test_cap_weights_hand_worked():
    # equal shares 0.25, cap 2 x 0.25 = 0.5: the first site gives up 0.47, the others share 0.5 equally
    assert cap_weights([0.97, 0.01, 0.01, 0.01], [0.25] * 4, 2.0) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])
    # unequal shares (0.1, 0.2, 0.3, 0.4): caps (0.2, 0.4, 0.6, 0.8); site 1 capped at 0.2, the
    # remaining 0.8 split in proportion 0.1 : 0.1 : 0.1 -> 0.2667 each (under their caps)
    assert cap_weights([0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], 2.0) == pytest.approx([0.2, 0.8 / 3, 0.8 / 3, 0.8 / 3])
    # a redistribution that pushes a second site over its cap: caps (0.2, 0.2, 1.6); site 1 -> 0.2 and
    # 0.8 split 0.35 : 0.05 = (0.7, 0.1); site 2 is now over -> 0.2, and the third takes the 0.6 left
    w = cap_weights([0.6, 0.35, 0.05], [0.1, 0.1, 0.8], 2.0)
    assert w == pytest.approx([0.2, 0.2, 0.6]) and w.sum() == pytest.approx(1.0)
    assert cap_weights([0.9, 0.1], [0.5, 0.5], None) == pytest.approx([0.9, 0.1])  # the paper: no cap
    with pytest.raises(ValueError, match="max_ratio must be >= 1"):
        cap_weights([0.5, 0.5], [0.5, 0.5], 0.5)


def test_server_explosive_completeness_case_stays_sane():
    """The real-MS failure: estimates 61 / 21.5 / 1.33 / 77 from a model that had just marked its
    first lesions, every site at loss 0.9, 25 / 24 / 24 / 24 training images."""
    estimates, sizes = [61.0, 21.5, 1.33, 77.0], [25, 24, 24, 24]
    ups = [update(f"site-{k + 1}", float(k), n, a=a, loss=0.9) for k, (a, n) in enumerate(zip(estimates, sizes))]
    # the paper's rule: softmax(a / 0.9) = softmax(67.8, 23.9, 1.48, 85.6): site-4 takes all but e^-17.8
    paper = FedIAServer(warmup_rounds=2, **PAPER_SERVER_GUARDS)
    ctx = sctx(5)
    w, _ = paper.aggregate(ups, ctx)
    assert ctx.report["weights"]["site-4"] == pytest.approx(1.0, abs=1e-7) and w["w"][0] == pytest.approx(3.0, abs=1e-6)
    # ours: every estimate clipped to 1.0 -> equal a / l -> softmax gives 0.25 each; no cap needed
    ours = FedIAServer(warmup_rounds=2)
    ctx = sctx(5)
    w, g = ours.aggregate(ups, ctx)
    assert [ctx.report["weights"][f"site-{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.25] * 4)
    assert w["w"][0] == pytest.approx((0 + 1 + 2 + 3) / 4) and g == {"completeness_aware": 1}
    assert ctx.report["rule"] == "completeness_aware" and ctx.report["completeness"]["site-4"] == 77.0
    # one site at a much lower loss: softmax(1/0.3, 1/0.9 x 3) = (0.7657, 0.0781 x 3) -> capped at
    # 2 x 25/97 = 0.5155, the rest shared equally: (1 - 0.5155) / 3 = 0.1615 each
    ups[0].stats["mean_loss"] = 0.3
    ctx = sctx(5)
    ours.aggregate(ups, ctx)
    cap = 2 * 25 / 97
    assert [ctx.report["weights"][f"site-{k}"] for k in (1, 2, 3, 4)] == pytest.approx([cap] + [(1 - cap) / 3] * 3)


def test_server_reports_size_weights_while_waiting():
    ctx = sctx(5)
    FedIAServer(warmup_rounds=2).aggregate([update("site-1", 0.0, 1, ready=0), update("site-2", 1.0, 3)], ctx)
    assert ctx.report["rule"] == "fedavg" and ctx.report["weights"] == {"site-1": 0.25, "site-2": 0.75}
    assert ctx.report["completeness_ready"] == {"site-1": 0, "site-2": 1}


@pytest.mark.parametrize("key,value,match", [
    ("mean_loss", float("nan"), "'mean_loss' is not finite"),
    ("completeness", 0.0, r"'completeness' must be in \(0, inf\)"),
    ("completeness", float("inf"), "'completeness' is not finite"),
    ("iou", 1.5, "'iou' must be in"),
    ("completeness_ready", 0.5, "'completeness_ready' must be 0 or 1"),
    ("mean_loss", np.array([0.1, 0.2]), "'mean_loss' must be one number"),
])
def test_server_check_stats_rejects(key, value, match):
    u = update("site-1", 0.0, 1)
    u.stats[key] = value
    with pytest.raises(ValueError, match=match):
        FedIAServer().check_stats(u, sctx(0))
    FedIAServer().check_stats(update("site-1", 0.0, 1, a=1.7), sctx(0))  # a_k > 1 is accepted (not clipped)
    missing = update("site-1", 0.0, 1)
    del missing.stats["iou"]
    with pytest.raises(ValueError, match="'iou' is missing"):
        FedIAServer().check_stats(missing, sctx(0))


# ----------------------------------------------------------------------------- client state machine
def test_client_estimates_triggers_corrects_once_and_survives_restart(tmp_path):
    site, full = lesion_masks()
    ctx = make_ctx(tmp_path, site, reference=full)
    model = FixedMapModel(predicted_map())
    # warm-up IoU 0.1, 0.2 at t=1,2 -> trend slope 0.1, intercept 0; t=3 fitted 0.3, actual 0.25
    # -> gap 0.05 > 0.03: trigger at round 2, correct at the start of round 3.
    ious = {0: 0.1, 1: 0.2, 2: 0.25, 3: 0.1, 4: 0.1}
    client = scripted(FedIAClient(warmup_rounds=2), ious)
    client.setup(ctx)
    out0 = run_round(client, model, 0)
    assert out0.stats == {"mean_loss": 0.4, "iou": 0.1, "completeness": 1.0, "completeness_ready": 0, "corrected": 0,
                          "num_images": 2}
    assert out0.num_samples == 2
    run_round(client, model, 1)
    out2 = run_round(client, model, 2)
    # completeness with the received model: 2 annotated / 6 predicted lesions = 1/3
    assert out2.stats["completeness_ready"] == 1 and out2.stats["completeness"] == pytest.approx(1 / 3)
    assert out2.metrics["iou_trend"] == pytest.approx(0.3)
    assert out2.metrics["correction_triggered"] == 1 and out2.stats["corrected"] == 0
    assert out2.metrics["true_completeness"] == pytest.approx(0.5)  # 2 of 4 lesions kept
    assert client.state["trend"] == pytest.approx([0.1, 0.0])

    out3 = run_round(client, model, 3)
    # prob 0.953 > 0.8 on the missing lesion (4 px per image) and the false strip (2 px per image):
    # 2 * (4 + 2) = 12 pixels corrected, 8 of them truly lesion -> precision 8 / 12; all 8 missing
    # lesion pixels recovered -> recall 1.0. The model trained on the corrected masks this round.
    assert out3.metrics["corrected_pixels"] == 12 and out3.stats["corrected"] == 1
    assert out3.metrics["corrected_precision"] == pytest.approx(8 / 12)
    assert out3.metrics["corrected_recall_missing"] == pytest.approx(1.0)
    assert int(client.seen_masks[3].sum()) == int(site.sum()) + 12
    assert (client.seen_masks[3] >= site).all()  # never 1 -> 0
    assert np.array_equal(ctx.data.splits["train"].labels, site)  # the site data is untouched
    assert os.path.exists(tmp_path / "state" / MASKS_FILE)
    # the corrected masks are the state folder's file, memory-mapped, not a copy in memory
    assert isinstance(client.masks, np.memmap) and client.masks.filename == str(tmp_path / "state" / MASKS_FILE)
    assert not os.path.exists(tmp_path / "state" / NEXT_MASKS_FILE)
    assert int(np.load(tmp_path / "state" / MASKS_FILE).sum()) == int(site.sum()) + 12
    # correct once: IoU 0.1 far below the trend at round 3 does not trigger again
    assert "iou_trend" not in out3.metrics and out3.metrics["correction_triggered"] == 0

    # site restart: a fresh rule with the same state_dir gets everything back
    again = scripted(FedIAClient(warmup_rounds=2), ious)
    again.setup(make_ctx(tmp_path, site, reference=full))
    assert again.state["completeness"] == pytest.approx(1 / 3)
    assert again.state["iou_history"] == {"0": 0.1, "1": 0.2, "2": 0.25, "3": 0.1}
    assert again.state["corrected"] and again.state["correction_rounds"] == [3]
    assert np.array_equal(again.masks, client.masks)
    out4 = run_round(again, model, 4)
    assert out4.metrics["corrected_pixels"] == 0 and out4.stats["corrected"] == 1
    assert out4.stats["completeness"] == pytest.approx(1 / 3)
    assert np.array_equal(again.seen_masks[4], client.masks)
    saved = json.loads((tmp_path / "state" / STATE_FILE).read_text())
    assert saved["mask_shape"] == [2, 8, 8]


def test_restart_with_unreadable_corrected_masks_names_the_file(tmp_path):
    site, _ = lesion_masks()
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_text(json.dumps({"corrected": True, "mask_shape": [2, 8, 8]}))
    (state / MASKS_FILE).write_bytes(b"not a numpy file")
    with pytest.raises(DataError, match=f"corrected masks {state / MASKS_FILE} cannot be read"):
        FedIAClient(warmup_rounds=2).setup(make_ctx(tmp_path, site))
    np.save(state / MASKS_FILE, np.zeros((3, 8, 8), dtype=np.uint8))  # another site's / run's masks
    with pytest.raises(DataError, match=r"are uint8 \(3, 8, 8\), the site's train masks are uint8 \(2, 8, 8\)"):
        FedIAClient(warmup_rounds=2).setup(make_ctx(tmp_path, site))


def test_client_warmup_from_first_lesion_defers_estimate_and_trend(tmp_path):
    site, _ = lesion_masks()
    ious = {0: 0.01, 1: 0.0, 2: 0.1, 3: 0.3, 4: 0.5, 5: 0.5}  # round 0: an untrained model's lucky guess
    blank = np.full((8, 8), -3.0, dtype=np.float32)  # the model marks nothing (sigmoid 0.047)
    # learning starts late: from round 4 the global model marks 3 lesions per image

    paper = scripted(FedIAClient(warmup_rounds=2, use_correction=False, **PAPER_CLIENT_GUARDS), ious)
    outs = run_with_late_model(paper, make_ctx(tmp_path / "paper", site), blank)
    # the paper's rule estimates at round 2 from a blank model: 1.0 for good
    assert outs[2].stats["completeness_ready"] == 1 and outs[5].stats["completeness"] == 1.0

    deferred = scripted(FedIAClient(warmup_rounds=2, use_correction=False, warmup_from_first_lesion=True), ious)
    outs = run_with_late_model(deferred, make_ctx(tmp_path / "deferred", site), blank)
    assert [o.stats["completeness_ready"] for o in outs] == [0, 0, 0, 0, 1, 1]
    # round 4: 2 annotated / 6 predicted lesions; the trend is fitted over the rounds before it after
    # the last round of IoU 0: rounds 2, 3 (t = 3, 4; IoU 0.1, 0.3) -> slope 0.2, intercept -0.5
    assert outs[4].stats["completeness"] == pytest.approx(1 / 3)
    assert deferred.state["trend"] == pytest.approx([0.2, -0.5])
    # the paper's trend over the warm-up rounds 0, 1 (t = 1, 2; IoU 0.01, 0) falls: -0.01 t + 0.02
    assert paper.state["trend"] == pytest.approx([-0.01, 0.02])


def test_client_correct_repeatedly_and_switch_off(tmp_path):
    site, _ = lesion_masks()
    model = FixedMapModel(predicted_map())
    ious = {0: 0.1, 1: 0.2, 2: 0.25, 3: 0.1, 4: 0.1}
    repeat = scripted(FedIAClient(warmup_rounds=2, correct_repeatedly=True), ious)
    repeat.setup(make_ctx(tmp_path / "a", site))
    outs = [run_round(repeat, model, r) for r in range(5)]
    # trigger at rounds 2 and 3 (0.1 < 0.4 - 0.03), corrections at rounds 3 and 4; the second finds
    # nothing new to flip (already 1). No reference -> no precision metric.
    assert [o.metrics["correction_triggered"] for o in outs] == [0, 0, 1, 1, 1]
    assert repeat.state["correction_rounds"] == [3, 4]
    assert outs[3].metrics["corrected_pixels"] == 12 and outs[4].metrics["corrected_pixels"] == 0
    assert "corrected_precision" not in outs[3].metrics

    off = scripted(FedIAClient(warmup_rounds=2, use_correction=False), ious)
    off.setup(make_ctx(tmp_path / "b", site))
    outs = [run_round(off, model, r) for r in range(5)]
    assert all(o.metrics["corrected_pixels"] == 0 and o.stats["corrected"] == 0 for o in outs)
    assert outs[4].stats["completeness"] == pytest.approx(1 / 3)  # still estimated (for the server)


def test_client_retry_empty_correction_keeps_the_trigger_armed(tmp_path):
    site, _ = lesion_masks()
    ious = {0: 0.1, 1: 0.2, 2: 0.25, 3: 0.1, 4: 0.1, 5: 0.1}
    unsure = predicted_map() / 3.0  # logit 1 on the lesions: sigmoid 0.73, marked (> 0.5) but < 0.8
    # from round 4 the global model is sure (0.953) of the missed lesions

    # trend over rounds 0, 1: IoU 0.1 t + 0 -> round 2 (t = 3): 0.25 < 0.30 - 0.03 triggers;
    # the correction at round 3 comes from the unsure model and changes nothing
    reference = run_with_late_model(scripted(FedIAClient(warmup_rounds=2), ious),
                                    make_ctx(tmp_path / "reference", site), unsure)
    assert [o.metrics["corrected_pixels"] for o in reference] == [0, 0, 0, 0, 0, 0]
    assert [o.stats["corrected"] for o in reference] == [0, 0, 0, 1, 1, 1]  # used up, nothing gained
    assert [o.metrics["correction_triggered"] for o in reference] == [0, 0, 1, 0, 0, 0]

    retry = scripted(FedIAClient(warmup_rounds=2, retry_empty_correction=True), ious)
    outs = run_with_late_model(retry, make_ctx(tmp_path / "retry", site), unsure)
    # round 3: nothing passed 0.8, the site is not corrected and round 3's IoU 0.1 < 0.4 - 0.03
    # triggers again; round 4 corrects with the sure model: the 2 missed 2x2 lesions and the 1x2
    # strip of each image = 12 pixels; afterwards the trigger is off (correct once)
    assert [o.metrics["corrected_pixels"] for o in outs] == [0, 0, 0, 0, 12, 0]
    assert [o.stats["corrected"] for o in outs] == [0, 0, 0, 0, 1, 1]
    assert [o.metrics["correction_triggered"] for o in outs] == [0, 0, 1, 1, 0, 0]
    assert retry.state["correction_rounds"] == [4]


def test_client_estimates_only_from_a_model_that_finds_lesions(tmp_path):
    # the complete masks: 2 lesions per image, 4 annotated; the model marks 1 lesion per image (2)
    _, full = lesion_masks()
    one = np.full((8, 8), -3.0, np.float32)
    one[1:3, 1:3] = 3.0
    ious = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.3}
    # 2 predicted < 0.6 x 4 annotated: deferred, the site reports "not ready" (the server stays on FedAvg)
    strict = scripted(FedIAClient(warmup_rounds=2, min_predicted_ratio=0.6), ious)
    strict.setup(make_ctx(tmp_path / "strict", full))
    outs = [run_round(strict, FixedMapModel(one), r) for r in range(4)]
    assert [o.stats["completeness_ready"] for o in outs] == [0, 0, 0, 0] and strict.state["completeness"] is None
    # 2 >= 0.5 x 4: estimated 4 / 2 = 2.0, clipped to the default cap 1.0 (completeness is a fraction)
    ours = scripted(FedIAClient(warmup_rounds=2), ious)
    ours.setup(make_ctx(tmp_path / "ours", full))
    out = [run_round(ours, FixedMapModel(one), r) for r in range(3)][-1]
    assert out.stats["completeness_ready"] == 1 and out.stats["completeness"] == 1.0
    # the paper's rule takes it as it is: 2.0
    paper = scripted(FedIAClient(warmup_rounds=2, **PAPER_CLIENT_GUARDS), ious)
    paper.setup(make_ctx(tmp_path / "paper", full))
    assert [run_round(paper, FixedMapModel(one), r) for r in range(3)][-1].stats["completeness"] == 2.0
    with pytest.raises(ValueError, match="min_predicted_ratio must be >= 0"):
        FedIAClient(min_predicted_ratio=-1)


def test_client_completeness_cap_and_no_prediction(tmp_path):
    site, _ = lesion_masks()
    ious = {0: 0.1, 1: 0.2, 2: 0.3}
    # a model predicting nothing: completeness undefined -> 1.0, still "ready"
    blank = scripted(FedIAClient(warmup_rounds=2, **PAPER_CLIENT_GUARDS), ious)
    blank.setup(make_ctx(tmp_path / "a", site))
    empty_model = FixedMapModel(np.full((8, 8), -5.0, np.float32))
    out = [run_round(blank, empty_model, r) for r in range(3)][-1]
    assert out.stats["completeness"] == 1.0 and out.stats["completeness_ready"] == 1
    # an under-segmenting model: 1 predicted lesion per image, 2 annotated (the complete masks)
    # -> 4 / 2 = 2.0, clipped to the cap 0.9
    _, full = lesion_masks()
    one = np.full((8, 8), -3.0, np.float32)
    one[1:3, 1:3] = 3.0
    capped = scripted(FedIAClient(warmup_rounds=2, completeness_cap=0.9), ious)
    capped.setup(make_ctx(tmp_path / "b", full))
    out = [run_round(capped, FixedMapModel(one), r) for r in range(3)][-1]
    assert capped.state["annotated_lesions"] == 4 and capped.state["predicted_lesions"] == 2
    assert out.stats["completeness"] == pytest.approx(0.9)
    # no annotated lesion at all: 0 / 2 -> raised to the floor 1e-3 (stays in (0, inf))
    floor = scripted(FedIAClient(warmup_rounds=2), ious)
    floor.setup(make_ctx(tmp_path / "c", site * 0))
    out = [run_round(floor, FixedMapModel(one), r) for r in range(3)][-1]
    assert out.stats["completeness"] == pytest.approx(1e-3)


def test_client_rejects_stale_state_and_bad_data(tmp_path):
    site, _ = lesion_masks()
    client = scripted(FedIAClient(warmup_rounds=2), {0: 0.1})
    client.setup(make_ctx(tmp_path, site))
    run_round(client, FixedMapModel(predicted_map()), 0)
    bigger = np.zeros((3, 8, 8), np.uint8)
    with pytest.raises(DataError, match="site-1.*shape"):
        FedIAClient(warmup_rounds=2).setup(make_ctx(tmp_path, bigger))
    with pytest.raises(ValueError, match="warmup_rounds"):
        FedIAClient(warmup_rounds=1)
    ctx = make_ctx(tmp_path / "c", site)
    ctx.data.task = "multi-label"
    with pytest.raises(DataError, match="segmentation"):
        binary_masks(ctx)


# ----------------------------------------------------------------------------- shared segmentation pieces
def test_iou_score():
    pred = np.array([[1, 1], [0, 0]])
    target = np.array([[1, 0], [1, 0]])
    assert iou_score(pred, target) == pytest.approx(1 / 3)  # I = 1, U = 3
    assert iou_score(np.zeros((2, 2)), np.zeros((2, 2))) == 1.0
    assert iou_score(np.ones((2, 2)), np.zeros((2, 2))) == 0.0


def test_train_dice_epoch_weights_batches_by_size():
    # 5 images, batch 2 -> batches of 2, 2, 1. Loss of a batch = its mean foreground fraction.
    # Only image 0 is foreground (fraction 1): the per-image mean is 1/5 = 0.2 whatever the
    # shuffle; an unweighted mean of batch losses would be 1/6 or 1/3.
    masks = np.zeros((5, 4, 4), np.uint8)
    masks[0] = 1
    model = FixedMapModel(np.zeros((4, 4), np.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_fn = lambda logits, y: logits.mean() * 0 + y.mean()  # noqa: E731
    mean_loss, steps = train_dice_epoch(model, torch.zeros(5, 1, 4, 4), masks, opt, loss_fn, torch.device("cpu"),
                                        2, np.random.default_rng(0))
    assert steps == 3 and mean_loss == pytest.approx(0.2)


def test_segmentation_client_trains_tiny_unet(tmp_path):
    from fedpartial.models import build_model

    rng = np.random.default_rng(0)
    masks = np.zeros((6, 16, 16), np.uint8)
    for i in range(6):
        r, c = rng.integers(2, 10, size=2)
        masks[i, r:r + 4, c:c + 4] = 1
    torch.manual_seed(0)
    model = build_model("unet", num_classes=1, in_channels=1, channels=(4, 8), strides=(2,), num_res_units=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client = SegmentationSupervisedClient(lr=1e-2, batch_size=4)
    client.setup(make_ctx(tmp_path, masks))
    out = client.train_round(model, RoundInput(round=0, num_rounds=1))
    assert out.num_samples == 6 and out.metrics["train_steps"] == 2  # batches of 4 and 2
    assert 0.0 < out.metrics["train_loss"] < 1.0 and 0.0 <= out.metrics["train_iou"] <= 1.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # FedIA's client runs the same real training path
    fedia = FedIAClient(warmup_rounds=2, lr=1e-2)
    fedia.setup(make_ctx(tmp_path / "f", masks))
    stats = fedia.train_round(model, RoundInput(round=0, num_rounds=3)).stats
    assert np.isfinite(stats["mean_loss"]) and stats["completeness_ready"] == 0


def test_lesion_batches_fill_each_batch_with_lesion_images():
    from fedpartial.algorithms.segmentation import lesion_batches

    has_lesion = np.zeros(10, bool)
    has_lesion[[3, 7]] = True  # 2 of 10 images hold a lesion
    rng = np.random.default_rng(0)
    batches = list(lesion_batches(has_lesion, 4, rng, lesion_fraction=0.5))
    assert [len(b) for b in batches] == [4, 4, 2]  # an epoch's steps, the last batch smaller
    # ceil(0.5 * 4) = 2 and ceil(0.5 * 2) = 1 lesion images at least per batch
    assert [int(has_lesion[b].sum()) >= need for b, need in zip(batches, [2, 2, 1])] == [True] * 3
    # fraction 0 = one plain permutation of all images
    plain = np.concatenate(list(lesion_batches(has_lesion, 4, np.random.default_rng(0), 0.0)))
    assert sorted(plain.tolist()) == list(range(10))
    # a site without lesions cannot oversample: plain batches
    assert sorted(np.concatenate(list(lesion_batches(np.zeros(5, bool), 2, rng, 1.0))).tolist()) == list(range(5))


@pytest.mark.parametrize("kind", ["dice", "dice_ce", "dice_focal"])
def test_segmentation_losses_punish_false_positives_on_an_empty_image(kind):
    from fedpartial.algorithms.segmentation import make_dice_loss

    loss = make_dice_loss(kind=kind)
    empty = torch.zeros(1, 1, 8, 8)
    quiet, loud = torch.full((1, 1, 8, 8), -6.0), torch.full((1, 1, 8, 8), 6.0)
    if kind == "dice":
        # soft Dice of an empty target: 1 - smooth / (sum p + smooth) -> close to 1 for any p > 0
        # (smooth_dr = 1e-5), so it barely tells a quiet prediction from one marking everything
        assert float(loss(loud, empty)) - float(loss(quiet, empty)) < 0.01
    else:
        # the pixel-wise term adds about log(1 + e^6) ~ 6 (CE) per false-positive pixel
        assert float(loss(loud, empty)) - float(loss(quiet, empty)) > 1.0
    with pytest.raises(ValueError, match="unknown"):
        make_dice_loss(kind="bce")


# ----------------------------------------------------------------------------- lr over rounds
def test_round_lr_cosine_by_hand():
    from fedpartial.training.common import round_lr
    # lr 1e-3 to 1e-4 over 5 rounds: progress 0, 1/4, 1/2, 1, and past the end stays at the last
    assert round_lr(1e-3, 0, 5, "cosine", 0.1) == pytest.approx(1e-3)
    # 1e-4 + 9e-4 * (1 + cos(pi/4)) / 2 = 1e-4 + 9e-4 * 0.853553 = 8.68198e-4
    assert round_lr(1e-3, 1, 5, "cosine", 0.1) == pytest.approx(8.68198e-4, rel=1e-5)
    assert round_lr(1e-3, 2, 5, "cosine", 0.1) == pytest.approx(5.5e-4)
    assert round_lr(1e-3, 4, 5, "cosine", 0.1) == pytest.approx(1e-4)
    assert round_lr(1e-3, 9, 5, "cosine", 0.1) == pytest.approx(1e-4)
    assert round_lr(1e-3, 3, 5, "constant") == 1e-3
    with pytest.raises(ValueError, match="lr_schedule 'step' unknown"):
        round_lr(1e-3, 0, 5, "step")


def test_segmentation_and_fedia_clients_train_each_round_at_the_scheduled_lr(tmp_path, monkeypatch):
    import fedpartial.algorithms.segmentation as seg

    used = []
    real = seg.make_adam
    monkeypatch.setattr(seg, "make_adam", lambda model, lr, betas, wd: (used.append(lr), real(model, lr, betas, wd))[1])
    site, full = lesion_masks()
    for client in (SegmentationSupervisedClient(lr=1e-2, batch_size=2, lr_schedule="cosine", final_lr_fraction=0.5),
                   FedIAClient(lr=1e-2, batch_size=2, lr_schedule="cosine", final_lr_fraction=0.5,
                               use_correction=False)):
        used.clear()
        client.setup(make_ctx(tmp_path / type(client).__name__, site, full))
        model = FixedMapModel(predicted_map())
        for r in range(3):
            run_round(client, model, r, num_rounds=3)
        # 1e-2 at round 0, (1e-2 + 5e-3) / 2 at the middle round, 5e-3 at the last
        assert used == pytest.approx([1e-2, 7.5e-3, 5e-3])
    with pytest.raises(ValueError, match="final_lr_fraction"):
        SegmentationSupervisedClient(lr_schedule="cosine", final_lr_fraction=0.0)
