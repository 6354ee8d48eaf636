"""The site's result policy (``SiteResultPolicy`` / ``filter_result``): every key of every result is
allow-listed, counts and values from fewer than k samples are withheld, unknown keys and kinds are
withheld. Numbers are worked out by hand; no FLARE run (filters get hand-made Shareables)."""
import logging

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply

from fedpartial.flare.common import SITE_METRICS, SITE_STATS, SITE_TRAIN_SIZE, SITE_VAL_MIN_CLASS_COUNT
from fedpartial.flare.filters import StatisticsPrivacyFilter
from fedpartial.flare.result_policy import (METRIC_RULES, SENT_METRICS, SiteResultPolicy, filter_result,
                                            merge_metric_rules, release_metrics)
from fedpartial.metrics.segmentation import pooled_validation

K = 5
FEDIA_METRICS = {"train_loss": 0.31, "train_iou": 0.42, "train_steps": 1, "corrected_pixels": 12,
                 "correction_triggered": 0, "corrected": 1, "corrected_pixels_total": 12, "completeness": 0.6,
                 "train_seconds": 2.5}
FEDIA_STATS = {"mean_loss": 0.31, "iou": 0.42, "completeness": 0.6, "completeness_ready": 1, "corrected": 1}
SEG_VAL = {"dice_per_image": 0.5, "iou_per_image": 0.4, "dice_pooled": 0.6, "iou_pooled": 0.43, "n_empty_both": 1,
           "predicted_lesion_share": 0.67, "tp": 120, "fp": 30, "fn": 50}


