"""The model card beside a job's result models (fedpartial.flare.model_card): built by hand from a
run folder with known numbers, then written by a simulator run (3 sites, 3 rounds of FedLSM,
multi-label), whose model files must also carry their decision thresholds; ``evaluate`` appends."""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.types import MULTI_LABEL, Dataset, Split
from fedpartial.flare.model_card import (CARD_JSON, CARD_MD, append_evaluation, build_card, render_markdown,
                                         write_card)

C = 4
NAMES = [f"c{i}" for i in range(C)]


def _save_model(path: Path, round_num: int, thresholds=None):
    from fedpartial.models import build_model
    from fedpartial.models.io import save_model_file

    meta = {"class_names": NAMES[:3], "task": MULTI_LABEL, "input_size": [8, 8],
            "normalisation": {"mean": 0.5, "std": 0.5}, "round": round_num}
    if thresholds:
        meta["decision_thresholds"] = thresholds
    save_model_file(path, build_model("small_cnn", 3, 1, width=4, depth=1), meta)


def _hand_run(tmp_path: Path) -> Path:
    """2 rounds, 3 sites: site-2's train size withheld and 0 samples in round 1, site-3 rejected in round 0."""
    run = tmp_path / "run"
    run.mkdir()
    thresholds = {"thresholds": {"c0": 0.35, "c1": 0.5, "c2": 0.6}, "rule": "r", "source": "s"}
    _save_model(run / "global_model.pt", 1, thresholds)
    _save_model(run / "best_global_model.pt", 0)
    counts = {"pos": [6, 0, 2], "neg": [10, 0, 7]}
    rounds = [
        {"round": 0, "sites": {"site-1": {"num_samples": 40, "val": {"auc": 0.7}, "val_counts": counts},
                               "site-2": {"num_samples": 12, "val": {"auc": 0.9}}},
         "server": {"weights": {"site-1": 0.75, "site-2": 0.25}, "trust": {"train_sizes": {"site-1": 40}}},
         "rejected": {"site-3": "update lacks parameter 'fc.bias'"}},
        {"round": 1, "sites": {"site-1": {"num_samples": 40, "val": {"auc": 0.8}, "val_counts": counts},
                               "site-2": {"num_samples": 0, "val": {"auc": 0.6, "val_curated": 1.0}},
                               "site-4": {"num_samples": 9, "val": {}}},
         "server": {"weights": {"site-1": 1.0}, "trust": {"train_sizes": {"site-1": 40}}}, "rejected": {}},
    ]
    (run / "metrics.json").write_text(json.dumps({"rounds": rounds}))
    return run


def test_card_of_a_hand_made_run(tmp_path):
    run = _hand_run(tmp_path)
    client = {"executors": [{"tasks": ["train"], "executor": {
        "path": "fedpartial.flare.executors.FedPartialExecutor",
        "args": {"rule": "fedlsm", "rule_args": {"lr": 0.001, "tau": 0.95}, "key_metric": "{key_metric}"}}}],
        "key_metric": "auc"}
    card = build_card(str(run), "fedlsm", {"use_awpa": False}, None, client, job_id="j1", num_rounds=3)
    method = card["method"]
    # tau 0.95 is FedLSM's default: not a departure; lr 1e-3 is (default 1e-4)
    assert method["client"]["departures"] == {"lr": {"value": 0.001, "default": 0.0001}}
    assert method["client"]["settings"]["tau"] == 0.95 and method["client"]["settings"]["ema_decay"] == 0.999
    assert method["server"]["departures"] == {"use_awpa": {"value": False, "default": True}}
    assert method["key_metric"] == "auc"
    assert card["training"]["rounds"] == [0, 1] and card["training"]["rounds_asked"] == 3
    assert card["training"]["sites"] == ["site-1", "site-2", "site-4"]
    census = card["census"]
    assert census["site-1"]["train_size"] == 40 and census["site-2"]["train_size"] == "withheld"
    assert census["site-2"]["samples"] == {"0": 12, "1": 0} and census["site-2"]["zero_sample_rounds"] == ["1"]
    assert census["site-1"]["val_images"] == {"c0": {"pos": 6, "neg": 10}, "c1": "withheld",
                                              "c2": {"pos": 2, "neg": 7}}
    assert census["site-3"]["rejected"] == {"0": "update lacks parameter 'fc.bias'"}
    assert census["site-3"]["train_size"] is None  # never accepted: nothing reported
    rows = card["validation"]["rounds"]
    assert rows[0]["model"] == "initial" and rows[1]["model"] == "round 0"
    assert rows[0]["pooled"] == pytest.approx(0.8) and rows[1]["pooled"] == pytest.approx(0.7)  # site means
    # site-4's val split annotates nothing (an unlabelled site): it reports no score; site-2's is curated
    assert card["validation"]["curated_sites"] == ["site-2"]
    assert "sites that reported a score: site-1, site-2 " in card["validation"]["labels"]
    assert "complete (curated) val labels at site-2" in card["validation"]["labels"]
    assert card["models"]["global_model.pt"]["decision_thresholds"]["thresholds"]["c0"] == 0.35
    assert card["models"]["best_global_model.pt"] == {"round": 0, "decision_thresholds": None}
    assert card["result_model"] == "global_model.pt" and "ChestX-ray14" in card["known_limits"]
    md = render_markdown(card)
    for text in ("# Model card: job j1", "`lr` = 0.001 (default 0.0001)", "| site-2 | withheld | 0: 12, 1: 0 |",
                 "| site-3 | - | - |", "c1 withheld", "| 0 | initial | 0.7000 | 0.9000 | - | 0.8000 |",
                 "c0 0.35, c1 0.50, c2 0.60",
                 "Source: README.md#results (rows fedlsm-ham, fedlsm-nih)", "## Evaluations", "None yet"):
        assert text in md, text


