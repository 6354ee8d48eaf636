"""Faults of a running POC system (issue #9): an admin abort of a running job, and a server crash and
restart. NVFlare 2.9 does not resume a job after a server restart (see docs/FAILURE_BEHAVIOUR.md);
FedPartialPersistor's ``resume_from`` continues it as a new job from the last saved global model."""
import contextlib
import glob
import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from fedpartial_tools.deploy import admin, cli as deploy, processes
from fedpartial.flare.common import GLOBAL_STATS
from fedpartial.flare.persistor import GLOBAL_MODEL_FILE, FedPartialPersistor
from fedpartial_tools.data.sites import dataset_overrides
from fedpartial_tools.jobs.packaging import package_job
from fedpartial.models.io import load_model_file, read_model_file
from test_poc import REPO, _env, poc_state  # noqa: F401  (poc_state: fixture that stops the system)

pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")]  # aiohttp in nvflare
SITES = ["site-1", "site-2"]


def _poc(env, script, *args, timeout=180):
    done = subprocess.run(["bash", str(REPO / "poc" / script), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (script, args, done.stdout[-3000:], done.stderr[-3000:])


@contextlib.contextmanager
def _admin(prod: Path):
    session = admin.new_admin_session(str(prod / "admin@hospital-a.org"), timeout=60)
    try:
        yield session
    finally:
        session.close()


def _job_processes(prod: Path, job_id: str) -> dict:
    """Live FLARE processes of one job (server runner_process, sites' worker_process)."""
    return {p: c for p, c in processes.live_workspace_processes(str(prod)).items() if job_id in c}


def _wait(what: str, check, timeout: float, poll: float = 0.5):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(poll)


@pytest.fixture
def poc_fedavg(poc_state, tmp_path):  # noqa: F811
    """A started 2-site POC system and ``package(name, *settings)`` making a small jobs/fedavg for it."""
    env = _env(tmp_path)
    _poc(env, "prepare.sh", poc_state, "--sites", len(SITES))
    _poc(env, "start.sh", poc_state)
    data = poc_state / "data"
    deploy.demo_data(str(REPO / "jobs" / "fedavg"), str(data), sites=len(SITES))

    def package(name, *settings):
        sets = [*dataset_overrides(str(data / "sites")), "device=cpu", "model.arch_args.width=8", *settings]
        return package_job(str(REPO / "jobs" / "fedavg"), str(poc_state / "jobs" / name), sets,
                           data_root=str(data / "sites"), name=name)

    prod = Path(sorted(glob.glob(str(poc_state / "poc" / "*" / "prod_*")))[-1])
    yield SimpleNamespace(env=env, state=poc_state, prod=prod, package=package)


@pytest.mark.slow
def test_admin_abort_ends_a_running_poc_job_and_its_site_processes(poc_fedavg):
    prod = poc_fedavg.prod
    with _admin(prod) as session:
        admin.wait_for_clients(session, SITES)
        job_id = session.submit_job(poc_fedavg.package("long", "num_rounds=500"))
        site_log = prod / "site-1" / job_id / "log.txt"
        _wait("site-1 trained a round", lambda: site_log.is_file() and "round 1/500" in site_log.read_text(), 90)
        assert session.get_job_meta(job_id)["status"] == "RUNNING"
        workers = [c for c in _job_processes(prod, job_id).values() if "worker_process" in c]
        assert len(workers) == len(SITES), workers

        started = time.time()
        session.abort_job(job_id)
        status = session.wait_for_job(job_id, timeout=30, poll_interval=0.5)["status"]
        aborted_s = time.time() - started
        _wait("job processes ended", lambda: not _job_processes(prod, job_id), 30)
        gone_s = time.time() - started
        print(f"abort: {status} after {aborted_s:.1f} s, every job process gone after {gone_s:.1f} s")
        assert status == "FINISHED:ABORTED" and aborted_s < 30

        # the system still runs the next job to the end
        result = admin.run_job(session, poc_fedavg.package("short", "num_rounds=1"),
                               str(poc_fedavg.state / "results"), timeout=120)
        assert result["status"] == "FINISHED:COMPLETED", result
        assert load_model_file(result["global_model"])[1]["round"] == 0


@pytest.mark.slow
def test_server_restart_loses_the_job_and_resume_from_continues_it(poc_fedavg):
    prod, rounds, t0 = poc_fedavg.prod, 3, time.time()
    with _admin(prod) as session:
        admin.wait_for_clients(session, SITES)
        job_id = session.submit_job(poc_fedavg.package("crash", f"num_rounds={rounds}"))
    saved_model = prod / "server" / job_id / GLOBAL_MODEL_FILE

    def saved_round():
        return read_model_file(saved_model)["meta"]["round"] if saved_model.is_file() else -1

    _wait("round 1 aggregated and saved", lambda: saved_round() >= 1, 90, poll=0.2)
    # the server crashes: its daemon loop, server process and job process (the sites keep running)
    killed = processes.kill_workspace_processes(str(prod / "server"))
    crashed_at, last = time.time(), saved_round()
    assert any("server_train" in c for c in killed.values()), killed
    assert any("runner_process" in c for c in killed.values()), killed
    assert 1 <= last < rounds - 1, f"job got to round {last} before the kill; too late to test resuming"
    for stale in ("daemon_pid.fl", "pid.fl"):  # what the kit asks an operator to remove after a crash
        (prod / "server" / stale).unlink(missing_ok=True)
    _poc(poc_fedavg.env, "start.sh", poc_fedavg.state, "-p", "server")
    print(f"[{time.time() - t0:.0f} s] crash at {crashed_at - t0:.0f} s; server restarted")

    with _admin(prod) as session:
        admin.wait_for_clients(session, SITES, timeout=90)
        # NVFlare 2.9: nothing resumes the job, nothing marks it ended, no snapshot was written
        assert job_id not in [j.job_id for j in session.get_system_info().job_info]
        assert session.get_job_meta(job_id)["status"] == "RUNNING"
        with pytest.raises(Exception, match="is not running"):  # and the stale record cannot be aborted
            session.abort_job(job_id)
        assert not [p for p in (poc_fedavg.state / "poc" / "snapshot-storage").rglob("*") if p.is_file()]
        print(f"[{time.time() - t0:.0f} s] sites reconnected")

        # resume as a new job from the last global model the crashed job saved
        result = admin.run_job(session, poc_fedavg.package(
            "resumed", f"start_round={last + 1}", f"num_rounds={rounds - last - 1}", f"resume_from={saved_model}"),
            str(poc_fedavg.state / "results"), timeout=120)
    print(f"[{time.time() - t0:.0f} s] crashed after round {last}; resumed job took {result['seconds']} s")
    # the sites' job processes of the lost job noticed it is gone and exited
    assert not _job_processes(prod, job_id)
    assert result["status"] == "FINISHED:COMPLETED", result
    _, meta = load_model_file(result["global_model"])
    assert meta["round"] == rounds - 1 and meta["job_id"] == result["job_id"]
    history = json.loads(Path(result["metrics"]).read_text())["rounds"]
    assert [r["round"] for r in history] == list(range(rounds))
    assert all((r["aggregated_at"] < crashed_at) == (r["round"] <= last) for r in history), history
    assert f"resumed from '{saved_model}' (round {last} of job {job_id})" in Path(result["server_log"]).read_text()


def test_resume_from_loads_weights_stats_and_metrics_and_checks_the_start_round(tmp_path):
    """No system: what the persistor of a resumed job loads, and its errors."""
    model = {"arch": "small_cnn", "arch_args": {"width": 4}, "in_channels": 3, "class_names": ["a", "b", "c"],
             "task": "single-label", "input_size": [16, 16]}

    def ctx(run_dir, **props):
        fl_ctx = FLContext()
        fl_ctx.set_prop(FLContextKey.CURRENT_RUN, run_dir.name, sticky=False)
        for key, value in props.items():
            fl_ctx.set_prop(key, value, private=True, sticky=False)
        engine = mock.MagicMock()
        engine.get_workspace.return_value.get_run_dir.return_value = str(run_dir)
        fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
        return fl_ctx

    with mock.patch.object(FLContext, "get_engine", lambda self: self.get_prop("__engine__")):
        old = tmp_path / "old-job"
        first = FedPartialPersistor(model, seed=1)
        weights = {k: v + 1.0 for k, v in first.load_model(ctx(old))[ModelLearnableKey.WEIGHTS].items()}
        stats = {"class_counts": np.array([3.0, 0.0, 5.0])}
        first.save_model(make_model_learnable(weights, {GLOBAL_STATS: stats}),
                         ctx(old, **{AppConstants.CURRENT_ROUND: 2}))
        (old / "metrics.json").write_text(json.dumps({"rounds": [{"round": r} for r in range(3)]}))

        new = tmp_path / "new-job"
        learnable = FedPartialPersistor(model, seed=2, resume_from=str(old)).load_model(
            ctx(new, **{AppConstants.START_ROUND: 3}))
        for k, v in weights.items():
            np.testing.assert_allclose(learnable[ModelLearnableKey.WEIGHTS][k], v, rtol=1e-6)
        np.testing.assert_array_equal(learnable[ModelLearnableKey.META][GLOBAL_STATS]["class_counts"],
                                      stats["class_counts"])
        assert json.loads((new / "metrics.json").read_text()) == json.loads((old / "metrics.json").read_text())

        with pytest.raises(ValueError, match=r"after round 2 \(job old-job\).*set start_round=3"):
            FedPartialPersistor(model, resume_from=str(old)).load_model(ctx(new, **{AppConstants.START_ROUND: 0}))
        with pytest.raises(ValueError, match="class_names"):
            FedPartialPersistor({**model, "class_names": ["a", "b", "x"]}, resume_from=str(old)).load_model(
                ctx(new, **{AppConstants.START_ROUND: 3}))