def _ctx(task="train", site="site-1", val_min_class_count=K):
    ctx = FLContext()
    if val_min_class_count is not None:  # what the executor sets: its val scores left out classes under k
        ctx.set_prop(SITE_VAL_MIN_CLASS_COUNT, val_min_class_count, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    ctx.set_prop(FLContextKey.FILTER_DIRECTION, "out", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=True)
    return ctx


def _train_result(n, metrics, stats=None, initial=None, train_size=None, **extra):
    """A train result as ``FedPartialExecutor._train`` builds it."""
    dxo = DXO(DataKind.WEIGHTS, data={"w": np.ones(2, np.float32)})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(MetaKey.INITIAL_METRICS, dict(initial or {}))
    dxo.set_meta_prop(SITE_STATS, dict(stats or {}))
    dxo.set_meta_prop(SITE_METRICS, dict(metrics))
    dxo.set_meta_prop(SITE_TRAIN_SIZE, n if train_size is None else train_size)
    for key, value in extra.items():
        dxo.set_meta_prop(key, value)
    return dxo.to_shareable()


def _policy(shareable, task="train", min_count=K, val_min_class_count=K):
    return SiteResultPolicy(min_count=min_count).process(shareable, _ctx(task, val_min_class_count=val_min_class_count))


def test_fedia_values_from_3_images_are_withheld_at_5_and_released_at_7():
    # 3 images < 5: every site value goes (removed), the sample count is sent as 0 ("takes no part"),
    # the statistics become what a site without images sends, the train size is removed
    out = from_shareable(_policy(_train_result(3, FEDIA_METRICS, {**FEDIA_STATS, "num_images": 3})))
    assert out.get_meta_prop(SITE_METRICS) == {}
    assert out.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 0
    assert out.get_meta_prop(SITE_STATS) == {"mean_loss": 1.0, "iou": 0.0, "completeness": 1.0,
                                             "completeness_ready": 0.0, "corrected": 0.0, "num_images": 0.0}
    assert SITE_TRAIN_SIZE not in out.meta
    np.testing.assert_array_equal(out.data["w"], [1, 1])  # weights are the gate's business
    # 7 images: released as sent (corrected_pixels 12 >= 5)
    out = from_shareable(_policy(_train_result(7, FEDIA_METRICS, {**FEDIA_STATS, "num_images": 7})))
    assert out.get_meta_prop(SITE_METRICS) == FEDIA_METRICS
    assert out.get_meta_prop(SITE_METRICS)["completeness"] == 0.6
    assert out.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 7 and out.get_meta_prop(SITE_TRAIN_SIZE) == 7
    assert out.get_meta_prop(SITE_STATS) == {**FEDIA_STATS, "num_images": 7}
    # 7 images but 4 corrected pixels: the pixel counts and the precision over them are withheld
    few = {**FEDIA_METRICS, "corrected_pixels": 4, "corrected_pixels_total": 4, "corrected_precision": 0.75}
    out = from_shareable(_policy(_train_result(7, few))).get_meta_prop(SITE_METRICS)
    assert sorted(set(few) - set(out)) == ["corrected_pixels", "corrected_pixels_total", "corrected_precision"]
    few["corrected_pixels_total"] = 8  # 8 >= 5: the precision over it is released with it
    out = from_shareable(_policy(_train_result(7, few))).get_meta_prop(SITE_METRICS)
    assert out["corrected_pixels_total"] == 8 and out["corrected_precision"] == 0.75 and "corrected_pixels" not in out


def test_fedmlp_per_class_tag_counts_and_rates():
    metrics = {"stage": 2.0, "train_loss": 0.7, "tags_new_pos_c1": 3.0, "tags_new_neg_c1": 9.0,
               "tags_new_pos_c2": 0.0, "tags_new_neg_cx": 7.0, "tags_total_pos": 4.0, "tags_total_neg": 30.0,
               "tag_precision_pos": 0.75, "tag_precision_neg": 0.9, "tag_recall_pos": 0.5}
    out, report = release_metrics(metrics, METRIC_RULES, scope_count=40, min_count=K)
    assert out == {"stage": 2.0, "train_loss": 0.7, "tags_new_neg_c1": 9.0, "tags_total_neg": 30.0,
                   "tag_precision_neg": 0.9}
    # 3, 0 and 4 tags < 5; the precision over 4 tags goes with them; recall's count is never sent
    assert sorted(report["withheld"]) == ["tag_precision_pos", "tag_recall_pos", "tags_new_pos_c1",
                                          "tags_new_pos_c2", "tags_total_pos"]
    assert report["unknown"] == ["tags_new_neg_cx"]  # not a class index: no rule, fail closed
    # a site of 4 samples: nothing that describes its samples leaves; the stage (set by the server) does
    out, _ = release_metrics(metrics, METRIC_RULES, scope_count=4, min_count=K)
    assert out == {"stage": 2.0}


def test_fedlsm_pseudo_label_counts_nan_and_diagnostics():
    metrics = {"loss": 0.5, "mean_entropy": float("nan"), "num_pseudo_positive": 4.0,
               "num_pseudo_negative": float("nan"), "pseudo_neg_precision": 0.8, "pseudo_precision": 0.75, "pseudo_recall": 0.5,
               "global_stats_received": 1.0, "n_confident": 200.0, "samples_seen": 250.0}
    out, report = release_metrics(metrics, METRIC_RULES, scope_count=250, min_count=K)
    assert out == {"loss": 0.5, "global_stats_received": 1.0, "n_confident": 200.0, "samples_seen": 250.0}
    assert sorted(report["withheld"]) == ["mean_entropy", "num_pseudo_negative", "num_pseudo_positive",
                                          "pseudo_neg_precision", "pseudo_precision", "pseudo_recall"]
    metrics.update(num_pseudo_positive=9.0, num_pseudo_negative=6.0)
    out, _ = release_metrics(metrics, METRIC_RULES, scope_count=250, min_count=K)
    assert out["num_pseudo_positive"] == 9.0 and out["num_pseudo_negative"] == 6.0
    assert out["pseudo_neg_precision"] == 0.8  # over 6 >= 5 negatives
    # FedIRM's pseudo_precision is over a count it does not send: one key, the stricter rule
    assert METRIC_RULES["pseudo_precision"] == ("rate:num_pseudo_positive", "local")
    assert "pseudo_precision" not in out and "pseudo_recall" not in out


def test_validation_metrics_withhold_pixel_counts_of_fewer_than_k_images():
    small = DXO(DataKind.METRICS, data={**SEG_VAL, "n_images": 3}).to_shareable()
    out = from_shareable(_policy(small, task="validate"))
    assert out.data_kind == DataKind.METRICS and out.data == {}  # tp / fp / fn, Dice... of 3 images: nothing
    big = DXO(DataKind.METRICS, data={**SEG_VAL, "n_images": 8, "n_empty_both": 2}).to_shareable()
    out = from_shareable(_policy(big, task="validate")).data
    assert out == {k: v for k, v in {**SEG_VAL, "n_images": 8}.items() if k != "n_empty_both"}  # 2 < 5
    # the server pools what is left: the 3-image site is skipped, not counted as zeros
    small_out = from_shareable(_policy(DXO(DataKind.METRICS, data={**SEG_VAL, "n_images": 3}).to_shareable())).data
    pooled = pooled_validation({"site-1": small_out, "site-2": out})
    assert pooled["sites"] == 1 and pooled["n_images"] == 8
    assert pooled["dice_pooled"] == pytest.approx(2 * 120 / (2 * 120 + 30 + 50))  # 0.75
    # the same rules on the received model's metrics in a train result
    out = from_shareable(_policy(_train_result(40, {}, initial={**SEG_VAL, "n_images": 3})))
    assert out.get_meta_prop(MetaKey.INITIAL_METRICS) == {}


def test_classification_validation_keeps_the_flat_rates_only():
    val = {"auc": 0.8, "map": float("nan"), "bacc": 0.7, "accuracy": 0.75, "f1": 0.6, "precision": 0.5, "recall": 0.4,
           "per_class": {"a": {"auc": 0.8, "n_pos": 2}}, "n_pos": 3}
    out = from_shareable(_policy(DXO(DataKind.METRICS, data=val).to_shareable(), task="validate")).data
    assert out == {"auc": 0.8, "bacc": 0.7, "accuracy": 0.75, "f1": 0.6, "precision": 0.5, "recall": 0.4}


@pytest.mark.parametrize("scored_with", [None, 3])
def test_classification_rates_leave_only_when_scored_without_classes_under_k(scored_with):
    """The rates leave only when the executor scored them without classes of fewer than k positives or
    negatives (it says so on the task's context); unknown, or scored with a smaller k: withheld, in a
    validation result and in a train result's metrics of the received model."""
    val = {"auc": 0.8, "accuracy": 0.75, "f1": 0.6, "val_curated": 1.0}
    out = from_shareable(_policy(DXO(DataKind.METRICS, data=val).to_shareable(), task="validate",
                                 val_min_class_count=scored_with)).data
    assert out == {"val_curated": 1.0}
    out = from_shareable(_policy(_train_result(40, {}, initial=val), val_min_class_count=scored_with))
    assert out.get_meta_prop(MetaKey.INITIAL_METRICS) == {"val_curated": 1.0}
    out = from_shareable(_policy(_train_result(40, {}, initial=val), min_count=3, val_min_class_count=scored_with))
    assert out.get_meta_prop(MetaKey.INITIAL_METRICS) == (val if scored_with == 3 else {"val_curated": 1.0})


def test_site_train_size_and_sample_count_must_be_counts():
    for size, kept in ((3, False), (40, True), (40.0, False), (True, False)):
        out = from_shareable(_policy(_train_result(40, {}, train_size=size)))
        assert (SITE_TRAIN_SIZE in out.meta) == kept, size
    out = from_shareable(_policy(_train_result("40", {"train_loss": 0.1})))
    assert MetaKey.NUM_STEPS_CURRENT_ROUND not in out.meta  # the aggregator rejects such an update
    assert out.get_meta_prop(SITE_METRICS) == {}  # no sample count: no scope


def test_unknown_meta_key_kind_and_payload_are_withheld(caplog):
    secret = 0.123456789
    msg = _train_result(40, {"train_loss": 0.2, "per_image_loss": secret}, per_image_losses=[secret] * 3)
    msg["side_channel"] = secret
    with caplog.at_level(logging.INFO):
        out = _policy(msg, task="train_v2")
    dxo = from_shareable(out)
    assert "per_image_losses" not in dxo.meta and dxo.get_meta_prop(SITE_METRICS) == {"train_loss": 0.2}
    assert "side_channel" not in out
    log = caplog.text
    for name in ("per_image_losses", "per_image_loss", "side_channel", "site 'site-1'", "task 'train_v2'"):
        assert name in log, name
    assert "0.1234" not in log  # names, never values
    # kinds a site does not send leave nothing
    for kind in (DataKind.COLLECTION, DataKind.STATISTICS, DataKind.APP_DEFINED):
        out = _policy(DXO(kind, data={"x": 1.0}).to_shareable())
        assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "DXO" not in out, kind
    out = _policy(Shareable({"weights": [1.0, 2.0]}))  # OK but no DXO
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "weights" not in out
    error = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    DXO(DataKind.METRICS, data={"tp": 3}).update_shareable(error)
    out = _policy(error)
    assert out.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and "DXO" not in out


def test_flare_meta_on_a_result_is_allowed_and_checked():
    msg = _train_result(40, {"train_loss": 0.2})
    # DXO.to_shareable adds no meta key: what the executor set is all there is
    assert set(from_shareable(msg).meta) == {MetaKey.NUM_STEPS_CURRENT_ROUND, MetaKey.INITIAL_METRICS, SITE_STATS,
                                             SITE_METRICS, SITE_TRAIN_SIZE}
    # a DXOFilter before the policy (FLARE's own or ours) appends its name to filter_history
    msg = StatisticsPrivacyFilter(preset="fedlsm", min_count=K).process(
        _train_result(40, {}, {"class_counts": np.array([9.0, 2.0])}), _ctx())
    assert from_shareable(msg).get_meta_prop(MetaKey.FILTER_HISTORY) == ["StatisticsPrivacyFilter"]
    out = from_shareable(_policy(msg))
    assert out.get_meta_prop(MetaKey.FILTER_HISTORY) == ["StatisticsPrivacyFilter"]
    assert out.get_meta_prop(SITE_STATS)["class_counts"].tolist() == [9, 0]
    data, meta, _ = filter_result(DataKind.WEIGHTS, {}, {MetaKey.FILTER_HISTORY: [{"x": 1}]})
    assert MetaKey.FILTER_HISTORY not in meta  # only names may travel there
    _, meta, _ = filter_result(DataKind.METRICS, {}, {MetaKey.NUM_STEPS_CURRENT_ROUND: 40, SITE_METRICS: {}})
    assert meta == {}  # a validation result carries no train meta


def test_site_stats_of_no_method_are_withheld_whole():
    stats = {"tag_check_hits": np.array([3.0, 9.0]), "tag_check_count": np.array([9.0, 9.0])}
    out = from_shareable(_policy(_train_result(40, {}, stats))).get_meta_prop(SITE_STATS)
    assert out == {}
    warmup = {"annotated_classes": np.array([1.0, 0.0])}  # FedMLP's warm-up message is a method's
    out = from_shareable(_policy(_train_result(40, {}, warmup))).get_meta_prop(SITE_STATS)
    assert out["annotated_classes"].tolist() == [1, 0]


def test_min_count_zero_switches_counts_off_but_not_the_allow_lists():
    out = from_shareable(_policy(_train_result(2, {"tags_total_pos": 1.0, "pseudo_recall": 0.5, "x": 1.0}),
                                 min_count=0))
    assert out.get_meta_prop(SITE_METRICS) == {"tags_total_pos": 1.0}
    assert out.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 2
    with pytest.raises(ValueError, match="min_count"):
        SiteResultPolicy(min_count=-1)


def test_metric_tables_are_checked():
    with pytest.raises(ValueError, match="'m': 'a' has unknown rule 'sometimes'"):
        merge_metric_rules({"m": {"a": "sometimes"}})
    with pytest.raises(ValueError, match="'m': 'r' is a rate of 'a', which is not a count"):
        merge_metric_rules({"m": {"a": "scope", "r": "rate:a"}})
    from fedpartial.algorithms import fedavg, fedia, fedirm, fedlsm, fedmlp, segmentation
    for module in (fedavg, segmentation, fedlsm, fedmlp, fedirm, fedia):
        for name, table in module.SENT_METRICS.items():
            assert SENT_METRICS[name] is table


# ---- every key the client rules really return has a rule ----------------------------------------
def _classification_data(task, n=24, c=3, labelled=True, seed=0):
    from fedpartial.data.types import Dataset, Split

    rng = np.random.default_rng(seed)
    cls = np.arange(n) % c
    labels = np.eye(c, dtype=np.float32)[cls] if task == "single-label" else (rng.random((n, c)) < 0.4).astype(
        np.float32)
    images = rng.integers(0, 60, size=(n, 8, 8), dtype=np.uint8)
    for k in range(c):
        images[labels[:, k] > 0, 2 * k:2 * k + 2, :] += 150
    mask = np.zeros((n, c), dtype=bool)
    if labelled:
        mask[:, :2] = True
    data = Dataset(task, [f"c{k}" for k in range(c)], {"train": Split(images, labels * mask, mask)}, site="site-1")
    reference = Dataset(task, [f"c{k}" for k in range(c)], {"train": Split(images, labels, np.ones_like(mask))},
                        site="site-1")
    return data, reference


def _client_ctx(tmp_path, data, reference):
    from fedpartial.algorithms.base import ClientContext

    tmp_path.mkdir(parents=True, exist_ok=True)
    return ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=str(tmp_path), seed=0,
                         log=lambda m: None, reference=reference)