def test_the_card_names_how_the_server_combined_the_updates(tmp_path):
    """An unweighted server (``median`` / ``trimmed_mean``) publishes sample shares as ``server.weights``
    that it did not apply: the card says which rule combined the updates."""
    from fedpartial.flare.model_card import write_model_card

    run = _hand_run(tmp_path)
    config = tmp_path / "app_server" / "config"
    config.mkdir(parents=True)
    (config / "config_fed_server.json").write_text(json.dumps({"trim": 0, "components": [
        {"id": "aggregator", "path": "fedpartial.flare.aggregators.RuleAggregator",
         "args": {"rule": "fedavg", "weight_rule": "trimmed_mean", "trim_fraction": "{trim}"}}]}))
    path, _ = write_model_card(str(run), str(config), None, "global_model.pt", "best_global_model.pt", "j1")
    card = json.loads(Path(path).read_text())
    weighting = card["method"]["weighting"]
    assert weighting["settings"] == {"weight_rule": "trimmed_mean", "trim_fraction": 0, "cap_samples": True,
                                     "max_norm_ratio": 10.0}
    assert weighting["departures"] == {"weight_rule": {"value": "trimmed_mean", "default": "mean"},
                                       "trim_fraction": {"value": 0, "default": 0.2}}
    md = render_markdown(card)
    assert "- aggregation: `trimmed_mean` (the sites' updates combined unweighted" in md
    assert "`weight_rule` = \"trimmed_mean\" (default \"mean\")" in md and "`trim_fraction` = 0 (default 0.2)" in md
    shipped = render_markdown(build_card(str(run), "fedavg", {}, None, None, aggregator_args={"rule": "fedavg"}))
    assert "- aggregation: `mean` (the method's weighted average); departures from the defaults: none" in shipped
    assert build_card(str(run), "fedavg", {}, None, None)["method"]["weighting"] is None  # no aggregator: unknown


def test_the_runtime_quotes_no_measured_number_and_names_where_the_numbers_are():
    """A number in the runtime drifts from the committed result rows when they are measured again: the
    notes say what kind of limit was measured and name the README / RESULTS rows that hold the values."""
    import re

    from fedpartial.algorithms.registry import CLIENT_RULES
    from fedpartial.flare.model_card import METHOD_NOTES

    assert set(METHOD_NOTES) == set(CLIENT_RULES)
    measured = re.compile(r"\d+\.\d+|\d+ ?%|\bvs\b")  # a score, a share, a comparison of two
    for rule, notes in METHOD_NOTES.items():
        for key in ("intended_use", "known_limits"):
            assert not measured.search(notes[key]), (rule, key, measured.search(notes[key]).group())
        places = [part.strip().split(" (")[0] for part in notes["source"].split(";")]
        assert places, rule
        for place in places:  # each names a file of the repository and a heading it has
            doc, _, anchor = place.partition("#")
            text = (Path(__file__).resolve().parents[1] / doc).read_text()
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", text, re.M)}
            assert not anchor or anchor in slugs, (rule, place)


