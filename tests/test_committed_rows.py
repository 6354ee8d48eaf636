"""Committed result rows, the timing report and the MS protocol's choice: numbers worked out by hand."""
import json
import os
import time
import threading

import pytest

from fedpartial_tools.bench import rows as committed
from fedpartial_tools.bench.ms6_protocol import choose
from fedpartial_tools.bench.timing import parse_config, round_times, table


def _row(suite="s", method="fedavg", seed=0, scored_on="test", h="abc", **metrics):
    return {"suite": suite, "method": method, "seed": seed, "scored_on": scored_on, "settings_hash": h,
            "commit": "c0ffee", "device": "cpu", "seconds": 1.5, "settings": "{}", **metrics}


def test_a_row_is_appended_found_and_replaced_by_its_key(tmp_path):
    path = str(tmp_path / "rows" / "s.csv")
    committed.append_row(path, _row(auc=0.5))
    committed.append_row(path, _row(seed=1, auc=0.7))
    committed.append_row(path, _row(auc=0.6))  # same key as the first: replaces it
    got = committed.read_committed(path)
    assert [(r["seed"], r["auc"]) for r in got] == [("1", "0.7"), ("0", "0.6")]
    assert committed.find_row(path, ("s", "fedavg", "0", "test", "abc"))["auc"] == "0.6"
    assert committed.find_row(path, ("s", "fedavg", "0", "val", "abc")) is None
    # the key columns first, provenance last, a new metric column joins the file
    committed.append_row(path, _row(seed=2, auc=0.8, f1=0.1))
    header = open(path).readline().strip().split(",")
    assert header[:5] == list(committed.KEY_COLUMNS) and header[-5:] == list(committed.PROVENANCE_COLUMNS)
    assert "f1" in header and committed.as_bench_row(committed.read_committed(path)[-1])["f1"] == pytest.approx(0.1)


def test_threads_appending_to_one_file_lose_no_row(tmp_path):
    path = str(tmp_path / "s.csv")
    threads = [threading.Thread(target=committed.append_row, args=(path, _row(seed=k, auc=k / 10))) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(r["seed"]) for r in committed.read_committed(path)) == list(range(12))


def test_settings_hash_depends_on_job_sets_order_and_profile_only():
    h = committed.settings_hash("fedavg", ["seed=0", "num_rounds=3"], "cpu")
    assert h == committed.settings_hash("fedavg", ["seed=0", "num_rounds=3"], "cpu") and len(h) == 16
    assert h != committed.settings_hash("fedavg", ["num_rounds=3", "seed=0"], "cpu")
    assert h != committed.settings_hash("fedavg", ["seed=0", "num_rounds=3"], "gpu")
    assert h != committed.settings_hash("fedlsm", ["seed=0", "num_rounds=3"], "cpu")


def test_merge_sorts_a_device_file_into_one_file_per_suite(tmp_path):
    device = str(tmp_path / "device.csv")
    for suite, seed in (("a", 0), ("b", 0), ("a", 1)):
        committed.append_row(device, _row(suite=suite, seed=seed, auc=0.5))
    out = tmp_path / "rows"
    assert committed.merge([device], str(out)) == {"a": 2, "b": 1}
    assert sorted(os.listdir(out)) == ["a.csv", "b.csv"]
    assert committed.merge([device], str(out)) == {"a": 2, "b": 1}  # again: replaced, not doubled
    assert len(committed.read_committed(str(out / "a.csv"))) == 2


