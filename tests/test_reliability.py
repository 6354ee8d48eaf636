"""Failure behaviour (docs/FAILURE_BEHAVIOUR.md).

Fast part, no FLARE run: the RuleAggregator on a bare FLContext drops an update with bad weights
or bad method statistics (one case per method), logs the site's name and aggregates the rest; a
round with too few valid updates fails clearly; an abort stops local training within seconds.

Slow part (simulator): a site whose rule raises in round 1 -> the job goes on when min_clients
allows and stops with a clear message otherwise; a site whose file has the wrong class names
stops with that message in the log; per-site state survives a site restart.
"""
import glob
import json
import re
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms.base import ClientRule, RoundInput, RoundResult
from fedpartial.algorithms.fedavg import SupervisedClient
from fedpartial.flare.aggregators import RuleAggregator
from fedpartial.flare.executors import FedPartialExecutor
from fedpartial.flare.common import SITE_STATS

REPO = Path(__file__).resolve().parents[1]
C, D = 3, 4
GLOBAL = {"fc.weight": np.zeros((C, D), np.float32), "fc.bias": np.zeros(C, np.float32)}
# the job's model block names the classifier parameters (fc.weight, fc.bias) for the aggregator
MODEL = {"arch": "small_cnn", "arch_args": {"width": 8, "depth": 2}, "in_channels": 1,
         "class_names": [f"c{i}" for i in range(C)], "task": "single-label"}


# ---------------------------------------------------------------------------------------------
# aggregator on a bare FLContext
# ---------------------------------------------------------------------------------------------
def _ctx(tmp_path, round_num=1):
    fl_ctx = FLContext()
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, round_num, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.NUM_ROUNDS, 3, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(GLOBAL, {}), private=True, sticky=False)
    engine = mock.MagicMock()
    engine.get_workspace.return_value.get_run_dir.return_value = str(tmp_path)
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    return fl_ctx


def _update(site, stats, value=1.0, n=10, round_num=1, weights=None):
    dxo = DXO(DataKind.WEIGHTS, data=weights or {k: np.full_like(v, value) for k, v in GLOBAL.items()})
    dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, n)
    dxo.set_meta_prop(SITE_STATS, stats)
    s = dxo.to_shareable()
    s.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, round_num)
    return s


@pytest.fixture(autouse=True)
def _engine_from_prop():
    with mock.patch.object(FLContext, "get_engine", lambda self: self.get_prop("__engine__")):
        yield


def _fedlsm_stats():
    return {"class_counts": np.array([4.0, 0.0, 2.0]), "label_pos": np.array([3.0, 1.0, 2.0]),
            "label_neg": np.array([7.0, 9.0, 8.0]), "annotated_classes": np.array([1.0, 0.0, 1.0])}


def _fedmlp_stats():
    return {"prototypes_pos": np.ones((C, D), np.float32), "prototypes_neg": np.zeros((C, D), np.float32),
            "prototype_counts_pos": np.array([2.0, 3.0, 0.0]), "prototype_counts_neg": np.array([8.0, 7.0, 0.0]),
            "learning_degree": np.array([0.5, 0.2, 0.0]), "annotated": np.array([1.0, 1.0, 0.0])}


def _fedirm_stats():
    return {"relation_matrix": np.full((C, C), 1 / C), "relation_counts": np.array([2.0, 3.0, 5.0]),
            "relation_multilabel": 0}


def _fedia_stats():
    return {"mean_loss": 0.3, "iou": 0.6, "completeness": 0.8, "completeness_ready": 1, "corrected": 0}


def _bad(stats, key, value):
    out = dict(stats)
    out[key] = value
    return out


