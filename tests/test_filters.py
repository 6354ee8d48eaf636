"""Statistics filters (minimum-count rule + noise), NVFlare's own weight filters on our messages, the
weight-diff pair that makes PercentilePrivacy usable, and the message recorder. No FLARE run:
filters are called on hand-made Shareables with a bare FLContext."""
import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.filters.exclude_vars import ExcludeVars
from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy

from fedpartial.algorithms.base import ServerContext, SiteUpdate
from fedpartial.flare.common import SITE_METRICS, SITE_STATS
from fedpartial.flare.filters import RestoreFullWeights, SendWeightDiff, StatisticsPrivacyFilter, filter_statistics
from fedpartial.flare.recorder import MessageRecorder, add_result_filter, load_recorded

C, D = 3, 4
GLOBAL = {"fc.weight": np.zeros((C, D), np.float32), "fc.bias": np.zeros(C, np.float32)}


def _ctx(direction="out", global_weights=None):
    fl_ctx = FLContext()
    fl_ctx.set_prop(FLContextKey.FILTER_DIRECTION, direction, private=True, sticky=False)
    fl_ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    if global_weights is not None:
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(global_weights, {}), private=True,
                        sticky=False)
    return fl_ctx


def _message(stats, weights=None, n=7):
    dxo = DXO(DataKind.WEIGHTS, data=weights or {k: v + 1 for k, v in GLOBAL.items()})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(SITE_STATS, stats)
    dxo.set_meta_prop(SITE_METRICS, {"train_loss": 0.5})
    return dxo.to_shareable()


def _server_ctx():
    return ServerContext(round=1, num_rounds=3, classifier_param_names=["fc.weight", "fc.bias"],
                         global_weights=GLOBAL)


def _fedmlp_stats():
    return {"prototypes_pos": np.arange(C * D, dtype=np.float32).reshape(C, D) + 1,
            "prototypes_neg": np.full((C, D), 2.0, np.float32),
            "prototype_counts_pos": np.array([0.0, 2.0, 7.0]), "prototype_counts_neg": np.array([9.0, 4.0, 5.0]),
            "learning_degree": np.array([0.2, 0.5, 0.9]), "annotated": np.array([1.0, 1.0, 1.0])}


def test_min_count_withholds_fedmlp_prototypes_below_k():
    stats = _fedmlp_stats()
    out, report = filter_statistics(stats, min_count=5, **{k: v for k, v in _preset("fedmlp").items()})
    # pos counts [0, 2, 7]: rows 0 and 1 < 5 -> withheld (row 0 was empty already, so 1 reported)
    np.testing.assert_array_equal(out["prototype_counts_pos"], [0, 0, 7])
    np.testing.assert_array_equal(out["prototypes_pos"][:2], 0.0)
    np.testing.assert_array_equal(out["prototypes_pos"][2], stats["prototypes_pos"][2])  # 9..12 kept
    # neg counts [9, 4, 5]: only row 1 (4 < 5) withheld
    np.testing.assert_array_equal(out["prototype_counts_neg"], [9, 0, 5])
    np.testing.assert_array_equal(out["prototypes_neg"][1], 0.0)
    assert out["prototypes_neg"][0].tolist() == [2.0] * D
    assert report["withheld"] == {"prototypes_pos": 1, "prototype_counts_pos": 1, "prototypes_neg": 1,
                                  "prototype_counts_neg": 1}
    assert out["prototypes_pos"].dtype == np.float32  # container / dtype kept
    np.testing.assert_array_equal(stats["prototype_counts_pos"], [0, 2, 7])  # input untouched
    from fedpartial.algorithms.fedmlp import FedMLPServer
    FedMLPServer().check_stats(SiteUpdate("site-1", GLOBAL, 7, out), _server_ctx())