def test_round_times_from_a_server_record(tmp_path):
    # launched at 100; rounds aggregated at 110, 112, 115, 117 -> gaps 2, 3, 2 (median 2)
    rounds = [{"round": k, "aggregated_at": t, "sites": {"site-1": {"train_seconds": a}, "site-2": {"train_seconds": b}}}
              for k, (t, a, b) in enumerate([(110, 9.0, 1.0), (112, 0.5, 0.8), (115, 0.4, 0.2), (117, 0.6, 0.1)])]
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"rounds": rounds}))
    got = round_times(str(path), 100.0)
    # start-up 10 s; per round the slowest site: 0.8, 0.4, 0.6 after the first -> median 0.6
    assert got == {"startup_s": 10.0, "round_s": 2.0, "train_s": 0.6, "rounds": 4}
    path.write_text(json.dumps({"rounds": []}))
    with pytest.raises(ValueError, match="records no aggregated round"):
        round_times(str(path), 0.0)


def test_timing_configs_and_their_ratios():
    assert parse_config("flare-defaults=") == ("flare-defaults", ["task_request_interval=2.0", "task_check_period=0.5",
                                                                  "memory_gc_rounds=1"])
    assert parse_config("fast=task_request_interval=0.1;task_check_period=0.05") == (
        "fast", ["task_request_interval=0.1", "task_check_period=0.05"])
    rows = [{"config": "a", "startup_s": 30.0, "floor_round_s": 2.0, "recipe_round_s": 3.0, "train_s": 1.0},
            {"config": "b", "startup_s": 15.0, "floor_round_s": 0.5, "recipe_round_s": 1.5, "train_s": 1.0}]
    last = table(rows).splitlines()[-1]
    assert last == "| b | 15.0 | 0.50 | 1.50 | 1.00 | 0.25 | 0.50 |"


def _p1(candidate, method, site_val, spread):
    return {"candidate": candidate, "method": method, "site_val_last5": site_val, "val_range_last5": spread}


def test_the_ms_protocol_chooses_on_the_sites_val_without_the_complete_mask_bound():
    rows = [_p1("constant", "fedia_lesions", 0.30, 0.05), _p1("constant", "fedavg_seg_lesions", 0.20, 0.05),
            _p1("cosine", "fedia_lesions", 0.32, 0.01), _p1("cosine", "fedavg_seg_lesions", 0.24, 0.01),
            # the bound's sites hold complete masks: a federation has no such val, it must not count
            _p1("constant", "fedavg_seg_full_lesions", 0.90, 0.0)]
    chosen, summary = choose(rows)
    assert chosen == "cosine" and summary["cosine"][0] == pytest.approx(0.28) and summary["constant"][2] == 2
    # within 0.005: the smaller last-rounds range wins
    rows[2]["site_val_last5"], rows[3]["site_val_last5"] = 0.298, 0.198
    rows[2]["val_range_last5"], rows[3]["val_range_last5"] = 0.09, 0.09
    assert choose(rows)[0] == "constant"
    assert choose([])[0] == "constant"  # nothing measured: the shipped recipe


def test_the_sites_val_pool_does_not_depend_on_the_order_the_sites_answered_in():
    """Trainings side by side change the order in which sites answer cross-site evaluation; the
    pooled score is summed in site order, so the row is the same to the last bit (0.3 + 0.2 + 0.1 is
    0.6 in that order and 0.6000000000000001 the other way round)."""
    from fedpartial_tools.run.results import server_model_validation

    answers = {f"site-{i}": {"SRV_global_model": {"auc": v}} for i, v in ((1, 0.3), (2, 0.2), (3, 0.1))}
    in_order = server_model_validation(answers, {s: 1 for s in answers})["global_model.pt"]["auc"]
    reversed_order = dict(reversed(list(answers.items())))
    assert server_model_validation(reversed_order, {s: 1 for s in answers})["global_model.pt"]["auc"] == in_order
    assert in_order == ((0.3 + 0.2) + 0.1) / 3 != ((0.1 + 0.2) + 0.3) / 3