METHODS = {  # server rule, good stats, (bad stats, words the rejection must contain)
    "fedlsm": ("fedlsm", _fedlsm_stats,
               [(_bad(_fedlsm_stats(), "class_counts", np.ones(C + 1)), ["class_counts", "shape"]),
                (_bad(_fedlsm_stats(), "label_pos", np.array([1.0, np.nan, 1.0])), ["label_pos", "NaN"])]),
    "fedmlp": ("fedmlp", _fedmlp_stats,
               [(_bad(_fedmlp_stats(), "prototypes_pos", np.ones((C, D + 1))), ["prototypes_pos", "shape"]),
                (_bad(_fedmlp_stats(), "prototype_counts_neg", np.ones(C - 1)), ["prototype_counts_neg"])]),
    "fedirm": ("fedirm", _fedirm_stats,
               [(_bad(_fedirm_stats(), "relation_matrix", np.full((C, C + 1), 0.25)), ["relation_matrix", "shape"]),
                (_bad(_fedirm_stats(), "relation_counts", np.array([1.0, np.inf, 1.0])), ["relation_counts"])]),
    "fedia": ("fedia", _fedia_stats,
              [(_bad(_fedia_stats(), "completeness", np.array([0.5, 0.5])), ["completeness", "one number"]),
               (_bad(_fedia_stats(), "mean_loss", float("nan")), ["mean_loss", "not finite"])]),
}
CASES = [(m, i) for m in METHODS for i in range(2)]


def test_aggregation_does_not_depend_on_the_order_sites_answer(tmp_path):
    # 1 + 1e16 - 1e16 is 0 or 1 in floating point depending on the order of the sum
    values = {"site-1": 1.0, "site-2": 1e16, "site-3": -1e16}
    results = []
    for order in (["site-1", "site-2", "site-3"], ["site-2", "site-3", "site-1"], ["site-3", "site-1", "site-2"]):
        agg = RuleAggregator(model=MODEL)
        fl_ctx = _ctx(tmp_path)
        for site in order:
            assert agg.accept(_update(site, {}, value=values[site]), fl_ctx)
        results.append(from_shareable(agg.aggregate(fl_ctx)).data["fc.weight"])
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("method, case", CASES)
def test_bad_statistics_are_rejected_with_the_site_name_and_the_rest_aggregated(tmp_path, caplog, method, case):
    rule, good, bad_cases = METHODS[method]
    bad_stats, words = bad_cases[case]
    agg = RuleAggregator(rule=rule, model=MODEL)
    fl_ctx = _ctx(tmp_path)
    assert agg.accept(_update("site-1", good(), value=1.0), fl_ctx)
    assert agg.accept(_update("site-2", good(), value=3.0), fl_ctx)
    with caplog.at_level(logging.ERROR):
        assert not agg.accept(_update("site-bad", bad_stats, value=100.0), fl_ctx)
    why = agg.rejected["site-bad"]
    assert all(w in why for w in words), why
    assert any("site-bad" in r.getMessage() and words[0] in r.getMessage() for r in caplog.records)
    out = from_shareable(agg.aggregate(fl_ctx))
    # equal sample counts: the mean of 1 and 3 for every parameter (FedLSM's AWPA rows too, since
    # both good sites send the same class counts); the bad site's 100 never enters.
    np.testing.assert_allclose(out.data["fc.weight"], 2.0)
    rounds = json.load(open(tmp_path / "metrics.json"))["rounds"]
    assert set(rounds[-1]["sites"]) == {"site-1", "site-2"} and "site-bad" in rounds[-1]["rejected"]


@pytest.mark.parametrize("weights, words", [
    ({"fc.weight": np.ones((C, D)), "fc.bias": np.ones(C), "extra": np.ones(1)}, "unexpected parameter 'extra'"),
    ({"fc.weight": np.ones((C, D))}, "lacks parameter 'fc.bias'"),
    ({"fc.weight": np.ones((C + 1, D)), "fc.bias": np.ones(C)}, "'fc.weight' has shape (4, 4)"),
    ({"fc.weight": np.full((C, D), np.inf), "fc.bias": np.ones(C)}, "'fc.weight' holds NaN or Inf"),
])
def test_bad_weights_are_rejected(tmp_path, weights, words):
    agg = RuleAggregator(rule="fedlsm", model=MODEL)
    assert not agg.accept(_update("site-3", _fedlsm_stats(), weights=weights), _ctx(tmp_path))
    assert words in agg.rejected["site-3"]


def test_too_few_valid_updates_fail_the_round_naming_the_rejected_sites(tmp_path):
    agg = RuleAggregator(rule="fedmlp", min_valid_updates=2, model=MODEL)
    fl_ctx = _ctx(tmp_path)
    assert agg.accept(_update("site-1", _fedmlp_stats()), fl_ctx)
    assert not agg.accept(_update("site-2", _bad(_fedmlp_stats(), "prototypes_neg", np.ones(C))), fl_ctx)
    with pytest.raises(RuntimeError, match=r"round 1: only 1 valid update.*2 needed.*site-2: .*prototypes_neg"):
        agg.aggregate(fl_ctx)