def test_min_count_withholds_a_fedmlp_tag_check_from_fewer_than_k_images():
    stats = {**_fedmlp_stats(), "tag_check_hits": np.array([3.0, 2.0, 0.0]),
             "tag_check_count": np.array([4.0, 10.0, 0.0])}
    out, report = filter_statistics(stats, min_count=5, **_preset("fedmlp"))
    # class 0's check ranked 4 images (< 5): withheld, so the server counts no check for it
    np.testing.assert_array_equal(out["tag_check_count"], [0, 10, 0])
    np.testing.assert_array_equal(out["tag_check_hits"], [0, 2, 0])
    assert report["withheld"]["tag_check_hits"] == 1
    from fedpartial.algorithms.fedmlp import FedMLPServer
    FedMLPServer(positive_tag_gate=0.7).check_stats(SiteUpdate("site-1", GLOBAL, 7, out), _server_ctx())


def _preset(name):
    from fedpartial.flare.filters import PRESETS
    p = PRESETS[name]
    return {"guards": p.get("guards"), "fill": p.get("fill"), "clip": p.get("clip"),
            "normalise_rows": p.get("normalise_rows")}


def test_fedirm_withheld_row_is_uniform_and_noisy_rows_still_sum_to_one():
    matrix = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    stats = {"relation_matrix": matrix, "relation_counts": np.array([3.0, 10.0, 0.0]), "relation_multilabel": 0}
    out, report = filter_statistics(stats, min_count=5, noise_sigma={"relation_matrix": 0.05},
                                    rng=np.random.default_rng(0), **_preset("fedirm"))
    np.testing.assert_allclose(out["relation_matrix"][0], [1 / 3] * 3)  # count 3 < 5: placeholder 1/C
    np.testing.assert_allclose(out["relation_matrix"][2], [1 / 3] * 3)  # count 0: placeholder unchanged
    np.testing.assert_array_equal(out["relation_counts"], [0, 10, 0])
    row = out["relation_matrix"][1]
    assert not np.allclose(row, matrix[1]) and np.isclose(row.sum(), 1.0) and (row >= 0).all()
    assert report == {"withheld": {"relation_matrix": 1, "relation_counts": 1}, "noised": ["relation_matrix"],
                      "no_count": [], "removed": []}
    from fedpartial.algorithms.fedirm import FedIRMServer
    FedIRMServer().check_stats(SiteUpdate("site-1", GLOBAL, 7, out), _server_ctx())


def test_fedlsm_count_noise_is_clipped_and_passes_the_server_check():
    stats = {"class_counts": np.array([0.0, 1.0, 40.0]), "label_pos": np.array([3.0, 6.0, 8.0]),
             "label_neg": np.array([20.0, 17.0, 15.0]), "annotated_classes": np.array([1.0, 1.0, 0.0])}
    sigma = {"class_counts": 50.0, "label_pos": 50.0, "label_neg": 50.0}
    out, _ = filter_statistics(stats, min_count=2, noise_sigma=sigma, rng=np.random.default_rng(1),
                               **_preset("fedlsm"))
    # class 0 (count 0) and class 1 (1 < 2) withheld: exact zeros, no noise on them
    assert out["class_counts"][0] == 0 and out["class_counts"][1] == 0
    assert out["class_counts"][2] != 40.0 and out["class_counts"][2] >= 0  # noised, clipped at 0
    assert (out["label_pos"] >= 0).all() and (out["label_neg"] >= 0).all()
    np.testing.assert_array_equal(out["annotated_classes"], [1, 1, 0])  # not a guarded / noised key
    from fedpartial.algorithms.fedlsm import AWPAServer
    AWPAServer().check_stats(SiteUpdate("site-1", GLOBAL, 7, out), _server_ctx())


def test_fedia_scalars_get_noise_and_stay_in_range():
    stats = {"mean_loss": 0.4, "iou": 0.98, "completeness": 0.6, "completeness_ready": 1, "corrected": 0,
             "num_images": 7}
    out, _ = filter_statistics(stats, noise_sigma={"iou": 1.0, "completeness": 1.0},
                               rng=np.random.default_rng(3), **_preset("fedia"))
    assert isinstance(out["iou"], float) and 0.0 <= out["iou"] <= 1.0 and out["iou"] != 0.98
    assert out["completeness"] > 0 and out["mean_loss"] == 0.4 and out["completeness_ready"] == 1
    from fedpartial.algorithms.fedia import FedIAServer
    FedIAServer().check_stats(SiteUpdate("site-1", GLOBAL, 7, out), _server_ctx())