@pytest.mark.slow
def test_two_trainings_side_by_side_give_the_rows_of_a_serial_run(tmp_path):
    """bench --parallel 2: each training its own simulator process, a row the same as its serial
    run's; the committed rows then stand in for a third run, which trains nothing."""
    from fedpartial_tools.bench import runner

    quick = ["rule_args.local_epochs=0.05", 'model.arch_args={"width": 8, "depth": 2}']
    rows = {}
    for parallel, jobs in ((1, ["fedavg"]), (2, ["fedavg", "fedavg_full"])):
        out = tmp_path / f"p{parallel}"
        trainings, _ = runner.plan_suite("fedmlp-premise", str(out), seeds=[0], data_dir=str(tmp_path / "data"),
                                         rounds=1, jobs=jobs, extra=quick, score_on="val")
        got = runner.run_trainings(trainings, score_on="val", parallel=parallel, rows_dir=str(out / "rows"),
                                   log=lambda *_: None)
        rows[parallel] = {r["method"]: r for r in got}
        assert len(committed.read_committed(str(out / "rows" / "fedmlp-premise.csv"))) == len(jobs)
    for key in ("auc", "map", "curve"):
        assert rows[1]["fedavg"][key] == rows[2]["fedavg"][key], key
    assert rows[2]["fedavg"]["auc"] != rows[2]["fedavg_full"]["auc"]  # two different trainings side by side
    # again with the committed rows: nothing is trained, the rows come back as committed
    trainings, _ = runner.plan_suite("fedmlp-premise", str(tmp_path / "p2"), seeds=[0], data_dir=str(tmp_path / "data"),
                                     rounds=1, jobs=["fedavg", "fedavg_full"], extra=quick, score_on="val")
    for t in trainings:
        os.remove(os.path.join(t.ws, "global_model.pt"))
    again = runner.run_trainings(trainings, score_on="val", parallel=2, rows_dir=str(tmp_path / "p2" / "rows"),
                                 log=lambda *_: None)
    assert [r["auc"] for r in again] == pytest.approx([float(f"{rows[2][j]['auc']:.6g}") for j in ("fedavg", "fedavg_full")])


def test_readme_results_are_computed_from_the_committed_rows():
    """README's results block is what bench-summary computes from docs/results/rows (a number
    edited by hand, or a row committed without the README, fails here)."""
    from pathlib import Path

    from fedpartial_tools.bench import summary

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "README.md").read_text()
    block = summary.summary(summary.committed_test_rows(str(repo / "docs" / "results" / "rows")))
    assert summary.replace_block(text, block, "README.md") == text


def _t(suite, method, seed, value):
    return {"suite": suite, "method": method, "seed": seed, "scored_on": "test", "auc": value}


def test_a_suite_line_from_hand_rows_and_only_complete_seeds():
    from fedpartial_tools.bench import summary

    rows = [_t("fedlsm-ham", "fedavg", 0, 0.80), _t("fedlsm-ham", "fedavg_full", 0, 0.90), _t("fedlsm-ham", "fedlsm", 0, 0.85),
            _t("fedlsm-ham", "fedavg", 1, 0.82), _t("fedlsm-ham", "fedavg_full", 1, 0.92), _t("fedlsm-ham", "fedlsm", 1, 0.81),
            _t("fedlsm-ham", "fedavg_compute", 0, 0.83), _t("fedlsm-ham", "fedavg_compute", 1, 0.84),
            _t("fedlsm-ham", "fedavg", 2, 0.99)]  # seed 2: no method row yet -> left out
    kept = summary.complete_seeds(rows)
    assert sorted({r["seed"] for r in kept}) == [0, 1]
    # means: FedAvg 0.81, compute-matched 0.835, full 0.91, FedLSM 0.83 -> gap (0.83 - 0.81) / 0.10 = 20 %
    # over FedAvg, (0.83 - 0.835) / 0.075 = -7 % over its compute; below both on seed 1 (0.81 < 0.82, < 0.84)
    assert summary.suite_line("fedlsm-ham", kept) == (
        "| fedlsm-ham | auc | 2 | 0.810 ± 0.014 | 0.835 ± 0.007 | 0.910 ± 0.014 | 0.830 ± 0.028 | 20 % / -7 % "
        "| 1 of 2 (1) / 1 of 2 (1) |")