def _cnn(c=3, dropout=0.0):
    from fedpartial.models import build_model

    torch.manual_seed(0)
    return build_model("small_cnn", c, 1, width=4, depth=1, dropout=dropout)


def _sent_keys(rounds):
    return {key for result in rounds for key in result.metrics} | {"train_seconds"}


def _fedlsm(tmp_path):
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.algorithms.fedlsm import FedLSMClient

    data, reference = _classification_data("multi-label")
    rule = FedLSMClient(batch_size=8, local_iterations=2, strong_view="flip")
    rule.setup(_client_ctx(tmp_path, data, reference))
    return [rule.train_round(_cnn(), RoundInput(0, 2))]


def _fedmlp(tmp_path):
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.algorithms.fedmlp import FedMLPClient

    data, reference = _classification_data("multi-label")
    rule = FedMLPClient(warmup_rounds=1, batch_size=8, num_views=1)
    rule.setup(_client_ctx(tmp_path, data, reference))
    model = _cnn()
    stats = rule.local_stats(model)
    c = 3
    global_stats = {"stage": 2, "prototypes_neg": np.repeat(stats["prototypes_neg"][:1], c, axis=0),
                    "prototypes_pos": np.repeat(stats["prototypes_pos"][:1], c, axis=0),
                    "prototype_valid": np.ones(c, bool), "learning_degree": np.ones(c), "tau0": np.full(c, 0.5),
                    "tau1": np.full(c, 0.5), "t0": 0.25, "t1": 0.25}
    return [rule.train_round(model, RoundInput(0, 3)), rule.train_round(model, RoundInput(1, 3, global_stats))]