def test_filter_edits_only_site_stats_of_the_message():
    msg = _message(_fedmlp_stats())
    f = StatisticsPrivacyFilter(preset="fedmlp", min_count=5, seed=0)
    dxo = from_shareable(f.process(msg, _ctx()))
    np.testing.assert_array_equal(dxo.get_meta_prop(SITE_STATS)["prototype_counts_pos"], [0, 0, 7])
    assert dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 7
    assert dxo.get_meta_prop(SITE_METRICS) == {"train_loss": 0.5}
    np.testing.assert_array_equal(dxo.data["fc.weight"], np.ones((C, D)))


def test_filter_rejects_bad_config_and_mismatched_guard():
    with pytest.raises(ValueError, match="preset 'fedxyz'"):
        StatisticsPrivacyFilter(preset="fedxyz")
    with pytest.raises(ValueError, match="noise_sigma\\['class_counts'\\]"):
        StatisticsPrivacyFilter(noise_sigma={"class_counts": -1})
    with pytest.raises(ValueError, match="min_count"):
        StatisticsPrivacyFilter(min_count=-2)
    with pytest.raises(ValueError, match="'protos' of shape \\(2, 4\\).*'counts'"):
        filter_statistics({"protos": np.zeros((2, 4)), "counts": np.ones(3)}, 1, guards={"protos": "counts"})


def test_nvflare_weight_filters_pass_our_meta_through():
    stats = _fedmlp_stats()
    weights = {"fc.weight": np.linspace(0.1, 1.2, C * D).reshape(C, D), "fc.bias": np.ones(C)}
    out = ExcludeVars(exclude_vars=["fc.bias"]).process(_message(stats, weights, n=1), _ctx())
    out = PercentilePrivacy(percentile=10, gamma=0.5).process(out, _ctx())
    dxo = from_shareable(out)
    assert set(dxo.data) == {"fc.weight"}
    np.testing.assert_array_equal(dxo.get_meta_prop(SITE_STATS)["prototypes_pos"], stats["prototypes_pos"])
    assert dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 1
    assert dxo.get_meta_prop(SITE_METRICS) == {"train_loss": 0.5}
    # PercentilePrivacy treats its input as a weight DIFF per sample-step (divides by the sample
    # count, 1 here): values 0.1, 0.2, ..., 1.2; the 10th percentile is 0.1 + 1.1 * 0.1 = 0.21, so
    # 0.1 and 0.2 become 0 and everything is clipped to gamma = 0.5. On FULL weights that wrecks
    # the model: use it only behind SendWeightDiff (below).
    expected = np.minimum(np.linspace(0.1, 1.2, C * D), 0.5)
    expected[:2] = 0.0
    np.testing.assert_allclose(dxo.data["fc.weight"].ravel(), expected)


def test_weight_diff_pair_round_trips_and_fills_excluded_parameters():
    received = {"fc.weight": np.full((C, D), 2.0, np.float32), "fc.bias": np.zeros(C, np.float32),
                "bn.num_batches_tracked": np.array(4)}
    local = {"fc.weight": np.full((C, D), 2.25, np.float32), "fc.bias": np.full(C, 0.5, np.float32),
             "bn.num_batches_tracked": np.array(6)}
    send = SendWeightDiff()
    ctx = _ctx("in")
    send.process(DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx)  # data filter: remember
    ctx.set_prop(FLContextKey.FILTER_DIRECTION, "out", private=True, sticky=False)
    msg = send.process(_message({"x": 1.0}, weights=local), ctx)
    diff = from_shareable(msg)
    assert diff.data_kind == DataKind.WEIGHT_DIFF
    np.testing.assert_allclose(diff.data["fc.weight"], 0.25)
    msg = ExcludeVars(exclude_vars=["fc.bias"]).process(msg, ctx)
    restored = from_shareable(RestoreFullWeights().process(msg, _ctx("in", global_weights=received)))
    assert restored.data_kind == DataKind.WEIGHTS and set(restored.data) == set(received)
    np.testing.assert_allclose(restored.data["fc.weight"], 2.25)  # 2 + 0.25
    np.testing.assert_array_equal(restored.data["fc.bias"], 0.0)  # excluded: the global value
    assert restored.data["bn.num_batches_tracked"] == 6 and restored.data["bn.num_batches_tracked"].dtype.kind == "i"
    assert restored.get_meta_prop(SITE_STATS) == {"x": 1.0}