def test_a_candidate_is_read_from_the_settings_a_row_ran_with():
    """Both candidates are explicit --set items: a profile default that changes later (the lesions
    profile now ships cosine) cannot turn a row of one candidate into the other's."""
    from fedpartial_tools.bench.ms6_protocol import candidate_of

    def row(*sets):
        return {"settings": json.dumps({"job": "fedia:lesions", "sets": ["seed=0", *sets], "profile": "cpu"})}

    assert candidate_of(row("rule_args.lr_schedule=constant")) == "constant"
    assert candidate_of(row("rule_args.lr_schedule=cosine")) == "cosine"
    # the candidate with the most settings that are all there, whatever their order
    assert candidate_of(row("rule_args.lr=0.001", "rule_args.lr_schedule=cosine")) == "cosine-lr1e-3"
    assert candidate_of(row("rule_args.lesion_fraction=0", "rule_args.lr_schedule=cosine",
                            "rule_args.lr=0.001")) == "cosine-lr1e-3-no-lesion-sampling"
    assert candidate_of(row("rule_args.lr=0.001")) == ""  # the schedule left to the profile
    assert candidate_of(row()) == ""  # the profile's default: no candidate of the protocol


def test_the_hash_sees_what_a_profile_default_comes_to(monkeypatch):
    """The same job and --set items hash differently once a default they leave alone changes."""
    from fedpartial_tools.jobs import settings as job_settings_module

    before = committed.settings_hash("fedavg", ["seed=0"], "cpu")
    real = job_settings_module.constructor_defaults

    def changed(path):
        out = dict(real(path))
        if "label_smoothing" in out:
            out["label_smoothing"] = 0.3
        return out

    monkeypatch.setattr(job_settings_module, "constructor_defaults", changed)
    assert committed.settings_hash("fedavg", ["seed=0"], "cpu") != before


def _trained_ws(ws, job="fedavg", sets=("seed=0",), model_bytes=b"weights"):
    from fedpartial_tools.bench import kept as bench_kept, runner

    ws.mkdir(parents=True)
    (ws / "global_model.pt").write_bytes(model_bytes)
    (ws / "best_global_model.pt").write_bytes(b"best")
    (ws / "metrics.json").write_text(json.dumps({"rounds": []}))
    (ws / runner.TRAINED_FILE).write_text(json.dumps({"job": job, "sets": list(sets), "seconds": 42.0}))