def test_rejections_are_forgotten_at_the_next_round(tmp_path):
    agg = RuleAggregator(rule="fedia", model=MODEL)
    fl_ctx = _ctx(tmp_path)
    agg.accept(_update("site-1", _fedia_stats()), fl_ctx)
    agg.accept(_update("site-2", _bad(_fedia_stats(), "iou", 2.0)), fl_ctx)
    agg.aggregate(fl_ctx)
    agg.reset(fl_ctx)
    assert agg.rejected == {} and agg.updates == []


# ---------------------------------------------------------------------------------------------
# abort: the executor stops local training within seconds
# ---------------------------------------------------------------------------------------------
def _tiny_dataset(n=64, seed=0):
    from fedpartial.data.types import SINGLE_LABEL, Dataset, Split

    rng = np.random.default_rng(seed)
    labels = np.eye(C, dtype=np.float32)[rng.integers(0, C, n)]
    images = rng.integers(0, 255, size=(n, 16, 16)).astype(np.uint8)
    split = Split(images, labels, np.ones_like(labels, dtype=bool))
    return Dataset(SINGLE_LABEL, [f"c{i}" for i in range(C)], {"train": split, "val": split.subset(np.arange(8))},
                   site="site-1")


def _ready_executor(rule, tmp_path):
    """A FedPartialExecutor set up by hand (what _setup does, minus the site file)."""
    import torch
    from fedpartial.algorithms.base import ClientContext
    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial.flare.executors import FedPartialExecutor

    model = {"arch": "small_cnn", "arch_args": {"width": 8, "depth": 2}, "in_channels": 1,
             "class_names": [f"c{i}" for i in range(C)], "task": "single-label"}
    ex = FedPartialExecutor(model=model, tensorboard=False, device="cpu")
    ex.site, ex.data, ex.device = "site-1", _tiny_dataset(), torch.device("cpu")
    ex.model = build_model_from_settings(model_settings(model))
    ex.rule, ex._abort_signal = rule, None
    rule.setup(ClientContext(site="site-1", data=ex.data, device=ex.device, state_dir=str(tmp_path),
                             abort=ex._aborted))
    ex.ready = True
    return ex


def test_abort_stops_a_long_local_round_within_seconds(tmp_path):
    import torch

    torch.set_num_threads(1)
    # 100000 local epochs of 4 steps: minutes of work unless the abort is honoured
    ex = _ready_executor(SupervisedClient(batch_size=16, local_epochs=100000, augmentation="none"), tmp_path)
    task = DXO(DataKind.WEIGHTS, data={k: v.detach().numpy() for k, v in ex.model.state_dict().items()}).to_shareable()
    task.set_header(AppConstants.CURRENT_ROUND, 0)
    task.set_header(AppConstants.NUM_ROUNDS, 2)
    signal, result = Signal(), {}

    def run():
        result["reply"] = ex.execute("train", task, mock.MagicMock(), signal)
        result["done"] = time.time()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive(), "the round ended before the abort: the test would prove nothing"
    aborted_at = time.time()
    signal.trigger("abort from admin")
    worker.join(timeout=10)
    assert not worker.is_alive(), "local training ignored the abort signal for 10 s"
    assert result["reply"].get_return_code() == ReturnCode.TASK_ABORTED
    assert result["done"] - aborted_at < 5.0