def test_send_weight_diff_needs_the_data_filter():
    with pytest.raises(RuntimeError, match="task_data_filters"):
        SendWeightDiff().process(_message({}), _ctx("out"))


def test_recorder_writes_what_passes_and_add_result_filter_appends_last(tmp_path):
    rec = MessageRecorder(str(tmp_path / "rec"))
    msg = _message({"class_counts": np.array([1.0, 2.0, 3.0])})
    assert rec.process(msg, _ctx()) is msg
    [record] = load_recorded(str(tmp_path / "rec"))
    assert record["task"] == "train" and record["dxo"]["kind"] == DataKind.WEIGHTS
    np.testing.assert_array_equal(record["dxo"]["meta"][SITE_STATS]["class_counts"], [1, 2, 3])

    config = {"task_result_filters": [{"tasks": ["train"], "filters": [{"path": "a.A", "args": {}}]}]}
    add_result_filter(config, {"path": "b.B", "args": {}})
    chains = config["task_result_filters"]
    assert [f["path"] for f in chains[0]["filters"]] == ["a.A", "b.B"]  # appended after the existing one
    assert chains[1] == {"tasks": ["submit_model", "validate"], "filters": [{"path": "b.B", "args": {}}]}


@pytest.mark.slow
def test_privacy_filters_in_a_job_config(tmp_path):
    """fedlsm with, on every site's train result: StatisticsPrivacyFilter (k = 5, noise on the
    counts) -> SendWeightDiff -> PercentilePrivacy -> ExcludeVars(fc.bias); on the server
    RestoreFullWeights. The job runs 2 rounds with no rejected update, the statistics still reach
    the server rule, and the recorded wire messages are weight DIFFs without fc.bias."""
    import json
    from pathlib import Path

    from test_privacy import METHODS, REPO, write_sites
    from fedpartial_tools.run.simulator import simulate

    filters = [{"path": "fedpartial.flare.filters.StatisticsPrivacyFilter",
                "args": {"preset": "fedlsm", "min_count": 5, "noise_sigma": {"class_counts": 2.0}}},
               {"path": "fedpartial.flare.filters.SendWeightDiff", "args": {}},
               {"path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
                "args": {"percentile": 10, "gamma": 0.1}},
               {"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars", "args": {"exclude_vars": ["fc.bias"]}},
               {"path": "fedpartial.flare.recorder.MessageRecorder", "args": {"folder": str(tmp_path / "wire")}}]
    sets = [*METHODS["fedlsm"][2], "num_rounds=2",
            "client.task_data_filters=" + json.dumps([{"tasks": ["train"], "filters": [
                {"path": "fedpartial.flare.filters.SendWeightDiff", "args": {}}]}]),
            "client.task_result_filters=" + json.dumps([{"tasks": ["train"], "filters": filters}]),
            "server.task_result_filters=" + json.dumps([{"tasks": ["train"], "filters": [
                {"path": "fedpartial.flare.filters.RestoreFullWeights", "args": {}}]}])]
    write_sites(tmp_path / "sites", "mismatch")
    summary = simulate(str(REPO / "jobs" / "fedlsm"), str(tmp_path / "sites"), str(tmp_path / "ws"), sets,
                       timeout=240, log=lambda m: None)
    assert summary["exit_code"] == 0, summary["errors"]
    rounds = json.loads((Path(summary["workspace"]) / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1] and not any(r["rejected"] for r in rounds)
    assert all(set(r["sites"]) == {"site-1", "site-2"} for r in rounds)
    records = [r for r in load_recorded(str(tmp_path / "wire")) if r["task"] == "train"]
    assert len(records) == 4
    for rec in records:
        assert rec["dxo"]["kind"] == DataKind.WEIGHT_DIFF and "fc.bias" not in rec["dxo"]["data"]
        counts = rec["dxo"]["meta"][SITE_STATS]["class_counts"]
        assert np.all(np.asarray(counts) >= 0)
    log = (Path(summary["workspace"]) / "simulator.log").read_text(errors="replace")
    assert "site statistics filtered (min_count=5)" in log
    assert "restored full weights (from weight diff; 1 parameter(s) taken from the global model)" in log


def test_privacy_measure_wires_the_percentile_filter_chain(tmp_path, monkeypatch):
    """``python -m fedpartial_tools.bench.privacy measure --percentile``: the filtered run gets SendWeightDiff in
    and out, PercentilePrivacy after it, RestoreFullWeights on the server; the plain run none."""
    import json

    from fedpartial_tools.bench import privacy

    import os

    import torch
    from fedpartial.models import build_model
    from fedpartial.models.io import save_model_file

    torch.manual_seed(0)
    model = build_model("small_cnn", 4, 1, width=8, depth=2)
    meta = {"task": "single-label", "class_names": privacy.DEMO_CLASSES, "normalisation": {"mean": 0.5, "std": 0.5},
            "input_size": [16, 16]}
    calls = []

    def fake_simulate(job, data_root, ws, sets, log=None):  # records the filter settings, "trains" nothing
        calls.append(dict(s.split("=", 1) for s in sets if s.startswith(("client.", "server."))))
        os.makedirs(ws, exist_ok=True)
        save_model_file(os.path.join(ws, "global_model.pt"), model, meta)
        return {"exit_code": 0, "errors": []}

    monkeypatch.setattr(privacy, "_simulate", lambda: fake_simulate)
    result = privacy.measure(str(tmp_path / "ws"), stats_filter=False, percentile=10, gamma=0.5, rounds=1,
                             log=lambda m: None)
    plain, filtered = calls
    assert json.loads(plain["client.task_result_filters"]) == [] and set(plain) == {"client.task_result_filters"}
    out = [f["path"].rsplit(".", 1)[1] for f in json.loads(filtered["client.task_result_filters"])[0]["filters"]]
    assert out == ["SendWeightDiff", "PercentilePrivacy"]
    assert json.loads(filtered["client.task_result_filters"])[0]["filters"][1]["args"] == {"percentile": 10.0,
                                                                                           "gamma": 0.5}
    assert "SendWeightDiff" in filtered["client.task_data_filters"]
    assert "RestoreFullWeights" in filtered["server.task_result_filters"]
    assert result["percentile_filter"] == {"percentile": 10, "gamma": 0.5} and result["stats_filter"] is None
    assert result["auc_difference"] == 0.0  # the same saved model twice
    with pytest.raises(ValueError, match="nothing to compare"):
        privacy.measure(str(tmp_path / "ws2"), stats_filter=False, percentile=None)


# Client rule -> the filter preset of the statistics it sends (FedAvg rules send none).
STAT_PRESETS = {"FedLSMClient": {"single-label": "fedlsm", "multi-label": "fedlsm"},
                "FedMLPClient": {"multi-label": "fedmlp"},
                "FedIRMClient": {"single-label": "fedirm", "multi-label": "fedirm_multilabel"},
                "FedIAClient": {"segmentation": "fedia"}}


def test_every_job_whose_sites_send_statistics_ships_the_min_count_rule():
    """No class-wise statistic computed from fewer than 5 samples leaves a site by default
    (a FedMLP prototype or a FedIRM relation row from one image is that image's features)."""
    import json
    from pathlib import Path

    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.jobs.recipes import RECIPES
    from fedpartial_tools.jobs.settings import _rule_of

    jobs = Path(__file__).resolve().parents[1] / "jobs"
    # the shipped folders and every other profile of the recipes (FedIRM's multi-label one sends vectors)
    client_files = sorted(jobs.glob("*/app/config/config_fed_client.json")) + [
        Path(find_job(name, profile)) / "app/config/config_fed_client.json"
        for name, cls in RECIPES.items() for profile in cls.PROFILES if profile != "cpu"]
    checked = []
    for client_file in client_files:
        job = client_file.parts[-4]
        client = json.loads(client_file.read_text())
        task = json.loads(client_file.with_name("config_fed_server.json").read_text())["model"]["task"]
        executor = client["executors"][0]["executor"]
        rule = _rule_of(executor["path"], executor["args"]).rsplit(".", 1)[1]
        filters = [f for chain in client["task_result_filters"] if "train" in chain["tasks"] for f in chain["filters"]
                   if f["path"].endswith("StatisticsPrivacyFilter")]
        if rule not in STAT_PRESETS:
            assert not filters, f"{job}: {rule} sends no statistics"
            continue
        assert len(filters) == 1, f"{job}: sends statistics without the StatisticsPrivacyFilter"
        args = filters[0]["args"]
        assert args["preset"] == STAT_PRESETS[rule][task], job
        assert args["min_count"] >= 5, job
        checked.append(job)
        # as shipped, the filter withholds a one-sample FedMLP prototype
        if rule == "FedMLPClient":
            out = from_shareable(StatisticsPrivacyFilter(**args).process(_message(_fedmlp_stats()), _ctx()))
            np.testing.assert_array_equal(out.get_meta_prop(SITE_STATS)["prototype_counts_pos"], [0, 0, 7])
    assert {"fedlsm", "fedmlp", "fedirm", "fedia", "fedirm_multilabel"} <= set(checked)


def test_presets_are_the_methods_own_declarations_and_consistent():
    from fedpartial.algorithms import fedia, fedirm, fedlsm, fedmlp
    from fedpartial.flare.filters import PRESETS, auto_preset

    for module in (fedlsm, fedmlp, fedirm, fedia):
        for name, policy in module.SENT_STATISTICS.items():
            assert PRESETS[name] is policy
            keys = set(policy["keys"])
            assert set(policy.get("signature", [])) <= keys, name
            for stat, count in policy.get("guards", {}).items():
                assert stat in keys and count in keys, f"{name}: guard {stat} -> {count}"
            assert set(policy.get("fill", {})) | set(policy.get("clip", {})) <= keys, name
    # the flag picks FedIRM's multi-label flavour (absent row 0.5, no row sums)
    names, merged = auto_preset({"relation_matrix": np.zeros((2, 2)), "relation_counts": np.ones(2),
                                 "relation_multilabel": 1})
    assert names == ["fedirm_multilabel"] and merged["fill"] == {"relation_matrix": 0.5}
    assert auto_preset({"class_counts": np.ones(2)})[0] == ["fedlsm"]
    # FedMLP's warm-up message is recognised only alone; FedLSM sends the same flags with its counts
    assert auto_preset({"annotated_classes": np.ones(2)})[0] == ["fedmlp_warmup"]
    assert auto_preset({"class_counts": np.ones(2), "annotated_classes": np.ones(2)})[0] == ["fedlsm"]
    # no method: no key may leave (the keys are the recognised methods' only)
    assert auto_preset({"learning_degree": np.ones(2), "annotated_classes": np.ones(2)}) == (
        [], {"keys": [], "guards": {}, "fill": {}, "clip": {}, "normalise_rows": []})
    assert auto_preset({"class_counts": np.ones(2)})[1]["keys"] == sorted(PRESETS["fedlsm"]["keys"])