def test_a_training_chosen_on_val_is_kept_and_scored_on_test_in_a_later_session(tmp_path, monkeypatch):
    """bench --select-on val keeps the model beside the rows; a later --reuse (another machine, no
    workspace left) scores that model on test without training it again, with the seconds it took."""
    from fedpartial_tools.bench import kept as bench_kept, runner

    rows_dir = str(tmp_path / "results" / "rows")
    kept = bench_kept.kept_training_dir(rows_dir, "fedlsm-ham", "fedavg", 1, "0123abcd")
    assert kept == str(tmp_path / "results" / "models" / "fedlsm-ham" / "fedavg-seed1-0123abcd")
    _trained_ws(tmp_path / "first" / "ws")
    assert bench_kept.keep_training(str(tmp_path / "first" / "ws"), kept).startswith("kept in")
    assert sorted(os.listdir(kept)) == ["bench_trained.json", "global_model.pt", "metrics.json"]  # no best model
    # the later session: an empty workspace, the model restored, nothing trained
    t = runner.Training("fedlsm-ham", 1, "fedavg", "fedavg", str(tmp_path / "later" / "ws"), str(tmp_path / "sites"),
                        "source.npz", ["seed=0"])
    monkeypatch.setattr(committed, "settings_hash", lambda *a: "0123abcd")
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate",
                        lambda *a, **k: pytest.fail("trained again although its model was kept"))
    scored = []

    def evaluate(name, suite, job, seed, ws, source, seconds, score_on):
        scored.append((open(os.path.join(ws, "global_model.pt"), "rb").read(), seconds, score_on))
        return {"suite": name, "method": job, "seed": seed, "scored_on": score_on, "auc": 0.5, "curve": "[]"}
    monkeypatch.setattr(runner, "_evaluate_row", evaluate)
    runner.run_training(t, "test", reuse=True, rows_dir=rows_dir, log=lambda *_: None)
    assert scored == [(b"weights", 42.0, "test")]
    before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60))
    (row,) = committed.read_committed(os.path.join(rows_dir, "fedlsm-ham.csv"))
    # when it was scored, so its order against the commit of the val rows can be read
    assert row["scored_on"] == "test" and before <= row["scored_at"] <= time.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_kept_training_is_the_model_and_no_more_and_a_large_one_is_not_kept(tmp_path):
    from fedpartial_tools.bench import kept as bench_kept, runner

    _trained_ws(tmp_path / "ws", model_bytes=b"x" * 2000)
    note = bench_kept.keep_training(str(tmp_path / "ws"), str(tmp_path / "kept"), with_best=True, max_bytes=1000)
    assert note.startswith("not kept: ") and not (tmp_path / "kept").exists()
    bench_kept.keep_training(str(tmp_path / "ws"), str(tmp_path / "kept"), with_best=True)
    assert sorted(os.listdir(tmp_path / "kept")) == ["bench_trained.json", "best_global_model.pt",
                                                     "global_model.pt", "metrics.json"]
    assert not bench_kept.restore_training(str(tmp_path / "nothing"), str(tmp_path / "ws2"))


def test_a_kept_record_holds_the_rounds_and_the_sites_validation_only(tmp_path):
    from fedpartial_tools.bench import kept, runner

    record = {"rounds": [{"round": r, "aggregated_at": 1.0 + r, "server": {"trust": {"update_norms": [1.0]}},
                          "sites": {"site-2": {"val": {"auc": 0.5 + r / 10}, "train_loss": 2.0},
                                    "site-1": {"val": {"auc": 0.7}, "num_samples": 9}}} for r in range(2)]}
    trimmed = kept.trimmed_metrics(record)
    assert trimmed == {"rounds": [{"round": r, "sites": {"site-2": {"val": {"auc": 0.5 + r / 10}},
                                                         "site-1": {"val": {"auc": 0.7}}}} for r in range(2)]}
    # the row's curve is the same from either, to the last bit
    curves = []
    for name, rec in (("full", record), ("trimmed", trimmed)):
        (tmp_path / name).write_text(json.dumps(rec))
        curves.append(runner._curve(str(tmp_path / name), "auc"))
    assert curves[0] == curves[1] == pytest.approx([0.6, 0.65])


def test_the_ms_protocol_chooses_only_when_every_candidate_has_rows(monkeypatch):
    """A choice among part of the candidates is none: the committed phase-1 rows choose cosine from
    constant and cosine alone, and nothing once a candidate without rows is added (phase 2's
    --chosen then refuses)."""
    from fedpartial_tools.bench import ms6_protocol

    rows = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results", "rows")
    two = {name: ms6_protocol.CANDIDATES[name] for name in ("constant", "cosine")}
    monkeypatch.setattr(ms6_protocol, "CANDIDATES", two)
    assert ms6_protocol.selection_table(rows).endswith("Chosen: **cosine**.")
    extra = {"cosine-lr9": ["rule_args.lr_schedule=cosine", "rule_args.lr=9"]}
    monkeypatch.setattr(ms6_protocol, "CANDIDATES", {**two, **extra})
    assert ms6_protocol.selection_table(rows).endswith(
        "Nothing chosen: no rows yet for cosine-lr9 (phase 1 runs them).")
    with pytest.raises(ValueError, match="do not choose 'cosine'"):
        ms6_protocol.run("unused", rows, "unused", deadline=0, parallel=1, chosen="cosine")