# ---------------------------------------------------------------------------------------------
# simulator runs (slow)
# ---------------------------------------------------------------------------------------------
class CrashingClient(SupervisedClient):
    """FedAvg's client rule that raises at ``crash_site`` from ``crash_round`` on: a site failing
    mid-job. Loaded by the simulator's sites from this file (PYTHONPATH=tests)."""

    def __init__(self, crash_site: str = "site-2", crash_round: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.crash_site, self.crash_round = crash_site, int(crash_round)

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        if self.ctx.site == self.crash_site and inp.round >= self.crash_round:
            raise RuntimeError(f"injected crash at {self.ctx.site} in round {inp.round}")
        return super().train_round(model, inp)


CRASHING_RULE = ("crashing", "test_reliability.CrashingClient")


class CrashingExecutor(FedPartialExecutor):
    """The site executor with the test's crashing rule added to the fixed table, as a new method's
    rule would be (a job names rules by registered name only). Loaded by the simulator's sites."""

    def __init__(self, **kwargs):
        from fedpartial.algorithms import registry

        registry.CLIENT_RULES.setdefault(*CRASHING_RULE)
        super().__init__(**kwargs)


class RoundCounter(ClientRule):
    """Counts the rounds it trained in ``state_dir`` (a stand-in for FedMLP tags / FedIRM teacher)."""

    def setup(self, ctx):
        super().setup(ctx)
        self.path = os.path.join(ctx.state_dir, "rounds.json")
        self.rounds = json.load(open(self.path)) if os.path.isfile(self.path) else []

    def train_round(self, model, inp):
        self.rounds.append(inp.round)
        json.dump(self.rounds, open(self.path, "w"))
        return RoundResult(num_samples=1)


def _logs(ws: Path) -> str:
    files = [ws / "simulator.log", *map(Path, glob.glob(str(ws / "simulator" / "**" / "log.txt"), recursive=True))]
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def _crash_run(tmp_path, monkeypatch, min_clients):
    from test_privacy import SMALL, write_sites
    from fedpartial_tools.run.simulator import simulate

    from fedpartial.algorithms import registry

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setitem(registry.CLIENT_RULES, *CRASHING_RULE)  # for --set rule_args.* here
    write_sites(tmp_path / "sites", "mismatch")
    job = tmp_path / "job"
    shutil.copytree(REPO / "jobs" / "fedavg", job)
    client_file = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_file.read_text())
    client["executors"][0]["executor"]["path"] = "test_reliability.CrashingExecutor"
    args = client["executors"][0]["executor"]["args"]
    # CrashingClient passes FedAvg's arguments on as **kwargs, which --set cannot see: written here
    args["rule"], args["rule_args"] = CRASHING_RULE[0], {**args.get("rule_args", {}), "batch_size": 16}
    client_file.write_text(json.dumps(client))
    ws = tmp_path / "ws"
    summary = simulate(str(job), str(tmp_path / "sites"), str(ws),
                       SMALL + ["num_rounds=3",
                                f"server.min_clients={min_clients}",
                                # after min_clients replies, wait for the others: with 0 an early
                                # error reply alone would close the round with no valid update
                                "wait_time_after_min_received=10"], timeout=240, log=lambda m: None)
    return summary, ws


@pytest.mark.slow
def test_site_crash_job_continues_when_min_clients_allows(tmp_path, monkeypatch):
    summary, ws = _crash_run(tmp_path, monkeypatch, min_clients=1)
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]  # all rounds ran
    assert set(rounds[0]["sites"]) == {"site-1", "site-2"}
    assert set(rounds[1]["sites"]) == set(rounds[2]["sites"]) == {"site-1"}  # site-2 dropped out
    logs = _logs(ws)
    assert "injected crash at site-2 in round 1" in logs
    # SAG ignores site-2's error reply, in its round or (when it has already aggregated) as a late
    # result: "Ignore the result from site-2 at round N. Result error code: EXECUTION_EXCEPTION"
    assert re.search(r"Ignore the result from site-2 at round [12]\. Result error code: EXECUTION_EXCEPTION", logs)
    assert summary["exit_code"] == 0 and summary["ok"] and summary["rounds_completed"] == 3


@pytest.mark.slow
def test_site_crash_stops_the_job_clearly_when_min_clients_cannot_be_met(tmp_path, monkeypatch):
    summary, ws = _crash_run(tmp_path, monkeypatch, min_clients=2)
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0]  # round 1 never aggregated
    logs = _logs(ws)
    assert "injected crash at site-2 in round 1" in logs
    assert "Result from site-2 is bad" in logs and "Cannot reach min_responses" in logs
    # a global model exists, but the run is not a success (the CLI exits 1 on it)
    assert not summary["ok"] and summary["rounds_completed"] == 1 and summary["num_rounds"] == 3


