"""A lying site in the FLARE simulator: site-3 claims 10^6 samples and sends 100x its weights
(tests/attacking_executor.py, carried in the job's app/custom for this run only). The shipped
aggregator defaults cap its count, reject its update by norm every round, and the job completes."""
import glob
import json
import shutil
from pathlib import Path

import pytest

from fedpartial.data.npz import save_npz
from fedpartial_tools.data.partition import split_file
from fedpartial_tools.data.sites import dataset_overrides
from fedpartial_tools.data.synthetic import make_classification
from fedpartial_tools.run.simulator import simulate

REPO = Path(__file__).resolve().parents[1]


def _attacked_job(dest: Path) -> Path:
    """jobs/fedavg with the attacking executor at every site (only site-3 lies) and without the
    cross-site evaluation (not what this test is about; it would double the run time)."""
    shutil.copytree(REPO / "jobs" / "fedavg", dest)
    config = dest / "app" / "config"
    client = json.loads((config / "config_fed_client.json").read_text())
    executor = client["executors"][0]["executor"]
    executor["path"] = "attacking_executor.AttackingExecutor"
    # named: --set rule_args.* looks up the rule of a component outside fedpartial only when named
    executor["args"].update(attack_site="site-3", claimed_samples=10 ** 6, scale=100.0,
                            rule="fedavg")
    (config / "config_fed_client.json").write_text(json.dumps(client, indent=2))
    server = json.loads((config / "config_fed_server.json").read_text())
    server["workflows"] = [w for w in server["workflows"] if w["id"] == "scatter_and_gather"]
    (config / "config_fed_server.json").write_text(json.dumps(server, indent=2))
    (dest / "app" / "custom").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "tests" / "attacking_executor.py", dest / "app" / "custom")
    return dest


@pytest.mark.slow
def test_simulator_rejects_the_lying_site_and_completes(tmp_path):
    src = tmp_path / "src.npz"
    save_npz(make_classification("multi-label", num_classes=4, n_train=96, n_val=24, n_test=12, seed=3), str(src))
    split_file(str(src), "label-set-mismatch", sites=3, seed=0, out=str(tmp_path / "sites"), classes_per_site=2)
    ws = tmp_path / "ws"
    summary = simulate(str(_attacked_job(tmp_path / "job")), str(tmp_path / "sites"), str(ws),
                       ["num_rounds=2", "rule_args.lr=0.003", "rule_args.batch_size=8",
                        "model.arch_args={\"width\": 8, \"depth\": 2}",
                        *dataset_overrides(str(tmp_path / "sites"))], timeout=300, log=lambda m: None)
    assert summary["ok"], summary
    rounds = json.loads((ws / "metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    for r in rounds:
        trust = r["server"]["trust"]
        assert list(trust["rejected"]) == ["site-3"], (r["round"], trust["rejected"], trust["update_norms"])
        assert "x the round's median norm" in trust["rejected"]["site-3"]
        assert "reported 1000000 samples" in trust["capped"]["site-3"]
        assert trust["capped"]["site-3"].endswith(f"capped to {trust['train_sizes']['site-3']}")
        # the honest updates moved the model: the median is a real scale, the attacker is > 10x it
        assert 0 < trust["median_norm"] and trust["update_norms"]["site-3"] > 10 * trust["median_norm"]
        assert set(r["sites"]) == {"site-1", "site-2"} and set(r["server"]["weights"]) == {"site-1", "site-2"}
    logs = "".join(Path(p).read_text(errors="replace")
                   for p in glob.glob(str(ws / "simulator" / "**" / "log.txt"), recursive=True))
    assert logs.count("rejected the update of site 'site-3': update norm") == 2, "server log lacks the rejection"
