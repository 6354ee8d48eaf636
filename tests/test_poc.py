"""POC mode through the poc/ scripts: poc/run_demo.sh makes synthetic site files, prepares and starts a
2-site POC system, packages jobs/fedavg (code in app/custom), submits it with the nvflare job CLI, waits,
downloads the result, evaluates the global model and stops everything. Also: the leftover-process
sweep that poc/stop.sh relies on."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpartial_tools.data.sites import dataset_overrides
from fedpartial_tools.deploy import admin, cli as deploy, processes

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), PYTHON=sys.executable)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for d in ("home", "tmp"):
        (tmp_path / d).mkdir(exist_ok=True)
    return env


@pytest.fixture
def poc_state(tmp_path):
    """The demo's state folder; whatever happens, the POC system is stopped and no process of it is left."""
    state = tmp_path / "state"
    yield state
    if state.exists():
        subprocess.run(["bash", str(REPO / "poc" / "stop.sh"), str(state)], env=_env(tmp_path),
                       capture_output=True, timeout=120)
    processes.kill_workspace_processes(str(tmp_path))
    assert not processes.live_workspace_processes(str(tmp_path))


@pytest.mark.slow
def test_run_demo_runs_fedavg_in_poc_and_downloads_the_result(poc_state, tmp_path):
    from fedpartial.models.io import load_model_file

    cmd = ["bash", str(REPO / "poc" / "run_demo.sh"), str(poc_state), "fedavg", "--sites", "2", "--rounds", "2",
           "--set", "model.arch_args.width=8", "--set", "rule_args.batch_size=32", "--set", "device=cpu"]
    proc = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_demo.sh took over 300 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]

    # the demo stopped its own system: nothing of the state folder runs any more
    assert not processes.live_workspace_processes(str(poc_state)), out[-2000:]
    # POC state stayed in the state folder
    assert (poc_state / "home" / ".nvflare" / "config.conf").is_file()
    assert (poc_state / "poc" / "jobs-storage").is_dir()

    packaged = poc_state / "jobs" / "fedavg"
    assert (packaged / "app" / "custom" / "fedpartial" / "__init__.py").is_file()  # bring-your-own-code
    server_cfg = json.loads((packaged / "app" / "config" / "config_fed_server.json").read_text())
    assert server_cfg["num_rounds"] == 2 and server_cfg["min_clients"] == 2

    results = [p for p in (poc_state / "results" / "fedavg").iterdir() if p.name != "latest"]
    assert len(results) == 1, results
    assert (poc_state / "results" / "fedavg" / "latest").resolve() == results[0].resolve()
    found = admin.find_results(str(results[0]))
    assert found["global_model"] and found["metrics"], found
    _, meta = load_model_file(found["global_model"])
    rounds = json.loads(Path(found["metrics"]).read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert sorted(rounds[-1]["sites"]) == ["site-1", "site-2"]
    # both sites' curves came to the server over FLARE's analytics streaming, and came down with the result
    assert found["tensorboard"].endswith("tb_events"), found
    assert sorted(os.listdir(found["tensorboard"])) == ["site-1", "site-2"]

    final = json.loads((poc_state / "final_metrics.json").read_text())
    assert final["model"] == os.path.abspath(found["global_model"]) and final["split"] == "test" and final["n"] > 0
    # the demo ends with evaluate's table, the model card and the bundle; the card names sites, rounds, validation
    card = Path(found["global_model"]).parent / "model_card.md"
    assert f"model card: {card}" in out and f"MONAI bundle: {poc_state / 'bundle'}" in out, out[-1500:]
    assert "metric" in out and "auc" in out  # the table, not the JSON
    text = card.read_text()
    assert "sites aggregated: site-1, site-2" in text and "rounds run: 2 of 2" in text, text[:2000]
    assert "## Validation per round" in text
    assert (poc_state / "bundle" / "configs" / "inference.json").is_file()


def test_leftover_sweep_kills_flare_processes_of_the_folder_only(tmp_path):
    """A process whose command line names the folder and looks like FLARE is found and killed; one of
    another folder, and a non-FLARE process naming the folder, are left alone."""
    sleeper = "import time, sys; time.sleep(60)"
    mine = subprocess.Popen([sys.executable, "-c", sleeper, "nvflare", str(tmp_path / "poc" / "site-1")],
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", sleeper, "nvflare", str(tmp_path) + "_other/site-1"],
                             start_new_session=True)
    editor = subprocess.Popen([sys.executable, "-c", sleeper, str(tmp_path / "notes.txt")], start_new_session=True)
    try:
        time.sleep(0.2)
        found = processes.workspace_processes(str(tmp_path))
        assert mine.pid in found and other.pid not in found and editor.pid not in found
        killed = processes.kill_workspace_processes(str(tmp_path))
        assert set(killed) == {mine.pid}
        assert mine.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None and editor.poll() is None
    finally:
        for p in (mine, other, editor):
            p.kill()
            p.wait()


# FedMLP runs in POC in tests/test_own_data.py (the own-data walk-through's fedmlp_ctich)
METHOD_SETTINGS = {
    "fedlsm": ["rule_args.local_epochs=0.3", "model.arch_args.width=8"],
    "fedirm": ["rule_args.mc_passes=2", "model.arch_args.width=8", "rule_args.unlabelled_start_round=0"],
    "fedia": ["rule_args.warmup_rounds=2", "num_rounds=3", "model.input_size=[32,32]"],
}


@pytest.mark.slow
def test_every_method_job_runs_in_poc(poc_state, tmp_path):
    """One POC system (3 sites); each method job but FedMLP (see METHOD_SETTINGS) is packaged,
    submitted by poc/run_job.sh, finished, and its downloaded global model loads."""
    from fedpartial.models.io import load_model_file

    env = _env(tmp_path)

    def sh(*args, timeout=300):
        done = subprocess.run(["bash", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout

    sh(REPO / "poc" / "prepare.sh", poc_state, "--sites", "3")
    sh(REPO / "poc" / "start.sh", poc_state)
    for job, settings in METHOD_SETTINGS.items():
        data = poc_state / f"data_{job}"
        deploy.demo_data(str(REPO / "jobs" / job), str(data), sites=3)
        settings = [*dataset_overrides(str(data / "sites")), "num_rounds=2", "device=cpu", *settings]
        rounds = int([s for s in settings if s.startswith("num_rounds=")][-1].split("=")[1])
        sets = [x for s in settings for x in ("--set", s)]
        out = sh(REPO / "poc" / "run_job.sh", poc_state, job, "--data-root", data / "sites", *sets, "--timeout", "400",
                 timeout=480)
        results = [p for p in (poc_state / "results" / job).iterdir() if p.name != "latest"]
        found = admin.find_results(str(results[0]))
        assert found["global_model"], (job, out[-2000:])
        _, meta = load_model_file(found["global_model"])
        assert meta["round"] == rounds - 1, (job, meta.get("round"))
    sh(REPO / "poc" / "stop.sh", poc_state)