@pytest.mark.slow
def test_wrong_class_names_stop_that_site_with_a_clear_message(tmp_path):
    from test_privacy import SMALL, write_sites
    from fedpartial_tools.run.simulator import simulate

    write_sites(tmp_path / "sites", "mismatch")
    bad = tmp_path / "bad"
    write_sites(bad, "mismatch", class_names=["c0", "c1", "c2", "cX"])
    os.replace(bad / "site-2.npz", tmp_path / "sites" / "site-2.npz")  # site-2's file names classes wrongly
    ws = tmp_path / "ws"
    started = time.time()
    # one client thread: with one thread per site, FLARE 2.9's simulator lets a thread that finds
    # site-2's task ended at once pick site-1 while site-1's own thread sleeps between tasks (the
    # client is marked running outside the lock), so both run site-1 and site-2 is never asked again
    try:  # min_clients = 2 sites: the job cannot go on without site-2
        summary = simulate(str(REPO / "jobs" / "fedavg"), str(tmp_path / "sites"), str(ws),
                           SMALL + ["num_rounds=2", "rule_args.batch_size=16"], threads=1, timeout=150,
                           log=lambda m: None)
        shown = summary["errors"] + _logs(ws)
    except RuntimeError as e:  # no global model at all: the error summary is the exception
        assert "exceeded" not in str(e), "the job hung after site-2 stopped"
        shown = str(e) + _logs(ws)
    assert time.time() - started < 120
    assert "site 'site-2': class names in" in shown
    assert "['c0', 'c1', 'c2', 'cX'] do not match the job's class list ['c0', 'c1', 'c2', 'c3']" in shown
    assert "site set-up failed" in shown
    assert "Result from site-2 is bad" in shown and "Cannot reach min_responses" in shown


def test_site_state_survives_a_site_restart(tmp_path, monkeypatch):
    """Two executor instances (a site process before and after a restart) of the same job and
    workspace: the second finds the state the first wrote, in <workspace>/fedpartial_state/<job>/<site>."""
    from test_privacy import write_sites
    from fedpartial.flare.executors import FedPartialExecutor

    from fedpartial.algorithms import registry

    # a test-only rule joins the fixed table the way a new method would
    monkeypatch.setitem(registry.CLIENT_RULES, "round_counter", "test_reliability.RoundCounter")
    write_sites(tmp_path / "sites", "mismatch")
    model = {"arch": "small_cnn", "arch_args": {"width": 8, "depth": 2}, "in_channels": 1,
             "class_names": [f"c{i}" for i in range(4)], "task": "single-label", "input_size": [16, 16]}

    class SiteContext(FLContext):
        def get_identity_name(self, default=""):
            return "site-1"

        def get_job_id(self):
            return self.get_prop("__job__")

    def start_site(job_id):
        fl_ctx = SiteContext()
        engine = mock.MagicMock()
        workspace = engine.get_workspace.return_value
        workspace.get_root_dir.return_value = str(tmp_path / "site-1-workspace")
        workspace.get_run_dir.return_value = str(tmp_path / "site-1-workspace" / job_id)
        fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
        fl_ctx.set_prop("__job__", job_id, private=True, sticky=False)
        ex = FedPartialExecutor(rule="round_counter", model=model, data_root=str(tmp_path / "sites"),
                                tensorboard=False, device="cpu")
        ex._setup(fl_ctx)
        return ex

    first = start_site("job-a")
    first.rule.train_round(first.model, RoundInput(0, 3))
    first.rule.train_round(first.model, RoundInput(1, 3))
    again = start_site("job-a")  # restarted site, same job: resumes with its state
    assert again.rule.rounds == [0, 1]
    assert (tmp_path / "site-1-workspace" / "fedpartial_state" / "job-a" / "site-1" / "rounds.json").is_file()
    assert start_site("job-b").rule.rounds == []  # another job never sees it


def test_class_wise_rules_need_the_model_block_and_get_its_classifier_names():
    with pytest.raises(ValueError, match=r"'fedlsm'.*\"model\": \"\{model\}\""):
        RuleAggregator(rule="fedlsm")
    assert RuleAggregator().classifier_names == []  # FedAvg needs none
    unet = {"arch": "unet", "arch_args": {"channels": [8, 16], "strides": [2]}, "in_channels": 1, "class_names": ["lesion"],
            "task": "segmentation"}
    names = RuleAggregator(rule="fedirm", model=MODEL).classifier_names
    assert names == ["fc.weight", "fc.bias"]
    assert RuleAggregator(model=unet).classifier_names[0].startswith("net.")