def _fedirm(tmp_path):
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.algorithms.fedirm import RELATION_MATRIX, FedIRMClient

    labelled, _ = _classification_data("single-label")
    unlabelled, reference = _classification_data("single-label", labelled=False)
    rule = FedIRMClient(batch_size=8, augmentation="flip", mc_passes=2, unlabelled_start_round=1)
    rule.setup(_client_ctx(tmp_path / "a", labelled, None))
    out = [rule.train_round(_cnn(dropout=0.3), RoundInput(0, 2))]
    rule = FedIRMClient(batch_size=8, augmentation="flip", mc_passes=2, unlabelled_start_round=1)
    rule.setup(_client_ctx(tmp_path / "b", unlabelled, reference))
    out.append(rule.train_round(_cnn(dropout=0.3), RoundInput(0, 2)))
    out.append(rule.train_round(_cnn(dropout=0.3), RoundInput(1, 2, {RELATION_MATRIX: np.full((3, 3), 1 / 3)})))
    return out


def _fedavg(tmp_path):
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.algorithms.fedavg import SupervisedClient

    data, _ = _classification_data("multi-label")
    rule = SupervisedClient(batch_size=8)
    rule.setup(_client_ctx(tmp_path, data, None))
    return [rule.train_round(_cnn(), RoundInput(0, 1))]


