"""Progress lines while a run goes on, and `simulate` failing loudly on an incomplete run."""
import json

import pytest

from fedpartial_tools import cli
from fedpartial_tools.run.progress import RoundProgress


def _metrics(path, rounds):
    path.write_text(json.dumps({"rounds": rounds}))
    return str(path)


def test_progress_prints_each_round_once_with_mean_key_metric_and_time_left(tmp_path):
    lines = []
    progress = RoundProgress(4, "auc", log=lines.append, started=0.0)
    path = tmp_path / "metrics.json"
    progress.update(None)  # no file yet: nothing printed
    assert lines == []
    round0 = {"round": 0, "sites": {"site-1": {"val": {"auc": 0.6}}, "site-2": {"val": {"auc": 0.8}}}}
    progress.update(_metrics(path, [round0]))
    progress.update(_metrics(path, [round0]))  # re-reading the same file prints nothing new
    assert len(lines) == 1
    assert lines[0].startswith("round 1/4: val auc 0.700 (mean of 2 sites)")
    round1 = {"round": 1, "sites": {"site-1": {"val": {"auc": 0.9}}}, "rejected": {"site-2": "NaN in weights"}}
    progress.update(_metrics(path, [round0, round1]))
    assert progress.rounds_done == 2
    assert "round 2/4: val auc 0.900 (mean of 1 sites)" in lines[1]
    assert "rejected: site-2" in lines[1]


def test_progress_time_left_is_elapsed_per_round_times_rounds_to_go():
    progress = RoundProgress(10, "dice")
    # 2 rounds in 30 s -> 15 s a round, 8 to go -> 120 s
    line = progress.line({"round": 1, "sites": {}}, done=2, elapsed=30.0)
    assert "30 s elapsed, ~120 s left" in line and "no validation metric (no site has a val split)" in line
    line = progress.line({"round": 1, "sites": {"site-1": {"val": {"dice": None}}}}, done=2, elapsed=30.0)
    assert "val dice undefined at every site" in line


def test_progress_ignores_a_half_written_file(tmp_path):
    lines = []
    path = tmp_path / "metrics.json"
    path.write_text('{"rounds": [')
    RoundProgress(3, "auc", log=lines.append).update(str(path))
    assert lines == []


@pytest.mark.parametrize("summary, code", [
    ({"ok": False, "exit_code": 0, "rounds_completed": 1, "num_rounds": 3, "errors": "", "workspace": "w"}, 1),
    ({"ok": False, "exit_code": 1, "rounds_completed": 3, "num_rounds": 3, "errors": "boom", "workspace": "w"}, 1),
])
def test_simulate_command_exits_non_zero_when_the_run_did_not_complete(monkeypatch, tmp_path, capsys, summary, code):
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate", lambda *a, **k: summary)
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "jobs/fedavg", "--data-root", str(tmp_path), "--workspace", str(tmp_path / "ws")])
    assert e.value.code == code
    err = capsys.readouterr().err
    assert f"{summary['rounds_completed']} of 3 rounds aggregated" in err
    assert f"exit code {summary['exit_code']}" in err


def test_simulate_command_succeeds_silently_on_a_complete_run(monkeypatch, tmp_path):
    summary = {"ok": True, "exit_code": 0, "rounds_completed": 3, "num_rounds": 3, "errors": "", "workspace": "w"}
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate", lambda *a, **k: summary)
    cli.main(["simulate", "jobs/fedavg", "--data-root", str(tmp_path), "--workspace", str(tmp_path / "ws")])