def test_an_evaluation_is_appended_to_both_files(tmp_path):
    run = _hand_run(tmp_path)
    write_card(str(run), build_card(str(run), "fedavg", {}, None))
    entry = {"model": "global_model.pt", "data": "/data/test.npz", "split": "test", "n": 30, "threshold": 0.5,
             "date": "2026-01-02T03:04:05+00:00", "metrics": {"auc": 0.75, "f1": 0.5}}
    assert append_evaluation(str(run / "global_model.pt"), entry) == str(run / CARD_MD)
    append_evaluation(str(run / "global_model.pt"), {**entry, "split": "val"})
    card = json.loads((run / CARD_JSON).read_text())
    assert [e["split"] for e in card["evaluations"]] == ["test", "val"]
    md = (run / CARD_MD).read_text()
    row = "| 2026-01-02T03:04:05+00:00 | global_model.pt | /data/test.npz | test | 30 | 0.5000 | 0.7500 | 0.5000 |"
    assert row in md
    assert append_evaluation(str(tmp_path / "elsewhere" / "m.pt"), entry) is None  # no card there


# ---- one simulator run ----------------------------------------------------------------------
def _learnable(n, rng):
    """Multi-label 16x16 images: class c brightens its own 4x4 tile."""
    labels = (rng.random((n, C)) < 0.35).astype(np.float32)
    images = rng.normal(60, 20, size=(n, 16, 16))
    for c in range(C):
        images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
    return np.clip(images, 0, 255).astype(np.uint8), labels


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    from fedpartial.data import sitefile
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.run.simulator import simulate

    tmp = tmp_path_factory.mktemp("card")
    root = tmp / "sites"
    root.mkdir()
    rng = np.random.default_rng(0)
    for k, classes in enumerate([[0, 1], [1, 2], [2, 3]], start=1):  # label-set mismatch
        images, full = _learnable(48, rng)
        mask = np.zeros_like(full, dtype=bool)
        mask[:, classes] = True
        val_images, val_labels = _learnable(24, rng)
        data = Dataset(MULTI_LABEL, NAMES, {"train": Split(images, full * mask, mask),
                                            "val": Split(val_images, val_labels, np.ones_like(val_labels, bool))},
                       site=f"site-{k}", info={"scenario": "label-set-mismatch"})
        sitefile.write_site_file(str(root / f"site-{k}.npz"), data)
    overrides = ["num_rounds=3", f"model.class_names={json.dumps(NAMES)}", "model.input_size=[16,16]",
                 "model.in_channels=1", "model.arch_args.width=8", "model.arch_args.depth=2", "rule_args.batch_size=16",
                 "rule_args.ude_pairs=4", "rule_args.strong_view=flip", "rule_args.lr=0.001", "device=cpu"]
    summary = simulate(find_job("fedlsm:multilabel"), str(root), str(tmp / "ws"), overrides, timeout=400,
                       log=lambda m: None)
    assert summary["ok"], summary["errors"]
    server = [p.parent for p in (tmp / "ws" / "simulator" / "server").glob("*/global_model.pt")]
    assert len(server) == 1, server
    return root, server[0]