class _MapModel(torch.nn.Module):
    """Predicts the same logit map for every image: lesions where ``logit_map`` > 0."""

    def __init__(self, logit_map):
        super().__init__()
        self.register_buffer("logit_map", torch.as_tensor(logit_map, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        logits = (self.logit_map * self.scale).expand(x.shape[0], 1, *self.logit_map.shape)
        return logits, logits


def _fedia(tmp_path):
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.algorithms.fedia import FedIAClient
    from fedpartial.algorithms.segmentation import SegmentationSupervisedClient
    from fedpartial.data.types import Dataset, Split

    full = np.zeros((2, 8, 8), dtype=np.uint8)
    full[:, 1:3, 1:3] = full[:, 5:7, 5:7] = 1
    site = np.zeros_like(full)
    site[:, 1:3, 1:3] = 1  # half the lesions annotated
    images = (site * 200 + 20).astype(np.uint8)
    data = Dataset("segmentation", ["lesion"], {"train": Split(images, site.copy())}, site="site-1")
    reference = Dataset("segmentation", ["lesion"], {"train": Split(images, full)}, site="site-1")
    logit_map = np.full((8, 8), -3.0, np.float32)
    logit_map[1:3, 1:3] = logit_map[5:7, 5:7] = 3.0
    ious = {0: 0.1, 1: 0.2, 2: 0.25, 3: 0.1}
    rule = FedIAClient(warmup_rounds=2)
    rule.train_on = lambda model, masks, r, num_rounds: (0.4, ious[r], 1)  # the trend decides, not real training
    rule.setup(_client_ctx(tmp_path / "fedia", data, reference))
    out = [rule.train_round(_MapModel(logit_map), RoundInput(r, 4)) for r in range(4)]
    seg = SegmentationSupervisedClient(batch_size=2)
    seg.setup(_client_ctx(tmp_path / "seg", data, None))
    return out + [seg.train_round(_MapModel(logit_map), RoundInput(0, 1))]


@pytest.mark.parametrize("run", [_fedavg, _fedlsm, _fedmlp, _fedirm, _fedia])
def test_every_metric_a_client_rule_returns_has_a_release_rule(tmp_path, run):
    torch.set_num_threads(1)
    sent = _sent_keys(run(tmp_path))
    _, report = release_metrics({k: 1.0 for k in sent}, METRIC_RULES, scope_count=100, min_count=K)
    assert report["unknown"] == [], f"{run.__name__[1:]}: no release rule for {report['unknown']}"
    assert len(sent) >= 3  # the rule ran and returned its metrics


def test_a_round_that_trained_on_fewer_than_k_images_sends_nothing():
    """One iteration of batch size 1 over 124 images: the rule reports 124 samples, but the weights
    and the loss come from one image. The executor's count of images drawn (a property of the
    task's FLContext, never on the wire) decides."""
    from fedpartial.flare.common import SITE_IMAGES_SEEN

    def policy(shareable, seen):
        ctx = _ctx()
        ctx.set_prop(SITE_IMAGES_SEEN, seen, private=True, sticky=False)
        return SiteResultPolicy(min_count=K).process(shareable, ctx)

    metrics = {"train_loss": 1.94, "train_steps": 1, "train_seconds": 0.2}
    out = policy(_train_result(124, metrics, train_size=124), 1)
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT and "DXO" not in out
    # 4 distinct images still too few; 5 is enough
    assert policy(_train_result(124, metrics), 4).get_return_code() == ReturnCode.EMPTY_RESULT
    released = from_shareable(policy(_train_result(124, metrics), 5))
    assert released.meta[SITE_METRICS] == metrics and released.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 124
    # a site taking no part (0 samples: FedIRM's unlabelled sites before they join) still answers
    idle = from_shareable(policy(_train_result(0, {"train_steps": 0}, train_size=124), 0))
    assert idle.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 0
    # the same pure function, as the policy calls it
    data, meta, report = filter_result(DataKind.WEIGHTS, {"w": np.ones(2)}, {MetaKey.NUM_STEPS_CURRENT_ROUND: 9},
                                       K, images_seen=3)
    assert data is None and report["kind"] == "WEIGHTS trained on 3 image(s), fewer than 5"


def test_images_drawn_are_counted_once_per_image():
    from fedpartial.algorithms.segmentation import lesion_batches
    from fedpartial.training.common import DRAWS, batch_indices, iteration_batches

    rng = np.random.default_rng(0)
    DRAWS.start()
    list(iteration_batches(124, 1, 1, rng))
    assert DRAWS.stop() == 1
    DRAWS.start()
    for _ in range(3):  # three epochs over the same 40 images: 40, not 120
        list(batch_indices(40, 8, rng))
    list(batch_indices(7, 8, rng))  # another array (a pool of 7): counted apart, the larger count wins
    assert DRAWS.stop() == 40
    DRAWS.start()
    list(lesion_batches(np.array([True, False] * 10), 4, rng, lesion_fraction=0.5))
    assert 10 <= DRAWS.stop() <= 20
    DRAWS.record(5, np.arange(5))  # not counting: ignored
    assert DRAWS.stop() == 0


def test_a_local_model_of_fewer_optimizer_steps_than_the_sites_floor_is_withheld(monkeypatch):
    """One Adam step moves every weight by exactly +-lr (its gradient's sign), so a 2-site average
    of one-step models with known weights decodes to both sites' signs; with a second step the
    moves are no longer +-lr. The executor counts the steps itself (torch's step hook), the site's
    policy withholds a result of fewer than its ``min_local_steps``."""
    from fedpartial.flare import result_policy
    from fedpartial.flare.common import SITE_OPTIMIZER_STEPS
    from fedpartial.training.common import STEPS

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    STEPS.start()
    for step in range(2):
        optimizer.zero_grad()
        net(torch.randn(8, 4)).pow(2).sum().backward()
        optimizer.step()
        if step == 0:
            moves = torch.cat([(p.detach() - b).abs().ravel() for p, b in zip(net.parameters(), before)])
            assert torch.allclose(moves, torch.full_like(moves, 0.01), atol=1e-6)  # the premise
    assert STEPS.stop() == 2
    moves = torch.cat([(p.detach() - b).abs().ravel() for p, b in zip(net.parameters(), before)])
    assert not torch.allclose(moves, torch.full_like(moves, 0.02), atol=1e-4)  # two steps: not +-2 lr
    STEPS.start()
    assert STEPS.stop() == 0  # counted from start() on only

    meta = {MetaKey.NUM_STEPS_CURRENT_ROUND: 9}
    data, _, report = filter_result(DataKind.WEIGHTS, {"w": np.ones(2)}, meta, K, images_seen=9, optimizer_steps=1,
                                    min_local_steps=2)
    assert data is None and report["kind"] == "WEIGHTS of 1 optimizer step(s), fewer than 2 ('min_local_steps')"
    assert filter_result(DataKind.WEIGHTS, {"w": np.ones(2)}, meta, K, images_seen=9, optimizer_steps=2,
                         min_local_steps=2)[0] is not None
    # no step at all sends the model received back (a site without labels this round): nothing of its data
    assert filter_result(DataKind.WEIGHTS, {"w": np.ones(2)}, meta, K, images_seen=9, optimizer_steps=0,
                         min_local_steps=2)[0] is not None

    def policy(steps, config):
        monkeypatch.setattr(result_policy, "participant_config", lambda ctx: config)
        ctx = _ctx()
        ctx.set_prop(SITE_OPTIMIZER_STEPS, steps, private=True, sticky=False)
        return SiteResultPolicy(min_count=K).process(_train_result(124, {"train_steps": steps}), ctx)

    # a provisioned site's floor (default 2) holds; a development site has none
    assert policy(1, {"path": "x"}).get_return_code() == ReturnCode.EMPTY_RESULT
    assert policy(2, {"path": "x"}).get_return_code() == ReturnCode.OK
    assert policy(2, {"path": "x", "min_local_steps": 3}).get_return_code() == ReturnCode.EMPTY_RESULT
    assert policy(1, None).get_return_code() == ReturnCode.OK
