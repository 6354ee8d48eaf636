"""The two thread-safety fixes that fedpartial_tools.run.flare_simulator applies to FLARE's simulator
(each test reproduces its race by hand, with threads, on FLARE's own SimulatorClientRunner)."""
import pickle
import threading
import time
from types import SimpleNamespace

import pytest
from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner

from fedpartial_tools.run import flare_simulator


@pytest.fixture
def patched(monkeypatch):
    # monkeypatch restores FLARE's methods afterwards: other tests see the class unchanged
    monkeypatch.setattr(SimulatorClientRunner, "__init__", SimulatorClientRunner.__init__)
    monkeypatch.setattr(SimulatorClientRunner, "get_next_run_client", SimulatorClientRunner.get_next_run_client)
    flare_simulator.patch()


def _runner(tmp_path, clients=(), build_ctx=None):
    args = SimpleNamespace(workspace=str(tmp_path), set=[])
    return SimulatorClientRunner("", args, list(clients), {}, SimpleNamespace(), build_ctx or {"job": "simulate_job"})


def test_each_client_thread_sends_its_own_site_name(tmp_path, patched):
    """Two threads write their site's name into build_ctx, then both send it (as FLARE's do_one_task
    does, pickled to the worker): each worker must receive its own site, and the other values."""
    runner = _runner(tmp_path)
    both_written = threading.Barrier(2)
    sent = {}

    def do_one_task(site):
        runner.build_ctx["client_name"] = site
        both_written.wait(timeout=5)
        sent[site] = pickle.loads(pickle.dumps({"build_ctx": runner.build_ctx}))["build_ctx"]

    threads = [threading.Thread(target=do_one_task, args=(s,)) for s in ("site-2", "site-3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sent == {"site-2": {"job": "simulate_job", "client_name": "site-2"},
                    "site-3": {"job": "simulate_job", "client_name": "site-3"}}
    assert type(sent["site-2"]) is dict


def test_a_site_picked_by_one_thread_is_not_picked_by_another(tmp_path, patched):
    """Two threads, three sites. Thread A runs site-1 and has just picked site-3 as its next; thread B
    runs site-2 and picks its next while site-1 is still marked running: it must wait for site-1
    (which A releases after its task) rather than take site-3 as well."""
    sites = [SimpleNamespace(client_name=f"site-{k}", simulate_running=False) for k in (1, 2, 3)]
    runner = _runner(tmp_path, sites)
    sites[0].simulate_running = sites[1].simulate_running = True  # A on site-1, B on site-2
    runner.run_client_index = 1
    assert runner.get_next_run_client(None) is sites[2]  # A's pick
    picked = []
    b = threading.Thread(target=lambda: picked.append(runner.get_next_run_client(None)), daemon=True)
    b.start()
    time.sleep(0.2)
    sites[0].simulate_running = False  # A's task on site-1 has ended
    b.join(timeout=5)
    assert [s.client_name for s in picked] == ["site-1"]
    assert all(s.simulate_running for s in (sites[0], sites[2]))