@pytest.mark.slow
def test_simulator_model_files_carry_thresholds_of_their_own_model_where_validated(sim_run):
    from fedpartial.models.io import load_model_file

    _, run = sim_run
    rounds = json.loads((run / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds:  # the sites' histograms reached the server: 24 val images per site and class
        record = r["server"]["decision_thresholds"]
        assert record["model_round"] == r["round"] - 1 and record["sites"] == 3
        for site, entry in r["sites"].items():
            assert [p + n for p, n in zip(entry["val_counts"]["pos"], entry["val_counts"]["neg"])] == [24] * C
    _, meta = load_model_file(run / "global_model.pt")
    dt = meta["decision_thresholds"]
    assert sorted(dt["thresholds"]) == NAMES and all(0 < t < 1 for t in dt["thresholds"].values())
    # the last aggregate (round 2) was never validated in training: the latest thresholds, of round 1's model
    assert dt["source"].startswith("latest available, NOT this file's model (the global model of round 2): "
                                   "the global model of round 1, validated on the sites' val splits at round 2")
    assert dt["thresholds"] == rounds[2]["server"]["decision_thresholds"]["thresholds"]
    _, best = load_model_file(run / "best_global_model.pt")
    best_round = best["round"]
    assert best["decision_thresholds"]["source"].startswith(
        f"this file's model: the global model of round {best_round}, validated on the sites' val splits at "
        f"round {best_round + 1}")
    assert best["decision_thresholds"]["thresholds"] == \
        rounds[best_round + 1]["server"]["decision_thresholds"]["thresholds"]


@pytest.mark.slow
def test_simulator_card_names_sites_rounds_validation_and_evaluate_appends(sim_run):
    from fedpartial.models.io import load_model_file
    from fedpartial_tools.evaluate import evaluate_data, record_in_model_card

    root, run = sim_run
    card = json.loads((run / CARD_JSON).read_text())
    md = (run / CARD_MD).read_text()
    rounds = json.loads((run / "metrics.json").read_text())["rounds"]
    assert card["method"]["rule"] == "fedlsm" and card["method"]["client"]["rule"] == "fedlsm"
    assert "lr" in card["method"]["client"]["departures"]
    assert card["training"]["rounds"] == [0, 1, 2] and card["training"]["rounds_asked"] == 3
    assert card["training"]["sites"] == ["site-1", "site-2", "site-3"]
    assert {s: c["train_size"] for s, c in card["census"].items()} == {f"site-{k}": 48 for k in (1, 2, 3)}
    for row, r in zip(card["validation"]["rounds"], rounds):
        assert row["sites"] == {s: e["val"]["auc"] for s, e in sorted(r["sites"].items())}
    for text in ("site-1", "site-2", "site-3", "rounds run: 3 of 3", "## Validation per round (auc)",
                 "| 2 | round 1 |", "`global_model.pt` (model of round 2, the result model)", "## Decision thresholds",
                 "measured on HAM10000 and NIH ChestX-ray14",
                 "Source: README.md#results (rows fedlsm-ham",
                 "- aggregation: `mean` (the method's weighted average); departures from the defaults: none"):
        assert text in md, text
    model, meta = load_model_file(run / "global_model.pt")
    result = evaluate_data(model, meta, str(root))
    assert record_in_model_card(str(run / "global_model.pt"), result) == str(run / CARD_MD)
    card = json.loads((run / CARD_JSON).read_text())
    (evaluation,) = card["evaluations"]
    assert evaluation["data"] == str(root) and evaluation["n"] == 72 and evaluation["split"] == "val"
    assert evaluation["metrics"]["auc"] == pytest.approx(result["pooled"]["auc"])
    assert f"| global_model.pt | {root} | val | 72 |" in (run / CARD_MD).read_text()


@pytest.mark.parametrize("deploy_map, reads_client", [
    ({"app": ["@ALL"]}, True),
    ({"app": ["server", "site-1", "site-2"]}, True),
    # the server's own app with a decoy client config; the sites ran another app
    ({"app_server": ["server"], "app_client": ["site-1", "site-2"]}, False),
    (None, True),  # no meta.json (the simulator): one app
], ids=["all", "listed", "decoy", "simulator"])
def test_the_card_states_the_sites_settings_only_when_they_ran_the_servers_app(tmp_path, deploy_map, reads_client):
    from fedpartial.flare.model_card import write_model_card

    run = _hand_run(tmp_path)
    config = tmp_path / "app_server" / "config"
    config.mkdir(parents=True)
    (config / "config_fed_server.json").write_text(json.dumps({"components": [], "workflows": []}))
    (config / "config_fed_client.json").write_text(json.dumps({"executors": [{"tasks": ["train"], "executor": {
        "path": "fedpartial.flare.executors.FedPartialExecutor", "args": {"rule": "fedavg", "rule_args": {
            "lr": 0.001}}}}]}))
    if deploy_map is not None:
        (run / "meta.json").write_text(json.dumps({"deploy_map": deploy_map}))
    path, _ = write_model_card(str(run), str(config), None, "global_model.pt", "best_global_model.pt", "j1")
    method = json.loads(Path(path).read_text())["method"]
    assert (method["client"] is not None) == reads_client, method
    if not reads_client:
        assert method["client_note"] == "the sites' settings are unknown: the server's app is not the one the sites ran"
