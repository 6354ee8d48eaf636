"""FedAvg end to end in the simulator (synthetic data), `evaluate` on the saved model, and proof
that method jobs never open the complete-label reference copies."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpartial_tools.cli import main as cli
from fedpartial.data.npz import save_npz
from fedpartial_tools.data.partition import split_file
from fedpartial_tools.data.sites import dataset_overrides
from fedpartial_tools.data.synthetic import make_classification
from fedpartial_tools.run.simulator import simulate

REPO = Path(__file__).resolve().parents[1]
METHOD_JOBS = [j for j in sorted(os.listdir(REPO / "jobs")) if not j.startswith("fedavg")]

# Installed in the simulator's processes through PYTHONPATH: records every file opened under a
# $REFERENCE_DIR (the complete labels) into $REFERENCE_AUDIT.
AUDIT_HOOK = '''
import os, sys
_log = os.environ.get("REFERENCE_AUDIT")
_ref = os.environ.get("REFERENCE_DIR", "//none")
def _hook(event, args):
    # an exception here would fail the audited call itself: never raise
    if not (_log and event == "open" and args and isinstance(args[0], str) and args[0].startswith(_ref)):
        return
    try:
        with open(_log, "a") as f:
            f.write(args[0] + "\\n")
    except OSError:
        pass
sys.addaudithook(_hook)
'''


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("foundation")
    src = root / "src.npz"
    save_npz(make_classification("multi-label", num_classes=4, n_train=120, n_val=40, n_test=60, seed=2), str(src))
    split_file(str(src), "label-set-mismatch", sites=2, seed=0, out=str(root / "sites"), classes_per_site=2)
    return root, src


@pytest.mark.slow
def test_fedavg_in_simulator_then_evaluate(sites, tmp_path, capsys):
    root, src = sites
    ws = tmp_path / "ws"
    simulate(str(REPO / "jobs" / "fedavg"), str(root / "sites"), str(ws),
             ["num_rounds=3", "rule_args.lr=0.003", "model.arch_args={\"width\": 8, \"depth\": 2}",
              *dataset_overrides(str(root / "sites"))], timeout=300)
    for name in ("global_model.pt", "best_global_model.pt", "metrics.json", "cross_site_val.json"):
        assert (ws / name).is_file(), name
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert set(rounds[-1]["sites"]) == {"site-1", "site-2"} and rounds[-1]["sites"]["site-1"]["num_samples"] > 0
    assert "auc" in rounds[-1]["sites"]["site-1"]["val"]
    assert glob.glob(str(ws / "tb" / "site-1" / "events.out.tfevents.*"))
    # every site's curves also reached the server through FLARE's analytics streaming
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for site in ("site-1", "site-2"):
        events = glob.glob(str(ws / "tb_server" / site / "events.out.tfevents.*"))
        assert events, sorted(os.listdir(ws / "tb_server")) if (ws / "tb_server").is_dir() else "no tb_server"
        acc = EventAccumulator(os.path.dirname(events[0]))
        acc.Reload()
        assert "train/train_loss" in acc.Tags()["scalars"], acc.Tags()["scalars"]
        assert [e.step for e in acc.Scalars("train/train_loss")] == [0, 1, 2]
    cross = json.loads((ws / "cross_site_val.json").read_text())
    assert "SRV_global_model" in json.dumps(cross)
    capsys.readouterr()
    cli(["evaluate", "--model", str(ws / "global_model.pt"), "--data", str(src), "--json", "--compact"])
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 60 and 0.0 <= out["auc"] <= 1.0 and set(out["per_class"]) == {f"finding_{i}" for i in range(4)}


def test_method_jobs_are_not_configured_to_read_reference_copies():
    for job in METHOD_JOBS:
        client = json.loads(next((REPO / "jobs" / job).glob("*/config/config_fed_client.json")).read_text())
        args = client["executors"][0]["executor"]["args"]
        assert "reference" not in args.get("data_file", "{site}.npz"), job
        assert not args.get("reference_file"), job
    assert METHOD_JOBS, "no method jobs found"


@pytest.mark.slow
def test_method_executor_never_opens_reference_files(sites, tmp_path):
    root, _ = sites
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    audit = tmp_path / "opened.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]),
               REFERENCE_AUDIT=str(audit), REFERENCE_DIR=str(root / "sites" / "reference"))

    def run(job, ws, *extra):
        cmd = [sys.executable, "-m", "fedpartial", "simulate", str(REPO / "jobs" / job), "--data-root",
               str(root / "sites"), "--workspace", str(ws), "--set", "num_rounds=2",
               "--set", "model.arch_args={\"width\": 8, \"depth\": 2}"]
        for item in [*dataset_overrides(str(root / "sites")), *extra]:
            cmd += ["--set", item]
        done = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (ws / "global_model.pt").is_file()

    run("fedlsm", tmp_path / "ws", "rule_args.local_epochs=0.5")
    assert not audit.exists() or audit.read_text() == "", audit.read_text()
    # the hook does see such opens: the upper-bound job reads the reference copies
    run("fedavg_full", tmp_path / "ws_full")
    assert "site-1_full.npz" in audit.read_text()
